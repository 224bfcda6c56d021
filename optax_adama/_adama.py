"""AdamA: Adam whose moments absorb micro-batch gradients one at a time.

The transformation and its state: :func:`scale_by_adama` folds each
micro-batch gradient with the kernel of :mod:`optax_adama._fold` and emits the
bias-corrected direction once per mini-batch. The aliases :func:`adama` and
:func:`adamaw` are in :mod:`optax_adama._chain`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any
from typing import Optional
from typing import overload

import jax
import jax.numpy as jnp
import optax

from optax_adama import _checks
from optax_adama import _estimators
from optax_adama import _fold
from optax_adama._floor import add_floor
from optax_adama._floor import floor_estimate
from optax_adama._quantize import BlockQuantization
from optax_adama._state import AdamAConfig
from optax_adama._state import ScaleByAdamAState


@dataclasses.dataclass(frozen=True, eq=False)
class FoldingParts:
  """What a fused step needs of an AdamA transformation to fold in its place."""

  # The hyperparameters its update closes over (the same object).
  config: AdamAConfig
  # The transforms run once per mini-batch after AdamA (mini_batch_chain).
  inner: Optional[optax.GradientTransformation] = None
  # offload_moments' min_size where the moments live in host memory.
  offload_min_size: Optional[int] = None
  # clipped_by_global_norm's clip (a _clipping.SketchedClip, which imports this
  # module): run on each micro-batch gradient before it is folded (its state
  # is a ClippedState's ``clip``).
  clip: Optional[Any] = None


class FoldingTransformation(optax.GradientTransformationExtraArgs):
  """An AdamA transformation: optax's ``(init, update)`` pair, and its :class:`FoldingParts`.

  Made by :func:`scale_by_adama`, :func:`adama`, :func:`adamaw`,
  :func:`mini_batch_chain` and :func:`offload_moments` of one of them. A
  ``GradientTransformationExtraArgs`` like any other, whose ``init`` and
  ``update`` stay plain functions (users' tools rely on that:
  ``chex.assert_max_traces`` reads the update's source,
  ``optax.with_extra_args_support`` its signature); ``folding`` rides on the
  pair, not in it, so ``init, update = tx`` and ``optax.chain(tx, ...)`` see
  two functions. The fused steps read ``folding`` once, when they are built:
  they fold a bare AdamA themselves. Any wrapper that makes a new pair
  (``optax.chain``, ``inject_hyperparams``) drops it, so wrapped, AdamA takes
  one ``update`` per micro-batch.
  """

  folding: Optional[FoldingParts]

  def __new__(cls, init: optax.TransformInitFn, update: optax.TransformUpdateExtraArgsFn,
              folding: Optional[FoldingParts] = None) -> FoldingTransformation:
    tx = super().__new__(cls, init, update)
    tx.folding = folding
    return tx


@overload
def folding_parts(tx: optax.GradientTransformation) -> Optional[FoldingParts]: ...
@overload
def folding_parts(tx: optax.GradientTransformation, caller: str) -> FoldingParts: ...


def folding_parts(tx: optax.GradientTransformation,
                  caller: Optional[str] = None) -> Optional[FoldingParts]:
  """The :class:`FoldingParts` of a bare AdamA transformation.

  ``tx`` as made by :func:`adama`, :func:`adamaw`, :func:`scale_by_adama` or
  ``mini_batch_chain(scale_by_adama(...), ...)``, optionally under
  ``offload_moments``. For any other ``tx``: ``None`` without ``caller``,
  else a ``TypeError`` naming it.
  """
  parts = getattr(tx, "folding", None) if isinstance(tx, FoldingTransformation) else None
  if parts is not None or caller is None:
    return parts
  raise TypeError(
      f"{caller} folds into AdamA's moments itself, so it needs an AdamA "
      "transformation as made by adama, adamaw, scale_by_adama or "
      "mini_batch_chain(scale_by_adama(...), ...), optionally under "
      "offload_moments, not wrapped in optax.chain or inject_hyperparams. "
      "Pass transforms that must see AdamA's direction to mini_batch_chain.")


def completed(state: ScaleByAdamAState) -> jax.Array:
  """Whether the call that produced ``state`` completed a mini-batch."""
  # jnp.asarray also unwraps containers such as flax.nnx.Optimizer's OptArray.
  return (jnp.asarray(state.micro_step) == 0) & (jnp.asarray(state.count) > 0)


def emitted(state: ScaleByAdamAState) -> jax.Array:
  """Whether the call that produced ``state`` emitted a (nonzero) update."""
  return completed(state) & (jnp.asarray(state.mini_batch_accepted) > 0)


def advance_counters(
    state: ScaleByAdamAState, mu: optax.Updates, nu: optax.Updates, all_finite: jax.Array,
    nu_floor: Any = None,
) -> ScaleByAdamAState:
  """The state after one more micro-batch, with the folded moments (and
  floor; ``None``: ``state``'s, unchanged)."""
  starts = state.micro_step == 0
  micro_step = state.micro_step + 1
  completes = micro_step == state.num_micro_batches
  accepted = jnp.where(starts, 0, state.mini_batch_accepted) + all_finite.astype(jnp.int32)
  return state._replace(
      count=jnp.where(completes, optax.safe_increment(state.count), state.count),
      micro_step=jnp.where(completes, 0, micro_step).astype(jnp.int32),
      mu=mu,
      nu=nu,
      nu_floor=state.nu_floor if nu_floor is None else nu_floor,
      mini_batch_accepted=accepted.astype(jnp.int32),
      num_dropped=state.num_dropped + (~all_finite).astype(jnp.int32),
  )


def fold_micro_batch(grads: optax.Updates, state: ScaleByAdamAState, config: AdamAConfig,
                     half_difference: Optional[optax.Updates] = None) -> ScaleByAdamAState:
  """``state`` after folding one micro-batch's gradient: AdamA's update without its direction.

  The fold's one entry over a tree (:func:`fold_leaf` per leaf); ``config``
  as :func:`scale_by_adama` made it, ``N`` and the estimator ``state``'s;
  ``half_difference`` for the ``"split"`` estimator.
  """
  leaves, treedef = jax.tree.flatten(grads)
  mus = treedef.flatten_up_to(state.mu)
  nus = treedef.flatten_up_to(state.nu)
  differences = _estimators.half_differences(half_difference, treedef, state)
  seeds = _fold.leaf_seeds(config, state, mus, nus)
  folded = [_fold.fold_leaf(g, m, v, state, config, s, d)
            for g, m, v, s, d in zip(leaves, mus, nus, seeds, differences)]
  new_mus, new_nus, finite = zip(*folded) if folded else ((), (), ())
  # Combines one boolean per leaf; no gradient waits on it.
  all_finite = functools.reduce(operator.and_, finite, jnp.array(True))
  nu_floor = None
  if _estimators.floors_split(state):
    nu_floor = treedef.unflatten([
        add_floor(f, _estimators.floor_increment(g, d, state, config, jnp.shape(g)))
        for f, g, d in zip(treedef.flatten_up_to(_estimators.decayed_floor(state, config)), leaves,
                           differences)])
  return advance_counters(
      state, treedef.unflatten(new_mus), treedef.unflatten(new_nus), all_finite, nu_floor)


@_checks.refuses_contrib_arguments
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
  exactly :func:`optax.scale_by_adam`,
  bit for bit. Other estimators of v: :mod:`optax_adama.contrib`.

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
      an integer (``np.int64`` and 0-d integer arrays too), fixed at ``init``
      (a static field of the state; ``update`` reads it from there).
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
  Returns:
    A :class:`optax.GradientTransformation` with state
    :class:`ScaleByAdamAState`.

  Raises:
    TypeError: if ``num_micro_batches`` is not an integer, or (at ``init``)
      if a param leaf is not a float, or is complex where ``quantization``
      takes it; the message names the leaf. Also for ``nu_estimator`` or
      ``split_floor``: the research estimators are in
      :mod:`optax_adama.contrib`.
    ValueError: if ``num_micro_batches < 1`` or is a JAX array (what
      ``optax.inject_hyperparams`` passes unless it is among ``static_args``;
      :func:`optax_adama.inject_hyperparams` keeps it static), if ``b1`` or ``b2`` is outside
      ``[0, 1)`` or ``eps`` / ``eps_root`` is negative, if ``nesterov`` is
      true.

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
  num_micro_batches = _checks.check_num_micro_batches(num_micro_batches)
  b1, b2, eps, eps_root = (_checks.real_hyperparam(x) for x in (b1, b2, eps, eps_root))
  _checks.check_hyperparams(b1, b2, eps, eps_root)
  _checks.check_nesterov(nesterov)
  _checks.check_storage_options(quantization, stochastic_rounding)
  config = AdamAConfig(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                       stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)
  dtypes = (None if mu_dtype is None else jnp.dtype(mu_dtype),
            None if nu_dtype is None else jnp.dtype(nu_dtype))

  def init_fn(params: optax.Params) -> ScaleByAdamAState:
    _checks.check_float_params(params, quantization)
    return _initial_state(params, num_micro_batches, dtypes, quantization)

  def update_fn(
      updates: optax.Updates, state: ScaleByAdamAState, params: Optional[optax.Params] = None,
      *, half_difference: Optional[optax.Updates] = None, **extra_args: Any,
  ) -> tuple[optax.Updates, ScaleByAdamAState]:
    del params, extra_args  # optax.chain hands every extra argument to all.
    name = state.nu_estimator
    new_state = fold_micro_batch(
        updates, _estimators.resolve_estimator(state, half_difference is not None),
        config, half_difference)
    # The direction reads the stored moments, not the fold's expression. Left
    # fused, XLA computes fold, direction and the params' update in one fusion
    # per leaf that also waits on `emit`, which needs every leaf's finiteness
    # flag: every gradient (and its finiteness mask) then stays alive until the
    # last one exists, a full gradient of temp (libtpu, FSDP: +1.1 P/8 a core).
    # Behind the barrier each leaf folds as soon as its gradient is ready.
    mu, nu = jax.lax.optimization_barrier((new_state.mu, new_state.nu))
    new_state = new_state._replace(mu=mu, nu=nu)
    emit = emitted(new_state)
    direction = direction_args(new_state, config)
    grads, treedef = jax.tree.flatten(updates)
    new_mus = treedef.flatten_up_to(new_state.mu)
    new_nus = treedef.flatten_up_to(new_state.nu)
    floors = _estimators.leaf_floors(new_state, treedef)
    updates = treedef.unflatten([
        _fold.gated_direction(m, v, g, emit, **direction,
                              nu_floor=None if f is None else floor_estimate(f))
        for m, v, g, f in zip(new_mus, new_nus, grads, floors)])
    return updates, _estimators.with_estimator(new_state, name)

  return FoldingTransformation(init_fn, update_fn, FoldingParts(config))


def _initial_moment(param: Any, dtype: Optional[jnp.dtype],
                    quantization: Optional[BlockQuantization]) -> Any:
  """A zero moment for ``param``: 8-bit blocks, or dense in ``dtype`` (the param's if None)."""
  if quantization is not None and quantization.quantizes(jnp.shape(param)):
    return quantization.zeros(jnp.shape(param))
  # zeros_like keeps the param's placement (a sharded param, a sharded
  # moment), as optax's moments do. (Quantized moments, shaped as blocks,
  # start on the default device; the steps' mesh= places them.)
  dtype = dtype or _checks.dtype_of(param)
  if isinstance(param, jax.core.Tracer):
    # Under jit a constant lands on one device whatever the params' split
    # (optax.MultiSteps' accumulator does on FSDP params, llama-2-jax #10);
    # zeros computed from the param take its sharding from the partitioner.
    return jnp.where(jnp.isfinite(param), param - param, 0).astype(dtype)
  return jnp.zeros_like(param, dtype)


def _initial_state(params: optax.Params, num_micro_batches: int,
                   dtypes: tuple[Optional[jnp.dtype], Optional[jnp.dtype]],
                   quantization: Optional[BlockQuantization]) -> ScaleByAdamAState:
  """The state before the first micro-batch: zero counters and moments, the
  default estimator (:mod:`optax_adama.contrib` makes it another)."""
  mu_dtype, nu_dtype = dtypes
  # One buffer per counter: a shared one could not be donated twice.
  zero = lambda: jnp.zeros([], jnp.int32)
  return ScaleByAdamAState(
      count=zero(),
      micro_step=zero(),
      mu=jax.tree.map(lambda p: _initial_moment(p, mu_dtype, quantization), params),
      nu=jax.tree.map(lambda p: _initial_moment(p, nu_dtype, quantization), params),
      nu_floor=(),
      mini_batch_accepted=zero(),
      num_dropped=zero(),
      num_micro_batches=num_micro_batches,
      nu_estimator=_estimators.DEFAULT_NU_ESTIMATOR,
  )


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


def direction_args(state: ScaleByAdamAState, config: AdamAConfig) -> dict[str, Any]:
  """The keyword arguments of :func:`_direction` for ``state``'s step."""
  return dict(corrections=_fold.bias_corrections(state.count, config.b1, config.b2),
              eps=config.eps, eps_root=config.eps_root,
              floor_nu=_estimators.takes_halves(state))


def emitted_direction(state: ScaleByAdamAState, params: optax.Params,
                      config: AdamAConfig) -> optax.Updates:
  """AdamA's direction for every leaf of ``params`` (zeros unless ``state`` emits)."""
  emit = emitted(state)
  direction = direction_args(state, config)
  leaves, treedef = jax.tree.flatten(params)
  mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
  floors = [None if f is None else floor_estimate(f)
            for f in _estimators.leaf_floors(state, treedef)]
  return treedef.unflatten(
      [_fold.gated_direction_of_leaf(m, v, p, emit, direction, f)
       for m, v, p, f in zip(mus, nus, leaves, floors)])


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
