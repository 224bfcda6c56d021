"""Transformer building blocks shared by the GPT, BERT, ViT and Llama models.

Everything here is deterministic (no dropout) so that a model's loss is a pure
function of its parameters and a batch, which is what `lax.scan` over
micro-batches in `optax_adama.microbatch_step` needs. The code is written to run
under `jax_numpy_rank_promotion="raise"` and `jax_numpy_dtype_promotion="strict"`:
broadcasts are explicit and mixed dtypes are cast by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import savers

Array = jax.Array
DType = Any

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


class LayerNorm(nnx.Module):
  """LayerNorm with statistics in float32 and explicit casts.

  `nnx.LayerNorm` relies on implicit bfloat16/float32 promotion, which
  `jax_numpy_dtype_promotion="strict"` forbids; this one casts by hand. The
  parameters (`scale`, `bias`) are the same as nnx.LayerNorm's.
  """

  def __init__(
      self,
      features: int,
      *,
      epsilon: float,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      rngs: nnx.Rngs,
  ):
    """Creates the layer.

    Args:
      features: size of the normalised (last) axis.
      epsilon: added to the variance.
      dtype: output dtype.
      param_dtype: parameter dtype.
      rngs: unused (the init is deterministic); kept for a uniform signature.
    """
    del rngs
    self.epsilon = epsilon
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((features,), param_dtype))
    self.bias = nnx.Param(jnp.zeros((features,), param_dtype))

  def __call__(self, x: Array) -> Array:
    """Normalises the last axis of `x`; returns `dtype`."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
    features = (1,) * (x.ndim - 1) + (-1,)
    y = y * self.scale[...].astype(jnp.float32).reshape(features)
    y = y + self.bias[...].astype(jnp.float32).reshape(features)
    return y.astype(self.dtype)


class MultiHeadAttention(nnx.Module):
  """Multi-head self-attention with a fused QKV projection.

  The softmax is computed in float32 whatever the compute dtype, so bfloat16
  models stay stable.
  """

  def __init__(
      self,
      hidden: int,
      num_heads: int,
      *,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      out_init: nnx.Initializer = DEFAULT_INIT,
      rngs: nnx.Rngs,
  ):
    """Creates the layer.

    Args:
      hidden: model width; must be divisible by `num_heads`.
      num_heads: number of attention heads.
      dtype: compute dtype.
      param_dtype: parameter dtype.
      out_init: init of the output projection (GPT-2 scales it by depth).
      rngs: random streams for initialisation.
    """
    if hidden % num_heads:
      raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
    self.num_heads = num_heads
    self.head_dim = hidden // num_heads
    self.dtype = dtype
    self.qkv = nnx.Linear(
        hidden, 3 * hidden, kernel_init=DEFAULT_INIT,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )
    self.out = nnx.Linear(
        hidden, hidden, kernel_init=out_init,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )

  def __call__(self, x: Array, mask: Array | None = None) -> Array:
    """Attends over the sequence.

    Args:
      x: [batch, length, hidden] inputs.
      mask: optional bool mask of rank 4, broadcastable to
        [batch, heads, query, key]; True where attention is allowed.

    Returns:
      [batch, length, hidden] outputs.
    """
    batch, length, hidden = x.shape
    qkv = checkpoint_name(self.qkv(x), "qkv")
    qkv = qkv.reshape(batch, length, 3, self.num_heads, self.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    # Scale q before the dot product: a smaller tensor than the scores.
    q = q * (1.0 / math.sqrt(self.head_dim))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    if mask is not None:
      # A large finite value rather than -inf: a fully masked row then
      # gives a uniform softmax instead of NaN.
      scores = jnp.where(mask, scores, float(jnp.finfo(jnp.float32).min))
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    context = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    context = checkpoint_name(context.reshape(batch, length, hidden), "attention_context")
    return checkpoint_name(self.out(context), "attention_out")


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


# Llama-family building blocks: RMSNorm, rotary positions, grouped-query
# attention and the SwiGLU MLP, all without biases (Touvron et al., 2023;
# the layout of MaxText's llama2 decoder and Flax's Gemma example).


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1/3.2's rotary frequency rescaling ("rope_type": "llama3").

  Long wavelengths are stretched by `factor`, short ones kept, and the band
  between `original_max_len / low_freq_factor` and
  `original_max_len / high_freq_factor` interpolated: the checkpoints of
  Llama 3.1 and 3.2 were trained with these frequencies, so a model that
  loads them must use the same.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192


def rotary_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
  """The rotary embedding's angular frequencies, ``head_dim / 2`` of them (float64)."""
  if head_dim % 2:
    raise ValueError(f"rotary embeddings rotate pairs: head_dim must be even, got {head_dim}.")
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv_freq
  wavelength = 2 * np.pi / inv_freq
  low_freq_wavelength = scaling.original_max_len / scaling.low_freq_factor
  high_freq_wavelength = scaling.original_max_len / scaling.high_freq_factor
  smooth = ((scaling.original_max_len / wavelength - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  medium = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  scaled = np.where(wavelength > low_freq_wavelength, inv_freq / scaling.factor, inv_freq)
  in_band = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
  return np.where(in_band, medium, scaled)


def apply_rotary(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
  """Rotates ``x`` ([batch, length, heads, head_dim]) by its positions' angles.

  The "rotate half" layout of GPT-NeoX and Hugging Face's Llama: coordinate i
  pairs with i + head_dim / 2. Computed in float32, returned in x's dtype.

  Args:
    x: queries or keys, [batch, length, heads, head_dim].
    positions: [length] integer positions.
    inv_freq: [head_dim / 2] frequencies (`rotary_inverse_frequencies`).
  """
  angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-second, first], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square LayerNorm (no centring, no bias), statistics in float32."""

  def __init__(
      self,
      features: int,
      *,
      epsilon: float,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      rngs: nnx.Rngs,
  ):
    """Creates the layer; arguments as in `LayerNorm`."""
    del rngs
    self.epsilon = epsilon
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((features,), param_dtype))

  def __call__(self, x: Array) -> Array:
    """Normalises the last axis of `x`; returns `dtype`."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    features = (1,) * (x.ndim - 1) + (-1,)
    return (y * self.scale[...].astype(jnp.float32).reshape(features)).astype(self.dtype)


class GroupedQueryAttention(nnx.Module):
  """Causal self-attention with rotary positions and `num_kv_heads` shared key/value heads.

  Each group of ``num_heads // num_kv_heads`` query heads reads one key/value
  head (Ainslie et al., 2023); ``num_kv_heads == num_heads`` is multi-head
  attention. The softmax is computed in float32.
  """

  def __init__(
      self,
      hidden: int,
      num_heads: int,
      num_kv_heads: int,
      *,
      head_dim: int,
      rope_theta: float,
      rope_scaling: RopeScaling | None = None,
      query_chunk: int | None = None,
      dtype: DType = jnp.float32,
      param_dtype: DType = jnp.float32,
      out_init: nnx.Initializer = DEFAULT_INIT,
      rngs: nnx.Rngs,
  ):
    """Creates the layer.

    Args:
      hidden: model width.
      num_heads: query heads; a multiple of `num_kv_heads`.
      num_kv_heads: key/value heads.
      head_dim: width of one head (even: the rotary embedding rotates pairs).
      rope_theta: the rotary embedding's base.
      rope_scaling: Llama 3.1/3.2's frequency rescaling, or None.
      query_chunk: None scores every query at once; a length attends that
        many queries at a time under `jax.checkpoint` (the same values; the
        [heads, length, length] scores, probabilities and their gradients
        then exist one chunk of rows at a time). Sequences it does not divide
        are attended whole.
      dtype: compute dtype.
      param_dtype: parameter dtype.
      out_init: init of the output projection.
      rngs: random streams for initialisation.
    """
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.rope_theta = rope_theta
    self.rope_scaling = rope_scaling
    self.query_chunk = query_chunk
    self.dtype = dtype
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.q = linear(hidden, num_heads * head_dim, kernel_init=DEFAULT_INIT)
    self.k = linear(hidden, num_kv_heads * head_dim, kernel_init=DEFAULT_INIT)
    self.v = linear(hidden, num_kv_heads * head_dim, kernel_init=DEFAULT_INIT)
    self.out = linear(num_heads * head_dim, hidden, kernel_init=out_init)

  def __call__(self, x: Array, mask: Array | None = None) -> Array:
    """Attends over the sequence (positions 0 .. length - 1).

    Args:
      x: [batch, length, hidden] inputs.
      mask: optional bool mask of rank 4, broadcastable to
        [batch, heads, query, key]; True where attention is allowed.

    Returns:
      [batch, length, hidden] outputs.
    """
    batch, length, _ = x.shape
    kv_heads, groups, head_dim = (self.num_kv_heads, self.num_heads // self.num_kv_heads,
                                  self.head_dim)
    q = checkpoint_name(self.q(x), "qkv").reshape(batch, length, self.num_heads, head_dim)
    k = checkpoint_name(self.k(x), "qkv").reshape(batch, length, kv_heads, head_dim)
    v = checkpoint_name(self.v(x), "qkv").reshape(batch, length, kv_heads, head_dim)
    inv_freq = rotary_inverse_frequencies(head_dim, self.rope_theta, self.rope_scaling)
    positions = jnp.arange(length)
    q = apply_rotary(q, positions, inv_freq) * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
    k = apply_rotary(k, positions, inv_freq)
    # Query head h reads key/value head h // groups (Hugging Face's repeat_kv).
    q = q.reshape(batch, length, kv_heads, groups, head_dim)
    if mask is not None:
      mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], length, length))
    chunk = self.query_chunk
    if chunk is None or chunk >= length or length % chunk:
      context = self._attend(q, k, v, mask)
    else:
      # One chunk of query rows at a time; the backward recomputes a chunk's
      # scores rather than keeping every chunk's.
      num_chunks = length // chunk
      q_chunks = jnp.moveaxis(q.reshape(batch, num_chunks, chunk, *q.shape[2:]), 1, 0)
      mask_chunks = None if mask is None else jnp.moveaxis(
          mask.reshape(*mask.shape[:2], num_chunks, chunk, length), 2, 0)
      attend = jax.checkpoint(self._attend, prevent_cse=False)
      chunks = jax.lax.map(lambda args: attend(args[0], k, v, args[1]),
                           (q_chunks, mask_chunks))
      context = jnp.moveaxis(chunks, 0, 1).reshape(q.shape)
    context = context.reshape(batch, length, self.num_heads * head_dim)
    context = checkpoint_name(context, "attention_context")
    return checkpoint_name(self.out(context), "attention_out")


  def _attend(self, q: Array, k: Array, v: Array, mask: Array | None) -> Array:
    """Attention of queries [b, q, kv, groups, d] over all keys; mask [b|1, h|1, q, s]."""
    batch, queries, kv_heads, groups, _ = q.shape
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32)
    scores = scores.reshape(batch, self.num_heads, queries, k.shape[1])
    if mask is not None:
      scores = jnp.where(mask, scores, float(jnp.finfo(jnp.float32).min))
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    probs = probs.reshape(batch, kv_heads, groups, queries, k.shape[1])
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)


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

  def __call__(self, x: Array, mask: Array | None = None) -> Array:
    """Applies the block to [batch, length, hidden] inputs."""
    x = x + self.attention(self.attention_norm(x), mask)
    return x + self.mlp(self.mlp_norm(x))


def _apply_block(block: nnx.Module, x: Array, mask: Array | None) -> Array:
  return block(x, mask)


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
    *, remat: str,
) -> Array:
  """One layer of a stacked block: the pure function `jax.lax.scan` runs."""
  def apply(layer_params, x):
    return nnx.merge(graphdef, layer_params)(x, mask)

  policy = REMAT_POLICIES[remat]
  if policy is not None:
    # prevent_cse=False: under scan, CSE cannot undo the recomputation.
    apply = jax.checkpoint(apply, policy=policy, prevent_cse=False)
  return apply(layer_params, x)


def apply_blocks(
    blocks: nnx.Module, x: Array, mask: Array | None, *, remat: str
) -> Array:
  """Runs `x` through `blocks` in order, each under the remat policy.

  Args:
    blocks: the model's `nnx.List` of blocks (unrolled), or one block
      (a `Block` or `LlamaBlock`) whose params are stacked on a leading
      layer axis (`scan_layers`), run under `jax.lax.scan`.
    x: [batch, length, hidden] activations.
    mask: attention mask passed to every block, or None.
    remat: a key of `REMAT_POLICIES`.

  Returns:
    The activations after the last block.
  """
  if not isinstance(blocks, nnx.List):  # one block module with stacked params
    graphdef, stacked = nnx.split(blocks)

    def body(x, layer_params):
      return apply_layer(graphdef, layer_params, x, mask, remat=remat), None

    return jax.lax.scan(body, x, stacked)[0]
  policy = REMAT_POLICIES[remat]
  if policy is None:
    apply = _apply_block
  else:
    apply = nnx.remat(_apply_block, policy=policy)
  for block in blocks:
    x = apply(block, x, mask)
  return x


def cross_entropy(
    logits: Array, labels: Array, weights: Array | None = None
) -> tuple[Array, Array]:
  """Weighted mean softmax cross-entropy and accuracy, computed in float32.

  Args:
    logits: [..., num_classes] logits of any float dtype.
    labels: [...] int labels.
    weights: optional [...] float weights (e.g. 1 at masked-LM positions);
      None weighs every position equally.

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
  total = jnp.maximum(jnp.sum(weights), 1.0)
  return jnp.sum(nll * weights) / total, jnp.sum(correct * weights) / total
