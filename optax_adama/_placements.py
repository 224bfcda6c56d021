"""Where a fused step's arrays live: one device, a data-parallel mesh, FSDP.

A :class:`Placement` is the set of hooks :func:`optax_adama.microbatch_step`'s scan
calls for one micro-batch's loss and gradient, the micro-batches' row placement,
the params add and the step's shardings; each layout (one device, data parallel
with or without ZeRO, FSDP on a plain or a staged loss) is one constructor here,
so the scan itself is written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Optional
from typing import Union

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from optax_adama import _adama
from optax_adama import _offload
from optax_adama import _sharding
from optax_adama import _steps
from optax_adama._release_mesh import stack_shardings
from optax_adama._staged import StagedLoss

Batch = Any
# (params, micro_batch) -> (loss, or (loss, aux) with has_aux; grads).
ValueAndGrad = Callable[[optax.Params, Batch], tuple[Any, optax.Updates]]
# (params, opt_state or None) -> the step's shardings.
Shardings = Callable[[optax.Params, Optional[optax.OptState]], _sharding.StepShardings]
# What a loss run under shard_map returns: (loss, aux, grads) with has_aux, else (loss, grads).
LocalOutputs = Union[tuple[jax.Array, Any, optax.Updates], tuple[jax.Array, optax.Updates]]


class Placement(NamedTuple):
  """Where the step's arrays live: the hooks the data-parallel step changes."""

  # (params, micro_batch) -> (loss, aux, grads); grads placed like `grad_shardings`.
  loss_and_grads: Callable[..., tuple[Any, Any, Any]]
  # (params, opt_state) -> StepShardings, or None on one device.
  shardings: Callable[[Any, Any], Optional[_sharding.StepShardings]]
  # (micro_batches) -> micro_batches, row axis placed.
  place_micro_batches: Callable[[Batch], Batch]
  # (params, updates, emitted) -> params; emitted is None where tx is not AdamA.
  apply_updates: Callable[[Any, Any, Optional[jax.Array]], Any]
  # How many devices share each micro-batch's rows.
  num_devices: int = 1


def with_offloaded_state(placement: Placement, tx: optax.GradientTransformation) -> Placement:
  """``placement`` keeping in host memory the state leaves that AdamA under
  :func:`offload_moments` offloads (its fold returns them to the host)."""
  parts = _adama.folding_parts(tx)
  if parts is None or parts.offload_min_size is None:
    return placement
  return placement._replace(shardings=lambda params, opt_state: _offload.keep_offloaded(
      placement.shardings(params, opt_state), opt_state, parts.offload_min_size))


def single_device_placement(value_and_grad: ValueAndGrad, has_aux: bool) -> Placement:
  def loss_and_grads(params: optax.Params,
                     micro_batch: Batch) -> tuple[jax.Array, Any, optax.Updates]:
    out, grads = value_and_grad(params, micro_batch)
    loss, aux = out if has_aux else (out, None)
    return loss, aux, grads

  return Placement(
      loss_and_grads=loss_and_grads,
      shardings=lambda params, opt_state: None,
      place_micro_batches=lambda micro_batches: micro_batches,
      apply_updates=lambda params, updates, emitted: _steps.apply_updates(params, updates))


def mesh_placement(value_and_grad: ValueAndGrad, has_aux: bool, mesh: Mesh,
                   shard_states: Optional[str], data_axis: _sharding.AxisName) -> Placement:
  def shardings(params: optax.Params,
                opt_state: Optional[optax.OptState]) -> _sharding.StepShardings:
    return _sharding.step_shardings(
        params, opt_state, mesh, shard_states=shard_states, data_axis=data_axis)

  def loss_and_grads(params: optax.Params,
                     micro_batch: Batch) -> tuple[jax.Array, Any, optax.Updates]:
    return _data_parallel_loss_and_grads(
        value_and_grad, has_aux, mesh, data_axis, shard_states,
        shardings(params, None), params, micro_batch)

  def place_micro_batches(micro_batches: Batch) -> Batch:
    return _sharding.place_micro_batch_rows(micro_batches, mesh, data_axis)

  def apply_updates(params: optax.Params, updates: optax.Updates,
                    emitted: Optional[jax.Array]) -> optax.Params:
    if shard_states in ("zero1", "zero2") and emitted is not None:
      # Params are replicated but AdamA's updates come out sharded like m
      # and v: applying them all-gathers. They are exactly zero until the
      # N-th micro-batch, so gather only then.
      params = jax.lax.cond(
          emitted, lambda: _steps.apply_updates(params, updates), lambda: params)
    else:
      params = _steps.apply_updates(params, updates)
    # Keep the carry where it started (replicated for ZeRO-1/2), or GSPMD may
    # shard it after the sharded update and gather it in every forward.
    return jax.lax.with_sharding_constraint(params, shardings(params, None).params)

  return Placement(loss_and_grads, shardings, place_micro_batches, apply_updates,
                    _sharding.num_devices(mesh, data_axis))


def _split_params_placement(loss_and_grads: _steps.LossAndGrads, shardings: Shardings,
                            mesh: Mesh, data_axis: _sharding.AxisName) -> Placement:
  """The placement of the FSDP steps: rows over ``data_axis``, and params kept
  split as ``shardings`` says after each update."""
  def apply_updates(params: optax.Params, updates: optax.Updates,
                    emitted: Optional[jax.Array]) -> optax.Params:
    del emitted
    params = _steps.apply_updates(params, updates)
    return jax.lax.with_sharding_constraint(params, shardings(params, None).params)

  return Placement(
      loss_and_grads, shardings,
      lambda micro_batches: _sharding.place_micro_batch_rows(micro_batches, mesh, data_axis),
      apply_updates, _sharding.num_devices(mesh, data_axis))


def fsdp_placement(value_and_grad: ValueAndGrad, has_aux: bool, mesh: Mesh,
                   data_axis: _sharding.AxisName) -> Placement:
  """FSDP for a plain loss: GSPMD gathers each param where the model reads it.

  Params, moments and each micro-batch's gradient are split as
  :func:`step_shardings` says for ``"fsdp"`` (each leaf along its largest
  axis). The loss runs on the split params without ``shard_map``, so the
  partitioner gathers a leaf where it is used: inside a model's own
  ``lax.scan`` over stacked layers, one layer's slice per iteration, as it
  does for a hand-written FSDP loop. The gradient is constrained to the
  params' split, which makes its reduction a reduce-scatter. (Gathering
  every leaf up front inside ``shard_map``, as the other stages do, held the
  whole model on every device: 66.34 GB a device for a 7B-shaped GPT.)
  """
  def shardings(params: optax.Params,
                opt_state: Optional[optax.OptState]) -> _sharding.StepShardings:
    return _sharding.step_shardings(
        params, opt_state, mesh, shard_states="fsdp", data_axis=data_axis)

  def loss_and_grads(params: optax.Params,
                     micro_batch: Batch) -> tuple[jax.Array, Any, optax.Updates]:
    out, grads = value_and_grad(params, micro_batch)
    loss, aux = out if has_aux else (out, None)
    grads = jax.lax.with_sharding_constraint(grads, shardings(params, None).grads)
    return loss, aux, grads

  return _split_params_placement(loss_and_grads, shardings, mesh, data_axis)


def staged_fsdp_placement(staged: StagedLoss, has_aux: bool, mesh: Mesh,
                          data_axis: _sharding.AxisName) -> Placement:
  """FSDP for a model in stages: each layer's params gathered inside the layer scan.

  Params, moments and gradients are split as :func:`stack_shardings` says (a
  slice of every layer on every device). Inside ``shard_map`` the outer leaves
  are gathered whole and each layer's slices are gathered as the scan reaches
  that layer, under ``jax.checkpoint`` so the backward gathers it again
  rather than keeping every layer's gathered params: no device holds more
  than a layer of gathered stack. The transpose of each gather is the
  reduce-scatter of that layer's gradient into the device's slice.
  """
  num_devices = _sharding.num_devices(mesh, data_axis)
  axis_names = _sharding.axis_names(data_axis)

  def shardings(params: optax.Params,
                opt_state: Optional[optax.OptState]) -> _sharding.StepShardings:
    return stack_shardings(staged, params, opt_state, mesh, shard_states="fsdp",
                           data_axis=data_axis)

  def gather(p: jax.Array, spec: PartitionSpec) -> jax.Array:
    dim = _sharding.split_dim(spec)
    if dim is None:  # a leaf no dimension of which the devices divide: replicated
      return _sharding.to_varying(p, axis_names)
    return jax.lax.all_gather(p, data_axis, axis=dim, tiled=True)

  def loss_and_grads(params: optax.Params,
                     micro_batch: Batch) -> tuple[jax.Array, Any, optax.Updates]:
    param_specs = jax.tree.map(lambda s: s.spec, shardings(params, None).params)
    outer_specs, stacked_specs = staged.split(param_specs)
    layer_specs = jax.tree.map(lambda s: PartitionSpec(*s[1:]), stacked_specs,
                               is_leaf=lambda x: isinstance(x, PartitionSpec))

    def local_loss(params: optax.Params, micro_batch: Batch) -> Any:  # loss, or (loss, aux)
      outer, stacked = staged.split(params)
      outer = jax.tree.map(gather, outer, outer_specs)
      x = staged.embed(outer, micro_batch)

      @jax.checkpoint
      def block(x: Any, layer: Any) -> Any:  # StagedLoss.block's activations, layer params
        return staged.block(jax.tree.map(gather, layer, layer_specs), x, micro_batch)

      x, _ = jax.lax.scan(lambda x, layer: (block(x, layer), None), x, stacked)
      return staged.head(outer, x, micro_batch)

    def local(params: optax.Params, micro_batch: Batch) -> LocalOutputs:
      out, grads = _steps.value_and_finite_grad(local_loss, has_aux=has_aux)(params, micro_batch)
      loss, aux = out if has_aux else (out, None)
      # Each gather's transpose summed the devices' gradients of their own
      # mean losses: divided by D, the gradient of the micro-batch's mean.
      grads = jax.tree.map(lambda g: g / num_devices, grads)
      loss = jax.lax.pmean(loss, data_axis)
      if has_aux:
        return loss, jax.tree.map(lambda x: _sharding.reduce_aux(x, data_axis), aux), grads
      return loss, grads

    return _shard_mapped(local, mesh, data_axis, has_aux, param_specs, param_specs,
                         params, micro_batch)

  return _split_params_placement(loss_and_grads, shardings, mesh, data_axis)


def _data_parallel_loss_and_grads(
    value_and_grad: ValueAndGrad, has_aux: bool, mesh: Mesh, data_axis: _sharding.AxisName,
    shard_states: Optional[str], shardings: _sharding.StepShardings, params: optax.Params,
    micro_batch: Batch) -> tuple[jax.Array, Any, optax.Updates]:
  """One micro-batch's loss and gradient, data parallel over ``data_axis``.

  Written with ``shard_map`` rather than left to GSPMD so the gradient
  reduction is the collective ZeRO asks for on every backend: GSPMD on CPU
  lowers "all-reduce, then keep my slice" as exactly that (a full-leaf
  all-reduce), while ``psum_scatter`` is a reduce-scatter everywhere.
  """
  axis_names = _sharding.axis_names(data_axis)
  num_devices = _sharding.num_devices(mesh, data_axis)
  param_specs = jax.tree.map(lambda s: s.spec, shardings.params)
  grad_specs = jax.tree.map(lambda s: s.spec, shardings.grads)

  def gather(p: jax.Array, spec: PartitionSpec) -> jax.Array:
    dim = _sharding.split_dim(spec)
    return p if dim is None else jax.lax.all_gather(p, data_axis, axis=dim, tiled=True)

  reduce_grad = lambda g, spec: _sharding.reduce_gradient(g, spec, data_axis, num_devices)
  reduce_aux = lambda x: _sharding.reduce_aux(x, data_axis)

  def local(params: optax.Params, micro_batch: Batch) -> LocalOutputs:
    # FSDP: gather each leaf for this device's forward and backward pass.
    params = jax.tree.map(gather, params, param_specs)
    # The params are the same on every device but their gradient is not:
    # mark them device-varying so the backward pass leaves the reduction to
    # reduce_grad instead of inserting an all-reduce of its own.
    params = jax.tree.map(lambda p: _sharding.to_varying(p, axis_names), params)
    out, grads = value_and_grad(params, micro_batch)
    loss, aux = out if has_aux else (out, None)
    grads = jax.tree.map(reduce_grad, grads, grad_specs)
    loss = jax.lax.pmean(loss, data_axis)
    if has_aux:
      return loss, jax.tree.map(reduce_aux, aux), grads
    return loss, grads

  return _shard_mapped(local, mesh, data_axis, has_aux, param_specs, grad_specs,
                       params, micro_batch)


# param_specs / grad_specs: trees of PartitionSpec like params. local returns
# LocalOutputs, typed Any: which of the two tuples is known from has_aux alone.
def _shard_mapped(local: Callable[[optax.Params, Batch], Any], mesh: Mesh,
                  data_axis: _sharding.AxisName, has_aux: bool, param_specs: Any,
                  grad_specs: Any, params: optax.Params,
                  micro_batch: Batch) -> tuple[jax.Array, Any, optax.Updates]:
  """``(loss, aux, grads)`` of ``local(params, micro_batch)`` under ``shard_map``:
  params placed by ``param_specs``, rows over ``data_axis``, the loss and aux
  replicated and the gradient placed by ``grad_specs``."""
  replicated = PartitionSpec()
  out_specs = ((replicated, replicated, grad_specs) if has_aux
               else (replicated, grad_specs))
  out = jax.shard_map(
      local, mesh=mesh, in_specs=(param_specs, PartitionSpec(data_axis)),
      out_specs=out_specs)(params, micro_batch)
  if has_aux:
    return out
  loss, grads = out
  return loss, None, grads
