"""The floor of AdamA's "split" estimator: a factored EMA of squared gradients.

"split" estimates Adam's v from each micro-batch's two halves, a difference of
two noisy terms that can cancel where the gradient is noise. Its floor is an
EMA of the "sum" fold g_i**2 / N**2 kept as Adafactor keeps its second moment
(row and column sums), read back per entry; see ``FactoredSquares`` and
docs/estimators.md. Pure functions of arrays and shapes: the fold that feeds
them and the state that holds them are in ``_adama``; the release step adds a
layer's part at a time (``add_layer_floor``) and, on a mesh, each device's
part of a sum (``factored_axes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Optional

import jax
import jax.numpy as jnp


class FactoredSquares(NamedTuple):
  """One leaf's floor of "split"'s v: an EMA of ``g_i**2 / N**2``, factored.

  ``g_i**2 / N**2`` is the ``"sum"`` estimator's fold, whose expectation
  ``(mu**2 + sigma**2) / N`` never exceeds Adam's ``mu**2 + sigma**2 / N``
  and equals it where the gradient is noise, exactly where "split"'s own v
  (a difference of two noisy terms) can fall to nothing. Stored as
  Adafactor stores its second moment (Shazeer & Stern, arXiv:1804.04235):
  sums over the last axis and over the second-to-last, read back as their
  outer product over the total. Leaves whose last two dimensions are not
  both at least ``FACTORED_MIN_DIM`` are kept whole, as ``optax.adafactor``
  keeps them (its ``min_dim_size_to_factor``): biases, norms, a stack's
  per-layer vectors.
  """

  # float32 [*shape[:-1]]: sums over the last axis; below 2-D the squares
  # themselves, shaped like the leaf.
  rows: jax.Array
  # float32 [*shape[:-2], shape[-1]]: sums over the second-to-last axis; below
  # 2-D a scalar, their total.
  cols: jax.Array


# optax.adafactor's min_dim_size_to_factor.
FACTORED_MIN_DIM = 128


def _factored(leaf_shape: Sequence[int]) -> bool:
  return len(leaf_shape) >= 2 and min(leaf_shape[-2:]) >= FACTORED_MIN_DIM


def zero_floor(shape: Sequence[int]) -> FactoredSquares:
  """An all-zero :class:`FactoredSquares` for a leaf of ``shape``."""
  shape = tuple(shape)
  if not _factored(shape):
    return FactoredSquares(jnp.zeros(shape, jnp.float32), jnp.zeros([], jnp.float32))
  return FactoredSquares(jnp.zeros(shape[:-1], jnp.float32),
                         jnp.zeros(shape[:-2] + shape[-1:], jnp.float32))


def factor_squares(squares: jax.Array, leaf_shape: Sequence[int]) -> FactoredSquares:
  """The :class:`FactoredSquares` increment of ``squares``.

  ``squares`` is shaped like a leaf of ``leaf_shape``, or like one layer's
  slice of a stacked leaf (one dimension fewer): then the increment is that
  layer's part, whose ``rows`` (and, from 3-D leaves, ``cols``) go to the
  layer's index and whose ``cols`` of a 2-D leaf add to all of them.
  """
  if not _factored(leaf_shape):
    return FactoredSquares(squares, jnp.sum(squares))
  if squares.ndim >= 2:
    return FactoredSquares(jnp.sum(squares, -1), jnp.sum(squares, -2))
  return FactoredSquares(jnp.sum(squares), squares)  # one layer of a 2-D stack


def factored_axes(dim: int, slice_ndim: int,
                  leaf_shape: Sequence[int]) -> tuple[Optional[int], Optional[int]]:
  """Where axis ``dim`` of a squares slice lands in :func:`factor_squares`'
  ``(rows, cols)``; ``None`` where it is summed away. For a device's block of
  a leaf (``dim`` split over devices): the blocks of a kept axis are placed
  side by side, the sums over a summed one are added."""
  if not _factored(leaf_shape):
    return dim, None
  if slice_ndim >= 2:
    rows = None if dim == slice_ndim - 1 else dim
    cols = None if dim == slice_ndim - 2 else (dim if dim < slice_ndim - 2 else dim - 1)
    return rows, cols
  return None, dim  # one layer of a 2-D stack


def add_layer_floor(floor: FactoredSquares, increment: FactoredSquares,
                    layer: jax.Array) -> FactoredSquares:
  """``floor`` of a stacked leaf plus layer ``layer``'s :func:`factor_squares` increment."""
  add_at = lambda x, inc: jax.lax.dynamic_update_index_in_dim(
      x, jax.lax.dynamic_index_in_dim(x, layer, keepdims=False) + inc, layer, 0)
  # cols carry the layer axis from 3-D leaves on; below, one sum across layers.
  cols = add_at(floor.cols, increment.cols) if floor.cols.ndim >= 2 else floor.cols + increment.cols
  return FactoredSquares(add_at(floor.rows, increment.rows), cols)


def floor_estimate(floor: FactoredSquares) -> jax.Array:
  """The floor's value for every entry of its leaf: ``rows x cols / total``."""
  if floor.cols.ndim == 0:  # kept whole
    return floor.rows
  total = jnp.sum(floor.rows, -1, keepdims=True)[..., None]
  # An all-zero slice (nothing folded yet) reads zero, not 0/0.
  return floor.rows[..., :, None] * floor.cols[..., None, :] / jnp.where(total > 0, total, 1)


def floor_layer_estimate(floor: FactoredSquares, layer: jax.Array) -> jax.Array:
  """:func:`floor_estimate` of layer ``layer`` of a stacked leaf, as a ``[1, ...]`` slice."""
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, layer, 1, 0)
  if floor.cols.ndim == 0 or floor.cols.ndim >= 2:  # whole, or factored per layer
    return floor_estimate(FactoredSquares(take(floor.rows), floor.cols if floor.cols.ndim == 0
                                          else take(floor.cols)))
  total = jnp.sum(floor.rows)  # a 2-D stack: one factorization across layers
  return take(floor.rows)[:, None] * floor.cols[None, :] / jnp.where(total > 0, total, 1)


def add_floor(floor: Any, increment: FactoredSquares) -> FactoredSquares:
  """``floor + increment``, fieldwise; ``floor`` may have come back in another
  container (``flax.nnx.Optimizer`` keeps its state's NamedTuples as
  ``nnx.State``), read by its field names."""
  return FactoredSquares(floor.rows + increment.rows, floor.cols + increment.cols)
