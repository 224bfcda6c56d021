"""What a user gets without naming an estimator: "mean", on every path and shape.

"mean" (each g_i**2 / N: v never below Adam's in expectation, so no step
longer than Adam's) needs nothing from the step but the gradient, so the
fused, release and per-update paths all compute it, for micro-batches of any
size, at no memory beyond m and v. "auto" stays selectable: "split" wherever the
step hands over each micro-batch's half difference, "mean" wherever it
cannot. These tests pin each case to the estimator it must equal, bitwise
where the same program runs, and check that the state keeps its name.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_release
from conftest import MLP

import optax_adama
from optax_adama import _chain
from optax_adama import _fold

MODEL = MLP(num_layers=3, width=8)


def _run_fused(tx, batch_size, steps=3, num_micro_batches=4):
  step = optax_adama.microbatch_step(MODEL.loss, tx)
  params = MODEL.params()
  state = tx.init(params)
  for seed in range(steps):
    params, state, _ = step(params, state, MODEL.batch(seed, batch_size))
  return params, state


def _adamaw(nu_estimator=None, **options):
  """The default (``None``), or a named estimator from optax_adama.contrib."""
  if nu_estimator is None:
    return optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=4, **options)
  return optax_adama.contrib.adamaw(1e-2, weight_decay=0.1, num_micro_batches=4,
                                    nu_estimator=nu_estimator, **options)


def test_the_default_estimator_is_mean_everywhere():
  params = {"w": jnp.ones(3)}
  for make in (optax_adama.adama, optax_adama.adamaw):
    state = _chain.adama_of(make(1e-3, num_micro_batches=4).init(params))
    assert state.nu_estimator == "mean"
    assert state.nu_floor == ()  # no state beyond m and v
  assert optax_adama.scale_by_adama(num_micro_batches=4).init(params).nu_estimator == "mean"


# 4, 1 and 3 rows per micro-batch. 16 (where "auto" splits) keeps the smoke in
# the default run; "auto" takes its "mean" path at 4 and 12 in
# test_fused_auto_equals_the_estimator_its_micro_batches_allow, and the default
# at those sizes runs with the slow tests.
@pytest.mark.parametrize("batch_size", [
    16, pytest.param(4, marks=pytest.mark.slow), pytest.param(12, marks=pytest.mark.slow)])
def test_fused_default_is_mean_for_every_micro_batch_size(batch_size):
  params, state = _run_fused(_adamaw(), batch_size)
  ref_params, ref_state = _run_fused(_adamaw("mean"), batch_size)
  chex.assert_trees_all_equal(params, ref_params)  # the same program: bitwise
  chex.assert_trees_all_equal(_chain.adama_of(state).nu, _chain.adama_of(ref_state).nu)
  assert _chain.adama_of(state).nu_estimator == "mean"


def test_fused_estimators_without_halves_compile_to_the_default_s_memory():
  """No halves, no floor: "momentum"'s step holds what the default's ("mean") holds."""
  mlp = MLP(num_layers=3, width=256)  # P = 0.79 MB: fixed temporaries are noise
  batch = mlp.batch(0, 16)
  params = mlp.params()
  p = optax_adama.memory.tree_bytes(params)
  totals = {}
  for name in ("momentum", "mean", "auto"):
    tx = _adamaw(name)
    step = optax_adama.microbatch_step(mlp.loss, tx)
    totals[name] = optax_adama.memory_report(step, params, tx.init(params), batch).total_bytes
  # "momentum" adds (1 - 1/N) m_hat**2 on the last fold as a select (not a
  # branch, which stalls a GPU per leaf); where activations are this small
  # XLA keeps one layer's fold of m beside its update (_add_squared_momentum).
  # On GPT-2 small the two compile to the same bytes (docs/estimators.md).
  # Plus the update's scalars (its weight, the bias correction, the
  # completion predicate), each padded to XLA's 64-byte alignment.
  scalars = 16 * 64
  assert totals["momentum"] - totals["mean"] <= optax_adama.memory.tree_bytes(
      params["layer0"]) + scalars, totals
  # "auto" ("split") takes each micro-batch's halves' gradients: most of a P more.
  assert totals["auto"] - totals["mean"] > 0.5 * p, totals


@pytest.mark.parametrize("batch_size, same_as", [
    (16, "split"),  # 4 rows per micro-batch: two halves of 2.
    (4, "mean"),    # one example per micro-batch: no halves.
    (12, "mean"),   # 3 rows per micro-batch: no equal halves.
])
def test_fused_auto_equals_the_estimator_its_micro_batches_allow(batch_size, same_as):
  params, state = _run_fused(_adamaw("auto"), batch_size)
  ref_params, ref_state = _run_fused(_adamaw(same_as), batch_size)
  # The same program: bitwise.
  chex.assert_trees_all_equal(params, ref_params)
  chex.assert_trees_all_equal(_chain.adama_of(state).nu, _chain.adama_of(ref_state).nu)
  assert _chain.adama_of(state).nu_estimator == "auto"  # the name it came with


def test_fused_auto_differs_from_mean_where_it_splits():
  # Guards the test above against both runs silently taking one path.
  params, _ = _run_fused(_adamaw("auto"), 16)
  mean_params, _ = _run_fused(_adamaw("mean"), 16)
  assert not all(jax.tree.leaves(jax.tree.map(
      lambda a, b: bool(jnp.array_equal(a, b)), params, mean_params)))


def test_explicit_split_refuses_one_example_micro_batches_and_names_the_default():
  with pytest.raises(ValueError, match="Leave nu_estimator at its default"):
    _run_fused(_adamaw("split"), 4, steps=1)


@pytest.mark.parametrize("name, same_as", [(None, "mean"), ("auto", "mean")])
def test_per_update_path_bitwise(name, same_as):
  """One ``tx.update`` per micro-batch (nnx.Optimizer, optax.chain): the default
  is "mean" there too; "auto", given no halves, is "mean" as well."""
  params = MODEL.params()
  default, mean = _adamaw(name), _adamaw(same_as)
  s_default, s_mean = default.init(params), mean.init(params)
  p_default = p_mean = params
  for i in range(8):
    grads = jax.grad(MODEL.loss)(p_default, MODEL.batch(i, 3))
    u_default, s_default = default.update(grads, s_default, p_default)
    u_mean, s_mean = mean.update(grads, s_mean, p_mean)
    chex.assert_trees_all_equal(u_default, u_mean)
    p_default = p_mean = optax.apply_updates(p_default, u_default)
  assert _chain.adama_of(s_default).nu_estimator == (name or "mean")


def test_per_update_auto_takes_a_half_difference_when_given():
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  default = optax_adama.contrib.scale_by_adama(num_micro_batches=2, nu_estimator="auto")
  split = optax_adama.contrib.scale_by_adama(num_micro_batches=2, nu_estimator="split")
  s_default, s_split = default.init(params), split.init(params)
  for i in range(4):
    g = {"w": jnp.array([0.3, -1.0, 2.0]) * (i + 1)}
    d = {"w": jnp.array([0.5, 0.1, -0.2])}
    u_default, s_default = default.update(g, s_default, half_difference=d)
    u_split, s_split = split.update(g, s_split, half_difference=d)
    chex.assert_trees_all_equal(u_default, u_split)
  chex.assert_trees_all_equal(s_default.nu, s_split.nu)


@pytest.mark.parametrize("name, same_as", [(None, "mean"), ("auto", "split")])
def test_release_bitwise(name, same_as):
  staged = test_release.staged_loss()
  params = test_release.make_params()
  runs = {}
  for key in (name, same_as):
    tx = (optax_adama.adama(1e-2, num_micro_batches=2) if key is None else
          optax_adama.contrib.adama(1e-2, num_micro_batches=2, nu_estimator=key))
    step = optax_adama.release_step(staged, tx)
    p, s = jax.tree.map(jnp.array, params), tx.init(params)
    for seed in range(2):
      p, s, _ = step(p, s, test_release.make_batch(seed, size=8))
    runs[key] = (p, s)
  chex.assert_trees_all_equal(runs[name][0], runs[same_as][0])
  assert _chain.adama_of(runs[name][1]).nu_estimator == (name or "mean")


def test_eight_bit_moments_take_split_and_keep_a_negative_v():
  """8-bit v is stored as a signed root: "split"'s dips below zero survive."""
  quantization = optax_adama.BlockQuantization(block_size=64, min_size=64)
  tx = optax_adama.contrib.scale_by_adama(num_micro_batches=2, nu_estimator="split",
                                  quantization=quantization, b2=0.5,
                                  stochastic_rounding=False)
  params = {"w": jnp.zeros(256)}
  state = tx.init(params)
  # Half differences larger than the gradient: the fold of v goes negative.
  g = {"w": jnp.linspace(-1.0, 1.0, 256)}
  d = {"w": jnp.full(256, 3.0)}
  dense = optax_adama.contrib.scale_by_adama(num_micro_batches=2, nu_estimator="split", b2=0.5)
  dense_state = dense.init(params)
  for _ in range(2):
    _, state = tx.update(g, state, half_difference=d)
    _, dense_state = dense.update(g, dense_state, half_difference=d)
  v = _fold.load(state.nu["w"], 2).reshape(-1)[:256]
  assert float(jnp.max(dense_state.nu["w"])) < 0  # every coordinate dipped
  # float8 e4m3 keeps 3 mantissa bits of the root: rounded to nearest, at
  # most 2**-4 relative on the root, (1 + 2**-4)**2 - 1 = 0.129 on v.
  np.testing.assert_allclose(v, dense_state.nu["w"], rtol=0.13)


def test_eight_bit_default_trains_like_float32_default():
  quantization = optax_adama.BlockQuantization(block_size=32, min_size=32)
  mlp = MLP(num_layers=3, width=16)
  losses = {}
  for name, options in (("f32", {}), ("8bit", {"quantization": quantization})):
    tx = optax_adama.adamaw(3e-3, weight_decay=0.0, num_micro_batches=2, **options)
    step = optax_adama.microbatch_step(mlp.loss, tx)
    params = mlp.params()
    state = tx.init(params)
    for i in range(200):
      params, state, metrics = step(params, state, mlp.batch(i % 20, 8))
    losses[name] = float(metrics["loss"])
  assert _chain.adama_of(state).nu_estimator == "mean"
  # 8-bit moments round m and sqrt(v) to 3 mantissa bits per block; over 200
  # steps on this MLP the loss lands within 10% of the float32 run's.
  assert abs(losses["8bit"] - losses["f32"]) <= 0.1 * losses["f32"], losses
