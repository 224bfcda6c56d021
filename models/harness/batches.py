"""Batches of the zoo's formats for measuring a step: shapes to compile, values to time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import models


def abstract_batch(config: models.Config, batch_size: int, seq_len: int | None = None) -> dict:
  """ShapeDtypeStructs of a batch in the format the model's loss expects."""
  sds = jax.ShapeDtypeStruct
  if isinstance(config, (models.GPTConfig, models.LlamaConfig)):
    seq_len = seq_len or config.max_len
    return {"tokens": sds((batch_size, seq_len + 1), jnp.int32)}
  if isinstance(config, models.BERTConfig):
    seq_len = seq_len or config.max_len
    return {"tokens": sds((batch_size, seq_len), jnp.int32),
            "targets": sds((batch_size, seq_len), jnp.int32),
            "mask_weights": sds((batch_size, seq_len), jnp.float32)}
  size, channels = config.image_size, config.num_channels
  return {"images": sds((batch_size, size, size, channels), jnp.float32),
          "labels": sds((batch_size,), jnp.int32)}


def random_batch(config: models.Config, batch: dict, seed: int = 0) -> dict:
  """A concrete batch for timing (speed does not depend on the values)."""
  rng = np.random.default_rng(seed)
  vocab = getattr(config, "vocab_size", None)
  out = {}
  for name, leaf in batch.items():
    if name == "labels":
      out[name] = rng.integers(0, config.num_classes, leaf.shape).astype(np.int32)
    elif name == "mask_weights":
      out[name] = (rng.random(leaf.shape) < 0.15).astype(np.float32)
    elif leaf.dtype == jnp.int32:
      out[name] = rng.integers(0, vocab, leaf.shape).astype(np.int32)
    else:
      out[name] = rng.random(leaf.shape).astype(np.float32)
  return jax.tree.map(jnp.asarray, out)


def tokens_per_example(model_config: models.Config, batch: dict) -> int:
  """Positions the model processes per example (patches + CLS for the ViT)."""
  if isinstance(model_config, models.ViTConfig):
    return model_config.num_patches + 1
  length = batch["tokens"].shape[1]
  # GPT batches carry one extra token: the last target.
  causal_lm = isinstance(model_config, (models.GPTConfig, models.LlamaConfig))
  return length - 1 if causal_lm else length
