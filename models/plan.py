"""Plan a training step that fits a memory budget: N, remat, savers and moments.

    python -m models.plan --preset gpt2_large --budget-gb 24
    python -m models.train --preset gpt2_large --plan 24      # trains with the plan
    python -m models.plan --preset gpt2_small --survey --num-micro-batches 4
    python -m models.plan --preset llama2_7b --budget-gb 16 --devices 8 \
        --batch-size 32 --seq-len 2048     # per device, on a mesh of 8 (ZeRO stages)
    python -m models.plan --preset llama2_7b --target tpu:v3-8 --devices 8 \
        --batch-size 32 --seq-len 2048     # compiled by libtpu (make venv-tpu), 15.48 GiB

The search and its step-time predictor are `models.planner` (its docstring
says what is searched and how time is predicted); `models.train --plan` runs
the same search. This command prints the plan, or with `--survey` measures
every activation setting at one N (compile only), and with `--frontier` times
a survey's settings on this machine and plots memory against step time.

`--devices D` plans data parallel on D devices: the budget is per device, the
batch the whole mini-batch. Where the process has fewer devices, fake CPU
devices are made for the compile-only measurements, by setting
XLA_FLAGS=--xla_force_host_platform_device_count=D before jax initialises,
with XLA's CPU code generation at its cheapest
(--xla_backend_optimization_level=0, no expensive LLVM passes: nothing runs,
and the compiled HLO, its memory and cost analyses and collectives are the
same; one llama2_7b step compiled in 9 s instead of 15 here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models import harness
from models import planner
from optax_adama.memory import Considered
from optax_adama.memory import Machine
from optax_adama.memory import Plan
from optax_adama.memory import PlanSettings


def survey_candidates(
    num_micro_batches: int, loss_chunks: Sequence[int] = (1, planner.LOSS_CHUNKS),
) -> list[PlanSettings]:
  """What `survey` measures at one N, float32 moments: every activation setting of
  the planner, 2-bit GELU, the loss in each chunk count above 1 of `loss_chunks`
  (`planner.default_loss_chunks`: GPT's) under remat "full" and the release, and the
  sampled projection (keep ratio 0.5) with no remat."""
  settings = [planner.step_settings(num_micro_batches, remat, bits)
              for remat, bits in planner.ACTIVATION_SETTINGS]
  settings.insert(2, planner.step_settings(num_micro_batches, "none", 2))
  settings += [planner.step_settings(num_micro_batches, remat, loss_chunks=chunks)
               for chunks in loss_chunks if chunks > 1 for remat in ("full", planner.RELEASE)]
  return settings + [planner.step_settings(num_micro_batches, "none", linear_keep_ratio=0.5)]


def survey(preset: str, candidates: Sequence[PlanSettings], *, batch_size: int,
           seq_len: int | None = None, machine: Machine | None = None) -> list[Considered]:
  """Each candidate compiled and measured, in order (fits: always True)."""
  machine = Machine() if machine is None else machine
  rows = []
  for candidate in candidates:
    measurement = planner.measure(preset, candidate, batch_size=batch_size, seq_len=seq_len)
    rows.append(Considered(
        candidate, measurement, measurement.predicted_s(machine, candidate.num_micro_batches),
        True))
  return rows


def time_settings(
    preset: str,
    candidates: Sequence[PlanSettings],
    *,
    batch_size: int,
    seq_len: int | None = None,
    rounds: int = 5,
    steps_per_round: int = 3,
) -> dict[str, float]:
  """Median measured AdamA step time (s) of each candidate on this machine, by label.

  The settings are run round by round, interleaved, so drift of a shared
  machine's load hits every setting alike (as `models.bench throughput` does
  for its methods).
  """
  runners = {}
  for candidate in candidates:
    # The step models.train runs for this setting (as `planner.measure` compiles it).
    run = planner.train_config(preset, candidate, batch_size=batch_size, seq_len=seq_len)
    config = harness.model_config_of(run)
    model = models.create(config, rngs=nnx.Rngs(0))
    loss_fn, params = models.split_loss_fn(model, has_aux=True)
    tx = harness.make_optimizer(run)
    step = harness.make_train_step(run, model, loss_fn, tx)
    batch = harness.random_batch(config, harness.abstract_batch(config, batch_size, seq_len))
    state = tx.init(params)
    runners[planner.label(candidate)] = [step.lower(params, state, batch).compile(),
                                         params, state, batch]
  times: dict[str, list[float]] = {label: [] for label in runners}
  for round_index in tqdm(range(rounds + 1), desc="timing rounds", file=sys.stderr):
    for label, (compiled, params, state, batch) in runners.items():  # round 0: warm-up
      start = time.perf_counter()
      for _ in range(steps_per_round):
        params, state, metrics = compiled(params, state, batch)
      jax.block_until_ready(metrics)
      runners[label][1:3] = [params, state]
      if round_index:
        times[label].append((time.perf_counter() - start) / steps_per_round)
  return {label: float(np.median(seconds)) for label, seconds in times.items()}


def plot_frontier(memory_p: dict[str, float], step_s: dict[str, float], path: Path,
                  title: str) -> None:
  """Memory (P) against step time, one point per setting; remat-only points joined."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def is_saver(label: str) -> bool:
    return " + " in label or label == planner.RELEASE

  fig, ax = plt.subplots(figsize=(7, 4.5))
  remat_only = sorted((memory_p[k], step_s[k] * 1e3) for k in memory_p
                      if not is_saver(k) and k in step_s)
  # The frontier: each remat point faster than every smaller one.
  frontier = [p for i, p in enumerate(remat_only)
              if all(p[1] < q[1] for q in remat_only[:i])]
  ax.step(*zip(*frontier), where="post", color="0.6", zorder=1,
          label="remat policies alone: frontier")
  for label in memory_p:
    if label in step_s:
      saver = is_saver(label)
      ax.scatter(memory_p[label], step_s[label] * 1e3, zorder=2,
                 marker="*" if saver else "o", s=120 if saver else 40)
      ax.annotate(label, (memory_p[label], step_s[label] * 1e3), fontsize=8,
                  xytext=(4, 4), textcoords="offset points")
  ax.set_xlabel("gpt2_small AdamA step, compile-only device memory (P)")
  ax.set_ylabel("gpt_tiny AdamA step time, CPU (ms)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m models.plan",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", required=True, choices=sorted(models.PRESETS))
  parser.add_argument("--budget-gb", type=float, default=None,
                      help="device memory budget in GB (1e9 bytes)")
  parser.add_argument("--batch-size", type=int, default=8,
                      help="mini-batch (sequences or images); N divides it")
  parser.add_argument("--seq-len", type=int, default=None,
                      help="tokens per sequence; default: the preset's context")
  parser.add_argument("--peak-tflops", type=float, default=Machine.peak_flops / 1e12)
  parser.add_argument("--bandwidth-gbs", type=float, default=Machine.memory_bandwidth / 1e9)
  parser.add_argument("--host-gbs", type=float, default=Machine.host_bandwidth / 1e9)
  parser.add_argument("--devices", type=int, default=1,
                      help="plan data parallel on a mesh of this many devices (ZeRO stages); "
                           "the budget is per device, --batch-size the whole mini-batch")
  parser.add_argument("--interconnect-gbs", type=float,
                      default=Machine.interconnect_bandwidth / 1e9,
                      help="GB/s a device sends in collectives (with --devices)")
  parser.add_argument("--target", default=None, choices=optax_adama.memory.TARGET_NAMES,
                      help="compile for this machine's devices with its own compiler, no "
                           "device needed (libtpu: make venv-tpu; XLA's GPU compiler: make "
                           "venv-gpu); the budget defaults to a device's usable memory")
  parser.add_argument("--survey", action="store_true",
                      help="instead: measure every activation setting at one N")
  parser.add_argument("--num-micro-batches", type=int, default=4,
                      help="N of --survey and --frontier")
  parser.add_argument("--frontier", type=Path, default=None, metavar="SURVEY_JSON",
                      help="instead: time --preset's step on this machine for every setting "
                           "of a --survey JSON and plot survey memory against step time")
  parser.add_argument("--plot", type=Path, default=None, help="the --frontier PNG")
  parser.add_argument("--rounds", type=int, default=5,
                      help="--frontier: timed rounds (medians over them)")
  parser.add_argument("--json", type=Path, default=None)
  parser.add_argument("--markdown", type=Path, default=None)
  return parser


# The flags that are a count or a size: each must be positive.
_POSITIVE = ("budget_gb", "batch_size", "seq_len", "num_micro_batches", "rounds", "peak_tflops",
             "bandwidth_gbs", "host_gbs", "interconnect_gbs")


def _parse_args(parser: argparse.ArgumentParser,
                argv: Sequence[str] | None) -> argparse.Namespace:
  args = parser.parse_args(argv)
  if args.target is not None:
    _check_target(parser, args)
  if args.budget_gb is None and not (args.survey or args.frontier):
    parser.error("give --budget-gb (or --survey, or --frontier)")
  for name in _POSITIVE:
    value = getattr(args, name)
    if value is not None and not value > 0:
      flag = "--" + name.replace("_", "-")
      parser.error(f"{flag} must be positive, got {value:g}: pass e.g. "
                   f"{flag} {parser.get_default(name) or 16}")
  if args.devices < 1:
    parser.error(f"--devices must be >= 1, got {args.devices}")
  if args.devices > 1:
    if args.survey or args.frontier:
      parser.error("--devices plans on a mesh; --survey and --frontier measure one device")
    if args.batch_size % args.devices:
      parser.error(f"--batch-size {args.batch_size} is the whole mini-batch over "
                   f"{args.devices} devices: pass a multiple of {args.devices}")
    problem = None if args.target is not None else _make_devices(args.devices)
    if problem:
      parser.error(problem)
  return args


def _check_target(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """`--target`: its devices, reachable here, and a budget it has; the budget
  defaults to one device's usable memory. Replaces the name by its `Target`."""
  if args.survey or args.frontier:
    parser.error("--target plans; --survey and --frontier measure this machine")
  target = optax_adama.memory.parse_target(args.target)
  try:
    found = len(optax_adama.memory.target_devices(target))
  except optax_adama.memory.TargetUnavailableError as error:
    parser.error(str(error))
  if args.devices > found:
    parser.error(f"--devices {args.devices}: {target.name} has {found} devices")
  usable_gb = target.memory_bytes / 1e9
  if args.budget_gb is None:
    args.budget_gb = usable_gb
  elif args.budget_gb > usable_gb:
    parser.error(f"--budget-gb {args.budget_gb:g}: a {target.name} device can use "
                 f"{usable_gb:.2f} GB; pass that or less")
  args.target = target


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Compile only: the CPU's machine code is never run, so XLA skips its costly
# optimisation (the HLO, memory and cost analyses are unchanged).
_CHEAP_CODEGEN_FLAGS = ("--xla_backend_optimization_level=0",
                        "--xla_llvm_disable_expensive_passes=true")


def _make_devices(devices: int) -> str | None:
  """Makes `devices` fake CPU devices where the process's XLA_FLAGS name no
  device count (XLA reads them as jax initialises: a no-op once it has);
  returns the one-line problem if there are still too few."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  if not any(f.startswith(_DEVICE_COUNT_FLAG) for f in flags):
    flags += [f"{_DEVICE_COUNT_FLAG}={devices}", *_CHEAP_CODEGEN_FLAGS]
    os.environ["XLA_FLAGS"] = " ".join(flags)
  if max(len(jax.devices()), len(jax.devices("cpu"))) >= devices:
    return None
  return (f"--devices {devices} needs {devices} devices; jax was initialised with "
          f"{jax.device_count()} before --devices could set XLA_FLAGS. Run it as its own "
          f"process, or with XLA_FLAGS={_DEVICE_COUNT_FLAG}={devices}")


def main(argv: Sequence[str] | None = None) -> Plan | list[Considered] | dict[str, Any]:
  parser = _parser()
  args = _parse_args(parser, argv)
  machine = Machine(args.peak_tflops * 1e12, args.bandwidth_gbs * 1e9,
                            args.host_gbs * 1e9, args.interconnect_gbs * 1e9)
  if args.target is not None:
    header = (f"{args.preset}, batch {args.batch_size} ({args.batch_size // args.devices} a "
              f"device), seq_len {args.seq_len or 'preset'}, on {args.devices} device(s), "
              f"compiled by {optax_adama.memory.compiled_by(args.target)}, "
              f"budget per device; predictor: {machine}")
  elif args.devices > 1:
    mesh = planner.device_mesh(args.devices)
    header = (f"{args.preset}, batch {args.batch_size} ({args.batch_size // args.devices} a "
              f"device), seq_len {args.seq_len or 'preset'}, data parallel on "
              f"{args.devices} {mesh.devices.flat[0].platform} devices (compile only), budget "
              f"per device; predictor: {machine}")
  else:
    header = (f"{args.preset}, batch {args.batch_size}, seq_len {args.seq_len or 'preset'}, "
              f"on {jax.default_backend()} (compile only); predictor: {machine}")
  if args.frontier:
    return _frontier(args)
  if args.survey:
    candidates = survey_candidates(args.num_micro_batches,
                                   planner.default_loss_chunks(args.preset, args.seq_len))
    rows = survey(args.preset, candidates, batch_size=args.batch_size,
                  seq_len=args.seq_len, machine=machine)
    p = rows[0].measurement.param_bytes
    lines = ["| setting | device memory | host memory | predicted step |", "|---|---|---|---|"]
    lines += [f"| {r.candidate.describe()} | {r.measurement.device_bytes:,} B "
              f"({r.measurement.device_bytes / p:.2f} P) | {r.measurement.host_bytes:,} B "
              f"| {r.predicted_s * 1e3:.1f} ms |" for r in rows]
    table, result = "\n".join(lines), rows
    payload: Any = {"header": header, "rows": [planner.considered_dict(r) for r in rows]}
  else:
    start = time.perf_counter()
    try:
      result = planner.plan(args.preset, args.budget_gb * 1e9, batch_size=args.batch_size,
                            seq_len=args.seq_len, devices=args.devices, machine=machine,
                            progress=True, target=args.target)
    except ValueError as error:  # nothing fits, or a batch the mesh cannot split
      flag = "--batch-size" if "batch_size" in str(error) else "--budget-gb"
      parser.error(f"{flag} {getattr(args, flag[2:].replace('-', '_')):g}: {error}")
    # The search's wall time, recorded so that a page quoting it can be checked.
    seconds = time.perf_counter() - start
    searched_on = f"{harness.cpu_name()}, {os.cpu_count()} cores"
    table = (f"{planner.table(result)}\n\n{_chosen_lines(args, result, machine)}\n"
             f"searched in {seconds:.0f} s on {searched_on}")
    payload = {"header": header, "argv": sys.argv[1:] if argv is None else list(argv),
               "compiled_by": optax_adama.memory.compiled_by(
                   args.target, None if args.target else args.devices),
               "seconds": round(seconds, 1), "searched_on": searched_on,
               "plan": planner.plan_dict(result, preset=args.preset,
                                         batch_size=args.batch_size, seq_len=args.seq_len)}
  print(header)
  print(table)
  if args.markdown:
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(f"{header}\n\n{table}\n")
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1, default=str))
  return result


def _chosen_lines(args: argparse.Namespace, result: Plan, machine: Machine) -> str:
  """The choice, its verified bytes and predicted time, and how to run it."""
  c, choice = result.measurement, result.settings
  seq = f" --seq-len {args.seq_len}" if args.seq_len else ""
  if args.devices == 1:
    return (f"chosen: {choice.describe()}: verified "
            f"{c.device_bytes / 1e9:.2f} GB ({c.device_bytes / c.param_bytes:.2f} P) of "
            f"{args.budget_gb:g} GB, predicted {result.predicted_s * 1e3:.1f} ms a step\n"
            f"train with: python -m models.train --preset {args.preset} "
            f"--batch-size {args.batch_size}{seq} --plan {args.budget_gb:g}")
  parts = c.predicted_parts(machine, choice.num_micro_batches)
  return (f"chosen: {choice.describe(on_mesh=True)}: verified {c.device_bytes / 1e9:.4g} GB a "
          f"device ({c.device_bytes / (c.param_bytes / args.devices):.2f} "
          f"P/{args.devices}) of {args.budget_gb:g} GB, predicted "
          f"{result.predicted_s * 1e3:.4g} ms a step ("
          + ", ".join(f"{name} {seconds * 1e3:.4g} ms" for name, seconds in parts.items()
                      if seconds) + ")\n"
          f"train with: python -m models.train --preset {args.preset} "
          f"--batch-size {args.batch_size}{seq} --mesh-devices {args.devices} "
          + " ".join(planner.train_flags(choice))
          + " (several hosts add --coordinator-address, --num-processes, --process-id)")


def _frontier(args: argparse.Namespace) -> dict[str, Any]:
  surveyed = json.loads(args.frontier.read_text())
  memory_p, candidates = {}, []
  for row in surveyed["rows"]:
    # Timed at this command's N; the memory is the survey's.
    candidates.append(dataclasses.replace(planner.step_settings(**row["candidate"]),
                                          num_micro_batches=args.num_micro_batches))
    measurement = row["measurement"]
    memory_p[planner.label(candidates[-1])] = (measurement["device_bytes"]
                                               / measurement["param_bytes"])
  step_s = time_settings(args.preset, candidates, batch_size=args.batch_size,
                         seq_len=args.seq_len, rounds=args.rounds)
  header = (f"memory: {surveyed['header']}; time: {args.preset}, batch {args.batch_size}, "
            f"N={args.num_micro_batches}, seq_len {args.seq_len or 'preset'}, on "
            f"{harness.cpu_name()} ({jax.default_backend()})")
  lines = ["| setting | memory | step time |", "|---|---|---|"]
  lines += [f"| {label} | {memory_p[label]:.2f} P | {step_s[label] * 1e3:.1f} ms |"
            for label in memory_p]
  table = "\n".join(lines)
  print(header)
  print(table)
  if args.plot:
    memory_of = surveyed["header"].split(",")[0]
    survey_n = surveyed["rows"][0]["candidate"]["num_micro_batches"]
    plot_frontier(memory_p, step_s, args.plot,
                  f"memory: {memory_of}, N={survey_n}, compile only; "
                  f"time: {args.preset}, N={args.num_micro_batches}, on {harness.cpu_name()}")
  result = {"header": header, "memory_p": memory_p, "step_s": step_s,
            "argv": list(sys.argv[1:])}
  if args.markdown:
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(f"{header}\n\n{table}\n")
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
