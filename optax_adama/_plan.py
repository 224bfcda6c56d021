"""Will a model fit? The AdamA step that fits a memory budget, found by compiling it.

:func:`plan` takes a user's ``loss_fn(params, micro_batch)`` (or a
:class:`StagedLoss`, or a :class:`ModelLevers` with levers of the model's own),
its params and one mini-batch, as arrays or ``jax.ShapeDtypeStruct``, and
searches what the library switches without touching the model: the number of
micro-batches N (divisors of the batch's rows), the moments' storage (float32,
bfloat16, 8-bit blocks), moments kept in host memory
(:func:`offload_moments`), the gradient release (:func:`release_step`, for a
:class:`StagedLoss`) and, on a mesh, the ZeRO stage. Every candidate is
compiled for abstract inputs (nothing is allocated or run) and measured as
:func:`memory_report` measures: argument + output + temp - alias bytes of one
device.

The search and its time predictor are :mod:`optax_adama._search`; a candidate
is compiled and measured by :mod:`optax_adama._measure`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Optional
from typing import Union

import jax
import optax

from optax_adama import _measure
from optax_adama import _sharding
from optax_adama._levers import GivenLoss
from optax_adama._levers import ModelLevers
from optax_adama._search import DEFAULT_MACHINE
from optax_adama._search import MOMENT_STORAGES
from optax_adama._search import SHARD_STAGES
from optax_adama._search import Considered
from optax_adama._search import Machine
from optax_adama._search import Measurement
from optax_adama._search import PlanSettings
from optax_adama._search import Skipped
from optax_adama._search import divisors
from optax_adama._search import search
from optax_adama._staged import StagedLoss

__all__ = ["Plan", "PlanSettings", "plan"]


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
    loss_fn: :func:`plan`'s ``loss_fn`` (or its :class:`ModelLevers`).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    mesh: the mesh planned on; None: one device.
    data_axis: the mesh axis (or axes) the batch is split over.
  """

  settings: PlanSettings
  device_bytes: int
  predicted_s: float
  budget_bytes: int
  measurement: Measurement
  considered: tuple[Considered, ...]
  skipped: tuple[Skipped, ...]
  bounded: tuple[tuple[PlanSettings, int], ...]
  loss_fn: Union[Callable[..., Any], ModelLevers] = dataclasses.field(repr=False, compare=False)
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
    loss_fn, has_aux = self._loss()
    return _measure.make_step(self.settings, loss_fn, tx, has_aux, self.mesh, self.data_axis)

  def shardings(self, params: Any, opt_state: Any) -> _sharding.StepShardings:
    """On a mesh: where the planned step keeps params and state (place them
    there first, ``jax.device_put(params, shardings.params)``).

    Raises:
      ValueError: for a plan of one device.
    """
    if self.mesh is None:
      raise ValueError("this plan runs on one device: nothing to place.")
    return _measure.step_shardings(self.settings, self._loss()[0], params, opt_state,
                                   self.mesh, self.data_axis)

  def table(self) -> str:
    """Markdown: every candidate compiled, best predicted first; the choice marked."""
    on_mesh = self.mesh is not None
    lines = ["| settings | device bytes | P | host bytes | predicted step | fits |",
             "|---|---|---|---|---|---|"]
    for row in sorted(self.considered, key=lambda r: (not r.fits, r.predicted_s)):
      m = row.measurement
      mark = " **(chosen)**" if row.candidate == self.settings else ""
      fits = "yes" if row.fits else "no"
      if not row.measurable:
        fits += " (not measurable here)"
      lines.append(f"| {row.candidate.describe(on_mesh=on_mesh)}{mark} | {m.device_bytes:,} | "
                   f"{m.device_bytes / m.param_bytes:.2f} | {m.host_bytes:,} | "
                   f"{row.predicted_s * 1e3:.4g} ms | {fits} |")
    lines += [f"| {settings.describe(on_mesh=on_mesh)} | at least {bound:,} | - | - | - | no: "
              "not compiled |" for settings, bound in self.bounded]
    lines += [f"| {s.describe()} | {s.replicated_bytes:,} whole | - | - | - | no: skipped |"
              for s in self.skipped]
    return "\n".join(lines)

  def __str__(self) -> str:
    m, on_mesh = self.measurement, self.mesh is not None
    where = " a device" if on_mesh else ""
    return (f"{self.settings.describe(on_mesh=on_mesh)}: {m.device_bytes / 1e9:.4g} GB{where} "
            f"({m.device_bytes / m.param_bytes:.2f} P) of {self.budget_bytes / 1e9:.4g} GB, "
            f"predicted {self.predicted_s * 1e3:.4g} ms a step; {len(self.considered)} "
            "candidates compiled")

  def _loss(self) -> tuple[Callable[..., Any], bool]:
    if isinstance(self.loss_fn, ModelLevers):
      return self.loss_fn.loss(self.settings)
    return self.loss_fn, self.has_aux

def plan(
    loss_fn: Union[Callable[..., Any], ModelLevers],
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
  is allocated or run. A :class:`ModelLevers` in place of ``loss_fn`` adds the
  model's own levers (remat policies, savers, a loss in chunks) to the search.

  Args:
    loss_fn: ``loss_fn(params, micro_batch)``, the micro-batch *mean* loss, as
      :func:`microbatch_step` takes it; a :class:`StagedLoss` adds the release;
      a :class:`ModelLevers` gives the loss of each variant of the model.
    params: the params, arrays or ``jax.ShapeDtypeStruct``.
    batch: one mini-batch, arrays or ``jax.ShapeDtypeStruct`` with a shared
      leading axis of rows (over all devices of ``mesh``).
    budget_bytes: device memory each device may use, bytes.
    mesh: plan data parallel on this mesh (fake CPU devices compile too:
      ``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
    data_axis: the mesh axis (or axes) the batch is split over.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)`` (a
      :class:`ModelLevers` says so for each variant).
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
                 shard_states=None, model=None)
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
  if not (callable(loss_fn) or isinstance(loss_fn, ModelLevers)):
    raise TypeError(f"loss_fn must be callable as loss_fn(params, micro_batch), got "
                    f"{type(loss_fn).__name__}.")
  params = _measure.abstract(params, "params")
  batch = _measure.abstract(batch, "batch")
  devices = 1 if mesh is None else _sharding.num_devices(mesh, data_axis)
  splits = _splits(batch, devices)
  stages = _check_stages(shard_stages, mesh)
  unknown = [m for m in moment_storages if m not in MOMENT_STORAGES]
  if unknown or not moment_storages:
    raise ValueError(f"moment_storages must name some of {MOMENT_STORAGES}, most precise first; "
                     f"got {tuple(moment_storages)!r}.")
  if isinstance(loss_fn, StagedLoss):
    loss_fn.check_stack(params)
  levers = loss_fn if isinstance(loss_fn, ModelLevers) else GivenLoss(loss_fn, has_aux)
  if offload is None:
    offload = _measure.counts_host_memory_apart()
  activations = list(levers.activations())
  candidates = _measure.Candidates(levers, params, batch, mesh, data_axis, devices)
  found = search(
      budget_bytes=budget_bytes, splits=splits, stages=stages, activations=activations,
      exact=levers.exact, moment_storages=tuple(moment_storages), offload=offload,
      measure=functools.lru_cache(maxsize=None)(candidates.measure), machine=machine,
      replicated=None if mesh is None else candidates.replicated,
      measurable=lambda settings, measured: measured.host_bytes > 0 or not (
          settings.offload_moments or levers.offloads(settings.model)),
      on_mesh=mesh is not None,
      lower_bound=candidates.narrower_bound if levers.bound_narrower_moments else None,
      progress=progress)
  if found.best is None:
    message = levers.nothing_fits_message(found.considered, found.skipped, budget_bytes)
    raise ValueError(message or candidates.nothing_fits(
        found, budget_bytes, splits=splits, offload=offload,
        staged=any(release for _, release in activations)))
  best = found.best.candidate
  verified = candidates.measure(best)  # uncached: compiled once more
  if verified.device_bytes > budget_bytes:
    raise RuntimeError(f"the chosen {best.describe(on_mesh=mesh is not None)} measured "
                       f"{verified.device_bytes:,} B on recompiling, over the budget.")
  return Plan(best, verified.device_bytes, found.best.predicted_s, int(budget_bytes), verified,
              found.considered, found.skipped, found.bounded, loss_fn, has_aux, mesh, data_axis)


def _check_budget(budget_bytes: Any) -> float:
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real):
    raise TypeError(f"budget_bytes must be a number of bytes, got "
                    f"{type(budget_bytes).__name__} {budget_bytes!r}.")
  if not (math.isfinite(float(budget_bytes)) and float(budget_bytes) > 0):
    raise ValueError(f"budget_bytes must be a positive, finite number of bytes per device, got "
                     f"{budget_bytes!r} (e.g. 16e9 for a 16 GB device).")
  return float(budget_bytes)


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


def _check_stages(shard_stages: Optional[Sequence[Optional[str]]],
                  mesh: Optional[jax.sharding.Mesh]) -> tuple[Optional[str], ...]:
  if shard_stages is None:
    return SHARD_STAGES if mesh is not None else (None,)
  for stage in shard_stages:
    if stage not in SHARD_STAGES or (stage is not None and mesh is None):
      raise ValueError(f"shard_stages: {stage!r} is not a stage {'of' if mesh else 'without'} "
                       f"a mesh; use {SHARD_STAGES if mesh is not None else (None,)} (a ZeRO "
                       "stage needs mesh=).")
  return tuple(shard_stages)
