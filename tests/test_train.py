"""The training CLI end to end, on a few steps of each model's test preset."""

import json

import jax
import numpy as np
import pytest

from models import train


@pytest.fixture(autouse=True)
def _standard_promotion():
  # optax's schedules and adamw (the baselines) rely on implicit promotion.
  with jax.numpy_dtype_promotion("standard"):
    yield


@pytest.mark.parametrize("model", ["gpt", "bert", "vit"])
def test_cli_writes_metrics(model, tmp_path):
  out = tmp_path / "run.json"
  train.main([
      "--model", model, "--preset", f"{model}_test", "--optimizer", "adama",
      "--num-micro-batches", "2", "--batch-size", "8", "--seq-len", "16",
      "--steps", "4", "--eval-batches", "2", "--max-bytes", "200000",
      "--metrics-out", str(out), "--no-progress",
  ])
  run = json.loads(out.read_text())
  assert len(run["train_loss"]) == 4
  assert np.all(np.isfinite(run["train_loss"]))
  assert np.isfinite(run["eval_loss"])
  assert run["tokens_per_s"] > 0
  memory = run["memory"]
  assert memory["total_bytes"] == (memory["argument_bytes"] + memory["output_bytes"]
                                   + memory["temp_bytes"] - memory["alias_bytes"])
  assert memory["total_p"] > 3.0  # params + m + v at least
  assert run["num_dropped"] == 0


def test_compare_runs_adama_and_accumulation_on_the_same_data(tmp_path, capsys):
  out = tmp_path / "compare.json"
  runs = train.main([
      "--preset", "gpt_test", "--compare", "--num-micro-batches", "4",
      "--batch-size", "8", "--seq-len", "16", "--steps", "3",
      "--eval-batches", "2", "--max-bytes", "200000", "--metrics-out", str(out),
      "--no-progress",
  ])
  assert [r["config"]["optimizer"] for r in runs] == ["adama", "adam"]
  # Same init and data: the first step's loss is computed before any update.
  assert runs[0]["train_loss"][0] == pytest.approx(runs[1]["train_loss"][0], rel=1e-6)
  assert runs[1]["memory"]["total_bytes"] > runs[0]["memory"]["total_bytes"]
  assert "| adama | 4 |" in capsys.readouterr().out
  assert len(json.loads(out.read_text())["runs"]) == 2


def test_bad_config_is_rejected_with_both_numbers():
  with pytest.raises(ValueError, match=r"batch size 10 .*num_micro_batches=4"):
    train.TrainConfig(batch_size=10, num_micro_batches=4)
  with pytest.raises(ValueError, match="optimizer"):
    train.TrainConfig(optimizer="sgd")
