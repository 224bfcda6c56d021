"""Memory, throughput and capacity of AdamA against every way JAX users accumulate.

    python -m models.bench memory --presets gpt2_small bert_base vit_base \
        --num-micro-batches 1 2 4 8 16 --json benchmarks/results/memory/raw/memory_sweep.json
    python -m models.bench throughput --presets gpt_tiny bert_tiny vit_tiny
    python -m models.bench capacity --budgets-gb 16 24 40 80

Methods, all at the same micro-batch size and with params and optimizer state
donated:

- ``full_batch``: ``optax.adam`` on the whole mini-batch at once (no
  accumulation; its activations are N micro-batches' worth),
- ``scan_accumulation``: a hand-written ``lax.scan`` that sums micro-batch
  gradients, then one ``optax.adam`` update (``microbatch_step`` with a
  non-AdamA transformation),
- ``multisteps``: ``optax.MultiSteps(optax.adam)``, one update call per
  micro-batch inside the scan,
- ``optax_microbatching``: ``optax.microbatching.microbatch`` (MEAN accumulator)
  over ``jax.value_and_grad``, then one ``optax.adam`` update,
- ``adama``: ``optax_adama.adama`` through ``optax_adama.microbatch_step``,
- ``scan_accumulation_bf16_8bit``: the careful user's baseline, a bfloat16
  gradient-sum carry and Adam with 8-bit moments (AdamA at N = 1, which is
  Adam, with ``BlockQuantization``),
- ``adama_8bit``: AdamA with 8-bit moments,
- ``adama_8bit_lowrank``: ``optax_adama.low_rank`` (GaLore, rank = width / 4,
  bfloat16 projectors) around AdamA with 8-bit moments,
- ``adama_8bit_lowrank_offload``: the same under ``optax_adama.offload_moments``
  (state in host memory); capacity counts device bytes only,
- ``adama_release`` (``memory --scan-layers``): ``optax_adama.adama`` through
  ``optax_adama.release_step`` on the model's stages (``models.staged_loss``),
  folding one layer's gradient at a time; ``adama_release_8bit``: the same
  with 8-bit moments whose blocks tile each layer; ``adama_release_8bit_offload``:
  those under ``optax_adama.offload_moments`` (capacity: device bytes, plus
  the moments in flight, see ``release_in_flight_bytes``).

With ``--scan-layers`` the models keep their blocks' params stacked and run
them under one ``lax.scan`` (every method sees that model); the floor is the
unrolled model's, whose largest gradient is one layer's leaf or an outer leaf:

    python -m models.bench memory --scan-layers --presets gpt2_small \
        --num-micro-batches 4 --methods scan_accumulation adama adama_release

``--dtype bfloat16`` runs every model in bf16 compute with float32 params and
moments (mixed precision, as on a GPU), as ``models.train`` and
``models.gpu_bench`` take it; the memory rows then read ``preset (bfloat16)``.

Memory is compile-only (``memory_analysis()``), so GPT-2 XL can be measured on a
laptop; quoted in bytes and in P (bytes of one copy of the parameters), next to
AdamA's analytic floor from ``optax_adama.memory.memory_floor``. By default XLA's
CPU backend compiles the steps; ``memory --target tpu:v3-8`` (or ``gpu:h100``, any
of ``optax_adama.memory.TARGET_NAMES``; in .venv-tpu / .venv-gpu) compiles them
for one device of that machine with its own compiler, and marks the steps over
its memory. Every memory table says which compiler made it.

The command line and its sweeps: each method's step (``models.harness.make_step``),
its floor (``harness.floor_for``) and the interleaved timing
(``harness.measure_throughput``) are the harness's, shared with models.gpu_bench and
models.demo; the memory table is ``models.harness.memory``'s and the capacity search
``models.harness.capacity``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

import models
import optax_adama
from models import harness
from models.harness import capacity
from models.harness.memory import MemoryRow
from models.harness.memory import check_memory_method
from models.harness.memory import measure_memory
from models.harness.memory import memory_table
from models.harness.memory import plot_memory_vs_n


def _parser() -> argparse.ArgumentParser:
  """The command line (its ``error`` ends the command as argparse does)."""
  parser = argparse.ArgumentParser(prog="python -m models.bench",
                                   description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--methods", nargs="+",
                      choices=(harness.METHODS + ("scan_accumulation_bf16",)
                               + harness.ESTIMATOR_METHODS + harness.SHARDED_METHODS
                               + harness.RELEASE_METHODS + harness.STATE_METHODS
                               + harness.FSDP_METHODS),
                      default=list(harness.METHODS))
  common.add_argument("--micro-batch-size", type=int, default=1)
  common.add_argument("--seq-len", type=int, default=None, help="default: the preset's context")
  common.add_argument("--json", type=Path, default=None, help="write results as JSON here")
  common.add_argument("--markdown", type=Path, default=None, help="write the table here")
  common.add_argument("--no-progress", action="store_true")
  common.add_argument("--dtype", choices=models.COMPUTE_DTYPES, default=None,
                      help="compute dtype of every model (params and moments float32, as "
                           "models.train's --dtype); default: float32")
  presets = dict(nargs="+", choices=sorted(models.PRESETS), metavar="PRESET")
  mem = sub.add_parser("memory", parents=[common], help="compile-only memory sweep")
  mem.add_argument("--presets", default=["gpt2_small", "bert_base", "vit_base"], **presets)
  mem.add_argument("--num-micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
  mem.add_argument("--remat", default="none", choices=sorted(models.REMAT_POLICIES))
  mem.add_argument("--plot", type=Path, default=None, help="PNG of memory vs N")
  mem.add_argument("--scan-layers", action="store_true",
                   help="stacked block params under one lax.scan; adds adama_release")
  mem.add_argument("--target", default=None,
                   help="compile for one device of this machine with its own compiler, e.g. "
                        "tpu:v3-8, gpu:h100 (optax_adama.memory.TARGET_NAMES; needs .venv-tpu "
                        "or .venv-gpu); default: XLA's CPU backend")
  thr = sub.add_parser("throughput", parents=[common], help="interleaved step timing")
  thr.add_argument("--presets", default=["gpt_tiny", "bert_tiny", "vit_tiny"], **presets)
  thr.add_argument("--num-micro-batches", type=int, default=4)
  thr.add_argument("--rounds", type=int, default=7)
  thr.add_argument("--steps-per-round", type=int, default=5)
  replot = sub.add_parser("plot", help="redraw memory vs N from a memory --json file")
  replot.add_argument("json_in", type=Path)
  replot.add_argument("--plot", type=Path, required=True)
  tab = sub.add_parser(
      "table", help="the markdown table of saved memory or capacity --json files, merged "
      "(e.g. one run per method)")
  tab.add_argument("json_in", type=Path, nargs="+")
  tab.add_argument("--json", type=Path, default=None, help="write the merged JSON here")
  tab.add_argument("--markdown", type=Path, default=None, help="write the table here")
  tab.add_argument("--plot", type=Path, default=None,
                   help="capacity runs: PNG of parameters that fit against the budget")
  cap = sub.add_parser("capacity", parents=[common], help="largest GPT under a budget")
  cap.add_argument("--budgets-gb", type=float, nargs="+", default=[16, 24, 40, 80])
  cap.add_argument("--num-micro-batches", type=int, default=4)
  cap.add_argument("--remat", default="full", choices=sorted(models.REMAT_POLICIES))
  cap.add_argument("--max-scale", type=int, default=96)
  cap.add_argument("--refine-width", action="store_true",
                   help="then grow the answer's width in steps of 64 at the same depth")
  cap.add_argument("--vocab-size", type=int, default=50257)
  cap.add_argument("--scan-layers", action="store_true",
                   help="every method on the scanned model (blocks stacked under one "
                        "lax.scan, where remat holds on any backend); allows the release "
                        "methods")
  cap.add_argument("--target", default=None, choices=optax_adama.memory.TARGET_NAMES,
                   help="compile every candidate with this machine's own compiler, for one "
                        "of its devices (or a mesh of --devices of them), e.g. gpu:h100 or "
                        "tpu:v5e-8 (needs .venv-gpu or .venv-tpu); default: XLA's CPU backend")
  cap.add_argument("--devices", type=int, default=1,
                   help="data-parallel mesh size (on CPU, fakes this many devices); "
                        "the budget is then per device")
  return parser


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """The arguments, refused as argparse refuses them where no method can run."""
  parser = _parser()
  args = parser.parse_args(argv)
  with harness.command_errors(parser):
    _check_args(args)
  return args


def _check_args(args: argparse.Namespace) -> None:
  """Raises ``ValueError`` for settings no method can measure, before any compile."""
  if args.command in ("plot", "table"):
    return
  if getattr(args, "target", None):
    args.target = optax_adama.memory.parse_target(args.target)
  harness.check_counts(**{name: getattr(args, name, None) for name in (
      "num_micro_batches", "micro_batch_size", "seq_len", "devices", "rounds",
      "steps_per_round", "max_scale")})
  for preset in getattr(args, "presets", ()):
    harness.check_seq_len(preset, models.get_config(preset), args.seq_len)
  scanned = getattr(args, "scan_layers", False)
  mesh = getattr(args, "devices", 1) > 1
  for method in args.methods:
    harness.check_method(method, scanned=scanned, mesh=mesh)
    if args.command == "memory":
      check_memory_method(method)
  if (mesh and getattr(args, "target", None) is None and jax.default_backend() == "cpu"
      and jax.device_count() < args.devices):
    raise ValueError(
        f"devices={args.devices} on CPU: start with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse_args(argv)
  if args.command == "plot":
    saved = json.loads(args.json_in.read_text())
    plot_memory_vs_n([MemoryRow(**row) for row in saved["rows"]], args.plot)
    return saved
  if args.command == "table":
    with harness.command_errors(_parser(), OSError):
      runs = [json.loads(path.read_text()) for path in args.json_in]
      commands = {run.get("command") for run in runs}
      if len(commands) != 1 or commands & {"memory", "capacity"} != commands:
        raise ValueError(f"json_in: table merges memory runs or capacity runs, got "
                         f"{sorted(map(str, commands))}; pass the --json files of one kind.")
      compilers = {run.get("compiled_for") for run in runs}
      if len(compilers) > 1:
        raise ValueError(f"json_in: these runs come from different compilers: "
                         f"{sorted(map(str, compilers))}; one table is one compiler's.")
    return merge_tables(args, runs)
  progress = not args.no_progress
  if getattr(args, "target", None):
    # Before anything starts jax's backends: without a GPU here, the CUDA
    # plugin's compile-only devices need jax on the CPU.
    with harness.command_errors(_parser(), optax_adama.memory.TargetUnavailableError):
      optax_adama.memory.target_devices(args.target)
  mesh = None
  target = getattr(args, "target", None)  # a Target, parsed with the arguments
  if args.command == "capacity" and args.devices > 1:
    mesh = (jax.make_mesh((args.devices,), ("data",)) if target is None
            else optax_adama.memory.target_mesh(target, (args.devices,)))
  result: dict[str, Any] = {"command": args.command, "machine": harness.machine_info(),
                            "argv": list(sys.argv[1:] if argv is None else argv)}
  if args.command == "memory":
    rows: list[MemoryRow] = []
    jobs = [(p, n) for p in args.presets for n in args.num_micro_batches]
    for preset, n in tqdm(jobs, desc="memory", disable=not progress, file=sys.stderr):
      methods = list(args.methods)
      if args.scan_layers and "adama_release" not in methods:
        methods.append("adama_release")
      rows += measure_memory(preset, methods, n, micro_batch_size=args.micro_batch_size,
                             seq_len=args.seq_len, remat=args.remat,
                             scan_layers=args.scan_layers, dtype=args.dtype,
                             target=args.target)
      # Written as it goes: a sweep of the big presets takes hours on a CPU.
      result["rows"] = [dataclasses.asdict(r) for r in rows]
      _write_outputs(args, result, memory_table(rows))
    table = memory_table(rows)
    if args.plot:
      plot_memory_vs_n(rows, args.plot)
  elif args.command == "throughput":
    result["presets"] = {}
    lines = ["| preset | N | " + " | ".join(args.methods) + " | AdamA / scan_accumulation |",
             "|" + "---|" * (len(args.methods) + 3)]
    for preset in args.presets:
      timing = harness.measure_throughput(
          preset, args.methods, args.num_micro_batches, micro_batch_size=args.micro_batch_size,
          seq_len=args.seq_len, rounds=args.rounds, steps_per_round=args.steps_per_round,
          progress=progress, dtype=args.dtype)
      result["presets"][preset] = timing
      ratio = ""
      if "adama" in timing and "scan_accumulation" in timing:
        ratio = (timing["adama"]["median_step_s"]
                 / timing["scan_accumulation"]["median_step_s"])
        ratio = f"{ratio:.3f}"
      lines.append(f"| {preset} | {args.num_micro_batches} | " + " | ".join(
          f"{timing[m]['median_step_s'] * 1e3:.1f} ms ({timing[m]['tokens_per_s']:,.0f} tok/s)"
          for m in args.methods) + f" | {ratio} |")
    table = "\n".join(lines)
  else:
    results = capacity.measure_capacity(
        args.budgets_gb, args.methods, num_micro_batches=args.num_micro_batches,
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len or 1024,
        remat=args.remat, max_scale=args.max_scale, vocab_size=args.vocab_size, mesh=mesh,
        refine_width=args.refine_width, scan_layers=args.scan_layers,
        dtype=None if args.dtype is None else jnp.dtype(args.dtype), progress=progress,
        target=target,
        # Written as it goes: each compile of a big model takes minutes on a CPU.
        on_result=lambda so_far: _write_outputs(
            args, {**result, "capacity": so_far}, capacity.capacity_table(so_far)))
    result["capacity"] = results
    on = "" if target is None else f", on {args.devices} of its devices"
    result["compiled_for"] = optax_adama.memory.compiled_by(target, args.devices) + on
    table = _capacity_page(result["compiled_for"], [result["argv"]], results)
  print(table)
  _write_outputs(args, result, table)
  return result


def merge_tables(args: argparse.Namespace, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """``table``: merges saved memory or capacity runs (all of one command) and
  prints their table."""
  (command,) = {run["command"] for run in runs}
  merged: dict[str, Any] = {"command": command, "machine": runs[0]["machine"],
                            "argv": [run["argv"] for run in runs]}
  if command == "memory":
    order = {m: i for i, m in enumerate(harness.METHODS)}
    rows = sorted((MemoryRow(**row) for run in runs for row in run["rows"]),
                  key=lambda r: (r.preset, r.num_micro_batches, order[r.method]))
    merged["rows"] = [dataclasses.asdict(r) for r in rows]
    table = memory_table(rows)
  else:
    merged["capacity"] = sorted((r for run in runs for r in run["capacity"]),
                                key=lambda r: r["budget_gb"])
    # None: runs saved before the field, their compiler not on record.
    (merged["compiled_for"],) = {run.get("compiled_for") for run in runs}
    table = _capacity_page(merged["compiled_for"], merged["argv"], merged["capacity"])
    if args.plot:
      capacity.plot_capacity(merged["capacity"], args.plot)
  print(table)
  _write_outputs(args, merged, table)
  return merged


def _capacity_page(compiled_for: str | None, argvs: Sequence[Sequence[str]],
                   results: Sequence[dict[str, Any]]) -> str:
  """A capacity table under the commands and the compiler that made it."""
  made_by = "; ".join(f"`python -m models.bench {' '.join(argv)}`" for argv in argvs)
  header = f"Made by {made_by}" + (f", compiled by {compiled_for}" if compiled_for else "")
  return header + ".\n\n" + capacity.capacity_table(results)


def _write_outputs(args: argparse.Namespace, result: dict[str, Any], table: str) -> None:
  if args.markdown:
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(table + "\n")
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
