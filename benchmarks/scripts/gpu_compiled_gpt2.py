"""The live GPU run's steps compiled again without its GPU, beside its live peaks.

    .venv-gpu/bin/python benchmarks/scripts/gpu_compiled_gpt2.py --target gpu:h100
    python benchmarks/scripts/gpu_compiled_gpt2.py --live RUN.json --presets gpt_test \\
        --out-dir DIR          # the CPU backend, no --target: the test's smoke

Reads a `models.gpu_bench` run's raw JSON (default: the H100's,
benchmarks/results/gpu/raw/gpu_nvidia_h100_80gb_hbm3.json) and, for every row of
``--presets`` that has a live peak, compiles the same step (`models.bench memory`'s
`measure_memory`: same preset, N, layout, remat, compute dtype, micro-batch and
sequence length) for one device of ``--target`` with that machine's compiler and
no device (`optax_adama.memory.compile_for`), or for XLA's CPU backend without
one. Each method's compiled total (argument + output + temp - alias,
`memory_analysis()`) goes beside the live run's own compiled total and its live
peak (`memory_stats()["peak_bytes_in_use"]` after three steps, which includes the
allocator's effects), with the difference to the live peak in GiB and %. The page
is ``<out-dir>/<stem>.md``, the rows ``<out-dir>/raw/<stem>.json``; ``--page-only``
writes the page again from them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LIVE = ROOT / "benchmarks" / "results" / "gpu" / "raw" / "gpu_nvidia_h100_80gb_hbm3.json"
OUT_DIR = ROOT / "benchmarks" / "results" / "memory"
GIB = 2**30
# A live run made while the library's default was nu_estimator="momentum" named
# that step "adama" and the "mean" one "adama_mean" (its page's notes); today
# "adama" is the "mean" default and "adama_momentum" the other. A run that has
# "adama_mean" rows is such a run, and its names map to today's steps so.
RENAMED_IN_OLD_RUNS = {"adama": "adama_momentum", "adama_mean": "adama"}
# Two steps whose bytes differ by less than this share of the larger are tied
# (the two estimators of AdamA differ by tens of KiB in 4 GiB), so their order
# is not an ordering.
TIE_SHARE = 1e-3
# The fields of a live row that make its step (a `models.harness.gpu.Case`).
CASE_FIELDS = ("preset", "num_micro_batches", "scan_layers", "micro_batch_size", "seq_len",
               "remat", "dtype")


def live_groups(live: dict[str, Any], presets: Sequence[str]
                ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
  """The live rows of ``presets`` with a peak, grouped by step settings, in the run's order."""
  rows = [r for r in live["rows"] if r["preset"] in presets and r.get("peak_bytes_in_use")]
  renamed = any(r["method"] == "adama_mean" for r in live["rows"])
  groups: dict[tuple, list[dict[str, Any]]] = {}
  for r in rows:
    r = dict(r, live_method=r["method"],
             method=RENAMED_IN_OLD_RUNS.get(r["method"], r["method"]) if renamed
             else r["method"])
    groups.setdefault(tuple(r[f] for f in CASE_FIELDS), []).append(r)
  return [(dict(zip(CASE_FIELDS, key)), group) for key, group in groups.items()]


def compile_live_program(case: dict[str, Any], method: str, target: Any) -> dict[str, float]:
  """The memory report of the program the live run compiled, compiled here.

  As `models.harness.gpu.measure_method` builds it: the model's own loss
  (`models.split_loss_fn`), on the scanned layout too, except the release step,
  which takes the staged loss; `models.bench memory --scan-layers` gives every
  method the staged loss (another program of the same model).
  """
  # pylint: disable=import-outside-toplevel
  import jax

  import models
  import optax_adama
  from models.harness import baselines
  from models.harness import batches
  from models.harness import memory
  config = models.get_config(case["preset"], scan_layers=case["scan_layers"],
                             remat=case["remat"], **baselines.dtype_override(case["dtype"]))
  split = models.staged_loss if method in baselines.RELEASE_METHODS else models.split_loss_fn
  loss_fn, params = split(models.create_abstract(config))
  batch = batches.abstract_batch(
      config, case["micro_batch_size"] * case["num_micro_batches"], case["seq_len"])
  step, tx = baselines.make_step(method, loss_fn, num_micro_batches=case["num_micro_batches"])
  args = memory.on_target((params, jax.eval_shape(tx.init, params), batch), target)
  compiled = optax_adama.memory.compile_for(step, *args, target=target)
  return optax_adama.memory_report(compiled, *args).to_dict()


def compile_group(case: dict[str, Any], live_rows: Sequence[dict[str, Any]],
                  target: Any) -> list[dict[str, Any]]:
  """One row per live row: its step compiled here, beside the live numbers."""
  from models.harness import baselines  # pylint: disable=import-outside-toplevel
  from models.harness import memory  # pylint: disable=import-outside-toplevel
  bench_rows = memory.measure_memory(
      case["preset"], [r["method"] for r in live_rows], case["num_micro_batches"],
      micro_batch_size=case["micro_batch_size"], seq_len=case["seq_len"],
      remat=case["remat"], scan_layers=case["scan_layers"], dtype=case["dtype"],
      target=target)
  out = []
  for live_row, bench_row in zip(live_rows, bench_rows):
    method = bench_row.method
    assert method == live_row["method"], (method, live_row["method"])
    # Unrolled, and the release step, the two are the same program.
    same = not case["scan_layers"] or method in baselines.RELEASE_METHODS
    start = time.perf_counter()
    report = bench_row.report if same else compile_live_program(case, method, target)
    if live_row["param_bytes"] != report["param_bytes"]:
      raise ValueError(f"{case} {method}: the live run's params are "
                       f"{live_row['param_bytes']} bytes, this compile's "
                       f"{report['param_bytes']}: not the same model.")
    compiled, peak = report["total_bytes"], live_row["peak_bytes_in_use"]
    out.append({**case, "method": method, "live_method": live_row["live_method"],
                "compiled_total_bytes": compiled,
                "device_compiled_total_bytes": live_row["compiled_total_bytes"],
                "peak_bytes_in_use": peak, "param_bytes": report["param_bytes"],
                "compiled_minus_peak_bytes": compiled - peak,
                "compiled_vs_peak": compiled / peak - 1,
                "compiled_minus_device_bytes": compiled - live_row["compiled_total_bytes"],
                "bench_compiled_total_bytes": bench_row.report["total_bytes"],
                "same_program": same,
                "compiled_by": bench_row.compiled_for, "fits": bench_row.fits,
                "compile_s": bench_row.compile_s + (0 if same else time.perf_counter() - start),
                "report": report, "bench_report": bench_row.report})
  return out


def ordering_note(rows: Sequence[dict[str, Any]], key: str = "compiled_total_bytes") -> str:
  """Whether the compiled bytes (``key``) order a group's methods as the live peaks do."""
  flipped, tied = [], []
  for a, b in itertools.combinations(rows, 2):
    compiled = a[key] - b[key]
    live = a["peak_bytes_in_use"] - b["peak_bytes_in_use"]
    compiled_tie = abs(compiled) < TIE_SHARE * max(a[key], b[key])
    live_tie = abs(live) < TIE_SHARE * max(a["peak_bytes_in_use"], b["peak_bytes_in_use"])
    pair = f"{a['method']} / {b['method']}"
    if compiled_tie and live_tie:
      continue
    if compiled_tie or live_tie:
      tied.append(pair + (" tied compiled only" if compiled_tie else " tied live only"))
    elif (compiled > 0) != (live > 0):
      flipped.append(pair)
  if not flipped and not tied:
    return "same order"
  return "; ".join(([f"**order differs**: {', '.join(flipped)}"] if flipped else []) + tied)


def gib_p(num_bytes: float, param_bytes: int) -> str:
  return f"{num_bytes / GIB:.2f} GiB ({num_bytes / param_bytes:.2f} P)"


def case_name(row: dict[str, Any]) -> str:
  layout = "scanned" if row["scan_layers"] else "unrolled"
  return (f"{row['preset']} {layout} N={row['num_micro_batches']} remat={row['remat']} "
          f"{row['dtype']}")


def table(rows: Sequence[dict[str, Any]], device: str) -> str:
  """Markdown: a row per method of every group."""
  lines = [f"| case | method | compiled here | compiled on the {device} | live peak "
           f"| here - live peak | here - on the {device} | `models.bench memory` here |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    method = r["method"] + (f" (live: {r['live_method']})"
                            if r["live_method"] != r["method"] else "")
    bench = ("same program" if r["same_program"]
             else "same bytes" if r["bench_compiled_total_bytes"] == r["compiled_total_bytes"]
             else gib_p(r["bench_compiled_total_bytes"], r["param_bytes"]))
    lines.append(
        f"| {case_name(r)} | {method} | {gib_p(r['compiled_total_bytes'], r['param_bytes'])} "
        f"| {gib_p(r['device_compiled_total_bytes'], r['param_bytes'])} "
        f"| {gib_p(r['peak_bytes_in_use'], r['param_bytes'])} "
        f"| {r['compiled_minus_peak_bytes'] / GIB:+.2f} GiB "
        f"({100 * r['compiled_vs_peak']:+.1f}%) "
        f"| {r['compiled_minus_device_bytes'] / GIB:+.2f} GiB "
        f"| {bench} |")
  return "\n".join(lines)


def orderings(rows: Sequence[dict[str, Any]], key: str = "compiled_total_bytes"
              ) -> dict[str, str]:
  """Per group, whether the compiled bytes (``key``) order its methods as the live
  peaks do."""
  groups: dict[str, list[dict[str, Any]]] = {}
  for r in rows:
    groups.setdefault(case_name(r), []).append(r)
  return {name: ordering_note(group, key) for name, group in groups.items()}


def spread(values: Sequence[float], unit: str, digits: int = 2) -> str:
  return f"{min(values):+.{digits}f} to {max(values):+.{digits}f}{unit}"


def page(result: dict[str, Any]) -> str:
  rows = result["rows"]
  device = result["live_machine"]["device"]
  order = orderings(rows)
  bench_order = orderings([r for r in rows if r["scan_layers"]], "bench_compiled_total_bytes")
  summary = []
  for layout, scanned in (("unrolled", False), ("scanned", True)):
    group = [r for r in rows if r["scan_layers"] == scanned]
    if group:
      summary.append(
          f"- {layout}: here - live peak "
          + spread([r["compiled_minus_peak_bytes"] / GIB for r in group], " GiB")
          + " (" + spread([100 * r["compiled_vs_peak"] for r in group], "%", 1) + "); "
          f"here - compiled on the {device} "
          + spread([r["compiled_minus_device_bytes"] / GIB for r in group], " GiB") + "; "
          f"live peak - compiled on the {device} "
          + spread([(r["peak_bytes_in_use"] - r["device_compiled_total_bytes"]) / GIB
                    for r in group], " GiB") + ".")
  lines = [
      f"# The live {device} steps compiled without a GPU, against their live peaks",
      "",
      f"Made by `{result['command']}` in {result['wall_s']:.0f} s on "
      f"{result['machine']['cpu_count']} CPU cores ({result['machine']['device']}, "
      f"jax {result['machine']['jax']}). Compiled here by: "
      + "; ".join(sorted({r["compiled_by"] for r in rows})) + ". Compiled on the "
      f"{device}, and its live peak: the run of `{result['live']}` "
      f"(jax {result['live_machine']['jax']}, XLA's GPU compiler on the card, with "
      "autotuning). Each row is the live row's step, with its settings (preset, N, "
      "layout, remat, compute dtype, micro-batch and sequence length; float32 params "
      "and moments) and its program: the model's own loss, on the scanned layout too, "
      "and the staged loss for the release step only (`models.harness.gpu.measure_method`)."
      " `models.bench memory --scan-layers` gives every method the staged loss, another "
      "program of the same model: its column (same bytes: the same total to the byte). "
      "Every compiled total is `memory_analysis()`: argument + output + temp - alias; "
      "the live peak is `memory_stats()['peak_bytes_in_use']` after three steps, in a "
      "process of its own, so it also holds what the allocator and the libraries take "
      "beside the program. P: one float32 copy of the params.",
      "",
      table(rows, device),
      "",
      *summary,
      "",
      "Ordering of each group's methods, compiled here against the live peaks (ties: "
      f"under {100 * TIE_SHARE:g}% apart):",
      "",
      *[f"- {name}: {note}" for name, note in order.items()],
      *[f"- {name}, `models.bench memory`'s program: {note}"
        for name, note in bench_order.items()],
  ]
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--live", type=Path, default=LIVE,
                      help="a models.gpu_bench run's raw JSON")
  parser.add_argument("--presets", nargs="+", default=["gpt2_small", "gpt2_medium"])
  parser.add_argument("--target", default=None,
                      help="compile for one device of this machine (e.g. gpu:h100; needs "
                           ".venv-gpu); default: XLA's CPU backend")
  parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
  parser.add_argument("--stem", default="gpu_compiled_gpt2")
  parser.add_argument("--page-only", action="store_true",
                      help="compile nothing: write the page again from its raw JSON")
  args = parser.parse_args(argv)
  raw = args.out_dir / "raw" / f"{args.stem}.json"
  if args.page_only:
    result = json.loads(raw.read_text())
    return write_page(result, args.out_dir / f"{args.stem}.md")
  import optax_adama  # pylint: disable=import-outside-toplevel
  from models import harness  # pylint: disable=import-outside-toplevel
  target = None
  if args.target:
    target = optax_adama.memory.parse_target(args.target)
    # Before anything starts jax's backends (as models.bench does).
    optax_adama.memory.target_devices(target)
  live = json.loads(args.live.read_text())
  groups = live_groups(live, args.presets)
  if not groups:
    parser.error(f"{args.live}: no row of {args.presets} with a live peak")
  start = time.perf_counter()
  rows = []
  for case, live_rows in groups:
    rows += compile_group(case, live_rows, target)
    print(f"{case}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
  try:
    live_path = str(args.live.resolve().relative_to(ROOT))
  except ValueError:
    live_path = str(args.live)
  argv = list(sys.argv[1:] if argv is None else argv)
  python = Path(sys.executable)
  if python.is_relative_to(ROOT):  # a venv of the repository: .venv-gpu/bin/python
    python = python.relative_to(ROOT)
  command = " ".join([python.name if python.is_absolute() else str(python),
                      "benchmarks/scripts/gpu_compiled_gpt2.py", *argv])
  result = {"command": command,
            "machine": harness.machine_info(), "wall_s": time.perf_counter() - start,
            "live": live_path, "live_machine": live["machine"],
            "target": args.target, "rows": rows}
  raw.parent.mkdir(parents=True, exist_ok=True)
  raw.write_text(json.dumps(result, indent=1) + "\n")
  return write_page(result, args.out_dir / f"{args.stem}.md")


def write_page(result: dict[str, Any], path: Path) -> dict[str, Any]:
  """The page of a result (and its groups' orderings, added to the result returned)."""
  text = page(result)
  path.write_text(text)
  print(text)
  return {**result, "orderings": orderings(result["rows"])}


if __name__ == "__main__":
  main()
