"""benchmarks/bf16_params.py, the convergence cost of bfloat16 params, on gpt_test."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest

import models

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bf16_params  # noqa: E402  # pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _standard_promotion():
  with jax.numpy_dtype_promotion("standard"):  # optax's schedules, as models.train runs
    yield


def test_the_arms_train_and_a_second_run_adds_its_arms_to_the_first(tmp_path):
  out, md = tmp_path / "b.json", tmp_path / "b.md"
  common = ["--seeds", "0", "--steps", "2", "--preset", "gpt_test", "--out", str(out),
            "--markdown", str(md)]
  create, split_loss_fn = models.create, models.split_loss_fn
  bf16_params.main(common + ["--arms", "bf16_stochastic"])
  bf16_params.main(common + ["--arms", "f32_bf16_grads", "--plot", str(tmp_path / "b.png")])
  # The diagnostic's hooks are put back.
  assert (models.create, models.split_loss_fn) == (create, split_loss_fn)
  saved = json.loads(out.read_text())
  assert [r["arm"] for r in saved["runs"]] == ["bf16_stochastic", "f32_bf16_grads"]
  assert len(saved["commands"]) == 2 and saved["command"] == "; ".join(saved["commands"])
  for r in saved["runs"]:
    assert len(r["train_loss"]) == 2 and np.isfinite(r["eval_loss"])
  assert [r["memory"]["param_bytes"] for r in saved["runs"]][::-1] == [
      2 * saved["runs"][0]["memory"]["param_bytes"], saved["runs"][0]["memory"]["param_bytes"]]
  text = md.read_text()
  assert "| bf16_stochastic | 1 |" in text and "| f32_bf16_grads | 1 |" in text
  assert (tmp_path / "b.png").stat().st_size > 0
