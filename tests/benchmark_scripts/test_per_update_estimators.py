"""Smoke run of benchmarks/scripts/per_update_estimators.py: one seed, 10 mini-batches."""

import json
import math

from conftest import load_script


def test_every_arm_runs_through_nnx_optimizer(tmp_path):
  bench = load_script("benchmarks/scripts/per_update_estimators.py")
  out, table = tmp_path / "raw.json", tmp_path / "table.md"
  result = bench.main(["--seeds", "0", "--steps", "10", "--learning-rates", "1e-2", "2e-2",
                       "--heldout-size", "256", "--json", str(out), "--markdown", str(table)])
  rows = json.loads(out.read_text())["rows"]
  assert len(rows) == len(bench.ARMS) * 2
  assert {r["arm"] for r in rows} == set(bench.ARMS)
  for row in rows:
    assert row["finite"] and len(row["curve"]) == 10
    assert row["update_calls"] == 10 * 4  # one optimizer.update per micro-batch
    assert all(math.isfinite(row[k]) for k in ("train_loss", "heldout_loss",
                                                "heldout_function_error"))
    assert ("gap_pct" in row) == (row["arm"] != bench.BASELINE)
  # "sum" folds g^2 / N^2: "mean" at sqrt(N) = 2 times the rate, so the estimator
  # really reached the optimizer.
  by = {(r["arm"], r["learning_rate"]): r["heldout_loss"] for r in rows}
  assert math.isclose(by[("sum", 1e-2)], by[("mean", 2e-2)], rel_tol=1e-3)
  assert not math.isclose(by[("sum", 1e-2)], by[("mean", 1e-2)], rel_tol=1e-3)
  text = table.read_text()
  assert text.splitlines()[2] == f"`{result['command']}`"
  assert "--steps 10" in result["command"]
