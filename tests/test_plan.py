"""Tests for models/planner.py and models/plan.py: the search, its predictor, the CLI paths.

The search is tested on a synthetic memory/time model (no compiles, so every
budget can be tried) against exhaustive enumeration; the compile-only
measurements on the 1-layer and 2-layer presets; the whole planner on gpt_test
with a budget between its smallest and largest step (slow).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import pytest

import models
import optax_adama
from models import harness, plan, planner, train

MACHINE = planner.Machine(peak_flops=1.0, memory_bandwidth=1e12, host_bandwidth=1.0)


@pytest.fixture(autouse=True)
def _standard_promotion():
  # The plan compiles models.train's optimizer, whose optax schedule relies on
  # implicit promotion (float ** int32).
  with jax.numpy_dtype_promotion("standard"):
    yield


SETTINGS = (("none", None), ("none", 2), ("dots", None), ("full", None))
# Synthetic step: memory = params and moments + activations / N, time =
# compute of the setting + N folds over the moments (as AdamA's step pays).
ACTIVATIONS = {("none", None): 16.0, ("none", 2): 12.0, ("dots", None): 9.0, ("full", None): 3.0}
COMPUTE = {("none", None): 10.0, ("none", 2): 10.1, ("dots", None): 11.0, ("full", None): 13.0}
STATE = {"float32": 3.0, "bfloat16": 2.0, "8bit": 1.5}
FOLD = {"float32": 0.5, "bfloat16": 0.35, "8bit": 0.6}
# The chunked loss: a share of the activations gone, one more head forward.
CHUNKED_ACTIVATIONS, CHUNKED_COMPUTE = 0.45, 0.3
LOSS_CHUNKS = (1, 8)


class SyntheticSteps:
  """A measure_fn with the synthetic model, counting its calls."""

  def __init__(self):
    self.calls = 0

  def __call__(self, candidate: planner.Candidate) -> planner.Measurement:
    self.calls += 1
    setting = (candidate.remat, candidate.gelu_bits)
    n = candidate.num_micro_batches
    chunked = candidate.loss_chunks > 1
    activations = ACTIVATIONS[setting] * (CHUNKED_ACTIVATIONS if chunked else 1.0)
    memory = 1.0 + STATE[candidate.moments] + activations / n
    seconds = COMPUTE[setting] + chunked * CHUNKED_COMPUTE + n * FOLD[candidate.moments]
    # The fold's traffic is the predictor's own: N * (P + 2 * state) / bandwidth.
    seconds -= n * (1.0 + 2 * STATE[candidate.moments]) * 1e6 / MACHINE.memory_bandwidth
    return planner.Measurement(device_bytes=int(memory * 1e6), host_bytes=0, param_bytes=10**6,
                               state_bytes=int(STATE[candidate.moments] * 1e6), flops=seconds,
                               bytes_accessed=0.0, compile_s=0.0)


def synthetic_plan(budget_bytes: float, steps: SyntheticSteps | None = None) -> planner.Plan:
  steps = steps or SyntheticSteps()
  return planner.plan("gpt_test", budget_bytes, batch_size=16, machine=MACHINE,
                      activation_settings=SETTINGS, loss_chunks=LOSS_CHUNKS, measure_fn=steps,
                      verify_fn=steps)


def best_remat_only(measure_fn, budget_bytes: float, batch_size: int,
                    remats: tuple[str, ...]) -> float:
  """The fastest predicted step over every remat policy and N, float32, no saver."""
  times = []
  for remat, n in itertools.product(remats, planner.divisors(batch_size)):
    candidate = planner.Candidate(n, remat)
    measurement = measure_fn(candidate)
    if measurement.device_bytes <= budget_bytes:
      times.append(measurement.predicted_s(MACHINE, n))
  return min(times)


@pytest.mark.parametrize("budget_mb", [4.3, 4.6, 5.0, 6.0, 8.0, 12.0, 20.0, 40.0])
def test_plan_fits_and_is_never_slower_than_remat_alone(budget_mb):
  budget = budget_mb * 1e6
  result = synthetic_plan(budget)
  assert result.verified.device_bytes <= budget
  assert result.predicted_s <= best_remat_only(
      SyntheticSteps(), budget, 16, ("none", "dots", "full")) + 1e-12
  # The choice is the best of everything that fits (exhaustive over the grid).
  steps = SyntheticSteps()
  every = [planner.Candidate(n, remat, bits, moments, chunks)
           for (remat, bits), n, moments, chunks in itertools.product(
               SETTINGS, planner.divisors(16), planner.MOMENT_STORAGES, LOSS_CHUNKS)]
  fitting = [steps(c).predicted_s(MACHINE, c.num_micro_batches) for c in every
             if steps(c).device_bytes <= budget]
  # Narrower moments are considered only where they buy a smaller N, so the
  # choice may be float32 where bfloat16 at the same N predicts a little less;
  # and only with the loss in chunks, which may cost one head forward more
  # than narrower moments alone would have.
  narrow_gain = max(FOLD["float32"] - FOLD["bfloat16"], 0.0) * 16 + CHUNKED_COMPUTE
  assert result.predicted_s <= min(fitting) + narrow_gain


def test_plan_compiles_far_fewer_candidates_than_the_grid():
  steps = SyntheticSteps()
  result = synthetic_plan(6e6, steps)
  grid = (len(SETTINGS) * len(planner.divisors(16))
          * len(planner.memory_levers(planner.MOMENT_STORAGES, LOSS_CHUNKS)))
  assert steps.calls == len(result.considered) + 1  # + the verification
  assert steps.calls <= grid // 2


def test_tight_budget_narrows_the_moments_and_the_table_says_why():
  # 4.3 MB: with float32 moments the fastest fit is remat "full" with the loss
  # in chunks at N = 8 (17.3 s); bfloat16 moments let "dots" fit at N = 4 (12.7 s).
  result = synthetic_plan(4.3e6)
  assert result.choice.moments != "float32"
  table = result.table()
  assert "**(chosen)**" in table and "| no |" in table


def test_impossible_budget_raises_a_clear_error():
  with pytest.raises(ValueError, match="nothing fits 0.001 GB for gpt_test.*smallest step"):
    synthetic_plan(1e6)


def test_train_overrides_are_train_config_fields():
  candidate = planner.Candidate(4, "none", 2, "8bit", loss_chunks=8)
  config = planner.train_config("gpt_test", candidate, batch_size=8, seq_len=16)
  assert (config.num_micro_batches, config.remat, config.gelu_bits, config.quantize_moments,
          config.scan_layers, config.loss_chunks, config.release) == (
              4, "none", 2, True, True, 8, False)
  assert planner.train_config("gpt_test", dataclasses.replace(candidate, moments="bfloat16"),
                              batch_size=8, seq_len=16).nu_dtype == "bfloat16"
  released = planner.train_config("gpt_test", planner.Candidate(2, planner.RELEASE), batch_size=8,
                                  seq_len=16)
  assert (released.release, released.remat, released.scan_layers) == (True, "none", True)
  assert "N=2 release" in planner.Candidate(2, planner.RELEASE).describe()


def test_exact_levers_come_before_narrower_moments():
  assert planner.memory_levers(planner.MOMENT_STORAGES, (1, 8)) == [
      ("float32", 1), ("float32", 8), ("bfloat16", 8), ("8bit", 8)]
  assert planner.memory_levers(("float32",), (1,)) == [("float32", 1)]
  assert planner.default_loss_chunks("gpt_test", None) == (1, planner.LOSS_CHUNKS)
  assert planner.default_loss_chunks("gpt_test", 30) == (1,)  # 8 does not divide 30
  assert planner.default_loss_chunks("bert_test", None) == (1,)


def test_the_chunked_loss_lets_a_smaller_n_fit():
  # 5.3 MB, float32 moments: "dots" (9 units of activations) needs N = 8;
  # with the loss in chunks (4.05) N = 4 fits, which the search must find.
  result = synthetic_plan(5.3e6)
  assert planner.Candidate(4, "dots", None, "float32", 8) in {
      row.candidate for row in result.considered if row.fits}


def test_measure_matches_memory_report_and_counts_every_layer():
  """gpt_tiny (2 layers): device bytes are memory_report's; flops cover both layers."""
  candidate = planner.Candidate(2, "none")
  measurement = planner.measure("gpt_tiny", candidate, batch_size=4, seq_len=32)
  config = models.get_config("gpt_tiny", scan_layers=True)
  assert measurement.host_bytes == 0  # nothing is offloaded without "offload"
  assert measurement.param_bytes == optax_adama.memory.tree_bytes(harness.split_model(config)[1])
  # Forward and backward of a transformer take at least 6 flops per parameter
  # per token in its matmuls (Kaplan et al. 2020); XLA's count of one scanned
  # layer alone would be below that for the 2-layer stack.
  config = models.get_config("gpt_tiny")
  block_params = 12 * config.hidden**2 * config.num_layers
  assert measurement.flops >= 6 * block_params * 4 * 32
  assert measurement.flops <= 3 * 6 * models.param_count(config) * 4 * 32 + 1e9


# Two compiles a case: the release in the default suite; the loss chunks
# (whose measurement test_survey_measures_what_the_savers_save also compiles)
# with the slow tests.
@pytest.mark.parametrize("saver", [pytest.param("loss_chunks", marks=pytest.mark.slow),
                                   "release"])
def test_measure_completes_the_loss_chunks_and_the_release_scans(saver):
  """Flops: chunks add one head forward; the release does remat "full"'s work."""
  config = models.get_config("gpt_test")
  flops = lambda c: planner.measure("gpt_test", c, batch_size=4, seq_len=16).flops
  if saver == "loss_chunks":
    head_forward = 2 * (2 * 16) * config.vocab_size * config.hidden  # per micro-batch
    extra = flops(planner.Candidate(2, loss_chunks=4)) - flops(planner.Candidate(2))
    # Uncompleted, the chunk scans would count a quarter of the head: -3/4 of it.
    assert extra == pytest.approx(2 * head_forward, rel=0.1)
  else:
    released, full = flops(planner.Candidate(2, planner.RELEASE)), flops(planner.Candidate(2, "full"))
    assert released == pytest.approx(full, rel=0.05)


@pytest.mark.slow
def test_plan_on_gpt_test_fits_and_beats_remat_alone():
  measure_fn = planner.cached_measure("gpt_test", batch_size=2, seq_len=16)
  remats = ("none", "full")
  sizes = [measure_fn(planner.Candidate(n, r)).device_bytes
           for r, n in itertools.product(remats, (1, 2))]
  budget = (min(sizes) + max(sizes)) / 2
  result = planner.plan("gpt_test", budget, batch_size=2, seq_len=16, machine=MACHINE,
                        activation_settings=(("none", None), ("none", 2), ("full", None)),
                        moment_storages=("float32",), measure_fn=measure_fn)
  assert result.verified.device_bytes <= budget
  assert result.predicted_s <= best_remat_only(measure_fn, budget, 2, remats)
  assert jax.default_backend() != "cpu" or result.verified.host_bytes == 0


def test_train_plan_flag_takes_the_plans_settings(monkeypatch):
  chosen = synthetic_plan(4.3e6)
  calls = []

  def fake_plan(preset, budget_bytes, **kwargs):
    calls.append((preset, budget_bytes, kwargs["batch_size"], kwargs["seq_len"]))
    return chosen

  monkeypatch.setattr(planner, "plan", fake_plan)
  config = harness.TrainConfig(model="gpt", preset="gpt_test", batch_size=16, seq_len=16)
  overrides = train._planned(config, 0.0043, progress=False)
  assert calls == [("gpt_test", 0.0043 * 1e9, 16, 16)]
  planned = dataclasses.replace(config, **overrides)
  assert planned.num_micro_batches == chosen.choice.num_micro_batches
  assert planned.remat == chosen.choice.remat and planned.scan_layers


def test_plot_frontier_writes_a_png(tmp_path):
  memory_p = {"none": 10.5, "none + gelu 4-bit": 9.1, "full": 5.4}
  step_s = {"none": 0.51, "none + gelu 4-bit": 0.48, "full": 0.46}
  path = tmp_path / "frontier.png"
  plan.plot_frontier(memory_p, step_s, path, "test")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offload_without_host_memory_is_not_chosen():
  """On a backend that drops the move to host, "offload" is "minimal" renamed."""
  settings = (("minimal", None), ("offload", None))

  def steps(candidate):
    return dataclasses.replace(
        SyntheticSteps()(dataclasses.replace(candidate, remat="full")),
        # Offload predicted a hair faster, as the CPU measured it.
        flops=13.0 - (candidate.remat == "offload") * 1e-3)

  result = planner.plan("gpt_test", 40e6, batch_size=16, machine=MACHINE,
                        activation_settings=settings, measure_fn=steps, verify_fn=steps)
  assert result.choice.remat == "minimal"
  assert "offload not measurable here" in result.table()


def test_time_settings_times_the_step_models_train_runs_for_each_setting():
  candidates = (planner.Candidate(2, "none"), planner.Candidate(2, planner.RELEASE, loss_chunks=2))
  times = plan.time_settings("gpt_test", candidates, batch_size=4, seq_len=16, rounds=1,
                             steps_per_round=1)
  assert set(times) == {"none", "release + loss in 2 chunks"}
  assert all(seconds > 0 for seconds in times.values())


def test_survey_candidates_cover_every_saver_and_reach_train():
  candidates = plan.survey_candidates(4)
  labels = [c.label() for c in candidates]
  assert len(set(labels)) == len(labels)
  assert {"none + gelu 2-bit", "full + loss in 8 chunks", "release + loss in 8 chunks",
          "none + sampled dW 0.5"} <= set(labels)
  assert {c.label() for c in candidates} >= {r for r, _ in planner.ACTIVATION_SETTINGS}
  sampled = planner.train_config("gpt_test", candidates[-1], batch_size=8, seq_len=16)
  assert sampled.linear_keep_ratio == 0.5 and sampled.num_micro_batches == 4


def test_survey_measures_what_the_savers_save():
  """The chunked loss keeps less than the whole logits (gpt_test: 256-token vocab)."""
  candidates = [planner.Candidate(1, "full"), planner.Candidate(1, "full", loss_chunks=4)]
  whole, chunked = plan.survey("gpt_test", candidates, batch_size=4, seq_len=32)
  assert chunked.measurement.device_bytes < whole.measurement.device_bytes
  assert chunked.predicted_s > 0 and chunked.candidate == candidates[1]
