"""The release on a mesh: where each leaf lives, and the data-parallel fold.

`release_shardings` / `stack_shardings` place params and state for a ZeRO
stage (a slice of every layer on each device; 8-bit moments in whole blocks);
the fold runs each device on its rows under `shard_map` with that stage's
reductions, and the update is applied to each device's slices.
"""

from __future__ import annotations

from typing import Any
from typing import Optional
from typing import Union

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from optax_adama import _chain
from optax_adama import _estimators
from optax_adama import _floor
from optax_adama import _fold
from optax_adama import _offload
from optax_adama import _quantize
from optax_adama import _release_fold
from optax_adama import _sharding
from optax_adama import _staged
from optax_adama import _steps
from optax_adama._adama import ScaleByAdamAState

__all__ = ["release_shardings", "stack_shardings"]


RELEASE_SHARD_STATES = (None, "zero1", "zero2", "fsdp")


def check_release_stage(mesh: Optional[Mesh], shard_states: Optional[str]) -> None:
  _sharding.check_shard_states(shard_states)
  if mesh is None and shard_states is not None:
    raise ValueError(f"shard_states={shard_states!r} needs a mesh.")
  if shard_states not in RELEASE_SHARD_STATES:
    raise NotImplementedError(
        f"release_step supports shard_states in {RELEASE_SHARD_STATES}, got "
        f"{shard_states!r}.")


def release_shardings(
    staged: _staged.StagedLoss,
    params: Any,
    opt_state: Any,
    mesh: jax.sharding.Mesh,
    *,
    shard_states: Optional[str] = "zero2",
    data_axis: _sharding.AxisName = "data",
) -> _sharding.StepShardings:
  """Where :func:`release_step` keeps params, optimizer state and gradients.

  :func:`step_shardings`' rule (a leaf split along the first dimension the
  data axis divides), except that a leaf of the stack is split along its
  first dimension *after* the layer axis: the release folds one layer at a
  time, and every device must hold its slice of that layer's moments.

  Args:
    staged: the model's :class:`StagedLoss` (where the stack is).
    params: a params tree (arrays or `jax.ShapeDtypeStruct`).
    opt_state: the AdamA state of ``params`` (``tx.init(params)``, or its
      ``jax.eval_shape``).
    mesh: the device mesh.
    shard_states: ``None``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
    data_axis: the mesh axis (or axes) the batch is split over.

  A state leaf in host memory (:func:`offload_moments`' ``init`` puts its
  large leaves there; :func:`moments.offloaded_state_shapes` for
  ``jax.eval_shape``) keeps its memory kind: each device holds its slice of
  it in host memory.

  8-bit moments (:class:`BlockQuantization`) are split where their params
  are: each device holds the whole blocks of its slice (a layer-aligned
  leaf's blocks of every layer, or a leaf's first axis) or, where each row
  is one block (a layer norm's scales; an embedding split along its width),
  a part of every block, whose scale the fold puts together across the
  devices. A leaf that fits neither way and has fewer blocks (per layer)
  than devices is kept whole on every device, its param and gradient too.

  Returns:
    A :class:`StepShardings`: ``jax.device_put(params, s.params)`` and
    ``jax.device_put(opt_state, s.opt_state)`` before the first step let the
    step donate them in place.

  Raises:
    ValueError: for an unknown ``shard_states``, or for an 8-bit moment with
      a block for each device that still does not split into whole blocks
      (the error names the leaf and the fix).
    NotImplementedError: for 8-bit moments of a stacked leaf whose blocks
      straddle layers (``layer_aligned=False``).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"], block=lambda layer, x, b: x @ layer["w"],
    ...     head=lambda outer, x, b: jnp.mean(x ** 2), layers="stack")
    >>> params = {"stack": {"w": jnp.zeros((4, 8, 8))}}
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=2)
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> s = optax_adama.sharding.release_shardings(staged, params, tx.init(params), mesh)
    >>> tuple(s.opt_state.adama.mu["stack"]["w"].spec)  # each device: a slice of every layer
    (None, 'data')
  """
  check_release_stage(mesh, shard_states)
  state = _chain.adama_of(opt_state)
  if isinstance(state, ScaleByAdamAState):
    _release_fold.check_moments(staged, params, state)
  shardings = stage_shardings(staged, params, opt_state, mesh, shard_states, data_axis,
                              align_blocks=True)
  # Offloaded leaves (offload_moments' init puts them in host memory) stay there.
  return shardings._replace(opt_state=_offload.in_host_memory(
      shardings.opt_state, _offload.host_leaves(opt_state)))


def stack_shardings(
    staged: _staged.StagedLoss,
    params: Any,
    opt_state: Any,
    mesh: jax.sharding.Mesh,
    *,
    shard_states: Optional[str] = "zero2",
    data_axis: _sharding.AxisName = "data",
) -> _sharding.StepShardings:
  """:func:`step_shardings` for a model in stages: stacked leaves split after the layer axis.

  What :func:`release_step` places (:func:`release_shardings`) and what
  :func:`microbatch_step` places for a :class:`StagedLoss` under
  ``shard_states="fsdp"``, where every device holds a slice of every layer
  and each layer's params are gathered inside the layer scan, one layer at
  a time. Any optimizer's state (its leaves shaped like params are split
  like them).

  Args:
    staged: the model's :class:`StagedLoss` (where the stack is).
    params: a params tree (arrays or `jax.ShapeDtypeStruct`).
    opt_state: its optimizer state (or its ``jax.eval_shape``).
    mesh: the device mesh.
    shard_states: ``None``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
    data_axis: the mesh axis (or axes) the batch is split over.

  Returns:
    A :class:`StepShardings`.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"], block=lambda layer, x, b: x @ layer["w"],
    ...     head=lambda outer, x, b: jnp.mean(x ** 2), layers="stack")
    >>> params = {"stack": {"w": jnp.zeros((4, 8, 8))}}
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=2)
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> s = optax_adama.sharding.stack_shardings(
    ...     staged, params, tx.init(params), mesh, shard_states="fsdp")
    >>> tuple(s.params["stack"]["w"].spec)  # a slice of every layer on each device
    (None, 'data')
  """
  return stage_shardings(staged, params, opt_state, mesh, shard_states, data_axis,
                         align_blocks=False)


# params / opt_state: their trees of arrays or jax.ShapeDtypeStruct, as release_shardings takes.
def stage_shardings(staged: _staged.StagedLoss, params: Any, opt_state: Any, mesh: Mesh,
                    shard_states: Optional[str], data_axis: _sharding.AxisName,
                    align_blocks: bool) -> _sharding.StepShardings:
  """:func:`stack_shardings`; ``align_blocks``: as :func:`release_step` folds 8-bit moments.

  The release folds each device's slice of a leaf inside ``shard_map``, so an
  8-bit moment must be split where its param is, whole blocks on each device
  (:func:`_sharding.quantized_sharding`); GSPMD (``microbatch_step``) takes
  the alignment of :func:`_sharding.step_shardings`, where a leaf that cannot
  split into whole blocks keeps its own split.
  """
  base = _sharding.step_shardings(
      params, opt_state, mesh, shard_states=shard_states, data_axis=data_axis)
  if shard_states is None:
    return base
  split = lambda tree: _stack_aware_shardings(staged, tree, mesh, data_axis)
  state = _chain.adama_of(opt_state)
  slices = split(params)
  if isinstance(state, ScaleByAdamAState):
    if align_blocks:
      slices = moment_slices(staged, params, opt_state, mesh, shard_states, data_axis)
      moments = lambda tree: _moment_shardings(slices, params, tree)
    else:
      moments = split
    state_shardings = _chain.adama_of(base.opt_state)._replace(
        mu=moments(state.mu), nu=moments(state.nu))
    if not align_blocks:
      state_shardings = _sharding.block_aligned_moments(
          state_shardings, state, params, slices, mesh, data_axis)
    opt_state_shardings = _chain.with_adama(
        base.opt_state, state_shardings, _chain.inner_of(base.opt_state))
  else:
    opt_state_shardings = base.opt_state
  grads = slices if shard_states in ("zero2", "fsdp") else base.grads
  param_shardings = slices if shard_states == "fsdp" else base.params
  return _sharding.StepShardings(param_shardings, opt_state_shardings, grads)


def moment_slices(staged: _staged.StagedLoss, params: Any, opt_state: Any, mesh: Mesh,
                  shard_states: Optional[str], data_axis: _sharding.AxisName) -> Any:
  """Per param, how the release splits its moments, in the param's layout:
  what each device folds (its gradient's slice) and updates."""
  if shard_states is None:
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
  slices = _stack_aware_shardings(staged, params, mesh, data_axis)
  state = _chain.adama_of(opt_state)
  return _block_aligned_slices(staged, slices, params, state.mu, mesh, data_axis)


def _splits_blocks(codes_spec: PartitionSpec) -> bool:
  """Whether the devices each hold a part of every block (the codes' last axis)."""
  dim = _sharding.split_dim(codes_spec)
  return dim is not None and dim == len(codes_spec) - 1


def _block_aligned_slices(staged: _staged.StagedLoss, slices: Any, params: Any, mu: Any,
                          mesh: Mesh, data_axis: _sharding.AxisName) -> Any:
  """``slices`` (each param's split) with the 8-bit moments' leaves that
  cannot split whole blocks kept whole on every device, or an error for
  those with a block for each device (where keeping them whole costs memory)."""
  num_devices = _sharding.num_devices(mesh, data_axis)
  replicated = NamedSharding(mesh, PartitionSpec())

  # param: an array or its jax.ShapeDtypeStruct; moment: its m leaf (or shapes).
  def align(path: jax.tree_util.KeyPath, sharding: NamedSharding, param: Any,
            moment: Any) -> NamedSharding:
    if not _release_fold.is_quantized(moment):
      return sharding
    shape = jnp.shape(param)
    if _sharding.quantized_sharding(moment, shape, sharding) is not None:
      return sharding
    blocks = moment.codes.shape[-2]
    if blocks < num_devices:
      return replicated
    raise ValueError(
        f"release_step(mesh=...) folds each device's slice of a leaf, and the "
        f"8-bit blocks of the moment of {jax.tree_util.keystr(path)} (shape {shape}, "
        f"codes {moment.codes.shape}) do not split into whole blocks along "
        f"{sharding.spec}: pass BlockQuantization(layer_aligned=True) and give the "
        f"dimension the devices split ({num_devices}) a size with whole blocks per "
        "device (e.g. pad it), or keep that leaf's moments dense (a larger min_size).")

  return jax.tree_util.tree_map_with_path(align, slices, params, mu,
                                          is_leaf=_release_fold.is_quantized)


def _moment_shardings(slices: Any, params: Any, moment: Any) -> Any:
  """A moment's shardings from its params' (``slices``, block-aligned)."""
  # param: an array or its jax.ShapeDtypeStruct; leaf: the moment's (or its shapes).
  def place(sharding: NamedSharding, param: Any,
            leaf: Any) -> Optional[Union[NamedSharding, _quantize.QuantizedArray]]:
    if _release_fold.is_quantized(leaf):
      return _sharding.quantized_sharding(leaf, jnp.shape(param), sharding)
    return sharding
  return jax.tree.map(place, slices, params, moment, is_leaf=_release_fold.is_quantized)


def _stack_aware_shardings(staged: _staged.StagedLoss, tree: Any, mesh: Mesh,
                           data_axis: _sharding.AxisName) -> Any:
  mesh = _sharding.auto_mesh(mesh)
  axis_size = _sharding.num_devices(mesh, data_axis)
  outer, stacked = staged.split(tree)
  outer = _sharding.sharded_tree_shardings(outer, mesh, data_axis=data_axis)
  stacked = jax.tree.map(
      lambda x: NamedSharding(mesh, PartitionSpec(
          None, *_sharding.shard_leaf_spec(jnp.shape(x)[1:], axis_size, data_axis))),
      stacked)
  return _staged.like(tree, staged.merge(outer, stacked))


# state_specs: a ScaleByAdamAState of PartitionSpecs; param_specs, slice_specs:
# trees of PartitionSpecs like params; offloaded: the (m, v, floor) flag trees.
def data_parallel_fold(staged: _staged.StagedLoss, parts: _release_fold.FoldingParts,
                       has_aux: bool, mesh: Mesh, shard_states: Optional[str],
                       data_axis: _sharding.AxisName, state_specs: Any, param_specs: Any,
                       slice_specs: Any, offloaded: tuple[Any, Any, Any],
                       params: optax.Params, state: ScaleByAdamAState,
                       micro_batch: _staged.Batch,
                       ) -> tuple[ScaleByAdamAState, jax.Array, Any]:
  """:func:`_release_fold.release_micro_batch` with each device on its rows,
  under ``shard_map``.

  Offloaded state leaves come in and leave in host memory, each device's
  slice of them (``shard_map`` keeps an operand's memory kind).
  """
  reductions = _data_parallel_reductions(
      staged, state_specs, param_specs, slice_specs, mesh, shard_states, data_axis)
  axis_names = _sharding.axis_names(data_axis)

  def local(params: optax.Params, state: ScaleByAdamAState, micro_batch: _staged.Batch,
            ) -> tuple[ScaleByAdamAState, jax.Array, Any]:
    if shard_states != "fsdp":
      # Replicated params, gradients that differ per device: marked varying,
      # the backward leaves the reduction to `reductions`.
      params = jax.tree.map(lambda p: _sharding.to_varying(p, axis_names), params)
    state, loss, aux, _ = _release_fold.release_micro_batch(
        staged, parts, has_aux, params, state, micro_batch, offloaded, reductions)
    return state, loss, aux

  replicated = PartitionSpec()
  halves = _estimators.takes_halves(state)  # [2, rows, ...]: each half's rows split
  rows = PartitionSpec(None, data_axis) if halves else PartitionSpec(data_axis)
  return jax.shard_map(
      local, mesh=mesh, in_specs=(param_specs, state_specs, rows),
      out_specs=(state_specs, replicated, replicated))(params, state, micro_batch)


def _data_parallel_reductions(staged: _staged.StagedLoss, state_specs: Any, param_specs: Any,
                              slice_specs: Any, mesh: Mesh, shard_states: Optional[str],
                              data_axis: _sharding.AxisName) -> _release_fold.Reductions:
  """The collectives of a ZeRO stage, for
  :func:`_release_fold.release_micro_batch` in ``shard_map``.

  ``slice_specs``: each leaf's split in its param's layout (:func:`moment_slices`).
  """
  num_devices = _sharding.num_devices(mesh, data_axis)
  outer_specs, stacked_specs = staged.split(slice_specs)
  is_spec = lambda x: isinstance(x, PartitionSpec)
  is_moment_spec = lambda x: is_spec(x) or _release_fold.is_quantized(x)
  # Per leaf, whether each device holds a part of every 8-bit block.
  splits_blocks = {kind: [_release_fold.is_quantized(x) and _splits_blocks(x.codes)
                          for x in jax.tree.leaves(tree, is_leaf=is_moment_spec)]
                   for kind, tree in zip(("outer", "layer"), staged.split(state_specs.mu))}
  pmax = lambda absmax: jax.lax.pmax(absmax, data_axis)
  outer_specs = jax.tree.leaves(outer_specs, is_leaf=is_spec)
  # A layer's slice is placed as its stacked moment, less the layer axis.
  layer_specs = [PartitionSpec(*spec[1:])
                 for spec in jax.tree.leaves(stacked_specs, is_leaf=is_spec)]

  axis_names = _sharding.axis_names(data_axis)
  outer_param_specs, stacked_param_specs = staged.split(param_specs)
  layer_param_specs = jax.tree.map(lambda s: PartitionSpec(*s[1:]), stacked_param_specs,
                                   is_leaf=is_spec)

  def gather(p: jax.Array, spec: PartitionSpec) -> jax.Array:
    # FSDP: this device's slice made whole (marked varying: its gradient is
    # reduced by `reduce`, not by the gather's transpose).
    dim = _sharding.split_dim(spec)
    if dim is not None:
      p = jax.lax.all_gather(p, data_axis, axis=dim, tiled=True)
    return _sharding.to_varying(p, axis_names)

  def reduce(grad: jax.Array, spec: PartitionSpec) -> jax.Array:
    if shard_states in ("zero2", "fsdp"):
      return _sharding.reduce_gradient(grad, spec, data_axis, num_devices)
    grad = _sharding.reduce_gradient(grad, PartitionSpec(), data_axis, num_devices)
    return local_slice(grad, spec, data_axis, num_devices)

  def all_finite(finite: jax.Array) -> jax.Array:
    # A non-finite entry may sit in another device's slice.
    return jax.lax.psum((~finite).astype(jnp.int32), data_axis) == 0

  def seed(s: Optional[jax.Array], spec: PartitionSpec) -> Optional[jax.Array]:
    # Each device rounds its own slice: its own noise. A leaf whole on every
    # device is rounded alike on each, so that it stays the same everywhere.
    if s is None or _sharding.split_dim(spec) is None:
      return s
    return _quantize.mix_seed(s, jax.lax.axis_index(data_axis).astype(jnp.uint32))

  def seeds(pairs: list[_fold.SeedPair],
            specs: list[PartitionSpec]) -> list[tuple[Optional[jax.Array], ...]]:
    return [tuple(seed(s, spec) for s in pair) for pair, spec in zip(pairs, specs)]

  def floor(increment: _floor.FactoredSquares, spec: PartitionSpec,
            leaf_shape: tuple[int, ...], slice_ndim: int) -> _floor.FactoredSquares:
    # Computed from this device's block of the gradient: whole again (and
    # the same on every device, as the state's replicated floor must be).
    dim = _sharding.split_dim(spec)
    if dim is None:
      return increment
    axes = _floor.factored_axes(dim, slice_ndim, leaf_shape)
    return _floor.FactoredSquares(*(
        _assembled(x, axis, data_axis, num_devices) for x, axis in zip(increment, axes)))

  def floors(increments: list[_floor.FactoredSquares], leaf_shapes: list[tuple[int, ...]],
             specs: list[PartitionSpec], layered: bool) -> list[_floor.FactoredSquares]:
    return [floor(inc, spec, shape, len(shape) - layered)
            for inc, spec, shape in zip(increments, specs, leaf_shapes)]

  return _release_fold.Reductions(
      loss=lambda loss: jax.lax.pmean(loss, data_axis),
      aux=lambda aux: jax.tree.map(lambda x: _sharding.reduce_aux(x, data_axis), aux),
      outer_grads=lambda grads: list(map(reduce, grads, outer_specs)),
      layer_grads=lambda grads: list(map(reduce, grads, layer_specs)),
      all_finite=all_finite,
      whole_block_absmax=lambda kind, i: pmax if splits_blocks[kind][i] else _release_fold.identity,
      layer_seeds=lambda pairs: seeds(pairs, layer_specs),
      # The outer leaves' seeds follow the stack's (see _fold_outer).
      outer_seeds=lambda pairs: seeds(pairs, layer_specs + outer_specs),
      outer_floors=lambda incs, shapes: floors(incs, shapes, outer_specs, False),
      layer_floors=lambda incs, shapes: floors(incs, shapes, layer_specs, True),
      outer_params=(lambda outer: jax.tree.map(gather, outer, outer_param_specs))
      if shard_states == "fsdp" else _release_fold.identity,
      layer_params=(lambda layer: jax.tree.map(gather, layer, layer_param_specs))
      if shard_states == "fsdp" else _release_fold.identity)


def _assembled(x: jax.Array, axis: Optional[int], data_axis: _sharding.AxisName,
               num_devices: int) -> jax.Array:
  """Inside ``shard_map``: the sum over devices of ``x``, each device's block
  placed at its offset along ``axis`` first (``None``: added as is)."""
  if axis is not None:
    size = x.shape[axis]
    whole = jnp.zeros(x.shape[:axis] + (size * num_devices,) + x.shape[axis + 1:], x.dtype)
    x = jax.lax.dynamic_update_slice_in_dim(
        whole, x, jax.lax.axis_index(data_axis) * size, axis)
  return jax.lax.psum(x, data_axis)


def local_slice(x: jax.Array, spec: PartitionSpec, data_axis: _sharding.AxisName,
                num_devices: int) -> jax.Array:
  """Inside ``shard_map``: this device's block of a replicated ``x`` under ``spec``."""
  dim = _sharding.split_dim(spec)
  if dim is None:
    return x
  size = x.shape[dim] // num_devices
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(data_axis) * size, size, dim)


def apply_sharded_updates(staged: _staged.StagedLoss, params: optax.Params,
                          updates: optax.Updates, slices: Any, mesh: Mesh,
                          data_axis: _sharding.AxisName) -> optax.Params:
  """Replicated params plus updates split like the moments, gathered in pieces.

  Each device adds its slice of the update to its slice of the params and
  all-gathers the sum into the params, the stack one layer at a time (a scan
  that updates the donated params in place): gathering the whole update
  first, as GSPMD does for ``params + updates``, keeps a parameter-sized
  buffer alive beside the params.
  """
  num_devices = _sharding.num_devices(mesh, data_axis)
  update_specs = partition_specs(slices)
  outer_specs, stacked_specs = staged.split(update_specs)

  def apply(p: jax.Array, u: jax.Array, spec: PartitionSpec) -> jax.Array:
    new = _steps.apply_updates(local_slice(p, spec, data_axis, num_devices), u)
    dim = _sharding.split_dim(spec)
    return new if dim is None else jax.lax.all_gather(new, data_axis, axis=dim, tiled=True)

  def apply_layer(stacked: optax.Params,
                  xs: tuple[jax.Array, optax.Updates]) -> tuple[optax.Params, None]:
    layer, layer_updates = xs
    layer_params = jax.tree.map(
        lambda p: jax.lax.dynamic_index_in_dim(p, layer, keepdims=False), stacked)
    new = jax.tree.map(lambda p, u, spec: apply(p, u, PartitionSpec(*spec[1:])),
                       layer_params, layer_updates, stacked_specs)
    return jax.tree.map(lambda p, n: jax.lax.dynamic_update_index_in_dim(p, n, layer, 0),
                        stacked, new), None

  def local(params: optax.Params, updates: optax.Updates) -> optax.Params:
    (outer, stacked), (outer_updates, stacked_updates) = map(staged.split, (params, updates))
    outer = jax.tree.map(apply, outer, outer_updates, outer_specs)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    stacked, _ = jax.lax.scan(
        apply_layer, stacked, (jnp.arange(num_layers, dtype=jnp.int32), stacked_updates))
    return _staged.like(params, staged.merge(outer, stacked))

  # Gathered leaves are the same on every device; shard_map's type check
  # cannot tell (all_gather's result counts as device-varying).
  return jax.shard_map(
      local, mesh=mesh, in_specs=(PartitionSpec(), update_specs),
      out_specs=PartitionSpec(), check_vma=False)(params, updates)


def partition_specs(shardings: Any) -> Any:  # a tree of NamedSharding -> of PartitionSpec
  return jax.tree.map(lambda s: s.spec, shardings)
