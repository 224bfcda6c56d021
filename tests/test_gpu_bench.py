"""The GPU benchmark's CPU dry run: the same script, tiny preset, every stage."""

import json

import jax
import numpy as np

import pytest

from models import gpu_bench


# The default suite runs the lean row group (scan accumulation in float32 and
# bf16, and AdamA) on the unrolled model: the same script end to end, 5 worker
# processes. Every method and the scanned layout's release row (9 processes,
# 100-140 s on 2 cores) run with the slow tests.
@pytest.mark.parametrize("layout, all_methods, methods", [
    ("unrolled", [], gpu_bench.LEAN_METHODS),
    pytest.param("scanned", ["gpt_test"], gpu_bench.METHODS + ("adama_release",),
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
  slug = gpu_bench.device_slug()
  saved_json = json.loads((tmp_path / "raw" / f"gpu_{slug}.json").read_text())
  # As JSON has them: a lean row group's method tuple is a list there.
  assert saved_json["rows"] == json.loads(json.dumps(rows))
  assert saved_json["command"].startswith("python -m")
  text = (tmp_path / f"gpu_{slug}.md").read_text()
  assert f"| gpt_test {layout} N=2 remat=full bfloat16 | adama |" in text and "n/a" in text
  assert "| gpt_test, N=2 |" in text  # the targets' summary
  assert (tmp_path / f"gpu_{slug}.png").stat().st_size > 0


def test_default_cases_fill_the_device_and_add_reference_rows():
  import argparse
  namespace = argparse.Namespace(
      presets=["gpt2_small", "gpt2_medium"], num_micro_batches=[4],
      layouts=["unrolled", "scanned"], remat="full", reference_remat=["none"],
      dtype="bfloat16", all_methods_presets=["gpt2_small"], micro_batch_size=None,
      seq_len=None)
  cases = gpu_bench.make_cases(namespace)
  assert {c.micro_batch_size for c in cases} == {8}  # 8 x 1,024 tokens
  small = [c for c in cases if c.preset == "gpt2_small"]
  assert [(c.scan_layers, c.remat) for c in small] == [
      (False, "full"), (True, "full"), (False, "none")]
  assert small[1].methods == gpu_bench.METHODS + ("adama_release",)
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
  result = gpu_bench.run_in_process(task, gpu_bench.worker_env(str(tmp_path)))
  assert "no_such_preset" in result["error"]
  log = tmp_path / "tasks.jsonl"
  gpu_bench.log_result(log, task, result)
  assert json.loads(log.read_text())["result"] == result
  row = {"case": "x", "method": "adama", **gpu_bench.MISSING_MEMORY, **result,
         "floor_bytes": None, "median_step_s": None}
  assert "| failed: " in gpu_bench.table([row])


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

  monkeypatch.setattr(gpu_bench, "run_in_process", fake_run)
  case = gpu_bench.Case("gpt_test", 2, False, method_names=("adama",))
  [row] = gpu_bench.run([case], workers=2, rounds=1, steps_per_round=1, cache_dir="",
                        progress=False)
  assert [c["kind"] for c in calls].count("memory") == 2
  assert row["retried_alone"] and "error" not in row and row["peak_bytes_in_use"] == 12


def test_a_failed_row_shows_the_exception_not_the_traceback_footer():
  row = {"case": "x", "method": "adama", **gpu_bench.MISSING_MEMORY, "param_bytes": None,
         "floor_bytes": None, "median_step_s": None,
         "error": "Traceback\njax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n"
                  "----\nFor simplicity, JAX has removed its internal frames"}
  assert "| failed: jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED" in gpu_bench.table([row])


def test_capacity_trains_the_compiled_answer_and_steps_down_when_it_does_not_fit(monkeypatch):
  # The compile-only search says 5 layers; 5 runs out of memory live, 4 trains.
  def fake_run(task, env):
    if task["scale"] == 5:
      return {"error": "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}
    return {"scale": task["scale"], "param_count": 400 if task["method"] != "scan_accumulation"
            else 100, "peak_bytes_in_use": 9, "losses": [5.0, 4.9, 4.8]}

  monkeypatch.setattr(gpu_bench, "run_in_process", fake_run)
  monkeypatch.setattr(gpu_bench, "search_capacity",
                      lambda case, method, env: {"scale": 5, "total_bytes": 10})
  case = gpu_bench.CapacityCase(budget_gb=1.0)
  rows = gpu_bench.run_capacity(case, ("scan_accumulation", "adama_release_8bit_offload"),
                                cache_dir="", tries=3)
  assert [r["trained_scale"] for r in rows] == [4, 4]
  assert [a["scale"] for a in rows[0]["attempts"]] == [5, 4]
  text = gpu_bench.capacity_table(rows)
  assert "| 5 layers | 4 layers |" in text and "| 4.00x |" in text and "5 fails, 4 trains" in text


def test_capacity_search_is_models_bench_capacity_with_the_case_s_settings(tmp_path):
  case = gpu_bench.CapacityCase(budget_gb=2.5, num_micro_batches=2, seq_len=16,
                                dtype="bfloat16", max_scale=3, vocab_size=128)
  command = gpu_bench.search_command(case, "scan_accumulation", tmp_path / "c.json")
  assert command[1:4] == ["-m", "models.bench", "capacity"] and "--scan-layers" in command
  flags = dict(zip(command[4::1], command[5::1]))
  assert flags["--budgets-gb"] == "2.5" and flags["--dtype"] == "bfloat16"
  assert flags["--max-scale"] == "3" and flags["--vocab-size"] == "128"
  from models import bench
  for method in gpu_bench.CAPACITY_METHODS:  # each one a method models.bench takes
    args = bench._parse_args(gpu_bench.search_command(case, method, tmp_path / "c.json")[3:])
    assert args.methods == [method] and args.dtype == "bfloat16"


def test_capacity_records_a_method_that_fits_nowhere(monkeypatch):
  monkeypatch.setattr(gpu_bench, "search_capacity",
                      lambda case, method, env: {"scale": 2, "total_bytes": 1})
  monkeypatch.setattr(gpu_bench, "run_in_process",
                      lambda task, env: {"error": "RESOURCE_EXHAUSTED"})
  [row] = gpu_bench.run_capacity(gpu_bench.CapacityCase(budget_gb=1.0), ("scan_accumulation",),
                                 cache_dir="", tries=3)
  assert row["trained_scale"] is None and [a["scale"] for a in row["attempts"]] == [2, 1]
  assert "| none layers |" in gpu_bench.capacity_table([row])


@pytest.mark.parametrize("method", [
    "scan_accumulation_bf16",
    # The release step with offloaded 8-bit moments compiles for ~40 s here.
    pytest.param("adama_release_8bit_offload", marks=pytest.mark.slow)])
def test_capacity_worker_trains_a_small_family_member(method):
  # The accumulation baselines are optax.adam, which relies on implicit promotion.
  with jax.numpy_dtype_promotion("standard"):
    _train_small_family_member(method)


def _train_small_family_member(method):
  case = gpu_bench.CapacityCase(budget_gb=1.0, num_micro_batches=2, seq_len=16,
                                dtype="float32", vocab_size=128)
  result = gpu_bench.train_at_scale(case, method, scale=1, steps=2)
  assert result["scale"] == 1 and result["param_count"] > 0
  assert all(np.isfinite(result["losses"])) and result["losses"][1] != result["losses"][0]
