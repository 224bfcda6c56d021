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
from typing import Any

import jax
from flax import nnx

from models import layers
from models import stages

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


class GPT(stages.CausalLM):
  """GPT-2 style decoder LM; `__call__` maps tokens to next-token logits.

  A `models.stages.CausalLM` (its loss, whole or in stages) with learned
  positions and an LM head tied to the token embedding.
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    """Initialises the parameters from `rngs`' `params` stream, N(0, 0.02)."""
    self.config = config
    self.token_embed = layers.embedding(config.vocab_size, config, rngs=rngs)
    self.position_embed = layers.learned_positions(config.max_len, config, rngs=rngs)
    out_init = layers.residual_init(config.num_layers)
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

  def embed(self, tokens: Array) -> Array:
    """Token plus position embeddings [batch, length, hidden]: the blocks' input."""
    length = tokens.shape[1]
    if length > self.config.max_len:
      raise ValueError(f"sequence length {length} > max_len {self.config.max_len}")
    positions = self.position_embed[...][:length].astype(self.config.dtype)
    return self.token_embed(tokens) + positions[None, :, :]

  def logits(self, x: Array) -> Array:
    """Next-token logits from the last block's output."""
    # Tied head: logits are inner products with the token embedding.
    return self.token_embed.attend(self.final_norm(x))

  def head_table(self) -> Array:
    """The LM head as a [vocab, hidden] table: the token embedding (tied)."""
    return self.token_embed.embedding[...]
