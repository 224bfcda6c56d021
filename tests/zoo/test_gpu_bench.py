"""The GPU benchmark's CPU dry run: the same script, tiny preset, every stage."""

import json
import shlex
import subprocess

import jax
import numpy as np
import pytest
from conftest import REPO

import models
from models import gpu_bench
from models.harness import gpu
from models.harness import gpu_report

GIB = 2**30


def readme_command(target, containing, section="Waiting for a GPU"):
  """The `make <target> ...` line of benchmarks/results/gpu/live_runs.md's ``section``
  (by default the "Waiting for a GPU" list) that names ``containing``."""
  text = (REPO / "benchmarks" / "results" / "gpu" / "live_runs.md").read_text()
  section = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
  [line] = [l.strip() for l in section.splitlines()
            if l.strip().startswith(f"make {target} ") and containing in l]
  return line


def make_argv(command, module):
  """The arguments `command` (a make line) passes to ``python -m module``."""
  dry = subprocess.run(["make", "-s", "-n", *shlex.split(command)[1:]], cwd=REPO,
                       capture_output=True, text=True, check=True).stdout
  words = shlex.split(dry.replace("\\\n", " "))
  return words[words.index(module) + 1:]


# The default suite runs the lean row group (scan accumulation in float32 and
# bf16, and AdamA) on the unrolled model: the same script end to end, 5 worker
# processes. Every method and the scanned layout's release row (9 processes,
# 100-140 s on 2 cores) run with the slow tests.
@pytest.mark.parametrize("layout, all_methods, methods", [
    ("unrolled", [], gpu_bench.LEAN_METHODS),
    pytest.param("scanned", ["gpt_test"], gpu.METHODS + ("adama_release",),
                 marks=pytest.mark.slow),
], ids=["lean_unrolled", "every_method_scanned"])
def test_dry_run_measures_every_method_in_its_own_process(tmp_path, layout, all_methods,
                                                          methods):
  rows = gpu_bench.main([
      "--presets", "gpt_test", "--num-micro-batches", "2", "--layouts", layout,
      "--seq-len", "16", "--workers", "2", "--rounds", "1", "--steps-per-round", "1",
      "--all-methods-presets", *all_methods, "--reference-remat",
      "--out-dir", str(tmp_path), "--no-progress"])
  by_method = {r["method"]: r for r in rows}
  assert set(by_method) == set(methods) and len(rows) == len(methods)
  # Every row states its layout, remat and dtypes; the default on a GPU is
  # bf16 compute with float32 params, rematerialized in full.
  assert {(r["scan_layers"], r["remat"], r["dtype"]) for r in rows} == {
      (layout == "scanned", "full", "bfloat16")}
  for r in rows:
    assert r["compiled_total_bytes"] > 3 * r["param_bytes"]  # params, m, v at least
    assert r["peak_bytes_in_use"] is None  # the CPU backend has no live peak
    assert r["floor_bytes"] > 3 * r["param_bytes"]
    assert r["median_step_s"] > 0  # every method was timed, the release step too
  # AdamA has no gradient accumulator: a P of float32 below scan accumulation.
  saved = (by_method["scan_accumulation"]["compiled_total_bytes"]
           - by_method["adama"]["compiled_total_bytes"])
  assert saved > 0.5 * by_method["adama"]["param_bytes"]
  slug = gpu.device_slug()
  saved_json = json.loads((tmp_path / "raw" / f"gpu_{slug}.json").read_text())
  # As JSON has them: a lean row group's method tuple is a list there.
  assert saved_json["rows"] == json.loads(json.dumps(rows))
  assert saved_json["command"].startswith("python -m")
  text = (tmp_path / f"gpu_{slug}.md").read_text()
  assert f"| gpt_test {layout} N=2 remat=full bfloat16 | adama |" in text and "n/a" in text
  assert "| gpt_test, N=2 |" in text  # the targets' summary
  assert (tmp_path / f"gpu_{slug}.png").stat().st_size > 0


def test_default_cases_fill_the_device_and_add_reference_rows():
  cases = gpu_bench.make_cases(gpu_bench._parse_args([]))
  assert {c.micro_batch_size for c in cases} == {8}  # 8 x 1,024 tokens
  # The GPT rows as before: each case timed in one process, JAX's allocator limit.
  assert {(c.seq_len, c.timed_together, c.memory_fraction) for c in cases} == {
      (None, None, None)}
  assert all(c.timing_groups == (c.methods,) for c in cases)
  small = [c for c in cases if c.preset == "gpt2_small"]
  assert [(c.scan_layers, c.remat) for c in small] == [
      (False, "full"), (True, "full"), (False, "none")]
  assert small[1].methods == gpu.METHODS + ("adama_release",)
  assert small[2].methods == gpu_bench.REFERENCE_METHODS
  medium_scanned = [c for c in cases if c.preset == "gpt2_medium" and c.scan_layers][0]
  assert "multisteps" not in medium_scanned.methods


def test_a_compute_dtype_the_models_cannot_run_is_refused():
  import pytest

  import models
  with pytest.raises(ValueError, match="float16 needs loss scaling"):
    models.get_config("gpt_test", dtype="float16")
  with pytest.raises(SystemExit):
    gpu_bench.main(["--dtype", "float16"])


def test_a_failed_method_is_recorded_not_fatal(tmp_path):
  # An unknown preset fails inside the worker process, as an out-of-memory would.
  case = {"preset": "no_such_preset", "num_micro_batches": 2, "scan_layers": False}
  task = {"kind": "memory", "case": case, "method": "adama"}
  result = gpu.run_in_process(task, gpu.worker_env(str(tmp_path)))
  assert "no_such_preset" in result["error"]
  log = tmp_path / "tasks.jsonl"
  gpu.log_result(log, task, result)
  assert json.loads(log.read_text())["result"] == result
  row = {"case": "x", "method": "adama", **gpu.MISSING_MEMORY, **result,
         "floor_bytes": None, "median_step_s": None}
  assert "| failed: " in gpu_report.table([row])


def test_a_task_crowded_out_of_the_device_runs_again_alone(monkeypatch):
  # Six gpt2_large processes at once overfill an 80 GB device: the memory task
  # that failed among them is measured again on its own.
  calls = []

  def fake_run(task, env):
    calls.append(task)
    if task["kind"] == "time":
      return {"adama": {"median_step_s": 0.1, "step_s_all": [0.1]}}
    if task["kind"] == "floor":
      return {"floor_bytes": 10, "param_bytes": 4}
    if sum(c["kind"] == "memory" for c in calls) == 1:
      return {"error": "Traceback...\njax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of "
                       "memory\n----\nFor simplicity, JAX has removed its internal frames"}
    return {"compiled_total_bytes": 11, "param_bytes": 4, "peak_bytes_in_use": 12,
            "compile_s": 1.0, "loss": 2.0}

  monkeypatch.setattr(gpu, "run_in_process", fake_run)
  case = gpu.Case("gpt_test", 2, False, method_names=("adama",))
  [row] = gpu.run([case], workers=2, rounds=1, steps_per_round=1, cache_dir="",
                        progress=False)
  assert [c["kind"] for c in calls].count("memory") == 2
  assert row["retried_alone"] and "error" not in row and row["peak_bytes_in_use"] == 12


def test_a_failed_row_shows_the_exception_not_the_traceback_footer():
  row = {"case": "x", "method": "adama", **gpu.MISSING_MEMORY, "param_bytes": None,
         "floor_bytes": None, "median_step_s": None,
         "error": "Traceback\njax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n"
                  "----\nFor simplicity, JAX has removed its internal frames"}
  assert "| failed: jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED" in gpu_report.table([row])


def test_capacity_trains_the_compiled_answer_and_steps_down_when_it_does_not_fit(monkeypatch):
  # The compile-only search says 5 layers; 5 runs out of memory live, 4 trains.
  def fake_run(task, env):
    if task["scale"] == 5:
      return {"error": "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}
    return {"scale": task["scale"], "param_count": 400 if task["method"] != "scan_accumulation"
            else 100, "peak_bytes_in_use": 9, "losses": [5.0, 4.9, 4.8]}

  monkeypatch.setattr(gpu, "run_in_process", fake_run)
  monkeypatch.setattr(gpu, "search_capacity",
                      lambda case, method, env: {"scale": 5, "total_bytes": 10})
  case = gpu.CapacityCase(budget_gb=1.0)
  rows = gpu.run_capacity(case, ("scan_accumulation", "adama_release_8bit_offload"),
                                cache_dir="", tries=3)
  assert [r["trained_scale"] for r in rows] == [4, 4]
  assert [a["scale"] for a in rows[0]["attempts"]] == [5, 4]
  text = gpu_report.capacity_table(rows)
  assert "| 5 layers | 4 layers |" in text and "| 4.00x |" in text and "5 fails, 4 trains" in text


def test_capacity_search_is_models_bench_capacity_with_the_case_s_settings(tmp_path):
  case = gpu.CapacityCase(budget_gb=2.5, num_micro_batches=2, seq_len=16,
                                dtype="bfloat16", max_scale=3, vocab_size=128)
  command = gpu.search_command(case, "scan_accumulation", tmp_path / "c.json")
  assert command[1:4] == ["-m", "models.bench", "capacity"] and "--scan-layers" in command
  flags = dict(zip(command[4::1], command[5::1]))
  assert flags["--budgets-gb"] == "2.5" and flags["--dtype"] == "bfloat16"
  assert flags["--max-scale"] == "3" and flags["--vocab-size"] == "128"
  from models import bench
  for method in gpu_bench.CAPACITY_METHODS:  # each one a method models.bench takes
    args = bench._parse_args(gpu.search_command(case, method, tmp_path / "c.json")[3:])
    assert args.methods == [method] and args.dtype == "bfloat16"


def test_capacity_records_a_method_that_fits_nowhere(monkeypatch):
  monkeypatch.setattr(gpu, "search_capacity",
                      lambda case, method, env: {"scale": 2, "total_bytes": 1})
  monkeypatch.setattr(gpu, "run_in_process",
                      lambda task, env: {"error": "RESOURCE_EXHAUSTED"})
  [row] = gpu.run_capacity(gpu.CapacityCase(budget_gb=1.0), ("scan_accumulation",),
                                 cache_dir="", tries=3)
  assert row["trained_scale"] is None and [a["scale"] for a in row["attempts"]] == [2, 1]
  assert "| none layers |" in gpu_report.capacity_table([row])


@pytest.mark.parametrize("method", [
    "scan_accumulation_bf16",
    # The release step with offloaded 8-bit moments compiles for ~40 s here.
    pytest.param("adama_release_8bit_offload", marks=pytest.mark.slow)])
def test_capacity_worker_trains_a_small_family_member(method):
  # The accumulation baselines are optax.adam, which relies on implicit promotion.
  with jax.numpy_dtype_promotion("standard"):
    _train_small_family_member(method)


def _train_small_family_member(method):
  case = gpu.CapacityCase(budget_gb=1.0, num_micro_batches=2, seq_len=16,
                                dtype="float32", vocab_size=128)
  result = gpu.train_at_scale(case, method, scale=1, steps=2)
  assert result["scale"] == 1 and result["param_count"] > 0
  assert all(np.isfinite(result["losses"])) and result["losses"][1] != result["losses"][0]


# The section of benchmarks/results/gpu/live_runs.md that shows the Llama 3.2 1B rows, and
# the raw file its table came from.
LLAMA_SECTION = "GPU: one H200, Llama 3.2 1B"
LLAMA_RAW = REPO / "benchmarks" / "results" / "gpu" / "raw" / "gpu_nvidia_h200_llama32_1b.json"


def test_the_llama_command_shown_is_the_one_that_made_the_table():
  command = readme_command("bench-gpu", "llama32_1b", LLAMA_SECTION)
  recorded = json.loads(LLAMA_RAW.read_text())["command"]
  assert make_argv(command, "models.gpu_bench") == shlex.split(recorded)[3:]


def test_the_llama_command_runs_the_gpt_rows_settings_in_groups_that_fit():
  command = readme_command("bench-gpu", "llama32_1b", LLAMA_SECTION)
  args = gpu_bench._parse_args(make_argv(command, "models.gpu_bench"))
  assert (args.tag, args.workers, args.rounds) == ("llama32_1b", 3, 3)
  unrolled, scanned = gpu_bench.make_cases(args)  # no rows without remat
  for case in (unrolled, scanned):
    # The GPT rows' micro-batch (8 x 1,024 tokens), N, dtypes and remat.
    assert (case.preset, case.num_micro_batches, case.micro_batch_size, case.seq_len,
            case.remat, case.dtype) == ("llama32_1b", 4, 8, 1024, "full", "bfloat16")
    assert case.memory_fraction == 0.95
    config = case.config()
    assert config.tie_embeddings and config.vocab_size == 128256
    assert config.loss_chunks == 1  # the whole logits, as the GPT rows
  assert not unrolled.scan_layers and scanned.scan_layers
  assert unrolled.methods == gpu_bench.LEAN_METHODS
  assert scanned.methods == gpu_bench.LEAN_METHODS + ("adama_release",)
  assert unrolled.timing_groups == (gpu_bench.LEAN_METHODS,)
  assert scanned.timing_groups == (gpu_bench.LEAN_METHODS,
                                   ("scan_accumulation", "adama_release"))
  # Why the groups and the share: each timed method holds params, m and v
  # (3 P) beside the model's P, and the largest step (scan accumulation,
  # scanned) adds ~21 GiB, estimated from its CPU compile.
  param_bytes = 4 * models.param_count("llama32_1b")
  resident = lambda methods: (1 + 3 * methods) * param_bytes + 21 * GIB
  h100 = 79.6 * GIB
  assert resident(4) > 0.95 * h100 > resident(3) > 0.75 * h100


def test_the_24_gib_llama_command_puts_the_line_between_adama_and_accumulation():
  command = readme_command("bench-gpu", "llama32_1b_24gib")
  args = gpu_bench._parse_args(make_argv(command, "models.gpu_bench"))
  [case] = gpu_bench.make_cases(args)  # unrolled alone
  assert (case.preset, case.scan_layers, case.num_micro_batches, case.micro_batch_size,
          case.seq_len, args.workers) == ("llama32_1b", False, 4, 8, 1024, 1)
  # The allocator's share of an H100 80GB (81,559 MiB) against the live peaks
  # the H200 measured for the same case (the raw JSON of its table).
  budget = args.memory_fraction * 81_559 * 2**20
  assert 23.5 * GIB < budget <= 24 * GIB
  rows = json.loads(LLAMA_RAW.read_text())["rows"]
  peak = {r["method"]: r["peak_bytes_in_use"] for r in rows if not r["scan_layers"]}
  assert peak["adama"] < budget < min(peak["scan_accumulation"], peak["scan_accumulation_bf16"])
  assert set(case.methods) == set(peak)


# 93 s on 2 cores even scanned alone: with the slow tests. The default suite
# checks the command's settings (the make -n parse above) and runs the same
# code path on the GPT's dry runs.
@pytest.mark.parametrize("layouts", [
    pytest.param(["scanned"], marks=pytest.mark.slow),
    # The README's command whole: the unrolled row group too (12 processes).
    pytest.param(["unrolled", "scanned"], marks=pytest.mark.slow),
], ids=["scanned", "both_layouts"])
def test_dry_run_of_the_llama_command_on_llama_test(tmp_path, monkeypatch, layouts):
  # llama_test in llama32_1b's place, with its per-preset settings; the
  # context, N and rounds cut to what the CPU runs in a minute or two.
  for per_preset in (gpu_bench.MICRO_BATCH_SIZES, gpu_bench.SEQ_LENS,
                     gpu_bench.TIMED_TOGETHER, gpu_bench.MEMORY_FRACTIONS):
    monkeypatch.setitem(per_preset, "llama_test", per_preset["llama32_1b"])
  argv = [w.replace("llama32_1b", "llama_test")
          for w in make_argv(readme_command("bench-gpu", "llama32_1b", LLAMA_SECTION),
                             "models.gpu_bench")]
  rows = gpu_bench.main(argv + [
      "--layouts", *layouts, "--seq-len", "16", "--num-micro-batches", "2", "--rounds", "1",
      "--steps-per-round", "1", "--out-dir", str(tmp_path)])
  scanned = [r for r in rows if r["scan_layers"]]
  assert [r["method"] for r in scanned] == list(gpu_bench.LEAN_METHODS) + ["adama_release"]
  assert len(rows) == 4 + 3 * (len(layouts) == 2)
  assert {(r["micro_batch_size"], r["seq_len"], r["timed_together"], r["memory_fraction"])
          for r in rows} == {(8, 16, 3, 0.95)}
  for r in rows:
    assert r["compiled_total_bytes"] > 3 * r["param_bytes"]  # params, m, v at least
    assert r["floor_bytes"] > 3 * r["param_bytes"] and r["peak_bytes_in_use"] is None
    assert r["median_step_s"] > 0 and r["reference_step_s"] > 0
  by_method = {r["method"]: r for r in scanned}
  saved = (by_method["scan_accumulation"]["compiled_total_bytes"]
           - by_method["adama"]["compiled_total_bytes"])
  assert saved > 0.5 * by_method["adama"]["param_bytes"]
  # Two timing processes for the scanned case, scan accumulation in each; a
  # method's reference is its own process's scan accumulation.
  stem = f"gpu_{gpu.device_slug()}_llama_test"
  log = [json.loads(line)
         for line in (tmp_path / "raw" / f"{stem}_tasks.jsonl").read_text().splitlines()]
  timed = [e for e in log if e["task"]["kind"] == "time" and e["task"]["case"]["scan_layers"]]
  assert [e["task"]["methods"] for e in timed] == [
      list(gpu_bench.LEAN_METHODS), ["scan_accumulation", "adama_release"]]
  references = [e["result"]["scan_accumulation"]["median_step_s"] for e in timed]
  assert by_method["adama_release"]["reference_step_s"] == references[1]
  assert {by_method[m]["reference_step_s"] for m in gpu_bench.LEAN_METHODS} == {references[0]}
  assert all(e["result"]["task_s"] > 0 for e in log)
  # The tagged outputs; the table of record and the running log's name untouched.
  assert json.loads((tmp_path / "raw" / f"{stem}.json").read_text())["rows"] == json.loads(
      json.dumps(rows))
  assert (tmp_path / f"{stem}.png").stat().st_size > 0
  assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(
      [f"{stem}.md", f"{stem}.png", f"{stem}.json", f"{stem}_tasks.jsonl"])
  text = (tmp_path / f"{stem}.md").read_text()
  assert "| llama_test scanned N=2 remat=full bfloat16 | adama_release |" in text
  assert "llama_test: 8 examples x 16 tokens per micro-batch" in text
  assert "timed in processes of at most 3 methods" in text and "0.95 of the device" in text


def test_each_method_is_against_the_scan_accumulation_of_its_own_timing_process(monkeypatch):
  calls = []

  def fake_run(task, env):
    calls.append((task, env))
    if task["kind"] == "time":  # the second process runs 2x slower throughout
      scale = 1.0 if "adama" in task["methods"] else 2.0
      return {m: {"median_step_s": scale * (1.1 if m != "scan_accumulation" else 1.0),
                  "step_s_all": [1.0]} for m in task["methods"]}
    if task["kind"] == "floor":
      return {"floor_bytes": 10, "param_bytes": 4}
    return {"compiled_total_bytes": 11, "param_bytes": 4, "peak_bytes_in_use": 12,
            "compile_s": 1.0, "loss": 2.0}

  monkeypatch.setattr(gpu, "run_in_process", fake_run)
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  case = gpu.Case("llama_test", 2, True, method_names=gpu_bench.LEAN_METHODS
                        + ("adama_release",), timed_together=3, memory_fraction=0.95)
  rows = gpu.run([case], workers=2, rounds=1, steps_per_round=1, cache_dir="",
                       progress=False)
  assert [t["methods"] for t, _ in calls if t["kind"] == "time"] == [
      list(gpu_bench.LEAN_METHODS), ["scan_accumulation", "adama_release"]]
  # Every process of the case (memory, floor, time) gets the allocator's share.
  assert {env["XLA_CLIENT_MEM_FRACTION"] for _, env in calls} == {"0.95"}
  by_method = {r["method"]: r for r in rows}
  assert by_method["scan_accumulation"]["median_step_s"] == 1.0  # its first process's
  assert by_method["adama_release"]["reference_step_s"] == 2.0
  # +10% each against its own process's scan accumulation, not the release's
  # 2.2 against the first process's 1.0.
  table = gpu_report.table(rows)
  assert table.count("| +10.0% |") == 3 and "+120.0%" not in table
  assert "| llama_test, N=2 | n/a; 1.100x |" in gpu_report.summary(rows)


def test_a_share_of_the_device_the_user_set_is_left_alone(monkeypatch):
  for name in gpu.MEMORY_FRACTION_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  assert "XLA_CLIENT_MEM_FRACTION" not in gpu.worker_env("/cache")
  assert gpu.worker_env("/cache", 0.95)["XLA_CLIENT_MEM_FRACTION"] == "0.95"
  # JAX refuses both names at once: the user's older one stands alone.
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  env = gpu.worker_env("/cache", 0.95)
  assert "XLA_CLIENT_MEM_FRACTION" not in env and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


@pytest.mark.parametrize("flags", [["--timed-together", "1"], ["--tag", "../x"],
                                   ["--memory-fraction", "1.5"]])
def test_flags_that_cannot_work_are_refused_before_any_process_starts(flags, capsys):
  with pytest.raises(SystemExit) as exit_info:
    gpu_bench.main(flags)
  assert exit_info.value.code == 2 and flags[0] in capsys.readouterr().err
