"""optax_adama.nnx: the fused step for an nnx.Module, nnx.Optimizer-style.

MicroBatchOptimizer must train as `microbatch_step` on `nnx.split` by hand
does, as `nnx.Optimizer` stepped once per micro-batch does (the "mean"
estimator), and handle the state `microbatch_step` cannot see: dropout
streams, batch statistics, filtered params, donated buffers.
"""

import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import update_with_halves
from flax import nnx

import optax_adama
from optax_adama import nnx as adama_nnx

ROOT = pathlib.Path(__file__).resolve().parents[2]
N, BATCH, WIDTH = 2, 8, 4


class MLP(nnx.Module):
  """Linear, tanh, optional BatchNorm and Dropout, Linear."""

  def __init__(self, *, rngs, dropout=0.0, batch_norm=False):
    self.hidden = nnx.Linear(WIDTH, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs) if batch_norm else None
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    x = jnp.tanh(self.hidden(x))
    if self.norm is not None:
      x = self.norm(x)
    return self.head(self.dropout(x))


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def loss_with_aux(model, batch):
  loss = loss_fn(model, batch)
  return loss, loss


def _batch(seed, size=BATCH):
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (size, WIDTH)), "y": jax.random.normal(ky, (size, 1))}


def _micro(batch, i):
  return jax.tree.map(lambda x: x[i::N], batch)  # microbatch_step's order


def _copy(model):
  """A copy with its own buffers: nnx.clone's shares them, and steps donate them."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def _params(model):
  return jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("nu_estimator", ["mean", "split"])
def test_matches_microbatch_step_on_nnx_split(nu_estimator):
  tx = optax_adama.contrib.adamaw(1e-2, num_micro_batches=N, nu_estimator=nu_estimator)
  batches = [_batch(seed) for seed in range(2)]
  model = MLP(rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(_copy(model), nnx.Param, ...)
  step = optax_adama.microbatch_step(
      lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b), tx)
  state = tx.init(params)
  for batch in batches:
    params, state, want = step(params, state, batch)

  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)
  for batch in batches:
    metrics = opt.update(model, loss_fn, batch)
  # The same program but for the row-index leaf and the statistics' plumbing,
  # which the model does not read: bitwise the same.
  chex.assert_trees_all_equal(_params(model), nnx.to_pure_dict(params))
  chex.assert_trees_all_equal(jax.tree.leaves(opt.opt_state), jax.tree.leaves(state))
  chex.assert_trees_all_equal(metrics, want)


@pytest.mark.parametrize("nu_estimator", ["mean", "momentum", "split"])
def test_matches_nnx_optimizer_per_micro_batch(nu_estimator):
  tx = optax_adama.contrib.adamaw(1e-2, weight_decay=0.1, num_micro_batches=N,
                          nu_estimator=nu_estimator)
  batches = [_batch(seed) for seed in range(2)]
  model = MLP(rngs=nnx.Rngs(0))
  reference = _copy(model)
  per_update = nnx.Optimizer(reference, tx, wrt=nnx.Param)

  @nnx.jit
  def train_micro_batch(model, opt, micro_batch):
    if nu_estimator != "split":
      opt.update(model, nnx.grad(loss_fn)(model, micro_batch))
      return
    update_with_halves(opt, model, nnx.grad(loss_fn), micro_batch)

  for batch in batches:
    for i in range(N):
      train_micro_batch(reference, per_update, _micro(batch, i))

  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)
  for batch in batches:
    opt.update(model, loss_fn, batch)
  chex.assert_trees_all_close(_params(model), _params(reference), rtol=1e-5, atol=1e-6)
  assert int(opt.step[...]) == 2 and int(per_update.step[...]) == 2 * N


def test_dropout_draws_new_masks_per_micro_batch_and_per_step():
  # Rows 2k and 2k + 1 are equal, so both micro-batches hold the same examples;
  # a zero learning rate keeps the params, so only the masks can move the loss.
  batch = jax.tree.map(lambda x: jnp.repeat(x, N, axis=0), _batch(0, BATCH // N))
  chex.assert_trees_all_equal(_micro(batch, 0), _micro(batch, 1))
  model = MLP(rngs=nnx.Rngs(0, dropout=1), dropout=0.5)
  opt = adama_nnx.MicroBatchOptimizer(
      model, optax_adama.adamaw(0.0, num_micro_batches=N), wrt=nnx.Param)
  first = opt.update(model, loss_with_aux, batch, has_aux=True)["aux"]
  second = opt.update(model, loss_with_aux, batch, has_aux=True)["aux"]
  assert first.shape == (N,)
  assert len({*first.tolist(), *second.tolist()}) == 2 * N, (first, second)
  assert int(model.dropout.rngs.count[...]) == 2  # one per step


def test_split_estimator_halves_draw_different_masks():
  # aux is dropout applied to ones, the same input in both halves: values 0 or
  # 2, averaged over the halves by "split", so 1.0 where the halves' masks differ.
  model = MLP(rngs=nnx.Rngs(0, dropout=1), dropout=0.5)
  tx = optax_adama.contrib.adamaw(1e-2, num_micro_batches=N, nu_estimator="split")
  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)

  def mask_aux(model, batch):
    return loss_fn(model, batch), model.dropout(jnp.ones((batch["x"].shape[0], 8)))

  aux = opt.update(model, mask_aux, _batch(0), has_aux=True)["aux"]
  assert aux.shape == (N, BATCH // N // 2, 8)
  assert jnp.any(aux == 1.0), aux


def test_batch_stats_are_the_mean_of_the_micro_batches_updates():
  model = MLP(rngs=nnx.Rngs(0), batch_norm=True)
  batch = _batch(0)
  updated = []
  for i in range(N):
    copy = _copy(model)
    loss_fn(copy, _micro(batch, i))
    updated.append(nnx.to_pure_dict(nnx.state(copy, nnx.BatchStat)))
  want = jax.tree.map(lambda *xs: sum(xs) / N, *updated)
  before = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))

  tx = optax_adama.adamaw(1e-2, num_micro_batches=N)
  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)
  opt.update(model, loss_fn, batch)
  got = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  assert not jnp.allclose(got["norm"]["mean"], before["norm"]["mean"])

  # A micro-batch with a non-finite loss is dropped, and so are its statistics.
  copy = _copy(model)
  loss_fn(copy, _micro(batch, 0))
  want = nnx.to_pure_dict(nnx.state(copy, nnx.BatchStat))
  poisoned = {"x": batch["x"].at[1].set(jnp.nan), "y": batch["y"]}  # row 1: micro-batch 1
  metrics = opt.update(model, loss_fn, poisoned)
  assert int(metrics["num_dropped"]) == 1
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), want,
                              rtol=1e-6, atol=1e-7)


def test_wrt_filter_leaves_the_other_params_unchanged():
  model = MLP(rngs=nnx.Rngs(0))
  before = _params(model)
  opt = adama_nnx.MicroBatchOptimizer(
      model, optax_adama.adamaw(1e-2, num_micro_batches=N),
      wrt=nnx.All(nnx.Param, nnx.PathContains("head")))
  opt.update(model, loss_fn, _batch(0))
  after = _params(model)
  chex.assert_trees_all_equal(after["hidden"], before["hidden"])
  assert not jnp.allclose(after["head"]["kernel"], before["head"]["kernel"])
  assert set(optax_adama.find_adama_state(opt.opt_state).mu) == {"head"}


def test_donates_buffers_yet_the_model_stays_readable_and_the_step_is_reused():
  model = MLP(rngs=nnx.Rngs(0))
  opt = adama_nnx.MicroBatchOptimizer(
      model, optax_adama.adamaw(1e-2, num_micro_batches=N), wrt=nnx.Param)
  traces = []

  def counted_loss(model, batch):
    traces.append(1)
    return loss_fn(model, batch)

  taken = model.head.kernel[...]
  opt.update(model, counted_loss, _batch(0))
  assert taken.is_deleted()  # donated; the Variable holds the step's output
  num_traces = len(traces)
  opt.update(model, counted_loss, _batch(1))
  assert len(traces) == num_traces  # compiled once, reused
  assert jnp.all(jnp.isfinite(model.head.kernel[...]))
  assert jnp.all(jnp.isfinite(model(_batch(2)["x"])))
  assert int(opt.step[...]) == 2


def test_a_non_adama_transformation_accumulates_gradients():
  model = MLP(rngs=nnx.Rngs(0))
  reference = _copy(model)
  graphdef, params, rest = nnx.split(reference, nnx.Param, ...)
  tx = optax.sgd(0.1)
  step = optax_adama.microbatch_step(
      lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b), tx, num_micro_batches=N)
  params, _, _ = step(params, tx.init(params), _batch(0))
  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param, num_micro_batches=N)
  opt.update(model, loss_fn, _batch(0))
  chex.assert_trees_all_close(_params(model), nnx.to_pure_dict(params), rtol=1e-6, atol=1e-7)


def test_the_optimizer_state_checkpoints_with_orbax(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  model = MLP(rngs=nnx.Rngs(0))
  tx = optax_adama.adamaw(1e-2, num_micro_batches=N)
  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)
  opt.update(model, loss_fn, _batch(0))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "run", {"model": nnx.state(model), "opt": nnx.state(opt)})
  checkpointer.wait_until_finished()
  opt.update(model, loss_fn, _batch(1))
  want = _params(model)

  # A new process: fresh model and optimizer, restored, one step on.
  model = MLP(rngs=nnx.Rngs(7))
  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)
  abstract = jax.eval_shape(lambda: {"model": nnx.state(model), "opt": nnx.state(opt)})
  restored = checkpointer.restore(tmp_path / "run", abstract)
  checkpointer.close()
  nnx.update(model, restored["model"])
  nnx.update(opt, restored["opt"])
  assert int(opt.step[...]) == 1
  opt.update(model, loss_fn, _batch(1))
  chex.assert_trees_all_equal(_params(model), want)


class Calls(nnx.Variable):
  """An integer count of forward passes."""


class Counting(MLP):
  def __init__(self, *, rngs):
    super().__init__(rngs=rngs)
    self.calls = Calls(jnp.array(0))

  def __call__(self, x):
    self.calls[...] += 1
    return super().__call__(x)


def test_bad_inputs_raise_naming_the_fix():
  model = MLP(rngs=nnx.Rngs(0))
  tx = optax_adama.adamaw(1e-2, num_micro_batches=N)
  with pytest.raises(TypeError, match="nnx.Module"):
    adama_nnx.MicroBatchOptimizer({"w": jnp.ones(2)}, tx, wrt=nnx.Param)
  with pytest.raises(TypeError, match=r"optax.GradientTransformation.*adamaw\(1e-3"):
    adama_nnx.MicroBatchOptimizer(model, optax_adama.adamaw, wrt=nnx.Param)
  with pytest.raises(ValueError, match="selects none.*wrt=nnx.Param"):
    adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.BatchStat)

  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)
  before = _params(model)
  with pytest.raises(ValueError, match="batch size 7 does not split into num_micro_batches=2"):
    opt.update(model, loss_fn, _batch(0, size=7))
  with pytest.raises(ValueError, match="share one leading batch size"):
    opt.update(model, loss_fn, {"x": jnp.ones((8, WIDTH)), "y": jnp.ones((6, 1))})
  with pytest.raises(TypeError, match="nnx.Module"):
    opt.update(nnx.state(model), loss_fn, _batch(0))
  with pytest.raises(ValueError, match="one MicroBatchOptimizer per model"):
    opt.update(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), loss_fn, _batch(0))

  counting = Counting(rngs=nnx.Rngs(0))
  counting_opt = adama_nnx.MicroBatchOptimizer(counting, tx, wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"\['calls'\].*mutable="):
    counting_opt.update(counting, loss_fn, _batch(0))
  counting_opt = adama_nnx.MicroBatchOptimizer(counting, tx, wrt=nnx.Param, mutable=Calls)
  with pytest.raises(ValueError, match=r"\['calls'\] of dtype int32.*floating point"):
    counting_opt.update(counting, loss_fn, _batch(0))
  shared = MLP(rngs=nnx.Rngs(0), batch_norm=True)
  zeros = jnp.zeros(8)
  shared.hidden.bias.set_value(zeros)
  shared.norm.bias.set_value(zeros)
  shared_opt = adama_nnx.MicroBatchOptimizer(shared, tx, wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"params\['hidden'\]\['bias'\] and params\['norm'\]"):
    shared_opt.update(shared, loss_fn, _batch(0))
  # Every failure came before the step ran: nothing donated, nothing changed.
  chex.assert_trees_all_equal(_params(model), before)
  assert int(opt.step[...]) == 0 and int(counting.calls[...]) == 0


def _run(code):
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)


def test_importing_the_library_does_not_import_flax():
  result = _run("import optax_adama, sys; assert 'flax' not in sys.modules; "
                "entry = optax_adama.nnx; assert 'flax' not in sys.modules; "
                "entry.MicroBatchOptimizer; assert 'flax' in sys.modules; "
                "from optax_adama.nnx import MicroBatchOptimizer as M; "
                "assert M is entry.MicroBatchOptimizer and M.__module__ == 'optax_adama.nnx'")
  assert result.returncode == 0, result.stderr


def test_without_flax_the_import_error_says_what_to_install():
  result = _run("import sys; sys.modules['flax'] = None\n"
                "try:\n  import optax_adama.nnx\n"
                "except ImportError as e:\n  print(e)\n")
  assert result.returncode == 0, result.stderr
  assert "pip install 'flax>=0.12.2'" in result.stdout, result.stdout


class DropoutAtCall(nnx.Module):
  """Flax's examples' pattern: the dropout keys come with the call, not the module."""

  def __init__(self, *, rngs):
    self.hidden = nnx.Linear(WIDTH, 8, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)
    self.head = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x, rngs):
    return self.head(self.dropout(jnp.tanh(self.hidden(x)), rngs=rngs))


def loss_with_rngs(model, batch, rngs):
  """The loss and, as aux, the mask its dropout drew (the same stream, one draw on)."""
  loss = jnp.mean((model(batch["x"], rngs) - batch["y"]) ** 2)
  return loss, model.dropout(jnp.ones(8), rngs=rngs)


def test_rngs_give_each_micro_batch_its_own_streams_as_documented():
  """Against a hand-written loop: nnx.Optimizer once per micro-batch, each with
  ``nnx.Rngs(dropout=fold_in(fold_in(key, step), i))``, the documented fork."""
  tx = optax_adama.adamaw(1e-2, num_micro_batches=N)
  batches = [_batch(seed) for seed in range(2)]
  model = DropoutAtCall(rngs=nnx.Rngs(0))
  reference = _copy(model)
  per_update = nnx.Optimizer(reference, tx, wrt=nnx.Param)

  @nnx.jit
  def train_micro_batch(model, opt, micro_batch, rngs):
    (_, mask), grads = nnx.value_and_grad(loss_with_rngs, has_aux=True)(
        model, micro_batch, rngs)
    opt.update(model, grads)
    return mask

  key = jax.random.key(7)
  want_masks = []
  for step, batch in enumerate(batches):
    for i in range(N):
      forked = nnx.Rngs(dropout=jax.random.fold_in(jax.random.fold_in(key, step), i))
      want_masks.append(train_micro_batch(reference, per_update, _micro(batch, i), forked))

  rngs = nnx.Rngs(dropout=7)
  opt = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param)
  masks = [opt.update(model, loss_with_rngs, batch, has_aux=True, rngs=rngs)["aux"]
           for batch in batches]
  chex.assert_trees_all_equal(jnp.concatenate(masks), jnp.stack(want_masks))
  assert len({tuple(m.tolist()) for m in want_masks}) == 2 * N  # new per micro-batch, step
  chex.assert_trees_all_close(_params(model), _params(reference), rtol=1e-5, atol=1e-6)
  assert int(rngs.dropout.count[...]) == 2  # one per step, as the model's own streams


def test_rngs_runs_are_a_function_of_the_seed():
  def train(seed):
    model = DropoutAtCall(rngs=nnx.Rngs(0))
    opt = adama_nnx.MicroBatchOptimizer(
        model, optax_adama.adamaw(1e-2, num_micro_batches=N), wrt=nnx.Param)
    rngs = nnx.Rngs(dropout=seed)
    for batch in (_batch(0), _batch(1)):
      opt.update(model, loss_with_rngs, batch, has_aux=True, rngs=rngs)
    return _params(model)

  chex.assert_trees_all_equal(train(3), train(3))
  with pytest.raises(AssertionError):
    chex.assert_trees_all_close(train(3), train(4))


def test_extra_arguments_reach_every_micro_batchs_loss():
  def scaled_loss(model, batch, scale, offset):
    return scale * loss_fn(model, batch) + offset["b"]

  batch = _batch(0)
  model = MLP(rngs=nnx.Rngs(0))
  reference = _copy(model)
  tx = optax_adama.adamaw(1e-2, num_micro_batches=N)
  got = adama_nnx.MicroBatchOptimizer(model, tx, wrt=nnx.Param).update(
      model, scaled_loss, batch, jnp.float32(3.0), {"b": jnp.float32(1.0)})
  want = adama_nnx.MicroBatchOptimizer(reference, tx, wrt=nnx.Param).update(
      reference, lambda m, b: 3.0 * loss_fn(m, b) + 1.0, batch)
  chex.assert_trees_all_close(got["loss"], want["loss"], rtol=1e-6)
  chex.assert_trees_all_close(_params(model), _params(reference), rtol=1e-6)


def test_rngs_misuse_is_refused_with_the_fix():
  model = DropoutAtCall(rngs=nnx.Rngs(0))
  opt = adama_nnx.MicroBatchOptimizer(
      model, optax_adama.adamaw(1e-2, num_micro_batches=N), wrt=nnx.Param)
  with pytest.raises(TypeError, match=r"rngs must be an nnx.Rngs .*got"):
    opt.update(model, loss_with_rngs, _batch(0), has_aux=True, rngs=jax.random.key(0))
  with pytest.raises(TypeError, match=r"extra argument 0 holds an nnx object .*rngs=rngs"):
    opt.update(model, loss_with_rngs, _batch(0), nnx.Rngs(dropout=0), has_aux=True)
  # Closing over an outer nnx.Rngs instead is Flax's own refusal.
  outer = nnx.Rngs(dropout=0)
  with pytest.raises(Exception, match="TraceContextError|trace level|different trace"):
    opt.update(model, lambda m, b: loss_with_rngs(m, b, outer), _batch(0), has_aux=True)
