"""AdamA under inject_hyperparams (optax's and ours) and schedules, under jax.jit and nnx.jit."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from _adama_helpers import RTOL

import optax_adama

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
