"""The search behind :func:`optax_adama.memory.plan`, and its time prediction.

Time is a roofline prediction, summed rather than overlapped (an upper bound
where XLA hides one behind another):

- compute: XLA's ``cost_analysis()`` flops over ``Machine.peak_flops``. XLA
  counts a loop body once, so the step's flops are taken per micro-batch and
  multiplied by N, and a :class:`StagedLoss`'s layer scan is completed with
  one more block's forward and backward, compiled alone (:func:`block_cost`),
  per uncounted layer. A plain loss's own loops are counted once each: the
  same for every candidate, so the ranking holds, the absolute time is low;
- folds: AdamA reads the gradient and m, v and writes m, v once per
  micro-batch, ``N * (P + 2 * state) / memory_bandwidth`` (a device's share
  under a ZeRO stage);
- host: what lives in host memory crosses the link out and back once per
  micro-batch, ``N * 2 * host_bytes / host_bandwidth``;
- collectives: :func:`collective_bytes` of the compiled step (every loop trip
  counted) as one device sends them on a ring, over
  ``Machine.interconnect_bandwidth``.

The search (:func:`search`, which ``models.planner`` runs for the zoo with its
remat policies and savers as more activation settings): per ZeRO stage and
activation setting, the smallest N that fits with the first memory lever, by
bisection over the divisors (memory falls as N grows, time grows with N: each
micro-batch pays the fold), then each further lever only where it lets a
smaller N fit. Exact levers come first (float32 moments, then float32 moments
in host memory), then narrower moments, which change the optimizer's numerics;
a narrower storage is not compiled where the float32 step at that N, less the
device bytes the narrower moments save, is still over the budget (a lower
bound: the program differs only in the optimizer's arithmetic). Compiles are
memoised by settings. The fastest predicted candidate wins and is
compiled once more, uncached, to confirm that it fits.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp

from optax_adama import _collectives
from optax_adama import _memory
from optax_adama import _targets
from optax_adama._staged import StagedLoss

__all__ = ["Considered", "Machine", "Measurement", "Skipped", "block_cost",
           "compile_for_measurement", "measure_compiled", "search"]

# Moment storages, most precise first: the planner narrows them only to fit.
MOMENT_STORAGES = ("float32", "bfloat16", "8bit")
SHARD_STAGES: tuple[Optional[str], ...] = (None, "zero1", "zero2", "fsdp")
# The library's activation settings: the loss as given, or the gradient release.
PLAIN, RELEASE = "plain", "release"
# offload_moments' default: smaller state leaves stay on the device.
OFFLOAD_MIN_SIZE = 4096
# Rates a candidate is measured with; the learning rate changes no buffer.
_MEASURED_LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class Machine:
  """The rates of the roofline time predictor (defaults: a 24 GB-class GPU).

  Examples:
    >>> import optax_adama
    >>> h100 = optax_adama.memory.Machine(peak_flops=400e12, memory_bandwidth=3.35e12)
    >>> h100.host_bandwidth  # the default: a PCIe link's order
    25000000000.0

  Attributes:
    peak_flops: float32 flop/s (per device).
    memory_bandwidth: device memory bytes/s.
    host_bandwidth: bytes/s each way between device and pinned host memory.
    interconnect_bandwidth: bytes/s one device sends to the others in a
      collective, on a mesh. 100 GB/s: the order of a TPU core's ICI or a
      GPU's NVLink share; PCIe-only GPUs and hosts over a network are slower.
  """

  peak_flops: float = 80e12
  memory_bandwidth: float = 1.0e12
  host_bandwidth: float = 25e9
  interconnect_bandwidth: float = 100e9


# The predictor's rates when none are given.
DEFAULT_MACHINE = Machine()


@dataclasses.dataclass(frozen=True)
class Measurement:
  """Compile-only numbers of one candidate's step.

  :func:`optax_adama.memory.plan`'s example shows one (``plan.measurement``).

  Attributes:
    device_bytes: argument + output + temp - alias bytes on one device.
    host_bytes: the same over the host_* fields (what lives in host memory).
    param_bytes: P, bytes of one copy of the params (whole).
    state_bytes: bytes of the optimizer state (whole, m and v in their storage).
    flops: predicted flops of the whole step (all micro-batches and layers),
      on one device of a mesh.
    bytes_accessed: XLA's memory traffic of the whole step, recorded, not used
      (on the CPU backend it counts every unfused elementwise op's traffic).
    compile_s: seconds spent compiling.
    collective_bytes: on a mesh, the bytes of the arrays the step's
      collectives make or take apart (:func:`collective_bytes`).
    link_bytes: what one device sends for them on a ring.
    state_shards: devices the moments are split over (each folds its share).
  """

  device_bytes: int
  host_bytes: int
  param_bytes: int
  state_bytes: int
  flops: float
  bytes_accessed: float
  compile_s: float
  collective_bytes: int = 0
  link_bytes: float = 0.0
  state_shards: int = 1

  def predicted_parts(self, machine: Machine, num_micro_batches: int) -> dict[str, float]:
    """The roofline's terms, seconds: compute, folds, host and collectives."""
    fold_bytes = (self.param_bytes + 2 * self.state_bytes) / self.state_shards
    return {"compute": self.flops / machine.peak_flops,
            "folds": num_micro_batches * fold_bytes / machine.memory_bandwidth,
            "host": num_micro_batches * 2 * self.host_bytes / machine.host_bandwidth,
            "collectives": self.link_bytes / machine.interconnect_bandwidth}

  def predicted_s(self, machine: Machine, num_micro_batches: int) -> float:
    """The roofline step time: the sum of :meth:`predicted_parts`, seconds."""
    return sum(self.predicted_parts(machine, num_micro_batches).values())


@dataclasses.dataclass(frozen=True)
class Considered:
  """A candidate the search compiled, and whether it fits.

  :func:`optax_adama.memory.plan`'s example shows one (``plan.considered``).

  ``measurable`` is False where the backend cannot show what the candidate
  saves (host memory on a backend that counts it as device memory): the
  search does not choose it.
  """

  candidate: Any
  measurement: Measurement
  predicted_s: float
  fits: bool
  measurable: bool = True


@dataclasses.dataclass(frozen=True)
class Skipped:
  """A ZeRO stage not compiled: its whole part is over the budget, whatever N.

  What it keeps whole on every device (the params, and under zero1/zero2 not
  the moments) exceeds the budget; ``plan.skipped`` lists them.

  Examples:
    >>> import optax_adama
    >>> optax_adama.memory.Skipped("zero1", None, 10**9).describe()
    'stage=zero1 moments=any, every N and remat: params whole on every device'

  Attributes:
    shard_states: the stage (None: data parallel).
    moments: the moment storage it was skipped with; None: with every storage
      (zero1 and zero2 keep only the params whole).
    replicated_bytes: those whole bytes on every device.
  """

  shard_states: Optional[str]
  moments: Optional[str]
  replicated_bytes: int

  def describe(self) -> str:
    what = ("params" if self.moments is None
            else f"params and {self.moments} moments")
    return (f"stage={self.shard_states or 'dp'} moments={self.moments or 'any'}, every N and "
            f"remat: {what} whole on every device")


@dataclasses.dataclass(frozen=True)
class Search:
  """What :func:`search` compiled: the smallest fitting N per setting and lever
  (``fitting``), every candidate (``considered``, in compile order), the
  stages skipped without compiling, and the candidates not compiled because a
  lower bound of their bytes was already over the budget (``bounded``:
  (candidate, bound) pairs)."""

  fitting: tuple[Considered, ...]
  considered: tuple[Considered, ...]
  skipped: tuple[Skipped, ...]
  bounded: tuple[tuple[Any, int], ...] = ()


def divisors(n: int) -> list[int]:
  """The divisors of n, increasing: the N that split a batch of n rows evenly."""
  return [d for d in range(1, n + 1) if n % d == 0]


def smallest_fitting(fits: Callable[[int], bool], upper: int) -> Optional[int]:
  """Smallest i in [0, upper) with fits(i), for fits monotone in i; None if none."""
  if upper == 0 or not fits(upper - 1):
    return None
  low, high = 0, upper - 1  # fits(high) holds
  while low < high:
    mid = (low + high) // 2
    if fits(mid):
      high = mid
    else:
      low = mid + 1
  return high


def search(
    *,
    budget_bytes: float,
    splits: Sequence[int],
    stages: Sequence[Optional[str]],
    activations: Sequence[Any],
    moment_storages: Sequence[str],
    levers: Callable[[Sequence[str]], Sequence[Any]],
    candidate_of: Callable[[int, Any, Any, Optional[str]], Any],
    measure: Callable[[Any], Measurement],
    machine: Machine,
    replicated: Optional[Callable[[Optional[str], str], int]] = None,
    measurable: Callable[[Any, Measurement], bool] = lambda candidate, measurement: True,
    describe: Callable[[Any], str] = str,
    lower_bound: Optional[Callable[[Any, dict[Any, Considered]], Optional[int]]] = None,
    progress: bool = False,
) -> Search:
  """The planner's search, over settings it only names (see the module docstring).

  Args:
    budget_bytes: per device.
    splits: the N to try, increasing.
    stages: ZeRO stages (None: data parallel or one device).
    activations: activation settings (opaque here: the library's plain loss
      and release, the zoo's remat policies and savers).
    moment_storages: storages to try, most precise first.
    levers: the memory levers, in the order to pull them, from the storages
      left after skipping those a stage cannot hold.
    candidate_of: ``candidate_of(n, activation, lever, stage)``: hashable,
      with a ``num_micro_batches`` attribute (n).
    measure: compiles and measures a candidate (called once per candidate).
    machine: the predictor's rates.
    replicated: ``replicated(stage, moments)``, bytes a stage keeps whole on
      every device; None: no stage is skipped.
    measurable: whether a measurement shows what its candidate saves.
    describe: a candidate's one-line name, for ``progress``.
    lower_bound: ``lower_bound(candidate, considered)``, bytes the candidate
      takes at least, from what was compiled so far (or None): over the
      budget, it is not compiled.
    progress: print each compile to stderr.

  Returns:
    A :class:`Search`.
  """
  considered: dict[Any, Considered] = {}
  bounded: dict[Any, int] = {}

  def fits(candidate: Any) -> bool:
    bound = None if lower_bound is None else lower_bound(candidate, considered)
    if candidate not in considered and bound is not None and bound > budget_bytes:
      bounded[candidate] = bound
      if progress:
        print(f"  {describe(candidate)}: at least {bound / 1e9:.2f} GB, not compiled",
              file=sys.stderr)
      return False
    return consider(candidate).fits

  def consider(candidate: Any) -> Considered:
    if candidate not in considered:
      measurement = measure(candidate)
      considered[candidate] = Considered(
          candidate, measurement,
          measurement.predicted_s(machine, candidate.num_micro_batches),
          measurement.device_bytes <= budget_bytes, measurable(candidate, measurement))
      if progress:
        print(f"  {describe(candidate)}: {measurement.device_bytes / 1e9:.2f} GB, "
              f"{considered[candidate].predicted_s * 1e3:.1f} ms, compiled in "
              f"{measurement.compile_s:.1f} s", file=sys.stderr)
    return considered[candidate]

  fitting: list[Considered] = []
  skipped: list[Skipped] = []
  for stage in stages:
    storages = list(moment_storages)
    if replicated is not None:  # skip the storages whose whole part alone is over
      whole = {moments: replicated(stage, moments) for moments in moment_storages}
      over = [moments for moments in moment_storages if whole[moments] > budget_bytes]
      storages = [moments for moments in moment_storages if moments not in over]
      if over and stage in ("zero1", "zero2"):  # the params alone, whatever the moments
        skipped.append(Skipped(stage, None, whole[over[0]]))
      else:
        skipped += [Skipped(stage, moments, whole[moments]) for moments in over]
      if progress and over:
        print(f"  stage={stage or 'dp'}: skipped with {', '.join(over)} moments "
              f"({min(whole[m] for m in over) / 1e9:.2f} GB or more whole on every device)",
              file=sys.stderr)
    if not storages:
      continue
    for activation in activations:
      upper = len(splits)  # each lever must beat the last one's N
      for lever in levers(storages):
        def candidate(i: int, lever=lever, activation=activation, stage=stage) -> Any:
          return candidate_of(splits[i], activation, lever, stage)
        index = smallest_fitting(lambda i: fits(candidate(i)), upper)
        if index is not None:
          found = considered[candidate(index)]
          if found.measurable:
            fitting.append(found)
          upper = index
        if upper == 0:
          break
  return Search(tuple(fitting), tuple(considered.values()), tuple(skipped),
                tuple(bounded.items()))


def ring_factor(kind: str, devices: int) -> float:
  """What one device sends, per byte of a collective's array, on a ring of D devices."""
  if kind == "collective-permute":
    return 1.0
  share = (devices - 1) / devices
  return 2 * share if kind == "all-reduce" else share


# Compile only: on the CPU the machine code is never run, so XLA skips its costly
# optimisation; the HLO, its memory and cost analyses and collectives are the same
# (MLP steps at N = 4 and 16: equal temp, argument bytes and flops, 3.2 s to compile
# instead of 6.3 s on 2 shared cores).
_CHEAP_CPU_CODEGEN: dict[str, str | bool] = {"xla_backend_optimization_level": "0",
                                              "xla_llvm_disable_expensive_passes": True}


def compile_for_measurement(lowered: jax.stages.Lowered,
                            platform: Optional[str] = None) -> jax.stages.Compiled:
  """``lowered.compile()`` for the memory it reports: on the CPU with code generation
  at its cheapest, on a TPU (a mesh of ``memory.target_mesh``'s compile-only devices)
  so that a program over HBM still reports its bytes instead of failing.

  ``platform``: where the program runs (its mesh's devices'); None: the default
  backend's.
  """
  platform = platform or jax.default_backend()
  if platform == "cpu":
    return lowered.compile(compiler_options=_CHEAP_CPU_CODEGEN)
  if platform == "tpu":
    return lowered.compile(compiler_options=dict(_targets.TPU_OPTIONS))
  return lowered.compile()


def compiled_cost(compiled: jax.stages.Compiled) -> tuple[float, float]:
  """(flops, bytes accessed) of XLA's cost analysis of a compiled program."""
  analysis = compiled.cost_analysis() or {}
  return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def measure_compiled(
    compiled: jax.stages.Compiled, *, params: Any, opt_state: Any, flops: float,
    bytes_accessed: float, compile_s: float, devices: int = 1, state_shards: int = 1,
) -> Measurement:
  """A compiled step's :class:`Measurement`: bytes as :func:`memory_report`
  counts them, collectives from its HLO; ``flops`` as the caller completed them."""
  report = _memory.memory_report(compiled, param_bytes=_memory.tree_bytes(params))
  memory: Any = compiled.memory_analysis()  # not None: memory_report read it
  collectives = _collectives.collective_bytes(compiled).by_kind
  return Measurement(
      device_bytes=report.total_bytes,
      host_bytes=int(memory.host_argument_size_in_bytes + memory.host_output_size_in_bytes
                     + memory.host_temp_size_in_bytes - memory.host_alias_size_in_bytes),
      param_bytes=report.param_bytes, state_bytes=_memory.tree_bytes(opt_state),
      flops=flops, bytes_accessed=bytes_accessed, compile_s=compile_s,
      collective_bytes=sum(collectives.values()),
      link_bytes=sum(nbytes * ring_factor(kind, devices) for kind, nbytes in collectives.items()),
      state_shards=state_shards)


def block_cost(staged: StagedLoss, params: Any, micro_batch: Any, *,
               policy: Optional[Callable[..., bool]] = None,
               remat: bool = False) -> tuple[float, float]:
  """(flops, bytes accessed) of one block's forward and backward, compiled alone.

  What each layer of the stack beyond the first adds to a step whose layer scan
  XLA counts once. The program returns the block's output as well as its
  gradients, so the forward is kept (in the model it feeds the next block); with
  ``remat`` (or a ``policy``) the block is under ``jax.checkpoint`` with
  ``prevent_cse=True``, so XLA cannot merge the recomputation into that forward
  (inside the model's scan it cannot either): the release's work, which
  recomputes each layer.
  """
  outer, stacked = staged.split(params)
  layer_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
  x = jax.eval_shape(staged.embed, outer, micro_batch)

  def block(layer_params, x):
    return staged.block(layer_params, x, micro_batch)

  if remat or policy is not None:
    block = jax.checkpoint(block, policy=policy, prevent_cse=True)

  def forward_and_backward(layer_params, x):
    out, vjp = jax.vjp(block, layer_params, x)
    return out, vjp(jax.tree.map(jnp.ones_like, out))

  return compiled_cost(compile_for_measurement(
      jax.jit(forward_and_backward).lower(layer_params, x)))
