"""Tests for models/planner.py and models/plan.py: the search, its predictor, the CLI paths.

The search is tested on a synthetic memory/time model (no compiles, so every
budget can be tried) against exhaustive enumeration; the compile-only
measurements on the 1-layer and 2-layer presets; the whole planner on gpt_test
with a budget between its smallest and largest step (slow). On a mesh: the
search with synthetic steps, then llama_test compiled on 8 CPU devices in a
subprocess (this file run as a script), under a budget only FSDP meets.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import REPO
from conftest import xla_flags

import models
import optax_adama
from models import harness
from models import plan
from models import planner
from models import train

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
    released = flops(planner.Candidate(2, planner.RELEASE))
    full = flops(planner.Candidate(2, "full"))
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


# On a mesh. The search with synthetic steps (no compiles): per-device memory
# = what a stage keeps whole + its shares + activations of a device's rows;
# time = compute + N collectives of the stage (AdamA reduces every micro-batch).
MESH_DEVICES = 8
WHOLE_PARAMS, MESH_STATE = 8.0, {"float32": 16.0, "bfloat16": 8.0, "8bit": 4.0}
MESH_ACTIVATIONS = {"full": 0.5, planner.RELEASE: 0.25}  # MB a row
MESH_COMPUTE = {"full": 10.0, planner.RELEASE: 10.0}
MESH_COLLECTIVES = {None: 2.0, "zero1": 2.0, "zero2": 1.0, "fsdp": 3.0}


def synthetic_whole(stage, moments):
  return int(1e6 * {None: WHOLE_PARAMS + MESH_STATE[moments], "zero1": WHOLE_PARAMS,
                    "zero2": WHOLE_PARAMS, "fsdp": 0.0}[stage])


def synthetic_mesh_step(candidate: planner.Candidate) -> planner.Measurement:
  stage, moments = candidate.shard_states, candidate.moments
  shares = {None: 0.0, "zero1": MESH_STATE[moments] / 8 + WHOLE_PARAMS,  # gradient whole
            "zero2": (MESH_STATE[moments] + WHOLE_PARAMS) / 8,
            "fsdp": (MESH_STATE[moments] + 2 * WHOLE_PARAMS) / 8}[stage]
  rows = 32 // candidate.num_micro_batches // MESH_DEVICES
  memory = (synthetic_whole(stage, moments) / 1e6 + shares
            + MESH_ACTIVATIONS[candidate.remat] * rows)
  seconds = (MESH_COMPUTE[candidate.remat]
             + candidate.num_micro_batches * MESH_COLLECTIVES[stage])
  return planner.Measurement(device_bytes=int(memory * 1e6), host_bytes=0, param_bytes=8 * 10**6,
                             state_bytes=0, flops=seconds, bytes_accessed=0.0, compile_s=0.0)


def synthetic_mesh_plan(budget_bytes: float, calls: list | None = None) -> planner.Plan:
  def steps(candidate):
    if calls is not None:
      calls.append(candidate)
    return synthetic_mesh_step(candidate)

  return planner.plan("llama_test", budget_bytes, batch_size=32, devices=MESH_DEVICES,
                      machine=MACHINE, loss_chunks=(1,),
                      activation_settings=(("full", None), (planner.RELEASE, None)),
                      measure_fn=steps, verify_fn=steps, replicated_fn=synthetic_whole)


def test_mesh_plan_skips_replicated_stages_and_keeps_rows_on_every_device():
  # 12.5 MB a device: data parallel keeps 24 MB (f32) or 16 MB (bf16) whole:
  # skipped with those, never compiled; with 8-bit moments (12 MB) it fits.
  calls = []
  result = synthetic_mesh_plan(12.5e6, calls)
  assert {c.num_micro_batches for c in calls} <= {1, 2, 4}  # 32 rows: 4, 2 or 1 a device
  assert not any(c.shard_states is None and c.moments in ("float32", "bfloat16") for c in calls)
  assert {(s.shard_states, s.moments) for s in result.skipped} == {(None, "float32"),
                                                                   (None, "bfloat16")}
  # zero2 at N = 1: 8 + 3 + 4 rows' activations, and the fewest collectives.
  assert result.choice == planner.Candidate(1, planner.RELEASE, shard_states="zero2")
  assert any(c.shard_states is None and c.moments == "8bit" for c in calls)
  assert result.table().count("skipped, not compiled") == 2
  # Below the params, zero1 and zero2 are skipped once each, whatever the moments.
  low = synthetic_mesh_plan(7e6)
  assert low.choice.shard_states == "fsdp"
  assert {(s.shard_states, s.moments) for s in low.skipped} >= {("zero1", None), ("zero2", None)}


def test_mesh_plan_refuses_what_a_mesh_cannot_run():
  with pytest.raises(ValueError, match="batch_size=12 does not give each of 8 devices"):
    planner.plan("llama_test", 1e9, batch_size=12, devices=8, measure_fn=synthetic_mesh_step)
  with pytest.raises(ValueError, match="shard_states 'fsdp' is not a stage of 1 device"):
    planner.plan("llama_test", 1e9, batch_size=8, shard_stages=("fsdp",),
                 measure_fn=synthetic_mesh_step)
  with pytest.raises(ValueError, match="every stage keeps more whole on each device"):
    planner.plan("llama_test", 1e6, batch_size=32, devices=8, shard_stages=("zero1", "zero2"),
                 measure_fn=synthetic_mesh_step, replicated_fn=synthetic_whole)


def test_the_stage_reaches_make_train_step_and_not_train_config():
  candidate = planner.Candidate(2, planner.RELEASE, shard_states="fsdp")
  assert candidate.train_overrides()["shard_states"] == "fsdp"
  assert "shard_states" not in planner.Candidate(2).train_overrides()  # models.train's flags
  assert planner.train_config("llama_test", candidate, batch_size=16, seq_len=16).release
  assert candidate.describe().endswith("stage=fsdp")
  assert planner.Candidate(2).describe(on_mesh=True).endswith("stage=dp")
  assert planner.Candidate(2).describe() == "N=2 remat=none savers=- moments=float32"
  with pytest.raises(ValueError, match="shard_states='zero2' splits state over a mesh"):
    harness.make_train_step(harness.TrainConfig(), None, None, None, shard_states="zero2")


def test_mesh_predictor_adds_sharded_folds_and_collectives():
  m = planner.Measurement(device_bytes=0, host_bytes=0, param_bytes=8, state_bytes=16, flops=0.0,
                          bytes_accessed=0.0, compile_s=0.0, link_bytes=300.0, state_shards=8)
  machine = planner.Machine(peak_flops=1.0, memory_bandwidth=1.0, host_bandwidth=1.0,
                            interconnect_bandwidth=100.0)
  # Two folds of one device's eighth of P + 2 S (40 / 8), and 300 bytes at 100 B/s.
  assert m.predicted_parts(machine, 2) == {"compute": 0.0, "folds": 10.0, "host": 0.0,
                                           "collectives": 3.0}
  assert m.predicted_s(machine, 2) == 13.0


def test_plan_devices_in_a_process_without_them_is_a_one_line_error(monkeypatch, capsys):
  if max(len(jax.devices()), len(jax.devices("cpu"))) >= MESH_DEVICES:
    pytest.skip("this process has 8 devices")
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after
  with pytest.raises(SystemExit) as exit_info:
    plan.main(["--preset", "llama_test", "--budget-gb", "1", "--devices", "8",
               "--batch-size", "8"])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--devices 8 needs 8 devices" in error and "XLA_FLAGS=" in error


def _command_error(capsys, argv) -> str:
  """The one line `python -m models.plan` prints for a user error, after its exit 2."""
  with pytest.raises(SystemExit) as exit_info:
    plan.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  lines = err.strip().splitlines()
  assert lines[-1].startswith("python -m models.plan: error: "), err
  return lines[-1]


def test_plan_command_user_errors_are_one_line_naming_the_flag(monkeypatch, capsys):
  # Nothing fits: the synthetic steps (no compiles) under 1 MB.
  monkeypatch.setattr(planner, "cached_measure", lambda *args, **kwargs: SyntheticSteps())
  monkeypatch.setattr(planner, "ACTIVATION_SETTINGS", SETTINGS)
  base = ["--preset", "gpt_test", "--batch-size", "16", "--seq-len", "16"]
  error = _command_error(capsys, [*base, "--budget-gb", "0.001"])
  assert "error: --budget-gb 0.001: nothing fits 0.001 GB for gpt_test" in error, error
  assert "Raise the budget" in error and "smallest step measured" in error, error
  error = _command_error(capsys, ["--preset", "gpt9000", "--budget-gb", "1"])
  assert "argument --preset: invalid choice: 'gpt9000' (choose from" in error, error
  for flag, value in (("--budget-gb", "0"), ("--batch-size", "-4"), ("--seq-len", "0")):
    argv = [*base, "--budget-gb", "1"] + [flag, value]
    error = _command_error(capsys, argv)
    assert f"error: {flag} must be positive, got {float(value):g}: pass e.g. {flag} " in error
  error = _command_error(capsys, [*base, "--budget-gb", "a lot"])
  assert "argument --budget-gb: invalid float value: 'a lot'" in error


# On 8 CPU devices, compiled: one subprocess (this file run as a script).
# llama_test (1 layer scanned), 8 sequences of 32 tokens (N = 1: a row a
# device), the release with float32 moments: four compiles of some 8 s here.


def _mesh_worker() -> dict:
  out = {}
  kwargs = {"batch_size": MESH_DEVICES, "seq_len": 32}
  measure_fn = planner.cached_measure("llama_test", devices=MESH_DEVICES, **kwargs)
  settings = {"devices": MESH_DEVICES, "activation_settings": ((planner.RELEASE, None),),
              "moment_storages": ("float32",), "loss_chunks": (1,), "measure_fn": measure_fn}
  with jax.numpy_dtype_promotion("standard"):  # models.train's schedule: float ** int32
    bytes_of = {stage: measure_fn(planner.Candidate(1, planner.RELEASE, shard_states=stage))
                .device_bytes for stage in ("zero2", "fsdp")}
    # Between FSDP's step and ZeRO-2's: only FSDP fits (ZeRO-1 keeps more).
    budget = (bytes_of["fsdp"] + bytes_of["zero2"]) / 2
    result = planner.plan("llama_test", budget, **kwargs, **settings)
    out["budget"], out["bytes_of"] = budget, bytes_of
    out["choice"] = dataclasses.asdict(result.choice)
    out["verified"] = dataclasses.asdict(result.verified)
    chosen = next(r for r in result.considered if r.candidate == result.choice)
    out["chosen_bytes"] = chosen.measurement.device_bytes
    out["rows"] = [(r.candidate.shard_states, r.measurement.device_bytes, r.fits)
                   for r in result.considered]
    out["skipped"] = [dataclasses.asdict(s) for s in result.skipped]
    out["table"] = result.table()
    out["parts"] = result.verified.predicted_parts(planner.Machine(), 1)
    try:
      planner.plan("llama_test", 0.9 * min(bytes_of.values()), **kwargs, **settings)
    except ValueError as error:
      out["nothing_fits"] = str(error)
    # The loss in chunks on the mesh steps that run it inside shard_map.
    out["chunked_traces"] = {}
    for stage, remat in (("zero2", "full"), ("fsdp", planner.RELEASE)):
      run = planner.train_config("llama_test", planner.Candidate(1, remat, loss_chunks=4),
                                 **kwargs)
      model = models.create_abstract(harness.model_config_of(run))
      loss_fn, params = models.split_loss_fn(model, has_aux=True)
      tx = harness.make_optimizer(run)
      mesh = planner.device_mesh(MESH_DEVICES)
      step = harness.make_train_step(run, model, loss_fn, tx, mesh=mesh, shard_states=stage)
      batch = harness.abstract_batch(harness.model_config_of(run), MESH_DEVICES, 32)
      try:
        step.lower(params, jax.eval_shape(tx.init, params), batch)
        traced = True
      except TypeError as error:
        traced = "manual axis types do not match" not in str(error)
      out["chunked_traces"][f"{stage}/{remat}"] = traced
  return out


@pytest.fixture(scope="module")
def eight_device_plan():
  env = dict(os.environ, XLA_FLAGS=xla_flags(MESH_DEVICES), JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"),
                                       env.get("PYTHONPATH", "")])
  result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_mesh_plan_picks_the_only_stage_that_fits_and_verifies_its_bytes(eight_device_plan):
  run = eight_device_plan
  assert run["choice"]["shard_states"] == "fsdp", run["rows"]
  assert run["verified"]["device_bytes"] == run["chosen_bytes"] <= run["budget"]
  assert all(not fits for stage, _, fits in run["rows"] if stage != "fsdp"), run["rows"]
  # Data parallel keeps params and float32 moments whole: over the budget, not compiled.
  assert [(s["shard_states"], s["moments"]) for s in run["skipped"]] == [(None, "float32")]
  assert None not in {stage for stage, _, _ in run["rows"]}
  assert "stage=fsdp **(chosen)**" in run["table"] and "skipped, not compiled" in run["table"]
  # FSDP gathers each layer and reduce-scatters its gradient: collectives in the time.
  assert run["verified"]["link_bytes"] > run["verified"]["param_bytes"] > 0
  assert run["parts"]["collectives"] > 0 and run["verified"]["state_shards"] == MESH_DEVICES


def test_mesh_plan_nothing_fits_names_the_smallest_step(eight_device_plan):
  smallest = min(eight_device_plan["bytes_of"].values())
  message = eight_device_plan["nothing_fits"]
  assert "on 8 devices: the smallest step measured is N=1 release" in message, message
  assert "stage=fsdp" in message and f"{smallest / 1e9:.3g} GB" in message, message


def test_the_chunked_loss_traces_on_every_mesh_step(eight_device_plan):
  # Its scan's carry starts from zeros of the features, which vary over the
  # devices inside shard_map as the chunk sums do (a constant carry was refused).
  assert eight_device_plan["chunked_traces"], eight_device_plan
  for key, traced in eight_device_plan["chunked_traces"].items():
    assert traced, key


@pytest.mark.slow
def test_plan_command_makes_its_devices_and_writes_the_mesh_plan(tmp_path):
  """`python -m models.plan --devices 8` in a process whose flags name no device
  count: it makes 8 CPU devices and searches the four stages (some 13 compiles)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
  paths = tmp_path / "plan.json", tmp_path / "plan.md"
  # 10 MB a device: every stage fits at N = 1 (the 1-layer step is ~2-4 MB).
  result = subprocess.run(
      [sys.executable, "-m", "models.plan", "--preset", "llama_test", "--budget-gb", "0.01",
       "--devices", "8", "--batch-size", "8", "--seq-len", "32", "--json", str(paths[0]),
       "--markdown", str(paths[1])],
      env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  written = json.loads(paths[0].read_text())
  assert "data parallel on 8 cpu devices" in written["header"]
  chosen = written["plan"]
  assert chosen["devices"] == 8 and chosen["verified"]["device_bytes"] <= 0.01e9
  stages = {row["candidate"]["shard_states"] for row in chosen["considered"]}
  assert stages == set(planner.SHARD_STAGES) and not chosen["skipped"]
  assert "run with: harness.make_train_step" in paths[1].read_text()


if __name__ == "__main__":
  print(json.dumps(_mesh_worker(), default=str))
