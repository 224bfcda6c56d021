"""The project's main job (`make demo`): AdamA in its use case, against Adam.

    python -m models.demo                      # about 5 minutes on 2 CPU cores
    python -m models.demo --steps 20 --memory-preset gpt_tiny   # a quick look

AdamA earns its place when two things hold at once: the gradient buffer it
removes is a visible share of the step (activations cut by rematerialization,
so params, moments and gradients are most of the memory), and every
micro-batch holds enough tokens that AdamA's second moment stays close to
Adam's (the study in benchmarks/results/convergence/study.md: 2,048 tokens and up). The demo shows
both halves:

1. Training: the tiny GPT on the offline corpus, N = 4 micro-batches of 32
   sequences x 64 tokens (2,048 tokens each), 300 mini-batch steps, AdamA
   (with its default second-moment estimator, `"mean"`: docs/estimators.md)
   against Adam with a float32
   gradient accumulator, at the same learning rate; held-out loss of both
   and their gap. Both run the scanned model with the LM-head loss in 8
   chunks; AdamA trains through `release_step`, the step measured below.
2. Memory: the same step (same N, 2,048 tokens per micro-batch, here two
   sequences of 1,024) for GPT-2 small, compiled only (`memory_analysis()`,
   nothing allocated): Adam + accumulator under `microbatch_step` with full
   rematerialization, AdamA under `release_step` (which recomputes each layer
   as full rematerialization does, and folds one layer's gradient at a
   time); the bytes each step needs, and what AdamA saves, in GiB, in P and
   in percent. Rematerialization changes what a step keeps, not what it
   computes, so the tiny training runs without it. The chunked loss keeps
   the LM head's logits (0.83 P a copy here) from hiding the gradient buffer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import optax

import models
import optax_adama
from models import harness


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """What the demo trains and what it compiles for the memory comparison."""

  steps: int = 300
  num_micro_batches: int = 4
  micro_batch_size: int = 32  # sequences of 64 tokens: 2,048 tokens.
  learning_rate: float = 2e-3
  seed: int = 0
  # The library's default estimator ("mean").
  nu_estimator: str = harness.DEFAULT_NU_ESTIMATOR
  memory_preset: str = "gpt2_small"
  memory_seq_len: int = 1024
  memory_micro_batch_size: int = 2  # sequences of memory_seq_len.
  # The LM head's loss in chunks (models.savers.chunked_cross_entropy), both
  # optimizers, both halves: exact up to summation order.
  loss_chunks: int = 8

  def train_config(self, optimizer: str) -> harness.TrainConfig:
    adama_options = {"nu_estimator": self.nu_estimator} if optimizer == "adama" else {}
    return harness.TrainConfig(
        model="gpt", optimizer=optimizer, num_micro_batches=self.num_micro_batches,
        batch_size=self.num_micro_batches * self.micro_batch_size, seq_len=64,
        steps=self.steps, learning_rate=self.learning_rate, seed=self.seed,
        scan_layers=True, release=optimizer == "adama", loss_chunks=self.loss_chunks,
        **adama_options)

  def adama(self) -> optax.GradientTransformation:
    return harness.adama_transform("adama", self.learning_rate,
                                   num_micro_batches=self.num_micro_batches,
                                   nu_estimator=self.nu_estimator)


def check(config: DemoConfig) -> None:
  """Raises ``ValueError`` for what the demo would refuse later, before it trains."""
  harness.check_counts(micro_batch_size=config.micro_batch_size,
                       memory_seq_len=config.memory_seq_len)
  for optimizer in ("adama", "adam"):
    harness.check_run(config.train_config(optimizer))
  harness.check_seq_len(config.memory_preset, models.get_config(config.memory_preset),
                        config.memory_seq_len, name="memory_seq_len")


def step_memory(config: DemoConfig) -> dict[str, optax_adama.MemoryReport]:
  """Compile-only memory of the scanned, rematerialized step, per optimizer:
  Adam + accumulator's ``microbatch_step``, AdamA's ``release_step``."""
  model_config = models.get_config(config.memory_preset, remat="full", scan_layers=True,
                                   loss_chunks=config.loss_chunks)
  loss_fn, params = harness.split_model(model_config)
  batch = harness.abstract_batch(
      model_config, config.memory_micro_batch_size * config.num_micro_batches,
      config.memory_seq_len)
  adam, adama = optax.adam(config.learning_rate), config.adama()
  steps = {
      # Adam with a float32 gradient accumulator: the hand-written scan.
      "adam": (adam, optax_adama.microbatch_step(
          loss_fn, adam, num_micro_batches=config.num_micro_batches,
          update_every_micro_batch=False)),
      "adama": (adama, optax_adama.release_step(loss_fn, adama)),
  }
  return {name: optax_adama.memory_report(step, params, jax.eval_shape(tx.init, params), batch)
          for name, (tx, step) in steps.items()}


def summary(config: DemoConfig, runs: dict[str, dict[str, Any]],
            memory: dict[str, optax_adama.MemoryReport]) -> dict[str, Any]:
  """The numbers the demo prints, as a dict (also what --json writes)."""
  adam, adama = memory["adam"], memory["adama"]
  saved = adam.total_bytes - adama.total_bytes
  return {
      "training": {
          "preset": runs["adama"]["preset"],
          "tokens_per_micro_batch": config.micro_batch_size * 64,
          "num_micro_batches": config.num_micro_batches,
          "steps": config.steps,
          "learning_rate": config.learning_rate,
          "nu_estimator": runs["adama"]["config"]["nu_estimator"],
          # What the estimator reads as here ("auto": "split" where micro-batches halve).
          "nu_estimator_reads_as": _reads_as(config),
          "eval_loss": {name: run["eval_loss"] for name, run in runs.items()},
          "eval_gap": runs["adama"]["eval_loss"] / runs["adam"]["eval_loss"] - 1,
      },
      "memory": {
          "preset": config.memory_preset,
          "scan_layers": True,
          "remat": "full",
          "loss_chunks": config.loss_chunks,
          "adama_step": "release_step",
          "tokens_per_micro_batch": config.memory_micro_batch_size * config.memory_seq_len,
          "param_bytes": adama.param_bytes,
          "total_bytes": {"adam": adam.total_bytes, "adama": adama.total_bytes},
          "saved_bytes": saved,
          "saved_fraction": saved / adam.total_bytes,
      },
      "machine": runs["adama"]["machine"],
  }


def _reads_as(config: DemoConfig) -> str:
  """The estimator AdamA's fused step computes for the demo's micro-batches."""
  if config.nu_estimator != "auto" or config.num_micro_batches == 1:
    return config.nu_estimator
  return "split" if config.micro_batch_size % 2 == 0 else "mean"


def report(result: dict[str, Any]) -> str:
  """Human-readable lines of a summary."""
  t, m = result["training"], result["memory"]
  p = m["param_bytes"]
  adam_bytes, adama_bytes = m["total_bytes"]["adam"], m["total_bytes"]["adama"]
  return "\n".join([
      f"Training {t['preset']}: N = {t['num_micro_batches']} micro-batches of "
      f"{t['tokens_per_micro_batch']:,} tokens, {t['steps']} steps, lr {t['learning_rate']:g}, "
      f"AdamA's estimator {t['nu_estimator']!r} ({t['nu_estimator_reads_as']!r} here)",
      f"  held-out loss: Adam + accumulation {t['eval_loss']['adam']:.4f}, "
      f"AdamA {t['eval_loss']['adama']:.4f} ({100 * t['eval_gap']:+.2f}%)",
      f"Step memory of {m['preset']} (scanned layers, remat full, loss in "
      f"{m['loss_chunks']} chunks, {m['tokens_per_micro_batch']:,} tokens per micro-batch), "
      "compile-only:",
      f"  Adam + float32 accumulator {harness.format_bytes(adam_bytes)} ({adam_bytes / p:.2f} P), "
      f"AdamA with gradient release {harness.format_bytes(adama_bytes)} ({adama_bytes / p:.2f} P)",
      f"  AdamA saves {harness.format_bytes(m['saved_bytes'])} ({m['saved_bytes'] / p:.2f} P), "
      f"{100 * m['saved_fraction']:.1f}% of the step.",
  ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  defaults = DemoConfig()
  parser = argparse.ArgumentParser(prog="python -m models.demo",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=defaults.steps)
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
  parser.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size,
                      help="sequences of 64 tokens per micro-batch")
  parser.add_argument("--nu-estimator", choices=harness.NU_ESTIMATOR_NAMES,
                      default=defaults.nu_estimator,
                      help="AdamA's second-moment estimator")
  parser.add_argument("--memory-preset", default=defaults.memory_preset,
                      choices=sorted(p for p, c in models.PRESETS.items()
                                     if harness.MODEL_KIND_OF_CONFIG[type(c)]
                                     in harness.CAUSAL_LM_KINDS),
                      help="the model of the memory half (a causal LM: its loss in chunks)")
  parser.add_argument("--memory-seq-len", type=int, default=defaults.memory_seq_len)
  parser.add_argument("--loss-chunks", type=int, default=defaults.loss_chunks,
                      help="the LM head's loss over this many chunks of tokens (both halves)")
  parser.add_argument("--json", type=Path, default=None, help="write the summary here")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  config = DemoConfig(steps=args.steps, seed=args.seed, learning_rate=args.learning_rate,
                      micro_batch_size=args.micro_batch_size,
                      nu_estimator=args.nu_estimator, memory_preset=args.memory_preset,
                      memory_seq_len=args.memory_seq_len, loss_chunks=args.loss_chunks)
  with harness.command_errors(parser):
    check(config)
  runs = {name: harness.train(config.train_config(name), progress=not args.no_progress)
          for name in ("adama", "adam")}
  result = summary(config, runs, step_memory(config))
  print(report(result))
  if args.json is not None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
