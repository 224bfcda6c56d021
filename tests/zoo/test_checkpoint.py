"""Checkpoint and resume in the trainer: a stopped run ends where the uninterrupted one does.

Bitwise: the params, the optimizer state (every leaf, 8-bit codes included), the
losses and the held-out loss of a resumed run equal the uninterrupted run's
exactly, not to a tolerance: the same compiled step on the same inputs is
deterministic on the CPU, so any difference is a bug in what was saved or in
where the data stream resumed.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import xla_flags

from models import checkpoint as checkpointing
from models import harness
from models import train
from models.harness import loop

# One xdist worker runs this file (make test: --dist loadgroup), so the
# module's uninterrupted runs are trained once, not once per worker.
pytestmark = pytest.mark.xdist_group("checkpoint")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A run small enough for the default suite: gpt_test, 4 micro-batches of 2.
RUN = dict(model="gpt", preset="gpt_test", num_micro_batches=4, batch_size=8, seq_len=16,
           steps=12, eval_batches=2, warmup_steps=2)


@pytest.fixture(autouse=True)
def _standard_promotion():
  # optax's schedules rely on implicit promotion, as in a user's trainer.
  with jax.numpy_dtype_promotion("standard"):
    yield


def _train(directory, every=2, **overrides):
  config = harness.TrainConfig(**{**RUN, **overrides})
  options = harness.CheckpointOptions(str(directory), every=every, keep=10)
  return harness.train(config, progress=False, checkpoint=options)


def _final_state(directory):
  """The newest checkpoint's state as numpy leaves, and its step."""
  manager = ocp.CheckpointManager(pathlib.Path(directory).absolute(),
                                  item_names=("state", "record"))
  step = manager.latest_step()
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  manager.close()
  return step, jax.tree.map(np.asarray, state.state)


def _assert_bitwise_equal(got, want):
  got_leaves, got_def = jax.tree.flatten(got)
  want_leaves, want_def = jax.tree.flatten(want)
  assert got_def == want_def
  for a, b in zip(got_leaves, want_leaves):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def _stopped_after(source, target, step):
  """``target``: ``source``'s checkpoints up to ``step``, as a run killed after saving it leaves
  them."""
  shutil.copytree(source, target)
  for path in target.iterdir():
    if path.name.isdigit() and int(path.name) > step:
      shutil.rmtree(path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  directory = tmp_path_factory.mktemp("uninterrupted")
  with jax.numpy_dtype_promotion("standard"):
    return directory, _train(directory)


def _assert_resumed_run_matches(resumed, directory, uninterrupted):
  full_dir, full = uninterrupted
  assert resumed["train_loss"] == full["train_loss"]
  assert resumed["eval_loss"] == full["eval_loss"]
  step, state = _final_state(directory)
  want_step, want = _final_state(full_dir)
  assert step == want_step == RUN["steps"]
  _assert_bitwise_equal(state, want)


def test_resumed_run_is_bitwise_the_uninterrupted_run(uninterrupted, tmp_path, capsys):
  _stopped_after(uninterrupted[0], tmp_path / "run", 6)
  resumed = _train(tmp_path / "run")
  assert resumed["resumed_from"] == 6
  assert "resuming from" in capsys.readouterr().err
  _assert_resumed_run_matches(resumed, tmp_path / "run", uninterrupted)


# Two 12-step runs of their own (63 s on 2 busy cores): with the slow tests.
# The run's resume keeps its smoke in test_resumed_run_is_bitwise_the_uninterrupted_run,
# 8-bit moments saved and stepped on bitwise theirs in
# test_low_rank_and_host_offloaded_state_round_trips.
@pytest.mark.slow
def test_eight_bit_moments_resume_bitwise(tmp_path):
  full = _train(tmp_path / "full", quantize_moments=True)
  _stopped_after(tmp_path / "full", tmp_path / "run", 4)
  resumed = _train(tmp_path / "run", quantize_moments=True)
  assert resumed["resumed_from"] == 4
  _assert_resumed_run_matches(resumed, tmp_path / "run", (tmp_path / "full", full))


def test_a_torn_and_a_corrupt_checkpoint_are_skipped(uninterrupted, tmp_path):
  run = tmp_path / "run"
  _stopped_after(uninterrupted[0], run, 8)
  # Killed while saving step 10: orbax's temporary directory, never renamed.
  torn = run / "10.orbax-checkpoint-tmp-1700000000"
  shutil.copytree(run / "8", torn)
  (torn / "commit_success.txt").unlink(missing_ok=True)
  # Step 8 damaged on disk afterwards: its array data truncated.
  data = [p for p in (run / "8" / "state").rglob("*") if p.is_file() and p.stat().st_size > 64]
  for path in data:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
  with pytest.warns(RuntimeWarning, match="does not restore"):
    resumed = _train(run)
  assert resumed["resumed_from"] == 6
  _assert_resumed_run_matches(resumed, run, uninterrupted)


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_written_again(uninterrupted, tmp_path):
  run = tmp_path / "run"
  _stopped_after(uninterrupted[0], run, RUN["steps"])
  newest = run / str(RUN["steps"])
  for path in (p for p in (newest / "state").rglob("*") if p.is_file() and p.stat().st_size > 64):
    path.write_bytes(path.read_bytes()[:8])
  with pytest.warns(RuntimeWarning, match="does not restore"):
    resumed = _train(run)
  assert resumed["resumed_from"] == RUN["steps"] - 2
  assert (run / f"{RUN['steps']}.damaged").is_dir()
  _assert_resumed_run_matches(resumed, run, uninterrupted)  # step 12 written anew


def test_no_restorable_checkpoint_is_refused_not_restarted(uninterrupted, tmp_path):
  run = tmp_path / "run"
  _stopped_after(uninterrupted[0], run, 4)
  for path in (p for p in run.rglob("*")
               if p.is_file() and p.parent.name == "state" and p.stat().st_size > 64):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
  with pytest.warns(RuntimeWarning, match="does not restore"):
    with pytest.raises(RuntimeError, match="none of the checkpoints"):
      _train(run)


def test_a_state_of_another_structure_is_refused_naming_the_leaf(tmp_path):
  runs = checkpointing.RunCheckpoints(tmp_path, identity={"run": 1})
  runs.save(1, {"w": np.ones((4, 2), np.float32)}, {"train_loss": []})
  runs.close()
  with pytest.raises(ValueError, match=r"w: checkpoint \(4, 2\) float32, this run \(4, 3\)"):
    checkpointing.RunCheckpoints(tmp_path, identity={"run": 1}).restore_latest(
        {"w": jax.ShapeDtypeStruct((4, 3), np.float32)})
  assert [p.name for p in tmp_path.iterdir()] == ["1"]


def test_another_runs_checkpoint_is_refused_and_left_alone(uninterrupted, tmp_path):
  run = tmp_path / "run"
  _stopped_after(uninterrupted[0], run, 6)
  before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
  with pytest.raises(ValueError, match=r"num_micro_batches: checkpoint 4, this run 2"):
    _train(run, num_micro_batches=2)
  with pytest.raises(ValueError, match=r"preset: checkpoint 'gpt_test', this run 'gpt_tiny'"):
    _train(run, preset="gpt_tiny")
  assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_keep_holds_the_newest_checkpoints(tmp_path):
  config = harness.TrainConfig(**{**RUN, "steps": 6})
  harness.train(config, progress=False,
                checkpoint=harness.CheckpointOptions(str(tmp_path), every=1, keep=2))
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [5, 6]


# Long enough that a signal sent after the first checkpoints lands mid-run:
# the signal follows the step-4 checkpoint within a 50 ms poll, and the 36
# steps and 9 saves left take seconds. Every step here is trained twice (the
# uninterrupted run, and the stopped and resumed processes), so no longer.
KILLED_RUN = {**RUN, "steps": 40}


@pytest.fixture(scope="module")
def uninterrupted_long(tmp_path_factory):
  """The uninterrupted killed-length run of a moment storage, trained when a
  test first asks for it (the 8-bit one only runs with the slow tests):
  ``uninterrupted_long(eight_bit) -> (directory, metrics)``."""
  runs = {}

  def run(eight_bit):
    if eight_bit not in runs:
      directory = tmp_path_factory.mktemp(f"uninterrupted_long_{eight_bit}")
      with jax.numpy_dtype_promotion("standard"):
        runs[eight_bit] = directory, _train(directory, every=20, steps=KILLED_RUN["steps"],
                                            quantize_moments=eight_bit)
    return runs[eight_bit]

  return run


def _command(directory, eight_bit):
  return [sys.executable, "-m", "models.train", "--no-progress", "--checkpoint-dir",
          str(directory), "--checkpoint-every", "4", "--metrics-out", str(directory) + ".json",
          *[f"--{k.replace('_', '-')}={v}" for k, v in KILLED_RUN.items()],
          *(["--quantize-moments"] if eight_bit else [])]


def _wait_for_step(directory, step, process, timeout=240):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if directory.exists() and any(p.name.isdigit() and int(p.name) >= step
                                  for p in directory.iterdir()):
      return
    assert process.poll() is None, process.communicate()
    time.sleep(0.05)
  raise TimeoutError(f"no checkpoint of step {step} in {timeout} s")


# A real SIGKILL in the default suite; the SIGTERM save and 8-bit moments (whose
# resume test_eight_bit_moments_resume_bitwise covers in-process, also slow)
# with the slow tests: 22-25 s each on 2 cores.
@pytest.mark.parametrize("how, eight_bit", [
    ("SIGKILL", False), pytest.param("SIGTERM", False, marks=pytest.mark.slow),
    pytest.param("SIGKILL", True, marks=pytest.mark.slow)])
def test_a_killed_training_process_resumes_bitwise(uninterrupted_long, tmp_path, capsys, how,
                                                   eight_bit):
  run = tmp_path / "run"
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  process = subprocess.Popen(_command(run, eight_bit), cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _wait_for_step(run, 4, process)
  process.send_signal(getattr(signal, how))
  _, err = process.communicate(timeout=120)
  if how == "SIGTERM":  # saves the step it finished and says so
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM at step" in err
  else:
    assert process.returncode == -signal.SIGKILL
  stopped_at = max(int(p.name) for p in run.iterdir() if p.name.isdigit())
  assert 4 <= stopped_at < KILLED_RUN["steps"]
  # The same command resumes in this process: what it reads back is on disk
  # either way, and a second process only added its start (JAX's import, the
  # compiles the run's cache holds).
  train.main(_command(run, eight_bit)[3:])
  assert f"resuming from {run / str(stopped_at)}" in capsys.readouterr().err
  want_dir, want_metrics = uninterrupted_long(eight_bit)
  step, state = _final_state(run)
  _, want = _final_state(want_dir)
  assert step == KILLED_RUN["steps"]
  _assert_bitwise_equal(state, want)
  metrics = json.loads(pathlib.Path(str(run) + ".json").read_text())
  assert metrics["resumed_from"] == stopped_at
  assert metrics["train_loss"] == want_metrics["train_loss"]
  assert metrics["eval_loss"] == want_metrics["eval_loss"]


def test_abstract_like_keeps_each_leafs_placement():
  x = jax.numpy.ones((4, 2))
  (leaf,) = jax.tree.leaves(checkpointing.abstract_like({"x": x}))
  assert (leaf.shape, leaf.dtype, leaf.sharding) == (x.shape, x.dtype, x.sharding)


_SHARDED_ROUND_TRIP = r'''
import pathlib, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
import optax_adama
from models import checkpoint as checkpointing

directory = pathlib.Path(sys.argv[1])
params = {"w": jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 1000, "b": jnp.ones(16)}
loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"][None] - b["y"]) ** 2)
batch = {"x": jnp.linspace(-1, 1, 32 * 64).reshape(32, 64), "y": jnp.zeros((32, 16))}
tx = optax_adama.adama(1e-2, num_micro_batches=2)

def placed(devices, stage):
  mesh = Mesh(np.array(devices), ("data",))
  shardings = optax_adama.sharding.step_shardings(
      params, tx.init(params), mesh, shard_states=stage)
  # From host copies: the steps donate what they are given.
  host = lambda tree: jax.tree.map(np.asarray, tree)
  state = {"params": jax.device_put(host(params), shardings.params),
           "opt_state": jax.device_put(host(tx.init(params)), shardings.opt_state)}
  return mesh, state

for stage in ("zero2", "fsdp"):
  mesh, state = placed(jax.devices(), stage)
  step = optax_adama.microbatch_step(loss, tx, mesh=mesh, shard_states=stage)
  state["params"], state["opt_state"], _ = step(state["params"], state["opt_state"], batch)
  want = jax.tree.map(np.asarray, state)
  runs = checkpointing.RunCheckpoints(directory / stage, identity={"stage": stage})
  runs.save(1, state, {"train_loss": []})
  runs.close()
  for devices in (jax.devices()[:4], jax.devices()[:1]):
    mesh, target = placed(devices, stage)
    abstract = checkpointing.abstract_like(target)
    restored = checkpointing.RunCheckpoints(
        directory / stage, identity={"stage": stage}).restore_latest(abstract)
    assert restored.step == 1
    for got, place in zip(jax.tree.leaves(restored.state), jax.tree.leaves(abstract)):
      assert got.sharding == place.sharding, (got.sharding, place.sharding)
    for got, expected in zip(jax.tree.leaves(restored.state), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(got), expected)
    # And it trains on, on the new mesh.
    step = optax_adama.microbatch_step(loss, tx, mesh=mesh, shard_states=stage)
    step(restored.state["params"], restored.state["opt_state"], batch)
  print(stage, "ok")
'''


def test_a_sharded_checkpoint_restores_onto_another_mesh_size_and_one_device(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(ROOT),
         "XLA_FLAGS": xla_flags(8)}
  done = subprocess.run([sys.executable, "-W", "error", "-c", _SHARDED_ROUND_TRIP, str(tmp_path)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split() == ["zero2", "ok", "fsdp", "ok"]


def test_low_rank_and_host_offloaded_state_round_trips(tmp_path):
  import optax_adama
  tx = optax_adama.offload_moments(optax_adama.low_rank(
      optax_adama.adama(1e-3, num_micro_batches=2, quantization=optax_adama.BlockQuantization()),
      rank=4, refresh_period=2), min_size=16)
  params = {"w": jax.numpy.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32)}
  state = tx.init(params)
  for i in range(3):  # mid-mini-batch: micro-step 1 of 2
    _, state = tx.update({"w": jax.numpy.cos(params["w"] * (i + 1))}, state, params)
  runs = checkpointing.RunCheckpoints(tmp_path, identity={})
  runs.save(3, {"params": params, "opt_state": state}, {"train_loss": []})
  runs.close()
  abstract = checkpointing.abstract_like({"params": params, "opt_state": tx.init(params)})
  restored = checkpointing.RunCheckpoints(tmp_path, identity={}).restore_latest(abstract)
  _assert_bitwise_equal(jax.tree.map(np.asarray, restored.state["opt_state"]),
                        jax.tree.map(np.asarray, state))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(restored.state["opt_state"])}
  assert kinds == {x.sharding.memory_kind for x in jax.tree.leaves(state)}
  assert "pinned_host" in kinds
  # The restored state continues exactly as the saved one does.
  g = {"w": jax.numpy.sin(params["w"])}
  want, _ = tx.update(g, state, params)
  got, _ = tx.update(g, restored.state["opt_state"], params)
  _assert_bitwise_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))


@pytest.mark.slow
def test_release_step_run_resumes_bitwise(tmp_path):
  release = dict(scan_layers=True, release=True, remat="full")
  full = _train(tmp_path / "full", **release)
  _stopped_after(tmp_path / "full", tmp_path / "run", 6)
  resumed = _train(tmp_path / "run", **release)
  assert resumed["resumed_from"] == 6
  _assert_resumed_run_matches(resumed, tmp_path / "run", (tmp_path / "full", full))


def test_runs_without_checkpoints_leave_the_signal_handlers_alone():
  before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  with loop._StopSignals(active=False):
    assert {sig: signal.getsignal(sig) for sig in before} == before
  with loop._StopSignals(active=True) as stop:
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop._handle(signal.SIGTERM, None)  # the first one is caught...
    assert stop.received == signal.SIGTERM
    assert {sig: signal.getsignal(sig) for sig in before} == before  # ...a second is not.
  assert {sig: signal.getsignal(sig) for sig in before} == before
