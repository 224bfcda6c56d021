"""Will a model fit? The AdamA step that fits a memory budget, found by compiling it.

:func:`plan` takes a user's ``loss_fn(params, micro_batch)`` (or a
:class:`StagedLoss`), its params and one mini-batch, as arrays or
``jax.ShapeDtypeStruct``, and searches what the library switches without
touching the model: the number of micro-batches N (divisors of the batch's
rows), the moments' storage (float32, bfloat16, 8-bit blocks), moments kept in
host memory (:func:`offload_moments`), the gradient release
(:func:`release_step`, for a :class:`StagedLoss`) and, on a mesh, the ZeRO
stage. Every candidate is compiled for abstract inputs (nothing is allocated
or run) and measured as :func:`memory_report` measures: argument + output +
temp - alias bytes of one device.

The candidates are measured and ranked by :mod:`optax_adama._search` (the
roofline prediction and the search, shared with ``models.planner``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adama import _chain
from optax_adama import _memory
from optax_adama import _microbatch
from optax_adama import _offload
from optax_adama import _plan_advice
from optax_adama import _quantize
from optax_adama import _release
from optax_adama import _release_mesh
from optax_adama import _sharding
from optax_adama import _targets
from optax_adama._search import DEFAULT_MACHINE
from optax_adama._search import MOMENT_STORAGES
from optax_adama._search import PLAIN
from optax_adama._search import RELEASE
from optax_adama._search import SHARD_STAGES
from optax_adama._search import Considered
from optax_adama._search import Machine
from optax_adama._search import Measurement
from optax_adama._search import Search
from optax_adama._search import Skipped
from optax_adama._search import block_cost
from optax_adama._search import compile_for_measurement
from optax_adama._search import compiled_cost
from optax_adama._search import divisors
from optax_adama._search import measure_compiled
from optax_adama._search import search
from optax_adama._staged import StagedLoss

__all__ = ["Plan", "PlanSettings", "plan"]

# offload_moments' default: smaller state leaves stay on the device.
OFFLOAD_MIN_SIZE = 4096
# Rates a candidate is measured with; the learning rate changes no buffer.
_MEASURED_LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class PlanSettings:
  """One setting of the step: what the library switches without touching the model.

  :func:`plan`'s example shows one (``plan.settings``).

  Attributes:
    num_micro_batches: N.
    moments: AdamA's m and v storage: "float32", "bfloat16" or "8bit" (blocks).
    offload_moments: m and v kept in host memory (:func:`offload_moments`).
    release: :func:`release_step` (a :class:`StagedLoss`'s gradient release)
      in place of :func:`microbatch_step`.
    shard_states: on a mesh, the ZeRO stage: None (data parallel), "zero1",
      "zero2" or "fsdp".
  """

  num_micro_batches: int
  moments: str = "float32"
  offload_moments: bool = False
  release: bool = False
  shard_states: Optional[str] = None

  def describe(self, *, on_mesh: bool = False) -> str:
    """"N=2 release moments=bfloat16", "+ offloaded" and " stage=fsdp" as they apply."""
    stage = f" stage={self.shard_states or 'dp'}" if on_mesh else ""
    return (f"N={self.num_micro_batches} {RELEASE if self.release else PLAIN} "
            f"moments={self.moments}{' offloaded' if self.offload_moments else ''}{stage}")

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
class Plan:
  """:func:`plan`'s answer: the settings, their verified bytes and predicted time.

  :func:`plan`'s example shows one.

  Attributes:
    settings: the chosen :class:`PlanSettings`.
    device_bytes: the chosen step's compiled bytes on one device, as
      :func:`memory_report` counts them (compiled once more to confirm).
    predicted_s: its predicted step time, seconds (the module docstring).
    budget_bytes: the budget, per device.
    measurement: the confirming compile's :class:`Measurement`.
    considered: every candidate compiled.
    skipped: the ZeRO stages not compiled (their whole part is over budget).
    bounded: (settings, bytes) not compiled: narrower moments at an N where
      the float32 step, less the bytes the narrower moments save, is over.
  """

  settings: PlanSettings
  device_bytes: int
  predicted_s: float
  budget_bytes: int
  measurement: Measurement
  considered: tuple[Considered, ...]
  skipped: tuple[Skipped, ...]
  bounded: tuple[tuple[PlanSettings, int], ...]
  loss_fn: Callable[..., Any] = dataclasses.field(repr=False, compare=False)
  has_aux: bool = False
  mesh: Optional[jax.sharding.Mesh] = dataclasses.field(default=None, repr=False)
  data_axis: _sharding.AxisName = "data"

  def optimizer(self, learning_rate: optax.ScalarOrSchedule,
                **adamaw_kwargs: Any) -> optax.GradientTransformation:
    """The planned :func:`adamaw` (see :meth:`PlanSettings.optimizer`)."""
    return self.settings.optimizer(learning_rate, **adamaw_kwargs)

  def step(self, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """The planned jitted step for ``tx`` (from :meth:`optimizer`):
    ``step(params, opt_state, batch) -> (params, opt_state, metrics)``."""
    return _step(self.settings, self.loss_fn, tx, self.has_aux, self.mesh, self.data_axis)

  def shardings(self, params: Any, opt_state: Any) -> _sharding.StepShardings:
    """On a mesh: where the planned step keeps params and state (place them
    there first, ``jax.device_put(params, shardings.params)``)."""
    if self.mesh is None:
      raise ValueError("this plan runs on one device: nothing to place.")
    return _shardings(self.settings, self.loss_fn, params, opt_state, self.mesh,
                      self.data_axis)

  def table(self) -> str:
    """Markdown: every candidate compiled, best predicted first; the choice marked."""
    return _table(self)

  def __str__(self) -> str:
    m, on_mesh = self.measurement, self.mesh is not None
    where = " a device" if on_mesh else ""
    return (f"{self.settings.describe(on_mesh=on_mesh)}: {m.device_bytes / 1e9:.4g} GB{where} "
            f"({m.device_bytes / m.param_bytes:.2f} P) of {self.budget_bytes / 1e9:.4g} GB, "
            f"predicted {self.predicted_s * 1e3:.4g} ms a step; {len(self.considered)} "
            "candidates compiled")


def _table(chosen: Plan) -> str:
  on_mesh = chosen.mesh is not None
  lines = ["| settings | device bytes | P | host bytes | predicted step | fits |",
           "|---|---|---|---|---|---|"]
  for row in sorted(chosen.considered, key=lambda r: (not r.fits, r.predicted_s)):
    m = row.measurement
    mark = " **(chosen)**" if row.candidate == chosen.settings else ""
    fits = "yes" if row.fits else "no"
    if not row.measurable:
      fits += " (not measurable here)"
    lines.append(f"| {row.candidate.describe(on_mesh=on_mesh)}{mark} | {m.device_bytes:,} | "
                 f"{m.device_bytes / m.param_bytes:.2f} | {m.host_bytes:,} | "
                 f"{row.predicted_s * 1e3:.4g} ms | {fits} |")
  lines += [f"| {settings.describe(on_mesh=on_mesh)} | at least {bound:,} | - | - | - | no: "
            "not compiled |" for settings, bound in chosen.bounded]
  lines += [f"| {s.describe()} | {s.replicated_bytes:,} whole | - | - | - | no: skipped |"
            for s in chosen.skipped]
  return "\n".join(lines)


def _step(settings: PlanSettings, loss_fn, tx, has_aux, mesh, data_axis) -> Callable[..., Any]:
  on_mesh = {} if mesh is None else {"mesh": mesh, "shard_states": settings.shard_states,
                                     "data_axis": data_axis}
  if settings.release:
    return _release.release_step(loss_fn, tx, has_aux=has_aux, **on_mesh)
  return _microbatch.microbatch_step(loss_fn, tx, num_micro_batches=settings.num_micro_batches,
                                     has_aux=has_aux, **on_mesh)


def _shardings(settings: PlanSettings, loss_fn, params, opt_state, mesh,
               data_axis) -> _sharding.StepShardings:
  if settings.release:
    return _release_mesh.release_shardings(loss_fn, params, opt_state, mesh,
                                           shard_states=settings.shard_states,
                                           data_axis=data_axis)
  return _sharding.step_shardings(params, opt_state, mesh, shard_states=settings.shard_states,
                                  data_axis=data_axis)


def plan(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    *,
    budget_bytes: float,
    mesh: Optional[jax.sharding.Mesh] = None,
    data_axis: _sharding.AxisName = "data",
    has_aux: bool = False,
    machine: Optional[Machine] = None,
    moment_storages: Optional[Sequence[str]] = None,
    offload: Optional[bool] = None,
    shard_stages: Optional[Sequence[Optional[str]]] = None,
    progress: bool = False,
) -> Plan:
  """The fastest predicted AdamA step of ``loss_fn`` that fits ``budget_bytes``.

  Searches N, the moments' storage, offloaded moments, the gradient release
  (for a :class:`StagedLoss`) and, with ``mesh``, the ZeRO stage; compiles
  each candidate for abstract inputs and measures it as :func:`memory_report`
  does (the module docstring has the search and the time predictor). Nothing
  is allocated or run.

  Args:
    loss_fn: ``loss_fn(params, micro_batch)``, the micro-batch *mean* loss, as
      :func:`microbatch_step` takes it; a :class:`StagedLoss` adds the release.
    params: the params, arrays or ``jax.ShapeDtypeStruct``.
    batch: one mini-batch, arrays or ``jax.ShapeDtypeStruct`` with a shared
      leading axis of rows (over all devices of ``mesh``).
    budget_bytes: device memory each device may use, bytes.
    mesh: plan data parallel on this mesh (fake CPU devices compile too:
      ``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
    data_axis: the mesh axis (or axes) the batch is split over.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    machine: the time predictor's rates; None: :class:`Machine`'s defaults.
    moment_storages: storages to try, most precise first; None: "float32",
      "bfloat16" and "8bit".
    offload: try moments in host memory; None: where the backend counts host
      memory apart from device memory (not the CPU's).
    shard_stages: ZeRO stages to try on a mesh; None: all four.
    progress: print each compile to stderr.

  Returns:
    The :class:`Plan`; ``plan.step(plan.optimizer(learning_rate))`` runs it.

  Raises:
    TypeError: for a ``budget_bytes`` that is not a number, a ``loss_fn``
      that is not callable or returns no scalar, non-array leaves of
      ``params`` or ``batch``.
    ValueError: for a budget that is not positive, a batch without a shared
      leading axis of rows (or, on a mesh, that no N leaves whole rows on
      every device), a ``loss_fn`` that fails on a micro-batch (its shapes
      named), or when nothing fits: the message gives the smallest step
      compiled and what dominates it (params, optimizer state, one
      micro-batch's activations).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> loss_fn = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]) ** 2)
    >>> params = {"w1": jax.ShapeDtypeStruct((32, 2048), jnp.float32),
    ...           "w2": jax.ShapeDtypeStruct((2048, 1), jnp.float32)}
    >>> batch = {"x": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
    >>> chosen = optax_adama.memory.plan(loss_fn, params, batch, budget_bytes=1.5e6)
    >>> # The whole batch at once needs 1.88 MB: two micro-batches fit.
    >>> chosen.settings  # doctest: +NORMALIZE_WHITESPACE
    PlanSettings(num_micro_batches=2, moments='float32', offload_moments=False, release=False,
                 shard_states=None)
    >>> tx = chosen.optimizer(1e-3)   # adamaw with N = 2
    >>> step = chosen.step(tx)        # microbatch_step(loss_fn, tx, num_micro_batches=2)
    >>> chosen.device_bytes <= 1.5e6, chosen.measurement.device_bytes == chosen.device_bytes
    (True, True)
    >>> all(c.fits == (c.measurement.device_bytes <= 1.5e6) for c in chosen.considered)
    True
  """
  budget_bytes = _check_budget(budget_bytes)
  machine = DEFAULT_MACHINE if machine is None else machine
  moment_storages = MOMENT_STORAGES if moment_storages is None else moment_storages
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable as loss_fn(params, micro_batch), got "
                    f"{type(loss_fn).__name__}.")
  params, batch = _abstract(params, "params"), _abstract(batch, "batch")
  devices = 1 if mesh is None else _sharding.num_devices(mesh, data_axis)
  splits = _splits(batch, devices)
  stages = _check_stages(shard_stages, mesh)
  unknown = [m for m in moment_storages if m not in MOMENT_STORAGES]
  if unknown or not moment_storages:
    raise ValueError(f"moment_storages must name some of {MOMENT_STORAGES}, most precise first; "
                     f"got {tuple(moment_storages)!r}.")
  staged = isinstance(loss_fn, StagedLoss)
  if isinstance(loss_fn, StagedLoss):
    loss_fn.check_stack(params)
  if offload is None:
    offload = _counts_host_memory_apart()
  context = _Context(loss_fn, params, batch, has_aux, mesh, data_axis, devices)
  measure = functools.lru_cache(maxsize=None)(context.measure)
  found = search(
      budget_bytes=budget_bytes, splits=splits, stages=stages,
      activations=(PLAIN, RELEASE) if staged else (PLAIN,),
      moment_storages=tuple(moment_storages),
      levers=functools.partial(_levers, offload=offload),
      candidate_of=lambda n, activation, lever, stage: PlanSettings(
          n, lever[0], lever[1], activation == RELEASE, stage),
      measure=measure, machine=machine,
      replicated=None if mesh is None else context.replicated,
      measurable=lambda c, m: not c.offload_moments or m.host_bytes > 0,
      describe=lambda c: c.describe(on_mesh=mesh is not None),
      lower_bound=context.narrower_bound, progress=progress)
  if not found.fitting:
    raise ValueError(context.nothing_fits(found, budget_bytes, splits=splits,
                                          offload=offload))
  precision = {m: i for i, m in enumerate(MOMENT_STORAGES)}
  best = min(found.fitting, key=lambda r: (
      r.predicted_s, precision[r.candidate.moments], r.candidate.offload_moments))
  verified = context.measure(best.candidate)  # uncached: compiled once more
  if verified.device_bytes > budget_bytes:
    raise RuntimeError(f"the chosen {best.candidate.describe()} measured "
                       f"{verified.device_bytes:,} B on recompiling, over the budget.")
  return Plan(best.candidate, verified.device_bytes, best.predicted_s, int(budget_bytes),
              verified, found.considered, found.skipped, found.bounded, loss_fn, has_aux, mesh,
              data_axis)


def _levers(storages: Sequence[str], *, offload: bool) -> list[tuple[str, bool]]:
  """(moments, offloaded) in the order pulled: exact first (float32 moments,
  then float32 moments in host memory), then narrower moments, then those in
  host memory."""
  first, narrower = storages[0], list(storages[1:])
  if not offload:
    return [(first, False)] + [(moments, False) for moments in narrower]
  return ([(first, False), (first, True)] + [(moments, False) for moments in narrower]
          + [(moments, True) for moments in narrower[-1:]])


def _check_budget(budget_bytes: Any) -> float:
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real):
    raise TypeError(f"budget_bytes must be a number of bytes, got "
                    f"{type(budget_bytes).__name__} {budget_bytes!r}.")
  if not (math.isfinite(float(budget_bytes)) and float(budget_bytes) > 0):
    raise ValueError(f"budget_bytes must be a positive, finite number of bytes per device, got "
                     f"{budget_bytes!r} (e.g. 16e9 for a 16 GB device).")
  return float(budget_bytes)


def _abstract(tree: Any, name: str) -> Any:
  """``tree`` as ``jax.ShapeDtypeStruct``s (no buffer is kept or made)."""
  def to_struct(leaf: Any) -> jax.ShapeDtypeStruct:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise TypeError(f"{name} must hold arrays or jax.ShapeDtypeStruct, got a leaf of type "
                      f"{type(leaf).__name__}: {leaf!r:.60}.")
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
  return jax.tree.map(to_struct, tree)


def _splits(batch: Any, devices: int) -> list[int]:
  """The N to try: divisors of the rows that leave every device whole rows."""
  shapes = [leaf.shape for leaf in jax.tree.leaves(batch)]
  if not shapes or any(not shape for shape in shapes):
    raise ValueError("batch needs a leading axis of rows on every leaf (the mini-batch that "
                     f"N micro-batches split), got shapes {shapes}.")
  rows = {shape[0] for shape in shapes}
  if len(rows) != 1 or 0 in rows:
    raise ValueError(f"batch leaves must share one leading number of rows (> 0), got "
                     f"{sorted(rows)} in shapes {shapes}.")
  (num_rows,) = rows
  splits = [n for n in divisors(num_rows) if (num_rows // n) % devices == 0]
  if not splits:
    raise ValueError(f"batch has {num_rows} rows: no N gives each of {devices} devices whole "
                     f"rows of a micro-batch; pass a multiple of {devices} rows.")
  return splits


def _check_stages(shard_stages, mesh) -> tuple[Optional[str], ...]:
  if shard_stages is None:
    return SHARD_STAGES if mesh is not None else (None,)
  for stage in shard_stages:
    if stage not in SHARD_STAGES or (stage is not None and mesh is None):
      raise ValueError(f"shard_stages: {stage!r} is not a stage {'of' if mesh else 'without'} "
                       f"a mesh; use {SHARD_STAGES if mesh is not None else (None,)} (a ZeRO "
                       "stage needs mesh=).")
  return tuple(shard_stages)


@functools.cache
def _counts_host_memory_apart() -> bool:
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


def _placed(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _device_share(tree: Any) -> int:
  """Bytes one device holds of ``tree``'s placed leaves (host memory left out)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if getattr(sharding, "memory_kind", None) == _offload.HOST_MEMORY_KIND:
      continue
    shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def _micro_batch(batch: Any, num_micro_batches: int) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (x.shape[0] // num_micro_batches, *x.shape[1:]), x.dtype), batch)


class _Context:
  """What every candidate of one :func:`plan` call shares, and its caches."""

  def __init__(self, loss_fn: Callable[..., Any], params: Any, batch: Any, has_aux: bool,
               mesh: Optional[jax.sharding.Mesh], data_axis: Any, devices: int):
    self.loss_fn, self.params, self.batch, self.has_aux = loss_fn, params, batch, has_aux
    self.mesh, self.data_axis, self.devices = mesh, data_axis, devices
    self._micro_batches: dict[int, Any] = {}
    self._block_costs: dict[tuple[int, bool], tuple[float, float]] = {}

  def arguments(self, settings: PlanSettings) -> tuple[optax.GradientTransformation, Any, Any]:
    """(tx, params, state) of a candidate, abstract, placed as its step keeps them."""
    tx = settings.optimizer(_MEASURED_LEARNING_RATE)
    state = jax.eval_shape(tx.init, self.params)
    if settings.offload_moments:
      state = _offload.offloaded_state_shapes(state, min_size=OFFLOAD_MIN_SIZE)
    if self.mesh is None:
      return tx, self.params, state
    shardings = _shardings(settings, self.loss_fn, self.params, state, self.mesh,
                           self.data_axis)
    return tx, _placed(self.params, shardings.params), _placed(state, shardings.opt_state)

  def measure(self, settings: PlanSettings) -> Measurement:
    """Compiles a candidate's step for abstract inputs and measures it."""
    n = settings.num_micro_batches
    micro_batch = self.check_loss(n)
    tx, params, state = self.arguments(settings)
    step = _step(settings, self.loss_fn, tx, self.has_aux, self.mesh, self.data_axis)
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
          device_bytes=temporaries + _device_share(params) + _device_share(state),
          host_bytes=0, param_bytes=_memory.tree_bytes(self.params),
          state_bytes=_memory.tree_bytes(state), flops=float("inf"), bytes_accessed=0.0,
          compile_s=time.perf_counter() - start)
    flops, bytes_accessed = compiled_cost(compiled)
    if isinstance(self.loss_fn, StagedLoss):  # complete the layer scan XLA counts once
      layers = self.loss_fn.check_stack(self.params)
      per_device = _micro_batch(micro_batch, self.devices)
      key = (n, settings.release)
      if key not in self._block_costs:
        self._block_costs[key] = block_cost(self.loss_fn, self.params, per_device,
                                            remat=settings.release)
      layer_flops, layer_bytes = self._block_costs[key]
      flops += (layers - 1) * layer_flops
      bytes_accessed += (layers - 1) * layer_bytes
    compile_s = time.perf_counter() - start
    return measure_compiled(
        compiled, params=self.params, opt_state=state, flops=n * flops,
        bytes_accessed=n * bytes_accessed, compile_s=compile_s, devices=self.devices,
        state_shards=self.devices if settings.shard_states is not None else 1)

  def check_loss(self, num_micro_batches: int) -> Any:
    """One micro-batch's shapes, after tracing ``loss_fn`` on them once."""
    if num_micro_batches not in self._micro_batches:
      self._micro_batches[num_micro_batches] = self._traced_micro_batch(num_micro_batches)
    return self._micro_batches[num_micro_batches]

  def _traced_micro_batch(self, num_micro_batches: int) -> Any:
    micro_batch = _micro_batch(self.batch, num_micro_batches)
    shapes = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), micro_batch)
    try:
      out = jax.eval_shape(self.loss_fn, self.params, micro_batch)
    except Exception as error:  # the user's code: any error is theirs to read
      raise ValueError(
          f"loss_fn failed on one micro-batch of shapes {shapes} (the batch's rows split into "
          f"N={num_micro_batches}): {type(error).__name__}: {error}") from error
    loss = out[0] if self.has_aux and isinstance(out, tuple) and len(out) == 2 else out
    if (self.has_aux and loss is out) or getattr(loss, "shape", None) != ():
      raise TypeError(
          f"loss_fn must return {'(loss, aux)' if self.has_aux else 'a scalar loss'} (has_aux="
          f"{self.has_aux}); on a micro-batch of shapes {shapes} it returned "
          f"{jax.tree.map(lambda x: x.shape, out)}.")
    return micro_batch

  def narrower_bound(self, settings: PlanSettings,
                     considered: dict[Any, Considered]) -> Optional[int]:
    """Bytes narrower moments take at least: the same step with float32 moments,
    compiled, less the device bytes the narrower moments no longer hold (the
    program is the same but for the optimizer's arithmetic). None: no such step
    compiled yet."""
    wide = dataclasses.replace(settings, moments=MOMENT_STORAGES[0])
    if settings == wide or wide not in considered:
      return None
    saved = (_device_share(self.arguments(wide)[2])
             - _device_share(self.arguments(settings)[2]))
    return considered[wide].measurement.device_bytes - saved

  def replicated(self, shard_states: Optional[str], moments: str) -> int:
    """Bytes a stage keeps whole on every device, whatever N: params and state
    with no stage, the params under zero1 and zero2, nothing under fsdp."""
    if shard_states == "fsdp":
      return 0
    param_bytes = _memory.tree_bytes(self.params)
    if shard_states is not None:
      return param_bytes
    state = jax.eval_shape(PlanSettings(1, moments).optimizer(_MEASURED_LEARNING_RATE).init,
                           self.params)
    return param_bytes + _memory.tree_bytes(state)

  def nothing_fits(self, found: Search, budget_bytes: float, *, splits: list[int],
                   offload: bool) -> str:
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
    param_share = _device_share(params)
    parts = _plan_advice.Breakdown(
        total=smallest.measurement.device_bytes, params=param_share,
        state=_device_share(state), batch=_memory.tree_bytes(self.batch) // self.devices,
        largest_param=max(_device_share(leaf) for leaf in jax.tree.leaves(params)))
    levers = _plan_advice.levers_left(
        settings, parts, splits=splits, staged=isinstance(self.loss_fn, StagedLoss),
        state_bytes_with=lambda moments: _device_share(
            self.arguments(dataclasses.replace(settings, moments=moments))[2]),
        devices=self.devices, stage=settings.shard_states, offload_counts=offload)
    return _plan_advice.nothing_fits_message(
        budget, settings.describe(on_mesh=self.mesh is not None), parts, levers)
