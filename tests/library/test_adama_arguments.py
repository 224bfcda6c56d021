"""AdamA's argument checks: N, hyperparameters, param dtypes, estimators, research arguments."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adama


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


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8])
def test_integer_and_bool_params_raise_naming_the_leaf(dtype):
  params = {"dense": {"w": jnp.ones(3), "step": jnp.zeros(2, dtype)}}
  for tx in (optax_adama.scale_by_adama(num_micro_batches=2),
             optax_adama.adamaw(0.1, num_micro_batches=2)):
    with pytest.raises(TypeError, match=r"\['dense'\]\['step'\] \((int32|bool|uint8)\)"):
      tx.init(params)


def test_nu_estimator_is_checked():
  with pytest.raises(ValueError, match="nu_estimator must be one of .* got 'median'"):
    optax_adama.contrib.adama(0.1, num_micro_batches=2, nu_estimator="median")


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
