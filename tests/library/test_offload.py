"""Host-offloaded optimizer state: placement, equal results, compiled bytes."""

import chex
import jax
import jax.numpy as jnp
import pytest
from conftest import MLP

import optax_adama

MODEL = MLP(num_layers=3, width=16)  # 256-element kernels, 16-element biases
MIN_SIZE = 64  # the kernels' moments are offloaded, the biases' and counters stay


def _adama(quantized=False, low_rank=False):
  quantization = (optax_adama.BlockQuantization(block_size=64, min_size=64)
                  if quantized else None)
  tx = optax_adama.adama(1e-2, num_micro_batches=2, quantization=quantization)
  if low_rank:
    tx = optax_adama.low_rank(tx, rank=4, refresh_period=2, min_size=0)
  return tx


def _memory_kinds(tree):
  return {jax.tree_util.keystr(path): leaf.sharding.memory_kind
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


# float32 and 8-bit low-rank moments in the default suite; full-rank 8-bit
# moments (the slowest to compile here) with the slow tests.
@pytest.mark.parametrize("quantized,low_rank", [
    (False, False), pytest.param(True, False, marks=pytest.mark.slow), (True, True)],
    ids=["float32", "8bit", "8bit_lowrank"])
def test_offloaded_step_equals_on_device_step(quantized, low_rank):
  on_device = _adama(quantized, low_rank)
  offloaded = optax_adama.offload_moments(_adama(quantized, low_rank), min_size=MIN_SIZE)
  params = MODEL.params()
  results = []
  for tx in (on_device, offloaded):
    step = optax_adama.microbatch_step(MODEL.loss, tx)
    p, state = jax.tree.map(jnp.array, params), tx.init(params)
    for seed in range(3):
      p, state, _ = step(p, state, MODEL.batch(seed, 8))
    results.append((p, state))
  (p_dev, s_dev), (p_off, s_off) = results
  # The same program; the transfers are copies, so the results are equal bit
  # for bit (the stochastic rounding seeds do not depend on placement).
  chex.assert_trees_all_equal(p_off, p_dev)
  chex.assert_trees_all_equal(jax.device_get(s_off), jax.device_get(s_dev))
  # After the steps the large state leaves are still in host memory.
  kinds = _memory_kinds(s_off)
  large = {k for k, x in zip(kinds, jax.tree.leaves(s_off)) if x.size >= MIN_SIZE}
  assert large and all(kinds[k] == "pinned_host" for k in large)
  assert all(kinds[k] == "device" for k in set(kinds) - large)


def test_init_places_large_leaves_in_host_memory():
  tx = optax_adama.offload_moments(_adama(), min_size=MIN_SIZE)
  state = tx.init(MODEL.params())
  mu = optax_adama.find_adama_state(state).mu
  assert mu["layer0"]["w"].sharding.memory_kind == "pinned_host"
  assert mu["layer0"]["b"].sharding.memory_kind == "device"
  assert optax_adama.find_adama_state(state).count.sharding.memory_kind == "device"
  # Host bytes: the kernels' m and v (the default estimator keeps no more), float32.
  assert optax_adama.moments.host_state_bytes(state, min_size=MIN_SIZE) == 3 * 2 * 256 * 4


def test_compiled_step_keeps_the_state_in_host_memory():
  tx = optax_adama.offload_moments(_adama(), min_size=MIN_SIZE)
  params = MODEL.abstract_params()
  step = optax_adama.microbatch_step(MODEL.loss, tx)
  shapes = optax_adama.moments.offloaded_state_shapes(
      jax.eval_shape(tx.init, params), min_size=MIN_SIZE)
  lowered = step.lower(params, shapes, MODEL.abstract_batch(8))
  text = lowered.as_text()
  # Six kernel moments in, as many out, each in host memory.
  assert text.count('mhlo.memory_kind = "pinned_host"') == 12
  compiled = lowered.compile()
  on_device = optax_adama.microbatch_step(MODEL.loss, _adama()).lower(
      params, jax.eval_shape(_adama().init, params), MODEL.abstract_batch(8)).compile()
  host = optax_adama.moments.host_state_bytes(shapes, min_size=MIN_SIZE)
  analysis = compiled.memory_analysis()
  total = optax_adama.memory_report(compiled, param_bytes=1).total_bytes
  if analysis.host_argument_size_in_bytes:  # a backend that counts host memory apart
    assert analysis.host_argument_size_in_bytes == host
  else:  # CPU: host arrays are counted as device arrays; the bytes are the same.
    device_total = optax_adama.memory_report(on_device, param_bytes=1).total_bytes
    assert total == device_total
