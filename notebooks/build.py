"""Builds and executes the notebooks from the cell sources below.

    python notebooks/build.py              # write + execute, store outputs
    NOTEBOOK_SMOKE=1 python notebooks/build.py --no-write   # CI: execute only

The sources live here, as code, so a change to a notebook is a reviewable diff;
the committed .ipynb files carry the outputs of the last full execution.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

# In the cell sources below, a backslash that ends a line joins it to the next one (the
# string literal drops both): the notebook's cell has one line where this file has two.
INSTALL = '''\
# This repository and its Flax models: the model zoo (models/) runs from a clone, since the
# wheel holds optax_adama alone. Opened inside a clone, the notebook uses that clone. Elsewhere
# (Colab) set OPTAX_ADAMA_REPO first, to a clone's path or to the git URL you cloned it from
# (`git remote get-url origin` in your clone), which is cloned beside the notebook. Unless the
# project imports already, its dependencies are pip-installed and the clone put on sys.path.
import importlib, importlib.util, os, pathlib, subprocess, sys, tomllib

class StopNotebook(Exception):
  def _render_traceback_(self):  # IPython (Jupyter, Colab) shows this line, not a traceback
    return [str(self)]

def stop(line):
  if "get_ipython" in globals():
    raise StopNotebook(line)  # the cell fails quietly, so "Run all" stops here
  sys.exit(line)  # plain Python: the line on stderr, status 1

def is_clone(folder):  # its pyproject.toml names the project
  try:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"] \
== "optax_adama"
  except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
    return False

WHAT_TO_SET = ("set OPTAX_ADAMA_REPO to a clone's path or to the git URL you cloned it from "
               "(`git remote get-url origin` in your clone), e.g. `%env OPTAX_ADAMA_REPO=<url>` "
               "in a cell above, and run again.")
REPO = os.environ.get("OPTAX_ADAMA_REPO", "").removeprefix("git+")
if not REPO:  # the clone the notebook was opened in, found from the working directory up
  here = pathlib.Path.cwd()
  REPO = next((str(f) for f in (here, *here.parents) if is_clone(f)), "")
  if not REPO:
    stop(f"Not in a clone of optax_adama: {WHAT_TO_SET}")
if "://" in REPO or REPO.startswith("git@"):
  if not os.path.isdir("optax_adama_repo"):
    subprocess.check_call(["git", "clone", "-q", "--depth", "1", REPO, "optax_adama_repo"])
  REPO = "optax_adama_repo"
REPO = os.path.abspath(REPO)
if not is_clone(pathlib.Path(REPO)):
  stop(f"OPTAX_ADAMA_REPO: {REPO} is not a clone of optax_adama; {WHAT_TO_SET}")
if not all(importlib.util.find_spec(m) for m in ("optax_adama", "models", "flax")):
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]  # the library's and the models' requirements
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                         *project["dependencies"], *project["optional-dependencies"]["models"]])
  sys.path.insert(0, REPO)
  importlib.invalidate_caches()
SMOKE = os.environ.get("NOTEBOOK_SMOKE") == "1"  # CI runs the smallest setting'''


QUICKSTART = [
    ("markdown", """\
# AdamA quickstart: gradient accumulation without a gradient buffer

Gradient accumulation with `optax.MultiSteps(optax.adamw(...))` keeps a
parameter-sized buffer of summed gradients alive across the micro-batches.
`optax_adama.adamaw` folds each micro-batch gradient straight into Adam's moments
instead, so the buffer is gone. This notebook swaps one for the other in a Flax NNX
training loop (one `update` per micro-batch), then uses the fused
`optax_adama.microbatch_step`, and compares the loss curves."""),
    ("code", INSTALL),
    ("code", '''\
import time
import jax, jax.numpy as jnp, numpy as np, optax
import matplotlib.pyplot as plt
from flax import nnx
import models, optax_adama
from models import data
from models.harness import warmup_cosine_schedule

NUM_MICRO_BATCHES, BATCH_SIZE, SEQ_LEN = 4, 32, 64
STEPS = 20 if SMOKE else 300
text = data.load_stdlib_text(max_bytes=2_000_000)  # Python's own sources, offline
print(f"{len(text.train):,} training bytes, {len(text.valid):,} held out; \
jax {jax.__version__} on {jax.devices()[0].platform}")'''),
    ("markdown", """\
## 1. `nnx.Optimizer`, one update per micro-batch

The baseline is what many Flax users write today; the AdamA version changes one
line, the optimizer. Both see the same initial weights and the same micro-batches."""),
    ("code", '''\
# Warm-up over the first tenth of the steps, then cosine decay to 2e-4.
schedule = warmup_cosine_schedule(2e-3, STEPS, warmup_steps=STEPS // 10)

def train_per_micro_batch(tx, steps=STEPS):
  model = models.create("gpt_tiny", rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_micro_batch(model, optimizer, micro_batch):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(micro_batch)[0])(model)
    optimizer.update(model, grads)
    return loss

  losses = []
  batches = data.lm_batches(text.train, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=0)
  for _, batch in zip(range(steps), batches):
    micro = [jax.tree.map(lambda x: x[i::NUM_MICRO_BATCHES], batch) \
for i in range(NUM_MICRO_BATCHES)]
    losses.append(np.mean([float(train_micro_batch(model, optimizer, mb)) for mb in micro]))
  return model, losses

baseline_tx = optax.MultiSteps(optax.adamw(schedule, weight_decay=1e-4), \
every_k_schedule=NUM_MICRO_BATCHES)
adama_tx = optax_adama.adamaw(schedule, weight_decay=1e-4, \
num_micro_batches=NUM_MICRO_BATCHES)  # the swap

start = time.perf_counter()
_, adam_losses = train_per_micro_batch(baseline_tx)
_, adama_losses = train_per_micro_batch(adama_tx)
print(f"trained both in {time.perf_counter() - start:.0f} s; \
final loss Adam {np.mean(adam_losses[-20:]):.3f}, AdamA {np.mean(adama_losses[-20:]):.3f}")'''),
    ("markdown", """\
## 2. The fused step: `optax_adama.microbatch_step`

One jitted call per mini-batch: a `jax.lax.scan` over the micro-batches with params
and optimizer state donated. With AdamA, XLA frees each layer's gradient as soon as
it is folded into the moments. Given `optax.adamw` instead, the same function does
ordinary gradient accumulation, the baseline. Each run is scored on held-out text.
Given section 1's `adama_tx`, it runs the same optimizer on the same math as
`nnx.Optimizer` did, in one compiled call."""),
    ("code", '''\
valid = [b for _, b in zip(range(16), data.lm_batches(
    text.valid, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=1234, shuffle=False, epochs=1))]

def train_fused(tx, steps=STEPS):
  model = models.create("gpt_tiny", rngs=nnx.Rngs(0))
  loss_fn, params = models.split_loss_fn(model)
  opt_state = tx.init(params)
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO_BATCHES)
  losses = []
  batches = data.lm_batches(text.train, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=0)
  for _, batch in zip(range(steps), batches):
    params, opt_state, metrics = step(params, opt_state, batch)
    losses.append(float(metrics["loss"]))
  nnx.update(model, params)  # write the trained weights back into the module
  eval_loss = jax.jit(loss_fn)
  return losses, float(np.mean([eval_loss(params, b) for b in valid]))

accumulation_losses, accumulation_held_out = train_fused(optax.adamw(schedule, weight_decay=1e-4))
fused_losses, fused_held_out = train_fused(adama_tx)  # the same optimizer as in section 1
print(f"held-out loss: Adam + accumulation {accumulation_held_out:.4f}, "
      f"AdamA {fused_held_out:.4f} ({fused_held_out / accumulation_held_out - 1:+.2%})")'''),
    ("code", '''\
smooth = lambda x, k=10: np.convolve(x, np.ones(k) / k, mode="valid")
plt.figure(figsize=(7, 4))
plt.plot(smooth(adam_losses), label="Adam (optax.MultiSteps), per micro-batch", color="black")
plt.plot(smooth(adama_losses), label="AdamA (nnx.Optimizer), per micro-batch")
plt.plot(smooth(fused_losses), "--", label="AdamA, fused microbatch_step (same optimizer)")
plt.xlabel("mini-batch step"); plt.ylabel("training loss (10-step average)")
plt.title(f"gpt_tiny on the standard library, N = {NUM_MICRO_BATCHES}"); \
plt.legend(); plt.grid(alpha=0.3)
plt.show()'''),
    ("markdown", """\
Both AdamA curves are the same optimizer, `adama_tx`, through `nnx.Optimizer` (one
`update` per micro-batch) and through the fused step: its default estimator needs
nothing but each micro-batch's gradient, so both paths fold the same second moment.

## 3. The second moment, and measuring your own model

AdamA's first moment is exactly Adam's; its v cannot see the mean gradient. The
default, the paper's `nu_estimator="mean"`, folds the mean of the squared micro-batch
gradients: larger than the square of their mean by their variance, so its steps are
smaller than Adam's, never larger, like a lower learning rate, more so for larger N and
smaller micro-batches (docs/estimators.md: -0.61% and +0.40% against Adam +
accumulation on GPT-2 small over 2,000 steps at N = 4 and 8). `"momentum"` folds each micro-batch's
g_i^2 / N^2 and adds (1 - 1/N) m_hat^2 once per mini-batch, at no memory beyond m and v:
Adam's own second moment where the mean gradient holds steady over m's horizon; where
it moves faster, v runs short and the steps long (`optax_adama.diagnostics.diagnose_second_moment`
measures it on your model). To see them side by side, name it:"""),
    ("code", '''\
momentum_losses, momentum_held_out = train_fused(optax_adama.contrib.adamaw(
    schedule, weight_decay=1e-4, num_micro_batches=NUM_MICRO_BATCHES, nu_estimator="momentum"))
for name, held_out in [("AdamA 'momentum'", momentum_held_out), ("AdamA default", fused_held_out)]:
  print(f"{name:>16}: held-out {held_out:.4f}, \
{held_out / accumulation_held_out - 1:+.2%} against Adam + accumulation")

plt.figure(figsize=(7, 4))
plt.plot(smooth(accumulation_losses), label="Adam + accumulation", color="black")
plt.plot(smooth(momentum_losses), label="AdamA, nu_estimator='momentum'")
plt.plot(smooth(fused_losses), "--", label="AdamA, default ('mean')")
plt.xlabel("mini-batch step"); plt.ylabel("training loss (10-step average)")
plt.title("fused microbatch_step, three optimizers"); plt.legend(); plt.grid(alpha=0.3)
plt.show()'''),
    ("markdown", """\
One seed of a tiny model decides little: in the study's cell closest to this one (the
tiny GPT, N = 4 x 512 tokens, 300 steps, 3 seeds; docs/estimators.md) `"mean"` trailed
Adam by a median 3.7% at Adam's rate and `"momentum"` by 4.1% at its best rate, half of
Adam's; at scale (GPT-2 small, 2,000 steps) the default was -0.61% and +0.40% against
Adam at N = 4 and 8, and `"momentum"` 4.4% behind at N = 8.

Before a long run on your own model, measure how far each estimator's v is from
Adam's: `diagnose_second_moment` follows Adam for a few mini-batches, keeping the mean
gradient that AdamA never keeps, and reports rho = v / v_Adam per estimator (AdamA's
steps are Adam's times 1/sqrt(rho)), with a suggestion."""),
    ("code", '''\
model = models.create("gpt_tiny", rngs=nnx.Rngs(0))
loss_fn, params = models.split_loss_fn(model)
batches = data.lm_batches(text.train, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=0)
diagnosis = optax_adama.diagnostics.diagnose_second_moment(
    loss_fn, params, [b for _, b in zip(range(6 if SMOKE else 60), batches)],
    num_micro_batches=NUM_MICRO_BATCHES, learning_rate=2e-3)
print(diagnosis.summary(learning_rate=2e-3))'''),
    ("markdown", """\
## 4. What it saves

XLA's own accounting of the two compiled steps (compile only, nothing runs), in
bytes and in P, the bytes of one copy of the parameters:"""),
    ("code", '''\
batch = next(data.lm_batches(text.train, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=0))
for name, tx in [("AdamA", optax_adama.adamaw(1e-3, num_micro_batches=NUM_MICRO_BATCHES)),
                 ("Adam + scan accumulation", optax.adamw(1e-3))]:
  state = jax.eval_shape(tx.init, params)
  fused = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO_BATCHES)
  report = optax_adama.memory_report(fused, params, state, batch)
  print(f"{name:>26}: {report.total_bytes / 2**20:6.2f} MiB = \
{report.in_p(report.total_bytes):5.2f} P")'''),
    ("markdown", """\
On this tiny model activations dominate, so one P is a small share. The
`memory_anatomy` notebook shows where the bytes go on GPT-2-sized models."""),
]

ANATOMY = [
    ("markdown", """\
# Where the bytes go: the memory anatomy of a training step

For one model and N micro-batches per mini-batch, this notebook compiles the
training step of every way JAX users accumulate gradients (compile only, so
GPT-2 sized models fit on a laptop) and splits XLA's `memory_analysis()` into
params, optimizer moments, gradient buffers and activations."""),
    ("code", INSTALL),
    ("code", '''\
import jax, numpy as np
import matplotlib.pyplot as plt
import models, optax_adama
from models import bench, harness

PRESET = "gpt_test" if SMOKE else "gpt2_small"
NUM_MICRO_BATCHES, MICRO_BATCH_SIZE = 4, 1
SEQ_LEN = 32 if SMOKE else 512
config = models.get_config(PRESET)
print(f"{PRESET}: {models.param_count(config):,} parameters; \
micro-batch {MICRO_BATCH_SIZE} x {SEQ_LEN} tokens")'''),
    ("code", '''\
rows = bench.measure_memory(PRESET, harness.METHODS, NUM_MICRO_BATCHES,
                            micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN)
floor = rows[0].floor
P = floor["param_bytes"]
for r in rows:
  print(f"{r.method:>20}: {r.report['total_bytes'] / 2**30:6.3f} GiB = \
{r.report['total_p']:5.2f} P")
print(f"{'AdamA floor':>20}: {floor['total_bytes'] / 2**30:6.3f} GiB = \
{floor['total_p']:5.2f} P")'''),
    ("markdown", """\
## The anatomy

`memory_analysis()` reports arguments, outputs, temporaries and the bytes where a
donated input is reused as an output. Params, the batch and the optimizer state
are arguments; what the optimizer state holds beyond Adam's m and v (MultiSteps
keeps its gradient accumulator there) counts as a gradient buffer. Of the
temporaries, one micro-batch's activations are measured separately (the temp of a
gradient-only program); the rest of the temp is gradient buffers and other
scratch. (The full-batch step has N micro-batches' worth of activations, so its
"gradient and other" bar includes the extra activations.)"""),
    ("code", '''\
loss_fn, abstract_params = harness.split_model(config)
state_bytes = {  # each method's optimizer state, from its abstract init
    m: optax_adama.memory.tree_bytes(jax.eval_shape(
        harness.make_step(m, loss_fn, num_micro_batches=NUM_MICRO_BATCHES)[1].init, \
abstract_params))
    for m in harness.METHODS}

def anatomy(row):
  r, f = row.report, row.floor
  moments = 2 * P  # Adam's m and v, for every method here
  state_extra = max(state_bytes[row.method] - moments, 0)  # MultiSteps' accumulator
  activations = min(f["activation_bytes"], r["temp_bytes"])
  other = r["total_bytes"] - P - f["batch_bytes"] - moments - state_extra - activations
  return {"params": P, "m + v": moments, "batch": f["batch_bytes"],
          "gradient buffers (state)": state_extra, "activations (1 micro-batch)": activations,
          "gradients and other temp": max(other, 0)}

parts = [anatomy(r) for r in rows]
names = list(parts[0])
fig, ax = plt.subplots(figsize=(9, 4.5))
bottom = np.zeros(len(rows))
for name in names:
  values = np.array([p[name] for p in parts]) / P
  ax.bar([r.method for r in rows], values, bottom=bottom, label=name)
  bottom += values
ax.axhline(floor["total_p"], color="black", linestyle="--", label="AdamA analytic floor")
ax.set_ylabel("compiled step memory (P)")
ax.set_title(f"{PRESET}, N = {NUM_MICRO_BATCHES}, micro-batch {MICRO_BATCH_SIZE} x {SEQ_LEN}")
ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
plt.xticks(rotation=20); plt.tight_layout(); plt.show()'''),
    ("markdown", """\
## Memory against N

More micro-batches shrink the activations of each. Gradient accumulation then hits
a floor of params + m + v + **an accumulator** + a micro-batch gradient; AdamA's
floor has no accumulator."""),
    ("code", '''\
sweep = []
for n in ([1, 4] if SMOKE else [1, 2, 4, 8]):
  sweep += bench.measure_memory(PRESET, ["scan_accumulation", "multisteps", "adama"], n,
                                micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN)
for method in ["scan_accumulation", "multisteps", "adama"]:
  pts = sorted((r.num_micro_batches, r.report["total_p"]) for r in sweep if r.method == method)
  plt.plot(*zip(*pts), marker="o", label=method)
plt.xscale("log", base=2); plt.xlabel("N"); plt.ylabel("compiled step memory (P)")
plt.title(f"{PRESET}: the same micro-batch, N of them per step"); \
plt.grid(alpha=0.3); plt.legend(); plt.show()'''),
    ("markdown", """\
## What the v difference means

AdamA's first moment is exactly Adam's. Its second moment cannot square the mean of
the micro-batch gradients, which it never forms. The paper's estimator (`"mean"`)
averages their squares, E[g_i^2], larger than Adam's (E g_i)^2 by the variance
between micro-batches, so its steps are a little more conservative, never larger; it is
the default. `"momentum"` folds g_i^2 / N^2 and adds (1 - 1/N) m_hat^2 once per
mini-batch, so v expects Adam's own where the mean gradient holds steady, in the same
memory (docs/estimators.md). With N = 1 all of them are Adam."""),
]

SCALE_OUT = [
    ("markdown", """\
# Scale out: AdamA on 8 devices with sharded moments

The same fused step, data parallel over a `jax.sharding.Mesh`. On a laptop or a
free Colab CPU runtime we fake 8 devices; on a multi-GPU or TPU machine the code is
unchanged. `shard_states="zero2"` splits m and v over the devices and
reduce-scatters every micro-batch gradient straight into the slices, so no device
ever holds a full gradient; 8-bit moments shrink the slices a further 4x."""),
    ("code", INSTALL + '''

# Before JAX starts: a CPU backend's device count is fixed when it starts.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") \
+ " --xla_force_host_platform_device_count=8"'''),
    ("code", '''\
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import models, optax_adama
from models import data

mesh = jax.make_mesh((jax.device_count(),), ("data",))
NUM_MICRO_BATCHES, BATCH_SIZE, SEQ_LEN = 4, 64, 32 if SMOKE else 64
STEPS = 5 if SMOKE else 50
model = models.create("gpt_test" if SMOKE else "gpt_tiny", rngs=nnx.Rngs(0))
loss_fn, params0 = models.split_loss_fn(model)
text = data.load_stdlib_text(max_bytes=1_000_000)
batches = [next(data.lm_batches(text.train, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, seed=s)) \
for s in range(STEPS)]
print(jax.device_count(), "devices:", mesh)'''),
    ("markdown", """\
## The same step, three ways

Single device, ZeRO-2 on 8 devices, and ZeRO-2 with 8-bit moments. Params and state
are placed with `step_shardings` once; the step donates them."""),
    ("code", '''\
def run(shard_states=None, quantization=None):
  tx = optax_adama.adamaw(1e-3, num_micro_batches=NUM_MICRO_BATCHES, quantization=quantization)
  params = jax.tree.map(jnp.array, params0)
  opt_state = tx.init(params)
  kwargs = {} if shard_states is None else {"mesh": mesh, "shard_states": shard_states}
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO_BATCHES, **kwargs)
  if shard_states is not None:
    shardings = optax_adama.sharding.step_shardings(params, opt_state, mesh, \
shard_states=shard_states)
    params = jax.device_put(params, shardings.params)
    opt_state = jax.device_put(opt_state, shardings.opt_state)
  report = optax_adama.memory_report(step, params, opt_state, batches[0])
  losses = []
  for batch in batches:
    params, opt_state, metrics = step(params, opt_state, batch)
    losses.append(float(metrics["loss"]))
  return params, losses, report

single, single_losses, single_report = run()
zero2, zero2_losses, zero2_report = run("zero2")
_, q_losses, q_report = run("zero2", optax_adama.BlockQuantization())
gap = max(float(jnp.max(jnp.abs(a - b))) \
for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(zero2)))
print(f"largest param difference, ZeRO-2 vs one device: {gap:.2e}")
print(f"final loss: one device {single_losses[-1]:.4f}, ZeRO-2 {zero2_losses[-1]:.4f}, \
ZeRO-2 + 8-bit {q_losses[-1]:.4f}")'''),
    ("markdown", """\
## Memory per device

For a sharded step, `memory_analysis()` reports one device's program. P is the
bytes of one full copy of the parameters."""),
    ("code", '''\
rows = [("one device, float32 moments", single_report),
        ("ZeRO-2 on 8, float32 moments", zero2_report),
        ("ZeRO-2 on 8, 8-bit moments", q_report)]
for name, r in rows:
  print(f"{name:>30}: arguments {r.in_p(r.argument_bytes):5.2f} P, \
temp {r.in_p(r.temp_bytes):5.2f} P, total {r.in_p(r.total_bytes):5.2f} P")

import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(7, 3.5))
names = [name for name, _ in rows]
args = np.array([r.in_p(r.argument_bytes - r.alias_bytes) for _, r in rows])
reused = np.array([r.in_p(r.alias_bytes) for _, r in rows])
temp = np.array([r.in_p(r.temp_bytes + r.output_bytes) for _, r in rows])
ax.barh(names, reused, label="donated arguments (params, m, v)")
ax.barh(names, args, left=reused, label="other arguments (batch)")
ax.barh(names, temp, left=reused + args, label="temp + fresh outputs")
ax.set_xlabel("compiled memory per device (P)"); ax.invert_yaxis(); ax.legend(fontsize=8)
plt.tight_layout(); plt.show()'''),
    ("markdown", """\
Params stay whole on every device with ZeRO-2 (1 P); m and v drop from 2 P to
2P/8 = 0.25 P, and to about 0.06 P with 8-bit codes: compare the arguments. (The
temp column is not a fair comparison: the one-device step runs all 64 rows of every
mini-batch itself, each of the 8 devices only 8.) `shard_states="fsdp"` splits the
params too.

## Capacity

The benchmark turns these savings into the largest GPT whose step fits a memory
budget, by compile-only search (`python -m models.bench capacity`; with `--devices 8`
the budget is per device). The committed results, from a clone of the repository:"""),
    ("code", '''\
from pathlib import Path
for name in ("capacity.md", "capacity_24gb.md", "capacity_8_devices_4gb.md"):
  table = Path(REPO) / "benchmarks" / "results" / "memory" / "raw" / name
  print(f"{name}:\\n{table.read_text()}" \
if table.exists() else f"{name}: not in this checkout")'''),
]


def to_notebook(cells) -> nbformat.NotebookNode:
  nb = nbformat.v4.new_notebook()
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.metadata["colab"] = {"provenance": []}
  nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown"
              else nbformat.v4.new_code_cell(src) for kind, src in cells]
  return nb


NOTEBOOKS = {"quickstart.ipynb": QUICKSTART, "memory_anatomy.ipynb": ANATOMY,
             "scale_out.ipynb": SCALE_OUT}


def execute(nb: nbformat.NotebookNode, timeout: int = 1800) -> nbformat.NotebookNode:
  NotebookClient(nb, timeout=timeout, kernel_name="python3",
                 resources={"metadata": {"path": str(HERE)}}).execute()
  return nb


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("names", nargs="*", default=list(NOTEBOOKS))
  parser.add_argument("--no-write", action="store_true", help="execute only (CI)")
  args = parser.parse_args(argv)
  for name in args.names:
    start = time.perf_counter()
    nb = execute(to_notebook(NOTEBOOKS[name]))
    print(f"{name}: executed in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if not args.no_write:
      nbformat.write(nb, HERE / name)


if __name__ == "__main__":
  main()
