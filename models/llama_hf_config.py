"""A Llama's Hugging Face ``config.json``, read into a `LlamaConfig` and written from one.

`models.llama_checkpoint` reads and writes the checkpoints whose architecture
this describes; the mapping of names (``hidden_size`` is ``hidden``,
``intermediate_size`` is ``mlp_dim``, Llama 3.1's ``rope_scaling`` is
`models.layers.RopeScaling`, ...) is in `config_from_hf` and `config_to_hf`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from models import layers
from models.llama import LlamaConfig

CONFIG_FILE = "config.json"

# The config.json fields a Llama's architecture cannot do without.
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")

PathLike = str | Path


def config_from_hf(config_json: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
  """The `LlamaConfig` of a Hugging Face Llama ``config.json``.

  Reads the architecture (vocab_size, hidden_size, intermediate_size,
  num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
  rms_norm_eps, rope_theta, rope_scaling of type "llama3",
  tie_word_embeddings, max_position_embeddings); ``torch_dtype`` is ignored:
  the params' dtype is ``param_dtype`` (float32 unless overridden).

  Args:
    config_json: the parsed ``config.json``.
    **overrides: `LlamaConfig` fields to set on top, e.g. ``scan_layers=True``,
      ``remat="full"``, ``dtype=jnp.bfloat16``, ``param_dtype=jnp.bfloat16``.

  Returns:
    The config.

  Raises:
    ValueError: for another ``model_type`` than "llama", biases
      (``attention_bias``/``mlp_bias``), an activation other than SiLU, a
      rope scaling other than "llama3", or a missing field; each message
      names the field and its value.
  """
  model_type = config_json.get("model_type")
  if model_type != "llama":
    raise ValueError(
        f"config.json has model_type={model_type!r}; this loader reads Llama checkpoints "
        "(model_type 'llama': Llama 2, 3, 3.1, 3.2 and their fine-tunes). Another "
        "architecture's weights do not fit models.Llama.")
  for field in ("attention_bias", "mlp_bias"):
    if config_json.get(field):
      raise ValueError(f"config.json has {field}={config_json[field]!r}: models.Llama's "
                       "projections have no biases, so these weights cannot load into it.")
  activation = config_json.get("hidden_act", "silu")
  if activation != "silu":
    raise ValueError(f"config.json has hidden_act={activation!r}; models.Llama's MLP is "
                     "SwiGLU (silu), so this checkpoint would compute something else.")
  missing = [field for field in _REQUIRED_FIELDS if config_json.get(field) is None]
  if missing:
    raise ValueError(f"config.json lacks {', '.join(missing)}: a Llama config.json names "
                     f"every one of {', '.join(_REQUIRED_FIELDS)}.")
  num_heads = int(config_json["num_attention_heads"])
  hidden = int(config_json["hidden_size"])
  head_dim = config_json.get("head_dim")
  # The default width stays None, so the config equals the preset it came from.
  if head_dim is not None and hidden % num_heads == 0 and head_dim == hidden // num_heads:
    head_dim = None
  # Transformers 5 keeps the rotary settings under "rope_parameters".
  rope = config_json.get("rope_parameters") or {}
  rope_theta = config_json.get("rope_theta", rope.get("rope_theta", 10000.0))
  rope_scaling = config_json.get("rope_scaling")
  if rope_scaling is None and rope.get("rope_type", "default") != "default":
    rope_scaling = rope
  num_kv_heads = config_json.get("num_key_value_heads")
  fields = {
      "vocab_size": int(config_json["vocab_size"]),
      "max_len": int(config_json.get("max_position_embeddings", 2048)),
      "num_layers": int(config_json["num_hidden_layers"]),
      "hidden": hidden,
      "num_heads": num_heads,
      "num_kv_heads": num_heads if num_kv_heads is None else int(num_kv_heads),
      "head_dim": None if head_dim is None else int(head_dim),
      "mlp_dim": int(config_json["intermediate_size"]),
      # Hugging Face's LlamaConfig defaults, for a config.json that leaves them out.
      "layer_norm_eps": float(config_json.get("rms_norm_eps", 1e-6)),
      "rope_theta": float(rope_theta),
      "rope_scaling": _rope_scaling_from_hf(rope_scaling),
      "tie_embeddings": bool(config_json.get("tie_word_embeddings", False)),
  }
  return LlamaConfig(**{**fields, **overrides})


def _rope_scaling_from_hf(rope_scaling: Mapping[str, Any] | None) -> layers.RopeScaling | None:
  if rope_scaling is None:
    return None
  rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
  if rope_type in (None, "default"):
    return None
  if rope_type != "llama3":
    raise ValueError(
        f"config.json has rope_scaling of type {rope_type!r}; models.Llama implements "
        "Llama 3.1's 'llama3' rescaling only (the rotary frequencies of another type would "
        "differ from the ones the checkpoint was trained with).")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [key for key in keys if key not in rope_scaling]
  if missing:
    raise ValueError(f"config.json's llama3 rope_scaling lacks {', '.join(missing)} "
                     f"(it has {sorted(rope_scaling)}).")
  return layers.RopeScaling(
      factor=float(rope_scaling["factor"]),
      low_freq_factor=float(rope_scaling["low_freq_factor"]),
      high_freq_factor=float(rope_scaling["high_freq_factor"]),
      original_max_len=int(rope_scaling["original_max_position_embeddings"]))


def read_hf_config(directory: PathLike, **overrides: Any) -> LlamaConfig:
  """`config_from_hf` of ``directory/config.json``."""
  path = Path(directory) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}: a Hugging Face checkpoint "
                            "directory holds config.json beside its safetensors files.")
  return config_from_hf(json.loads(path.read_text()), **overrides)


def config_to_hf(config: LlamaConfig, *, torch_dtype: Any = jnp.float32) -> dict[str, Any]:
  """The Hugging Face ``config.json`` of a `LlamaConfig` (``LlamaForCausalLM``).

  ``torch_dtype`` names the dtype the tensors are saved in. Run settings
  (remat, scan_layers, compute dtype, savers) are not part of it.
  """
  scaling = config.rope_scaling
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden,
      "intermediate_size": config.mlp_width,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_size,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_len,
      "rms_norm_eps": config.layer_norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": None if scaling is None else {
          "rope_type": "llama3", "factor": scaling.factor,
          "low_freq_factor": scaling.low_freq_factor,
          "high_freq_factor": scaling.high_freq_factor,
          "original_max_position_embeddings": scaling.original_max_len,
      },
      "tie_word_embeddings": config.tie_embeddings,
      "attention_bias": False,
      "mlp_bias": False,
      # transformers 4 reads "torch_dtype"; 5 reads "dtype" (and still the old name).
      "torch_dtype": jnp.dtype(torch_dtype).name,
      "dtype": jnp.dtype(torch_dtype).name,
  }


# What a checkpoint directory holds besides weights and config, copied with a
# fine-tuned model so it loads and tokenizes as the original did.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")
# config.json keys of the original that the model's shapes do not decide.
_KEPT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp")


def copy_hf_extras(source: PathLike, directory: PathLike) -> list[Path]:
  """Copies `source`'s tokenizer files and its special token ids into `directory`.

  `directory` holds a checkpoint written by `save_hf_checkpoint`; its
  config.json gains the source's BOS/EOS/pad ids. Returns the files copied.
  """
  source, directory = Path(source), Path(directory)
  copied = []
  for name in TOKENIZER_FILES:
    if (source / name).is_file():
      shutil.copyfile(source / name, directory / name)
      copied.append(directory / name)
  if (source / CONFIG_FILE).is_file():
    original = json.loads((source / CONFIG_FILE).read_text())
    config = json.loads((directory / CONFIG_FILE).read_text())
    config.update({k: original[k] for k in _KEPT_KEYS if k in original})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
  return copied
