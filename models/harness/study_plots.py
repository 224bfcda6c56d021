"""The study's figures: gaps to Adam per cell, training curves, rho over training.

`plot_gaps` (study.png), `plot_curves` (study_curves.png) and `plot_rho`
(rho.png) draw `models.harness.study`'s rows and diagnoses for
`python -m models.validate study | curves | rho`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import optax_adama
from models.harness import reporting
from models.harness import study
from models.harness.settings import DEFAULT_NU_ESTIMATOR

ARM_COLORS = {"adam_accumulation": "tab:brown", "adam_bf16acc": "tab:purple",
              "auto": "tab:red", "mean": "tab:blue", "sum": "tab:gray",
              "momentum": "tab:orange", "split": "tab:green"}
N_MARKERS = {2: "s", 4: "o", 8: "^"}
GAP_PLOT_TICKS = (-20, -10, -5, -2, -1, 0, 1, 2, 5, 10, 20, 50, 100)


def _plotted_gap(row: dict[str, Any]) -> tuple[float, float, float]:
  """``(gap, low, high)`` in percent: the median paired gap and its range over
  seeds from three seeds on (what docs/estimators.md quotes), else the gap itself."""
  paired = [100 * g for g in row["paired_gaps"]]
  if len(paired) > 2:
    return 100 * row["paired_gap_median"], min(paired), max(paired)
  gap = 100 * row["gap_to_adam"]
  return gap, gap, gap


def plot_gaps(rows: Sequence[dict[str, Any]], path: Path) -> None:
  """Gap to Adam (best lr vs best) against tokens per micro-batch, per model.

  Colour: the arm; marker: N; filled: median of three or more seeds, with
  the seeds' range as a bar; hollow: fewer seeds. The band is the 1% target.
  The y axis is linear within ±2% and logarithmic beyond, so the band and
  the misses of tens of percent both read.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in rows if r["arm"] != "adam" and not np.isnan(r["gap_to_adam"])]
  # A panel per model and run length: gaps after 100 and 300 steps of the
  # same cell are different measurements and would overlay at one x.
  kinds = list(dict.fromkeys((r["model"], r["steps"]) for r in sorted(
      rows, key=lambda r: (r["model"], r["steps"]))))
  lengths = {model: sum(m == model for m, _ in kinds) for model, _ in kinds}
  columns = min(3, len(kinds))
  rows_of_panels = -(-len(kinds) // columns)
  fig, axes = plt.subplots(rows_of_panels, columns,
                           figsize=(5 * columns + 1.7, 4.2 * rows_of_panels), squeeze=False)
  for ax in axes.flat[len(kinds):]:
    ax.set_visible(False)
  tokens = [r["tokens_per_micro_batch"] for r in rows] or [256]
  # Powers of two spanning every model's cells, so the panels share one axis.
  ticks = [2 ** k for k in range(int(np.floor(np.log2(min(tokens)))),
                                 int(np.ceil(np.log2(max(tokens)))) + 1)]
  for ax, (kind, steps) in zip(axes.flat, kinds):
    ax.axhspan(-1, 1, color="tab:green", alpha=0.08, linewidth=0)
    ax.axhline(0.0, color="black", linewidth=0.8)
    for row in rows:
      if (row["model"], row["steps"]) == (kind, steps):
        _draw_gap(ax, row)
    _gap_axis(ax, ticks)
    length = f", {steps} steps" if lengths[kind] > 1 else ""
    ax.set_title(f"{kind}{length}: held-out loss vs Adam, best lr vs best", fontsize=10)
  fig.legend(handles=_gap_legend(rows), loc="center right", fontsize=8, frameon=False)
  reporting.save_figure(fig, path, rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))


def _draw_gap(ax: Any, row: dict[str, Any]) -> None:
  gap, low, high = _plotted_gap(row)
  n = row["num_micro_batches"]
  # N spreads the points a little sideways so equal cells do not hide.
  x = row["tokens_per_micro_batch"] * 2 ** (0.06 * (np.log2(n) - 2))
  color = ARM_COLORS.get(row["arm"], "black")
  ax.errorbar([x], [gap], yerr=[[gap - low], [high - gap]], color=color,
              marker=N_MARKERS.get(n, "D"), markersize=7, capsize=2, linewidth=1,
              markerfacecolor=color if len(row["paired_gaps"]) > 2 else "none")


def _gap_axis(ax: Any, ticks: Sequence[int]) -> None:
  ax.set_xscale("log", base=2)
  ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
  ax.set_xticks([], minor=True)
  ax.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
  ax.set_yscale("symlog", linthresh=2)
  ax.set_yticks(GAP_PLOT_TICKS, [f"{t:+g}" if t else "0" for t in GAP_PLOT_TICKS])
  ax.set_yticks([], minor=True)
  ax.set_ylim(GAP_PLOT_TICKS[0] * 1.3, GAP_PLOT_TICKS[-1] * 1.3)
  ax.set_xlabel("tokens (or image patches) per micro-batch")
  ax.set_ylabel("gap to Adam (%)")
  ax.grid(alpha=0.3)


def _gap_legend(rows: Sequence[dict[str, Any]]) -> list[Any]:
  from matplotlib.lines import Line2D

  arms = {r["arm"] for r in rows}
  ns = sorted({r["num_micro_batches"] for r in rows})
  handle = lambda label, **kw: Line2D([], [], label=label, **{"color": "black", **kw})
  return ([handle(a, color=ARM_COLORS.get(a, "black"), marker="o", linestyle="")
           for a in ARM_COLORS if a in arms]
          + [handle(f"N = {n}", marker=N_MARKERS.get(n, "D"), linestyle="",
                    markerfacecolor="none") for n in ns]
          + [handle("median of 3+ seeds,\nbar: their range", marker="o"),
             handle("1-2 seeds", marker="o", linestyle="", markerfacecolor="none"),
             handle("within 1%", color="tab:green", alpha=0.3, linewidth=6)])


def plot_curves(results: dict[str, dict[str, Any]], cells: Sequence[tuple[int | str, ...]],
                path: Path, *, steps: int = 300,
                arms: Sequence[str] = ("adam", DEFAULT_NU_ESTIMATOR)) -> None:
  """Training loss of Adam and the default, side by side, one panel per cell.

  Each arm at its best rate in the cell; every seed it has there drawn thin,
  the median over seeds drawn thick, the held-out loss of each seed in the
  legend. Adam is its whole-batch run (the same math as Adam + accumulation).
  A cell is ``(model, N, examples per micro-batch)``, drawn from its runs of
  ``steps`` steps, or ``(model, N, examples, steps)`` with its own.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  best = {(r["model"], r["num_micro_batches"], r["micro_batch_size"], r["steps"], r["arm"]): r
          for r in study.best_rows(results)}
  fig, axes = plt.subplots(1, len(cells), figsize=(5.5 * len(cells), 4.2), squeeze=False)
  for ax, (model, n, size, *cell_steps) in zip(axes[0], cells):
    length = cell_steps[0] if cell_steps else steps
    for arm, color in zip(arms, ("tab:gray", "tab:blue")):
      key = ((model, 1, n * size, length, arm) if arm == "adam"
             else (model, n, size, length, arm))
      row = best.get(key)
      if row is None:
        continue
      runs = [r for r in results.values()
              if r["model"] == model and r["arm"] == arm and r["steps"] == length
              and r["learning_rate"] == row["best_lr"]
              and r["num_micro_batches"] * r["micro_batch_size"] == n * size
              and (arm == "adam" or r["num_micro_batches"] == n)]
      curves = np.array([r["train_loss"] for r in runs])
      x = np.arange(curves.shape[1]) * (length / curves.shape[1])
      ax.plot(x, curves.T, color=color, alpha=0.25, linewidth=0.8)
      held_out = " / ".join(f"{r['eval_loss']:.3f}" for r in sorted(runs, key=lambda r: r["seed"]))
      label = "Adam" if arm == "adam" else f"AdamA default ({arm!r})"
      ax.plot(x, np.median(curves, axis=0), color=color, linewidth=2,
              label=f"{label}, lr {row['best_lr']:g}\nheld-out {held_out}")
    ax.set_title(f"{model}, N = {n} x {size} ({n * size * study.positions_per_example(model):,} "
                 f"tokens per mini-batch), {length} steps", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (median over seeds thick)")
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
    else:
      ax.text(0.5, 0.5, f"no runs of {length} steps in this cell", ha="center",
              transform=ax.transAxes)
  reporting.save_figure(fig, path)


def plot_rho(diagnoses: dict[str, optax_adama.diagnostics.SecondMomentDiagnosis],
             path: Path) -> None:
  """Median rho, its interquartile band and its 5th percentile (the coordinates whose
  steps most exceed Adam's) over training, per model and estimator."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(diagnoses), figsize=(5 * len(diagnoses), 4),
                           squeeze=False)
  for ax, (name, diagnosis) in zip(axes[0], diagnoses.items()):
    for estimator, quantiles in diagnosis.rho.items():
      x = np.arange(1, len(quantiles) + 1)
      column = lambda q: quantiles[:, diagnosis.QUANTILES.index(q)]
      line, = ax.plot(x, column(0.5), label=estimator)
      ax.fill_between(x, column(0.25), column(0.75), alpha=0.15, color=line.get_color())
      ax.plot(x, column(diagnosis.QUANTILES[0]), color=line.get_color(),
              linestyle=":", linewidth=0.8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_title(f"{name}: rho = v / v_adam (N={diagnosis.num_micro_batches})")
    ax.set_xlabel("mini-batch step")
    ax.set_ylabel("rho: median, quartiles, 5th percentile (dotted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  reporting.save_figure(fig, path)
