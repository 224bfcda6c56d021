"""models/: GPT, BERT, ViT and Llama shapes, losses, gradients, remat; tiny models that learn."""

from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models_helpers import KINDS
from _models_helpers import make_batch
from _models_helpers import module_call
from _models_helpers import smoke_config
from flax import nnx

import models
from models import layers

# Every model is exercised at its 1-layer, width-128 test config. Losses are
# checked against independent references (optax's cross-entropy, a direct
# convolution, truncated sequences), preset sizes against the published counts
# (test_models_presets.py) and a closed form.

# Only the GPT in the default suite: each kind's loss against its module and
# reference is checked there by test_forward_shapes_and_loss, and its split
# loss's gradients by test_bfloat16_compute; the Adam step on BERT and ViT
# (25-40 s each on 2 busy cores) runs with the slow tests.
KINDS_GPT_ONLY = (
    "gpt", pytest.param("bert", marks=pytest.mark.slow),
    pytest.param("vit", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow))


def reference_loss(model: models.Model, batch: dict) -> jax.Array:
  """The loss recomputed from the model's logits with optax's cross-entropy."""
  if isinstance(model, (models.GPT, models.Llama)):
    logits = model(batch["tokens"][:, :-1]).astype(jnp.float32)
    labels = batch["tokens"][:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  if isinstance(model, models.BERT):
    logits = model(batch["tokens"]).astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    weights = batch["mask_weights"]
    return jnp.sum(nll * weights) / jnp.sum(weights)
  logits = model(batch["images"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


@pytest.mark.parametrize("kind", KINDS)
def test_forward_shapes_and_loss(kind):
  config = smoke_config(kind)
  model = models.create(config, rngs=nnx.Rngs(0))
  batch = make_batch(config)
  inputs = batch["images"] if kind == "vit" else batch["tokens"]
  if kind in ("gpt", "llama"):
    inputs = inputs[:, :-1]

  @nnx.jit  # one compile for everything: eager dispatch is slower here
  def run(model, inputs, batch):
    return model(inputs), model.loss(batch), reference_loss(model, batch)

  logits, (loss, metrics), ref_loss = run(model, inputs, batch)
  if kind == "vit":
    assert logits.shape == (4, config.num_classes)
  else:
    assert logits.shape == (4, config.max_len, config.vocab_size)
  assert logits.dtype == jnp.float32
  assert loss.shape == () and metrics["accuracy"].shape == ()
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  # Small init: near-uniform predictions, so the loss is close to log(classes).
  num_classes = config.num_classes if kind == "vit" else config.vocab_size
  assert abs(float(loss) - math.log(num_classes)) < 0.5


def test_bert_pooler_shape():
  config = smoke_config("bert")
  model = models.create(config, rngs=nnx.Rngs(0))
  tokens = make_batch(config)["tokens"]
  pooled = nnx.jit(lambda model, tokens: model.pool(model.encode(tokens)))(model, tokens)
  assert pooled.shape == (4, config.hidden)


@pytest.mark.parametrize("kind", KINDS_GPT_ONLY)
def test_loss_fn_matches_module_and_adam_step_lowers_loss(kind):
  config = smoke_config(kind)
  model = models.create(config, rngs=nnx.Rngs(0))
  batch = make_batch(config)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss_fn = models.make_loss_fn(graphdef, rest)
  aux_fn = jax.jit(models.make_loss_fn(graphdef, rest, has_aux=True))

  loss0, metrics = aux_fn(params, batch)
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0

  tx = optax.adam(1e-3)
  state = tx.init(params)
  step = adam_step(loss_fn, tx)

  new_params, state, loss, grads = step(params, state, batch)
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  grad_leaves = jax.tree.leaves(grads)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad_leaves)
  assert sum(float(jnp.sum(jnp.abs(g))) for g in grad_leaves) > 0.0
  loss1, _ = aux_fn(new_params, batch)
  assert float(loss1) < float(loss0)

  # Writing the trained params back updates the module.
  nnx.update(model, new_params)
  assert jax.tree.all(jax.tree.map(jnp.array_equal, nnx.state(model, nnx.Param), new_params))


def test_split_loss_fn_equals_make_loss_fn():
  config = smoke_config("vit")
  model = models.create(config, rngs=nnx.Rngs(0))
  batch = make_batch(config)
  loss_fn, params = models.split_loss_fn(model, has_aux=True)
  graphdef, ref_params, rest = nnx.split(model, nnx.Param, ...)
  assert jax.tree.structure(params) == jax.tree.structure(ref_params)
  ref_fn = models.make_loss_fn(graphdef, rest, has_aux=True)

  @nnx.jit
  def run(model, params, ref_params, batch):
    return loss_fn(params, batch), ref_fn(ref_params, batch), model.loss(batch)

  (loss, metrics), (ref_loss, ref_metrics), (module_loss, module_metrics) = run(
      model, params, ref_params, batch
  )
  np.testing.assert_allclose(loss, ref_loss)
  np.testing.assert_allclose(loss, module_loss, rtol=1e-6)
  np.testing.assert_allclose(metrics["accuracy"], ref_metrics["accuracy"])
  np.testing.assert_allclose(metrics["accuracy"], module_metrics["accuracy"])


@pytest.mark.parametrize(
    "kind, policies",
    # Every policy goes through the same wrapper, and each costs a compile, so
    # the fast set checks "minimal" and "dots" on the GPT ("full" inside the
    # scanned GPT: test_scan_layers_remat_applies_inside_the_scanned_block);
    # the others, BERT and ViT included, run with the slow tests.
    [
        ("gpt", ("minimal", "dots")),
        pytest.param("bert", ("full",), marks=pytest.mark.slow),
        pytest.param("vit", ("full",), marks=pytest.mark.slow),
        pytest.param("gpt", ("full", "dots_no_batch"), marks=pytest.mark.slow),
        pytest.param("bert", ("minimal", "dots", "dots_no_batch"), marks=pytest.mark.slow),
        pytest.param("vit", ("minimal", "dots", "dots_no_batch"), marks=pytest.mark.slow),
    ],
)
def test_remat_policies_match_no_remat(kind, policies):
  batch = make_batch(smoke_config(kind))

  def loss_and_grads(remat: str):
    model = models.create(smoke_config(kind, remat=remat), rngs=nnx.Rngs(0))
    loss_fn, params = models.split_loss_fn(model)
    return jax.jit(jax.value_and_grad(loss_fn))(params, batch)

  ref_loss, ref_grads = loss_and_grads("none")
  for remat in policies:
    loss, grads = loss_and_grads(remat)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, ref_grads
    )


def test_remat_actually_recomputes():
  """`full` remat must show up in the jaxpr of the gradient, `none` must not."""
  batch = make_batch(smoke_config("gpt"))

  def jaxpr_text(remat: str) -> str:
    loss_fn, params = models.split_loss_fn(models.create("gpt_test", remat=remat, rngs=nnx.Rngs(0)))
    return str(jax.make_jaxpr(jax.grad(loss_fn))(params, batch))

  assert "checkpoint" in jaxpr_text("full") or "remat" in jaxpr_text("full")
  assert "checkpoint" not in jaxpr_text("none") and "remat" not in jaxpr_text("none")


def test_minimal_remat_keeps_the_named_activations_and_nothing_quadratic(capsys):
  """Under "minimal" the backward pass keeps exactly the tagged block tensors."""
  config = smoke_config("gpt")
  batch = make_batch(config)
  length = batch["tokens"].shape[1] - 1

  def saved(remat: str) -> str:
    loss_fn, params = models.split_loss_fn(
        models.create(config, remat=remat, rngs=nnx.Rngs(0)))
    jax.ad_checkpoint.print_saved_residuals(lambda p: loss_fn(p, batch), params)
    return capsys.readouterr().out

  minimal, full = saved("minimal"), saved("full")
  # The qkv projection [B, T, 3 * hidden] and the MLP's hidden [B, T, 4 * hidden]
  # are kept, by shape (jax labels checkpoint names in this print from 0.10.2).
  rows = batch["tokens"].shape[0]
  for width in (3 * config.hidden, 4 * config.hidden):
    assert f"f32[{rows},{length},{width}]" in minimal
    assert f"f32[{rows},{length},{width}]" not in full
  if "named '" in minimal:
    # mlp_out only feeds a residual add, whose backward needs nothing saved.
    for name in ("qkv", "attention_context", "attention_out", "mlp_hidden"):
      assert f"named '{name}'" in minimal
      assert f"named '{name}'" not in full
  # No float [batch, heads, T, T] scores or probabilities (the bool causal mask
  # is saved outside the blocks under every policy).
  quadratic = re.compile(rf"^f32\[\d+,\d+,{length},{length}\]", re.MULTILINE)
  assert not quadratic.search(minimal)
  assert quadratic.search(saved("none"))


def test_unknown_remat_and_preset_raise():
  with pytest.raises(ValueError, match="remat.*'some'"):
    models.create("gpt_test", remat="some", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="remat.*'some'"):
    models.ViTConfig(remat="some")  # checked once, where the config is built
  with pytest.raises(KeyError):
    models.get_config("gpt5")


def test_gpt_is_causal():
  config = smoke_config("gpt")
  model = models.create(config, rngs=nnx.Rngs(0))
  tokens = make_batch(config)["tokens"][:, :-1]
  changed = tokens.at[:, 10:].set((tokens[:, 10:] + 1) % config.vocab_size)
  logits, changed_logits = module_call(model, tokens), module_call(model, changed)
  np.testing.assert_allclose(logits[:, :10], changed_logits[:, :10], rtol=1e-5, atol=1e-6)
  assert not np.allclose(logits[:, 10:], changed_logits[:, 10:])


def test_gpt_tied_head():
  model = models.create("gpt_test", rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(params)}
  assert not any("head" in name for name in names)  # no separate output matrix


def test_bert_attention_mask_equals_truncation():
  """Outputs at real tokens with padded keys masked equal those of the unpadded sequence."""
  config = smoke_config("bert")
  model = models.create(config, rngs=nnx.Rngs(0))
  tokens = make_batch(config)["tokens"]
  length = 20
  mask = jnp.broadcast_to(jnp.arange(config.max_len)[None, :] < length, tokens.shape)
  padded = jnp.where(mask, tokens, 256)  # [PAD]

  @nnx.jit  # one compile: eager dispatch is slower here
  def encode(model, padded, mask, truncated):
    return (model.encode(padded, attention_mask=mask), model.encode(padded),
            model.encode(truncated))

  masked, unmasked, truncated = encode(model, padded, mask, tokens[:, :length])
  np.testing.assert_allclose(masked[:, :length], truncated, rtol=1e-4, atol=1e-5)
  assert not np.allclose(unmasked[:, :length], truncated)


def test_bert_token_types_change_output():
  config = smoke_config("bert")
  model = models.create(config, rngs=nnx.Rngs(0))
  tokens = make_batch(config)["tokens"]
  np.testing.assert_allclose(model(tokens, jnp.zeros_like(tokens)), model(tokens))
  assert not np.allclose(model(tokens, jnp.ones_like(tokens)), model(tokens))


def test_vit_patch_embedding_equals_strided_conv():
  config = models.ViTConfig.test(image_size=8, patch_size=4, num_channels=3)
  model = models.create(config, rngs=nnx.Rngs(0))
  images = make_batch(config)["images"]
  p = config.patch_size
  ours = model.patch_embed(model.patchify(images))
  kernel = model.patch_embed.kernel[...].reshape(p, p, config.num_channels, config.hidden)
  conv = jax.lax.conv_general_dilated(
      images, kernel, window_strides=(p, p), padding="VALID",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )
  conv = conv + model.patch_embed.bias[...][None, None, None, :]
  np.testing.assert_allclose(ours, conv.reshape(ours.shape), rtol=1e-5, atol=1e-5)


def test_vit_accepts_images_without_channel_axis():
  config = smoke_config("vit")
  model = models.create(config, rngs=nnx.Rngs(0))
  images = make_batch(config)["images"]
  no_channel, with_channel = nnx.jit(  # one compile: eager dispatch is slower here
      lambda model, images: (model(images[..., 0]), model(images)))(model, images)
  np.testing.assert_allclose(no_channel, with_channel)
  with pytest.raises(ValueError, match="shape"):
    model(jnp.zeros((2, 16, 16, 1), jnp.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_compute(kind):
  batch = make_batch(smoke_config(kind))
  model32 = models.create(smoke_config(kind), rngs=nnx.Rngs(0))
  model16 = models.create(smoke_config(kind, dtype=jnp.bfloat16), rngs=nnx.Rngs(0))
  loss_fn, params = models.split_loss_fn(model16)
  loss_fn32, params32 = models.split_loss_fn(model32)

  @jax.jit
  def run(params, params32, batch):
    return jax.value_and_grad(loss_fn)(params, batch), loss_fn32(params32, batch)

  (loss, grads), loss32 = run(params, params32, batch)
  assert loss.dtype == jnp.float32
  # Parameters stay float32 (param_dtype); gradients match them.
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(loss, loss32, rtol=2e-2)


def test_remat_policy_names():
  assert set(layers.REMAT_POLICIES) == {"none", "minimal", "full", "dots", "dots_no_batch",
                                       "offload"}


def test_loss_fn_scans_over_micro_batches():
  """The pure loss under `lax.scan` (as `optax_adama.microbatch_step` runs it):
  the mean of micro-batch gradients equals the full-batch gradient."""
  config = smoke_config("gpt")
  loss_fn, params = models.split_loss_fn(models.create(config, rngs=nnx.Rngs(0)))
  batch = make_batch(config, batch_size=4)
  num_micro_batches = 2

  @jax.jit
  def both(params, batch):
    micro = jax.tree.map(
        lambda x: x.reshape((num_micro_batches, -1) + x.shape[1:]), batch
    )

    def body(total, micro_batch):
      grads = jax.grad(loss_fn)(params, micro_batch)
      return jax.tree.map(lambda t, g: t + g / num_micro_batches, total, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    accumulated, _ = jax.lax.scan(body, zeros, micro)
    return accumulated, jax.grad(loss_fn)(params, batch)

  accumulated, full = both(params, batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               accumulated, full)


def adam_step(loss_fn, tx):
  """A jitted optax step: (params, state, batch) -> (params, state, loss, grads)."""

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    # optax.adam computes b1**count (python float ** int32), which strict
    # dtype promotion rejects; that is optax's business, not the model's.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, grads

  return step


def train(name: str, batches, *, steps: int, learning_rate: float = 3e-3):
  """Trains a preset with Adam on a batch stream.

  Returns:
    (jitted loss_fn returning (loss, metrics), trained params, training losses).
  """
  aux_fn, params = models.split_loss_fn(models.create(name, rngs=nnx.Rngs(0)), has_aux=True)
  loss_fn = lambda params, batch: aux_fn(params, batch)[0]
  tx = optax.adam(learning_rate)
  state = tx.init(params)
  step = adam_step(loss_fn, tx)

  losses = []
  for batch in itertools.islice(batches, steps):
    params, state, loss, _ = step(params, state, batch)
    losses.append(float(loss))
  return jax.jit(aux_fn), params, losses


def unigram_entropy(corpus: np.ndarray) -> float:
  """Entropy (nats) of the byte frequencies: the loss of a context-free model."""
  probs = np.bincount(corpus, minlength=256) / len(corpus)
  probs = probs[probs > 0]
  return float(-(probs * np.log(probs)).sum())


@pytest.mark.slow
def test_gpt_tiny_learns_stdlib_bytes():
  from models import data

  text = data.load_stdlib_text(max_bytes=1_000_000)
  batches = data.lm_batches(text.train, batch_size=16, seq_len=64, seed=0)
  loss_fn, params, losses = train("gpt_tiny", batches, steps=200)
  valid = next(data.lm_batches(text.valid, batch_size=64, seq_len=64, seed=0))
  # Starts near uniform (log 256 = 5.5); must end well below the best
  # context-free model (~3.1 nats), i.e. it uses the context.
  assert losses[0] > 5.0
  valid_loss, _ = loss_fn(params, valid)
  assert float(valid_loss) < unigram_entropy(text.train) - 0.5


@pytest.mark.slow
def test_bert_tiny_learns_masked_bytes():
  from models import data

  text = data.load_stdlib_text(max_bytes=1_000_000)
  batches = data.mlm_batches(text.train, batch_size=16, seq_len=64, seed=0)
  # Post-LN BERT without warmup stalls at the unigram solution at 3e-3.
  loss_fn, params, losses = train("bert_tiny", batches, steps=400, learning_rate=1e-3)
  valid = next(data.mlm_batches(text.valid, batch_size=64, seq_len=64, seed=0))
  assert losses[0] > 5.0
  valid_loss, _ = loss_fn(params, valid)
  assert float(valid_loss) < unigram_entropy(text.train) - 0.1


@pytest.mark.slow
def test_vit_tiny_learns_digits():
  from models import data

  digits = data.load_digits()
  batches = data.image_batches(digits.train_images, digits.train_labels, batch_size=64, seed=0)
  loss_fn, params, _ = train("vit_tiny", batches, steps=200, learning_rate=1e-3)
  _, metrics = loss_fn(params, {"images": digits.valid_images, "labels": digits.valid_labels})
  assert float(metrics["accuracy"]) > 0.8
