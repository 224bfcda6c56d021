"""AdamA's step with the update once per mini-batch against once per micro-batch.

    PYTHONPATH=. python benchmarks/scripts/fold_then_update_speed.py \
        --json benchmarks/results/step_time/raw/fold_then_update_speed.json

`microbatch_step` with a bare AdamA (`optax_adama.adama`) scans folds only and
applies AdamA's direction once, after the N-th fold. The same AdamA under
`optax.chain` is opaque to the step, which then calls `tx.update` on every
micro-batch and adds its (zero until the N-th) updates to params in the scan:
a params-sized read and write per micro-batch. This times both against scan
accumulation (`optax.adam` with a gradient-sum carry), interleaved: each round
runs a few steps of every method in turn, and the table gives medians over
rounds and the median of the per-round ratios. Models: an MLP whose step is
dominated by parameter-sized elementwise work (large params, few rows), where
the difference shows, and the tiny GPT, where compute dominates. Compile-only
memory of each step is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

import models
import optax_adama
from models import harness


def mlp_problem(width: int = 2048, num_layers: int = 8, rows: int = 8, num_micro_batches: int = 4):
  """(loss_fn, params, batch) of a tanh MLP with ``rows`` rows per micro-batch."""
  key = jax.random.PRNGKey(0)

  def loss_fn(params, batch):
    x = batch["x"]
    for w in params["w"]:
      x = jnp.tanh(x @ w)
    return jnp.mean((x - batch["y"]) ** 2)

  params = {"w": [jax.random.normal(jax.random.fold_in(key, i), (width, width)) / width**0.5
                  for i in range(num_layers)]}
  batch = {"x": jax.random.normal(key, (num_micro_batches * rows, width)),
           "y": jnp.zeros((num_micro_batches * rows, width))}
  return loss_fn, params, batch


def preset_problem(preset: str, micro_batch_size: int = 8, num_micro_batches: int = 4):
  config = models.get_config(preset)
  loss_fn, abstract = harness.split_model(config)
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), abstract)
  batch = harness.random_batch(
      config, harness.abstract_batch(config, micro_batch_size * num_micro_batches))
  return loss_fn, params, batch


def methods(num_micro_batches: int) -> dict[str, tuple[optax.GradientTransformation, dict]]:
  adama = lambda: optax_adama.adama(1e-4, num_micro_batches=num_micro_batches)
  return {
      "scan_accumulation": (optax.adam(1e-4), dict(
          num_micro_batches=num_micro_batches, update_every_micro_batch=False)),
      "adama (update once)": (adama(), {}),
      "adama in optax.chain (update per micro-batch)": (optax.chain(adama()), {}),
  }


def time_methods(loss_fn, params, batch, num_micro_batches: int, rounds: int,
                 steps_per_round: int) -> dict[str, dict[str, float]]:
  """Per method: median step seconds, median per-round ratio to scan accumulation, total P."""
  runs = {}
  for name, (tx, kwargs) in methods(num_micro_batches).items():
    step = optax_adama.microbatch_step(loss_fn, tx, **kwargs)
    p = jax.tree.map(jnp.copy, params)
    state = tx.init(p)
    report = optax_adama.memory_report(step, p, state, batch)
    p, state, _ = step(p, state, batch)  # compile and warm up
    jax.block_until_ready(p)
    runs[name] = {"step": step, "carry": (p, state), "times": [],
                  "total_p": report.total_bytes / optax_adama.memory.tree_bytes(params)}
  for _ in tqdm(range(rounds), desc="rounds"):
    for run in runs.values():
      p, state = run["carry"]
      start = time.perf_counter()
      for _ in range(steps_per_round):
        p, state, _ = run["step"](p, state, batch)
      jax.block_until_ready(p)
      run["times"].append((time.perf_counter() - start) / steps_per_round)
      run["carry"] = (p, state)
  base = runs["scan_accumulation"]["times"]
  return {name: {"median_step_s": statistics.median(run["times"]),
                 "ratio_to_scan_accumulation": statistics.median(
                     t / b for t, b in zip(run["times"], base)),
                 "total_p": run["total_p"]}
          for name, run in runs.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--steps-per-round", type=int, default=3)
  parser.add_argument("--num-micro-batches", type=int, default=4)
  parser.add_argument("--presets", nargs="*", default=["gpt_tiny"])
  parser.add_argument("--json", type=Path, default=None)
  args = parser.parse_args(argv)
  n = args.num_micro_batches
  problems = {"mlp 8 x 2048, 8 rows per micro-batch": lambda: mlp_problem(num_micro_batches=n)}
  problems.update({f"{p}, 8 examples per micro-batch": (lambda p=p: preset_problem(p, 8, n))
                   for p in args.presets})
  results = {}
  for label, make in problems.items():
    results[label] = time_methods(*make(), n, args.rounds, args.steps_per_round)
    for name, r in results[label].items():
      print(f"{label} | {name} | {r['median_step_s'] * 1e3:.1f} ms | "
            f"x{r['ratio_to_scan_accumulation']:.3f} | {r['total_p']:.3f} P", flush=True)
  if args.json:
    args.json.write_text(json.dumps({"num_micro_batches": n, "results": results,
                                     "machine": harness.machine_info()}, indent=1))


if __name__ == "__main__":
  main()
