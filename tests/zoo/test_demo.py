"""The main job (`make demo`) on a few steps and a tiny memory model."""

import json

import jax
import pytest

from models import demo
from models import harness


@pytest.fixture(autouse=True)
def _standard_promotion():
  # optax's schedules and adam (the baseline) rely on implicit promotion.
  with jax.numpy_dtype_promotion("standard"):
    yield


def test_demo_reports_the_gap_and_the_saving_from_its_own_runs(tmp_path, capsys):
  out = tmp_path / "demo.json"
  result = demo.main(["--steps", "2", "--micro-batch-size", "4", "--memory-preset", "gpt_tiny",
                      "--memory-seq-len", "16", "--json", str(out), "--no-progress"])
  training, memory = result["training"], result["memory"]
  assert training["tokens_per_micro_batch"] == 4 * 64
  assert training["nu_estimator"] == "mean"  # the library's default
  assert training["nu_estimator_reads_as"] == "mean"  # on every path
  losses = training["eval_loss"]
  assert training["eval_gap"] == pytest.approx(losses["adama"] / losses["adam"] - 1)
  # The accumulator is one P of float32 gradients; AdamA's release step holds
  # one layer's (measured with the loss in 8 chunks: 0.66 P saved on gpt_tiny;
  # on the 1-layer gpt_test, where one layer is the whole stack, 0.14 P).
  saved = memory["total_bytes"]["adam"] - memory["total_bytes"]["adama"]
  assert saved == memory["saved_bytes"]
  assert 0.5 * memory["param_bytes"] < saved <= 1.5 * memory["param_bytes"]
  assert json.loads(out.read_text()) == result
  printed = capsys.readouterr().out
  assert "AdamA saves" in printed and "% of the step" in printed


def test_byte_formatting_switches_to_mib_for_tiny_steps():
  assert harness.format_bytes(3 * 2**30) == "3.00 GiB"
  assert harness.format_bytes(5 * 2**20) == "5.00 MiB"
