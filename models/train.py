"""Train a GPT, BERT or ViT with AdamA or a gradient-accumulation baseline.

    python -m models.train --model gpt --preset gpt_tiny --optimizer adama \
        --num-micro-batches 4 --batch-size 32 --steps 300 --seed 0 \
        --metrics-out run.json

Every optimizer runs through `optax_adama.microbatch_step`, so the comparison is
on equal terms: the same micro-batches, the same donation, one jitted call per
mini-batch (`--scan-layers --release`: AdamA through `optax_adama.release_step`,
the same updates with one layer's gradient alive at a time). `--compare` trains
AdamA and Adam with gradient accumulation on the same data and prints their
compiled memory and final losses side by side (the project's main job, `make
demo`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models import data, savers

MODEL_KINDS = ("gpt", "bert", "vit")
OPTIMIZERS = ("adama", "adam", "multisteps")
MOMENT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run. Field names match the command-line flags."""

  model: str = "gpt"
  preset: str | None = None  # None: f"{model}_tiny".
  optimizer: str = "adama"
  num_micro_batches: int = 4
  batch_size: int = 32  # mini-batch size; micro-batches are batch_size / N.
  seq_len: int = 64  # text models only.
  steps: int = 300
  learning_rate: float = 2e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  seed: int = 0
  eval_batches: int = 16
  data_path: str | None = None  # a user text file or directory (text models).
  max_bytes: int = 2_000_000  # corpus cap for the standard-library text.
  remat: str = "none"
  gelu_bits: int | None = None  # few-bit GELU backward (models.savers); None: exact.
  linear_keep_ratio: float | None = None  # sampled MLP projection backward (models.savers).
  loss_chunks: int = 1  # gpt: the LM head's loss over this many chunks of tokens.
  scan_layers: bool = False  # blocks stacked under one lax.scan (what models.plan plans).
  # AdamA's gradient release (optax_adama.release_step): each scanned layer's
  # gradient folded and dropped in the backward scan. Needs scan_layers, adama.
  release: bool = False
  # Moment storage, as `optax_adama.adamaw` takes it. None: the params' dtype.
  mu_dtype: str | None = None  # e.g. "bfloat16"; adam/multisteps take it too.
  nu_dtype: str | None = None  # adama only (optax.adamw has no nu_dtype).
  quantize_moments: bool = False  # 8-bit BlockQuantization(); adama only.
  nu_estimator: str = "mean"  # AdamA's second-moment estimator; adama only.
  accumulation_dtype: str | None = None  # adam only: the accumulator's dtype.

  def __post_init__(self):
    if self.model not in MODEL_KINDS:
      raise ValueError(f"model must be one of {MODEL_KINDS}, got {self.model!r}.")
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}.")
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}.")
    if self.num_micro_batches < 1:
      raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}.")
    if self.batch_size % self.num_micro_batches:
      raise ValueError(
          f"batch size {self.batch_size} does not split into "
          f"num_micro_batches={self.num_micro_batches} equal micro-batches.")
    for name in ("mu_dtype", "nu_dtype"):
      value = getattr(self, name)
      if value is not None and value not in MOMENT_DTYPES:
        raise ValueError(f"{name} must be one of {MOMENT_DTYPES} or None, got {value!r}.")
    if self.optimizer != "adama":
      if self.nu_dtype is not None:
        raise ValueError(
            f"nu_dtype={self.nu_dtype!r} needs optimizer='adama' (optax.adamw has no "
            f"nu_dtype), got optimizer={self.optimizer!r}.")
      if self.quantize_moments:
        raise ValueError(
            "quantize_moments (8-bit moments) needs optimizer='adama', got "
            f"optimizer={self.optimizer!r}.")
      if self.nu_estimator != "mean":
        raise ValueError(
            f"nu_estimator={self.nu_estimator!r} needs optimizer='adama', got "
            f"optimizer={self.optimizer!r}.")
    if self.nu_estimator not in optax_adama.NU_ESTIMATORS:
      raise ValueError(f"nu_estimator must be one of {optax_adama.NU_ESTIMATORS}, "
                       f"got {self.nu_estimator!r}.")
    if self.release and not (self.scan_layers and self.optimizer == "adama"):
      raise ValueError(
          "release (optax_adama.release_step) needs scan_layers=True and optimizer='adama', "
          f"got scan_layers={self.scan_layers}, optimizer={self.optimizer!r}.")
    if self.accumulation_dtype is not None:
      if self.accumulation_dtype not in MOMENT_DTYPES:
        raise ValueError(f"accumulation_dtype must be one of {MOMENT_DTYPES} or None, "
                         f"got {self.accumulation_dtype!r}.")
      if self.optimizer != "adam":
        raise ValueError(
            f"accumulation_dtype={self.accumulation_dtype!r} is for gradient "
            f"accumulation (optimizer='adam'), got optimizer={self.optimizer!r}.")

  @property
  def preset_name(self) -> str:
    return self.preset or f"{self.model}_tiny"


# Options only one side of `--compare` takes; the other side keeps its default.
ADAMA_ONLY = ("nu_dtype", "quantize_moments", "nu_estimator", "release")
ACCUMULATION_ONLY = ("accumulation_dtype",)


def config_for(options: dict[str, Any], optimizer: str) -> TrainConfig:
  """The run of `optimizer` from `options`, less what only the other optimizer takes.

  `--compare --nu-estimator momentum --accumulation-dtype bfloat16` then means
  AdamA with the momentum estimator against Adam with a bf16 accumulator.
  """
  dropped = ACCUMULATION_ONLY if optimizer == "adama" else ADAMA_ONLY
  return TrainConfig(**{**{k: v for k, v in options.items() if k not in dropped},
                        "optimizer": optimizer})


def warmup_cosine_schedule(
    learning_rate: float, steps: int, warmup_steps: int
) -> optax.Schedule:
  """Linear warm-up from 0 to `learning_rate`, then cosine decay to a tenth of it.

  Args:
    learning_rate: the peak learning rate.
    steps: length of the schedule, in optimizer (mini-batch) steps.
    warmup_steps: steps of linear warm-up; capped at `steps // 2`, so short
      runs (smoke tests) keep at least half their steps after warm-up.

  Returns:
    The schedule, a function of the step count.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}.")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
  return optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, min(warmup_steps, steps // 2), steps,
      end_value=0.1 * learning_rate)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """The optimizer of a run; every one counts its schedule in mini-batches."""
  schedule = warmup_cosine_schedule(config.learning_rate, config.steps, config.warmup_steps)
  if config.optimizer == "adama":
    quantization = optax_adama.BlockQuantization() if config.quantize_moments else None
    return optax_adama.adamaw(
        schedule, weight_decay=config.weight_decay,
        num_micro_batches=config.num_micro_batches, mu_dtype=config.mu_dtype,
        nu_dtype=config.nu_dtype, quantization=quantization,
        nu_estimator=config.nu_estimator)
  adamw = optax.adamw(schedule, weight_decay=config.weight_decay, mu_dtype=config.mu_dtype)
  if config.optimizer == "multisteps":
    return optax.MultiSteps(adamw, every_k_schedule=config.num_micro_batches)
  return adamw  # microbatch_step accumulates the mean gradient for it.


def model_config_of(config: TrainConfig) -> models.Config:
  """The model config of a run: its preset with the run's remat, savers and layout."""
  if config.loss_chunks != 1 and config.model != "gpt":
    raise ValueError(f"loss_chunks is GPT's (its tied LM head), not {config.model!r}'s.")
  chunks = {"loss_chunks": config.loss_chunks} if config.loss_chunks != 1 else {}
  return models.get_config(config.preset_name, remat=config.remat, gelu_bits=config.gelu_bits,
                           scan_layers=config.scan_layers,
                           linear_keep_ratio=config.linear_keep_ratio, **chunks)


def make_step(config: TrainConfig, model: nnx.Module, loss_fn: Callable,
              tx: optax.GradientTransformation) -> Callable:
  """The jitted training step: `release_step` on the model's stages, or `microbatch_step`.

  Both take and return the same (params, opt_state, batch) and metrics with
  "loss"; the release's loss is the head's (it has no accuracy aux).
  """
  if config.release:
    staged, _ = models.staged_loss(model)
    return optax_adama.release_step(staged, tx)
  return optax_adama.microbatch_step(
      loss_fn, tx, num_micro_batches=config.num_micro_batches, has_aux=True,
      accumulation_dtype=config.accumulation_dtype)


def make_data(config: TrainConfig, model_config: Any) -> tuple[Iterator[dict], list[dict]]:
  """(training batch stream, fixed list of held-out batches) for a run."""
  if config.model == "vit":
    digits = data.load_digits(seed=0)
    train = data.image_batches(
        digits.train_images, digits.train_labels, batch_size=config.batch_size,
        seed=config.seed)
    # Capped at the held-out split (359 digits), so a mini-batch larger than it
    # is scored on the whole split, in one batch; smaller ones as before.
    valid = data.image_batches(
        digits.valid_images, digits.valid_labels,
        batch_size=min(config.batch_size, len(digits.valid_labels)),
        shuffle=False, epochs=1)
  else:
    text = (data.load_text(config.data_path) if config.data_path
            else data.load_stdlib_text(max_bytes=config.max_bytes))
    seq_len = min(config.seq_len, model_config.max_len)
    batches = data.lm_batches if config.model == "gpt" else data.mlm_batches
    train = batches(text.train, batch_size=config.batch_size, seq_len=seq_len,
                    seed=config.seed)
    # Held-out masks are drawn from a fixed seed: every run scores the same task.
    valid = batches(text.valid, batch_size=config.batch_size, seq_len=seq_len,
                    seed=1234, shuffle=False, epochs=1)
  eval_batches = [b for _, b in zip(range(config.eval_batches), valid)]
  if not eval_batches:
    raise ValueError("the held-out split is too small for one batch.")
  return train, eval_batches


def tokens_per_example(model_config: models.Config, batch: dict) -> int:
  """Positions the model processes per example (patches + CLS for the ViT)."""
  if isinstance(model_config, models.ViTConfig):
    return model_config.num_patches + 1
  length = batch["tokens"].shape[1]
  # GPT batches carry one extra token: the last target.
  return length - 1 if isinstance(model_config, models.GPTConfig) else length


def evaluate(loss_fn, params, batches: Sequence[dict]) -> dict[str, float]:
  """Mean loss and aux metrics over held-out batches."""
  eval_step = jax.jit(loss_fn)
  totals: dict[str, float] = {}
  for batch in batches:
    loss, aux = eval_step(params, batch)
    for name, value in {"loss": loss, **aux}.items():
      totals[name] = totals.get(name, 0.0) + float(value)
  return {name: value / len(batches) for name, value in totals.items()}


def train(config: TrainConfig, *, progress: bool = True) -> dict[str, Any]:
  """Trains one model and returns its metrics (see the module docstring)."""
  model_config = model_config_of(config)
  model = models.create(model_config, rngs=nnx.Rngs(config.seed))
  loss_fn, params = models.split_loss_fn(model, has_aux=True)
  tx = make_optimizer(config)
  step = make_step(config, model, loss_fn, tx)
  del model  # the loss merges params back into a fresh module each call
  opt_state = tx.init(params)
  train_batches, eval_batches = make_data(config, model_config)

  first = next(train_batches)
  compile_start = time.perf_counter()
  compiled = step.lower(params, opt_state, first).compile()
  compile_s = time.perf_counter() - compile_start
  memory = optax_adama.memory_report(compiled, param_bytes=optax_adama.memory.tree_bytes(params))
  tokens_per_step = config.batch_size * tokens_per_example(model_config, first)

  train_loss: list[float] = []
  step_times: list[float] = []
  bar = tqdm(total=config.steps, desc=f"{config.preset_name}/{config.optimizer}",
             disable=not progress, dynamic_ncols=True, file=sys.stderr)
  batch = first
  for i in range(config.steps):
    start = time.perf_counter()
    params, opt_state, metrics = compiled(params, opt_state, batch)
    loss = float(metrics["loss"])  # blocks: the timing covers the step
    step_times.append(time.perf_counter() - start)
    train_loss.append(loss)
    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / step_times[-1]:,.0f}")
    bar.update()
    if i + 1 < config.steps:
      batch = next(train_batches)
  bar.close()

  eval_metrics = evaluate(loss_fn, params, eval_batches)
  # The first steps include one-off work (allocation, caches): time the rest.
  steady = step_times[len(step_times) // 10:] or step_times
  median_step_s = float(np.median(steady))
  adama_state = optax_adama.find_adama_state(opt_state)
  return {
      "config": dataclasses.asdict(config),
      "preset": config.preset_name,
      "param_count": models.param_count(model_config),
      "train_loss": train_loss,
      "final_train_loss": float(np.mean(train_loss[-max(1, config.steps // 20):])),
      "eval_loss": eval_metrics["loss"],
      "eval_metrics": eval_metrics,
      "median_step_s": median_step_s,
      "steps_per_s": 1.0 / median_step_s,
      "tokens_per_s": tokens_per_step / median_step_s,
      "compile_s": compile_s,
      "memory": memory.to_dict(),
      "num_dropped": None if adama_state is None else int(adama_state.num_dropped),
      "machine": machine_info(),
  }


def cpu_name() -> str:
  """The CPU model, e.g. 'AMD EPYC 7B13', from /proc/cpuinfo where there is one."""
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
  """Where a result was measured: backend, device, CPU, versions."""
  device = jax.devices()[0]
  return {
      "backend": jax.default_backend(),
      "device": getattr(device, "device_kind", str(device)),
      "num_devices": jax.device_count(),
      "cpu": cpu_name(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "optax": optax.__version__,
  }


def comparison_table(runs: Sequence[dict[str, Any]]) -> str:
  """A markdown table: one row per run, memory in MB and in P."""
  head = ("| optimizer | N | compiled step memory | eval loss | final train loss | tokens/s |\n"
          "|---|---|---|---|---|---|")
  rows = [
      f"| {r['config']['optimizer']} | {r['config']['num_micro_batches']} "
      f"| {r['memory']['total_bytes'] / 2**20:.2f} MiB ({r['memory']['total_p']:.2f} P) "
      f"| {r['eval_loss']:.4f} | {r['final_train_loss']:.4f} | {r['tokens_per_s']:,.0f} |"
      for r in runs
  ]
  return "\n".join([head, *rows])


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  defaults = TrainConfig()
  parser = argparse.ArgumentParser(
      prog="python -m models.train", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--model", choices=MODEL_KINDS, default=defaults.model)
  parser.add_argument("--preset", default=None, choices=sorted(models.PRESETS),
                      help="default: <model>_tiny")
  parser.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
  parser.add_argument("--num-micro-batches", type=int, default=defaults.num_micro_batches)
  parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
  parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
  parser.add_argument("--steps", type=int, default=defaults.steps)
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
  parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
  parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument("--eval-batches", type=int, default=defaults.eval_batches)
  parser.add_argument("--data-path", default=None,
                      help="your own text file or directory (gpt/bert)")
  parser.add_argument("--max-bytes", type=int, default=defaults.max_bytes)
  parser.add_argument("--remat", choices=sorted(models.REMAT_POLICIES), default="none")
  parser.add_argument("--gelu-bits", type=int, choices=savers.CODE_BITS, default=None,
                      help="GELU backward from a code of this many bits (models.savers); "
                           "default: exact")
  parser.add_argument("--linear-keep-ratio", type=float, default=None,
                      help="MLP output projection's weight gradient from this share of its "
                           "input rows (models.savers.sampled_matmul); default: exact")
  parser.add_argument("--loss-chunks", type=int, default=defaults.loss_chunks,
                      help="gpt: the LM head's loss over this many chunks of tokens, one "
                           "chunk's logits alive at a time (models.savers)")
  parser.add_argument("--scan-layers", action="store_true",
                      help="blocks' params stacked and run under one lax.scan")
  parser.add_argument("--release", action="store_true",
                      help="with --scan-layers, adama: gradient release (optax_adama."
                           "release_step), one layer's gradient alive at a time")
  parser.add_argument("--plan", type=float, default=None, metavar="BUDGET_GB",
                      help="models.plan chooses N, remat, savers and moment storage to fit "
                           "this many GB at the best predicted step time (overrides them)")
  parser.add_argument("--mu-dtype", choices=MOMENT_DTYPES, default=None,
                      help="first-moment dtype (default: the params' dtype)")
  parser.add_argument("--nu-dtype", choices=MOMENT_DTYPES, default=None,
                      help="second-moment dtype, adama only (default: the params' dtype)")
  parser.add_argument("--quantize-moments", action="store_true",
                      help="8-bit block-wise moments (optax_adama.BlockQuantization), adama only")
  parser.add_argument("--nu-estimator", choices=optax_adama.NU_ESTIMATORS,
                      default=defaults.nu_estimator,
                      help="AdamA's second-moment estimator, adama only")
  parser.add_argument("--accumulation-dtype", choices=MOMENT_DTYPES, default=None,
                      help="gradient accumulator dtype, adam only (default: the params')")
  parser.add_argument("--metrics-out", type=Path, default=None,
                      help="write the run(s) as JSON here")
  parser.add_argument("--compare", action="store_true",
                      help="train AdamA and Adam with gradient accumulation, print both")
  parser.add_argument("--no-progress", action="store_true")
  return parser.parse_args(argv)


def _planned(config: TrainConfig, budget_gb: float, *, progress: bool) -> dict[str, Any]:
  """The TrainConfig fields `models.plan` chooses for `config` under `budget_gb`."""
  from models import plan  # models.plan imports this module.
  chosen = plan.plan(config.preset_name, budget_gb * 1e9, batch_size=config.batch_size,
                     seq_len=config.seq_len, progress=progress)
  print(chosen.table())
  print(f"plan: {chosen.choice.describe()}, verified "
        f"{chosen.verified.device_bytes / 1e9:.3f} GB of {budget_gb:g} GB")
  return chosen.choice.train_overrides()


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = _parse_args(argv)
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  options = {k: v for k, v in vars(args).items() if k in fields}
  if args.plan is not None:
    options.update(_planned(TrainConfig(**options), args.plan, progress=not args.no_progress))
  # All configs first: a bad combination fails before any training.
  if args.compare:
    run_configs = [config_for(options, o) for o in ("adama", "adam")]
  else:
    run_configs = [TrainConfig(**options)]
  config = run_configs[0]
  runs = [train(run_config, progress=not args.no_progress) for run_config in run_configs]
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
  return runs


if __name__ == "__main__":
  main()
