"""The fused training step: one jitted, buffer-donating call per mini-batch.

`microbatch_step` scans over the micro-batches of a mini-batch with
`jax.lax.scan`. With an AdamA transformation each micro-batch gradient goes
straight into the moments and is dropped, so no full gradient ever has to
exist; with any other transformation it does the gradient accumulation users
write by hand (a gradient-sum carry, one `update` on the mean), the baseline.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from optax_adama import _adama
from optax_adama import _chain
from optax_adama import _clipping
from optax_adama import _estimators
from optax_adama import _offload
from optax_adama import _placements
from optax_adama import _schedules
from optax_adama import _sharding
from optax_adama import _steps
from optax_adama._adama import ScaleByAdamAState
from optax_adama._adama import find_adama_state
from optax_adama._checks import check_num_micro_batches
from optax_adama._staged import StagedLoss

__all__ = ["microbatch_step"]

Batch = Any
Metrics = dict[str, Any]
# Per micro-batch, stacked by the scan: (loss, aux, dropped).
MicroBatchOutputs = tuple[jax.Array, Any, jax.Array]


def updates_every_micro_batch(opt_state: optax.OptState) -> bool:
  """Whether a transformation expects one ``update`` call per micro-batch.

  True when its state holds an AdamA state or an ``optax.MultiSteps`` state.
  """
  return _updates_every_micro_batch(opt_state, find_adama_state(opt_state))


def _updates_every_micro_batch(opt_state: optax.OptState,
                               adama_state: Optional[ScaleByAdamAState]) -> bool:
  is_multi_steps = lambda x: isinstance(x, optax.MultiStepsState)
  return adama_state is not None or any(
      map(is_multi_steps, jax.tree.leaves(opt_state, is_leaf=is_multi_steps)))


def microbatch_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    num_micro_batches: Optional[int] = None,
    has_aux: bool = False,
    update_every_micro_batch: Optional[bool] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
    shard_states: Optional[str] = None,
    data_axis: _sharding.AxisName = "data",
    accumulation_dtype: Optional[jax.typing.DTypeLike] = None,
) -> Callable[[optax.Params, optax.OptState, Batch], tuple[optax.Params, optax.OptState, Metrics]]:
  """Builds a jitted training step that scans over ``N`` micro-batches.

  ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` splits
  ``batch`` into ``N`` micro-batches and runs a :func:`jax.lax.scan` over them.
  Micro-batch ``i`` holds rows ``i, i + N, i + 2N, ...`` (a column-major
  reshape, as :func:`optax.microbatching.reshape_batch_axis`), so a batch axis
  sharded over devices stays sharded inside every micro-batch. ``params`` and
  ``opt_state`` are donated: their input buffers are reused for the outputs.

  Two modes, picked from the optimizer state unless forced:

  * one ``update`` per micro-batch (AdamA, ``optax.MultiSteps``): each
    micro-batch gradient is handed to ``tx.update`` and the (zero until the
    ``N``-th) updates applied. With AdamA the gradient is folded into the
    moments and dies there, so XLA can free each layer's gradient as soon as
    it is folded. A bare AdamA (``adama``, ``adamaw``, ``scale_by_adama``,
    ``mini_batch_chain``, optionally under ``offload_moments``) is not called
    per micro-batch: the scan only folds, with params fixed, and its
    direction and the transforms after it run once, after the ``N``-th fold:
    the same results without a params-sized read and write per micro-batch.
    That path takes each call to start a mini-batch, as the previous call
    leaves it; do not interleave your own ``tx.update`` calls on the same
    state mid-mini-batch. With :mod:`optax_adama.contrib`'s
    ``nu_estimator="auto"`` or ``"split"`` each micro-batch's gradient is
    taken as its two halves' (its first and second half of rows) in one
    vmapped backward, and their half difference goes to ``update`` as well;
    on a mesh each half's rows are split over the devices. ``"auto"`` does
    so where the rows halve (on a mesh: where each device holds rows of both
    halves) and folds as ``"mean"`` elsewhere; ``"split"`` raises there. The micro-batch's loss
    and gradient are then the mean of its halves' (its own for a loss
    averaged over equally weighted examples; close to it for a loss
    normalised by a data-dependent count, such as masked tokens); its aux
    the mean of the halves' floating leaves and the sum of their integer
    ones (counts).
  * gradient accumulation (anything else, e.g. ``optax.adam``): the scan carries
    a gradient sum, and ``tx.update`` is called once with the mean gradient.

  Non-finite micro-batches are dropped in every mode, the same way: a
  micro-batch whose loss is not finite contributes nothing, and non-finite
  gradient entries are taken as zero; ``metrics["num_dropped"]`` counts the
  micro-batches hit. The mean still divides by ``N``. If every micro-batch of
  a mini-batch is dropped, params stay unchanged (AdamA, accumulation; the
  optimizer state takes a zero-gradient step). ``optax.MultiSteps`` applies
  its mean of zeros like any other: use its ``should_skip_update_fn`` to skip.

  With ``mesh``, the step is data parallel on that mesh through GSPMD: the
  batch is split over ``data_axis``, each device scans over its own rows of
  every micro-batch, and ``shard_states`` chooses ZeRO-1 (m, v split over the
  devices), ZeRO-2 (also each micro-batch gradient reduce-scattered straight
  into the moment slices, so no device holds the whole reduced gradient) or
  FSDP (params split too). With a transformation that is not AdamA (e.g.
  ``optax.adam``) under ZeRO-2 or FSDP, each device accumulates its slice of
  the gradient sum: the sharded accumulation baseline. Results equal the
  single-device step up to float rounding. Place params and state with
  :func:`step_shardings` first so their buffers can be donated; run
  ``jax.distributed.initialize()`` first on several hosts.

  Args:
    loss_fn: ``loss_fn(params, micro_batch)`` returning the micro-batch *mean*
      loss, or ``(loss, aux)`` when ``has_aux``.
    tx: any optax transformation.
    num_micro_batches: ``N``, the number of micro-batches per mini-batch.
      With AdamA it is read from the optimizer state and may be left out;
      given, it must agree.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    update_every_micro_batch: force the mode; ``None`` picks it from the
      state: one ``update`` per micro-batch when it holds an AdamA or an
      ``optax.MultiSteps`` state, gradient accumulation otherwise.
    mesh: a :class:`jax.sharding.Mesh` to run data parallel on; ``None`` runs
      on the default device, as plain ``jax.jit``.
    shard_states: with ``mesh``: ``None`` (replicated params and state, the
      gradient all-reduced), ``"zero1"``, ``"zero2"`` or ``"fsdp"``. Under
      ``"fsdp"`` with a :class:`StagedLoss` as ``loss_fn`` each layer's params
      are gathered inside the layer scan, one layer at a time (place with
      :func:`optax_adama.sharding.stack_shardings`); with any other loss
      each leaf is split along its largest axis and GSPMD gathers it where
      the model reads it (inside the model's own layer scan, a layer at a
      time).
    data_axis: the mesh axis (or axes) the batch is split over; the batch size
      divided by ``N`` must be a multiple of its size.
    accumulation_dtype: gradient accumulation only: the dtype of the
      gradient-sum carry (``jnp.bfloat16``: half the accumulator of float32
      params, each micro-batch gradient rounded to nearest into it); ``None``
      keeps each param's dtype.

  Returns:
    The jitted step, with ``.lower(params, opt_state, batch)`` available.
    ``metrics["loss"]`` is the mean of the finite micro-batch losses,
    ``metrics["num_nonfinite_losses"]`` counts the others,
    ``metrics["num_dropped"]`` counts the micro-batches dropped, and with
    ``has_aux`` ``metrics["aux"]`` holds each micro-batch's aux, stacked.
    The transforms of a bare :func:`mini_batch_chain` get ``value=`` the
    mini-batch's loss (``metrics["loss"]``; NaN when every micro-batch was
    dropped), as ``optax.contrib.reduce_on_plateau`` reads it; ``update``
    gets no extra arguments on the other paths.

  Raises:
    ValueError: at construction if ``num_micro_batches < 1``. At the first
      call, before any buffer is used: if ``num_micro_batches`` differs from
      the AdamA state's, is missing without an AdamA state, or does not split
      the batch; or if two leaves of params and state are the same array
      (donation would hand one buffer over twice); or if AdamA's ``"split"``
      estimator meets micro-batches of odd size (on a mesh: of a size that
      is not a multiple of twice the data axis).

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
    >>> tx = optax_adama.adama(0.1, num_micro_batches=2)
    >>> step = optax_adama.microbatch_step(loss_fn, tx)  # N from the state
    >>> params = {"w": jnp.zeros(())}
    >>> state = tx.init(params)
    >>> batch = {"x": jnp.arange(4.0), "y": 2.0 * jnp.arange(4.0)}
    >>> params, state, metrics = step(params, state, batch)
    >>> # Micro-batch gradients -8 and -20: Adam's first step would be the rate,
    >>> # 0.1; AdamA's v (the default, "mean") is (8**2 + 20**2) / 2 = 232, not 14**2.
    >>> print(float(metrics["loss"]), round(float(params["w"]), 4))  # 0.1 * 14 / sqrt(232)
    14.0 0.0919

  References:
    Zhang et al., `Adam Accumulation ... <https://arxiv.org/abs/2305.19982>`_.
  """
  if num_micro_batches is not None:
    num_micro_batches = check_num_micro_batches(num_micro_batches)
  _sharding.check_shard_states(shard_states)
  if mesh is None and shard_states is not None:
    raise ValueError(f"shard_states={shard_states!r} needs a mesh.")
  # A non-finite loss poisons its gradient in the backward (AdamA then drops
  # the micro-batch; accumulation zeroes it).
  value_and_grad = _steps.value_and_finite_grad(
      _steps.naming_the_nnx_optimizer(loss_fn), has_aux=has_aux)
  if mesh is None:
    placement = _placements.single_device_placement(value_and_grad, has_aux)
  elif shard_states == "fsdp" and isinstance(loss_fn, StagedLoss):
    placement = _placements.staged_fsdp_placement(
        loss_fn, has_aux, _sharding.auto_mesh(mesh), data_axis)
  elif shard_states == "fsdp":
    placement = _placements.fsdp_placement(
        value_and_grad, has_aux, _sharding.auto_mesh(mesh), data_axis)
  else:
    placement = _placements.mesh_placement(
        value_and_grad, has_aux, _sharding.auto_mesh(mesh), shard_states, data_axis)
  placement = _placements.with_offloaded_state(placement, tx)
  step = _scan_step(tx, placement, num_micro_batches, update_every_micro_batch,
                    has_aux, accumulation_dtype)
  if mesh is None:
    return _steps.with_distinct_buffers(jax.jit(step, donate_argnums=(0, 1)))
  # Params and state keep the shardings they were placed with (the step
  # constrains its outputs to the same), the batch is split on arrival.
  jitted = jax.jit(
      step, donate_argnums=(0, 1),
      in_shardings=(None, None, _sharding.batch_sharding(mesh, data_axis)))
  def expected_shardings(params: optax.Params, opt_state: optax.OptState) -> tuple[Any, Any]:
    shardings = placement.shardings(params, opt_state)
    assert shardings is not None  # a mesh's placement has shardings
    return shardings.params, shardings.opt_state

  return _steps.with_distinct_buffers(
      jitted, placement.num_devices, data_axis, num_micro_batches, expected_shardings)


def _scan_step(tx: optax.GradientTransformation, placement: _placements.Placement,
               num_micro_batches: Optional[int], update_every_micro_batch: Optional[bool],
               has_aux: bool, accumulation_dtype: Optional[jax.typing.DTypeLike]) -> _steps.Step:
  """The step as a function of (params, opt_state, batch), before jit.

  Which path a step takes is decided here, once: when the step is built for
  ``tx`` (a bare AdamA folds itself: :func:`_fold_then_update`) and, at the
  top of its trace, for the state's structure (one ``update`` per
  micro-batch for AdamA or ``optax.MultiSteps`` inside other transforms,
  gradient accumulation otherwise). The paths take that decision as given;
  where AdamA sits inside other transforms, its new state is read back out
  of the new optimizer state (after each update, and for the metrics).
  """
  parts = _adama.folding_parts(tx)

  def step(params: optax.Params, opt_state: optax.OptState,
           batch: Batch) -> tuple[optax.Params, optax.OptState, Metrics]:
    shardings = placement.shardings(params, opt_state)
    if shardings is not None:
      params, opt_state = jax.lax.with_sharding_constraint(
          (params, opt_state), (shardings.params, shardings.opt_state))
    _schedules.check_schedules_count_mini_batches(opt_state)
    adama_state = find_adama_state(opt_state)
    n = _resolve_num_micro_batches(num_micro_batches, adama_state)
    micro_batches = placement.place_micro_batches(_steps.split_micro_batches(batch, n))
    per_micro = (_updates_every_micro_batch(opt_state, adama_state)
                 if update_every_micro_batch is None else update_every_micro_batch)
    run: Callable[..., tuple[optax.Params, optax.OptState, MicroBatchOutputs]]
    if per_micro and parts is not None:
      run = functools.partial(_fold_then_update, parts)
    elif per_micro:
      run = functools.partial(_per_micro_batch_updates, tx, adama_state)
    else:
      run = functools.partial(
          _accumulated_gradient_update, tx, accumulation_dtype=accumulation_dtype)
    params, opt_state, (losses, aux, dropped) = run(
        placement, params, opt_state, micro_batches)
    new_adama_state = find_adama_state(opt_state)
    if adama_state is not None and new_adama_state is not None:  # AdamA counted them.
      dropped = new_adama_state.num_dropped - adama_state.num_dropped
    metrics = _steps.step_metrics(losses, dropped, aux if has_aux else None)
    if shardings is not None:
      params, opt_state = jax.lax.with_sharding_constraint(
          (params, opt_state), (shardings.params, shardings.opt_state))
    return params, opt_state, metrics

  return step


def _per_micro_batch_updates(
    tx: optax.GradientTransformation, adama_state: Optional[ScaleByAdamAState],
    placement: _placements.Placement, params: optax.Params, opt_state: optax.OptState,
    micro_batches: Batch,
) -> tuple[optax.Params, optax.OptState, MicroBatchOutputs]:
  """One ``tx.update`` per micro-batch (AdamA inside other transforms, MultiSteps).

  ``adama_state``: the AdamA state inside ``opt_state``, or ``None``.
  """
  adama = adama_state is not None
  # The state's own update resolves "auto" from whether it gets a half difference.
  split = adama_state is not None and _steps.resolve_halves(
      adama_state, micro_batches, placement.num_devices)[1]
  update = optax.with_extra_args_support(tx).update

  def body(carry: tuple[optax.Params, optax.OptState],
           micro_batch: Batch) -> tuple[tuple[optax.Params, optax.OptState], MicroBatchOutputs]:
    params, opt_state = carry
    extra_args: dict[str, Any]
    if adama:  # AdamA drops (and counts) non-finite gradients itself.
      loss, aux, grads, extra_args = _adama_gradient(placement, params, micro_batch, split)
      dropped = jnp.array(False)
    else:
      loss, aux, grads = placement.loss_and_grads(params, micro_batch)
      (grads, dropped), extra_args = _zero_nonfinite(loss, grads), {}
    updates, opt_state = update(grads, opt_state, params, **extra_args)
    new_adama_state = find_adama_state(opt_state)
    emitted = None if new_adama_state is None else _adama.emitted(new_adama_state)
    params = placement.apply_updates(params, updates, emitted)
    return (params, opt_state), (loss, aux, dropped)

  (params, opt_state), outputs = jax.lax.scan(body, (params, opt_state), micro_batches)
  return params, opt_state, outputs


def _fold_then_update(
    parts: _adama.FoldingParts, placement: _placements.Placement, params: optax.Params,
    opt_state: optax.OptState, micro_batches: Batch,
) -> tuple[optax.Params, optax.OptState, MicroBatchOutputs]:
  """A bare AdamA: the scan only folds, then one update (``_per_micro_batch_updates``'s).

  The results of one ``tx.update`` per micro-batch, but params are a
  constant of the scan instead of its carry: AdamA's direction, the
  transforms after it and the params add run once, after the N-th fold,
  instead of gated to zero on every micro-batch (a params-sized read and
  write per micro-batch: on an H100 GPT-2 small's unrolled step was 7%
  slower than scan accumulation with it). It takes the scan to start a
  mini-batch, as every call of this step leaves it. Offloaded moments
  (``offload_moments``) come to the device around each fold and the update,
  as that wrapper's ``update`` brings them.
  """
  to_device, to_host = _offload.moves(parts.offload_min_size)
  name = _chain.adama_of(opt_state).nu_estimator
  state, split = _steps.resolve_halves(
      _chain.adama_of(opt_state), micro_batches, placement.num_devices)
  # "momentum" folds as "sum" and adds its m_hat**2 term once, after the scan.
  # (Offloaded moments are all on the device for the update below anyway.)
  momentum_after = _estimators.adds_momentum_after_fold(state, per_layer_offload=False)
  if momentum_after:
    state = _estimators.with_estimator(state, "sum")

  # clipped_by_global_norm's clip scales (and sketches) each gradient before
  # its fold, in the same scan.
  clip = None if parts.clip is None else parts.clip.transform(state.num_micro_batches)

  def body(carry: tuple[ScaleByAdamAState, Any],
           micro_batch: Batch) -> tuple[tuple[ScaleByAdamAState, Any], MicroBatchOutputs]:
    state, clip_state = carry
    loss, aux, grads, extra_args = _adama_gradient(placement, params, micro_batch, split)
    if clip is not None:
      extra_args = _clipping.scaled_extra_args(extra_args, clip_state.scale)
      grads, clip_state = clip.update(grads, clip_state)
    state = _adama.fold_micro_batch(grads, to_device(state), parts.config, **extra_args)
    return (to_host(state), clip_state), (loss, aux, jnp.array(False))

  (state, clip_state), outputs = jax.lax.scan(
      body, (state, to_device(_chain.clip_of(opt_state))), micro_batches)
  state = to_device(state)
  if momentum_after:
    state = _estimators.add_momentum_term(state, parts.config)
  updates = _adama.emitted_direction(state, params, parts.config)
  inner_state = None
  if parts.inner is not None:
    # value=: what optax.contrib.reduce_on_plateau reads, the mini-batch's loss.
    updates, inner_state = _chain.per_mini_batch_update(
        parts.inner, updates, state, to_device(_chain.inner_of(opt_state)), params,
        value=_steps.mean_finite_loss(outputs[0]))
  params = placement.apply_updates(params, updates, _adama.emitted(state))
  opt_state = _chain.with_adama(
      opt_state, _estimators.with_estimator(state, name), inner_state, clip_state)
  return params, to_host(opt_state), outputs


def _adama_gradient(
    placement: _placements.Placement, params: optax.Params, micro_batch: Batch, split: bool,
) -> tuple[jax.Array, Any, optax.Updates, dict[str, optax.Updates]]:
  """``(loss, aux, grads, extra_args)`` of a micro-batch, as AdamA takes them.

  A non-finite loss has poisoned the gradient already (the placements take it
  with :func:`_steps.value_and_finite_grad`), so AdamA drops the micro-batch;
  with ``split`` the gradient is the mean of the halves' and ``extra_args``
  holds their half difference.
  """
  if not split:
    loss, aux, grads = placement.loss_and_grads(params, micro_batch)
    return loss, aux, grads, {}
  loss, aux, grads, difference = _steps.loss_and_half_grads(
      placement.loss_and_grads, params, micro_batch)
  return loss, aux, grads, {"half_difference": difference}


def _accumulated_gradient_update(
    tx: optax.GradientTransformation, placement: _placements.Placement, params: optax.Params,
    opt_state: optax.OptState, micro_batches: Batch, *,
    accumulation_dtype: Optional[jax.typing.DTypeLike] = None,
) -> tuple[optax.Params, optax.OptState, MicroBatchOutputs]:
  """A gradient-sum carry over the micro-batches, one ``tx.update`` on the mean."""

  def body(grad_sum: optax.Updates,
           micro_batch: Batch) -> tuple[optax.Updates, MicroBatchOutputs]:
    loss, aux, grads = placement.loss_and_grads(params, micro_batch)
    grads, dropped = _zero_nonfinite(loss, grads)
    return jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads), (loss, aux, dropped)

  grad_sum = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=accumulation_dtype), params)
  shardings = placement.shardings(params, None)
  if shardings is not None:
    # Under ZeRO-2 / FSDP each device accumulates its slice only (as
    # DeepSpeed's ZeRO-2 does): the baseline AdamA is compared against.
    grad_sum = jax.lax.with_sharding_constraint(grad_sum, shardings.grads)
  grad_sum, outputs = jax.lax.scan(body, grad_sum, micro_batches)
  num_micro_batches = jax.tree.leaves(micro_batches)[0].shape[0]
  grads = jax.tree.map(
      lambda s, p: s.astype(p.dtype) / num_micro_batches, grad_sum, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  # Every micro-batch dropped: a zero-gradient step for the optimizer state,
  # none for params (AdamA's rule).
  any_kept = ~jnp.all(outputs[2])
  updates = jax.tree.map(lambda u: jnp.where(any_kept, u, jnp.zeros_like(u)), updates)
  return optax.apply_updates(params, updates), opt_state, outputs


def _resolve_num_micro_batches(given: Optional[int],
                               adama_state: Optional[ScaleByAdamAState]) -> int:
  """``N``: the AdamA state's (static), checked against the one given."""
  if adama_state is None:
    if given is None:
      raise ValueError(
          "microbatch_step needs num_micro_batches: the optimizer state holds "
          "no AdamA state to take it from.")
    return given
  if given is not None and given != adama_state.num_micro_batches:
    raise ValueError(
        f"microbatch_step(num_micro_batches={given}) but the optimizer was made "
        f"with num_micro_batches={adama_state.num_micro_batches}: every other "
        "step would be skipped. Leave num_micro_batches out of microbatch_step "
        "to take the optimizer's.")
  return adama_state.num_micro_batches


def _zero_nonfinite(loss: jax.Array, grads: optax.Updates) -> tuple[optax.Updates, jax.Array]:
  """(grads with non-finite entries and non-finite-loss micro-batches zeroed, dropped)."""
  loss_finite = jnp.isfinite(loss)
  leaves, treedef = jax.tree.flatten(grads)
  finite = [jnp.isfinite(g) for g in leaves]
  kept = [jnp.where(loss_finite & f, g, jnp.zeros_like(g)) for g, f in zip(leaves, finite)]
  # Counted, never gating the sum: no leaf waits for the others.
  all_finite = functools.reduce(
      operator.and_, [jnp.all(f) for f in finite], loss_finite)
  return treedef.unflatten(kept), ~all_finite


