"""Tests for `optax_adama.memory.plan`: will a user's own model fit, and how?

Two models that are not the zoo's: a plain-JAX MLP and a small Flax NNX
transformer (a StagedLoss, so the release is a candidate), each under a loose,
a tight and an impossible budget, every budget read off the model's own
compiled steps (`memory_report`), never typed in. The plan's step is compiled
again for the caller's arrays: its bytes are the plan's, within the budget, and
it trains. On 8 CPU devices (a subprocess: this file run as a script) a budget
below one copy of the params leaves FSDP the only stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO
from conftest import xla_flags
from flax import nnx

import optax_adama

plan = optax_adama.memory.plan
LEARNING_RATE = 3e-3


def mlp_problem(rows: int = 8):
  """A 3-layer tanh MLP regression: (loss_fn, params, batch) as arrays."""
  keys = jax.random.split(jax.random.key(0), 5)
  sizes = (32, 256, 256, 1)
  params = {f"w{i}": jax.random.normal(keys[i], (a, b)) / a ** 0.5
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
  x = jax.random.normal(keys[3], (rows, sizes[0]))
  batch = {"x": x, "y": jnp.sin(x.sum(axis=1, keepdims=True))}

  def loss_fn(params, micro_batch):
    h = micro_batch["x"]
    for i in range(len(sizes) - 2):
      h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h @ params[f"w{len(sizes) - 2}"] - micro_batch["y"]) ** 2)

  return loss_fn, params, batch


class Block(nnx.Module):
  """Pre-norm self-attention and MLP, causal."""

  def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
    self.norm1, self.norm2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(width, 4 * width, rngs=rngs), nnx.Linear(4 * width, width,
                                                                             rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(x[..., 0])
    x = x + self.attention(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
  """Embedding, a stack of blocks (params stacked by nnx.vmap), a tied head."""

  def __init__(self, vocab: int, width: int, heads: int, layers: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_block(rngs):
      return Block(width, heads, rngs=rngs)

    self.blocks = make_block(rngs)
    self.norm = nnx.LayerNorm(width, rngs=rngs)


def transformer_problem(rows: int = 8, length: int = 32, vocab: int = 64):
  """TinyLM as a StagedLoss: (staged, params, batch) as arrays."""
  model = TinyLM(vocab, 64, 4, 2, rngs=nnx.Rngs(0))
  _, params = nnx.split(model)
  block_def, norm_def = nnx.graphdef(model.blocks), nnx.graphdef(model.norm)

  def embed(outer, micro_batch):
    return outer["embed"]["embedding"][micro_batch["tokens"]]

  def block(layer, x, micro_batch):
    return nnx.merge(block_def, layer)(x)

  def head(outer, x, micro_batch):
    logits = nnx.merge(norm_def, outer["norm"])(x) @ outer["embed"]["embedding"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, micro_batch["labels"]).mean()

  staged = optax_adama.StagedLoss(embed, block, head, layers="blocks")
  tokens = jax.random.randint(jax.random.key(1), (rows, length + 1), 0, vocab)
  # A learnable sequence: each token is the previous one plus one.
  tokens = (tokens[:, :1] + jnp.arange(length + 1)[None, :]) % vocab
  return staged, params, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


PROBLEMS = {"mlp": mlp_problem, "transformer": transformer_problem}


def step_bytes(loss_fn, params, batch, settings) -> int:
  """Compiled bytes of one setting's step, as memory_report counts them."""
  tx = settings.optimizer(LEARNING_RATE)
  release = settings.release
  step = (optax_adama.release_step(loss_fn, tx) if release else
          optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=settings.num_micro_batches))
  state = jax.eval_shape(tx.init, params)
  return optax_adama.memory_report(step, params, state, batch).total_bytes


# The transformer's plans compile the plain step and the release at each N
# tried, and a block alone for the flops: some 10 compiles a budget, a minute or
# more on 2 shared cores, so with the slow tests.
@pytest.fixture(scope="module", params=["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def problem(request):
  """(name, loss_fn, params, batch, bytes of the plain step at N = 1 and at N = 8)."""
  loss_fn, params, batch = PROBLEMS[request.param]()
  settings = optax_adama.memory.PlanSettings
  whole, split = (step_bytes(loss_fn, params, batch, settings(n)) for n in (1, 8))
  return request.param, loss_fn, params, batch, whole, split


def test_loose_budget_takes_the_fastest_step_whole(problem):
  _, loss_fn, params, batch, whole, _ = problem
  chosen = plan(loss_fn, params, batch, budget_bytes=2 * whole)
  # One micro-batch of float32 moments fits: nothing slower is needed.
  assert (chosen.settings.num_micro_batches, chosen.settings.moments) == (1, "float32")
  assert chosen.device_bytes <= 2 * whole
  assert str(chosen).startswith("N=1 ")


def test_tight_budget_splits_or_narrows_and_its_step_trains(problem):
  name, loss_fn, params, batch, whole, split = problem
  assert split < whole, (name, split, whole)
  budget = (whole + split) // 2  # the plain step at N = 1 is over it
  chosen = plan(loss_fn, params, batch, budget_bytes=budget)
  settings = chosen.settings
  assert settings.num_micro_batches > 1 or settings.moments != "float32" or settings.release
  # Predicted bytes are the compiled bytes of the plan's own step, for arrays.
  tx = chosen.optimizer(LEARNING_RATE)
  step = chosen.step(tx)
  state = tx.init(params)
  report = optax_adama.memory_report(step, params, state, batch)
  assert report.total_bytes == chosen.device_bytes <= budget
  losses = []
  for _ in range(4):
    params, state, metrics = step(params, state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0], losses
  assert "**(chosen)**" in chosen.table()


def test_impossible_budget_names_the_smallest_step_and_what_dominates(problem):
  _, loss_fn, params, batch, _, split = problem
  with pytest.raises(ValueError, match=r"nothing fits budget_bytes=.*the smallest step compiled, "
                                       r"N=8 .*params [\d,]+ B, optimizer state [\d,]+ B, "
                                       r".*Levers left, by what each would save"):
    plan(loss_fn, params, batch, budget_bytes=split // 4)


def _levers_named(error: str) -> list[str]:
  """The levers of a nothing-fits error, in the order it gives them."""
  listed = error.split("(estimates): ", 1)[1].split("; or a smaller model", 1)[0]
  return [lever.rsplit(": -", 1)[0] for lever in listed.split("; ")]


def _four_layer_mlp():
  """An MLP of 2.58 MB of params (a user's report), 256 rows of 400 features."""
  widths = (400, 400, 400, 400, 412)
  params = {f"w{i}": jax.ShapeDtypeStruct((a, b), jnp.float32)
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))}

  def loss_fn(params, micro_batch):
    h = micro_batch["x"]
    for i in range(len(widths) - 1):
      h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean(h ** 2)

  return loss_fn, params, {"x": jax.ShapeDtypeStruct((256, 400), jnp.float32)}


def test_nothing_fits_names_only_levers_left_biggest_first():
  """At N = 256 (one row per micro-batch) a larger N is spent, and remat of one
  row's activations saves least; at 100 KB the 8-bit moments the planner picks
  itself at 9 MB are named."""
  loss_fn, params, batch = _four_layer_mlp()
  with pytest.raises(ValueError) as raised:
    plan(loss_fn, params, batch, budget_bytes=6.5e6)
  levers = _levers_named(str(raised.value))
  assert "N=256" in str(raised.value) and not any("larger N" in lever for lever in levers)
  assert not any("8-bit moments" in lever for lever in levers)  # the step has them
  assert levers[0].startswith("a mesh of 8 devices") and levers[-1].startswith("remat"), levers
  with pytest.raises(ValueError) as raised:
    plan(loss_fn, params, batch, budget_bytes=1e5)
  levers = _levers_named(str(raised.value))
  assert any(lever.startswith("8-bit moments") for lever in levers), levers
  saved = [float(lever.rsplit(": -", 1)[1].split()[0]) for lever in
           str(raised.value).split("(estimates): ", 1)[1].split("; or a smaller")[0].split("; ")]
  assert saved == sorted(saved, reverse=True)
  assert plan(loss_fn, params, batch, budget_bytes=9e6).settings.moments != "float32"


def test_bad_inputs_are_refused_with_the_argument_named():
  loss_fn, params, batch = mlp_problem()
  for budget in (0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="budget_bytes must be a positive"):
      plan(loss_fn, params, batch, budget_bytes=budget)
  with pytest.raises(TypeError, match="budget_bytes must be a number"):
    plan(loss_fn, params, batch, budget_bytes="16GB")
  with pytest.raises(ValueError, match=r"batch leaves must share one leading number of rows"):
    plan(loss_fn, params, {"x": batch["x"], "y": batch["y"][:4]}, budget_bytes=1e9)
  with pytest.raises(ValueError, match=r"batch needs a leading axis of rows"):
    plan(loss_fn, params, {"x": jnp.zeros(())}, budget_bytes=1e9)
  with pytest.raises(TypeError, match="params must hold arrays"):
    plan(loss_fn, {"w": "weights"}, batch, budget_bytes=1e9)
  with pytest.raises(TypeError, match="loss_fn must be callable"):
    plan(None, params, batch, budget_bytes=1e9)

  def fixed_rows(params, micro_batch):  # written for the whole batch of 8 rows
    return loss_fn(params, {"x": micro_batch["x"].reshape(8, 32), "y": micro_batch["y"]})

  with pytest.raises(ValueError, match=r"loss_fn failed on one micro-batch of shapes "
                                       r"\{'x': \(\(\d, 32\), 'float32'\).*N=\d"):
    plan(fixed_rows, params, batch, budget_bytes=1e9)
  with pytest.raises(TypeError, match=r"loss_fn must return a scalar loss"):
    plan(lambda p, b: b["x"] @ p["w0"], params, batch, budget_bytes=1e9)
  with pytest.raises(ValueError, match=r"moment_storages must name some of \('float32'"):
    plan(loss_fn, params, batch, budget_bytes=1e9, moment_storages=("int4",))
  with pytest.raises(ValueError, match="shard_stages: 'fsdp' is not a stage without a mesh"):
    plan(loss_fn, params, batch, budget_bytes=1e9, shard_stages=("fsdp",))


def test_the_plan_refuses_to_choose_twice():
  settings = optax_adama.memory.PlanSettings(2, moments="8bit", release=True)
  with pytest.raises(TypeError, match=r"the plan chooses \['num_micro_batches'\]"):
    settings.optimizer(1e-3, num_micro_batches=4)
  state = settings.optimizer(1e-3).init({"w": jnp.zeros((2, 64, 64))})
  assert optax_adama.find_adama_state(state).num_micro_batches == 2


# On 8 CPU devices, compiled: a subprocess (this file run as a script).
MESH_DEVICES = 8


def _mesh_worker() -> dict:
  keys = jax.random.split(jax.random.key(0), 3)
  # Eight tanh layers stacked (a StagedLoss: under FSDP each layer's params are
  # gathered as its turn comes, one layer at a time).
  params = {"stack": {"w": jax.random.normal(keys[0], (8, 256, 256)) / 16},
            "head": jax.random.normal(keys[1], (256, 1)) / 16}
  batch = {"x": jax.random.normal(keys[2], (MESH_DEVICES, 256))}
  loss_fn = optax_adama.StagedLoss(
      embed=lambda outer, b: b["x"],
      block=lambda layer, x, b: jnp.tanh(x @ layer["w"]),
      head=lambda outer, x, b: jnp.mean((x @ outer["head"]) ** 2), layers="stack")
  mesh = jax.make_mesh((MESH_DEVICES,), ("data",))
  param_bytes = optax_adama.memory.tree_bytes(params)
  budget = 0.9 * param_bytes  # below one copy: no stage that keeps the params whole fits
  chosen = plan(loss_fn, params, batch, budget_bytes=budget, mesh=mesh)
  tx = chosen.optimizer(LEARNING_RATE)
  state = tx.init(params)
  shardings = chosen.shardings(params, state)
  params = jax.device_put(params, shardings.params)
  state = jax.device_put(state, shardings.opt_state)
  step = chosen.step(tx)
  compiled_bytes = optax_adama.memory_report(step, params, state, batch).total_bytes
  params, state, metrics = step(params, state, batch)
  return {"budget": budget, "stage": chosen.settings.shard_states, "bytes": chosen.device_bytes,
          "compiled_bytes": compiled_bytes, "skipped": [s.shard_states for s in chosen.skipped],
          "loss": float(metrics["loss"]), "text": str(chosen)}


def test_on_a_mesh_a_budget_below_the_params_picks_fsdp():
  env = dict(os.environ, XLA_FLAGS=xla_flags(MESH_DEVICES), JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"),
                                       env.get("PYTHONPATH", "")])
  result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  run = json.loads(result.stdout.strip().splitlines()[-1])
  assert run["stage"] == "fsdp", run
  assert run["compiled_bytes"] == run["bytes"] <= run["budget"]
  # Data parallel, ZeRO-1 and ZeRO-2 keep the params whole: skipped, not compiled.
  assert set(run["skipped"]) == {None, "zero1", "zero2"}, run
  assert np.isfinite(run["loss"]) and "stage=fsdp" in run["text"]


if __name__ == "__main__":
  print(json.dumps(_mesh_worker()))
