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
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models import harness

# Every method of a row group, on the same layout, remat, dtypes and micro-batch:
# gradient accumulation with a float32 and a bfloat16 carry (what MaxText users
# run), optax's two ways, AdamA with the library's defaults ("mean") and with the
# "momentum" estimator (the price of its once-per-step m_hat^2 term).
METHODS = ("scan_accumulation", "scan_accumulation_bf16", "optax_microbatching",
           "multisteps", "adama", "adama_momentum")
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
# The memory fields of a row whose process failed (its "error" says why).
MISSING_MEMORY = {"compiled_total_bytes": None, "param_bytes": None,
                  "peak_bytes_in_use": None, "compile_s": None, "loss": None}


@dataclasses.dataclass(frozen=True)
class Case:
  """One preset, N, layout, remat and compute dtype; its methods share all of them."""

  preset: str
  num_micro_batches: int
  scan_layers: bool
  micro_batch_size: int = 1
  seq_len: int | None = None  # None: the preset's context.
  remat: str = "full"
  dtype: str = "bfloat16"  # compute; params and moments are float32.
  method_names: tuple[str, ...] | None = None  # None: METHODS (+ release if scanned).
  timed_together: int | None = None  # None: every method in one timing process.
  memory_fraction: float | None = None  # None: JAX's default share of the device.

  @property
  def name(self) -> str:
    layout = "scanned" if self.scan_layers else "unrolled"
    return (f"{self.preset} {layout} N={self.num_micro_batches} remat={self.remat} "
            f"{self.dtype}")

  @property
  def methods(self) -> tuple[str, ...]:
    if self.method_names is not None:
      return tuple(self.method_names)
    # The float32-moment release step only: the table compares steps on the
    # same moments, and the 8-minute budget has no room for more.
    return METHODS + (("adama_release",) if self.scan_layers else ())

  @property
  def timing_groups(self) -> tuple[tuple[str, ...], ...]:
    """The methods of each timing process: scan accumulation first in every one,
    so each method's ratio to it comes from one process's interleaved rounds."""
    methods = self.methods
    if self.timed_together is None or len(methods) <= self.timed_together:
      return (methods,)
    if self.timed_together < 2 or "scan_accumulation" not in methods:
      raise ValueError(
          f"timed_together={self.timed_together} splits {methods} into timing groups, "
          "each led by scan_accumulation: it needs scan_accumulation among the methods "
          "and room for one more (timed_together >= 2).")
    others = [m for m in methods if m != "scan_accumulation"]
    size = self.timed_together - 1
    return tuple(("scan_accumulation", *others[i:i + size])
                 for i in range(0, len(others), size))

  def config(self) -> models.Config:
    return models.get_config(self.preset, scan_layers=self.scan_layers, remat=self.remat,
                             dtype=jnp.dtype(self.dtype))

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
  config = dataclasses.replace(case.config(), scan_layers=False)
  batch = harness.abstract_batch(
      config, case.micro_batch_size * case.num_micro_batches, case.seq_len)
  floor = harness.floor_for(method, config, batch, case.num_micro_batches)
  return {"floor_bytes": floor.total_bytes, "param_bytes": floor.param_bytes}


def measure_times(case: Case, rounds: int, steps_per_round: int,
                  methods: Sequence[str] | None = None) -> dict[str, Any]:
  """Interleaved median step time of ``methods`` (default: every method of the case)."""
  times = harness.measure_throughput(
      case.config(), tuple(methods or case.methods), case.num_micro_batches,
      micro_batch_size=case.micro_batch_size, seq_len=case.seq_len, rounds=rounds,
      steps_per_round=steps_per_round, progress=False)
  return {method: {"median_step_s": t["median_step_s"], "step_s_all": t["step_s_all"]}
          for method, t in times.items()}


@dataclasses.dataclass(frozen=True)
class CapacityCase:
  """The live capacity search: one budget, the family's shape, every method's step."""

  budget_gb: float
  num_micro_batches: int = 4
  micro_batch_size: int = 1
  seq_len: int = 1024
  remat: str = "full"
  dtype: str = "bfloat16"
  max_scale: int = 128
  vocab_size: int = 50257


def search_command(case: CapacityCase, method: str, out: Path) -> list[str]:
  """`models.bench capacity` for one method: the largest gpt_family scale whose
  compiled step fits the budget (compile only), written as JSON to ``out``.

  Every method runs the scanned stack (the release methods need it; the same
  layout for all). Compiled on this device, so its autotuned workspaces count.
  """
  return [sys.executable, "-m", "models.bench", "capacity", "--budgets-gb",
          str(case.budget_gb), "--methods", method, "--scan-layers",
          "--num-micro-batches", str(case.num_micro_batches),
          "--micro-batch-size", str(case.micro_batch_size), "--seq-len", str(case.seq_len),
          "--remat", case.remat, "--dtype", case.dtype, "--max-scale", str(case.max_scale),
          "--vocab-size", str(case.vocab_size), "--json", str(out), "--no-progress"]


def search_capacity(case: CapacityCase, method: str, env: dict[str, str]) -> dict[str, Any]:
  """Runs :func:`search_command` in a process of its own; {"error": ...} if it fails."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "capacity.json"
    done = subprocess.run(search_command(case, method, out), capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode or not out.exists():
      return {"error": done.stderr.strip()[-2000:] or f"exit status {done.returncode}"}
    return json.loads(out.read_text())["capacity"][0]


def train_at_scale(case: CapacityCase, method: str, scale: int, steps: int = 3) -> dict[str, Any]:
  """Trains ``steps`` steps of gpt_family(scale) with ``method``; raises when it does not fit."""
  config = harness.gpt_family(scale, remat=case.remat, vocab_size=case.vocab_size,
                            scan_layers=True, dtype=jnp.dtype(case.dtype))
  model = models.create(config, rngs=nnx.Rngs(0))
  loss_fn, params = models.staged_loss(model)
  del model
  step, tx = harness.make_step(method, loss_fn, num_micro_batches=case.num_micro_batches,
                               rank=config.hidden // 4)
  state = tx.init(params)
  batch = harness.random_batch(config, harness.abstract_batch(
      config, case.micro_batch_size * case.num_micro_batches, case.seq_len))
  losses = []
  for _ in range(steps):
    params, state, metrics = step(params, state, batch)
    losses.append(float(metrics["loss"]))  # waits for the step: an OOM surfaces here
  stats = jax.devices()[0].memory_stats()
  return {"scale": scale, "param_count": models.param_count(config), "losses": losses,
          "peak_bytes_in_use": None if not stats else stats.get("peak_bytes_in_use")}


def case_from_dict(fields: dict[str, Any]) -> Case:
  """A case back from its JSON form (its method tuple arrives as a list)."""
  names = fields.get("method_names")
  return Case(**{**fields, "method_names": None if names is None else tuple(names)})


def _worker(task: dict[str, Any]) -> dict[str, Any]:
  if task["kind"] == "capacity_train":
    return train_at_scale(CapacityCase(**task["case"]), task["method"], task["scale"])
  case = case_from_dict(task["case"])
  if task["kind"] == "memory":
    return measure_method(case, task["method"])
  if task["kind"] == "floor":
    return measure_floor(case, task["method"])
  return measure_times(case, task["rounds"], task["steps_per_round"], task.get("methods"))


def run_in_process(task: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
  """Runs one task in a fresh Python process and returns its JSON result.

  A task that fails (out of memory, say) returns {"error": ...} rather than
  raising: one method's failure must not lose the other methods' numbers.
  Either way "task_s" is the process's wall time, start-up and compile
  included (what a run's duration is estimated from).
  """
  start = time.perf_counter()
  done = subprocess.run(
      [sys.executable, "-m", "models.gpu_bench", "--worker", json.dumps(task)],
      capture_output=True, text=True, env=env, check=False)
  task_s = time.perf_counter() - start
  if done.returncode:
    return {"error": done.stderr.strip()[-2000:] or f"exit status {done.returncode}",
            "task_s": task_s}
  return {**json.loads(done.stdout.strip().splitlines()[-1]), "task_s": task_s}


def log_result(log: Path | None, task: dict[str, Any], result: dict[str, Any]) -> None:
  """Appends one task's result as it arrives, so a run cut short keeps them."""
  if log is not None:
    with log.open("a") as f:
      f.write(json.dumps({"task": task, "result": result}) + "\n")


# JAX's variable for the allocator's share of the device, and its older name
# (setting both is an error, so a share the user set is left alone).
MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def worker_env(cache_dir: str, memory_fraction: float | None = None) -> dict[str, str]:
  """The environment of every task: one compilation cache, no preallocation, and
  the allocator's share of the device where the case sets one."""
  share = {}
  if memory_fraction is not None and not any(v in os.environ
                                             for v in MEMORY_FRACTION_VARIABLES):
    share = {MEMORY_FRACTION_VARIABLES[0]: str(memory_fraction)}
  return {
      **os.environ,
      **share,
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
  def env(task):
    return worker_env(cache_dir, task["case"].get("memory_fraction"))

  memory_tasks = [{"kind": "memory", "case": dataclasses.asdict(c), "method": m}
                  for c in cases for m in c.methods]
  def floor_key(case, method):
    # One floor per model, N, remat, dtype and kind of step (the release's is
    # remat "full").
    return (case.preset, case.num_micro_batches, case.micro_batch_size, case.seq_len,
            case.dtype, "full" if method in harness.RELEASE_METHODS else case.remat,
            method in harness.RELEASE_METHODS)

  floor_cases = {floor_key(c, m): (c, m) for c in cases for m in c.methods}
  floor_tasks = [{"kind": "floor", "case": dataclasses.asdict(c), "method": m}
                 for c, m in floor_cases.values()]
  results: dict[int, dict[str, Any]] = {}
  tasks = memory_tasks + floor_tasks
  timing_tasks = [{"kind": "time", "case": dataclasses.asdict(c), "methods": list(group),
                   "rounds": rounds, "steps_per_round": steps_per_round}
                  for c in cases for group in c.timing_groups]
  with tqdm(total=len(tasks) + len(timing_tasks), desc="gpu bench", disable=not progress,
            file=sys.stderr) as bar:
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
      futures = {pool.submit(run_in_process, t, env(t)): i for i, t in enumerate(tasks)}
      for future in concurrent.futures.as_completed(futures):
        results[futures[future]] = future.result()
        log_result(log, tasks[futures[future]], results[futures[future]])
        bar.update()
    # A large preset's processes can crowd each other out of the device (out of
    # memory, or no device left to start on): a failed task runs again alone,
    # and only a failure there is the method's own.
    for i, task in enumerate(tasks):
      if "error" in results[i]:
        results[i] = {**run_in_process(task, env(task)), "retried_alone": True}
        log_result(log, task, results[i])
    # Timing needs the machine to itself: one process at a time. A method
    # keeps its first group's median and that group's scan accumulation's
    # (its reference); scan accumulation's own median is its first group's.
    timings: dict[Case, dict[str, dict[str, Any]]] = {}
    for task in timing_tasks:
      result = run_in_process(task, env(task))
      log_result(log, task, result)
      bar.update()
      reference = (result.get("scan_accumulation") or {}).get("median_step_s")
      mine = timings.setdefault(case_from_dict(task["case"]), {})
      for method in task["methods"]:
        if method in result and method not in mine:
          mine[method] = {**result[method], "reference_step_s": reference}
  floors = {key: results[len(memory_tasks) + i]
            for i, key in enumerate(floor_cases)}
  rows = []
  for i, task in enumerate(memory_tasks):
    case, method = case_from_dict(task["case"]), task["method"]
    timing = timings.get(case, {}).get(method) or {}
    floor = floors[floor_key(case, method)]
    rows.append({"case": case.name, **task["case"], "method": method,
                 **MISSING_MEMORY, **results[i],
                 "param_bytes": results[i].get("param_bytes") or floor.get("param_bytes"),
                 "floor_bytes": floor.get("floor_bytes"),
                 "median_step_s": timing.get("median_step_s"),
                 "reference_step_s": timing.get("reference_step_s"),
                 "step_s_all": timing.get("step_s_all")})
  return rows


def run_capacity(case: CapacityCase, methods: Sequence[str], *, cache_dir: str,
                 tries: int = 3, workers: int = 3,
                 log: Path | None = None) -> list[dict[str, Any]]:
  """Per method, the largest GPT of the family that trains within the budget.

  The compile-only searches run a few at a time (host work, no device
  memory); then each answer is trained, one process at a time with the device
  to itself, and on a failure (out of memory) the next smaller scale is
  tried, at most ``tries`` scales in all.
  """
  env = worker_env(cache_dir)
  searches = [{"kind": "capacity_search", "case": dataclasses.asdict(case), "method": m}
              for m in methods]
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    found = list(pool.map(lambda t: search_capacity(CapacityCase(**t["case"]), t["method"], env),
                          searches))
  rows = []
  for task, search in zip(searches, found):
    log_result(log, task, search)
    row = {"method": task["method"], "budget_gb": case.budget_gb,
           "compiled_scale": search.get("scale"), "compiled_bytes": search.get("total_bytes"),
           "trained_scale": None, "param_count": None, "peak_bytes_in_use": None,
           "losses": None, "attempts": [], "error": search.get("error")}
    scale = search.get("scale") or 0
    while scale >= 1 and len(row["attempts"]) < tries:
      train = {"kind": "capacity_train", "case": dataclasses.asdict(case),
               "method": task["method"], "scale": scale}
      result = run_in_process(train, env)
      log_result(log, train, result)
      row["attempts"].append({"scale": scale, "error": result.get("error")})
      if "error" not in result:
        row.update(trained_scale=scale, param_count=result["param_count"],
                   peak_bytes_in_use=result["peak_bytes_in_use"], losses=result["losses"],
                   error=None)
        break
      scale -= 1
    rows.append(row)
  return rows


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
        f"| {'' if peak is None else harness.format_bytes(peak)} "
        f"| {'' if not (count and base) else f'{count / base:.2f}x'} "
        f"| {tries} |")
  return "\n".join(lines) + "\n"


def table(rows: Sequence[dict[str, Any]]) -> str:
  """Markdown: memory (compiled, live peak, floor) and step time per method."""

  def amount(num_bytes, p):
    if num_bytes is None or p is None:
      return "n/a"
    return f"{harness.format_bytes(num_bytes)} ({num_bytes / p:.2f} P)"

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
  harness.save_figure(fig, path)


def device_slug() -> str:
  device = jax.devices()[0]
  return re.sub(r"[^a-z0-9]+", "_", getattr(device, "device_kind", str(device)).lower()).strip("_")


def make_cases(args: argparse.Namespace) -> list[Case]:
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
        cases.append(Case(preset, n, scanned, size, seq_len, args.remat, args.dtype,
                          names, **per_preset))
      for remat in args.reference_remat:
        if remat != args.remat:
          cases.append(Case(preset, n, False, size, seq_len, remat, args.dtype,
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
  parser.add_argument("--out-dir", type=Path, default=Path("benchmarks"))
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
    print(json.dumps(_worker(json.loads(args.worker))))
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
    rows = run(cases, workers=args.workers, rounds=args.rounds,
               steps_per_round=args.steps_per_round, cache_dir=cache_dir,
               progress=not args.no_progress, log=log)
  wall_s = time.perf_counter() - start
  stem = f"gpu_{device_slug()}{tag}"
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
  case = CapacityCase(budget, num_micro_batches=args.num_micro_batches[0],
                      micro_batch_size=args.micro_batch_size or 1,
                      seq_len=args.seq_len or 1024, remat=args.remat, dtype=args.dtype,
                      max_scale=args.capacity_max_scale, vocab_size=args.capacity_vocab_size)
  start = time.perf_counter()
  slug = device_slug()
  (args.out_dir / "raw").mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="jax_cache_") as cache_dir:
    rows = run_capacity(case, CAPACITY_METHODS, cache_dir=cache_dir,
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
          "trains: three steps ran.\n\n" + capacity_table(rows))
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
          + summary(rows) + "\n" + table(rows))
  (out_dir / f"{stem}.md").write_text(text)
  plot(rows, out_dir / f"{stem}.png")
  print(text)
  return text


if __name__ == "__main__":
  main()
