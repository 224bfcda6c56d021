"""AdamA's state: static fields, optax.tree lookups, Flax state dicts, an orbax round trip."""

import copy
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _adama_helpers import _grads
from _adama_helpers import _params

import optax_adama


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
