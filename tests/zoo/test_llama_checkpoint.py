"""Hugging Face Llama checkpoints in and out of `models.Llama` (models.llama_checkpoint).

The checkpoints here are written by `save_hf_checkpoint` from random weights
scaled so that activations are O(1) (attention peaked, not uniform, and the
rotary positions matter), and checked three ways: loaded back bitwise in every
layout, against a float64 NumPy forward written from Hugging Face's
``modeling_llama`` semantics on the raw tensors, and as the start of
``python -m models.train --init-from``. The sharded load runs in a subprocess
with 4 virtual CPU devices (the device count is fixed when JAX starts).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import xla_flags
from fixtures_text import BPE_VOCAB_SIZE
from flax import nnx
from safetensors.numpy import load_file
from safetensors.numpy import save_file

import models
from models import harness
from models import layers
from models import llama_checkpoint as hf
from models import train

ROOT = Path(__file__).resolve().parents[2]

# llama_test (width 128, 4 query heads of 32, 2 kv heads) with 2 layers, so
# stacking is a real stack and the second layer's names are checked too.
GQA = models.LlamaConfig.test(num_layers=2)
# Llama 3.1's rope rescaling with a short original context: at head width 32,
# base 10,000, two frequencies are kept, three interpolated and eleven divided
# by the factor (the reference test checks all three bands occur).
SCALED = layers.RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_len=64)
# Grouped-query attention with an LM head of its own; multi-head attention
# (num_kv_heads = num_heads) with the head tied to the embedding, rescaled rope.
VARIANTS = {
    "gqa": GQA,
    "tied_mha": models.LlamaConfig.test(num_layers=2, num_kv_heads=4, tie_embeddings=True,
                                        rope_scaling=SCALED),
}


def _random_params(config: models.LlamaConfig, seed: int) -> dict:
  """Params of `config`'s model as nested dicts of float32 NumPy arrays.

  Kernels N(0, 1/fan_in), norm scales 1 + N(0, 0.1^2), embeddings N(0, 1):
  every layer's output is O(1), so a wrong transpose, head order or rotation
  moves the logits by O(1), far beyond float32 rounding.
  """
  rng = np.random.default_rng(seed)
  params: dict = {}
  for path, leaf in _leaves(nnx.state(models.create_abstract(config), nnx.Param)).items():
    shape = leaf.shape
    if path[-1] == "kernel":
      value = rng.normal(size=shape) / np.sqrt(shape[-2])
    elif path[-1] == "scale":
      value = 1.0 + 0.1 * rng.normal(size=shape)
    else:
      value = rng.normal(size=shape)
    node = params
    for key in path[:-1]:
      node = node.setdefault(str(key), {})
    node[path[-1]] = value.astype(np.float32)
  return params


def _leaves(tree) -> dict:
  """Leaves by name path, ("blocks", "0", "mlp", "up", "kernel"): nnx.State or nested dicts."""
  def name(key):
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
  return {tuple(name(k) for k in path if name(k) != "value"): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _flat(tree) -> dict:
  """Leaves by "/"-joined path, as NumPy arrays."""
  return {"/".join(path): np.asarray(leaf) for path, leaf in _leaves(tree).items()}


def _save(directory: Path, config: models.LlamaConfig, seed: int = 0, **kwargs) -> dict:
  """Writes random params of `config` (scanned layout) as a checkpoint; returns them."""
  config = models.get_config(config, scan_layers=True)
  params = _random_params(config, seed)
  hf.save_hf_checkpoint(params, config, directory, **kwargs)
  return params


def _unstacked(flat_scanned: dict, num_layers: int) -> dict:
  """Scanned leaves ("blocks/x/kernel", [L, ...]) as unrolled ones ("blocks/i/x/kernel")."""
  out = {}
  for name, value in flat_scanned.items():
    if name.startswith("blocks/"):
      for i in range(num_layers):
        out[f"blocks/{i}/{name[len('blocks/'):]}"] = value[i]
    else:
      out[name] = value
  return out


def _assert_bitwise(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_saved_checkpoint_loads_back_bitwise_scanned_and_unrolled(variant, tmp_path):
  config = VARIANTS[variant]
  want = _flat(_save(tmp_path, config))
  files = load_file(str(tmp_path / hf.SINGLE_FILE))
  # The Hugging Face layout: torch's [out, in] weights, one tensor per layer.
  q_out = config.num_heads * config.head_size
  assert files["model.layers.1.self_attn.q_proj.weight"].shape == (q_out, config.hidden)
  np.testing.assert_array_equal(files["model.layers.1.self_attn.k_proj.weight"],
                                want["blocks/attention/k/kernel"][1].T)
  assert ("lm_head.weight" in files) == (not config.tie_embeddings)
  assert len(files) == 2 + 9 * config.num_layers + (not config.tie_embeddings)
  assert json.loads((tmp_path / hf.CONFIG_FILE).read_text())["num_key_value_heads"] == (
      config.num_kv_heads)

  scanned = hf.load_hf_checkpoint(tmp_path)  # scan_layers=True by default
  assert scanned.config == models.get_config(config, scan_layers=True)
  _assert_bitwise(_flat(nnx.state(scanned, nnx.Param)), want)
  unrolled = hf.load_hf_checkpoint(tmp_path, scan_layers=False)
  _assert_bitwise(_flat(nnx.state(unrolled, nnx.Param)), _unstacked(want, config.num_layers))
  # And out again: the same bytes, whichever layout wrote them.
  hf.save_hf_checkpoint(unrolled, unrolled.config, tmp_path / "again")
  again = load_file(str(tmp_path / "again" / hf.SINGLE_FILE))
  _assert_bitwise(again, files)


def test_bfloat16_checkpoints_load_as_float32_or_bfloat16(tmp_path):
  want = _flat(_save(tmp_path, GQA, dtype=jnp.bfloat16))
  header = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
  assert header["torch_dtype"] == "bfloat16"
  assert load_file(str(tmp_path / hf.SINGLE_FILE))["model.norm.weight"].dtype == ml_dtypes.bfloat16
  as_bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in want.items()}
  _assert_bitwise(_flat(hf.load_hf_params(tmp_path, models.get_config(GQA, scan_layers=True))),
                  {k: v.astype(np.float32) for k, v in as_bf16.items()})
  model = hf.load_hf_checkpoint(tmp_path, param_dtype=jnp.bfloat16)
  _assert_bitwise(_flat(nnx.state(model, nnx.Param)), as_bf16)


def test_a_sharded_checkpoint_with_an_index_loads_as_the_single_file(tmp_path):
  config = VARIANTS["tied_mha"]
  want = _flat(_save(tmp_path / "single", config))
  # 80 kB: an MLP kernel is 128 x 256 x 4 bytes = 131 kB and an attention
  # kernel 66 kB, so each kernel gets a file of its own; a layer's two norm
  # scales (512 bytes each) share one.
  written = hf.save_hf_checkpoint(hf.load_hf_checkpoint(tmp_path / "single"),
                                  models.get_config(config, scan_layers=True), tmp_path / "sharded",
                                  max_shard_bytes=80_000)
  names = [p.name for p in written]
  assert names[-2:] == [hf.INDEX_FILE, hf.CONFIG_FILE]
  index = json.loads((tmp_path / "sharded" / hf.INDEX_FILE).read_text())
  files = sorted(set(index["weight_map"].values()))
  assert files == sorted(names[:-2]) and len(files) > 5
  assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert any(len([n for n, f in index["weight_map"].items() if f == file]) > 1 for file in files)
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
  _assert_bitwise(_flat(nnx.state(hf.load_hf_checkpoint(tmp_path / "sharded"), nnx.Param)),
                  want)


def _rewrite(directory: Path, edit) -> None:
  """Applies `edit(tensors)` to a single-file checkpoint's tensors, in place."""
  tensors = load_file(str(directory / hf.SINGLE_FILE))
  edit(tensors)
  save_file(tensors, str(directory / hf.SINGLE_FILE), {"format": "pt"})


def _edit_config(directory: Path, **fields) -> None:
  path = directory / hf.CONFIG_FILE
  path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_missing_misshapen_or_unknown_tensor_is_refused_by_name(tmp_path):
  _save(tmp_path, GQA)
  original = load_file(str(tmp_path / hf.SINGLE_FILE))

  _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
    hf.load_hf_checkpoint(tmp_path)

  def misshapen(tensors):
    tensors.update(original)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 128), np.float32)
  _rewrite(tmp_path, misshapen)
  with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape "
                                       r"\(32, 128\), the model expects \(64, 128\)"):
    hf.load_hf_checkpoint(tmp_path, scan_layers=False)

  def extra(tensors):
    tensors.update(original)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(128, np.float32)
  _rewrite(tmp_path, extra)
  with pytest.raises(ValueError, match=r"no place for: model\.layers\.0\.self_attn\.q_proj\.bias"):
    hf.load_hf_checkpoint(tmp_path)

  def int8(tensors):
    tensors.update(original)
    tensors.pop("model.layers.0.self_attn.q_proj.bias")
    tensors["model.norm.weight"] = np.ones(128, np.int8)
  _rewrite(tmp_path, int8)
  with pytest.raises(ValueError, match=r"model\.norm\.weight is I8"):
    hf.load_hf_checkpoint(tmp_path)

  # Older exports' rotary buffers are recomputed, not loaded: accepted.
  def rotary(tensors):
    tensors.update(original)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)
  _rewrite(tmp_path, rotary)
  hf.load_hf_params(tmp_path, models.get_config(GQA, scan_layers=True))


def test_a_tied_model_ignores_a_stored_lm_head_as_hugging_face_does(tmp_path):
  config = VARIANTS["tied_mha"]
  want = _flat(_save(tmp_path, config))
  _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
  _assert_bitwise(_flat(hf.load_hf_params(tmp_path, models.get_config(config, scan_layers=True))),
                  want)


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "mistral"}, r"model_type='mistral'.*Llama checkpoints"),
    ({"attention_bias": True}, r"attention_bias=True.*no biases"),
    ({"mlp_bias": True}, r"mlp_bias=True"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"type 'yarn'.*'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"type 'linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"lacks low_freq_factor"),
    ({"hidden_size": None}, r"lacks hidden_size"),
])
def test_a_config_this_model_cannot_compute_is_refused_by_name(fields, message, tmp_path):
  _save(tmp_path, GQA)
  _edit_config(tmp_path, **fields)
  with pytest.raises(ValueError, match=message):
    hf.load_hf_checkpoint(tmp_path)


def test_a_directory_without_a_checkpoint_says_what_it_looked_for(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load_hf_checkpoint(tmp_path)
  (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(hf.config_to_hf(GQA)))
  with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index"):
    hf.load_hf_checkpoint(tmp_path)
  _save(tmp_path / "full", GQA)
  with pytest.raises(FileExistsError, match="already holds config.json, model.safetensors"):
    hf.save_hf_checkpoint(_random_params(models.get_config(GQA, scan_layers=True), 0),
                          models.get_config(GQA, scan_layers=True), tmp_path / "full")


# config.json as published (the architecture's fields; token ids and the like left out).
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32000,
}
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_published_configs_are_the_presets():
  assert hf.config_from_hf(LLAMA2_7B) == models.LlamaConfig.llama2_7b()
  assert hf.config_from_hf(LLAMA32_1B) == models.LlamaConfig.llama32_1b()
  assert models.param_count(hf.config_from_hf(LLAMA32_1B)) == 1_235_814_400
  # Transformers 5 writes the rotary settings under rope_parameters.
  v5 = {k: v for k, v in LLAMA32_1B.items() if k not in ("rope_scaling", "rope_theta")}
  v5["rope_parameters"] = {**LLAMA32_1B["rope_scaling"], "rope_theta": 500000.0}
  assert hf.config_from_hf(v5) == models.LlamaConfig.llama32_1b()
  assert hf.config_from_hf(LLAMA32_1B, scan_layers=True, remat="full").remat == "full"
  for preset in ("llama2_7b", "llama3_8b", "llama32_1b", "llama_test"):
    config = models.get_config(preset)
    assert hf.config_from_hf(hf.config_to_hf(config)) == config


# The reference: Hugging Face's LlamaForCausalLM forward (modeling_llama.py) in
# float64 NumPy, from the raw tensors of the files, sharing no code with the zoo.


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
  """transformers' _compute_llama3_parameters, step for step."""
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_context_len = scaling["original_max_position_embeddings"]
  low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
  wavelen = 2 * np.pi / inv_freq
  inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth_factor = (old_context_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, inv_freq_llama)


def _reference_logits(tensors: dict, config: dict, tokens: np.ndarray,
                      kv_heads_of: str = "repeat") -> np.ndarray:
  """The logits; `kv_heads_of="tile"` is a wrong model for the control (head j reads kv j % n)."""
  w = {name: value.astype(np.float64) for name, value in tensors.items()}
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
  head_dim = config.get("head_dim") or config["hidden_size"] // heads
  eps = config["rms_norm_eps"]
  batch, length = tokens.shape

  def rms_norm(x, weight):
    return weight * (x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps))

  def rotate_half(x):
    return np.concatenate([-x[..., head_dim // 2:], x[..., :head_dim // 2]], axis=-1)

  inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
  if config.get("rope_scaling"):
    inv_freq = _llama3_inv_freq(inv_freq, config["rope_scaling"])
  freqs = np.arange(length)[:, None] * inv_freq[None, :]
  cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
  causal = np.triu(np.full((length, length), -np.inf), k=1)

  def project(h, name, num):  # [batch, heads, length, head_dim]
    return (h @ w[name].T).reshape(batch, length, num, head_dim).transpose(0, 2, 1, 3)

  x = w["model.embed_tokens.weight"][tokens]
  for i in range(config["num_hidden_layers"]):
    layer = f"model.layers.{i}."
    h = rms_norm(x, w[layer + "input_layernorm.weight"])
    q = project(h, layer + "self_attn.q_proj.weight", heads)
    k = project(h, layer + "self_attn.k_proj.weight", kv_heads)
    v = project(h, layer + "self_attn.v_proj.weight", kv_heads)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    # repeat_kv: query head j reads key/value head j // (heads / kv_heads).
    spread = np.repeat if kv_heads_of == "repeat" else lambda a, n, axis: np.tile(a, (1, n, 1, 1))
    k, v = spread(k, heads // kv_heads, axis=1), spread(v, heads // kv_heads, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim) + causal
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, heads * head_dim)
    x = x + context @ w[layer + "self_attn.o_proj.weight"].T
    h = rms_norm(x, w[layer + "post_attention_layernorm.weight"])
    gate, up = h @ w[layer + "mlp.gate_proj.weight"].T, h @ w[layer + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[layer + "mlp.down_proj.weight"].T
  x = rms_norm(x, w["model.norm.weight"])
  head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
  return x @ w[head].T


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_loaded_model_computes_hugging_faces_llama(variant, tmp_path):
  config = VARIANTS[variant]
  _save(tmp_path, config, seed=7)
  hf_config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
  tensors = load_file(str(tmp_path / hf.SINGLE_FILE))
  tokens = np.random.default_rng(2).integers(0, config.vocab_size, (2, 48), dtype=np.int32)
  want = _reference_logits(tensors, hf_config, tokens)

  def logits(scan_layers):
    graphdef, params = nnx.split(hf.load_hf_checkpoint(tmp_path, scan_layers=scan_layers))
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens)))

  got = logits(scan_layers=True)
  if variant == "gqa":
    # Both layouts compute the same model (so the same loss): the same float32
    # ops in a scan or unrolled, which XLA may fuse differently.
    np.testing.assert_allclose(logits(scan_layers=False), got, rtol=0,
                               atol=1e-6 * np.abs(got).max())
  scale = np.abs(want).max()
  # float32 against float64 through two layers: each matmul sums <= 256
  # products (relative rounding ~ sqrt(256) * 6e-8 = 1e-6) and a peaked
  # softmax can amplify a score's error a few times; measured: 5e-7 of the
  # logits' largest in both variants. 2e-5 of it is 40x that, and 10,000x
  # below what rope without its scaling (0.26) or kv heads tiled instead of
  # repeated (0.98) cost, checked below.
  tolerance = 2e-5 * scale
  np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
  # The check can fail: Hugging Face's model without its rope scaling, or
  # with kv heads tiled instead of repeated, is far outside it.
  if hf_config["rope_scaling"]:
    head_dim = hf_config["head_dim"]
    inv_freq = 1.0 / hf_config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    scaled = _llama3_inv_freq(inv_freq, hf_config["rope_scaling"])
    ratio = scaled / inv_freq
    assert (ratio == 1).sum() == 2 and (ratio == 1 / 8).sum() == 11  # and 3 between
    unscaled = _reference_logits(tensors, {**hf_config, "rope_scaling": None}, tokens)
    assert np.abs(unscaled - got).max() > 100 * tolerance
  if hf_config["num_key_value_heads"] < hf_config["num_attention_heads"]:
    tiled = _reference_logits(tensors, hf_config, tokens, kv_heads_of="tile")
    assert np.abs(tiled - got).max() > 100 * tolerance


# Sharded loading: 4 CPU devices, in a subprocess; each device reads its slice.
_SHARDED = r'''
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding
from flax import nnx
import models, optax_adama
from models import llama_checkpoint as hf

directory = sys.argv[1]
reads = []  # (tensor, elements read) of every slice read from the files
original = hf._Files.slice

class Counted:
  def __init__(self, name, inner):
    self.name, self.inner = name, inner
  def __getitem__(self, index):
    part = self.inner[index]
    reads.append((self.name, int(np.asarray(part).size)))
    return part
  def __getattr__(self, attribute):
    return getattr(self.inner, attribute)

hf._Files.slice = lambda self, name: Counted(name, original(self, name))
mesh = Mesh(np.array(jax.devices()), ("data",))
want = nnx.state(hf.load_hf_checkpoint(directory), nnx.Param)  # one device
reads.clear()

# mesh alone: FSDP over it; explicit shardings: stack_shardings of an AdamA run.
config = hf.read_hf_config(directory, scan_layers=True)
staged, abstract = models.staged_loss(models.create_abstract(config))
tx = optax_adama.adama(1e-3, num_micro_batches=2)
shardings = optax_adama.sharding.stack_shardings(
    staged, abstract, jax.eval_shape(tx.init, abstract), mesh, shard_states="fsdp").params
results = {}
for how, params in (
    ("mesh", nnx.state(hf.load_hf_checkpoint(directory, mesh=mesh), nnx.Param)),
    ("shardings", hf.load_hf_params(directory, config, shardings=shardings))):
  out = {}
  for (path, got), (_, expected), (_, placed) in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(want),
      jax.tree_util.tree_leaves_with_path(shardings)):
    name = "/".join(str(getattr(k, "key", "")) for k in path).strip("/")
    assert isinstance(got.sharding, NamedSharding) and got.sharding.spec == placed.spec, name
    assert np.array_equal(np.asarray(got), np.asarray(expected)), name
    out[name] = {"shape": list(got.shape),
                 "shards": sorted({tuple(s.data.shape) for s in got.addressable_shards}),
                 "devices": len({s.device for s in got.addressable_shards})}
  results[how] = out
sizes = {}
for name, elements in reads:
  sizes.setdefault(name, set()).add(elements)
print(json.dumps({"results": results, "reads": {k: sorted(v) for k, v in sizes.items()},
                  "devices": jax.device_count()}))
'''


def test_a_mesh_load_gives_each_device_only_its_slice(tmp_path):
  params = _flat(_save(tmp_path, GQA))
  env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
         "XLA_FLAGS": xla_flags(4)}
  done = subprocess.run([sys.executable, "-W", "error", "-c", _SHARDED, str(tmp_path)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout.splitlines()[-1])
  assert report["devices"] == 4
  for how, leaves in report["results"].items():
    assert sorted(leaves) == sorted(params), how
    for name, leaf in leaves.items():
      shape = leaf["shape"]
      # FSDP: one shard shape on 4 devices, a quarter of the leaf: split on
      # its first axis, after the layer axis for a stacked one.
      split = 1 if name.startswith("blocks/") else 0
      quarter = shape[:split] + [shape[split] // 4] + shape[split + 1:]
      assert leaf["shards"] == [quarter] and leaf["devices"] == 4, (how, name, leaf)
  files = load_file(str(tmp_path / hf.SINGLE_FILE))
  # Nothing read whole: each read is one device's quarter of one layer's tensor.
  assert sorted(report["reads"]) == sorted(files)
  for name, sizes in report["reads"].items():
    assert sizes == [files[name].size // 4], (name, sizes)


# `python -m models.train --init-from`.


@pytest.fixture
def llama_test_checkpoint(tmp_path) -> Path:
  _save(tmp_path, models.LlamaConfig.test(), seed=3)
  return tmp_path


def test_train_init_from_starts_at_the_checkpoints_loss(llama_bpe_dir):
  # A checkpoint with its tokenizer (a 512-token BPE): the run's text is
  # tokenized with it, so the loaded model's loss is its loss on real ids.
  argv = ["--model", "llama", "--init-from", str(llama_bpe_dir),
          "--num-micro-batches", "2", "--batch-size", "4", "--seq-len", "16", "--steps", "2",
          "--eval-batches", "1", "--max-bytes", "100000", "--no-progress",
          "--seed", "1"]  # the checkpoint was initialised from seed 0
  with jax.numpy_dtype_promotion("standard"):  # optax's schedules promote implicitly
    (run,) = train.main(argv)
  assert run["preset"] == str(llama_bpe_dir)
  expected_config = models.LlamaConfig.test(vocab_size=BPE_VOCAB_SIZE)
  assert run["param_count"] == models.param_count(expected_config)
  # The first step's loss is the loaded model's on the run's first batch (its
  # two micro-batches' mean, before any update), not an initialisation's.
  config = train.train_config(argv)
  model_config = harness.model_config_of(config)
  assert model_config == expected_config
  first = next(harness.make_data(config, model_config)[0])
  assert set(first) == {"tokens", "segment_ids", "positions", "loss_weights"}  # packed rows
  assert int(first["tokens"].max()) >= 256  # BPE ids, not bytes
  # has_aux: the program the run's evaluation compiled (the compilation cache has it).
  loss_fn, params = models.split_loss_fn(
      hf.load_hf_checkpoint(llama_bpe_dir, scan_layers=False), has_aux=True)
  loss_fn = jax.jit(loss_fn)
  loaded = float(loss_fn(params, first)[0])
  assert run["train_loss"][0] == pytest.approx(loaded, rel=1e-5)
  # The run's seed without --init-from would have started elsewhere: both are
  # random models near ln(512), apart by 0.03, 500x the match's tolerance above.
  initialised = nnx.state(models.create(model_config, rngs=nnx.Rngs(config.seed)), nnx.Param)
  assert abs(float(loss_fn(initialised, first)[0]) - loaded) > 1e-2
  assert np.isfinite(run["train_loss"][1]) and np.isfinite(run["eval_loss"])


def test_train_init_from_takes_only_its_own_preset(llama_test_checkpoint, capsys):
  directory = str(llama_test_checkpoint)
  run = ["--model", "llama", "--init-from", directory, "--scan-layers", "--remat", "full"]
  config = train.train_config([*run, "--preset", "llama_test"])
  model_config = harness.model_config_of(config)
  assert model_config == models.LlamaConfig.test(scan_layers=True, remat="full")
  # --init-from alone names the Llama (an explicit other --model is refused below).
  assert train.train_config(["--init-from", directory]).model == "llama"
  for argv, message in (
      ([*run, "--preset", "llama_tiny"],
       r"--preset llama_tiny is not the model of .*config\.json \(num_layers 2 vs 1; mlp_dim "),
      (["--model", "gpt", "--init-from", directory],
       "--init-from loads a Llama checkpoint; add --model llama"),
      (["--model", "llama", "--init-from", str(llama_test_checkpoint / "absent")],
       "no config.json in"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      train.train_config(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # one line: argparse's
    assert error.startswith("python -m models.train: error: ")
    assert re.search(message, error), error
