"""Tests for the library's planner, `optax_adama.memory.plan`: will a model fit, and how?

The zoo's layer (`models.planner`, `models.plan`) is tests/zoo/test_plan_levers.py.

Two models that are not the zoo's: a plain-JAX MLP and a small Flax NNX
transformer (a StagedLoss, so the release is a candidate), each under a loose,
a tight and an impossible budget, every budget read off the model's own
compiled steps (`memory_report`), never typed in. The plan's step is compiled
again for the caller's arrays: its bytes are the plan's, within the budget, and
it trains. A scanned MLP with remat as a `ModelLevers` is planned and trained
the same way. The search itself runs on a synthetic memory/time model (no
compiles, so every budget can be tried) against exhaustive enumeration, one
device through `plan` and on a mesh through `_search.search`. On 8 CPU
devices (a subprocess: this file run as a script) a budget below one copy of
the params leaves FSDP the only stage.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_on_devices
from flax import nnx

import optax_adama
from optax_adama import _measure
from optax_adama import _search

plan = optax_adama.memory.plan
PlanSettings = optax_adama.memory.PlanSettings
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
  settings = PlanSettings
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
  settings = PlanSettings(2, moments="8bit", release=True)
  with pytest.raises(TypeError, match=r"the plan chooses \['num_micro_batches'\]"):
    settings.optimizer(1e-3, num_micro_batches=4)
  state = settings.optimizer(1e-3).init({"w": jnp.zeros((2, 64, 64))})
  assert optax_adama.find_adama_state(state).num_micro_batches == 2


# A model's own levers: a scanned MLP whose layers may be recomputed (remat).
def scanned_mlp(params, batch, layer=lambda x, w: jnp.tanh(x @ w)):
  x, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), batch["x"], params["stack"])
  return jnp.mean(x ** 2)


class Remat(optax_adama.memory.ModelLevers):
  """Remat "none" or "full" of `scanned_mlp`, each layer's flops counted once more
  by `uncounted_cost` where `extra_flops` says so."""

  def __init__(self, extra_flops: float = 0.0):
    self.extra_flops = extra_flops

  def activations(self):
    return [("remat=none", False), ("remat=full", False)]

  def loss(self, settings):
    if settings.model == "remat=none":
      return scanned_mlp, False
    rematted = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))
    return (lambda params, batch: scanned_mlp(params, batch, rematted)), False

  def uncounted_cost(self, settings, params, micro_batch):
    return self.extra_flops, 0.0


def test_model_levers_are_searched_and_the_chosen_variant_trains():
  """Under 3 MB remat "none" needs N = 4, "full" fits N = 1: chosen, and the plan's
  step is the variant's, its compiled bytes the plan's."""
  keys = jax.random.split(jax.random.key(0), 2)
  params = {"stack": jax.random.normal(keys[0], (8, 128, 128)) / 128 ** 0.5}
  batch = {"x": jax.random.normal(keys[1], (128, 128))}
  chosen = plan(Remat(), params, batch, budget_bytes=3e6, moment_storages=("float32",))
  assert (chosen.settings.model, chosen.settings.num_micro_batches) == ("remat=full", 1)
  smallest_n = {model: min(c.candidate.num_micro_batches for c in chosen.considered
                           if c.fits and c.candidate.model == model)
                for model in ("remat=none", "remat=full")}
  assert smallest_n == {"remat=none": 4, "remat=full": 1}
  assert "| N=1 remat=full moments=float32 **(chosen)** |" in chosen.table()
  tx = chosen.optimizer(LEARNING_RATE)
  state = tx.init(params)
  step = chosen.step(tx)
  assert optax_adama.memory_report(step, params, state, batch).total_bytes == chosen.device_bytes
  _, _, metrics = step(params, state, batch)
  assert np.isfinite(float(metrics["loss"]))
  # measure: one candidate as plan measured it; uncounted_cost's flops N times over.
  settings = PlanSettings(2, model="remat=none")
  planned = next(c.measurement for c in chosen.considered if c.candidate == settings)
  measured = Remat(extra_flops=1e6).measure(settings, params, batch)
  assert measured.device_bytes == planned.device_bytes
  assert measured.flops == planned.flops + 2 * 1e6


# The search on a synthetic step (no compiles): memory = params and moments +
# activations / N, time = compute of the setting + N folds over the moments
# (as AdamA's step pays); the loss in chunks is an exact lever.
@dataclasses.dataclass(frozen=True)
class Variant:
  remat: str
  bits: int | None = None
  chunks: int = 1

  def __str__(self):
    return f"remat={self.remat} bits={self.bits} chunks={self.chunks}"


SETTINGS = (("none", None), ("none", 2), ("dots", None), ("full", None))
ACTIVATIONS = {("none", None): 16.0, ("none", 2): 12.0, ("dots", None): 9.0, ("full", None): 3.0}
COMPUTE = {("none", None): 10.0, ("none", 2): 10.1, ("dots", None): 11.0, ("full", None): 13.0}
STATE = {"float32": 3.0, "bfloat16": 2.0, "8bit": 1.5}
FOLD = {"float32": 0.5, "bfloat16": 0.35, "8bit": 0.6}
# The chunked loss: a share of the activations gone, one more head forward.
CHUNKED_ACTIVATIONS, CHUNKED_COMPUTE = 0.45, 0.3
LOSS_CHUNKS = (1, 8)
MACHINE = optax_adama.memory.Machine(peak_flops=1.0, memory_bandwidth=1e12, host_bandwidth=1.0)
ROWS = 16


class SyntheticSteps:
  """A candidate's synthetic measurement, counting the calls."""

  def __init__(self):
    self.calls = 0

  def __call__(self, settings: PlanSettings) -> optax_adama.memory.Measurement:
    self.calls += 1
    variant, n = settings.model, settings.num_micro_batches
    setting, chunked = (variant.remat, variant.bits), variant.chunks > 1
    activations = ACTIVATIONS[setting] * (CHUNKED_ACTIVATIONS if chunked else 1.0)
    memory = 1.0 + STATE[settings.moments] + activations / n
    seconds = COMPUTE[setting] + chunked * CHUNKED_COMPUTE + n * FOLD[settings.moments]
    # The fold's traffic is the predictor's own: N * (P + 2 * state) / bandwidth.
    seconds -= n * (1.0 + 2 * STATE[settings.moments]) * 1e6 / MACHINE.memory_bandwidth
    return optax_adama.memory.Measurement(
        device_bytes=int(memory * 1e6), host_bytes=0, param_bytes=10**6,
        state_bytes=int(STATE[settings.moments] * 1e6), flops=seconds, bytes_accessed=0.0,
        compile_s=0.0)


class SyntheticLevers(optax_adama.memory.ModelLevers):
  """`SETTINGS` as activations, `LOSS_CHUNKS` as the exact lever."""

  bound_narrower_moments = False  # the synthetic bytes are not the optimizer state's

  def __init__(self, settings=SETTINGS, offloading=(), message=None):
    self.settings, self.offloading, self.message = settings, offloading, message

  def activations(self):
    return [(Variant(remat, bits), False) for remat, bits in self.settings]

  def exact(self, variant):
    return [dataclasses.replace(variant, chunks=chunks) for chunks in LOSS_CHUNKS]

  def loss(self, settings):
    return (lambda params, batch: jnp.mean(batch["x"] @ params["w"])), False

  def offloads(self, variant):
    return variant.remat in self.offloading

  def nothing_fits_message(self, considered, skipped, budget_bytes):
    return self.message


def synthetic_plan(monkeypatch, budget_bytes, steps=None, levers=None):
  steps = steps or SyntheticSteps()
  monkeypatch.setattr(_measure.Candidates, "measure", lambda self, settings: steps(settings))
  params = {"w": jax.ShapeDtypeStruct((4, 1), jnp.float32)}
  batch = {"x": jax.ShapeDtypeStruct((ROWS, 4), jnp.float32)}
  return plan(levers or SyntheticLevers(), params, batch, budget_bytes=budget_bytes,
              machine=MACHINE, offload=False)


@pytest.mark.parametrize("budget_mb", [4.3, 4.6, 5.0, 6.0, 8.0, 12.0, 20.0, 40.0])
def test_search_fits_and_is_never_slower_than_remat_alone(monkeypatch, budget_mb):
  budget, steps = budget_mb * 1e6, SyntheticSteps()
  result = synthetic_plan(monkeypatch, budget)
  assert result.measurement.device_bytes <= budget
  predicted = lambda c: steps(c).predicted_s(MACHINE, c.num_micro_batches)
  remat_alone = [PlanSettings(n, model=Variant(remat))
                 for remat, n in itertools.product(("none", "dots", "full"),
                                                   _search.divisors(ROWS))]
  assert result.predicted_s <= min(predicted(c) for c in remat_alone
                                   if steps(c).device_bytes <= budget) + 1e-12
  # The choice is the best of everything that fits (exhaustive over the grid).
  every = [PlanSettings(n, moments, model=Variant(remat, bits, chunks))
           for (remat, bits), n, moments, chunks in itertools.product(
               SETTINGS, _search.divisors(ROWS), _search.MOMENT_STORAGES, LOSS_CHUNKS)]
  fitting = [predicted(c) for c in every if steps(c).device_bytes <= budget]
  # Narrower moments are considered only where they buy a smaller N, so the
  # choice may be float32 where bfloat16 at the same N predicts a little less;
  # and only with the loss in chunks, which may cost one head forward more
  # than narrower moments alone would have.
  narrow_gain = max(FOLD["float32"] - FOLD["bfloat16"], 0.0) * ROWS + CHUNKED_COMPUTE
  assert result.predicted_s <= min(fitting) + narrow_gain


def test_search_compiles_far_fewer_candidates_than_the_grid(monkeypatch):
  steps = SyntheticSteps()
  result = synthetic_plan(monkeypatch, 6e6, steps)
  grid = (len(SETTINGS) * len(_search.divisors(ROWS))
          * len(_search.memory_levers(_search.MOMENT_STORAGES, LOSS_CHUNKS, offload=False)))
  assert steps.calls == len(result.considered) + 1  # + the verification
  assert steps.calls <= grid // 2


def test_tight_budget_narrows_the_moments_and_the_table_says_why(monkeypatch):
  # 4.3 MB: with float32 moments the fastest fit is remat "full" with the loss
  # in chunks at N = 8 (17.3 s); bfloat16 moments let "dots" fit at N = 4 (12.7 s).
  result = synthetic_plan(monkeypatch, 4.3e6)
  assert result.settings.moments != "float32"
  table = result.table()
  assert "**(chosen)**" in table and "| no |" in table


def test_an_exact_lever_lets_a_smaller_n_fit(monkeypatch):
  # 5.3 MB, float32 moments: "dots" (9 units of activations) needs N = 8;
  # with the loss in chunks (4.05) N = 4 fits, which the search must find.
  result = synthetic_plan(monkeypatch, 5.3e6)
  assert PlanSettings(4, model=Variant("dots", None, 8)) in {
      row.candidate for row in result.considered if row.fits}


def test_exact_levers_come_before_narrower_moments_and_host_memory():
  storages = _search.MOMENT_STORAGES
  assert _search.memory_levers(storages, (1, 8), offload=False) == [
      ("float32", False, 1), ("float32", False, 8), ("bfloat16", False, 8), ("8bit", False, 8)]
  assert _search.memory_levers(storages, (None,), offload=True) == [
      ("float32", False, None), ("float32", True, None), ("bfloat16", False, None),
      ("8bit", False, None), ("8bit", True, None)]
  assert _search.memory_levers(("bfloat16",), (1,), offload=False) == [("bfloat16", False, 1)]


def test_a_variant_that_offloads_without_host_memory_is_not_chosen(monkeypatch):
  """On a backend that drops the move to host, "offload" is "minimal" renamed."""
  steps = SyntheticSteps()

  def offload_minimal(settings):
    variant = dataclasses.replace(settings.model, remat="full")
    return dataclasses.replace(  # offload predicted a hair faster, as the CPU measured it
        steps(dataclasses.replace(settings, model=variant)),
        flops=13.0 - (settings.model.remat == "offload") * 1e-3)

  levers = SyntheticLevers((("minimal", None), ("offload", None)), offloading=("offload",))
  result = synthetic_plan(monkeypatch, 40e6, offload_minimal, levers)
  assert result.settings.model.remat == "minimal"
  assert "(not measurable here)" in result.table()


def test_nothing_fits_says_it_in_the_levers_words_or_the_librarys(monkeypatch):
  worded = SyntheticLevers(message="nothing fits, in the model's words")
  with pytest.raises(ValueError, match="^nothing fits, in the model's words$"):
    synthetic_plan(monkeypatch, 1e6, levers=worded)
  with pytest.raises(ValueError, match=r"nothing fits budget_bytes=1,000,000 .* smallest step "
                                       r"compiled, N=16 remat=full"):
    synthetic_plan(monkeypatch, 1e6)


# On a mesh, the search alone (plan needs the devices): per-device memory = what
# a stage keeps whole + its shares + activations of a device's rows; time =
# compute + N collectives of the stage (AdamA reduces every micro-batch).
MESH_DEVICES = 8
WHOLE_PARAMS, MESH_STATE = 8.0, {"float32": 16.0, "bfloat16": 8.0, "8bit": 4.0}
MESH_ACTIVATIONS = {"full": 0.5, "release": 0.25}  # MB a row
MESH_COLLECTIVES = {None: 2.0, "zero1": 2.0, "zero2": 1.0, "fsdp": 3.0}


def synthetic_whole(stage, moments):
  return int(1e6 * {None: WHOLE_PARAMS + MESH_STATE[moments], "zero1": WHOLE_PARAMS,
                    "zero2": WHOLE_PARAMS, "fsdp": 0.0}[stage])


def synthetic_mesh_search(budget_bytes, calls):
  def measure(settings):
    calls.append(settings)
    stage, moments = settings.shard_states, settings.moments
    shares = {None: WHOLE_PARAMS,  # gradient whole
              "zero1": MESH_STATE[moments] / 8 + WHOLE_PARAMS,  # gradient whole
              "zero2": (MESH_STATE[moments] + WHOLE_PARAMS) / 8,
              "fsdp": (MESH_STATE[moments] + 2 * WHOLE_PARAMS) / 8}[stage]
    rows = 32 // settings.num_micro_batches // MESH_DEVICES
    memory = (synthetic_whole(stage, moments) / 1e6 + shares
              + MESH_ACTIVATIONS[settings.model] * rows)
    seconds = 10.0 + settings.num_micro_batches * MESH_COLLECTIVES[stage]
    return optax_adama.memory.Measurement(
        device_bytes=int(memory * 1e6), host_bytes=0, param_bytes=8 * 10**6, state_bytes=0,
        flops=seconds, bytes_accessed=0.0, compile_s=0.0)

  return _search.search(
      budget_bytes=budget_bytes, splits=[n for n in _search.divisors(32) if 32 // n % 8 == 0],
      stages=_search.SHARD_STAGES, activations=[("full", False), ("release", True)],
      exact=lambda variant: (variant,), moment_storages=_search.MOMENT_STORAGES, offload=False,
      measure=measure, machine=MACHINE, replicated=synthetic_whole, on_mesh=True)


def test_mesh_search_skips_replicated_stages_and_keeps_rows_on_every_device():
  # 12.5 MB a device: data parallel keeps 24 MB (f32) or 16 MB (bf16) whole:
  # skipped with those, never compiled; with 8-bit moments (12 MB) it fits.
  calls = []
  found = synthetic_mesh_search(12.5e6, calls)
  assert {c.num_micro_batches for c in calls} <= {1, 2, 4}  # 32 rows: 4, 2 or 1 a device
  assert not any(c.shard_states is None and c.moments in ("float32", "bfloat16") for c in calls)
  assert {(s.shard_states, s.moments) for s in found.skipped} == {(None, "float32"),
                                                                  (None, "bfloat16")}
  # zero2 at N = 1: 8 + 3 + 4 rows' activations, and the fewest collectives.
  assert found.best.candidate == PlanSettings(1, release=True, shard_states="zero2",
                                              model="release")
  assert any(c.shard_states is None and c.moments == "8bit" for c in calls)
  # Below the params, zero1 and zero2 are skipped once each, whatever the moments.
  low = synthetic_mesh_search(7e6, [])
  assert low.best.candidate.shard_states == "fsdp"
  assert {(s.shard_states, s.moments) for s in low.skipped} >= {("zero1", None), ("zero2", None)}


def test_mesh_predictor_adds_sharded_folds_and_collectives():
  m = optax_adama.memory.Measurement(device_bytes=0, host_bytes=0, param_bytes=8, state_bytes=16,
                                     flops=0.0, bytes_accessed=0.0, compile_s=0.0,
                                     link_bytes=300.0, state_shards=8)
  machine = optax_adama.memory.Machine(peak_flops=1.0, memory_bandwidth=1.0, host_bandwidth=1.0,
                                       interconnect_bandwidth=100.0)
  # Two folds of one device's eighth of P + 2 S (40 / 8), and 300 bytes at 100 B/s.
  assert m.predicted_parts(machine, 2) == {"compute": 0.0, "folds": 10.0, "host": 0.0,
                                           "collectives": 3.0}
  assert m.predicted_s(machine, 2) == 13.0


# On 8 CPU devices, compiled: a subprocess (this file run as a script).
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
  run = run_on_devices(__file__)
  assert run["stage"] == "fsdp", run
  assert run["compiled_bytes"] == run["bytes"] <= run["budget"]
  # Data parallel, ZeRO-1 and ZeRO-2 keep the params whole: skipped, not compiled.
  assert set(run["skipped"]) == {None, "zero1", "zero2"}, run
  assert np.isfinite(run["loss"]) and "stage=fsdp" in run["text"]


if __name__ == "__main__":
  print(json.dumps(_mesh_worker()))
