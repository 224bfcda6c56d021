"""``python -m models.train``'s command line: its help, the model a preset names,
and what a rerun of a finished run prints.

The refusals of bad settings (one line, status 2) are in tests/zoo/test_commands.py.
"""

import json
import math
import re

import jax
import numpy as np
import pytest

from models import harness
from models import train
from models.harness.settings import warmup_cosine_schedule


@pytest.fixture(autouse=True)
def _standard_promotion():
  # optax's schedules and adamw (the baselines) rely on implicit promotion.
  with jax.numpy_dtype_promotion("standard"):
    yield


def _help_entries(text: str) -> dict[str, str]:
  """Each option's entry in ``--help``: its first flag -> the entry on one line."""
  entries: dict[str, str] = {}
  flag = None
  for line in text.splitlines():
    start = re.match(r"  (-[-\w]+)", line)
    if start:
      flag = start[1]
      entries[flag] = line.strip()
    elif flag is not None and line.startswith(" " * 6):  # the entry's wrapped lines
      entries[flag] += " " + line.strip()
    else:
      flag = None
  return entries


def test_help_shows_every_flags_default_exactly_once(capsys):
  with pytest.raises(SystemExit) as exit_info:
    train.main(["--help"])
  assert exit_info.value.code == 0
  entries = _help_entries(capsys.readouterr().out)
  flags = [a.option_strings[0] for a in train.build_parser()._actions
           if a.option_strings and a.dest != "help"]
  assert sorted(entries) == sorted(flags + ["-h"])
  for flag in flags:
    # The formatter used to append "(default: None)" to some and skip flags
    # without help text: "--steps STEPS" said nothing of its 300.
    assert len(re.findall("default", entries[flag])) == 1, entries[flag]
    assert "(default: None)" not in entries[flag], entries[flag]
  defaults = harness.TrainConfig()
  for flag, value in (("--steps", defaults.steps), ("--batch-size", defaults.batch_size),
                      ("--num-micro-batches", defaults.num_micro_batches),
                      ("--seq-len", defaults.seq_len), ("--learning-rate", defaults.learning_rate),
                      ("--checkpoint-every", 100), ("--keep", 3)):
    assert entries[flag].endswith(f"(default: {value})"), entries[flag]


@pytest.mark.parametrize("preset, model", [
    ("llama_test", "llama"), ("llama_tiny", "llama"), ("vit_test", "vit"),
    ("bert_tiny", "bert"), ("gpt_test", "gpt"), (None, "gpt")])
def test_the_preset_names_the_model(preset, model):
  argv = [] if preset is None else ["--preset", preset]
  config = train.train_config(argv)
  assert (config.model, config.preset_name) == (model, preset or "gpt_tiny")
  # Said again, the same model is no contradiction.
  assert train.train_config([*argv, "--model", model]).model == model


def test_a_model_that_contradicts_the_preset_is_still_refused(capsys):
  with pytest.raises(SystemExit) as exit_info:
    train.main(["--model", "gpt", "--preset", "llama_test", "--steps", "1"])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--preset llama_test is a llama model, not a gpt" in error
  assert "--model llama" in error


def test_rerunning_a_finished_run_says_so_and_prints_no_nan(tmp_path, capsys):
  out = tmp_path / "run.json"
  argv = ["--preset", "gpt_test", "--num-micro-batches", "2", "--batch-size", "8",
          "--seq-len", "16", "--steps", "2", "--eval-batches", "2", "--max-bytes", "200000",
          "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-out", str(out),
          "--no-progress"]
  first = train.main(argv)[0]
  assert first["tokens_per_s"] > 0
  capsys.readouterr()
  again = train.main(argv)[0]
  printed = capsys.readouterr().out
  assert "nan" not in printed.lower()
  assert (f"gpt_test/adama: already finished at step 2 in {tmp_path / 'ckpt'}; "
          "nothing trained") in printed
  assert "| adama | 2 |" in printed and printed.rstrip().splitlines()[-2].endswith("| - |")
  # The same params: the eval loss is the finished run's, and the timings,
  # not measured, are null in the JSON (NaN is no JSON value).
  assert again["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-6)
  written = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"wrote {c}"))
  assert written["tokens_per_s"] is None and written["median_step_s"] is None
  assert all(not (isinstance(v, float) and math.isnan(v)) for v in written.values())


def test_clip_norm_clips_each_optimizer_its_own_way(capsys):
  import optax  # pylint: disable=import-outside-toplevel

  import optax_adama  # pylint: disable=import-outside-toplevel

  params = {"w": jax.numpy.ones((3, 2))}
  argv = ["--preset", "gpt_test", "--clip-norm", "0.5", "--num-micro-batches", "2"]
  adama = train.train_config([*argv, "--optimizer", "adama"])
  assert adama.clip_norm == 0.5
  clip_state, adama_state = harness.make_optimizer(adama).init(params)
  assert isinstance(clip_state, optax_adama.contrib.SketchedClipState)
  assert optax_adama.find_adama_state(adama_state).num_micro_batches == 2
  # Gradient accumulation clips the mean gradient exactly: optax's clip first.
  config = train.train_config([*argv, "--optimizer", "adam"])
  schedule = warmup_cosine_schedule(config.learning_rate, config.steps, config.warmup_steps)

  def second_update(tx):  # the second gradient is clipped, the first not
    state = tx.init(params)
    for scale in (0.1, 10.0):
      updates, state = tx.update({"w": jax.numpy.full((3, 2), scale)}, state, params)
    return updates["w"]

  made = second_update(harness.make_optimizer(config))
  adamw = lambda: optax.adamw(schedule, weight_decay=config.weight_decay)
  np.testing.assert_allclose(
      made, second_update(optax.chain(optax.clip_by_global_norm(0.5), adamw())), rtol=1e-6)
  assert not np.allclose(made, second_update(adamw()))  # the clip changed the step
  assert harness.TrainConfig().clip_norm is None
  with pytest.raises(SystemExit) as exit_info:
    train.main([*argv[:2], "--clip-norm", "0", "--steps", "1"])
  assert exit_info.value.code == 2
  assert "--clip-norm 0.0: it must be a positive number." in capsys.readouterr().err
