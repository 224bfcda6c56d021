"""The fold kernel: one gradient leaf into its moments, and the direction.

The per-leaf math of docs/design.md. A moment is either a dense array or a
:class:`QuantizedArray`; :func:`load` and :func:`_store` are the one interface
to both, so the fold and the direction are written once. Every path folds
through :func:`fold_leaf`: one ``update`` call per micro-batch, the fused
steps' scan, and the release's layer scan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Optional
from typing import Union

import jax
import jax.numpy as jnp

from optax_adama import _checks
from optax_adama import _quantize
from optax_adama._quantize import QuantizedArray
from optax_adama._state import AdamAConfig
from optax_adama._state import ScaleByAdamAState

Moment = Union[jax.Array, QuantizedArray]
# b1 / b2: Python floats, or arrays where inject_hyperparams traces them.
Decay = Union[float, jax.Array]
# A leaf's (m, v) rounding seeds, None where a moment rounds to nearest.
SeedPair = tuple[Optional[jax.Array], Optional[jax.Array]]


def compute_dtype(*dtypes: jnp.dtype) -> jnp.dtype:
  # Fold in at least float32: a bf16 moment absorbing (1-b2)/N * g**2 in bf16
  # arithmetic would round most contributions away before the store. (Chosen
  # by width, since strict dtype promotion has no bf16 -> f32 path.) A
  # complex moment folds in complex of its own width.
  widths = [jnp.dtype(d) for d in dtypes]
  is_complex = [jnp.issubdtype(d, jnp.complexfloating) for d in widths]
  # The width of one real component: a complex64 is two float32s.
  wide = any(d.itemsize > (8 if c else 4) for d, c in zip(widths, is_complex))
  if any(is_complex):
    return jnp.dtype(jnp.complex128 if wide else jnp.complex64)
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def abs_squared(x: jax.Array) -> jax.Array:
  """``|x|**2``, real: optax's v of a complex leaf folds ``|g|**2``."""
  return (x * jnp.conj(x)).real if jnp.iscomplexobj(x) else x * x


def _increment(grad: jax.Array, order: int, dtype: jnp.dtype) -> jax.Array:
  """``grad`` (order 1) or ``|grad|**2`` (order 2) in ``dtype``.

  A real gradient is widened first (a bf16 square loses most of its bits); a
  complex one is squared before any cast, so a real v (``nu_dtype=float32``
  for complex params) gets ``|g|**2``, not ``Re(g)**2``.
  """
  if order == 2 and jnp.iscomplexobj(grad):
    return abs_squared(grad).astype(dtype)
  grad = grad.astype(dtype)
  return grad if order == 1 else abs_squared(grad)


# One load/store interface for both kinds of moment. `order` is 1 for m and 2
# for v: a quantized v is stored as its signed root sign(v) sqrt(|v|), so its
# codes span twice the decades of v, and is squared on load, sign kept. v is
# never negative but under "split", whose v can dip below zero where noise
# dominates; the sign keeps that dip as a float32 v keeps it, rather than a
# clip that would bias v upwards.


def load(moment: Moment, order: int) -> jax.Array:
  """The moment's value, widened for arithmetic, in the moment's own layout."""
  if isinstance(moment, QuantizedArray):
    root = _quantize.dequantize_blocks(moment)
    return root * jnp.abs(root) if order == 2 else root
  return moment.astype(compute_dtype(moment.dtype))


def _stored_absmax(moment: QuantizedArray, order: int) -> jax.Array:
  """Per block, the largest magnitude of the stored value (v, not sqrt v)."""
  root = _quantize.quantized_absmax(moment)
  return root * root if order == 2 else root


def _store(
    value: jax.Array, like: Moment, order: int, seed: Optional[jax.Array],
    absmax: Optional[jax.Array] = None,
) -> Moment:
  """Narrows ``value`` to ``like``'s storage; stochastically if ``seed``.

  For a quantized moment ``absmax`` bounds each block's largest magnitude.
  """
  if isinstance(like, QuantizedArray):
    if order == 2:
      signed_root = jnp.sign(value) * jnp.sqrt(jnp.abs(value))
      return _quantize.quantize_blocks(
          signed_root, like.codes.dtype, seed,
          absmax=None if absmax is None else jnp.sqrt(absmax),
          unbiased_square=True)
    return _quantize.quantize_blocks(value, like.codes.dtype, seed, absmax=absmax)
  narrows = jnp.dtype(like.dtype).itemsize < value.dtype.itemsize
  if seed is not None and narrows and value.dtype == jnp.float32:
    value = _quantize.stochastic_round(value, like.dtype, seed)
  return value.astype(like.dtype)


def to_layout(x: jax.Array, like: Moment) -> jax.Array:
  """``x`` (shaped like the param) in ``like``'s layout (blocks if quantized)."""
  if isinstance(like, QuantizedArray):
    return _quantize.to_blocks(x, *like.codes.shape)
  return x


class _Folded(NamedTuple):
  """A moment's new value before it is stored, and a bound for its scales."""

  value: jax.Array  # float32/64, in the moment's layout.
  absmax: Optional[jax.Array]  # float32 [num_blocks] for a quantized moment, else None.


def _fold_moment(
    moment: Moment, grad: jax.Array, is_finite: jax.Array, decay: jax.Array,
    weight: jax.typing.ArrayLike, order: int, less: Optional[jax.Array] = None,
    less_absmax: Optional[jax.Array] = None,
    whole_block_absmax: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> _Folded:
  """``decay * moment + weight * (grad**order - less)``, not yet stored.

  ``grad`` is the raw gradient leaf, ``is_finite`` where it (and the half
  difference) is finite: the other entries are folded as zero; ``less`` is
  the "split" estimator's noise term (``less_absmax`` bounds it per block
  where ``moment`` is quantized).
  ``whole_block_absmax`` makes a per-block absmax of this leaf's part of
  each block the whole block's (a ``pmax`` where a mesh splits blocks).
  """
  dtype = compute_dtype(_quantize.storage_dtype(moment))
  decay = jnp.asarray(decay).astype(dtype)
  weight = jnp.asarray(weight).astype(dtype)
  if isinstance(moment, QuantizedArray):
    finite_grad = jnp.where(is_finite, grad, jnp.zeros_like(grad))
    increment = to_layout(_increment(finite_grad, order, dtype), moment)
    if less is not None:
      increment = increment - to_layout(less.astype(dtype), moment)
    new = weight * increment + decay * load(moment, order)
  else:
    # optax's expression, (1 - b) g**k + b m, on the raw gradient, then the
    # guard: the compiler fuses the multiply-add as it fuses optax's (a select
    # before the product moves the fusion, and the last bit), so N = 1 rounds
    # bit for bit as optax.scale_by_adam does. Non-finite entries keep b m,
    # as folding them as zero did.
    kept = decay * load(moment, order)
    increment = _increment(grad, order, dtype)
    if less is not None:
      increment = increment - less.astype(dtype)
    new = jnp.where(is_finite, weight * increment + kept, kept)
  if not isinstance(moment, QuantizedArray):
    return _Folded(new, None)
  # The new scales come from bounds (old block absmax, gradient block absmax),
  # not from the new values: an exact absmax would be a reduction over the
  # float32 result, which XLA then materializes for every leaf at once (2 P
  # of temp, measured). |new| <= decay |old|max + weight |g|max**order; with
  # "split"'s term, |g**2 - less| <= max(|g|max**2, |less|max).
  grad_absmax = whole_block_absmax(
      _quantize.finite_absmax_blocks(grad, *moment.codes.shape))**order
  if less_absmax is not None:
    grad_absmax = jnp.maximum(grad_absmax, less_absmax)
  stored_absmax = whole_block_absmax(_stored_absmax(moment, order))
  return _Folded(new, decay * stored_absmax + weight * grad_absmax)


def bias_corrections(count: jax.Array, b1: Any, b2: Any) -> tuple[jax.Array, jax.Array]:
  """``(1 - b1**t, 1 - b2**t)`` once per step, in float32, as optax computes them.

  ``optax.tree.bias_correction`` raises ``decay**count`` in float32 once for
  the whole tree and casts it to each moment's dtype; computed the same way
  (one scalar each, shared by every leaf) XLA simplifies each leaf's
  direction as it simplifies optax's, and ``N = 1`` matches
  ``optax.scale_by_adam`` bit for bit. Explicit casts keep this valid under
  ``jax_numpy_dtype_promotion="strict"`` (optax's ``float ** int32`` raises there).
  """
  t = jnp.asarray(count).astype(jnp.float32)
  correction1, correction2 = (1 - jnp.asarray(b).astype(jnp.float32) ** t for b in (b1, b2))
  return correction1, correction2


def _direction(
    mu: Moment, nu: Moment, like: jax.ShapeDtypeStruct, corrections: tuple,
    eps: jax.Array, eps_root: jax.Array, floor_nu: bool = False,
    nu_floor: Optional[jax.Array] = None,
) -> jax.Array:
  """The bias-corrected Adam direction of one leaf, shaped and typed as ``like``.

  ``corrections`` is :func:`bias_corrections` of the step. ``floor_nu``
  reads ``v_hat`` as at least ``m_hat**2`` (the "split" estimator, whose v
  can dip to or below zero where noise dominates): no coordinate then steps
  more than the learning rate. ``nu_floor`` (shaped like the leaf, raw as v
  is) raises ``v_hat`` further to at least its own bias-corrected value:
  :class:`FactoredSquares`.
  """
  dtype = compute_dtype(_quantize.storage_dtype(mu), _quantize.storage_dtype(nu))
  correction1, correction2 = (c.astype(dtype) for c in corrections)
  eps, eps_root = (jnp.asarray(x).astype(dtype) for x in (eps, eps_root))
  # A complex m beside a real v (complex params, nu_dtype=float32; or real
  # params, mu_dtype=complex64): both in ``dtype``, for strict promotion.
  m_hat = load(mu, 1).astype(dtype) / correction1
  v_hat = load(nu, 2).astype(dtype) / correction2
  if floor_nu:
    v_hat = jnp.maximum(v_hat, m_hat * m_hat)
  if nu_floor is not None:
    v_hat = jnp.maximum(v_hat, to_layout(nu_floor.astype(dtype), mu) / correction2)
  u = m_hat / (jnp.sqrt(v_hat + eps_root) + eps)
  if isinstance(mu, QuantizedArray):
    u = _quantize.from_blocks(u, like.shape)
  return u.astype(like.dtype)


def update_like(grad: jax.Array, mu: Moment, nu: Moment) -> jax.ShapeDtypeStruct:
  """The shape and dtype of a leaf's update: ``optax.scale_by_adam``'s.

  optax returns the promotion of the gradient's dtype and the moments' (its
  update is ``m_hat / (sqrt(v_hat) + eps)`` with ``m`` and ``v`` folded from
  the gradient): float32 params and moments with bfloat16 gradients give
  float32 updates, which are then added to the params unrounded. An 8-bit
  moment has no dtype of its own there; the gradient's stands for it.
  Promoted as JAX's standard mode does, also where a caller runs strict
  promotion (AdamA's arithmetic casts explicitly).
  """
  dtypes = [_checks.dtype_of(grad)] + [
      jnp.dtype(m.dtype) for m in (mu, nu) if not isinstance(m, QuantizedArray)]
  with jax.numpy_dtype_promotion("standard"):
    dtype = functools.reduce(jnp.promote_types, dtypes)
  return jax.ShapeDtypeStruct(jnp.shape(grad), dtype)


def gated_direction(mu: Moment, nu: Moment, grad: jax.Array, emit: jax.Array,
                    **hyperparams: Any) -> jax.Array:  # Any: _direction's mixed keywords
  """The direction where ``emit``, exact zeros elsewhere."""
  # Only the gradient's shape and dtype enter: the gradient itself would
  # become an operand of the branch, one more reason for XLA to keep it alive.
  like = update_like(grad, mu, nu)
  if not isinstance(mu, QuantizedArray):
    u = _direction(mu, nu, like, **hyperparams)
    return jnp.where(emit, u, jnp.zeros_like(u))
  # A quantized moment must be read back from its stored bytes. Computed
  # unconditionally, XLA fuses the requantization into the direction and
  # reads the float32 fold result instead, which then stays alive for every
  # leaf until the all-leaf `emit` is known. Behind a branch (run on the
  # emitting call only) the direction reads the codes.
  return jax.lax.cond(
      emit, lambda: _direction(mu, nu, like, **hyperparams),
      lambda: jnp.zeros(like.shape, like.dtype))


def leaf_seeds(config: AdamAConfig, state: ScaleByAdamAState, mus: Sequence[Moment],
               nus: Sequence[Moment]) -> list[SeedPair]:
  """Two uint32 seeds per leaf (m, v), fresh for every call; no key in the state.

  ``None`` seeds (round to nearest, or nothing to round) unless
  ``config.stochastic_rounding`` and some moment is stored narrower than
  float32.
  """
  narrow = any(_quantize.storage_dtype(x).itemsize < 4 for x in list(mus) + list(nus))
  if not (config.stochastic_rounding and narrow):
    return [(None, None)] * len(mus)
  call_seed = _quantize.mix_seed(
      _quantize.mix_seed(jnp.asarray(config.rounding_seed), state.count),
      state.micro_step)
  return [(_quantize.mix_seed(call_seed, jnp.uint32(2 * i)),
           _quantize.mix_seed(call_seed, jnp.uint32(2 * i + 1)))
          for i in range(len(mus))]


def nu_weight(b2: Decay, num_micro_batches: int, nu_estimator: str) -> Decay:
  """The weight of each g_i**2 in v's fold."""
  if nu_estimator in ("auto", "mean", "split"):  # E = mu**2 + sigma**2 (before split's term)
    return (1 - b2) / num_micro_batches
  return (1 - b2) / num_micro_batches**2  # E = (mu**2 + sigma**2) / N


def split_noise(half_difference: jax.Array, is_finite: jax.Array,
                num_micro_batches: int) -> jax.Array:
  """``(1 - 1/N) d**2``: with ``d = (g_a - g_b) / 2`` over a micro-batch's two
  halves, ``E[d**2] = sigma**2``, so ``g**2 - (1 - 1/N) d**2`` has Adam's
  expectation ``mu**2 + sigma**2 / N``."""
  d = jnp.where(is_finite, half_difference, jnp.zeros_like(half_difference))
  d = d.astype(compute_dtype(d.dtype))
  return (1 - 1 / num_micro_batches) * d * d


def fold_leaf(grad: jax.typing.ArrayLike, mu: Moment, nu: Moment, state: ScaleByAdamAState,
              config: AdamAConfig, seeds: Sequence[Optional[jax.Array]],
              half_difference: Optional[jax.Array] = None,
              whole_block_absmax: Callable[[jax.Array], jax.Array] = lambda x: x,
              ) -> tuple[Moment, Moment, jax.Array]:
  """Folds one gradient leaf into its moments: ``(mu, nu, all entries finite)``.

  The fold kernel: :func:`fold_micro_batch` maps it over a tree, and
  :func:`release_step` over one layer's slices at a time (on a mesh that
  splits 8-bit blocks, ``whole_block_absmax`` puts each block's parts
  together: see :func:`_fold_moment`).
  """
  b1, b2, nu_estimator = config.b1, config.b2, state.nu_estimator
  # The guard is elementwise so it fuses into the fold. Gating the fold on a
  # reduction over the leaf (all-finite) makes XLA keep gradients alive
  # longer: 0.44 P of temp instead of 0.16 P on an 8-layer MLP.
  grad = jnp.asarray(grad)  # a Python float param's gradient too
  is_finite = jnp.isfinite(grad)
  if half_difference is not None:
    is_finite &= jnp.isfinite(half_difference)
  starts, n = state.micro_step == 0, state.num_micro_batches
  less = less_absmax = None
  if half_difference is not None:
    less = split_noise(half_difference, is_finite, n)
    if isinstance(nu, QuantizedArray):  # from the raw input: see _fold_moment
      less_absmax = (1 - 1 / n) * whole_block_absmax(_quantize.finite_absmax_blocks(
          half_difference, *nu.codes.shape))**2
  m = _fold_moment(mu, grad, is_finite, jnp.where(starts, b1, 1.0), (1 - b1) / n, 1,
                   whole_block_absmax=whole_block_absmax)
  v = _fold_moment(nu, grad, is_finite, jnp.where(starts, b2, 1.0),
                   nu_weight(b2, n, nu_estimator), 2, less, less_absmax,
                   whole_block_absmax=whole_block_absmax)
  if nu_estimator == "momentum" and n > 1:
    v = add_squared_momentum(m, v, state, b1, b2)
  return (_store(m.value, mu, 1, seeds[0], m.absmax),
          _store(v.value, nu, 2, seeds[1], v.absmax),
          jnp.all(is_finite))  # the flag is counted only, never gating: free.


def add_squared_momentum(m: _Folded, v: _Folded, state: ScaleByAdamAState, b1: Decay,
                         b2: Decay) -> _Folded:
  """On a mini-batch's last call, ``v += (1 - b2)(1 - 1/N) m_hat**2``.

  With the ``1/N**2`` fold this makes ``E[v]`` about Adam's ``mu**2 +
  sigma**2 / N`` when the mean gradient is steady over ~1/(1-b1) steps: the
  squared mean is estimated from the bias-corrected momentum, leaf by leaf,
  from the fold's own value.
  """
  n = state.num_micro_batches
  completes = state.micro_step + 1 == n
  dtype = v.value.dtype
  t = (state.count + 1).astype(dtype)
  weight = (1 - b2) * (1 - 1 / n) / (1 - jnp.asarray(b1).astype(dtype) ** t) ** 2
  weight = jnp.where(completes, weight, 0.0).astype(dtype)
  # A select, not a branch per leaf: on a GPU each `lax.cond` waits for its
  # predicate on the host, and one per leaf per micro-batch made GPT-2
  # small's step 24% slower on an H100 (measured; now +0.4% over "mean").
  # The price: where activations are tiny (an 8-layer MLP) the fold of m is
  # kept beside its in-place update, one more leaf alive; not on GPT-2.
  value = v.value + weight * abs_squared(m.value).astype(dtype)
  absmax = None
  if v.absmax is not None and m.absmax is not None:  # both quantized, or neither
    absmax = v.absmax + weight * m.absmax**2
  return _Folded(value, absmax)


def gated_direction_of_leaf(m: Moment, v: Moment, p: jax.Array, emit: jax.Array,
                            direction: dict[str, Any],  # _direction's mixed keywords
                            nu_floor: Optional[jax.Array] = None) -> jax.Array:
  """One leaf's direction where ``emit``, exact zeros elsewhere (``nu_floor``:
  the floor's value over the leaf, :func:`floor_estimate`)."""
  # For steps that fold in a scan and apply after it: 8-bit moments are read
  # from their codes anyway there, so a select fuses into the update, where
  # gated_direction's branch would materialize a float32 direction.
  # The fused steps differentiate with respect to params: the gradient has
  # the params' dtype.
  u = _direction(m, v, update_like(p, m, v), nu_floor=nu_floor, **direction)
  return jnp.where(emit, u, jnp.zeros_like(u))
