"""models/ with scanned layers: equal to unrolled, remat in the scan, the release step on them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models_helpers import closed_form_count
from _models_helpers import make_batch
from _models_helpers import module_call
from _models_helpers import module_loss
from _models_helpers import smoke_config
from flax import nnx

import models
import optax_adama
from models import stages

# The Llama's training step and layouts are also checked in tests/zoo/test_llama.py
# (release against the unrolled fused step, a model that learns) and
# tests/zoo/test_llama_checkpoint.py (scanned against unrolled logits): here with
# the slow tests, to keep the default suite's time.
KINDS_LLAMA_SLOW = ("gpt", "bert", "vit", pytest.param("llama", marks=pytest.mark.slow))


def unstacked_params(scanned: nnx.State, num_layers: int) -> nnx.State:
  """The params of a `scan_layers` model laid out as the unrolled model's."""
  blocks = scanned["blocks"]
  layers_list = {i: jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(num_layers)}
  return nnx.State({**scanned, "blocks": nnx.State(layers_list)})


@pytest.mark.parametrize("kind", KINDS_LLAMA_SLOW)
def test_scan_layers_equals_unrolled(kind):
  config = smoke_config(kind, num_layers=3)
  batch = make_batch(config)
  scanned = models.create(config, scan_layers=True, rngs=nnx.Rngs(0))
  # A different seed: the unrolled model gets the scanned model's weights below.
  unrolled = models.create(config, rngs=nnx.Rngs(1))
  assert models.param_count(scanned) == models.param_count(unrolled)
  block_shapes = {x.shape for x in jax.tree.leaves(nnx.state(scanned.blocks, nnx.Param))}
  assert all(shape[0] == 3 for shape in block_shapes)
  nnx.update(unrolled, unstacked_params(nnx.state(scanned, nnx.Param), 3))
  (loss, _), (ref_loss, _) = module_loss(scanned, batch), module_loss(unrolled, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  inputs = batch["images"] if kind == "vit" else batch["tokens"]
  inputs = inputs[:, :-1] if kind in ("gpt", "llama") else inputs
  np.testing.assert_allclose(
      module_call(scanned, inputs), module_call(unrolled, inputs), rtol=1e-5, atol=1e-6)
  # The same seed gives the same weights in both layouts.
  same_seed = models.create(config, rngs=nnx.Rngs(0))
  jax.tree.map(np.testing.assert_array_equal,
               nnx.state(same_seed, nnx.Param), nnx.state(unrolled, nnx.Param))


def test_scan_layers_remat_applies_inside_the_scanned_block():
  batch = make_batch(smoke_config("gpt", num_layers=2))

  def run(remat: str):
    model = models.create(
        smoke_config("gpt", num_layers=2), scan_layers=True, remat=remat, rngs=nnx.Rngs(0))
    loss_fn, params = models.split_loss_fn(model)
    grad_fn = jax.value_and_grad(loss_fn)
    return str(jax.make_jaxpr(grad_fn)(params, batch)), jax.jit(grad_fn)(params, batch)

  (full_jaxpr, (loss, grads)), (none_jaxpr, (ref_loss, ref_grads)) = run("full"), run("none")
  assert "checkpoint" in full_jaxpr or "remat" in full_jaxpr
  assert "checkpoint" not in none_jaxpr and "remat" not in none_jaxpr
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               grads, ref_grads)


def test_scan_layers_preset_param_counts():
  for name in ("gpt2_small", "bert_base", "vit_base"):
    assert models.param_count(models.get_config(name, scan_layers=True)) == closed_form_count(
        models.PRESETS[name])


# BERT's and ViT's stages (a mask side input, a class token) are checked
# against the unrolled model by test_scan_layers_equals_unrolled; the
# release on them takes 25 s each on 2 cores. The GPT's (48 s on 2 busy
# cores) runs with them: the release on a scanned zoo model against the
# unrolled fused step keeps its smoke in tests/zoo/test_llama.py
# (test_release_equals_the_unrolled_fused_step), the GPT's stages theirs in
# test_scan_layers_equals_unrolled.
@pytest.mark.parametrize("kind", [
    pytest.param("gpt", marks=pytest.mark.slow), pytest.param("bert", marks=pytest.mark.slow),
    pytest.param("vit", marks=pytest.mark.slow)])
def test_release_step_on_scanned_model_equals_unrolled_microbatch_step(kind):
  config = smoke_config(kind, num_layers=2)
  batches = [make_batch(config, seed=seed) for seed in range(2)]
  learning_rate = 1e-3
  tx = optax_adama.adamaw(learning_rate, weight_decay=0.1, num_micro_batches=2)
  staged, params = models.staged_loss(models.create(config, scan_layers=True, rngs=nnx.Rngs(0)))
  loss_fn, ref_params = models.split_loss_fn(models.create(config, rngs=nnx.Rngs(0)))
  np.testing.assert_allclose(
      jax.jit(staged)(params, batches[0]), jax.jit(loss_fn)(ref_params, batches[0]), rtol=1e-5)
  step = optax_adama.release_step(staged, tx)
  ref_step = optax_adama.microbatch_step(loss_fn, tx)
  state, ref_state = tx.init(params), tx.init(ref_params)
  for batch in batches:
    params, state, metrics = step(params, state, batch)
    ref_params, ref_state, ref_metrics = ref_step(ref_params, ref_state, batch)
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
  hidden = config.hidden
  # Params move by lr * m_hat / sqrt(v_hat) per step; where a gradient is
  # mostly rounding that direction differs between the layouts' summation
  # orders by ~1e-4 of its bound 1 (seen: 1.1e-7 on one of the ViT's 49,152
  # weights after 2 steps at 1e-3), so their floor is 1e-4 of lr * steps.
  params_atol = 1e-4 * learning_rate * len(batches)
  for tree, ref_tree, atol in ((params, ref_params, params_atol),
                               (state.adama.mu, ref_state.adama.mu, 1e-7),
                               (state.adama.nu, ref_state.adama.nu, 1e-7)):
    # Key order is the same in both layouts: compare leaf by leaf.
    for (path, leaf), ref_leaf in zip(
        jax.tree_util.tree_leaves_with_path(unstacked_params(tree, 2)),
        jax.tree.leaves(ref_tree), strict=True):
      if "qkv" in jax.tree_util.keystr(path) and leaf.ndim == 1:
        # The key bias: its gradient is zero in exact arithmetic (softmax is
        # shift-invariant per query), so its moments are rounding noise that
        # differs between the two layouts.
        leaf, ref_leaf = (jnp.concatenate([x[:hidden], x[2 * hidden:]]) for x in (leaf, ref_leaf))
      np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-5, atol=atol)


def test_every_model_takes_the_one_staged_loss_path():
  """embed -> blocks -> head -> loss is written once (models.stages): each model gives
  its stages, none writes the composition again; the two decoders share their head."""
  for model_class in (models.GPT, models.BERT, models.ViT, models.Llama):
    assert issubclass(model_class, stages.StagedModel)
    assert model_class.loss is stages.StagedModel.loss
    assert model_class.run_blocks is stages.StagedModel.run_blocks
    assert "stage_embed" in vars(model_class) or issubclass(model_class, stages.CausalLM)
  for decoder in (models.GPT, models.Llama):
    assert issubclass(decoder, stages.CausalLM)
    for name in ("__call__", "stage_embed", "stage_mask", "stage_head", "attention_mask"):
      assert getattr(decoder, name) is getattr(stages.CausalLM, name), name
