"""Hugging Face Llama checkpoints in and out of the zoo's `models.Llama`.

Fine-tuning starts from published weights: a directory in the Hugging Face
layout (``config.json`` and ``model.safetensors``, or shards listed in
``model.safetensors.index.json``) is read into a `models.Llama`, and
`save_hf_checkpoint` writes one back (to export a fine-tuned model, or to make
a small checkpoint for a test).

    model = llama_checkpoint.load_hf_checkpoint("Llama-3.2-1B", remat="full")
    loss_fn, params = models.split_loss_fn(model, has_aux=True)

On a mesh, name where each parameter lives (e.g. FSDP's shardings of a
`models.staged_loss`) and every device reads only its own slice of each
tensor, straight from the files: the whole model is never on one device, nor
in host memory.

    config = llama_checkpoint.read_hf_config(directory, scan_layers=True)
    staged, abstract = models.staged_loss(models.create_abstract(config))
    shardings = optax_adama.sharding.stack_shardings(
        staged, abstract, jax.eval_shape(tx.init, abstract), mesh, shard_states="fsdp")
    params = llama_checkpoint.load_hf_params(directory, config, shardings=shardings.params)

Names map as Hugging Face's ``LlamaForCausalLM`` writes them: ``model.embed_tokens``
is ``token_embed/embedding``; ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` are
``blocks/attention/{q,k,v,out}/kernel``; ``mlp.{gate,up,down}_proj`` are
``blocks/mlp/{gate,up,down}/kernel``; ``input_layernorm`` and
``post_attention_layernorm`` are ``attention_norm`` and ``mlp_norm``;
``model.norm`` is ``final_norm``; ``lm_head`` is ``lm_head/kernel`` (absent when
the embeddings are tied). A ``torch.nn.Linear`` weight is [out, in] and a Flax
kernel [in, out], so kernels are transposed; the rotary embedding is already
Hugging Face's "rotate half", so q and k need no permutation. With
``scan_layers`` the layers are stacked on a leading axis. The ``config.json``
side (`read_hf_config`, `config_from_hf`, `config_to_hf`) is
`models.llama_hf_config`'s, named here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import models
import optax_adama
from models.llama import Llama
from models.llama import LlamaConfig
from models.llama_hf_config import CONFIG_FILE
from models.llama_hf_config import PathLike
from models.llama_hf_config import config_from_hf
from models.llama_hf_config import config_to_hf
from models.llama_hf_config import read_hf_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# What Hugging Face's sharded save names its files: model-00001-of-00004.safetensors.
_SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# Tensors a checkpoint may hold that the model does not: older exports keep
# each layer's rotary frequencies as a buffer, which the zoo recomputes.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# safetensors dtype names the loader casts from; integer (quantized) tensors
# would cast to garbage, so they are refused.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")

ParamPath = tuple[str, ...]


# The name map.


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One Hugging Face tensor: where it lives in the zoo's params, and how."""

  name: str  # e.g. "model.layers.3.self_attn.q_proj.weight"
  path: ParamPath  # the zoo's param, e.g. ("blocks", "attention", "q", "kernel")
  layer: int | None  # the index on the param's leading (stacked) axis, if any
  transpose: bool  # a torch Linear weight [out, in] for a Flax kernel [in, out]


_BLOCK_TENSORS = (  # (Hugging Face name inside model.layers.{i}, zoo path, transposed)
    ("self_attn.q_proj.weight", ("attention", "q", "kernel"), True),
    ("self_attn.k_proj.weight", ("attention", "k", "kernel"), True),
    ("self_attn.v_proj.weight", ("attention", "v", "kernel"), True),
    ("self_attn.o_proj.weight", ("attention", "out", "kernel"), True),
    ("mlp.gate_proj.weight", ("mlp", "gate", "kernel"), True),
    ("mlp.up_proj.weight", ("mlp", "up", "kernel"), True),
    ("mlp.down_proj.weight", ("mlp", "down", "kernel"), True),
    ("input_layernorm.weight", ("attention_norm", "scale"), False),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), False),
)


def _tensor_map(config: LlamaConfig) -> list[_Tensor]:
  """Every Hugging Face tensor of `config`'s model, in Hugging Face's order."""
  tensors = [_Tensor("model.embed_tokens.weight", ("token_embed", "embedding"), None, False)]
  for i in range(config.num_layers):
    for name, path, transpose in _BLOCK_TENSORS:
      if config.scan_layers:
        tensors.append(_Tensor(f"model.layers.{i}.{name}", ("blocks", *path), i, transpose))
      else:
        tensors.append(_Tensor(f"model.layers.{i}.{name}", ("blocks", str(i), *path), None,
                               transpose))
  tensors.append(_Tensor("model.norm.weight", ("final_norm", "scale"), None, False))
  if not config.tie_embeddings:
    tensors.append(_Tensor("lm_head.weight", ("lm_head", "kernel"), None, True))
  return tensors


def _hf_shape(tensor: _Tensor, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
  shape = leaf_shape[1:] if tensor.layer is not None else leaf_shape
  return tuple(reversed(shape)) if tensor.transpose else tuple(shape)


def _path_name(key: Any) -> str | None:
  """One step of a tree path as a name; None for a Variable's own ``.value``."""
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return None if key.name == "value" else key.name
  return str(key)


def _by_path(tree: Any) -> dict[ParamPath, Any]:
  """The leaves of a params-like tree (an `nnx.State` or nested dicts) by name path."""
  leaves = jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return {tuple(n for n in map(_path_name, path) if n is not None): leaf
          for path, leaf in leaves}


def _params_path(path: ParamPath) -> str:
  return "/".join(path)


# Reading.


def _check_complete(path: Path) -> None:
  """Refuses a safetensors file shorter than its header says (an interrupted download).

  The header (8 bytes of length, then JSON) gives every tensor's byte range; a
  truncated file would otherwise open and fail mid-load, or read short.
  """
  size = path.stat().st_size
  try:
    with open(path, "rb") as file:
      (length,) = struct.unpack("<Q", file.read(8))
      header = json.loads(file.read(length)) if 8 + length <= size else None
  except (struct.error, ValueError):
    header = None
  if header is None:
    raise ValueError(f"{path} is truncated or not safetensors: its {size} bytes hold no "
                     "complete header; download or copy the shard again.")
  end = max((info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"),
            default=0)
  if size < 8 + length + end:
    raise ValueError(f"{path} is truncated: {size:,} bytes, its header describes "
                     f"{8 + length + end:,}; download or copy the shard again.")


class _Files:
  """The open safetensors files of a checkpoint, by tensor name (headers only until sliced)."""

  def __init__(self, directory: PathLike, stack: contextlib.ExitStack):
    directory = Path(directory)
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():  # Hugging Face's own order: the single file first.
      weight_map = None
      files = [single.name]
    elif index.is_file():
      weight_map = json.loads(index.read_text()).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map (tensor name -> file); rewrite it as "
                         "Hugging Face's save_pretrained does.")
      files = sorted(set(weight_map.values()))
    else:
      raise FileNotFoundError(
          f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}: the loader reads Hugging Face "
          "safetensors checkpoints (convert a PyTorch .bin checkpoint with save_pretrained("
          "..., safe_serialization=True) first).")
    self.handles: dict[str, Any] = {}
    for file in files:
      if not (directory / file).is_file():
        raise FileNotFoundError(f"{INDEX_FILE} in {directory} lists {file}, which is missing.")
      _check_complete(directory / file)
      self.handles[file] = stack.enter_context(
          safe_open(str(directory / file), framework="numpy"))
    if weight_map is None:
      self.location = {name: files[0] for name in self.handles[files[0]].keys()}
    else:
      self.location = dict(weight_map)
      for name, file in weight_map.items():
        if name not in self.handles[file].keys():
          raise ValueError(f"{INDEX_FILE} puts {name} in {file}, which does not hold it.")

  def slice(self, name: str) -> Any:
    """The lazy slice of a tensor: ``[...]`` reads only the indexed part."""
    return self.handles[self.location[name]].get_slice(name)


def _check_tensors(files: _Files, expected: list[_Tensor],
                   abstract: dict[ParamPath, Any], config: LlamaConfig) -> None:
  """Refuses a missing, misshapen, non-float or unexpected tensor, by name."""
  names = {t.name for t in expected}
  missing = [t.name for t in expected if t.name not in files.location]
  if missing:
    raise ValueError(
        f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; a checkpoint of "
        "another size, or a truncated one (compare its config.json with its tensors).")
  ignored = set()
  if config.tie_embeddings and "lm_head.weight" in files.location:
    _check_tied_head(files)
    ignored.add("lm_head.weight")
  extra = sorted(name for name in files.location
                 if name not in names and name not in ignored and not _IGNORED.fullmatch(name))
  if extra:
    raise ValueError(
        f"the checkpoint holds {len(extra)} tensor(s) models.Llama has no place for: "
        f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; not a plain "
        "LlamaForCausalLM (biases, adapters or another architecture's weights?).")
  for tensor in expected:
    found = files.slice(tensor.name)
    want = _hf_shape(tensor, abstract[tensor.path].shape)
    if tuple(found.get_shape()) != want:
      raise ValueError(
          f"{tensor.name} has shape {tuple(found.get_shape())}, the model expects {want} "
          f"(for {_params_path(tensor.path)}{', transposed' if tensor.transpose else ''}); "
          "its config.json and tensors disagree, or an override changed the model's shape.")
    if found.get_dtype() not in _FLOAT_DTYPES:
      raise ValueError(f"{tensor.name} is {found.get_dtype()}; the loader reads float "
                       f"tensors ({', '.join(_FLOAT_DTYPES)}), not quantized ones.")


def _check_tied_head(files: _Files, rows: int = 4096) -> None:
  """A tied model's file may hold ``lm_head.weight`` too: loaded tied, it must equal the
  embedding. transformers 5 keeps a differing one as an untied head; here it is refused
  with the fix rather than dropped. Compared ``rows`` rows at a time (never whole)."""
  head, embed = files.slice("lm_head.weight"), files.slice("model.embed_tokens.weight")
  if tuple(head.get_shape()) != tuple(embed.get_shape()):
    raise ValueError(f"lm_head.weight has shape {tuple(head.get_shape())}, "
                     f"model.embed_tokens.weight {tuple(embed.get_shape())}; config.json "
                     "says tie_word_embeddings, which needs them equal.")
  num_rows = head.get_shape()[0]
  for start in range(0, num_rows, rows):
    stop = min(start + rows, num_rows)  # safetensors refuses a slice past the end
    if not np.array_equal(np.asarray(head[start:stop]), np.asarray(embed[start:stop])):
      raise ValueError(
          "config.json says tie_word_embeddings but the checkpoint's lm_head.weight differs "
          f"from model.embed_tokens.weight (from row {start}); transformers 5 would keep it "
          "as an untied head. Load it untied (tie_embeddings=False, or set "
          '"tie_word_embeddings": false in config.json), or drop lm_head.weight to tie.')


def _leaf_reader(files: _Files, tensors: list[_Tensor], shape: tuple[int, ...],
                 dtype: Any) -> Callable[[tuple[slice, ...]], np.ndarray]:
  """The callback of `jax.make_array_from_callback` for one param: reads one index's slice."""
  by_layer = {t.layer: t for t in tensors}

  def read(tensor: _Tensor, index: tuple[slice, ...]) -> np.ndarray:
    # Only the requested rows and columns are read from the file.
    hf_index = tuple(reversed(index)) if tensor.transpose else index
    part = np.asarray(files.slice(tensor.name)[hf_index])
    return part.T if tensor.transpose else part

  def callback(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(slice(*s.indices(size)[:2]) for s, size in zip(index, shape))
    if None in by_layer:
      part = read(by_layer[None], index)
    else:
      layers_index, rest = index[0], index[1:]
      part = np.stack([read(by_layer[layer], rest)
                       for layer in range(layers_index.start, layers_index.stop)])
    return np.ascontiguousarray(part.astype(dtype))

  return callback


def default_shardings(config: LlamaConfig, mesh: jax.sharding.Mesh) -> Any:
  """FSDP over ``mesh``'s "data" axis: each device a slice of every param.

  `optax_adama.sharding.stack_shardings` for a scanned model (a stacked
  param split after its layer axis, so each layer is split too), its
  `step_shardings` rule for an unrolled one.
  """
  abstract = models.create_abstract(config)
  if config.scan_layers:
    staged, params = models.staged_loss(abstract)
    return optax_adama.sharding.stack_shardings(
        staged, params, (), mesh, shard_states="fsdp").params
  params = nnx.state(abstract, nnx.Param)
  return optax_adama.sharding.step_shardings(params, (), mesh, shard_states="fsdp").params


def load_hf_params(
    directory: PathLike,
    config: LlamaConfig,
    *,
    mesh: jax.sharding.Mesh | None = None,
    shardings: Any = None,
) -> nnx.State:
  """The params of ``config``'s `models.Llama`, read from a Hugging Face checkpoint.

  Every tensor's name and shape is checked against the model before any is
  read. Each param is built with `jax.make_array_from_callback`: each device
  reads its own slice of the tensor(s) from the files, cast to
  ``config.param_dtype``, so no device (and no host buffer) ever holds more
  than its share of the model.

  Args:
    directory: holds ``model.safetensors``, or the shards that
      ``model.safetensors.index.json`` lists (config.json is not read here:
      ``config`` says what to build; see `read_hf_config`).
    config: the model to load into: its shapes must be the checkpoint's;
      ``scan_layers`` stacks the layers; run settings (remat, dtypes) are free.
    mesh: with no ``shardings``, FSDP over this mesh (`default_shardings`).
    shardings: where each param lives: a `jax.sharding.Sharding` for all of
      them, or a tree like ``nnx.state(model, nnx.Param)`` (an `nnx.State` or
      nested dicts) of them, e.g. ``stack_shardings(...).params``. None and
      no mesh: the default device.

  Returns:
    An `nnx.State` like ``nnx.state(models.create_abstract(config), nnx.Param)``;
    ``loss_fn(params, batch)`` of `models.split_loss_fn` or the staged loss of
    `models.staged_loss` (built on the abstract model) take it as it is.

  Raises:
    ValueError: a missing tensor, an unexpected one (rotary ``inv_freq``
      buffers excepted, and a tied model's ``lm_head.weight`` when it equals
      the embedding: one that differs is refused, not dropped), a shape other
      than the model's, an integer dtype, or a truncated file, named.
    FileNotFoundError: no safetensors checkpoint in ``directory``.
  """
  abstract_params = nnx.state(models.create_abstract(config), nnx.Param)
  abstract = _by_path(abstract_params)
  if shardings is None:
    shardings = (default_shardings(config, mesh) if mesh is not None
                 else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  if isinstance(shardings, jax.sharding.Sharding):
    placement = {path: shardings for path in abstract}
  else:
    placement = _by_path(shardings)
    missing = sorted(_params_path(p) for p in abstract if p not in placement)
    if missing:
      raise ValueError(f"shardings has no entry for {', '.join(missing[:5])}; pass a tree "
                       "like nnx.state(model, nnx.Param), or one Sharding for every param.")
  tensors = _tensor_map(config)
  by_param: dict[ParamPath, list[_Tensor]] = {}
  for tensor in tensors:
    by_param.setdefault(tensor.path, []).append(tensor)
  with contextlib.ExitStack() as stack:
    files = _Files(directory, stack)
    _check_tensors(files, tensors, abstract, config)

    def build(path, leaf):
      names = tuple(n for n in map(_path_name, path) if n is not None)
      reader = _leaf_reader(files, by_param[names], leaf.shape, leaf.dtype)
      return jax.make_array_from_callback(leaf.shape, placement[names], reader,
                                          dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(build, abstract_params)


def load_hf_checkpoint(
    directory: PathLike,
    *,
    scan_layers: bool = True,
    param_dtype: Any = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    shardings: Any = None,
    **config_overrides: Any,
) -> Llama:
  """The `models.Llama` of a Hugging Face checkpoint directory, ready to fine-tune.

  The config comes from ``directory/config.json`` (`read_hf_config`) and the
  params from its safetensors files (`load_hf_params`, which checks every
  name and shape first). Split it for training as any zoo model:
  ``models.split_loss_fn(model)``, or ``models.staged_loss(model)`` for
  ``optax_adama.release_step``.

  Args:
    directory: a Hugging Face checkpoint (config.json and model.safetensors,
      or shards with model.safetensors.index.json).
    scan_layers: stack the layers under one `jax.lax.scan` (one block
      compiled, what FSDP and the release step take).
    param_dtype: the params' dtype (the files' dtype is cast to it).
    mesh: as `load_hf_params`: FSDP over it when no ``shardings`` are given.
    shardings: as `load_hf_params`.
    **config_overrides: other `LlamaConfig` fields, e.g. ``remat="full"``,
      ``dtype=jnp.bfloat16`` (compute), ``loss_chunks=4``.

  Returns:
    The model; its params are wherever ``shardings`` put them.
  """
  config = read_hf_config(directory, scan_layers=scan_layers, param_dtype=param_dtype,
                          **config_overrides)
  graphdef, _, rest = nnx.split(models.create_abstract(config), nnx.Param, ...)
  params = load_hf_params(directory, config, mesh=mesh, shardings=shardings)
  return nnx.merge(graphdef, params, rest)


# Writing.


def _params_of(model_or_params: Any) -> dict[ParamPath, Any]:
  if isinstance(model_or_params, nnx.Module):
    model_or_params = nnx.state(model_or_params, nnx.Param)
  return _by_path(model_or_params)


def save_hf_checkpoint(
    model_or_params: Any,
    config: LlamaConfig,
    directory: PathLike,
    *,
    max_shard_bytes: int | None = None,
    dtype: Any = None,
) -> list[Path]:
  """Writes a model as a Hugging Face checkpoint: config.json and safetensors.

  The inverse of `load_hf_checkpoint` (``LlamaForCausalLM.from_pretrained``
  reads it too): kernels transposed to torch's [out, in], stacked layers
  written one tensor per layer. Each tensor goes through host memory on its
  own (one layer's slice of a stacked param at a time), so a sharded model
  is gathered a tensor at a time. config.json is written last, so an
  interrupted save leaves no directory that loads.

  Args:
    model_or_params: a `models.Llama`, or its params (``nnx.state(model,
      nnx.Param)`` or the same as nested dicts).
    config: the model's config (its shapes and layout).
    directory: where to write (created); it must not hold a checkpoint yet.
    max_shard_bytes: None: one ``model.safetensors``; else files of at most
      this many bytes (a tensor larger than it gets a file of its own) and
      ``model.safetensors.index.json``, as Hugging Face shards.
    dtype: the dtype to write, e.g. ``jnp.bfloat16``; None: each param's own.

  Returns:
    The files written, config.json last.
  """
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  ours = (CONFIG_FILE, SINGLE_FILE, INDEX_FILE)
  existing = [p.name for p in directory.iterdir()
              if p.name in ours or _SHARD_PATTERN.fullmatch(p.name)]
  if existing:
    raise FileExistsError(f"{directory} already holds {', '.join(sorted(existing))}; save "
                          "into an empty directory (stale shards would mix with new ones).")
  if max_shard_bytes is not None and max_shard_bytes < 1:
    raise ValueError(f"max_shard_bytes must be a positive byte count or None, "
                     f"got {max_shard_bytes!r}.")
  params = _params_of(model_or_params)
  tensors = _tensor_map(config)
  missing = sorted({_params_path(t.path) for t in tensors if t.path not in params})
  if missing:
    raise ValueError(f"the params lack {', '.join(missing[:5])} that config's model has; "
                     "pass the config the params were built with (scan_layers, tied head).")
  expected = _by_path(nnx.state(models.create_abstract(config), nnx.Param))
  for path, leaf in expected.items():
    if tuple(params[path].shape) != tuple(leaf.shape):
      raise ValueError(f"{_params_path(path)} has shape {tuple(params[path].shape)}, "
                       f"config's model has {tuple(leaf.shape)}; pass the params' own config.")
  out_dtype = None if dtype is None else jnp.dtype(dtype)

  def host(tensor: _Tensor) -> np.ndarray:
    leaf = params[tensor.path]
    array = np.asarray(leaf if tensor.layer is None else leaf[tensor.layer])
    array = array.T if tensor.transpose else array
    return np.ascontiguousarray(array if out_dtype is None else array.astype(out_dtype))

  def nbytes(tensor: _Tensor) -> int:
    leaf = params[tensor.path]
    size = math.prod(leaf.shape[1:] if tensor.layer is not None else leaf.shape)
    return size * (out_dtype or jnp.dtype(leaf.dtype)).itemsize

  groups = _shard_groups(tensors, nbytes, max_shard_bytes)
  written = []
  metadata = {"format": "pt"}  # what transformers checks before loading with torch
  if max_shard_bytes is None:
    save_file({t.name: host(t) for t in groups[0]}, str(directory / SINGLE_FILE), metadata)
    written.append(directory / SINGLE_FILE)
  else:
    weight_map = {}
    for i, group in enumerate(groups):
      file = _SHARD_FILE.format(index=i + 1, count=len(groups))
      save_file({t.name: host(t) for t in group}, str(directory / file), metadata)
      weight_map.update({t.name: file for t in group})
      written.append(directory / file)
    index = {"metadata": {"total_size": sum(map(nbytes, tensors))}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    written.append(directory / INDEX_FILE)
  saved_dtype = out_dtype or jnp.dtype(params[tensors[0].path].dtype)
  (directory / CONFIG_FILE).write_text(
      json.dumps(config_to_hf(config, torch_dtype=saved_dtype), indent=2))
  written.append(directory / CONFIG_FILE)
  return written


def _shard_groups(tensors: list[_Tensor], nbytes: Callable[[_Tensor], int],
                  max_shard_bytes: int | None) -> list[list[_Tensor]]:
  """Consecutive runs of tensors of at most ``max_shard_bytes`` each (one run: None)."""
  if max_shard_bytes is None:
    return [list(tensors)]
  groups: list[list[_Tensor]] = [[]]
  size = 0
  for tensor in tensors:
    if groups[-1] and size + nbytes(tensor) > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(tensor)
    size += nbytes(tensor)
  return groups


__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "config_from_hf",
    "config_to_hf",
    "default_shardings",
    "load_hf_checkpoint",
    "load_hf_params",
    "read_hf_config",
    "save_hf_checkpoint",
]
