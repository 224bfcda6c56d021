"""optax's own optimizer checks (``optax/_src/alias_test.py``) with AdamA in Adam's place.

optax runs every alias on a parabola and on Rosenbrock's function, in real and
complex arithmetic, checks that ``update`` compiles once, that updates keep the
gradients' dtype, and that a state passed through ``lax.cond`` keeps its
structure and dtypes. AdamA is called here as optax calls ``adam``: one
``update`` per gradient, so with ``N > 1`` every call is a micro-batch and the
params move every N-th call.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_adama

# optax's own settings for adam in alias_test.py: rate 0.1, 10,000 update calls,
# params within 3e-2 of the optimum.
_RATE = 0.1
_CALLS = 10_000
_TOLERANCE = 3e-2


def _parabola(dtype):
  start = jnp.array([-1.0, 10.0, 1.0], dtype)
  optimum = jnp.array([1.0, -1.0, 1.0], dtype)
  if jnp.iscomplexobj(start):
    optimum = optimum * (1 + 1j)
  return start, optimum, lambda x: jnp.sum(jnp.abs(x - optimum) ** 2)


def _rosenbrock(dtype):
  a = 1.0 + 1.0j if jnp.issubdtype(dtype, jnp.complexfloating) else 1.0
  start = jnp.zeros(2, dtype)
  optimum = jnp.array([a, a * a], dtype)

  def objective(x):
    return jnp.abs(a - x[0]) ** 2 + 100.0 * jnp.abs(x[1] - x[0] ** 2) ** 2

  return start, optimum, objective


_FACTORIES = {"adama": optax_adama.adama, "adamaw": optax_adama.adamaw}


def _step_fn(tx, objective, traces):
  @jax.jit
  def step(params, state):
    traces.append(None)  # runs once per trace, not per call
    grads = jax.grad(objective)(params)
    # optax's convention: a complex gradient is conjugated before it is applied.
    grads = jax.tree.map(jnp.conj, grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64])
@pytest.mark.parametrize("target", [_parabola, _rosenbrock])
# N = 1 is optax.adam itself (tests/library/test_adama.py checks it value for value).
@pytest.mark.parametrize("num_micro_batches", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_reaches_the_optimum_as_optax_adam_does(name, num_micro_batches, target, dtype):
  tx = _FACTORIES[name](_RATE, num_micro_batches=num_micro_batches)
  params, optimum, objective = target(dtype)
  state = optax.tree.map_params(tx, lambda p: p, tx.init(params))  # a no-op map works
  traces = []
  step = _step_fn(tx, objective, traces)
  for _ in range(_CALLS):
    params, state = step(params, state)
  assert len(traces) == 1, "update recompiled on a later call"
  assert params.dtype == jnp.dtype(dtype)
  assert jnp.allclose(params, optimum, rtol=_TOLERANCE, atol=_TOLERANCE), (params, optimum)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64])
@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_state_keeps_its_structure_and_dtypes_through_lax_cond(name, dtype):
  # optax's test_state_shape_dtype_shard_stability: both branches of a cond must
  # agree, so an update that changed a dtype or a static field would not trace.
  tx = _FACTORIES[name](_RATE, num_micro_batches=2)
  params, _, objective = _parabola(dtype)

  @jax.jit
  def step(params, state, take):
    grads = jax.tree.map(jnp.conj, jax.grad(objective)(params))
    updates, state = jax.lax.cond(take, lambda: tx.update(grads, state, params),
                                  lambda: (jnp.zeros_like(params), state))
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for take in (True, False, True):
    params, new_state = step(params, state, take)
    assert params.dtype == jnp.dtype(dtype)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert ([x.dtype for x in jax.tree.leaves(new_state)]
            == [x.dtype for x in jax.tree.leaves(state)])
    state = new_state


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_wraps_in_optax_multisteps_as_optax_adam_does(dtype):
  # optax's test_gradient_accumulation: MultiSteps' cond takes AdamA's update
  # only if its dtype is the gradients'. MultiSteps itself needs standard
  # promotion (int / float).
  tx = optax.MultiSteps(optax_adama.adama(_RATE, num_micro_batches=1), every_k_schedule=4)
  params = jnp.array([1.0, 2.0], dtype)
  grads = jax.grad(lambda x: jnp.sum(x * x))(params)
  with jax.numpy_dtype_promotion("standard"):
    updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
  assert updates.dtype == grads.dtype
