"""The second-moment diagnostic: rho where its value is known in advance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_adama

NUM_MICRO, ROWS, DIM = 4, 16, 8


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _batches(num_steps, *, identical_micro_batches):
  batches = []
  for step in range(num_steps):
    key = jax.random.fold_in(jax.random.key(0), step)
    kx, ky = jax.random.split(key)
    if identical_micro_batches:  # rows i::N equal across micro-batches
      x = jnp.tile(jax.random.normal(kx, (ROWS // NUM_MICRO, DIM)), (NUM_MICRO, 1))
      x = x.reshape(NUM_MICRO, ROWS // NUM_MICRO, DIM).transpose(1, 0, 2).reshape(ROWS, DIM)
      y = jnp.ones(ROWS)
    else:  # pure noise: the target is independent of x, its mean is zero
      x = jax.random.normal(kx, (ROWS, DIM))
      y = 3.0 * jax.random.normal(ky, (ROWS,))
    batches.append({"x": x, "y": y})
  return batches


def test_identical_micro_batches_make_mean_exact_and_sum_n_times_small():
  diagnosis = optax_adama.diagnostics.diagnose_second_moment(
      loss_fn, {"w": jnp.zeros(DIM)}, _batches(20, identical_micro_batches=True),
      num_micro_batches=NUM_MICRO)
  # All g_i equal: mean of squares = square of mean, exactly (float32 sums).
  np.testing.assert_allclose(diagnosis.median("mean"), 1.0, rtol=1e-4)
  np.testing.assert_allclose(diagnosis.median("sum"), 1 / NUM_MICRO, rtol=1e-4)
  assert diagnosis.suggested_estimator() == "mean"
  assert diagnosis.rho["mean"].shape == (20, len(diagnosis.QUANTILES))
  # Every coordinate is exact, so the tails are too; the summary names them.
  np.testing.assert_allclose(diagnosis.quantile("mean", 0.05), 1.0, rtol=1e-4)
  np.testing.assert_allclose(diagnosis.quantile("mean", 0.95), 1.0, rtol=1e-4)
  assert "1.00x or more on 5% of coordinates" in diagnosis.summary()
  with pytest.raises(ValueError, match="q must be one of"):
    diagnosis.quantile("mean", 0.3)


def test_noise_dominated_gradients_make_mean_about_n_times_adam():
  diagnosis = optax_adama.diagnostics.diagnose_second_moment(
      loss_fn, {"w": jnp.zeros(DIM)}, _batches(200, identical_micro_batches=False),
      num_micro_batches=NUM_MICRO, learning_rate=1e-4)
  # Independent zero-mean micro-batch gradients: E[mean of g_i^2] = sigma^2,
  # E[g_bar^2] = sigma^2 / N, so rho("mean") ~ N and rho("sum") ~ 1. (EMAs over
  # 200 steps of a b2 = 0.999 average: a spread of about 10%.)
  assert 0.7 * NUM_MICRO < diagnosis.median("mean") < 1.3 * NUM_MICRO
  assert 0.7 < diagnosis.median("sum") < 1.3
  # "split" estimates Adam's v from each micro-batch's halves: rho ~ 1 too.
  assert 0.7 < diagnosis.median("split") < 1.3
  best = diagnosis.suggested_estimator()
  assert best in ("sum", "momentum", "split")
  text = diagnosis.summary(learning_rate=1e-3)
  assert f"Suggested: nu_estimator={best!r}" in text


def test_split_is_left_out_where_micro_batches_do_not_halve():
  batches = [{"x": b["x"][:12], "y": b["y"][:12]}
             for b in _batches(3, identical_micro_batches=False)]
  diagnosis = optax_adama.diagnostics.diagnose_second_moment(  # micro-batches of 3 rows
      loss_fn, {"w": jnp.zeros(DIM)}, batches, num_micro_batches=NUM_MICRO)
  assert set(diagnosis.rho) == {"mean", "sum", "momentum"}


def test_empty_batches_raise():
  with pytest.raises(ValueError, match="batches is empty"):
    optax_adama.diagnostics.diagnose_second_moment(
        loss_fn, {"w": jnp.zeros(DIM)}, [], num_micro_batches=NUM_MICRO)


@pytest.mark.parametrize("estimator", ["mean", "split"])
def test_following_an_estimator_is_adamas_own_path(estimator):
  """follow=e takes the steps AdamA with nu_estimator=e takes on the same batches."""
  batches = _batches(12, identical_micro_batches=False)
  params = {"w": jnp.zeros(DIM)}
  diagnosis = optax_adama.diagnostics.diagnose_second_moment(
      loss_fn, params, batches, num_micro_batches=NUM_MICRO, learning_rate=0.05,
      follow=estimator)
  tx = optax_adama.contrib.adama(0.05, num_micro_batches=NUM_MICRO, nu_estimator=estimator)
  step = optax_adama.microbatch_step(loss_fn, tx)
  state, losses = tx.init(params), []
  for batch in batches:
    params, state, metrics = step(params, state, batch)
    losses.append(float(metrics["loss"]))
  # Same math, folds summed in another order: float32 rounding only.
  np.testing.assert_allclose(diagnosis.losses, losses, rtol=1e-5)
  adams_path = optax_adama.diagnostics.diagnose_second_moment(
      loss_fn, {"w": jnp.zeros(DIM)}, batches, num_micro_batches=NUM_MICRO,
      learning_rate=0.05)
  assert np.max(np.abs(adams_path.losses - diagnosis.losses)) > 1e-3


def test_follow_rejects_what_it_cannot_follow():
  batches = _batches(2, identical_micro_batches=False)
  with pytest.raises(ValueError, match="follow must be"):
    optax_adama.diagnostics.diagnose_second_moment(loss_fn, {"w": jnp.zeros(DIM)}, batches,
                                       num_micro_batches=NUM_MICRO, follow="adamw")
  odd = [{"x": b["x"][:12], "y": b["y"][:12]} for b in batches]  # 3 rows a micro-batch
  with pytest.raises(ValueError, match="even number of rows"):
    optax_adama.diagnostics.diagnose_second_moment(loss_fn, {"w": jnp.zeros(DIM)}, odd,
                                       num_micro_batches=NUM_MICRO, follow="split")


def test_summary_says_where_the_default_steps_short_of_adam():
  # Pure noise across micro-batches: "mean"'s v (mu^2 + sigma^2) is near N
  # times Adam's (mu^2 + sigma^2 / N), so its steps are near 1/sqrt(N) of Adam's.
  noisy = optax_adama.diagnostics.diagnose_second_moment(
      loss_fn, {"w": jnp.zeros(DIM)}, _batches(40, identical_micro_batches=False),
      num_micro_batches=NUM_MICRO, learning_rate=1e-4)
  rho = noisy.median("mean")
  assert rho > 2.0, rho  # N = 4 for noise alone
  text = noisy.summary()
  assert f"The default ('mean') keeps v at {rho:.2f}x Adam's" in text
  assert f"the rate times {np.sqrt(rho):.2f} gives Adam's median step" in text
  # Identical micro-batches: "mean" is Adam's v exactly, and the summary adds nothing.
  exact = optax_adama.diagnostics.diagnose_second_moment(
      loss_fn, {"w": jnp.zeros(DIM)}, _batches(40, identical_micro_batches=True),
      num_micro_batches=NUM_MICRO, learning_rate=1e-4)
  assert "The default" not in exact.summary()


def test_summary_says_where_a_suggested_estimator_runs():
  # A mean gradient that flips sign every step with no noise: Adam's v is its
  # square while m, an average over about 10 steps, nearly cancels, so
  # "momentum" keeps v near 1/N of Adam's; "mean" is exact.
  batches = _batches(40, identical_micro_batches=True)
  batches = [{"x": b["x"], "y": b["y"] * (-1) ** step} for step, b in enumerate(batches)]
  diagnosis = optax_adama.diagnostics.diagnose_second_moment(
      loss_fn, {"w": jnp.zeros(DIM)}, batches, num_micro_batches=NUM_MICRO,
      learning_rate=1e-4)
  assert diagnosis.median("momentum") < 0.5
  np.testing.assert_allclose(diagnosis.median("mean"), 1.0, rtol=1e-4)
  text = diagnosis.summary()
  assert "The default" not in text
  assert "Suggested: nu_estimator='mean'." in text  # runs on every path: no note
  # "split" runs only where the step takes each micro-batch's halves; a
  # suggestion of it says where.
  rho = lambda median: np.full(
      (4, len(optax_adama.diagnostics.SecondMomentDiagnosis.QUANTILES)), median)
  fused = optax_adama.diagnostics.SecondMomentDiagnosis(
      NUM_MICRO, {"mean": rho(3.0), "split": rho(1.01)}, np.ones(4))
  assert fused.suggested_estimator() == "split"
  assert ("Suggested: nu_estimator='split' (in microbatch_step or release_step"
          in fused.summary())
  # The default's line names "split" only where it was measured and tracks Adam.
  assert "nu_estimator='split' in microbatch_step or release_step keeps v at 1.01x" in (
      fused.summary())
  unmeasured = optax_adama.diagnostics.SecondMomentDiagnosis(
      NUM_MICRO, {"mean": rho(3.0), "sum": rho(1.0)}, np.ones(4))
  assert "The default ('mean') keeps v at 3.00x" in unmeasured.summary()
  assert "split" not in unmeasured.summary()
  # A default whose v ran short (not "mean" in exact arithmetic; any estimator
  # the default might be): its steps run long, and the rate scaled down matches.
  short = optax_adama.diagnostics.SecondMomentDiagnosis(
      NUM_MICRO, {"mean": rho(0.64), "sum": rho(1.3)}, np.ones(4))
  assert ("The default ('mean') keeps v at 0.64x Adam's, so its steps run 1.25x Adam's: "
          "scale the learning rate by 0.80.") in short.summary()
  # Where the default is also the suggestion, its rate factor is said once.
  alone = optax_adama.diagnostics.SecondMomentDiagnosis(
      NUM_MICRO, {"mean": rho(0.64)}, np.ones(4))
  assert "Its steps are 1.25x Adam's: scale Adam's learning rate by 0.80" in alone.summary()
  assert alone.summary().count("0.80") == 1 and "The default" not in alone.summary()
  long_steps = optax_adama.diagnostics.SecondMomentDiagnosis(
      NUM_MICRO, {"mean": rho(1.69), "sum": rho(0.25)}, np.ones(4))
  assert long_steps.suggested_estimator() == "mean"
  assert long_steps.summary().count("1.30") == 1, long_steps.summary()
