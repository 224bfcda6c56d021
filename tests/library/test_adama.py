"""AdamA as a plain Optax transformation: one ``update`` call per micro-batch."""

import copy
import inspect
import pickle
import re

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adama

# float32 Adam over ~25 steps: each step's update is m/(sqrt(v)+eps) with O(1)
# magnitude and ~1e-7 relative rounding per op; a few dozen ops per step and
# 25 steps stay well inside 1e-5 relative, the contract of the issue.
RTOL = 1e-5
ATOL = 1e-6


def _params():
  return {
      "dense": {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)},
      "scale": jnp.ones(()),
  }


def _grads(params, step, micro=0):
  """Deterministic, step- and micro-batch-dependent gradients."""
  return jax.tree.map(
      lambda p: jnp.sin(3.0 * p + 0.7 * step + 1.3 * micro) + 0.1 * micro, params)


def _run_adama(tx, params, num_steps, num_micro_batches, grads_fn=_grads):
  state = tx.init(params)
  for step in range(num_steps):
    for micro in range(num_micro_batches):
      updates, state = tx.update(grads_fn(params, step, micro), state, params)
      params = optax.apply_updates(params, updates)
  return params, state


def _run_optax(tx, params, num_steps, grads_fn):
  state = tx.init(params)
  with jax.numpy_dtype_promotion("standard"):
    for step in range(num_steps):
      updates, state = tx.update(grads_fn(params, step), state, params)
      params = optax.apply_updates(params, updates)
  return params


def _adama_state(state):
  found = optax_adama.find_adama_state(state)
  assert found is not None
  return found


@pytest.mark.parametrize("nu_estimator", optax_adama.contrib.NU_ESTIMATORS)
@pytest.mark.parametrize("make", ["adam", "adamw"])
def test_one_micro_batch_matches_optax(make, nu_estimator):
  params = _params()
  if make == "adam":
    ours = optax_adama.contrib.adama(0.05, num_micro_batches=1, nu_estimator=nu_estimator)
    ref = optax.adam(0.05)
  else:
    ours = optax_adama.contrib.adamaw(0.05, weight_decay=0.1, num_micro_batches=1,
                              nu_estimator=nu_estimator)
    ref = optax.adamw(0.05, weight_decay=0.1)
  got, _ = _run_adama(ours, params, 25, 1)
  want = _run_optax(ref, params, 25, lambda p, s: _grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("hyper", [
    dict(b1=0.9, b2=0.98, eps=1e-9),  # Flax's Gemma example's settings
    dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=1e-12),
    dict(b1=0.5, b2=0.9, eps=1e-3),
], ids=["gemma", "eps_root", "fast_decay"])
def test_one_micro_batch_is_optax_scale_by_adam_bit_for_bit(hyper):
  """N = 1 is optax.scale_by_adam exactly: moments, count and updates, every
  step of 300 jitted ones (a last-bit drift would compound and show). With
  float32 moments: narrower ones round stochastically by default, where
  optax rounds to nearest."""
  ours = optax_adama.scale_by_adama(num_micro_batches=1, **hyper)
  ref = optax.scale_by_adam(**hyper)
  params = {"w": jnp.zeros((40, 25)), "b": jnp.zeros(7)}
  ours_update, ref_update = jax.jit(ours.update), jax.jit(ref.update)
  state, ref_state = ours.init(params), ref.init(params)
  key = jax.random.PRNGKey(0)
  for step in range(300):
    keys = jax.random.split(jax.random.fold_in(key, step), 2)
    # Scales from 1e-3 to 1e3: the fold's products round in every binade.
    grads = {"w": jax.random.normal(keys[0], (40, 25)) * 10.0 ** (step % 7 - 3),
             "b": jax.random.normal(keys[1], (7,))}
    updates, state = ours_update(grads, state)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
      ref_updates, ref_state = ref_update(grads, ref_state)
    chex.assert_trees_all_equal(updates, ref_updates)
  chex.assert_trees_all_equal((state.mu, state.nu, state.count),
                              (ref_state.mu, ref_state.nu, ref_state.count))


def test_one_micro_batch_adam_trains_as_optax_adam_bit_for_bit():
  """The alias too: jitted, adama(lr, N = 1) moves params as optax.adam(lr)."""

  def train(tx):
    @jax.jit
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params = _params()
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):
      for i in range(100):
        params, state = step(params, state, _grads(params, i))
    return params

  chex.assert_trees_all_equal(train(optax_adama.adama(0.05, num_micro_batches=1)),
                              train(optax.adam(0.05)))


# Identical micro-batches are Adam exactly under "mean" (the default; and
# "split", whose halves then agree); "momentum" reads the squared mean gradient
# from m_hat**2, exact at N = 1 only (test_one_micro_batch_matches_optax).
def test_identical_micro_batches_match_optax_adam():
  params = _params()
  ours = optax_adama.adama(0.05, num_micro_batches=4)
  same = lambda p, s, m: _grads(p, s)  # every micro-batch has the same gradient
  got, _ = _run_adama(ours, params, 25, 4, same)
  want = _run_optax(optax.adam(0.05), params, 25, lambda p, s: _grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_adamaw_mask_and_weight_decay_once_per_mini_batch():
  params = _params()
  mask = {"dense": {"w": True, "b": False}, "scale": False}
  ours = optax_adama.adamaw(0.05, weight_decay=0.3, num_micro_batches=3, mask=mask)
  same = lambda p, s, m: _grads(p, s)
  got, _ = _run_adama(ours, params, 10, 3, same)
  ref = optax.adamw(0.05, weight_decay=0.3, mask=mask)
  want = _run_optax(ref, params, 10, lambda p, s: _grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


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


def test_first_moment_equals_adam_first_moment_of_mean_gradient():
  params = _params()
  num_micro = 4
  tx = optax_adama.scale_by_adama(num_micro_batches=num_micro)
  ref = optax.scale_by_adam()
  state, ref_state = tx.init(params), ref.init(params)
  for step in range(5):
    micro = [_grads(params, step, i) for i in range(num_micro)]
    for g in micro:
      _, state = tx.update(g, state)
    mean = jax.tree.map(lambda *g: sum(g) / num_micro, *micro)
    with jax.numpy_dtype_promotion("standard"):
      _, ref_state = ref.update(mean, ref_state)
  chex.assert_trees_all_close(state.mu, ref_state.mu, rtol=1e-6, atol=1e-7)
  # v holds E[g_i^2] >= (E g_i)^2: never smaller than Adam's, so never larger steps.
  for ours, adam in zip(jax.tree.leaves(state.nu), jax.tree.leaves(ref_state.nu)):
    assert np.all(np.asarray(ours) >= np.asarray(adam) * (1 - 1e-6))
    assert np.any(np.asarray(ours) > np.asarray(adam) * 1.01)


def test_schedule_counts_mini_batches():
  def schedule(count):
    return 0.1 / (1.0 + jnp.asarray(count, jnp.float32))
  params = {"w": jnp.zeros(2)}
  tx = optax_adama.adama(schedule, num_micro_batches=3)
  ref = optax.adam(schedule)
  state, ref_state = tx.init(params), ref.init(params)
  for step in range(3):
    grads = {"w": jnp.array([1.0, -2.0]) * (step + 1)}
    for micro in range(3):  # identical micro-batches: AdamA equals Adam
      updates, state = tx.update(grads, state, params)
      if micro < 2:
        assert bool(jnp.all(updates["w"] == 0.0))
    with jax.numpy_dtype_promotion("standard"):
      want, ref_state = ref.update(grads, ref_state, params)
    # lr(0), lr(1), lr(2) differ by up to 3x: counting micro-batches instead
    # (lr(2), lr(5), lr(8)) would miss by far more than rounding.
    chex.assert_trees_all_close(updates, want, rtol=1e-6)


def test_zero_updates_until_last_micro_batch_and_has_updated():
  params = _params()
  tx = optax.chain(optax_adama.adama(0.1, num_micro_batches=3))
  state = tx.init(params)
  flags = []
  for call in range(6):
    updates, state = tx.update(_grads(params, 0, call), state, params)
    flags.append(bool(optax_adama.has_updated(state)))
    nonzero = any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    assert nonzero == flags[-1]
    if not flags[-1]:
      for u in jax.tree.leaves(updates):
        assert bool(jnp.all(u == 0))
  assert flags == [False, False, True] * 2


def test_has_updated_rejects_foreign_state():
  with pytest.raises(ValueError, match="AdamA state"):
    optax_adama.has_updated(optax.adam(0.1).init({"w": jnp.zeros(1)}))


@pytest.mark.parametrize("bad", [0, -2])
def test_num_micro_batches_below_one_raises_at_construction(bad):
  for make in (optax_adama.scale_by_adama,
               lambda **kw: optax_adama.adama(0.1, **kw),
               lambda **kw: optax_adama.adamaw(0.1, **kw)):
    with pytest.raises(ValueError, match=f"num_micro_batches must be >= 1, got {bad}"):
      make(num_micro_batches=bad)


@pytest.mark.parametrize("bad", [2.0, np.float64(2.0), True, np.bool_(True), "2",
                                 jnp.array(2.0), jnp.array([2])])
def test_num_micro_batches_must_be_an_integer(bad):
  with pytest.raises(TypeError, match="num_micro_batches must be an integer"):
    optax_adama.scale_by_adama(num_micro_batches=bad)


@pytest.mark.parametrize("name, bad", [("b1", 1.0), ("b1", -0.1), ("b2", 1.0),
                                       ("b2", np.float32(1.5)), ("eps", -1e-8),
                                       ("eps_root", -1.0)])
def test_out_of_range_hyperparams_raise_quoting_them(name, bad):
  with pytest.raises(ValueError, match=f"{name} must be .*got {re.escape(repr(bad))}"):
    optax_adama.adamaw(0.1, num_micro_batches=2, **{name: bad})


def test_traced_hyperparams_are_not_checked_under_jit():
  # inject_hyperparams hands the factory tracers inside jit: they must pass.
  tx = optax.inject_hyperparams(optax_adama.adama, static_args=("num_micro_batches",))(
      learning_rate=0.1, b1=0.9, b2=0.999, num_micro_batches=2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  updates, _ = jax.jit(tx.update)({"w": jnp.ones(3)}, state, params)
  assert updates["w"].shape == (3,)


@pytest.mark.parametrize("integer", [np.int64(2), np.int32(2), np.array(2)])
def test_integer_like_num_micro_batches_are_accepted(integer):
  state = optax_adama.adama(0.1, num_micro_batches=integer).init({"w": jnp.ones(2)})
  assert optax_adama.find_adama_state(state).num_micro_batches == 2
  assert type(optax_adama.find_adama_state(state).num_micro_batches) is int


def test_update_reads_num_micro_batches_and_the_estimator_from_the_state():
  # N and the estimator have one home, the state's static fields: an update
  # folds as the state was made, whatever N its transformation was built with.
  params = {"w": jnp.array([1.0, -2.0, 0.5])}
  made = optax_adama.contrib.scale_by_adama(num_micro_batches=4, nu_estimator="momentum")
  other = optax_adama.scale_by_adama(num_micro_batches=2)
  states = [made.init(params)] * 2
  for call in range(8):
    grads = {"w": jnp.array([0.5, -0.25, 1.0]) * (call + 1)}
    outs = [tx.update(grads, st) for tx, st in zip((made, other), states)]
    np.testing.assert_array_equal(outs[0][0]["w"], outs[1][0]["w"])
    states = [o[1] for o in outs]
  assert int(states[1].count) == 2 and states[1].nu_estimator == "momentum"


def test_the_static_fields_are_tree_structure_and_survive_copies():
  state = optax_adama.contrib.scale_by_adama(num_micro_batches=3, nu_estimator="sum").init(
      {"w": jnp.ones(2)})
  assert state._fields == ("count", "micro_step", "mu", "nu", "nu_floor",
                           "mini_batch_accepted", "num_dropped")
  assert len(jax.tree.leaves(state)) == 6  # nu_floor is ()
  with pytest.raises(AttributeError, match="immutable"):
    state.num_micro_batches = 2
  for copied in (copy.deepcopy(state), pickle.loads(pickle.dumps(state)),
                 jax.tree.map(jnp.copy, state), state._replace(count=state.count + 1)):
    assert (copied.num_micro_batches, copied.nu_estimator) == (3, "sum")
    assert jax.tree.structure(copied) == jax.tree.structure(state)
  assert "num_micro_batches=3, nu_estimator='sum')" in repr(state)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8])
def test_integer_and_bool_params_raise_naming_the_leaf(dtype):
  params = {"dense": {"w": jnp.ones(3), "step": jnp.zeros(2, dtype)}}
  for tx in (optax_adama.scale_by_adama(num_micro_batches=2),
             optax_adama.adamaw(0.1, num_micro_batches=2)):
    with pytest.raises(TypeError, match=r"\['dense'\]\['step'\] \((int32|bool|uint8)\)"):
      tx.init(params)


@pytest.mark.parametrize("ours, theirs", [
    (optax_adama.scale_by_adama, optax.scale_by_adam), (optax_adama.adama, optax.adam),
    (optax_adama.adamaw, optax.adamw)])
def test_positional_parameters_are_optaxs(ours, theirs):
  # Code written for optax passes hyperparameters positionally; each must
  # land where optax's would (adamw's 5th is eps_root, not weight_decay).
  positional = lambda f: [name for name, p in inspect.signature(f).parameters.items()
                          if p.kind == p.POSITIONAL_OR_KEYWORD]
  assert positional(ours) == positional(theirs)
  assert "nesterov" in inspect.signature(ours).parameters


def test_adamaw_positional_call_matches_optax_adamw():
  params = _params()
  # eps, eps_root and weight_decay far apart: any two swapped move the params.
  args = (0.05, 0.8, 0.99, 1e-2, 0.5, None, 0.3)  # ... eps_root, mu_dtype, weight_decay
  got, _ = _run_adama(optax_adama.adamaw(*args, num_micro_batches=1), params, 10, 1)
  want = _run_optax(optax.adamw(*args), params, 10, lambda p, s: _grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_nesterov_is_refused_naming_the_alternative():
  for make in (optax_adama.adama, optax_adama.adamaw):
    with pytest.raises(ValueError, match=r"nesterov=True.*optax.MultiSteps"):
      make(1e-3, num_micro_batches=4, nesterov=True)
  for falsy in (False, 0, None, np.False_):  # as optax reads it: `if nesterov:`
    optax_adama.adama(1e-3, num_micro_batches=4, nesterov=falsy).init(_params())


def _complex_params():
  w = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  return {"w": jax.lax.complex(w, w[::-1]), "b": jnp.zeros(3)}


def _complex_grads(params, step, micro=0):
  return jax.tree.map(lambda p: (jnp.sin(3.0 * p + 0.7 * step + 1.3 * micro)
                                 + 0.1 * micro).astype(p.dtype), params)


# optax.adam moves complex params with v the EMA of |g|**2 (stored complex,
# imaginary part zero); AdamA does the same, so upstream code written for
# complex params runs unchanged (optax's alias tests run every optimizer on
# a complex parabola).
@pytest.mark.parametrize("nu_estimator", ["mean", "sum", "momentum"])
def test_complex_params_step_as_optax_adam(nu_estimator):
  params = _complex_params()
  ours = optax_adama.contrib.adama(0.05, num_micro_batches=1, nu_estimator=nu_estimator)
  got, state = _run_adama(ours, params, 25, 1, _complex_grads)
  want = _run_optax(optax.adam(0.05), params, 25, lambda p, s: _complex_grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)
  adama_state = _adama_state(state)
  want_state = optax.adam(0.05).init(params)[0]
  dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)
  for ours_moment, optax_moment in ((adama_state.mu, want_state.mu),
                                    (adama_state.nu, want_state.nu)):
    assert dtypes(ours_moment) == dtypes(optax_moment)
  assert float(jnp.max(jnp.abs(adama_state.nu["w"].imag))) == 0.0


def test_complex_params_fold_the_mean_of_absolute_squares_float64_reference():
  """N = 3 distinct micro-batches against the fold written out in complex128."""
  params = _complex_params()
  lr, b1, b2, eps, n = 0.05, 0.9, 0.999, 1e-8, 3
  got, _ = _run_adama(optax_adama.adama(lr, num_micro_batches=n), params, 6, n,
                      _complex_grads)
  want = jax.tree.map(
      lambda p: np.asarray(p, np.complex128 if jnp.iscomplexobj(p) else np.float64), params)
  m = jax.tree.map(np.zeros_like, want)
  v = jax.tree.map(lambda p: np.zeros(p.shape), want)
  for step in range(6):
    # _complex_grads, in float64 / complex128 at the reference's own params.
    grads = [{key: np.sin(3.0 * p + 0.7 * step + 1.3 * micro) + 0.1 * micro
              for key, p in want.items()} for micro in range(n)]
    for key in want:
      gs = [g[key] for g in grads]
      m[key] = b1 * m[key] + (1 - b1) * sum(gs) / n
      v[key] = b2 * v[key] + (1 - b2) * sum(np.abs(g) ** 2 for g in gs) / n
      m_hat, v_hat = m[key] / (1 - b1 ** (step + 1)), v[key] / (1 - b2 ** (step + 1))
      want[key] = want[key] - lr * m_hat / (np.sqrt(v_hat) + eps)
  # float32 against float64 over 6 steps of O(lr) updates: rounding ~1e-7 per op.
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), want, rtol=RTOL, atol=ATOL)


def test_real_params_with_complex_moments_match_optax_without_warnings():
  # optax's upstream dtype tests pass mu_dtype=complex64 with real params; the
  # suite's filterwarnings=error turns any complex-to-real cast into a failure,
  # and AdamA runs under strict promotion (only optax's own update needs the
  # standard one).
  params = _params()
  ours = optax_adama.adama(0.05, num_micro_batches=1, mu_dtype=jnp.complex64)
  ref = optax.adam(0.05, mu_dtype=jnp.complex64)
  state, ref_state = ours.init(params), ref.init(params)
  grads = _grads(params, 0)
  for _ in range(3):
    updates, state = ours.update(grads, state, params)
    with jax.numpy_dtype_promotion("standard"):
      ref_updates, ref_state = ref.update(grads, ref_state, params)
  chex.assert_trees_all_close(updates, ref_updates, rtol=RTOL, atol=ATOL)
  dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)
  assert dtypes(updates) == dtypes(ref_updates)
  # "momentum" at N > 1 adds |m_hat|**2 of the complex m to the real v.
  momentum = optax_adama.contrib.adama(0.05, num_micro_batches=3, mu_dtype=jnp.complex64,
                               nu_estimator="momentum")
  state = momentum.init(params)
  for micro in range(6):
    updates, state = momentum.update(_grads(params, 0, micro), state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("nu_estimator", ["mean", "sum", "momentum"])
def test_complex_updates_turn_with_the_gradients_phase(nu_estimator):
  """Gradients times e^{i theta}: m turns with them, v (|g|**2, |m_hat|**2)
  does not, so every update turns by the same phase. A v of g**2 (or m**2)
  would turn by twice the phase and break it."""
  params = _complex_params()
  phase = jax.lax.complex(jnp.cos(0.7), jnp.sin(0.7))
  turn = lambda tree: jax.tree.map(
      lambda g: g * phase.astype(g.dtype) if jnp.iscomplexobj(g) else g, tree)
  grads = [_complex_grads(params, step, micro) for step in range(3) for micro in range(3)]
  runs = []
  for make_grads in (lambda g: g, turn):
    tx = optax_adama.contrib.adama(0.05, num_micro_batches=3, nu_estimator=nu_estimator)
    state, total = tx.init(params), jax.tree.map(jnp.zeros_like, params)
    for g in grads:
      updates, state = tx.update(make_grads(g), state, params)
      total = jax.tree.map(jnp.add, total, updates)
    runs.append(total)
  chex.assert_trees_all_close(runs[1], turn(runs[0]), rtol=RTOL, atol=ATOL)


def test_complex_params_with_a_real_second_moment_fold_absolute_squares():
  # v is real even for complex params: nu_dtype=float32 halves its bytes and
  # must step as the complex v does (|g|**2, not Re(g)**2).
  params = _complex_params()
  runs = []
  for nu_dtype in (None, jnp.float32):
    tx = optax_adama.adama(0.05, num_micro_batches=2, nu_dtype=nu_dtype)
    got, state = _run_adama(tx, params, 5, 2, _complex_grads)
    runs.append(got)
  assert _adama_state(state).nu["w"].dtype == jnp.float32
  chex.assert_trees_all_close(runs[1], runs[0], rtol=RTOL, atol=ATOL)


def test_inject_hyperparams_takes_complex_params():
  # optax casts the hyperparameters to the params' widest dtype, complex64 here
  # (its choice of that dtype promotes float32 with complex64: standard mode).
  params = _complex_params()
  tx = optax_adama.inject_hyperparams(optax_adama.adama)(
      learning_rate=0.05, num_micro_batches=1)
  with jax.numpy_dtype_promotion("standard"):
    got, _ = _run_adama(tx, params, 5, 1, _complex_grads)
  want = _run_optax(optax.adam(0.05), params, 5, lambda p, s: _complex_grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_complex_params_train_through_microbatch_step_as_per_micro_batch_updates():
  target = jnp.asarray([1 + 2j, -1j, 0.5], jnp.complex64)
  def loss_fn(params, batch):
    residual = batch["x"] @ params["w"] + (params["b"].astype(jnp.complex64) - target)[None]
    return jnp.mean(jnp.abs(residual) ** 2)
  params = _complex_params()
  batch = {"x": jax.random.normal(jax.random.key(0), (8, 2)).astype(jnp.complex64)}
  tx = optax_adama.adama(0.05, num_micro_batches=4)
  step = optax_adama.microbatch_step(loss_fn, tx)
  fused = jax.tree.map(jnp.copy, params)  # the step donates its params
  state = tx.init(fused)
  for _ in range(3):
    fused, state, metrics = step(fused, state, batch)
  loop, loop_state = params, tx.init(params)
  for _ in range(3):
    for i in range(4):  # micro-batch i: rows i, i + 4 (microbatch_step's split)
      grads = jax.grad(loss_fn)(loop, jax.tree.map(lambda x, i=i: x[i::4], batch))
      updates, loop_state = tx.update(grads, loop_state, loop)
      loop = optax.apply_updates(loop, updates)
  chex.assert_trees_all_close(fused, loop, rtol=RTOL, atol=ATOL)
  assert float(metrics["loss"]) < float(loss_fn(params, batch))


def test_complex_params_refuse_eight_bit_moments_and_split_naming_the_leaf():
  params = _complex_params()
  eight_bit = optax_adama.adama(0.05, num_micro_batches=2, quantization=(
      optax_adama.BlockQuantization(block_size=2, min_size=2)))
  with pytest.raises(TypeError, match=r"\['w'\] \(complex64\).*quantization=None"):
    eight_bit.init(params)
  for estimator in ("split", "auto"):
    with pytest.raises(TypeError, match=r"\['w'\] \(complex64\).*nu_estimator=\"mean\""):
      optax_adama.contrib.adama(0.05, num_micro_batches=2, nu_estimator=estimator).init(params)
  wide = {"w": jax.lax.complex(jnp.ones((8, 8)), jnp.ones((8, 8)))}
  with pytest.raises(TypeError, match=r"low_rank projects real matrices.*\['w'\]"):
    optax_adama.low_rank(optax_adama.adama(0.05, num_micro_batches=2), rank=2,
                         refresh_period=10, min_size=16).init(wide)
  with pytest.raises(TypeError, match=r"measures real params.*\['w'\]"):
    optax_adama.diagnostics.diagnose_second_moment(
        lambda p, b: 0.0, params, [], num_micro_batches=2)


def test_nonfinite_entries_never_reach_moments_and_are_counted():
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  tx = optax_adama.adama(0.1, num_micro_batches=2)
  state = tx.init(params)
  bad = {"a": jnp.array([1.0, jnp.nan, 1.0]), "b": jnp.array([jnp.inf, 1.0])}
  good = {"a": jnp.ones(3), "b": jnp.ones(2)}
  updates, state = tx.update(bad, state, params)
  updates, state = tx.update(good, state, params)
  adama_state = _adama_state(state)
  for leaf in jax.tree.leaves((adama_state.mu, adama_state.nu, updates)):
    assert bool(jnp.all(jnp.isfinite(leaf)))
  assert int(adama_state.num_dropped) == 1
  # The NaN entry was folded as zero: its first moment got only the good half.
  np.testing.assert_allclose(adama_state.mu["a"], [0.1, 0.05, 0.1], rtol=1e-6)
  assert bool(optax_adama.has_updated(state))


def test_all_micro_batches_dropped_leaves_params_unchanged():
  params = _params()
  tx = optax_adama.adamaw(0.1, weight_decay=0.5, num_micro_batches=2)
  state = tx.init(params)
  # One healthy mini-batch first, so momentum would move params if applied.
  for micro in range(2):
    updates, state = tx.update(_grads(params, 0, micro), state, params)
    params = optax.apply_updates(params, updates)
  before = params
  nan = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
  for _ in range(2):
    updates, state = tx.update(nan, state, params)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(params, before)
  assert not bool(optax_adama.has_updated(state))
  adama_state = _adama_state(state)
  assert int(adama_state.num_dropped) == 2
  for leaf in jax.tree.leaves((adama_state.mu, adama_state.nu)):
    assert bool(jnp.all(jnp.isfinite(leaf)))


@pytest.mark.parametrize(
    "param_dtype,mu_dtype,nu_dtype",
    [(jnp.float32, None, None), (jnp.bfloat16, jnp.float32, jnp.float32),
     (jnp.float32, jnp.bfloat16, jnp.float32), (jnp.bfloat16, None, None)])
def test_dtypes_honoured_and_stable(param_dtype, mu_dtype, nu_dtype):
  params = jax.tree.map(lambda p: p.astype(param_dtype), _params())
  tx = optax_adama.adama(
      0.01, num_micro_batches=2, mu_dtype=mu_dtype, nu_dtype=nu_dtype)
  state = tx.init(params)
  chex.clear_trace_counter()  # keyed by source: shared by the parametrizations
  # Counts compilations through a public route: a recompile retraces update.
  update = jax.jit(chex.assert_max_traces(tx.update, n=1))
  first = jax.tree.map(lambda x: (x.dtype, x.weak_type), state)
  for call in range(4):
    grads = jax.tree.map(lambda p: p.astype(param_dtype), _grads(params, 0, call))
    updates, state = update(grads, state, params)
    with jax.numpy_dtype_promotion("standard"):  # optax's add of wider updates.
      params = optax.apply_updates(params, updates)
    assert jax.tree.map(lambda x: (x.dtype, x.weak_type), state) == first
    # optax.adam's rule: the promotion of the gradient's and moments' dtypes.
    with jax.numpy_dtype_promotion("standard"):
      want = jnp.promote_types(jnp.promote_types(param_dtype, mu_dtype or param_dtype),
                               nu_dtype or param_dtype)
    for u in jax.tree.leaves(updates):
      assert u.dtype == want
  adama_state = _adama_state(state)
  for leaf in jax.tree.leaves(adama_state.mu):
    assert leaf.dtype == (mu_dtype or param_dtype)
  for leaf in jax.tree.leaves(adama_state.nu):
    assert leaf.dtype == (nu_dtype or param_dtype)


def test_mini_batch_chain_requires_adama_head():
  tx = optax_adama.mini_batch_chain(optax.scale_by_adam(), optax.scale(-1.0))
  with pytest.raises(TypeError, match="scale_by_adama"):
    tx.init({"w": jnp.zeros(1)})


def test_mini_batch_chain_extends_an_adamaw_as_the_spelled_out_chain():
  # adamaw(...) then a tail == scale_by_adama, decay, rate, tail in one chain:
  # the same updates one update per micro-batch and in the fused step.
  tail = lambda: optax.scale_by_schedule(
      lambda count: 1.0 / (1.0 + count.astype(jnp.float32)))
  extended = optax_adama.mini_batch_chain(
      optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=2), tail())
  spelled = optax_adama.mini_batch_chain(
      optax_adama.scale_by_adama(num_micro_batches=2), optax.add_decayed_weights(0.1),
      optax.scale_by_learning_rate(1e-2), tail())
  params = {"w": jnp.array([1.0, -2.0, 0.5])}
  states = [tx.init(params) for tx in (extended, spelled)]
  assert isinstance(states[0].adama, optax_adama.ScaleByAdamAState)
  with jax.numpy_dtype_promotion("standard"):
    for call in range(6):
      grads = {"w": jnp.array([0.5, 0.25, -1.0]) * (call + 1)}
      outs = [tx.update(grads, st, params) for tx, st in zip((extended, spelled), states)]
      np.testing.assert_array_equal(outs[0][0]["w"], outs[1][0]["w"])
      states = [o[1] for o in outs]
  assert int(optax.tree.get(states[0].inner[1], "count")) == 3  # mini-batches, not calls

  def loss(p, batch):
    return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

  batch = {"x": jnp.arange(12.0).reshape(4, 3) / 10, "y": jnp.arange(4.0)}
  fused = [optax_adama.microbatch_step(loss, tx, num_micro_batches=2)(
      jax.tree.map(jnp.copy, params), tx.init(params), batch)[0] for tx in (extended, spelled)]
  np.testing.assert_array_equal(fused[0]["w"], fused[1]["w"])
  with pytest.raises(TypeError, match="before offload_moments"):
    optax_adama.mini_batch_chain(optax_adama.offload_moments(
        optax_adama.adama(1e-2, num_micro_batches=2)), tail())


def test_mini_batch_chain_passes_extra_args_on_as_optax_multisteps_does():
  # Identical micro-batch gradients make AdamA's v Adam's, so the two chains
  # agree to rounding; in both the plateau transform keeps the value of the
  # call that completes the mini-batch. rtol 0.9: no value after the first
  # counts as an improvement, so with patience 1 the scale halves on
  # mini-batches 2 and 3.
  plateau = lambda: optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.9)
  ours = optax_adama.mini_batch_chain(
      optax_adama.scale_by_adama(num_micro_batches=2), optax.scale(-0.1), plateau())
  ref = optax.MultiSteps(optax.chain(optax.scale_by_adam(), optax.scale(-0.1), plateau()),
                         every_k_schedule=2)
  params = {"w": jnp.array([1.0, -2.0])}
  with jax.numpy_dtype_promotion("standard"):  # optax's own transforms need it
    state, ref_state = ours.init(params), ref.init(params)
    for call in range(6):
      grads = {"w": jnp.array([0.5, 0.25]) * (call // 2 + 1)}
      value = jnp.asarray(10.0 - call)
      updates, state = ours.update(grads, state, params, value=value)
      ref_updates, ref_state = ref.update(grads, ref_state, params, value=value)
      np.testing.assert_allclose(updates["w"], ref_updates["w"], rtol=1e-6)
  assert float(optax.tree.get(state, "scale")) == 0.25
  assert float(optax.tree.get(state, "best_value")) == 9.0  # the first completing call's


def test_all_dropped_mini_batch_counts_for_bias_correction_and_schedule_alike():
  seen = []
  def schedule(count):
    seen.append(count)  # traced or concrete: read after the fact
    return 0.1 * jnp.ones([], jnp.float32)
  params = {"w": jnp.ones(3)}
  tx = optax_adama.adama(schedule, num_micro_batches=2)
  state = tx.init(params)
  nan = {"w": jnp.full(3, jnp.nan)}
  for grads in (params, params, nan, nan):  # one healthy, one dropped mini-batch
    updates, state = tx.update(grads, state, params)
  schedule_state = state.inner[0]  # optax.scale_by_learning_rate's
  # The rule: every completed mini-batch counts, dropped or not.
  assert int(state.adama.count) == 2
  assert int(schedule_state.count) == 2
  assert not bool(optax_adama.has_updated(state))
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(3)})


# The gate acts on the update whatever stores the moments: float32 keeps its
# smoke in the default run, the bfloat16 and 8-bit stores (eager updates of
# 12-25 s on 2 busy cores) run with the slow tests.
@pytest.mark.parametrize("storage", [
    {},
    pytest.param({"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16}, marks=pytest.mark.slow),
    pytest.param({"quantization": optax_adama.BlockQuantization(block_size=64, min_size=64)},
                 marks=pytest.mark.slow),
], ids=["float32", "bfloat16", "8bit"])
def test_emitted_update_is_exactly_zero_when_every_micro_batch_drops(storage):
  # The gate on its own: momentum from a healthy mini-batch would otherwise
  # give a nonzero direction on the completing call.
  params = {"w": jnp.ones((8, 16))}
  tx = optax_adama.scale_by_adama(num_micro_batches=2, **storage)
  state = tx.init(params)
  for grads in (params, params):
    updates, state = tx.update(grads, state)
  assert bool(jnp.all(updates["w"] != 0))
  nan = {"w": jnp.full((8, 16), jnp.nan)}
  for _ in range(2):
    updates, state = jax.jit(tx.update)(nan, state)
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros((8, 16))})


LINEAR = optax.linear_schedule(1.0, 0.0, transition_steps=10)


def _learning_rates(tx, num_calls, num_micro_batches=2):
  """state.hyperparams["learning_rate"] after each completing call, jitted."""
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  rates = []
  for call in range(num_calls):
    _, state = update({"w": jnp.full(3, 0.5 + call)}, state, params)
    if (call + 1) % num_micro_batches == 0:
      rates.append(round(float(state.hyperparams["learning_rate"]), 6))
  return rates, state


def test_optax_inject_hyperparams_with_static_num_micro_batches_works_as_written():
  tx = optax.inject_hyperparams(optax_adama.adamaw, static_args=("num_micro_batches",))(
      learning_rate=1e-3, num_micro_batches=4)
  ref = optax_adama.adamaw(1e-3, num_micro_batches=4)
  params = {"w": jnp.linspace(-1.0, 1.0, 6)}
  state, ref_state = tx.init(params), ref.init(params)
  update = jax.jit(tx.update)
  for call in range(8):
    grads = {"w": jnp.sin(params["w"] + call)}
    got, state = update(grads, state, params)
    want, ref_state = ref.update(grads, ref_state, params)
    # Jitted against eager: the same float32 ops fused differently.
    chex.assert_trees_all_close(got, want, rtol=RTOL)
  # Changing the rate between steps, the Flax way.
  state.hyperparams["learning_rate"] = jnp.asarray(0.0, jnp.float32)
  for _ in range(4):
    got, state = update({"w": jnp.ones(6)}, state, params)
  chex.assert_trees_all_equal(got, {"w": jnp.zeros(6)})


def test_optax_inject_hyperparams_with_a_plain_schedule_fails_loudly():
  # Without static_args: refused when the state is made (N arrives as an array).
  tx = optax.inject_hyperparams(optax_adama.adama)(
      learning_rate=LINEAR, num_micro_batches=2)
  with pytest.raises(ValueError, match="per micro-batch.*optax_adama.inject_hyperparams"):
    tx.init({"w": jnp.ones(3)})
  # With static_args the state is made, and the fused step refuses it while
  # tracing, before any buffer is donated: the schedule would count micro-batches.
  tx = optax.inject_hyperparams(optax_adama.adama, static_args=("num_micro_batches",))(
      learning_rate=LINEAR, num_micro_batches=2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  step = optax_adama.microbatch_step(lambda p, b: jnp.sum(b["x"] @ p["w"]), tx)
  with pytest.raises(ValueError, match=r"per micro-batch.*optax_adama.inject_hyperparams"):
    step(params, state, {"x": jnp.ones((2, 3))})
  assert not params["w"].is_deleted()  # nothing donated
  # The same wrapper with a schedule that counts mini-batches is taken.
  tx = optax.inject_hyperparams(optax_adama.adama, static_args=("num_micro_batches",))(
      learning_rate=optax_adama.mini_batch_schedule(LINEAR, 2), num_micro_batches=2)
  optax_adama.microbatch_step(lambda p, b: jnp.sum(b["x"] @ p["w"]), tx)(
      params, tx.init(params), {"x": jnp.ones((2, 3))})


def test_optax_inject_hyperparams_without_static_n_is_refused_under_nnx_jit():
  from flax import nnx

  @nnx.jit
  def build():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = optax.inject_hyperparams(optax_adama.adamaw)(learning_rate=1e-2, num_micro_batches=2)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)

  with pytest.raises(ValueError, match=r'static_args=\("num_micro_batches",\)'):
    build()


def test_a_jax_array_num_micro_batches_is_refused_naming_both_fixes():
  # N fixes the state's structure; a JAX array N is what optax.inject_hyperparams
  # passes without static_args (eagerly too, so the refusal does not depend on jit).
  with pytest.raises(ValueError, match=r'static_args=\("num_micro_batches",\)'):
    optax_adama.adama(0.1, num_micro_batches=jnp.array(2))
  tx = optax.inject_hyperparams(optax_adama.adamaw)(learning_rate=1e-3, num_micro_batches=4)
  for init in (tx.init, jax.jit(tx.init)):
    with pytest.raises(ValueError, match="optax_adama.inject_hyperparams"):
      init({"w": jnp.ones(3)})


@pytest.mark.parametrize("make", ["ours", "optax_static"])
def test_injected_adamaw_builds_and_trains_under_jax_jit(make):
  factory = (optax_adama.inject_hyperparams(optax_adama.adamaw) if make == "ours" else
             optax.inject_hyperparams(optax_adama.adamaw, static_args=("num_micro_batches",)))
  tx = factory(learning_rate=1e-3, num_micro_batches=4)
  ref = optax_adama.adamaw(1e-3, num_micro_batches=4)
  params = {"w": jnp.linspace(-1.0, 1.0, 6)}
  state, ref_state = jax.jit(tx.init)(params), ref.init(params)
  update = jax.jit(tx.update)
  for call in range(8):
    grads = {"w": jnp.cos(params["w"] * call)}
    got, state = update(grads, state, params)
    want, ref_state = ref.update(grads, ref_state, params)
    # Jitted against eager: the same float32 ops fused differently.
    chex.assert_trees_all_close(got, want, rtol=RTOL)
  assert int(optax_adama.find_adama_state(state).count) == 2


@pytest.mark.parametrize("make", ["ours", "optax_static"])
def test_injected_adamaw_in_nnx_optimizer_built_under_nnx_jit(make):
  from flax import nnx
  factory = (optax_adama.inject_hyperparams(optax_adama.adamaw) if make == "ours" else
             optax.inject_hyperparams(optax_adama.adamaw, static_args=("num_micro_batches",)))

  @nnx.jit
  def build():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = factory(learning_rate=1e-2, num_micro_batches=2)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  model, optimizer = build()
  before = jnp.copy(model.kernel[...])

  @nnx.jit
  def train_step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)

  train_step(model, optimizer, jnp.ones((4, 3)))
  chex.assert_trees_all_equal(model.kernel[...], before)  # micro-batch 1 of 2
  train_step(model, optimizer, jnp.ones((4, 3)))
  assert not jnp.allclose(model.kernel[...], before)
  optimizer.opt_state.hyperparams["learning_rate"][...] = jnp.asarray(0.0)
  after = jnp.copy(model.kernel[...])
  for _ in range(2):
    train_step(model, optimizer, jnp.ones((4, 3)))
  # lr 0, no weight decay moves: the rate set between steps is the one used.
  chex.assert_trees_all_equal(model.kernel[...], after)


def test_schedules_count_mini_batches_however_they_are_injected():
  # adama(schedule) gives lr 1.0, 0.9, 0.8 for mini-batches 0, 1, 2.
  ours, state = _learning_rates(optax_adama.inject_hyperparams(optax_adama.adamaw)(
      learning_rate=LINEAR, num_micro_batches=2), 6)
  assert ours == [1.0, 0.9, 0.8]
  wrapped, _ = _learning_rates(optax.inject_hyperparams(
      optax_adama.adamaw, static_args=("num_micro_batches",))(
      learning_rate=optax_adama.mini_batch_schedule(LINEAR, 2), num_micro_batches=2), 6)
  assert wrapped == [1.0, 0.9, 0.8]
  # And the updates are those of adamaw(schedule).
  params = {"w": jnp.ones(3)}
  ref = optax_adama.adamaw(LINEAR, num_micro_batches=2)
  ref_state = ref.init(params)
  tx = optax_adama.inject_hyperparams(optax_adama.adamaw)(
      learning_rate=LINEAR, num_micro_batches=2)
  state = tx.init(params)
  for call in range(6):
    grads = {"w": jnp.full(3, 0.5 + call)}
    got, state = tx.update(grads, state, params)
    want, ref_state = ref.update(grads, ref_state, params)
    # The injected rate is the schedule's value cast to float32 first.
    chex.assert_trees_all_close(got, want, rtol=RTOL)


def test_inject_hyperparams_rejects_factories_without_num_micro_batches():
  with pytest.raises(TypeError, match="takes no num_micro_batches"):
    optax_adama.inject_hyperparams(optax.adam)


def test_optax_tree_utils_find_and_set_state_fields_as_in_optax_adam():
  # Loops log the step with tree_get(opt_state, "count") whatever the optimizer.
  # (Under inject_hyperparams "count" is there twice, as it is for optax.adam.)
  params = {"w": jnp.ones(3)}
  tx = optax.chain(optax_adama.adama(0.1, num_micro_batches=2))
  state = tx.init(params)
  for call in range(5):
    _, state = tx.update({"w": jnp.full(3, float(call))}, state, params)
  assert int(optax.tree_utils.tree_get(state, "count")) == 2
  assert int(optax.tree_utils.tree_get(state, "micro_step")) == 1
  chex.assert_trees_all_equal(optax.tree_utils.tree_get(state, "mu"),
                              optax_adama.find_adama_state(state).mu)
  reset = optax.tree_utils.tree_set(state, micro_step=jnp.zeros([], jnp.int32))
  assert int(optax_adama.find_adama_state(reset).micro_step) == 0
  assert optax_adama.find_adama_state(reset).num_micro_batches == 2


def test_optax_tree_set_reaches_a_hyperparameter_beside_or_around_adama():
  # optax's own use: tree_set(state, learning_rate=...) on inject_hyperparams,
  # and on a chain whose other member holds the key. The static fields
  # (num_micro_batches, nu_estimator) are tree structure, no leaves there.
  params = jnp.ones(3)
  injected = optax_adama.inject_hyperparams(optax_adama.adama)(
      learning_rate=1.0, num_micro_batches=2)
  state = optax.tree.set(injected.init(params), learning_rate=jnp.asarray(0.5))
  assert float(optax.tree.get(state, "learning_rate")) == 0.5
  for _ in range(2):
    updates, state = injected.update(jnp.ones(3), state, params)
  # A first Adam step is -lr * sign(g) (up to eps): the rate set above.
  np.testing.assert_allclose(updates, -0.5 * np.ones(3), rtol=1e-6)
  with jax.numpy_dtype_promotion("standard"):  # optax.inject_hyperparams(optax.scale)
    chained = optax.chain(optax.inject_hyperparams(optax.scale)(step_size=1.0),
                          optax_adama.adama(1.0, num_micro_batches=2))
    state = optax.tree.set(chained.init(params), step_size=jnp.asarray(2.0))
  assert float(optax.tree.get(state, "step_size")) == 2.0
  assert jax.tree.structure(state) == jax.tree.structure(chained.init(params))
  assert optax_adama.find_adama_state(state).num_micro_batches == 2


def test_flax_state_dicts_hold_the_leaves_and_not_the_static_fields():
  serialization = pytest.importorskip("flax.serialization")
  params = {"w": jnp.arange(3.0)}
  state = optax_adama.adama(0.1, num_micro_batches=2).init(params)
  state_dict = serialization.to_state_dict(state)["adama"]
  assert set(state_dict) == set(optax_adama.ScaleByAdamAState._fields)
  assert not {"num_micro_batches", "nu_estimator"} & set(state_dict)


# 42 s of eager 8-bit updates on 2 busy cores: with the slow tests. An adamaw
# state through orbax's StandardCheckpointer keeps its smoke in
# tests/library/test_nnx_entry.py (test_the_optimizer_state_checkpoints_with_orbax), an
# 8-bit state saved mid-mini-batch and stepped on bitwise in
# tests/zoo/test_checkpoint.py (test_low_rank_and_host_offloaded_state_round_trips).
@pytest.mark.slow
def test_optax_chain_of_adama_state_round_trips_through_orbax_mid_mini_batch(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  params = _params()
  tx = optax_adama.adamaw(
      0.05, weight_decay=0.1, num_micro_batches=3,
      quantization=optax_adama.BlockQuantization(block_size=4, min_size=8))
  state = tx.init(params)
  for call in range(4):  # one mini-batch and one micro-batch into the next
    updates, state = tx.update(_grads(params, 0, call), state, params)
    params = optax.apply_updates(params, updates)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()
  abstract = jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)})
  restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
  assert isinstance(optax_adama.find_adama_state(restored["opt_state"]).mu["dense"]["w"],
                    optax_adama.moments.QuantizedArray)
  # Training goes on from the restored state exactly as from the live one.
  for call in range(4, 6):
    grads = _grads(params, 1, call)
    want, state = tx.update(grads, state, params)
    got, restored["opt_state"] = tx.update(grads, restored["opt_state"], params)
    chex.assert_trees_all_equal(got, want)


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


def test_nu_estimator_is_checked():
  with pytest.raises(ValueError, match="nu_estimator must be one of .* got 'median'"):
    optax_adama.contrib.adama(0.1, num_micro_batches=2, nu_estimator="median")


_DTYPE_CASES = [(p, g, m) for p in ("float32", "bfloat16") for g in ("float32", "bfloat16")
                for m in (None, "bfloat16", "float32")]


@pytest.mark.parametrize("param_dtype, grad_dtype, mu_dtype", _DTYPE_CASES)
def test_update_dtypes_match_optax_adam_under_mixed_precision(param_dtype, grad_dtype, mu_dtype):
  # optax.adam returns the promotion of the gradient's and the moments' dtypes:
  # float32 params with bfloat16 gradients get float32 updates, not updates
  # rounded to bfloat16 before they are added (~0.4% relative error per step).
  params = {"w": jnp.linspace(-1.0, 1.0, 8).astype(param_dtype)}
  grads = {"w": jnp.linspace(0.5, -0.3, 8).astype(grad_dtype)}
  with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic mixes dtypes.
    ref = optax.adam(1e-3, mu_dtype=mu_dtype)
    want, _ = ref.update(grads, ref.init(params), params)
  tx = optax_adama.adama(1e-3, num_micro_batches=1, mu_dtype=mu_dtype)
  got, _ = tx.update(grads, tx.init(params), params)
  assert got["w"].dtype == want["w"].dtype
  # The same values, to the rounding of the narrowest dtype involved.
  rtol = 1e-2 if "bfloat16" in (param_dtype, grad_dtype, mu_dtype) else 1e-6
  np.testing.assert_allclose(np.asarray(got["w"], np.float32),
                             np.asarray(want["w"], np.float32), rtol=rtol)


@pytest.mark.parametrize("param_dtype, mu_dtype", [("float32", None), ("bfloat16", "float32"),
                                                   ("bfloat16", None)])
def test_fused_step_update_dtype_matches_optax_for_params_dtype(param_dtype, mu_dtype):
  # The fused path's gradient has the params' dtype; its direction follows
  # the same rule as the per-update path, so params move the same way.
  loss_fn = lambda p, b: jnp.mean((b["x"] * p["w"].astype(jnp.float32)[None] - 1.0) ** 2)
  params = {"w": jnp.linspace(-1.0, 1.0, 8).astype(param_dtype)}
  batch = {"x": jnp.linspace(0.1, 2.0, 16).reshape(2, 8).repeat(2, axis=0)}
  tx = optax_adama.adama(1e-2, num_micro_batches=2, mu_dtype=mu_dtype)
  step = optax_adama.microbatch_step(loss_fn, tx)
  got, _, _ = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
  state, want = tx.init(params), params
  for i in range(2):
    g = jax.grad(loss_fn)(want, jax.tree.map(lambda x: x[i::2], batch))
    u, state = tx.update(g, state, want)
    with jax.numpy_dtype_promotion("standard"):
      want = optax.apply_updates(want, u)
  assert got["w"].dtype == jnp.dtype(param_dtype)
  np.testing.assert_allclose(np.asarray(got["w"], np.float32), np.asarray(want["w"], np.float32),
                             rtol=1e-6 if param_dtype == "float32" else 1e-2)


def test_python_float_params_step_as_optax_adam():
  tx = optax_adama.adama(0.1, num_micro_batches=1)
  updates, _ = tx.update(0.3, tx.init(1.0), 1.0)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
    want, _ = optax.adam(0.1).update(0.3, optax.adam(0.1).init(1.0), 1.0)
  np.testing.assert_allclose(updates, want, rtol=1e-6)


@pytest.mark.parametrize("mask", [None, {"w": True, "b": False}], ids=["all", "masked"])
def test_adamaw_with_float32_moments_on_bfloat16_params_under_strict_promotion(mask):
  # The mixed-precision setup of docs/usage.md: the float32 update plus the
  # bf16 param's weight decay, added in float32 (optax's implicit promotion
  # gives the same float32 sum; strict promotion has no implicit path).
  params = {"w": jnp.linspace(-1, 1, 8).reshape(4, 2).astype(jnp.bfloat16),
            "b": jnp.ones(2, jnp.bfloat16)}
  grads = jax.tree.map(lambda p: (0.3 * p + 0.1).astype(p.dtype), params)
  tx = optax_adama.adamaw(0.1, weight_decay=0.5, mask=mask, num_micro_batches=1,
                          mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  updates, _ = tx.update(grads, tx.init(params), params)
  with jax.numpy_dtype_promotion("standard"):
    ref = optax.adamw(0.1, weight_decay=0.5, mask=mask, mu_dtype=jnp.float32)
    want, _ = ref.update(grads, ref.init(params), params)
  for got, expected in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
    assert got.dtype == expected.dtype == jnp.float32
    # optax rounds weight_decay * param to bf16 before the float32 sum: at
    # most half a bf16 ulp of 0.5 (2**-9) times the decay's 0.5 apart.
    np.testing.assert_allclose(got, expected, atol=0.5 * 2**-9)


def test_injected_decay_rates_that_round_to_one_name_the_fix():
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  injected = optax_adama.inject_hyperparams(optax_adama.adamaw)
  with pytest.raises(ValueError, match=r"rounds to 1 in bfloat16.*hyperparam_dtype=jnp.float32"):
    injected(learning_rate=1e-3, num_micro_batches=2).init(params)
  tx = optax_adama.inject_hyperparams(optax_adama.adamaw, hyperparam_dtype=jnp.float32)(
      learning_rate=1e-3, num_micro_batches=2)
  state = tx.init(params)
  # optax's scale_by_learning_rate multiplies the bf16 update by the float32
  # rate by implicit promotion, as a user's (standard) promotion allows.
  with jax.numpy_dtype_promotion("standard"):
    for _ in range(2):
      updates, state = tx.update({"w": jnp.full(3, 0.5, jnp.bfloat16)}, state, params)
  # A first Adam step: -lr * sign(g), up to eps and bf16 rounding.
  np.testing.assert_allclose(updates["w"].astype(jnp.float32), -1e-3, rtol=2**-7)


def test_adamaw_weight_decay_may_be_a_schedule_as_in_optax():
  params = {"w": jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)}
  grads = {"w": 0.3 * params["w"] + 0.1}
  weight_decay = optax.linear_schedule(0.5, 0.0, transition_steps=4)
  tx = optax_adama.adamaw(0.1, weight_decay=weight_decay, num_micro_batches=1)
  state = tx.init(params)
  with jax.numpy_dtype_promotion("standard"):  # optax's schedule and bias correction
    ref = optax.adamw(0.1, weight_decay=weight_decay)
    ref_state = ref.init(params)
    for _ in range(3):  # the decay rate moves each step
      updates, state = tx.update(grads, state, params)
      want, ref_state = ref.update(grads, ref_state, params)
      np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("factory", ["adama", "adamaw", "scale_by_adama"])
@pytest.mark.parametrize("removed", [{"nu_estimator": "split"}, {"nu_estimator": "mean"},
                                     {"split_floor": False}])
def test_research_arguments_name_their_contrib_replacement(factory, removed):
  """The main transforms fold "mean" only; the estimators' arguments moved."""
  args = () if factory == "scale_by_adama" else (1e-3,)
  with pytest.raises(TypeError, match=rf"optax_adama\.contrib\.{factory}\("):
    getattr(optax_adama, factory)(*args, num_micro_batches=2, **removed)
  # The contrib versions take them, and their states are the main ones.
  tx = getattr(optax_adama.contrib, factory)(
      *args, num_micro_batches=2, nu_estimator=removed.get("nu_estimator", "split"),
      split_floor=removed.get("split_floor", True))
  assert isinstance(optax_adama.find_adama_state(tx.init({"w": jnp.ones(3)})),
                    optax_adama.ScaleByAdamAState)


def test_the_main_signatures_hold_no_research_arguments():
  # optax.inject_hyperparams reads the signature: it must be the clean one.
  for factory in (optax_adama.adama, optax_adama.adamaw, optax_adama.scale_by_adama):
    names = inspect.signature(factory).parameters
    assert "nu_estimator" not in names and "split_floor" not in names
  tx = optax.inject_hyperparams(optax_adama.adama, static_args=("num_micro_batches",))(
      learning_rate=1e-3, num_micro_batches=2)
  state = tx.init({"w": jnp.ones(3)})
  assert optax_adama.find_adama_state(state).nu_estimator == "mean"
