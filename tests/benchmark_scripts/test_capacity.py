"""benchmarks/scripts/oom_reports.py's capacity table: rows kept across runs, host bytes beside.

The capacity search compiles multi-billion-parameter steps for minutes each,
so a run may measure one method and keep the others' rows from the JSON it
updates; offloaded methods show a device's share of the host memory beside
their parameters. The search itself runs in ``tests/benchmark_scripts/test_oom_reports.py``'s
8-device subprocess (its compile path) and by hand (the command in the table).
"""

import json
import os
import sys

import jax
import jax.numpy as jnp

import optax_adama

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "benchmarks", "scripts"))
import oom_reports  # noqa: E402  # pylint: disable=wrong-import-position
import oom_steps  # noqa: E402  # pylint: disable=wrong-import-position


def _row(method, budget, scale, host=None):
  return {"method": method, "budget_gb": budget, "scale": scale, "num_layers": scale,
          "hidden": 64 * scale, "param_count": scale * 10**9, "per_device_bytes": budget * 1e9,
          "host_bytes_per_device": host, "num_micro_batches": 4, "seq_len": 2048,
          "devices": 8, "rows_per_device": 1}


def test_a_run_of_one_method_keeps_the_other_methods_rows(tmp_path):
  args = oom_reports._parse(["capacity", "--json", str(tmp_path / "c.json"),
                             "--markdown", str(tmp_path / "c.md")])
  args.argv = ["capacity"]
  oom_reports._save_capacity(args, [_row("scan_accumulation", 80.0, 10),
                                    _row("adama_release_offload", 80.0, 30, host=2e11)])
  args.argv = ["capacity", "--methods", "adama_release_8bit_offload"]
  oom_reports._save_capacity(args, [_row("adama_release_8bit_offload", 80.0, 40, host=5e10)])
  saved = json.loads((tmp_path / "c.json").read_text())
  assert [r["method"] for r in saved["rows"]] == [
      "scan_accumulation", "adama_release_offload", "adama_release_8bit_offload"]
  assert saved["commands"] == ["python benchmarks/scripts/oom_reports.py capacity",
                               "python benchmarks/scripts/oom_reports.py capacity --methods "
                               "adama_release_8bit_offload"]
  table = (tmp_path / "c.md").read_text()
  assert "40,000M (40 x 2560), host 50 GB a device" in table
  assert "adama_release_8bit_offload: 4.00x" in table
  # Measuring a method again replaces its rows (and keeps one copy of the command).
  oom_reports._save_capacity(args, [_row("adama_release_8bit_offload", 80.0, 41, host=5e10)])
  saved = json.loads((tmp_path / "c.json").read_text())
  assert [r["scale"] for r in saved["rows"]] == [10, 30, 41]
  assert len(saved["commands"]) == 2


def test_eight_bit_offload_method_stores_8_bit_moments_in_host_memory():
  tx = oom_steps.adama_tx("adama_release_8bit_offload", 4)
  params = {"stack": jnp.zeros((4, 64, 128))}
  state = optax_adama.find_adama_state(jax.eval_shape(tx.init, params))
  codes = state.mu["stack"].codes
  assert codes.dtype == jnp.float8_e4m3fn and codes.shape[0] == 4  # each layer's blocks
  assert optax_adama.moments.host_state_bytes(tx.init(params)) >= 2 * codes.size
