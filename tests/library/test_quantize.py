"""Smaller moments: stochastic rounding, 8-bit blocks, their fold and memory."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP

import optax_adama
from optax_adama import _quantize

CODE_MAX = 448.0  # largest float8_e4m3fn value


def test_block_layout_pads_least():
  assert _quantize.block_layout(4096, 2048) == (2, 2048)
  assert _quantize.block_layout(2049, 2048) == (2, 1025)  # 1 padding element
  assert _quantize.block_layout(100, 2048) == (1, 100)
  x = jnp.arange(2049.0).reshape(683, 3)
  blocks = _quantize.to_blocks(x, 2, 1025)
  assert blocks.shape == (2, 1025) and float(blocks[1, -1]) == 0.0
  np.testing.assert_array_equal(_quantize.from_blocks(blocks, x.shape), x)


def test_layer_aligned_layout_tiles_each_layer_with_whole_blocks():
  aligned = optax_adama.BlockQuantization(layer_aligned=True)
  # 768 x 3072 per layer = 1152 blocks of 2048; a bias row is one block.
  assert aligned.layout((12, 768, 3072)) == (12 * 1152, 2048)
  assert aligned.layout((24, 1536)) == (24, 1536)
  # Blocks divide the slice exactly, 8 of them per layer where a divisor
  # allows (a mesh of 8 devices splits them whole): 6 x 1000 -> 8 blocks of
  # 750 (not 3 of 2000); 16,896 -> 16 of 1,056 (not 11 of 1,536); where
  # none does (6 x 1001 = 2 x 3 x 7 x 11 x 13), the longest: 3 of 2002.
  assert aligned.layout((4, 6, 1000)) == (32, 750)
  assert aligned.blocks_shape((4, 6, 1000)) == (4, 8, 750)
  assert aligned.blocks_shape((66, 16896)) == (66, 16, 1056)
  assert aligned.blocks_shape((4, 6, 1001)) == (4, 3, 2002)
  # With layer_aligned=False the bias stack's blocks straddle layers (18 of 2048).
  assert optax_adama.BlockQuantization(layer_aligned=False).layout((24, 1536)) == (18, 2048)
  # 1-D leaves as before; a slice of prime size over block_size stays dense.
  assert aligned.layout((2049,)) == (2, 1025)
  assert aligned.quantizes((4, 4099)) is False
  # Layer l's slice is index l of the blocks' leading axis.
  x = jnp.arange(4 * 6 * 1000, dtype=jnp.float32).reshape(4, 6, 1000)
  blocks = _quantize.to_blocks(x, *aligned.blocks_shape(x.shape))
  np.testing.assert_array_equal(blocks[1].reshape(6, 1000), x[1])


def test_round_trip_error_is_bounded():
  # Values over 7 decades below each block's absmax.
  key = jax.random.key(0)
  magnitudes = 10.0 ** jax.random.uniform(key, (8, 2048), minval=-7.0, maxval=0.0)
  signs = jnp.where(jax.random.bernoulli(jax.random.key(1), 0.5, (8, 2048)), 1.0, -1.0)
  x = magnitudes * signs * (10.0 ** jnp.arange(8.0))[:, None]  # blocks of any scale
  q = _quantize.quantize_blocks(x)
  assert q.codes.dtype == jnp.float8_e4m3fn and q.codes.shape == x.shape
  assert q.scale.dtype == jnp.float32 and q.scale.shape == (8,)
  y = _quantize.dequantize_blocks(q)
  absmax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  # Each block's absmax is stored exactly (up to the float32 scale division).
  np.testing.assert_allclose(jnp.max(jnp.abs(y), axis=1, keepdims=True), absmax, rtol=1e-6)
  # Normal float8 range (>= 2**-6 of the code max): 3 mantissa bits, so
  # round-to-nearest is within 2**-4 relative.
  normal = jnp.abs(x) >= absmax * 2.0**-6 / CODE_MAX
  rel = jnp.abs(y - x) / jnp.abs(x)
  assert float(jnp.max(jnp.where(normal, rel, 0.0))) <= 2.0**-4 + 1e-6
  # Below it (subnormal codes): absolute error at most half the smallest step.
  abs_err = jnp.abs(y - x) / absmax
  assert float(jnp.max(jnp.where(normal, 0.0, abs_err))) <= 2.0**-10 / CODE_MAX + 1e-9
  # Signs survive wherever a value is not rounded to zero.
  assert bool(jnp.all((y == 0) | (jnp.sign(y) == jnp.sign(x))))
  # An all-zero block stays zero (no 0/0).
  zero = _quantize.quantize_blocks(jnp.zeros((2, 16)))
  np.testing.assert_array_equal(_quantize.dequantize_blocks(zero), 0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_stochastic_round_is_unbiased_between_neighbours(dtype):
  x = jnp.full((20000,), 1.0 + 2.0**-10)  # between two codes of either dtype
  seed = jnp.uint32(7)
  r = _quantize.stochastic_round(x, dtype, seed)
  lower, upper = 1.0, 1.0 + 2.0 ** -jnp.finfo(dtype).nmant
  assert set(np.unique(np.asarray(r)).tolist()) == {lower, upper}
  assert np.all(np.asarray(r.astype(dtype).astype(jnp.float32)) == np.asarray(r))
  # E[SR(x)] = x: the mean of 20000 draws is within 4 standard errors.
  p = (float(x[0]) - lower) / (upper - lower)
  stderr = (upper - lower) * np.sqrt(p * (1 - p) / x.size)
  assert abs(float(jnp.mean(r)) - float(x[0])) < 4 * stderr
  # Negative values round symmetrically; non-finite values pass through.
  np.testing.assert_array_equal(_quantize.stochastic_round(-x, dtype, seed), -r)
  special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0])
  np.testing.assert_array_equal(
      _quantize.stochastic_round(special, dtype, seed), special)


def _params():
  # One large leaf (quantized: 96 x 100 = 9600 >= min_size) and a small one.
  return {"w": jax.random.normal(jax.random.key(0), (96, 100)), "b": jnp.zeros(100)}


def _grads(step, micro):
  """A per-element signal over 3 decades of scale, plus micro-batch noise."""
  scale = 10.0 ** (-3.0 * jnp.arange(100.0) / 100.0)
  def leaf(p, k):
    noise = jax.random.normal(jax.random.fold_in(jax.random.key(k), step * 8 + micro), p.shape)
    signal = jnp.cos(jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape))
    return jnp.broadcast_to(scale, p.shape) * (signal + 0.5 * noise)
  return {"w": leaf(_params()["w"], 1), "b": leaf(_params()["b"], 2)}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(tx, num_steps, num_micro_batches=4):
  """num_steps mini-batches of scale_by_adama; returns (last update, state)."""
  def mini_batch(state, step):
    state, _ = jax.lax.scan(
        lambda s, i: (tx.update(_grads(step, i), s)[1], None),
        state, jnp.arange(num_micro_batches - 1))
    updates, state = tx.update(_grads(step, num_micro_batches - 1), state)
    return state, updates
  state, updates = jax.lax.scan(mini_batch, tx.init(_params()), jnp.arange(num_steps))
  return jax.tree.map(lambda u: u[-1], updates), state


def _cosine(a, b):
  a, b = jnp.ravel(a), jnp.ravel(b)
  return float(jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))


def test_float32_moments_are_never_rounded():
  # Nothing is narrower than the fold's float32, so the option changes nothing.
  rounded = optax_adama.scale_by_adama(num_micro_batches=4, stochastic_rounding=True)
  nearest = optax_adama.scale_by_adama(num_micro_batches=4, stochastic_rounding=False)
  chex.assert_trees_all_equal(_run(rounded, 5), _run(nearest, 5))


def test_stochastic_rounding_must_be_a_bool():
  with pytest.raises(TypeError, match="stochastic_rounding must be a bool"):
    optax_adama.scale_by_adama(num_micro_batches=4, stochastic_rounding=None)


def test_eight_bit_fold_tracks_the_float32_fold():
  # The fold's rounding alone: "mean", whose v is the folded squares only
  # ("momentum" adds m_hat**2 from the rounded m, a second source).
  ref_updates, ref_state = _run(
      optax_adama.scale_by_adama(num_micro_batches=4), 60)
  tx = optax_adama.scale_by_adama(
      num_micro_batches=4, quantization=optax_adama.BlockQuantization())
  updates, state = _run(tx, 60)
  mu, nu = state.mu, state.nu
  assert isinstance(mu["w"], optax_adama.moments.QuantizedArray)
  assert mu["w"].codes.shape == (5, 1920)  # 9600 elements in 5 blocks, no padding
  assert nu["b"].dtype == jnp.float32  # small leaves stay in float32
  m = _quantize.from_blocks(_quantize.dequantize_blocks(mu["w"]), (96, 100))
  sqrt_v = _quantize.from_blocks(_quantize.dequantize_blocks(nu["w"]), (96, 100))
  assert _cosine(m, ref_state.mu["w"]) > 0.98
  # sqrt(v) is rounded so that v is unbiased (measured 0.999; rounding
  # sqrt(v) without bias made v 4.9% high).
  v_ratio = float(jnp.mean(sqrt_v**2) / jnp.mean(ref_state.nu["w"]))
  assert abs(v_ratio - 1.0) < 0.01, v_ratio
  assert _cosine(updates["w"], ref_updates["w"]) > 0.96  # measured 0.975
  # With v unbiased, its per-element rounding noise (a random walk: each of
  # the N stores per mini-batch adds fresh noise that b2 forgets slowly) still
  # makes 1 / sqrt(v) larger on average (Jensen), and m's noise adds to the
  # norm: measured 1.063 here. (Rounding sqrt(v) without bias gave 1.00: its
  # high v cancelled the same noise by chance; on the noisy gradients below,
  # 1.058 before, 1.10 now.) An open question of the 8-bit format, not of the
  # rounding's bias.
  norm_ratio = float(jnp.linalg.norm(updates["w"]) / jnp.linalg.norm(ref_updates["w"]))
  assert 1.0 <= norm_ratio <= 1.08, norm_ratio
  chex.assert_trees_all_close(updates["b"], ref_updates["b"], rtol=1e-5, atol=1e-6)


def test_bfloat16_v_needs_stochastic_rounding():
  _, ref = _run(optax_adama.scale_by_adama(num_micro_batches=4), 60)
  def mean_v(stochastic):
    tx = optax_adama.scale_by_adama(
        num_micro_batches=4, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16,
        stochastic_rounding=stochastic)
    _, state = _run(tx, 60)
    assert state.nu["w"].dtype == jnp.bfloat16
    return float(jnp.mean(state.nu["w"].astype(jnp.float32)) / jnp.mean(ref.nu["w"]))
  # Round-to-nearest drops most (1 - b2) / N * g**2 increments (below half a
  # bfloat16 ulp of v) and v's decay; stochastic rounding keeps v unbiased.
  # (Measured: 1.6% low after 60 steps, and the gap grows with the run.)
  assert abs(mean_v(True) - 1.0) < 0.004
  assert abs(mean_v(False) - 1.0) > 0.01


# The 8-layer MLP of tests/library/test_memory.py: P = 2.1 MB, the largest leaf P / 8.
MODEL = MLP(num_layers=8, width=256)
BATCH, NUM_MICRO = 32, 4
_mlp_loss = MODEL.loss


def test_eight_bit_state_shrinks_and_keeps_the_memory_floor():
  params, batch = MODEL.abstract_params(), MODEL.abstract_batch(BATCH)
  # "mean", the estimator of the floor (the default's halves: test_defaults.py).
  tx = optax_adama.adama(
      1e-3, num_micro_batches=NUM_MICRO, quantization=optax_adama.BlockQuantization())
  state = jax.eval_shape(tx.init, params)
  P = optax_adama.memory.tree_bytes(params)
  adama_state = optax_adama.find_adama_state(state)
  moment_bytes = optax_adama.memory.tree_bytes((adama_state.mu, adama_state.nu))
  # 1 byte per element + a float32 scale per 2048, biases in float32: ~0.5 P.
  assert 0.5 * P <= moment_bytes <= 0.52 * P
  step = optax_adama.microbatch_step(_mlp_loss, tx, num_micro_batches=NUM_MICRO)
  report = optax_adama.memory_report(step, params, state, batch)
  floor = optax_adama.memory.memory_floor(
      _mlp_loss, params, state, batch, num_micro_batches=NUM_MICRO)
  float32 = optax_adama.adama(1e-3, num_micro_batches=NUM_MICRO)
  report32 = optax_adama.memory_report(
      optax_adama.microbatch_step(_mlp_loss, float32, num_micro_batches=NUM_MICRO),
      params, jax.eval_shape(float32.init, params), batch)
  # Measured on CPU: 2.58 P against 3.25 P for float32 moments. The fold is
  # leaf-local (no float32 copy of m and v: that would be 2 P of temp), but
  # the step is not at the floor (1.67 P): the per-leaf directions, computed
  # behind a branch so they read the stored codes, stay alive together until
  # the params update (about 0.9 P of temp). A known gap, see _adama.py.
  assert report32.total_bytes - report.total_bytes >= 0.6 * P, (report, report32)
  assert report.temp_bytes <= 1.2 * P, report
  assert report.total_bytes <= 1.6 * floor.total_bytes, (report, floor.to_dict())


def test_bfloat16_moments_step_memory():
  params, batch = MODEL.abstract_params(), MODEL.abstract_batch(BATCH)
  # "mean", the floor's estimator (the default's halves: test_defaults.py).
  tx = optax_adama.adama(1e-3, num_micro_batches=NUM_MICRO,
                         mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  state = jax.eval_shape(tx.init, params)
  P = optax_adama.memory.tree_bytes(params)
  step = optax_adama.microbatch_step(_mlp_loss, tx, num_micro_batches=NUM_MICRO)
  report = optax_adama.memory_report(step, params, state, batch)
  floor = optax_adama.memory.memory_floor(
      _mlp_loss, params, state, batch, num_micro_batches=NUM_MICRO)
  # Measured: 2.38 P against a floor of 2.16 P (+10%: the stochastic
  # rounding's float32 intermediates), 0.88 P below float32 moments.
  assert report.total_bytes <= 1.15 * floor.total_bytes, (report, floor.to_dict())
  assert report.total_bytes <= 2.5 * P, report


def test_quantized_state_through_adamaw_and_jit_is_stable():
  tx = optax_adama.adamaw(
      1e-2, weight_decay=0.1, num_micro_batches=2,
      quantization=optax_adama.BlockQuantization(block_size=512, min_size=1000))
  params = _params()
  state = tx.init(params)
  chex.clear_trace_counter()
  update = jax.jit(chex.assert_max_traces(tx.update, n=1))  # no recompilation
  first = jax.tree.map(lambda x: (x.shape, x.dtype), state)
  for call in range(4):
    updates, state = update(_grads(0, call), state, params)
    params = optax.apply_updates(params, updates)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == first
  assert bool(optax_adama.has_updated(state))
  with pytest.raises(TypeError, match="BlockQuantization"):
    optax_adama.scale_by_adama(num_micro_batches=2, quantization="8bit")


def _train_gpt(quantize_moments, **config):
  """Held-out loss of a GPT trained by `models.train` with AdamA."""
  from models import harness  # the tests may use the models; the library may not

  config = harness.TrainConfig(
      model="gpt", optimizer="adama", quantize_moments=quantize_moments,
      **config)
  with jax.numpy_dtype_promotion("standard"):  # optax's schedule
    return harness.train(config, progress=False)["eval_loss"]


def test_tiny_gpt_smoke_eight_bit_trains_like_float32():
  kwargs = dict(preset="gpt_test", steps=20, batch_size=8, seq_len=16,
                eval_batches=2, max_bytes=200_000)
  loss32 = _train_gpt(False, **kwargs)
  loss8 = _train_gpt(True, **kwargs)
  assert np.isfinite(loss8)
  assert abs(loss8 - loss32) <= 0.03 * loss32, (loss8, loss32)


@pytest.mark.slow
def test_tiny_gpt_eight_bit_final_loss_within_one_percent():
  # The issue's contract, on `make demo`'s run (gpt_tiny, 300 steps, N = 4),
  # measured on "mean": 8-bit rounding alone. (Under "momentum", the default then,
  # the two runs part ways on GPT's plateau: 2.4349 against 2.5109, the
  # 8-bit run 3.0% lower.)
  kwargs = dict(preset="gpt_tiny", steps=300, batch_size=32, seq_len=64, eval_batches=16)
  loss32 = _train_gpt(False, **kwargs)
  loss8 = _train_gpt(True, **kwargs)
  assert abs(loss8 - loss32) <= 0.01 * loss32, (loss8, loss32)


def _v_ratio_on_noisy_gradients(num_mini_batches):
  """Mean 8-bit v over mean float32 v, N = 4, gradients ~ N(0.05, 0.1**2)."""
  shape, num_micro_batches = (64, 128), 4
  params = {"w": jnp.zeros(shape)}

  def run(tx):
    def mini_batch(state, step):
      def micro(state, i):
        key = jax.random.fold_in(jax.random.key(7), step * num_micro_batches + i)
        g = 0.05 + 0.1 * jax.random.normal(key, shape)
        return tx.update({"w": g}, state)[1], None
      return jax.lax.scan(micro, state, jnp.arange(num_micro_batches))[0], None
    return jax.lax.scan(mini_batch, tx.init(params), jnp.arange(num_mini_batches))[0]

  # "mean": v is the folded squares alone, so the ratio is the rounding's
  # ("momentum" adds m_hat**2 from the rounded m as well).
  dense = jax.jit(lambda: run(optax_adama.scale_by_adama(
      num_micro_batches=num_micro_batches)))()
  quantized = jax.jit(lambda: run(optax_adama.scale_by_adama(
      num_micro_batches=num_micro_batches,
      quantization=optax_adama.BlockQuantization())))()
  sqrt_v = _quantize.dequantize_blocks(quantized.nu["w"])
  return float(jnp.mean(sqrt_v**2) / jnp.mean(dense.nu["w"]))


def test_eight_bit_v_is_unbiased_on_noisy_gradients():
  # Rounding sqrt(v) without bias drifted v up: 1.072 after 40 mini-batches.
  assert abs(_v_ratio_on_noisy_gradients(40) - 1.0) < 0.01


@pytest.mark.slow
def test_eight_bit_v_stays_unbiased_over_400_mini_batches():
  # Was about 1.09 from 100 mini-batches on.
  assert abs(_v_ratio_on_noisy_gradients(400) - 1.0) < 0.01
