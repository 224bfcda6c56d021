"""The at-scale check's CPU stand-in: AdamA's default against Adam + accumulation, long.

    PYTHONPATH=. python benchmarks/scripts/cpu_stand_in.py       # trains both, ~70 min
    PYTHONPATH=. python benchmarks/scripts/cpu_stand_in.py \
        --metrics benchmarks/results/convergence/raw/cpu_stand_in.json
    PYTHONPATH=. python benchmarks/scripts/cpu_stand_in.py --retrain-default   # AdamA's, ~35 min

Without a GPU the largest run this project makes is the tiny GPT on the offline
corpus for about 35 minutes a side on 2 CPU cores: `models.train --compare`
(the same data, init and schedule for both), N = 4 micro-batches of 32
sequences x 64 tokens, 3,000 steps, warm-up + cosine from 2e-3. Writes the
raw runs (``--metrics``), their training curves (``--plot``) and a table
(``--markdown``). ``--metrics`` of an existing file only plots and tabulates;
with ``--retrain-default`` it trains AdamA again with today's default
estimator (Adam's side does not depend on it), keeps Adam's run, and keeps
an earlier AdamA run under another estimator as a row of its own.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from models import harness
from models import train

# The result page, its plot and its raw runs, from the checkout's root.
RESULTS = Path("benchmarks/results/convergence")
TRAIN_ARGS = ["--model", "gpt", "--preset", "gpt_tiny", "--compare", "--num-micro-batches",
              "4", "--batch-size", "128", "--seq-len", "64", "--steps", "3000",
              "--learning-rate", "2e-3", "--warmup-steps", "100", "--no-progress"]


def _train_args(steps: int | None, *extra: str) -> list[str]:
  """``TRAIN_ARGS`` with ``--steps`` overridden (if given), then ``extra``."""
  args = list(TRAIN_ARGS)
  if steps is not None:
    args[args.index("--steps") + 1] = str(steps)
  return args + list(extra)


def _label(run) -> str:
  config = run["config"]
  if config["optimizer"] != "adama":
    return "Adam + accumulation (float32)"
  if config["nu_estimator"] == harness.DEFAULT_NU_ESTIMATOR:
    return f"AdamA (default, nu_estimator={config['nu_estimator']!r})"
  return f"AdamA (nu_estimator={config['nu_estimator']!r}, an earlier default)"


def _setting_differences(config: dict, stored: dict) -> dict:
  """Where a config differs from a stored run's, beyond the optimizer and its
  estimator. A field the stored run does not have (added to
  ``harness.TrainConfig`` since) counts only if it is off its default."""
  defaults = {f.name: f.default for f in dataclasses.fields(harness.TrainConfig)}
  ignored = {"optimizer", "nu_estimator"}
  return {key: (value, stored.get(key, defaults.get(key)))
          for key, value in config.items()
          if key not in ignored and value != stored.get(key, defaults.get(key))}


def retrain_default(runs, steps: int | None = None):
  """Trains AdamA's side again under today's default estimator.

  Args:
    runs: the stored runs (AdamA's first, Adam + accumulation's last).
    steps: the override of ``--steps`` the stored runs were made with, if any.

  Returns:
    The new default run first, then every stored AdamA run under another
    estimator, then Adam's run, unchanged.

  Raises:
    ValueError: before any training, if the stored Adam run was made in
      another setting than the one AdamA would be trained in now.
  """
  adam = runs[-1]
  train_args = [a for a in _train_args(steps, "--optimizer", "adama") if a != "--compare"]
  config = dataclasses.asdict(train.train_config(train_args))
  differences = _setting_differences(config, adam["config"])
  if differences:
    raise ValueError(f"the stored Adam run was made in another setting ({differences}, "
                     "now against stored); train both again (move the metrics file away)")
  default = train.main(train_args)[0]
  earlier = [r for r in runs[:-1]
             if r["config"]["nu_estimator"] != default["config"]["nu_estimator"]]
  return [default, *earlier, adam]


def markdown(runs, metrics_path: Path, plot_path: Path) -> str:
  adama, adam = runs[0], runs[-1]
  config = adama["config"]
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
      "Made by `PYTHONPATH=. python benchmarks/scripts/cpu_stand_in.py` "
      + ("(the default's row by `... --retrain-default`) " if len(runs) > 2 else "")
      + f"(raw runs: [{metrics_path.name}](raw/{metrics_path.name})).",
      "",
      "| run | held-out loss | final training loss (last 5%) | median step | loop |",
      "|---|---|---|---|---|",
  ]
  for run in runs:
    lines.append(f"| {_label(run)} | {run['eval_loss']:.4f} | {run['final_train_loss']:.4f} "
                 f"| {1e3 * run['median_step_s']:.0f} ms | {run['loop_s'] / 60:.1f} min |")
  lines.append("")
  for run in runs[:-1]:
    gap = run["eval_loss"] / adam["eval_loss"] - 1
    lines.append(f"Held-out gap, {_label(run)} against Adam: **{100 * gap:+.2f}%** "
                 "(target: within 1%).")
    lines.append("")
  lines += [f"![training curves]({plot_path.name})", ""]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--metrics", type=Path, default=RESULTS / "raw" / "cpu_stand_in.json")
  parser.add_argument("--plot", type=Path, default=RESULTS / "cpu_stand_in.png")
  parser.add_argument("--markdown", type=Path, default=RESULTS / "cpu_stand_in.md")
  parser.add_argument("--steps", type=int, default=None, help="override the 3,000 steps")
  parser.add_argument("--retrain-default", action="store_true",
                      help="train AdamA's side again with the default estimator; keep the rest")
  args = parser.parse_args(argv)
  if args.retrain_default:
    if not args.metrics.exists():
      parser.error(f"--retrain-default needs the stored runs; {args.metrics} does not exist")
    runs = retrain_default(json.loads(args.metrics.read_text())["runs"], args.steps)
    args.metrics.write_text(json.dumps({"runs": runs}, indent=1))
  elif not args.metrics.exists():
    train.main(_train_args(args.steps, "--metrics-out", str(args.metrics)))
  runs = json.loads(args.metrics.read_text())["runs"]
  harness.plot_loss_curves(runs, _label, args.plot)
  args.markdown.write_text(markdown(runs, args.metrics, args.plot))
  print(args.markdown.read_text())


if __name__ == "__main__":
  sys.exit(main())
