"""Tiny Llama checkpoints with their own tokenizers, built locally for tests.

A fine-tuning test needs what a published checkpoint directory holds: the
weights and config.json (`write_tiny_checkpoint`, the smallest Llama preset)
and a tokenizer beside them. The tokenizers are trained here on the standard
library's text, so nothing is downloaded: a byte-level BPE saved as
tokenizer.json (Llama 3's layout, `write_bpe_tokenizer`), or a sentencepiece
model saved as tokenizer.model (Llama 2's, `write_sentencepiece_tokenizer`).

`llama_bpe_dir` and `llama_sentencepiece_dir` are session-wide fixtures of
both, which tests/conftest.py gives every test.
"""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import pytest

BPE_VOCAB_SIZE = 512
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
# The BPE trainer gives special tokens the first ids, in this order.
BPE_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BPE_BOS_ID, BPE_EOS_ID = 0, 1
# sentencepiece's own layout: <unk> 0, <s> 1, </s> 2.
SENTENCEPIECE_VOCAB_SIZE = 512
SENTENCEPIECE_BOS_ID, SENTENCEPIECE_EOS_ID = 1, 2


@functools.cache
def stdlib_sample(num_bytes: int = 200_000) -> str:
  """The first `num_bytes` of the standard library's sources (`models.data`), as text."""
  from models import data

  corpus = data.load_stdlib_text(max_bytes=num_bytes, valid_fraction=0.0).train
  return corpus.tobytes().decode("utf-8", "replace")


def write_bpe_tokenizer(directory: Path, *, vocab_size: int = BPE_VOCAB_SIZE) -> Path:
  """Trains a byte-level BPE (GPT-2's / Llama 3's kind) on `stdlib_sample`; writes
  tokenizer.json (BOS prepended by its post-processor, as Llama 3's) and a
  tokenizer_config.json naming BOS/EOS. About 0.2 s."""
  from tokenizers import Tokenizer
  from tokenizers import decoders
  from tokenizers import models as bpe_models
  from tokenizers import pre_tokenizers
  from tokenizers import processors
  from tokenizers import trainers

  tokenizer = Tokenizer(bpe_models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(BPE_SPECIAL_TOKENS), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator([stdlib_sample()], trainer=trainer)
  # Llama 3's post-processor: transformers' tokenizer prepends BOS, as the
  # project frames each document (which encodes without special tokens).
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
      special_tokens=[(BOS_TOKEN, BPE_BOS_ID)])
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / "tokenizer.json"
  tokenizer.save(str(path))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
      "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=1))
  return path


def write_sentencepiece_tokenizer(directory: Path, *,
                                  vocab_size: int = SENTENCEPIECE_VOCAB_SIZE) -> Path:
  """Trains a sentencepiece BPE with byte fallback (Llama 2's kind) on the lines of
  `stdlib_sample`; writes tokenizer.model and Llama 2's tokenizer_config.json. About 0.1 s.

  Normalized as Llama 2's tokenizer.model is (identity, whitespace kept, digits
  split), so text keeps its newlines and indents and transformers' converted
  LlamaTokenizerFast gives the same ids; sentencepiece's defaults would squeeze
  runs of spaces and drop newlines.
  """
  import sentencepiece

  lines = [line for line in stdlib_sample().splitlines() if line.strip()]
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
      model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
      remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
      minloglevel=2)
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / "tokenizer.model"
  path.write_bytes(model.getvalue())
  # Llama 2's tokenizer_config.json: transformers 5 reads the tokenizer's class
  # and BOS from it (without it, its tokenizer adds no BOS).
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
      "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False},
      indent=1))
  return path


def write_tiny_checkpoint(directory: Path, *, vocab_size: int, bos_token_id: int | list[int],
                          eos_token_id: int | list[int], seed: int = 0):
  """Writes a `LlamaConfig.test` Llama (1 layer, width 128) with `vocab_size` tokens as a
  Hugging Face checkpoint, with BOS/EOS ids in config.json as published ones have them.

  Returns:
    The model's `LlamaConfig`.
  """
  from flax import nnx

  from models import llama_checkpoint
  from models.llama import Llama
  from models.llama import LlamaConfig

  config = LlamaConfig.test(vocab_size=vocab_size)
  llama_checkpoint.save_hf_checkpoint(Llama(config, rngs=nnx.Rngs(seed)), config, directory)
  config_path = directory / llama_checkpoint.CONFIG_FILE
  config_json = json.loads(config_path.read_text())
  config_json.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id)
  config_path.write_text(json.dumps(config_json, indent=1))
  return config


def write_llama_bpe_dir(directory: Path) -> Path:
  """A tiny Llama checkpoint with a 512-token BPE tokenizer.json beside it (Llama 3's layout)."""
  write_bpe_tokenizer(directory)
  write_tiny_checkpoint(directory, vocab_size=BPE_VOCAB_SIZE, bos_token_id=BPE_BOS_ID,
                        eos_token_id=BPE_EOS_ID)
  return directory


def write_llama_sentencepiece_dir(directory: Path) -> Path:
  """A tiny Llama checkpoint with a 512-piece tokenizer.model beside it (Llama 2's layout)."""
  write_sentencepiece_tokenizer(directory)
  write_tiny_checkpoint(directory, vocab_size=SENTENCEPIECE_VOCAB_SIZE,
                        bos_token_id=SENTENCEPIECE_BOS_ID, eos_token_id=SENTENCEPIECE_EOS_ID)
  return directory


@pytest.fixture(scope="session")
def llama_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  """`write_llama_bpe_dir` once per test run (read only: copy it to change it)."""
  pytest.importorskip("tokenizers", reason="the [models] extra's tokenizers trains the BPE")
  return write_llama_bpe_dir(tmp_path_factory.mktemp("llama_bpe"))


@pytest.fixture(scope="session")
def llama_sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  """`write_llama_sentencepiece_dir` once per test run (read only: copy it to change it)."""
  pytest.importorskip("sentencepiece", reason="the [models] extra's sentencepiece trains it")
  return write_llama_sentencepiece_dir(tmp_path_factory.mktemp("llama_sentencepiece"))
