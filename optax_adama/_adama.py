"""AdamA: Adam whose moments absorb micro-batch gradients one at a time.

This module holds the math of docs/design.md: the moment fold, the bias-corrected
direction emitted once per mini-batch, the leaf-local non-finite guard, and the
`adama` / `adamaw` aliases built from them.

The per-leaf math lives at module level. A moment is either a dense array or a
:class:`QuantizedArray`; :func:`_load` and :func:`_store` are the one interface
to both, so the fold and the direction are written once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
import weakref
from typing import Any, Callable, NamedTuple, Optional, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adama import _floor
from optax_adama import _quantize
from optax_adama._quantize import BlockQuantization
from optax_adama._floor import FactoredSquares
from optax_adama._floor import add_floor
from optax_adama._floor import floor_estimate
from optax_adama._floor import zero_floor
from optax_adama._quantize import QuantizedArray

__all__ = [
    "NU_ESTIMATORS",
    "ScaleByAdamAState",
    "MiniBatchChainState",
    "scale_by_adama",
    "mini_batch_chain",
    "adama",
    "adamaw",
    "has_updated",
    "find_adama_state",
]

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]
Moment = Union[jax.Array, QuantizedArray]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["count", "micro_step", "mu", "nu", "nu_floor",
                 "mini_batch_accepted", "num_dropped"],
    meta_fields=["num_micro_batches", "nu_estimator"])
class ScaleByAdamAState(NamedTuple):
  """State of :func:`scale_by_adama`.

  A ``NamedTuple``, as optax's states are, so ``optax.tree_utils.tree_get``
  and ``tree_set`` find its leaves (``tree_get(state, "count")``).
  ``num_micro_batches`` and ``nu_estimator`` are static (registered as part of
  the tree structure, not leaves, and not in ``_fields``: ``tree_get`` does
  not see them, read ``find_adama_state(state).num_micro_batches``, and a
  state dict of Flax's ``serialization`` does not hold them, so save and
  restore the state with orbax, docs/checkpointing.md), so a jitted step can
  read them while tracing: :func:`microbatch_step` takes ``N`` from here, and whether to hand
  each update the difference of a micro-batch's halves (``"split"``), so a
  mismatch cannot happen.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> state = optax_adama.scale_by_adama(num_micro_batches=4).init({"w": jnp.ones(2)})
    >>> int(state.count), int(state.micro_step), state.num_micro_batches
    (0, 0, 4)
  """

  count: chex.Array  # int32 []: mini-batches completed, dropped ones included; bias correction and schedules count these.
  micro_step: chex.Array  # int32 []: micro-batches folded into the current mini-batch, in [0, N).
  mu: optax.Updates  # like params (dtype mu_dtype): first moment; with quantization, a QuantizedArray per large leaf.
  nu: optax.Updates  # like params (dtype nu_dtype): second moment, mean of g_i**2; with quantization, a QuantizedArray of sign(v) sqrt(|v|) per large leaf.
  nu_floor: Any  # "auto"/"split" at N > 1: a FactoredSquares per param leaf (float32 row and column sums, 0.26% of P on GPT-2 small), the floor of "split"'s v; otherwise () (nothing).
  mini_batch_accepted: chex.Array  # int32 []: micro-batches of the current (or just completed) mini-batch with an all-finite gradient.
  num_dropped: chex.Array  # int32 []: micro-batches with any non-finite gradient entry, since init.
  num_micro_batches: int  # static Python int: N, the update calls per mini-batch.
  nu_estimator: str = "mean"  # static: the estimator of v ("auto" or one of NU_ESTIMATORS).


# `_fields` names the pytree children only: optax's tree_get / tree_set walk a
# NamedTuple state's `_fields` as its subtrees, and a static field there is a
# leaf they count that jax's flattening does not (tree_set then failed on any
# state holding this one: inject_hyperparams, chain). `_replace`, repr and
# pickling keep every field.
ScaleByAdamAState._fields = ("count", "micro_step", "mu", "nu", "nu_floor",
                             "mini_batch_accepted", "num_dropped")


@dataclasses.dataclass(frozen=True, eq=False)
class AdamAConfig:
  """The hyperparameters of one AdamA transformation, fixed when it is built.

  Made once by :func:`scale_by_adama`, read by its ``update`` and by the steps
  that fold micro-batches themselves (:func:`microbatch_step`,
  :func:`release_step`), so both compute the same math from the same values.
  ``b1``, ``b2``, ``eps``, ``eps_root`` and ``rounding_seed`` may be arrays
  (traced under ``inject_hyperparams``); the rest are static Python values.
  Compared by identity (``eq=False``): the array fields are not hashable.
  """

  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  num_micro_batches: int
  nu_estimator: str
  stochastic_rounding: bool
  rounding_seed: Any


@dataclasses.dataclass(frozen=True, eq=False)
class FoldingParts:
  """What a fused step needs of an AdamA transformation to fold by itself."""

  config: AdamAConfig
  # The transforms run once per mini-batch after AdamA (mini_batch_chain).
  inner: Optional[optax.GradientTransformation] = None
  # offload_moments' min_size where the moments live in host memory.
  offload_min_size: Optional[int] = None


# The update functions AdamA's factories made, each with its parts, written
# once when the transformation is built. A side table rather than a callable
# object or a function attribute: optax's GradientTransformation is a pair of
# plain functions, and users' tools rely on that (chex.assert_max_traces reads
# the update's source; optax.with_extra_args_support its signature).
_FOLDING_PARTS: "weakref.WeakKeyDictionary[Callable, FoldingParts]" = (
    weakref.WeakKeyDictionary())


def folding_update(update_fn: Callable, parts: FoldingParts) -> Callable:
  """Registers ``update_fn`` as an AdamA ``update`` made of ``parts``; returns it."""
  _FOLDING_PARTS[update_fn] = parts
  return update_fn


def folding_parts(tx: optax.GradientTransformation,
                  caller: Optional[str] = None) -> Optional[FoldingParts]:
  """The :class:`FoldingParts` of a bare AdamA transformation.

  ``tx`` as made by :func:`adama`, :func:`adamaw`, :func:`scale_by_adama` or
  ``mini_batch_chain(scale_by_adama(...), ...)``, optionally under
  ``offload_moments``. For any other ``tx``: ``None`` without ``caller``,
  else a ``TypeError`` naming it.
  """
  parts = _FOLDING_PARTS.get(tx.update)
  if parts is not None or caller is None:
    return parts
  raise TypeError(
      f"{caller} folds into AdamA's moments itself, so it needs an AdamA "
      "transformation as made by adama, adamaw, scale_by_adama or "
      "mini_batch_chain(scale_by_adama(...), ...), optionally under "
      "offload_moments, not wrapped in optax.chain or inject_hyperparams. "
      "Pass transforms that must see AdamA's direction to mini_batch_chain.")


def check_num_micro_batches(num_micro_batches: Any) -> int:
  """``N`` as a Python int.

  Integer-like values are accepted as :class:`optax.MultiSteps` accepts them
  (``np.int64(2)``, a 0-d NumPy integer array); bools and floats are not, and
  neither is a JAX array: ``N`` fixes the structure of the state (it is a
  static field of :class:`ScaleByAdamAState`), so it must be known without
  tracing. A JAX array ``N`` is what ``optax.inject_hyperparams`` passes when
  ``num_micro_batches`` is not among its ``static_args``; that wrapper would
  also evaluate a plain schedule once per ``update`` call, i.e. per
  micro-batch, so the error names both ways that count mini-batches.
  """
  value = num_micro_batches
  if (isinstance(value, jax.Array) and jnp.ndim(value) == 0
      and jnp.issubdtype(value.dtype, jnp.integer)):
    raise ValueError(
        f"num_micro_batches must be a Python or NumPy integer, got a JAX array "
        f"({value!r}): N fixes the state's structure. optax.inject_hyperparams "
        "turns numeric arguments into arrays (and would evaluate a schedule once "
        "per update call, i.e. per micro-batch). Use "
        "optax_adama.inject_hyperparams(...) (N static, schedules count "
        "mini-batches), or optax.inject_hyperparams(..., "
        "static_args=(\"num_micro_batches\",)) for constant hyperparameters.")
  dtype = getattr(value, "dtype", None)
  is_integer_array = (
      dtype is not None and np.issubdtype(dtype, np.integer) and np.ndim(value) == 0)
  if isinstance(value, bool) or not (isinstance(value, int) or is_integer_array):
    raise TypeError(
        f"num_micro_batches must be an integer, got {value!r} "
        f"({type(value).__name__}).")
  value = int(value)
  if value < 1:
    raise ValueError(f"num_micro_batches must be >= 1, got {value}.")
  return value


def _check_hyperparams(b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
  """Rejects decay rates outside [0, 1) and negative epsilons, quoting them.

  ``b2 = 1`` would make v's bias correction ``1 - b2**t`` zero. Traced values
  (``optax.inject_hyperparams`` inside ``jit``) cannot be checked and pass.
  """
  ranges = {"b1": (b1, 0.0, 1.0), "b2": (b2, 0.0, 1.0),
            "eps": (eps, 0.0, math.inf), "eps_root": (eps_root, 0.0, math.inf)}
  for name, (value, low, high) in ranges.items():
    if isinstance(value, jax.core.Tracer) or jnp.ndim(value) != 0:
      continue
    if not low <= float(value) < high:
      bound = f"in [{low}, {high})" if high < math.inf else f">= {low}"
      rounded = ""
      if float(value) == high and jnp.dtype(_dtype_of(value)).itemsize < 4:
        rounded = (f": a decay rate below 1 rounds to 1 in {_dtype_of(value)}, as "
                   "inject_hyperparams casts hyperparameters to the params' dtype; "
                   "pass inject_hyperparams(..., hyperparam_dtype=jnp.float32)")
      raise ValueError(f"{name} must be {bound}, got {value!r}{rounded}.")


def _real_hyperparam(value: Any) -> Any:
  """``value``'s real part where it is complex, else ``value``.

  ``optax.inject_hyperparams`` casts hyperparameters to the params' widest
  dtype, complex64 for complex params; rates and decays are real, and a
  complex one would turn the updates of real leaves complex.
  """
  if callable(value) or not jnp.iscomplexobj(value):
    return value
  return jnp.real(value)


def _check_nesterov(nesterov: Any) -> None:
  # optax's Nesterov direction, b1 m_hat + (1 - b1) g_bar / (1 - b1**t), reads
  # the step's mean gradient g_bar beside m: the buffer AdamA never forms.
  if nesterov:
    raise ValueError(
        f"nesterov={nesterov!r}: AdamA has no Nesterov form. optax's reads the "
        "mini-batch's mean gradient beside m, the gradient buffer AdamA exists to "
        "drop; use optax.MultiSteps(optax.adam(..., nesterov=True)) for it.")


def _check_storage_options(quantization: Any, nu_estimator: Any,
                           stochastic_rounding: Any) -> None:
  """Raises for a bad ``quantization`` / ``nu_estimator`` / ``stochastic_rounding``."""
  if quantization is not None and not isinstance(quantization, BlockQuantization):
    raise TypeError(
        f"quantization must be a BlockQuantization or None, got {quantization!r}.")
  if nu_estimator not in NU_ESTIMATOR_NAMES:
    raise ValueError(
        f"nu_estimator must be one of {NU_ESTIMATOR_NAMES}, got {nu_estimator!r}.")
  if not isinstance(stochastic_rounding, (bool, np.bool_)):
    raise TypeError(
        f"stochastic_rounding must be a bool, got {stochastic_rounding!r}.")


def _check_float_params(params: optax.Params, quantization: Optional[BlockQuantization],
                        nu_estimator: str) -> None:
  """Raises a ``TypeError`` naming every leaf AdamA cannot move.

  Real and complex floats move as in ``optax.adam`` (complex leaves fold
  ``|g|**2`` into v); integer and boolean leaves never would, and complex
  leaves have no 8-bit codes and no halves' ``"split"`` term.
  """
  leaves = jax.tree_util.tree_leaves_with_path(params)
  name = lambda path, leaf: f"{jax.tree_util.keystr(path)} ({jnp.dtype(_dtype_of(leaf))})"
  bad = [name(path, leaf) for path, leaf in leaves
         if not jnp.issubdtype(_dtype_of(leaf), jnp.inexact)]
  if bad:
    raise TypeError(
        "AdamA moves floating-point params only; these leaves would "
        f"never move: {', '.join(bad)}. Keep integer and boolean state out "
        "of the optimized tree (e.g. nnx.Optimizer(model, tx, wrt=nnx.Param)), "
        "or cast them to a float dtype.")
  quantized = complex_leaf_names(params, [
      quantization is not None and quantization.quantizes(jnp.shape(leaf))
      for _, leaf in leaves])
  if quantized:
    raise TypeError(
        f"8-bit moments are real; these complex leaves cannot take them: "
        f"{', '.join(quantized)}. Raise BlockQuantization(min_size=...) above "
        "their size or pass quantization=None.")
  complex_leaves = complex_leaf_names(params)
  if complex_leaves and nu_estimator in ("split", "auto"):
    raise TypeError(
        f"nu_estimator={nu_estimator!r} takes halves' squared differences, real "
        f"only; these leaves are complex: {', '.join(complex_leaves)}. "
        "Pass nu_estimator=\"mean\" (the default).")


def complex_leaf_names(params: optax.Params, selected: Any = None) -> list[str]:
  """``"['path'] (dtype)"`` of each complex leaf (of those ``selected``, a
  list aligned with the leaves, is true for), for errors that name them."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  selected = [True] * len(leaves) if selected is None else selected
  return [f"{jax.tree_util.keystr(path)} ({jnp.dtype(_dtype_of(leaf))})"
          for (path, leaf), on in zip(leaves, selected)
          if on and jnp.issubdtype(_dtype_of(leaf), jnp.complexfloating)]


def _dtype_of(leaf: Any) -> jnp.dtype:
  return jnp.dtype(getattr(leaf, "dtype", None) or jnp.result_type(leaf))


def _compute_dtype(*dtypes: jnp.dtype) -> jnp.dtype:
  # Fold in at least float32: a bf16 moment absorbing (1-b2)/N * g**2 in bf16
  # arithmetic would round most contributions away before the store. (Chosen
  # by width, since strict dtype promotion has no bf16 -> f32 path.) A
  # complex moment folds in complex of its own width.
  dtypes = [jnp.dtype(d) for d in dtypes]
  is_complex = [jnp.issubdtype(d, jnp.complexfloating) for d in dtypes]
  # The width of one real component: a complex64 is two float32s.
  wide = any(d.itemsize > (8 if c else 4) for d, c in zip(dtypes, is_complex))
  if any(is_complex):
    return jnp.dtype(jnp.complex128 if wide else jnp.complex64)
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _abs_squared(x: jax.Array) -> jax.Array:
  """``|x|**2``, real: optax's v of a complex leaf folds ``|g|**2``."""
  return (x * jnp.conj(x)).real if jnp.iscomplexobj(x) else x * x


def _increment(grad: jax.Array, order: int, dtype: jnp.dtype) -> jax.Array:
  """``grad`` (order 1) or ``|grad|**2`` (order 2) in ``dtype``.

  A real gradient is widened first (a bf16 square loses most of its bits); a
  complex one is squared before any cast, so a real v (``nu_dtype=float32``
  for complex params) gets ``|g|**2``, not ``Re(g)**2``.
  """
  if order == 2 and jnp.iscomplexobj(grad):
    return _abs_squared(grad).astype(dtype)
  grad = grad.astype(dtype)
  return grad if order == 1 else _abs_squared(grad)


# One load/store interface for both kinds of moment. `order` is 1 for m and 2
# for v: a quantized v is stored as its signed root sign(v) sqrt(|v|), so its
# codes span twice the decades of v, and is squared on load, sign kept. v is
# never negative but under "split", whose v can dip below zero where noise
# dominates; the sign keeps that dip as a float32 v keeps it, rather than a
# clip that would bias v upwards.


def _load(moment: Moment, order: int) -> jax.Array:
  """The moment's value, widened for arithmetic, in the moment's own layout."""
  if isinstance(moment, QuantizedArray):
    root = _quantize.dequantize_blocks(moment)
    return root * jnp.abs(root) if order == 2 else root
  return moment.astype(_compute_dtype(moment.dtype))


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
          signed_root, like.codes.dtype, seed, absmax=jnp.sqrt(absmax),
          unbiased_square=True)
    return _quantize.quantize_blocks(value, like.codes.dtype, seed, absmax=absmax)
  narrows = jnp.dtype(like.dtype).itemsize < value.dtype.itemsize
  if seed is not None and narrows and value.dtype == jnp.float32:
    value = _quantize.stochastic_round(value, like.dtype, seed)
  return value.astype(like.dtype)


def _to_layout(x: jax.Array, like: Moment) -> jax.Array:
  """``x`` (shaped like the param) in ``like``'s layout (blocks if quantized)."""
  if isinstance(like, QuantizedArray):
    return _quantize.to_blocks(x, *like.codes.shape)
  return x


class _Folded(NamedTuple):
  """A moment's new value before it is stored, and a bound for its scales."""

  value: jax.Array  # float32/64, in the moment's layout.
  absmax: Optional[jax.Array]  # float32 [num_blocks] for a quantized moment, else None.


def _fold_moment(
    moment: Moment, grad: jax.Array, finite_grad: jax.Array, decay: jax.Array,
    weight: jax.Array, order: int, less: Optional[jax.Array] = None,
    less_absmax: Optional[jax.Array] = None,
    whole_block_absmax: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> _Folded:
  """``decay * moment + weight * (grad**order - less)``, not yet stored.

  ``grad`` is the raw gradient leaf, ``finite_grad`` the same with its
  non-finite entries zeroed; ``less`` is the "split" estimator's noise term
  (``less_absmax`` bounds it per block where ``moment`` is quantized).
  ``whole_block_absmax`` makes a per-block absmax of this leaf's part of
  each block the whole block's (a ``pmax`` where a mesh splits blocks).
  """
  dtype = _compute_dtype(_quantize.storage_dtype(moment))
  decay = jnp.asarray(decay).astype(dtype)
  weight = jnp.asarray(weight).astype(dtype)
  increment = _to_layout(_increment(finite_grad, order, dtype), moment)
  if less is not None:
    increment = increment - _to_layout(less.astype(dtype), moment)
  new = decay * _load(moment, order) + weight * increment
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


def _direction(
    mu: Moment, nu: Moment, like: jax.ShapeDtypeStruct, count: jax.Array,
    b1: jax.Array, b2: jax.Array, eps: jax.Array, eps_root: jax.Array,
    floor_nu: bool = False, nu_floor: Optional[jax.Array] = None,
) -> jax.Array:
  """The bias-corrected Adam direction of one leaf, shaped and typed as ``like``.

  ``floor_nu`` reads ``v_hat`` as at least ``m_hat**2`` (the "split"
  estimator, whose v can dip to or below zero where noise dominates): no
  coordinate then steps more than the learning rate. ``nu_floor`` (shaped
  like the leaf, raw as v is) raises ``v_hat`` further to at least its own
  bias-corrected value: :class:`FactoredSquares`.
  """
  dtype = _compute_dtype(_quantize.storage_dtype(mu), _quantize.storage_dtype(nu))
  # Explicit casts keep this valid under jax_numpy_dtype_promotion="strict"
  # (optax.tree.bias_correction raises there: float ** int32).
  t = count.astype(dtype)
  b1, b2, eps, eps_root = (jnp.asarray(x).astype(dtype) for x in (b1, b2, eps, eps_root))
  # A complex m beside a real v (complex params, nu_dtype=float32; or real
  # params, mu_dtype=complex64): both in ``dtype``, for strict promotion.
  m_hat = _load(mu, 1).astype(dtype) / (1 - b1**t)
  v_hat = _load(nu, 2).astype(dtype) / (1 - b2**t)
  if floor_nu:
    v_hat = jnp.maximum(v_hat, m_hat * m_hat)
  if nu_floor is not None:
    v_hat = jnp.maximum(v_hat, _to_layout(nu_floor.astype(dtype), mu) / (1 - b2**t))
  u = m_hat / (jnp.sqrt(v_hat + eps_root) + eps)
  if isinstance(mu, QuantizedArray):
    u = _quantize.from_blocks(u, like.shape)
  return u.astype(like.dtype)


def _update_like(grad: jax.Array, mu: Moment, nu: Moment) -> jax.ShapeDtypeStruct:
  """The shape and dtype of a leaf's update: ``optax.scale_by_adam``'s.

  optax returns the promotion of the gradient's dtype and the moments' (its
  update is ``m_hat / (sqrt(v_hat) + eps)`` with ``m`` and ``v`` folded from
  the gradient): float32 params and moments with bfloat16 gradients give
  float32 updates, which are then added to the params unrounded. An 8-bit
  moment has no dtype of its own there; the gradient's stands for it.
  Promoted as JAX's standard mode does, also where a caller runs strict
  promotion (AdamA's arithmetic casts explicitly).
  """
  dtypes = [_dtype_of(grad)] + [
      jnp.dtype(m.dtype) for m in (mu, nu) if not isinstance(m, QuantizedArray)]
  with jax.numpy_dtype_promotion("standard"):
    dtype = functools.reduce(jnp.promote_types, dtypes)
  return jax.ShapeDtypeStruct(jnp.shape(grad), dtype)


def _gated_direction(mu, nu, grad, emit, **hyperparams) -> jax.Array:
  """The direction where ``emit``, exact zeros elsewhere."""
  # Only the gradient's shape and dtype enter: the gradient itself would
  # become an operand of the branch, one more reason for XLA to keep it alive.
  like = _update_like(grad, mu, nu)
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


def leaf_seeds(config: AdamAConfig, state: ScaleByAdamAState, mus, nus):
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


# The estimators of v, by name (``nu_estimator=``); see scale_by_adama and
# docs/estimators.md. "auto" is "split" where the step hands over each
# micro-batch's half difference and "mean" where it cannot.
NU_ESTIMATORS = ("mean", "sum", "momentum", "split")
NU_ESTIMATOR_NAMES = ("auto",) + NU_ESTIMATORS
# The default: runs on every path and shape at no memory beyond m and v, and
# its v is never below Adam's in expectation (E = mu**2 + sigma**2), so no
# coordinate steps further than Adam's would. At Adam's learning rate it is
# the estimator nearest Adam almost everywhere it was measured: GPT-2 small on
# a GPU, 2,000 steps, -0.61% (N = 4) and +0.40% (N = 8) held-out against
# Adam + accumulation, where "momentum" was +0.29% and +4.44%
# (benchmarks/gpu_convergence.md; docs/estimators.md has the tiny models).
DEFAULT_NU_ESTIMATOR = "mean"


def _nu_weight(b2, num_micro_batches: int, nu_estimator: str):
  """The weight of each g_i**2 in v's fold."""
  if nu_estimator in ("auto", "mean", "split"):  # E = mu**2 + sigma**2 (before split's term)
    return (1 - b2) / num_micro_batches
  return (1 - b2) / num_micro_batches**2  # E = (mu**2 + sigma**2) / N


def _split_noise(half_difference, is_finite, num_micro_batches: int) -> jax.Array:
  """``(1 - 1/N) d**2``: with ``d = (g_a - g_b) / 2`` over a micro-batch's two
  halves, ``E[d**2] = sigma**2``, so ``g**2 - (1 - 1/N) d**2`` has Adam's
  expectation ``mu**2 + sigma**2 / N``."""
  d = jnp.where(is_finite, half_difference, jnp.zeros_like(half_difference))
  d = d.astype(_compute_dtype(d.dtype))
  return (1 - 1 / num_micro_batches) * d * d


def floor_increment(grad, half_difference, state: ScaleByAdamAState, config: AdamAConfig,
                    leaf_shape) -> FactoredSquares:
  """The floor's increment from one gradient leaf (or one layer's slice of one).

  The ``"sum"`` estimator's fold ``(1 - b2) / N**2 * g**2`` of the entries
  :func:`fold_leaf` folds (non-finite ones as zero), factored.
  """
  is_finite = jnp.isfinite(grad) & jnp.isfinite(half_difference)
  dtype = _compute_dtype(jnp.dtype(grad.dtype))
  g = jnp.where(is_finite, grad, jnp.zeros_like(grad)).astype(dtype)
  weight = jnp.asarray(_nu_weight(config.b2, state.num_micro_batches, "sum")).astype(dtype)
  return jax.tree.map(lambda x: x.astype(jnp.float32),
                      _floor.factor_squares(weight * g * g, leaf_shape))


def decayed_floor(state: ScaleByAdamAState, config: AdamAConfig) -> Any:
  """``state.nu_floor``, decayed by ``b2`` on a mini-batch's first micro-batch."""
  decay = jnp.where(state.micro_step == 0, jnp.asarray(config.b2), 1.0).astype(jnp.float32)
  return jax.tree.map(lambda x: decay * x, state.nu_floor)


def fold_leaf(grad, mu, nu, state: ScaleByAdamAState, config: AdamAConfig, seeds,
              half_difference=None, whole_block_absmax=lambda x: x):
  """Folds one gradient leaf into its moments: ``(mu, nu, all entries finite)``.

  The fold kernel: :func:`fold_micro_batch` maps it over a tree, and
  :func:`release_step` over one layer's slices at a time (on a mesh that
  splits 8-bit blocks, ``whole_block_absmax`` puts each block's parts
  together: see :func:`_fold_moment`).
  """
  b1, b2, nu_estimator = config.b1, config.b2, config.nu_estimator
  # The guard is elementwise so it fuses into the fold. Gating the fold on a
  # reduction over the leaf (all-finite) makes XLA keep gradients alive
  # longer: 0.44 P of temp instead of 0.16 P on an 8-layer MLP.
  is_finite = jnp.isfinite(grad)
  if half_difference is not None:
    is_finite &= jnp.isfinite(half_difference)
  finite_grad = jnp.where(is_finite, grad, jnp.zeros_like(grad))
  starts, n = state.micro_step == 0, state.num_micro_batches
  less = less_absmax = None
  if half_difference is not None:
    less = _split_noise(half_difference, is_finite, n)
    if isinstance(nu, QuantizedArray):  # from the raw input: see _fold_moment
      less_absmax = (1 - 1 / n) * whole_block_absmax(_quantize.finite_absmax_blocks(
          half_difference, *nu.codes.shape))**2
  m = _fold_moment(mu, grad, finite_grad, jnp.where(starts, b1, 1.0), (1 - b1) / n, 1,
                   whole_block_absmax=whole_block_absmax)
  v = _fold_moment(nu, grad, finite_grad, jnp.where(starts, b2, 1.0),
                   _nu_weight(b2, n, nu_estimator), 2, less, less_absmax,
                   whole_block_absmax=whole_block_absmax)
  if nu_estimator == "momentum" and n > 1:
    v = _add_squared_momentum(m, v, state, b1, b2)
  return (_store(m.value, mu, 1, seeds[0], m.absmax),
          _store(v.value, nu, 2, seeds[1], v.absmax),
          jnp.all(is_finite))  # the flag is counted only, never gating: free.


def _add_squared_momentum(m: _Folded, v: _Folded, state, b1, b2) -> _Folded:
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
  value = v.value + weight * _abs_squared(m.value).astype(dtype)
  absmax = None if v.absmax is None else v.absmax + weight * m.absmax**2
  return _Folded(value, absmax)


def adds_momentum_after_fold(state: ScaleByAdamAState, per_layer_offload: bool) -> bool:
  """Whether a step that folds a whole mini-batch may fold ``"momentum"`` as
  ``"sum"`` and add its ``m_hat**2`` term once, after: float32 moments (the
  term then lands on the same unrounded v) that are whole on the device
  after the fold (not host-offloaded moments brought in a layer at a time)."""
  return (state.nu_estimator == "momentum" and state.num_micro_batches > 1
          and not per_layer_offload
          and all(not isinstance(x, QuantizedArray) and jnp.dtype(x.dtype) == jnp.float32
                  for x in jax.tree.leaves((state.mu, state.nu),
                                           is_leaf=lambda x: isinstance(x, QuantizedArray))))


def add_momentum_term(state: ScaleByAdamAState, config: AdamAConfig) -> ScaleByAdamAState:
  """``state`` after a mini-batch folded as ``"sum"``, with ``"momentum"``'s
  ``(1 - b2)(1 - 1/N) m_hat**2`` added to v: :func:`_add_squared_momentum`
  on every leaf at once, outside the fold's layer scan (where, fused with
  the fold, XLA copied a whole layer stack's m: +0.68 P on GPT-2 small's
  release step)."""
  n = state.num_micro_batches
  # The same arithmetic as the fold's (b2 as given, b1 in float32): the
  # two ways then round alike.
  t = jnp.asarray(state.count).astype(jnp.float32)  # the completed mini-batch
  weight = (1 - config.b2) * (1 - 1 / n) / (
      1 - jnp.asarray(config.b1).astype(jnp.float32) ** t) ** 2
  weight = jnp.asarray(weight).astype(jnp.float32)
  nu = jax.tree.map(lambda m, v: v + weight * (m * m), state.mu, state.nu)
  return state._replace(nu=nu)


def completed(state: ScaleByAdamAState) -> jax.Array:
  """Whether the call that produced ``state`` completed a mini-batch."""
  # jnp.asarray also unwraps containers such as flax.nnx.Optimizer's OptArray.
  return (jnp.asarray(state.micro_step) == 0) & (jnp.asarray(state.count) > 0)


def emitted(state: ScaleByAdamAState) -> jax.Array:
  """Whether the call that produced ``state`` emitted a (nonzero) update."""
  return completed(state) & (jnp.asarray(state.mini_batch_accepted) > 0)


def advance_counters(
    state: ScaleByAdamAState, mu, nu, all_finite: jax.Array, nu_floor: Any = None,
) -> ScaleByAdamAState:
  """The state after one more micro-batch, with the folded moments (and
  floor; ``None``: ``state``'s, unchanged)."""
  starts = state.micro_step == 0
  micro_step = state.micro_step + 1
  completes = micro_step == state.num_micro_batches
  accepted = jnp.where(starts, 0, state.mini_batch_accepted) + all_finite.astype(jnp.int32)
  return ScaleByAdamAState(
      count=jnp.where(completes, optax.safe_increment(state.count), state.count),
      micro_step=jnp.where(completes, 0, micro_step).astype(jnp.int32),
      mu=mu,
      nu=nu,
      nu_floor=state.nu_floor if nu_floor is None else nu_floor,
      mini_batch_accepted=accepted.astype(jnp.int32),
      num_dropped=state.num_dropped + (~all_finite).astype(jnp.int32),
      num_micro_batches=state.num_micro_batches,
      nu_estimator=state.nu_estimator,
  )


def fold_micro_batch(grads, state: ScaleByAdamAState, config: AdamAConfig,
                     half_difference=None) -> ScaleByAdamAState:
  """``state`` after folding one micro-batch's gradient: AdamA's update without its direction.

  The fold's one entry over a tree (:func:`fold_leaf` per leaf); ``config``
  as :func:`scale_by_adama` made it; ``half_difference`` for the ``"split"``
  estimator.
  """
  if config.num_micro_batches != state.num_micro_batches:
    raise ValueError(
        f"num_micro_batches={config.num_micro_batches} but the state was made "
        f"with num_micro_batches={state.num_micro_batches}.")
  leaves, treedef = jax.tree.flatten(grads)
  mus = treedef.flatten_up_to(state.mu)
  nus = treedef.flatten_up_to(state.nu)
  differences = _half_differences(half_difference, treedef, state)
  seeds = leaf_seeds(config, state, mus, nus)
  folded = [fold_leaf(g, m, v, state, config, s, d)
            for g, m, v, s, d in zip(leaves, mus, nus, seeds, differences)]
  new_mus, new_nus, finite = zip(*folded) if folded else ((), (), ())
  # Combines one boolean per leaf; no gradient waits on it.
  all_finite = functools.reduce(operator.and_, finite, jnp.array(True))
  nu_floor = None
  if floors_split(state):
    nu_floor = treedef.unflatten([
        add_floor(f, floor_increment(g, d, state, config, jnp.shape(g)))
        for f, g, d in zip(treedef.flatten_up_to(decayed_floor(state, config)), leaves,
                           differences)])
  return advance_counters(
      state, treedef.unflatten(new_mus), treedef.unflatten(new_nus), all_finite, nu_floor)


def scale_by_adama(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    num_micro_batches: int,
    nesterov: bool = False,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    quantization: Optional[BlockQuantization] = None,
    stochastic_rounding: bool = True,
    rounding_seed: int = 0,
    nu_estimator: str = DEFAULT_NU_ESTIMATOR,
    split_floor: bool = True,
) -> optax.GradientTransformation:
  r"""Rescale micro-batch gradients with Adam Accumulation (AdamA).

  Call ``update`` once per micro-batch gradient :math:`g_i` (the gradient of
  that micro-batch's *mean* loss). Each call folds :math:`g_i` into the moments
  and drops it; no gradient accumulator exists. The first call of a mini-batch
  decays the moments once. Calls ``1..N-1`` of a mini-batch emit exactly zero
  updates; the ``N``-th emits the bias-corrected Adam direction:

  .. math::

    m &\leftarrow \beta_1 m,\quad v \leftarrow \beta_2 v
      \quad \text{(once per mini-batch)} \\
    m &\leftarrow m + \tfrac{1-\beta_1}{N} g_i,\quad
    v \leftarrow v + \tfrac{1-\beta_2}{N} g_i^2
      \quad (i = 1..N) \\
    t &\leftarrow t + 1,\quad
    u = \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t) + \epsilon_{root}}
      + \epsilon}

  :math:`m` equals Adam's first moment of the mean gradient; :math:`v` is the
  mean of the squared micro-batch gradients, larger than Adam's by their
  variance, so steps are never larger than Adam's. With ``N = 1`` this is
  exactly :func:`optax.scale_by_adam`.

  Transformations chained *before* AdamA see one micro-batch gradient per
  call, not the mini-batch mean: ``optax.clip_by_global_norm(c)`` there clips
  each :math:`g_i` (and keeps the whole micro-batch gradient alive to take its
  norm, the buffer AdamA removes); leaf-local ones (``optax.clip``,
  ``optax.adaptive_grad_clip``) cost nothing extra. Do not wrap AdamA in
  ``optax.apply_if_finite``: a skipped call shifts the mini-batch boundaries.
  The guard below replaces it.

  Non-finite gradients never reach the moments: each NaN or Inf gradient entry
  is folded as zero, and a micro-batch holding any is counted in
  ``num_dropped``. (:func:`microbatch_step` also drops a micro-batch whose loss
  is not finite, whole.) The guard is elementwise on purpose: dropping the whole
  micro-batch on one bad entry would need every leaf's gradient alive until all
  were checked, one full gradient, the very buffer AdamA removes. A mini-batch
  with no entirely finite micro-batch is a step on a zero gradient whose update
  is skipped: the moments decay once and ``count`` (hence bias correction and
  the schedules of :func:`adama`) advances, as after any mini-batch, but the
  emitted update is zero and params stay unchanged.

  Smaller moments: a ``mu_dtype`` / ``nu_dtype`` narrower than float32 (e.g.
  ``jnp.bfloat16``) or ``quantization=BlockQuantization()`` (8-bit block-wise
  codes, v stored as :math:`\sqrt v`; see :class:`BlockQuantization`) shrink
  the state from 2 P to P or about P/2. Either way each leaf is widened to
  float32, folded and narrowed again inside its own fold, so no second
  full-precision copy of the moments exists. Narrowing uses stochastic
  rounding by default: round-to-nearest would drop the small per-micro-batch
  increments :math:`(1-\beta_2)/N\, g_i^2` (and v's decay) entirely. The
  rounding of a quantized :math:`\sqrt v` is unbiased for :math:`v` itself.

  Args:
    b1: Decay rate of the first moment.
    b2: Decay rate of the second moment.
    eps: Term added to the denominator for numerical stability.
    eps_root: Term added inside the square root of the denominator.
    mu_dtype: dtype of the first moment; ``None`` means the dtype of params.
    num_micro_batches: ``N``, the number of ``update`` calls per mini-batch:
      an integer (``np.int64`` and 0-d integer arrays too), fixed at ``init``.
    nesterov: accepted for ``optax.adam``'s signature; only ``False``. Its
      Nesterov direction reads the mini-batch's mean gradient beside m, the
      buffer AdamA never forms, so ``True`` raises a ``ValueError``.
    nu_dtype: dtype of the second moment; ``None`` means the dtype of params.
    quantization: store the moments of leaves with at least
      ``quantization.min_size`` elements as 8-bit blocks (a
      :class:`QuantizedArray` each); smaller leaves keep ``mu_dtype`` /
      ``nu_dtype``. ``None``: no quantization.
    stochastic_rounding: round moments stochastically when they are stored
      narrower than float32 (``False``: round to nearest). With float32
      moments nothing is rounded either way.
    rounding_seed: seed of the rounding noise, drawn afresh on every call
      from the seed, the step count and the micro-batch index.
    nu_estimator: how v sees the micro-batch gradients (each is exactly
      Adam at ``N = 1``, and none costs memory beyond m and v). With
      :math:`\mu` the mean gradient and :math:`\sigma^2` one micro-batch's
      gradient variance, Adam's :math:`E[\bar g^2] = \mu^2 + \sigma^2/N`:
      ``"split"`` folds :math:`(g_i^2 - (1-1/N) d_i^2)/N` with :math:`d_i =
      (g_a - g_b)/2` over the gradients of micro-batch :math:`i`'s two halves
      (:math:`E[d_i^2] = \sigma^2`, so :math:`E = \mu^2 + \sigma^2/N`,
      Adam's, from one micro-batch at a time) and reads :math:`\hat v` as at
      least :math:`\hat m^2` and at least its floor, since this v can dip
      below zero where noise dominates: the floor is an EMA of the
      ``"sum"`` fold :math:`g_i^2/N^2` (never above Adam's v in expectation,
      equal to it where the gradient is noise), kept as Adafactor keeps its
      second moment, row and column sums (:class:`FactoredSquares`, 0.26% of
      P on GPT-2 small) in ``state.nu_floor``; it needs ``update(g_i, state, half_difference=d_i)`` with
      ``g_i = (g_a + g_b)/2``, which :func:`microbatch_step` and
      :func:`release_step` pass (one vmapped backward over the halves).
      ``"mean"`` (the default) folds :math:`g_i^2 / N` (:math:`E = \mu^2 +
      \sigma^2`: steps never larger than Adam's), on every path (fused,
      release, one ``update`` per micro-batch) and every micro-batch shape,
      at no memory beyond m and v; ``"sum"`` folds :math:`g_i^2 / N^2`
      (:math:`E = (\mu^2 + \sigma^2)/N`, a PyTorch loop dividing each
      micro-batch loss by N); ``"momentum"`` is ``"sum"`` plus
      :math:`(1-1/N)\hat m^2` once per mini-batch (:math:`E \approx \mu^2 +
      \sigma^2/N`, Adam's, where the mean gradient is steady over m's ~10
      steps; where it is not, v falls short and steps run long). ``"auto"`` is
      ``"split"`` wherever a half difference comes with the gradient (the
      fused steps, micro-batches of an even number of rows) and ``"mean"``
      wherever none does; docs/estimators.md has the measurements behind
      the choice (GPT-2 small, 2,000 steps at Adam's rate, against Adam +
      accumulation: ``"mean"`` -0.61% at N = 4 and +0.40% at N = 8,
      ``"momentum"`` +0.29% and +4.44%, ``"auto"`` +12.89% at N = 4).
    split_floor: ``"split"`` (and so ``"auto"`` where it reads ``"split"``)
      keeps its floor in the state and reads v_hat as at least it (the
      default: no coordinate's step then runs away from Adam's). ``False``
      keeps no floor: at 300 steps on the tiny GPT it trains up to 2.6
      points closer to Adam on the same seeds, at the price of steps up to
      59x Adam's on 0.1% of coordinates (docs/estimators.md#the-floor).

  Returns:
    A :class:`optax.GradientTransformation` with state
    :class:`ScaleByAdamAState`.

  Raises:
    TypeError: if ``num_micro_batches`` is not an integer, or (at ``init``)
      if a param leaf is not a float, or is complex where ``quantization``
      takes it or ``nu_estimator`` is ``"split"`` / ``"auto"``; the message
      names the leaf.
    ValueError: if ``num_micro_batches < 1`` or is a JAX array (what
      ``optax.inject_hyperparams`` passes unless it is among ``static_args``;
      :func:`optax_adama.inject_hyperparams` keeps it static), if ``b1`` or ``b2`` is outside
      ``[0, 1)`` or ``eps`` / ``eps_root`` is negative, if ``nesterov`` is
      true, if ``nu_estimator`` names no estimator, or (at ``update``) if
      ``num_micro_batches`` differs from the ``N`` the state was made with or ``"split"`` gets no
      ``half_difference`` (``N > 1``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_adama
    >>> tx = optax_adama.scale_by_adama(num_micro_batches=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> u, state = tx.update({"w": jnp.ones(3)}, state)  # micro-batch 1: zeros
    >>> print(u["w"])
    [0. 0. 0.]
    >>> u, state = tx.update({"w": jnp.ones(3)}, state)  # micro-batch 2: emits
    >>> print(u["w"].round(4))
    [1. 1. 1.]

  References:
    Zhang et al., `Adam Accumulation to Reduce Memory Footprints of both
    Activations and Gradients for Large-scale DNN Training
    <https://arxiv.org/abs/2305.19982>`_, 2023.
  """
  num_micro_batches = check_num_micro_batches(num_micro_batches)
  b1, b2, eps, eps_root = (_real_hyperparam(x) for x in (b1, b2, eps, eps_root))
  _check_hyperparams(b1, b2, eps, eps_root)
  _check_nesterov(nesterov)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  nu_dtype = None if nu_dtype is None else jnp.dtype(nu_dtype)
  _check_storage_options(quantization, nu_estimator, stochastic_rounding)
  config = AdamAConfig(
      b1=b1, b2=b2, eps=eps, eps_root=eps_root, num_micro_batches=num_micro_batches,
      nu_estimator=nu_estimator, stochastic_rounding=stochastic_rounding,
      rounding_seed=rounding_seed)

  def init_moment(param, dtype):
    if quantization is not None and quantization.quantizes(jnp.shape(param)):
      return quantization.zeros(jnp.shape(param))
    # zeros_like keeps the param's placement (a sharded param, a sharded
    # moment), as optax's moments do. (Quantized moments, shaped as blocks,
    # start on the default device; the steps' mesh= places them.)
    dtype = dtype or _dtype_of(param)
    if isinstance(param, jax.core.Tracer):
      # Under jit a constant lands on one device whatever the params' split
      # (optax.MultiSteps' accumulator does on FSDP params, llama-2-jax #10);
      # zeros computed from the param take its sharding from the partitioner.
      return jnp.where(jnp.isfinite(param), param - param, 0).astype(dtype)
    return jnp.zeros_like(param, dtype)

  if not isinstance(split_floor, bool):
    raise TypeError(f"split_floor must be True or False, got {split_floor!r}.")
  floors = split_floor and nu_estimator in ("auto", "split") and num_micro_batches > 1

  def init_fn(params: optax.Params) -> ScaleByAdamAState:
    _check_float_params(params, quantization, nu_estimator)
    # One buffer per counter: a shared one could not be donated twice.
    zero = lambda: jnp.zeros([], jnp.int32)
    return ScaleByAdamAState(
        count=zero(),
        micro_step=zero(),
        mu=jax.tree.map(lambda p: init_moment(p, mu_dtype), params),
        nu=jax.tree.map(lambda p: init_moment(p, nu_dtype), params),
        nu_floor=(jax.tree.map(lambda p: zero_floor(jnp.shape(p)), params)
                  if floors else ()),
        mini_batch_accepted=zero(),
        num_dropped=zero(),
        num_micro_batches=num_micro_batches,
        nu_estimator=nu_estimator,
    )

  def update_fn(updates, state, params=None, *, half_difference=None, **extra_args):
    del params, extra_args  # optax.chain hands every extra argument to all.
    name = state.nu_estimator
    new_state = fold_micro_batch(
        updates, resolve_estimator(state, half_difference is not None), config,
        half_difference)
    emit = emitted(new_state)
    direction = direction_args(new_state, config)
    grads, treedef = jax.tree.flatten(updates)
    new_mus = treedef.flatten_up_to(new_state.mu)
    new_nus = treedef.flatten_up_to(new_state.nu)
    floors = leaf_floors(new_state, treedef)
    return treedef.unflatten([
        _gated_direction(m, v, g, emit, nu_floor=None if f is None else floor_estimate(f),
                         **direction)
        for m, v, g, f in zip(new_mus, new_nus, grads, floors)]), with_estimator(new_state, name)

  return optax.GradientTransformationExtraArgs(
      init_fn, folding_update(update_fn, FoldingParts(config)))


def takes_halves(state: ScaleByAdamAState) -> bool:
  """Whether ``update`` folds a half difference: "split" at ``N > 1`` (at
  ``N = 1`` the estimator is Adam's g**2 and needs none)."""
  return state.nu_estimator == "split" and state.num_micro_batches > 1


def wants_halves(state: ScaleByAdamAState) -> bool:
  """Whether a fused step should take each micro-batch's halves for ``state``:
  "split" (which needs them) or "auto" (which uses them where they exist)."""
  return state.nu_estimator in ("auto", "split") and state.num_micro_batches > 1


def with_estimator(state: Any, nu_estimator: str) -> Any:
  """``state`` (a :class:`ScaleByAdamAState`, or one of its shardings) with
  another static ``nu_estimator``; the leaves are shared, not copied."""
  return state._replace(nu_estimator=nu_estimator)


def resolve_estimator(state: ScaleByAdamAState, halves: bool) -> ScaleByAdamAState:
  """``state`` with "auto" read as the estimator this call computes.

  "auto" is "split" where the caller hands over each micro-batch's half
  difference (``halves``) and "mean" where it cannot; the other names stand.
  A step resolves once, folds and reads the direction from the resolved
  state, and hands back its state under the name it came with
  (:func:`with_estimator`), so the state's structure never changes.
  """
  if state.nu_estimator != "auto":
    return state
  split = halves and state.num_micro_batches > 1
  return with_estimator(state, "split" if split else "mean")


def _half_differences(half_difference, treedef,
                      state: ScaleByAdamAState) -> list[Optional[jax.Array]]:
  """The "split" estimator's half differences, one per leaf (``None``: unused)."""
  if not takes_halves(state):
    return [None] * treedef.num_leaves
  if half_difference is None:
    raise ValueError(
        "nu_estimator='split' needs update(..., half_difference=d) with "
        "d = (g_a - g_b) / 2, g_a and g_b the gradients of the micro-batch's two "
        "halves (and updates = (g_a + g_b) / 2); optax_adama.microbatch_step "
        "passes it.")
  return treedef.flatten_up_to(half_difference)


def find_adama_state(state: Any) -> Optional[ScaleByAdamAState]:
  """Returns the first :class:`ScaleByAdamAState` inside an optimizer state.

  Args:
    state: any optimizer state, e.g. of ``optax.chain(..., adama(...), ...)``.

  Returns:
    The AdamA state, or ``None`` if ``state`` holds none.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_adama
    >>> tx = optax.chain(optax.clip(1.0), optax_adama.adama(1e-3, num_micro_batches=2))
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> optax_adama.find_adama_state(state).num_micro_batches
    2
    >>> print(optax_adama.find_adama_state(optax.adam(1e-3).init({"w": jnp.ones(2)})))
    None
  """
  is_adama = lambda x: isinstance(x, ScaleByAdamAState)
  for leaf in jax.tree.leaves(state, is_leaf=is_adama):
    if is_adama(leaf):
      return leaf
  return None


def direction_args(state: ScaleByAdamAState, config: AdamAConfig) -> dict:
  """The keyword arguments of :func:`_direction` for ``state``'s step."""
  return dict(count=state.count, b1=config.b1, b2=config.b2, eps=config.eps,
              eps_root=config.eps_root, floor_nu=takes_halves(state))


def floors_split(state: ScaleByAdamAState) -> bool:
  """Whether this call folds and reads "split"'s floor: "split" with a floor in
  the state (``split_floor=False`` keeps none)."""
  return takes_halves(state) and bool(jax.tree.leaves(state.nu_floor))


def leaf_floors(state: ScaleByAdamAState, treedef) -> list[Optional[FactoredSquares]]:
  """Per leaf of ``treedef``, the floor the direction reads (``None``: none)."""
  if not floors_split(state):
    return [None] * treedef.num_leaves
  return treedef.flatten_up_to(state.nu_floor)


def gated_direction_of_leaf(m, v, p, emit, direction: dict,
                            nu_floor: Optional[jax.Array] = None) -> jax.Array:
  """One leaf's direction where ``emit``, exact zeros elsewhere (``nu_floor``:
  the floor's value over the leaf, :func:`floor_estimate`)."""
  # For steps that fold in a scan and apply after it: 8-bit moments are read
  # from their codes anyway there, so a select fuses into the update, where
  # _gated_direction's branch would materialize a float32 direction.
  # The fused steps differentiate with respect to params: the gradient has
  # the params' dtype.
  u = _direction(m, v, _update_like(p, m, v), nu_floor=nu_floor, **direction)
  return jnp.where(emit, u, jnp.zeros_like(u))


def emitted_direction(state: ScaleByAdamAState, params, config: AdamAConfig):
  """AdamA's direction for every leaf of ``params`` (zeros unless ``state`` emits)."""
  emit = emitted(state)
  direction = direction_args(state, config)
  leaves, treedef = jax.tree.flatten(params)
  mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
  floors = [None if f is None else floor_estimate(f) for f in leaf_floors(state, treedef)]
  return treedef.unflatten(
      [gated_direction_of_leaf(m, v, p, emit, direction, f)
       for m, v, p, f in zip(mus, nus, leaves, floors)])


class MiniBatchChainState(NamedTuple):
  """State of :func:`mini_batch_chain` (and so of :func:`adama`, :func:`adamaw`).

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> state = optax_adama.adama(1e-3, num_micro_batches=4).init({"w": jnp.ones(2)})
    >>> isinstance(state, optax_adama.MiniBatchChainState)
    True
    >>> int(state.adama.micro_step), state.adama.nu_estimator
    (0, 'mean')
  """

  adama: ScaleByAdamAState  # state of the scale_by_adama head.
  inner: optax.OptState  # state of the transforms run once per mini-batch.


def adama_of(opt_state: Any) -> Any:
  """The AdamA part of a :func:`mini_batch_chain` state, or ``opt_state``
  itself (also for trees shaped like one, e.g. of shardings)."""
  return opt_state.adama if isinstance(opt_state, MiniBatchChainState) else opt_state


def inner_of(opt_state: Any) -> Any:
  """The state of the transforms chained after AdamA; ``None`` if there are none."""
  return opt_state.inner if isinstance(opt_state, MiniBatchChainState) else None


def with_adama(opt_state: Any, adama_state: Any, inner_state: Any) -> Any:
  """``opt_state`` with its AdamA part (and, if chained, the inner part) replaced."""
  if isinstance(opt_state, MiniBatchChainState):
    return MiniBatchChainState(adama=adama_state, inner=inner_state)
  return adama_state


def mini_batch_chain(
    head: optax.GradientTransformation,
    *transforms: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """Chains transforms that must run once per mini-batch after AdamA.

  ``optax.chain(scale_by_adama(...), optax.add_decayed_weights(wd))`` would add
  weight decay on every micro-batch call, and an ``optax`` schedule would count
  micro-batches. Here ``transforms`` see AdamA's emitted direction and their
  state advances once per completed mini-batch (a mini-batch whose
  micro-batches were all dropped included, so schedules and bias correction
  count the same steps); every call that emits nothing emits exactly zero.

  Args:
    head: a :func:`scale_by_adama` transformation.
    *transforms: transformations applied to the emitted direction, in order.

  Returns:
    A :class:`optax.GradientTransformation` with state
    :class:`MiniBatchChainState`.

  Raises:
    TypeError: at ``init``, if ``head``'s state is not a
      :class:`ScaleByAdamAState`.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_adama
    >>> tx = optax_adama.mini_batch_chain(  # adamaw(1e-3, ...), spelled out
    ...     optax_adama.scale_by_adama(num_micro_batches=2),
    ...     optax.add_decayed_weights(1e-4), optax.scale_by_learning_rate(1e-3))
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> int(state.adama.count), state.adama.num_micro_batches
    (0, 2)
  """
  inner = optax.chain(*map(_taking_its_extra_args, transforms))

  def init_fn(params):
    adama_state = head.init(params)
    if not isinstance(adama_state, ScaleByAdamAState):
      raise TypeError(
          "mini_batch_chain expects a scale_by_adama transformation as head, "
          f"got state {type(adama_state).__name__}.")
    return MiniBatchChainState(adama=adama_state, inner=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    # Extra arguments go to the head (the "split" estimator's half_difference)
    # and to the transforms (optax.contrib.reduce_on_plateau's value), whose
    # state keeps the completing call's.
    direction, adama_state = optax.with_extra_args_support(head).update(
        updates, state.adama, params, **extra_args)
    new_updates, inner_state = per_mini_batch_update(
        inner, direction, adama_state, state.inner, params, **extra_args)
    return new_updates, MiniBatchChainState(adama=adama_state, inner=inner_state)

  head_parts = folding_parts(head)
  if head_parts is None:  # e.g. optax.scale_by_adam: refused by init_fn.
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return optax.GradientTransformationExtraArgs(
      init_fn, folding_update(update_fn, dataclasses.replace(head_parts, inner=inner)))


def _taking_its_extra_args(
    tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` handed only the extra arguments its ``update`` takes.

  The fused steps pass ``value=`` (the mini-batch's loss) that no caller asked
  for; ``optax.chain`` would hand it to every transform with extra-argument
  support, and one without ``**kwargs`` (``optax.contrib.sam``) would raise.
  """
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    return tx  # optax.chain drops extra arguments for it itself
  try:
    signature = inspect.signature(tx.update)
  except (TypeError, ValueError):  # no signature to read: hand it everything
    return tx
  kinds = [p.kind for p in signature.parameters.values()]
  if inspect.Parameter.VAR_KEYWORD in kinds:
    return tx
  # After (updates, state, params): the names it takes as keywords.
  names = {name for i, (name, p) in enumerate(signature.parameters.items())
           if p.kind is inspect.Parameter.KEYWORD_ONLY
           or (i >= 3 and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)}

  def update_fn(updates, state, params=None, **extra_args):
    taken = {k: v for k, v in extra_args.items() if k in names}
    return tx.update(updates, state, params, **taken)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def per_mini_batch_update(inner, direction, adama_state, inner_state, params,
                          **extra_args):
  """``inner`` on AdamA's direction, advanced once per completed mini-batch.

  ``extra_args`` (e.g. ``value=`` the loss) are passed on to ``inner``.
  """
  # The transforms run on every call (elementwise work that fuses with the
  # fold), but only a completing call keeps their state, and only an
  # emitting one their output.
  emit = emitted(adama_state)
  inner_updates, new_inner_state = inner.update(direction, inner_state, params, **extra_args)
  updates = jax.tree.map(
      lambda u, d: jnp.where(emit, u, jnp.zeros_like(u)).astype(d.dtype),
      inner_updates, direction)
  new_inner_state = optax.tree.where(completed(adama_state), new_inner_state, inner_state)
  return updates, new_inner_state


def adama(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    num_micro_batches: int,
    nesterov: bool = False,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    quantization: Optional[BlockQuantization] = None,
    stochastic_rounding: bool = True,
    nu_estimator: str = DEFAULT_NU_ESTIMATOR,
    split_floor: bool = True,
) -> optax.GradientTransformation:
  r"""Adam Accumulation: Adam fed one micro-batch gradient per ``update`` call.

  Drop-in for ``optax.MultiSteps(optax.adam(lr), every_k_schedule=N)`` without
  its gradient accumulator: each call folds a micro-batch gradient into the
  moments (see :func:`scale_by_adama`); the ``N``-th call of a mini-batch emits

  .. math::

    u_t = -\alpha_t \, \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}

  and every other call emits exactly zero. A schedule ``learning_rate(t)``
  counts mini-batches. To read or change the learning rate during training,
  build the optimizer with :func:`optax_adama.inject_hyperparams` (the
  ``optax.inject_hyperparams`` of AdamA, whose schedules count mini-batches):
  ``state.hyperparams["learning_rate"]``.

  Args:
    learning_rate: a float or an optax schedule of the mini-batch count.
    b1: Decay rate of the first moment.
    b2: Decay rate of the second moment.
    eps: Term added to the denominator for numerical stability.
    eps_root: Term added inside the square root of the denominator.
    mu_dtype: dtype of the first moment; ``None`` means the dtype of params.
    num_micro_batches: ``N``, the number of ``update`` calls per mini-batch.
    nesterov: only ``False``; see :func:`scale_by_adama`.
    nu_dtype: dtype of the second moment; ``None`` means the dtype of params.
    quantization: 8-bit block-wise moments, see :func:`scale_by_adama`.
    stochastic_rounding: see :func:`scale_by_adama`.
    nu_estimator: ``"mean"`` (the default), ``"momentum"``, ``"sum"``,
      ``"split"`` or ``"auto"``; see :func:`scale_by_adama`.
    split_floor: whether ``"split"`` keeps and reads its floor; see
      :func:`scale_by_adama`.

  Returns:
    A :class:`optax.GradientTransformation`.

  Raises:
    TypeError: if ``num_micro_batches`` is not an integer, or (at ``init``)
      if a param leaf is not a float (or is complex where 8-bit moments or
      ``"split"`` would take it).
    ValueError: if ``num_micro_batches < 1`` or is a JAX array (as
      ``optax.inject_hyperparams`` passes it: use
      :func:`optax_adama.inject_hyperparams`), if ``b1`` or ``b2`` is outside
      ``[0, 1)`` or ``eps`` / ``eps_root`` is negative, if ``nesterov`` is
      true, or if ``"split"`` is asked with ``quantization``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_adama
    >>> loss = lambda p, x: jnp.mean((x * p["w"] - 1.0) ** 2)
    >>> tx = optax.chain(optax_adama.adama(0.1, num_micro_batches=2))
    >>> params = {"w": jnp.zeros(())}
    >>> state = tx.init(params)
    >>> for x in (1.0, 2.0):  # two micro-batches (gradients -2, -4), one step
    ...   u, state = tx.update(jax.grad(loss)(params, x), state)
    ...   params = optax.apply_updates(params, u)
    >>> # Adam on the mean gradient (-3) would step 0.1; AdamA's v (the default,
    >>> # "mean") is (4 + 16) / 2 = 10, not 9, so its step is 0.1 * 3 / sqrt(10).
    >>> print(round(float(params["w"]), 4))
    0.0949

  References:
    Zhang et al., `Adam Accumulation to Reduce Memory Footprints of both
    Activations and Gradients for Large-scale DNN Training
    <https://arxiv.org/abs/2305.19982>`_, 2023.
  """
  return mini_batch_chain(
      scale_by_adama(
          b1, b2, eps, eps_root, mu_dtype, num_micro_batches=num_micro_batches,
          nesterov=nesterov, nu_dtype=nu_dtype, quantization=quantization,
          stochastic_rounding=stochastic_rounding, nu_estimator=nu_estimator,
          split_floor=split_floor),
      optax.scale_by_learning_rate(_real_hyperparam(learning_rate)),
  )


def adamaw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    weight_decay: float = 1e-4,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *,
    num_micro_batches: int,
    nesterov: bool = False,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    quantization: Optional[BlockQuantization] = None,
    stochastic_rounding: bool = True,
    nu_estimator: str = DEFAULT_NU_ESTIMATOR,
    split_floor: bool = True,
) -> optax.GradientTransformation:
  r"""AdamA with decoupled weight decay, applied once per mini-batch.

  .. math::

    u_t = -\alpha_t \left( \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}
      + \lambda \theta_{t-1} \right)

  on the ``N``-th call of a mini-batch, zero on the others. Matches
  :func:`optax.adamw` for ``N = 1``. Schedules count mini-batches; see
  :func:`adama` for reading the learning rate during training.

  Args:
    learning_rate: a float or an optax schedule of the mini-batch count.
    b1: Decay rate of the first moment.
    b2: Decay rate of the second moment.
    eps: Term added to the denominator for numerical stability.
    eps_root: Term added inside the square root of the denominator.
    mu_dtype: dtype of the first moment; ``None`` means the dtype of params.
    weight_decay: :math:`\lambda`, the decoupled weight decay rate.
    mask: as in :func:`optax.adamw`: a tree of booleans or a callable
      returning one; ``True`` leaves are decayed.
    num_micro_batches: ``N``, the number of ``update`` calls per mini-batch.
    nesterov: only ``False``; see :func:`scale_by_adama`.
    nu_dtype: dtype of the second moment; ``None`` means the dtype of params.
    quantization: 8-bit block-wise moments, see :func:`scale_by_adama`.
    stochastic_rounding: see :func:`scale_by_adama`.
    nu_estimator: ``"mean"`` (the default), ``"momentum"``, ``"sum"``,
      ``"split"`` or ``"auto"``; see :func:`scale_by_adama`.
    split_floor: whether ``"split"`` keeps and reads its floor; see
      :func:`scale_by_adama`.

  Returns:
    A :class:`optax.GradientTransformation`; ``update`` needs ``params``.

  Raises:
    TypeError: if ``num_micro_batches`` is not an integer, or (at ``init``)
      if a param leaf is not a float (or is complex where 8-bit moments or
      ``"split"`` would take it).
    ValueError: if ``num_micro_batches < 1`` or is a JAX array (as
      ``optax.inject_hyperparams`` passes it: use
      :func:`optax_adama.inject_hyperparams`), if ``b1`` or ``b2`` is outside
      ``[0, 1)`` or ``eps`` / ``eps_root`` is negative, if ``nesterov`` is
      true, or if ``"split"`` is asked with ``quantization``.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.adamaw(1e-3, weight_decay=0.1, num_micro_batches=4)
    >>> state = tx.init({"w": jnp.ones(2)})

  References:
    Zhang et al., `Adam Accumulation ... <https://arxiv.org/abs/2305.19982>`_;
    Loshchilov & Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return mini_batch_chain(
      scale_by_adama(
          b1, b2, eps, eps_root, mu_dtype, num_micro_batches=num_micro_batches,
          nesterov=nesterov, nu_dtype=nu_dtype, quantization=quantization,
          stochastic_rounding=stochastic_rounding, nu_estimator=nu_estimator,
          split_floor=split_floor),
      _add_decayed_weights(_real_hyperparam(weight_decay), mask),
      optax.scale_by_learning_rate(_real_hyperparam(learning_rate)),
  )


def _add_decayed_weights(weight_decay: Any, mask: Any) -> optax.GradientTransformation:
  """``optax.add_decayed_weights`` with each param cast to its update's dtype.

  With float32 moments and bfloat16 params the update is float32; optax adds
  ``weight_decay * param`` by implicit promotion (float32 too, after rounding
  the product to bfloat16), which strict promotion refuses. Cast first, the
  product is float32 throughout. Schedules, masks and optax's state as optax's.
  """
  decay = optax.add_decayed_weights(weight_decay, mask)

  def update_fn(updates, state, params=None):
    if params is not None:
      params = jax.tree.map(
          lambda u, p: None if u is None else jnp.asarray(p).astype(u.dtype),
          updates, params, is_leaf=lambda x: x is None)
    return decay.update(updates, state, params)

  return optax.GradientTransformation(decay.init, update_fn)


def has_updated(state: Any) -> jax.Array:
  """Whether the last ``update`` call emitted a (nonzero) parameter update.

  Like :meth:`optax.MultiSteps.has_updated`: ``True`` right after the call that
  completes a mini-batch, unless every micro-batch of it was dropped.

  Args:
    state: the state of :func:`adama`, :func:`adamaw`, :func:`mini_batch_chain`,
      or any chain holding one of them.

  Returns:
    A scalar boolean array.

  Raises:
    ValueError: if ``state`` holds no AdamA state.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.adama(0.1, num_micro_batches=2)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.ones(2)}, state)
    >>> bool(optax_adama.has_updated(state))
    False
    >>> _, state = tx.update({"w": jnp.ones(2)}, state)
    >>> bool(optax_adama.has_updated(state))
    True
  """
  adama_state = find_adama_state(state)
  if adama_state is None:
    raise ValueError(
        "has_updated expects an AdamA state (from scale_by_adama, adama, "
        f"adamaw or a chain holding one), got {type(state).__name__}.")
  return emitted(adama_state)

