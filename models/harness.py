"""The harness's shared machinery: what more than one command runs.

The commands (`python -m models.train`, `.bench`, `.plan`, `.validate`,
`.demo`, `.gpu_bench`) and the libraries beside this one (`models.planner`,
`models.study`) import this module; it imports the model zoo (`models`) and
`optax_adama` only, never a command. So no command imports another, and the
imports run one way: commands -> harness -> zoo -> optax_adama
(tests/test_imports.py holds them to it). What one command alone uses stays
in that command.

- Where a result was measured: `machine_info`, `cpu_name`.
- Output: `format_bytes`, `save_figure`.
- Batches: `abstract_batch` (shapes, for compile-only measurements),
  `random_batch` (values, for timing), `tokens_per_example`.
- A training run: `TrainConfig` and `train` (models.train, models.validate and
  its study, models.demo), checkpointed and resumed with `CheckpointOptions`
  (`models.checkpoint`), with the pieces the planner compiles on their own
  (`make_optimizer`, `make_train_step` and, on a mesh, `train_step_shardings`,
  `model_config_of`).
- The accumulation methods the benchmarks compare (`models.bench` describes
  each): `make_step(method, loss_fn, ...)`, `split_model`, the floor a method
  is held to (`floor_for`) and interleaved step timing (`measure_throughput`),
  for models.bench, models.gpu_bench and models.demo.

None of this is the zoo's API (`models/__init__.py`): it trains and measures
models, it does not build them, and it is not in the wheel.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models import checkpoint as checkpointing
from models import data
from models import llama_checkpoint

# Where a result was measured.


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


# Output.

GIB = 2**30


def format_bytes(num_bytes: float) -> str:
  """GiB, or MiB below a tenth of a GiB (the tiny models' steps)."""
  if abs(num_bytes) >= 0.1 * GIB:
    return f"{num_bytes / GIB:.2f} GiB"
  return f"{num_bytes / 2**20:.2f} MiB"


def save_figure(fig: Any, path: Path, *, rect: Any = None) -> None:
  """Lays out (within ``rect``, figure fractions, if given), writes (creating
  the folder) and closes a matplotlib figure."""
  import matplotlib.pyplot as plt

  fig.tight_layout(rect=rect)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def running_mean(values: Sequence[float], window: int = 50) -> np.ndarray:
  """The mean over the last ``window`` values at each point (fewer at the start)."""
  values = np.asarray(values, np.float64)
  sums = np.cumsum(np.concatenate([[0.0], values]))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (sums[1:] - sums[starts]) / (ends - starts)


def plot_loss_curves(runs: Sequence[dict[str, Any]], label: Callable[[dict], str], path: Path,
                     *, title: str = "whole run", window: int = 50, log: bool = False,
                     style: Callable[[dict], dict[str, Any]] | None = None) -> None:
  """Training curves (running means) of ``models.train`` runs: the whole run and its
  second half, each labelled with ``label(run)`` and the held-out loss, drawn with
  matplotlib's ``style(run)`` (colour, line style...; default: its colour cycle)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (full, tail) = plt.subplots(1, 2, figsize=(11.5, 4.2))
  for run in runs:
    curve = running_mean(run["train_loss"], window)
    steps = np.arange(1, len(curve) + 1)
    text = f"{label(run)}: held-out {run['eval_loss']:.4f}"
    kwargs = {} if style is None else style(run)
    full.plot(steps, curve, label=text, **kwargs)
    tail.plot(steps[len(curve) // 2:], curve[len(curve) // 2:], label=text, **kwargs)
  full.set(xlabel="step", ylabel=f"training loss (mean of {window} steps)", title=title,
           yscale="log" if log else "linear")
  tail.set(xlabel="step", title="second half")
  full.legend(fontsize=8)
  save_figure(fig, path)


# Command-line errors.


@contextlib.contextmanager
def command_errors(parser: argparse.ArgumentParser,
                   *errors: type[Exception]) -> Iterator[None]:
  """Ends the command as argparse ends it on a user error: one line, exit 2.

  Wrap only what checks the user's settings (building configs, looking up a
  preset, a checkpoint's identity, the planner's search), not the run: a
  ``ValueError`` (or one of ``errors``) raised inside becomes
  ``parser.error(...)`` (``usage``, then ``prog: error: ...``, status 2),
  with the names of the parser's options in it written as their flags
  (:func:`as_flags`), so the line names the flag to change. Anything else,
  and anything raised outside, is a bug and keeps its traceback.
  """
  try:
    yield
  except (ValueError, *errors) as error:
    parser.error(as_flags(parser, str(error)))


def as_flags(parser: argparse.ArgumentParser, message: str) -> str:
  """``message`` with the parser's option names written as their flags.

  The library and ``TrainConfig`` name settings as Python does
  (``num_micro_batches=3``); the command line knows them as flags
  (``--num-micro-batches 3``). Every ``name=value`` of an option's ``dest``
  is rewritten (a switch's ``name=True`` to its flag, ``name=False`` to
  ``no FLAG``), and a bare ``dest`` with an underscore in it (no English word
  has one) to its flag.
  """
  actions = {a.dest: a for a in parser._actions if a.option_strings}
  for sub in parser._actions:
    if isinstance(sub, argparse._SubParsersAction):
      for child in sub.choices.values():
        actions.update({a.dest: a for a in child._actions
                        if a.option_strings and a.dest not in actions})

  def assignment(match: re.Match) -> str:
    action, value = actions[match[1]], match[3]
    flag = action.option_strings[-1]
    if isinstance(action.const, bool) and action.nargs == 0:  # a switch
      return flag if value == str(action.const) else f"no {flag}"
    return f"{flag} {value}"

  names = "|".join(sorted(map(re.escape, actions), key=len, reverse=True))
  if not names:
    return message
  message = re.sub(rf"\b({names})=(['\"]?)([^\s,;:)'\"]+)\2", assignment, message)
  return re.sub(rf"(?<![-\w])({names})\b(?!=)",
                lambda m: actions[m[1]].option_strings[-1] if "_" in m[1] else m[1], message)


def check_counts(**counts: int | Sequence[int] | None) -> None:
  """Raises ``ValueError`` naming the first count below 1 (None: not given)."""
  for name, values in counts.items():
    for value in values if isinstance(values, (list, tuple)) else [values]:
      if value is not None and value < 1:
        raise ValueError(f"{name}={value}: it must be 1 or more.")


def check_seq_len(preset: str, config: models.Config, seq_len: int | None, *,
                  name: str = "seq_len") -> None:
  """Raises ``ValueError`` if ``seq_len`` (the setting ``name``) is longer than
  the model's context."""
  max_len = getattr(config, "max_len", None)
  if seq_len is not None and max_len is not None and seq_len > max_len:
    raise ValueError(f"{name}={seq_len} is longer than {preset}'s max_len={max_len}; pass "
                     f"--{name.replace('_', '-')} {max_len} or less.")


# Batches.


def abstract_batch(config: models.Config, batch_size: int, seq_len: int | None = None) -> dict:
  """ShapeDtypeStructs of a batch in the format the model's loss expects."""
  sds = jax.ShapeDtypeStruct
  if isinstance(config, (models.GPTConfig, models.LlamaConfig)):
    seq_len = seq_len or config.max_len
    return {"tokens": sds((batch_size, seq_len + 1), jnp.int32)}
  if isinstance(config, models.BERTConfig):
    seq_len = seq_len or config.max_len
    return {"tokens": sds((batch_size, seq_len), jnp.int32),
            "targets": sds((batch_size, seq_len), jnp.int32),
            "mask_weights": sds((batch_size, seq_len), jnp.float32)}
  size, channels = config.image_size, config.num_channels
  return {"images": sds((batch_size, size, size, channels), jnp.float32),
          "labels": sds((batch_size,), jnp.int32)}


def random_batch(config: models.Config, batch: dict, seed: int = 0) -> dict:
  """A concrete batch for timing (speed does not depend on the values)."""
  rng = np.random.default_rng(seed)
  vocab = getattr(config, "vocab_size", None)
  out = {}
  for name, leaf in batch.items():
    if name == "labels":
      out[name] = rng.integers(0, config.num_classes, leaf.shape).astype(np.int32)
    elif name == "mask_weights":
      out[name] = (rng.random(leaf.shape) < 0.15).astype(np.float32)
    elif leaf.dtype == jnp.int32:
      out[name] = rng.integers(0, vocab, leaf.shape).astype(np.int32)
    else:
      out[name] = rng.random(leaf.shape).astype(np.float32)
  return jax.tree.map(jnp.asarray, out)


def tokens_per_example(model_config: models.Config, batch: dict) -> int:
  """Positions the model processes per example (patches + CLS for the ViT)."""
  if isinstance(model_config, models.ViTConfig):
    return model_config.num_patches + 1
  length = batch["tokens"].shape[1]
  # GPT batches carry one extra token: the last target.
  causal_lm = isinstance(model_config, (models.GPTConfig, models.LlamaConfig))
  return length - 1 if causal_lm else length


# A training run.

MODEL_KINDS = ("gpt", "bert", "vit", "llama")
# The causal language models: next-token batches of text (models.data.lm_batches).
CAUSAL_LM_KINDS = ("gpt", "llama")
MODEL_KIND_OF_CONFIG = {models.GPTConfig: "gpt", models.BERTConfig: "bert",
                        models.ViTConfig: "vit", models.LlamaConfig: "llama"}
OPTIMIZERS = ("adama", "adam", "multisteps")
MOMENT_DTYPES = ("float32", "bfloat16", "float16")
PARAM_DTYPES = ("float32", "bfloat16")
PARAM_ROUNDINGS = ("stochastic", "nearest")
# AdamA's estimators of v: the main transforms' ("mean", the paper's) and the
# research ones of optax_adama.contrib, which the study runs.
NU_ESTIMATOR_NAMES = ("auto",) + optax_adama.contrib.NU_ESTIMATORS
DEFAULT_NU_ESTIMATOR = "mean"


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
  # Compute dtype of the model (params, moments and the update stay float32):
  # "bfloat16" is mixed precision as practitioners train on a GPU.
  dtype: str = "float32"
  # Storage of the params: "bfloat16" halves them (moments follow unless
  # mu_dtype / nu_dtype say otherwise), and param_rounding says how a bfloat16
  # param takes its update: "stochastic" (optax_adama.contrib.
  # round_params_stochastically, chained last) or "nearest" (optax's add).
  param_dtype: str = "float32"
  param_rounding: str = "stochastic"
  gelu_bits: int | None = None  # few-bit GELU backward (models.savers); None: exact.
  linear_keep_ratio: float | None = None  # sampled MLP projection backward (models.savers).
  loss_chunks: int = 1  # gpt, llama: the LM head's loss over this many chunks of tokens.
  scan_layers: bool = False  # blocks stacked under one lax.scan (what models.plan plans).
  # AdamA's gradient release (optax_adama.release_step): each scanned layer's
  # gradient folded and dropped in the backward scan. Needs scan_layers, adama.
  release: bool = False
  # Moment storage, as `optax_adama.adamaw` takes it. None: the params' dtype.
  mu_dtype: str | None = None  # e.g. "bfloat16"; adam/multisteps take it too.
  nu_dtype: str | None = None  # adama only (optax.adamw has no nu_dtype).
  quantize_moments: bool = False  # 8-bit BlockQuantization(); adama only.
  nu_estimator: str = DEFAULT_NU_ESTIMATOR  # AdamA's second-moment estimator; adama only.
  split_floor: bool = True  # "split"'s floor (optax_adama.adama's split_floor); adama only.
  accumulation_dtype: str | None = None  # adam only: the accumulator's dtype.
  # llama: fine-tune from a Hugging Face checkpoint directory (models.llama_checkpoint):
  # the model is its config.json's, with this run's remat, dtype and layout.
  init_from: str | None = None

  def __post_init__(self):
    if self.model not in MODEL_KINDS:
      raise ValueError(f"model must be one of {MODEL_KINDS}, got {self.model!r}.")
    if self.init_from is not None and self.model != "llama":
      raise ValueError(f"init_from={self.init_from!r} is a Llama checkpoint, got "
                       f"model={self.model!r}; use model='llama' (--model llama).")
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}.")
    self._check_model()
    check_counts(steps=self.steps, num_micro_batches=self.num_micro_batches,
                 batch_size=self.batch_size)
    if self.batch_size % self.num_micro_batches:
      divisors = [n for n in range(1, self.batch_size + 1) if self.batch_size % n == 0]
      raise ValueError(
          f"batch size {self.batch_size} does not split into "
          f"num_micro_batches={self.num_micro_batches} equal micro-batches: pick "
          f"num_micro_batches from {divisors}, or a batch_size that is a multiple of "
          f"{self.num_micro_batches}.")
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
      if not self.split_floor:
        raise ValueError(f"split_floor=False needs optimizer='adama', got "
                         f"optimizer={self.optimizer!r}.")
      if self.nu_estimator != DEFAULT_NU_ESTIMATOR:
        raise ValueError(
            f"nu_estimator={self.nu_estimator!r} needs optimizer='adama', got "
            f"optimizer={self.optimizer!r}.")
    if self.dtype not in models.COMPUTE_DTYPES:
      raise ValueError(f"dtype (compute) must be one of {models.COMPUTE_DTYPES}, got "
                       f"{self.dtype!r} (float16 needs loss scaling, which the models do "
                       "not do).")
    if self.param_dtype not in PARAM_DTYPES:
      raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}.")
    if self.param_rounding not in PARAM_ROUNDINGS:
      raise ValueError(f"param_rounding must be one of {PARAM_ROUNDINGS}, got "
                       f"{self.param_rounding!r}.")
    if self.nu_estimator not in NU_ESTIMATOR_NAMES:
      raise ValueError(f"nu_estimator must be one of {NU_ESTIMATOR_NAMES}, "
                       f"got {self.nu_estimator!r}.")
    if self.release and not (self.scan_layers and self.optimizer == "adama"):
      raise ValueError(
          "release (release=True, optax_adama.release_step) needs scan_layers=True and "
          "optimizer='adama', "
          f"got scan_layers={self.scan_layers}, optimizer={self.optimizer!r}.")
    if self.accumulation_dtype is not None:
      if self.accumulation_dtype not in MOMENT_DTYPES:
        raise ValueError(f"accumulation_dtype must be one of {MOMENT_DTYPES} or None, "
                         f"got {self.accumulation_dtype!r}.")
      if self.optimizer != "adam":
        raise ValueError(
            f"accumulation_dtype={self.accumulation_dtype!r} is for gradient "
            f"accumulation (optimizer='adam'), got optimizer={self.optimizer!r}.")

  def _check_model(self) -> None:
    """The preset is one of ``models.PRESETS`` and a model of ``model``'s kind."""
    if self.preset is None:
      return
    if self.preset not in models.PRESETS:
      raise ValueError(f"preset={self.preset} is not a preset; known: {sorted(models.PRESETS)}.")
    kind = MODEL_KIND_OF_CONFIG[type(models.PRESETS[self.preset])]
    if kind != self.model:
      own = sorted(p for p, c in models.PRESETS.items()
                   if MODEL_KIND_OF_CONFIG[type(c)] == self.model)
      raise ValueError(f"preset={self.preset} is a {kind} model, not a {self.model}: pass "
                       f"model={kind}, or a {self.model} preset ({', '.join(own)}).")

  @property
  def preset_name(self) -> str:
    # A fine-tuning run without a preset is named by its checkpoint.
    return self.preset or self.init_from or f"{self.model}_tiny"


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


def adama_transform(factory: str, *args: Any, nu_estimator: str = DEFAULT_NU_ESTIMATOR,
                    split_floor: bool = True, **kwargs: Any) -> optax.GradientTransformation:
  """``optax_adama.<factory>`` (``"adama"``, ``"adamaw"``) for the default estimator
  of v, ``optax_adama.contrib.<factory>`` for a research one (the study's arms)."""
  if nu_estimator == DEFAULT_NU_ESTIMATOR and split_floor:
    return getattr(optax_adama, factory)(*args, **kwargs)
  return getattr(optax_adama.contrib, factory)(
      *args, nu_estimator=nu_estimator, split_floor=split_floor, **kwargs)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """The optimizer of a run; every one counts its schedule in mini-batches."""
  schedule = warmup_cosine_schedule(config.learning_rate, config.steps, config.warmup_steps)
  if config.optimizer == "adama":
    # The release folds one layer's slice of the stack's moments at a time:
    # layer-aligned blocks let it read that slice's codes alone (the default
    # layout tiles wide layers too; the fused runs keep the flat layout they
    # were measured with).
    quantization = (optax_adama.BlockQuantization(layer_aligned=config.release)
                    if config.quantize_moments else None)
    options = dict(weight_decay=config.weight_decay,
                   num_micro_batches=config.num_micro_batches, mu_dtype=config.mu_dtype,
                   nu_dtype=config.nu_dtype, quantization=quantization)
    tx = adama_transform("adamaw", schedule, nu_estimator=config.nu_estimator,
                         split_floor=config.split_floor, **options)
    rounding = param_rounding(config)
    return tx if rounding is None else optax_adama.mini_batch_chain(tx, rounding)
  adamw = optax.adamw(schedule, weight_decay=config.weight_decay, mu_dtype=config.mu_dtype)
  rounding = param_rounding(config)
  adamw = adamw if rounding is None else optax.chain(adamw, rounding)
  if config.optimizer == "multisteps":
    return optax.MultiSteps(adamw, every_k_schedule=config.num_micro_batches)
  return adamw  # microbatch_step accumulates the mean gradient for it.


def param_rounding(config: TrainConfig) -> optax.GradientTransformation | None:
  """The transform chained last that rounds a run's narrow params stochastically;
  ``None`` where optax's add (round to nearest) applies the update."""
  if config.param_dtype == "float32" or config.param_rounding == "nearest":
    return None
  return optax_adama.contrib.round_params_stochastically(config.seed)


def base_model_config(config: TrainConfig) -> models.Config:
  """A run's model before its run settings: its preset, or its checkpoint's config.json.

  With ``init_from``, a ``preset`` named too must be the checkpoint's model.
  """
  if config.init_from is None:
    return models.get_config(config.preset_name)
  loaded = llama_checkpoint.read_hf_config(config.init_from)
  preset = None if config.preset is None else models.get_config(config.preset)
  if preset is not None and preset != loaded:
    differences = "; ".join(
        f"{f.name} {getattr(preset, f.name)!r} vs {getattr(loaded, f.name)!r}"
        for f in dataclasses.fields(preset) if getattr(preset, f.name) != getattr(loaded, f.name))
    raise ValueError(f"--preset {config.preset} is not the model of {config.init_from}'s "
                     f"config.json ({differences}); omit --preset: the checkpoint defines "
                     "the model.")
  return loaded


def model_config_of(config: TrainConfig) -> models.Config:
  """The model config of a run: its preset (or checkpoint) with the run's remat, savers, layout."""
  if config.loss_chunks != 1 and config.model not in CAUSAL_LM_KINDS:
    raise ValueError(f"loss_chunks is a causal LM's ({CAUSAL_LM_KINDS}: its LM head), not "
                     f"{config.model!r}'s.")
  base = base_model_config(config)
  if config.model == "llama":  # the others' batches are cut to their context (make_data)
    check_seq_len(config.preset_name, base, config.seq_len)
  chunks = {"loss_chunks": config.loss_chunks} if config.loss_chunks != 1 else {}
  return models.get_config(base, remat=config.remat, gelu_bits=config.gelu_bits,
                           dtype=jnp.dtype(config.dtype),
                           param_dtype=jnp.dtype(config.param_dtype),
                           scan_layers=config.scan_layers,
                           linear_keep_ratio=config.linear_keep_ratio, **chunks)


def make_train_step(config: TrainConfig, model: nnx.Module, loss_fn: Callable,
                    tx: optax.GradientTransformation, *,
                    mesh: jax.sharding.Mesh | None = None,
                    shard_states: str | None = None) -> Callable:
  """The jitted training step: `release_step` on the model's stages, or `microbatch_step`.

  Both take and return the same (params, opt_state, batch) and metrics with
  "loss"; the release's loss is the head's (it has no accuracy aux).

  With `mesh` the step is data parallel over its "data" axis and
  `shard_states` picks the ZeRO stage (None, "zero1", "zero2", "fsdp"; see
  `optax_adama.sharding`). The plain loss is used under FSDP too: GSPMD
  gathers each layer where the model's own scan reads it. Place params and
  state first with `train_step_shardings`.
  """
  if mesh is None and shard_states is not None:
    raise ValueError(f"shard_states={shard_states!r} splits state over a mesh; pass mesh= "
                     "(a jax.sharding.Mesh with a 'data' axis) or shard_states=None.")
  on_mesh = {} if mesh is None else {"mesh": mesh, "shard_states": shard_states}
  if config.release:
    staged, _ = models.staged_loss(model)
    return optax_adama.release_step(staged, tx, **on_mesh)
  return optax_adama.microbatch_step(
      loss_fn, tx, num_micro_batches=config.num_micro_batches, has_aux=True,
      accumulation_dtype=config.accumulation_dtype, **on_mesh)


def train_step_shardings(config: TrainConfig, model: nnx.Module, params: Any, opt_state: Any,
                         mesh: jax.sharding.Mesh,
                         shard_states: str | None) -> optax_adama.sharding.StepShardings:
  """Where `make_train_step(..., mesh=mesh, shard_states=...)` keeps params and state.

  The release splits a stacked leaf off its layer axis (`release_shardings`),
  `microbatch_step` along its largest axis under FSDP (`step_shardings`).
  """
  if config.release:
    staged, _ = models.staged_loss(model)
    return optax_adama.sharding.release_shardings(staged, params, opt_state, mesh,
                                                  shard_states=shard_states)
  return optax_adama.sharding.step_shardings(params, opt_state, mesh, shard_states=shard_states)


def make_data(config: TrainConfig, model_config: Any) -> tuple[Iterator[dict], list[dict]]:
  """(training batch stream, fixed list of held-out batches) for a run."""
  if config.model == "vit":
    # The preset's input size names the data set: 8x8 digits for vit_tiny and
    # vit_test, 28x28 MNIST-5k for vit_mnist.
    images = data.load_images_for(model_config.image_size)
    train = data.image_batches(
        images.train_images, images.train_labels, batch_size=config.batch_size,
        seed=config.seed)
    if model_config.image_size == 8:
      # Capped at the held-out split (359 digits), so a mini-batch larger than
      # it is scored on the whole split, in one batch; smaller ones as before.
      valid_batch_size = min(config.batch_size, len(images.valid_labels))
    else:
      # MNIST-5k: all 1,000 held-out images in 5 batches of 200 whatever the
      # mini-batch (within the default 16 eval batches), so a run's held-out
      # loss does not depend on which part of the split its batch size reaches.
      valid_batch_size = len(images.valid_labels) // 5
    valid = data.image_batches(
        images.valid_images, images.valid_labels, batch_size=valid_batch_size,
        shuffle=False, epochs=1)
  else:
    text = (data.load_text(config.data_path) if config.data_path
            else data.load_stdlib_text(max_bytes=config.max_bytes))
    seq_len = min(config.seq_len, model_config.max_len)
    batches = data.lm_batches if config.model in CAUSAL_LM_KINDS else data.mlm_batches
    train = batches(text.train, batch_size=config.batch_size, seq_len=seq_len,
                    seed=config.seed)
    # Held-out masks are drawn from a fixed seed: every run scores the same task.
    valid = batches(text.valid, batch_size=config.batch_size, seq_len=seq_len,
                    seed=1234, shuffle=False, epochs=1)
  eval_batches = [b for _, b in zip(range(config.eval_batches), valid)]
  if not eval_batches:
    raise ValueError("the held-out split is too small for one batch.")
  return train, eval_batches


def evaluate(loss_fn, params, batches: Sequence[dict]) -> dict[str, float]:
  """Mean loss and aux metrics over held-out batches."""
  eval_step = jax.jit(loss_fn)
  totals: dict[str, float] = {}
  for batch in batches:
    loss, aux = eval_step(params, batch)
    for name, value in {"loss": loss, **aux}.items():
      totals[name] = totals.get(name, 0.0) + float(value)
  return {name: value / len(batches) for name, value in totals.items()}


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
  """Where and how often a run saves itself (`--checkpoint-dir` and friends)."""

  directory: str
  every: int = 100  # steps between saves; the last step and a stop signal save too.
  keep: int = 3  # the newest checkpoints kept.

  def __post_init__(self):
    if self.every < 1:
      raise ValueError(f"checkpoint every must be >= 1 steps, got {self.every}.")
    if self.keep < 1:
      raise ValueError(f"keep must be >= 1, got {self.keep}.")


# A held-out batch count changes what is scored, not what is trained.
_RESUMABLE_CHANGES = ("eval_batches",)


class _StopSignals:
  """SIGTERM / SIGINT set a flag the step loop reads after each step.

  The loop then saves and exits, instead of dying mid-step: the preemption
  notice of a shared or spot machine. Installed only in the main thread (the
  only one Python delivers signals to); the previous handlers come back on exit.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, active: bool):
    self.active = active  # without checkpoints there is nothing to save first.
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self):
    if self.active and threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signum
    # A second signal while the checkpoint is written acts as it always does.
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _run_checkpoints(config: TrainConfig,
                     checkpoint: CheckpointOptions | None) -> checkpointing.RunCheckpoints | None:
  """The checkpoints of the run of ``config`` (None: the run saves none)."""
  if checkpoint is None:
    return None
  return checkpointing.RunCheckpoints(
      Path(checkpoint.directory), identity=dataclasses.asdict(config),
      keep=checkpoint.keep, ignored=_RESUMABLE_CHANGES)


def check_run(config: TrainConfig, checkpoint: CheckpointOptions | None = None) -> None:
  """Raises ``ValueError`` (``OSError`` for a missing file) where ``train`` would
  refuse ``config`` after its start: the model's settings (``model_config_of``),
  a ``data_path`` that is not there, and checkpoints of another run in
  ``checkpoint.directory``. Reads no data and builds no model, so a command
  checks every run it was asked for before training the first.
  """
  model_config_of(config)
  if config.data_path is not None and not Path(config.data_path).exists():
    raise FileNotFoundError(f"data_path={config.data_path} does not exist; pass a text "
                            "file or a directory of them.")
  run_checkpoints = _run_checkpoints(config, checkpoint)
  if run_checkpoints is not None:
    try:
      run_checkpoints.check_identity()
    finally:
      run_checkpoints.close()


def _resume(run_checkpoints, params, opt_state, config):
  """``(params, opt_state, first step, losses so far)``, from the newest checkpoint."""
  if run_checkpoints is None:
    return params, opt_state, 0, []
  restored = run_checkpoints.restore_latest(
      checkpointing.abstract_like({"params": params, "opt_state": opt_state}))
  if restored is None:
    return params, opt_state, 0, []
  print(f"resuming from {run_checkpoints.directory / str(restored.step)}: "
        f"step {restored.step} of {config.steps}", file=sys.stderr)
  return (restored.state["params"], restored.state["opt_state"],
          int(restored.record["data_position"]), list(restored.record["train_loss"]))


@dataclasses.dataclass
class _RunState:
  """Where a run stands: its state, the steps done, their losses and this process's times."""

  params: Any
  opt_state: Any
  done: int
  train_loss: list[float]
  step_times: list[float] = dataclasses.field(default_factory=list)

  def save(self, run_checkpoints) -> None:
    if run_checkpoints is not None and self.done not in run_checkpoints.steps():
      run_checkpoints.save(
          self.done, {"params": self.params, "opt_state": self.opt_state},
          # A copy: the save runs in the background while the next steps
          # append to the live list (a SIGKILL test caught a checkpoint of
          # step k carrying step k + 1's loss).
          {"train_loss": list(self.train_loss), "data_position": self.done})


def _run_steps(config, compiled, batches, first, run: _RunState, run_checkpoints,
               every: int | None, tokens_per_step: int, show: bool) -> None:
  """Steps ``run`` to ``config.steps``, saving every ``every`` and on a stop signal."""
  bar = tqdm(total=config.steps, initial=run.done, disable=not show,
             desc=f"{config.preset_name}/{config.optimizer}", dynamic_ncols=True,
             file=sys.stderr)
  batch = first
  with _StopSignals(active=run_checkpoints is not None) as stop:
    while run.done < config.steps:
      begin = time.perf_counter()
      run.params, run.opt_state, metrics = compiled(
          run.params, run.opt_state, batch)
      loss = float(metrics["loss"])  # blocks: the timing covers the step
      run.step_times.append(time.perf_counter() - begin)
      run.train_loss.append(loss)
      run.done += 1
      bar.set_postfix(loss=f"{loss:.3f}",
                      tok_s=f"{tokens_per_step / run.step_times[-1]:,.0f}")
      bar.update()
      if every is not None and (run.done % every == 0 or run.done == config.steps
                                or stop.received is not None):
        run.save(run_checkpoints)
      if stop.received is not None:
        bar.close()
        run_checkpoints.close()
        print(f"{signal.Signals(stop.received).name} at step {run.done}: saved "
              f"{run_checkpoints.directory / str(run.done)}; run the same command "
              "again to resume", file=sys.stderr)
        raise SystemExit(128 + stop.received)
      if run.done < config.steps:
        batch = next(batches)
  bar.close()


def train(config: TrainConfig, *, progress: bool = True,
          checkpoint: CheckpointOptions | None = None) -> dict[str, Any]:
  """Trains one model and returns its metrics.

  The metrics: the config, the preset and its parameter count, every step's
  training loss (``train_loss``, restored ones first after a resume) and the
  mean of the last 5% (``final_train_loss``), the held-out loss and metrics
  (``eval_loss``, ``eval_metrics``), the median step time and throughput, the
  compile time, the step loop's wall time (``loop_s``: this process's steps,
  saves included), the compiled step's memory, the micro-batches AdamA
  dropped, the step it resumed from (``resumed_from``) and the machine.
  ``progress`` shows a progress bar.

  With ``checkpoint`` the run saves params, optimizer state and its record
  (step, data position, losses) every ``checkpoint.every`` steps, at the last
  step and when SIGTERM or SIGINT arrives (then it exits with status 128 +
  the signal); started again with the same directory it resumes from the
  newest complete checkpoint and ends bitwise where the uninterrupted run
  would have (the data stream and all randomness are functions of the seed
  and the step).
  """
  model_config = model_config_of(config)
  if config.init_from is None:
    model = models.create(model_config, rngs=nnx.Rngs(config.seed))
  else:  # the checkpoint's weights in place of an initialisation
    model = models.create_abstract(model_config)
    nnx.update(model, llama_checkpoint.load_hf_params(config.init_from, model_config))
  loss_fn, params = models.split_loss_fn(model, has_aux=True)
  tx = make_optimizer(config)
  step = make_train_step(config, model, loss_fn, tx)
  del model  # the loss merges params back into a fresh module each call
  train_batches, eval_batches = make_data(config, model_config)
  run_checkpoints = _run_checkpoints(config, checkpoint)
  run = _RunState(*_resume(run_checkpoints, params, tx.init(params), config))
  start = run.done
  for _ in range(start):  # the data position: one batch per step done.
    next(train_batches)

  first = next(train_batches)
  compile_start = time.perf_counter()
  compiled = step.lower(run.params, run.opt_state, first).compile()
  compile_s = time.perf_counter() - compile_start
  memory = optax_adama.memory_report(
      compiled, param_bytes=optax_adama.memory.tree_bytes(run.params))
  tokens_per_step = config.batch_size * tokens_per_example(model_config, first)

  loop_start = time.perf_counter()
  _run_steps(config, compiled, train_batches, first, run, run_checkpoints,
             None if checkpoint is None else checkpoint.every, tokens_per_step, progress)
  if run_checkpoints is not None:
    run_checkpoints.close()  # the last save written: part of the run's cost.
  loop_s = time.perf_counter() - loop_start

  eval_metrics = evaluate(loss_fn, run.params, eval_batches)
  # The first steps include one-off work (allocation, caches): time the rest.
  steady = run.step_times[len(run.step_times) // 10:] or run.step_times or [float("nan")]
  median_step_s = float(np.median(steady))
  adama_state = optax_adama.find_adama_state(run.opt_state)
  return {
      "config": dataclasses.asdict(config),
      "preset": config.preset_name,
      "param_count": models.param_count(model_config),
      "train_loss": run.train_loss,
      "final_train_loss": float(np.mean(run.train_loss[-max(1, config.steps // 20):])),
      "eval_loss": eval_metrics["loss"],
      "eval_metrics": eval_metrics,
      "median_step_s": median_step_s,
      "steps_per_s": 1.0 / median_step_s,
      "tokens_per_s": tokens_per_step / median_step_s,
      "compile_s": compile_s,
      "loop_s": loop_s,  # wall time of the steps this process ran, saves included.
      "memory": memory.to_dict(),
      "num_dropped": None if adama_state is None else int(adama_state.num_dropped),
      "resumed_from": start or None,
      "machine": machine_info(),
  }


# The accumulation methods of models.bench (its docstring describes each).

METHODS = ("full_batch", "scan_accumulation", "multisteps", "optax_microbatching", "adama")
# Capacity: smaller optimizer state. The careful user's accumulation baseline,
# then AdamA with 8-bit, low-rank (GaLore) and host-offloaded moments.
STATE_METHODS = ("scan_accumulation_bf16_8bit", "adama_8bit", "adama_8bit_lowrank",
                 "adama_8bit_lowrank_offload")
LOW_RANK_REFRESH_PERIOD = 200  # mini-batches, GaLore's default
# Data parallel on a mesh (capacity with a per-device budget): plain data-parallel
# accumulation and AdamA (params, m, v replicated), AdamA with ZeRO-2 (m, v split,
# gradients reduce-scattered), and ZeRO-2 with 8-bit moments.
SHARDED_METHODS = ("dp_scan_accumulation", "dp_adama", "zero2_scan_accumulation",
                   "zero2_adama", "zero2_adama_8bit")
# Needs the model in stages, so only with --scan-layers: the release step with
# float32 moments, with 8-bit ones whose blocks tile each layer, and with those
# kept in host memory (each layer's slice brought in for its fold and update).
RELEASE_METHODS = ("adama_release", "adama_release_8bit", "adama_release_8bit_offload")
# FSDP on a mesh, the model in stages (--scan-layers): every device holds a
# slice of every layer, each layer's params gathered inside the layer scan.
# Scan accumulation (optax.adam, a float32 accumulator split like the params)
# against the release with float32 and with layer-aligned 8-bit moments.
FSDP_METHODS = ("fsdp_scan_accumulation", "fsdp_adama_release", "fsdp_adama_release_8bit")
# AdamA with another second-moment estimator than the default ("mean"), for its
# price against the default (step time, memory) in the same row group.
ESTIMATOR_METHODS = ("adama_momentum",)
Step = Callable[..., Any]


def make_step(
    method: str, loss_fn: Callable, *, num_micro_batches: int, learning_rate: float = 1e-4,
    mesh: jax.sharding.Mesh | None = None, rank: int | None = None,
) -> tuple[Step, optax.GradientTransformation]:
  """(jitted donating step, its optimizer) of a method.

  ``full_batch`` runs the whole mini-batch as one micro-batch; every other
  method scans ``num_micro_batches`` of them. ``rank``: the low-rank methods'
  projection rank.
  """
  check_method(method, scanned=isinstance(loss_fn, optax_adama.StagedLoss),
               mesh=mesh is not None)
  adam = optax.adam(learning_rate)
  if method in FSDP_METHODS:
    return _fsdp_step(method, loss_fn, num_micro_batches, learning_rate, mesh)
  if method in STATE_METHODS:
    return _state_method_step(method, loss_fn, num_micro_batches, learning_rate, rank)
  if method in SHARDED_METHODS:
    quantization = optax_adama.BlockQuantization() if method.endswith("_8bit") else None
    tx = (adam if method.endswith("_scan_accumulation") else optax_adama.adama(
        learning_rate, num_micro_batches=num_micro_batches, quantization=quantization))
    step = optax_adama.microbatch_step(
        loss_fn, tx, num_micro_batches=num_micro_batches, mesh=mesh,
        shard_states="zero2" if method.startswith("zero2") else None)
    return step, tx
  if method == "full_batch":
    return optax_adama.microbatch_step(loss_fn, adam, num_micro_batches=1), adam
  if method in ("scan_accumulation", "scan_accumulation_bf16"):
    # _bf16: the gradient sum carried in bfloat16, as MaxText users run it.
    step = optax_adama.microbatch_step(
        loss_fn, adam, num_micro_batches=num_micro_batches, update_every_micro_batch=False,
        accumulation_dtype=jnp.bfloat16 if method.endswith("_bf16") else None)
    return step, adam
  if method == "multisteps":
    tx = optax.MultiSteps(adam, every_k_schedule=num_micro_batches)
    return optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=num_micro_batches), tx
  if method == "optax_microbatching":
    return _optax_microbatching_step(loss_fn, adam, num_micro_batches), adam
  if method == "adama" or method in ESTIMATOR_METHODS:
    estimator = DEFAULT_NU_ESTIMATOR if method == "adama" else method.removeprefix("adama_")
    tx = adama_transform("adama", learning_rate, num_micro_batches=num_micro_batches,
                         nu_estimator=estimator)
    return optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=num_micro_batches), tx
  if method in RELEASE_METHODS:
    quantization = (optax_adama.BlockQuantization(layer_aligned=True)
                    if "_8bit" in method else None)
    tx = optax_adama.adama(learning_rate, num_micro_batches=num_micro_batches,
                           quantization=quantization)
    if method.endswith("_offload"):
      tx = optax_adama.offload_moments(tx)
    return optax_adama.release_step(loss_fn, tx), tx
  raise AssertionError(f"check_method passed {method!r}, which has no step")


def check_method(method: str, *, scanned: bool, mesh: bool) -> None:
  """Raises ``ValueError`` if ``method`` cannot run on this model and devices.

  ``scanned``: the model is in stages (``--scan-layers``); ``mesh``: the step
  runs on several devices (``--devices``). The release and FSDP methods need
  the stages, the data-parallel and FSDP ones a mesh.
  """
  known = (METHODS + ("scan_accumulation_bf16",) + STATE_METHODS + SHARDED_METHODS
           + RELEASE_METHODS + FSDP_METHODS + ESTIMATOR_METHODS)
  if method not in known:
    raise ValueError(f"unknown method {method!r}; known: {known}")
  needs = []
  if method in RELEASE_METHODS + FSDP_METHODS and not scanned:
    needs.append("a scanned model (--scan-layers)")
  if method in SHARDED_METHODS + FSDP_METHODS and not mesh:
    needs.append("a mesh (--devices 2 or more)")
  if needs:
    raise ValueError(f"method {method} needs {' and '.join(needs)}; add the flag or "
                     "drop the method from --methods.")


def _fsdp_step(method, staged, num_micro_batches, learning_rate, mesh):
  """The steps of FSDP_METHODS (place their arguments with :func:`fsdp_shardings`)."""
  if method == "fsdp_scan_accumulation":
    tx = optax.adam(learning_rate)
    return optax_adama.microbatch_step(staged, tx, num_micro_batches=num_micro_batches,
                                       mesh=mesh, shard_states="fsdp"), tx
  quantization = (optax_adama.BlockQuantization(layer_aligned=True)
                  if method.endswith("_8bit") else None)
  tx = optax_adama.adama(learning_rate, num_micro_batches=num_micro_batches,
                         quantization=quantization)
  return optax_adama.release_step(staged, tx, mesh=mesh, shard_states="fsdp"), tx


def fsdp_shardings(method: str, staged: optax_adama.StagedLoss, params: Any, opt_state: Any,
                   mesh: jax.sharding.Mesh) -> optax_adama.sharding.StepShardings:
  """Where an FSDP method's step keeps params and state (each layer split)."""
  shardings = (optax_adama.sharding.stack_shardings if method == "fsdp_scan_accumulation"
               else optax_adama.sharding.release_shardings)
  return shardings(staged, params, opt_state, mesh, shard_states="fsdp")


def _state_method_step(method, loss_fn, num_micro_batches, learning_rate, rank):
  """The steps of STATE_METHODS: 8-bit, low-rank and offloaded moments."""
  quantization = optax_adama.BlockQuantization()
  if method == "scan_accumulation_bf16_8bit":
    adam_8bit = _without_adama_state(optax_adama.adama(
        learning_rate, num_micro_batches=1, quantization=quantization))
    step = optax_adama.microbatch_step(
        loss_fn, adam_8bit, num_micro_batches=num_micro_batches,
        update_every_micro_batch=False, accumulation_dtype=jnp.bfloat16)
    return step, adam_8bit
  tx = optax_adama.adama(learning_rate, num_micro_batches=num_micro_batches,
                         quantization=quantization)
  if "lowrank" in method:
    if rank is None:
      raise ValueError(f"method {method!r} needs a rank.")
    tx = optax_adama.low_rank(tx, rank=rank, refresh_period=LOW_RANK_REFRESH_PERIOD,
                              projector_dtype=jnp.bfloat16)
  if method.endswith("_offload"):
    tx = optax_adama.offload_moments(tx)
  return optax_adama.microbatch_step(loss_fn, tx), tx


def _without_adama_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` with its state as a flat tuple of arrays.

  AdamA at N = 1 is Adam; with its state flattened, ``microbatch_step`` finds
  no AdamA state and runs it as any optax optimizer, after a gradient-sum
  carry: Adam with 8-bit moments for the accumulation baseline.
  """

  def update_fn(updates, state, params=None):
    treedef = jax.tree.structure(jax.eval_shape(tx.init, params))
    new_updates, new_state = tx.update(updates, treedef.unflatten(state), params)
    return new_updates, tuple(jax.tree.leaves(new_state))

  return optax.GradientTransformation(lambda p: tuple(jax.tree.leaves(tx.init(p))), update_fn)


def _optax_microbatching_step(loss_fn, tx, num_micro_batches):
  """The step a user writes with optax.microbatching: mean gradient, one update."""

  def step(params, opt_state, batch):
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    value_and_grad = optax.microbatching.microbatch(
        jax.value_and_grad(loss_fn), argnums=1,
        microbatch_size=batch_size // num_micro_batches,
        accumulator=optax.microbatching.AccumulationType.MEAN)
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  return jax.jit(step, donate_argnums=(0, 1))


def gpt_family(scale: int, *, remat: str = "none", vocab_size: int = 50257,
               hidden: int | None = None, scan_layers: bool = False,
               dtype: Any = None) -> models.GPTConfig:
  """A GPT-2-shaped model grown in depth and width together.

  ``scale`` = number of layers; width = 64 * scale rounded to a multiple of
  128 (GPT-2 small is scale 12: 12 layers, width 768; scale 24 gives 24 layers
  of width 1536), or ``hidden`` (a multiple of 64: heads of 64) when given.
  ``dtype``: the compute dtype (``None``: the config's default, float32);
  params stay float32.
  """
  if hidden is None:
    hidden = max(128, int(round(64 * scale / 128)) * 128)
  elif hidden % 64:
    raise ValueError(f"hidden={hidden} must be a multiple of 64 (heads of width 64).")
  config = models.GPTConfig(num_layers=scale, hidden=hidden, num_heads=hidden // 64,
                            remat=remat, vocab_size=vocab_size, scan_layers=scan_layers)
  return config if dtype is None else dataclasses.replace(config, dtype=jnp.dtype(dtype))


def split_model(config: models.Config) -> tuple[Callable, Any]:
  """(pure loss_fn, abstract params) of a config, nothing allocated.

  With ``scan_layers`` the loss is a ``StagedLoss`` (also a plain loss_fn).
  """
  if config.scan_layers:
    return models.staged_loss(models.create_abstract(config))
  graphdef, params, rest = nnx.split(models.create_abstract(config), nnx.Param, ...)
  return models.make_loss_fn(graphdef, rest), params


def adama_floor(config: models.Config, batch: dict,
                num_micro_batches: int) -> optax_adama.memory.MemoryFloor:
  """AdamA's floor on the unrolled model (its largest gradient is one leaf)."""
  loss_fn, params = split_model(dataclasses.replace(config, scan_layers=False))
  state = jax.eval_shape(
      optax_adama.adama(1e-4, num_micro_batches=num_micro_batches).init, params)
  return optax_adama.memory.memory_floor(loss_fn, params, state, batch,
                                  num_micro_batches=num_micro_batches)


def floor_for(method: str, config: models.Config, batch: dict,
              num_micro_batches: int) -> optax_adama.memory.MemoryFloor:
  """The floor a method is held to.

  AdamA's (`adama_floor`): the unrolled model's, whose largest gradient is one
  leaf. The release step's: it recomputes each layer from its saved input in
  the backward pass, so its activations are those of the scanned model with
  every block rematerialized (the layer inputs, one layer's recomputation and
  the head), and its largest gradient is one layer's slice of a stacked leaf
  or an outer leaf.
  """
  if method not in RELEASE_METHODS:
    return adama_floor(config, batch, num_micro_batches)
  config = dataclasses.replace(config, scan_layers=True, remat="full")
  loss_fn, params = split_model(config)
  state = jax.eval_shape(
      optax_adama.adama(1e-4, num_micro_batches=num_micro_batches).init, params)
  floor = optax_adama.memory.memory_floor(loss_fn, params, state, batch,
                                   num_micro_batches=num_micro_batches)
  stack_path = (loss_fn.layers,) if isinstance(loss_fn.layers, str) else tuple(loss_fn.layers)

  def gradient_bytes(path, leaf):
    keys = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
    stacked = keys[:len(stack_path)] == stack_path
    return optax_adama.memory.tree_bytes(leaf) // (config.num_layers if stacked else 1)

  largest = max(gradient_bytes(path, leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(params))
  return dataclasses.replace(floor, largest_gradient_bytes=largest)


def dtype_override(dtype: str | None) -> dict[str, Any]:
  """The config field of a compute dtype (``--dtype``); none for None (the preset's)."""
  return {} if dtype is None else {"dtype": jnp.dtype(dtype)}


def measure_throughput(
    preset: str,
    methods: Sequence[str],
    num_micro_batches: int,
    *,
    micro_batch_size: int,
    seq_len: int | None = None,
    rounds: int = 7,
    steps_per_round: int = 5,
    progress: bool = True,
    dtype: str | None = None,
) -> dict[str, dict[str, float]]:
  """Median step time per method, the methods interleaved round by round.

  Interleaving means slow drift of the machine (other load, thermal state)
  hits every method alike, so their ratio is trustworthy. ``dtype``: the
  compute dtype (params and moments stay float32); None: the preset's.
  """
  config = models.get_config(preset, **dtype_override(dtype))
  model = models.create(config, rngs=nnx.Rngs(0))
  # The release step needs the model in stages (scanned configs only).
  splits = {False: models.split_loss_fn(model)}
  if any(m in RELEASE_METHODS for m in methods):
    splits[True] = models.staged_loss(model)
  batch_size = micro_batch_size * num_micro_batches
  batch = random_batch(config, abstract_batch(config, batch_size, seq_len))
  tokens_per_step = batch_size * tokens_per_example(config, batch)
  runners = {}
  for method in methods:
    loss_fn, init_params = splits[method in RELEASE_METHODS]
    step, tx = make_step(method, loss_fn, num_micro_batches=num_micro_batches)
    params = jax.tree.map(jnp.array, init_params)
    state = tx.init(params)
    compiled = step.lower(params, state, batch).compile()
    runners[method] = [compiled, params, state]
  times: dict[str, list[float]] = {m: [] for m in methods}
  with tqdm(total=rounds * len(methods), desc=f"throughput {preset}", disable=not progress,
            file=sys.stderr) as bar:
    for round_index in range(rounds + 1):  # round 0 warms up, untimed
      for method in methods:
        compiled, params, state = runners[method]
        start = time.perf_counter()
        for _ in range(steps_per_round):
          params, state, metrics = compiled(params, state, batch)
        jax.block_until_ready((params, state, metrics))
        elapsed = (time.perf_counter() - start) / steps_per_round
        runners[method][1:] = [params, state]
        if round_index:
          times[method].append(elapsed)
          bar.update()
  out = {}
  for method in methods:
    median = float(np.median(times[method]))
    out[method] = {"median_step_s": median, "steps_per_s": 1.0 / median,
                   "tokens_per_s": tokens_per_step / median,
                   "step_s_all": times[method]}
  return out
