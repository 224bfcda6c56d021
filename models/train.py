"""Train a GPT, BERT, ViT or Llama with AdamA or a gradient-accumulation baseline.

    python -m models.train --model gpt --preset gpt_tiny --optimizer adama \
        --num-micro-batches 4 --batch-size 32 --steps 300 --seed 0 \
        --metrics-out run.json

Every optimizer runs through `optax_adama.microbatch_step`, so the comparison is
on equal terms: the same micro-batches, the same donation, one jitted call per
mini-batch (`--scan-layers --release`: AdamA through `optax_adama.release_step`,
the same updates with one layer's gradient alive at a time). `--compare` trains
AdamA and Adam with gradient accumulation on the same data and prints their
compiled memory and final losses side by side (the project's main job, `make
demo`). `--model llama --init-from DIR` fine-tunes a Hugging Face Llama
checkpoint (`models.llama_checkpoint`) instead of training from scratch.

The command line only: the training run itself (`TrainConfig`, `train`) lives
in `models.harness`, below this and the other commands that train
(models.validate, models.demo), and `--plan` asks `models.planner`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import models
from models import data
from models import harness
from models import planner
from models import savers
from models import text

# Options only one side of `--compare` takes; the other side keeps its default.
ADAMA_ONLY = ("nu_dtype", "quantize_moments", "nu_estimator", "split_floor", "release")
ACCUMULATION_ONLY = ("accumulation_dtype",)


def config_for(options: dict[str, Any], optimizer: str) -> harness.TrainConfig:
  """The run of `optimizer` from `options`, less what only the other optimizer takes.

  `--compare --nu-estimator momentum --accumulation-dtype bfloat16` then means
  AdamA with the momentum estimator against Adam with a bf16 accumulator.
  """
  dropped = ACCUMULATION_ONLY if optimizer == "adama" else ADAMA_ONLY
  return harness.TrainConfig(**{**{k: v for k, v in options.items() if k not in dropped},
                                "optimizer": optimizer})


def comparison_table(runs: Sequence[dict[str, Any]]) -> str:
  """A markdown table: one row per run, memory in MB and in P."""
  head = ("| optimizer | N | compiled step memory | eval loss | final train loss | tokens/s |\n"
          "|---|---|---|---|---|---|")
  rows = [
      f"| {r['config']['optimizer']} | {r['config']['num_micro_batches']} "
      f"| {r['memory']['total_bytes'] / 2**20:.2f} MiB ({r['memory']['total_p']:.2f} P) "
      f"| {r['eval_loss']:.4f} | {r['final_train_loss']:.4f} | {_tokens_per_s(r)} |"
      for r in runs
  ]
  return "\n".join([head, *rows])


def build_parser() -> argparse.ArgumentParser:
  """The command's parser; every flag's help ends with its default, written once.

  The defaults are in the help strings by hand (``%(default)s`` where the
  value itself says it), not through ``ArgumentDefaultsHelpFormatter``: that
  one skips flags without help text and appends ``(default: None)`` to flags
  whose ``None`` means something ("the params' dtype"), so half the flags
  showed no default and others showed two.
  """
  defaults = harness.TrainConfig()
  parser = argparse.ArgumentParser(
      prog="python -m models.train", description=__doc__.split("\n\n")[0])
  _add_run_args(parser.add_argument_group("model, data and schedule"), defaults)
  _add_memory_args(parser.add_argument_group("memory savers"), defaults)
  _add_optimizer_args(parser.add_argument_group("optimizer state and estimator"), defaults)
  _add_output_args(parser.add_argument_group("output and checkpoints"))
  harness.add_device_args(parser.add_argument_group(
      "devices: the mesh, its ZeRO stage, several hosts (jax.distributed)"))
  return parser


def _tokens_per_s(run: dict[str, Any]) -> str:
  # None: the run trained no step in this process (it was finished already).
  return "-" if run["tokens_per_s"] is None else f"{run['tokens_per_s']:,.0f}"


def _trained_nothing(run: dict[str, Any]) -> bool:
  """Whether the run's checkpoint had all its steps, so this process trained none."""
  return run["resumed_from"] is not None and run["resumed_from"] >= run["config"]["steps"]


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  """The parser (for the errors found later) and the arguments, checked together."""
  parser = build_parser()
  args = parser.parse_args(argv)
  args.model = _model_of(args)
  # Before anything touches a device: the processes join into one set of devices.
  harness.start_processes(args, parser)
  args.mesh_devices = harness.mesh_devices_of(args.mesh_devices, parser, args.shard_states)
  args.shard_states = harness.stage_of(args.shard_states)
  _check_args(parser, args)
  return parser, args


def _model_of(args: argparse.Namespace) -> str:
  """``--model``, or the model ``--preset`` or ``--init-from`` already names.

  ``--preset llama_test`` or ``--init-from DIR`` alone trains the Llama; an
  explicit ``--model`` that contradicts either is still refused.
  """
  if args.model is not None:
    return args.model
  if args.init_from is not None:  # a Hugging Face Llama directory
    return "llama"
  if args.preset is not None:
    return harness.MODEL_KIND_OF_CONFIG[type(models.PRESETS[args.preset])]
  return harness.TrainConfig().model


def _add_run_args(group: Any, defaults: harness.TrainConfig) -> None:
  group.add_argument("--model", choices=harness.MODEL_KINDS, default=None,
                     help=f"the model family (default: --preset's, llama with --init-from, else "
                          f"{defaults.model})")
  group.add_argument("--preset", default=None, choices=sorted(models.PRESETS),
                     help="the model and its size; names the model, so --model can be "
                          "omitted (default: <model>_tiny)")
  group.add_argument("--optimizer", choices=harness.OPTIMIZERS, default=defaults.optimizer,
                     help="adama: AdamA; adam: optax.adamw on the mean gradient of the "
                          "micro-batches (gradient accumulation); multisteps: optax.MultiSteps "
                          "(default: %(default)s)")
  group.add_argument("--num-micro-batches", type=int, default=defaults.num_micro_batches,
                     metavar="N", help="micro-batches per step; N must divide --batch-size "
                                       "(default: %(default)s)")
  group.add_argument("--batch-size", type=int, default=defaults.batch_size,
                     help="examples per optimizer step (the mini-batch, split into N "
                          "micro-batches) (default: %(default)s)")
  group.add_argument("--seq-len", type=int, default=defaults.seq_len,
                     help="tokens per example, text models (gpt, bert: cut to the preset's "
                          "max_len; llama: at most its max_len) (default: %(default)s)")
  group.add_argument("--steps", type=int, default=defaults.steps,
                     help="optimizer steps (mini-batches) to train; a --checkpoint-dir run "
                     "resumed with a larger value continues, its warm-up + cosine schedule "
                     "rebuilt over the new total (default: %(default)s)")
  group.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                     help="peak learning rate: linear warm-up to it, then cosine decay to a "
                          "tenth of it (default: %(default)g)")
  group.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                     help="steps of warm-up, at most half of --steps (default: %(default)s)")
  group.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                     help="decoupled weight decay (AdamW's) (default: %(default)g)")
  group.add_argument("--seed", type=int, default=defaults.seed,
                     help="seed of the initial params and the data order (default: %(default)s)")
  group.add_argument("--eval-batches", type=int, default=defaults.eval_batches,
                     help="held-out batches the final eval loss is the mean of, at most the "
                          "held-out split's (default: %(default)s)")
  group.add_argument("--data-path", default=None,
                     help="your own text file or directory, gpt/bert/llama (default: Python's "
                          "standard library sources)")
  group.add_argument("--max-bytes", type=int, default=defaults.max_bytes,
                     help="bytes of the standard library's sources read, without --data-path "
                          "(default: %(default)s)")
  group.add_argument("--init-from", default=None, metavar="DIR",
                     help="llama: fine-tune from a Hugging Face checkpoint directory "
                          "(config.json and safetensors); the model is its config.json's, "
                          "so --preset is omitted or names the same model (default: train "
                          "from a random initialisation)")


def _add_memory_args(group: Any, defaults: harness.TrainConfig) -> None:
  group.add_argument("--remat", choices=sorted(models.REMAT_POLICIES), default=defaults.remat,
                     help="what the backward pass recomputes instead of keeping "
                          "(default: %(default)s)")
  group.add_argument("--dtype", choices=models.COMPUTE_DTYPES, default=defaults.dtype,
                     help="compute dtype; params, moments and updates stay float32 "
                          "(bfloat16: mixed precision, as on a GPU) (default: %(default)s)")
  group.add_argument("--param-dtype", choices=harness.PARAM_DTYPES,
                     default=defaults.param_dtype,
                     help="params' storage; bfloat16 halves them (moments follow unless "
                          "--mu-dtype / --nu-dtype say otherwise) (default: %(default)s)")
  group.add_argument("--param-rounding", choices=harness.PARAM_ROUNDINGS,
                     default=defaults.param_rounding,
                     help="how bfloat16 params take their update: stochastic rounding "
                          "(optax_adama.contrib.round_params_stochastically) or optax's "
                          "round to nearest (default: %(default)s)")
  group.add_argument("--gelu-bits", type=int, choices=savers.CODE_BITS, default=None,
                     help="GELU backward from a code of this many bits (models.savers) "
                          "(default: the exact GELU backward)")
  group.add_argument("--linear-keep-ratio", type=float, default=None,
                     help="MLP output projection's weight gradient from this share of its "
                          "input rows (models.savers.sampled_matmul) (default: all rows, exact)")
  group.add_argument("--loss-chunks", type=int, default=defaults.loss_chunks,
                     help="gpt, llama: the LM head's loss over this many chunks of tokens, one "
                          "chunk's logits alive at a time (models.savers) (default: %(default)s)")
  group.add_argument("--scan-layers", action="store_true",
                     help="blocks' params stacked and run under one lax.scan (default: off)")
  group.add_argument("--release", action="store_true",
                     help="with --scan-layers, adama: gradient release (optax_adama."
                          "release_step), one layer's gradient alive at a time (default: off)")
  group.add_argument("--plan", type=float, default=None, metavar="BUDGET_GB",
                     help="models.plan's planner chooses N, remat, savers and moment storage "
                          "to fit this many GB at the best predicted step time (overrides them) "
                          "(default: off, the flags as given)")


def _add_optimizer_args(group: Any, defaults: harness.TrainConfig) -> None:
  group.add_argument("--mu-dtype", choices=harness.MOMENT_DTYPES, default=None,
                     help="first-moment dtype (default: the params' dtype)")
  group.add_argument("--nu-dtype", choices=harness.MOMENT_DTYPES, default=None,
                     help="second-moment dtype, adama only (default: the params' dtype)")
  group.add_argument("--quantize-moments", action="store_true",
                     help="8-bit block-wise moments (optax_adama.BlockQuantization), adama "
                          "only (default: off)")
  group.add_argument("--nu-estimator", choices=harness.NU_ESTIMATOR_NAMES,
                     default=defaults.nu_estimator,
                     help="AdamA's second-moment estimator, adama only (default: %(default)s)")
  group.add_argument("--no-split-floor", dest="split_floor", action="store_false",
                     help="'auto'/'split' without their floor (optax_adama.adama's "
                          "split_floor=False), adama only (default: off, with the floor)")
  group.add_argument("--accumulation-dtype", choices=harness.MOMENT_DTYPES, default=None,
                     help="gradient accumulator dtype, adam only (default: the params' dtype)")
  group.add_argument("--clip-norm", type=float, default=None, metavar="X",
                     help="clip the mini-batch gradient's global norm to X: adama without a "
                          "gradient buffer (optax_adama.clipped_by_global_norm, one "
                          "mini-batch late), adam / multisteps with "
                          "optax.clip_by_global_norm (default: off)")


def _add_output_args(group: Any) -> None:
  checkpoint = harness.CheckpointOptions("")
  group.add_argument("--metrics-out", type=Path, default=None, metavar="PATH",
                     help="write the run(s) as JSON here (default: not written)")
  group.add_argument("--compare", action="store_true",
                     help="train AdamA and Adam with gradient accumulation, print both "
                          "(default: off, one --optimizer)")
  group.add_argument("--save-hf", type=Path, default=None, metavar="DIR",
                     help="after training, write the Llama to DIR as a Hugging Face checkpoint "
                     "(safetensors, config.json that transformers 4 and 5 read, and "
                     "--init-from's tokenizer files); DIR must not hold one (default: off)")
  group.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                     help="save params, optimizer state, step and data position here (orbax, "
                          "in the background) and resume from the newest complete checkpoint "
                          "when started again with the same directory (default: no checkpoints)")
  group.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                     help="with --checkpoint-dir: steps between saves (the last step and "
                          f"SIGTERM / SIGINT save too) (default: {checkpoint.every})")
  group.add_argument("--keep", type=int, default=None, metavar="N",
                     help="with --checkpoint-dir: how many of the newest checkpoints to "
                          f"keep (default: {checkpoint.keep})")
  group.add_argument("--no-progress", action="store_true",
                     help="no progress bar on stderr (default: off, the bar is shown)")


# Numeric flags' smallest values, checked on the command line before anything
# loads or compiles; past here a 0 divides (--seq-len in models.data) or a
# negative seed fails inside numpy, each as a traceback mid-run.
# (--steps, --batch-size, --num-micro-batches: TrainConfig checks them.)
_AT_LEAST = (("seq_len", 1), ("eval_batches", 1), ("max_bytes", 1), ("warmup_steps", 0),
             ("seed", 0))


def _flag(dest: str) -> str:
  return "--" + dest.replace("_", "-")


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Numbers out of their range, refused with the flag and the value."""
  for dest, least in _AT_LEAST:
    value = getattr(args, dest)
    if value < least:
      parser.error(f"{_flag(dest)} {value}: it must be {least} or more.")
  # A learning rate of 0 trains nothing and a negative one climbs the loss
  # (the run still ends "successfully"); nan and inf poison every param.
  if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
    parser.error(f"--learning-rate {args.learning_rate}: it must be a positive number.")
  if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
    parser.error(f"--weight-decay {args.weight_decay}: it must be 0 or a positive number.")
  if args.clip_norm is not None and not (math.isfinite(args.clip_norm) and args.clip_norm > 0):
    parser.error(f"--clip-norm {args.clip_norm}: it must be a positive number.")
  if args.plan is not None and not (math.isfinite(args.plan) and args.plan > 0):
    parser.error(f"--plan {args.plan}: the budget must be a positive number of GB.")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Flags that only make sense together, refused with the fix."""
  _check_numbers(parser, args)
  for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--keep", args.keep)):
    if value is not None and args.checkpoint_dir is None:
      parser.error(f"{flag} needs --checkpoint-dir (where to save)")
    if value is not None and value < 1:
      parser.error(f"{flag} must be >= 1, got {value}")
  if args.checkpoint_dir is not None and args.compare:
    parser.error("--checkpoint-dir saves one run; --compare trains two: give each run "
                 "its own directory (run without --compare, once per --optimizer)")
  if args.save_hf is not None:
    if args.model != "llama":
      parser.error(f"--save-hf writes a Llama checkpoint; add --model llama "
                   f"(got --model {args.model})")
    if args.compare:
      parser.error("--save-hf writes one run; --compare trains two (run without --compare)")
    if (args.save_hf / "config.json").exists():
      parser.error(f"--save-hf {args.save_hf} already holds a checkpoint (config.json); "
                   "name an empty or new directory")
  if args.init_from is not None:
    if args.model != "llama":
      parser.error(f"--init-from loads a Llama checkpoint; add --model llama "
                   f"(got --model {args.model})")
    if args.plan is not None and args.preset is None:
      parser.error("--plan plans a preset: with --init-from, name the checkpoint's --preset")
    try:  # the checkpoint's config.json, and a --preset that disagrees with it
      harness.base_model_config(harness.TrainConfig(
          model="llama", preset=args.preset, init_from=args.init_from))
    except (OSError, ValueError) as error:
      parser.error(str(error))


def _planned(config: harness.TrainConfig, budget_gb: float, *,
             progress: bool) -> dict[str, Any]:
  """The TrainConfig fields `models.planner` chooses for `config` under `budget_gb`."""
  chosen = planner.plan(config.preset_name, budget_gb * 1e9, batch_size=config.batch_size,
                        seq_len=config.seq_len, devices=config.mesh_devices, progress=progress)
  print(planner.table(chosen))
  print(f"plan: {chosen.settings.describe()}, verified "
        f"{chosen.measurement.device_bytes / 1e9:.3f} GB of {budget_gb:g} GB")
  return planner.train_overrides(chosen.settings)


def _config_options(args: argparse.Namespace) -> dict[str, Any]:
  """The parsed arguments that are fields of ``harness.TrainConfig``."""
  fields = {f.name for f in dataclasses.fields(harness.TrainConfig)}
  return {k: v for k, v in vars(args).items() if k in fields}


def train_config(argv: Sequence[str]) -> harness.TrainConfig:
  """The run ``python -m models.train ARGV`` trains (one side, without
  ``--plan``'s search), checked as the command line is, without training it."""
  parser, args = _parse_args(argv)
  with harness.command_errors(parser):
    return harness.TrainConfig(**_config_options(args))


def _runs(parser: argparse.ArgumentParser, args: argparse.Namespace,
          ) -> tuple[list[harness.TrainConfig], harness.CheckpointOptions | None]:
  """The runs the command trains, each checked, and where they save.

  Every user error (a setting the library refuses, a plan nothing fits,
  checkpoints of another run) ends the command here, before any training.
  """
  with harness.command_errors(parser, OSError):
    options = _config_options(args)
    if args.plan is not None:
      options.update(_planned(harness.TrainConfig(**options), args.plan,
                              progress=not args.no_progress))
    if args.compare:
      run_configs = [config_for(options, o) for o in ("adama", "adam")]
    else:
      run_configs = [harness.TrainConfig(**options)]
    checkpoint = None
    if args.checkpoint_dir is not None:
      defaults = harness.CheckpointOptions(str(args.checkpoint_dir))
      checkpoint = harness.CheckpointOptions(
          defaults.directory, every=args.checkpoint_every or defaults.every,
          keep=args.keep or defaults.keep)
    for run_config in run_configs:
      harness.check_run(run_config, checkpoint)
    # --compare's runs read the same data: one check covers both.
    _check_data(run_configs[0])
  return run_configs, checkpoint


def _check_data(config: harness.TrainConfig) -> None:
  """Raises ``ValueError`` where the run's data cannot fill its batches.

  Reads the data as ``harness.make_data`` will (about a second for the
  default 2 MB of text), so a split too short for ``--seq-len`` and
  ``--batch-size`` is a one-line error naming the split here, not a traceback
  after the step has compiled.
  """
  model_config = harness.model_config_of(config)
  if config.model == "vit":  # the held-out batches are capped at the split: only training fails
    try:
      harness.make_data(config, model_config)
    except ValueError as error:
      raise ValueError(f"the training images: {str(error).rstrip('.')}; pass a smaller "
                       "--batch-size.") from error
    return
  if harness.uses_packed_text(config.model, config.init_from, config.data_path):
    # Tokenizes (cached for the run that follows when --data-path is given)
    # and packs: bad rows, a tokenizer larger than the embedding and splits
    # smaller than a batch are refused here, before the step compiles.
    source = (f"--data-path {config.data_path}" if config.data_path is not None
              else "Python's standard library (--max-bytes)")
    try:
      harness.packed_text_batches(
          model_config, init_from=config.init_from, data_path=config.data_path,
          max_bytes=config.max_bytes, batch_size=config.batch_size,
          seq_len=min(config.seq_len, model_config.max_len), seed=config.seed)
    except text.DataError:
      raise
    except ValueError as error:
      raise ValueError(f"the training split of {source}: {str(error).rstrip('.')}; pass a "
                       "smaller --batch-size or --seq-len, or more text.") from error
    return
  if config.data_path is not None:
    corpus, source = data.load_text(config.data_path), f"--data-path {config.data_path}"
  else:
    corpus = data.load_stdlib_text(max_bytes=config.max_bytes)
    source = f"the first {config.max_bytes:,} bytes (--max-bytes) of Python's standard library"
  batches = data.lm_batches if config.model in harness.CAUSAL_LM_KINDS else data.mlm_batches
  seq_len = min(config.seq_len, model_config.max_len)  # as make_data clamps it
  for split, tokens in (("training", corpus.train), ("held-out", corpus.valid)):
    try:
      batches(tokens, batch_size=config.batch_size, seq_len=seq_len)
    except ValueError as error:
      raise ValueError(f"the {split} split of {source}: {str(error).rstrip('.')}; pass a "
                       "smaller --batch-size or --seq-len, or more text.") from error


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  parser, args = _parse_args(argv)
  run_configs, checkpoint = _runs(parser, args)
  config = run_configs[0]
  runs = [harness.train(run_config, progress=not args.no_progress, checkpoint=checkpoint,
                        hf_directory=args.save_hf)
          for run_config in run_configs]
  for run in runs:
    if _trained_nothing(run):
      # No step ran here, so there is no step time: the harness's median of
      # none is nan, which the table printed as "tokens/s nan" and the JSON
      # as NaN (not JSON). None says "not measured" in both.
      run.update(median_step_s=None, steps_per_s=None, tokens_per_s=None)
      print(f"{run['preset']}/{run['config']['optimizer']}: already finished at step "
            f"{run['resumed_from']} in {checkpoint.directory}; nothing trained (the eval "
            "loss is the checkpoint's params'; no step time, so no tokens/s)")
  print(f"\n{config.preset_name}: {runs[0]['param_count']:,} parameters, "
        f"batch {config.batch_size} = {config.num_micro_batches} micro-batches, "
        f"{config.steps} steps, on {runs[0]['machine']['device']}")
  print(comparison_table(runs))
  if args.compare:
    adama, adam = runs
    saved = adam["memory"]["total_bytes"] - adama["memory"]["total_bytes"]
    print(f"AdamA saves {saved / 2**20:.2f} MiB ({saved / adama['memory']['param_bytes']:.2f} P) "
          f"of compiled step memory; eval loss differs by "
          f"{100 * (adama['eval_loss'] / adam['eval_loss'] - 1):+.2f}%.")
  if args.metrics_out is not None:
    args.metrics_out.parent.mkdir(parents=True, exist_ok=True)
    payload = runs[0] if len(runs) == 1 else {"runs": runs}
    args.metrics_out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.metrics_out}")
  if args.save_hf is not None:
    print(f"wrote {args.save_hf}: a Hugging Face checkpoint of the trained model")
  return runs


if __name__ == "__main__":
  main()
