"""What checkpointing every K steps costs a training run, interleaved.

    python benchmarks/scripts/checkpoint_overhead.py --steps 300 --every 100 --rounds 3

Trains the same run (the tiny GPT, `models.train`'s defaults) with and without
`--checkpoint-dir`, alternating the two in each round so that machine noise
falls on both, and compares the wall time of the step loop (the saves and the
wait for the last one included; compile and evaluation excluded). Writes
benchmarks/results/step_time/raw/checkpoint_overhead.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

import models
import optax_adama
from models import checkpoint as checkpointing
from models import harness


def save_costs(config: harness.TrainConfig, saves: int = 7) -> dict:
  """One save of the run's state, taken apart: the time `save` blocks the loop
  (the copy off the device, orbax's bookkeeping) and the time its background
  write takes after that; medians over `saves`, with the state's leaves and bytes."""
  loss_fn, params = models.split_loss_fn(
      models.create(harness.model_config_of(config), rngs=nnx.Rngs(0)), has_aux=True)
  state = {"params": params, "opt_state": harness.make_optimizer(config).init(params)}
  blocking, writing = [], []
  with tempfile.TemporaryDirectory() as directory:
    runs = checkpointing.RunCheckpoints(directory, identity={}, keep=2)
    for step in range(1, saves + 1):
      begin = time.perf_counter()
      runs.save(step, state, {"train_loss": [0.0] * config.steps})
      saved = time.perf_counter()
      runs.wait()
      blocking.append(saved - begin)
      writing.append(time.perf_counter() - saved)
    runs.close()
  return {"leaves": len(jax.tree.leaves(state)),
          "bytes": optax_adama.memory.tree_bytes(state),
          "median_blocking_s": statistics.median(blocking),
          "median_background_write_s": statistics.median(writing)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="gpt_tiny")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--every", type=int, default=100)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", type=Path,
                      default=Path("benchmarks/results/step_time/raw/checkpoint_overhead.json"))
  args = parser.parse_args()
  config = harness.TrainConfig(model="gpt", preset=args.preset, steps=args.steps)
  loops: dict[str, list[float]] = {"none": [], "checkpoint": []}
  with jax.numpy_dtype_promotion("standard"):
    for round_index in range(args.rounds):
      for arm in ("none", "checkpoint") if round_index % 2 == 0 else ("checkpoint", "none"):
        with tempfile.TemporaryDirectory() as directory:
          options = (harness.CheckpointOptions(directory, every=args.every)
                     if arm == "checkpoint" else None)
          run = harness.train(config, progress=False, checkpoint=options)
        loops[arm].append(run["loop_s"])
        print(f"round {round_index} {arm}: {run['loop_s']:.2f} s", flush=True)
  median = {arm: statistics.median(times) for arm, times in loops.items()}
  costs = save_costs(config)
  overhead = median["checkpoint"] / median["none"] - 1
  paired = [c / n - 1 for c, n in zip(loops["checkpoint"], loops["none"])]
  result = {"preset": args.preset, "steps": args.steps, "every": args.every,
            "rounds": args.rounds, "loop_s": loops, "median_loop_s": median,
            "overhead": overhead, "paired_overheads": paired, "one_save": costs,
            "median_step_s_without": median["none"] / args.steps,
            "command": f"python benchmarks/scripts/checkpoint_overhead.py --steps {args.steps} "
                       f"--every {args.every} --rounds {args.rounds}",
            "machine": harness.machine_info()}
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=1))
  print(f"| {args.preset}, {args.steps} steps | no checkpoints | every {args.every} steps | "
        "cost |\n|---|---|---|---|")
  print(f"| step loop, median of {args.rounds} interleaved rounds | {median['none']:.2f} s | "
        f"{median['checkpoint']:.2f} s | {100 * overhead:+.2f}% (paired: "
        + ", ".join(f"{100 * p:+.2f}%" for p in paired) + ") |")
  print(f"one save of {costs['leaves']} leaves, {costs['bytes'] / 1e6:.2f} MB: blocks "
        f"{1e3 * costs['median_blocking_s']:.1f} ms, writes "
        f"{1e3 * costs['median_background_write_s']:.1f} ms more in the background")


if __name__ == "__main__":
  main()
