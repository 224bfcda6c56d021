"""benchmarks/scripts/bf16_params.py, the convergence cost of bfloat16 params, on gpt_test."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest

import models
import optax_adama

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))
import bf16_params  # noqa: E402  # pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _standard_promotion():
  with jax.numpy_dtype_promotion("standard"):  # optax's schedules, as models.train runs
    yield


def test_the_arms_train_and_a_second_run_adds_its_arms_to_the_first(tmp_path):
  out, md = tmp_path / "b.json", tmp_path / "b.md"
  common = ["--seeds", "0", "--steps", "2", "--preset", "gpt_test", "--out", str(out),
            "--markdown", str(md)]
  create, split_loss_fn = models.create, models.split_loss_fn
  bf16_params.main(common + ["--arms", "bf16_stochastic"])
  bf16_params.main(common + ["--arms", "f32_bf16_grads", "--plot", str(tmp_path / "b.png")])
  # The diagnostic's hooks are put back.
  assert (models.create, models.split_loss_fn) == (create, split_loss_fn)
  saved = json.loads(out.read_text())
  assert [r["arm"] for r in saved["runs"]] == ["bf16_stochastic", "f32_bf16_grads"]
  assert len(saved["commands"]) == 2 and saved["command"] == "; ".join(saved["commands"])
  for r in saved["runs"]:
    assert len(r["train_loss"]) == 2 and np.isfinite(r["eval_loss"])
  assert [r["memory"]["param_bytes"] for r in saved["runs"]][::-1] == [
      2 * saved["runs"][0]["memory"]["param_bytes"], saved["runs"][0]["memory"]["param_bytes"]]
  text = md.read_text()
  assert "| bf16_stochastic | 1 |" in text and "| f32_bf16_grads | 1 |" in text
  assert "gpt_test at 0.002, " in text  # the preset and rate the runs recorded
  assert (tmp_path / "b.png").stat().st_size > 0


def test_the_bf16_forward_arm_rounds_values_and_passes_gradients_straight_through():
  x = jax.numpy.asarray([1.0 + 2.0**-10, -3.0, 0.1], jax.numpy.float32)
  rounded = bf16_params._bf16_forward(x)
  np.testing.assert_array_equal(rounded, x.astype(jax.numpy.bfloat16).astype(x.dtype))
  assert rounded[0] != x[0]  # 1 + 2**-10 lies between two bfloat16 values
  grad = jax.grad(lambda v: (bf16_params._bf16_forward(v) * 3.0).sum())(x)
  np.testing.assert_array_equal(grad, np.full(3, 3.0, np.float32))


def test_the_reseeded_arm_draws_other_rounding_noise_and_puts_the_hook_back():
  from models import harness

  config = harness.TrainConfig(model="gpt", preset="gpt_test", param_dtype="bfloat16", seed=2)
  params = {"w": jax.numpy.full((4096,), 1.0 + 2.0**-9, jax.numpy.bfloat16)}
  updates = {"w": jax.numpy.full((4096,), 2.0**-9, jax.numpy.float32)}  # half a spacing

  def rounded(transform):
    new, _ = transform.update(updates, transform.init(params), params)
    return np.asarray(new["w"])

  original = harness.param_rounding
  default = original(config)
  with bf16_params._diagnostic("bf16_stochastic_reseeded"):
    reseeded = harness.param_rounding(config)
  assert harness.param_rounding is original
  # The same rounding as seed 1002's, and other noise than seed 2's: half a
  # spacing rounds up on about half of 4,096 entries, so two independent draws
  # agree on all of them with probability 2**-4096.
  same_seed = optax_adama.contrib.round_params_stochastically(2 + bf16_params.RESEED_OFFSET)
  np.testing.assert_array_equal(rounded(reseeded), rounded(same_seed))
  assert (rounded(reseeded) != rounded(default)).any()


def test_the_rounding_noise_arm_adds_stochastic_rounding_s_variance_off_the_grid():
  jnp = jax.numpy
  x = jnp.asarray([1.0, 1.99, 3.0, 0.1, -0.1], jnp.float32)
  # bfloat16 keeps 8 significant bits: spacing 2**-7 in [1, 2), 2**-6 in [2, 4).
  np.testing.assert_array_equal(bf16_params._bf16_spacing(x),
                                [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-11, 2.0**-11])
  n = 200_000
  params = {"w": jnp.full((n,), 1.5, jnp.float32)}
  updates = {"w": jnp.zeros((n,), jnp.float32)}
  transform = bf16_params.rounding_noise(seed=0)
  noise, count = transform.update(updates, transform.init(params), params)
  noise = np.asarray(noise["w"], np.float64)
  sigma = 2.0**-7 / np.sqrt(6.0)
  # Five standard errors of a mean and of a standard deviation over n draws.
  assert abs(noise.mean()) < 5 * sigma / np.sqrt(n)
  assert abs(noise.std() / sigma - 1) < 5 / np.sqrt(2 * n)
  assert int(count) == 1
  again, _ = transform.update(updates, count, params)  # each step its own noise
  assert (np.asarray(again["w"]) != noise).mean() > 0.99
