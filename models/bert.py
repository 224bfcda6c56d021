"""BERT style bidirectional encoder with a masked-LM head (Devlin et al., 2019), Flax NNX.

Token + position + token-type embeddings followed by a LayerNorm, post-LN blocks
with exact-GELU MLPs, a pooler (dense + tanh on the first token), and the MLM head
(dense + GELU + LayerNorm, then a decoder tied to the token embedding plus an
output bias). With the pooler and MLM head the presets come to 110M (base) and
336M (large) parameters, the published 110M / 335M.

Batch format for `BERT.loss`:
  {"tokens": int32[batch, seq_len]        masked input ids,
   "targets": int32[batch, seq_len]       original ids,
   "mask_weights": float32[batch, seq_len] 1 where the loss is taken, else 0}
and optionally "token_types": int32[batch, seq_len] and
"attention_mask": bool[batch, seq_len] (True for real tokens, False for padding).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import layers
from models import stages

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BERTConfig(layers.TransformerConfig):
  """Hyper-parameters of a `BERT` model.

  The block stack's fields (`num_layers`, `hidden`, `num_heads`, `mlp_dim`,
  `remat`, dtypes) come from `models.layers.TransformerConfig`.

  Attributes:
    vocab_size: number of token ids (30522 for BERT's WordPiece; 260 for the
      byte vocabulary of `models.data`: 256 bytes + [PAD], [MASK], [CLS], [SEP]).
    max_len: number of learned positions.
    type_vocab_size: number of token types (segments).
  """

  vocab_size: int = 30522
  max_len: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12

  @classmethod
  def bert_base(cls, **overrides: Any) -> BERTConfig:
    """BERT-base: 12 layers, width 768, 12 heads (110M parameters)."""
    return cls(**{"num_layers": 12, "hidden": 768, "num_heads": 12, **overrides})

  @classmethod
  def bert_large(cls, **overrides: Any) -> BERTConfig:
    """BERT-large: 24 layers, width 1024, 16 heads (335M parameters)."""
    return cls(**{"num_layers": 24, "hidden": 1024, "num_heads": 16, **overrides})

  @classmethod
  def tiny(cls, **overrides: Any) -> BERTConfig:
    """A byte-level model small enough to train on two CPU cores."""
    return cls(**{
        "vocab_size": 260, "max_len": 128, "num_layers": 2, "hidden": 128,
        "num_heads": 4, **overrides,
    })

  @classmethod
  def test(cls, **overrides: Any) -> BERTConfig:
    """One layer, width 128: the smoke-test configuration."""
    return cls(**{
        "vocab_size": 260, "max_len": 32, "num_layers": 1, "hidden": 128,
        "num_heads": 4, **overrides,
    })


class BERT(stages.StagedModel):
  """BERT encoder with pooler and tied masked-LM head.

  `loss` (`models.stages.StagedModel`'s) is the masked-LM cross-entropy averaged
  over the positions with mask_weights > 0, with the accuracy there.
  """

  def __init__(self, config: BERTConfig, *, rngs: nnx.Rngs):
    """Initialises the parameters.

    Args:
      config: the model's hyper-parameters.
      rngs: random streams for initialisation (the `params` stream is used).
    """
    self.config = config
    dense = dict(
        kernel_init=layers.DEFAULT_INIT, dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs,
    )
    norm = dict(
        epsilon=config.layer_norm_eps, dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs,
    )
    self.token_embed = layers.embedding(config.vocab_size, config, rngs=rngs)
    self.position_embed = layers.learned_positions(config.max_len, config, rngs=rngs)
    self.type_embed = layers.embedding(config.type_vocab_size, config, rngs=rngs)
    self.embed_norm = layers.LayerNorm(config.hidden, **norm)
    self.blocks = layers.make_blocks(
        lambda: layers.Block(
            config.hidden, config.num_heads, config.mlp_width, pre_norm=False,
            layer_norm_eps=config.layer_norm_eps,
            gelu_approximate=False, gelu_bits=config.gelu_bits,
            linear_keep_ratio=config.linear_keep_ratio,
            dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
        ),
        config.num_layers, scan_layers=config.scan_layers,
    )
    self.pooler = nnx.Linear(config.hidden, config.hidden, **dense)
    self.mlm_dense = nnx.Linear(config.hidden, config.hidden, **dense)
    self.mlm_norm = layers.LayerNorm(config.hidden, **norm)
    self.mlm_bias = nnx.Param(jnp.zeros((config.vocab_size,), config.param_dtype))

  def encode(
      self,
      tokens: Array,
      token_types: Array | None = None,
      attention_mask: Array | None = None,
  ) -> Array:
    """Computes the contextual embeddings.

    Args:
      tokens: int[batch, length] token ids, length <= config.max_len.
      token_types: optional int[batch, length] segment ids (default all 0).
      attention_mask: optional bool[batch, length], False at padding keys.

    Returns:
      [batch, length, hidden] final hidden states.
    """
    x = self.embed(tokens, token_types)
    mask = None if attention_mask is None else attention_mask[:, None, None, :]
    return self.run_blocks(x, mask)

  def embed(self, tokens: Array, token_types: Array | None = None) -> Array:
    """The normalised embeddings [batch, length, hidden]: the blocks' input."""
    length = tokens.shape[1]
    if length > self.config.max_len:
      raise ValueError(f"sequence length {length} > max_len {self.config.max_len}")
    if token_types is None:
      token_types = jnp.zeros_like(tokens)
    positions = self.position_embed[...][:length].astype(self.config.dtype)
    x = self.token_embed(tokens) + positions[None, :, :] + self.type_embed(token_types)
    return self.embed_norm(x)

  def pool(self, hidden_states: Array) -> Array:
    """BERT's pooled output: dense + tanh on the first token's hidden state."""
    return jnp.tanh(self.pooler(hidden_states[:, 0]))

  def mlm_logits(self, hidden_states: Array) -> Array:
    """Masked-LM logits [batch, length, vocab_size] from the hidden states."""
    h = jax.nn.gelu(self.mlm_dense(hidden_states), approximate=False)
    logits = self.token_embed.attend(self.mlm_norm(h))
    return logits + self.mlm_bias[...].astype(logits.dtype)[None, None, :]

  def __call__(
      self,
      tokens: Array,
      token_types: Array | None = None,
      attention_mask: Array | None = None,
  ) -> Array:
    """Masked-LM logits [batch, length, vocab_size]; arguments as in `encode`."""
    return self.mlm_logits(self.encode(tokens, token_types, attention_mask))

  # The loss in three stages (`models.stages.StagedModel`), from a batch.

  def stage_embed(self, batch: dict[str, Array]) -> Array:
    return self.embed(batch["tokens"], batch.get("token_types"))

  def stage_mask(self, x: Array, batch: dict[str, Array]) -> Array | None:
    del x
    attention_mask = batch.get("attention_mask")
    return None if attention_mask is None else attention_mask[:, None, None, :]

  def stage_head(self, x: Array, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    logits = self.mlm_logits(x)
    loss, accuracy = layers.cross_entropy(logits, batch["targets"], batch["mask_weights"])
    return loss, {"accuracy": accuracy}
