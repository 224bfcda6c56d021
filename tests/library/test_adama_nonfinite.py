"""AdamA's guard against non-finite gradients: dropped entries and dropped micro-batches."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _adama_helpers import _adama_state
from _adama_helpers import _grads
from _adama_helpers import _params

import optax_adama


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


def _mlp_loss(params, batch):
  hidden = jax.nn.relu(batch["x"] @ params["w1"])
  return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _mlp():
  rng = np.random.default_rng(0)
  params = {"w1": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32),
            "unused": jnp.ones((3,), jnp.float32)}
  batch = {"x": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)}
  return params, batch


def test_value_and_finite_grad_is_value_and_grad_where_the_loss_is_finite():
  from optax_adama import _steps

  params, batch = _mlp()
  expected = jax.jit(jax.value_and_grad(_mlp_loss))(params, batch)
  got = jax.jit(_steps.value_and_finite_grad(_mlp_loss))(params, batch)
  chex.assert_trees_all_equal(got, expected)  # bit for bit: the seed is exactly 1
  with_aux = lambda p, b: (_mlp_loss(p, b), {"twice": 2 * _mlp_loss(p, b)})
  (loss, aux), grads = _steps.value_and_finite_grad(with_aux, has_aux=True)(params, batch)
  chex.assert_trees_all_close((loss, grads), expected, rtol=1e-6)
  np.testing.assert_allclose(aux["twice"], 2 * loss, rtol=1e-6)


def test_value_and_finite_grad_poisons_every_reached_entry_of_a_nonfinite_loss():
  from optax_adama import _steps

  params, batch = _mlp()
  batch["y"] = batch["y"].at[0, 0].set(jnp.inf)
  loss, grads = jax.jit(_steps.value_and_finite_grad(_mlp_loss))(params, batch)
  assert not np.isfinite(loss)
  # Every entry the loss reached is NaN (jax.value_and_grad leaves some finite:
  # the squared error's own gradient is inf only on the bad row); an entry it
  # never reached is 0 where the seed gates (TPU, GPU) and NaN where a select
  # after the backward does (CPU), both folded as a dropped entry (b m).
  assert np.all(np.isnan(grads["w2"])) and np.all(np.isnan(grads["w1"]))
  unused = np.asarray(grads["unused"])
  assert np.all(np.isnan(unused) if jax.default_backend() == "cpu" else unused == 0), unused
  with pytest.raises(TypeError, match="real scalar"):
    _steps.value_and_finite_grad(lambda p, b: b["x"] @ p["w1"])(params, batch)
