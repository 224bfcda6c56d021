"""Memory, throughput and capacity of AdamA against every way JAX users accumulate.

    python -m models.bench memory --presets gpt2_small bert_base vit_base \
        --num-micro-batches 1 2 4 8 16 --json benchmarks/memory.json
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

Each method's step (``models.harness.make_step``), its floor
(``harness.floor_for``) and the interleaved timing
(``harness.measure_throughput``) live in ``models.harness``, shared with
models.gpu_bench and models.demo; the sweeps, the capacity search, the tables
and the plots are this command's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

import models
import optax_adama
from models import capacity
from models import harness


@dataclasses.dataclass(frozen=True)
class MemoryRow:
  preset: str
  method: str
  num_micro_batches: int
  micro_batch_size: int
  param_count: int
  report: dict[str, float]
  floor: dict[str, float]
  compile_s: float
  # The compiler of the step (optax_adama.memory.compiled_by); "" in runs saved
  # before the column, all XLA's CPU backend.
  compiled_for: str = ""
  # Whether the step fits one device of the --target; None without one.
  fits: bool | None = None


def measure_memory(
    preset: str | models.Config,
    methods: Sequence[str],
    num_micro_batches: int,
    *,
    micro_batch_size: int,
    seq_len: int | None = None,
    remat: str = "none",
    scan_layers: bool = False,
    dtype: str | None = None,
    target: optax_adama.memory.Target | None = None,
) -> list[MemoryRow]:
  """Compile-only memory of each method's step, and AdamA's floor.

  With ``scan_layers`` the steps run the scanned model and the floor is the
  unrolled model's (the same params; its largest gradient is one layer's).
  ``dtype``: the compute dtype (params and moments stay float32); None: the
  preset's. ``target``: compile each step for one device of that machine with
  its compiler and options (the floor's activations stay the CPU backend's).
  """
  config = models.get_config(preset, remat=remat, scan_layers=scan_layers,
                             **harness.dtype_override(dtype))
  notes = [note for note, on in (("scanned", scan_layers), (dtype, dtype is not None)) if on]
  name = (preset if isinstance(preset, str) else "custom") + (
      f" ({', '.join(notes)})" if notes else "")
  loss_fn, params = harness.split_model(config)
  rows = []
  batch = harness.abstract_batch(config, micro_batch_size * num_micro_batches, seq_len)
  floors = {}
  for method in methods:
    _check_memory_method(method)
    release = method in harness.RELEASE_METHODS
    if release not in floors:
      floors[release] = harness.floor_for(method, config, batch, num_micro_batches).to_dict()
    floor = floors[release]
    step, tx = harness.make_step(method, loss_fn, num_micro_batches=num_micro_batches,
                                 rank=config.hidden // 4)
    opt_state = jax.eval_shape(tx.init, params)
    start = time.perf_counter()
    args = on_target((params, opt_state, batch), target)
    compiled = optax_adama.memory.compile_for(step, *args, target=target)
    report = optax_adama.memory_report(compiled, *args)
    rows.append(MemoryRow(
        name, method, num_micro_batches, micro_batch_size,
        models.param_count(config), report.to_dict(), floor,
        time.perf_counter() - start, optax_adama.memory.compiled_by(target),
        None if target is None else target.fits(report.total_bytes)))
  return rows


def on_target(tree: Any, target: optax_adama.memory.Target | None) -> Any:
  """``tree``'s shapes placed on the first compile-only device of ``target``
  (what the step then compiles for); ``tree`` itself without one."""
  if target is None:
    return tree
  device = optax_adama.memory.target_devices(target)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _check_memory_method(method: str) -> None:
  """Refuses what the compile-only memory table cannot measure."""
  if method.endswith("_offload"):
    raise ValueError(
        f"method {method}: its state lives in host memory, which this compile-only "
        "table would count as device memory on CPU; measure it with the capacity "
        "command, or drop it from --methods.")


def compiled_for_line(rows: Sequence[MemoryRow]) -> str:
  """The memory table's first line: which compiler made its steps' bytes."""
  compilers = sorted({r.compiled_for or optax_adama.memory.compiled_by() for r in rows})
  return "Compiled by " + "; ".join(compilers) + "."


def memory_table(rows: Sequence[MemoryRow]) -> str:
  """Markdown: one row per (preset, N), one column per method, in GiB and P; the
  line above it names the compiler, and a step over a target's memory says so."""
  methods = [m for m in harness.METHODS + harness.RELEASE_METHODS
             if any(r.method == m for r in rows)]
  release = any(r.method in harness.RELEASE_METHODS for r in rows)
  head = ("| preset | params | N | floor | " + " | ".join(methods) + " | AdamA vs floor |"
          + (" release vs its floor (remat full) |" if release else "")
          + "\n|" + "---|" * (len(methods) + 5 + release))
  lines = [head]
  keys = sorted({(r.preset, r.num_micro_batches) for r in rows},
                key=lambda k: (list(models.PRESETS).index(k[0]) if k[0] in models.PRESETS
                               else 0, k[1]))
  for preset, n in keys:
    group = {r.method: r for r in rows if (r.preset, r.num_micro_batches) == (preset, n)}
    any_row = next((r for r in group.values() if r.method not in harness.RELEASE_METHODS),
                   next(iter(group.values())))
    floor = any_row.floor
    cells = []
    for method in methods:
      r = group.get(method)
      cells.append("" if r is None else
                   f"{r.report['total_bytes'] / 2**30:.2f} GiB ({r.report['total_p']:.2f} P)"
                   + (" **over**" if r.fits is False else ""))
    def vs_own_floor(method):
      r = group.get(method)
      if r is None:
        return ""
      return (f"{100 * (r.report['total_bytes'] / r.floor['total_bytes'] - 1):+.1f}%"
              + (f" ({r.floor['total_p']:.2f} P)" if method in harness.RELEASE_METHODS else ""))

    lines.append(
        f"| {preset} | {any_row.param_count / 1e6:.1f}M | {n} "
        f"| {floor['total_bytes'] / 2**30:.2f} GiB ({floor['total_p']:.2f} P) | "
        + " | ".join(cells) + f" | {vs_own_floor('adama')} |"
        + (f" {vs_own_floor('adama_release')} |" if release else ""))
  note = compiled_for_line(rows)
  if any(r.fits is not None for r in rows):
    note += (" Each step for one device of it; **over**: the step does not fit that "
             "device's memory. The floor's activations are the CPU backend's.")
  return note + "\n\n" + "\n".join(lines)


def plot_memory_vs_n(rows: Sequence[MemoryRow], path: Path) -> None:
  """One panel per preset: compiled memory (P) against N, a line per method."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  presets = list(dict.fromkeys(r.preset for r in rows))
  fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
  for ax, preset in zip(axes[0], presets):
    for method in harness.METHODS:
      points = sorted((r.num_micro_batches, r.report["total_p"])
                      for r in rows if r.preset == preset and r.method == method)
      if points:
        ax.plot(*zip(*points), marker="o", label=method)
    floor = sorted({(r.num_micro_batches, r.floor["total_p"]) for r in rows if r.preset == preset})
    ax.plot(*zip(*floor), "k--", label="AdamA floor")
    # Full-batch memory grows N-fold and would flatten the lines that matter.
    accumulating = [r.report["total_p"] for r in rows
                    if r.preset == preset and r.method != "full_batch"]
    if accumulating:
      low = min(min(accumulating), min(p for _, p in floor))
      ax.set_ylim(low * 0.9, max(accumulating) * 1.15)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per mini-batch (N)")
    ax.set_ylabel("compiled step memory (P)")
    ax.set_title(f"{preset} (full_batch leaves the frame as N grows)")
    ax.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


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
      _check_memory_method(method)
  if mesh and jax.default_backend() == "cpu" and jax.device_count() < args.devices:
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
    return merge_tables(args, runs)
  progress = not args.no_progress
  if getattr(args, "target", None):
    # Before anything starts jax's backends: without a GPU here, the CUDA
    # plugin's compile-only devices need jax on the CPU.
    with harness.command_errors(_parser(), optax_adama.memory.TargetUnavailableError):
      optax_adama.memory.target_devices(args.target)
  mesh = None
  if args.command == "capacity" and args.devices > 1:
    mesh = jax.make_mesh((args.devices,), ("data",))
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
        # Written as it goes: each compile of a big model takes minutes on a CPU.
        on_result=lambda so_far: _write_outputs(
            args, {**result, "capacity": so_far}, capacity.capacity_table(so_far)))
    result["capacity"] = results
    table = f"Compiled by {optax_adama.memory.compiled_by(num_devices=args.devices)}.\n\n" + (
        capacity.capacity_table(results))
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
    table = capacity.capacity_table(merged["capacity"])
    if args.plot:
      capacity.plot_capacity(merged["capacity"], args.plot)
  print(table)
  _write_outputs(args, merged, table)
  return merged


def _write_outputs(args: argparse.Namespace, result: dict[str, Any], table: str) -> None:
  if args.markdown:
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(table + "\n")
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
