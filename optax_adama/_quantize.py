"""Narrow storage for AdamA's moments: stochastic rounding and 8-bit blocks.

Once gradients are gone, m and v are what is left of the optimizer's memory.
This module holds the leaf-local pieces :func:`scale_by_adama` uses to store
them in fewer bits without keeping a second full-precision copy: every
function here maps one leaf (or one leaf's blocks) to one leaf, elementwise or
with a per-block reduction, so XLA fuses dequantize -> fold -> requantize into
the fold of that leaf alone.

Two formats:

* a narrow float dtype (``bfloat16``, ``float16``) given as ``mu_dtype`` /
  ``nu_dtype``, written back with stochastic rounding. Round-to-nearest is
  wrong for v: with ``b2 = 0.999`` the per-mini-batch decay (0.1%) and each
  micro-batch's increment ((1 - b2) / N of g**2) are below half a bfloat16 ulp
  (0.2%), so v stops decaying and drops small contributions. Stochastic
  rounding keeps every fold unbiased.
* :class:`BlockQuantization`: 8-bit block-wise quantization in the style of
  bitsandbytes' 8-bit Adam. Each leaf is flattened into blocks of about
  ``block_size`` elements; a block stores one float32 scale (its absmax) and
  one byte per element, a ``float8_e4m3fn`` code of ``value / scale``. The
  float8 code is a dynamic-exponent code like bitsandbytes' dynamic map: 3
  mantissa bits at every magnitude over 5.5 decades below the block's absmax,
  rather than a linear code that rounds everything below absmax / 255 to zero.
  v is stored as ``sqrt(v)`` (its sign kept: see ``_fold.load``), so its
  codes span 11 decades of v: a small v next to a large one in the same
  block does not become zero (which would turn ``m / (sqrt(v) + eps)`` into
  ``m / eps``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple
from typing import Optional

import chex
import jax
import jax.numpy as jnp

__all__ = [
    "BlockQuantization",
    "QuantizedArray",
    "mix_seed",
    "random_bits",
    "stochastic_round",
    "stochastic_round_square",
    "storage_dtype",
    "block_absmax",
    "finite_absmax_blocks",
    "quantized_absmax",
    "quantize_blocks",
    "dequantize_blocks",
    "to_blocks",
    "from_blocks",
    "block_layout",
]


class QuantizedArray(NamedTuple):
  """One leaf stored as 8-bit codes with a float32 scale per block.

  The leaf's own shape is not stored: :func:`scale_by_adama` reads it from the
  gradient leaf it folds in. :class:`BlockQuantization`'s example shows one.
  """

  # float8_e4m3fn [num_blocks, block_len], or [leading, blocks_per_index,
  # block_len] for a layer-aligned leaf (each index of its leading axis, each
  # layer of a stack, tiled by its own blocks): value / scale, rounded.
  codes: chex.Array
  scale: chex.Array  # float32 codes.shape[:-1]: block absmax / the code's largest value.


@dataclasses.dataclass(frozen=True)
class BlockQuantization:
  """8-bit block-wise storage for AdamA's moments (see the module docstring).

  Attributes:
    block_size: the most elements one block (one scale) covers. 2048, as
      bitsandbytes: the scale costs 4 bytes per 2048, 0.2% of the codes.
    min_size: leaves with fewer elements are kept in ``mu_dtype`` /
      ``nu_dtype`` (biases, norm scales), as bitsandbytes' ``min_8bit_size``:
      they hold a negligible share of the bytes and a large share of the
      sensitivity.
    code_dtype: the 8-bit float the codes are stored in.
    layer_aligned: how a leaf of rank 2 or more is laid out in blocks.
      ``True``: each index of its leading axis (each layer of a stacked leaf
      ``[num_layers, ...]``) is tiled by whole blocks of its own, so that a
      layer's slice of the moment is a contiguous run of blocks: what
      :func:`release_step` needs to fold 8-bit moments one layer at a time
      in place. The blocks then divide the slice exactly (at most
      ``block_size`` elements each, fewer where the slice's size asks, or
      where fewer give a block count divisible by 8, which a mesh of up to
      8 devices splits whole); a slice with no such tiling into blocks of
      at least ``block_size // 8`` elements (a prime size, say) keeps its
      leaf in ``mu_dtype`` / ``nu_dtype``. ``False``: the whole leaf is
      flattened into even blocks (blocks may straddle layers). ``None``
      (the default): the tiling of ``True`` where the slice has one with
      blocks of at least ``block_size // 8`` elements (every layer of a
      transformer stack), so the layout follows a stack's layers without
      knowing which leaves are stacked; the layout of ``False`` otherwise
      (narrow rows, which would pay a scale per few elements), which
      :func:`release_step` folds through a float32 copy of that leaf.
      1-D leaves are laid out as with ``False``.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=4,
    ...                        quantization=optax_adama.BlockQuantization())
    >>> state = optax_adama.find_adama_state(tx.init({"w": jnp.zeros((256, 256))}))
    >>> state.mu["w"].codes.dtype, state.mu["w"].codes.size  # 1 byte per entry
    (dtype(float8_e4m3fn), 65536)
  """

  block_size: int = 2048
  min_size: int = 4096
  code_dtype: jax.typing.DTypeLike = jnp.float8_e4m3fn
  layer_aligned: Optional[bool] = None

  def __post_init__(self) -> None:
    if self.block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
    if jnp.dtype(self.code_dtype).itemsize != 1:
      raise ValueError(
          f"code_dtype must be an 8-bit float, got {jnp.dtype(self.code_dtype)}.")

  def quantizes(self, shape: tuple[int, ...]) -> bool:
    """Whether a leaf of ``shape`` is stored in 8 bits."""
    if math.prod(shape) < max(self.min_size, 1):
      return False
    # Only an explicit layer_aligned=True keeps a leaf with no tiling dense.
    return self.layer_aligned is not True or len(shape) < 2 or self._aligns(shape)

  def layout(self, shape: tuple[int, ...]) -> tuple[int, int]:
    """``(num_blocks, block_len)`` of a leaf of ``shape`` (all its blocks)."""
    slice_size = math.prod(shape[1:])
    block_len = _exact_block_len(slice_size, self.block_size)
    if self._aligns(shape) and block_len is not None:
      return shape[0] * (slice_size // block_len), block_len
    if self.layer_aligned is True and len(shape) >= 2:
      raise ValueError(
          f"a layer-aligned leaf of shape {shape} has no tiling into blocks of "
          f"{self.block_size // 8}-{self.block_size} elements; it is not quantized.")
    return block_layout(math.prod(shape), self.block_size)

  def _aligns(self, shape: tuple[int, ...]) -> bool:
    """Whether a leaf of ``shape`` gets the layer-aligned tiling."""
    if self.layer_aligned is False or len(shape) < 2:
      return False
    block_len = _exact_block_len(math.prod(shape[1:]), self.block_size)
    if self.layer_aligned is None:  # not rows so narrow that scales would cost
      return block_len is not None and block_len >= max(1, self.block_size // 8)
    return block_len is not None

  def blocks_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The codes' shape for a leaf of ``shape``.

    ``(num_blocks, block_len)``; layer-aligned, ``(shape[0], num_blocks //
    shape[0], block_len)``: a layer's blocks are an index of the leading axis,
    so a mesh can split every layer's blocks over its devices as it splits
    the layer (``release_step(mesh=...)``).
    """
    num_blocks, block_len = self.layout(shape)
    if self._aligns(shape):
      return (shape[0], num_blocks // shape[0], block_len)
    return (num_blocks, block_len)

  def zeros(self, shape: tuple[int, ...]) -> QuantizedArray:
    """The quantized form of ``jnp.zeros(shape)``."""
    blocks_shape = self.blocks_shape(shape)
    return QuantizedArray(
        codes=jnp.zeros(blocks_shape, self.code_dtype),
        scale=jnp.zeros(blocks_shape[:-1], jnp.float32))


# A layer's block count divisible by this where a divisor allows: a mesh of
# up to 8 devices (or any power of two dividing the count) then splits every
# layer's blocks whole (release_step(mesh=...)).
_PREFERRED_BLOCKS_MULTIPLE = 8


def _exact_block_len(size: int, block_size: int) -> Optional[int]:
  """The largest divisor of ``size`` that is at most ``block_size`` and at
  least ``block_size // 8``, preferring one that leaves a block count
  divisible by 8 (or ``size`` itself, when that is at most ``block_size``)."""
  if size <= block_size:
    return size
  divisors = [n for n in range(block_size, max(1, block_size // 8) - 1, -1) if size % n == 0]
  preferred = [n for n in divisors if (size // n) % _PREFERRED_BLOCKS_MULTIPLE == 0]
  return (preferred + divisors)[0] if divisors else None


def block_layout(size: int, block_size: int) -> tuple[int, int]:
  """``(num_blocks, block_len)`` covering ``size`` elements with least padding.

  ``num_blocks = ceil(size / block_size)`` and the blocks are as even as
  possible, so fewer than ``num_blocks`` padding elements are added (a leaf of
  2049 elements becomes 2 blocks of 1025, not 2 of 2048).
  """
  num_blocks = max(1, -(-size // block_size))
  return num_blocks, max(1, -(-size // num_blocks))


def to_blocks(x: jax.Array, *blocks_shape: int) -> jax.Array:
  """Flattens ``x`` (row-major) into ``blocks_shape`` (blocks along the last
  axis: ``num_blocks, block_len``, or a layer-aligned leaf's three), zero-padded."""
  flat = jnp.ravel(x)
  pad = math.prod(blocks_shape) - flat.size
  if pad:
    flat = jnp.pad(flat, (0, pad))
  return flat.reshape(blocks_shape)


def from_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`to_blocks`: drops the padding, restores ``shape``."""
  size = math.prod(shape)
  flat = blocks.reshape(-1)
  if flat.size != size:
    flat = flat[:size]
  return flat.reshape(shape)


def mix_seed(seed: jax.Array, value: jax.Array) -> jax.Array:
  """A uint32 hash of two uint32 scalars (or arrays): derives per-call seeds."""
  golden = jnp.uint32(0x9E3779B9)
  return _hash32(seed.astype(jnp.uint32) * golden + value.astype(jnp.uint32))


def _hash32(x: jax.Array) -> jax.Array:
  # A 32-bit integer finalizer with low bias ("lowbias32", C. Wellons): each
  # output bit depends on every input bit, in five elementwise ops.
  x = x ^ (x >> jnp.uint32(16))
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> jnp.uint32(15))
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> jnp.uint32(16))


def random_bits(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
  """Uniform uint32 noise of ``shape``: a hash of each element's index and ``seed``.

  A counter-based generator built from iota and integer ops, so XLA fuses it
  into the fold that consumes it (a ``jax.random`` draw is a separate,
  materialized buffer on CPU: leaf-sized, for every leaf at once). The index is
  global, so the noise does not depend on how the leaf is sharded.
  """
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride)
    stride = (stride * shape[dim]) % (1 << 32)
  return _hash32(index ^ _hash32(jnp.asarray(seed, jnp.uint32)))


def stochastic_round(
    x: jax.Array, dtype: jax.typing.DTypeLike, seed: jax.Array
) -> jax.Array:
  r"""Rounds float32 ``x`` to ``dtype``'s mantissa width, up or down at random.

  .. math::

    \mathrm{SR}(x) = \lfloor x \rfloor_d \text{ with probability }
      1 - \frac{x - \lfloor x \rfloor_d}{\lceil x \rceil_d - \lfloor x \rfloor_d},
    \text{ else } \lceil x \rceil_d

  so :math:`\mathbb{E}[\mathrm{SR}(x)] = x`. Implemented on the float32 bit
  pattern: uniform random bits are added to the mantissa bits ``dtype`` drops,
  which are then cleared. Sign-magnitude makes this symmetric for negative
  values. Values below ``dtype``'s smallest normal (float8 subnormals) get a
  second, round-to-nearest step in the final cast; non-finite values pass
  through.

  Args:
    x: a float32 array.
    dtype: the narrow float dtype the result will be cast to.
    seed: a uint32 scalar; the noise is a hash of it and each element's index
      (see :func:`random_bits`), so one seed gives one rounding.

  Returns:
    A float32 array whose values are exactly representable in ``dtype`` (in
    its normal range); cast it with ``.astype(dtype)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_adama import _quantize
    >>> x = jnp.full((10000,), 1.0 + 2.0**-10)  # 1/8 of a bfloat16 ulp above 1
    >>> r = _quantize.stochastic_round(x, jnp.bfloat16, jnp.uint32(0))
    >>> print(sorted(set(r.tolist())), round(float(r.mean()), 3))
    [1.0, 1.0078125] 1.001
  """
  if x.dtype != jnp.float32:
    raise TypeError(f"stochastic_round expects float32, got {x.dtype}.")
  dropped_bits = jnp.finfo(jnp.float32).nmant - jnp.finfo(dtype).nmant
  if dropped_bits <= 0:
    return x
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = random_bits(x.shape, seed) >> jnp.uint32(32 - dropped_bits)
  keep = jnp.uint32(0xFFFFFFFF ^ ((1 << dropped_bits) - 1))
  rounded = jax.lax.bitcast_convert_type((bits + noise) & keep, jnp.float32)
  return jnp.where(jnp.isfinite(x), rounded, x)


def stochastic_round_square(
    x: jax.Array, dtype: jax.typing.DTypeLike, seed: jax.Array
) -> jax.Array:
  r"""Rounds float32 ``x`` to ``dtype`` so that its *square* is unbiased.

  With :math:`l \le x \le h` the neighbours of ``x`` in ``dtype``, rounds up
  with probability :math:`(x^2 - l^2) / (h^2 - l^2)`, so
  :math:`\mathbb{E}[\mathrm{SR}(x)^2] = x^2`. :func:`stochastic_round` is
  unbiased for ``x`` instead, which makes :math:`\mathrm{SR}(x)^2` too large
  on average by the rounding variance. That is the rounding for a moment
  stored as its square root (v as :math:`\sqrt v`): v then stays unbiased
  over many folds rather than drifting up. As :func:`stochastic_round`,
  values below ``dtype``'s smallest normal are rounded to nearest by the
  final cast, and non-finite values pass through.

  Args:
    x: a float32 array (its magnitude is rounded, its sign kept).
    dtype: the narrow float dtype the result will be cast to.
    seed: a uint32 scalar (see :func:`random_bits`).

  Returns:
    A float32 array of values representable in ``dtype`` (in its normal range).
  """
  if x.dtype != jnp.float32:
    raise TypeError(f"stochastic_round_square expects float32, got {x.dtype}.")
  dropped_bits = jnp.finfo(jnp.float32).nmant - jnp.finfo(dtype).nmant
  if dropped_bits <= 0:
    return x
  keep = jnp.uint32(0xFFFFFFFF ^ ((1 << dropped_bits) - 1))
  low_bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & keep
  low = jax.lax.bitcast_convert_type(low_bits, jnp.float32)
  high = jax.lax.bitcast_convert_type(
      low_bits + jnp.uint32(1 << dropped_bits), jnp.float32)
  round_up = (x - low) * (x + low) / ((high - low) * (high + low))
  # 24 random bits: a uniform draw in [0, 1) on float32's exact grid.
  uniform = (random_bits(x.shape, seed) >> jnp.uint32(8)).astype(jnp.float32)
  rounded = jnp.where(uniform * 2.0**-24 < round_up, high, low)
  return jnp.where(jnp.isfinite(x), rounded, x)


def storage_dtype(moment: jax.Array | QuantizedArray) -> jnp.dtype:
  """The dtype a moment is stored in (its codes' for a :class:`QuantizedArray`)."""
  if isinstance(moment, QuantizedArray):
    return jnp.dtype(moment.codes.dtype)
  return jnp.dtype(moment.dtype)


def block_absmax(blocks: jax.Array) -> jax.Array:
  """float32 ``blocks.shape[:-1]``: the largest magnitude in each block."""
  return jnp.max(jnp.abs(blocks), axis=-1)


# The two reductions below work on bit patterns on purpose. A reduction that
# shares its float32 producer with the fold (say max(|dequantize(m)|) next to
# b1 * dequantize(m) + ...) makes XLA materialize that producer, a float32
# copy of the leaf, and on CPU it keeps them alive for all leaves at once (2 P
# of temp, measured). Integer ops on the stored bytes share nothing with the
# fold, so each reduction reads its input buffer directly.


def finite_absmax_blocks(x: jax.Array, *blocks_shape: int) -> jax.Array:
  """float32 ``blocks_shape[:-1]``: the largest finite magnitude of ``x`` per block.

  ``x`` is blocked as by :func:`to_blocks`; NaN and Inf entries count as zero
  (the fold drops them).
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  # Positive float32 bit patterns sort as their values; Inf and NaN sort last.
  magnitude = bits & jnp.uint32(0x7FFFFFFF)
  magnitude = jnp.where(magnitude < jnp.uint32(0x7F800000), magnitude,
                        jnp.zeros_like(magnitude))
  largest = jnp.max(to_blocks(magnitude, *blocks_shape), axis=-1)
  return jax.lax.bitcast_convert_type(largest, jnp.float32)


def quantized_absmax(quantized: QuantizedArray) -> jax.Array:
  """float32 ``codes.shape[:-1]``: the largest stored magnitude in each block."""
  codes = quantized.codes
  bits = jax.lax.bitcast_convert_type(codes, jnp.uint8) & jnp.uint8(0x7F)
  largest = jax.lax.bitcast_convert_type(jnp.max(bits, axis=-1), codes.dtype)
  return largest.astype(jnp.float32) * quantized.scale


def quantize_blocks(
    blocks: jax.Array,
    code_dtype: jax.typing.DTypeLike = jnp.float8_e4m3fn,
    seed: Optional[jax.Array] = None,
    absmax: Optional[jax.Array] = None,
    unbiased_square: bool = False,
) -> QuantizedArray:
  """Quantizes float32 ``[..., block_len]`` blocks with one scale per block.

  Args:
    blocks: float32 values, e.g. from :func:`to_blocks`.
    code_dtype: an 8-bit float dtype.
    seed: a uint32 seed for stochastic rounding; ``None`` rounds to nearest.
    absmax: float32 ``blocks.shape[:-1]``, an upper bound of each block's largest
      magnitude; ``None`` computes it exactly. A bound computed without
      ``blocks`` lets XLA fuse the producer of ``blocks`` into the
      quantization instead of materializing it in float32 for the reduction;
      a loose bound costs range at the bottom of the code, not precision
      (float8 codes have the same relative precision at every scale).

  Returns:
    A :class:`QuantizedArray`.
  """
  code_max = float(jnp.finfo(code_dtype).max)
  if absmax is None:
    absmax = block_absmax(blocks)
  scale = absmax / code_max
  # An all-zero block keeps scale 0 (it dequantizes to zeros either way).
  divisor = jnp.where(absmax > 0, scale, jnp.ones_like(scale))
  scaled = blocks / divisor[..., None]
  if seed is not None:
    round_fn = stochastic_round_square if unbiased_square else stochastic_round
    scaled = round_fn(scaled, code_dtype, seed)
  # float8_e4m3fn has no infinity: anything past its max would become NaN.
  codes = jnp.clip(scaled, -code_max, code_max).astype(code_dtype)
  return QuantizedArray(codes=codes, scale=scale)


def dequantize_blocks(quantized: QuantizedArray) -> jax.Array:
  """float32 values of a :class:`QuantizedArray`, in its codes' shape."""
  return quantized.codes.astype(jnp.float32) * quantized.scale[..., None]
