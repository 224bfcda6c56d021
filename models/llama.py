"""Llama-family decoder-only language model (Touvron et al., 2023) in Flax NNX.

Pre-norm blocks of RMSNorm, causal grouped-query attention with rotary
position embeddings, and a SwiGLU MLP, all without biases; a final RMSNorm and
an LM head, tied to the token embedding or not per preset. The presets
reproduce the published shapes and parameter counts of Llama 2 7B
(6,738,415,616), Llama 3 8B (8,030,261,248) and Llama 3.2 1B (1,235,814,400).

The parameter names follow the zoo (``blocks/attention/q/kernel``, ...);
``models.llama_checkpoint`` maps Hugging Face checkpoints onto them. The rotary
embedding uses Hugging Face's "rotate half" layout, so its q and k projections
load without a permutation.

Batch format for `Llama.loss`: {"tokens": int32[batch, seq_len + 1]}; the model
reads tokens[:, :-1] and predicts tokens[:, 1:] (the GPT's format). Packed rows
(`models.text.text_batches`) add, each [batch, seq_len + 1]: "segment_ids"
(0 padding, 1.. per document; attention stays within a document),
"positions" (the rotary positions, restarting at 0 per document) and
"loss_mask" (loss_mask[:, 1:] marks the targets: a prompt's tokens carry no
loss); `models.stages.CausalLM` says how each is read. A packed row then gives
every document the per-token losses it has alone.
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
class LlamaConfig(layers.TransformerConfig):
  """Hyper-parameters of a `Llama` model.

  The block stack's fields (`num_layers`, `hidden`, `num_heads`, `mlp_dim`,
  `remat`, `scan_layers`, dtypes, `linear_keep_ratio`) come from
  `models.layers.TransformerConfig`; `layer_norm_eps` is RMSNorm's epsilon.
  `gelu_bits` must stay None: the MLP's activation is SiLU, and the few-bit
  backward's codes are fitted to GELU's derivative.

  Attributes:
    vocab_size: number of token ids.
    max_len: the longest sequence the preset was trained for.
    num_kv_heads: key/value heads of grouped-query attention; divides
      `num_heads` (equal to it: multi-head attention).
    head_dim: width of a head; None means hidden // num_heads.
    rope_theta: the rotary embedding's base (10,000 in Llama 2, 500,000 in 3).
    rope_scaling: Llama 3.1/3.2's rotary rescaling, or None.
    tie_embeddings: the LM head is the token embedding (Llama 3.2 1B) rather
      than a matrix of its own (Llama 2, Llama 3 8B).
    loss_chunks: as `GPTConfig.loss_chunks` (the LM head's loss by chunks).
    attention_chunk: None attends every query at once; a length that divides
      the sequence attends that many queries at a time, each chunk
      recomputed in the backward (`layers.GroupedQueryAttention`'s
      `query_chunk`): the same values, the [heads, length, length] tensors
      one chunk of rows at a time (LLaMA-7B at 2,048 tokens: 512 MiB each).
  """

  vocab_size: int = 32000
  max_len: int = 4096
  num_kv_heads: int = 32
  head_dim: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: layers.RopeScaling | None = None
  tie_embeddings: bool = False
  loss_chunks: int = 1
  attention_chunk: int | None = None
  num_layers: int = 32
  num_heads: int = 32
  hidden: int = 4096
  mlp_dim: int | None = 11008

  def __post_init__(self):
    super().__post_init__()
    if self.mlp_dim is None:
      raise ValueError("mlp_dim must be set for a Llama (SwiGLU widths are not 4 x hidden).")
    if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
          f"{self.num_kv_heads}: each key/value head serves a whole group of query "
          "heads; choose num_kv_heads among the divisors of num_heads.")
    if self.head_dim is None and self.hidden % self.num_heads:
      raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                       "set head_dim explicitly.")
    if self.head_size % 2:
      raise ValueError(f"the head size must be even (rotary embeddings rotate pairs), got "
                       f"{self.head_size}; change hidden / num_heads or set an even head_dim.")
    if self.gelu_bits is not None:
      raise ValueError(
          f"gelu_bits={self.gelu_bits!r}: a Llama's MLP is SwiGLU, and the few-bit backward "
          "(models.savers.few_bit_gelu) is fitted to GELU; use gelu_bits=None (remat or "
          "linear_keep_ratio save activation memory here).")
    if not isinstance(self.loss_chunks, int) or self.loss_chunks < 1:
      raise ValueError(f"loss_chunks must be a positive int, got {self.loss_chunks!r}")
    if self.attention_chunk is not None and (
        not isinstance(self.attention_chunk, int) or self.attention_chunk < 1):
      raise ValueError(f"attention_chunk must be None or a positive int (queries per chunk), "
                       f"got {self.attention_chunk!r}")

  @property
  def head_size(self) -> int:
    """The width of one attention head actually used."""
    return self.hidden // self.num_heads if self.head_dim is None else self.head_dim

  @classmethod
  def llama2_7b(cls, **overrides: Any) -> LlamaConfig:
    """Llama 2 7B: 32 layers, width 4096, 32 heads (6,738,415,616 parameters)."""
    return cls(**{
        "vocab_size": 32000, "max_len": 4096, "num_layers": 32, "hidden": 4096,
        "num_heads": 32, "num_kv_heads": 32, "mlp_dim": 11008, **overrides,
    })

  @classmethod
  def llama3_8b(cls, **overrides: Any) -> LlamaConfig:
    """Llama 3 8B: 32 layers, width 4096, 8 kv heads, 128k vocabulary (8,030,261,248)."""
    return cls(**{
        "vocab_size": 128256, "max_len": 8192, "num_layers": 32, "hidden": 4096,
        "num_heads": 32, "num_kv_heads": 8, "mlp_dim": 14336, "rope_theta": 500000.0,
        **overrides,
    })

  @classmethod
  def llama32_1b(cls, **overrides: Any) -> LlamaConfig:
    """Llama 3.2 1B: 16 layers, width 2048, tied embeddings (1,235,814,400)."""
    return cls(**{
        "vocab_size": 128256, "max_len": 131072, "num_layers": 16, "hidden": 2048,
        "num_heads": 32, "num_kv_heads": 8, "mlp_dim": 8192, "rope_theta": 500000.0,
        "rope_scaling": layers.RopeScaling(factor=32.0), "tie_embeddings": True,
        **overrides,
    })

  @classmethod
  def small(cls, **overrides: Any) -> LlamaConfig:
    """GPT-2 small's size as a Llama: 12 layers, width 768, 4 kv heads (124.6M)."""
    return cls(**{
        "vocab_size": 32000, "max_len": 2048, "num_layers": 12, "hidden": 768,
        "num_heads": 12, "num_kv_heads": 4, "mlp_dim": 2048, **overrides,
    })

  @classmethod
  def tiny(cls, **overrides: Any) -> LlamaConfig:
    """A byte-level Llama small enough to train on two CPU cores."""
    return cls(**{
        "vocab_size": 256, "max_len": 128, "num_layers": 2, "hidden": 128,
        "num_heads": 4, "num_kv_heads": 2, "mlp_dim": 384, **overrides,
    })

  @classmethod
  def test(cls, **overrides: Any) -> LlamaConfig:
    """One layer, width 128, 2 kv heads for 4 query heads: the smoke-test configuration."""
    return cls(**{
        "vocab_size": 256, "max_len": 64, "num_layers": 1, "hidden": 128,
        "num_heads": 4, "num_kv_heads": 2, "mlp_dim": 256, **overrides,
    })


class Llama(stages.CausalLM):
  """Llama-family decoder LM; `__call__` maps tokens to next-token logits.

  A `models.stages.CausalLM` (its loss, whole or in stages) with rotary
  positions in its attention and an LM head tied to the token embedding or its
  own (`tie_embeddings`).
  """

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    """Initialises the parameters (N(0, 0.02); residual writes scaled by depth).

    Args:
      config: the model's hyper-parameters.
      rngs: random streams for initialisation (the `params` stream is used).
    """
    self.config = config
    self.token_embed = layers.embedding(config.vocab_size, config, rngs=rngs)
    out_init = layers.residual_init(config.num_layers)  # as GPT-2's
    self.blocks = layers.make_blocks(
        lambda: layers.LlamaBlock(
            config.hidden, config.num_heads, config.num_kv_heads, config.mlp_width,
            head_dim=config.head_size, norm_eps=config.layer_norm_eps,
            rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
            query_chunk=config.attention_chunk, linear_keep_ratio=config.linear_keep_ratio,
            dtype=config.dtype,
            param_dtype=config.param_dtype, out_init=out_init, rngs=rngs,
        ),
        config.num_layers, scan_layers=config.scan_layers,
    )
    self.final_norm = layers.RMSNorm(
        config.hidden, epsilon=config.layer_norm_eps, dtype=config.dtype,
        param_dtype=config.param_dtype, rngs=rngs,
    )
    if not config.tie_embeddings:
      self.lm_head = nnx.Linear(
          config.hidden, config.vocab_size, use_bias=False, kernel_init=layers.DEFAULT_INIT,
          dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
      )

  def embed(self, tokens: Array) -> Array:
    """Token embeddings [batch, length, hidden]: the blocks' input (positions are rotary)."""
    length = tokens.shape[1]
    if length > self.config.max_len:
      raise ValueError(
          f"sequence length {length} > max_len {self.config.max_len}, the longest this "
          "preset was trained for; pass shorter sequences (seq_len) or build the config "
          f"with max_len={length} if you mean to extend it.")
    return self.token_embed(tokens)

  def stage_positions(self, batch: dict[str, Array]) -> Array | None:
    """The rotary positions of the inputs, batch["positions"][:, :-1], if the batch has them."""
    return batch["positions"][:, :-1] if "positions" in batch else None

  def head_table(self) -> Array:
    """The LM head as a [vocab, hidden] table (the embedding when tied)."""
    if self.config.tie_embeddings:
      return self.token_embed.embedding[...]
    return self.lm_head.kernel[...].T

  def logits(self, x: Array) -> Array:
    """Next-token logits from the last block's output."""
    x = self.final_norm(x)
    if self.config.tie_embeddings:
      return self.token_embed.attend(x)
    return self.lm_head(x)
