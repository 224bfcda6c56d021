"""benchmarks/scripts/gpu_compiled_gpt2.py at its smallest: gpt_test on the CPU backend."""

import json
import pathlib
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))
import gpu_compiled_gpt2  # noqa: E402  # pylint: disable=wrong-import-position

GPT_TEST_PARAM_BYTES = 941568


@pytest.fixture(autouse=True)
def _standard_promotion():
  with jax.numpy_dtype_promotion("standard"):  # optax's adam, as models.bench runs it
    yield


def _live_row(method, peak, **changes):
  return {"preset": "gpt_test", "num_micro_batches": 2, "scan_layers": False,
          "micro_batch_size": 2, "seq_len": 16, "remat": "full", "dtype": "bfloat16",
          "method": method, "compiled_total_bytes": peak - 2**16,
          "peak_bytes_in_use": peak, "param_bytes": GPT_TEST_PARAM_BYTES, **changes}


def test_each_live_row_is_compiled_again_and_set_beside_its_peak(tmp_path):
  live = tmp_path / "live.json"
  live.write_text(json.dumps({"machine": {"device": "Test GPU", "jax": "0.0"}, "rows": [
      _live_row("scan_accumulation", 8 * GPT_TEST_PARAM_BYTES),
      _live_row("adama_mean", 7 * GPT_TEST_PARAM_BYTES),
      _live_row("adama_mean", 7 * GPT_TEST_PARAM_BYTES, scan_layers=True),
      _live_row("adama", 10 * 2**20, peak_bytes_in_use=None),  # no live peak: left out
      _live_row("adama", 300 * 2**20, preset="gpt2_small"),  # another preset: left out
  ]}))
  result = gpu_compiled_gpt2.main(["--live", str(live), "--presets", "gpt_test",
                                   "--out-dir", str(tmp_path), "--stem", "page"])
  saved = json.loads((tmp_path / "raw" / "page.json").read_text())
  assert saved["rows"] == json.loads(json.dumps(result["rows"]))
  text = (tmp_path / "page.md").read_text()
  rows = saved["rows"]
  # A run with "adama_mean" predates the "mean" default: its names map to today's.
  assert [(r["method"], r["live_method"], r["scan_layers"]) for r in rows] == [
      ("scan_accumulation", "scan_accumulation", False), ("adama", "adama_mean", False),
      ("adama", "adama_mean", True)]
  # Unrolled, the live run's program is models.bench memory's; scanned, the live
  # run's is the model's own loss and models.bench memory's the staged one.
  assert [r["same_program"] for r in rows] == [True, True, False]
  assert rows[0]["compiled_total_bytes"] == rows[0]["bench_compiled_total_bytes"]
  assert rows[2]["report"]["param_bytes"] == rows[2]["bench_report"]["param_bytes"]
  for r in rows:
    report = r["report"]
    assert r["compiled_total_bytes"] == report["total_bytes"] == (
        report["argument_bytes"] + report["output_bytes"] + report["temp_bytes"]
        - report["alias_bytes"])
    assert r["compiled_minus_peak_bytes"] == r["compiled_total_bytes"] - r["peak_bytes_in_use"]
    assert r["compiled_minus_device_bytes"] == (r["compiled_total_bytes"]
                                                - r["device_compiled_total_bytes"])
    assert r["compiled_vs_peak"] == pytest.approx(
        r["compiled_total_bytes"] / r["peak_bytes_in_use"] - 1)
    assert r["compiled_by"].startswith("XLA's CPU backend") and r["fits"] is None
  # AdamA compiles under accumulation, as its live peak is: the same order.
  assert rows[1]["compiled_total_bytes"] < rows[0]["compiled_total_bytes"]
  assert "| same program |" in text
  assert result["orderings"] == {"gpt_test unrolled N=2 remat=full bfloat16": "same order",
                                 "gpt_test scanned N=2 remat=full bfloat16": "same order"}
  assert "| adama (live: adama_mean) |" in text and "compiled on the Test GPU" in text
  assert f"{rows[0]['compiled_minus_peak_bytes'] / 2**30:+.2f} GiB" in text
  assert "- gpt_test unrolled N=2 remat=full bfloat16: same order" in text
  # --page-only writes the same page again from the raw JSON, compiling nothing.
  (tmp_path / "page.md").unlink()
  again = gpu_compiled_gpt2.main(["--out-dir", str(tmp_path), "--stem", "page", "--page-only"])
  assert (tmp_path / "page.md").read_text() == text
  assert again["orderings"] == result["orderings"]


def test_an_order_that_flips_is_named():
  rows = [{"method": "a", "compiled_total_bytes": 2 * 2**30, "peak_bytes_in_use": 2**30},
          {"method": "b", "compiled_total_bytes": 2**30, "peak_bytes_in_use": 2 * 2**30},
          {"method": "c", "compiled_total_bytes": 2**30 + 2**20,
           "peak_bytes_in_use": 3 * 2**30}]
  assert gpu_compiled_gpt2.ordering_note(rows) == (
      "**order differs**: a / b, a / c; b / c tied compiled only")


def test_a_live_run_without_the_presets_is_refused(tmp_path):
  live = tmp_path / "live.json"
  live.write_text(json.dumps({"machine": {}, "rows": [_live_row("adama", 2**20)]}))
  with pytest.raises(SystemExit):
    gpu_compiled_gpt2.main(["--live", str(live), "--presets", "gpt2_small",
                            "--out-dir", str(tmp_path)])
