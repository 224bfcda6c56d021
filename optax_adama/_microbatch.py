"""The fused training step: one jitted, buffer-donating call per mini-batch.

`microbatch_step` scans over the micro-batches of a mini-batch with
`jax.lax.scan`. With an AdamA transformation each micro-batch gradient goes
straight into the moments and is dropped, so no full gradient ever has to
exist; with any other transformation it does the gradient accumulation users
write by hand (a gradient-sum carry, one `update` on the mean), the baseline.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax_adama import _sharding
from optax_adama._adama import ScaleByAdamAState
from optax_adama._adama import _adama_emitted
from optax_adama._adama import _check_num_micro_batches
from optax_adama._adama import find_adama_state

__all__ = ["microbatch_step", "split_micro_batches", "updates_every_micro_batch"]

Batch = Any
Metrics = dict[str, Any]


def split_micro_batches(batch: Batch, num_micro_batches: int) -> Batch:
  """Reshapes each leaf of ``batch`` from ``[B, ...]`` to ``[N, B // N, ...]``.

  Micro-batch ``i`` holds rows ``i, i + N, i + 2N, ...`` (a column-major
  reshape, as :func:`optax.microbatching.reshape_batch_axis`), so a batch axis
  sharded over devices stays sharded inside every micro-batch.

  Args:
    batch: a pytree of arrays sharing a leading batch axis.
    num_micro_batches: ``N``; must divide the batch size.

  Returns:
    The reshaped pytree.

  Raises:
    ValueError: if the leaves disagree on the batch size, or ``N`` does not
      divide it.
  """
  num_micro_batches = _check_num_micro_batches(num_micro_batches)
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("batch has no array leaves.")
  sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
  if None in sizes:
    raise ValueError("every batch leaf needs a leading batch axis; got a scalar.")
  if len(sizes) != 1:
    raise ValueError(
        f"batch leaves must share one leading batch size, got {sorted(sizes)}.")
  (batch_size,) = sizes
  if batch_size % num_micro_batches:
    raise ValueError(
        f"batch size {batch_size} does not split into "
        f"num_micro_batches={num_micro_batches} equal micro-batches.")
  return optax.microbatching.reshape_batch_axis(
      batch, batch_size // num_micro_batches)


def updates_every_micro_batch(opt_state: optax.OptState) -> bool:
  """Whether a transformation expects one ``update`` call per micro-batch.

  True when its state holds an AdamA state or an ``optax.MultiSteps`` state.
  """
  is_per_micro = lambda x: isinstance(x, (ScaleByAdamAState, optax.MultiStepsState))
  return any(
      is_per_micro(leaf)
      for leaf in jax.tree.leaves(opt_state, is_leaf=is_per_micro))


def microbatch_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    num_micro_batches: int,
    has_aux: bool = False,
    update_every_micro_batch: Optional[bool] = None,
    mesh: Optional[jax.sharding.Mesh] = None,
    shard_states: Optional[str] = None,
    data_axis: _sharding.AxisName = "data",
) -> Callable[[optax.Params, optax.OptState, Batch], tuple[optax.Params, optax.OptState, Metrics]]:
  """Builds a jitted training step that scans over ``N`` micro-batches.

  ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` splits
  ``batch`` into ``N`` micro-batches (see :func:`split_micro_batches`) and runs
  a :func:`jax.lax.scan` over them. ``params`` and ``opt_state`` are donated:
  their input buffers are reused for the outputs.

  Two modes, picked from the optimizer state unless forced:

  * one ``update`` per micro-batch (AdamA, ``optax.MultiSteps``): each
    micro-batch gradient is handed to ``tx.update`` and the (zero until the
    ``N``-th) updates applied. With AdamA the gradient is folded into the
    moments and dies there, so XLA can free each layer's gradient as soon as
    it is folded. A micro-batch whose loss is not finite is dropped whole
    (its gradient is replaced by NaN, which AdamA's leaf-local guard drops).
  * gradient accumulation (anything else, e.g. ``optax.adam``): the scan carries
    a gradient sum, and ``tx.update`` is called once with the mean gradient.

  With ``mesh``, the step is data parallel on that mesh through GSPMD (``jit``
  with ``in_shardings`` / ``out_shardings``, see :func:`step_shardings`): the
  batch is split over ``data_axis``, each device scans over its own rows of
  every micro-batch, and ``shard_states`` chooses ZeRO-1 (m, v split over the
  devices), ZeRO-2 (also each micro-batch gradient reduce-scattered straight
  into the moment slices, so no device holds the whole reduced gradient) or
  FSDP (params split too). With a transformation that is not AdamA (e.g.
  ``optax.adam``) under ZeRO-2 or FSDP, each device accumulates its slice of
  the gradient sum: the sharded accumulation baseline. Results equal the
  single-device step up to float rounding.
  Place params and state with :func:`step_shardings` first so their buffers
  can be donated; run ``jax.distributed.initialize()`` first on several hosts.

  Args:
    loss_fn: ``loss_fn(params, micro_batch)`` returning the micro-batch *mean*
      loss, or ``(loss, aux)`` when ``has_aux``.
    tx: any optax transformation.
    num_micro_batches: ``N``, the number of micro-batches per mini-batch.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    update_every_micro_batch: force the mode; ``None`` picks it from the state
      (see :func:`updates_every_micro_batch`).
    mesh: a :class:`jax.sharding.Mesh` to run data parallel on; ``None`` runs
      on the default device, as plain ``jax.jit``.
    shard_states: with ``mesh``: ``None`` (replicated params and state, the
      gradient all-reduced), ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
    data_axis: the mesh axis (or axes) the batch is split over; the batch size
      divided by ``N`` must be a multiple of its size.

  Returns:
    The jitted step, with ``.lower(params, opt_state, batch)`` available.
    ``metrics["loss"]`` is the mean of the finite micro-batch losses,
    ``metrics["num_nonfinite_losses"]`` counts the others, with AdamA
    ``metrics["num_dropped"]`` counts the micro-batches dropped, and with
    ``has_aux`` ``metrics["aux"]`` holds each micro-batch's aux, stacked.

  Raises:
    ValueError: at construction if ``num_micro_batches < 1``; at the first call
      if the batch does not split into ``N`` micro-batches.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
    >>> tx = optax_adama.adama(0.1, num_micro_batches=2)
    >>> step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=2)
    >>> params = {"w": jnp.zeros(())}
    >>> state = tx.init(params)
    >>> batch = {"x": jnp.arange(4.0), "y": 2.0 * jnp.arange(4.0)}
    >>> params, state, metrics = step(params, state, batch)
    >>> print(float(metrics["loss"]), round(float(params["w"]), 4))
    14.0 0.0919

  References:
    Zhang et al., `Adam Accumulation ... <https://arxiv.org/abs/2305.19982>`_.
  """
  num_micro_batches = _check_num_micro_batches(num_micro_batches)
  _sharding.check_shard_states(shard_states)
  if mesh is None and shard_states is not None:
    raise ValueError(f"shard_states={shard_states!r} needs a mesh.")
  if mesh is not None:
    mesh = _sharding.auto_mesh(mesh)
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def constrain(tree, shardings):
    return tree if mesh is None else jax.lax.with_sharding_constraint(tree, shardings)

  def shardings_of(params, opt_state):
    return _sharding.step_shardings(
        params, opt_state, mesh, shard_states=shard_states, data_axis=data_axis)

  def loss_and_grads(params, micro_batch):
    if mesh is not None:
      return _data_parallel_loss_and_grads(
          value_and_grad, has_aux, mesh, data_axis, shard_states,
          shardings_of(params, None), params, micro_batch)
    out, grads = value_and_grad(params, micro_batch)
    loss, aux = out if has_aux else (out, None)
    return loss, aux, grads

  def per_micro_batch_updates(params, opt_state, micro_batches):
    guard_loss = find_adama_state(opt_state) is not None

    def body(carry, micro_batch):
      params, opt_state = carry
      loss, aux, grads = loss_and_grads(params, micro_batch)
      if guard_loss:
        # A scalar-gated select per leaf: local, and fuses with the fold.
        loss_finite = jnp.isfinite(loss)
        grads = jax.tree.map(
            lambda g: jnp.where(loss_finite, g, jnp.full_like(g, jnp.nan)), grads)
      updates, opt_state = tx.update(grads, opt_state, params)
      if mesh is not None and shard_states in ("zero1", "zero2") and guard_loss:
        # Params are replicated but the updates come out sharded like m and v:
        # applying them all-gathers. AdamA's updates are exactly zero until
        # the N-th micro-batch, so gather only then.
        params = jax.lax.cond(
            _adama_emitted(find_adama_state(opt_state)),
            lambda: optax.apply_updates(params, updates), lambda: params)
      else:
        params = optax.apply_updates(params, updates)
      if mesh is not None:
        # Keep the carry where it started (replicated for ZeRO-1/2), or GSPMD
        # may shard it after the sharded update and gather it in every forward.
        params = constrain(params, shardings_of(params, None).params)
      return (params, opt_state), (loss, aux)

    (params, opt_state), (losses, aux) = jax.lax.scan(
        body, (params, opt_state), micro_batches)
    return params, opt_state, losses, aux

  def accumulated_gradient_update(params, opt_state, micro_batches):
    def body(grad_sum, micro_batch):
      loss, aux, grads = loss_and_grads(params, micro_batch)
      return jax.tree.map(jnp.add, grad_sum, grads), (loss, aux)

    grad_sum = jax.tree.map(jnp.zeros_like, params)
    if mesh is not None:
      # Under ZeRO-2 / FSDP each device accumulates its slice only (as
      # DeepSpeed's ZeRO-2 does): the baseline AdamA is compared against.
      grad_sum = constrain(grad_sum, shardings_of(params, None).grads)
    grad_sum, (losses, aux) = jax.lax.scan(body, grad_sum, micro_batches)
    grads = jax.tree.map(lambda g: g / num_micro_batches, grad_sum)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses, aux

  def step(params, opt_state, batch):
    micro_batches = split_micro_batches(batch, num_micro_batches)
    if mesh is not None:
      # [N, B / N, ...]: the row axis stays split over the devices (the
      # column-major split keeps each device's rows on that device).
      micro_batches = constrain(micro_batches, jax.tree.map(
          lambda _: NamedSharding(mesh, PartitionSpec(None, data_axis)),
          micro_batches))
    per_micro = (
        updates_every_micro_batch(opt_state)
        if update_every_micro_batch is None else update_every_micro_batch)
    run = per_micro_batch_updates if per_micro else accumulated_gradient_update
    dropped_before = _num_dropped(opt_state)
    params, opt_state, losses, aux = run(params, opt_state, micro_batches)
    finite = jnp.isfinite(losses)
    num_finite = jnp.sum(finite.astype(jnp.int32))
    metrics: Metrics = {
        "loss": jnp.sum(jnp.where(finite, losses, jnp.zeros_like(losses)))
        / num_finite.astype(losses.dtype),
        "num_nonfinite_losses": num_micro_batches - num_finite,
    }
    if dropped_before is not None:
      metrics["num_dropped"] = _num_dropped(opt_state) - dropped_before
    if has_aux:
      metrics["aux"] = aux
    return params, opt_state, metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=(0, 1))
  return _MeshStep(step, mesh, shardings_of, data_axis)


def _data_parallel_loss_and_grads(
    value_and_grad, has_aux, mesh, data_axis, shard_states, shardings,
    params, micro_batch):
  """One micro-batch's loss and gradient, data parallel over ``data_axis``.

  Written with ``shard_map`` rather than left to GSPMD so the gradient
  reduction is the collective ZeRO asks for on every backend: GSPMD on CPU
  lowers "all-reduce, then keep my slice" as exactly that (a full-leaf
  all-reduce), while ``psum_scatter`` is a reduce-scatter everywhere.
  """
  axis_names = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  num_devices = 1
  for name in axis_names:
    num_devices *= mesh.shape[name]
  param_specs = jax.tree.map(lambda s: s.spec, shardings.params)
  grad_specs = jax.tree.map(lambda s: s.spec, shardings.grads)

  def split_dim(spec):
    dims = [i for i, name in enumerate(spec) if name is not None]
    return dims[0] if dims else None

  def gather(p, spec):
    dim = split_dim(spec)
    return p if dim is None else jax.lax.all_gather(p, data_axis, axis=dim, tiled=True)

  def reduce_grad(g, spec):
    dim = split_dim(spec)
    if dim is None:  # all-reduce (plain data parallel, ZeRO-1, odd-sized leaves)
      return jax.lax.psum(g, data_axis) / num_devices
    # ZeRO-2 / FSDP: each device receives the sum of its slice only.
    return jax.lax.psum_scatter(
        g, data_axis, scatter_dimension=dim, tiled=True) / num_devices

  def reduce_aux(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jax.lax.pmean(x, data_axis)
    return jax.lax.psum(x, data_axis)  # counts add up over devices

  def local(params, micro_batch):
    # FSDP: gather each leaf for this device's forward and backward pass.
    params = jax.tree.map(gather, params, param_specs)
    # The params are the same on every device but their gradient is not:
    # mark them device-varying so the backward pass leaves the reduction to
    # reduce_grad instead of inserting an all-reduce of its own.
    params = jax.tree.map(lambda p: _to_varying(p, axis_names), params)
    out, grads = value_and_grad(params, micro_batch)
    loss, aux = out if has_aux else (out, None)
    grads = jax.tree.map(reduce_grad, grads, grad_specs)
    loss = jax.lax.pmean(loss, data_axis)
    if has_aux:
      return loss, jax.tree.map(reduce_aux, aux), grads
    return loss, grads

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


def _to_varying(x, axis_names):
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # where newer JAX keeps the varying axes
  vma = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
  missing = tuple(name for name in axis_names if name not in vma)
  if not missing:  # e.g. an FSDP leaf straight from all_gather
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


class _MeshStep:
  """``jax.jit(step)`` with shardings derived from the arguments' shapes.

  ``jit`` needs one sharding per leaf, which depends on the params tree; this
  builds (and caches) one jitted step per argument structure, with the same
  ``__call__`` / ``lower`` interface as a jitted function.
  """

  def __init__(self, step, mesh, shardings_of, data_axis):
    self._step = step
    self._mesh = mesh
    self._shardings_of = shardings_of
    self._data_axis = data_axis
    self._jitted: dict[Any, Any] = {}

  def _jit_for(self, params, opt_state, batch):
    key = jax.tree.map(
        lambda x: (tuple(jnp.shape(x)), jnp.dtype(x.dtype)),
        (params, opt_state, batch))
    key = (jax.tree.structure(key), tuple(jax.tree.leaves(key)))
    if key not in self._jitted:
      shardings = self._shardings_of(params, opt_state)
      batch_sharding = _sharding.batch_sharding(self._mesh, self._data_axis)
      replicated = NamedSharding(self._mesh, PartitionSpec())
      self._jitted[key] = jax.jit(
          self._step,
          in_shardings=(shardings.params, shardings.opt_state, batch_sharding),
          out_shardings=(shardings.params, shardings.opt_state, replicated),
          donate_argnums=(0, 1))
    return self._jitted[key]

  def __call__(self, params, opt_state, batch):
    return self._jit_for(params, opt_state, batch)(params, opt_state, batch)

  def lower(self, params, opt_state, batch):
    return self._jit_for(params, opt_state, batch).lower(params, opt_state, batch)

  def _cache_size(self) -> int:
    return sum(f._cache_size() for f in self._jitted.values())


def _num_dropped(opt_state: optax.OptState) -> Optional[jax.Array]:
  adama_state = find_adama_state(opt_state)
  return None if adama_state is None else adama_state.num_dropped
