"""models.text: a checkpoint's tokenizer, the user's data, packing with segment ids, the cache.

The tokenizers are trained here (tests/fixtures_text.py) beside a tiny Llama
checkpoint; nothing is downloaded. References: the tokenizer libraries' own
`encode`, `models.data`'s byte corpus, and a small numpy language model that
attends within segments, run on packed rows and on each document alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from models import data
from models import text
from tests import fixtures_text

SAMPLE = "def greet(name):\n  return f'hello {name}'  # caf\u00e9 \u2603\n"


def documents_of(token_lists, prompt_lengths=None) -> text.Documents:
  """`text.Documents` of explicit token lists (prompt lengths 0 unless given)."""
  lengths = np.array([len(t) for t in token_lists], np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  prompts = np.zeros(len(token_lists), np.int64) if prompt_lengths is None else np.array(
      prompt_lengths, np.int64)
  return text.Documents(np.concatenate([np.asarray(t, np.int32) for t in token_lists]),
                        starts, lengths, prompts)


def write_jsonl(path: Path, rows) -> Path:
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return path


# Tokenizers.


def test_byte_default_equals_models_data_tokens(tmp_path):
  corpus = fixtures_text.stdlib_sample().encode()
  folder = tmp_path / "corpus"
  folder.mkdir()
  for i in range(7):
    (folder / f"part{i}.py").write_bytes(corpus[i * 3000:(i + 1) * 3000])
  (folder / "empty.txt").write_bytes(b"")  # skipped by both
  (folder / "latin1.txt").write_bytes("caf\u00e9 na\u00efve".encode("latin-1"))  # not UTF-8
  tokenizer = text.load_tokenizer(None)
  assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (
      "bytes", 256, None, None)
  for path in (folder, folder / "part3.py"):
    documents = text.tokenize(path, tokenizer).documents
    train, valid = text.split_documents(documents, 0.25)
    expected = data.load_text(path, valid_fraction=0.25)
    for split, reference in ((train, expected.train), (valid, expected.valid)):
      joined = np.concatenate([split.document(i) for i in range(len(split))])
      np.testing.assert_array_equal(joined, reference.astype(np.int32))
  assert tokenizer.decode(tokenizer.encode(SAMPLE)) == SAMPLE


def test_tokenizer_json_of_a_checkpoint(llama_bpe_dir):
  from tokenizers import Tokenizer

  tokenizer = text.load_tokenizer(llama_bpe_dir)
  assert (tokenizer.kind, tokenizer.vocab_size) == ("tokenizers", fixtures_text.BPE_VOCAB_SIZE)
  assert (tokenizer.bos_id, tokenizer.eos_id) == (fixtures_text.BPE_BOS_ID,
                                                  fixtures_text.BPE_EOS_ID)
  reference = Tokenizer.from_file(str(llama_bpe_dir / "tokenizer.json"))
  assert reference.token_to_id(fixtures_text.BOS_TOKEN) == fixtures_text.BPE_BOS_ID
  sample = fixtures_text.stdlib_sample()[:5000]
  expected = reference.encode(sample, add_special_tokens=False).ids
  np.testing.assert_array_equal(tokenizer.encode(sample), expected)
  assert len(expected) < 0.7 * len(sample.encode())  # merges learned: not bytes
  assert tokenizer.decode(tokenizer.encode(SAMPLE)) == SAMPLE
  # A file's bytes that are not UTF-8 (read as surrogates) are U+FFFD to it, not an error.
  np.testing.assert_array_equal(tokenizer.encode("caf\udce9"), tokenizer.encode("caf\ufffd"))


@pytest.mark.parametrize("config, tokenizer_files, expected", [
    # config.json wins; a list of stop ids (Llama 3 instruct) picks the tokenizer's EOS.
    ({"bos_token_id": 0, "eos_token_id": [2, 1]},
     {"tokenizer_config.json": {"eos_token": fixtures_text.EOS_TOKEN}}, (0, 1)),
    ({"bos_token_id": 0, "eos_token_id": [2, 1]}, {}, (0, 2)),  # else its first
    ({"bos_token_id": 2, "eos_token_id": 0},
     {"tokenizer_config.json": {"bos_token": fixtures_text.BOS_TOKEN}}, (2, 0)),
    # Without ids in config.json: the tokenizer's files, AddedToken dicts too.
    ({}, {"special_tokens_map.json": {"bos_token": {"content": fixtures_text.BOS_TOKEN},
                                      "eos_token": fixtures_text.EOS_TOKEN}}, (0, 1)),
    ({}, {"tokenizer_config.json": {"eos_token": fixtures_text.PAD_TOKEN},
          "special_tokens_map.json": {"eos_token": fixtures_text.EOS_TOKEN}}, (None, 2)),
    ({}, {}, (None, None)),
])
def test_bos_eos_from_config_and_tokenizer_files(tmp_path, llama_bpe_dir, config,
                                                 tokenizer_files, expected):
  shutil.copy(llama_bpe_dir / "tokenizer.json", tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512, **config}))
  for name, content in tokenizer_files.items():
    (tmp_path / name).write_text(json.dumps(content))
  tokenizer = text.load_tokenizer(tmp_path)
  assert (tokenizer.bos_id, tokenizer.eos_id) == expected


def test_sentencepiece_tokenizer_of_a_checkpoint(tmp_path, llama_sentencepiece_dir):
  import sentencepiece

  tokenizer = text.load_tokenizer(llama_sentencepiece_dir)
  assert (tokenizer.kind, tokenizer.vocab_size) == (
      "sentencepiece", fixtures_text.SENTENCEPIECE_VOCAB_SIZE)
  assert (tokenizer.bos_id, tokenizer.eos_id) == (fixtures_text.SENTENCEPIECE_BOS_ID,
                                                  fixtures_text.SENTENCEPIECE_EOS_ID)
  reference = sentencepiece.SentencePieceProcessor(
      model_file=str(llama_sentencepiece_dir / "tokenizer.model"))
  sample = fixtures_text.stdlib_sample()[:3000]
  np.testing.assert_array_equal(tokenizer.encode(sample), reference.encode(sample))
  # Without config.json: the ids the sentencepiece model declares.
  shutil.copy(llama_sentencepiece_dir / "tokenizer.model", tmp_path)
  bare = text.load_tokenizer(tmp_path)
  assert (bare.bos_id, bare.eos_id) == (reference.bos_id(), reference.eos_id()) == (1, 2)


# Reading the data.


def test_read_documents_of_a_directory_of_text_and_jsonl(tmp_path):
  (tmp_path / "a.txt").write_text("first file\n")
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / ".hidden.txt").write_text("not read")
  rows = [{"text": "a row", "id": 7}, {"prompt": "Q?", "completion": " A."}]
  (tmp_path / "b.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
  documents = text.read_documents(tmp_path)
  assert documents == [
      text.Document("first file\n", None, str(tmp_path / "a.txt")),
      text.Document("a row", None, f"{tmp_path / 'b.jsonl'} line 1"),
      text.Document(" A.", "Q?", f"{tmp_path / 'b.jsonl'} line 3"),
  ]


def test_prompt_completion_rows_are_framed_and_masked(llama_bpe_dir, tmp_path):
  tokenizer = text.load_tokenizer(llama_bpe_dir)
  path = write_jsonl(tmp_path / "sft.jsonl", [
      {"prompt": "def add(a, b):", "completion": "\n  return a + b\n"},
      {"text": "import os\n"}])
  documents = text.tokenize(path, tokenizer).documents
  prompt, completion = tokenizer.encode("def add(a, b):"), tokenizer.encode("\n  return a + b\n")
  bos, eos = fixtures_text.BPE_BOS_ID, fixtures_text.BPE_EOS_ID
  np.testing.assert_array_equal(documents.document(0), [bos, *prompt, *completion, eos])
  np.testing.assert_array_equal(documents.document(1),
                                [bos, *tokenizer.encode("import os\n"), eos])
  assert documents.prompt_lengths.tolist() == [1 + len(prompt), 0]
  row = text.pack(documents, seq_len=64).rows([0])
  # Targets: the completion and its EOS, then the text document but its BOS.
  targets = row["tokens"][0][row["loss_mask"][0]]
  np.testing.assert_array_equal(targets, [*completion, eos, *tokenizer.encode("import os\n"), eos])


# Packing.


def test_pack_by_hand():
  documents = documents_of([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]])
  rows = text.pack(documents, seq_len=7).rows([0, 1])  # rows of 8 tokens
  np.testing.assert_array_equal(rows["tokens"], [[1, 2, 3, 4, 5, 6, 7, 8],
                                                 [9, 10, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 2, 2, 2, 2, 2],
                                                      [1, 1, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 0, 1, 2, 3, 4],
                                                    [0, 1, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows["loss_mask"], [[0, 1, 1, 0, 1, 1, 1, 1],
                                                    [0, 1, 0, 0, 0, 0, 0, 0]])
  # A document that fits a row is never split: [4..8] does not fit after [1, 2, 3, 11, 12].
  # A longer one (10 tokens, prompt of 3) starts in the free space and overlaps by one.
  documents = documents_of([[1, 2, 3, 11, 12], [4, 5, 6, 7, 8], list(range(20, 30))],
                           prompt_lengths=[0, 0, 3])
  packed = text.pack(documents, seq_len=7)
  rows = packed.rows(range(len(packed)))
  np.testing.assert_array_equal(rows["tokens"], [[1, 2, 3, 11, 12, 0, 0, 0],
                                                 [4, 5, 6, 7, 8, 20, 21, 22],
                                                 [22, 23, 24, 25, 26, 27, 28, 29]])
  np.testing.assert_array_equal(rows["positions"][1:], [[0, 1, 2, 3, 4, 0, 1, 2],
                                                        [0, 1, 2, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(rows["loss_mask"][1:], [[0, 1, 1, 1, 1, 0, 0, 0],
                                                        [0, 1, 1, 1, 1, 1, 1, 1]])


def unpack(packed: text.PackedText) -> list[tuple[list[int], list[bool]]]:
  """Each segment of every row, in order: (its tokens, its loss mask); checks positions."""
  rows = packed.rows(range(len(packed)))
  segments = []
  for tokens, segment_ids, positions, mask in zip(*(rows[k] for k in (
      "tokens", "segment_ids", "positions", "loss_mask"))):
    assert not mask[segment_ids == 0].any()
    for segment in range(1, segment_ids.max() + 1):
      (where,) = np.nonzero(segment_ids == segment)
      assert (np.diff(where) == 1).all(), "a segment is contiguous"
      np.testing.assert_array_equal(positions[where], np.arange(len(where)))
      segments.append((tokens[where].tolist(), mask[where].tolist()))
    used = segment_ids > 0
    assert used[0] and (np.diff(used.astype(int)) <= 0).all(), "padding only at a row's end"
    assert (np.diff(segment_ids[used]) >= 0).all(), "segments in order"
  return segments


@pytest.mark.parametrize("seq_len", [1, 5, 16, 40])
def test_pack_round_trips_documents(seq_len):
  rng = np.random.default_rng(seq_len)
  token_lists = [rng.integers(0, 100, rng.integers(2, 60)).tolist() for _ in range(40)]
  prompts = [int(rng.integers(0, len(t) + 1)) if i % 3 == 0 else 0
             for i, t in enumerate(token_lists)]
  packed = text.pack(documents_of(token_lists, prompts), seq_len)
  segments = iter(unpack(packed))
  width, num_targets = seq_len + 1, 0
  for tokens, prompt in zip(token_lists, prompts):
    offset = 0
    while True:  # the document's pieces, each overlapping the previous by one token
      piece, mask = next(segments)
      assert piece == tokens[offset:offset + len(piece)]
      assert mask == [j > 0 and offset + j >= prompt for j in range(len(piece))]
      num_targets += sum(mask)
      if len(tokens) <= width:
        assert piece == tokens, "a document that fits a row is not split"
      if offset + len(piece) == len(tokens):
        break
      offset += len(piece) - 1
  assert next(segments, None) is None
  assert num_targets == sum(len(t) - max(1, p) for t, p in zip(token_lists, prompts))


def reference_losses(batch, params, *, within_segments=True, positions=True):
  """Per-token cross-entropy of a one-layer attention LM in float64 numpy, at loss_mask[:, 1:].

  It has an absolute position table, so positions matter (Llama's rotary ones
  cancel in q.k; restarting them matters only through rounding).
  """
  embed, position_table, wq, wk, wv, head = params
  tokens, segments = batch["tokens"][:, :-1], batch["segment_ids"][:, :-1]
  where = batch["positions"] if positions else np.broadcast_to(
      np.arange(tokens.shape[1] + 1), batch["positions"].shape)
  x = embed[tokens] + position_table[where[:, :-1]]
  scores = np.einsum("bqd,bkd->bqk", x @ wq, x @ wk) / np.sqrt(wq.shape[1])
  allowed = np.tril(np.ones(scores.shape[1:], bool))[None]
  if within_segments:
    allowed = allowed & (segments[:, :, None] == segments[:, None, :])
  scores = np.where(allowed, scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  logits = (x + probs @ (x @ wv)) @ head
  logits -= logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  labels = batch["tokens"][:, 1:]
  nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
  return nll[batch["loss_mask"][:, 1:]]  # row-major: documents in packing order


def test_packed_losses_equal_each_document_run_alone(llama_bpe_dir, tmp_path):
  tokenizer = text.load_tokenizer(llama_bpe_dir)
  sample = fixtures_text.stdlib_sample()
  rows = [{"text": sample[i * 97:i * 97 + 20 + 13 * (i % 5)]} for i in range(12)]
  rows += [{"prompt": sample[i * 31:i * 31 + 25], "completion": sample[i * 7:i * 7 + 15]}
           for i in range(6)]
  documents = text.tokenize(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer).documents
  seq_len = 96
  assert documents.lengths.max() <= seq_len + 1
  rng = np.random.default_rng(0)
  vocab, width = tokenizer.vocab_size, 16
  params = [rng.normal(size=shape) for shape in [(vocab, width), (seq_len + 1, width),
                                                 (width, width), (width, width), (width, width),
                                                 (width, vocab)]]
  packed = text.pack(documents, seq_len)
  assert len(packed) < len(documents) / 2  # several documents share each row
  batch = packed.rows(range(len(packed)))
  alone = [text.pack(documents.subset([i]), seq_len).rows([0]) for i in range(len(documents))]
  expected = np.concatenate([reference_losses(b, params) for b in alone])
  assert len(expected) == batch["loss_mask"][:, 1:].sum()
  np.testing.assert_allclose(reference_losses(batch, params), expected, rtol=1e-12)
  # The comparison can fail: attending across documents, or positions that do
  # not restart, change the losses.
  for wrong in ({"within_segments": False}, {"positions": False}):
    assert not np.allclose(reference_losses(batch, params, **wrong), expected, rtol=1e-3)


def test_text_batches_and_the_held_out_documents(llama_bpe_dir, tmp_path):
  tokenizer = text.load_tokenizer(llama_bpe_dir)
  sample = fixtures_text.stdlib_sample()
  rows = [{"text": sample[i * 500:(i + 1) * 500]} for i in range(20)]
  path = write_jsonl(tmp_path / "d.jsonl", rows)
  train, valid, tokenized = text.load_packed_text(path, tokenizer, seq_len=32,
                                                  valid_fraction=0.2, model_vocab_size=512)
  held_out = data.held_out_indices(20, 0.2)
  every = tokenized.documents
  for split, indices in ((valid, held_out), (train, np.setdiff1d(np.arange(20), held_out))):
    np.testing.assert_array_equal(split.documents.starts, every.starts[indices])
  batches = text.text_batches(train, batch_size=4, seed=3, epochs=1)
  first = next(batches)
  assert set(first) == {"tokens", "segment_ids", "positions", "loss_mask"}
  for key, dtype in (("tokens", np.int32), ("segment_ids", np.int32), ("positions", np.int32),
                     ("loss_mask", np.bool_)):
    assert first[key].shape == (4, 33) and first[key].dtype == dtype
  again = next(text.text_batches(train, batch_size=4, seed=3, epochs=1))
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
  assert sum(1 for _ in batches) + 1 == len(train) // 4
  assert set(next(data.lm_batches(every.tokens, batch_size=4, seq_len=32))) <= set(first)


# The cache.


def test_the_cache_is_reused_and_invalidated(llama_bpe_dir, tmp_path, monkeypatch):
  checkpoint = tmp_path / "checkpoint"
  shutil.copytree(llama_bpe_dir, checkpoint)
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "a.py").write_text(fixtures_text.stdlib_sample()[:4000])
  (corpus / "b.jsonl").write_text(json.dumps({"prompt": "x = ", "completion": "1"}) + "\n")
  cache = tmp_path / "cache"
  tokenizer = text.load_tokenizer(checkpoint)
  first = text.tokenize(corpus, tokenizer, cache_dir=cache, progress=False)
  assert not first.from_cache and (first.cache_path / "tokens.npy").is_file()

  def refuse(*args, **kwargs):
    raise AssertionError("tokenized again")

  with monkeypatch.context() as patch:
    patch.setattr(text, "tokenize_documents", refuse)
    second = text.tokenize(corpus, tokenizer, cache_dir=cache)
    assert second.from_cache and second.cache_path == first.cache_path
    assert isinstance(second.documents.tokens, np.memmap)
    for name in ("tokens", "starts", "lengths", "prompt_lengths"):
      np.testing.assert_array_equal(getattr(second.documents, name),
                                    getattr(first.documents, name))
    (corpus / "a.py").write_text(fixtures_text.stdlib_sample()[:4001])  # the data changes
    with pytest.raises(AssertionError, match="tokenized again"):
      text.tokenize(corpus, tokenizer, cache_dir=cache)
  changed_data = text.tokenize(corpus, tokenizer, cache_dir=cache, progress=False)
  assert not changed_data.from_cache and changed_data.cache_path != first.cache_path
  # The tokenizer changes: its file's bytes (same vocabulary), then config.json's EOS.
  tokenizer_json = checkpoint / "tokenizer.json"
  tokenizer_json.write_text(json.dumps(json.loads(tokenizer_json.read_text()), indent=3))
  changed_file = text.tokenize(corpus, text.load_tokenizer(checkpoint), cache_dir=cache,
                               progress=False)
  config = json.loads((checkpoint / "config.json").read_text())
  (checkpoint / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
  changed_eos = text.tokenize(corpus, text.load_tokenizer(checkpoint), cache_dir=cache,
                              progress=False)
  paths = {r.cache_path for r in (first, changed_data, changed_file, changed_eos)}
  assert not changed_file.from_cache and not changed_eos.from_cache and len(paths) == 4
  assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in paths)


# Errors: one line naming the file, the row and the fix.


def data_error(call, *args, **kwargs) -> str:
  with pytest.raises(text.DataError) as caught:
    call(*args, **kwargs)
  message = str(caught.value)
  assert "\n" not in message and isinstance(caught.value, ValueError)
  return message


def test_bad_jsonl_rows(tmp_path):
  path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "ok"}, {"content": "x", "id": 2}])
  message = data_error(text.read_documents, path)
  assert f"{path} line 2" in message and "['content', 'id']" in message and '"text"' in message
  path = write_jsonl(tmp_path / "half.jsonl", [{"prompt": "only a prompt"}])
  assert "line 1" in data_error(text.read_documents, path)
  path.write_text('{"text": "ok"}\n{"text": oops}\n')
  assert "line 2 is not valid JSON" in data_error(text.read_documents, path)
  write_jsonl(path, [{"text": ["not", "a", "string"]}])
  assert '"text" is a JSON list' in data_error(text.read_documents, path)
  write_jsonl(path, [["a", "list"]])
  assert "not an object" in data_error(text.read_documents, path)


def test_empty_inputs(tmp_path):
  (tmp_path / "empty.txt").write_text("")
  assert "empty.txt is empty" in data_error(text.read_documents, tmp_path / "empty.txt")
  (tmp_path / "blank.jsonl").write_text("\n\n")
  assert "blank.jsonl is empty" in data_error(text.read_documents, tmp_path / "blank.jsonl")
  (tmp_path / "folder").mkdir()
  assert "empty directory" in data_error(text.read_documents, tmp_path / "folder")
  (tmp_path / "folder" / "a.txt").write_text("")
  assert "holds only empty files" in data_error(text.read_documents, tmp_path / "folder")
  assert "does not exist" in data_error(text.read_documents, tmp_path / "missing")


def test_documents_and_rows_shorter_than_two_tokens(tmp_path):
  one_byte = tmp_path / "one.txt"
  one_byte.write_text("a")
  message = data_error(text.tokenize, one_byte, text.byte_tokenizer())
  assert str(one_byte) in message and "1 token(s)" in message and "at least 2" in message
  path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "fine"}, {"text": ""}])
  assert "rows.jsonl line 2 has 0 token(s)" in data_error(text.tokenize, path,
                                                          text.byte_tokenizer())
  write_jsonl(path, [{"prompt": "a question", "completion": ""}])
  assert "line 1: the completion is empty" in data_error(text.tokenize, path,
                                                          text.byte_tokenizer())
  for seq_len in (0, -3, 2.0):
    message = data_error(text.load_packed_text, one_byte, text.byte_tokenizer(), seq_len=seq_len)
    assert f"seq_len={seq_len!r}" in message and "seq_len >= 1" in message


def test_tokenizer_errors(tmp_path, llama_bpe_dir):
  shutil.copy(llama_bpe_dir / "tokenizer.json", tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256}))
  message = data_error(text.load_tokenizer, tmp_path)
  assert "tokenizer.json has ids up to 511 (512 tokens)" in message and "256 rows" in message
  tokenizer = text.load_tokenizer(llama_bpe_dir)
  assert "256 rows" in data_error(text.check_vocab_size, tokenizer, 256)
  text.check_vocab_size(tokenizer, 512)  # equal, or an embedding padded larger, is fine
  empty = tmp_path / "no_tokenizer"
  empty.mkdir()
  assert "neither tokenizer.json nor tokenizer.model" in data_error(text.load_tokenizer, empty)
  (empty / "tokenizer.json").write_text("{}")
  assert "cannot be read by tokenizers" in data_error(text.load_tokenizer, empty)
