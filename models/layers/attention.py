"""Self-attention: GPT-2/BERT/ViT's multi-head, and the Llama's grouped-query with rotary positions.

The softmax is computed in float32 whatever the compute dtype, and a masked
score is the most negative float32 rather than -inf (a fully masked row then
gives a uniform softmax instead of NaN).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.layers.config import DEFAULT_INIT

Array = jax.Array
DType = Any


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


# The Llama's attention: rotary positions and grouped-query attention, without
# biases (Touvron et al., 2023; the layout of MaxText's llama2 decoder and
# Flax's Gemma example).


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
    positions: [length] integer positions shared by the batch, or
      [batch, length] per example (packed rows restart them per document).
    inv_freq: [head_dim / 2] frequencies (`rotary_inverse_frequencies`).
  """
  frequencies = jnp.asarray(inv_freq, jnp.float32).reshape((1,) * positions.ndim + (-1,))
  angles = positions.astype(jnp.float32)[..., None] * frequencies
  angles = jnp.concatenate([angles, angles], axis=-1)
  # [batch | 1, length, 1 (heads), head_dim]
  angles = angles[None, :, None, :] if positions.ndim == 1 else angles[:, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-second, first], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


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

  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    """Attends over the sequence.

    Args:
      x: [batch, length, hidden] inputs.
      mask: optional bool mask of rank 4, broadcastable to
        [batch, heads, query, key]; True where attention is allowed.
      positions: optional int [batch, length] rotary positions (packed rows
        restart them per document); None: 0 .. length - 1.

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
    if positions is None:
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
