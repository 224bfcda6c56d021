"""The blocks (attention and MLP with their residuals) and how a stack of them runs.

`Block` is GPT-2, BERT and ViT's (LayerNorm, GELU MLP); `LlamaBlock` the
Llama's (RMSNorm, SwiGLU MLP, no biases). `make_blocks` builds a stack as a
list or with stacked params (`scan_layers`), and `apply_blocks` runs either
under a remat policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import savers
from models.layers.attention import GroupedQueryAttention
from models.layers.attention import MultiHeadAttention
from models.layers.attention import RopeScaling
from models.layers.config import DEFAULT_INIT
from models.layers.config import REMAT_POLICIES
from models.layers.norms import LayerNorm
from models.layers.norms import RMSNorm

Array = jax.Array
DType = Any


class MLP(nnx.Module):
  """Two-layer GELU feed-forward network."""

  def __init__(
      self,
      hidden: int,
      mlp_dim: int,
      *,
      gelu_approximate: bool,
      gelu_bits: int | None = None,
      linear_keep_ratio: float | None = None,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      out_init: nnx.Initializer = DEFAULT_INIT,
      rngs: nnx.Rngs,
  ):
    """Creates the layer.

    Args:
      hidden: model width.
      mlp_dim: inner width (4 * hidden in GPT-2, BERT and ViT).
      gelu_approximate: tanh GELU (GPT-2) instead of the exact erf GELU
        (BERT, ViT).
      gelu_bits: None, or 1 to 4: `savers.few_bit_gelu` with that many bits.
      linear_keep_ratio: None, or the keep ratio of `savers.sampled_matmul`
        in the output projection (seeded by the GELU output's bits).
      dtype: compute dtype.
      param_dtype: parameter dtype.
      out_init: init of the output projection.
      rngs: random streams for initialisation.
    """
    self.gelu_approximate = gelu_approximate
    self.gelu_bits = gelu_bits
    self.linear_keep_ratio = linear_keep_ratio
    self.fc = nnx.Linear(
        hidden, mlp_dim, kernel_init=DEFAULT_INIT,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )
    self.proj = nnx.Linear(
        mlp_dim, hidden, kernel_init=out_init,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )

  def __call__(self, x: Array) -> Array:
    """Applies fc -> GELU -> proj to [..., hidden] inputs."""
    h = checkpoint_name(self.fc(x), "mlp_hidden")
    if self.gelu_bits is None:
      h = jax.nn.gelu(h, approximate=self.gelu_approximate)
    else:
      h = savers.few_bit_gelu(h, self.gelu_bits, self.gelu_approximate)
    if self.linear_keep_ratio is None:
      return checkpoint_name(self.proj(h), "mlp_out")
    kernel = self.proj.kernel[...].astype(h.dtype)
    out = savers.sampled_matmul(h, kernel, savers.key_from_bits(h), self.linear_keep_ratio)
    bias = self.proj.bias[...].astype(out.dtype).reshape((1,) * (out.ndim - 1) + (-1,))
    return checkpoint_name(out + bias, "mlp_out")


class Block(nnx.Module):
  """A transformer block: attention and MLP, each with a residual and a LayerNorm.

  `pre_norm=True` is the GPT-2 / ViT layout, x + f(LN(x)); `pre_norm=False` is
  BERT's post-LN layout, LN(x + f(x)).
  """

  def __init__(
      self,
      hidden: int,
      num_heads: int,
      mlp_dim: int,
      *,
      pre_norm: bool,
      layer_norm_eps: float,
      gelu_approximate: bool,
      gelu_bits: int | None = None,
      linear_keep_ratio: float | None = None,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      out_init: nnx.Initializer = DEFAULT_INIT,
      rngs: nnx.Rngs,
  ):
    """Creates the block; arguments are as in `MultiHeadAttention` and `MLP`."""
    self.pre_norm = pre_norm
    self.ln1 = LayerNorm(
        hidden, epsilon=layer_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )
    self.attention = MultiHeadAttention(
        hidden, num_heads, dtype=dtype, param_dtype=param_dtype,
        out_init=out_init, rngs=rngs,
    )
    self.ln2 = LayerNorm(
        hidden, epsilon=layer_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )
    self.mlp = MLP(
        hidden, mlp_dim, gelu_approximate=gelu_approximate, gelu_bits=gelu_bits,
        linear_keep_ratio=linear_keep_ratio, dtype=dtype,
        param_dtype=param_dtype, out_init=out_init, rngs=rngs,
    )

  def __call__(self, x: Array, mask: Array | None = None) -> Array:
    """Applies the block to [batch, length, hidden] inputs."""
    if self.pre_norm:
      x = x + self.attention(self.ln1(x), mask)
      return x + self.mlp(self.ln2(x))
    x = self.ln1(x + self.attention(x, mask))
    return self.ln2(x + self.mlp(x))


class GatedMLP(nnx.Module):
  """SwiGLU feed-forward network: down(silu(gate(x)) * up(x)), no biases (Shazeer, 2020)."""

  def __init__(
      self,
      hidden: int,
      mlp_dim: int,
      *,
      linear_keep_ratio: float | None = None,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      out_init: nnx.Initializer = DEFAULT_INIT,
      rngs: nnx.Rngs,
  ):
    """Creates the layer; `linear_keep_ratio` as in `MLP` (the down projection)."""
    self.linear_keep_ratio = linear_keep_ratio
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.gate = linear(hidden, mlp_dim, kernel_init=DEFAULT_INIT)
    self.up = linear(hidden, mlp_dim, kernel_init=DEFAULT_INIT)
    self.down = linear(mlp_dim, hidden, kernel_init=out_init)

  def __call__(self, x: Array) -> Array:
    """Applies the gated MLP to [..., hidden] inputs."""
    gate = checkpoint_name(self.gate(x), "mlp_hidden")
    up = checkpoint_name(self.up(x), "mlp_hidden")
    h = jax.nn.silu(gate) * up
    if self.linear_keep_ratio is None:
      return checkpoint_name(self.down(h), "mlp_out")
    kernel = self.down.kernel[...].astype(h.dtype)
    out = savers.sampled_matmul(h, kernel, savers.key_from_bits(h), self.linear_keep_ratio)
    return checkpoint_name(out, "mlp_out")


class LlamaBlock(nnx.Module):
  """A Llama decoder block: x + attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

  def __init__(
      self,
      hidden: int,
      num_heads: int,
      num_kv_heads: int,
      mlp_dim: int,
      *,
      head_dim: int,
      norm_eps: float,
      rope_theta: float,
      rope_scaling: RopeScaling | None = None,
      query_chunk: int | None = None,
      linear_keep_ratio: float | None = None,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      out_init: nnx.Initializer = DEFAULT_INIT,
      rngs: nnx.Rngs,
  ):
    """Creates the block; arguments as in `GroupedQueryAttention` and `GatedMLP`."""
    norm = functools.partial(RMSNorm, hidden, epsilon=norm_eps, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
    self.attention_norm = norm()
    self.attention = GroupedQueryAttention(
        hidden, num_heads, num_kv_heads, head_dim=head_dim, rope_theta=rope_theta,
        rope_scaling=rope_scaling, query_chunk=query_chunk, dtype=dtype,
        param_dtype=param_dtype,
        out_init=out_init, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = GatedMLP(hidden, mlp_dim, linear_keep_ratio=linear_keep_ratio, dtype=dtype,
                        param_dtype=param_dtype, out_init=out_init, rngs=rngs)

  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    """Applies the block to [batch, length, hidden] inputs at `positions` ([batch, length];
    None: 0 .. length - 1)."""
    x = x + self.attention(self.attention_norm(x), mask, positions)
    return x + self.mlp(self.mlp_norm(x))


def _apply_block(block: nnx.Module, x: Array, mask: Array | None) -> Array:
  return block(x, mask)


def _apply_block_at(block: nnx.Module, x: Array, mask: Array | None, positions: Array) -> Array:
  return block(x, mask, positions)


def make_blocks(
    make_block: Callable[[], nnx.Module], num_layers: int, *, scan_layers: bool
) -> nnx.Module:
  """`num_layers` blocks: an `nnx.List`, or one block with stacked params.

  The stacked block is built from the same blocks as the list (same random
  draws, in the same order), so both layouts start from the same weights.
  """
  blocks = [make_block() for _ in range(num_layers)]
  if not scan_layers:
    return nnx.List(blocks)
  graphdef, _ = nnx.split(blocks[0])
  states = [nnx.split(block)[1] for block in blocks]
  return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def apply_layer(
    graphdef: nnx.GraphDef, layer_params: nnx.State, x: Array, mask: Array | None,
    *, remat: str, positions: Array | None = None,
) -> Array:
  """One layer of a stacked block: the pure function `jax.lax.scan` runs.

  `positions` ([batch, length]) go to blocks that take them (`LlamaBlock`);
  None calls the block with `(x, mask)` alone, as every block takes.
  """
  def apply(layer_params, x):
    block = nnx.merge(graphdef, layer_params)
    return block(x, mask) if positions is None else block(x, mask, positions)

  policy = REMAT_POLICIES[remat]
  if policy is not None:
    # prevent_cse=False: under scan, CSE cannot undo the recomputation.
    apply = jax.checkpoint(apply, policy=policy, prevent_cse=False)
  return apply(layer_params, x)


def apply_blocks(
    blocks: nnx.Module, x: Array, mask: Array | None, *, remat: str,
    positions: Array | None = None,
) -> Array:
  """Runs `x` through `blocks` in order, each under the remat policy.

  Args:
    blocks: the model's `nnx.List` of blocks (unrolled), or one block
      (a `Block` or `LlamaBlock`) whose params are stacked on a leading
      layer axis (`scan_layers`), run under `jax.lax.scan`.
    x: [batch, length, hidden] activations.
    mask: attention mask passed to every block, or None.
    remat: a key of `REMAT_POLICIES`.
    positions: [batch, length] positions for blocks that take them (rotary
      attention), or None: each block's default, 0 .. length - 1.

  Returns:
    The activations after the last block.
  """
  if not isinstance(blocks, nnx.List):  # one block module with stacked params
    graphdef, stacked = nnx.split(blocks)

    def body(x, layer_params):
      return apply_layer(graphdef, layer_params, x, mask, remat=remat,
                         positions=positions), None

    return jax.lax.scan(body, x, stacked)[0]
  policy = REMAT_POLICIES[remat]
  if positions is None:
    apply = _apply_block if policy is None else nnx.remat(_apply_block, policy=policy)
    for block in blocks:
      x = apply(block, x, mask)
    return x
  apply_at = _apply_block_at if policy is None else nnx.remat(_apply_block_at, policy=policy)
  for block in blocks:
    x = apply_at(block, x, mask, positions)
  return x
