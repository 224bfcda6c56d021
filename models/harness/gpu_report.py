"""`models.gpu_bench`'s tables and plot: its rows against their targets and references."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models.harness import reporting


def capacity_table(rows: Sequence[dict[str, Any]]) -> str:
  """Markdown: what each method trains, against float32 scan accumulation."""
  base = next((r["param_count"] for r in rows
               if r["method"] == "scan_accumulation" and r["param_count"]), None)
  lines = ["| method | compiled fits | trains (live) | parameters | live peak | vs scan "
           "accumulation | tries |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    count, peak = r["param_count"], r["peak_bytes_in_use"]
    tries = ", ".join(str(a["scale"]) + (" fails" if a["error"] else " trains")
                      for a in r["attempts"])
    lines.append(
        f"| {r['method']} | {r['compiled_scale'] or 'none'} layers "
        f"| {r['trained_scale'] or 'none'} layers "
        f"| {'' if not count else f'{count / 1e6:,.1f}M'} "
        f"| {'' if peak is None else reporting.format_bytes(peak)} "
        f"| {'' if not (count and base) else f'{count / base:.2f}x'} "
        f"| {tries} |")
  return "\n".join(lines) + "\n"


def table(rows: Sequence[dict[str, Any]]) -> str:
  """Markdown: memory (compiled, live peak, floor) and step time per method."""

  def amount(num_bytes, p):
    if num_bytes is None or p is None:
      return "n/a"
    return f"{reporting.format_bytes(num_bytes)} ({num_bytes / p:.2f} P)"

  def failure(error):
    # The exception's own line, not the traceback's closing remarks.
    lines = error.strip().splitlines() or ["failed"]
    said = [l for l in lines if re.match(r"\s*[\w.]*(Error|Exception)\b", l)]
    return "failed: " + (said or lines)[-1].strip()[:100].replace("|", "/")

  lines = ["| case | method | compiled | live peak | peak vs floor | median step "
           "| vs scan accumulation |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    p, peak, floor = r["param_bytes"], r["peak_bytes_in_use"], r["floor_bytes"]
    vs_floor = "" if peak is None or not floor else f"{100 * (peak / floor - 1):+.1f}%"
    compiled = failure(r["error"]) if r.get("error") else amount(r["compiled_total_bytes"], p)
    step = r["median_step_s"]
    ref = _reference(r, rows)
    speed = "" if step is None or not ref else f"{100 * (step / ref - 1):+.1f}%"
    lines.append(
        f"| {r['case']} | {r['method']} | {compiled} "
        f"| {amount(peak, p)} | {vs_floor} "
        f"| {'' if step is None else f'{1e3 * step:.1f} ms'} | {speed} |")
  return "\n".join(lines) + "\n"


def _ratio(num, den) -> float | None:
  return None if num is None or not den else num / den


def _reference(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> float | None:
  """Scan accumulation's median in the process that timed ``row`` (rows of
  older runs have none recorded: their case's scan accumulation row)."""
  if row.get("reference_step_s") is not None:
    return row["reference_step_s"]
  return next((r["median_step_s"] for r in rows
               if r["case"] == row["case"] and r["method"] == "scan_accumulation"), None)


def summary(rows: Sequence[dict[str, Any]]) -> str:
  """The targets per preset and N, as ratios of the table's medians and peaks.

  AdamA against scan accumulation in the same row group (target <= 1.02x);
  scanned against unrolled scan accumulation at the same remat (<= 1.10x);
  the release step against unrolled scan accumulation at remat "full"
  (<= 1.05x) and without remat (the price of release); AdamA's live peak
  against its analytic floor (within 5%); the "momentum" estimator against
  the default ("mean") in step time (<= 1.03x) and live peak (<= 1.01x).
  """
  by = {(r["preset"], r["num_micro_batches"], r["scan_layers"], r["remat"], r["method"]): r
        for r in rows}
  lines = ["| preset, N | AdamA / scan accum. (unrolled; scanned) | scanned / unrolled "
           "scan accum. | release / unrolled accum. remat full | release / unrolled "
           "accum. remat none | AdamA live peak vs floor (unrolled) | \"momentum\" / default "
           "step; live peak (unrolled; scanned) |",
           "|---|---|---|---|---|---|---|"]

  def get(preset, n, scanned, remat, method, key):
    return (by.get((preset, n, scanned, remat, method)) or {}).get(key)

  def text(value, fmt="{:.3f}x"):
    return "n/a" if value is None else fmt.format(value)

  def vs_accumulation(preset, n, scanned, method):
    # Against the scan accumulation timed in the same process.
    row = by.get((preset, n, scanned, "full", method))
    return None if row is None else _ratio(row["median_step_s"], _reference(row, rows))

  for preset, n in dict.fromkeys((r["preset"], r["num_micro_batches"]) for r in rows):
    step = lambda scanned, remat, method: get(preset, n, scanned, remat, method,
                                              "median_step_s")
    adama = [vs_accumulation(preset, n, sc, "adama") for sc in (False, True)]
    release = step(True, "full", "adama_release")
    peak = get(preset, n, False, "full", "adama", "peak_bytes_in_use")
    floor = get(preset, n, False, "full", "adama", "floor_bytes")
    vs_floor = None if peak is None or not floor else 100 * (peak / floor - 1)
    vs_default = "; ".join(
        f"{text(_ratio(step(sc, 'full', 'adama_momentum'), step(sc, 'full', 'adama')))}, "
        + text(_ratio(get(preset, n, sc, "full", "adama_momentum", "peak_bytes_in_use"),
                      get(preset, n, sc, "full", "adama", "peak_bytes_in_use")))
        for sc in (False, True))
    scanned_vs_unrolled = _ratio(step(True, "full", "scan_accumulation"),
                                 step(False, "full", "scan_accumulation"))
    lines.append(
        f"| {preset}, N={n} | {text(adama[0])}; {text(adama[1])} "
        f"| {text(scanned_vs_unrolled)} "
        f"| {text(_ratio(release, step(False, 'full', 'scan_accumulation')))} "
        f"| {text(_ratio(release, step(False, 'none', 'scan_accumulation')))} "
        f"| {text(vs_floor, '{:+.1f}%')} | {vs_default} |")
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
  """Step time and live peak (in P) of every method, one column per preset."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  presets = list(dict.fromkeys(r["preset"] for r in rows))
  fig, axes = plt.subplots(2, len(presets), figsize=(6.5 * len(presets), 7.5), squeeze=False)
  for column, preset in enumerate(presets):
    mine = [r for r in rows if r["preset"] == preset]
    labels = [f"{r['method']}\n{'scan' if r['scan_layers'] else 'unroll'} "
              f"N={r['num_micro_batches']} {r['remat']}" for r in mine]
    positions = range(len(mine))
    step_ms = [1e3 * (r["median_step_s"] or 0.0) for r in mine]
    peak_p = [(r["peak_bytes_in_use"] or r["compiled_total_bytes"] or 0) / r["param_bytes"]
              if r.get("param_bytes") else 0.0 for r in mine]
    colors = ["tab:blue" if r["method"].startswith("adama") else "tab:gray" for r in mine]
    for row, values, unit in ((0, step_ms, "median step (ms)"), (1, peak_p, "live peak (P)")):
      ax = axes[row][column]
      ax.bar(positions, values, color=colors)
      ax.set_xticks(list(positions), labels, rotation=90, fontsize=7)
      ax.set_ylabel(unit)
      ax.set_title(f"{preset}, {mine[0]['dtype']} compute, float32 params")
  reporting.save_figure(fig, path)
