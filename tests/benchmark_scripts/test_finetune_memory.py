"""benchmarks/scripts/finetune_memory.py: the trainer's step against accumulation, compile-only.

The fast test runs the script's tiny case on XLA's CPU backend (seconds) and
holds its rows to references: AdamA's step is the one `models.train` builds
from its flags, accumulation's bytes are `models.bench memory`'s for the same
model. The real compilers' run (Llama 3.2 1B for a 24 GiB GPU, .venv-gpu) is
slow and skips where the CUDA plugin is absent.
"""

from __future__ import annotations

import importlib.util
import json

import jax
import pytest
from conftest import load_script

finetune_memory = load_script("benchmarks/scripts/finetune_memory.py")


def test_the_tiny_case_compiles_both_steps_against_their_references(tmp_path):
  from models import train
  from models.harness import memory

  raw, page = tmp_path / "raw.json", tmp_path / "page.md"
  with jax.numpy_dtype_promotion("standard"):  # optax's adam and schedules promote implicitly
    rows = finetune_memory.main(["--cases", "llama_test_cpu", "--raw", str(raw),
                                 "--page", str(page), "--no-progress"])
  by_method = {r["method"]: r for r in rows}
  assert sorted(by_method) == ["accumulation", "accumulation_8bit", "adama", "adama_clipped",
                               "adama_float32_moments"]
  case = finetune_memory.CASES["llama_test_cpu"]
  # AdamA's step is the trainer's: the TrainConfig models.train makes of these flags.
  assert finetune_memory.train_config(case, 1) == train.train_config([
      "--model", "llama", "--preset", "llama_test", "--optimizer", "adama",
      "--num-micro-batches", "2", "--batch-size", "4", "--seq-len", "32", "--remat", "full",
      "--dtype", "bfloat16", "--scan-layers", "--release", "--quantize-moments"])
  # Accumulation's bytes are models.bench memory's on the same model: the float32
  # scan, and with AdamA's 8-bit moments the bfloat16 carry + 8-bit moments scan.
  with jax.numpy_dtype_promotion("standard"):
    references = memory.measure_memory(
        "llama_test", ["scan_accumulation", "scan_accumulation_bf16_8bit"], 2,
        micro_batch_size=2, seq_len=32, remat="full", scan_layers=True, dtype="bfloat16")
  for method, reference in zip(("accumulation", "accumulation_8bit"), references):
    assert by_method[method]["report"]["total_bytes"] == reference.report["total_bytes"]
    assert by_method[method]["report"]["param_bytes"] == reference.report["param_bytes"]
  # The release with 8-bit moments holds neither a gradient buffer nor float32
  # moments: well under accumulation (4.57 P against 6.42 P when written), and
  # its float32 moments take more than 8-bit ones (5.64 P).
  total_p = {method: row["report"]["total_p"] for method, row in by_method.items()}
  assert total_p["adama"] < total_p["adama_float32_moments"] < total_p["accumulation"] - 0.5
  assert all(r["fits"] is None and r["compiled_by"].startswith("XLA's CPU backend")
             for r in rows)
  assert json.loads(raw.read_text())["rows"] == rows
  text = page.read_text()
  assert "| llama_test (0.00B), cpu | 2 x 32, N = 2 | accumulation (`scan_accumulation`)" in text
  assert text.count(" P) |") == 5 + 4  # five steps, four against accumulation
  # --clip-norm with the release: the sketch's 2^16 floats more (here, a tiny
  # model, they are not small against P), still well under accumulation.
  assert total_p["adama"] < total_p["adama_clipped"] < total_p["accumulation"] - 0.5
  assert "AdamA with `--clip-norm 1.0` (`make_train_step`, release), 8-bit moments" in text
  assert ".venv/bin/python benchmarks/scripts/finetune_memory.py --cases llama_test_cpu" in text
  # --page-only compiles nothing: the same rows and page again, from the JSON.
  page.unlink()
  again = finetune_memory.main(["--page-only", "--raw", str(raw), "--page", str(page)])
  assert again == rows and page.read_text() == text


def test_plot_live_draws_a_runs_curve_beside_its_json(tmp_path):
  metrics = tmp_path / "run.json"
  metrics.write_text(json.dumps({"preset": "llama32_1b", "config": {"optimizer": "adama"},
                                 "train_loss": [5.0 - 0.01 * k for k in range(40)],
                                 "eval_loss": 4.7}))
  finetune_memory.main(["--plot-live", str(metrics)])
  png = tmp_path / "run.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                    reason="no CUDA jaxlib plugin in this Python: `make venv-gpu`, then run "
                           "with .venv-gpu")
def test_llama32_1b_fits_a_24_gib_gpu_with_adama_and_not_with_accumulation(tmp_path):
  with jax.numpy_dtype_promotion("standard"):
    rows = finetune_memory.main(["--cases", "llama32_1b_24gb", "--raw", str(tmp_path / "r.json"),
                                 "--page", str(tmp_path / "p.md"), "--no-progress"])
  fits = {r["method"]: r["fits"] for r in rows}
  assert fits == {"accumulation": False, "adama": True, "adama_clipped": True}
  # The page's numbers (benchmarks/results/memory/finetune_llama.md) when written.
  total_gib = {r["method"]: round(r["report"]["total_bytes"] / 2**30, 2) for r in rows}
  assert total_gib == {"accumulation": 30.48, "adama": 20.75, "adama_clipped": 20.75}
