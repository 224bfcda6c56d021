"""The commands refuse a user's mistake as argparse does: one line, status 2.

Each case runs a command's ``main`` in this process with settings a user gets
wrong (sizes that do not split, a preset of another model, a method without
the flag it needs, checkpoints of another run) and checks what the terminal
shows: no traceback, one ``prog: error: ...`` line that names the flag to
change, exit status 2. Every case is refused before anything trains or
compiles, so the file runs in seconds.
"""

import argparse
import dataclasses
import json

import numpy as np
import pytest

from models import bench
from models import checkpoint as checkpointing
from models import demo
from models import gpu_bench
from models import harness
from models import planner
from models import train
from models import validate


def _refusal(main, argv, capsys) -> str:
  """The error line ``main(argv)`` ends with (status 2, nothing else on stderr)."""
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  lines = err.strip().splitlines()
  assert lines[0].startswith("usage: ")
  error = [line for line in lines if ": error: " in line]
  assert len(error) == 1 and error[0] == lines[-1], err
  return error[0].split(": error: ", 1)[1]


# (command, argv, what the error line must say): each a user's typical mistake.
CASES = [
    # A new user's first try: 32 does not split into 3.
    (train, ["--num-micro-batches", "3", "--batch-size", "32"],
     ["--num-micro-batches 3", "[1, 2, 4, 8, 16, 32]", "--batch-size"]),
    (train, ["--steps", "0"], ["--steps 0"]),
    (train, ["--model", "bert", "--preset", "gpt_test"], ["--preset gpt_test", "--model gpt"]),
    (train, ["--release"], ["--scan-layers"]),
    (train, ["--optimizer", "adam", "--nu-estimator", "momentum"],
     ["--nu-estimator momentum", "--optimizer adama"]),
    (train, ["--model", "llama", "--preset", "llama_test", "--seq-len", "128"],
     ["--seq-len 128", "--seq-len 64"]),
    (train, ["--data-path", "/no/such/corpus"], ["--data-path /no/such/corpus"]),
    # Numbers out of range: a ZeroDivisionError, a ValueError from numpy, or a
    # run that "succeeds" with nonsense (--learning-rate 0 trains nothing).
    (train, ["--seq-len", "0"], ["--seq-len 0", "1 or more"]),
    (train, ["--seq-len", "-5"], ["--seq-len -5", "1 or more"]),
    (train, ["--learning-rate", "0"], ["--learning-rate 0", "positive"]),
    (train, ["--learning-rate", "-0.001"], ["--learning-rate -0.001", "positive"]),
    (train, ["--learning-rate", "nan"], ["--learning-rate nan"]),
    (train, ["--warmup-steps", "-1"], ["--warmup-steps -1", "0 or more"]),
    (train, ["--eval-batches", "0"], ["--eval-batches 0", "1 or more"]),
    (train, ["--max-bytes", "0"], ["--max-bytes 0", "1 or more"]),
    (train, ["--seed", "-1"], ["--seed -1", "0 or more"]),
    (train, ["--weight-decay", "-1"], ["--weight-decay -1"]),
    (train, ["--plan", "0"], ["--plan 0"]),
    (train, ["--batch-size", "0"], ["--batch-size 0"]),
    (train, ["--num-micro-batches", "-2"], ["--num-micro-batches -2"]),
    # Data too short for the batches: each split named, with what to change.
    (train, ["--preset", "gpt_test", "--max-bytes", "100"],
     ["training split", "2 windows of --seq-len 32 (90 tokens)", "--batch-size 32"]),
    (train, ["--model", "bert", "--preset", "bert_test", "--max-bytes", "3000",
             "--batch-size", "64", "--seq-len", "16"],
     ["held-out split", "18 windows of --seq-len 16 (300 tokens)", "--batch-size 64"]),
    (train, ["--model", "vit", "--preset", "vit_test", "--batch-size", "2048",
             "--num-micro-batches", "1"],
     ["training images", "1438 images", "--batch-size 2048"]),
    (bench, ["memory", "--presets", "gpt_test", "--num-micro-batches", "0"],
     ["--num-micro-batches 0"]),
    (bench, ["memory", "--presets", "gpt_test", "--methods", "adama_release"], ["--scan-layers"]),
    (bench, ["memory", "--presets", "gpt_test", "--methods", "adama_8bit_lowrank_offload"],
     ["capacity", "--methods"]),
    (bench, ["memory", "--presets", "gpt_test", "--seq-len", "64"],
     ["--seq-len 64", "--seq-len 32"]),
    (bench, ["memory", "--presets", "no_such_preset"], ["--presets", "gpt2_small"]),
    (bench, ["capacity", "--methods", "dp_adama"], ["--devices"]),
    (bench, ["capacity", "--devices", "4096", "--methods", "dp_adama"],
     ["--devices 4096", "xla_force_host_platform_device_count=4096"]),
    (bench, ["throughput", "--presets", "gpt_test", "--rounds", "0"], ["--rounds 0"]),
    # validate checks every run of the experiment before the first trains.
    (validate, ["--num-micro-batches", "3", "--seeds", "0"], ["--num-micro-batches 3"]),
    (validate, ["--steps", "0"], ["--steps 0"]),
    (validate, ["--models", "llama"], ["--models", "'gpt'"]),
    (gpu_bench, ["--num-micro-batches", "0"], ["--num-micro-batches 0"]),
    (gpu_bench, ["--presets", "gpt_test", "--seq-len", "64"], ["--seq-len 64", "--seq-len 32"]),
    (gpu_bench, ["--capacity", "--capacity-budget-gb", "0"], ["--capacity-budget-gb 0"]),
    # The CPU reports no memory limit to search under.
    (gpu_bench, ["--capacity", "--presets", "gpt_test"], ["--capacity-budget-gb"]),
    (demo, ["--micro-batch-size", "0"], ["--micro-batch-size 0"]),
    (demo, ["--steps", "0"], ["--steps 0"]),
    (demo, ["--memory-preset", "gpt_test", "--memory-seq-len", "64"],
     ["--memory-seq-len 64", "--memory-seq-len 32"]),
    (demo, ["--memory-preset", "bert_test"], ["--memory-preset", "gpt2_small"]),
]


@pytest.mark.parametrize("command, argv, expected", CASES,
                         ids=[f"{c.__name__.split('.')[-1]}-{' '.join(a)}" for c, a, _ in CASES])
def test_commands_refuse_bad_settings_in_one_line(command, argv, expected, capsys, monkeypatch):
  # Refused before training: a run would fail the test, not take minutes.
  monkeypatch.setattr(harness, "train", lambda *a, **k: pytest.fail("trained"))
  error = _refusal(command.main, argv, capsys)
  for text in expected:
    assert text in error, error


def test_train_refuses_a_checkpoint_directory_of_another_run(tmp_path, capsys):
  argv = ["--preset", "gpt_test", "--batch-size", "8", "--steps", "2",
          "--checkpoint-dir", str(tmp_path)]
  saved = dataclasses.replace(train.train_config(argv), num_micro_batches=2)
  checkpoints = checkpointing.RunCheckpoints(
      tmp_path, identity=dataclasses.asdict(saved), asynchronous=False)
  checkpoints.save(1, {"w": np.zeros(2, np.float32)}, {"train_loss": [1.0], "data_position": 1})
  checkpoints.close()
  error = _refusal(train.main, argv, capsys)
  assert "--num-micro-batches: checkpoint 2, this run 4" in error
  assert "--checkpoint-dir" in error
  assert checkpoints.steps() == [1]  # nothing overwritten


def test_train_says_a_budget_nothing_fits_in_one_line(monkeypatch, capsys):
  def nothing_fits(preset, budget_bytes, **kwargs):
    raise ValueError(f"nothing fits {budget_bytes / 1e9:.3g} GB for {preset} at batch "
                     f"{kwargs['batch_size']}: raise the budget.")
  monkeypatch.setattr(planner, "plan", nothing_fits)
  error = _refusal(train.main, ["--preset", "gpt_test", "--plan", "0.001"], capsys)
  assert error == "nothing fits 0.001 GB for gpt_test at batch 32: raise the budget."


def test_a_bug_during_training_keeps_its_traceback(monkeypatch):
  # Only the settings are the user's: an error while training is the code's.
  def broken(config, **kwargs):
    raise ValueError("a bug")
  monkeypatch.setattr(harness, "train", broken)
  with pytest.raises(ValueError, match="a bug"):
    train.main(["--preset", "gpt_test", "--steps", "1"])


def test_bench_table_refuses_runs_of_two_commands(tmp_path, capsys):
  paths = []
  for command in ("memory", "capacity"):
    paths.append(tmp_path / f"{command}.json")
    paths[-1].write_text(json.dumps({"command": command}))
  error = _refusal(bench.main, ["table", *map(str, paths)], capsys)
  assert "['capacity', 'memory']" in error
  missing = _refusal(bench.main, ["table", str(tmp_path / "none.json")], capsys)
  assert "none.json" in missing


def test_library_names_read_as_the_flags_of_the_parser():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num-micro-batches", type=int)
  parser.add_argument("--scan-layers", action="store_true")
  parser.add_argument("--no-split-floor", dest="split_floor", action="store_false")
  parser.add_argument("--optimizer")
  parser.add_argument("--model")
  read = lambda message: harness.as_flags(parser, message)
  assert read("num_micro_batches=3 does not split") == "--num-micro-batches 3 does not split"
  assert read("needs scan_layers=True, got scan_layers=False") == (
      "needs --scan-layers, got no --scan-layers")
  assert read("split_floor=False needs optimizer='adama'") == (
      "--no-split-floor needs --optimizer adama")
  # A bare name with an underscore is a setting; a word is left a word.
  assert read("pick num_micro_batches; the model is the checkpoint's") == (
      "pick --num-micro-batches; the model is the checkpoint's")
  assert read("--num-micro-batches 2 and other_name=4") == (
      "--num-micro-batches 2 and other_name=4")
