"""benchmarks/scripts/finetune_study.py: pretrain, save as Hugging Face, fine-tune three ways.

The smoke runs the whole study at its smallest (a 300-token BPE, 3 pretraining
and 2 fine-tuning steps, one seed) and holds it to references: the pretrained
directory reloads with the pretraining run's own held-out loss, Adam +
accumulation and optax.MultiSteps (the same update) agree, and the table
carries the runs' numbers.
"""

from __future__ import annotations

import json
import math

import jax
import pytest
from conftest import load_script

pytest.importorskip("tokenizers", reason="the [models] extra's tokenizers trains the BPE")
finetune_study = load_script("benchmarks/scripts/finetune_study.py")


def test_the_smallest_study_pretrains_saves_and_fine_tunes_three_arms(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the token cache
  work, raw, png, page = (tmp_path / "work", tmp_path / "raw.json", tmp_path / "plot.png",
                          tmp_path / "tables.md")
  with jax.numpy_dtype_promotion("standard"):  # optax's adam and schedules promote implicitly
    record = finetune_study.main([
        "--seeds", "0", "--vocab-size", "300", "--pretrain-bytes", "100000",
        "--finetune-bytes", "60000", "--pretrain-steps", "3", "--finetune-steps", "2",
        "--warmup-steps", "1", "--eval-batches", "2", "--work-dir", str(work),
        "--json", str(raw), "--png", str(png), "--markdown", str(page)])
    # The pretrained directory is the trained model: reloaded, it scores the
    # pretraining run's held-out batches as the run did.
    pretrain_argv = [a for a in record["pretrain"]["argv"] if a != "--no-progress"]
    at = pretrain_argv.index("--save-hf")
    del pretrain_argv[at:at + 2]  # the directory now holds the checkpoint
    reloaded = finetune_study.held_out_loss(pretrain_argv, work / "pretrained")
  assert reloaded == pytest.approx(record["pretrain"]["eval_loss"], rel=1e-5)

  pretrained = work / "pretrained"
  config = json.loads((pretrained / "config.json").read_text())
  assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (300, 0, 1)
  assert (pretrained / "tokenizer.json").is_file()
  assert record["corpora"]["pretrain"]["rows"] > 0 and record["corpora"]["finetune"]["rows"] > 0

  assert [(r["arm"], r["seed"]) for r in record["runs"]] == [
      ("adam", 0), ("multisteps", 0), ("adama", 0)]
  assert all(len(r["train_loss"]) == 2 and math.isfinite(r["eval_loss"]) for r in record["runs"])
  by_arm = {r["arm"]: r for r in record["runs"]}
  # MultiSteps applies Adam to the micro-batches' mean gradient: accumulation's update.
  assert by_arm["multisteps"]["eval_loss"] == pytest.approx(by_arm["adam"]["eval_loss"],
                                                            rel=1e-4)
  summary = record["summary"]["adama"]
  assert summary["vs_adam_percent"] == pytest.approx(
      100 * (by_arm["adama"]["eval_loss"] / by_arm["adam"]["eval_loss"] - 1))
  assert summary["drop_from_pretrained"] == pytest.approx(
      record["before_finetune_eval_loss"] - by_arm["adama"]["eval_loss"])

  saved = json.loads(raw.read_text())
  assert saved["summary"] == record["summary"] and png.stat().st_size > 0
  tables = page.read_text()
  assert f"{by_arm['adama']['eval_loss']:.4f}" in tables
  assert f"**{record['before_finetune_eval_loss']:.4f}**" in tables
