"""``mini_batch_chain`` and the aliases ``adama`` / ``adamaw`` built on it.

Transforms after AdamA run once per mini-batch, on its emitted direction.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Optional
from typing import Union

import jax
import jax.numpy as jnp
import optax

from optax_adama import _adama
from optax_adama import _checks


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

  adama: _adama.ScaleByAdamAState  # state of the scale_by_adama head.
  inner: optax.OptState  # state of the transforms run once per mini-batch.


class ClippedState(NamedTuple):
  """State of :func:`optax_adama.clipped_by_global_norm`: the clip's, and AdamA's.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.clipped_by_global_norm(
    ...     optax_adama.adama(1e-3, num_micro_batches=2), 1.0)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> float(state.clip.scale), int(state.adama.adama.micro_step)
    (1.0, 0)
  """

  clip: Any  # a SketchedClipState: the factor of this mini-batch and its sketch.
  adama: Any  # the clipped AdamA transformation's state.


def adama_of(opt_state: Any) -> Any:
  """The AdamA part of a :func:`mini_batch_chain` or :class:`ClippedState`
  state, or ``opt_state`` itself (also for trees shaped like one, e.g. of
  shardings)."""
  if isinstance(opt_state, ClippedState):
    return adama_of(opt_state.adama)
  return opt_state.adama if isinstance(opt_state, MiniBatchChainState) else opt_state


def inner_of(opt_state: Any) -> Any:
  """The state of the transforms chained after AdamA; ``None`` if there are none."""
  if isinstance(opt_state, ClippedState):
    return inner_of(opt_state.adama)
  return opt_state.inner if isinstance(opt_state, MiniBatchChainState) else None


def clip_of(opt_state: Any) -> Any:
  """The clip's state of a :class:`ClippedState`; ``None`` for any other state."""
  return opt_state.clip if isinstance(opt_state, ClippedState) else None


def with_adama(opt_state: Any, adama_state: Any, inner_state: Any,
               clip_state: Any = None) -> Any:
  """``opt_state`` with its AdamA part (and, if chained, the inner part; if
  clipped and ``clip_state`` is given, the clip's) replaced."""
  if isinstance(opt_state, ClippedState):
    return ClippedState(clip=opt_state.clip if clip_state is None else clip_state,
                        adama=with_adama(opt_state.adama, adama_state, inner_state))
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

  ``head`` may itself be such a chain (:func:`adama`, :func:`adamaw`): then
  ``transforms`` run after its own, on the update it emits, e.g.
  ``mini_batch_chain(adamaw(...), contrib.round_params_stochastically())``.

  Args:
    head: a :func:`scale_by_adama` transformation, or a chain of one
      (:func:`adama`, :func:`adamaw`, a ``mini_batch_chain``).
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
  head_parts = _adama.folding_parts(head)
  if head_parts is not None and head_parts.clip is not None:
    raise TypeError(
        "mini_batch_chain takes AdamA's chain before clipped_by_global_norm: write "
        "clipped_by_global_norm(mini_batch_chain(adamaw(...), ...), max_norm).")
  if head_parts is not None and head_parts.inner is not None:
    return _extended(head, head_parts, inner)

  def init_fn(params: optax.Params) -> MiniBatchChainState:
    adama_state = head.init(params)
    if not isinstance(adama_state, _adama.ScaleByAdamAState):
      raise TypeError(
          "mini_batch_chain expects a scale_by_adama transformation as head, "
          f"got state {type(adama_state).__name__}.")
    return MiniBatchChainState(adama=adama_state, inner=inner.init(params))

  def update_fn(updates: optax.Updates, state: MiniBatchChainState,
                params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, MiniBatchChainState]:
    # Extra arguments go to the head (the "split" estimator's half_difference)
    # and to the transforms (optax.contrib.reduce_on_plateau's value), whose
    # state keeps the completing call's.
    direction, adama_state = optax.with_extra_args_support(head).update(
        updates, state.adama, params, **extra_args)
    new_updates, inner_state = per_mini_batch_update(
        inner, direction, adama_state, state.inner, params, **extra_args)
    return new_updates, MiniBatchChainState(adama=adama_state, inner=inner_state)

  if head_parts is None:  # e.g. optax.scale_by_adam: refused by init_fn.
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return _adama.FoldingTransformation(
      init_fn, update_fn, dataclasses.replace(head_parts, inner=inner))


def _extended(head: optax.GradientTransformation, head_parts: _adama.FoldingParts,
              tail: optax.GradientTransformation) -> optax.GradientTransformation:
  """An AdamA chain ``head`` with ``tail`` run after its transforms, once per
  mini-batch; its inner state is ``(head's inner state, tail's state)``, as
  ``optax.chain(head's transforms, tail)`` keeps it."""
  if head_parts.offload_min_size is not None:
    raise TypeError(
        "mini_batch_chain takes AdamA's chain before offload_moments: write "
        "offload_moments(mini_batch_chain(adamaw(...), ...)).")

  def init_fn(params: optax.Params) -> MiniBatchChainState:
    head_state = head.init(params)
    return MiniBatchChainState(adama=head_state.adama,
                               inner=(head_state.inner, tail.init(params)))

  def update_fn(updates: optax.Updates, state: MiniBatchChainState,
                params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, MiniBatchChainState]:
    head_inner, tail_state = state.inner
    # An AdamA chain takes extra arguments already (a FoldingTransformation).
    updates, head_state = head.update(
        updates, MiniBatchChainState(adama=state.adama, inner=head_inner), params,
        **extra_args)
    updates, tail_state = per_mini_batch_update(
        tail, updates, head_state.adama, tail_state, params, **extra_args)
    return updates, MiniBatchChainState(adama=head_state.adama,
                                        inner=(head_state.inner, tail_state))

  inner = optax.chain(head_parts.inner, tail)
  return _adama.FoldingTransformation(
      init_fn, update_fn, dataclasses.replace(head_parts, inner=inner))


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

  def update_fn(updates: optax.Updates, state: optax.OptState,
                params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, optax.OptState]:
    taken = {k: v for k, v in extra_args.items() if k in names}
    return tx.update(updates, state, params, **taken)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def per_mini_batch_update(
    inner: optax.GradientTransformation, direction: optax.Updates,
    adama_state: _adama.ScaleByAdamAState, inner_state: optax.OptState,
    params: Optional[optax.Params], **extra_args: Any,
) -> tuple[optax.Updates, optax.OptState]:
  """``inner`` on AdamA's direction, advanced once per completed mini-batch.

  ``extra_args`` (e.g. ``value=`` the loss) are passed on to ``inner``.
  """
  # The transforms run on every call (elementwise work that fuses with the
  # fold), but only a completing call keeps their state, and only an
  # emitting one their output.
  emit = _adama.emitted(adama_state)
  inner_updates, new_inner_state = inner.update(direction, inner_state, params, **extra_args)
  updates = jax.tree.map(
      lambda u, d: jnp.where(emit, u, jnp.zeros_like(u)).astype(d.dtype),
      inner_updates, direction)
  new_inner_state = optax.tree.where(_adama.completed(adama_state), new_inner_state, inner_state)
  return updates, new_inner_state


@_checks.refuses_contrib_arguments
@_checks.takes_arguments_of(_adama.scale_by_adama, without=("rounding_seed",))
def adama(learning_rate: optax.ScalarOrSchedule,
          **head_arguments: Any) -> optax.GradientTransformation:
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

  The arguments after ``learning_rate`` are :func:`scale_by_adama`'s (but
  ``rounding_seed``), passed on to it as given.

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

  Returns:
    A :class:`optax.GradientTransformation`.

  Raises:
    TypeError: if ``num_micro_batches`` is not an integer, or (at ``init``)
      if a param leaf is not a float (or is complex where 8-bit moments
      would take it); for ``nu_estimator`` or ``split_floor``, which live in
      :mod:`optax_adama.contrib`.
    ValueError: if ``num_micro_batches < 1`` or is a JAX array (as
      ``optax.inject_hyperparams`` passes it: use
      :func:`optax_adama.inject_hyperparams`), if ``b1`` or ``b2`` is outside
      ``[0, 1)`` or ``eps`` / ``eps_root`` is negative, if ``nesterov`` is
      true.

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
      _adama.scale_by_adama(**head_arguments),
      optax.scale_by_learning_rate(_checks.real_hyperparam(learning_rate)))


@_checks.refuses_contrib_arguments
@_checks.takes_arguments_of(_adama.scale_by_adama, positional_after=("weight_decay", "mask"),
                            without=("rounding_seed",))
def adamaw(learning_rate: optax.ScalarOrSchedule, weight_decay: float = 1e-4,
           mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
           **head_arguments: Any) -> optax.GradientTransformation:
  r"""AdamA with decoupled weight decay, applied once per mini-batch.

  .. math::

    u_t = -\alpha_t \left( \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}
      + \lambda \theta_{t-1} \right)

  on the ``N``-th call of a mini-batch, zero on the others. Matches
  :func:`optax.adamw` for ``N = 1``. Schedules count mini-batches; see
  :func:`adama` for reading the learning rate during training.

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, num_micro_batches, nesterov,
      nu_dtype, quantization, stochastic_rounding: as in :func:`adama`
      (:func:`scale_by_adama`'s arguments but ``rounding_seed``, in
      ``optax.adamw``'s order).
    weight_decay: :math:`\lambda`, the decoupled weight decay rate.
    mask: as in :func:`optax.adamw`: a tree of booleans or a callable
      returning one; ``True`` leaves are decayed.

  Returns:
    A :class:`optax.GradientTransformation`; ``update`` needs ``params``.

  Raises:
    As :func:`adama` raises.

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
      _adama.scale_by_adama(**head_arguments),
      _add_decayed_weights(_checks.real_hyperparam(weight_decay), mask),
      optax.scale_by_learning_rate(_checks.real_hyperparam(learning_rate)))


def _add_decayed_weights(weight_decay: Any, mask: Any) -> optax.GradientTransformation:
  """``optax.add_decayed_weights`` with each param cast to its update's dtype.

  With float32 moments and bfloat16 params the update is float32; optax adds
  ``weight_decay * param`` by implicit promotion (float32 too, after rounding
  the product to bfloat16), which strict promotion refuses. Cast first, the
  product is float32 throughout. Schedules, masks and optax's state as optax's.
  """
  decay = optax.add_decayed_weights(weight_decay, mask)

  def update_fn(updates: optax.Updates, state: optax.OptState,
                params: Optional[optax.Params] = None) -> tuple[optax.Updates, optax.OptState]:
    if params is not None:
      params = jax.tree.map(
          lambda u, p: None if u is None else jnp.asarray(p).astype(u.dtype),
          updates, params, is_leaf=lambda x: x is None)
    return decay.update(updates, state, params)

  return optax.GradientTransformation(decay.init, update_fn)
