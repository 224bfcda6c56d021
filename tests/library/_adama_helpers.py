"""Helpers of the test_adama_*.py modules: tolerances, a small tree, its gradients, step loops."""

import jax
import jax.numpy as jnp
import optax

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
