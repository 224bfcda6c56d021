"""The loss of every model of the zoo, in three stages: embed -> blocks -> head.

A model of the zoo is a `StagedModel`: it says how a batch enters (its
`stage_embed`), which attention mask its blocks see (`stage_mask`) and how the
last block's output becomes the loss (`stage_head`). The composition of the
three is written here once, for both ways a step takes the loss:

- whole, `model.loss(batch)` (`make_loss_fn`, `split_loss_fn`: the pure
  `loss_fn(params, batch)` that `optax_adama.microbatch_step` scans), the
  blocks run by `models.layers.apply_blocks`;
- in stages, `staged_loss(model)`: the `optax_adama.StagedLoss` whose layers
  `optax_adama.release_step` runs one at a time, the same pieces with one block
  (`models.layers.apply_layer`) in place of the stack.

`CausalLM` adds what the two decoder LMs (GPT, Llama) share: next-token
batches, the causal mask and the LM head's loss, whole or by chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import optax_adama
from models import layers
from models import savers

Array = jax.Array
Batch = dict[str, Array]


class StagedModel(nnx.Module):
  """A model whose loss is embed -> blocks -> head; subclasses give the three stages.

  A subclass sets `self.config` (a `models.layers.TransformerConfig`) and
  `self.blocks` (from `models.layers.make_blocks`), and defines
  `stage_embed`, `stage_mask` and `stage_head`.
  """

  def loss(self, batch: Batch) -> tuple[Array, dict[str, Array]]:
    """The mean loss of a batch and its metrics ({"accuracy": ...}), float32 scalars.

    Args:
      batch: the model's batch format (its module's docstring).
    """
    x = self.stage_embed(batch)
    x = self.run_blocks(x, self.stage_mask(x, batch), self.stage_positions(batch))
    return self.stage_head(x, batch)

  def run_blocks(self, x: Array, mask: Array | None, positions: Array | None = None) -> Array:
    """The block stack on the blocks' input `x`, under the config's remat policy.

    `positions` ([batch, length] ints) reach blocks with rotary attention; None
    leaves each block at its default (0 .. length - 1), and blocks that take
    no positions are called as they always were.
    """
    return layers.apply_blocks(self.blocks, x, mask, positions=positions,
                               remat=self.config.remat)

  def stage_embed(self, batch: Batch) -> Array:
    """The blocks' input [batch, length, hidden] from a batch."""
    raise NotImplementedError

  def stage_mask(self, x: Array, batch: Batch) -> Array | None:
    """The attention mask every block sees (None: attend to everything)."""
    raise NotImplementedError

  def stage_positions(self, batch: Batch) -> Array | None:
    """The positions [batch, length] every block sees; None (the default): 0 .. length - 1.

    Only a model whose blocks take positions (the Llama's rotary attention)
    returns any; the others add theirs in `stage_embed` or have none.
    """
    del batch
    return None

  def stage_head(self, x: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
    """The loss and metrics from the last block's output."""
    raise NotImplementedError


class CausalLM(StagedModel):
  """A decoder-only LM: tokens to next-token logits, trained on next-token batches.

  Batch format of `loss`: {"tokens": int32[batch, seq_len + 1]}; the model
  reads tokens[:, :-1] and predicts tokens[:, 1:]. Packed rows (`models.text`)
  may add, each [batch, seq_len + 1]: "segment_ids" (int; 0 is padding, 1..
  a document of the row): a token attends only to earlier tokens of its own
  segment (padding to padding, so no row of the mask is empty);
  "loss_mask" (bool): loss_mask[:, 1:] marks the targets, and the loss and
  accuracy are their mean (a prompt's tokens carry no loss); "positions"
  (int, restarting at 0 per document), read by models whose blocks take
  positions (`stage_positions`: the Llama's rotary ones). Without these keys
  the model computes exactly what it did before they existed. A subclass defines `embed`
  (tokens to the blocks' input), `final_norm`, `logits` (the last block's
  output to logits) and `head_table` (the LM head as a [vocab, hidden] table,
  for the loss by chunks); `config.loss_chunks` picks the loss.
  """

  def __call__(self, tokens: Array) -> Array:
    """Computes next-token logits.

    Args:
      tokens: int[batch, length] token ids, length <= config.max_len.

    Returns:
      [batch, length, vocab_size] logits in the compute dtype.
    """
    x = self.embed(tokens)
    x = self.run_blocks(x, self.attention_mask(x))
    return self.logits(x)

  def embed(self, tokens: Array) -> Array:
    """The blocks' input [batch, length, hidden] from token ids."""
    raise NotImplementedError

  def logits(self, x: Array) -> Array:
    """Next-token logits from the last block's output."""
    raise NotImplementedError

  def head_table(self) -> Array:
    """The LM head as a [vocab, hidden] table."""
    raise NotImplementedError

  def attention_mask(self, x: Array) -> Array:
    """The causal mask of the blocks' input `x` ([batch, length, hidden])."""
    length = x.shape[1]
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None, :, :]

  def stage_embed(self, batch: Batch) -> Array:
    return self.embed(batch["tokens"][:, :-1])

  def stage_mask(self, x: Array, batch: Batch) -> Array:
    """The causal mask, and with "segment_ids" each token's own segment only.

    [1, 1, length, length] without segment ids; [batch, 1, length, length]
    with them (the per-example mask costs only when rows are packed).
    """
    mask = self.attention_mask(x)
    if "segment_ids" in batch:
      segments = batch["segment_ids"][:, :-1]
      # Padding (0) attends to padding: the diagonal keeps every row non-empty.
      mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    return mask

  def stage_head(self, x: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
    """Mean next-token cross-entropy and accuracy, over the whole logits or by chunks.

    With "loss_mask", the mean over the targets loss_mask[:, 1:] marks. With
    "loss_weights" (float, in its place), the sum of the weighted losses over
    the rows' count: weights that sum to the rows over a whole micro-batch
    (`models.harness.weigh_targets`) give its mean per target, whichever
    devices hold which rows (each device's mean then counts its rows' share).
    """
    labels = batch["tokens"][:, 1:]
    denominator = None
    if "loss_weights" in batch:
      weights, denominator = batch["loss_weights"][:, 1:], labels.shape[0]
    else:
      weights = batch["loss_mask"][:, 1:] if "loss_mask" in batch else None
    if self.config.loss_chunks == 1:
      loss, accuracy = layers.cross_entropy(self.logits(x), labels, weights, denominator)
    else:
      loss, accuracy = savers.chunked_cross_entropy(
          self.final_norm(x), self.head_table(), labels, num_chunks=self.config.loss_chunks,
          dtype=self.config.dtype, weights=weights, denominator=denominator)
    return loss, {"accuracy": accuracy}


def make_loss_fn(
    graphdef: nnx.GraphDef, *rest: nnx.State, has_aux: bool = False
) -> Callable[..., Any]:
  """The pure loss of a split model, for `jax.grad` and `lax.scan`.

  Args:
    graphdef: from `graphdef, params, *rest = nnx.split(model, nnx.Param, ...)`.
    *rest: the non-parameter states from the same split (our models have
      none, but passing them keeps this correct for any NNX model).
    has_aux: also return the model's metrics dict (e.g. "accuracy").

  Returns:
    `loss_fn(params, batch) -> loss`, or `-> (loss, metrics)` if `has_aux`,
    where loss is the float32 mean loss of the batch. The batch formats are
    documented on `GPT.loss`, `BERT.loss` and `ViT.loss`.
  """

  def loss_fn(params: nnx.State, batch: Batch) -> Any:
    model = nnx.merge(graphdef, params, *rest)
    loss, metrics = model.loss(batch)
    return (loss, metrics) if has_aux else loss

  return loss_fn


def split_loss_fn(
    model: nnx.Module, *, has_aux: bool = False
) -> tuple[Callable[..., Any], nnx.State]:
  """Splits `model` and returns `(loss_fn, params)`; see `make_loss_fn`.

  After training, write the parameters back with `nnx.update(model, params)`.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return make_loss_fn(graphdef, rest, has_aux=has_aux), params


def staged_loss(model: nnx.Module) -> tuple[optax_adama.StagedLoss, nnx.State]:
  """Splits a `scan_layers` model into `(staged loss, params)` for `release_step`.

  The stages are the model's own `stage_embed`, one block (under the model's
  remat policy) and `stage_head`; the stacked block params are
  `params["blocks"]`. Called as `staged(params, batch)` it is the model's mean
  loss, so `optax_adama.microbatch_step(staged, tx)` runs the same model.

      staged, params = models.staged_loss(models.create(config, rngs=rngs))
      step = optax_adama.release_step(staged, optax_adama.adama(lr, num_micro_batches=4))
  """
  if not model.config.scan_layers:
    raise ValueError("staged_loss needs a model built with scan_layers=True.")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  block_graphdef, _ = nnx.split(model.blocks)
  # embed and head never read the blocks: shapes stand in for them.
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  template = nnx.merge(graphdef, shapes, rest)

  def merged(outer: nnx.State) -> nnx.Module:
    return nnx.merge(graphdef, nnx.State({**outer, "blocks": shapes["blocks"]}), rest)

  def block(layer_params: nnx.State, x: jax.Array, batch: Batch) -> jax.Array:
    # Each layer rebuilds the mask and positions from the micro-batch it is
    # given (as the whole loss builds them once): nothing extra in the carry.
    mask = template.stage_mask(x, batch)
    return layers.apply_layer(block_graphdef, layer_params, x, mask,
                              positions=template.stage_positions(batch),
                              remat=model.config.remat)

  staged = optax_adama.StagedLoss(
      embed=lambda outer, batch: merged(outer).stage_embed(batch),
      block=block,
      head=lambda outer, x, batch: merged(outer).stage_head(x, batch)[0],
      layers="blocks")
  return staged, params
