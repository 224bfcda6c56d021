"""Shardings for data-parallel AdamA over a `jax.sharding.Mesh` (ZeRO, FSDP).

The multi-device engine is JAX's own: :func:`microbatch_step` with ``mesh=``
jits the step with these `NamedSharding`s as ``in_shardings`` /
``out_shardings`` and lets GSPMD insert the collectives. This module only
decides *where* each array lives:

* the batch is split over the data axis (each device scans over its own rows
  of every micro-batch);
* ``shard_states`` picks what else is split over it, ZeRO-style:

  ==========  ======  ===========  ==========================================
  stage       params  m, v         gradient of a micro-batch
  ==========  ======  ===========  ==========================================
  ``None``    full    full         all-reduced (plain data parallel)
  ``"zero1"`` full    1/D each     all-reduced, then each device folds its
                                   slice
  ``"zero2"`` full    1/D each     reduce-scattered: no device ever holds the
                                   full gradient
  ``"fsdp"``  1/D     1/D each     reduce-scattered; params gathered by GSPMD
                                   where the forward pass needs them
  ==========  ======  ===========  ==========================================

A leaf is split along its first axis whose size the data axis divides (under
FSDP its largest such axis: the model's own layer scan then slices every
device's share), and kept whole when none does (scalars, odd sizes): small leaves cost little, and
one rule for params, moments and gradients keeps them aligned leaf by leaf,
so folding a reduce-scattered gradient into its moment slice needs no
communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Optional
from typing import Union

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from optax_adama import _adama
from optax_adama import _offload
from optax_adama import _quantize

__all__ = [
    "SHARD_STATES",
    "StepShardings",
    "shard_leaf_spec",
    "sharded_tree_shardings",
    "step_shardings",
    "batch_sharding",
]

SHARD_STATES = (None, "zero1", "zero2", "fsdp")

AxisName = Union[str, Sequence[str]]


class StepShardings(NamedTuple):
  """Shardings of a training step's arguments, each a tree of `NamedSharding`.

  Made by :func:`step_shardings` and :func:`release_shardings`, whose
  examples show one.
  """

  params: Any  # like params.
  opt_state: Any  # like the optimizer state.
  grads: Any  # like params: where each micro-batch gradient is reduced to.


def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis in GSPMD's ``Auto`` mode.

  ``jax.make_mesh`` makes ``Explicit`` axes by default (sharding in types),
  where ``with_sharding_constraint`` is refused; this step leaves the
  propagation to GSPMD instead, so it uses the same devices as Auto axes.
  """
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  if tuple(mesh.axis_types) == auto:
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def check_shard_states(shard_states: Optional[str]) -> Optional[str]:
  if shard_states not in SHARD_STATES:
    raise ValueError(
        f"shard_states must be one of {SHARD_STATES}, got {shard_states!r}.")
  return shard_states


def _axis_size(mesh: Union[Mesh, AbstractMesh], data_axis: AxisName) -> int:
  names = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  missing = [n for n in names if n not in mesh.shape]
  if missing:
    raise ValueError(
        f"data_axis {data_axis!r} is not in the mesh axes {tuple(mesh.shape)}: "
        "pass data_axis= one of them (the axis the batch is split over), or "
        f"make the mesh with an axis named {missing[0]!r}.")
  size = 1
  for name in names:
    size *= mesh.shape[name]
  return size


def shard_leaf_spec(
    shape: Sequence[int], axis_size: int, data_axis: AxisName = "data", *,
    largest: bool = False,
) -> PartitionSpec:
  """The `PartitionSpec` of a leaf of ``shape`` split ``axis_size`` ways.

  Args:
    shape: the leaf's shape.
    axis_size: the number of devices along the data axis.
    data_axis: the mesh axis (or axes) to split over.
    largest: split the largest dimension ``axis_size`` divides (the first
      of equals) rather than the first. FSDP's rule: a model's own
      ``lax.scan`` over layers slices the leading layer axis of its stacked
      params, and a leaf split along that axis is gathered whole to slice it.

  Returns:
    ``PartitionSpec`` naming ``data_axis`` at the chosen dimension, or the
    replicated ``PartitionSpec()`` if ``axis_size`` divides none.
  """
  dims = [dim for dim, size in enumerate(shape) if size >= axis_size and size % axis_size == 0]
  if not dims:
    return PartitionSpec()
  dim = max(dims, key=lambda d: shape[d]) if largest else dims[0]  # ties: the first
  return PartitionSpec(*([None] * dim), data_axis)


def sharded_tree_shardings(
    tree: Any, mesh: Mesh, *, data_axis: AxisName = "data", largest: bool = False
) -> Any:
  """A `NamedSharding` per leaf of ``tree``, each split over ``data_axis``.

  The mesh's axes are used in GSPMD's ``Auto`` mode. The rule of
  :func:`shard_leaf_spec`: the first dimension the data axis
  divides is split (the largest with ``largest``), other leaves are
  replicated. Moments, gradients and params of the same shape get the same
  sharding.

  Args:
    tree: a pytree of arrays or `jax.ShapeDtypeStruct` (e.g. params, or an
      optimizer state).
    mesh: the device mesh.
    data_axis: the mesh axis (or axes) to split over.

  Returns:
    A tree like ``tree`` of `NamedSharding`.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from optax_adama import _sharding
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> s = _sharding.sharded_tree_shardings({"w": jnp.zeros((4, 3))}, mesh)
    >>> print(s["w"].spec)
    P('data',)
  """
  mesh = auto_mesh(mesh)
  axis_size = _axis_size(mesh, data_axis)
  return jax.tree.map(
      lambda x: NamedSharding(
          mesh, shard_leaf_spec(jax.numpy.shape(x), axis_size, data_axis, largest=largest)),
      tree)


def replicated_shardings(tree: Any, mesh: Mesh) -> Any:
  """A replicated `NamedSharding` per leaf of ``tree``."""
  mesh = auto_mesh(mesh)
  return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


def step_shardings(
    params: Any,
    opt_state: Any,
    mesh: Mesh,
    *,
    shard_states: Optional[str] = "zero2",
    data_axis: AxisName = "data",
) -> StepShardings:
  """Shardings of params, optimizer state and gradients for a ZeRO stage.

  Use them to place the training state before the first step, e.g.
  ``params = jax.device_put(params, shardings.params)``, so that
  :func:`microbatch_step` can reuse (donate) the buffers in place.

  Args:
    params: a params tree (arrays or `jax.ShapeDtypeStruct`).
    opt_state: the optimizer state of ``params`` (``tx.init(params)``, or its
      ``jax.eval_shape``).
    mesh: the device mesh.
    shard_states: ``None`` (plain data parallel), ``"zero1"``, ``"zero2"`` or
      ``"fsdp"``; see the module docstring.
    data_axis: the mesh axis (or axes) the batch is split over.

  A state leaf in host memory (:func:`offload_moments`' ``init`` puts its
  large leaves there) keeps its memory kind: each device holds its slice of
  it in host memory.

  Returns:
    A :class:`StepShardings`.

  Raises:
    ValueError: for an unknown ``shard_states``.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax_adama
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> params = {"w": jnp.zeros((8, 2))}
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=2)
    >>> shardings = optax_adama.sharding.step_shardings(
    ...     params, tx.init(params), mesh, shard_states="zero2")
    >>> print(shardings.params["w"].spec, shardings.grads["w"].spec)
    P() P('data',)
  """
  check_shard_states(shard_states)
  mesh = auto_mesh(mesh)
  # FSDP splits each leaf along its largest axis (as hand-written FSDP loops do),
  # so a model's own layer scan slices a layer out of every device's share.
  largest = shard_states == "fsdp"
  sharded = lambda tree: sharded_tree_shardings(
      tree, mesh, data_axis=data_axis, largest=largest)
  replicated = lambda tree: replicated_shardings(tree, mesh)
  opt_state_shardings = (replicated(opt_state) if shard_states is None
                         else _replicated_floors(_sharded_state(
                             opt_state, mesh, data_axis, largest), mesh))
  if shard_states is not None:
    opt_state_shardings = block_aligned_moments(
        opt_state_shardings, opt_state, params, sharded(params), mesh, data_axis)
  return StepShardings(
      params=sharded(params) if shard_states == "fsdp" else replicated(params),
      # Offloaded leaves (offload_moments' init puts them in host memory) stay there.
      opt_state=_offload.in_host_memory(opt_state_shardings, _offload.host_leaves(opt_state)),
      grads=(sharded(params) if shard_states in ("zero2", "fsdp")
             else replicated(params)),
  )


def _sharded_state(opt_state: Any, mesh: Mesh, data_axis: AxisName, largest: bool) -> Any:
  """The optimizer state split as params of its shapes are; 8-bit codes along
  their blocks (:func:`block_aligned_moments` then aligns them to the params)."""
  is_quantized = lambda x: isinstance(x, _quantize.QuantizedArray)
  return jax.tree.map(
      lambda x: sharded_tree_shardings(
          x, mesh, data_axis=data_axis, largest=largest and not is_quantized(x)),
      opt_state, is_leaf=is_quantized)


def block_aligned_moments(opt_state_shardings: Any, opt_state: Any, params: Any,
                          param_slices: Any, mesh: Mesh, data_axis: AxisName) -> Any:
  """``opt_state_shardings`` with AdamA's 8-bit moments split where their
  gradients are (``param_slices``): each device then quantizes the blocks of
  its own slice of a gradient, with no resharding inside the step.

  Where a leaf's slices are not whole blocks (:func:`quantized_sharding` is
  ``None``) and it has fewer blocks than devices, the leaf is a few blocks,
  kept whole on every device; otherwise it keeps its own split, and GSPMD
  reshards between the two (a warning of "involuntary full rematerialization"
  names such a leaf).
  """
  is_quantized = lambda x: isinstance(x, _quantize.QuantizedArray)
  devices = num_devices(mesh, data_axis)
  replicated = NamedSharding(mesh, PartitionSpec())

  def align(param_slice: NamedSharding, param: jax.Array, moment: Any,
            moment_sharding: Any) -> Any:  # moment: a Moment, its sharding likewise
    # A gradient kept whole on every device: any split of its moment is a local slice.
    if not is_quantized(moment) or split_dim(param_slice.spec) is None:
      return moment_sharding
    aligned = quantized_sharding(moment, jnp.shape(param), param_slice)
    if aligned is not None:
      return aligned
    if moment.codes.shape[-2] < devices:
      return _quantize.QuantizedArray(codes=replicated, scale=replicated)
    return moment_sharding

  def per_state(state_shardings: Any, state: Any) -> Any:  # any node of the state trees
    if not isinstance(state, _adama.ScaleByAdamAState):
      return state_shardings
    moments = {}
    for name in ("mu", "nu"):
      moment = getattr(state, name)
      # Low-rank moments have their own tree (projected leaves): left as they are.
      if (jax.tree.structure(moment, is_leaf=is_quantized) != jax.tree.structure(params)
          or not any(map(is_quantized, jax.tree.leaves(moment, is_leaf=is_quantized)))):
        continue
      moments[name] = jax.tree.map(align, param_slices, params, moment,
                                   getattr(state_shardings, name), is_leaf=is_quantized)
    return state_shardings._replace(**moments)

  is_adama = lambda x: isinstance(x, _adama.ScaleByAdamAState)
  return jax.tree.map(per_state, opt_state_shardings, opt_state, is_leaf=is_adama)


def quantized_sharding(moment: _quantize.QuantizedArray, shape: Sequence[int],
                       sharding: NamedSharding) -> Optional[_quantize.QuantizedArray]:
  """The sharding of an 8-bit moment whose param is split as ``sharding``:
  each device holds the codes of its own slice; ``None`` if none does.

  A leaf's codes are its elements in row-major order, blocked along the last
  axis: ``[num_blocks, block_len]``, or ``[shape[0], blocks, block_len]``
  layer-aligned. A param split along an axis the codes keep (a layer-aligned
  leaf's first) splits them there; one split where each index before the
  split holds whole blocks splits the blocks' axis (a slice of every layer:
  whole blocks on each device); one split where each index before it is one
  block splits the blocks themselves (each device a part of every block, its
  scale put together across the devices).
  """
  spec = sharding.spec
  dim = split_dim(spec)
  codes_shape = moment.codes.shape
  kept = len(codes_shape) - 2  # leading axes of the leaf the codes keep
  codes_dim = None
  if dim is not None:
    if math.prod(codes_shape) != math.prod(shape):  # padded blocks
      return None
    devices = num_devices(sharding.mesh, spec[dim])
    before = math.prod(shape[kept:dim])
    candidates = ([dim] if dim < kept else
                  [axis for axis, fits in ((kept, before == 1),
                                           (kept + 1, before == codes_shape[kept])) if fits])
    codes_dim = next((a for a in candidates if codes_shape[a] % devices == 0), None)
    if codes_dim is None:
      return None
  named = lambda ndim: NamedSharding(sharding.mesh, PartitionSpec(
      *(spec[dim] if i == codes_dim else None for i in range(ndim))))
  return _quantize.QuantizedArray(codes=named(len(codes_shape)),
                                  scale=named(len(codes_shape) - 1))


def _replicated_floors(opt_state_shardings: Any, mesh: Mesh) -> Any:
  """``opt_state_shardings`` with AdamA's "split" floor replicated: it is a
  few vectors per leaf, and whole on every device each device can read the
  floor of its own slice without a collective."""
  def replicate_floor(x: Any) -> Any:  # any node of the shardings tree
    if isinstance(x, _adama.ScaleByAdamAState):
      return x._replace(nu_floor=replicated_shardings(x.nu_floor, mesh))
    return x

  return jax.tree.map(replicate_floor, opt_state_shardings,
                      is_leaf=lambda x: isinstance(x, _adama.ScaleByAdamAState))


def batch_sharding(mesh: Mesh, data_axis: AxisName = "data") -> NamedSharding:
  """The sharding of a batch: its leading (example) axis split over ``data_axis``.

  Args:
    mesh: the device mesh.
    data_axis: the mesh axis (or axes) the batch is split over.

  Returns:
    A ``NamedSharding``; ``jax.device_put(batch, it)`` places each device's rows.

  Examples:
    >>> import jax, numpy as np, optax_adama
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> tuple(optax_adama.sharding.batch_sharding(mesh).spec)
    ('data',)
  """
  mesh = auto_mesh(mesh)
  _axis_size(mesh, data_axis)
  return NamedSharding(mesh, PartitionSpec(data_axis))


# Inside a data-parallel step: where rows go, and the collectives that reduce
# one device's share of a micro-batch to the whole micro-batch's.


def place_micro_batch_rows(micro_batches: Any, mesh: Mesh, data_axis: AxisName) -> Any:
  """``[N, B / N, ...]`` micro-batches with the row axis split over the devices.

  The column-major split keeps each device's rows on that device.
  """
  row_split = NamedSharding(mesh, PartitionSpec(None, data_axis))
  return jax.lax.with_sharding_constraint(
      micro_batches, jax.tree.map(lambda _: row_split, micro_batches))


def axis_names(data_axis: AxisName) -> tuple[str, ...]:
  return (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)


def num_devices(mesh: Union[Mesh, AbstractMesh], data_axis: AxisName) -> int:
  """Devices along ``data_axis``; a ``ValueError`` naming the mesh's axes if absent."""
  return _axis_size(mesh, data_axis)


def split_dim(spec: PartitionSpec) -> Optional[int]:
  """The dimension a spec splits over the data axis; ``None`` if replicated."""
  dims = [i for i, name in enumerate(spec) if name is not None]
  return dims[0] if dims else None


def reduce_gradient(grad: jax.Array, spec: PartitionSpec, data_axis: AxisName,
                    num_devices: int) -> jax.Array:
  """Inside ``shard_map``: the device-mean of ``grad``, placed as ``spec`` says."""
  dim = split_dim(spec)
  if dim is None:  # all-reduce (plain data parallel, ZeRO-1, odd-sized leaves)
    return jax.lax.psum(grad, data_axis) / num_devices
  # ZeRO-2 / FSDP: each device receives the sum of its slice only.
  return jax.lax.psum_scatter(
      grad, data_axis, scatter_dimension=dim, tiled=True) / num_devices


def reduce_aux(x: jax.typing.ArrayLike, data_axis: AxisName) -> jax.Array:
  """Inside ``shard_map``: a float aux value averaged over devices, a count summed."""
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jax.lax.pmean(x, data_axis)
  return jax.lax.psum(x, data_axis)


def to_varying(x: jax.Array, axis_names: tuple[str, ...]) -> jax.Array:
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # where newer JAX keeps the varying axes
  vma = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
  missing = tuple(name for name in axis_names if name not in vma)
  if not missing:  # e.g. an FSDP leaf straight from all_gather
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)  # type: ignore[attr-defined]  # JAX before pcast
