"""The losses the models' heads take: cross-entropy and accuracy in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy(
    logits: Array, labels: Array, weights: Array | None = None,
    denominator: Array | float | None = None,
) -> tuple[Array, Array]:
  """Weighted mean softmax cross-entropy and accuracy, computed in float32.

  Args:
    logits: [..., num_classes] logits of any float dtype.
    labels: [...] int labels.
    weights: optional [...] float weights (e.g. 1 at masked-LM positions);
      None weighs every position equally.
    denominator: what the weighted sums are divided by; None: the weights'
      sum (at least 1).

  Returns:
    (mean loss, accuracy) as float32 scalars, both weighted by `weights`.
  """
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  if weights is None:
    return jnp.mean(nll), jnp.mean(correct)
  weights = weights.astype(jnp.float32)
  # max(., 1) so a micro-batch without any target gives 0, not NaN.
  total = jnp.maximum(jnp.sum(weights), 1.0) if denominator is None else denominator
  return jnp.sum(nll * weights) / total, jnp.sum(correct * weights) / total
