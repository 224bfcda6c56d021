"""GPT-2 style decoder-only language model (Radford et al., 2019) in Flax NNX.

Learned positional embedding, pre-LN blocks with causal self-attention and a 4x
tanh-GELU MLP, a final LayerNorm, and an LM head tied to the token embedding.
Biases and LayerNorm epsilon follow GPT-2, so the presets reproduce the published
parameter counts (124M, 355M, 774M, 1.56B).

Batch format for `GPT.loss`: {"tokens": int32[batch, seq_len + 1]}; the model
reads tokens[:, :-1] and predicts tokens[:, 1:].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import layers
from models import savers

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GPTConfig(layers.TransformerConfig):
  """Hyper-parameters of a `GPT` model.

  The block stack's fields (`num_layers`, `hidden`, `num_heads`, `mlp_dim`,
  `remat`, dtypes) come from `models.layers.TransformerConfig`.

  Attributes:
    vocab_size: number of token ids (50257 for GPT-2's BPE, 256 for bytes).
    max_len: context length (number of learned positions).
    loss_chunks: 1 forms the whole ``[tokens, vocab]`` logits for the loss;
      more takes the loss over that many chunks of tokens
      (``models.savers.chunked_cross_entropy``: one chunk's logits alive at
      a time, recomputed in the backward). Same loss and gradient.
  """

  vocab_size: int = 50257
  max_len: int = 1024
  loss_chunks: int = 1

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.loss_chunks, int) or self.loss_chunks < 1:
      raise ValueError(f"loss_chunks must be a positive int, got {self.loss_chunks!r}")

  @classmethod
  def gpt2_small(cls, **overrides: Any) -> GPTConfig:
    """GPT-2 small: 12 layers, width 768, 12 heads (124M parameters)."""
    return cls(**{"num_layers": 12, "hidden": 768, "num_heads": 12, **overrides})

  @classmethod
  def gpt2_medium(cls, **overrides: Any) -> GPTConfig:
    """GPT-2 medium: 24 layers, width 1024, 16 heads (355M parameters)."""
    return cls(**{"num_layers": 24, "hidden": 1024, "num_heads": 16, **overrides})

  @classmethod
  def gpt2_large(cls, **overrides: Any) -> GPTConfig:
    """GPT-2 large: 36 layers, width 1280, 20 heads (774M parameters)."""
    return cls(**{"num_layers": 36, "hidden": 1280, "num_heads": 20, **overrides})

  @classmethod
  def gpt2_xl(cls, **overrides: Any) -> GPTConfig:
    """GPT-2 XL: 48 layers, width 1600, 25 heads (1.56B parameters)."""
    return cls(**{"num_layers": 48, "hidden": 1600, "num_heads": 25, **overrides})

  @classmethod
  def tiny(cls, **overrides: Any) -> GPTConfig:
    """A byte-level model small enough to train on two CPU cores."""
    return cls(**{
        "vocab_size": 256, "max_len": 128, "num_layers": 2, "hidden": 128,
        "num_heads": 4, **overrides,
    })

  @classmethod
  def test(cls, **overrides: Any) -> GPTConfig:
    """One layer, width 128: the smoke-test configuration."""
    return cls(**{
        "vocab_size": 256, "max_len": 32, "num_layers": 1, "hidden": 128,
        "num_heads": 4, **overrides,
    })


class GPT(nnx.Module):
  """GPT-2 style decoder LM; `__call__` maps tokens to next-token logits."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    """Initialises the parameters.

    Args:
      config: the model's hyper-parameters.
      rngs: random streams for initialisation (the `params` stream is used).
    """
    self.config = config
    self.token_embed = nnx.Embed(
        config.vocab_size, config.hidden, embedding_init=layers.DEFAULT_INIT,
        dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
    )
    self.position_embed = nnx.Param(
        layers.DEFAULT_INIT(rngs.params(), (config.max_len, config.hidden), config.param_dtype)
    )
    # GPT-2 scales the init of the projections that write into the residual
    # stream by 1/sqrt(2 * num_layers), so its variance stays O(1) with depth.
    out_init = nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * config.num_layers))
    self.blocks = layers.make_blocks(
        lambda: layers.Block(
            config.hidden, config.num_heads, config.mlp_width, pre_norm=True,
            layer_norm_eps=config.layer_norm_eps,
            gelu_approximate=True, gelu_bits=config.gelu_bits,
            linear_keep_ratio=config.linear_keep_ratio,
            dtype=config.dtype, param_dtype=config.param_dtype,
            out_init=out_init, rngs=rngs,
        ),
        config.num_layers, scan_layers=config.scan_layers,
    )
    self.final_norm = layers.LayerNorm(
        config.hidden, epsilon=config.layer_norm_eps, dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs,
    )

  def __call__(self, tokens: Array) -> Array:
    """Computes next-token logits.

    Args:
      tokens: int[batch, length] token ids, length <= config.max_len.

    Returns:
      [batch, length, vocab_size] logits in the compute dtype.
    """
    x = self.embed(tokens)
    x = layers.apply_blocks(self.blocks, x, self.attention_mask(x), remat=self.config.remat)
    return self.logits(x)

  def embed(self, tokens: Array) -> Array:
    """Token plus position embeddings [batch, length, hidden]: the blocks' input."""
    length = tokens.shape[1]
    if length > self.config.max_len:
      raise ValueError(f"sequence length {length} > max_len {self.config.max_len}")
    positions = self.position_embed[...][:length].astype(self.config.dtype)
    return self.token_embed(tokens) + positions[None, :, :]

  def attention_mask(self, x: Array) -> Array:
    """The causal mask of the blocks' input `x` ([batch, length, hidden])."""
    length = x.shape[1]
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None, :, :]

  def logits(self, x: Array) -> Array:
    """Next-token logits from the last block's output."""
    # Tied head: logits are inner products with the token embedding.
    return self.token_embed.attend(self.final_norm(x))

  def loss(self, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    """Mean next-token cross-entropy of a batch.

    Args:
      batch: {"tokens": int32[batch, seq_len + 1]}.

    Returns:
      (loss, {"accuracy": next-token accuracy}), float32 scalars.
    """
    x = self.stage_embed(batch)
    x = layers.apply_blocks(self.blocks, x, self.stage_mask(x, batch), remat=self.config.remat)
    return self.stage_head(x, batch)

  # The loss in three stages (see `models.staged_loss`), from a batch.

  def stage_embed(self, batch: dict[str, Array]) -> Array:
    return self.embed(batch["tokens"][:, :-1])

  def stage_mask(self, x: Array, batch: dict[str, Array]) -> Array:
    del batch
    return self.attention_mask(x)

  def stage_head(self, x: Array, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    labels = batch["tokens"][:, 1:]
    if self.config.loss_chunks == 1:
      loss, accuracy = layers.cross_entropy(self.logits(x), labels)
    else:
      loss, accuracy = savers.chunked_cross_entropy(
          self.final_norm(x), self.token_embed.embedding[...], labels,
          num_chunks=self.config.loss_chunks, dtype=self.token_embed.dtype)
    return loss, {"accuracy": accuracy}
