"""Clipping the mini-batch gradient's global norm without a gradient buffer: a study.

    python benchmarks/scripts/clipping_study.py --seeds 0 1 2 --steps 300 \\
        --sweep-rates 1e-2 2e-2 4e-2 8e-2 --learning-rate <picked from the sweep>

A tiny Llama (``llama_tiny``, byte-level standard-library text, 16 x 64 tokens
per mini-batch, N = 4 micro-batches, warm-up then cosine as ``models.train``)
trained through ``optax_adama.microbatch_step`` with each arm:

- ``adam_acc_clip``: ``optax.chain(optax.clip_by_global_norm(1), optax.adam(lr))``
  with gradient accumulation, the reference;
- ``adam_acc``: ``optax.adam(lr)`` with accumulation, unclipped;
- ``adama``: ``optax_adama.adama(lr)``, unclipped;
- ``adama_clip_elementwise``: ``optax.clip(1)`` per micro-batch before AdamA;
- ``adama_clip_micro_global``: ``optax.clip_by_global_norm(1)`` per micro-batch
  before AdamA (it holds a micro-batch gradient whole: a reference point only);
- ``adama_sketch_lag1``: ``optax_adama.contrib.clip_by_sketched_global_norm(1)`` before
  AdamA (the mini-batch norm from a 2^16-float sketch, applied one mini-batch late);
- ``adama_update_rms``: Adafactor's update clipping,
  ``mini_batch_chain(scale_by_adama(N), optax.clip_by_block_rms(1), scale_by_learning_rate(lr))``;
- ``adama_two_pass``: the exact current-mini-batch factor (a first pass takes the
  mini-batch gradient's norm, the fused step then folds the gradients scaled by
  it, through the loss): what a second forward and backward pass would buy.

First ``--sweep-rates`` runs the two Adam arms at seed 0, to find a rate where
accumulation unclipped spikes and clipped trains. Then every arm at
``--learning-rate`` for each seed: held-out loss, spikes (a step whose training
loss exceeds the median of the previous 20 by more than ``--spike-percent``),
divergence (a non-finite loss, or a final training loss above the first).
Memory: the compiled fused step (``memory_report``, compile only) of a
parameter-heavy Llama (4 layers, width 512, 4 rows of 32 tokens), in P (the
params' bytes). Step time: medians of interleaved rounds of the jitted steps.
Writes ``--json`` and ``--png`` and prints the tables of
benchmarks/results/convergence/clipping.md. ``--costs-only`` measures memory and
time again into an existing ``--json`` (after a change to a transform's code).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
import optax_adama
from models import data
from models.harness import memory as memory_harness
from models.harness.reporting import machine_info
from models.harness.settings import warmup_cosine_schedule

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "convergence"
NUM_MICRO_BATCHES = 4
MAX_NORM = 1.0
ARMS = ("adam_acc_clip", "adam_acc", "adama", "adama_clip_elementwise",
        "adama_clip_micro_global", "adama_sketch_lag1", "adama_update_rms", "adama_two_pass")
# Arms timed and measured for memory (the two-pass arm's cost is a second
# forward and backward pass by construction, ~+100%).
COST_ARMS = ("adama", "adama_sketch_lag1", "adama_sketch_chained", "adama_update_rms",
             "adama_clip_elementwise", "adama_clip_micro_global", "adam_acc", "adam_acc_clip")


def make_tx(arm: str, schedule: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer of an arm (the two-pass arm folds as ``adama``)."""
  n = NUM_MICRO_BATCHES
  adama = lambda: optax_adama.adama(schedule, num_micro_batches=n)
  if arm == "adam_acc_clip":
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(schedule))
  if arm == "adam_acc":
    return optax.adam(schedule)
  if arm in ("adama", "adama_two_pass"):
    return adama()
  if arm == "adama_clip_elementwise":
    return optax.chain(optax.clip(MAX_NORM), adama())
  if arm == "adama_clip_micro_global":
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), adama())
  if arm == "adama_sketch_lag1":  # the shipped design: folded in microbatch_step's scan
    return optax_adama.clipped_by_global_norm(adama(), MAX_NORM)
  if arm == "adama_sketch_chained":  # the same clip before AdamA in optax.chain (cost only)
    return optax.chain(
        optax_adama.contrib.clip_by_sketched_global_norm(MAX_NORM, num_micro_batches=n), adama())
  if arm == "adama_update_rms":
    return optax_adama.mini_batch_chain(
        optax_adama.scale_by_adama(num_micro_batches=n), optax.clip_by_block_rms(MAX_NORM),
        optax.scale_by_learning_rate(schedule))
  raise ValueError(f"unknown arm {arm!r}; known: {ARMS}")


def scaled_loss(loss_fn: Callable) -> Callable:
  """``loss_fn`` times the batch's ``clip_factor`` (the two-pass arm's factor)."""
  def loss(params, batch):
    value, aux = loss_fn(params, {"tokens": batch["tokens"]})
    return value * batch["clip_factor"][0], aux
  return loss


def make_step(arm: str, loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
  """The fused step of an arm: ``step(params, opt_state, batch) -> (params, state, loss)``."""
  if arm != "adama_two_pass":
    fused = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO_BATCHES,
                                        has_aux=True)
    def step(params, opt_state, batch):
      params, opt_state, metrics = fused(params, opt_state, batch)
      return params, opt_state, metrics["loss"]
    return step
  fused = optax_adama.microbatch_step(scaled_loss(loss_fn), tx, has_aux=True)
  # The first pass: the mini-batch gradient's norm (the mean of equal micro-batches'
  # mean losses is the batch's mean loss).
  first_pass = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b)[0]))

  def two_pass_step(params, opt_state, batch):
    loss, grads = first_pass(params, batch)
    norm = optax.tree.norm(grads)
    factor = jnp.where(norm > MAX_NORM, MAX_NORM / norm, 1.0)
    rows = batch["tokens"].shape[0]
    scaled = {"tokens": batch["tokens"], "clip_factor": jnp.full((rows,), factor)}
    params, opt_state, _ = fused(params, opt_state, scaled)
    return params, opt_state, loss
  return two_pass_step


def count_spikes(losses: list[float], percent: float, window: int = 20) -> int:
  """Steps whose loss exceeds the median of the previous ``window`` (fewer before
  step ``window``, from step 5) by more than ``percent``%, or is not finite."""
  spikes = 0
  for i in range(5, len(losses)):
    previous = float(np.median(losses[max(0, i - window):i]))
    if not np.isfinite(losses[i]) or losses[i] > previous * (1 + percent / 100):
      spikes += 1
  return spikes


@dataclasses.dataclass
class Setting:
  """What every convergence run shares."""

  steps: int
  batch_size: int
  seq_len: int
  warmup_steps: int
  eval_batches: int
  spike_percent: float


def train_run(arm: str, learning_rate: float, seed: int, setting: Setting,
              text: data.TextSplits) -> dict[str, Any]:
  """One run: the training curve, held-out loss, spikes and divergence."""
  model = models.create("llama_tiny", rngs=nnx.Rngs(seed))
  loss_fn, params = models.split_loss_fn(model, has_aux=True)
  schedule = warmup_cosine_schedule(learning_rate, setting.steps, setting.warmup_steps)
  tx = make_tx(arm, schedule)
  step = make_step(arm, loss_fn, tx)
  opt_state = tx.init(params)
  batches = data.lm_batches(text.train, batch_size=setting.batch_size,
                            seq_len=setting.seq_len, seed=seed)
  losses = []
  start = time.perf_counter()
  for _, batch in zip(range(setting.steps), batches):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  wall_s = time.perf_counter() - start
  valid = data.lm_batches(text.valid, batch_size=setting.batch_size, seq_len=setting.seq_len,
                          seed=1234, shuffle=False, epochs=1)
  evaluate = jax.jit(lambda p, b: loss_fn(p, b)[0])
  eval_losses = [float(evaluate(params, b)) for _, b in zip(range(setting.eval_batches), valid)]
  final = float(np.mean(losses[-max(1, setting.steps // 20):]))
  diverged = (not all(np.isfinite(losses))) or final > losses[0]
  return {"arm": arm, "learning_rate": learning_rate, "seed": seed, "train_loss": losses,
          "eval_loss": float(np.mean(eval_losses)), "final_train_loss": final,
          "spikes": count_spikes(losses, setting.spike_percent), "diverged": bool(diverged),
          "wall_s": wall_s}


def heavy_llama() -> models.LlamaConfig:
  """A parameter-heavy Llama for the memory and time columns (~16M params)."""
  return dataclasses.replace(models.get_config("llama_tiny"), num_layers=4, hidden=512,
                             mlp_dim=2048, num_heads=8, num_kv_heads=4)


def cost_runs(rounds: int, text: data.TextSplits,
              target: optax_adama.memory.Target | None = None) -> dict[str, dict[str, Any]]:
  """Compiled memory (P) of each cost arm's fused step and interleaved step times,
  on the tiny Llama (16 x 64 tokens) and the heavy one (4 x 32 tokens). With a
  ``target``: memory only, compiled for one device of it by its own compiler."""
  results: dict[str, dict[str, Any]] = {arm: {} for arm in COST_ARMS}
  for model_name, config, batch_size, seq_len in (
      ("llama_tiny", models.get_config("llama_tiny"), 16, 64),
      ("llama_heavy", heavy_llama(), 4 * NUM_MICRO_BATCHES, 32)):
    batch = next(data.lm_batches(text.train, batch_size=batch_size, seq_len=seq_len, seed=0))
    steps, states = {}, {}
    for arm in COST_ARMS:
      loss_fn, params = models.split_loss_fn(models.create(config, rngs=nnx.Rngs(0)),
                                             has_aux=True)
      tx = make_tx(arm, optax.constant_schedule(1e-4))
      fused = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO_BATCHES,
                                          has_aux=True)
      opt_state = tx.init(params)
      args = memory_harness.on_target((params, opt_state, batch), target)
      compiled = optax_adama.memory.compile_for(fused, *args, target=target)
      report = optax_adama.memory_report(
          compiled, param_bytes=optax_adama.memory.tree_bytes(params))
      results[arm][f"{model_name}_memory_p"] = report.total_bytes / report.param_bytes
      results[arm][f"{model_name}_memory_bytes"] = report.total_bytes
      if target is not None:
        continue
      params, opt_state, _ = fused(params, opt_state, batch)  # warm
      steps[arm], states[arm] = fused, (params, opt_state)
    if target is not None:
      print(f"memory {model_name} ({optax_adama.memory.compiled_by(target)}): " + ", ".join(
          f"{a} {results[a][f'{model_name}_memory_p']:.3f} P" for a in COST_ARMS),
            file=sys.stderr, flush=True)
      continue
    times: dict[str, list[float]] = {arm: [] for arm in COST_ARMS}
    for _ in range(rounds):
      for arm in COST_ARMS:
        params, opt_state = states[arm]
        begin = time.perf_counter()
        params, opt_state, metrics = steps[arm](params, opt_state, batch)
        jax.block_until_ready((params, opt_state, metrics))
        times[arm].append(time.perf_counter() - begin)
        states[arm] = (params, opt_state)
    for arm in COST_ARMS:
      results[arm][f"{model_name}_step_s"] = float(np.median(times[arm]))
    print(f"costs {model_name}: " + ", ".join(
        f"{a} {results[a][f'{model_name}_memory_p']:.3f} P "
        f"{results[a][f'{model_name}_step_s'] * 1e3:.1f} ms" for a in COST_ARMS),
          file=sys.stderr, flush=True)
  return results


def sketch_accuracy(text: data.TextSplits, trials: int = 8) -> dict[str, float]:
  """The sketch's relative error of ||g_bar|| on real mini-batch gradients of the
  heavy Llama (more entries than buckets), over ``trials`` mini-batches."""
  loss_fn, params = models.split_loss_fn(models.create(heavy_llama(), rngs=nnx.Rngs(0)),
                                         has_aux=True)
  grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0]))
  tx = optax_adama.contrib.clip_by_sketched_global_norm(MAX_NORM, num_micro_batches=1)
  update = jax.jit(tx.update)
  state = tx.init(params)
  errors = []
  batches = data.lm_batches(text.train, batch_size=4, seq_len=32, seed=0)
  for _, batch in zip(range(trials), batches):
    grads = grad(params, batch)
    _, state = update(grads, state)
    errors.append(float(state.norm_estimate / optax.tree.norm(grads)) - 1)
  return {"num_params": int(sum(x.size for x in jax.tree.leaves(params))),
          "mean_relative_error": float(np.mean(errors)),
          "rms_relative_error": float(np.sqrt(np.mean(np.square(errors))))}


def summarize(runs: list[dict[str, Any]], costs: dict[str, dict[str, Any]],
              learning_rate: float) -> dict[str, dict[str, Any]]:
  """Per arm at ``learning_rate``: held-out losses, their median, the gap to the
  reference, spikes, divergences, memory and time against unclipped AdamA."""
  main = [r for r in runs if r["learning_rate"] == learning_rate]
  by_arm = {arm: sorted((r for r in main if r["arm"] == arm), key=lambda r: r["seed"])
            for arm in ARMS}
  reference = statistics.median(r["eval_loss"] for r in by_arm["adam_acc_clip"])
  summary = {}
  # Cost-only arms (no training runs of their own) after the trained ones.
  for arm in [*ARMS, *(a for a in COST_ARMS if a not in ARMS)]:
    arm_runs = by_arm.get(arm, [])
    if not arm_runs and arm not in costs:
      continue
    row: dict[str, Any] = {}
    if arm_runs:
      median = statistics.median(r["eval_loss"] for r in arm_runs)
      row = {"eval_loss": [r["eval_loss"] for r in arm_runs], "median_eval_loss": median,
             "gap_percent": 100 * (median / reference - 1),
             "spikes": [r["spikes"] for r in arm_runs],
             "diverged": sum(r["diverged"] for r in arm_runs)}
    for key, value in costs.get(arm, {}).items():
      row[key] = value
      base = costs["adama"][key]
      if key.endswith("_memory_p"):
        row[key.replace("_memory_p", "_memory_delta_p")] = value - base
      if key.endswith("_step_s"):
        row[key.replace("_step_s", "_time_percent")] = 100 * (value / base - 1)
    summary[arm] = row
  return summary


def plot(runs: list[dict[str, Any]], learning_rate: float, path: Path) -> None:
  """Training-loss curves (seed 0, smoothed over 10 steps) of every arm."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  figure, axis = plt.subplots(figsize=(9, 5))
  for run in runs:
    if run["learning_rate"] != learning_rate or run["seed"] != 0:
      continue
    losses = np.asarray(run["train_loss"])
    smooth = np.convolve(losses, np.ones(10) / 10, mode="valid")
    axis.plot(np.arange(len(smooth)) + 9, smooth, label=run["arm"],
              linestyle="--" if run["arm"].startswith("adam_") else "-")
  axis.set_xlabel("mini-batch step")
  axis.set_ylabel("training loss (10-step mean)")
  axis.set_ylim(top=4.0)
  axis.set_title(f"llama_tiny, N = {NUM_MICRO_BATCHES}, lr {learning_rate:g}, seed 0")
  axis.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=100)


def markdown(args: argparse.Namespace, sweep: list[dict[str, Any]],
             summary: dict[str, dict[str, Any]], accuracy: dict[str, float],
             machine: dict[str, Any], wall_s: float, targets: tuple[str, ...] = ()) -> str:
  """The results page's tables (the prose around them is written by hand);
  ``targets``: the compile-only targets whose memory columns to add."""
  lines = [f"Command: `python benchmarks/scripts/clipping_study.py "
           f"{shlex.join(sys.argv[1:])}` ({wall_s / 60:.1f} min).",
           f"Machine: {machine.get('cpu', machine.get('device'))}, "
           f"{machine.get('backend')}, jax {jax.__version__}.", "",
           "Rate sweep (seed 0, Adam + accumulation):", "",
           "| lr | arm | held-out loss | spikes | diverged |", "|---|---|---|---|---|"]
  for run in sweep:
    lines.append(f"| {run['learning_rate']:g} | {run['arm']} | {run['eval_loss']:.4f} | "
                 f"{run['spikes']} | {run['diverged']} |")
  if not summary:
    return "\n".join(lines) + "\n"
  lines += ["", f"At lr {args.learning_rate:g}, seeds {args.seeds}; spikes: steps over the "
            f"previous 20 steps' median by > {args.spike_percent:g}%; memory: compiled "
            "fused step of the heavy Llama; time: median of interleaved steps (ms), "
            "tiny / heavy:", "",
            "| arm | held-out loss (median) | per seed | vs reference | spikes per seed | "
            "diverged | memory (P) | vs AdamA (P) | step ms tiny / heavy | vs AdamA |"
            + "".join(f" {t}: memory (P) | vs AdamA (P) |" for t in targets),
            "|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(targets)]
  for arm, row in summary.items():
    seeds = ", ".join(f"{x:.4f}" for x in row.get("eval_loss", []))
    memory = (f"{row['llama_heavy_memory_p']:.3f} | {row['llama_heavy_memory_delta_p']:+.3f}"
              if "llama_heavy_memory_p" in row else "- | -")
    times = (f"{row['llama_tiny_step_s'] * 1e3:.1f} / {row['llama_heavy_step_s'] * 1e3:.1f} | "
             f"{row['llama_tiny_time_percent']:+.1f}% / {row['llama_heavy_time_percent']:+.1f}%"
             if "llama_tiny_step_s" in row else "~2x (two passes) | -")
    on_targets = "".join(
        f" {row[f'{target_key(t)}_llama_heavy_memory_p']:.3f} | "
        f"{row[f'{target_key(t)}_llama_heavy_memory_delta_p']:+.3f} |"
        if f"{target_key(t)}_llama_heavy_memory_p" in row else " - | - |" for t in targets)
    trained = (f"{row['median_eval_loss']:.4f} | {seeds} | {row['gap_percent']:+.2f}% | "
               f"{row['spikes']} | {row['diverged']}" if "eval_loss" in row
               else "- | - | - | - | -")
    lines.append(f"| {arm} | {trained} | {memory} | {times} |{on_targets}")
  lines += ["", f"Sketch accuracy (2^16 buckets) on the heavy Llama's real mini-batch "
            f"gradients ({accuracy['num_params']:,} entries, 8 mini-batches): relative "
            f"error of the norm, mean {100 * accuracy['mean_relative_error']:+.3f}%, "
            f"RMS {100 * accuracy['rms_relative_error']:.3f}%."]
  return "\n".join(lines) + "\n"


def target_key(target: str) -> str:
  """``gpu:h100`` -> ``gpu_h100``: the prefix of a target's keys in the costs."""
  return target.replace(":", "_").replace("-", "_")


def with_target_costs(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """The record's costs, each arm's row with its targets' memory added under
  keys prefixed by :func:`target_key`."""
  costs = {arm: dict(row) for arm, row in record["costs"].items()}
  for target, measured in record.get("target_costs", {}).items():
    for arm, row in measured["costs"].items():
      costs.setdefault(arm, {}).update(
          {f"{target_key(target)}_{key}": value for key, value in row.items()})
  return costs


def remeasure_costs(args: argparse.Namespace) -> None:
  """Memory and step time again (after a change to a transform's code), the
  convergence runs of ``--json`` kept."""
  record = json.loads(args.json.read_text())
  text = data.load_stdlib_text(max_bytes=2_000_000)
  start = time.perf_counter()
  if args.target is None:
    record["costs"] = cost_runs(args.time_rounds, text)
    record["sketch_accuracy"] = sketch_accuracy(text)
    record["costs_wall_s"] = time.perf_counter() - start
    record["costs_argv"] = sys.argv[1:]
  else:
    target = optax_adama.memory.parse_target(args.target)
    record.setdefault("target_costs", {})[args.target] = {
        "compiled_by": optax_adama.memory.compiled_by(target),
        "argv": sys.argv[1:], "costs": cost_runs(0, text, target)}
  rate = record["runs"][0]["learning_rate"]
  record["summary"] = summarize(record["runs"], with_target_costs(record), rate)
  args.json.write_text(json.dumps(record, indent=1))
  args.learning_rate, args.seeds = rate, sorted({r["seed"] for r in record["runs"]})
  args.spike_percent = record["setting"]["spike_percent"]
  tables = markdown(args, record["sweep"], record["summary"], record["sketch_accuracy"],
                    record["machine"], record["wall_s"], tuple(record.get("target_costs", {})))
  if args.markdown is not None:
    args.markdown.write_text(tables)
  print(tables)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--learning-rate", type=float, default=None,
                      help="the rate of the main runs; none: the sweep only")
  parser.add_argument("--sweep-rates", type=float, nargs="*", default=[])
  parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  parser.add_argument("--warmup-steps", type=int, default=20)
  parser.add_argument("--spike-percent", type=float, default=25.0)
  parser.add_argument("--time-rounds", type=int, default=20)
  parser.add_argument("--json", type=Path, default=RESULTS / "raw" / "clipping.json")
  parser.add_argument("--markdown", type=Path, default=None,
                      help="also write the tables here (they are printed either way)")
  parser.add_argument("--png", type=Path, default=RESULTS / "clipping.png")
  parser.add_argument("--costs-only", action="store_true",
                      help="measure memory and time again into an existing --json")
  parser.add_argument("--target", default=None, choices=optax_adama.memory.TARGET_NAMES,
                      help="with --costs-only: memory only, compiled for one device of "
                           "this target by its own compiler (make venv-gpu / venv-tpu)")
  args = parser.parse_args(argv)
  if args.costs_only:
    remeasure_costs(args)
    return
  setting = Setting(steps=args.steps, batch_size=16, seq_len=64,
                    warmup_steps=args.warmup_steps, eval_batches=16,
                    spike_percent=args.spike_percent)
  text = data.load_stdlib_text(max_bytes=2_000_000)
  start = time.perf_counter()
  sweep = []
  for rate in args.sweep_rates:
    for arm in ("adam_acc", "adam_acc_clip"):
      sweep.append(train_run(arm, rate, 0, setting, text))
      print(f"sweep {rate:g} {arm}: eval {sweep[-1]['eval_loss']:.4f} spikes "
            f"{sweep[-1]['spikes']} diverged {sweep[-1]['diverged']}", file=sys.stderr,
            flush=True)
  runs = []
  if args.learning_rate is not None:
    for seed in args.seeds:
      for arm in args.arms:
        runs.append(train_run(arm, args.learning_rate, seed, setting, text))
        print(f"{arm} seed {seed}: eval {runs[-1]['eval_loss']:.4f} spikes "
              f"{runs[-1]['spikes']} diverged {runs[-1]['diverged']} "
              f"({runs[-1]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
  costs = cost_runs(args.time_rounds, text) if args.learning_rate is not None else {}
  accuracy = sketch_accuracy(text)
  summary = summarize(runs, costs, args.learning_rate) if runs else {}
  wall_s = time.perf_counter() - start
  machine = machine_info()
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(
      {"argv": sys.argv[1:], "machine": machine, "setting": dataclasses.asdict(setting),
       "num_micro_batches": NUM_MICRO_BATCHES, "max_norm": MAX_NORM, "sweep": sweep,
       "runs": runs, "costs": costs, "summary": summary, "sketch_accuracy": accuracy,
       "wall_s": wall_s}, indent=1))
  if runs:
    plot(runs, args.learning_rate, args.png)
  tables = markdown(args, sweep, summary, accuracy, machine, wall_s)
  if args.markdown is not None:
    args.markdown.write_text(tables)
  print(tables)


if __name__ == "__main__":
  main()
