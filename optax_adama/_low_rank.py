"""Low-rank (GaLore) moments for AdamA: optax's GaLore, refreshed per mini-batch.

GaLore keeps, for a 2-D leaf G (m x n, m >= n), a projector P (m x r) and the
optimizer's moments in r x n; the update is ``P @ inner(P^T g)``. AdamA only
ever sees ``P^T g_i``, one micro-batch gradient at a time, so the two compose
leaf by leaf: this module wraps :func:`optax.contrib.scale_by_galore` around
any AdamA transformation and adds the four things AdamA needs from it:

* the refresh period counts mini-batches: optax's counts ``update`` calls,
  one per micro-batch here, so it is given ``refresh_period * N`` calls, and a
  refresh then always falls on the first micro-batch of a mini-batch (the
  projector is the SVD of that micro-batch gradient of the leaf alone; no
  mini-batch gradient exists to take it from);
* a refresh from a non-finite micro-batch gradient keeps the old projector
  (optax's would store NaNs, and every later update would be NaN; AdamA drops
  such a micro-batch and must not be poisoned by it);
* the projector can be stored narrower than the gradient (``bfloat16``): in
  float32 an m x r projector costs more than the r x n moments it serves once
  those are 8-bit;
* a ``half_difference=d`` given to ``update`` (the fused step's, for the
  ``"split"`` estimator) is projected with the gradient's projector and handed
  on: projection is linear, so ``P^T d`` is the half difference of the
  projected halves, and "split" is exact in the projected space (optax's
  GaLore takes no extra arguments, so "split" could not run there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import Optional
from typing import Union

import jax
import jax.numpy as jnp
import optax
from optax.contrib import GaLoreDimensionNumbers
from optax.contrib import GaLoreState

from optax_adama._adama import find_adama_state
from optax_adama._checks import complex_leaf_names

__all__ = ["low_rank", "low_rank_mask"]


def low_rank_mask(params: optax.Params, rank: int, min_size: int = 4096) -> Any:
  """Which leaves :func:`low_rank` projects by default: a tree of bools.

  A leaf is projected when it is 2-D, both its dimensions exceed ``rank``
  (a projection that keeps a whole side saves nothing) and it has at least
  ``min_size`` elements. 1-D leaves (biases, norm scales) and small matrices
  keep full moments.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``).
    rank: the projection's rank.
    min_size: the fewest elements a projected leaf has.

  Returns:
    A tree like ``params`` of Python bools.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> params = {"w": jnp.zeros((128, 64)), "b": jnp.zeros(64), "small": jnp.zeros((8, 8))}
    >>> optax_adama.moments.low_rank_mask(params, rank=4)
    {'b': False, 'small': False, 'w': True}
  """
  return jax.tree.map(
      lambda p: (len(jnp.shape(p)) == 2 and min(jnp.shape(p)) > rank
                 and math.prod(jnp.shape(p)) >= min_size), params)


def low_rank(
    inner: optax.GradientTransformation,
    *,
    rank: int,
    refresh_period: int,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    min_size: int = 4096,
    projector_dtype: Optional[jax.typing.DTypeLike] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Runs ``inner`` (e.g. :func:`adama`) on low-rank projected gradients (GaLore).

  For each projected leaf (m x n; the smaller side is projected when
  ``n > m``) a projector :math:`P` (m x r) is the top-``r`` left singular
  vectors of the leaf's gradient at the first micro-batch of every
  ``refresh_period``-th mini-batch; between refreshes it is fixed. Every
  micro-batch gradient is projected before ``inner`` folds it, so AdamA's
  moments are r x n:

  .. math::

    g_i' = P^\top g_i, \qquad
    u = P \, \mathrm{AdamA}(g_1', \dots, g_N')

  As in GaLore, the moments are kept (not rotated) when :math:`P` is
  refreshed. Leaves not projected (see :func:`low_rank_mask`) pass through to
  ``inner`` whole. With a signed permutation as :math:`P` (e.g. full rank and
  a diagonal refresh gradient) this is ``inner`` exactly, since Adam is
  elementwise and even in the sign of the gradient.

  ``update`` takes the ``"split"`` estimator's ``half_difference=d`` (which
  :func:`microbatch_step` passes) and hands ``inner`` :math:`P^\top d`,
  projected with the projector of :math:`g_i`, never refreshed from ``d``;
  unprojected leaves get ``d`` whole. Without it ``inner`` gets none
  (``nu_estimator="auto"`` then folds ``"mean"``, the default, which needs
  none).

  ``inner`` sees no params (they have the full shape, the moments the
  projected one): use :func:`adama` or :func:`scale_by_adama`, not
  :func:`adamaw`. It works inside :func:`microbatch_step` (the state holds the
  AdamA state, which the step finds), with 8-bit moments
  (``quantization=BlockQuantization()``, applied to the r x n moments) and
  under :func:`offload_moments`.

  Args:
    inner: the transformation run in the projected space; AdamA (its state
      gives ``N``), or any gradient-only transformation (then ``N = 1`` and
      this is :func:`optax.contrib.scale_by_galore`).
    rank: ``r``, the projection rank (at most the leaf's smaller side).
    refresh_period: ``T``, mini-batches between projector refreshes.
    mask: a tree of bools like params, or a callable returning one: which
      leaves to project. ``None``: :func:`low_rank_mask` with ``rank`` and
      ``min_size``.
    min_size: with ``mask=None``, the fewest elements a projected leaf has.
    projector_dtype: the projector's storage dtype; ``None`` keeps the
      gradient's. ``jnp.bfloat16`` halves it; it is computed (SVD) and
      applied in the gradient's dtype.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` with state
    :class:`optax.contrib.GaLoreState` (``base_optimizer_state`` is
    ``inner``'s, on the projected shapes).

  Raises:
    ValueError: if ``rank`` or ``refresh_period`` is not positive.
    TypeError: (at ``init``) if a leaf it would project is complex.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.low_rank(
    ...     optax_adama.adama(1e-3, num_micro_batches=2), rank=4,
    ...     refresh_period=100, min_size=0)
    >>> state = tx.init({"w": jnp.ones((32, 16)), "b": jnp.ones(16)})
    >>> adama_state = optax_adama.find_adama_state(state)
    >>> print(adama_state.mu["w"].shape, adama_state.mu["b"].shape)
    (4, 16) (16,)

  References:
    Zhao et al., `GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
    Projection <https://arxiv.org/abs/2403.03507>`_, 2024;
    Zhang et al., `Adam Accumulation ... <https://arxiv.org/abs/2305.19982>`_,
    2023.
  """
  for name, value in (("rank", rank), ("refresh_period", refresh_period)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")

  # A tree like params of GaLoreDimensionNumbers, None where a leaf is not projected.
  def dimension_numbers(params: optax.Params) -> Any:
    projected = mask(params) if callable(mask) else mask
    if projected is None:
      projected = low_rank_mask(params, rank, min_size)
    # Each side of the matrix is one axis: GaLoreDimensionNumbers' default.
    return jax.tree.map(
        lambda p, on: GaLoreDimensionNumbers() if on and jnp.ndim(p) == 2 else None,
        params, projected)

  # dims: optax's weight_dimension_numbers, a tree as above or a function of params.
  def galore(update_proj_gap: int, base: optax.GradientTransformation = inner,
             dims: Union[Any, Callable[[optax.Params], Any]] = dimension_numbers,
             ) -> optax.GradientTransformation:
    return optax.contrib.scale_by_galore(
        rank=rank, update_proj_gap=update_proj_gap, base_optimizer=base,
        weight_dimension_numbers=dims)

  def store(projector: jax.Array) -> jax.Array:
    return projector if projector_dtype is None else projector.astype(projector_dtype)

  def keep_finite(new: Any, old: Any) -> Any:  # trees of projectors
    # A projector must be finite; only a refresh from a non-finite gradient
    # makes one that is not. The check reads the small m x r projector, not
    # the gradient, so it holds no gradient alive.
    return jax.tree.map(
        lambda n, o: jnp.where(jnp.all(jnp.isfinite(n)), n, o), new, old)

  def init_fn(params: optax.Params) -> GaLoreState:
    _refuse_complex_projections(params, dimension_numbers(params))
    state = galore(1).init(params)  # the period does not enter init.
    return state._replace(projector=jax.tree.map(store, state.projector))

  def update_fn(
      updates: optax.Updates, state: GaLoreState, params: Optional[optax.Params] = None, *,
      half_difference: Optional[optax.Updates] = None, **extra_args: Any,
  ) -> tuple[optax.Updates, GaLoreState]:
    del params  # the moments have the projected shapes; see the docstring.
    # optax's GaLore calls its base without extra arguments: bind them to it.
    base = _with_extra_args(inner, extra_args)
    adama_state = find_adama_state(state.base_optimizer_state)
    num_micro_batches = 1 if adama_state is None else adama_state.num_micro_batches
    period = refresh_period * num_micro_batches
    # optax computes the SVD in float32 and casts it to the gradient's dtype;
    # its cond needs the kept projector in that dtype too (exact from bf16).
    wide = jax.tree.map(lambda p, g: p.astype(g.dtype), state.projector, updates)
    if half_difference is None:
      new_updates, new_state = galore(period, base).update(
          updates, state._replace(projector=wide))
      kept = keep_finite(new_state.projector, wide)
      return new_updates, new_state._replace(projector=jax.tree.map(store, kept))
    # The refresh alone: optax's update with a pass-through base. Only its
    # projector and count are read; the projections it makes are dead code.
    refreshed = galore(period, _pass_through()).update(
        updates, state._replace(projector=wide))[1]
    kept = keep_finite(refreshed.projector, wide)
    # g and d as one pair through optax's projection (linear, so P^T d is the
    # half difference of the projected halves) with that projector, refreshed
    # from g alone: count 1 of period 2 never refreshes. Unprojected leaves
    # pass both through whole.
    dims = dimension_numbers(updates)
    pair_projector = (kept, jax.tree.map(
        lambda p, d: p.astype(d.dtype), kept, half_difference))
    (new_updates, _), new_state = galore(2, _with_half_difference(base), (dims, dims)).update(
        (updates, half_difference),
        GaLoreState(count=jnp.ones([], jnp.int32),
                    base_optimizer_state=state.base_optimizer_state,
                    projector=pair_projector))
    return new_updates, GaLoreState(
        count=refreshed.count, base_optimizer_state=new_state.base_optimizer_state,
        projector=jax.tree.map(store, kept))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _refuse_complex_projections(params: optax.Params, dimension_numbers: Any) -> None:
  """Raises a ``TypeError`` naming each complex leaf ``low_rank`` would project.

  optax's GaLore projects with real SVD factors (its cast drops the imaginary
  part of a complex gradient).
  """
  projected = jax.tree.structure(params).flatten_up_to(dimension_numbers)
  complex_leaves = complex_leaf_names(params, [dims is not None for dims in projected])
  if complex_leaves:
    raise TypeError(
        f"low_rank projects real matrices; these are complex: {', '.join(complex_leaves)}. "
        "Leave them out with mask=.")


def _pass_through() -> optax.GradientTransformation:
  """Returns its updates and whatever state it is handed, untouched."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(), lambda updates, state, params=None: (updates, state))


def _with_extra_args(inner: optax.GradientTransformation,
                     extra_args: dict[str, Any]) -> optax.GradientTransformation:
  """``inner`` with ``extra_args`` (e.g. ``value=``) given to every ``update``."""
  update = optax.with_extra_args_support(inner).update

  def update_fn(updates: optax.Updates, state: optax.OptState,
                params: Optional[optax.Params] = None,
                **more: Any) -> tuple[optax.Updates, optax.OptState]:
    return update(updates, state, params, **extra_args, **more)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _with_half_difference(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` on ``(g, d)`` pairs: updates ``inner(g, half_difference=d)``.

  d comes back as it came (its back-projection is dead code): optax's GaLore
  maps its base over one tree, and returns updates of that tree's structure.
  """
  update = optax.with_extra_args_support(inner).update

  def update_fn(pair: tuple[optax.Updates, optax.Updates], state: optax.OptState,
                params: Optional[optax.Params] = None,
                ) -> tuple[tuple[optax.Updates, optax.Updates], optax.OptState]:
    grads, half_difference = pair
    updates, state = update(grads, state, params, half_difference=half_difference)
    return (updates, half_difference), state

  return optax.GradientTransformation(inner.init, update_fn)
