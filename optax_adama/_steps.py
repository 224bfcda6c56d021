"""What both fused steps share: micro-batches, their halves, metrics, donation.

:func:`optax_adama.microbatch_step` and :func:`optax_adama.release_step` split
a mini-batch the same way, take the ``"split"`` estimator's halves the same
way, poison a micro-batch whose loss is not finite the same way (AdamA's
elementwise guard then drops it), report the same metrics and refuse the same
shared buffers before donating them. Nothing here knows which step calls it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from optax_adama import _adama
from optax_adama import _estimators
from optax_adama._checks import check_num_micro_batches

if TYPE_CHECKING:
  from optax_adama._state import ScaleByAdamAState

Batch = Any
Metrics = dict[str, Any]
# A fused training step: (params, opt_state, batch) -> (params, opt_state, metrics).
Step = Callable[[optax.Params, optax.OptState, Batch],
                tuple[optax.Params, optax.OptState, Metrics]]
# (params, micro_batch) -> (loss, aux, grads): one micro-batch's gradient.
LossAndGrads = Callable[[optax.Params, Batch], tuple[jax.Array, Any, optax.Updates]]


def naming_the_nnx_optimizer(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """``loss_fn``, whose Flax ``TraceContextError`` says what to use instead.

  A loss that merges a model whose Dropout streams (``RngCount``) or batch
  statistics it closed over from outside the jitted step mutates them inside the
  scan, and Flax refuses that with an error that names no way out. The library
  core does not import flax, so the error is recognised by its class's name.
  """

  @functools.wraps(loss_fn)
  def loss(*args: Any, **kwargs: Any) -> Any:
    try:
      return loss_fn(*args, **kwargs)
    except Exception as error:
      if type(error).__name__ == "TraceContextError":
        error.add_note(
            "optax_adama: the loss mutates Flax state it closed over (a Dropout's "
            "RngCount, BatchNorm's statistics) inside the jitted step, which is a "
            "pure function of (params, opt_state, batch). Use "
            "optax_adama.nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param) and "
            "opt.update(model, loss_fn, batch) with loss_fn(model, micro_batch): "
            "it carries the model's RNG streams and batch statistics through the "
            "micro-batches (docs/nnx.md, 'Dropout and other RNG streams').")
      raise

  return loss

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
  num_micro_batches = check_num_micro_batches(num_micro_batches)
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("batch has no array leaves.")
  if any(jnp.ndim(leaf) == 0 for leaf in leaves):
    raise ValueError("every batch leaf needs a leading batch axis; got a scalar.")
  sizes = {jnp.shape(leaf)[0] for leaf in leaves}
  if len(sizes) != 1:
    raise ValueError(
        f"batch leaves must share one leading batch size, got {sorted(sizes)}.")
  (batch_size,) = sizes
  if batch_size % num_micro_batches:
    raise ValueError(
        f"batch size {batch_size} does not split into "
        f"num_micro_batches={num_micro_batches} equal micro-batches: pass a batch of "
        f"a multiple of {num_micro_batches} rows (e.g. "
        f"{batch_size - batch_size % num_micro_batches or num_micro_batches}).")
  return jax.tree.map(functools.partial(
      _column_major_split, micro_batch_size=batch_size // num_micro_batches), batch)


def _column_major_split(x: jax.Array, micro_batch_size: int) -> jax.Array:
  """``[B, ...]`` to ``[B // micro_batch_size, micro_batch_size, ...]``, column-major.

  What :func:`optax.microbatching.reshape_batch_axis` does, written here
  because optax 0.2.8 compares JAX versions as strings and so, on JAX 0.10,
  skips its explicit-mesh branch. On a mesh with explicit axes the reshape
  must name its output sharding: the batch axis's moves to the micro-batch
  rows.
  """
  shape = (-1, micro_batch_size) + x.shape[1:]
  explicit = _explicit_sharding(x)
  if explicit is None:
    return x.reshape(shape, order="F")
  mesh, spec = explicit
  return x.reshape(shape, order="F",
                   out_sharding=jax.sharding.NamedSharding(mesh, jax.P(None, *spec)))


def _explicit_sharding(x: jax.Array) -> Optional[tuple[jax.sharding.Mesh, tuple[Any, ...]]]:
  """``(mesh, spec of every axis)`` of ``x``'s type on a mesh whose axes are
  all explicit (sharding in types); ``None`` elsewhere."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or not mesh.axis_names or not mesh.are_all_axes_explicit:
    return None
  return mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))


def _halvable(micro_batches: Batch, num_devices: int) -> bool:
  """Whether ``[N, B, ...]`` micro-batches split into two halves whose rows
  split evenly over ``num_devices`` devices."""
  return jax.tree.leaves(micro_batches)[0].shape[1] % (2 * num_devices) == 0


def check_halvable(micro_batches: Batch, num_devices: int = 1) -> None:
  """Raises unless ``[N, B, ...]`` micro-batches split into two halves whose
  rows split evenly over ``num_devices`` devices."""
  if not _halvable(micro_batches, num_devices):
    size = jax.tree.leaves(micro_batches)[0].shape[1]
    rule = "even" if num_devices == 1 else f"a multiple of 2 x {num_devices} devices"
    raise ValueError(
        "nu_estimator='split' takes the gradients of each micro-batch's two halves: "
        f"the micro-batch size must be {rule}, got {size}. Leave nu_estimator "
        "at its default ('mean'), which needs no halves, or use 'auto', which "
        "folds such micro-batches as 'mean'.")


def resolve_halves(state: ScaleByAdamAState, micro_batches: Batch,
                   num_devices: int = 1) -> tuple[ScaleByAdamAState, bool]:
  """The AdamA state as this step folds ``micro_batches``: ``(state, halves)``.

  ``halves`` says whether each micro-batch's gradient is taken as its two
  halves'. "split" needs them (and raises where the rows do not halve);
  "auto" takes them where the rows halve and is "mean" elsewhere (one
  example per micro-batch, an odd count). The returned state carries the
  resolved estimator; hand it back under its own name with
  ``_estimators.with_estimator``.
  """
  if not _estimators.wants_halves(state):
    return state, False
  if state.nu_estimator == "split":
    check_halvable(micro_batches, num_devices)
  halves = _halvable(micro_batches, num_devices)
  return _estimators.resolve_estimator(state, halves), halves


def halves(micro_batch: Batch) -> Batch:
  """``[B, ...]`` rows as ``[2, B / 2, ...]``: the micro-batch's two halves.

  The first and second half of the rows; on a mesh with explicit axes, rows
  ``0, 2, 4, ...`` and ``1, 3, 5, ...`` (a reshape there must keep the rows'
  sharding in its type, and two halves of a sharded axis have none).
  """
  def split(x: jax.Array) -> jax.Array:
    if _explicit_sharding(x) is not None:
      return _column_major_split(x, x.shape[0] // 2)
    return x.reshape((2, x.shape[0] // 2) + x.shape[1:])

  return jax.tree.map(split, micro_batch)


def mean_of_halves(pairs: Any) -> Any:  # trees of [2, ...] leaves
  """``(x_a + x_b) / 2`` of a tree of ``[2, ...]`` leaves (one per half)."""
  return jax.tree.map(lambda x: (x[0] + x[1]) / 2, pairs)


def combine_halves(pairs: Any) -> Any:  # (loss, aux) of [2, ...] leaves
  """A loss and aux of the whole micro-batch from its halves' ``[2, ...]`` leaves.

  Floating leaves are averaged (a mean over the examples, such as the loss or
  an accuracy, is the mean of the equal halves'); integer and boolean leaves
  are added, keeping their dtype (counts, such as tokens or correct
  predictions, add up).
  """
  def combine(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return (x[0] + x[1]) / 2
    return (x[0] + x[1]).astype(x.dtype)
  return jax.tree.map(combine, pairs)


def half_difference(pairs: Any) -> Any:  # trees of [2, ...] leaves
  """``(x_a - x_b) / 2`` of a tree of ``[2, ...]`` leaves (one per half)."""
  return jax.tree.map(lambda x: (x[0] - x[1]) / 2, pairs)


def loss_and_half_grads(
    loss_and_grads: LossAndGrads, params: optax.Params, micro_batch: Batch,
) -> tuple[jax.Array, Any, optax.Updates, optax.Updates]:
  """(loss, aux, (g_a + g_b) / 2, (g_a - g_b) / 2) over the micro-batch's halves.

  One vmapped backward over the two halves: the same FLOPs as the micro-batch's
  own, and each leaf's two gradients are alive only until it is folded.
  """
  loss, aux, grads = jax.vmap(loss_and_grads, in_axes=(None, 0))(params, halves(micro_batch))
  return (*combine_halves((loss, aux)), mean_of_halves(grads), half_difference(grads))


def value_and_finite_grad(fun: Callable[..., Any], has_aux: bool = False,
                          ) -> Callable[..., tuple[Any, optax.Updates]]:
  """``jax.value_and_grad(fun, has_aux=has_aux)`` whose gradient is NaN where
  the loss is not finite, so AdamA's elementwise guard drops the micro-batch.

  On a TPU or GPU the backward starts from a cotangent of 1 where the loss is
  finite and of NaN where it is not (NaN times any weight is NaN; entries no
  token reached stay 0, which the fold treats as it treats a dropped entry:
  ``b m``). It is the gate :func:`poison_if_loss_nonfinite` puts after the
  backward (as it still does on the CPU), put before it: libtpu (0.0.42.1) kept
  an unrolled FSDP model's gradients alive, whole, until that select (LLaMA-7B
  on a v3-8 at N = 2: 26.25 GiB of temporaries a core, against 4.69 GiB temp
  with this seed; docs/targets.md).
  """
  def value_and_grad(params: optax.Params, *args: Any) -> tuple[Any, optax.Updates]:
    if has_aux:
      loss, pullback, aux = jax.vjp(lambda p: fun(p, *args), params, has_aux=True)
    else:
      (loss, pullback), aux = jax.vjp(lambda p: fun(p, *args), params), None
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
      raise TypeError("the loss must be a real scalar (as jax.grad needs), got "
                      f"{jax.typeof(loss)}.")
    # Where each backend holds least (measured on a 2-layer MLP's AdamA step):
    # the seed on TPU (-31 KB) and GPU (even); XLA's CPU backend keeps a
    # gradient-sized buffer more for a seed it cannot fold (+0.94 P), so there
    # the gate stays a select after the backward.
    seed = jax.lax.platform_dependent(
        loss, cpu=jnp.ones_like,
        default=lambda x: jnp.where(jnp.isfinite(x), jnp.ones_like(x), jnp.full_like(x, jnp.nan)))
    (grads,) = pullback(seed)
    grads = jax.lax.platform_dependent(
        loss, grads, cpu=poison_if_loss_nonfinite, default=lambda _, g: g)
    return ((loss, aux) if has_aux else loss), grads

  return value_and_grad


def poison_if_loss_nonfinite(loss: jax.Array, grads: optax.Updates) -> optax.Updates:
  # A scalar-gated select per leaf: local, and fuses with AdamA's fold, whose
  # elementwise guard then drops the whole micro-batch and counts it.
  loss_finite = jnp.isfinite(loss)
  return jax.tree.map(
      lambda g: jnp.where(loss_finite, g, jnp.full_like(g, jnp.nan)), grads)


def mean_finite_loss(losses: jax.Array) -> jax.Array:
  """The mean of the finite entries of ``[N]`` micro-batch losses: the step's loss."""
  finite = jnp.isfinite(losses)
  return (jnp.sum(jnp.where(finite, losses, jnp.zeros_like(losses)))
          / jnp.sum(finite.astype(jnp.int32)).astype(losses.dtype))


def step_metrics(losses: jax.Array, dropped: jax.Array, aux: Any = None) -> Metrics:
  """A step's metrics from its ``[N]`` micro-batch losses and drop counts.

  ``loss`` averages the finite losses only; ``dropped`` is a count or ``[N]``
  flags; ``aux`` (stacked per micro-batch) is passed through when given.
  """
  num_finite = jnp.sum(jnp.isfinite(losses).astype(jnp.int32))
  metrics: Metrics = {
      "loss": mean_finite_loss(losses),
      "num_nonfinite_losses": losses.shape[0] - num_finite,
      "num_dropped": jnp.sum(jnp.asarray(dropped).astype(jnp.int32)),
  }
  if aux is not None:
    metrics["aux"] = aux
  return metrics


def with_distinct_buffers(jitted: jax.stages.Wrapped, num_devices: int = 1,
                          data_axis: Any = "data", num_micro_batches: Optional[int] = None,
                          expected_shardings: Optional[Callable] = None) -> Step:
  """``jitted`` with a check that no two donated leaves are one array.

  XLA refuses to donate one buffer twice ("Attempt to donate the same buffer
  twice") only when the step runs, in terms of flattened argument numbers.
  Params that share a leaf (tied weights stored twice, one ``jnp.zeros``
  reused) are caught here first, by leaf path. On a mesh (``num_devices >
  1``) the batch's rows are checked against the devices too, before ``jit``
  places the batch (whose own error names neither the step nor the fix), and
  ``expected_shardings(params, opt_state) -> (param shardings, state
  shardings)`` against the leaves already placed on the mesh (a leaf placed
  otherwise would be copied into place, and its donation lost). Leaves not
  yet on the mesh (fresh from ``tx.init``) are placed here: ``jit`` would
  place them too, but not ``offload_moments``' host leaves, which its
  ``init`` commits to one device.
  """

  @functools.wraps(jitted)
  def step(params: optax.Params, opt_state: optax.OptState,
           batch: Batch) -> tuple[optax.Params, optax.OptState, Metrics]:
    leaves = jax.tree.leaves((params, opt_state))
    if len({id(x) for x in leaves}) != len(leaves):
      raise_shared_leaves(params, opt_state)
    if num_devices > 1:
      check_rows_per_device(batch, opt_state, num_devices, data_axis, num_micro_batches)
    if expected_shardings is not None:
      expected = expected_shardings(params, opt_state)
      check_placement(params, opt_state, *expected)
      params, opt_state = place_off_mesh((params, opt_state), expected)
    return jitted(params, opt_state, batch)

  step.lower = jitted.lower  # type: ignore[attr-defined]  # as a jitted function's
  return step


def check_rows_per_device(batch: Batch, opt_state: optax.OptState, num_devices: int,
                          data_axis: Any,
                          num_micro_batches: Optional[int] = None) -> None:
  """Raises unless every micro-batch of ``batch`` gives each device as many rows.

  ``num_micro_batches``: the step's ``N``; ``None``: the AdamA state's.
  """
  state = _adama.find_adama_state(opt_state)
  n = num_micro_batches or (state.num_micro_batches if state is not None else None)
  sizes = {jnp.shape(x)[0] for x in jax.tree.leaves(batch) if jnp.ndim(x)}
  if n is None or len(sizes) != 1:
    return  # split_micro_batches names these while tracing
  (rows,) = sizes
  if rows % (n * num_devices):
    example = n * num_devices * max(1, rows // (n * num_devices))
    raise ValueError(
        f"batch has {rows} rows: on a mesh of {num_devices} devices along "
        f"{data_axis!r}, each of the N = {n} micro-batches must give every "
        f"device the same number of rows, so the batch needs a multiple of "
        f"N x {num_devices} = {n * num_devices} rows (e.g. {example}).")


# *_shardings: trees of NamedSharding like params and opt_state.
def check_placement(params: optax.Params, opt_state: optax.OptState, param_shardings: Any,
                    state_shardings: Any) -> None:
  """Raises for a leaf placed on the step's mesh with another sharding than the
  step keeps it in. Leaves not placed on a mesh (fresh from ``tx.init``) pass:
  the step places them, at the cost of a copy."""
  for name, tree, shardings in (("params", params, param_shardings),
                                ("opt_state", opt_state, state_shardings)):
    for (path, leaf), expected in zip(jax.tree_util.tree_leaves_with_path(tree),
                                      jax.tree.leaves(shardings)):
      sharding = getattr(leaf, "sharding", None)
      if not isinstance(sharding, jax.sharding.NamedSharding):
        continue
      if sharding.mesh.devices.shape != expected.mesh.devices.shape or (
          sharding.is_equivalent_to(expected, jnp.ndim(leaf))):
        continue
      memory = sharding.memory_kind != expected.memory_kind
      where = lambda s: f"{s.spec} in {s.memory_kind} memory" if memory else f"{s.spec}"
      raise ValueError(
          f"{name}{jax.tree_util.keystr(path)} is placed as {where(sharding)} but this "
          f"step keeps it as {where(expected)}: the step would copy it into place "
          "and lose its donation. Place params and state with the step's shardings "
          "before the first step (optax_adama.sharding.step_shardings for "
          "microbatch_step, release_shardings for release_step, with the same "
          "shard_states and data_axis" + (
              "; under offload_moments, from the state its init returns, whose "
              "large leaves it puts in host memory" if memory else "") + ").")


def place_off_mesh(tree: Any, shardings: Any) -> Any:  # any tree, its NamedShardings
  """``tree`` with its leaves not placed on the mesh of ``shardings`` (the
  leaves :func:`check_placement` lets through) put there."""
  def place(leaf: jax.Array, expected: jax.sharding.NamedSharding) -> jax.Array:
    sharding = getattr(leaf, "sharding", None)
    on_mesh = (isinstance(sharding, jax.sharding.NamedSharding)
               and sharding.mesh.devices.shape == expected.mesh.devices.shape)
    return leaf if on_mesh else jax.device_put(leaf, expected)
  return jax.tree.map(place, tree, shardings)


def raise_shared_leaves(params: optax.Params, opt_state: optax.OptState) -> None:
  first_path: dict[int, str] = {}
  for name, tree in (("params", params), ("opt_state", opt_state)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      where = name + jax.tree_util.keystr(path)
      if id(leaf) in first_path:
        raise ValueError(
            f"{first_path[id(leaf)]} and {where} are the same array, and the "
            "step donates its inputs: one buffer cannot be donated twice. "
            "Give each leaf its own buffer, e.g. params = jax.tree.map(jnp.copy, "
            "params) before tx.init(params), or keep a tied weight once in the "
            "tree.")
      first_path[id(leaf)] = where


def apply_updates(params: optax.Params, updates: optax.Updates) -> optax.Params:
  """``optax.apply_updates`` with its promotion spelled out.

  ``p + u`` in the two dtypes' promotion, cast back to ``p``'s: optax's values
  under JAX's standard promotion, and valid under strict promotion too, where
  AdamA hands bfloat16 params float32 updates (as ``optax.adam`` does when
  its moments are float32).
  """
  def add(p: jax.Array, u: jax.Array) -> jax.Array:
    with jax.numpy_dtype_promotion("standard"):
      dtype = jnp.promote_types(p.dtype, u.dtype)
    return (p.astype(dtype) + u.astype(dtype)).astype(p.dtype)
  return jax.tree.map(add, params, updates)
