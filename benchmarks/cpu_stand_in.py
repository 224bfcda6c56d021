"""The at-scale check's CPU stand-in: AdamA's default against Adam + accumulation, long.

    PYTHONPATH=. python benchmarks/cpu_stand_in.py             # trains both, ~20 min
    PYTHONPATH=. python benchmarks/cpu_stand_in.py --metrics benchmarks/raw/cpu_stand_in.json

Without a GPU the largest run this project makes is the tiny GPT on the offline
corpus for about ten minutes a side on 2 CPU cores: `models.train --compare`
(the same data, init and schedule for both), N = 4 micro-batches of 32
sequences x 64 tokens, 3,000 steps, warm-up + cosine from 2e-3. Writes the
raw runs (``--metrics``), their training curves (``--plot``) and a table
(``--markdown``). ``--metrics`` of an existing file only plots and tabulates.
"""

import argparse
import json
import sys
from pathlib import Path

from models import harness
from models import train

TRAIN_ARGS = ["--model", "gpt", "--preset", "gpt_tiny", "--compare", "--num-micro-batches",
              "4", "--batch-size", "128", "--seq-len", "64", "--steps", "3000",
              "--learning-rate", "2e-3", "--warmup-steps", "100", "--no-progress"]


def _label(run) -> str:
  config = run["config"]
  if config["optimizer"] == "adama":
    return f"AdamA (default, nu_estimator={config['nu_estimator']!r})"
  return "Adam + accumulation (float32)"


def markdown(runs, metrics_path: Path, plot_path: Path) -> str:
  adama, adam = runs
  config = adama["config"]
  gap = adama["eval_loss"] / adam["eval_loss"] - 1
  lines = [
      "# At scale, CPU stand-in: the default against Adam + accumulation",
      "",
      "No GPU was lent, so this is the CPU stand-in of the at-scale check: "
      f"`{adama['preset']}` "
      f"({adama['param_count']:,} parameters) on the offline corpus, "
      f"N = {config['num_micro_batches']} micro-batches of "
      f"{config['batch_size'] // config['num_micro_batches']} sequences x "
      f"{config['seq_len']} tokens, {config['steps']:,} steps, warm-up + cosine from "
      f"{config['learning_rate']:g}, seed {config['seed']}, on {adama['machine']['device']}. "
      "Made by `PYTHONPATH=. python benchmarks/cpu_stand_in.py` "
      f"(raw runs: [{metrics_path.name}](raw/{metrics_path.name})).",
      "",
      "| run | held-out loss | final training loss (last 5%) | median step | loop |",
      "|---|---|---|---|---|",
  ]
  for run in runs:
    lines.append(f"| {_label(run)} | {run['eval_loss']:.4f} | {run['final_train_loss']:.4f} "
                 f"| {1e3 * run['median_step_s']:.0f} ms | {run['loop_s'] / 60:.1f} min |")
  lines += ["", f"Held-out gap, AdamA against Adam: **{100 * gap:+.2f}%** (target: within 1%).",
            "", f"![training curves]({plot_path.name})", ""]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--metrics", type=Path, default=Path("benchmarks/raw/cpu_stand_in.json"))
  parser.add_argument("--plot", type=Path, default=Path("benchmarks/cpu_stand_in.png"))
  parser.add_argument("--markdown", type=Path, default=Path("benchmarks/cpu_stand_in.md"))
  parser.add_argument("--steps", type=int, default=None, help="override the 3,000 steps")
  args = parser.parse_args(argv)
  if not args.metrics.exists():
    train_args = TRAIN_ARGS + ["--metrics-out", str(args.metrics)]
    if args.steps is not None:
      train_args[train_args.index("--steps") + 1] = str(args.steps)
    train.main(train_args)
  runs = json.loads(args.metrics.read_text())["runs"]
  harness.plot_loss_curves(runs, _label, args.plot)
  args.markdown.write_text(markdown(runs, args.metrics, args.plot))
  print(args.markdown.read_text())


if __name__ == "__main__":
  sys.exit(main())
