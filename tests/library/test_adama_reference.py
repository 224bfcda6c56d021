"""AdamA's moments and params against float64 references; the split and other nu estimators."""

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _adama_helpers import _adama_state
from _adama_helpers import _run_adama

import optax_adama

# One to three leaves, each a scalar or up to 4 x 4.
_SHAPES = st.lists(
    st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), min_size=1, max_size=3)


def _reference_float64(params, grads, lrs, b1, b2, eps, nu_estimator="mean"):
  """docs/design.md's math in float64 numpy; grads[t][i] is micro-batch i of step t."""
  params = [np.asarray(p, np.float64) for p in params]
  m = [np.zeros_like(p) for p in params]
  v = [np.zeros_like(p) for p in params]
  for t, micro_grads in enumerate(grads, start=1):
    n = len(micro_grads)
    m = [b1 * mk for mk in m]
    v = [b2 * vk for vk in v]
    nu_weight = (1 - b2) / (n if nu_estimator == "mean" else n**2)
    for g in micro_grads:
      m = [mk + (1 - b1) / n * gk for mk, gk in zip(m, g)]
      v = [vk + nu_weight * gk**2 for vk, gk in zip(v, g)]
    if nu_estimator == "momentum":
      v = [vk + (1 - b2) * (1 - 1 / n) * (mk / (1 - b1**t)) ** 2 for vk, mk in zip(v, m)]
    params = _step_float64(params, m, v, t, lrs[t - 1], b1, b2, eps)
  return params, m, v


def _factored_float64(squares):
  """Adafactor's read of a leaf's squares (arXiv:1804.04235, eq. 4), for leaves
  whose last two dimensions are both >= 128 (optax.adafactor's rule); others whole."""
  if squares.ndim < 2 or min(squares.shape[-2:]) < 128:
    return squares
  rows, cols = squares.sum(-1), squares.sum(-2)
  total = rows.sum(-1)[..., None, None]
  outer = rows[..., :, None] * cols[..., None, :]
  return np.where(total > 0, outer / np.where(total > 0, total, 1), 0)


def _step_float64(params, m, v, t, lr, b1, b2, eps, floor_nu=False, nu_floor=None):
  """The bias-corrected Adam step from the moments; ``floor_nu``: "split"'s
  ``m_hat**2`` floor; ``nu_floor``: its "sum" EMA's read (leaf-shaped)."""
  m_hat = [mk / (1 - b1**t) for mk in m]
  v_hat = [vk / (1 - b2**t) for vk in v]
  if floor_nu:
    v_hat = [np.maximum(vh, mh**2) for vh, mh in zip(v_hat, m_hat)]
  if nu_floor is not None:
    v_hat = [np.maximum(vh, f / (1 - b2**t)) for vh, f in zip(v_hat, nu_floor)]
  return [p - lr * mh / (np.sqrt(vh) + eps) for p, mh, vh in zip(params, m_hat, v_hat)]


_REFERENCE_DRAWS = dict(
    shapes=_SHAPES,
    num_micro_batches=st.integers(1, 5),
    b1=st.floats(0.5, 0.95),
    b2=st.floats(0.9, 0.9999),
    seed=st.integers(0, 2**16),
)


# Each example compiles its own shapes (2-3 s on 2 busy cores): 20 examples
# run with the slow tests, the smoke below (3 an estimator) in the default run.
@pytest.mark.slow
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    **_REFERENCE_DRAWS, nu_estimator=st.sampled_from(["mean", "sum", "momentum"]))
def test_moments_and_params_match_float64_reference(
    shapes, num_micro_batches, b1, b2, seed, nu_estimator):
  _check_moments_and_params(shapes, num_micro_batches, b1, b2, seed, nu_estimator)


@pytest.mark.parametrize("nu_estimator", ["mean", "sum", "momentum"])
@hypothesis.settings(max_examples=3, deadline=None)
@hypothesis.given(**_REFERENCE_DRAWS)
def test_moments_and_params_match_float64_reference_smoke(
    nu_estimator, shapes, num_micro_batches, b1, b2, seed):
  _check_moments_and_params(shapes, num_micro_batches, b1, b2, seed, nu_estimator)


def _check_moments_and_params(shapes, num_micro_batches, b1, b2, seed, nu_estimator):
  rng = np.random.default_rng(seed)
  num_steps, eps = 4, 1e-8
  params = [rng.normal(size=s).astype(np.float32) for s in shapes]
  grads = [[[rng.normal(size=s).astype(np.float32) for s in shapes]
            for _ in range(num_micro_batches)] for _ in range(num_steps)]
  # count = mini-batches done (an int32 array; cast for strict promotion).
  schedule = lambda count: 0.01 * (1.0 + jnp.asarray(count, jnp.float32))
  lrs = [0.01 * (1.0 + t) for t in range(num_steps)]
  tx = optax_adama.contrib.adama(
      schedule, b1=b1, b2=b2, eps=eps, num_micro_batches=num_micro_batches,
      nu_estimator=nu_estimator)
  got, state = _run_adama(
      tx, [jnp.asarray(p) for p in params], num_steps, num_micro_batches,
      lambda p, s, i: [jnp.asarray(g) for g in grads[s][i]])
  want, m, v = _reference_float64(params, grads, lrs, b1, b2, eps, nu_estimator)
  adama_state = _adama_state(state)
  # Moments: a handful of float32 multiply-adds per element (relative 1e-6).
  chex.assert_trees_all_close(adama_state.mu, m, rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(adama_state.nu, v, rtol=1e-5, atol=1e-9)
  # Params move by lr * O(1) per step; the update divides by sqrt(v) + eps, so
  # tiny v (a gradient near zero) amplifies rounding: compare absolutely at a
  # fraction of the smallest step (0.01).
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-4)
  assert int(adama_state.count) == num_steps


def _reference_split_float64(params, halves, lrs, b1, b2, eps, floor_read="factored"):
  """The "split" estimator in float64; halves[t][i] = (g_a, g_b) per leaf.

  With its floor: an EMA of the "sum" estimator's g**2 / N**2, kept whole
  here and read factored (:func:`_factored_float64`), or ``floor_read``
  "whole" or ``None`` (no floor) to show the difference.
  """
  params = [np.asarray(p, np.float64) for p in params]
  m = [np.zeros_like(p) for p in params]
  v = [np.zeros_like(p) for p in params]
  floor = [np.zeros_like(p) for p in params]
  for t, micro in enumerate(halves, start=1):
    n = len(micro)
    m = [b1 * mk for mk in m]
    v = [b2 * vk for vk in v]
    floor = [b2 * fk for fk in floor]
    for pair in micro:
      for k, (a, b) in enumerate(pair):
        g, d = (np.float64(a) + b) / 2, (np.float64(a) - b) / 2
        m[k] = m[k] + (1 - b1) / n * g
        v[k] = v[k] + (1 - b2) / n * (g**2 - (1 - 1 / n) * d**2)
        floor[k] = floor[k] + (1 - b2) / n**2 * g**2
    read = {"factored": [_factored_float64(f) for f in floor], "whole": floor, None: None}
    params = _step_float64(params, m, v, t, lrs[t - 1], b1, b2, eps, floor_nu=n > 1,
                           nu_floor=read[floor_read] if n > 1 else None)
  return params, m, v


# As above: 20 examples with the slow tests, 6 in the default run's smoke.
@pytest.mark.slow
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(**_REFERENCE_DRAWS, noise=st.floats(0.0, 3.0))
def test_split_estimator_matches_float64_reference(
    shapes, num_micro_batches, b1, b2, noise, seed):
  _check_split_estimator(shapes, num_micro_batches, b1, b2, noise, seed)


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(**_REFERENCE_DRAWS, noise=st.floats(0.0, 3.0))
def test_split_estimator_matches_float64_reference_smoke(
    shapes, num_micro_batches, b1, b2, noise, seed):
  _check_split_estimator(shapes, num_micro_batches, b1, b2, noise, seed)


def _check_split_estimator(shapes, num_micro_batches, b1, b2, noise, seed):
  rng = np.random.default_rng(seed)
  num_steps, eps, lr = 4, 1e-8, 0.01
  params = [rng.normal(size=s).astype(np.float32) for s in shapes]
  # Halves share a mean and differ by `noise`: large noise drives v below
  # m_hat**2 (and below zero), where the floor of the direction acts.
  halves = [[[(mean + noise * rng.normal(size=s), mean + noise * rng.normal(size=s))
              for s in shapes for mean in [rng.normal(size=s)]]
             for _ in range(num_micro_batches)] for _ in range(num_steps)]
  halves = [[[(a.astype(np.float32), b.astype(np.float32)) for a, b in pair]
             for pair in micro] for micro in halves]
  tx = optax_adama.contrib.adama(lr, b1=b1, b2=b2, eps=eps, num_micro_batches=num_micro_batches,
                         nu_estimator="split")
  got, state = [jnp.asarray(p) for p in params], None
  state = tx.init(got)
  for micro in halves:
    for pair in micro:
      g = [jnp.asarray((a + b) / 2) for a, b in pair]
      d = [jnp.asarray((a - b) / 2) for a, b in pair]
      updates, state = tx.update(g, state, got, half_difference=d)
      got = optax.apply_updates(got, updates)
  want, m, v = _reference_split_float64(params, halves, [lr] * num_steps, b1, b2, eps)
  adama_state = _adama_state(state)
  chex.assert_trees_all_close(adama_state.mu, m, rtol=1e-5, atol=1e-7)
  # v is a difference of squares here: absolute error ~1e-7 of the squares.
  chex.assert_trees_all_close(adama_state.nu, v, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-4)


def test_split_floor_is_factored_as_adafactor_for_large_leaves():
  # A leaf whose last two dimensions are >= 128 keeps its floor as row and
  # column sums (the same float64 reference reads it back); noise 3 puts
  # many coordinates' v below the floor, so the floor decides their steps.
  rng = np.random.default_rng(0)
  shapes, n, num_steps, lr = [(128, 160), (2, 128, 130), (7,)], 4, 3, 0.01
  params = [rng.normal(size=s).astype(np.float32) for s in shapes]
  halves = [[[tuple((mean + 3 * rng.normal(size=s)).astype(np.float32) for _ in range(2))
              for s in shapes for mean in [0.1 * rng.normal(size=s)]]
             for _ in range(n)] for _ in range(num_steps)]
  # "split" given halves
  tx = optax_adama.contrib.adama(lr, num_micro_batches=n, nu_estimator="auto")
  got = [jnp.asarray(p) for p in params]
  state = tx.init(got)
  floor_shapes = [(f.rows.shape, f.cols.shape) for f in state.adama.nu_floor]
  assert floor_shapes == [((128,), (160,)), ((2, 128), (2, 130)), ((7,), ())]
  for micro in halves:
    for pair in micro:
      updates, state = tx.update([jnp.asarray((a + b) / 2) for a, b in pair], state, got,
                                 half_difference=[jnp.asarray((a - b) / 2) for a, b in pair])
      got = optax.apply_updates(got, updates)
  want, _, _ = _reference_split_float64(params, halves, [lr] * num_steps, 0.9, 0.999, 1e-8)
  # float32 sums of 128-160 squares: ~1e-6 relative in the floor, 1e-6 in a step.
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
  # The floor acted: read whole instead of factored, or not at all, the
  # steps differ by far more than the tolerance.
  for read in ("whole", None):
    other, _, _ = _reference_split_float64(params, halves, [lr] * num_steps, 0.9, 0.999,
                                           1e-8, floor_read=read)
    assert max(np.max(np.abs(g - o)) for g, o in zip(got, other)) > 1e-3
  # split_floor=False keeps no floor and steps as the reference without one.
  tx = optax_adama.contrib.adama(lr, num_micro_batches=n, nu_estimator="auto", split_floor=False)
  got = [jnp.asarray(p) for p in params]
  state = tx.init(got)
  assert state.adama.nu_floor == ()
  for micro in halves:
    for pair in micro:
      updates, state = tx.update([jnp.asarray((a + b) / 2) for a, b in pair], state, got,
                                 half_difference=[jnp.asarray((a - b) / 2) for a, b in pair])
      got = optax.apply_updates(got, updates)
  chex.assert_trees_all_close(got, other, rtol=1e-5, atol=1e-5)
  with pytest.raises(TypeError, match="split_floor must be True or False"):
    optax_adama.contrib.adama(lr, num_micro_batches=n, nu_estimator="split",
                              split_floor="no")


@pytest.mark.parametrize("num_micro_batches", [2, 4, 8])
def test_split_estimator_expects_adams_second_moment(num_micro_batches):
  # Per coordinate: micro-batch gradient g_i ~ mu + N(0, sigma**2), its halves
  # g_a, g_b ~ mu + N(0, 2 sigma**2). Adam's E[mean_i(g_i)**2] is mu**2 +
  # sigma**2 / N; one mini-batch's fold should have that mean, where "mean"'s
  # has mu**2 + sigma**2.
  n, coords, sigma = num_micro_batches, 200_000, 1.0
  rng = np.random.default_rng(0)
  mu = rng.uniform(-1.0, 1.0, coords)
  tx = optax_adama.contrib.scale_by_adama(b2=0.5, num_micro_batches=n, nu_estimator="split")
  state = tx.init({"w": jnp.zeros(coords)})
  for _ in range(n):
    a, b = (mu + np.sqrt(2) * sigma * rng.normal(size=coords) for _ in range(2))
    _, state = tx.update({"w": jnp.asarray((a + b) / 2, jnp.float32)}, state,
                         half_difference={"w": jnp.asarray((a - b) / 2, jnp.float32)})
  contribution = np.asarray(state.nu["w"], np.float64) / 0.5  # (1 - b2) v_in
  want = np.mean(mu**2) + sigma**2 / n
  # Five standard errors of the mean over the coordinates: fails by chance
  # with probability below 1e-6; "mean"'s expectation is sigma**2 (1 - 1/N)
  # above `want`, at least 100 standard errors away.
  standard_error = np.std(contribution) / np.sqrt(coords)
  assert abs(np.mean(contribution) - want) < 5 * standard_error
  assert sigma**2 * (1 - 1 / n) > 100 * standard_error


def test_split_estimator_rejects_what_it_cannot_take():
  tx = optax_adama.contrib.adama(0.1, num_micro_batches=2, nu_estimator="split")
  params = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="needs update\\(..., half_difference=d\\)"):
    tx.update(params, tx.init(params), params)
  with pytest.raises(ValueError, match="nu_estimator must be one of"):
    optax_adama.contrib.adama(0.1, num_micro_batches=2, nu_estimator="splits")
  # N = 1 is Adam: no halves needed.
  one = optax_adama.contrib.adama(0.1, num_micro_batches=1, nu_estimator="split")
  updates, _ = one.update(params, one.init(params), params)
  # float32 0.999 is 0.99900001: 1 - b2 is off by 1.3e-5 relative, the step
  # by half that through the square root.
  np.testing.assert_allclose(updates["w"], -0.1, rtol=1e-5)


def test_nu_estimators_order_v_as_their_expectations_say():
  # Noisy micro-batches around a steady mean: E[v] is mu^2 + sigma^2 ("mean"),
  # (mu^2 + sigma^2) / N ("sum") and about mu^2 + sigma^2 / N ("momentum",
  # Adam's), so mean > momentum > sum, and momentum is near Adam's v.
  num_micro, mu, sigma, steps = 4, 1.0, 2.0, 300
  params = {"w": jnp.zeros(4096)}
  def v_after(nu_estimator):
    tx = optax_adama.contrib.scale_by_adama(num_micro_batches=num_micro, nu_estimator=nu_estimator)
    def mini_batch(state, step):
      def micro(state, i):
        key = jax.random.fold_in(jax.random.key(3), step * num_micro + i)
        g = mu + sigma * jax.random.normal(key, (4096,))
        return tx.update({"w": g}, state)[1], None
      return jax.lax.scan(micro, state, jnp.arange(num_micro))[0], None
    state = jax.jit(lambda: jax.lax.scan(mini_batch, tx.init(params), jnp.arange(steps))[0])()
    t = steps
    return float(jnp.mean(state.nu["w"]) / (1 - 0.999**t))
  mean, total, momentum = (v_after(e) for e in ("mean", "sum", "momentum"))
  adam = mu**2 + sigma**2 / num_micro  # 2.0
  np.testing.assert_allclose(mean, mu**2 + sigma**2, rtol=0.05)  # 5.0
  np.testing.assert_allclose(total, (mu**2 + sigma**2) / num_micro, rtol=0.05)  # 1.25
  # m_hat averages ~10 mini-batches of noise: m_hat^2 is mu^2 plus its variance.
  np.testing.assert_allclose(momentum, adam, rtol=0.1)
