"""A checkpoint's own tokenizer and a user's text, packed into rows with segment ids.

Fine-tuning a published Llama reads the user's data (`read_documents`: a text
file, a directory of them, or JSON Lines rows ``{"text": ...}`` or
``{"prompt": ..., "completion": ...}``, whose loss is on the completion only)
with the checkpoint's tokenizer (`load_tokenizer`; `byte_tokenizer`, the bytes
of `models.data`, without one). Documents are framed as ``[BOS] ids [EOS]``,
tokenized once into a numpy cache (`tokenize`), held out whole
(`split_documents`) and packed as MaxText packs them (`pack`); `text_batches`
yields, each [batch, seq_len + 1]:

- ``tokens`` int32 (0 in padding): the model reads ``[:, :-1]`` and predicts
  ``[:, 1:]``, as with `models.data.lm_batches`' ``{"tokens"}``.
- ``segment_ids`` int32: 0 for padding, 1, 2, ... per document in the row
  (MaxText's ``inputs_segmentation``). Attention stays within a segment:
  ``causal & (segment_ids[:, :, None] == segment_ids[:, None, :])``.
- ``positions`` int32: restarting at 0 at each segment (``inputs_position``).
- ``loss_mask`` bool: token t is a target predicted from token t - 1, so the
  loss weighs ``tokens[:, 1:]`` by ``loss_mask[:, 1:]``. False on padding,
  prompts, and each segment's first token: the step from one document's last
  token into the next is never a target.

A document that fits in a row is never split, so its per-token losses equal
those of the document run alone; a longer one fills rows with pieces that
overlap by one token, as `lm_batches`' windows do. Errors the user can fix
raise `DataError`: one line naming the file, the row and the fix (exit 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tqdm

from models import data

PathLike = str | os.PathLike[str]
Batch = dict[str, np.ndarray]

TOKENIZER_JSON = "tokenizer.json"  # the `tokenizers` library's file (Llama 3, fast tokenizers)
TOKENIZER_MODEL = "tokenizer.model"  # a sentencepiece model (Llama 2 and earlier)
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # in order of precedence
JSONL_SUFFIX = ".jsonl"
CACHE_VERSION = 1  # bumped when the cache's files change meaning, so none is misread
ARRAYS = ("tokens", "starts", "lengths", "prompt_lengths")  # a cache entry's .npy files
ENCODE_CHUNK = 256  # documents per `encode_batch`: work for its threads, a moving progress bar


class DataError(ValueError):
  """A problem with the user's data or tokenizer: one line naming the file, the row, the fix."""

  def __init__(self, message: str):
    super().__init__(" ".join(message.splitlines()))  # one line, whatever was interpolated


# Tokenizers.


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
  """Text to token ids and back, with the BOS/EOS ids that frame a document.

  Attributes:
    kind: "bytes" (`byte_tokenizer`), "tokenizers" or "sentencepiece".
    source: the file it was read from ("bytes" for the default), for messages.
    vocab_size: every id is below it (added tokens included).
    bos_id: prepended to each document, or None (the byte default has none).
    eos_id: appended to each document, or None.
    fingerprint: the tokenizer file's digest and the BOS/EOS ids (the cache key's part).
  """

  kind: str
  source: str
  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  fingerprint: str
  encode_batch_fn: Callable[[list[str]], list[Any]] = dataclasses.field(repr=False)
  decode_fn: Callable[[list[int]], str] = dataclasses.field(repr=False)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """The int32 ids of each text, without BOS/EOS."""
    return [np.asarray(ids, np.int32) for ids in self.encode_batch_fn(list(texts))]

  def encode(self, text: str) -> np.ndarray:
    """The int32 ids of one text, without BOS/EOS."""
    return self.encode_batch([text])[0]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """The text of `ids`, special tokens written out."""
    return self.decode_fn([int(i) for i in ids])


def _bytes_of(text: str) -> bytes:
  # surrogateescape gives back the exact bytes of a file that is not UTF-8
  # (`_read_text` kept them), so the byte tokens equal models.data's.
  return text.encode("utf-8", "surrogateescape")


def _well_formed(text: str) -> str:
  # Subword tokenizers take valid Unicode only: bytes `_read_text` could not
  # decode become U+FFFD. The ASCII test skips the round trip in the common case.
  return text if text.isascii() else _bytes_of(text).decode("utf-8", "replace")


def byte_tokenizer() -> TextTokenizer:
  """The byte-level default: ids 0..255 are the UTF-8 bytes, no BOS/EOS (`models.data`'s)."""
  return TextTokenizer(
      kind="bytes", source="bytes", vocab_size=data.NUM_BYTES, bos_id=None, eos_id=None,
      fingerprint="bytes",
      encode_batch_fn=lambda texts: [np.frombuffer(_bytes_of(t), np.uint8) for t in texts],
      decode_fn=lambda ids: bytes(ids).decode("utf-8", "replace"))


def _read_json(path: Path) -> dict[str, Any]:
  try:
    loaded = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    loaded = error
  if not isinstance(loaded, dict):
    raise DataError(f"{path} is not a JSON object ({loaded}); restore the checkpoint's file.")
  return loaded


def _special_id(config: Mapping[str, Any], directory: Path, name: str,
                token_to_id: Callable[[str], int | None], fallback: int | None) -> int | None:
  """The id of the ``name`` ("bos" or "eos") token.

  config.json's ``{name}_token_id``, the model's own, wins; of a list (Llama 3
  instruct's stop ids), the one the tokenizer's files name (``<|eot_id|>``),
  else the first. Without it: the tokenizer's files, then `fallback`.
  """
  from_tokenizer = None
  for path in (directory / file for file in CONFIG_FILES):
    token = _read_json(path).get(f"{name}_token") if path.is_file() else None
    token = token.get("content") if isinstance(token, dict) else token  # an AddedToken dict
    if isinstance(token, str):
      from_tokenizer = token_to_id(token)
      break
  from_config = config.get(f"{name}_token_id")
  if isinstance(from_config, int):
    return from_config
  if isinstance(from_config, list) and from_config:
    return from_tokenizer if from_tokenizer in from_config else int(from_config[0])
  return from_tokenizer if from_tokenizer is not None else fallback


def _file_digest(path: Path) -> str:
  with open(path, "rb") as file:
    return hashlib.file_digest(file, "sha256").hexdigest()


def _library(name: str, path: Path) -> Any:
  # Imported on use: a run without a checkpoint needs neither library.
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError:
    raise DataError(f"{path} needs the {name} library: pip install {name} (or pip install -e "
                    "'.[models]').") from None


def load_tokenizer(directory: PathLike | None) -> TextTokenizer:
  """The tokenizer of a Hugging Face checkpoint directory; None: the byte default.

  ``tokenizer.json`` through ``tokenizers``, else ``tokenizer.model`` through
  ``sentencepiece`` (Llama 2 era); BOS/EOS as `_special_id` says; checked
  against config.json's ``vocab_size`` (`check_vocab_size`) when it has one.
  `DataError`: no tokenizer file, a bad one, or its library missing.
  """
  if directory is None:
    return byte_tokenizer()
  directory = Path(directory)
  config = _read_json(directory / "config.json") if (directory / "config.json").is_file() else {}
  if (directory / TOKENIZER_JSON).is_file():
    tokenizer = _load_tokenizers_json(directory / TOKENIZER_JSON, config)
  elif (directory / TOKENIZER_MODEL).is_file():
    tokenizer = _load_sentencepiece(directory / TOKENIZER_MODEL, config)
  else:
    raise DataError(f"{directory} holds neither {TOKENIZER_JSON} nor {TOKENIZER_MODEL}; copy the "
                    "checkpoint's tokenizer files beside its config.json.")
  if isinstance(config.get("vocab_size"), int):
    check_vocab_size(tokenizer, config["vocab_size"])
  return tokenizer


def _load_tokenizers_json(path: Path, config: Mapping[str, Any]) -> TextTokenizer:
  tokenizers = _library("tokenizers", path)
  try:
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
  except Exception as error:  # the library raises a bare Exception for a bad file
    raise DataError(f"{path} cannot be read by tokenizers {tokenizers.__version__} ({error}); "
                    "restore the checkpoint's file or upgrade tokenizers.") from None
  bos_id, eos_id = (_special_id(config, path.parent, name, tokenizer.token_to_id, None)
                    for name in ("bos", "eos"))
  # add_special_tokens=False: the file's post-processor may add BOS (Llama 3's
  # does); `tokenize_documents` frames every document itself.
  return TextTokenizer(
      "tokenizers", str(path), tokenizer.get_vocab_size(with_added_tokens=True), bos_id, eos_id,
      f"{_file_digest(path)}:bos={bos_id}:eos={eos_id}",
      lambda texts: [e.ids for e in tokenizer.encode_batch(
          [_well_formed(t) for t in texts], add_special_tokens=False)],
      lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def _load_sentencepiece(path: Path, config: Mapping[str, Any]) -> TextTokenizer:
  processor = _library("sentencepiece", path).SentencePieceProcessor()
  try:
    processor.Load(str(path))
  except (OSError, RuntimeError) as error:
    raise DataError(f"{path} cannot be read by sentencepiece ({error}); restore the "
                    "checkpoint's file.") from None

  def token_to_id(piece: str) -> int | None:
    index = processor.piece_to_id(piece)  # the unknown token's id for a piece it lacks
    return index if processor.id_to_piece(index) == piece else None

  # The model's own ids are the last resort; sentencepiece says -1 for none.
  bos_id, eos_id = (_special_id(config, path.parent, name, token_to_id, own if own >= 0 else None)
                    for name, own in (("bos", processor.bos_id()), ("eos", processor.eos_id())))
  return TextTokenizer(
      "sentencepiece", str(path), processor.get_piece_size(), bos_id, eos_id,
      f"{_file_digest(path)}:bos={bos_id}:eos={eos_id}",
      lambda texts: processor.encode([_well_formed(t) for t in texts], out_type=int),
      processor.decode)


def check_vocab_size(tokenizer: TextTokenizer, model_vocab_size: int) -> None:
  """Raises `DataError` where the tokenizer's ids index past the model's embedding.

  A smaller vocabulary is fine: embeddings are often padded to a round size.
  """
  specials = [i for i in (tokenizer.bos_id, tokenizer.eos_id) if i is not None]
  largest = max([tokenizer.vocab_size - 1, *specials])
  if largest >= model_vocab_size:
    raise DataError(
        f"{tokenizer.source} has ids up to {largest} ({tokenizer.vocab_size} tokens) but the "
        f"model's embedding has {model_vocab_size} rows; use the checkpoint's own tokenizer, or "
        f"a model with vocab_size >= {largest + 1}.")


# Reading the user's data.


@dataclasses.dataclass(frozen=True)
class Document:
  """One document before tokenization.

  Attributes:
    text: the whole text, or the completion when `prompt` is set.
    prompt: the instruction, whose tokens are not trained on; None for text.
    source: "file" or "file line N", for messages.
  """

  text: str
  prompt: str | None
  source: str


def _jsonl_documents(path: Path) -> list[Document]:
  documents = []
  with open(path, encoding="utf-8", errors="surrogateescape") as lines:
    for number, line in enumerate(lines, start=1):
      if not line.strip():
        continue
      where = f"{path} line {number}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as error:
        raise DataError(f"{where} is not valid JSON ({error.msg} at column {error.colno}); "
                        "each line of a .jsonl file is one JSON object.") from None
      if not isinstance(row, dict):
        raise DataError(f"{where} is a JSON {type(row).__name__}, not an object; write rows "
                        'as {"text": ...} or {"prompt": ..., "completion": ...}.')
      fields = (("prompt", "completion") if "prompt" in row and "completion" in row
                else ("text",) if "text" in row else None)
      if fields is None:
        raise DataError(f'{where}: the row has fields {sorted(row)} but needs "text", or "prompt" '
                        'and "completion"; rename its fields or fix the row.')
      for field in fields:
        if not isinstance(row[field], str):
          raise DataError(f'{where}: "{field}" is a JSON {type(row[field]).__name__}, not a '
                          "string; write the text as a JSON string.")
      prompt = row["prompt"] if len(fields) == 2 else None
      documents.append(Document(row[fields[-1]], prompt, where))
  return documents


def _read_text(path: Path) -> list[Document]:
  # Lossless for any bytes: `_bytes_of` gives them back, `_well_formed` cleans them.
  text = path.read_bytes().decode("utf-8", "surrogateescape")
  return [Document(text, None, str(path))] if text else []


def data_files(data_path: PathLike) -> list[Path]:
  """The files of `data_path`: the file itself, or a directory's (`models.data.list_files`)."""
  path = Path(data_path)
  if path.is_file():
    return [path]
  if not path.is_dir():
    raise DataError(f"{path} does not exist; pass a text file, a directory of them, or a "
                    f"{JSONL_SUFFIX} file.")
  files = data.list_files(path)
  if not files:
    raise DataError(f"{path} is an empty directory; put text or {JSONL_SUFFIX} files in it.")
  return files


def read_documents(data_path: PathLike) -> list[Document]:
  """The documents of a text file, a directory of files, or a JSON Lines file.

  A text file is one document; a ``.jsonl`` file (in a directory too) one per
  row, other fields ignored. A directory's empty files are skipped, as
  `models.data.load_text` skips them. `DataError` names a bad row's line.
  """
  documents = []
  for path in data_files(data_path):
    documents += _jsonl_documents(path) if path.suffix == JSONL_SUFFIX else _read_text(path)
  if not documents:
    what = "is empty" if Path(data_path).is_file() else "holds only empty files"
    raise DataError(f"{data_path} {what}; training needs at least one document with text.")
  return documents


# Tokenizing, and the cache.


@dataclasses.dataclass(frozen=True)
class Documents:
  """Tokenized documents, each a slice of one token array that subsets share (no copies).

  Attributes:
    tokens: int32[num_tokens], every document framed as [BOS] ids [EOS].
    starts: int64[num_documents], where each document begins in `tokens`.
    lengths: int64[num_documents], its number of tokens (2 or more).
    prompt_lengths: int64[num_documents], its leading tokens that are not
      targets (BOS and the prompt); 0 for a text document.
  """

  tokens: np.ndarray
  starts: np.ndarray
  lengths: np.ndarray
  prompt_lengths: np.ndarray

  def __len__(self) -> int:
    return len(self.starts)

  def document(self, index: int) -> np.ndarray:
    """The tokens of document `index`."""
    start = int(self.starts[index])
    return np.asarray(self.tokens[start:start + int(self.lengths[index])])

  def subset(self, indices: np.ndarray | Sequence[int]) -> Documents:
    """The documents at `indices`, in that order, over the same `tokens`."""
    indices = np.asarray(indices, np.int64)
    return Documents(self.tokens, self.starts[indices], self.lengths[indices],
                     self.prompt_lengths[indices])


def tokenize_documents(documents: Sequence[Document], tokenizer: TextTokenizer, *,
                        progress: bool | None) -> Documents:
  """Encodes and frames `documents` ([BOS] prompt text [EOS]); refuses any under 2 tokens."""
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
  framed: list[np.ndarray] = []
  prompt_lengths = np.zeros(len(documents), np.int64)
  with tqdm.tqdm(total=len(documents), desc="tokenizing", unit="doc",
                 disable=None if progress is None else not progress) as bar:
    for first in range(0, len(documents), ENCODE_CHUNK):
      chunk = documents[first:first + ENCODE_CHUNK]
      texts = tokenizer.encode_batch([d.text for d in chunk])
      prompts = iter(tokenizer.encode_batch([d.prompt for d in chunk if d.prompt is not None]))
      for index, (document, ids) in enumerate(zip(chunk, texts), start=first):
        head = np.asarray(bos, np.int32)
        if document.prompt is not None:
          head = np.concatenate([head, next(prompts)])
          prompt_lengths[index] = len(head)
          if not len(ids) and not eos:
            raise DataError(f"{document.source}: the completion is empty, so nothing is left "
                            "to train on; remove the row or give it a completion.")
        framed.append(np.concatenate([head, ids, np.asarray(eos, np.int32)]))
        if len(framed[-1]) < 2:
          raise DataError(f"{document.source} has {len(framed[-1])} token(s); training needs "
                          "at least 2 (a token and its successor); remove it or add text.")
      bar.update(len(chunk))
  lengths = np.array([len(f) for f in framed], np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  return Documents(np.concatenate(framed).astype(np.int32), starts, lengths, prompt_lengths)


def default_cache_dir() -> Path:
  """Where token caches live by default: $XDG_CACHE_HOME (or ~/.cache)/optax_adama/tokens."""
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "optax_adama/tokens"


def cache_key(data_path: PathLike, tokenizer: TextTokenizer) -> str:
  """A cache entry's name: a digest of the data files' names and bytes, and the tokenizer.

  Bytes rather than mtimes: hashing costs far less than tokenizing, and a file
  rewritten within the clock's resolution, or copied with its mtime, gets a new key.
  """
  root = Path(data_path)
  files = [[path.relative_to(root).as_posix() if root.is_dir() else path.name,
            _file_digest(path)] for path in data_files(root)]
  blob = json.dumps({"version": CACHE_VERSION, "tokenizer": tokenizer.fingerprint,
                     "files": files})
  return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class TokenizedText:
  """`tokenize`'s result: the documents, and whether they came from the cache (`cache_path`)."""

  documents: Documents
  from_cache: bool
  cache_path: Path | None


def tokenize(data_path: PathLike, tokenizer: TextTokenizer, *,
             cache_dir: PathLike | None = None, progress: bool | None = None) -> TokenizedText:
  """The documents of `data_path` tokenized once: a cache entry is read back when there is one.

  An entry, ``cache_dir/<cache_key>/``, holds the `Documents` arrays as .npy
  (tokens memory-mapped when read) and ``meta.json``, written aside then
  renamed, so no run leaves half an entry. `cache_dir` None caches nothing;
  `progress` None shows the tqdm bar on a terminal only. `DataError`: as
  `read_documents`, and for a document of fewer than 2 tokens.
  """
  entry = None if cache_dir is None else Path(cache_dir) / cache_key(data_path, tokenizer)
  if entry is not None and (entry / "meta.json").is_file():
    arrays = {name: np.load(entry / f"{name}.npy", mmap_mode="r" if name == "tokens" else None)
              for name in ARRAYS}
    return TokenizedText(Documents(**arrays), from_cache=True, cache_path=entry)
  documents = tokenize_documents(read_documents(data_path), tokenizer, progress=progress)
  if entry is not None:
    partial = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    for name in ARRAYS:
      np.save(partial / f"{name}.npy", getattr(documents, name))
    meta = {"data_path": str(data_path), "tokenizer": tokenizer.source,
            "num_documents": len(documents), "num_tokens": len(documents.tokens)}
    (partial / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    try:
      partial.rename(entry)
    except OSError:  # another run wrote the same entry first, with the same bytes
      shutil.rmtree(partial)
  return TokenizedText(documents, from_cache=False, cache_path=entry)


def split_documents(documents: Documents, valid_fraction: float) -> tuple[Documents, Documents]:
  """(train, held out): whole documents held out by `models.data.held_out_indices`.

  A single document is cut at its tail instead, as `models.data.load_text`
  cuts a single file; a cut piece under 2 tokens (no target) is left out.
  """
  if len(documents) > 1:
    valid = data.held_out_indices(len(documents), valid_fraction)
    return documents.subset(np.setdiff1d(np.arange(len(documents)), valid)), documents.subset(valid)
  length, start, prompt = (int(a[0]) for a in (documents.lengths, documents.starts,
                                               documents.prompt_lengths))
  cut = length - int(length * valid_fraction)

  def piece(begin: int, end: int) -> Documents:
    one = np.ones(int(end - begin >= 2), np.int64)  # [1], or [] for a piece without a target
    return Documents(documents.tokens, one * (start + begin), one * (end - begin),
                     one * max(0, prompt - begin))

  return piece(0, cut), piece(cut, length)


# Packing.


@dataclasses.dataclass(frozen=True)
class PackedText:
  """Documents laid into rows of ``seq_len + 1`` tokens, as a table of pieces.

  A piece is a document, or part of a long one, at a column of a row; `rows`
  builds a batch's arrays when it is drawn, so the tokens stay memory-mapped.

  Attributes:
    documents: the packed documents.
    seq_len: the model's input length; rows have seq_len + 1 tokens.
    row_pieces: int64[num_rows + 1]; row r holds pieces row_pieces[r]:row_pieces[r + 1].
    pieces: int64[num_pieces, 4]: each piece's column in its row, start in
      `documents.tokens`, length (2 or more), and first token that is a
      target (1 or more: a segment's first token has no predecessor).
  """

  documents: Documents
  seq_len: int
  row_pieces: np.ndarray
  pieces: np.ndarray

  def __len__(self) -> int:
    return len(self.row_pieces) - 1

  def rows(self, indices: np.ndarray | Sequence[int]) -> Batch:
    """{"tokens", "segment_ids", "positions", "loss_mask"} of rows `indices`, [n, seq_len + 1]."""
    shape = (len(indices), self.seq_len + 1)
    batch = {"tokens": np.zeros(shape, np.int32), "segment_ids": np.zeros(shape, np.int32),
             "positions": np.zeros(shape, np.int32), "loss_mask": np.zeros(shape, bool)}
    for out, row in enumerate(np.asarray(indices, np.int64)):
      for segment, piece in enumerate(self.pieces[self.row_pieces[row]:self.row_pieces[row + 1]]):
        column, start, length, first_target = piece.tolist()
        where = slice(column, column + length)
        batch["tokens"][out, where] = self.documents.tokens[start:start + length]
        batch["segment_ids"][out, where] = segment + 1
        batch["positions"][out, where] = np.arange(length)
        batch["loss_mask"][out, column + first_target:column + length] = True
    return batch


def check_seq_len(seq_len: int) -> None:
  """Raises `DataError` for a `seq_len` under 1: a row needs an input and its target."""
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise DataError(f"seq_len={seq_len!r} makes rows of fewer than 2 tokens; training needs "
                    "an input and its target: use seq_len >= 1.")


def pack(documents: Documents, seq_len: int) -> PackedText:
  """Lays documents, in order, into rows of ``seq_len + 1`` tokens.

  A document (or the rest of one) that fits in a row goes whole into the
  current row, else into a new one. A longer one starts in the current row
  and goes on in full rows, each piece overlapping the last by one token, so
  every token but the first is a target exactly once. `DataError`: as `check_seq_len`.
  """
  check_seq_len(seq_len)
  width = seq_len + 1
  rows, pieces = [], []
  row, fill = 0, 0
  for start, length, prompt in zip(documents.starts.tolist(), documents.lengths.tolist(),
                                   documents.prompt_lengths.tolist()):
    offset = 0  # where the next piece begins in the document
    while True:
      remaining, space = length - offset, width - fill
      if fill and (space < 2 or space < remaining <= width):
        row, fill, space = row + 1, 0, width
      take = min(space, remaining)
      rows.append(row)
      pieces.append((fill, start + offset, take, max(1, prompt - offset)))
      fill += take
      if offset + take == length:
        break
      offset += take - 1
  num_rows = row + 1 if fill else row
  return PackedText(documents, seq_len,
                    np.searchsorted(np.array(rows, np.int64), np.arange(num_rows + 1)),
                    np.array(pieces, np.int64).reshape(-1, 4))


def text_batches(packed: PackedText, *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 epochs: int | None = None, drop_remainder: bool = True) -> Iterator[Batch]:
  """Batches of packed rows: {"tokens", "segment_ids", "positions", "loss_mask"}, [b, seq_len + 1].

  In `models.data.lm_batches`' order (shuffled per epoch from `seed` alone); a
  model that reads only its "tokens" runs on them too (attending across documents).
  `ValueError` at the call for a `batch_size` below 1 or fewer rows than a batch.
  """
  data._check_batching(len(packed), batch_size=batch_size, drop_remainder=drop_remainder,
                       examples=f"{len(packed)} packed rows of seq_len={packed.seq_len}")
  orders = data._epoch_orders(len(packed), batch_size=batch_size, seed=seed, shuffle=shuffle,
                              epochs=epochs, drop_remainder=drop_remainder)
  return (packed.rows(index) for _, index in orders)


def load_packed_text(data_path: PathLike, tokenizer: TextTokenizer, *, seq_len: int,
                     valid_fraction: float = 0.1, cache_dir: PathLike | None = None,
                     model_vocab_size: int | None = None, progress: bool | None = None,
                     ) -> tuple[PackedText, PackedText, TokenizedText]:
  """(train rows, held-out rows, all documents): `tokenize`, `split_documents`, `pack`.

  Checks first (`check_vocab_size` against `model_vocab_size`, `check_seq_len`), so a bad
  setting raises `DataError` before minutes of tokenizing. `cache_dir` is usually
  `default_cache_dir()`.
  """
  if model_vocab_size is not None:
    check_vocab_size(tokenizer, model_vocab_size)
  check_seq_len(seq_len)
  tokenized = tokenize(data_path, tokenizer, cache_dir=cache_dir, progress=progress)
  train, valid = split_documents(tokenized.documents, valid_fraction)
  return pack(train, seq_len), pack(valid, seq_len), tokenized
