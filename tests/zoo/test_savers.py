"""Tests for models/savers.py: few-bit GELU and its use in the models.

The derivative code is checked against the method's own optimality conditions
(levels are conditional means, boundaries sit where f' is the mean of the two
neighbouring levels) with closed-form integrals of the exact GELU; the gradient
against jax.grad of the exact GELU, within the error the design states.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import optax_adama
from models import harness
from models import savers

ALL_BITS = savers.CODE_BITS


def normal_cdf(x: float) -> float:
  return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def closed_form_level(low: float, high: float) -> float:
  """E[GELU'(x) | low <= x < high], x ~ N(0, 1), exact GELU, in closed form.

  d/dx (Phi^2 / 2 - phi^2 / 2) = Phi phi + x phi^2 = GELU'(x) phi(x).
  """
  def antiderivative(x):
    if math.isinf(x):
      return 0.5 if x > 0 else 0.0
    return 0.5 * normal_cdf(x) ** 2 - 0.5 * float(savers.standard_normal_pdf(x)) ** 2

  return ((antiderivative(high) - antiderivative(low))
          / (normal_cdf(high) - normal_cdf(low)))


@pytest.mark.parametrize("bits", ALL_BITS)
def test_levels_are_the_normal_weighted_means_of_gelu_derivative(bits):
  code = savers.gelu_derivative_code(bits)
  edges = [-math.inf, *code.boundaries, math.inf]
  expected = [closed_form_level(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]
  # Midpoint rule on a 2.4e-4 grid: quadrature error ~1e-8, far below 1e-6.
  np.testing.assert_allclose(code.levels, expected, atol=1e-6)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("approximate", [False, True])
def test_boundaries_sit_where_the_derivative_is_the_mean_of_its_two_levels(bits, approximate):
  code = savers.gelu_derivative_code(bits, approximate)
  at_boundaries = savers.gelu_derivative(code.boundaries, approximate)
  midpoints = 0.5 * (code.levels[:-1] + code.levels[1:])
  # The boundaries are grid points (width 2.4e-4) and |GELU''| <= 0.8, so the
  # condition holds to 0.8 * 2.4e-4 = 2e-4; 5e-4 leaves room.
  np.testing.assert_allclose(at_boundaries, midpoints, atol=5e-4)
  assert np.all(np.diff(code.boundaries) > 0)


@pytest.mark.parametrize("bits", [2, 3])
def test_code_is_a_local_minimum_and_beats_random_starts(bits):
  code = savers.gelu_derivative_code(bits)
  points, weights, derivative = savers._design_grid(False)

  def optimal_levels_error(boundaries):
    index = np.searchsorted(boundaries, points, side="right")
    mass = np.bincount(index, weights, minlength=len(boundaries) + 1)
    levels = np.bincount(index, weights * derivative, minlength=len(boundaries) + 1) / mass
    return savers.piecewise_l2_error(boundaries, levels)

  assert optimal_levels_error(code.boundaries) == pytest.approx(code.l2_error, rel=1e-9)
  for i in range(len(code.boundaries)):
    for step in (-0.02, 0.02):
      moved = code.boundaries.copy()
      moved[i] += step
      assert optimal_levels_error(moved) > code.l2_error
  rng = np.random.default_rng(0)
  for _ in range(20):
    random = np.sort(rng.normal(size=len(code.boundaries)))
    assert optimal_levels_error(random) > code.l2_error


def test_error_falls_with_bits():
  errors = [savers.gelu_derivative_code(bits).l2_error for bits in ALL_BITS]
  assert all(later < earlier / 3 for earlier, later in zip(errors[:-1], errors[1:])), errors


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("approximate", [False, True])
def test_gradient_error_is_what_the_design_states(bits, approximate):
  x = jax.random.normal(jax.random.key(bits), (200_000,))
  cotangent = jax.random.normal(jax.random.key(100 + bits), x.shape)
  few_bit = jax.vjp(lambda x: savers.few_bit_gelu(x, bits, approximate), x)[1](cotangent)[0]
  exact = jax.vjp(lambda x: jax.nn.gelu(x, approximate=approximate), x)[1](cotangent)[0]
  code = savers.gelu_derivative_code(bits, approximate)
  slope_error = np.asarray((few_bit - exact) / cotangent, np.float64)
  # Monte Carlo mean of (q - f')^2 over N(0, 1) inputs: the design's l2_error,
  # within 5 standard errors of the 200k-sample mean.
  squared = slope_error**2
  assert abs(squared.mean() - code.l2_error) < 5 * squared.std() / math.sqrt(squared.size)
  # Pointwise, each level is a mean of f' over its interval, so the error is
  # at most the spread of f' over the interval of that element.
  points = np.linspace(-8, 8, 400_001)
  index = np.searchsorted(code.boundaries, points, side="right")
  derivative = savers.gelu_derivative(points, approximate)
  spread = np.array([np.ptp(derivative[index == i]) for i in range(len(code.levels))])
  x_index = np.searchsorted(code.boundaries, np.asarray(x), side="right")
  assert np.all(np.abs(slope_error) <= spread[x_index] + 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 9)])
def test_forward_is_exact_and_shapes_and_dtypes_are_kept_under_jit(dtype, shape):
  x = jax.random.normal(jax.random.key(0), shape).astype(dtype)
  forward = jax.jit(savers.few_bit_gelu, static_argnums=(1, 2))
  # Against GELU compiled alike: op by op, XLA may round tanh otherwise (1 ulp).
  gelu = jax.jit(jax.nn.gelu, static_argnames="approximate")
  np.testing.assert_array_equal(forward(x, 2, True), gelu(x, approximate=True))
  grad = jax.jit(jax.grad(lambda x: savers.few_bit_gelu(x, 3).astype(jnp.float32).sum()))(x)
  assert grad.shape == x.shape and grad.dtype == x.dtype
  code = savers.gelu_derivative_code(3)
  expected = code.levels[np.searchsorted(code.boundaries, np.asarray(x, np.float32),
                                         side="right")]
  np.testing.assert_allclose(np.asarray(grad, np.float32), expected,
                             rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_packing_round_trips_and_uses_bits_per_element(bits):
  codes = jax.random.randint(jax.random.key(bits), (37,), 0, 2**bits).astype(jnp.uint8)
  packed = savers.pack_codes(codes, bits)
  assert packed.dtype == jnp.uint8
  assert packed.size == savers.packed_bytes(37, bits) == math.ceil(37 * {3: 4}.get(bits, bits) / 8)
  np.testing.assert_array_equal(savers.unpack_codes(packed, bits, 37), codes)


def test_saved_residual_is_the_packed_code():
  x = jnp.ones((4, 64), jnp.float32)
  _, residuals = jax.vjp(lambda x: savers.few_bit_gelu(x, 2), x)
  leaves = [leaf for leaf in jax.tree.leaves(residuals) if hasattr(leaf, "dtype")]
  assert [(leaf.dtype, leaf.size) for leaf in leaves] == [(jnp.uint8, 4 * 64 // 4)]


def test_bad_bits_raise():
  with pytest.raises(ValueError, match="bits must be one of"):
    savers.gelu_derivative_code(5)
  with pytest.raises(ValueError, match="gelu_bits must be None or one of"):
    models.get_config("gpt_test", gelu_bits=8)


@pytest.mark.parametrize("kind", [
    "gpt", pytest.param("bert", marks=pytest.mark.slow),
    pytest.param("vit", marks=pytest.mark.slow)])
def test_model_with_few_bit_gelu_has_the_same_loss_and_close_gradients(kind):
  exact_config = models.get_config(f"{kind}_test")
  exact_loss, params = models.split_loss_fn(models.create(exact_config, rngs=nnx.Rngs(0)))
  few_bit_loss, _ = harness.split_model(models.get_config(f"{kind}_test", gelu_bits=4))
  batch = harness.random_batch(exact_config, harness.abstract_batch(exact_config, 2))
  exact_value, exact_grad = jax.jit(jax.value_and_grad(exact_loss))(params, batch)
  few_bit_value, few_bit_grad = jax.jit(jax.value_and_grad(few_bit_loss))(params, batch)
  assert few_bit_value == exact_value
  exact_flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(exact_grad)])
  few_bit_flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(few_bit_grad)])
  # 4 bits: the derivative's RMS error is 0.024 against an RMS of ~0.6, so
  # the gradient keeps its direction (a bug in the codes drops cosine to ~0).
  cosine = jnp.dot(exact_flat, few_bit_flat) / (
      jnp.linalg.norm(exact_flat) * jnp.linalg.norm(few_bit_flat))
  assert cosine > 0.99


def gradient_temp_bytes(preset: str, batch_size: int, **overrides) -> int:
  """Temp bytes of the compiled gradient of a scanned model (compile only).

  Scanned: XLA's CPU scheduler keeps an unrolled model's activations alive
  whatever is saved (remat "full" measures the same as "none" there), while a
  scan's saved residuals are exactly what the backward pass reads.
  """
  config = models.get_config(preset, scan_layers=True, **overrides)
  loss_fn, params = harness.split_model(config)
  batch = harness.abstract_batch(config, batch_size)
  compiled = jax.jit(jax.grad(loss_fn)).lower(params, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_few_bit_gelu_cuts_the_compiled_gradient_memory():
  exact, two = (gradient_temp_bytes("gpt_test", 4, gelu_bits=bits) for bits in (None, 2))
  # Autodiff keeps at least the float32 GELU input, [4 * 32, 512] per layer;
  # the code keeps 1/16 of it. (2 against 4 bits is a 16 KB difference here,
  # within XLA's buffer rounding: the slow gpt2_small test compares those.)
  gelu_input_bytes = 4 * 32 * 512 * 4
  assert two <= exact - gelu_input_bytes * (1 - 1 / 16)


@pytest.mark.slow
def test_gpt2_small_adama_step_memory_with_two_and_four_bits():
  """gpt2_small, scanned, AdamA, N = 4 sequences of 1024, compile only."""
  totals = {}
  for bits in (None, 4, 2):
    config = models.get_config("gpt2_small", scan_layers=True, gelu_bits=bits)
    loss_fn, params = harness.split_model(config)
    step, tx = harness.make_step("adama", loss_fn, num_micro_batches=4)
    report = optax_adama.memory_report(
        step, params, jax.eval_shape(tx.init, params), harness.abstract_batch(config, 4))
    totals[bits] = report.total_bytes
  # 12 layers x 1024 x 3072 float32 GELU inputs: 151 MB that the code shrinks 8x or 16x.
  gelu_input_bytes = 12 * 1024 * 3072 * 4
  assert totals[4] <= totals[None] - gelu_input_bytes * (1 - 1 / 8)
  assert totals[2] <= totals[4]


def sampled_matmul_problem():
  """x with row norms spread 30x (where norm sampling matters), w, g."""
  x = (jax.random.normal(jax.random.key(0), (4, 16, 8))
       * jnp.linspace(0.1, 3.0, 16)[None, :, None])
  w = jax.random.normal(jax.random.key(1), (8, 5))
  g = jax.random.normal(jax.random.key(2), (4, 16, 5))
  return x, w, g


def sampled_grads(x, w, g, key, keep_ratio):
  return jax.vjp(lambda x, w: savers.sampled_matmul(x, w, key, keep_ratio), x, w)[1](g)


def test_sampled_matmul_weight_gradient_is_unbiased_and_input_gradient_exact():
  x, w, g = sampled_matmul_problem()
  exact_x, exact_w = jax.vjp(lambda x, w: x @ w, x, w)[1](g)
  keys = jax.random.split(jax.random.key(3), 4000)
  grads = jax.jit(jax.vmap(lambda key: sampled_grads(x, w, g, key, 0.25)))(keys)
  estimates = np.asarray(grads[1], np.float64)
  # Unbiased: every entry's mean over 4000 draws within 5 standard errors
  # (40 entries; an estimator without the 1/q reweighting is off by >20 SE).
  standard_error = estimates.std(axis=0) / math.sqrt(len(keys))
  assert np.all(np.abs(estimates.mean(axis=0) - exact_w) <= 5 * standard_error + 1e-6)
  np.testing.assert_allclose(grads[0][0], exact_x, rtol=1e-5, atol=1e-5)
  # keep_ratio 1 keeps every row: exact, up to the order of the 64-row float32
  # sum (an entry near cancellation moved 7e-7 once: a few ulps of its terms).
  np.testing.assert_allclose(sampled_grads(x, w, g, keys[0], 1.0)[1], exact_w, rtol=1e-5,
                             atol=2e-6)


def test_sampled_matmul_saves_the_kept_rows_only():
  x, w, _ = sampled_matmul_problem()
  forward = jax.vjp(lambda x: savers.sampled_matmul(x, w, jax.random.key(0), 0.25), x)
  shapes = sorted(leaf.shape for leaf in jax.tree.leaves(forward[1]) if hasattr(leaf, "shape"))
  assert (16, 8) in shapes  # 25% of the 64 rows of x
  assert (64, 8) not in shapes and (4, 16, 8) not in shapes
  with pytest.raises(ValueError, match="keep_ratio must be in"):
    savers.sampled_matmul(x, w, jax.random.key(0), 0.0)


def test_model_with_sampled_projection_samples_only_the_projection_kernel_gradient():
  config = models.get_config("gpt_test")
  exact_loss, params = models.split_loss_fn(models.create(config, rngs=nnx.Rngs(0)))
  batch = harness.random_batch(config, harness.abstract_batch(config, 2))
  exact_value, exact_grad = jax.jit(jax.value_and_grad(exact_loss))(params, batch)
  kernel = ("blocks", 0, "mlp", "proj", "kernel")
  for keep_ratio in (1.0, 0.5):
    loss_fn, _ = harness.split_model(models.get_config("gpt_test", linear_keep_ratio=keep_ratio))
    value, grad = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    np.testing.assert_allclose(value, exact_value, rtol=1e-6)
    flat, exact_flat = (dict(jax.tree_util.tree_leaves_with_path(g)) for g in (grad, exact_grad))
    for path, leaf in flat.items():
      is_kernel = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)[:5] == kernel
      if keep_ratio == 1.0 or not is_kernel:
        # Everything else gets the exact input gradient (keep 1: all exact).
        np.testing.assert_allclose(leaf, exact_flat[path], rtol=1e-4, atol=1e-7)
      else:
        assert not np.allclose(leaf, exact_flat[path])


@pytest.mark.parametrize("num_chunks", [1, 4, 32])
def test_chunked_cross_entropy_equals_the_whole_logits_loss(num_chunks):
  keys = jax.random.split(jax.random.key(0), 3)
  features = jax.random.normal(keys[0], (2, 16, 8))
  table = jax.random.normal(keys[1], (50, 8))
  labels = jax.random.randint(keys[2], (2, 16), 0, 50)
  whole = lambda f, t: models.layers.cross_entropy(f @ t.T, labels)
  chunked = lambda f, t: savers.chunked_cross_entropy(f, t, labels, num_chunks=num_chunks)
  np.testing.assert_allclose(chunked(features, table), whole(features, table), rtol=1e-6)
  grads = jax.grad(lambda *a: chunked(*a)[0], argnums=(0, 1))(features, table)
  expected = jax.grad(lambda *a: whole(*a)[0], argnums=(0, 1))(features, table)
  # The same sums in another order: float32 rounding of a loss near 9.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               grads, expected)


def test_chunked_cross_entropy_rejects_chunks_that_do_not_divide_the_tokens():
  with pytest.raises(ValueError, match="num_chunks=3 must be a positive divisor.*32"):
    savers.chunked_cross_entropy(jnp.zeros((2, 16, 8)), jnp.zeros((50, 8)),
                                 jnp.zeros((2, 16), jnp.int32), num_chunks=3)
  with pytest.raises(ValueError, match="loss_chunks must be a positive int"):
    models.get_config("gpt_test", loss_chunks=0)


def test_gpt_loss_chunks_cut_the_release_step_memory():
  """gpt_test with a 4,096-token vocabulary, scanned, remat full, AdamA's
  release step, N = 2 micro-batches of 8 x 32 tokens: the [256, 4096] logits
  (4 MB a copy) are most of the step; 8 chunks keep 1/8 of them. Measured:
  29.5 MB whole, 17.5 MB in 8 chunks (params 2.9 MB). (That the chunked model
  trains as the whole one: tests/zoo/test_train.py.)"""
  batch = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}
  totals = {}
  for chunks in (1, 8):
    config = models.get_config("gpt_test", vocab_size=4096, scan_layers=True, remat="full",
                               loss_chunks=chunks)
    staged, params = models.staged_loss(models.create_abstract(config))
    tx = optax_adama.adama(1e-3, num_micro_batches=2)
    step = optax_adama.release_step(staged, tx)
    totals[chunks] = optax_adama.memory_report(
        step, params, jax.eval_shape(tx.init, params), batch).total_bytes
  logits_bytes = 8 * 32 * 4096 * 4
  assert totals[8] <= totals[1] - 2 * logits_bytes, totals
