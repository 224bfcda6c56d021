"""AdamA as a plain Optax transformation against optax.adam and adamw."""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _adama_helpers import ATOL
from _adama_helpers import RTOL
from _adama_helpers import _adama_state
from _adama_helpers import _grads
from _adama_helpers import _params
from _adama_helpers import _run_adama
from _adama_helpers import _run_optax

import optax_adama


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
