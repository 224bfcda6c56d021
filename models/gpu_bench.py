"""One call for the GPU numbers: live peak memory and interleaved step times.

    make bench-gpu                  # python -m models.gpu_bench, on a GPU machine
    python -m models.gpu_bench --presets gpt_test --num-micro-batches 2 --seq-len 16 \
        --out-dir /tmp/gpu_dry_run  # the CPU dry run the tests make

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

The memory processes run a few at a time (`--workers`) and share a persistent
compilation cache with the timing processes, so each step compiles once.
Results go to `<out-dir>/raw/gpu_<device>.json` and a markdown table,
`<out-dir>/gpu_<device>.md`; on the CPU backend there is no live peak (the
column says so) and the run only checks that the pipeline works.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models import harness

METHODS = ("scan_accumulation", "optax_microbatching", "multisteps", "adama")
# The memory fields of a row whose process failed (its "error" says why).
MISSING_MEMORY = {"compiled_total_bytes": None, "param_bytes": None,
                  "peak_bytes_in_use": None, "compile_s": None, "loss": None}


@dataclasses.dataclass(frozen=True)
class Case:
  """One preset, N and layout; every method is measured on it."""

  preset: str
  num_micro_batches: int
  scan_layers: bool
  micro_batch_size: int = 1
  seq_len: int | None = None  # None: the preset's context.

  @property
  def name(self) -> str:
    layout = "scanned" if self.scan_layers else "unrolled"
    return f"{self.preset} {layout} N={self.num_micro_batches}"

  @property
  def methods(self) -> tuple[str, ...]:
    # The float32 release step only: the table compares steps on the same
    # moments, and the 8-minute budget has no room for more.
    return METHODS + (("adama_release",) if self.scan_layers else ())

  def config(self) -> models.Config:
    return models.get_config(self.preset, scan_layers=self.scan_layers)

  def batch(self, config: models.Config) -> dict:
    return harness.random_batch(config, harness.abstract_batch(
        config, self.micro_batch_size * self.num_micro_batches, self.seq_len))


def measure_method(case: Case, method: str) -> dict[str, Any]:
  """Compiles and runs one method's step; meant for a process of its own."""
  config = case.config()
  model = models.create(config, rngs=nnx.Rngs(0))
  split = models.staged_loss if method in harness.RELEASE_METHODS else models.split_loss_fn
  loss_fn, params = split(model)
  del model
  batch = case.batch(config)
  step, tx = harness.make_step(method, loss_fn, num_micro_batches=case.num_micro_batches)
  state = tx.init(params)
  param_bytes = optax_adama.memory.tree_bytes(params)
  start = time.perf_counter()
  compiled = step.lower(params, state, batch).compile()
  compile_s = time.perf_counter() - start
  report = optax_adama.memory_report(compiled, param_bytes=param_bytes)
  for _ in range(3):
    params, state, metrics = compiled(params, state, batch)
  jax.block_until_ready((params, state, metrics))
  stats = jax.devices()[0].memory_stats()  # None on the CPU backend
  return {"compiled_total_bytes": report.total_bytes, "param_bytes": param_bytes,
          "peak_bytes_in_use": None if not stats else stats.get("peak_bytes_in_use"),
          "compile_s": compile_s, "loss": float(metrics["loss"])}


def measure_floor(case: Case, method: str) -> dict[str, Any]:
  """The floor ``method`` is held to (`models.harness.floor_for`)."""
  config = models.get_config(case.preset, scan_layers=False)
  batch = harness.abstract_batch(
      config, case.micro_batch_size * case.num_micro_batches, case.seq_len)
  floor = harness.floor_for(method, config, batch, case.num_micro_batches)
  return {"floor_bytes": floor.total_bytes, "param_bytes": floor.param_bytes}


def measure_times(case: Case, rounds: int, steps_per_round: int) -> dict[str, Any]:
  """Interleaved median step time of every method of the case."""
  times = harness.measure_throughput(
      case.config(), case.methods, case.num_micro_batches,
      micro_batch_size=case.micro_batch_size, seq_len=case.seq_len, rounds=rounds,
      steps_per_round=steps_per_round, progress=False)
  return {method: {"median_step_s": t["median_step_s"], "step_s_all": t["step_s_all"]}
          for method, t in times.items()}


def _worker(task: dict[str, Any]) -> dict[str, Any]:
  case = Case(**task["case"])
  if task["kind"] == "memory":
    return measure_method(case, task["method"])
  if task["kind"] == "floor":
    return measure_floor(case, task["method"])
  return measure_times(case, task["rounds"], task["steps_per_round"])


def run_in_process(task: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
  """Runs one task in a fresh Python process and returns its JSON result.

  A task that fails (out of memory, say) returns {"error": ...} rather than
  raising: one method's failure must not lose the other methods' numbers.
  """
  done = subprocess.run(
      [sys.executable, "-m", "models.gpu_bench", "--worker", json.dumps(task)],
      capture_output=True, text=True, env=env, check=False)
  if done.returncode:
    return {"error": done.stderr.strip()[-2000:] or f"exit status {done.returncode}"}
  return json.loads(done.stdout.strip().splitlines()[-1])


def log_result(log: Path | None, task: dict[str, Any], result: dict[str, Any]) -> None:
  """Appends one task's result as it arrives, so a run cut short keeps them."""
  if log is not None:
    with log.open("a") as f:
      f.write(json.dumps({"task": task, "result": result}) + "\n")


def worker_env(cache_dir: str) -> dict[str, str]:
  """The environment of every task: one compilation cache, no preallocation."""
  return {
      **os.environ,
      # Several memory processes share the GPU: each allocates what it uses,
      # and its peak counts its own allocations only.
      "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
      "JAX_COMPILATION_CACHE_DIR": cache_dir,
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }


def run(cases: Sequence[Case], *, workers: int, rounds: int, steps_per_round: int,
        cache_dir: str, progress: bool = True,
        log: Path | None = None) -> list[dict[str, Any]]:
  """Every case: memory tasks a few at a time, then timing tasks one at a time.

  Each task's result is appended to `log` (JSON lines) as it arrives.
  """
  env = worker_env(cache_dir)
  memory_tasks = [{"kind": "memory", "case": dataclasses.asdict(c), "method": m}
                  for c in cases for m in c.methods]
  def floor_key(case, method):
    # One floor per model, N and kind of step (the release's is remat "full").
    return (case.preset, case.num_micro_batches, case.micro_batch_size, case.seq_len,
            method in harness.RELEASE_METHODS)

  floor_cases = {floor_key(c, m): (c, m) for c in cases for m in c.methods}
  floor_tasks = [{"kind": "floor", "case": dataclasses.asdict(c), "method": m}
                 for c, m in floor_cases.values()]
  results: dict[int, dict[str, Any]] = {}
  tasks = memory_tasks + floor_tasks
  with tqdm(total=len(tasks) + len(cases), desc="gpu bench", disable=not progress,
            file=sys.stderr) as bar:
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
      futures = {pool.submit(run_in_process, t, env): i for i, t in enumerate(tasks)}
      for future in concurrent.futures.as_completed(futures):
        results[futures[future]] = future.result()
        log_result(log, tasks[futures[future]], results[futures[future]])
        bar.update()
    # Timing needs the machine to itself: one process at a time.
    timings = []
    for case in cases:
      task = {"kind": "time", "case": dataclasses.asdict(case), "rounds": rounds,
              "steps_per_round": steps_per_round}
      timings.append(run_in_process(task, env))
      log_result(log, task, timings[-1])
      bar.update()
  floors = {key: results[len(memory_tasks) + i]
            for i, key in enumerate(floor_cases)}
  rows = []
  for i, task in enumerate(memory_tasks):
    case, method = Case(**task["case"]), task["method"]
    timing = timings[cases.index(case)].get(method) or {}
    floor = floors[floor_key(case, method)]
    rows.append({"case": case.name, **task["case"], "method": method,
                 **MISSING_MEMORY, **results[i],
                 "param_bytes": results[i].get("param_bytes") or floor.get("param_bytes"),
                 "floor_bytes": floor.get("floor_bytes"),
                 "median_step_s": timing.get("median_step_s"),
                 "step_s_all": timing.get("step_s_all")})
  return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
  """Markdown: memory (compiled, live peak, floor) and step time per method."""

  def amount(num_bytes, p):
    if num_bytes is None or p is None:
      return "n/a"
    return f"{harness.format_bytes(num_bytes)} ({num_bytes / p:.2f} P)"

  def failure(error):
    last = error.strip().splitlines()[-1] if error.strip() else "failed"
    return "failed: " + last[:80].replace("|", "/")

  lines = ["| case | method | compiled | live peak | peak vs floor | median step "
           "| vs scan accumulation |", "|---|---|---|---|---|---|---|"]
  reference = {r["case"]: r["median_step_s"] for r in rows
               if r["method"] == "scan_accumulation"}
  for r in rows:
    p, peak, floor = r["param_bytes"], r["peak_bytes_in_use"], r["floor_bytes"]
    vs_floor = "" if peak is None or not floor else f"{100 * (peak / floor - 1):+.1f}%"
    compiled = failure(r["error"]) if r.get("error") else amount(r["compiled_total_bytes"], p)
    step = r["median_step_s"]
    ref = reference.get(r["case"])
    speed = "" if step is None or not ref else f"{100 * (step / ref - 1):+.1f}%"
    lines.append(
        f"| {r['case']} | {r['method']} | {compiled} "
        f"| {amount(peak, p)} | {vs_floor} "
        f"| {'' if step is None else f'{1e3 * step:.1f} ms'} | {speed} |")
  return "\n".join(lines) + "\n"


def device_slug() -> str:
  device = jax.devices()[0]
  return re.sub(r"[^a-z0-9]+", "_", getattr(device, "device_kind", str(device)).lower()).strip("_")


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(prog="python -m models.gpu_bench",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--presets", nargs="+", default=["gpt2_small", "gpt2_medium"],
                      choices=sorted(models.PRESETS))
  parser.add_argument("--num-micro-batches", nargs="+", type=int, default=[4, 8])
  parser.add_argument("--layouts", nargs="+", choices=("unrolled", "scanned"),
                      default=["unrolled", "scanned"])
  parser.add_argument("--micro-batch-size", type=int, default=1)
  parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's context")
  parser.add_argument("--workers", type=int, default=4,
                      help="memory processes at a time (each compiles on the host)")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps-per-round", type=int, default=3)
  parser.add_argument("--out-dir", type=Path, default=Path("benchmarks"))
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  if args.worker is not None:
    print(json.dumps(_worker(json.loads(args.worker))))
    return []
  cases = [Case(preset, n, layout == "scanned", args.micro_batch_size, args.seq_len)
           for preset in args.presets for n in args.num_micro_batches
           for layout in args.layouts]
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="jax_cache_") as cache_dir:
    log = args.out_dir / "raw" / "gpu_tasks.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    rows = run(cases, workers=args.workers, rounds=args.rounds,
               steps_per_round=args.steps_per_round, cache_dir=cache_dir,
               progress=not args.no_progress, log=log)
  wall_s = time.perf_counter() - start
  slug = device_slug()
  command = "python -m models.gpu_bench " + " ".join(argv if argv is not None else sys.argv[1:])
  (args.out_dir / "raw").mkdir(parents=True, exist_ok=True)
  (args.out_dir / "raw" / f"gpu_{slug}.json").write_text(json.dumps(
      {"command": command, "machine": harness.machine_info(), "wall_s": wall_s, "rows": rows},
      indent=1))
  text = (f"Measured by `{command}` on {harness.machine_info()['device']} in {wall_s:.0f} s.\n\n"
          + table(rows))
  (args.out_dir / f"gpu_{slug}.md").write_text(text)
  print(text)
  return rows


if __name__ == "__main__":
  main()
