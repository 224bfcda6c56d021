"""Fine-tuning a pretrained Llama with Adam + accumulation, optax.MultiSteps and AdamA: a study.

    nice python benchmarks/scripts/finetune_study.py --seeds 0 1 2 --unclipped-controls

Issue 60's item 6a, on the CPU, end to end through ``models.train`` as a user
runs it:

1. Pretrain. A byte-level BPE (``tokenizers``, ``--vocab-size`` tokens) is
   trained on the ``.py`` sources of some standard-library packages
   (`PRETRAIN_PACKAGES`, one JSON Lines ``{"text": ...}`` row per file); a
   ``llama_tiny`` with the tokenizer's vocabulary is written as a Hugging
   Face directory beside it (random weights, BOS/EOS ids in config.json) and
   ``models.train --init-from`` it ``--data-path pretrain.jsonl --save-hf``
   pretrains it and writes the pretrained directory, tokenizer included.
2. Fine-tune. A different corpus: the docstrings (English prose, not code) of
   the standard library's top-level modules, one row per docstring, none from
   the pretraining packages. Each arm is ``models.train --init-from
   PRETRAINED --data-path finetune.jsonl --optimizer {adam,multisteps,adama}
   --clip-norm 1.0`` with the same micro-batch, N, warm-up + cosine schedule
   and steps, for each seed (the seed orders the data; the weights are the
   checkpoint's). Adam and MultiSteps clip the mini-batch gradient's global
   norm with ``optax.clip_by_global_norm``; AdamA with
   ``optax_adama.clipped_by_global_norm`` (no gradient buffer,
   one mini-batch late). The held-out loss is the run's own (the documents
   ``models.text`` holds out); the pretrained model's loss on the same
   held-out batches is the reference before fine-tuning.

The commands run in this process through ``models.train.main`` (one JAX
start-up, the same code path as ``python -m models.train``). Writes ``--json``
and ``--png`` and prints the tables of benchmarks/results/convergence/finetune.md.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import models
from models import data
from models import harness
from models import llama_checkpoint
from models import train
from models.harness.reporting import machine_info

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "convergence"
ARMS = ("adam", "multisteps", "adama")
# Controls without --clip-norm (--unclipped-controls): whether a gap between
# the arms is the clip's or the optimizer's.
CONTROLS = {"adam_unclipped": "adam", "adama_unclipped": "adama"}
ARM_NAMES = {"adam": "Adam + accumulation", "multisteps": "optax.MultiSteps",
             "adama": "AdamA (sketched clip)", "adam_unclipped": "Adam + accumulation, unclipped",
             "adama_unclipped": "AdamA, unclipped"}
PRESET = "llama_tiny"
# Pretraining reads code: the sources of these packages (a part of the stdlib).
PRETRAIN_PACKAGES = ("asyncio", "email", "http", "importlib", "json", "logging", "unittest",
                     "urllib", "xml", "concurrent", "multiprocessing", "tomllib", "wsgiref")
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
BOS_ID, EOS_ID = 0, 1  # the BPE trainer gives the special tokens the first ids
MIN_DOCSTRING_CHARS = 40  # shorter ones ("Return x.") teach little and pack as noise


def pretrain_documents(max_bytes: int) -> list[str]:
  """The ``.py`` files of `PRETRAIN_PACKAGES`, in sorted order, up to ``max_bytes``."""
  documents: list[str] = []
  total = 0
  for package in PRETRAIN_PACKAGES:
    root = data.stdlib_root() / package
    if not root.is_dir():
      continue
    for path in data.list_files(root, suffixes=(".py",), exclude_dirs=data.STDLIB_EXCLUDED_DIRS):
      source = path.read_text(encoding="utf-8", errors="replace")
      if total + len(source) > max_bytes:
        return documents
      documents.append(source)
      total += len(source)
  return documents


def finetune_documents(max_bytes: int) -> list[str]:
  """Docstrings of the standard library's top-level modules (``Lib/*.py``, none of
  `PRETRAIN_PACKAGES`): module, class and function docstrings, up to ``max_bytes``."""
  documents: list[str] = []
  total = 0
  for path in sorted(data.stdlib_root().glob("*.py")):
    try:
      tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
      continue
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      docstring = ast.get_docstring(node)
      if docstring is None or len(docstring) < MIN_DOCSTRING_CHARS:
        continue
      if total + len(docstring) > max_bytes:
        return documents
      documents.append(docstring)
      total += len(docstring)
  return documents


def write_jsonl(documents: list[str], path: Path) -> dict[str, int]:
  """``{"text": ...}`` rows; returns the row and character counts."""
  with open(path, "w", encoding="utf-8") as rows:
    for document in documents:
      rows.write(json.dumps({"text": document}) + "\n")
  return {"rows": len(documents), "chars": sum(len(d) for d in documents),
          "file_bytes": path.stat().st_size}


def train_tokenizer(documents: list[str], vocab_size: int, directory: Path) -> int:
  """A byte-level BPE (Llama 3's kind) on ``documents``: tokenizer.json and a
  tokenizer_config.json naming BOS/EOS/pad. Returns its vocabulary size."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders  # pylint: disable=import-outside-toplevel
  from tokenizers import models as bpe_models  # pylint: disable=import-outside-toplevel
  from tokenizers import pre_tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import trainers  # pylint: disable=import-outside-toplevel

  tokenizer = Tokenizer(bpe_models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
      show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(documents, trainer=trainer)
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
      "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=1))
  if tokenizer.token_to_id(BOS_TOKEN) != BOS_ID or tokenizer.token_to_id(EOS_TOKEN) != EOS_ID:
    raise RuntimeError("the BPE trainer did not give BOS/EOS the first ids.")
  return tokenizer.get_vocab_size()


def write_initial_checkpoint(directory: Path, vocab_size: int, seed: int) -> None:
  """A random `PRESET` Llama with ``vocab_size`` tokens as a Hugging Face directory
  (``directory`` already holds the tokenizer), BOS/EOS ids in config.json."""
  preset = models.get_config(PRESET)
  assert isinstance(preset, models.LlamaConfig)
  config = dataclasses.replace(preset, vocab_size=vocab_size)
  llama_checkpoint.save_hf_checkpoint(models.create(config, rngs=nnx.Rngs(seed)), config,
                                      directory)
  config_path = directory / llama_checkpoint.CONFIG_FILE
  config_json = json.loads(config_path.read_text())
  config_json.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=2)
  config_path.write_text(json.dumps(config_json, indent=1))


def run_command(argv: list[str], metrics_path: Path) -> dict[str, Any]:
  """``python -m models.train ARGV --metrics-out PATH``, in this process: its metrics,
  the command line and its wall time (data, compile, steps, eval)."""
  argv = [*argv, "--metrics-out", str(metrics_path), "--no-progress"]
  start = time.perf_counter()
  train.main(argv)
  wall_s = time.perf_counter() - start
  metrics = json.loads(metrics_path.read_text())
  return {"command": "python -m models.train " + shlex.join(argv), "argv": argv,
          "wall_s": wall_s,
          "train_loss": metrics["train_loss"], "eval_loss": metrics["eval_loss"],
          "final_train_loss": metrics["final_train_loss"],
          "median_step_s": metrics["median_step_s"], "param_count": metrics["param_count"],
          "memory_total_bytes": metrics["memory"]["total_bytes"]}


def held_out_loss(argv: list[str], checkpoint: Path | None = None) -> float:
  """A checkpoint's loss on the held-out batches a run of ``argv`` scores (the
  harness's own data and evaluation): ``checkpoint``, else ``--init-from``'s."""
  config = train.train_config(argv)
  model_config = harness.model_config_of(config)
  _, eval_batches = harness.make_data(config, model_config)
  model = models.create_abstract(model_config)
  directory = config.init_from if checkpoint is None else checkpoint
  if directory is None or not isinstance(model_config, models.LlamaConfig):
    raise ValueError("a Llama checkpoint's run: pass --init-from or a checkpoint.")
  nnx.update(model, llama_checkpoint.load_hf_params(directory, model_config))
  loss_fn, params = models.split_loss_fn(model, has_aux=True)
  return float(harness.evaluate(loss_fn, params, eval_batches)["loss"])


def summarize(runs: list[dict[str, Any]], before: float) -> dict[str, dict[str, Any]]:
  """Per arm: held-out losses by seed, their median, the gap to Adam + accumulation's
  median and the drop from the pretrained model's loss."""
  summary = {}
  reference = statistics.median(r["eval_loss"] for r in runs if r["arm"] == "adam")
  for arm in (*ARMS, *CONTROLS):
    arm_runs = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
    if not arm_runs:
      continue
    median = statistics.median(r["eval_loss"] for r in arm_runs)
    summary[arm] = {"seeds": [r["seed"] for r in arm_runs],
                    "eval_loss": [r["eval_loss"] for r in arm_runs],
                    "median_eval_loss": median,
                    "vs_adam_percent": 100 * (median / reference - 1),
                    "drop_from_pretrained": before - median,
                    "median_step_s": statistics.median(r["median_step_s"] for r in arm_runs),
                    "wall_s": [r["wall_s"] for r in arm_runs]}
  return summary


def plot(runs: list[dict[str, Any]], before: float, path: Path) -> None:
  """One panel per arm: every seed's training loss (10-step mean, its unclipped
  control dotted), the pretrained model's held-out loss as a dashed line."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  figure, axes = plt.subplots(1, len(ARMS), figsize=(12, 4), sharey=True)
  for axis, arm in zip(axes, ARMS):
    for run in (r for r in runs if CONTROLS.get(r["arm"], r["arm"]) == arm):
      losses = np.asarray(run["train_loss"])
      window = min(10, len(losses))
      smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
      unclipped = run["arm"] in CONTROLS
      axis.plot(np.arange(len(smooth)) + window, smooth, linestyle=":" if unclipped else "-",
                label=f"{'unclipped, ' if unclipped else ''}seed {run['seed']}")
    axis.axhline(before, color="gray", linestyle="--", label="held-out, pretrained")
    axis.set_title(ARM_NAMES[arm])
    axis.set_xlabel("mini-batch step")
    axis.legend(fontsize=8)
  axes[0].set_ylabel("training loss (10-step mean)")
  figure.suptitle("Fine-tuning the pretrained llama_tiny on stdlib docstrings, --clip-norm 1.0")
  figure.tight_layout()
  figure.savefig(path, dpi=100)


def markdown(record: dict[str, Any]) -> str:
  """The results page's generated part: setting, commands, table."""
  setting, corpora, machine = record["setting"], record["corpora"], record["machine"]
  pretrain = record["pretrain"]
  lines = [
      f"Study command: `python benchmarks/scripts/finetune_study.py "
      f"{shlex.join(record['argv'])}` ({record['wall_s'] / 60:.1f} min in all).",
      f"Machine: {machine.get('cpu', machine.get('device'))}, {machine.get('backend')}, "
      f"jax {jax.__version__}.", "",
      f"- Model: `{PRESET}` with the tokenizer's vocabulary, "
      f"{pretrain['param_count']:,} parameters.",
      f"- Tokenizer: byte-level BPE, {record['vocab_size']:,} tokens, trained on the "
      "pretraining corpus.",
      f"- Pretraining corpus: {corpora['pretrain']['rows']:,} `.py` files of the standard "
      f"library's {', '.join(PRETRAIN_PACKAGES)} ({corpora['pretrain']['chars']:,} "
      "characters).",
      f"- Fine-tuning corpus: {corpora['finetune']['rows']:,} docstrings (module, class, "
      f"function; {MIN_DOCSTRING_CHARS}+ characters) of the standard library's top-level "
      f"modules ({corpora['finetune']['chars']:,} characters); `models.text` holds out "
      "every tenth document.",
      f"- Rows: {setting['batch_size']} x {setting['seq_len']} tokens per mini-batch, "
      f"N = {setting['num_micro_batches']} micro-batches; warm-up {setting['warmup_steps']} "
      "steps then cosine to a tenth.",
      f"- Pretraining: {setting['pretrain_steps']} steps of Adam + accumulation at lr "
      f"{setting['pretrain_learning_rate']:g}, {pretrain['wall_s']:.0f} s: `{pretrain['command']}`",
      f"- Fine-tuning: {setting['finetune_steps']} steps at lr "
      f"{setting['finetune_learning_rate']:g}, --clip-norm {setting['clip_norm']:g}, per "
      f"run e.g. `{record['runs'][0]['command']}`", "",
      f"Held-out loss of the fine-tuning corpus before fine-tuning (the pretrained "
      f"model): **{record['before_finetune_eval_loss']:.4f}**.", "",
      "| arm | held-out loss (median) | per seed | vs Adam + accumulation | drop from "
      "pretrained | step ms (median) | wall s per run |",
      "|---|---|---|---|---|---|---|"]
  for arm, row in record["summary"].items():
    seeds = ", ".join(f"{x:.4f}" for x in row["eval_loss"])
    walls = ", ".join(f"{x:.0f}" for x in row["wall_s"])
    lines.append(f"| {ARM_NAMES[arm]} | {row['median_eval_loss']:.4f} | {seeds} | "
                 f"{row['vs_adam_percent']:+.2f}% | {row['drop_from_pretrained']:.4f} | "
                 f"{row['median_step_s'] * 1e3:.1f} | {walls} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--vocab-size", type=int, default=2048)
  parser.add_argument("--pretrain-bytes", type=int, default=1_500_000)
  parser.add_argument("--finetune-bytes", type=int, default=600_000)
  parser.add_argument("--pretrain-steps", type=int, default=400)
  parser.add_argument("--pretrain-learning-rate", type=float, default=3e-3)
  parser.add_argument("--finetune-steps", type=int, default=150)
  parser.add_argument("--finetune-learning-rate", type=float, default=1e-3)
  parser.add_argument("--warmup-steps", type=int, default=15)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--num-micro-batches", type=int, default=4)
  parser.add_argument("--clip-norm", type=float, default=1.0)
  parser.add_argument("--eval-batches", type=int, default=16)
  parser.add_argument("--unclipped-controls", action="store_true",
                      help="also fine-tune Adam + accumulation and AdamA without --clip-norm")
  parser.add_argument("--work-dir", type=Path, default=Path("/tmp/finetune_study"),
                      help="corpora, checkpoints and metrics; must not hold a checkpoint")
  parser.add_argument("--json", type=Path, default=RESULTS / "raw" / "finetune.json")
  parser.add_argument("--png", type=Path, default=RESULTS / "finetune.png")
  parser.add_argument("--markdown", type=Path, default=None,
                      help="also write the tables here (they are printed either way)")
  args = parser.parse_args(argv)
  work = args.work_dir
  work.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()

  pretrain_docs = pretrain_documents(args.pretrain_bytes)
  corpora = {"pretrain": write_jsonl(pretrain_docs, work / "pretrain.jsonl"),
             "finetune": write_jsonl(finetune_documents(args.finetune_bytes),
                                     work / "finetune.jsonl")}
  initial, pretrained = work / "initial", work / "pretrained"
  for directory in (initial, pretrained):  # this script's own outputs of an earlier run
    shutil.rmtree(directory, ignore_errors=True)
  vocab_size = train_tokenizer(pretrain_docs, args.vocab_size, initial)
  write_initial_checkpoint(initial, vocab_size, seed=0)
  shape = ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--num-micro-batches", str(args.num_micro_batches),
           "--warmup-steps", str(args.warmup_steps), "--eval-batches", str(args.eval_batches)]
  pretrain = run_command(
      ["--model", "llama", "--init-from", str(initial), "--data-path", str(work / "pretrain.jsonl"),
       "--optimizer", "adam", "--steps", str(args.pretrain_steps),
       "--learning-rate", str(args.pretrain_learning_rate), *shape,
       "--save-hf", str(pretrained)], work / "pretrain_metrics.json")
  print(f"pretrained: held-out {pretrain['eval_loss']:.4f} ({pretrain['wall_s']:.0f} s)",
        file=sys.stderr, flush=True)

  def finetune_argv(arm: str, seed: int) -> list[str]:
    clip = [] if arm in CONTROLS else ["--clip-norm", str(args.clip_norm)]
    return ["--model", "llama", "--init-from", str(pretrained),
            "--data-path", str(work / "finetune.jsonl"),
            "--optimizer", CONTROLS.get(arm, arm), *clip, "--steps", str(args.finetune_steps),
            "--learning-rate", str(args.finetune_learning_rate), "--seed", str(seed), *shape]

  before = held_out_loss(finetune_argv("adam", args.seeds[0]))
  print(f"before fine-tuning: held-out {before:.4f}", file=sys.stderr, flush=True)
  runs = []
  for seed in args.seeds:
    for arm in (*ARMS, *(CONTROLS if args.unclipped_controls else ())):
      run = run_command(finetune_argv(arm, seed), work / f"finetune_{arm}_{seed}.json")
      runs.append({"arm": arm, "seed": seed, **run})
      print(f"{arm} seed {seed}: held-out {run['eval_loss']:.4f} ({run['wall_s']:.0f} s)",
            file=sys.stderr, flush=True)
  record = {
      "argv": sys.argv[1:] if argv is None else argv, "machine": machine_info(),
      "vocab_size": vocab_size, "corpora": corpora,
      "setting": {"batch_size": args.batch_size, "seq_len": args.seq_len,
                  "num_micro_batches": args.num_micro_batches,
                  "warmup_steps": args.warmup_steps, "eval_batches": args.eval_batches,
                  "pretrain_steps": args.pretrain_steps,
                  "pretrain_learning_rate": args.pretrain_learning_rate,
                  "finetune_steps": args.finetune_steps,
                  "finetune_learning_rate": args.finetune_learning_rate,
                  "clip_norm": args.clip_norm},
      "pretrain": pretrain, "before_finetune_eval_loss": before, "runs": runs,
      "summary": summarize(runs, before), "wall_s": time.perf_counter() - start}
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(record, indent=1))
  plot(runs, before, args.png)
  tables = markdown(record)
  if args.markdown is not None:
    args.markdown.write_text(tables)
  print(tables)
  return record


if __name__ == "__main__":
  main()
