"""AdamA in Flax training loops: nnx.Optimizer and a Linen TrainState.

Both call ``update`` once per micro-batch, the MultiSteps contract; both must
land on the same parameters as the fused ``microbatch_step``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import update_with_halves
from flax import linen
from flax import nnx
from flax.training import train_state

import models
import optax_adama
from models import data

NUM_MICRO, BATCH, SEQ = 2, 8, 16


def _batches(num_steps):
  text = data.load_stdlib_text(max_bytes=60_000)
  stream = data.lm_batches(text.train, batch_size=BATCH, seq_len=SEQ, seed=0)
  return [jax.tree.map(jnp.asarray, next(stream)) for _ in range(num_steps)]


def _micro(batch, i):
  return jax.tree.map(lambda x: x[i::NUM_MICRO], batch)  # microbatch_step's order


def _fused(loss_fn, params, tx, batches):
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO)
  state = tx.init(params)
  params = jax.tree.map(jnp.array, params)
  for batch in batches:
    params, state, _ = step(params, state, batch)
  return params


def _without_key_bias(state):
  """Params less the attention key bias: softmax is shift invariant, so its
  true gradient is 0 and Adam normalises rounding noise into lr-sized steps
  that differ between any two programs. It cannot change the output."""
  state = nnx.to_pure_dict(state)
  for block in state["blocks"].values():
    bias = block["attention"]["qkv"]["bias"]
    hidden = bias.shape[0] // 3
    block["attention"]["qkv"]["bias"] = bias.at[hidden:2 * hidden].set(0.0)
  return jax.tree.leaves(state)


def _assert_same_model(model, want, batches, atol=1e-6):
  # Same math, different XLA fusion: float32 rounding over 3 steps. The key
  # bias is compared through the logits.
  got = nnx.state(model, nnx.Param)
  chex.assert_trees_all_close(
      _without_key_bias(got), _without_key_bias(want), rtol=1e-5, atol=atol)
  tokens = batches[0]["tokens"][:, :-1]
  fused_model = models.create("gpt_test", rngs=nnx.Rngs(0))
  nnx.update(fused_model, want)
  chex.assert_trees_all_close(model(tokens), fused_model(tokens), rtol=1e-4, atol=1e-5)


# On a GPT, all three with the slow tests (39 s for "mean" on 2 busy cores).
# Each keeps its smoke on an MLP in tests/library/test_nnx_entry.py: nnx.Optimizer per
# micro-batch against the MicroBatchOptimizer
# (test_matches_nnx_optimizer_per_micro_batch, "split"'s halves'
# half_difference included), and that against microbatch_step
# (test_matches_microbatch_step_on_nnx_split).
@pytest.mark.parametrize("nu_estimator", [
    pytest.param("mean", marks=pytest.mark.slow), pytest.param("momentum", marks=pytest.mark.slow),
    pytest.param("split", marks=pytest.mark.slow)])
def test_nnx_optimizer_matches_microbatch_step(nu_estimator):
  tx = optax_adama.contrib.adamaw(3e-3, weight_decay=0.1, num_micro_batches=NUM_MICRO,
                          nu_estimator=nu_estimator)
  batches = _batches(3)
  model = models.create("gpt_test", rngs=nnx.Rngs(0))
  loss_fn, params = models.split_loss_fn(model)
  want = _fused(loss_fn, params, tx, batches)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  grad = lambda model, rows: nnx.grad(lambda m: m.loss(rows)[0])(model)

  @nnx.jit
  def train_micro_batch(model, optimizer, micro_batch):
    if nu_estimator != "split":
      optimizer.update(model, grad(model, micro_batch))
      return
    update_with_halves(optimizer, model, grad, micro_batch)

  for batch in batches:
    for i in range(NUM_MICRO):
      train_micro_batch(model, optimizer, _micro(batch, i))
  # "split"'s v is a difference of squares: where it nearly cancels, the
  # rounding of g and d is amplified in the step (13 of 49k entries moved
  # 1.5e-6 apart). Compared at 1% of one step (lr 3e-3).
  _assert_same_model(model, want, batches, atol=3e-5 if nu_estimator == "split" else 1e-6)


class _MLP(linen.Module):
  @linen.compact
  def __call__(self, x):
    x = linen.tanh(linen.Dense(16)(x))
    return linen.Dense(1)(x)


def test_linen_train_state_matches_microbatch_step():
  # Both sides name the estimator they share ("mean": one update per
  # micro-batch, no halves and no per-mini-batch term).
  tx = optax_adama.adama(1e-2, num_micro_batches=NUM_MICRO)
  module = _MLP()
  x = np.linspace(-1, 1, 4 * BATCH, dtype=np.float32).reshape(-1, 4)
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(np.sin(x.sum(1, keepdims=True)))}
  params = module.init(jax.random.key(0), batch["x"][:1])["params"]

  def loss_fn(params, micro_batch):
    pred = module.apply({"params": params}, micro_batch["x"])
    return jnp.mean((pred - micro_batch["y"]) ** 2)

  want = _fused(loss_fn, params, tx, [batch] * 4)
  state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)
  for _ in range(4):
    for i in range(NUM_MICRO):
      grads = jax.grad(loss_fn)(state.params, _micro(batch, i))
      state = state.apply_gradients(grads=grads)
  chex.assert_trees_all_close(state.params, want, rtol=1e-5, atol=1e-6)
  # TrainState.step counts update calls (micro-batches); AdamA counts mini-batches.
  assert int(state.step) == 4 * NUM_MICRO
  assert int(optax_adama.find_adama_state(state.opt_state).count) == 4


def test_nnx_optimizer_moments_carry_the_params_sharding_names():
  # Flax's own optimizer test, with AdamA in Adam's place: a kernel annotated
  # with nnx.with_partitioning gives m and v the same logical axes, so
  # nnx.get_partition_spec shards the moments as the params.
  mesh = jax.make_mesh((1, 1), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    model = nnx.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), sharding=("a", "b")))
    optimizer = nnx.Optimizer(model, optax_adama.adamaw(0.1, num_micro_batches=2),
                              wrt=nnx.Param)
  adama_state = nnx.state(optimizer)["opt_state"]["adama"]
  specs = nnx.get_partition_spec(nnx.state(optimizer))["opt_state"]["adama"]
  for moment in ("mu", "nu"):
    assert adama_state[moment]["kernel"].out_sharding == ("a", "b")
    assert specs[moment]["kernel"].get_value() == jax.sharding.PartitionSpec("a", "b")


class _EveryVariableKind(nnx.Module):
  """One Variable of each kind ``nnx.split(model)`` hands over with no filter."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)      # RngKey (key<fry>), RngCount (uint32)
    self.norm = nnx.BatchNorm(4, rngs=rngs)         # BatchStat (float32)
    self.cache = nnx.Cache(jnp.zeros((2, 4)))       # a float cache
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
    self.hidden = nnx.Intermediate((jnp.zeros((2, 4)),))  # as a sow leaves it

  def __call__(self, x):
    return self.norm(self.dropout(self.linear(x)))


def _split_every_kind():
  model = _EveryVariableKind(rngs=nnx.Rngs(0, dropout=1))
  model(jnp.ones((2, 4)))
  return nnx.split(model, nnx.Param, nnx.RngKey, nnx.RngCount, nnx.BatchStat,
                   nnx.Cache, nnx.Intermediate)


@pytest.mark.parametrize("kind", ["RngKey", "RngCount", "Cache index"])
def test_init_names_a_non_float_flax_leaf_instead_of_crashing(kind):
  """A Dropout's key (key<fry>) crashed ``jnp.dtype`` in the leaf check."""
  _, params, key, count, _, cache, _ = _split_every_kind()
  tree = {"RngKey": key, "RngCount": count,
          "Cache index": nnx.State({"cache_index": cache["cache_index"]})}[kind]
  expected = {"RngKey": r"key<fry>", "RngCount": r"uint32", "Cache index": r"int32"}[kind]
  for init in (lambda t: optax_adama.adamaw(1e-3, num_micro_batches=2).init(t),
               lambda t: optax_adama.adama(1e-3, num_micro_batches=2).init(t)):
    with pytest.raises(TypeError, match=rf"would never move: .*\({expected}\).*nnx\.Param"):
      init({"params": params, "other": tree})


def test_memory_plan_names_the_key_leaf_of_an_unfiltered_split():
  model = _EveryVariableKind(rngs=nnx.Rngs(0, dropout=1))
  model(jnp.ones((2, 4)))
  graphdef, state = nnx.split(model)  # no filter: docs/fit.md's pattern

  def loss_fn(state, batch):
    return jnp.mean(nnx.merge(graphdef, state)(batch["x"]) ** 2)

  batch = {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
  with pytest.raises(TypeError, match=r"would never move: .*key<fry>"):
    optax_adama.memory.plan(loss_fn, state, batch, budget_bytes=16e6)


@pytest.mark.parametrize("kind", ["BatchStat", "Cache", "Intermediate"])
def test_float_flax_state_is_accepted_as_optax_accepts_it(kind):
  """Float Variables move as ``optax.adamw`` would move them; AdamA at N = 1 is Adam."""
  _, params, _, _, stats, cache, intermediate = _split_every_kind()
  tree = {"BatchStat": stats, "Cache": nnx.State({"cache": cache["cache"]}),
          "Intermediate": intermediate}[kind]
  tree = {"params": params, "other": tree}
  tx, reference = optax_adama.adamaw(1e-2, num_micro_batches=1), optax.adamw(1e-2)
  grads = jax.tree.map(jnp.ones_like, tree)
  updates, _ = tx.update(grads, tx.init(tree), tree)
  with jax.numpy_dtype_promotion("standard"):  # optax's own code needs it
    expected, _ = reference.update(grads, reference.init(tree), tree)
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)


def test_dropout_closed_over_by_a_plain_loss_names_micro_batch_optimizer():
  """``microbatch_step`` on a loss that merges a Dropout's closed-over RngCount
  fails in Flax (``TraceContextError``); the error says what to use instead."""
  model = _EveryVariableKind(rngs=nnx.Rngs(0, dropout=1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, batch):
    return jnp.mean(nnx.merge(graphdef, params, rest)(batch["x"]) ** 2)

  tx = optax_adama.adamaw(1e-3, num_micro_batches=2)
  step = optax_adama.microbatch_step(loss_fn, tx)
  with pytest.raises(Exception, match=r"Cannot mutate RngCount") as raised:
    step(params, tx.init(params), {"x": jnp.ones((4, 4))})
  assert "MicroBatchOptimizer(model, tx, wrt=nnx.Param)" in "".join(
      getattr(raised.value, "__notes__", []))
