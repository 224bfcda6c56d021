"""Smoke run of the convergence experiment (the full one is `make validate`)."""

import json

import jax
import pytest

from models import validate


@pytest.fixture(autouse=True)
def _standard_promotion():
  with jax.numpy_dtype_promotion("standard"):  # optax schedules and adamw
    yield


# One seed in the default suite (two training runs); two seeds, whose mean and
# spread the table reports, with the slow tests (summarize's arithmetic over
# seeds is checked by hand below).
@pytest.mark.parametrize("seeds", [["0"], pytest.param(["0", "1"], marks=pytest.mark.slow)],
                         ids=["one_seed", "two_seeds"])
def test_validate_writes_table_plot_and_raw_runs(tmp_path, seeds):
  rows = validate.main([
      "--models", "vit", "--seeds", *seeds, "--num-micro-batches", "2",
      "--steps", "3", "--out-dir", str(tmp_path), "--no-progress",
  ])
  assert [r["arm"] for r in rows] == ["Adam", "AdamA N=2"]
  assert all(r["seeds"] == len(seeds) for r in rows)
  table = (tmp_path / "convergence.md").read_text()
  assert f"| vit_tiny | AdamA N=2 | 3 | {len(seeds)} |" in table
  assert (tmp_path / "convergence.png").stat().st_size > 0
  raw = json.loads((tmp_path / "raw" / "convergence.json").read_text())
  assert len(raw["runs"]) == 2 * len(seeds)


def _run(arm, num_micro_batches, seed, eval_loss, accuracy):
  return {"arm": arm, "preset": "gpt_tiny", "eval_loss": eval_loss,
          "eval_metrics": {"loss": eval_loss, "accuracy": accuracy},
          "config": {"model": "gpt", "seed": seed, "steps": 10,
                     "num_micro_batches": num_micro_batches}}


def test_summary_of_a_hand_computed_example():
  runs = [_run("Adam", 1, 0, 2.0, 0.5), _run("Adam", 1, 1, 4.0, 0.7),
          _run("AdamA N=2", 2, 0, 2.2, 0.4), _run("AdamA N=2", 2, 1, 3.9, 0.6)]
  adam, adama = validate.summarize(runs)
  assert adam["eval_loss_mean"] == pytest.approx(3.0)
  assert adam["rel_diff_to_adam"] == pytest.approx(0.0)
  # Means 3.05 against 3.0: +1.67%. Paired by seed: +10% (2.2 / 2.0) and
  # -2.5% (3.9 / 4.0), so the largest paired difference is 10%.
  assert adama["eval_loss_mean"] == pytest.approx(3.05)
  assert adama["eval_loss_std"] == pytest.approx(1.7 / 2**0.5)  # ddof=1 of two
  assert adama["rel_diff_to_adam"] == pytest.approx(0.05 / 3)
  assert adama["paired_rel_diff_max"] == pytest.approx(0.1)
  assert adama["eval_accuracy_mean"] == pytest.approx(0.5)
  assert (adama["seeds"], adama["num_micro_batches"], adama["steps"]) == (2, 2, 10)
  table = validate.markdown(
      [adam, adama], "cmd", {"cpu": "x", "backend": "cpu", "jax": "0", "optax": "0",
                             "python": "3"})
  assert ("| gpt_tiny | AdamA N=2 | 10 | 2 | 3.0500 ± 1.2021 | 0.5000 | +1.67% | 10.00% "
          "| **no** |") in table
