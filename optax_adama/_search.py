"""The search behind :func:`optax_adama.memory.plan`: its settings, and which to compile.

A candidate is a :class:`PlanSettings`: N, the moments' storage, moments in
host memory, the gradient release, the ZeRO stage and the caller's own model
levers (:class:`optax_adama.memory.ModelLevers`: remat policies, savers, a loss
in chunks; ``models.planner`` supplies the zoo's). Nothing here compiles:
:func:`search` asks ``measure`` for each candidate it needs
(:mod:`optax_adama._measure` compiles it) and ranks them by a roofline
prediction of the step time, summed rather than overlapped (an upper bound
where XLA hides one behind another):

- compute: XLA's ``cost_analysis()`` flops over ``Machine.peak_flops``. XLA
  counts a loop body once, so the step's flops are taken per micro-batch and
  multiplied by N, and the loops inside the loss are completed per uncounted
  trip (``ModelLevers.uncounted_cost``: a :class:`StagedLoss`'s layer scan by
  one more block's forward and backward, compiled alone). A plain loss's own
  loops are counted once each: the same for every candidate, so the ranking
  holds, the absolute time is low;
- folds: AdamA reads the gradient and m, v and writes m, v once per
  micro-batch, ``N * (P + 2 * state) / memory_bandwidth`` (a device's share
  under a ZeRO stage);
- host: what lives in host memory crosses the link out and back once per
  micro-batch, ``N * 2 * host_bytes / host_bandwidth``;
- collectives: :func:`collective_bytes` of the compiled step (every loop trip
  counted) as one device sends them on a ring, over
  ``Machine.interconnect_bandwidth``.

The search: per ZeRO stage and activation setting (the loss as given or the
release; with model levers, each of their activations), the smallest N that
fits with the first memory lever, by bisection over the divisors (memory falls
as N grows, time grows with N: each micro-batch pays the fold), then each
further lever only where it lets a smaller N fit. Exact levers come first
(float32 moments with each of the model's exact levers, such as a loss in
chunks, then float32 moments in host memory), then narrower moments, which
change the optimizer's numerics; a narrower storage is not compiled where the
float32 step at that N, less the device bytes the narrower moments save, is
still over the budget (a lower bound: the program differs only in the
optimizer's arithmetic). Compiles are memoised by settings. The fastest
predicted candidate wins (ties: the most precise moments, on the device, with
the fewest exact levers) and is compiled once more, uncached, to confirm that
it fits.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any
from typing import Optional

import jax.numpy as jnp
import optax

from optax_adama import _chain
from optax_adama import _offload
from optax_adama import _quantize

__all__ = ["Considered", "Machine", "Measurement", "PlanSettings", "Skipped", "search"]

# Moment storages, most precise first: the planner narrows them only to fit.
MOMENT_STORAGES = ("float32", "bfloat16", "8bit")
SHARD_STAGES: tuple[Optional[str], ...] = (None, "zero1", "zero2", "fsdp")
# How a step without the release, and the release, read in a settings' name.
PLAIN, RELEASE = "plain", "release"
# offload_moments' default: smaller state leaves stay on the device.
OFFLOAD_MIN_SIZE = 4096
# The learning rate a candidate is compiled with: it changes no buffer.
MEASURED_LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class PlanSettings:
  """One setting of the step: N, the moments, the release, the stage, the model's levers.

  :func:`plan`'s example shows one (``plan.settings``).

  Attributes:
    num_micro_batches: N.
    moments: AdamA's m and v storage: "float32", "bfloat16" or "8bit" (blocks).
    offload_moments: m and v kept in host memory (:func:`offload_moments`).
    release: :func:`release_step` (a :class:`StagedLoss`'s gradient release)
      in place of :func:`microbatch_step`.
    shard_states: on a mesh, the ZeRO stage: None (data parallel), "zero1",
      "zero2" or "fsdp".
    model: the variant of the model the step compiles, one value of the
      caller's :class:`ModelLevers` (its ``str`` names it in tables); None:
      the ``loss_fn`` as given.
  """

  num_micro_batches: int
  moments: str = "float32"
  offload_moments: bool = False
  release: bool = False
  shard_states: Optional[str] = None
  model: Hashable = None

  def describe(self, *, on_mesh: bool = False) -> str:
    """"N=2 release moments=bfloat16", with the model's variant in place of
    "plain", " offloaded" and " stage=fsdp" (" stage=dp" on a mesh) as they apply."""
    if self.release:
      activation = RELEASE if self.model is None else f"{RELEASE} {self.model}"
    else:
      activation = PLAIN if self.model is None else str(self.model)
    stage = f" stage={self.shard_states or 'dp'}" if on_mesh or self.shard_states else ""
    return (f"N={self.num_micro_batches} {activation} moments={self.moments}"
            f"{' offloaded' if self.offload_moments else ''}{stage}")

  def optimizer(self, learning_rate: optax.ScalarOrSchedule,
                **adamaw_kwargs: Any) -> optax.GradientTransformation:
    """:func:`adamaw` with these moments and N (under :func:`offload_moments` if offloaded).

    Raises:
      TypeError: for an ``adamaw_kwargs`` the settings choose (N, the moments).
    """
    chosen = {"num_micro_batches", "mu_dtype", "nu_dtype", "quantization"} & set(adamaw_kwargs)
    if chosen:
      raise TypeError(f"the plan chooses {sorted(chosen)}; pass the other adamaw arguments "
                      "only (weight_decay, b1, b2, ...).")
    narrow = jnp.bfloat16 if self.moments == "bfloat16" else None
    # The default layout tiles each layer of a stacked leaf with its own blocks,
    # as the release folds them, and any other leaf evenly.
    quantization = _quantize.BlockQuantization() if self.moments == "8bit" else None
    tx = _chain.adamaw(learning_rate, num_micro_batches=self.num_micro_batches,
                       mu_dtype=narrow, nu_dtype=narrow, quantization=quantization,
                       **adamaw_kwargs)
    if self.offload_moments:
      tx = _offload.offload_moments(tx, min_size=OFFLOAD_MIN_SIZE)
    return tx


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

  candidate: PlanSettings
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
  """What :func:`search` compiled: the fastest predicted fitting candidate
  (``best``; None: nothing fits), the smallest fitting N per setting and lever
  (``fitting``), every candidate (``considered``, in compile order), the stages
  skipped without compiling, and the candidates not compiled because a lower
  bound of their bytes was already over the budget (``bounded``: (candidate,
  bound) pairs)."""

  best: Optional[Considered]
  fitting: tuple[Considered, ...]
  considered: tuple[Considered, ...]
  skipped: tuple[Skipped, ...]
  bounded: tuple[tuple[PlanSettings, int], ...] = ()


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


def memory_levers(storages: Sequence[str], exact: Sequence[Hashable], *,
                  offload: bool) -> list[tuple[str, bool, Hashable]]:
  """(moments, offloaded, model) in the order pulled: exact first (the most
  precise moments with each of the model's exact levers, then those moments in
  host memory), then narrower moments, then the narrowest in host memory; the
  moments after the first take the last exact lever."""
  first, narrower, most = storages[0], list(storages[1:]), exact[-1]
  levers = [(first, False, model) for model in exact]
  if offload:
    levers.append((first, True, most))
  levers += [(moments, False, most) for moments in narrower]
  if offload:
    levers += [(moments, True, most) for moments in narrower[-1:]]
  return levers


def search(
    *,
    budget_bytes: float,
    splits: Sequence[int],
    stages: Sequence[Optional[str]],
    activations: Sequence[tuple[Hashable, bool]],
    exact: Callable[[Hashable], Sequence[Hashable]],
    moment_storages: Sequence[str],
    offload: bool,
    measure: Callable[[PlanSettings], Measurement],
    machine: Machine,
    replicated: Optional[Callable[[Optional[str], str], int]] = None,
    measurable: Callable[[PlanSettings, Measurement], bool] = lambda settings, measured: True,
    on_mesh: bool = False,
    lower_bound: Optional[Callable[[PlanSettings, dict[PlanSettings, Considered]],
                                   Optional[int]]] = None,
    progress: bool = False,
) -> Search:
  """The planner's search (see the module docstring).

  Args:
    budget_bytes: per device.
    splits: the N to try, increasing.
    stages: ZeRO stages (None: data parallel or one device).
    activations: (model, release) pairs, each searched over every N: the
      model's variant (``PlanSettings.model``) and whether the step is the
      release.
    exact: a variant's exact memory levers (:meth:`ModelLevers.exact`).
    moment_storages: storages to try, most precise first.
    offload: try moments in host memory.
    measure: compiles and measures a candidate (called once per candidate).
    machine: the predictor's rates.
    replicated: ``replicated(stage, moments)``, bytes a stage keeps whole on
      every device; None: no stage is skipped.
    measurable: whether a measurement shows what its candidate saves.
    on_mesh: name each candidate's stage in ``progress``.
    lower_bound: ``lower_bound(candidate, considered)``, bytes the candidate
      takes at least, from what was compiled so far (or None): over the
      budget, it is not compiled.
    progress: print each compile to stderr.

  Returns:
    A :class:`Search`.
  """
  considered: dict[PlanSettings, Considered] = {}
  bounded: dict[PlanSettings, int] = {}
  precision = {moments: i for i, moments in enumerate(MOMENT_STORAGES)}

  def fits(candidate: PlanSettings) -> bool:
    bound = None if lower_bound is None else lower_bound(candidate, considered)
    if candidate not in considered and bound is not None and bound > budget_bytes:
      bounded[candidate] = bound
      if progress:
        print(f"  {candidate.describe(on_mesh=on_mesh)}: at least {bound / 1e9:.2f} GB, not "
              "compiled", file=sys.stderr)
      return False
    return consider(candidate).fits

  def consider(candidate: PlanSettings) -> Considered:
    if candidate not in considered:
      measurement = measure(candidate)
      considered[candidate] = Considered(
          candidate, measurement,
          measurement.predicted_s(machine, candidate.num_micro_batches),
          measurement.device_bytes <= budget_bytes, measurable(candidate, measurement))
      if progress:
        print(f"  {candidate.describe(on_mesh=on_mesh)}: "
              f"{measurement.device_bytes / 1e9:.2f} GB, "
              f"{considered[candidate].predicted_s * 1e3:.1f} ms, compiled in "
              f"{measurement.compile_s:.1f} s", file=sys.stderr)
    return considered[candidate]

  fitting: list[tuple[Considered, tuple[float, int, bool, int]]] = []
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
    for model, release in activations:
      upper = len(splits)  # each lever must beat the last one's N
      variants = list(exact(model))
      for moments, offloaded, variant in memory_levers(storages, variants, offload=offload):
        def candidate(i: int, moments: str = moments, offloaded: bool = offloaded,
                      variant: Hashable = variant, release: bool = release,
                      stage: Optional[str] = stage) -> PlanSettings:
          return PlanSettings(splits[i], moments, offloaded, release, stage, variant)
        index = smallest_fitting(lambda i: fits(candidate(i)), upper)
        if index is not None:
          found = considered[candidate(index)]
          if found.measurable:
            # Ties go to the most precise moments, on the device, fewest exact levers.
            fitting.append((found, (found.predicted_s, precision[moments], offloaded,
                                    variants.index(variant))))
          upper = index
        if upper == 0:
          break
  best = min(fitting, key=lambda pair: pair[1])[0] if fitting else None
  return Search(best, tuple(found for found, _ in fitting), tuple(considered.values()),
                tuple(skipped), tuple(bounded.items()))
