"""The Llama-family decoder: its pieces against independent references, and training.

Shapes, the loss against optax's cross-entropy, scanned against unrolled layers, remat
and bf16 compute run for every model kind in tests/zoo/test_models.py; here is what only a
Llama has: grouped-query attention (equal to multi-head attention over repeated key and
value heads, and to a float64 NumPy reference), the rotary embedding's relative-position
property and Llama 3's frequency rescaling, causality, the published sizes exactly, the
refusals of bad configs, and a tiny model that trains through AdamA's steps and the CLI.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import optax_adama
from models import harness
from models import layers
from models import train

# The published counts (Meta's model cards as counted by Hugging Face transformers).
PUBLISHED = {"llama2_7b": 6_738_415_616, "llama3_8b": 8_030_261_248,
             "llama32_1b": 1_235_814_400}


def tokens(batch: int, length: int, vocab: int = 256, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


def closed_form(config: models.LlamaConfig) -> int:
  d, q = config.hidden, config.num_heads * config.head_size
  kv = config.num_kv_heads * config.head_size
  block = 2 * d * q + 2 * d * kv + 3 * d * config.mlp_dim + 2 * d
  return (1 if config.tie_embeddings else 2) * config.vocab_size * d + config.num_layers * block + d


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_sizes_exactly(name):
  assert closed_form(models.PRESETS[name]) == PUBLISHED[name]


def test_counted_parameters_equal_the_closed_form():
  # Building llama2_7b/llama3_8b abstractly takes seconds: their counts are in
  # tests/zoo/test_models.py's slow presets; the 1B and the small ones here.
  for name in ("llama32_1b", "llama_small", "llama_tiny", "llama_test"):
    assert models.param_count(name) == closed_form(models.PRESETS[name]), name
  assert abs(models.param_count("llama_small") - 124e6) / 124e6 < 0.01  # GPT-2 small's size
  for name in ("llama_tiny", "llama_test"):
    config = models.PRESETS[name]
    assert config.num_kv_heads < config.num_heads


def _attention(num_kv_heads: int, seed: int = 0, **kwargs) -> layers.GroupedQueryAttention:
  return layers.GroupedQueryAttention(
      64, 4, num_kv_heads, head_dim=16, rope_theta=10000.0, rngs=nnx.Rngs(seed), **kwargs)


def test_grouped_query_attention_is_multi_head_attention_over_repeated_kv_heads():
  grouped = _attention(2)
  full = _attention(4, seed=1)
  # Query head h reads key/value head h // 2: repeat each kv head's columns.
  for name in ("k", "v"):
    kernel = getattr(grouped, name).kernel[...].reshape(64, 2, 16)
    getattr(full, name).kernel[...] = jnp.repeat(kernel, 2, axis=1).reshape(64, 64)
  full.q.kernel[...] = grouped.q.kernel[...]
  full.out.kernel[...] = grouped.out.kernel[...]
  x = jax.random.normal(jax.random.key(0), (2, 10, 64))
  mask = jnp.tril(jnp.ones((10, 10), bool))[None, None]
  np.testing.assert_allclose(grouped(x, mask), full(x, mask), rtol=1e-5, atol=1e-6)


def _rotate_reference(x: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
  """Rotate-half rotary embedding in float64 ([length, heads, head_dim])."""
  angles = np.arange(x.shape[0])[:, None] * inv_freq[None, :]
  cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
  sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


def test_multi_head_case_equals_a_float64_reference():
  attention = _attention(4)
  x = np.asarray(jax.random.normal(jax.random.key(1), (1, 12, 64)), np.float64)
  w = {name: np.asarray(getattr(attention, name).kernel[...], np.float64)
       for name in ("q", "k", "v", "out")}
  inv_freq = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
  q, k, v = ((x[0] @ w[name]).reshape(12, 4, 16) for name in ("q", "k", "v"))
  q, k = _rotate_reference(q, inv_freq), _rotate_reference(k, inv_freq)
  scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(16)
  scores = np.where(np.tril(np.ones((12, 12), bool))[None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  expected = np.einsum("hqk,khd->qhd", probs, v).reshape(12, 64) @ w["out"]
  mask = jnp.tril(jnp.ones((12, 12), bool))[None, None]
  # float32 matmuls of width 64 against float64: ~1e-6 relative.
  np.testing.assert_allclose(attention(jnp.asarray(x, jnp.float32), mask)[0], expected,
                             rtol=1e-4, atol=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
  inv_freq = layers.rotary_inverse_frequencies(16, 10000.0)
  q, k = jax.random.normal(jax.random.key(2), (2, 1, 1, 1, 16))

  def score(query_position, key_position):
    rq = layers.apply_rotary(q, jnp.array([query_position]), inv_freq)
    rk = layers.apply_rotary(k, jnp.array([key_position]), inv_freq)
    return float(jnp.sum(rq * rk))

  for shift in (1, 7, 100):
    np.testing.assert_allclose(score(5 + shift, 2 + shift), score(5, 2), rtol=1e-4)
  assert abs(score(5, 2) - score(5, 3)) > 1e-3  # and it does depend on it
  # A rotation: norms are kept, position 0 is the identity.
  rotated = layers.apply_rotary(q, jnp.array([37]), inv_freq)
  np.testing.assert_allclose(jnp.linalg.norm(rotated), jnp.linalg.norm(q), rtol=1e-5)
  np.testing.assert_allclose(layers.apply_rotary(q, jnp.array([0]), inv_freq), q)


def test_llama3_rope_scaling_keeps_short_wavelengths_and_stretches_long_ones():
  base = layers.rotary_inverse_frequencies(64, 500000.0)
  scaling = layers.RopeScaling(factor=32.0)
  scaled = layers.rotary_inverse_frequencies(64, 500000.0, scaling)
  wavelength = 2 * np.pi / base
  short = wavelength < scaling.original_max_len / scaling.high_freq_factor
  long = wavelength > scaling.original_max_len / scaling.low_freq_factor
  assert short.any() and long.any() and (~short & ~long).any()
  np.testing.assert_array_equal(scaled[short], base[short])
  np.testing.assert_allclose(scaled[long], base[long] / 32.0)
  between = ~short & ~long
  assert np.all(scaled[between] < base[between])
  assert np.all(scaled[between] > base[between] / 32.0)


def test_causal():
  model = models.create("llama_test", rngs=nnx.Rngs(0))
  x = tokens(1, 16)
  changed = x.at[0, 9].set((x[0, 9] + 1) % 256)
  logits, changed_logits = nnx.jit(lambda m, a, b: (m(a), m(b)))(model, x, changed)
  np.testing.assert_allclose(logits[0, :9], changed_logits[0, :9], rtol=1e-6)
  assert not np.allclose(logits[0, 9:], changed_logits[0, 9:])


def test_tied_head_reads_the_embedding():
  model = models.create("llama_test", tie_embeddings=True, rngs=nnx.Rngs(0))
  assert not hasattr(model, "lm_head")
  assert models.param_count(model) == closed_form(model.config)
  loss_fn, params = models.split_loss_fn(model)
  chunked_fn, _ = models.split_loss_fn(models.create(
      "llama_test", tie_embeddings=True, loss_chunks=4, rngs=nnx.Rngs(0)))
  batch = {"tokens": tokens(2, 33)}
  (loss, grads), (chunked, chunked_grads) = (
      jax.jit(jax.value_and_grad(f))(params, batch) for f in (loss_fn, chunked_fn))
  np.testing.assert_allclose(chunked, loss, rtol=1e-5)
  np.testing.assert_allclose(chunked_grads["token_embed"]["embedding"],
                             grads["token_embed"]["embedding"], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("overrides, field", [
    ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
    ({"hidden": 120, "num_heads": 8, "num_kv_heads": 8}, "head size"),
    ({"head_dim": 15}, "head size"),
    ({"gelu_bits": 2}, "gelu_bits"),
    ({"mlp_dim": None}, "mlp_dim"),
])
def test_bad_configs_are_refused_naming_the_field(overrides, field):
  with pytest.raises(ValueError, match=field):
    models.get_config("llama_test", **overrides)


def test_a_sequence_longer_than_the_preset_is_refused_with_the_fix():
  model = models.create("llama_test", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_len 64"):
    model(tokens(1, 65))
  with pytest.raises(ValueError, match="--seq-len 64"):
    harness.model_config_of(harness.TrainConfig(model="llama", preset="llama_test", seq_len=128))


# 9 s each: the release with the slow tests (the next test holds it equal to the fused step).
@pytest.mark.parametrize("release", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_tiny_model_memorises_a_batch(release):
  # A model that learns: 40 AdamA steps on one batch take the loss from about
  # log(256) = 5.5 to below 3.
  batch = {"tokens": tokens(8, 33)}
  model = models.create("llama_test", scan_layers=True, remat="full", rngs=nnx.Rngs(0))
  staged, params = models.staged_loss(model)
  tx = optax_adama.adama(3e-3, num_micro_batches=2)
  step = (optax_adama.release_step(staged, tx) if release
          else optax_adama.microbatch_step(staged, tx))
  state = tx.init(params)
  losses = []
  for _ in range(40):
    params, state, metrics = step(params, state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[0] > 5.0 and losses[-1] < 3.0, (release, losses[::10])


def test_release_equals_the_unrolled_fused_step():
  config = models.get_config("llama_test", num_layers=2)
  batch = {"tokens": tokens(4, 33)}
  tx = optax_adama.adamaw(1e-3, weight_decay=0.1, num_micro_batches=2)
  staged, params = models.staged_loss(models.create(config, scan_layers=True, rngs=nnx.Rngs(0)))
  loss_fn, ref_params = models.split_loss_fn(models.create(config, rngs=nnx.Rngs(0)))
  step, ref_step = optax_adama.release_step(staged, tx), optax_adama.microbatch_step(loss_fn, tx)
  state, ref_state = tx.init(params), tx.init(ref_params)
  for _ in range(2):
    params, state, metrics = step(params, state, batch)
    ref_params, ref_state, ref_metrics = ref_step(ref_params, ref_state, batch)
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
  stacked = params["blocks"]
  for layer in range(2):
    ours = jax.tree.map(lambda x: x[layer], stacked)
    # The same 1e-4 x lr x steps floor as the GPT's release test (tests/zoo/test_models.py).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-7),
                 ours, ref_params["blocks"][layer])


def test_cli_trains_a_llama(tmp_path):
  out = tmp_path / "run.json"
  with jax.numpy_dtype_promotion("standard"):  # optax's schedules promote implicitly
    train.main(["--model", "llama", "--preset", "llama_test", "--num-micro-batches", "2",
                "--batch-size", "8", "--seq-len", "32", "--steps", "3", "--eval-batches", "2",
                "--max-bytes", "200000", "--scan-layers", "--release", "--remat", "full",
                "--metrics-out", str(out), "--no-progress"])
  run = json.loads(out.read_text())
  assert len(run["train_loss"]) == 3 and np.all(np.isfinite(run["train_loss"]))
  assert run["config"]["model"] == "llama"


@pytest.mark.slow
def test_llama_tiny_learns_stdlib_bytes():
  from test_models import train as train_steps
  from test_models import unigram_entropy

  from models import data

  text = data.load_stdlib_text(max_bytes=1_000_000)
  batches = data.lm_batches(text.train, batch_size=16, seq_len=64, seed=0)
  loss_fn, params, losses = train_steps("llama_tiny", batches, steps=200)
  valid = next(data.lm_batches(text.valid, batch_size=64, seq_len=64, seed=0))
  assert losses[0] > 5.0
  valid_loss, _ = loss_fn(params, valid)
  assert float(valid_loss) < unigram_entropy(text.train) - 0.5


def test_the_capacity_search_counts_parameters_as_the_model_does():
  from conftest import load_script
  oom_reports = load_script("benchmarks/scripts/oom_reports.py")

  for config in (oom_reports.llama_family(8), oom_reports.llama_family(21),
                 models.get_config("llama_test", tie_embeddings=True)):
    assert oom_reports.llama_param_count(config) == models.param_count(config)
  scale_64 = oom_reports.llama_family(64)  # llama3_8b's width, twice its depth
  assert (scale_64.hidden, scale_64.num_heads, scale_64.num_kv_heads, scale_64.mlp_dim) == (
      4096, 32, 8, 14336)


def test_chunked_attention_has_the_same_loss_and_gradients():
  batch = {"tokens": tokens(2, 33)}

  def loss_and_grads(**overrides):
    model = models.create("llama_test", scan_layers=True, remat="full", rngs=nnx.Rngs(0),
                          **overrides)
    loss_fn, params = models.split_loss_fn(model)
    return jax.jit(jax.value_and_grad(loss_fn))(params, batch)

  loss, grads = loss_and_grads()
  for chunk in (8, 5):  # 5 does not divide 32 tokens: attended whole
    chunked, chunked_grads = loss_and_grads(attention_chunk=chunk)
    np.testing.assert_allclose(chunked, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 chunked_grads, grads)
  with pytest.raises(ValueError, match="attention_chunk"):
    models.get_config("llama_test", attention_chunk=0)
