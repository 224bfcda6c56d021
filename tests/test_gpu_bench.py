"""The GPU benchmark's CPU dry run: the same script, tiny preset, every stage."""

import json

from models import gpu_bench


def test_dry_run_measures_every_method_in_its_own_process(tmp_path):
  rows = gpu_bench.main([
      "--presets", "gpt_test", "--num-micro-batches", "2", "--layouts", "scanned",
      "--seq-len", "16", "--workers", "2", "--rounds", "1", "--steps-per-round", "1",
      "--out-dir", str(tmp_path), "--no-progress"])
  by_method = {r["method"]: r for r in rows}
  assert set(by_method) == set(gpu_bench.METHODS) | {"adama_release"}
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
  assert saved_json["rows"] == rows and saved_json["command"].startswith("python -m")
  text = (tmp_path / f"gpu_{slug}.md").read_text()
  assert "| gpt_test scanned N=2 | adama |" in text and "n/a" in text


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
