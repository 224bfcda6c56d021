"""Smoke versions of the benchmarks, so the benchmark code never rots."""

import json

import jax
import pytest
from conftest import load_script
from conftest import xla_flags

import models
import optax_adama
from models import bench
from models import harness
from models.harness import capacity


@pytest.fixture(autouse=True)
def _standard_promotion():
  # The baselines are optax.adam / MultiSteps, which rely on implicit promotion.
  with jax.numpy_dtype_promotion("standard"):
    yield


def test_memory_smoke_adama_below_accumulation(tmp_path):
  out = tmp_path / "memory.json"
  result = bench.main([
      "memory", "--presets", "gpt_test", "--num-micro-batches", "4",
      "--methods", "scan_accumulation", "adama", "--micro-batch-size", "2",
      "--json", str(out), "--plot", str(tmp_path / "memory.png"), "--no-progress",
  ])
  rows = {r["method"]: r for r in result["rows"]}
  P = rows["adama"]["report"]["param_bytes"]
  saved = (rows["scan_accumulation"]["report"]["total_bytes"]
           - rows["adama"]["report"]["total_bytes"])
  # The accumulator is one P; XLA may reuse part of it for activations of
  # this tiny model, but at least half must show.
  assert saved >= 0.5 * P
  assert rows["adama"]["floor"]["total_bytes"] > 3 * P
  assert json.loads(out.read_text())["rows"]
  assert (tmp_path / "memory.png").stat().st_size > 0


def test_memory_and_throughput_take_a_compute_dtype(monkeypatch):
  """``--dtype bfloat16``: bf16 compute on float32 params, as models.train's ``--dtype``."""
  result = bench.main([
      "memory", "--presets", "gpt_test", "--num-micro-batches", "2", "--methods", "adama",
      "--micro-batch-size", "4", "--seq-len", "32", "--dtype", "bfloat16", "--no-progress"])
  (row,) = result["rows"]
  assert row["preset"] == "gpt_test (bfloat16)"
  # As the bf16 model's own config compiles (float32's step has 41% fewer temp
  # bytes); the step alone, not measure_memory's floor beside it (one compile less).
  config = bench.models.get_config("gpt_test", dtype=jax.numpy.bfloat16)
  loss_fn, params = harness.split_model(config)
  step, tx = harness.make_step("adama", loss_fn, num_micro_batches=2, rank=config.hidden // 4)
  by_config = optax_adama.memory_report(step, params, jax.eval_shape(tx.init, params),
                                        harness.abstract_batch(config, 4 * 2, 32))
  assert by_config.to_dict() == row["report"]
  assert row["report"]["param_bytes"] == 4 * models.param_count("gpt_test")  # float32 params
  # throughput hands it to harness.measure_throughput, whose model takes it as
  # memory's does (harness.dtype_override); its interleaved timing is smoked below.
  seen = {}

  def timing(preset, methods, *args, **kwargs):
    seen.update(kwargs)
    return {m: {"median_step_s": 1.0, "tokens_per_s": 1.0} for m in methods}
  monkeypatch.setattr(harness, "measure_throughput", timing)
  bench.main(["throughput", "--presets", "gpt_test", "--methods", "adama", "--dtype",
              "bfloat16", "--no-progress"])
  assert seen["dtype"] == "bfloat16"


def test_throughput_smoke_interleaves_methods():
  result = bench.main([
      "throughput", "--presets", "gpt_test", "--methods", "scan_accumulation", "adama",
      "--num-micro-batches", "2", "--micro-batch-size", "2", "--seq-len", "16",
      "--rounds", "2", "--steps-per-round", "1", "--no-progress",
  ])
  timing = result["presets"]["gpt_test"]
  for method in ("scan_accumulation", "adama"):
    assert len(timing[method]["step_s_all"]) == 2
    assert timing[method]["tokens_per_s"] > 0


# Compile-only, on byte-vocabulary models. The default suite searches 1-2
# layers (4 compiles; at 8.5 MB scan accumulation fits 1 layer, AdamA 2: 9.9
# and 7.5 MB measured); the search over 1-4 layers (P of 1-13 MB), whose
# anchors and gallop cost 8 larger compiles, runs with the slow tests.
@pytest.mark.parametrize("budget_gb, max_scale", [
    (0.0085, 2), pytest.param(0.03, 4, marks=pytest.mark.slow)], ids=["1-2_layers", "1-4_layers"])
def test_capacity_smoke_adama_fits_at_least_as_large(budget_gb, max_scale):
  results = capacity.measure_capacity(
      [budget_gb], ["scan_accumulation", "adama"], num_micro_batches=2,
      micro_batch_size=1, seq_len=16, remat="full", max_scale=max_scale, vocab_size=256,
      progress=False)
  by_method = {r["method"]: r for r in results}
  assert by_method["adama"]["scale"] >= by_method["scan_accumulation"]["scale"] >= 1
  assert by_method["adama"]["total_bytes"] <= budget_gb * 1e9


# 16 s on 2 cores; the capacity search itself is smoke-tested above, the
# release's memory in tests/library/test_release.py and tests/library/test_sharding.py.
@pytest.mark.slow
def test_capacity_smoke_scanned_release_holds_less():
  # Compile-only, one scanned byte-vocabulary model: the release step with
  # layer-aligned 8-bit moments against scan accumulation on the same model
  # (the capacity search itself is tested above on the unrolled one).
  scanned = dict(SMALL_STEP, hidden=128, scan_layers=True)
  accumulation, count = capacity.total_bytes_at(2, "scan_accumulation", **scanned)
  release, _ = capacity.total_bytes_at(2, "adama_release_8bit", **scanned)
  # Measured 2.77 P against 5.16 P: the accumulator, the stacked gradient and
  # 6 of the 8 bytes of m and v a parameter.
  assert accumulation - release > 2.0 * 4 * count, (accumulation, release, count)
  with pytest.raises(ValueError, match="scanned model"):
    capacity.total_bytes_at(1, "adama_release_8bit", **SMALL_STEP)
  # Offloaded, the codes leave the count and the slices in flight (one
  # layer's, the embeddings') come back; nothing else changes.
  offloaded, _ = capacity.total_bytes_at(2, "adama_release_8bit_offload", **scanned)
  config = capacity.gpt_family(2, remat="full", vocab_size=256, hidden=128, scan_layers=True)
  staged, params = harness.split_model(config)
  _, tx = harness.make_step("adama_release_8bit_offload", staged, num_micro_batches=2)
  state = jax.eval_shape(tx.init, params)
  host = optax_adama.moments.host_state_bytes(state)
  in_flight = capacity.release_in_flight_bytes(staged, state)
  assert 0 < in_flight < host
  # Measured 2.59 P against 2.77 P, equal to the sum to within 704 B of
  # scalar temps (0.05% of P): no stack-sized copy appears.
  assert abs(offloaded - (release - host + in_flight)) < 0.01 * 4 * count


def test_fsdp_methods_place_each_layer_split_and_count_one_devices_bytes():
  # A one-device mesh: the FSDP steps compile with their arguments placed as
  # they keep them (the 8-device numbers: benchmarks/scripts/fsdp_memory.py, slow).
  mesh = jax.make_mesh((1,), ("data",))
  scanned = dict(SMALL_STEP, hidden=128, scan_layers=True)
  totals = {method: capacity.total_bytes_at(2, method, mesh=mesh, **scanned)
            for method in harness.FSDP_METHODS}
  count = totals["fsdp_scan_accumulation"][1]
  # 8-bit moments save 6 of their 8 bytes a parameter against float32 ones,
  # and the release drops accumulation's float32 accumulator and stacked gradient.
  assert (totals["fsdp_adama_release"][0] - totals["fsdp_adama_release_8bit"][0]
          > 0.6 * 6 * count), totals
  assert totals["fsdp_scan_accumulation"][0] > totals["fsdp_adama_release"][0], totals
  with pytest.raises(ValueError, match=r"needs a scanned model \(--scan-layers\) and a mesh"):
    capacity.total_bytes_at(1, "fsdp_adama_release_8bit", **SMALL_STEP)


@pytest.mark.parametrize("guess", [None, 1, 4, 5, 6, 13, 20])
@pytest.mark.parametrize("threshold,want", [(0, 0), (1, 1), (5, 5), (12, 12), (99, 20)])
def test_largest_fitting_finds_the_threshold(threshold, want, guess):
  calls = []
  def fits(s):
    calls.append(s)
    return s <= threshold
  assert capacity.largest_fitting(fits, 1, 20, guess=guess) == want
  assert len(calls) <= 2 * 5 + 1  # gallop + bisect, both logarithmic
  if guess is not None and abs(guess - want) <= 1 and 1 <= want < 20:
    assert len(calls) <= 3  # a good guess costs two or three compiles


@pytest.mark.slow
def test_capacity_on_eight_devices_zero2_fits_more(tmp_path):
  """The per-device capacity search on 8 fake CPU devices (its own process)."""
  import os
  import subprocess
  import sys
  out = tmp_path / "capacity.json"
  env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
  subprocess.run(
      [sys.executable, "-m", "models.bench", "capacity", "--devices", "8",
       "--budgets-gb", "0.02", "--methods", "dp_scan_accumulation",
       "zero2_scan_accumulation", "zero2_adama_8bit",
       "--num-micro-batches", "2", "--micro-batch-size", "1", "--seq-len", "32",
       "--max-scale", "5", "--vocab-size", "256", "--json", str(out), "--no-progress"],
      check=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  results = {r["method"]: r for r in json.loads(out.read_text())["capacity"]}
  assert results["zero2_adama_8bit"]["param_count"] > results["dp_scan_accumulation"]["param_count"]
  # A sharded accumulator already fits more than a replicated one; AdamA with
  # 8-bit moments at least as much again.
  assert (results["zero2_scan_accumulation"]["param_count"]
          >= results["dp_scan_accumulation"]["param_count"])
  assert (results["zero2_adama_8bit"]["param_count"]
          >= results["zero2_scan_accumulation"]["param_count"])


def test_refine_width_grows_the_answer_while_it_fits(monkeypatch):
  """The width refinement, on a fake byte count (no compiles): bytes = layers x width."""
  def fake_total_bytes_at(scale, method, *, hidden=None, **_):
    width = capacity.gpt_family(scale).hidden if hidden is None else hidden
    return scale * width, scale * width // 2  # (bytes, params)

  monkeypatch.setattr(capacity, "total_bytes_at", fake_total_bytes_at)
  budget_gb = 21 * 1408 / 1e9  # 29,568 "bytes"
  common = dict(num_micro_batches=2, micro_batch_size=1, seq_len=16, remat="full",
                max_scale=40, progress=False)
  (coarse,) = capacity.measure_capacity([budget_gb], ["adama"], **common)
  (fine,) = capacity.measure_capacity([budget_gb], ["adama"], refine_width=True, **common)
  # 21 x 1280 = 26,880 fits, 22 x 1408 = 30,976 does not: the family's answer.
  assert (coarse["scale"], coarse["hidden"], coarse["total_bytes"]) == (21, 1280, 26880)
  # At 21 layers, 1344 (28,224) and 1408 (29,568) fit, 1472 (30,912) does not.
  assert (fine["scale"], fine["hidden"], fine["total_bytes"]) == (21, 1408, 29568)
  assert fine["param_count"] == 29568 // 2


def test_table_merges_capacity_runs_of_one_method_each(tmp_path):
  """`models.bench table`: per-method capacity runs merged into one table with ratios."""
  def run(method, params):
    return {"command": "capacity", "machine": {}, "argv": ["capacity", "--methods", method],
            "capacity": [{"budget_gb": 16.0, "method": method, "scale": 20, "hidden": 1280,
                          "param_count": params, "total_bytes": 1, "compiles": 1}]}
  paths = []
  for method, params in [("scan_accumulation", 400e6), ("adama", 500e6)]:
    paths.append(tmp_path / f"{method}.json")
    paths[-1].write_text(json.dumps(run(method, params)))
  merged = bench.main(["table", *map(str, paths), "--markdown", str(tmp_path / "t.md"),
                       "--json", str(tmp_path / "merged.json")])
  assert [r["method"] for r in merged["capacity"]] == ["scan_accumulation", "adama"]
  table = (tmp_path / "t.md").read_text()
  assert "| 16 GB | 400M (20 layers x 1280) | 500M (20 layers x 1280) | adama: 1.25x |" in table
  assert json.loads((tmp_path / "merged.json").read_text()) == merged
  assert table.startswith("Made by `python -m models.bench capacity --methods "
                          "scan_accumulation`; `python -m models.bench capacity --methods adama`.")


def test_table_refuses_capacity_runs_of_two_compilers(tmp_path, capsys):
  paths = []
  for compiler in ("XLA's CPU backend", "libtpu 0.0.42.1 for TPU v3-8"):
    paths.append(tmp_path / f"{len(paths)}.json")
    paths[-1].write_text(json.dumps({
        "command": "capacity", "machine": {}, "argv": ["capacity"], "compiled_for": compiler,
        "capacity": [{"budget_gb": 16.0, "method": "adama", "scale": 20, "hidden": 1280,
                      "param_count": 1, "total_bytes": 1, "compiles": 1}]}))
  with pytest.raises(SystemExit) as ended:
    bench.main(["table", *map(str, paths)])
  assert ended.value.code == 2
  assert "different compilers" in capsys.readouterr().err


@pytest.fixture(scope="module")
def width_64_adama_bytes():
  return capacity.total_bytes_at(1, "adama", **SMALL_STEP)[0]


SMALL_STEP = dict(num_micro_batches=2, micro_batch_size=1, seq_len=8, remat="full",
                  vocab_size=256, hidden=64)


# On one xdist worker (make test: --dist loadgroup): the fixture compiles once.
# adama_8bit_lowrank_offload wraps adama_8bit_lowrank, which wraps adama_8bit:
# it keeps their smoke in the default run (with the accumulation baseline);
# the two inner ones (16-20 s each on 2 busy cores) run with the slow tests.
_INNER_STATE_METHODS = ("adama_8bit", "adama_8bit_lowrank")


@pytest.mark.xdist_group("bench_width_64")
@pytest.mark.parametrize("method", [
    pytest.param(method, marks=pytest.mark.slow) if method in _INNER_STATE_METHODS else method
    for method in sorted(harness.STATE_METHODS)])
def test_state_method_smoke(method, width_64_adama_bytes):
  """Fast smoke of each capacity state method on a width-64 model (one compile):
  it holds less than float32 AdamA (measured 3.02-3.51 P against 3.75 P; at
  this width most leaves are under the 8-bit minimum size). The slow test
  below orders the methods on a wider model."""
  total, _ = capacity.total_bytes_at(1, method, **SMALL_STEP)
  assert 0 < total < width_64_adama_bytes, method


@pytest.mark.slow  # four compiles of 8-bit steps: a minute on a busy CPU
def test_state_methods_shrink_the_state_in_order():
  """The capacity methods with smaller moments, on a width-256 model (compile only).

  Rank-64 moments (and bf16 projectors) save over full 8-bit ones, the
  offloaded state leaves the device count, and the careful accumulation
  baseline (a bf16 gradient sum beside 8-bit Adam) needs more than AdamA.
  """
  common = dict(num_micro_batches=2, micro_batch_size=1, seq_len=16, remat="full",
                vocab_size=256, hidden=256)
  measured = {m: capacity.total_bytes_at(1, m, **common)
              for m in ("adama_8bit", "adama_8bit_lowrank", "adama_8bit_lowrank_offload",
                        "scan_accumulation_bf16_8bit")}
  total = {m: b for m, (b, _) in measured.items()}
  P = 4 * measured["adama_8bit"][1]
  # 8-bit m and v of the kernels (3/4 of the params) shrink to a quarter:
  # about 0.4 P of codes; measured 0.7 P with the temporaries they drag along.
  assert total["adama_8bit"] - total["adama_8bit_lowrank"] > 0.3 * P
  # Offloaded: the low-rank codes and the projectors (about 0.15 P) leave the count.
  assert total["adama_8bit_lowrank"] - total["adama_8bit_lowrank_offload"] > 0.1 * P
  assert total["scan_accumulation_bf16_8bit"] > total["adama_8bit_lowrank"]


def test_unrolled_residuals_script_reads_the_peak_xla_reports(tmp_path):
  """benchmarks/scripts/unrolled_residuals.py (its own process: it sets XLA_FLAGS to dump).

  What it parses from the dumped buffer assignment (the buffers live at the temp
  peak) must add up to the temp bytes `memory_analysis()` reports for the same
  program, within the 10% that slot sharing and the 0.01 P cut leave.
  """
  import os
  import subprocess
  import sys
  out = tmp_path / "residuals.json"
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  scratch = tmp_path / "tmp"  # the script's dump directory goes here
  scratch.mkdir()
  subprocess.run(
      [sys.executable, os.path.join("benchmarks", "scripts", "unrolled_residuals.py"),
       "--presets", "bert_test", "--json", str(out)],
      check=True, cwd=root, env={**os.environ, "PYTHONPATH": root, "TMPDIR": str(scratch)})
  assert not list(scratch.iterdir())  # the dumps are removed when it exits
  (result,) = json.loads(out.read_text())
  for program in ("grad", "fold", "step"):
    live = sum(result[program]["live_at_peak_p"].values())
    assert live == pytest.approx(result[program]["temp_p"], rel=0.1), program
  # The MLP hidden activation (1 sequence of 32 tokens, width 512) is live at the
  # fold's peak: the forward residuals the module docstring is about.
  assert "f32[1,32,512]" in result["fold"]["live_at_peak_p"]


# "split" alone in the default suite (two compiles: the release holds well
# under the fused step); against "mean" (four compiles) with the slow tests.
@pytest.mark.parametrize("estimators", [
    ("split",), pytest.param(("mean", "split"), marks=pytest.mark.slow)],
    ids=["split", "mean_and_split"])
def test_estimator_memory_script_release_takes_split_at_means_memory(estimators):
  """benchmarks/scripts/estimator_memory.py on a 4-layer scanned gpt_test: in the fused
  step "split" holds the stack's gradient twice (one leaf, per half); the
  release step folds each layer's halves and drops them, at "mean"'s memory."""
  module = load_script("benchmarks/scripts/estimator_memory.py")
  totals = module.estimator_totals(
      "gpt_test", batch_size=4, num_micro_batches=2, scan_layers=True,
      estimators=estimators, num_layers=4)
  assert set(totals) == {name for e in estimators for name in (e, f"{e}/release")}
  # Measured: fused 19.8 MB ("mean") and 23.3 MB ("split"); release 13.5 and
  # 13.9 MB (the embedding's and head's halves, outside the stack).
  assert totals["split/release"] < 0.7 * totals["split"], totals
  if "mean" in estimators:
    assert totals["split"] > 1.15 * totals["mean"], totals
    assert totals["split/release"] < 1.05 * totals["mean/release"], totals


def test_cpu_stand_in_tables_and_plots_a_compare_run(tmp_path):
  """benchmarks/scripts/cpu_stand_in.py on a `models.train --compare` payload: the gap,
  the curves (smoothed as a running mean) and the table."""
  import numpy as np

  module = load_script("benchmarks/scripts/cpu_stand_in.py")
  np.testing.assert_allclose(harness.running_mean([4.0, 2.0, 0.0], window=2), [4.0, 3.0, 1.0])

  def run(optimizer, eval_loss):
    config = {"optimizer": optimizer, "nu_estimator": "auto", "num_micro_batches": 4,
              "batch_size": 128, "seq_len": 64, "steps": 3, "learning_rate": 2e-3, "seed": 0}
    return {"config": config, "preset": "gpt_tiny", "param_count": 10, "eval_loss": eval_loss,
            "train_loss": [3.0, 2.5, 2.0], "final_train_loss": 2.0, "median_step_s": 0.1,
            "loop_s": 60.0, "machine": {"device": "cpu"}}

  metrics = tmp_path / "raw" / "run.json"
  metrics.parent.mkdir()
  metrics.write_text(json.dumps({"runs": [run("adama", 1.98), run("adam", 2.0)]}))
  module.main(["--metrics", str(metrics), "--plot", str(tmp_path / "curves.png"),
               "--markdown", str(tmp_path / "table.md")])
  table = (tmp_path / "table.md").read_text()
  assert "**-1.00%**" in table and "CPU stand-in" in table
  assert (tmp_path / "curves.png").stat().st_size > 0


def test_cpu_stand_in_retrains_the_default_and_keeps_the_rest(tmp_path, monkeypatch):
  """--retrain-default: AdamA trained again under the default estimator, the
  earlier AdamA run kept as its own row, Adam's run unchanged; a stored Adam
  run from another setting is refused before any training."""
  import dataclasses

  module = load_script("benchmarks/scripts/cpu_stand_in.py")
  adam_args = [a for a in module.TRAIN_ARGS if a != "--compare"] + ["--optimizer", "adam",
                                                                      "--steps", "3"]

  def run(optimizer, estimator, eval_loss):
    config = dataclasses.asdict(module.train.train_config(adam_args))
    config.update(optimizer=optimizer, nu_estimator=estimator)
    # A run stored before TrainConfig had these fields: read as their defaults.
    del config["dtype"], config["split_floor"]
    return {"config": config, "preset": "gpt_tiny", "param_count": 10, "eval_loss": eval_loss,
            "train_loss": [3.0, 2.5, 2.0], "final_train_loss": 2.0, "median_step_s": 0.1,
            "loop_s": 60.0, "machine": {"device": "cpu"}}

  trained = []

  def fake_train(argv):
    trained.append(argv)
    new = run("adama", harness.DEFAULT_NU_ESTIMATOR, 2.02)
    new["config"]["steps"] = int(argv[argv.index("--steps") + 1])
    return [new]

  monkeypatch.setattr(module.train, "main", fake_train)
  metrics = tmp_path / "run.json"
  metrics.write_text(json.dumps({"runs": [run("adama", "auto", 1.98), run("adam", "auto", 2.0)]}))
  module.main(["--metrics", str(metrics), "--retrain-default", "--steps", "3",
               "--plot", str(tmp_path / "curves.png"), "--markdown", str(tmp_path / "table.md")])
  (argv,) = trained
  assert "--compare" not in argv and argv[argv.index("--optimizer") + 1] == "adama"
  runs = json.loads(metrics.read_text())["runs"]
  assert [(r["config"]["optimizer"], r["config"]["nu_estimator"]) for r in runs] == [
      ("adama", harness.DEFAULT_NU_ESTIMATOR), ("adama", "auto"), ("adam", "auto")]
  table = (tmp_path / "table.md").read_text()
  assert (f"AdamA (default, nu_estimator={harness.DEFAULT_NU_ESTIMATOR!r}) against Adam: "
          "**+1.00%**") in table
  assert "AdamA (nu_estimator='auto', an earlier default) against Adam: **-1.00%**" in table
  # Adam's run made at another length than the retrained side would be:
  # refused before training, the file kept.
  with pytest.raises(ValueError, match=r"another setting \({'steps': \(4, 3\)}"):
    module.main(["--metrics", str(metrics), "--retrain-default", "--steps", "4"])
  assert len(trained) == 1 and len(json.loads(metrics.read_text())["runs"]) == 3


@pytest.mark.slow
def test_fsdp_memory_script_measures_every_method_per_device(tmp_path):
  """benchmarks/scripts/fsdp_memory.py on gpt_test (its own process: 8 fake devices)."""
  import subprocess
  import sys
  from pathlib import Path

  root = Path(__file__).resolve().parents[2]
  out = tmp_path / "fsdp.json"
  result = subprocess.run(
      [sys.executable, str(root / "benchmarks" / "scripts" / "fsdp_memory.py"),
       "--presets", "gpt_test",
       "--seq-len", "32", "--json", str(out), "--markdown", str(tmp_path / "fsdp.md")],
      cwd=root, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["method"] for r in rows] == ["fsdp_scan_accumulation", "fsdp_adama",
                                         "fsdp_adama_release", "fsdp_adama_release_bf16",
                                         "fsdp_adama_release_8bit"]
  for r in rows:  # at least the floor; the floor at least the params' and state's share
    assert r["per_device_bytes"] >= r["floor_bytes"] >= (
        r["param_bytes"] + r["state_bytes"]) / 8, r
    # Every loop's trip count read; each micro-batch's gradient reduce-scattered
    # once; no more than FSDP's ideal (XLA may hoist a gather of params that
    # the micro-batch loop does not change out of it: less).
    assert r["uncounted_loops"] == 0 and r["collective_ratio"] < 1.1, r
    assert r["collective_bytes"]["reduce-scatter"] == pytest.approx(
        4 * r["param_bytes"], rel=0.01), r
  state = {r["method"]: r["state_bytes"] for r in rows}
  assert state["fsdp_adama_release_8bit"] < 0.6 * state["fsdp_adama_release_bf16"], state
