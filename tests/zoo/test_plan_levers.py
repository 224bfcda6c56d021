"""Tests for the zoo's planner, `models/planner.py` and `models/plan.py`.

The zoo gives `optax_adama.memory.plan` (tested in tests/library/test_plan.py: the
search, the time predictor, `ModelLevers`) its levers: remat policies, savers
and the loss in chunks (`PresetLevers`). Here: the levers map onto
`models.train`'s flags and its step; the compile-only measurements on the
1-layer and 2-layer presets complete the layer and chunk scans; the whole
planner on gpt_test with a budget between its smallest and largest step
(slow); the commands' paths and their one-line errors. On a mesh: llama_test
compiled on 8 CPU devices in a subprocess (this file run as a script), under a
budget only FSDP meets.
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
from conftest import run_on_devices
from conftest import xla_flags

import models
import optax_adama
from models import harness
from models import plan
from models import planner
from models import train
from optax_adama import _measure

MACHINE = optax_adama.memory.Machine(peak_flops=1.0, memory_bandwidth=1e12, host_bandwidth=1.0)
MESH_DEVICES = 8
step_settings = planner.step_settings


@pytest.fixture(autouse=True)
def _standard_promotion():
  # The plan compiles models.train's optimizer, whose optax schedule relies on
  # implicit promotion (float ** int32).
  with jax.numpy_dtype_promotion("standard"):
    yield


def test_settings_are_models_train_flags_and_back():
  settings = step_settings(4, "none", 2, "8bit", loss_chunks=8)
  config = planner.train_config("gpt_test", settings, batch_size=8, seq_len=16)
  assert (config.num_micro_batches, config.remat, config.gelu_bits, config.quantize_moments,
          config.scan_layers, config.loss_chunks, config.release) == (
              4, "none", 2, True, True, 8, False)
  assert planner.train_config("gpt_test", dataclasses.replace(settings, moments="bfloat16"),
                              batch_size=8, seq_len=16).nu_dtype == "bfloat16"
  released = step_settings(2, planner.RELEASE)
  config = planner.train_config("gpt_test", released, batch_size=8, seq_len=16)
  assert (config.release, config.remat, config.scan_layers) == (True, "none", True)
  assert released.release and released.model == planner.ModelVariant(remat=None)
  for one in (settings, released, step_settings(1, "full", shard_states="fsdp")):
    assert step_settings(**planner.flags_of(one)) == one
  assert planner.label(step_settings(2, "none", 4, loss_chunks=8)) == (
      "none + gelu 4-bit + loss in 8 chunks")


def test_the_levers_are_the_activation_settings_then_the_loss_chunks():
  levers = planner.PresetLevers("gpt_test", batch_size=16, seq_len=16,
                                activation_settings=(("full", None), (planner.RELEASE, None)))
  assert levers.activations() == [(planner.ModelVariant("full"), False),
                                  (planner.ModelVariant(None), True)]
  assert [v.loss_chunks for v in levers.exact(planner.ModelVariant("full"))] == [
      1, planner.LOSS_CHUNKS]
  assert levers.offloads(planner.ModelVariant("offload"))
  assert not levers.offloads(planner.ModelVariant("minimal"))
  assert planner.default_loss_chunks("gpt_test", None) == (1, planner.LOSS_CHUNKS)
  assert planner.default_loss_chunks("gpt_test", 30) == (1,)  # 8 does not divide 30
  assert planner.default_loss_chunks("bert_test", None) == (1,)


def test_measure_matches_memory_report_and_counts_every_layer():
  """gpt_tiny (2 layers): device bytes are memory_report's; flops cover both layers."""
  settings = step_settings(2, "none")
  measurement = planner.measure("gpt_tiny", settings, batch_size=4, seq_len=32)
  config = models.get_config("gpt_tiny", scan_layers=True)
  assert measurement.host_bytes == 0  # nothing is offloaded without "offload"
  assert measurement.param_bytes == optax_adama.memory.tree_bytes(harness.split_model(config)[1])
  # The step models.train runs for the setting, compiled: the same bytes.
  run = planner.train_config("gpt_tiny", settings, batch_size=4, seq_len=32)
  model = models.create_abstract(harness.model_config_of(run))
  loss_fn, params = models.split_loss_fn(model, has_aux=True)
  tx = harness.make_optimizer(run)
  step = harness.make_train_step(run, model, loss_fn, tx)
  batch = harness.abstract_batch(harness.model_config_of(run), 4, 32)
  report = optax_adama.memory_report(step, params, jax.eval_shape(tx.init, params), batch)
  assert report.total_bytes == measurement.device_bytes
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
  flops = lambda s: planner.measure("gpt_test", s, batch_size=4, seq_len=16).flops
  if saver == "loss_chunks":
    head_forward = 2 * (2 * 16) * config.vocab_size * config.hidden  # per micro-batch
    extra = flops(step_settings(2, loss_chunks=4)) - flops(step_settings(2))
    # Uncompleted, the chunk scans would count a quarter of the head: -3/4 of it.
    assert extra == pytest.approx(2 * head_forward, rel=0.1)
  else:
    released = flops(step_settings(2, planner.RELEASE))
    full = flops(step_settings(2, "full"))
    assert released == pytest.approx(full, rel=0.05)


@pytest.mark.slow
def test_plan_on_gpt_test_fits_and_beats_remat_alone():
  sizes = {(remat, n): planner.measure("gpt_test", step_settings(n, remat), batch_size=2,
                                       seq_len=16)
           for remat, n in itertools.product(("none", "full"), (1, 2))}
  budget = (min(m.device_bytes for m in sizes.values())
            + max(m.device_bytes for m in sizes.values())) / 2
  result = planner.plan("gpt_test", budget, batch_size=2, seq_len=16, machine=MACHINE,
                        activation_settings=(("none", None), ("none", 2), ("full", None)),
                        moment_storages=("float32",))
  assert result.measurement.device_bytes <= budget
  assert result.predicted_s <= min(m.predicted_s(MACHINE, n) for (_, n), m in sizes.items()
                                   if m.device_bytes <= budget)
  assert jax.default_backend() != "cpu" or result.measurement.host_bytes == 0


def _steps_of_a_gigabyte(self, settings):
  """Every candidate's step at 1 GB, no compile (monkeypatched over the measuring)."""
  return optax_adama.memory.Measurement(device_bytes=10**9, host_bytes=0, param_bytes=10**6,
                                        state_bytes=0, flops=1.0, bytes_accessed=0.0,
                                        compile_s=0.0)


def test_train_plan_flag_takes_the_plans_settings(monkeypatch, capsys):
  chosen = step_settings(4, "dots", moments="bfloat16", loss_chunks=8)
  measurement = _steps_of_a_gigabyte(None, chosen)
  considered = optax_adama.memory.Considered(chosen, measurement, 1.0, True)
  planned = optax_adama.memory.Plan(chosen, 10**9, 1.0, 2 * 10**9, measurement, (considered,),
                                    (), (), planner.PresetLevers("gpt_test", batch_size=16))
  calls = []

  def fake_plan(preset, budget_bytes, **kwargs):
    calls.append((preset, budget_bytes, kwargs["batch_size"], kwargs["seq_len"]))
    return planned

  monkeypatch.setattr(planner, "plan", fake_plan)
  config = harness.TrainConfig(model="gpt", preset="gpt_test", batch_size=16, seq_len=16)
  overrides = train._planned(config, 2.0, progress=False)
  assert calls == [("gpt_test", 2.0 * 1e9, 16, 16)]
  run = dataclasses.replace(config, **overrides)
  assert (run.num_micro_batches, run.remat, run.loss_chunks, run.nu_dtype, run.scan_layers) == (
      4, "dots", 8, "bfloat16", True)
  printed = capsys.readouterr().out
  assert "| N=4 remat=dots savers=loss in 8 chunks moments=bfloat16 **(chosen)** | 1 GB" in printed
  assert "plan: N=4 remat=dots savers=loss in 8 chunks moments=bfloat16, verified 1.000 GB" in (
      printed)


def test_plot_frontier_writes_a_png(tmp_path):
  memory_p = {"none": 10.5, "none + gelu 4-bit": 9.1, "full": 5.4}
  step_s = {"none": 0.51, "none + gelu 4-bit": 0.48, "full": 0.46}
  path = tmp_path / "frontier.png"
  plan.plot_frontier(memory_p, step_s, path, "test")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_settings_times_the_step_models_train_runs_for_each_setting():
  candidates = (step_settings(2, "none"), step_settings(2, planner.RELEASE, loss_chunks=2))
  times = plan.time_settings("gpt_test", candidates, batch_size=4, seq_len=16, rounds=1,
                             steps_per_round=1)
  assert set(times) == {"none", "release + loss in 2 chunks"}
  assert all(seconds > 0 for seconds in times.values())


def test_survey_candidates_cover_every_saver_and_reach_train():
  candidates = plan.survey_candidates(4)
  labels = [planner.label(c) for c in candidates]
  assert len(set(labels)) == len(labels)
  assert {"none + gelu 2-bit", "full + loss in 8 chunks", "release + loss in 8 chunks",
          "none + sampled dW 0.5"} <= set(labels)
  assert set(labels) >= {r for r, _ in planner.ACTIVATION_SETTINGS}
  sampled = planner.train_config("gpt_test", candidates[-1], batch_size=8, seq_len=16)
  assert sampled.linear_keep_ratio == 0.5 and sampled.num_micro_batches == 4


def test_survey_measures_what_the_savers_save():
  """The chunked loss keeps less than the whole logits (gpt_test: 256-token vocab)."""
  candidates = [step_settings(1, "full"), step_settings(1, "full", loss_chunks=4)]
  whole, chunked = plan.survey("gpt_test", candidates, batch_size=4, seq_len=32)
  assert chunked.measurement.device_bytes < whole.measurement.device_bytes
  assert chunked.predicted_s > 0 and chunked.candidate == candidates[1]


def test_plan_refuses_what_its_devices_cannot_run():
  with pytest.raises(ValueError, match="batch_size=12 does not give each of 8 devices"):
    planner.plan("llama_test", 1e9, batch_size=12, devices=8)
  with pytest.raises(ValueError, match="shard_states 'fsdp' is not a stage of 1 device"):
    planner.plan("llama_test", 1e9, batch_size=8, shard_stages=("fsdp",))
  levers = planner.PresetLevers("llama_test", batch_size=32, devices=8)
  skipped = [optax_adama.memory.Skipped("zero1", None, 2 * 10**6),
             optax_adama.memory.Skipped("zero2", None, 3 * 10**6)]
  assert levers.nothing_fits_message((), skipped, 1e6) == (
      "nothing fits 0.001 GB for llama_test on 8 devices: every stage keeps more whole on each "
      "device, the least stage=zero1 moments=any, every N and remat: params whole on every "
      "device (0.002 GB). Raise the budget or add shard_states='fsdp'.")


def test_the_stage_reaches_make_train_step_and_not_train_config():
  settings = step_settings(2, planner.RELEASE, shard_states="fsdp")
  assert planner.train_overrides(settings)["shard_states"] == "fsdp"
  assert planner.train_overrides(step_settings(2))["shard_states"] is None  # data parallel
  assert planner.train_config("llama_test", settings, batch_size=16, seq_len=16).release
  assert settings.describe().endswith("stage=fsdp")
  assert step_settings(2).describe(on_mesh=True).endswith("stage=dp")
  assert step_settings(2).describe() == "N=2 remat=none savers=- moments=float32"
  with pytest.raises(ValueError, match="shard_states='zero2' splits state over a mesh"):
    harness.make_train_step(harness.TrainConfig(), None, None, None, shard_states="zero2")


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
  # Nothing fits: every step at 1 GB (no compiles) under 1 MB; N = 16 compiled first.
  monkeypatch.setattr(_measure.Candidates, "measure", _steps_of_a_gigabyte)
  monkeypatch.setattr(planner, "ACTIVATION_SETTINGS", (("full", None),))
  base = ["--preset", "gpt_test", "--batch-size", "16", "--seq-len", "16"]
  error = _command_error(capsys, [*base, "--budget-gb", "0.001"])
  assert ("error: --budget-gb 0.001: nothing fits 0.001 GB for gpt_test at batch 16: the "
          "smallest step measured is N=16 remat=full savers=- moments=float32 at 1 GB. Raise the "
          "budget or the batch's divisibility") in error, error
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
# device), the release with float32 moments: seven compiles of some 8 s here.
def _mesh_worker() -> dict:
  out = {}
  kwargs = {"batch_size": MESH_DEVICES, "seq_len": 32}
  settings = {"devices": MESH_DEVICES, "activation_settings": ((planner.RELEASE, None),),
              "moment_storages": ("float32",), "loss_chunks": (1,)}
  with jax.numpy_dtype_promotion("standard"):  # models.train's schedule: float ** int32
    bytes_of = {stage: planner.measure("llama_test", step_settings(1, planner.RELEASE,
                                                                   shard_states=stage),
                                       devices=MESH_DEVICES, **kwargs).device_bytes
                for stage in ("zero2", "fsdp")}
    # Between FSDP's step and ZeRO-2's: only FSDP fits (ZeRO-1 keeps more).
    budget = (bytes_of["fsdp"] + bytes_of["zero2"]) / 2
    result = planner.plan("llama_test", budget, **kwargs, **settings)
    out["budget"], out["bytes_of"] = budget, bytes_of
    out["plan"] = planner.plan_dict(result, preset="llama_test", **kwargs)
    out["table"] = planner.table(result)
    out["parts"] = result.measurement.predicted_parts(optax_adama.memory.Machine(), 1)
    try:
      planner.plan("llama_test", 0.9 * min(bytes_of.values()), **kwargs, **settings,
                   shard_stages=("fsdp",))
    except ValueError as error:
      out["nothing_fits"] = str(error)
    # The loss in chunks on the mesh steps that run it inside shard_map.
    out["chunked_traces"] = {}
    for stage, remat in (("zero2", "full"), ("fsdp", planner.RELEASE)):
      run = planner.train_config("llama_test", step_settings(1, remat, loss_chunks=4), **kwargs)
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
  return run_on_devices(__file__)


def test_mesh_plan_picks_the_only_stage_that_fits_and_verifies_its_bytes(eight_device_plan):
  run, chosen = eight_device_plan, eight_device_plan["plan"]
  rows = [(r["candidate"]["shard_states"], r["measurement"]["device_bytes"], r["fits"])
          for r in chosen["considered"]]
  assert chosen["choice"]["shard_states"] == "fsdp", rows
  assert chosen["devices"] == MESH_DEVICES
  assert chosen["verified"]["device_bytes"] == run["bytes_of"]["fsdp"] <= run["budget"]
  assert all(not fits for stage, _, fits in rows if stage != "fsdp"), rows
  # Data parallel keeps params and float32 moments whole: over the budget, not compiled.
  assert [(s["shard_states"], s["moments"]) for s in chosen["skipped"]] == [(None, "float32")]
  assert None not in {stage for stage, _, _ in rows}
  assert "stage=fsdp **(chosen)**" in run["table"] and "skipped, not compiled" in run["table"]
  # FSDP gathers each layer and reduce-scatters its gradient: collectives in the time.
  verified = chosen["verified"]
  assert verified["link_bytes"] > verified["param_bytes"] > 0
  assert run["parts"]["collectives"] > 0 and verified["state_shards"] == MESH_DEVICES


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
  assert stages == {None, "zero1", "zero2", "fsdp"} and not chosen["skipped"]
  # The plan's last word is a models.train command that trains it on the mesh.
  line = next(x for x in paths[1].read_text().splitlines() if x.startswith("train with: "))
  command = line.removeprefix("train with: python -m models.train ").split(" (")[0].split()
  run = train.train_config(command)
  assert (run.mesh_devices, run.shard_states) == (8, chosen["choice"]["shard_states"])
  assert run.num_micro_batches == chosen["choice"]["num_micro_batches"]


if __name__ == "__main__":
  print(json.dumps(_mesh_worker(), default=str))
