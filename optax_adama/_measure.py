"""One candidate of :func:`optax_adama.memory.plan`: its step compiled and measured.

:class:`Candidates` holds what every candidate of one plan shares (the model's
levers, the params, the batch, the mesh) and compiles a :class:`PlanSettings`'
step for abstract inputs, placed as the step keeps them: nothing is allocated
or run. A measurement is :func:`memory_report`'s bytes of one device, the
step's collectives, and XLA's flops completed per uncounted loop trip.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any
from typing import Optional
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adama import _collectives
from optax_adama import _memory
from optax_adama import _microbatch
from optax_adama import _offload
from optax_adama import _plan_advice
from optax_adama import _release
from optax_adama import _release_mesh
from optax_adama import _sharding
from optax_adama import _targets
from optax_adama._search import MOMENT_STORAGES
from optax_adama._search import OFFLOAD_MIN_SIZE
from optax_adama._search import Considered
from optax_adama._search import Measurement
from optax_adama._search import PlanSettings
from optax_adama._search import Search
from optax_adama._staged import StagedLoss

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


def ring_factor(kind: str, devices: int) -> float:
  """What one device sends, per byte of a collective's array, on a ring of D devices."""
  if kind == "collective-permute":
    return 1.0
  share = (devices - 1) / devices
  return 2 * share if kind == "all-reduce" else share


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

  def block(layer_params: Any, x: Any) -> Any:
    return staged.block(layer_params, x, micro_batch)

  if remat or policy is not None:
    block = jax.checkpoint(block, policy=policy, prevent_cse=True)

  def forward_and_backward(layer_params: Any, x: Any) -> tuple[Any, Any]:
    out, vjp = jax.vjp(block, layer_params, x)
    return out, vjp(jax.tree.map(jnp.ones_like, out))

  return compiled_cost(compile_for_measurement(
      jax.jit(forward_and_backward).lower(layer_params, x)))


def make_step(settings: PlanSettings, loss_fn: Callable[..., Any],
              tx: optax.GradientTransformation, has_aux: bool,
              mesh: Optional[jax.sharding.Mesh],
              data_axis: _sharding.AxisName) -> Callable[..., Any]:
  """The jitted step of ``settings``: :func:`release_step` or :func:`microbatch_step`."""
  on_mesh: dict[str, Any] = {} if mesh is None else {
      "mesh": mesh, "shard_states": settings.shard_states, "data_axis": data_axis}
  if settings.release:
    return _release.release_step(loss_fn, tx, has_aux=has_aux, **on_mesh)  # type: ignore[arg-type]
  return _microbatch.microbatch_step(loss_fn, tx, num_micro_batches=settings.num_micro_batches,
                                     has_aux=has_aux, **on_mesh)


def step_shardings(settings: PlanSettings, loss_fn: Callable[..., Any], params: Any,
                   opt_state: Any, mesh: jax.sharding.Mesh,
                   data_axis: _sharding.AxisName) -> _sharding.StepShardings:
  """Where the step of ``settings`` on ``mesh`` keeps params and state."""
  if settings.release:
    return _release_mesh.release_shardings(loss_fn, params, opt_state, mesh,  # type: ignore[arg-type]
                                           shard_states=settings.shard_states,
                                           data_axis=data_axis)
  return _sharding.step_shardings(params, opt_state, mesh, shard_states=settings.shard_states,
                                  data_axis=data_axis)


@functools.cache
def counts_host_memory_apart() -> bool:
  """Whether the default backend reports host memory apart (the CPU's counts
  pinned host arrays as device arrays: offloading shows no saving there)."""
  if jax.default_backend() == "cpu":
    return False
  shapes = _offload.offloaded_state_shapes(
      {"x": jax.ShapeDtypeStruct((OFFLOAD_MIN_SIZE,), jnp.float32)}, min_size=1)
  try:
    compiled = jax.jit(lambda tree: tree).lower(shapes).compile()
  except Exception:  # pylint: disable=broad-except
    return False  # no host memory space on this backend
  memory: Any = compiled.memory_analysis()
  return memory is not None and memory.host_argument_size_in_bytes > 0


def abstract(tree: Any, name: str) -> Any:
  """``tree`` as ``jax.ShapeDtypeStruct``s (no buffer is kept or made).

  Raises:
    TypeError: for a leaf that is not an array, naming the argument ``name``.
  """
  def to_struct(leaf: Any) -> jax.ShapeDtypeStruct:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise TypeError(f"{name} must hold arrays or jax.ShapeDtypeStruct, got a leaf of type "
                      f"{type(leaf).__name__}: {leaf!r:.60}.")
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
  return jax.tree.map(to_struct, tree)


def placed(tree: Any, shardings: Any) -> Any:
  """``tree``'s shapes as ``jax.ShapeDtypeStruct``s placed on ``shardings``."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def device_share(tree: Any) -> int:
  """Bytes one device holds of ``tree``'s placed leaves (host memory left out)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if getattr(sharding, "memory_kind", None) == _offload.HOST_MEMORY_KIND:
      continue
    shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def micro_batch_of(batch: Any, num_micro_batches: int) -> Any:
  """One of ``num_micro_batches`` micro-batches of ``batch``'s rows, abstract."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[0] // num_micro_batches, *x.shape[1:]), x.dtype), batch)


class Levers(Protocol):
  """What :class:`Candidates` asks of a :class:`ModelLevers` (whose module imports this one)."""

  def loss(self, settings: PlanSettings) -> tuple[Callable[..., Any], bool]: ...

  def optimizer(self, settings: PlanSettings) -> optax.GradientTransformation: ...

  def uncounted_cost(self, settings: PlanSettings, params: Any,
                     micro_batch: Any) -> tuple[float, float]: ...


class Candidates:
  """What every candidate of one :func:`plan` call shares, and its caches."""

  def __init__(self, levers: Levers, params: Any, batch: Any,
               mesh: Optional[jax.sharding.Mesh], data_axis: _sharding.AxisName,
               devices: int):
    self.levers, self.params, self.batch = levers, params, batch
    self.mesh, self.data_axis, self.devices = mesh, data_axis, devices
    self._micro_batches: dict[int, Any] = {}
    self._losses: dict[tuple[bool, Hashable], tuple[Callable[..., Any], bool]] = {}
    self._uncounted: dict[tuple[int, bool, Hashable], tuple[float, float]] = {}

  def loss_of(self, settings: PlanSettings) -> tuple[Callable[..., Any], bool]:
    """(loss_fn, has_aux) of the model variant and release of ``settings``."""
    key = (settings.release, settings.model)
    if key not in self._losses:
      self._losses[key] = self.levers.loss(settings)
    return self._losses[key]

  def arguments(self, settings: PlanSettings) -> tuple[optax.GradientTransformation, Any, Any]:
    """(tx, params, state) of a candidate, abstract, placed as its step keeps them."""
    tx = self.levers.optimizer(settings)
    state = jax.eval_shape(tx.init, self.params)
    if settings.offload_moments:
      state = _offload.offloaded_state_shapes(state, min_size=OFFLOAD_MIN_SIZE)
    if self.mesh is None:
      return tx, self.params, state
    shardings = step_shardings(settings, self.loss_of(settings)[0], self.params, state,
                               self.mesh, self.data_axis)
    return tx, placed(self.params, shardings.params), placed(state, shardings.opt_state)

  def measure(self, settings: PlanSettings) -> Measurement:
    """Compiles a candidate's step for abstract inputs and measures it."""
    n = settings.num_micro_batches
    micro_batch = self.check_loss(settings)
    loss_fn, has_aux = self.loss_of(settings)
    tx, params, state = self.arguments(settings)
    step = make_step(settings, loss_fn, tx, has_aux, self.mesh, self.data_axis)
    start = time.perf_counter()
    jitted: Any = step  # a jitted step, with .lower
    platform = None if self.mesh is None else self.mesh.devices.flat[0].platform
    lowered = jitted.lower(params, state, self.batch)
    try:
      compiled = compile_for_measurement(lowered, platform)
    except jax.errors.JaxRuntimeError as error:  # a TPU target's program over HBM
      temporaries = _targets.temporaries_over_memory(lowered, error)
      if temporaries is None:
        raise
      # Not compiled, so no bytes but libtpu's temporaries: at least those and
      # the device's share of params and state; never the fastest.
      return Measurement(
          device_bytes=temporaries + device_share(params) + device_share(state),
          host_bytes=0, param_bytes=_memory.tree_bytes(self.params),
          state_bytes=_memory.tree_bytes(state), flops=float("inf"), bytes_accessed=0.0,
          compile_s=time.perf_counter() - start)
    flops, bytes_accessed = compiled_cost(compiled)
    # The loops XLA counts once, completed per uncounted trip on one device's rows.
    key = (n, settings.release, settings.model)
    if key not in self._uncounted:
      self._uncounted[key] = self.levers.uncounted_cost(
          settings, self.params, micro_batch_of(micro_batch, self.devices))
    uncounted_flops, uncounted_bytes = self._uncounted[key]
    flops += uncounted_flops
    bytes_accessed += uncounted_bytes
    compile_s = time.perf_counter() - start
    return measure_compiled(
        compiled, params=self.params, opt_state=state, flops=n * flops,
        bytes_accessed=n * bytes_accessed, compile_s=compile_s, devices=self.devices,
        state_shards=self.devices if settings.shard_states is not None else 1)

  def check_loss(self, settings: PlanSettings) -> Any:
    """One micro-batch's shapes, after tracing the loss on them once per N."""
    n = settings.num_micro_batches
    if n not in self._micro_batches:
      self._micro_batches[n] = self._traced_micro_batch(settings)
    return self._micro_batches[n]

  def _traced_micro_batch(self, settings: PlanSettings) -> Any:
    num_micro_batches = settings.num_micro_batches
    loss_fn, has_aux = self.loss_of(settings)
    micro_batch = micro_batch_of(self.batch, num_micro_batches)
    shapes = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), micro_batch)
    try:
      out = jax.eval_shape(loss_fn, self.params, micro_batch)
    except Exception as error:  # the user's code: any error is theirs to read
      raise ValueError(
          f"loss_fn failed on one micro-batch of shapes {shapes} (the batch's rows split into "
          f"N={num_micro_batches}): {type(error).__name__}: {error}") from error
    loss = out[0] if has_aux and isinstance(out, tuple) and len(out) == 2 else out
    if (has_aux and loss is out) or getattr(loss, "shape", None) != ():
      raise TypeError(
          f"loss_fn must return {'(loss, aux)' if has_aux else 'a scalar loss'} (has_aux="
          f"{has_aux}); on a micro-batch of shapes {shapes} it returned "
          f"{jax.tree.map(lambda x: x.shape, out)}.")
    return micro_batch

  def narrower_bound(self, settings: PlanSettings,
                     considered: dict[PlanSettings, Considered]) -> Optional[int]:
    """Bytes narrower moments take at least: the same step with float32 moments,
    compiled, less the device bytes the narrower moments no longer hold (the
    program is the same but for the optimizer's arithmetic). None: no such step
    compiled yet."""
    wide = dataclasses.replace(settings, moments=MOMENT_STORAGES[0])
    if settings == wide or wide not in considered:
      return None
    saved = (device_share(self.arguments(wide)[2])
             - device_share(self.arguments(settings)[2]))
    return considered[wide].measurement.device_bytes - saved

  def replicated(self, shard_states: Optional[str], moments: str) -> int:
    """Bytes a stage keeps whole on every device, whatever N: params and state
    with no stage, the params under zero1 and zero2, nothing under fsdp."""
    if shard_states == "fsdp":
      return 0
    param_bytes = _memory.tree_bytes(self.params)
    if shard_states is not None:
      return param_bytes
    state = jax.eval_shape(self.levers.optimizer(PlanSettings(1, moments)).init, self.params)
    return param_bytes + _memory.tree_bytes(state)

  def nothing_fits(self, found: Search, budget_bytes: float, *, splits: Sequence[int],
                   offload: bool, staged: bool) -> str:
    """The error when no candidate fits: the smallest step, taken apart, and the
    levers left, priced on this model."""
    where = "" if self.mesh is None else f" on {self.devices} devices"
    budget = f"budget_bytes={budget_bytes:,.0f} ({budget_bytes / 1e9:.3g} GB) a device{where}"
    if not found.considered:
      least = min(found.skipped, key=lambda s: s.replicated_bytes)
      return (f"nothing fits {budget}: every stage keeps more whole on each device, the least "
              f"{least.describe()} ({least.replicated_bytes:,} B). Raise the budget or add "
              "'fsdp' to shard_stages.")
    smallest = min(found.considered, key=lambda r: r.measurement.device_bytes)
    settings = smallest.candidate
    _, params, state = self.arguments(settings)
    parts = _plan_advice.Breakdown(
        total=smallest.measurement.device_bytes, params=device_share(params),
        state=device_share(state), batch=_memory.tree_bytes(self.batch) // self.devices,
        largest_param=max(device_share(leaf) for leaf in jax.tree.leaves(params)))
    levers = _plan_advice.levers_left(
        settings, parts, splits=list(splits), staged=staged,
        state_bytes_with=lambda moments: device_share(
            self.arguments(dataclasses.replace(settings, moments=moments))[2]),
        devices=self.devices, stage=settings.shard_states, offload_counts=offload)
    return _plan_advice.nothing_fits_message(
        budget, settings.describe(on_mesh=self.mesh is not None), parts, levers)
