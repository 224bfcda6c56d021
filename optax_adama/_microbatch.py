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

from optax_adama._adama import ScaleByAdamAState
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

  Args:
    loss_fn: ``loss_fn(params, micro_batch)`` returning the micro-batch *mean*
      loss, or ``(loss, aux)`` when ``has_aux``.
    tx: any optax transformation.
    num_micro_batches: ``N``, the number of micro-batches per mini-batch.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    update_every_micro_batch: force the mode; ``None`` picks it from the state
      (see :func:`updates_every_micro_batch`).

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
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)

  def loss_and_grads(params, micro_batch):
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
      params = optax.apply_updates(params, updates)
      return (params, opt_state), (loss, aux)

    (params, opt_state), (losses, aux) = jax.lax.scan(
        body, (params, opt_state), micro_batches)
    return params, opt_state, losses, aux

  def accumulated_gradient_update(params, opt_state, micro_batches):
    def body(grad_sum, micro_batch):
      loss, aux, grads = loss_and_grads(params, micro_batch)
      return jax.tree.map(jnp.add, grad_sum, grads), (loss, aux)

    grad_sum = jax.tree.map(jnp.zeros_like, params)
    grad_sum, (losses, aux) = jax.lax.scan(body, grad_sum, micro_batches)
    grads = jax.tree.map(lambda g: g / num_micro_batches, grad_sum)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses, aux

  def step(params, opt_state, batch):
    micro_batches = split_micro_batches(batch, num_micro_batches)
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

  return jax.jit(step, donate_argnums=(0, 1))


def _num_dropped(opt_state: optax.OptState) -> Optional[jax.Array]:
  adama_state = find_adama_state(opt_state)
  return None if adama_state is None else adama_state.num_dropped
