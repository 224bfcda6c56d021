"""Batches of the zoo's formats for measuring a step: shapes to compile, values to time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import models
from models import data
from models import text


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


def uses_packed_text(model_kind: str, init_from: str | None, data_path: str | None) -> bool:
  """Whether a causal LM's run reads `models.text`'s packed rows, not `models.data`'s bytes.

  A checkpoint's run (its tokenizer) and a JSON Lines file do. A run from
  scratch on plain text keeps the byte stream it had before packing existed,
  so its committed numbers stay reproducible.
  """
  if model_kind not in ("gpt", "llama"):
    return False
  return init_from is not None or (data_path is not None
                                   and Path(data_path).suffix == text.JSONL_SUFFIX)


def packed_text_batches(model_config: models.Config, *, init_from: str | None,
                        data_path: str | None, max_bytes: int, batch_size: int, seq_len: int,
                        seed: int, progress: bool | None = None,
                        ) -> tuple[Iterator[dict], Iterator[dict], int]:
  """(training rows, held-out rows, held-out row count) of packed text.

  Tokenized with `init_from`'s tokenizer (the byte default without one),
  checked against the model's embedding; `data_path` is a text file, a
  directory of them or JSON Lines (cached by `models.text.tokenize`), else the
  standard library's text is read as `models.data` reads it. Documents never
  attend across their boundary and restart their positions; prompt tokens
  carry no loss. `models.text.DataError` for bad data or a tokenizer larger
  than the embedding; the held-out stream's batches are at most `batch_size`
  rows, fewer when the split is smaller.
  """
  tokenizer = text.load_tokenizer(init_from)
  vocab_size = model_config.vocab_size  # type: ignore[union-attr]
  if data_path is not None:
    train, valid, _ = text.load_packed_text(
        data_path, tokenizer, seq_len=seq_len, cache_dir=text.default_cache_dir(),
        model_vocab_size=vocab_size, progress=progress)
  else:
    text.check_vocab_size(tokenizer, vocab_size)
    stdlib = data.load_stdlib_text(max_bytes=max_bytes)
    train, valid = (text.pack(text.tokenize_documents(
        [text.Document(bytes(split).decode("utf-8", "surrogateescape"), None,
                       f"Python's standard library ({name} split)")],
        tokenizer, progress=progress), seq_len)
        for name, split in (("training", stdlib.train), ("held-out", stdlib.valid)))
  if len(valid) == 0:
    raise text.DataError(f"the held-out split of {data_path or 'the standard library'} packs "
                         "into no row; add documents or text.")
  train_rows = text.text_batches(train, batch_size=batch_size, seed=seed)
  valid_rows = text.text_batches(valid, batch_size=min(batch_size, len(valid)), shuffle=False,
                                 epochs=1)
  return train_rows, valid_rows, len(valid)


def weigh_targets(batch: dict, num_micro_batches: int) -> dict:
  """`batch` with "loss_weights" in place of "loss_mask": each target weighs the
  micro-batch's rows over its targets, so the model's loss (the weighted sum
  over its rows' count) is the micro-batch's mean per target on any mesh.

  Without it a device's loss is the mean over its own rows' targets, and the
  devices' means are averaged: packed rows carry unequal numbers of targets
  (prompts, document starts), so a mesh would train on another loss than one
  device. Micro-batch i is rows i, i + N, ... (`optax_adama.microbatch_step`'s
  split).
  """
  if "loss_mask" not in batch:
    return batch
  mask = np.asarray(batch["loss_mask"], np.float32)
  weights = np.zeros_like(mask)
  for i in range(num_micro_batches):
    rows = mask[i::num_micro_batches]
    targets = rows[:, 1:].sum()
    weights[i::num_micro_batches] = rows * (len(rows) / max(targets, 1.0))
  return {**{k: v for k, v in batch.items() if k != "loss_mask"}, "loss_weights": weights}
