"""`models.gpu_bench`'s machinery: its row groups, the processes that measure them, their rows.

A `Case` is one preset, N, layout, remat and compute dtype, and its methods.
Each method's memory is measured in a process of its own (`measure_method`:
the live peak after three steps, the compiled total) beside the floor it is
held to (`measure_floor`), and the methods' step times interleaved in one
process (`measure_times`, or several where they do not fit the device
together: `Case.timing_groups`). `run` starts those processes (`python -m
models.gpu_bench --worker TASK`, which calls `run_task`) a few at a time with
one compilation cache and gathers their rows; `run_capacity` is the live
capacity search (`CapacityCase`: the compile-only search of
`models.harness.capacity`, then the answer trained, stepping down a scale
while it runs out of memory). The tables and the plot of the rows are
`models.harness.gpu_report`'s.
"""

from __future__ import annotations

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
from models.harness import baselines
from models.harness import batches
from models.harness import capacity

# Every method of a row group, on the same layout, remat, dtypes and micro-batch:
# gradient accumulation with a float32 and a bfloat16 carry (what MaxText users
# run), optax's two ways, AdamA with the library's defaults ("mean") and with the
# "momentum" estimator (the price of its once-per-step m_hat^2 term).
METHODS = ("scan_accumulation", "scan_accumulation_bf16", "optax_microbatching",
           "multisteps", "adama", "adama_momentum")

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
    return batches.random_batch(config, batches.abstract_batch(
        config, self.micro_batch_size * self.num_micro_batches, self.seq_len))


def measure_method(case: Case, method: str) -> dict[str, Any]:
  """Compiles and runs one method's step; meant for a process of its own."""
  config = case.config()
  model = models.create(config, rngs=nnx.Rngs(0))
  split = models.staged_loss if method in baselines.RELEASE_METHODS else models.split_loss_fn
  loss_fn, params = split(model)
  del model
  batch = case.batch(config)
  step, tx = baselines.make_step(method, loss_fn, num_micro_batches=case.num_micro_batches)
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
  batch = batches.abstract_batch(
      config, case.micro_batch_size * case.num_micro_batches, case.seq_len)
  floor = baselines.floor_for(method, config, batch, case.num_micro_batches)
  return {"floor_bytes": floor.total_bytes, "param_bytes": floor.param_bytes}


def measure_times(case: Case, rounds: int, steps_per_round: int,
                  methods: Sequence[str] | None = None) -> dict[str, Any]:
  """Interleaved median step time of ``methods`` (default: every method of the case)."""
  times = baselines.measure_throughput(
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
  config = capacity.gpt_family(scale, remat=case.remat, vocab_size=case.vocab_size,
                            scan_layers=True, dtype=jnp.dtype(case.dtype))
  model = models.create(config, rngs=nnx.Rngs(0))
  loss_fn, params = models.staged_loss(model)
  del model
  step, tx = baselines.make_step(method, loss_fn, num_micro_batches=case.num_micro_batches,
                               rank=config.hidden // 4)
  state = tx.init(params)
  batch = batches.random_batch(config, batches.abstract_batch(
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


def run_task(task: dict[str, Any]) -> dict[str, Any]:
  """Runs one task of `run` or `run_capacity` here (in the worker process) and
  returns its JSON-able result."""
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
            case.dtype, "full" if method in baselines.RELEASE_METHODS else case.remat,
            method in baselines.RELEASE_METHODS)

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


def device_slug() -> str:
  """The device's kind as a file name's part, e.g. "nvidia_h100_80gb_hbm3"."""
  device = jax.devices()[0]
  return re.sub(r"[^a-z0-9]+", "_", getattr(device, "device_kind", str(device)).lower()).strip("_")
