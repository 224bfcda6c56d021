"""One call for the GPU numbers: live peak memory and interleaved step times.

    make bench-gpu                  # python -m models.gpu_bench, on a GPU machine
    python -m models.gpu_bench --presets gpt_test --num-micro-batches 2 --seq-len 16 \
        --out-dir /tmp/gpu_dry_run  # the CPU dry run the tests make
    make bench-gpu BENCH_GPU_ARGS="--presets llama32_1b --reference-remat --workers 2 \
        --rounds 3 --no-progress --tag llama32_1b"   # Llama 3.2 1B, gpu_<device>_llama32_1b.md

For each preset, N and layout (unrolled blocks, or blocks stacked under one
`lax.scan`), every method of `models.bench` (scan accumulation,
`optax.microbatching`, `optax.MultiSteps`, AdamA; and AdamA with gradient
release on the scanned layout) is measured twice:

- memory, each method in a process of its own so live peaks do not mix: the
  device's `memory_stats()["peak_bytes_in_use"]` after three steps, next to
  the compile-only `memory_analysis()` total and AdamA's analytic floor
  (`optax_adama.memory.memory_floor` on the unrolled model: params + m + v + batch
  + one micro-batch's activations + the largest gradient leaf; for the
  release step, which recomputes each layer in its backward, the same with
  every block rematerialized);
- time, the methods of one preset, N and layout in one process, interleaved
  round by round (`models.harness.measure_throughput`), median step time.
  Where they do not fit the device together (`TIMED_TOGETHER`: llama32_1b),
  in several processes, each with scan accumulation, the reference of its
  own methods' ratios.

The memory processes run a few at a time (`--workers`) and share a persistent
compilation cache with the timing processes, so each step compiles once.
Results go to `<out-dir>/raw/gpu_<device>.json` (the tasks' results as they came:
`raw/gpu_<device>_tasks.jsonl`) and a markdown table, `<out-dir>/gpu_<device>.md`;
`--tag T` names them `gpu_<device>_T...`. On the CPU backend there is no live
peak (the column says so) and the run only checks that the pipeline works.

    make bench-gpu-capacity         # python -m models.gpu_bench --capacity

is the live capacity search, a call of its own: per method of
``CAPACITY_METHODS`` the largest GPT-2-shaped model whose step compiles
under the device's memory, then that model trained for three steps, one
scale smaller at a time while it runs out of memory
(`<out-dir>/gpu_<device>_capacity.md` and its raw JSON).

The command line, its row groups and the report it writes; the cases, the
processes that measure them and the tables are `models.harness.gpu` and
`models.harness.gpu_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

import models
from models import harness
from models.harness import gpu
from models.harness import gpu_report

# The row groups of presets outside --all-methods-presets (the budget's cut).
LEAN_METHODS = ("scan_accumulation", "scan_accumulation_bf16", "adama")
# The reference rows at another remat (the price of remat, and of the release
# step's recomputation, against a step that saves its activations).
REFERENCE_METHODS = ("scan_accumulation", "adama")
# Examples per micro-batch that fill an H100 at 1,024 tokens with bf16 compute
# and remat "full" (8,192 tokens; what the table states).
MICRO_BATCH_SIZES = {"gpt2_small": 8, "gpt2_medium": 8, "gpt2_large": 8, "gpt2_xl": 4,
                     "llama32_1b": 8}
# Tokens per example where the preset's context is not the GPT rows' 1,024:
# llama32_1b's 131,072 would not fit one example. At 1,024 its micro-batches
# have the GPT rows' shape, so the rows differ by model only.
SEQ_LENS = {"llama32_1b": 1024}
# Methods timed together in one process, scan accumulation in each, where a
# case's methods do not fit the device together: `harness.measure_throughput`
# keeps the model's params (P) and each method's params, m and v (3 P).
# llama32_1b (P = 4.6 GiB): the model and 3 methods hold 46 GiB, plus ~21 GiB
# for the largest step (scanned scan accumulation: its CPU compile's temp,
# 24.2 GiB, times gpt2_medium's GPU/CPU ratio, 0.87), 67 GiB; all 4 scanned
# ones, 81 GiB.
TIMED_TOGETHER = {"llama32_1b": 3}
# The share of the device each process's allocator may take: JAX's default,
# 0.75 (59.6 GiB of an H100; the limit stands with preallocation off), is
# below those 67 GiB. Every process of the preset gets it, so that memory and
# timing processes compile under the same limit and share the cache.
MEMORY_FRACTIONS = {"llama32_1b": 0.95}
# The live capacity search (--capacity): float32 and bf16-carry accumulation
# against the release step with 8-bit moments in host memory, all scanned.
CAPACITY_METHODS = ("scan_accumulation", "scan_accumulation_bf16",
                    "adama_release_8bit_offload")


def make_cases(args: argparse.Namespace) -> list[gpu.Case]:
  """The row groups of a run: every layout at --remat, plus the reference rows."""
  cases = []
  for preset in args.presets:
    size = args.micro_batch_size or MICRO_BATCH_SIZES.get(preset, 1)
    seq_len = args.seq_len or SEQ_LENS.get(preset)
    per_preset = {"timed_together": args.timed_together or TIMED_TOGETHER.get(preset),
                  "memory_fraction": args.memory_fraction or MEMORY_FRACTIONS.get(preset)}
    every = preset in args.all_methods_presets
    for n in args.num_micro_batches:
      for layout in args.layouts:
        scanned = layout == "scanned"
        names = None if every else (
            LEAN_METHODS + (("adama_release",) if scanned else ()))
        cases.append(gpu.Case(preset, n, scanned, size, seq_len, args.remat, args.dtype,
                              names, **per_preset))
      for remat in args.reference_remat:
        if remat != args.remat:
          cases.append(gpu.Case(preset, n, False, size, seq_len, remat, args.dtype,
                                REFERENCE_METHODS, **per_preset))
  return cases


def _parser() -> argparse.ArgumentParser:
  """The command line (its ``error`` ends the command as argparse does)."""
  parser = argparse.ArgumentParser(prog="python -m models.gpu_bench",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--presets", nargs="+", default=["gpt2_small", "gpt2_medium"],
                      choices=sorted(models.PRESETS))
  parser.add_argument("--num-micro-batches", nargs="+", type=int, default=[4])
  parser.add_argument("--layouts", nargs="+", choices=("unrolled", "scanned"),
                      default=["unrolled", "scanned"])
  parser.add_argument("--remat", choices=sorted(models.REMAT_POLICIES), default="full",
                      help="every method's remat policy (the release step recomputes "
                           "each layer, as 'full' does)")
  parser.add_argument("--reference-remat", nargs="*", default=["none"],
                      choices=sorted(models.REMAT_POLICIES),
                      help="also unrolled scan accumulation and AdamA at these remats")
  parser.add_argument("--dtype", choices=models.COMPUTE_DTYPES, default="bfloat16",
                      help="compute dtype (params and moments float32)")
  parser.add_argument("--all-methods-presets", nargs="*", default=["gpt2_small"],
                      help="presets that also run optax.microbatching and MultiSteps "
                           "(the others: scan accumulation f32/bf16 carry and AdamA)")
  parser.add_argument("--micro-batch-size", type=int, default=None,
                      help=f"default: per preset {MICRO_BATCH_SIZES}, else 1")
  parser.add_argument("--seq-len", type=int, default=None,
                      help=f"default: per preset {SEQ_LENS}, else the preset's context")
  parser.add_argument("--timed-together", type=int, default=None,
                      help="methods per timing process, scan accumulation in each (where "
                           "a case's methods do not fit the device together); default: per "
                           f"preset {TIMED_TOGETHER}, else all of a case's")
  parser.add_argument("--memory-fraction", type=float, default=None,
                      help="the share of the device each process's allocator may take; "
                           f"default: per preset {MEMORY_FRACTIONS}, else JAX's (0.75)")
  parser.add_argument("--workers", type=int, default=6,
                      help="memory processes at a time (each compiles on the host)")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps-per-round", type=int, default=3)
  parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/gpu"))
  parser.add_argument("--tag", default=None,
                      help="names the outputs gpu_<device>_<tag>.md (and .png, raw .json, "
                           "raw _tasks.jsonl), so a run of other presets leaves the table "
                           "of record, gpu_<device>.md, alone")
  parser.add_argument("--capacity", action="store_true",
                      help="instead of the row groups: the largest GPT each of "
                           f"{CAPACITY_METHODS} trains on this device (compile-only "
                           "search, then trained, stepping down on out-of-memory)")
  parser.add_argument("--capacity-budget-gb", type=float, default=None,
                      help="default: the device's memory (memory_stats bytes_limit)")
  parser.add_argument("--capacity-max-scale", type=int, default=128)
  parser.add_argument("--capacity-vocab-size", type=int, default=50257)
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--no-progress", action="store_true")
  return parser


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """The command line, with the refusals argparse cannot make itself."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.tag is not None and not re.fullmatch(r"[a-z0-9_]+", args.tag):
    parser.error(f"--tag {args.tag!r}: use lower-case letters, digits and _ (it names files)")
  if args.timed_together is not None and args.timed_together < 2:
    parser.error(f"--timed-together {args.timed_together}: each timing process holds scan "
                 "accumulation and at least one method to time against it; use 2 or more")
  if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
    parser.error(f"--memory-fraction {args.memory_fraction}: a share of the device, in (0, 1]")
  with harness.command_errors(parser):
    harness.check_counts(**{name: getattr(args, name) for name in (
        "num_micro_batches", "micro_batch_size", "seq_len", "workers", "rounds",
        "steps_per_round", "capacity_max_scale", "capacity_vocab_size")})
    for preset in args.presets:
      harness.check_seq_len(preset, models.get_config(preset), args.seq_len)
    if args.capacity_budget_gb is not None and args.capacity_budget_gb <= 0:
      raise ValueError(f"capacity_budget_gb={args.capacity_budget_gb}: a budget in GB, "
                       "above 0.")
  return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = _parse_args(argv)
  if args.worker is not None:
    print(json.dumps(gpu.run_task(json.loads(args.worker))))
    return []
  if args.capacity:
    return main_capacity(args, argv)
  cases = make_cases(args)
  tag = "" if args.tag is None else f"_{args.tag}"
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="jax_cache_") as cache_dir:
    # Named for the device once the run is over: this process does not start
    # a backend before its workers (it would take the device's memory).
    log = args.out_dir / "raw" / f"gpu_tasks{tag}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    rows = gpu.run(cases, workers=args.workers, rounds=args.rounds,
               steps_per_round=args.steps_per_round, cache_dir=cache_dir,
               progress=not args.no_progress, log=log)
  wall_s = time.perf_counter() - start
  stem = f"gpu_{gpu.device_slug()}{tag}"
  log.replace(args.out_dir / "raw" / f"{stem}_tasks.jsonl")
  command = "python -m models.gpu_bench " + " ".join(argv if argv is not None else sys.argv[1:])
  (args.out_dir / "raw" / f"{stem}.json").write_text(json.dumps(
      {"command": command, "machine": harness.machine_info(), "wall_s": wall_s, "rows": rows},
      indent=1))
  write_report(rows, command=command, device=harness.machine_info()["device"],
               wall_s=wall_s, out_dir=args.out_dir, stem=stem)
  return rows


def device_budget_gb() -> float:
  """The device's memory in GB, as its allocator reports it."""
  stats = jax.devices()[0].memory_stats()
  if not stats or "bytes_limit" not in stats:
    raise ValueError("this backend reports no memory limit: pass --capacity-budget-gb")
  return stats["bytes_limit"] / 1e9


def main_capacity(args: argparse.Namespace, argv: Sequence[str] | None) -> list[dict[str, Any]]:
  """--capacity: runs the search, writes gpu_<slug>_capacity.md and its raw JSON."""
  with harness.command_errors(_parser()):
    budget = args.capacity_budget_gb or device_budget_gb()
  case = gpu.CapacityCase(budget, num_micro_batches=args.num_micro_batches[0],
                      micro_batch_size=args.micro_batch_size or 1,
                      seq_len=args.seq_len or 1024, remat=args.remat, dtype=args.dtype,
                      max_scale=args.capacity_max_scale, vocab_size=args.capacity_vocab_size)
  start = time.perf_counter()
  slug = gpu.device_slug()
  (args.out_dir / "raw").mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="jax_cache_") as cache_dir:
    rows = gpu.run_capacity(case, CAPACITY_METHODS, cache_dir=cache_dir,
                        log=args.out_dir / "raw" / f"gpu_{slug}_capacity_tasks.jsonl")
  wall_s = time.perf_counter() - start
  command = "python -m models.gpu_bench " + " ".join(argv if argv is not None else sys.argv[1:])
  machine = harness.machine_info()
  (args.out_dir / "raw" / f"gpu_{slug}_capacity.json").write_text(json.dumps(
      {"command": command, "machine": machine, "wall_s": wall_s,
       "case": dataclasses.asdict(case), "rows": rows}, indent=1))
  text = (f"Measured by `{command}` on {machine['device']} in {wall_s:.0f} s: budget "
          f"{budget:.3g} GB; gpt_family (GPT-2 shaped, width 64 x layers), scanned, "
          f"remat {case.remat}, {case.dtype} compute, float32 params; N = "
          f"{case.num_micro_batches} micro-batches of {case.micro_batch_size} x "
          f"{case.seq_len} tokens. Compiled: the compile-only search on this device; "
          "trains: three steps ran.\n\n" + gpu_report.capacity_table(rows))
  (args.out_dir / f"gpu_{slug}_capacity.md").write_text(text)
  print(text)
  return rows


def write_report(rows: Sequence[dict[str, Any]], *, command: str, device: str, wall_s: float,
                 out_dir: Path, stem: str) -> str:
  """<stem>.md (targets, then the table) and <stem>.png; returns the text."""
  sizes = sorted({(r["preset"], r["micro_batch_size"], r["seq_len"]) for r in rows})
  stated = "; ".join(f"{p}: {b} examples x {t or 'context'} tokens per micro-batch"
                     for p, b, t in sizes)
  # Conditions only some presets run under (absent from older raw rows).
  grouped = sorted({(r["preset"], r["timed_together"]) for r in rows
                    if r.get("timed_together")})
  shares = sorted({(r["preset"], r["memory_fraction"]) for r in rows
                   if r.get("memory_fraction")})
  stated += "".join(
      f"; {p}: timed in processes of at most {k} methods, scan accumulation in each "
      "(every 'vs scan accumulation' against its own process's)" for p, k in grouped)
  stated += "".join(f"; {p}: each process's allocator limited to {f:g} of the device"
                    for p, f in shares)
  text = (f"Measured by `{command}` on {device} in {wall_s:.0f} s. Params and moments "
          f"float32; compute dtype and remat per row; {stated}. Live peak: "
          "`memory_stats()['peak_bytes_in_use']` after three steps in a process of its "
          "own; step: median of interleaved rounds.\n\n"
          + gpu_report.summary(rows) + "\n" + gpu_report.table(rows))
  (out_dir / f"{stem}.md").write_text(text)
  gpu_report.plot(rows, out_dir / f"{stem}.png")
  print(text)
  return text


if __name__ == "__main__":
  main()
