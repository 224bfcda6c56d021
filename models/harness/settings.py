"""A training run's settings (`TrainConfig`) and what they build: the model's config
and the optimizer, its schedule counted in mini-batches.

`models.train`'s flags are `TrainConfig`'s fields; the loop (`models.harness.loop`),
the study and the planner build their runs from it too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

import models
import optax_adama
from models import llama_checkpoint
from models.harness.checks import check_counts
from models.harness.checks import check_seq_len

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
  # The mini-batch gradient's global norm clipped to this: adama by
  # optax_adama.clipped_by_global_norm (no gradient buffer, one mini-batch
  # late), adam / multisteps by optax.clip_by_global_norm. None: off.
  clip_norm: float | None = None
  # llama: fine-tune from a Hugging Face checkpoint directory (models.llama_checkpoint):
  # the model is its config.json's, with this run's remat, dtype and layout.
  init_from: str | None = None
  # The mesh (models.harness.devices): this many devices on a "data" axis, each
  # a slice of every micro-batch's rows; shard_states the ZeRO stage (None:
  # data parallel, "zero1", "zero2", "fsdp"; a stage needs 2 devices or more).
  # 1 and None: one device, no mesh.
  mesh_devices: int = 1
  shard_states: str | None = None

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
    self._check_mesh()
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
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm must be > 0 or None, got {self.clip_norm!r}.")
    if self.clip_norm is not None and self.release and self.mesh_devices > 1:
      raise ValueError("clip_norm with release on a mesh: release_step takes "
                       "optax_adama.clipped_by_global_norm on one device only so far; use "
                       "release=False (the fused step) to clip on a mesh.")
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

  def _check_mesh(self) -> None:
    """A stage the library knows, and whole rows of each micro-batch on every device."""
    if self.shard_states not in optax_adama.sharding.SHARD_STATES:
      raise ValueError(f"shard_states must be one of {optax_adama.sharding.SHARD_STATES}, "
                       f"got {self.shard_states!r}.")
    if isinstance(self.mesh_devices, bool) or not isinstance(self.mesh_devices, int) \
        or self.mesh_devices < 1:
      raise ValueError(f"mesh_devices must be an integer >= 1, got {self.mesh_devices!r}.")
    if self.shard_states is not None and self.mesh_devices == 1:
      # The planner refuses a stage of one device too: nothing to split it over.
      raise ValueError(f"shard_states={self.shard_states!r} splits state over a mesh, and "
                       "mesh_devices=1 is none; pass mesh_devices=2 or more, or "
                       "no stage.")
    rows = self.batch_size // self.num_micro_batches
    if rows % self.mesh_devices:
      raise ValueError(
          f"each micro-batch's {rows} rows (batch_size {self.batch_size} / "
          f"num_micro_batches {self.num_micro_batches}) do not split over mesh_devices="
          f"{self.mesh_devices}; pass a batch_size that is a multiple of "
          f"{self.num_micro_batches * self.mesh_devices}.")

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


# Params that weight decay leaves alone: norm scales and biases (the zoo's
# names for them), as LLM recipes exclude them (MaxText, EasyLM, nanoGPT).
_UNDECAYED_NAMES = ("scale", "bias", "mlm_bias")


def _leaf_name(path: tuple) -> str:
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  names = [str(n) for n in names if n is not None and n != "value"]
  return names[-1] if names else ""


def weight_decay_mask(params: Any) -> Any:
  """True where weight decay applies: every param but norm scales and biases.

  The tree `optax.adamw(mask=...)` and `optax_adama.adamaw(mask=...)` take,
  by name, so a scanned stack's [layers, width] norm scales are left alone too.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, _: _leaf_name(path) not in _UNDECAYED_NAMES, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """The optimizer of a run; every one counts its schedule in mini-batches.

  Weight decay (`weight_decay`) skips norm scales and biases (`weight_decay_mask`).
  """
  schedule = warmup_cosine_schedule(config.learning_rate, config.steps, config.warmup_steps)
  if config.optimizer == "adama":
    # The release folds one layer's slice of the stack's moments at a time:
    # layer-aligned blocks let it read that slice's codes alone (the default
    # layout tiles wide layers too; the fused runs keep the flat layout they
    # were measured with).
    quantization = (optax_adama.BlockQuantization(layer_aligned=config.release)
                    if config.quantize_moments else None)
    options = dict(weight_decay=config.weight_decay, mask=weight_decay_mask,
                   num_micro_batches=config.num_micro_batches, mu_dtype=config.mu_dtype,
                   nu_dtype=config.nu_dtype, quantization=quantization)
    tx = adama_transform("adamaw", schedule, nu_estimator=config.nu_estimator,
                         split_floor=config.split_floor, **options)
    rounding = param_rounding(config)
    tx = tx if rounding is None else optax_adama.mini_batch_chain(tx, rounding)
    if config.clip_norm is None:
      return tx
    return optax_adama.clipped_by_global_norm(tx, config.clip_norm)
  adamw = optax.adamw(schedule, weight_decay=config.weight_decay, mu_dtype=config.mu_dtype,
                      mask=weight_decay_mask)
  rounding = param_rounding(config)
  adamw = adamw if rounding is None else optax.chain(adamw, rounding)
  if config.clip_norm is not None:
    adamw = optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)
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
