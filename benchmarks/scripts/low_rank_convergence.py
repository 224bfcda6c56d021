"""Convergence of AdamA with 8-bit, low-rank and offloaded moments against Adam.

    python benchmarks/scripts/low_rank_convergence.py --seeds 0 1 \
        --out benchmarks/results/convergence/raw/low_rank_convergence.json \
        --markdown benchmarks/results/convergence/low_rank_convergence.md

The protocol of ``models.validate`` for gpt_tiny (same settings, same data
order and initial weights per seed, held-out loss at the end): Adam with
gradient accumulation against AdamA at N = 4 with full float32 moments, 8-bit
moments, low-rank GaLore moments (by default rank 32 = width / 4, refreshed
every 50 mini-batches, embeddings projected too; 8-bit, bf16 projectors) and
the same with the state offloaded to host memory; ``adam_lowrank`` is GaLore
on Adam with gradient accumulation (the same projection, no AdamA), to tell
GaLore's cost from AdamA's. The optimizer of each arm replaces
``models.harness.make_optimizer``'s for its run; everything else is
``models.harness.train``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_adama
from models import harness
from models import validate

NUM_MICRO_BATCHES = 4
ARMS = ("adam", "adama", "adama_8bit", "adama_8bit_lowrank", "adama_8bit_lowrank_offload",
        "adam_lowrank")


def block_kernels(rank: int):
  """The low-rank mask without the embeddings (GaLore projects the blocks only)."""

  def mask(params):
    default = optax_adama.moments.low_rank_mask(params, rank)
    return jax.tree_util.tree_map_with_path(
        lambda path, on: on and "embed" not in jax.tree_util.keystr(path), default)

  return mask


def arm_optimizer(arm: str, config: harness.TrainConfig, rank: int, refresh_period: int,
                  embeddings: bool):
  """The optimizer of an arm, with the run's schedule."""
  schedule = harness.warmup_cosine_schedule(config.learning_rate, config.steps, config.warmup_steps)
  if arm == "adam_lowrank":  # optax's GaLore on the accumulated mean gradient
    return optax_adama.low_rank(
        optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(schedule)),
        rank=rank, refresh_period=refresh_period,
        mask=None if embeddings else block_kernels(rank))
  quantization = optax_adama.BlockQuantization() if "8bit" in arm else None
  tx = optax_adama.adama(schedule, num_micro_batches=config.num_micro_batches,
                         quantization=quantization)
  if "lowrank" in arm:
    tx = optax_adama.low_rank(tx, rank=rank, refresh_period=refresh_period,
                              mask=None if embeddings else block_kernels(rank),
                              projector_dtype=jnp.bfloat16)
  if arm.endswith("_offload"):
    tx = optax_adama.offload_moments(tx)
  return tx


def run(arm: str, seed: int, steps: int, **low_rank) -> dict:
  settings = {**validate.SETTINGS["gpt"], "steps": steps}
  config = harness.TrainConfig(
      model="gpt", optimizer="adama" if arm.startswith("adama") else "adam",
      num_micro_batches=NUM_MICRO_BATCHES, seed=seed, **settings)
  make_optimizer = harness.make_optimizer
  if arm != "adam":
    harness.make_optimizer = lambda c: arm_optimizer(arm, c, **low_rank)
  try:
    result = harness.train(config, progress=False)
  finally:
    harness.make_optimizer = make_optimizer
  return {"arm": arm, "seed": seed, "eval_loss": result["eval_loss"],
          "eval_metrics": result["eval_metrics"], "train_loss": result["train_loss"],
          "memory": result["memory"], "machine": result["machine"]}


def table(runs: list[dict], command: str, settings: str) -> str:
  adam = {r["seed"]: r["eval_loss"] for r in runs if r["arm"] == "adam"}
  lines = [f"Command: `{command}`", "", f"Low-rank arms: {settings}.", "",
           "| arm (gpt_tiny, N = 4) | seeds | held-out loss | rel. diff to Adam "
           "| max paired | compiled step memory |", "|---|---|---|---|---|---|"]
  for arm in ARMS:
    mine = [r for r in runs if r["arm"] == arm]
    if not mine:
      continue
    losses = np.array([r["eval_loss"] for r in mine])
    paired = [r["eval_loss"] / adam[r["seed"]] - 1 for r in mine if r["seed"] in adam]
    rel = f"{100 * (losses.mean() / np.mean(list(adam.values())) - 1):+.2f}%" if adam else ""
    worst = f"{100 * max(paired, key=abs):+.2f}%" if paired and arm != "adam" else ""
    memory = mine[0]["memory"]
    lines.append(f"| {arm} | {len(mine)} | {losses.mean():.4f} ± {losses.std():.4f} | "
                 f"{'' if arm == 'adam' else rel} | {worst} | "
                 f"{memory['total_bytes'] / 2**20:.1f} MiB ({memory['total_p']:.2f} P) |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--steps", type=int, default=validate.SETTINGS["gpt"]["steps"])
  parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
  parser.add_argument("--rank", type=int, default=32, help="gpt_tiny's width / 4")
  parser.add_argument("--refresh-period", type=int, default=50, help="in mini-batches")
  parser.add_argument("--blocks-only", action="store_true",
                      help="project the blocks' kernels only, not the embeddings")
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--markdown", type=Path, required=True)
  args = parser.parse_args(argv)
  command = ("python benchmarks/scripts/low_rank_convergence.py "
             + " ".join(sys.argv[1:] if argv is None else argv))
  settings = (f"rank {args.rank}, refreshed every {args.refresh_period} mini-batches, "
              + ("blocks' kernels only" if args.blocks_only else "embeddings projected too"))
  runs = []
  for seed in args.seeds:
    for arm in args.arms:
      runs.append(run(arm, seed, args.steps, rank=args.rank,
                      refresh_period=args.refresh_period, embeddings=not args.blocks_only))
      print(arm, seed, runs[-1]["eval_loss"], flush=True)
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(
          {"command": command, "rank": args.rank, "refresh_period": args.refresh_period,
           "blocks_only": args.blocks_only, "runs": runs}, indent=1))
      args.markdown.write_text(table(runs, command, settings) + "\n")
  print(table(runs, command, settings))


if __name__ == "__main__":
  main()
