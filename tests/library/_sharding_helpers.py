"""Helpers of the test_sharding*.py modules: the test MLP and its steps, collectives, diffs."""

import re

import jax
import numpy as np
from conftest import MLP

import optax_adama

NUM_DEVICES = 8
NUM_LAYERS, WIDTH, BATCH, NUM_MICRO = 3, 64, 64, 4
STAGES = (None, "zero1", "zero2", "fsdp")


MODEL = MLP(num_layers=NUM_LAYERS, width=WIDTH)
_params = MODEL.params
loss_fn = MODEL.loss


def _batch(seed, size=BATCH):
  return MODEL.batch(100 + seed, size)


def _collectives(hlo_text):
  """{collective kind: [result shapes]} of a compiled HLO module."""
  found = {}
  pattern = (r"= (.+?) (all-reduce|reduce-scatter|all-gather|all-to-all|"
             r"collective-permute)(?:-start)?\(")
  for line in hlo_text.splitlines():
    match = re.search(pattern, line)
    if match:
      found.setdefault(match.group(2), []).append(match.group(1))
  return found


def _largest_operand(shapes):
  """Elements of the largest array in a list of HLO result shapes (tuples too)."""
  sizes = [0]
  for shape in shapes:
    for dims in re.findall(r"\w+\[([\d,]*)\]", shape):
      sizes.append(int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
  return max(sizes)


def _run(tx, params, steps=3, batch_size=BATCH, **step_kwargs):
  step = optax_adama.microbatch_step(
      loss_fn, tx, num_micro_batches=NUM_MICRO, **step_kwargs)
  state = tx.init(params)
  mesh = step_kwargs.get("mesh")
  if mesh is not None:
    shardings = optax_adama.sharding.step_shardings(
        params, state, mesh, shard_states=step_kwargs.get("shard_states"))
    params = jax.device_put(params, shardings.params)
    state = jax.device_put(state, shardings.opt_state)
  compiled = step.lower(params, state, _batch(0, batch_size)).compile()
  for seed in range(steps):
    params, state, metrics = step(params, state, _batch(seed, batch_size))
  return params, state, metrics, compiled


# The differences are taken in NumPy on the host: eager jnp ops on arrays
# placed over 8 devices compile once per leaf's shape and sharding (7 of the
# subprocess's 65 s on 2 cores).
def _leaf_pairs(a, b):
  as_float32 = lambda tree: [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
  return zip(as_float32(a), as_float32(b))


def _max_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in _leaf_pairs(a, b))


def _max_relative_diff(a, b):
  """max |a - b| / max |b|, the worst leaf: for moments whose scales differ."""
  return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in _leaf_pairs(a, b))


def _assert_split_close(run):
  """"split" on a mesh against one device after two steps: its moments to
  float32 rounding, its params within 2% of a step (lr 1e-2).

  Its v is g**2 - (1 - 1/N) d**2, which nearly cancels where noise dominates;
  there the rounding of another summation order (1e-12 in a v of 1e-7) moves
  the direction m_hat / sqrt(v_hat) by about 1% of a step on a handful of
  entries (measured after two steps: params 1.1e-4 apart on the MLP here,
  6.5e-5 on 35 of 32,768 entries of the release's stack; moments 4e-7 of
  their largest entry). From the third step those params' gradients differ
  too and the moments drift apart (6e-5 relative), so two steps are compared.
  """
  assert run["moment_relative_diff"] < 1e-5, run
  assert run["param_diff"] < 2e-4, run


def _num_release_layers():
  import test_release  # pylint: disable=g-import-not-at-top
  return test_release.NUM_LAYERS
