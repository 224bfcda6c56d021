"""Smoke run of the convergence experiment (the full one is `make validate`)."""

import json

import jax
import pytest

from models import validate


@pytest.fixture(autouse=True)
def _standard_promotion():
  with jax.numpy_dtype_promotion("standard"):  # optax schedules and adamw
    yield


def test_validate_writes_table_plot_and_raw_runs(tmp_path):
  rows = validate.main([
      "--models", "vit", "--seeds", "0", "1", "--num-micro-batches", "2",
      "--steps", "3", "--out-dir", str(tmp_path), "--no-progress",
  ])
  assert [r["arm"] for r in rows] == ["Adam", "AdamA N=2"]
  assert all(r["seeds"] == 2 for r in rows)
  adam, adama = rows
  assert adama["rel_diff_to_adam"] == pytest.approx(
      adama["eval_loss_mean"] / adam["eval_loss_mean"] - 1)
  table = (tmp_path / "convergence.md").read_text()
  assert "| vit_tiny | AdamA N=2 | 3 | 2 |" in table
  assert (tmp_path / "convergence.png").stat().st_size > 0
  raw = json.loads((tmp_path / "raw" / "convergence.json").read_text())
  assert len(raw["runs"]) == 4
