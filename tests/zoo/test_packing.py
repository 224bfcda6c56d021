"""Packed rows in the Llama: segment ids, restarting positions and the loss mask.

Documents packed into one row (`models.text.pack`) must give each token the
loss it has when its document runs alone: attention stays within a document
and the rotary positions restart at each one. The reference is the same
model on each document alone, unpacked; the checks fail if the segment mask
or the position restart is taken away. Without the packed-row keys the models
compute what they did before the keys existed (`test_without_the_keys_...`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
import optax_adama
from models import text

SEQ_LEN = 32
# float32 round-off: the packed row's softmax runs over a longer, masked row
# (its masked scores give exp(.) = 0 exactly, but XLA sums other lengths in
# another order) and the rotary angles of a position are the same numbers;
# the measured worst relative difference of the per-token losses is ~3e-7.
RTOL, ATOL = 1e-5, 1e-6


def documents_of(token_lists, prompt_lengths) -> text.Documents:
  """`text.Documents` of explicit token lists with their prompt lengths."""
  lengths = np.array([len(t) for t in token_lists], np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  return text.Documents(np.concatenate([np.asarray(t, np.int32) for t in token_lists]),
                        starts, lengths, np.array(prompt_lengths, np.int64))


def packed_rows(seed: int = 0) -> dict[str, jax.Array]:
  """Every row of documents of lengths 3..45 (one longer than a row: split), some with prompts."""
  rng = np.random.default_rng(seed)
  lengths = [7, 12, 5, 20, 9, 3, 45, 15, 11]
  token_lists = [rng.integers(3, 256, n).tolist() for n in lengths]
  prompts = [0, 4, 0, 8, 0, 0, 0, 6, 0]
  packed = text.pack(documents_of(token_lists, prompts), SEQ_LEN)
  rows = packed.rows(np.arange(len(packed)))
  assert (rows["segment_ids"].max(axis=1) > 1).sum() >= 3, "rows pack several documents"
  assert (rows["segment_ids"] == 0).any(), "and some padding"
  return {key: jnp.asarray(value) for key, value in rows.items()}


def per_token_losses(model: models.Llama, batch) -> jax.Array:
  """Cross-entropy of each next-token prediction, [batch, length - 1], through the
  model's own stages (embed, mask, positions, blocks, logits)."""
  x = model.stage_embed(batch)
  x = model.run_blocks(x, model.stage_mask(x, batch), model.stage_positions(batch))
  log_probs = jax.nn.log_softmax(model.logits(x).astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(log_probs, batch["tokens"][:, 1:, None], axis=-1)[..., 0]


def segments_of(batch):
  """(row, first column, length) of every segment of every row."""
  segment_ids = np.asarray(batch["segment_ids"])
  for row, ids in enumerate(segment_ids):
    for segment in range(1, ids.max() + 1):
      (where,) = np.nonzero(ids == segment)
      yield row, int(where[0]), len(where)


def alone_and_packed(model, batch, packed_losses):
  """Per segment: (losses of the document piece run alone, the packed row's at its tokens)."""
  graphdef, state = nnx.split(model)
  # Jitted: eager dispatch of every op at each piece's length took 30 s on 2 cores.
  alone_losses = jax.jit(lambda state, batch: per_token_losses(nnx.merge(graphdef, state), batch))
  for row, column, length in segments_of(batch):
    piece = batch["tokens"][row:row + 1, column:column + length]
    alone = alone_losses(state, {"tokens": piece})[0]
    yield column, np.asarray(alone), np.asarray(packed_losses[row, column:column + length - 1])


@pytest.fixture(scope="module")
def llama():
  return models.create("llama_test", num_layers=2, rngs=nnx.Rngs(0))


def test_packed_rows_give_each_document_its_unpacked_losses(llama):
  batch = packed_rows()
  losses = per_token_losses(llama, batch)
  assert bool(jnp.isfinite(losses).all()), "padding attends to padding: no empty mask row"
  compared = 0
  for _, alone, packed in alone_and_packed(llama, batch, losses):
    np.testing.assert_allclose(packed, alone, rtol=RTOL, atol=ATOL)
    compared += len(alone)
  assert compared == int((np.asarray(batch["segment_ids"])[:, 1:] > 0).sum()
                         - (np.diff(np.asarray(batch["segment_ids"]), axis=1) > 0).sum())


@pytest.mark.parametrize("broken", ["segment_ids", "positions"])
def test_without_the_segment_mask_or_position_restart_packed_differs(llama, broken):
  """The reference above can fail: one document per row, or positions not restarted.

  Rotary scores depend only on the distance between query and key, so within
  the segment mask positions 0.. across the row (each document shifted by its
  column) give the same losses to round-off (measured 4.8e-7): the broken
  positions here are all 0, which the rotation does see."""
  batch = dict(packed_rows())
  if broken == "segment_ids":
    batch["segment_ids"] = jnp.ones_like(batch["segment_ids"])
    reference = packed_rows()  # segments as packed, to cut the pieces out
  else:
    batch["positions"] = jnp.zeros_like(batch["positions"])
    reference = batch
  losses = per_token_losses(llama, batch)
  worst = 0.0
  for column, alone, packed in alone_and_packed(llama, reference, losses):
    if column > 0 or broken == "positions":  # a row's first document keeps its context
      worst = max(worst, float(np.max(np.abs(packed - alone))))
  assert worst > 1e-3, worst  # round-off is under 1e-6


def test_without_the_keys_the_loss_is_unchanged_and_trivial_keys_change_nothing(llama):
  """No packed-row keys: the causal [1, 1, L, L] mask and positions 0.., as before the
  keys existed (bitwise against the committed code when written: 112 logits, losses and
  gradients of llama_test / gpt_test and their chunked, scanned and staged variants).
  One segment, positions 0.. and every target: the same loss to round-off."""
  tokens = packed_rows()["tokens"]
  plain = {"tokens": tokens}
  x = llama.stage_embed(plain)
  assert llama.stage_mask(x, plain).shape == (1, 1, SEQ_LEN, SEQ_LEN)
  assert llama.stage_positions(plain) is None
  np.testing.assert_array_equal(per_token_losses(llama, plain)[:, :-1],
                                per_token_losses(llama, {"tokens": tokens[:, :-1]}))
  trivial = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens),
             "positions": jnp.broadcast_to(jnp.arange(SEQ_LEN + 1), tokens.shape),
             "loss_mask": jnp.ones(tokens.shape, bool)}
  np.testing.assert_allclose(llama.loss(trivial)[0], llama.loss(plain)[0], rtol=1e-6)


def test_the_loss_is_the_mean_over_targets_and_prompts_carry_none(llama):
  batch = packed_rows()
  targets = np.asarray(batch["loss_mask"])[:, 1:]
  assert (~targets & (np.asarray(batch["segment_ids"])[:, 1:] > 0)).sum() > 10, "prompts"
  losses = np.asarray(per_token_losses(llama, batch), np.float64)
  np.testing.assert_allclose(llama.loss(batch)[0], losses[targets].mean(), rtol=1e-6)
  # The head is per token: the loss's gradient at a position whose label is
  # not a target (a prompt token, a segment's first token, padding) is zero.
  x = llama.run_blocks(llama.stage_embed(batch), llama.stage_mask(
      llama.stage_embed(batch), batch), llama.stage_positions(batch))
  for loss_chunks in (1, 4):
    head = models.create("llama_test", num_layers=2, loss_chunks=loss_chunks, rngs=nnx.Rngs(0))
    grad = jax.grad(lambda x, head=head: head.stage_head(x, batch)[0])(x)
    grad_norms = np.asarray(jnp.abs(grad).sum(axis=-1))
    assert (grad_norms[~targets] == 0).all(), loss_chunks
    assert (grad_norms[targets] > 0).all(), loss_chunks


def test_chunked_attention_chunked_loss_and_staged_loss_equal_the_plain_loss():
  batch = packed_rows()
  config = models.get_config("llama_test", num_layers=2, scan_layers=True)
  plain = models.create(config, rngs=nnx.Rngs(0))
  loss = plain.loss(batch)[0]
  for overrides in ({"loss_chunks": 4}, {"attention_chunk": 8}):
    variant = models.create(config, **overrides, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(variant.loss(batch)[0], loss, rtol=1e-6, err_msg=str(overrides))
  staged, params = models.staged_loss(plain)
  np.testing.assert_allclose(staged(params, batch), loss, rtol=1e-6)
  loss_fn, same_params = models.split_loss_fn(plain)
  grads, staged_grads = (jax.grad(f)(p, batch) for f, p in ((loss_fn, same_params),
                                                            (staged, params)))
  for leaf, staged_leaf in zip(jax.tree.leaves(grads), jax.tree.leaves(staged_grads),
                               strict=True):
    np.testing.assert_allclose(staged_leaf, leaf, rtol=1e-5, atol=1e-7)


def test_microbatch_step_and_release_step_train_on_packed_rows():
  batch = packed_rows()
  batch = {key: value[:4] for key, value in batch.items()}
  tx = optax_adama.adama(1e-3, num_micro_batches=2)
  model = models.create("llama_test", num_layers=2, scan_layers=True, rngs=nnx.Rngs(0))
  loss_fn, params = models.split_loss_fn(model)
  staged, staged_params = models.staged_loss(model)
  expected = float(loss_fn(params, batch))
  for make_step, loss, step_params in ((optax_adama.microbatch_step, loss_fn, params),
                                       (optax_adama.release_step, staged, staged_params)):
    step = make_step(loss, tx)
    before = jax.tree.map(np.asarray, step_params)
    # A copy: the step donates its params, and both splits share the model's buffers.
    step_params = jax.tree.map(jnp.array, step_params)
    new_params, _, metrics = step(step_params, tx.init(step_params), batch)
    assert np.isfinite(float(metrics["loss"]))
    # The mean of the two micro-batches' masked means: near the whole batch's.
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=0.2)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), new_params, before)
    assert max(jax.tree.leaves(moved)) > 0
