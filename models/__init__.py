"""Flax NNX transformers (GPT-2, BERT, ViT, Llama) used to validate AdamA against Adam.

`PRESETS` names every configuration; `create` builds a model from a preset name
or a config; `param_count` counts parameters without allocating them; and
`make_loss_fn` turns a split model into the pure `loss_fn(params, batch)` that
`optax_adama.microbatch_step` scans over micro-batches:

    model = models.create("gpt_tiny", rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = models.make_loss_fn(graphdef, rest)
    loss = loss_fn(params, {"tokens": tokens})  # int32[batch, seq_len + 1]

A decoder's batch may also carry the packed-row keys of `models.text`, each
[batch, seq_len + 1]: "segment_ids" (attention within a document),
"loss_mask" (loss_mask[:, 1:] marks the targets) and "positions" (restarting
per document; the Llama's rotary positions read them, the GPT's learned
table does not). `models.stages.CausalLM` documents them.

Data loaders live in `models.data`.

This package is two layers, and its layout says which module is which
(tests/project/test_imports.py reads it). The model zoo is this front, the models
(`gpt`, `bert`, `vit`, `llama`, with the loss path they share, `stages`, and
their building blocks, `layers`), `savers` and the I/O (`data`, `checkpoint`,
`llama_checkpoint` with `llama_hf_config`); it imports `optax_adama` and nothing
of the tools.
Everything here is how a user builds a model and turns it into
`loss_fn(params, batch)`: the presets and configs, the model classes,
`create`/`create_abstract`/`get_config`/`param_count`, and the loss builders
of `models.stages` (`make_loss_fn`, `split_loss_fn`, and `staged_loss`, the
stages `optax_adama.release_step` takes). The tools are the commands (`python
-m models.train`, `bench`, `plan`, `validate`, `demo`, `gpu_bench`: each
module with a `__main__` block) and the harness below them (`models.harness`,
and `models.planner`); they train, measure and plot, and none of it is
imported here. A built wheel ships `optax_adama` and `models` (with the
`[models]` extra for the zoo's dependencies).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Union

import jax
from flax import nnx

from models.bert import BERT
from models.bert import BERTConfig
from models.gpt import GPT
from models.gpt import GPTConfig
from models.layers import COMPUTE_DTYPES
from models.layers import REMAT_POLICIES
from models.llama import Llama
from models.llama import LlamaConfig
from models.stages import make_loss_fn
from models.stages import split_loss_fn
from models.stages import staged_loss
from models.vit import ViT
from models.vit import ViTConfig

Config = Union[GPTConfig, BERTConfig, ViTConfig, LlamaConfig]
Model = Union[GPT, BERT, ViT, Llama]
Batch = dict[str, jax.Array]

PRESETS: dict[str, Config] = {
    "gpt2_small": GPTConfig.gpt2_small(),
    "gpt2_medium": GPTConfig.gpt2_medium(),
    "gpt2_large": GPTConfig.gpt2_large(),
    "gpt2_xl": GPTConfig.gpt2_xl(),
    "gpt_tiny": GPTConfig.tiny(),
    "gpt_test": GPTConfig.test(),
    "bert_base": BERTConfig.bert_base(),
    "bert_large": BERTConfig.bert_large(),
    "bert_tiny": BERTConfig.tiny(),
    "bert_test": BERTConfig.test(),
    "vit_base": ViTConfig.vit_base(),
    "vit_large": ViTConfig.vit_large(),
    "vit_tiny": ViTConfig.tiny(),
    "vit_mnist": ViTConfig.mnist(),  # 28x28 MNIST-5k (models.data.load_mnist_5k)
    "vit_test": ViTConfig.test(),
    "llama2_7b": LlamaConfig.llama2_7b(),
    "llama3_8b": LlamaConfig.llama3_8b(),
    "llama32_1b": LlamaConfig.llama32_1b(),
    "llama_small": LlamaConfig.small(),
    "llama_tiny": LlamaConfig.tiny(),
    "llama_test": LlamaConfig.test(),
}

_MODEL_CLASSES: dict[type, type[nnx.Module]] = {
    GPTConfig: GPT,
    BERTConfig: BERT,
    ViTConfig: ViT,
    LlamaConfig: Llama,
}


def get_config(name_or_config: str | Config, **overrides: Any) -> Config:
  """Looks up a preset by name (or takes a config) and applies field overrides.

  Args:
    name_or_config: a key of `PRESETS`, or a config instance.
    **overrides: config fields to replace, e.g. `remat="full"`.

  Returns:
    The (frozen) config.
  """
  if isinstance(name_or_config, str):
    if name_or_config not in PRESETS:
      raise KeyError(f"unknown preset {name_or_config!r}; known: {sorted(PRESETS)}")
    config = PRESETS[name_or_config]
  else:
    config = name_or_config
  return dataclasses.replace(config, **overrides) if overrides else config


def create(name_or_config: str | Config, *, rngs: nnx.Rngs, **overrides: Any) -> Model:
  """Builds the model for a preset name or config.

  Works under `nnx.eval_shape`, so the largest presets can be inspected and
  compiled without allocating their parameters:
  `nnx.eval_shape(lambda: models.create("gpt2_xl", rngs=nnx.Rngs(0)))`.

  Args:
    name_or_config: a key of `PRESETS`, or a config instance.
    rngs: random streams for initialisation.
    **overrides: config fields to replace, e.g. `remat="full"`.

  Returns:
    A `GPT`, `BERT`, `ViT` or `Llama` module.
  """
  config = get_config(name_or_config, **overrides)
  return _MODEL_CLASSES[type(config)](config, rngs=rngs)


def create_abstract(name_or_config: str | Config, **overrides: Any) -> Model:
  """The model with `jax.ShapeDtypeStruct`s in place of arrays (nothing allocated)."""
  return nnx.eval_shape(lambda: create(name_or_config, rngs=nnx.Rngs(0), **overrides))


def param_count(model_or_config: nnx.Module | str | Config) -> int:
  """Number of scalar parameters (`nnx.Param` entries) of a model.

  Args:
    model_or_config: a model (concrete or abstract), a preset name or a
      config; names and configs are counted via `nnx.eval_shape`.

  Returns:
    The total number of parameters.
  """
  if isinstance(model_or_config, nnx.Module):
    model = model_or_config
  else:
    model = create_abstract(model_or_config)
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return sum(math.prod(leaf.shape) for leaf in leaves)


__all__ = [
    "BERT",
    "BERTConfig",
    "Batch",
    "Config",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Model",
    "PRESETS",
    "COMPUTE_DTYPES",
    "REMAT_POLICIES",
    "ViT",
    "ViTConfig",
    "create",
    "create_abstract",
    "get_config",
    "make_loss_fn",
    "param_count",
    "split_loss_fn",
    "staged_loss",
]
