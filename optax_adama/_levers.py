"""`ModelLevers`: the levers inside a model that :func:`optax_adama.memory.plan` searches too.

The library switches N, the moments, the release and the ZeRO stage without
touching the model. What only the model's author can switch (a remat policy, a
saver that keeps less for the backward, the loss in chunks) comes in through
a :class:`ModelLevers`, passed to ``plan`` in place of ``loss_fn``: the levers
name the variants of the model, and ``plan`` compiles each variant's loss as
it compiles its own candidates. ``models.planner`` gives the zoo's levers this
way; a ``loss_fn`` alone is the model as given (:class:`GivenLoss`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any
from typing import Optional

import jax
import optax

from optax_adama import _measure
from optax_adama import _sharding
from optax_adama._search import MEASURED_LEARNING_RATE
from optax_adama._search import Considered
from optax_adama._search import Measurement
from optax_adama._search import PlanSettings
from optax_adama._search import Skipped
from optax_adama._staged import StagedLoss

__all__ = ["ModelLevers"]


class ModelLevers(abc.ABC):
  """Levers inside a model that only its author can pull, for :func:`plan` to search.

  :func:`plan` searches what the library switches without touching the model
  (N, the moments, the release, the ZeRO stage). A model may save memory in
  ways only its code knows: a remat policy, a saver that keeps less for the
  backward, its loss in chunks. Subclass ``ModelLevers``, pass an instance to
  :func:`plan` in place of ``loss_fn``, and each variant of the model it names
  is searched with the library's levers: a variant is any hashable value (a
  policy's name, a frozen dataclass), ``PlanSettings.model`` of each
  candidate, named in tables by its ``str``.

  :meth:`activations` and :meth:`loss` are required. The other methods have
  the defaults of a plain ``loss_fn``: :meth:`optimizer` is the plan's
  ``adamaw``, :meth:`uncounted_cost` completes a :class:`StagedLoss`'s layer
  scan, and nothing moves to host memory.

  Examples:
    A scanned MLP whose layers may be recomputed in the backward: under 3 MB,
    keeping every layer's activations needs four micro-batches, remat one.

    >>> import jax, jax.numpy as jnp, optax_adama
    >>> def mlp(params, batch, layer=lambda x, w: jnp.tanh(x @ w)):
    ...   x, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), batch["x"], params["stack"])
    ...   return jnp.mean(x ** 2)
    >>> class Remat(optax_adama.memory.ModelLevers):
    ...   def activations(self):  # (variant, release) pairs, each searched over every N
    ...     return [("remat=none", False), ("remat=full", False)]
    ...   def loss(self, settings):  # (loss_fn, has_aux) of the variant settings.model
    ...     if settings.model == "remat=none":
    ...       return mlp, False
    ...     rematted = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))
    ...     return (lambda params, batch: mlp(params, batch, rematted)), False
    >>> params = {"stack": jax.ShapeDtypeStruct((8, 128, 128), jnp.float32)}
    >>> batch = {"x": jax.ShapeDtypeStruct((128, 128), jnp.float32)}
    >>> chosen = optax_adama.memory.plan(Remat(), params, batch, budget_bytes=3e6)
    >>> chosen.settings.model, chosen.settings.num_micro_batches, chosen.settings.moments
    ('remat=full', 1, 'float32')
    >>> min(c.candidate.num_micro_batches for c in chosen.considered if c.fits
    ...     and c.candidate.model == "remat=none" and c.candidate.moments == "float32")
    4
  """

  #: Whether :func:`plan` skips compiling narrower moments where the float32
  #: step at that N, less the bytes they would save, is already over the
  #: budget (a lower bound: the programs differ only in the optimizer's
  #: arithmetic). False compiles them, so that the table lists them measured.
  bound_narrower_moments: bool = True

  @abc.abstractmethod
  def activations(self) -> Sequence[tuple[Hashable, bool]]:
    """(variant, release) pairs, each searched over every N, in this order.

    The model's variants that change what its forward keeps for the backward
    (remat policies, savers), each with whether its step is the gradient
    release (:func:`release_step`: :meth:`loss` then gives a
    :class:`StagedLoss`).
    """

  def exact(self, variant: Hashable) -> Sequence[Hashable]:
    """``variant``'s exact memory levers: variants of it with the same math in less
    memory (the loss in chunks), ``variant`` itself first.

    :func:`plan` pulls them in order with float32 moments, each only where it
    lets a smaller N fit, before narrower moments (with the last of them).
    """
    return (variant,)

  @abc.abstractmethod
  def loss(self, settings: PlanSettings) -> tuple[Callable[..., Any], bool]:
    """``(loss_fn, has_aux)`` of the variant ``settings.model``: the micro-batch mean
    loss as :func:`microbatch_step` takes it, a :class:`StagedLoss` where
    ``settings.release``. Called once per variant and release."""

  def optimizer(self, settings: PlanSettings) -> optax.GradientTransformation:
    """The optimizer ``settings``' step is compiled with; it must hold
    ``settings``' N and moments. Default: ``settings.optimizer`` (:func:`adamaw`);
    override it to measure the optimizer you train with."""
    return settings.optimizer(MEASURED_LEARNING_RATE)

  def uncounted_cost(self, settings: PlanSettings, params: Any,
                     micro_batch: Any) -> tuple[float, float]:
    """``(flops, bytes accessed)`` of one micro-batch that XLA's cost analysis of
    the step misses: it counts a loop's body once, so the loops inside the loss
    are completed here per uncounted trip. ``micro_batch`` is one device's
    share, abstract. Default: a :class:`StagedLoss`'s layers after the first,
    one block compiled alone (under the release, recomputed); else none."""
    loss_fn, _ = self.loss(settings)
    if not isinstance(loss_fn, StagedLoss):
      return 0.0, 0.0
    layers = loss_fn.check_stack(params)
    layer_flops, layer_bytes = self.block_cost(loss_fn, params, micro_batch,
                                               remat=settings.release)
    return (layers - 1) * layer_flops, (layers - 1) * layer_bytes

  @staticmethod
  def block_cost(staged: StagedLoss, params: Any, micro_batch: Any, *,
                 policy: Optional[Callable[..., bool]] = None,
                 remat: bool = False) -> tuple[float, float]:
    """``(flops, bytes accessed)`` of one layer of ``staged`` (its block's forward and
    backward), compiled alone as :func:`plan` compiles a step, under
    ``jax.checkpoint`` with ``policy`` (or with ``remat``): for :meth:`uncounted_cost`,
    what each layer of a scanned stack after the first adds."""
    return _measure.block_cost(staged, params, micro_batch, policy=policy, remat=remat)

  @staticmethod
  def compiled_cost(fn: Callable[..., Any], *args: Any) -> tuple[float, float]:
    """``(flops, bytes accessed)`` of ``jax.jit(fn)`` for ``args`` (arrays or
    ``jax.ShapeDtypeStruct``), compiled as :func:`plan` compiles a step: for
    :meth:`uncounted_cost`, one trip of a loop of the loss's own."""
    return _measure.compiled_cost(_measure.compile_for_measurement(jax.jit(fn).lower(*args)))

  def offloads(self, variant: Hashable) -> bool:
    """Whether ``variant`` moves activations to host memory: where the backend
    counts none apart (the CPU's), its step is measured but not chosen."""
    del variant
    return False

  def nothing_fits_message(self, considered: Sequence[Considered],
                           skipped: Sequence[Skipped], budget_bytes: float) -> Optional[str]:
    """The error :func:`plan` raises when nothing fits, in the model's terms;
    None (the default): the library's, which prices the levers left."""
    del considered, skipped, budget_bytes
    return None

  def measure(self, settings: PlanSettings, params: Any, batch: Any, *,
              mesh: Optional[jax.sharding.Mesh] = None,
              data_axis: _sharding.AxisName = "data") -> Measurement:
    """One candidate compiled and measured as :func:`plan` measures each, with
    no search: ``settings``' step for ``params`` and ``batch`` (arrays or
    ``jax.ShapeDtypeStruct``), on one device or data parallel on ``mesh``."""
    params, batch = _measure.abstract(params, "params"), _measure.abstract(batch, "batch")
    devices = 1 if mesh is None else _sharding.num_devices(mesh, data_axis)
    return _measure.Candidates(self, params, batch, mesh, data_axis, devices).measure(settings)


class GivenLoss(ModelLevers):
  """A ``loss_fn`` as given: no levers of its own; a :class:`StagedLoss` adds the release."""

  def __init__(self, loss_fn: Callable[..., Any], has_aux: bool):
    self.loss_fn, self.has_aux = loss_fn, has_aux

  def activations(self) -> Sequence[tuple[Hashable, bool]]:
    release = [(None, True)] if isinstance(self.loss_fn, StagedLoss) else []
    return [(None, False), *release]

  def loss(self, settings: PlanSettings) -> tuple[Callable[..., Any], bool]:
    del settings
    return self.loss_fn, self.has_aux
