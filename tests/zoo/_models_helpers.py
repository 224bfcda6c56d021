"""Helpers of the test_models*.py modules: test configs, batches, losses and closed-form sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models

KINDS = ("gpt", "bert", "vit", "llama")
CAUSAL_LMS = (models.GPTConfig, models.LlamaConfig)


def make_batch(config: models.Config, *, batch_size: int = 4, seed: int = 0) -> dict:
  """A random batch in the model's format (shapes from the config)."""
  rng = np.random.default_rng(seed)
  if isinstance(config, CAUSAL_LMS):
    tokens = rng.integers(0, config.vocab_size, (batch_size, config.max_len + 1))
    return {"tokens": jnp.asarray(tokens, jnp.int32)}
  if isinstance(config, models.BERTConfig):
    shape = (batch_size, config.max_len)
    weights = np.zeros(shape, np.float32)
    weights[:, ::5] = 1.0
    return {
        "tokens": jnp.asarray(rng.integers(0, config.vocab_size, shape), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, config.vocab_size, shape), jnp.int32),
        "mask_weights": jnp.asarray(weights),
    }
  size, channels = config.image_size, config.num_channels
  return {
      "images": jnp.asarray(rng.random((batch_size, size, size, channels)), jnp.float32),
      "labels": jnp.asarray(rng.integers(0, config.num_classes, (batch_size,)), jnp.int32),
  }


def smoke_config(kind: str, **overrides) -> models.Config:
  """The 1-layer, width-128 config of a model kind."""
  return models.get_config(f"{kind}_test", **overrides)




@nnx.jit
def module_loss(model: models.Model, batch: dict) -> tuple[jax.Array, dict]:
  """`model.loss(batch)`, jitted: eager op-by-op dispatch is slower than compiling."""
  return model.loss(batch)


@nnx.jit
def module_call(model: models.Model, inputs: jax.Array) -> jax.Array:
  """`model(inputs)`, jitted."""
  return model(inputs)


def closed_form_count(config: models.Config) -> int:
  """Parameters counted by hand from the architecture, independent of the code."""
  d, L, m = config.hidden, config.num_layers, config.mlp_width
  if isinstance(config, models.LlamaConfig):
    # No biases: q and o of heads x head_dim, k and v of kv_heads x head_dim,
    # three SwiGLU matrices, two RMSNorm scales; a final norm; a head unless tied.
    q, kv = config.num_heads * config.head_size, config.num_kv_heads * config.head_size
    block = 2 * d * q + 2 * d * kv + 3 * d * m + 2 * d
    heads = 1 if config.tie_embeddings else 2
    return heads * config.vocab_size * d + L * block + d
  block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)
  if isinstance(config, models.GPTConfig):
    return config.vocab_size * d + config.max_len * d + L * block + 2 * d
  if isinstance(config, models.BERTConfig):
    embeddings = (config.vocab_size + config.max_len + config.type_vocab_size) * d + 2 * d
    pooler = d * d + d
    mlm_head = d * d + d + 2 * d + config.vocab_size
    return embeddings + L * block + pooler + mlm_head
  patch = config.patch_size**2 * config.num_channels
  embeddings = patch * d + d + d + (config.num_patches + 1) * d
  return embeddings + L * block + 2 * d + d * config.num_classes + config.num_classes
