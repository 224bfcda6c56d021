"""Gradient release for a scanned layer stack: AdamA folds one layer at a time.

With the layers' params stacked on a leading axis and applied under one
`jax.lax.scan`, the backward scan of autodiff emits the whole stack's gradient
as one array, and AdamA has to keep a stack-sized gradient alive to fold it.
`release_step` owns the backward instead: a reverse scan over the layers that,
from each layer's saved input, takes the `jax.vjp` of that layer, folds its
parameter cotangent into the layer's slice of m and v (in place, in the scan
carry) and passes the input cotangent on. One layer's gradient is alive at a
time. The math is `scale_by_adama`'s, leaf by leaf (`_fold.fold_leaf`, the fold kernel), and so are
the counters and the emitted direction.

The pieces: :mod:`optax_adama._staged` (the loss's form),
:mod:`optax_adama._release_fold` (one micro-batch's reverse scan) and
:mod:`optax_adama._release_mesh` (the mesh's shardings and data-parallel fold).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from optax_adama import _adama
from optax_adama import _chain
from optax_adama import _estimators
from optax_adama import _floor
from optax_adama import _fold
from optax_adama import _offload
from optax_adama import _release_fold
from optax_adama import _release_mesh
from optax_adama import _sharding
from optax_adama import _staged
from optax_adama import _steps
from optax_adama._adama import ScaleByAdamAState
from optax_adama._chain import MiniBatchChainState
from optax_adama._sharding import StepShardings

__all__ = ["release_step"]


def release_step(
    staged: _staged.StagedLoss,
    tx: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    mesh: Optional[jax.sharding.Mesh] = None,
    shard_states: Optional[str] = None,
    data_axis: _sharding.AxisName = "data",
) -> Callable[[optax.Params, optax.OptState, _staged.Batch],
              tuple[optax.Params, optax.OptState, _staged.Metrics]]:
  r"""A :func:`microbatch_step` for a scanned layer stack, with gradient release.

  ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, jitted
  with ``params`` and ``opt_state`` donated, splits ``batch`` into the ``N``
  micro-batches of the AdamA state and, for each, runs the forward pass (the
  blocks under a ``jax.lax.scan`` that saves each layer's input), then owns
  the backward: a reverse scan over the layers that recomputes layer
  :math:`l` from its input, takes its ``jax.vjp``, folds the parameter
  cotangent into rows :math:`l` of m and v and passes the input cotangent on.
  The head's and the embedding's gradients are folded once, summed. So one
  layer's gradient is alive at a time instead of the whole stack's.

  Params, state and metrics equal :func:`microbatch_step` on ``staged``
  (float rounding aside) with the same ``tx``: the same fold, non-finite
  guard, ``nu_estimator``, counters, direction, and the transforms of
  :func:`mini_batch_chain` (learning rate, weight decay) on the emitted
  direction. Each layer's forward is computed twice (as with
  ``remat="full"``): the price of keeping only its input. With
  ``nu_estimator="split"`` every stage runs on the micro-batch's two halves
  at once (vmapped) and each layer's gradient is taken per half, folded as
  their mean and half difference and dropped: the stack's gradient is never
  held, twice or once.

  What it asks of the model: a :class:`StagedLoss`, i.e. the loss written
  as embed, one block, head, with the block's params stacked. Flax NNX models
  built with ``nnx.vmap`` / ``nnx.scan`` over layers and MaxText's
  ``scan_layers`` already keep them so (``models.staged_loss`` does it for
  this project's models).

  Args:
    staged: the model's loss in stages.
    tx: an AdamA transformation: :func:`adama`, :func:`adamaw`,
      :func:`scale_by_adama`, or :func:`mini_batch_chain` of one; moments
      dense (float32, bfloat16) or 8-bit with
      ``BlockQuantization(layer_aligned=True)``, whose blocks tile each
      layer's slice (on a mesh each device holds its slice's codes: see
      :func:`release_shardings`). It may be under :func:`offload_moments`:
      the moments stay in host memory and each layer's slice is brought in
      for its fold and for its update, so the device holds one layer's
      moments at a time (and the outer leaves' while they are folded); on a
      mesh each device keeps its slice of them in host memory and brings in
      its part of each layer's (place the state with
      :func:`release_shardings` of ``tx.init(params)``, which keeps the
      leaves' memory kinds).
      Then the transforms of :func:`mini_batch_chain` run on one layer's
      slice at a time (each stacked leaf as a ``[1, ...]`` slice, so its rank
      is kept): they must act elementwise with a state of scalars, as the
      learning rate, schedules and weight decay of :func:`adama` and
      :func:`adamaw` do; a transform that reads the whole update (a
      global-norm clip) would see one layer.
    has_aux: whether ``staged.head`` returns ``(loss, aux)``.
    mesh: a :class:`jax.sharding.Mesh` to run data parallel on (each device
      folds its rows of every micro-batch; GSPMD and ``shard_map``, as
      :func:`microbatch_step` with ``mesh``); ``None`` runs on one device.
    shard_states: with ``mesh``: ``None`` (params and moments replicated,
      each layer's gradient all-reduced), ``"zero1"`` (moments split over
      the devices, each layer's gradient all-reduced and each device folds
      its slice), ``"zero2"`` (moments split, each layer's gradient
      reduce-scattered) or ``"fsdp"`` (params split too: each layer's are
      gathered as the forward scan reaches it and again in the release
      scan, so no device holds more than one layer of them gathered). A
      stacked leaf is split along a dimension other than the layer axis, so
      that every device holds a slice of every layer: place params and
      state with :func:`release_shardings`, not :func:`step_shardings`.
    data_axis: the mesh axis (or axes) the batch is split over.

  Returns:
    The jitted step, with ``.lower(params, opt_state, batch)``. Metrics as
    :func:`microbatch_step`'s: ``loss``, ``num_nonfinite_losses``,
    ``num_dropped`` and, with ``has_aux``, ``aux``.

  Raises:
    TypeError: if ``tx`` is not an AdamA transformation.
    ValueError: for ``shard_states`` without a mesh, or an unknown stage;
      at the first call, for ``nu_estimator="split"`` and micro-batches that
      do not split into two halves (of rows for every device, on a mesh),
      and on a mesh for 8-bit moments that do not split into whole blocks
      per device (:func:`release_shardings`), or for params or state placed
      on the mesh with other shardings or memory kinds than the step keeps
      them in (offloaded moments in device memory), before any buffer is
      donated.
    NotImplementedError: (at the first call) for a chained transform with a
      per-parameter state under :func:`offload_moments`, or for 8-bit
      moments of a stacked leaf whose blocks straddle layers
      (``layer_aligned=False``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"] @ outer["w_in"],
    ...     block=lambda layer, x, b: jnp.tanh(x @ layer["w"]),
    ...     head=lambda outer, x, b: jnp.mean((x @ outer["w_out"] - b["y"]) ** 2),
    ...     layers="stack")
    >>> keys = jax.random.split(jax.random.key(0), 3)
    >>> params = {"w_in": jax.random.normal(keys[0], (2, 4)),
    ...           "stack": {"w": jax.random.normal(keys[1], (8, 4, 4)) / 2},
    ...           "w_out": jax.random.normal(keys[2], (4, 1))}
    >>> tx = optax_adama.adamaw(1e-2, num_micro_batches=2)
    >>> step = optax_adama.release_step(staged, tx)
    >>> state = tx.init(params)
    >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}
    >>> params, state, metrics = step(params, state, batch)
    >>> int(state.adama.count), int(metrics["num_dropped"])
    (1, 0)

  References:
    Zhang et al., `Adam Accumulation ... <https://arxiv.org/abs/2305.19982>`_,
    section 3 ("gradient release").
  """
  _release_mesh.check_release_stage(mesh, shard_states)
  parts = _adama.folding_parts(tx, "release_step")
  if parts.clip is not None and mesh is not None:
    raise TypeError(
        "release_step takes clipped_by_global_norm on one device only so far (on a mesh "
        "each device sees its slices of the gradients, not the whole leaves the sketch "
        "indexes). Use microbatch_step with mesh= for a clipped AdamA on a mesh.")
  if mesh is not None:
    mesh = _sharding.auto_mesh(mesh)

  def step(params: optax.Params, opt_state: optax.OptState,
           batch: _staged.Batch) -> tuple[optax.Params, optax.OptState, _staged.Metrics]:
    staged.check_stack(params)
    _check_is_state_of_tx(opt_state, parts)
    shardings: Optional[StepShardings] = None
    slices: Any = None
    if mesh is not None:
      shardings = _step_shardings(staged, parts, params, opt_state, mesh, shard_states,
                                  data_axis)
      slices = _release_mesh.moment_slices(staged, params, opt_state, _sharding.auto_mesh(mesh),
                                           shard_states, data_axis)
      params, opt_state = _constrained((params, opt_state), shardings)
    state = _chain.adama_of(opt_state)
    micro_batches = _micro_batches(state, batch, mesh, data_axis)
    resolved, _ = _steps.resolve_halves(
        state, micro_batches, 1 if mesh is None else _sharding.num_devices(mesh, data_axis))
    momentum_after = _estimators.adds_momentum_after_fold(
        resolved, per_layer_offload=parts.offload_min_size is not None)
    if momentum_after:  # fold as "sum"; the m_hat**2 term follows the scan
      resolved = _estimators.with_estimator(resolved, "sum")
    offloaded = _release_fold.offloaded_state(state, parts)
    fold = _scan_body(staged, parts, has_aux, params, mesh, shard_states,
                      data_axis, shardings, slices, offloaded)
    to_device, to_host = _offload.moves(parts.offload_min_size)
    (folded, clip_state), (losses, aux) = jax.lax.scan(
        fold, (resolved, to_device(_chain.clip_of(opt_state))), micro_batches)
    if momentum_after:
      folded = _estimators.add_momentum_term(folded, parts.config)
    params, inner_state = _apply_emitted(
        staged, parts, params, folded, _chain.inner_of(opt_state),
        _steps.mean_finite_loss(losses),
        _sharded_update(staged, slices, shard_states, mesh, data_axis), offloaded,
        None if mesh is None or shardings is None else _split_by_layer(
            staged, slices, _release_mesh.partition_specs(_chain.adama_of(shardings.opt_state)),
            mesh, data_axis))
    opt_state = _chain.with_adama(
        opt_state, _estimators.with_estimator(folded, state.nu_estimator), inner_state,
        to_host(clip_state))
    if shardings is not None:
      # Back where they started: params replicated (the sharded update is
      # all-gathered once per step), moments split.
      params, opt_state = _constrained((params, opt_state), shardings)
    metrics = _steps.step_metrics(
        losses, folded.num_dropped - state.num_dropped, aux if has_aux else None)
    return params, opt_state, metrics

  if mesh is None:
    return _steps.with_distinct_buffers(jax.jit(step, donate_argnums=(0, 1)))
  jitted = jax.jit(step, donate_argnums=(0, 1),
                   in_shardings=(None, None, _sharding.batch_sharding(mesh, data_axis)))
  def expected_shardings(params: optax.Params, opt_state: optax.OptState) -> tuple[Any, Any]:
    assert mesh is not None  # only a step on a mesh checks shardings
    shardings = _step_shardings(staged, parts, params, opt_state, mesh, shard_states,
                                data_axis)
    return shardings.params, shardings.opt_state

  return _steps.with_distinct_buffers(
      jitted, _sharding.num_devices(mesh, data_axis), data_axis,
      expected_shardings=expected_shardings)


def _step_shardings(staged: _staged.StagedLoss, parts: _adama.FoldingParts,
                    params: optax.Params, opt_state: optax.OptState, mesh: Mesh,
                    shard_states: Optional[str], data_axis: _sharding.AxisName) -> StepShardings:
  """:func:`release_shardings` as the step keeps them: under
  :func:`offload_moments` the state leaves it offloads in host memory (decided
  by each whole leaf's size, as ``init`` places them, not by where they are)."""
  _release_fold.check_moments(staged, params, _chain.adama_of(opt_state))
  shardings = _release_mesh.stage_shardings(staged, params, opt_state, mesh, shard_states,
                                            data_axis, align_blocks=True)
  return _offload.keep_offloaded(shardings, opt_state, parts.offload_min_size)


def _check_is_state_of_tx(opt_state: optax.OptState, parts: _adama.FoldingParts) -> None:
  clipped = isinstance(opt_state, _chain.ClippedState)
  unclipped = opt_state.adama if clipped else opt_state
  chained = isinstance(unclipped, MiniBatchChainState)
  is_adama = isinstance(_chain.adama_of(opt_state), ScaleByAdamAState)
  if not is_adama or chained != (parts.inner is not None) or clipped != (parts.clip is not None):
    raise TypeError(
        f"opt_state ({type(opt_state).__name__}) is not the state of tx: "
        "pass tx.init(params).")


def _constrained(params_and_state: tuple[optax.Params, optax.OptState],
                 shardings: StepShardings) -> tuple[optax.Params, optax.OptState]:
  return jax.lax.with_sharding_constraint(
      params_and_state, (shardings.params, shardings.opt_state))


def _scan_body(
    staged: _staged.StagedLoss, parts: _adama.FoldingParts, has_aux: bool,
    params: optax.Params, mesh: Optional[Mesh], shard_states: Optional[str],
    data_axis: _sharding.AxisName, shardings: Optional[StepShardings], slices: Any,
    offloaded: tuple[Any, Any, Any],
) -> Callable[[tuple[ScaleByAdamAState, Any], _staged.Batch],
              tuple[tuple[ScaleByAdamAState, Any], tuple[jax.Array, Any]]]:
  """The scan body ``((state, clip state), micro_batch) -> (..., (loss, aux))``.

  ``offloaded``: :func:`_release_fold.offloaded_state` of the whole state.
  The clip state is ``clipped_by_global_norm``'s, ``None`` without it.
  """
  def fold(carry: tuple[ScaleByAdamAState, Any], micro_batch: _staged.Batch,
           ) -> tuple[tuple[ScaleByAdamAState, Any], tuple[jax.Array, Any]]:
    state, clip_state = carry
    if _estimators.takes_halves(state):
      # Halved before the devices take their rows: each device then holds
      # rows of both halves, and the halves are the micro-batch's own.
      micro_batch = _steps.halves(micro_batch)
    if mesh is None or shardings is None:
      clip = (None if parts.clip is None
              else (parts.clip.sketcher(clip_state, params), clip_state.sketch))
      state, loss, aux, sketch = _release_fold.release_micro_batch(
          staged, parts, has_aux, params, state, micro_batch, offloaded, clip=clip)
      if parts.clip is not None and sketch is not None:
        clip_state = parts.clip.advance(clip_state, sketch, state.num_micro_batches)
    else:
      state, loss, aux = _release_mesh.data_parallel_fold(
          staged, parts, has_aux, mesh, shard_states, data_axis,
          _estimators.with_estimator(_release_mesh.partition_specs(_chain.adama_of(shardings.opt_state)),
                                state.nu_estimator),
          _release_mesh.partition_specs(shardings.params),
          _release_mesh.partition_specs(slices), offloaded, params, state,
          micro_batch)
    return (state, clip_state), (loss, aux)
  return fold


def _sharded_update(
    staged: _staged.StagedLoss, slices: Any, shard_states: Optional[str], mesh: Optional[Mesh],
    data_axis: _sharding.AxisName,
) -> Optional[Callable[[optax.Params, optax.Updates], optax.Params]]:
  """``(params, updates) -> params`` for updates split like ZeRO's moments
  (``slices``: :func:`_release_mesh.moment_slices`).

  ``None`` where params and updates are whole on every device.
  """
  if shard_states in (None, "fsdp") or mesh is None:  # FSDP: params split as the update is
    return None
  return lambda params, updates: _release_mesh.apply_sharded_updates(
      staged, params, updates, slices, mesh, data_axis)


def _micro_batches(state: ScaleByAdamAState, batch: _staged.Batch, mesh: Optional[Mesh],
                   data_axis: _sharding.AxisName) -> _staged.Batch:
  """The state's ``N`` micro-batches of ``batch``, placed."""
  micro_batches = _steps.split_micro_batches(batch, state.num_micro_batches)
  if mesh is None:
    return micro_batches
  return _sharding.place_micro_batch_rows(micro_batches, mesh, data_axis)


def _apply_emitted(
    staged: _staged.StagedLoss, parts: _adama.FoldingParts, params: optax.Params,
    state: ScaleByAdamAState, inner_state: optax.OptState, loss: jax.Array,
    sharded_update: Optional[Callable[[optax.Params, optax.Updates], optax.Params]],
    offloaded: Optional[tuple[Any, Any, Any]] = None,
    split: Optional[Callable[..., tuple[optax.Params, optax.OptState]]] = None,
) -> tuple[optax.Params, optax.OptState]:
  """``(params, inner_state)`` after the mini-batch's update (zero unless it emits).

  The transforms after AdamA get ``value=loss``, the mini-batch's loss.

  ``sharded_update(params, updates)`` applies an update split like the
  moments (ZeRO); ``None``: params and update are whole on every device.
  Offloaded moments (``offloaded``: :func:`_release_fold.offloaded_state`) are applied a
  layer at a time; ``split(apply_by_layer) -> (params, inner_state)`` runs
  that on a ZeRO-1/2 mesh (:func:`_split_by_layer`).
  """
  if parts.offload_min_size is not None:
    apply = functools.partial(_apply_by_layer, staged, parts, offloaded=offloaded)
    if sharded_update is None or split is None:
      return apply(params, state, inner_state, loss)
    return split(apply, params, state, inner_state, loss)
  updates = _adama.emitted_direction(state, params, parts.config)
  if parts.inner is not None:
    updates, inner_state = _chain.per_mini_batch_update(
        parts.inner, updates, state, inner_state, params, value=loss)
  if sharded_update is None:
    return _steps.apply_updates(params, updates), inner_state
  return sharded_update(params, updates), inner_state


class _Split(NamedTuple):
  """Inside ``shard_map`` under ZeRO-1/2: each device's slices of whole
  params and the gather back, for the outer leaves and for ``[1, ...]``
  layer slices (flat lists of leaves)."""

  outer: Callable[[list], list]
  outer_whole: Callable[[list], list]
  layer: Callable[[list], list]
  layer_whole: Callable[[list], list]


_WHOLE = _Split(*[_release_fold.identity] * 4)


def _split_by_layer(
    staged: _staged.StagedLoss, slices: Any, state_specs: Any, mesh: Mesh,
    data_axis: _sharding.AxisName,
) -> Callable[..., tuple[optax.Params, optax.OptState]]:
  """``(apply_by_layer, params, state, inner_state, loss) -> (params, inner_state)``
  for offloaded moments under ZeRO-1/2: :func:`_apply_by_layer` in
  ``shard_map``, each device on its slice of each layer's moments (brought
  in from host memory), adding it to its slice of the params and gathering
  the layer, as :func:`_release_mesh.apply_sharded_updates` does."""
  num_devices = _sharding.num_devices(mesh, data_axis)
  outer_specs, stacked_specs = (jax.tree.leaves(tree, is_leaf=_is_spec)
                                for tree in staged.split(_release_mesh.partition_specs(slices)))

  def local(leaves: list[Any], specs: list[Any]) -> list[Any]:
    return [_release_mesh.local_slice(x, spec, data_axis, num_devices)
            for x, spec in zip(leaves, specs)]

  def whole(leaves: list[Any], specs: list[Any]) -> list[Any]:
    gather = lambda x, dim: jax.lax.all_gather(x, data_axis, axis=dim, tiled=True)
    return [x if _sharding.split_dim(spec) is None else gather(x, _sharding.split_dim(spec))
            for x, spec in zip(leaves, specs)]

  split = _Split(outer=lambda leaves: local(leaves, outer_specs),
                 outer_whole=lambda leaves: whole(leaves, outer_specs),
                 layer=lambda leaves: local(leaves, stacked_specs),
                 layer_whole=lambda leaves: whole(leaves, stacked_specs))

  def run(apply_by_layer: Callable[..., tuple[optax.Params, optax.OptState]],
          params: optax.Params, state: ScaleByAdamAState, inner_state: optax.OptState,
          loss: jax.Array) -> tuple[optax.Params, optax.OptState]:
    replicated = jax.tree.map(lambda _: PartitionSpec(), inner_state)
    specs = _estimators.with_estimator(state_specs, state.nu_estimator)
    # Gathered leaves are the same on every device (see _release_mesh.apply_sharded_updates).
    return jax.shard_map(
        lambda p, st, i, l: apply_by_layer(p, st, i, l, split=split), mesh=mesh,
        in_specs=(PartitionSpec(), specs, replicated, PartitionSpec()),
        out_specs=(PartitionSpec(), replicated), check_vma=False)(
            params, state, inner_state, loss)

  return run


_is_spec = lambda x: isinstance(x, PartitionSpec)


def _apply_by_layer(
    staged: _staged.StagedLoss, parts: _adama.FoldingParts, params: optax.Params,
    state: ScaleByAdamAState, inner_state: optax.OptState, loss: jax.Array,
    offloaded: Optional[tuple[Any, Any, Any]] = None, split: _Split = _WHOLE,
) -> tuple[optax.Params, optax.OptState]:
  """``(params, inner_state)`` after the emitted update, a layer at a time.

  For offloaded moments: the direction of a whole stacked leaf would bring
  the stack's moments to the device at once. Here the outer leaves are
  updated first, then a scan over the layers brings in one layer's slice of
  m and v, computes its direction, runs ``inner`` on it and adds it to the
  layer's params in place. ``inner`` sees params-shaped trees whose other
  leaves are zeros it does not use (elementwise transforms, checked by their
  state); its state advances once, from the outer call, and it gets
  ``value=loss``, the mini-batch's loss. ``offloaded``:
  :func:`_release_fold.offloaded_state` of the whole state (``None``: of ``state``);
  ``split``: under ZeRO-1/2 in ``shard_map``, each device's slices
  (:func:`_split_by_layer`).
  """
  inner = parts.inner
  if inner is not None and any(jnp.ndim(x) > 0 for x in jax.tree.leaves(inner_state)):
    raise NotImplementedError(
        "release_step with offload_moments runs the transforms chained after "
        "AdamA one layer at a time, which needs them elementwise with a state "
        "of scalars (learning rate, schedule, weight decay); this chain keeps "
        "per-parameter state.")
  if offloaded is None:
    offloaded = _release_fold.offloaded_state(state, parts)
  emit = _adama.emitted(state)
  direction = _adama.direction_args(state, parts.config)

  def leaf_direction(m: _fold.Moment, v: _fold.Moment, p: jax.Array,
                     floor: Optional[jax.Array], m_offloaded: bool,
                     v_offloaded: bool) -> jax.Array:
    m, v = _offload.to_device(m, m_offloaded), _offload.to_device(v, v_offloaded)
    return _fold.gated_direction_of_leaf(m, v, p, emit, direction, floor)

  def chained(outer: Any, stacked: Any, outer_params: Any,
              stacked_params: Any) -> tuple[optax.Updates, optax.OptState]:
    """``inner`` on the tree of ``outer`` and ``stacked`` updates."""
    updates = _staged.like(params, staged.merge(outer, stacked))
    if inner is None:
      return updates, inner_state
    return _chain.per_mini_batch_update(
        inner, updates, state, inner_state,
        _staged.like(params, staged.merge(outer_params, stacked_params)), value=loss)

  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  outer, stacked = staged.split(params)
  (mu_outer, mu_stacked), (nu_outer, nu_stacked) = map(staged.split, (state.mu, state.nu))
  (mu_off_outer, mu_off_stacked), (nu_off_outer, nu_off_stacked) = map(
      staged.split, offloaded[:2])
  outer_def, stacked_def = jax.tree.structure(outer), jax.tree.structure(stacked)
  if _estimators.floors_split(state):
    floor_outer, floor_stacked = staged.split(_offload.to_device(state.nu_floor, offloaded[2]))
    outer_floors = split.outer(
        [_floor.floor_estimate(f) for f in outer_def.flatten_up_to(floor_outer)])
    stacked_floors = stacked_def.flatten_up_to(floor_stacked)
  else:
    outer_floors, stacked_floors = [None] * outer_def.num_leaves, None
  # Under ZeRO-1/2 this device's slices of the (whole) outer params.
  local_outer = outer_def.unflatten(split.outer(jax.tree.leaves(outer)))
  outer_dirs = outer_def.unflatten([
      leaf_direction(m, v, p, f, m_off, v_off)
      for m, v, p, f, m_off, v_off in zip(
          outer_def.flatten_up_to(mu_outer), outer_def.flatten_up_to(nu_outer),
          jax.tree.leaves(local_outer), outer_floors,
          outer_def.flatten_up_to(mu_off_outer), outer_def.flatten_up_to(nu_off_outer))])
  updates, new_inner_state = chained(outer_dirs, zeros(stacked), local_outer, stacked)
  new_outer = outer_def.unflatten(split.outer_whole(jax.tree.leaves(
      _steps.apply_updates(local_outer, staged.split(updates)[0]))))

  mus, nus = stacked_def.flatten_up_to(mu_stacked), stacked_def.flatten_up_to(nu_stacked)
  # Read only here: what came to the device is dropped after the scan.
  (mus, mu_flags, _), (nus, nu_flags, _) = (
      _release_fold.on_device_whole(moments, stacked_def.flatten_up_to(flags))
      for moments, flags in ((mus, mu_off_stacked), (nus, nu_off_stacked)))
  flags = list(zip(mu_flags, nu_flags))
  num_layers = jax.tree.leaves(stacked)[0].shape[0]

  def update_layer(stacked: Any, layer: jax.Array) -> tuple[Any, None]:
    # [1, ...] slices: the chained transforms see each leaf at its rank.
    layer_params = stacked_def.unflatten(split.layer([
        jax.lax.dynamic_slice_in_dim(p, layer, 1, 0) for p in jax.tree.leaves(stacked)]))
    floors = ([None] * len(mus) if stacked_floors is None else
              split.layer([_floor.floor_layer_estimate(f, layer) for f in stacked_floors]))
    dirs = stacked_def.unflatten([
        leaf_direction(_release_fold.layer_slice(m, layer, num_layers, keepdims=True),
                       _release_fold.layer_slice(v, layer, num_layers, keepdims=True), p, f, *flag)
        for m, v, p, f, flag in zip(mus, nus, jax.tree.leaves(layer_params), floors, flags)])
    updates, _ = chained(zeros(local_outer), dirs, local_outer, layer_params)
    new = split.layer_whole(jax.tree.leaves(
        _steps.apply_updates(layer_params, staged.split(updates)[1])))
    return stacked_def.unflatten([
        jax.lax.dynamic_update_slice_in_dim(p, n, layer, 0)
        for p, n in zip(jax.tree.leaves(stacked), new)]), None

  stacked, _ = jax.lax.scan(update_layer, stacked, jnp.arange(num_layers, dtype=jnp.int32))
  return _staged.like(params, staged.merge(new_outer, stacked)), new_inner_state
