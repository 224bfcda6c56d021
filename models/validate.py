"""Does AdamA converge like Adam? Train each tiny model with both and compare.

    python -m models.validate                     # the committed experiment
    python -m models.validate --models vit --seeds 0 --steps 50   # a quick look
    python -m models.validate study ...   # estimators x micro-batch size (models.harness.study)
    python -m models.validate rho ...     # v / v_adam along Adam's path
    python -m models.validate curves ...  # Adam and the default, training curves per cell

For each model (GPT on the standard-library byte corpus, BERT masked-LM on the
same corpus, ViT on scikit-learn's digits) and each seed, trains

- Adam on the whole mini-batch (the same math as Adam with gradient
  accumulation: the mean of micro-batch mean gradients is the mini-batch mean),
- AdamA with the same mini-batch split into N micro-batches, N in {2, 4, 8},

from the same initial weights on the same data order, and writes
``convergence.md`` (final held-out loss, mean ± std over seeds, and the relative
difference to Adam), ``convergence.png`` (training curves) and the raw runs as
JSON. Target: AdamA within 1% of Adam's held-out loss for every model and N.

The experiment is this command's own; the training run is
`models.harness.train`, and what `study`, `rho` and `curves` run is
`models.harness.study`'s (their figures `models.harness.study_plots`'); their
command line is here (`study_main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import optax_adama
from models import harness
from models.harness import study
from models.harness import study_plots

# Per-model settings: enough steps for the curves to flatten on two CPU cores.
# BERT (post-LN) needs the lower learning rate to leave the unigram plateau.
SETTINGS: dict[str, dict[str, Any]] = {
    "gpt": {"steps": 600, "learning_rate": 2e-3, "batch_size": 32, "seq_len": 64},
    "bert": {"steps": 600, "learning_rate": 1e-3, "batch_size": 32, "seq_len": 64},
    "vit": {"steps": 600, "learning_rate": 2e-3, "batch_size": 32},
}


@dataclasses.dataclass(frozen=True)
class Arm:
  """One optimizer setting of the experiment."""

  optimizer: str
  num_micro_batches: int

  @property
  def label(self) -> str:
    return "Adam" if self.optimizer == "adam" else f"AdamA N={self.num_micro_batches}"


def arms(num_micro_batches: Sequence[int]) -> list[Arm]:
  return [Arm("adam", 1)] + [Arm("adama", n) for n in num_micro_batches]


def run_experiment(
    model_kinds: Sequence[str],
    seeds: Sequence[int],
    num_micro_batches: Sequence[int],
    *,
    steps: int | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
  """Trains every (model, seed, arm) and returns the runs."""
  runs = []
  for arm, config in tqdm(experiment(model_kinds, seeds, num_micro_batches, steps=steps),
                          desc="validate", disable=not progress, file=sys.stderr):
    run = harness.train(config, progress=False)
    run["arm"] = arm.label
    runs.append(run)
  return runs


def experiment(model_kinds: Sequence[str], seeds: Sequence[int],
               num_micro_batches: Sequence[int], *,
               steps: int | None = None) -> list[tuple[Arm, harness.TrainConfig]]:
  """Every (model, seed, arm) run, built (and so checked) before any trains.

  Raises:
    ValueError: for a model kind without settings here, or a run that
      ``harness.TrainConfig`` refuses (an N that does not split the mini-batch).
  """
  unknown = sorted(set(model_kinds) - set(SETTINGS))
  if unknown:
    raise ValueError(f"models={unknown}: this experiment has settings for {sorted(SETTINGS)}.")
  jobs = []
  for model_kind in model_kinds:
    settings = dict(SETTINGS[model_kind], **({} if steps is None else {"steps": steps}))
    jobs += [(arm, harness.TrainConfig(model=model_kind, optimizer=arm.optimizer,
                                       num_micro_batches=arm.num_micro_batches, seed=seed,
                                       **settings))
             for seed in seeds for arm in arms(num_micro_batches)]
  return jobs


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per (model, arm): eval loss mean/std over seeds, relative to Adam."""
  rows = []
  for model_kind in dict.fromkeys(r["config"]["model"] for r in runs):
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
      if r["config"]["model"] == model_kind:
        by_arm.setdefault(r["arm"], []).append(r)
    adam = by_arm.get("Adam")
    adam_by_seed = {r["config"]["seed"]: r["eval_loss"] for r in adam} if adam else {}
    adam_mean = float(np.mean(list(adam_by_seed.values()))) if adam else float("nan")
    for label, group in by_arm.items():
      losses = np.array([r["eval_loss"] for r in group])
      # Paired by seed: same init and data, so the seed-to-seed spread cancels.
      paired = [r["eval_loss"] / adam_by_seed[r["config"]["seed"]] - 1
                for r in group if r["config"]["seed"] in adam_by_seed]
      accuracy = [r["eval_metrics"].get("accuracy") for r in group]
      rows.append({
          "model": model_kind,
          "preset": group[0]["preset"],
          "arm": label,
          "num_micro_batches": group[0]["config"]["num_micro_batches"],
          "seeds": len(group),
          "steps": group[0]["config"]["steps"],
          "eval_loss_mean": float(losses.mean()),
          "eval_loss_std": float(losses.std(ddof=1)) if len(losses) > 1 else 0.0,
          "rel_diff_to_adam": float(losses.mean() / adam_mean - 1),
          "paired_rel_diff_max": float(np.max(np.abs(paired))) if paired else float("nan"),
          "eval_accuracy_mean": (float(np.mean(accuracy))
                                 if all(a is not None for a in accuracy) else None),
      })
  return rows


def markdown(rows: Sequence[dict[str, Any]], command: str, machine: dict[str, Any]) -> str:
  lines = [
      "# AdamA vs Adam: convergence",
      "",
      f"Command: `{command}`  ",
      f"Machine: {machine['cpu']} CPU ({machine['backend']}), jax {machine['jax']}, "
      f"optax {machine['optax']}, Python {machine['python']}.",
      "",
      "Final held-out loss, mean ± std over seeds. *rel. diff* compares the means; "
      "*max paired* is the largest per-seed difference (same init, same data).",
      "",
      "| model | optimizer | steps | seeds | eval loss | eval accuracy | rel. diff to Adam "
      "| max paired | within 1% |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    acc = "" if r["eval_accuracy_mean"] is None else f"{r['eval_accuracy_mean']:.4f}"
    within = ("" if r["arm"] == "Adam"
              else "yes" if abs(r["rel_diff_to_adam"]) <= 0.01 else "**no**")
    rel = "" if r["arm"] == "Adam" else f"{100 * r['rel_diff_to_adam']:+.2f}%"
    paired = "" if r["arm"] == "Adam" else f"{100 * r['paired_rel_diff_max']:.2f}%"
    lines.append(
        f"| {r['preset']} | {r['arm']} | {r['steps']} | {r['seeds']} "
        f"| {r['eval_loss_mean']:.4f} ± {r['eval_loss_std']:.4f} | {acc} | {rel} "
        f"| {paired} | {within} |")
  return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict[str, Any]], path: Path, *, smooth: int = 20) -> None:
  """Training-loss curves, mean over seeds, one panel per model."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  kinds = list(dict.fromkeys(r["config"]["model"] for r in runs))
  fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
  for ax, kind in zip(axes[0], kinds):
    labels = list(dict.fromkeys(r["arm"] for r in runs if r["config"]["model"] == kind))
    for label in labels:
      curves = np.array([r["train_loss"] for r in runs
                         if r["config"]["model"] == kind and r["arm"] == label])
      mean = curves.mean(axis=0)
      kernel = np.ones(min(smooth, len(mean))) / min(smooth, len(mean))
      smoothed = np.convolve(mean, kernel, mode="valid")
      style = {"color": "black", "linewidth": 2.0} if label == "Adam" else {"linewidth": 1.2}
      ax.plot(np.arange(len(smoothed)) + len(kernel), smoothed, label=label, **style)
    preset = next(r["preset"] for r in runs if r["config"]["model"] == kind)
    ax.set_title(f"{preset} (mean of seeds, {smooth}-step average)")
    ax.set_xlabel("mini-batch step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  harness.save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]] | None:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] in (["study"], ["rho"], ["curves"]):  # the estimator study
    return study_main(argv)
  parser = argparse.ArgumentParser(prog="python -m models.validate",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  parser.add_argument("--num-micro-batches", nargs="+", type=int, default=[2, 4, 8])
  parser.add_argument("--steps", type=int, default=None,
                      help="override every model's step count (quick looks)")
  parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/convergence"))
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  with harness.command_errors(parser):  # every run checked before the first trains
    for _, config in experiment(args.models, args.seeds, args.num_micro_batches,
                                steps=args.steps):
      harness.check_run(config)
  runs = run_experiment(args.models, args.seeds, args.num_micro_batches,
                        steps=args.steps, progress=not args.no_progress)
  rows = summarize(runs)
  command = "python -m models.validate " + " ".join(sys.argv[1:] if argv is None else argv)
  text = markdown(rows, command.strip(), runs[0]["machine"])
  args.out_dir.mkdir(parents=True, exist_ok=True)
  (args.out_dir / "convergence.md").write_text(text)
  plot(runs, args.out_dir / "convergence.png")
  (args.out_dir / "raw").mkdir(exist_ok=True)
  (args.out_dir / "raw" / "convergence.json").write_text(
      json.dumps({"rows": rows, "runs": runs}, indent=1))
  print(text)
  return rows



def parse_cell(text: str) -> tuple[str, int, int] | tuple[str, int, int, int]:
  """``"gpt:4:32"`` -> (model, N, examples per micro-batch), checked;
  ``"vit_mnist:4:64:100"`` adds the run length the cell is drawn at."""
  try:
    model, *numbers = text.split(":")
    if len(numbers) not in (2, 3):
      raise ValueError(text)
    cell = (model, *map(int, numbers))
  except ValueError:
    raise argparse.ArgumentTypeError(
        "a cell is MODEL:N:EXAMPLES_PER_MICRO_BATCH[:STEPS] (e.g. gpt:4:32, "
        f"vit_mnist:4:64:100), got {text!r}") from None
  if model not in study.STUDY_MODELS:
    raise argparse.ArgumentTypeError(f"model {model!r} is not one of {study.STUDY_MODELS}")
  return cell


def _study_parser() -> argparse.ArgumentParser:
  """The command line of `study`, `rho` and `curves` (`models.harness.study`)."""
  parser = argparse.ArgumentParser(prog="python -m models.validate study|rho",
                                   description=study.__doc__.split("\n\n")[0])
  parser.add_argument("command", choices=("study", "rho", "curves"))
  parser.add_argument("--models", nargs="+", choices=study.STUDY_MODELS, default=["gpt"])
  parser.add_argument("--arms", nargs="+", choices=study.ARMS, default=list(study.ARMS))
  parser.add_argument("--num-micro-batches", nargs="+", type=int, default=[4, 8])
  parser.add_argument("--micro-batch-sizes", nargs="+", type=int, default=[4],
                      help="examples per micro-batch")
  parser.add_argument("--lr-factors", nargs="+", type=float, default=[0.5, 1.0, 2.0])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0],
                      help="study: seeds of every run; rho: the first is its seed")
  parser.add_argument("--follow", choices=("adam",) + optax_adama.contrib.NU_ESTIMATORS,
                      default="adam", help="rho: whose path to follow (default: Adam's)")
  parser.add_argument("--best-seeds", nargs="*", type=int, default=[],
                      help="extra seeds, run at each arm's best rate only")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--results", type=Path,
                      default=Path("benchmarks/results/convergence/raw/study.jsonl"))
  parser.add_argument("--rows", type=Path, default=None,
                      help="rho: measure every model x N x micro-batch size cell, add "
                      "one JSON row per cell to this file (cells already there are "
                      "skipped) and write <out-dir>/<its stem>.md, their table against "
                      "the tail targets, instead of rho.png and raw/rho.json")
  parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/convergence"))
  parser.add_argument("--cells", nargs="+", type=parse_cell, default=[],
                      metavar="MODEL:N:SIZE[:STEPS]",
                      help="curves: the cells to draw from --results, e.g. gpt:4:32 "
                           "vit_mnist:4:64:100 (without STEPS, --steps)")
  parser.add_argument("--no-progress", action="store_true")
  return parser


def study_main(argv: Sequence[str]) -> None:
  """`study`, `rho` and `curves`: the estimator study, the tails of v and their curves."""
  parser = _study_parser()
  args = parser.parse_args(argv)
  command = "python -m models.validate " + " ".join(argv)
  if args.command == "curves":
    if not args.cells:
      parser.error("curves needs --cells MODEL:N:SIZE ...")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    study_plots.plot_curves(study.load_results(args.results), args.cells,
                            args.out_dir / "study_curves.png", steps=args.steps)
    return
  if args.command == "rho" and args.rows is not None:
    table = args.out_dir / f"{args.rows.stem}.md"
    study.run_rho_rows(args.models, args.num_micro_batches, args.micro_batch_sizes, args.steps,
                 args.seeds[0], args.follow, args.rows, table, command=command)
    print(table.read_text())
    return
  if args.command == "rho":
    diagnoses = {}
    for kind in args.models:
      for size in args.micro_batch_sizes:
        for n in args.num_micro_batches:
          d = study.measure_rho(kind, n, size, args.steps, args.seeds[0], args.follow)
          path = "" if args.follow == "adam" else f", {args.follow!r}'s path"
          # One size keeps the names the plots and raw files always had.
          per = "" if len(args.micro_batch_sizes) == 1 else f", {size} per micro-batch"
          diagnoses[f"{kind} N={n}{per}{path}"] = d
          print(f"{kind}, N={n}{per}:\n{d.summary()}\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    study_plots.plot_rho(diagnoses, args.out_dir / "rho.png")
    (args.out_dir / "raw").mkdir(parents=True, exist_ok=True)
    (args.out_dir / "raw" / "rho.json").write_text(json.dumps({
        "command": command,
        **{name: {e: q.tolist() for e, q in d.rho.items()} for name, d in diagnoses.items()},
    }))
    return
  runs = study.grid(args.models, args.arms, args.num_micro_batches, args.micro_batch_sizes,
              args.lr_factors, args.seeds, args.steps)
  study.run_grid(runs, args.results, command=command, progress=not args.no_progress)
  if args.best_seeds:
    extra = study.best_seed_runs(runs, study.best_rows(study.load_results(args.results)),
                                 args.best_seeds)
    study.run_grid(extra, args.results, command=command, progress=not args.no_progress)
  results = study.load_results(args.results)
  rows = study.best_rows(results)
  text = study.markdown(rows, list(dict.fromkeys(
      r.get("command", "") for r in results.values() if r.get("command"))))
  args.out_dir.mkdir(parents=True, exist_ok=True)
  (args.out_dir / "study.md").write_text(text)
  study_plots.plot_gaps(rows, args.out_dir / "study.png")
  print(text)

if __name__ == "__main__":
  main()
