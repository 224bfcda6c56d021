"""LayerNorm and RMSNorm, with their statistics in float32 and every cast explicit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
DType = Any


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
