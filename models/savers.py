"""Activation savers: layers whose backward pass keeps less than autodiff would.

Pure JAX (`jax.custom_vjp`), usable in any Flax or plain-JAX model. Each saver
computes the same forward value as the layer it replaces and changes only what
is saved for the backward pass, so it composes with AdamA (which never sees the
activations) and with any `jax.checkpoint` policy.

- `few_bit_gelu`: GELU whose backward keeps a `bits`-bit code of the input
  (1 to 4 bits, packed into uint8) instead of the float input, and multiplies
  the incoming cotangent by a piecewise-constant approximation of GELU' with
  the levels and boundaries that minimise the derivative's L2 error under a
  standard normal input (`gelu_derivative_code`).
- `sampled_matmul`: x @ w whose backward keeps only a `keep_ratio` share of
  x's rows (column-row pairs of the weight gradient x^T g): the largest-norm
  half kept outright, the rest sampled by norm and reweighted, so the weight
  gradient is unbiased (WTA-CRS); the input gradient g w^T is exact.

References:
  Novikov, Bershatsky, Gusak, Shonenkov, Dimitrov, Oseledets, "Few-Bit Backward:
  Quantized Gradients of Activation Functions for Memory Footprint Reduction",
  ICML 2023, https://arxiv.org/abs/2202.00441
  Liu, Wang, Dao, Zhou, Yuan, Song, Shrivastava, Hu, "Winner-Take-All Column Row
  Sampling for Memory Efficient Adaptation of Language Model", NeurIPS 2023,
  https://arxiv.org/abs/2305.15265
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# Bits a code may have, and the width of the uint8 slot that holds one code:
# 3-bit codes do not tile a byte, so they are stored in 4-bit slots.
CODE_BITS = (1, 2, 3, 4)
_SLOT_BITS = {1: 1, 2: 2, 3: 4, 4: 4}

# The design grid: the derivative is flat (0 or 1) outside +-8 and a standard
# normal puts ~1e-15 of its mass there, so the outer intervals end at the grid.
_GRID_LIMIT = 8.0
_GRID_POINTS = 2**16
_TANH_GELU_SCALE = math.sqrt(2.0 / math.pi)
_TANH_GELU_CUBIC = 0.044715


def gelu_derivative(x: np.ndarray, approximate: bool = False) -> np.ndarray:
  """GELU'(x) in float64: of x Phi(x), or of GPT-2's tanh form if `approximate`."""
  x = np.asarray(x, np.float64)
  if approximate:
    inner = _TANH_GELU_SCALE * (x + _TANH_GELU_CUBIC * x**3)
    tanh = np.tanh(inner)
    inner_slope = _TANH_GELU_SCALE * (1.0 + 3.0 * _TANH_GELU_CUBIC * x**2)
    return 0.5 * (1.0 + tanh) + 0.5 * x * (1.0 - tanh**2) * inner_slope
  cdf = 0.5 * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2.0)))
  return cdf + x * standard_normal_pdf(x)


def standard_normal_pdf(x: np.ndarray) -> np.ndarray:
  """The N(0, 1) density, the weight of the method's error."""
  return np.exp(-0.5 * np.square(x)) / math.sqrt(2.0 * math.pi)


@dataclasses.dataclass(frozen=True)
class DerivativeCode:
  """A piecewise-constant approximation of an activation's derivative.

  Interval i is [boundaries[i-1], boundaries[i]) with boundaries[-1] = -inf and
  boundaries[num_levels - 1] = +inf; the derivative is `levels[i]` on it.

  Attributes:
    bits: bits of one code; there are 2**bits intervals.
    boundaries: float64[2**bits - 1], increasing.
    levels: float64[2**bits], the value of the derivative on each interval.
    l2_error: E[(f'(x) - q(x))^2] for x ~ N(0, 1): what the design minimises.
  """

  bits: int
  boundaries: np.ndarray
  levels: np.ndarray
  l2_error: float


def _design_grid(approximate: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(points, normal weights, derivative) of a midpoint rule on [-8, 8]."""
  width = 2 * _GRID_LIMIT / _GRID_POINTS
  points = -_GRID_LIMIT + width * (np.arange(_GRID_POINTS) + 0.5)
  return points, standard_normal_pdf(points) * width, gelu_derivative(points, approximate)


def piecewise_l2_error(
    boundaries: np.ndarray, levels: np.ndarray, *, approximate: bool = False
) -> float:
  """E[(GELU'(x) - q(x))^2], x ~ N(0, 1), of the code (boundaries, levels)."""
  points, weights, derivative = _design_grid(approximate)
  approximation = np.asarray(levels)[np.searchsorted(boundaries, points, side="right")]
  return float(np.sum(weights * np.square(derivative - approximation)))


def _interval_means(cuts: np.ndarray, weights: np.ndarray, derivative: np.ndarray) -> np.ndarray:
  """The weighted mean of f' on each interval points[cuts[i]:cuts[i + 1]]."""
  return (np.add.reduceat(weights * derivative, cuts[:-1])
          / np.add.reduceat(weights, cuts[:-1]))


def _lloyd(cuts: np.ndarray, weights: np.ndarray, derivative: np.ndarray,
           max_iterations: int) -> np.ndarray:
  """Alternates the two optimality conditions until no boundary moves.

  `cuts` are grid indices: interval i is points[cuts[i]:cuts[i + 1]]. Each
  level is set to its interval's weighted mean of f' (optimal for fixed
  boundaries); then each boundary is moved, inside its neighbours, to the grid
  point that minimises the error for fixed levels. Neither step can raise the
  error, so the iteration descends to a stationary point of the
  boundary-level problem.
  """
  for _ in range(max_iterations):
    levels = _interval_means(cuts, weights, derivative)
    moved = cuts.copy()
    for i in range(1, len(cuts) - 1):
      low, high = moved[i - 1] + 1, moved[i + 1] - 1
      left, right = levels[i - 1], levels[i]
      # Error with the boundary at s, minus a constant: the prefix sum of
      # w [(f' - left)^2 - (f' - right)^2] from the left neighbour to s.
      gain = weights[low - 1:high] * (right - left) * (
          2.0 * derivative[low - 1:high] - left - right)
      prefix = np.concatenate([[0.0], np.cumsum(gain)])
      moved[i] = low - 1 + int(np.argmin(prefix[1:])) + 1
    if np.array_equal(moved, cuts):
      break
    cuts = moved
  return cuts


@functools.cache
def gelu_derivative_code(bits: int, approximate: bool = False) -> DerivativeCode:
  """The optimal `bits`-bit piecewise-constant approximation of GELU'.

  Minimises, over 2**bits - 1 boundaries s and 2**bits levels y,

  .. math::
    \\int (f'(x) - q(x))^2 \\, \\varphi(x) \\, dx, \\qquad
    q(x) = y_i \\text{ for } s_{i-1} \\le x < s_i,

  with `phi` the N(0, 1) density (the paper's model of pre-activations). At
  the optimum each level is the phi-weighted mean of f' on its interval and
  f'(s_i) = (y_i + y_{i+1}) / 2 at each boundary. GELU' is not monotone
  (it dips below 0 and rises above 1), so the problem has local optima:
  Lloyd's alternation is run from two starts (equal-probability and
  equal-width intervals) and the lower error kept. Cached: one design per
  (bits, approximate) per process, about a second each.

  Args:
    bits: bits per code, 1 to 4.
    approximate: design for the tanh GELU (GPT-2) instead of x Phi(x).

  Returns:
    The `DerivativeCode`; boundaries are accurate to the design grid (2.4e-4).

  References:
    Novikov et al., "Few-Bit Backward", https://arxiv.org/abs/2202.00441
  """
  if bits not in CODE_BITS:
    raise ValueError(f"bits must be one of {CODE_BITS}, got {bits!r}.")
  points, weights, derivative = _design_grid(approximate)
  num_levels = 2**bits
  # Start 1: intervals of equal normal probability; start 2: equal width on [-3, 3].
  mass = np.cumsum(weights) / np.sum(weights)
  quantile_cuts = np.searchsorted(mass, np.arange(1, num_levels) / num_levels)
  width_cuts = np.searchsorted(points, np.linspace(-3.0, 3.0, num_levels + 1)[1:-1])
  best = None
  for inner in (quantile_cuts, width_cuts):
    cuts = _lloyd(np.concatenate([[0], inner, [_GRID_POINTS]]).astype(np.int64),
                  weights, derivative, max_iterations=2000)
    levels = _interval_means(cuts, weights, derivative)
    # A boundary lies between the last point of one interval and the first of the next.
    boundaries = 0.5 * (points[cuts[1:-1] - 1] + points[cuts[1:-1]])
    error = piecewise_l2_error(boundaries, levels, approximate=approximate)
    if best is None or error < best.l2_error:
      best = DerivativeCode(bits, boundaries, levels, error)
  return best


def pack_codes(codes: Array, bits: int) -> Array:
  """Packs integer codes in [0, 2**bits) into a flat uint8 array.

  1-, 2- and 4-bit codes take exactly `bits` bits each; 3-bit codes take a
  4-bit slot (8 / 3 is not whole). The last byte is zero-padded.
  """
  slot = _SLOT_BITS[bits]
  per_byte = 8 // slot
  flat = codes.reshape(-1).astype(jnp.uint8)
  flat = jnp.pad(flat, (0, (-flat.size) % per_byte))
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * slot)[None, :]
  # The shifted codes occupy disjoint bits, so their sum is their bitwise or.
  return jnp.sum(flat.reshape(-1, per_byte) << shifts, axis=1, dtype=jnp.uint8)


def unpack_codes(packed: Array, bits: int, size: int) -> Array:
  """Inverse of `pack_codes`: the first `size` codes, as a flat uint8 array."""
  slot = _SLOT_BITS[bits]
  per_byte = 8 // slot
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * slot)[None, :]
  mask = jnp.uint8(2**slot - 1)
  return ((packed[:, None] >> shifts) & mask).reshape(-1)[:size]


def packed_bytes(num_elements: int, bits: int) -> int:
  """Bytes `pack_codes` uses for `num_elements` codes of `bits` bits."""
  return -(-num_elements // (8 // _SLOT_BITS[bits]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def few_bit_gelu(x: Array, bits: int, approximate: bool = False) -> Array:
  """GELU, exact forward, backward from a `bits`-bit code of the input.

  The forward is `jax.nn.gelu(x, approximate)`. For the backward it keeps only
  the index of the interval of `gelu_derivative_code(bits, approximate)` that
  each element falls in, packed `8 // bits` to a byte (3 bits: two to a byte),
  instead of the float input autodiff would keep, and returns
  `cotangent * levels[code]`.

  .. math::
    \\frac{\\partial L}{\\partial x} \\approx \\frac{\\partial L}{\\partial y}
    \\, q(x), \\qquad E_{x \\sim N(0,1)}[(q(x) - \\mathrm{GELU}'(x))^2]
    = \\text{DerivativeCode.l2\\_error}

  Args:
    x: pre-activations, any float dtype and shape.
    bits: bits per saved element, 1 to 4.
    approximate: the tanh GELU (GPT-2) instead of x Phi(x) (BERT, ViT).

  Returns:
    GELU(x), same shape and dtype as `x`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from models.savers import few_bit_gelu
    >>> x = jnp.linspace(-3.0, 3.0, 7)
    >>> bool(jnp.allclose(few_bit_gelu(x, 2), jax.nn.gelu(x, approximate=False)))
    True
    >>> grad = jax.grad(lambda x: few_bit_gelu(x, 2).sum())(x)

  References:
    Novikov et al., "Few-Bit Backward", https://arxiv.org/abs/2202.00441
  """
  return jax.nn.gelu(x, approximate=approximate)


def _few_bit_gelu_forward(x: Array, bits: int, approximate: bool) -> tuple[Array, Array]:
  code = gelu_derivative_code(bits, approximate)
  x32 = x.astype(jnp.float32)
  # At most 15 boundaries: counting those below x is one fused elementwise pass
  # (a binary search would loop over the whole array log2(15) times).
  codes = sum((x32 >= float(b)).astype(jnp.uint8) for b in code.boundaries)
  return jax.nn.gelu(x, approximate=approximate), pack_codes(codes, bits)


def _few_bit_gelu_backward(
    bits: int, approximate: bool, packed: Array, cotangent: Array
) -> tuple[Array]:
  levels = jnp.asarray(gelu_derivative_code(bits, approximate).levels, jnp.float32)
  codes = unpack_codes(packed, bits, cotangent.size).reshape(cotangent.shape)
  slope = jnp.take(levels, codes.astype(jnp.int32))
  return ((cotangent.astype(jnp.float32) * slope).astype(cotangent.dtype),)


few_bit_gelu.defvjp(_few_bit_gelu_forward, _few_bit_gelu_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sampled_matmul(x: Array, w: Array, key: Array, keep_ratio: float) -> Array:
  """`x @ w`, exact forward; the backward keeps `keep_ratio` of x's rows.

  With x as rows x_i (every leading axis flattened) and g the output
  cotangent, the weight gradient is a sum of column-row pairs,
  x^T g = sum_i x_i^T g_i. The forward keeps k = ceil(keep_ratio * n) rows:
  the k // 2 of largest norm outright (winner-take-all), and k - k // 2 drawn
  with replacement from the others with probability q_j proportional to
  ||x_j||, each scaled by 1 / ((k - k // 2) q_j):

  .. math::
    \\widehat{x^T g} = \\sum_{i \\in C} x_i^T g_i
      + \\frac{1}{m} \\sum_{s=1}^{m} \\frac{x_{j_s}^T g_{j_s}}{q_{j_s}},
    \\qquad E[\\widehat{x^T g}] = x^T g.

  Rows are drawn by ||x_i|| alone: the variance-optimal probabilities are
  proportional to ||x_i|| ||g_i||, but the forward, which decides what to
  keep, cannot see g. The input gradient g w^T needs only w,
  so it is exact. `keep_ratio=1` keeps every row and is exact.

  Args:
    x: [..., d_in] inputs.
    w: [d_in, d_out] weight.
    key: a `jax.random.key`; draw a fresh one per step for the estimate to
      be unbiased over steps.
    keep_ratio: share of rows kept for the weight gradient, in (0, 1].

  Returns:
    [..., d_out] = x @ w.

  References:
    Liu et al., "Winner-Take-All Column Row Sampling", https://arxiv.org/abs/2305.15265
  """
  del key
  _check_keep_ratio(keep_ratio)
  return x @ w


def _check_keep_ratio(keep_ratio: float) -> None:
  if not 0.0 < keep_ratio <= 1.0:
    raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}.")


def _sampled_matmul_forward(x, w, key, keep_ratio):
  _check_keep_ratio(keep_ratio)
  rows = x.reshape(-1, x.shape[-1])
  num_rows = rows.shape[0]
  num_kept = min(num_rows, math.ceil(keep_ratio * num_rows))
  if num_kept == num_rows:
    return x @ w, (rows, jnp.arange(num_rows), w)
  num_winners = num_kept // 2
  num_sampled = num_kept - num_winners
  norms = jnp.linalg.norm(rows.astype(jnp.float32), axis=1)
  winners = jax.lax.top_k(norms, num_winners)[1]
  # The others, by norm; a tiny floor keeps all-zero rows drawable (q > 0).
  is_winner = jnp.zeros(num_rows, bool).at[winners].set(True)
  rest = jnp.where(is_winner, 0.0, norms + 1e-12)
  probabilities = rest / jnp.sum(rest)
  drawn = jax.random.choice(key, num_rows, (num_sampled,), p=probabilities)
  scale = 1.0 / (num_sampled * probabilities[drawn])
  kept = jnp.concatenate([rows[winners], rows[drawn] * scale[:, None].astype(rows.dtype)])
  return x @ w, (kept, jnp.concatenate([winners, drawn]), w)


def _sampled_matmul_backward(keep_ratio, residuals, cotangent):
  del keep_ratio
  kept, indices, w = residuals
  cotangent_rows = cotangent.reshape(-1, cotangent.shape[-1])
  grad_w = kept.T @ cotangent_rows[indices]
  grad_x = cotangent @ w.T
  return grad_x, grad_w.astype(w.dtype), None


sampled_matmul.defvjp(_sampled_matmul_forward, _sampled_matmul_backward)


def key_from_bits(x: Array) -> Array:
  """A PRNG key seeded by the bits of `x`: fresh draws per batch, no key to pass.

  For savers inside a model whose loss must stay a pure function of params
  and batch (what a `lax.scan` over micro-batches needs): different inputs
  seed different draws, and the same input the same draw.
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jax.random.key(jnp.sum(bits, dtype=jnp.uint32))


def chunked_cross_entropy(
    features: Array, table: Array, labels: Array, *, num_chunks: int,
    dtype: jnp.dtype | None = None, weights: Array | None = None,
    denominator: Array | float | None = None,
) -> tuple[Array, Array]:
  """Mean cross-entropy and accuracy of ``features @ table.T`` logits, by chunks.

  A language model's head (a tied embedding ``table`` of ``[vocab, hidden]``)
  makes ``[tokens, vocab]`` logits; with a large vocabulary they, their
  softmax and their gradient are the largest activations of the step (GPT-2
  small, 2,048 tokens: 0.83 P a copy). Here the tokens are taken in
  ``num_chunks`` chunks under a ``jax.lax.scan`` whose body is rematerialized:
  the forward keeps only each chunk's two scalar sums, the backward recomputes
  one chunk's logits at a time, and the table's gradient is summed over the
  chunks in the scan's carry. The same values as
  ``layers.cross_entropy(features @ table.T, labels)`` up to float rounding.

  Args:
    features: ``[..., hidden]`` (the final norm's output).
    table: ``[vocab, hidden]``.
    labels: ``[...]`` int labels, the shape of ``features`` less its last axis.
    num_chunks: how many chunks the tokens are split into; it must divide
      their number.
    dtype: the logits' compute dtype (``features`` and ``table`` are cast
      to it, as ``nnx.Embed.attend`` does); ``None`` keeps ``features``'.
    weights: optional ``[...]`` weights of the labels (a loss mask); the
      results are then their weighted means, as ``layers.cross_entropy``'s.
    denominator: with ``weights``, what their weighted sums are divided by
      (None: the weights' sum), as ``layers.cross_entropy``'s.

  Returns:
    (mean loss, accuracy), float32 scalars.
  """
  hidden = features.shape[-1]
  features, labels = features.reshape(-1, hidden), labels.reshape(-1)
  num_tokens = labels.shape[0]
  if num_chunks < 1 or num_tokens % num_chunks:
    raise ValueError(
        f"num_chunks={num_chunks} must be a positive divisor of the number of tokens, "
        f"{num_tokens}.")
  dtype = features.dtype if dtype is None else dtype
  features, table = features.astype(dtype), table.astype(dtype)

  if weights is not None:
    return _weighted_chunked_cross_entropy(features, table, labels, weights.reshape(-1),
                                           num_chunks=num_chunks, denominator=denominator)

  @jax.checkpoint
  def chunk_sums(chunk_features, chunk_labels):
    # Contracting the hidden axes of both: `chunk_features @ table.T` would
    # have XLA lay out a transposed copy of the table.
    logits = jnp.einsum("th,vh->tv", chunk_features, table).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, chunk_labels[:, None], axis=-1)[:, 0]
    correct = (jnp.argmax(logits, axis=-1) == chunk_labels).astype(jnp.float32)
    return jnp.sum(nll), jnp.sum(correct)

  def body(totals, chunk):
    sums = chunk_sums(*chunk)
    return jax.tree.map(jnp.add, totals, sums), None

  chunks = (features.reshape(num_chunks, -1, hidden), labels.reshape(num_chunks, -1))
  # zeros_like of the features: under shard_map the carry then varies over the
  # devices as the sums do (a plain constant does not, and the scan refuses it).
  zero = jnp.zeros_like(features[0, 0], jnp.float32)
  (nll, correct), _ = jax.lax.scan(body, (zero, zero), chunks)
  return nll / num_tokens, correct / num_tokens


def _weighted_chunked_cross_entropy(features: Array, table: Array, labels: Array,
                                    weights: Array, *, num_chunks: int,
                                    denominator: Array | float | None = None,
                                    ) -> tuple[Array, Array]:
  """`chunked_cross_entropy` with flat `weights`: sum(loss * w) / max(sum(w), 1), or
  / `denominator` when given."""
  hidden = features.shape[-1]
  weights = weights.astype(jnp.float32)

  @jax.checkpoint
  def chunk_sums(chunk_features, chunk_labels, chunk_weights):
    logits = jnp.einsum("th,vh->tv", chunk_features, table).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, chunk_labels[:, None], axis=-1)[:, 0]
    correct = (jnp.argmax(logits, axis=-1) == chunk_labels).astype(jnp.float32)
    return jnp.sum(nll * chunk_weights), jnp.sum(correct * chunk_weights)

  def body(totals, chunk):
    return jax.tree.map(jnp.add, totals, chunk_sums(*chunk)), None

  chunks = (features.reshape(num_chunks, -1, hidden), labels.reshape(num_chunks, -1),
            weights.reshape(num_chunks, -1))
  zero = jnp.zeros_like(features[0, 0], jnp.float32)
  (nll, correct), _ = jax.lax.scan(body, (zero, zero), chunks)
  # max(., 1) as layers.cross_entropy: a micro-batch without targets gives 0, not NaN.
  total = jnp.maximum(jnp.sum(weights), 1.0) if denominator is None else denominator
  return nll / total, correct / total
