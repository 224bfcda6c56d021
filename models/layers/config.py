"""The stack's settings every model shares: its config, remat policies, dtypes and init."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import savers

# The block's activations tagged with `checkpoint_name`, for the "minimal" policy.
CHECKPOINT_NAMES = ("qkv", "attention_context", "attention_out", "mlp_hidden", "mlp_out")

# Compute dtypes the models run: float32, and bfloat16 with float32 params
# (mixed precision as MaxText and Levanter train).
COMPUTE_DTYPES = ("float32", "bfloat16")

# Remat policy names (the `remat` field of every model config) mapped onto
# `jax.checkpoint` policies. `None` means: do not wrap the block at all.
#   none          keep every activation (fastest, most memory)
#   minimal       keep the CHECKPOINT_NAMES tensors: the weight matmul outputs
#                 and the attention context, nothing T x T; the backward pass
#                 recomputes the attention scores, softmax and elementwise ops
#   full          keep only the block inputs, recompute the block on backward
#   dots          keep matmul outputs, recompute elementwise ops (GELU, LN, ...)
#   dots_no_batch keep only weight matmuls; attention scores (T x T, batched
#                 dots) are recomputed, which is what saves memory at long T
#   offload       the "minimal" tensors, moved to host memory (pinned_host)
#                 after the forward and back for the backward: device memory
#                 of "full", without its recompute of the matmuls, for
#                 host-link traffic (the idea of SSDTrain, which offloads to SSDs)
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "minimal": jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES),
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=CHECKPOINT_NAMES,
        offload_src="device", offload_dst="pinned_host"),
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters every model here shares: the stack of blocks.

  `GPTConfig`, `BERTConfig` and `ViTConfig` add their inputs and outputs and
  override defaults (e.g. `layer_norm_eps`) where the published models differ.

  Attributes:
    num_layers: number of transformer blocks.
    num_heads: attention heads per block.
    hidden: model width.
    mlp_dim: MLP inner width; None means 4 * hidden.
    layer_norm_eps: LayerNorm epsilon.
    remat: block remat policy, a key of `REMAT_POLICIES`.
    scan_layers: keep the blocks' params stacked on a leading layer axis and
      run them under one `jax.lax.scan` (one block compiled, not
      `num_layers`); same params and outputs as the unrolled stack.
    gelu_bits: None for autodiff's GELU; 1 to 4 for `savers.few_bit_gelu` in
      the blocks' MLPs (same forward; the backward keeps a packed code of
      that many bits per element instead of the float input).
    linear_keep_ratio: None for an exact MLP output projection; in (0, 1]
      for `savers.sampled_matmul`: its weight gradient from that share of
      the GELU output's rows (unbiased), the rest not saved.
    dtype: compute dtype.
    param_dtype: parameter dtype.
  """

  num_layers: int = 12
  num_heads: int = 12
  hidden: int = 768
  mlp_dim: int | None = None
  layer_norm_eps: float = 1e-5
  remat: str = "none"
  scan_layers: bool = False
  gelu_bits: int | None = None
  linear_keep_ratio: float | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {self.remat!r}")
    if jnp.dtype(self.dtype).name not in COMPUTE_DTYPES:
      # float16's 5-bit exponent underflows small gradients unless the loss
      # is scaled, which these models and steps do not do.
      raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got "
                       f"{jnp.dtype(self.dtype).name!r} (float16 needs loss scaling; use "
                       "bfloat16 for mixed precision).")
    if self.gelu_bits is not None and self.gelu_bits not in savers.CODE_BITS:
      raise ValueError(f"gelu_bits must be None or one of {savers.CODE_BITS}, "
                       f"got {self.gelu_bits!r}")
    if self.linear_keep_ratio is not None and not 0.0 < self.linear_keep_ratio <= 1.0:
      raise ValueError(f"linear_keep_ratio must be None or in (0, 1], "
                       f"got {self.linear_keep_ratio!r}")

  @property
  def mlp_width(self) -> int:
    """The MLP inner width actually used."""
    return 4 * self.hidden if self.mlp_dim is None else self.mlp_dim


# Weight init as in GPT-2 / BERT: N(0, 0.02).
DEFAULT_INIT = nnx.initializers.normal(stddev=0.02)


def residual_init(num_layers: int) -> nnx.Initializer:
  """Init of the projections that write into the residual stream (GPT-2's).

  N(0, 0.02) scaled by 1/sqrt(2 * num_layers), so the stream's variance stays
  O(1) with depth.
  """
  return nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * num_layers))


def embedding(num_embeddings: int, config: TransformerConfig, *, rngs: nnx.Rngs) -> nnx.Embed:
  """A [num_embeddings, hidden] lookup table (token ids, segment ids), initialised
  as `DEFAULT_INIT`, in the config's compute and param dtypes."""
  return nnx.Embed(num_embeddings, config.hidden, embedding_init=DEFAULT_INIT,
                   dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)


def learned_positions(length: int, config: TransformerConfig, *, rngs: nnx.Rngs) -> nnx.Param:
  """A [length, hidden] table of learned position embeddings, initialised as
  `DEFAULT_INIT`, in the config's param dtype."""
  return nnx.Param(DEFAULT_INIT(rngs.params(), (length, config.hidden), config.param_dtype))
