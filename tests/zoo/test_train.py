"""The training CLI end to end, on a few steps of each model's test preset."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import models
import optax_adama
from models import harness
from models import train


@pytest.fixture(autouse=True)
def _standard_promotion():
  # optax's schedules and adamw (the baselines) rely on implicit promotion.
  with jax.numpy_dtype_promotion("standard"):
    yield


# BERT's run checks the metrics file in the default suite. GPT goes through
# this CLI in the tests below (its loss chunks, the release, 8-bit moments,
# --compare) and ViT through models.harness in tests/zoo/test_validate.py; their
# runs here are slow tests.
@pytest.mark.parametrize("model", [
    pytest.param("gpt", marks=pytest.mark.slow), "bert",
    pytest.param("vit", marks=pytest.mark.slow)])
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
  assert run["memory"]["total_p"] > 3.0  # params + m + v at least
  assert run["num_dropped"] == 0


def test_compare_runs_adama_and_accumulation_on_the_same_data(tmp_path, capsys):
  out = tmp_path / "compare.json"
  runs = train.main([
      "--preset", "gpt_test", "--compare", "--num-micro-batches", "4",
      "--batch-size", "8", "--seq-len", "16", "--steps", "3",
      "--eval-batches", "2", "--max-bytes", "200000", "--metrics-out", str(out),
      "--nu-estimator", "momentum", "--accumulation-dtype", "bfloat16", "--no-progress",
  ])
  assert [r["config"]["optimizer"] for r in runs] == ["adama", "adam"]
  # Each side takes the options that are its own and keeps the other's defaults.
  assert [r["config"]["nu_estimator"] for r in runs] == ["momentum", "mean"]
  assert [r["config"]["accumulation_dtype"] for r in runs] == [None, "bfloat16"]
  # Same init and data: the first step's loss is computed before any update.
  assert runs[0]["train_loss"][0] == pytest.approx(runs[1]["train_loss"][0], rel=1e-6)
  assert runs[1]["memory"]["total_bytes"] > runs[0]["memory"]["total_bytes"]
  assert "| adama | 4 |" in capsys.readouterr().out
  assert len(json.loads(out.read_text())["runs"]) == 2


def test_an_adama_only_option_without_compare_is_still_an_error(capsys):
  with pytest.raises(SystemExit, match="2"):
    train.main(["--optimizer", "adam", "--nu-estimator", "momentum", "--steps", "1"])
  assert "--nu-estimator momentum needs --optimizer adama" in capsys.readouterr().err


def test_vit_mini_batch_larger_than_the_held_out_split_is_scored_on_all_of_it():
  # 359 held-out digits: a 512-image mini-batch is scored on one batch of all
  # 359, a 128-image one on two full batches as before (the study's cells).
  config = harness.TrainConfig(model="vit", batch_size=512, num_micro_batches=4)
  _, held_out = harness.make_data(config, harness.model_config_of(config))
  assert [b["labels"].shape[0] for b in held_out] == [359]
  config = harness.TrainConfig(model="vit", batch_size=128, num_micro_batches=4)
  _, held_out = harness.make_data(config, harness.model_config_of(config))
  assert [b["labels"].shape[0] for b in held_out] == [128, 128]


def test_bad_config_is_rejected_with_both_numbers():
  with pytest.raises(ValueError, match=r"batch size 10 .*num_micro_batches=4"):
    harness.TrainConfig(batch_size=10, num_micro_batches=4)
  with pytest.raises(ValueError, match="optimizer"):
    harness.TrainConfig(optimizer="sgd")


def test_schedule_warms_up_then_decays_to_a_tenth():
  schedule = harness.warmup_cosine_schedule(1.0, steps=100, warmup_steps=10)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(0.5)
  assert float(schedule(10)) == pytest.approx(1.0)
  assert float(schedule(55)) == pytest.approx(0.55)  # half-way down the cosine
  assert float(schedule(100)) == pytest.approx(0.1)
  # A warm-up longer than half the run is cut to half the run.
  short = harness.warmup_cosine_schedule(1.0, steps=10, warmup_steps=20)
  assert float(short(5)) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="-1"):
    harness.warmup_cosine_schedule(1.0, steps=10, warmup_steps=-1)


def _moment_bytes(config):
  """(P, bytes of the optimizer state) of `config`'s optimizer on gpt_test."""
  params = models.split_loss_fn(models.create("gpt_test", rngs=nnx.Rngs(0)))[1]
  state = jax.eval_shape(harness.make_optimizer(config).init, params)
  return optax_adama.memory.tree_bytes(params), optax_adama.memory.tree_bytes(state)


@pytest.mark.parametrize("optimizer", ["adama", "adam", "multisteps"])
def test_bfloat16_first_moment_halves_its_bytes(optimizer):
  P, float32 = _moment_bytes(harness.TrainConfig(optimizer=optimizer))
  _, narrow = _moment_bytes(harness.TrainConfig(optimizer=optimizer, mu_dtype="bfloat16"))
  assert float32 - narrow == P // 2  # m: 4 bytes a parameter -> 2
  if optimizer == "adama":
    _, both = _moment_bytes(harness.TrainConfig(mu_dtype="bfloat16", nu_dtype="bfloat16"))
    assert float32 - both == P


def test_quantized_moments_from_the_cli(tmp_path):
  out = tmp_path / "run.json"
  train.main([
      "--preset", "gpt_test", "--quantize-moments", "--mu-dtype", "bfloat16",
      "--num-micro-batches", "2", "--batch-size", "4", "--seq-len", "16", "--steps", "2",
      "--eval-batches", "1", "--max-bytes", "200000", "--metrics-out", str(out),
      "--no-progress",
  ])
  run = json.loads(out.read_text())
  assert run["config"]["quantize_moments"] and run["config"]["mu_dtype"] == "bfloat16"
  assert np.all(np.isfinite(run["train_loss"]))
  # Params (1 P) + 8-bit m and v (about P / 2) + the batch: well under the
  # 3 P of float32 moments.
  assert run["memory"]["argument_p"] < 1.7
  P, state = _moment_bytes(harness.TrainConfig(quantize_moments=True))
  assert state < 0.6 * P


def test_moment_options_are_checked_and_quote_the_bad_value():
  with pytest.raises(ValueError, match="'float8'"):
    harness.TrainConfig(mu_dtype="float8")
  with pytest.raises(ValueError, match="nu_dtype.*'bf16'"):
    harness.TrainConfig(nu_dtype="bf16")
  with pytest.raises(ValueError, match="quantize_moments.*'adam'"):
    harness.TrainConfig(optimizer="adam", quantize_moments=True)
  with pytest.raises(ValueError, match="nu_dtype='bfloat16'.*'multisteps'"):
    harness.TrainConfig(optimizer="multisteps", nu_dtype="bfloat16")


# The scanned fused step's run, shared: the whole-logits side of the loss
# chunks' test and the fused side of the release's (one training run and its
# compiles less; both tests on one xdist worker under --dist loadgroup).
SCANNED_GPT_ARGS = [
    "--model", "gpt", "--preset", "gpt_test", "--optimizer", "adama",
    "--num-micro-batches", "4", "--batch-size", "8", "--seq-len", "16",
    "--steps", "3", "--eval-batches", "2", "--max-bytes", "200000", "--scan-layers"]


def _scanned_gpt_run(directory, *extra):
  out = directory / f"run{'_'.join(a.strip('-') for a in extra)}.json"
  train.main([*SCANNED_GPT_ARGS, *extra, "--metrics-out", str(out), "--no-progress"])
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fused_scanned_run(tmp_path_factory):
  with jax.numpy_dtype_promotion("standard"):  # before the autouse fixture above
    return _scanned_gpt_run(tmp_path_factory.mktemp("fused_scanned"))


@pytest.mark.xdist_group("train_fused_scanned")
def test_loss_chunks_train_gpt_as_the_whole_logits_do(fused_scanned_run, tmp_path):
  chunked = _scanned_gpt_run(tmp_path, "--loss-chunks", "4")
  # The same sums in another order; three steps of lr 1e-3-scale updates.
  np.testing.assert_allclose(chunked["train_loss"], fused_scanned_run["train_loss"], rtol=1e-5)
  assert (chunked["config"]["loss_chunks"], fused_scanned_run["config"]["loss_chunks"]) == (4, 1)
  with pytest.raises(ValueError, match="loss_chunks is a causal LM's"):
    harness.train(harness.TrainConfig(model="bert", loss_chunks=2))


@pytest.mark.xdist_group("train_fused_scanned")
def test_release_trains_as_the_fused_scanned_step(fused_scanned_run, tmp_path):
  """`--release` (release_step) against `microbatch_step` on the same scanned model."""
  runs = [fused_scanned_run, _scanned_gpt_run(tmp_path, "--release")]
  assert [r["config"]["release"] for r in runs] == [False, True]
  # The same folds in another order (per layer in the backward scan instead of
  # per leaf after it): float32 rounding over three steps.
  np.testing.assert_allclose(runs[1]["train_loss"], runs[0]["train_loss"], rtol=1e-5)
  np.testing.assert_allclose(runs[1]["eval_loss"], runs[0]["eval_loss"], rtol=1e-5)
  # --compare: AdamA through the release against Adam's microbatch_step.
  options = {"scan_layers": True, "release": True}
  assert train.config_for(options, "adama").release
  assert not train.config_for(options, "adam").release
  for bad in ({"optimizer": "adam", "scan_layers": True}, {"scan_layers": False}):
    with pytest.raises(ValueError, match="release .* needs scan_layers=True and optimizer"):
      harness.TrainConfig(release=True, **bad)


@pytest.mark.xdist_group("train_fused_scanned")
def test_release_with_the_clip_trains_as_the_fused_step_with_it(tmp_path):
  """`--release --clip-norm`: release_step folds the sketched clip as microbatch_step does."""
  clip = ("--clip-norm", "0.05")  # under the first mini-batch's norm: the clip acts
  runs = [_scanned_gpt_run(tmp_path, *clip), _scanned_gpt_run(tmp_path, "--release", *clip)]
  assert [(r["config"]["release"], r["config"]["clip_norm"]) for r in runs] == [
      (False, 0.05), (True, 0.05)]
  np.testing.assert_allclose(runs[1]["train_loss"], runs[0]["train_loss"], rtol=1e-5)
  np.testing.assert_allclose(runs[1]["eval_loss"], runs[0]["eval_loss"], rtol=1e-5)


def test_split_floor_option_reaches_adama_and_is_refused_for_adam():
  config = harness.TrainConfig(optimizer="adama", nu_estimator="auto", split_floor=False)
  state = harness.make_optimizer(config).init({"w": jax.numpy.zeros((4, 4))})
  assert optax_adama.find_adama_state(state).nu_floor == ()  # no floor kept
  floored = harness.make_optimizer(harness.TrainConfig(optimizer="adama", nu_estimator="auto"))
  assert optax_adama.find_adama_state(floored.init({"w": jax.numpy.zeros((4, 4))})).nu_floor != ()
  with pytest.raises(ValueError, match="split_floor=False needs optimizer='adama'"):
    harness.TrainConfig(optimizer="adam", split_floor=False)


def test_bfloat16_params_from_the_cli_train_with_stochastic_rounding(tmp_path):
  out = tmp_path / "run.json"
  runs = train.main([
      "--preset", "gpt_test", "--param-dtype", "bfloat16", "--mu-dtype", "float32",
      "--nu-dtype", "float32", "--num-micro-batches", "2", "--batch-size", "4",
      "--seq-len", "16", "--steps", "3", "--eval-batches", "1", "--max-bytes", "200000",
      "--metrics-out", str(out), "--no-progress", "--compare",
  ])
  assert [r["config"]["param_dtype"] for r in runs] == ["bfloat16", "bfloat16"]
  for run in runs:
    assert np.all(np.isfinite(run["train_loss"])) and np.isfinite(run["eval_loss"])
  # P is the bfloat16 params' bytes here: float32 m and v are 2 P each, so the
  # arguments are 5 P and the batch.
  assert 5.0 <= runs[0]["memory"]["argument_p"] < 5.3


@pytest.mark.parametrize("optimizer", ["adama", "adam", "multisteps"])
def test_bfloat16_params_chain_stochastic_rounding_last_unless_asked_to_round_to_nearest(
    optimizer):
  params = models.split_loss_fn(models.create(
      models.get_config("gpt_test", param_dtype=jax.numpy.bfloat16), rngs=nnx.Rngs(0)))[1]
  for rounding, rounds in (("stochastic", True), ("nearest", False)):
    config = harness.TrainConfig(optimizer=optimizer, param_dtype="bfloat16",
                                 param_rounding=rounding, mu_dtype="float32")
    state = harness.make_optimizer(config).init(params)
    found = [s for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax_adama.contrib.RoundParamsStochasticallyState))
        if isinstance(s, optax_adama.contrib.RoundParamsStochasticallyState)]
    assert len(found) == rounds, (optimizer, rounding)
  # float32 params: nothing to round.
  assert harness.param_rounding(harness.TrainConfig(param_rounding="stochastic")) is None
  with pytest.raises(ValueError, match="param_dtype must be one of"):
    harness.TrainConfig(param_dtype="float16")
  with pytest.raises(ValueError, match="param_rounding must be one of"):
    harness.TrainConfig(param_rounding="up")
