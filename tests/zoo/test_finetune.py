"""Fine-tuning a Hugging Face Llama directory with `python -m models.train`, and back.

The directory is tests/fixtures_text.py's tiny Llama with a 512-token BPE
trained locally; the data is JSON Lines written here. The run reads the
checkpoint's tokenizer, writes a Hugging Face directory (`--save-hf`) that
loads back into the zoo as the trained model, and refuses bad input with one
line and exit status 2 before anything compiles.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save_file

import models
from models import harness
from models import llama_checkpoint as hf
from models import llama_hf_config
from models import text
from models import train

_SMALL_RUN = ["--model", "llama", "--num-micro-batches", "2", "--batch-size", "4",
              "--seq-len", "32", "--eval-batches", "2", "--no-progress"]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
  # The token cache lives under $XDG_CACHE_HOME: each test its own.
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return path


def corpus_rows(count: int = 120) -> list[dict]:
  """Paragraphs of the standard library, a third as prompt + completion rows."""
  from fixtures_text import stdlib_sample

  paragraphs = [p for p in stdlib_sample().split("\n\n") if len(p.strip()) > 40][:count]
  return [{"prompt": "Continue:\n", "completion": p} if i % 3 == 0 else {"text": p}
          for i, p in enumerate(paragraphs)]


def test_fine_tune_writes_a_directory_that_loads_as_the_trained_model(llama_bpe_dir, tmp_path):
  data_path = write_jsonl(tmp_path / "data.jsonl", corpus_rows())
  out = tmp_path / "fine_tuned"
  argv = [*_SMALL_RUN, "--init-from", str(llama_bpe_dir), "--data-path", str(data_path),
          "--steps", "4", "--learning-rate", "1e-2", "--clip-norm", "1.0",
          "--save-hf", str(out)]
  with jax.numpy_dtype_promotion("standard"):  # optax's schedules promote implicitly
    (run,) = train.main(argv)
  # The directory a user hands to transformers: weights, config, tokenizer.
  assert {p.name for p in out.iterdir()} == {
      "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
  config_json = json.loads((out / "config.json").read_text())
  original = json.loads((llama_bpe_dir / "config.json").read_text())
  for key in ("bos_token_id", "eos_token_id", "vocab_size", "tie_word_embeddings"):
    assert config_json[key] == original[key], key
  assert config_json["torch_dtype"] == config_json["dtype"] == "float32"  # transformers 4 and 5
  assert text.load_tokenizer(out).fingerprint == text.load_tokenizer(llama_bpe_dir).fingerprint
  # The saved model is the trained one: its held-out loss is the run's, on the
  # run's own held-out batches, to float32 round-off of one evaluation.
  config = train.train_config(argv[:-2])  # the same run, less --save-hf (now taken)
  _, eval_batches = harness.make_data(config, harness.model_config_of(config))
  trained = hf.load_hf_checkpoint(out, scan_layers=False)
  loss_fn, params = models.split_loss_fn(trained, has_aux=True)
  loss = np.mean([float(jax.jit(loss_fn)(params, b)[0]) for b in eval_batches])
  assert loss == pytest.approx(run["eval_loss"], rel=1e-5)
  # ...and not the checkpoint it started from.
  loss_fn0, params0 = models.split_loss_fn(hf.load_hf_checkpoint(llama_bpe_dir, scan_layers=False),
                                           has_aux=True)
  start = np.mean([float(jax.jit(loss_fn0)(params0, b)[0]) for b in eval_batches])
  assert loss < start - 0.05


def _exit_2(argv, capsys) -> str:
  with pytest.raises(SystemExit) as exit_info:
    train.main(argv)
  assert exit_info.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines[-1].startswith("python -m models.train: error: ")
  return lines[-1]


def test_bad_data_and_tokenizers_are_one_line_errors_with_exit_2(llama_bpe_dir, tmp_path,
                                                                  capsys):
  rows = corpus_rows(40)
  good = write_jsonl(tmp_path / "good.jsonl", rows)
  no_field = write_jsonl(tmp_path / "no_field.jsonl", [*rows[:5], {"body": "x"}])
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  short = write_jsonl(tmp_path / "short.jsonl", [{"text": ""}])
  bare = tmp_path / "bare"  # a checkpoint without its tokenizer
  shutil.copytree(llama_bpe_dir, bare)
  (bare / "tokenizer.json").unlink()
  small = tmp_path / "small_vocab"  # an embedding smaller than the tokenizer
  shutil.copytree(llama_bpe_dir, small)
  config_json = json.loads((small / "config.json").read_text())
  (small / "config.json").write_text(json.dumps({**config_json, "vocab_size": 256}))
  run = [*_SMALL_RUN, "--steps", "1"]
  for argv, message in (
      (["--init-from", str(llama_bpe_dir), "--data-path", str(no_field)],
       r'no_field\.jsonl line 6: the row has fields \[.body.\] but needs "text"'),
      (["--init-from", str(llama_bpe_dir), "--data-path", str(empty)], r"empty\.jsonl"),
      (["--data-path", str(short)], r"short\.jsonl line 1 has 0 token\(s\)"),
      (["--init-from", str(bare), "--data-path", str(good)],
       "holds neither tokenizer.json nor tokenizer.model"),
      (["--init-from", str(small), "--data-path", str(good), "--preset", "llama_test"],
       r"ids up to 511 .* embedding has 256 rows"),
      (["--init-from", str(llama_bpe_dir), "--data-path", str(tmp_path / "absent.jsonl")],
       r"absent\.jsonl does not exist"),
      (["--init-from", str(llama_bpe_dir), "--data-path", str(good), "--batch-size", "4096",
        "--num-micro-batches", "1"], r"the training split of --data-path .*good\.jsonl"),
  ):
    error = _exit_2([*run, *argv], capsys)
    assert __import__("re").search(message, error), (message, error)


def test_save_hf_refuses_a_directory_holding_a_checkpoint(llama_bpe_dir, capsys):
  error = _exit_2([*_SMALL_RUN, "--init-from", str(llama_bpe_dir), "--steps", "1",
                   "--save-hf", str(llama_bpe_dir)], capsys)
  assert "already holds a checkpoint" in error


def test_a_truncated_shard_is_refused_by_name(tmp_path):
  config = models.LlamaConfig.test()
  from flax import nnx

  hf.save_hf_checkpoint(models.create(config, rngs=nnx.Rngs(0)), config, tmp_path,
                        max_shard_bytes=100_000)
  shards = sorted(tmp_path.glob("model-*.safetensors"))
  assert len(shards) >= 2
  victim = shards[1]
  victim.write_bytes(victim.read_bytes()[:-1000])
  with pytest.raises(ValueError, match=rf"{victim.name} is truncated: "):
    hf.load_hf_checkpoint(tmp_path)
  victim.write_bytes(b"\x00" * 4)  # not even a header
  with pytest.raises(ValueError, match=rf"{victim.name} is truncated or not safetensors"):
    hf.load_hf_checkpoint(tmp_path)


def test_tied_config_with_its_own_lm_head_loads_when_equal_and_is_refused_when_not(tmp_path):
  from flax import nnx

  config = models.LlamaConfig.test(tie_embeddings=True)
  hf.save_hf_checkpoint(models.create(config, rngs=nnx.Rngs(0)), config, tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  embed = tensors["model.embed_tokens.weight"]
  # A file that carries the head as well, equal to the embedding (some
  # exporters write both): loads tied, the same model.
  save_file({**tensors, "lm_head.weight": embed.copy()}, str(tmp_path / "model.safetensors"),
            {"format": "pt"})
  model = hf.load_hf_checkpoint(tmp_path, scan_layers=False)
  np.testing.assert_array_equal(np.asarray(model.token_embed.embedding[...]), embed)
  # A head that differs is refused with the reason (transformers 5 would keep
  # it untied), never dropped.
  save_file({**tensors, "lm_head.weight": embed + 1.0}, str(tmp_path / "model.safetensors"),
            {"format": "pt"})
  with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
    hf.load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("optimizer", ["adama", "adam"])
def test_weight_decay_skips_norm_scales_and_biases(optimizer):
  from flax import nnx

  config = harness.TrainConfig(model="gpt", preset="gpt_test", optimizer=optimizer,
                               num_micro_batches=2, batch_size=4, weight_decay=0.5,
                               learning_rate=0.1, warmup_steps=0, steps=10)
  params = nnx.state(models.create(harness.model_config_of(config), rngs=nnx.Rngs(0)),
                     nnx.Param)
  tx = harness.make_optimizer(config)
  state = tx.init(params)
  zeros = jax.tree.map(jax.numpy.zeros_like, params)
  with jax.numpy_dtype_promotion("standard"):
    for _ in range(2 if optimizer == "adama" else 1):  # one mini-batch
      updates, state = tx.update(zeros, state, params)
  # Zero gradients: the update is the decay alone, -lr * wd * param (lr 0.1 at
  # step 0 of a cosine without warm-up), on every param but norms and biases.
  names = {"/".join(str(getattr(k, "key", k)) for k in path): (u, p)
           for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(updates),
                                   jax.tree.leaves(params))}
  decayed = [n for n in names if not n.split("/")[-2].endswith(("bias", "scale"))]
  assert 0 < len(decayed) < len(names)
  for name, (update, param) in names.items():
    expected = -0.1 * 0.5 * np.asarray(param) if name in decayed else 0 * np.asarray(param)
    np.testing.assert_allclose(np.asarray(update), expected, rtol=1e-6, atol=1e-8,
                               err_msg=name)
  # The mask is a tree of booleans like the params (optax's mask= form).
  mask = harness.weight_decay_mask(params)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  assert sorted(n for n, m in zip(names, jax.tree.leaves(mask)) if m) == sorted(decayed)


def test_resuming_with_more_steps_continues_the_run(tmp_path, capsys):
  run = ["--preset", "llama_test", "--num-micro-batches", "2", "--batch-size", "4",
         "--seq-len", "16", "--eval-batches", "1", "--max-bytes", "100000", "--no-progress",
         "--checkpoint-dir", str(tmp_path / "run"), "--checkpoint-every", "2"]
  with jax.numpy_dtype_promotion("standard"):
    (first,) = train.main([*run, "--steps", "4"])
    (longer,) = train.main([*run, "--steps", "6"])
  err = capsys.readouterr().err
  assert "step 4 of 6 (the run had 4 steps: the warm-up + cosine schedule now spans 6" in err
  assert longer["resumed_from"] == 4 and len(longer["train_loss"]) == 6
  assert longer["train_loss"][:4] == first["train_loss"]  # the steps done are kept
  # A smaller --steps than the checkpoint's is refused before training.
  error = _exit_2([*run, "--steps", "3"], capsys)
  assert "holds step 6, past --steps 3; pass --steps 6 or more" in error


def test_prompt_tokens_carry_no_loss_through_the_run_s_batches(llama_bpe_dir, tmp_path):
  from fixtures_text import stdlib_sample

  # The same documents as text rows and as prompt + completion rows: equal
  # tokens, segments and positions, so the two losses differ by the mask alone.
  # Documents that fit in a row: a long one goes on in pieces whose positions
  # restart, and the test reads the prompt's targets off the positions.
  prompt = "Continue:\n"
  tokenizer = text.load_tokenizer(llama_bpe_dir)
  completions = [line.strip() for line in stdlib_sample().splitlines()
                 if len(line.strip()) > 20 and len(tokenizer.encode(prompt + line.strip())) <= 28]
  completions = completions[:80]
  as_text = write_jsonl(tmp_path / "text.jsonl", [{"text": prompt + c} for c in completions])
  as_pairs = write_jsonl(tmp_path / "pairs.jsonl",
                         [{"prompt": prompt, "completion": c} for c in completions])
  run = dict(model="llama", init_from=str(llama_bpe_dir), num_micro_batches=2, batch_size=4,
             seq_len=32, eval_batches=1, steps=1)
  text_config = harness.TrainConfig(**run, data_path=str(as_text))
  model_config = harness.model_config_of(text_config)
  text_batch = next(harness.make_data(text_config, model_config)[0])
  pair_batch = next(harness.make_data(
      harness.TrainConfig(**run, data_path=str(as_pairs)), model_config)[0])
  for key in ("tokens", "segment_ids", "positions"):
    np.testing.assert_array_equal(text_batch[key], pair_batch[key], err_msg=key)
  # A target is a prompt's when its position in its document is before the
  # completion: BOS and the prompt's tokens. Position 0 (BOS) is no target.
  prompt_length = 1 + len(tokenizer.encode(prompt))
  in_document = pair_batch["segment_ids"][:, 1:] > 0
  positions = pair_batch["positions"][:, 1:]
  np.testing.assert_array_equal(text_batch["loss_weights"][:, 1:] > 0,
                                in_document & (positions > 0))
  completion_targets = in_document & (positions >= prompt_length)
  np.testing.assert_array_equal(pair_batch["loss_weights"][:, 1:] > 0, completion_targets)
  assert (in_document & ~completion_targets).sum() > 10  # prompts' targets were there

  loss_fn, params = models.split_loss_fn(hf.load_hf_checkpoint(llama_bpe_dir, scan_layers=False),
                                         has_aux=True)
  loss_fn = jax.jit(loss_fn)
  # Each target's cross-entropy, read off the text batch (its loss is linear in
  # the weights: d loss / d weight = cross-entropy / rows).
  rows = text_batch["tokens"].shape[0]
  per_token = rows * np.asarray(jax.grad(
      lambda w: loss_fn(params, {**text_batch, "loss_weights": w})[0])(
          jax.numpy.asarray(text_batch["loss_weights"])))[:, 1:]
  # The run's loss on the pairs: each micro-batch's mean over its completion
  # targets alone (micro-batch i is rows i, i + N, ...), averaged.
  expected = np.mean([per_token[i::2][completion_targets[i::2]].mean() for i in range(2)])
  pair_loss = float(loss_fn(params, pair_batch)[0])
  assert pair_loss == pytest.approx(expected, rel=1e-5)
  text_loss = float(loss_fn(params, text_batch)[0])
  assert abs(pair_loss - text_loss) > 1e-3, (pair_loss, text_loss)


@pytest.mark.slow  # 15 s; test_resuming_with_more_steps_continues_the_run is its smoke
def test_a_run_resumed_with_more_steps_follows_the_longer_schedule_from_its_step(tmp_path):
  """k steps of the k-step run, then the n-step run's optimizer on the same state.

  Not a fresh n-step run: the first k steps took the k-step cosine. From step
  k the rate is the n-step warm-up + cosine's at step k (optax's schedules are
  functions of the count the state carries, and the total).
  """
  from flax import nnx

  base = dict(model="llama", preset="llama_test", num_micro_batches=2, batch_size=4,
              seq_len=16, eval_batches=1, max_bytes=100_000, warmup_steps=1,
              learning_rate=1e-2)
  short, longer = harness.TrainConfig(**base, steps=3), harness.TrainConfig(**base, steps=6)
  checkpoint = harness.CheckpointOptions(str(tmp_path / "run"), every=3)
  with jax.numpy_dtype_promotion("standard"):  # optax's schedules promote implicitly
    harness.train(short, progress=False, checkpoint=checkpoint)
    resumed = harness.train(longer, progress=False, checkpoint=checkpoint)
    fresh = harness.train(longer, progress=False)
    # The reference, by hand: the same initialisation and batches; the short
    # run's optimizer for its steps, then the longer one's on the same state.
    model_config = harness.model_config_of(longer)
    model = models.create(model_config, rngs=nnx.Rngs(longer.seed))
    loss_fn, params = models.split_loss_fn(model, has_aux=True)
    batches, _ = harness.make_data(longer, model_config)
    state = harness.make_optimizer(short).init(params)
    expected = []
    for config, steps in ((short, short.steps), (longer, longer.steps - short.steps)):
      step = harness.make_train_step(config, model, loss_fn, harness.make_optimizer(config))
      for _ in range(steps):
        params, state, metrics = step(params, state, next(batches))
        expected.append(float(metrics["loss"]))
  assert resumed["resumed_from"] == 3
  np.testing.assert_allclose(resumed["train_loss"], expected, rtol=1e-6)
  # ...which a fresh run of the longer schedule is not.
  assert np.abs(np.subtract(fresh["train_loss"][4:], resumed["train_loss"][4:])).max() > 1e-4


@pytest.mark.parametrize("source", ["llama_bpe_dir", "llama_sentencepiece_dir"])
def test_transformers_reads_the_directory_as_the_zoo_wrote_it(source, request, tmp_path):
  """Where torch and transformers are installed (4.x or 5.x; the suite needs
  neither): the directory `--save-hf` writes loads with `AutoTokenizer` and
  `AutoModelForCausalLM`, giving the zoo's ids (BOS framed) and logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  source = request.getfixturevalue(source)
  model = hf.load_hf_checkpoint(source, scan_layers=False)
  # What train(hf_directory=...) writes: the checkpoint, then the source's extras.
  hf.save_hf_checkpoint(model, hf.read_hf_config(source), tmp_path)
  llama_hf_config.copy_hf_extras(source, tmp_path)
  sample = "def fine_tune(model, data):\n    return model.train(data)  # 2 passes\n"
  tokenizer = text.load_tokenizer(tmp_path)
  ids = [tokenizer.bos_id, *tokenizer.encode(sample).tolist()]
  assert transformers.AutoTokenizer.from_pretrained(tmp_path)(sample)["input_ids"] == ids
  theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
  assert next(theirs.parameters()).dtype == torch.float32
  with torch.no_grad():
    want = theirs(torch.tensor([ids])).logits.numpy()
  got = np.asarray(model(np.asarray([ids], np.int32)))
  # float32 both sides, torch's kernels against XLA's: 5e-7 measured.
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow  # 12 s; test_weight_decay_skips_norm_scales_and_biases is its smoke
def test_weight_decay_under_the_release_leaves_the_stacked_norm_scales_alone():
  """The release folds a scanned stack layer by layer: its [layers, width] norm
  scales take the same first step with and without weight decay, the kernels not."""
  from flax import nnx

  stepped = {}
  for weight_decay in (0.0, 0.5):
    config = harness.TrainConfig(
        model="llama", preset="llama_test", scan_layers=True, release=True,
        weight_decay=weight_decay, steps=2, batch_size=4, num_micro_batches=2, seq_len=16,
        eval_batches=1, max_bytes=100_000, learning_rate=1e-2, warmup_steps=0)
    model_config = harness.model_config_of(config)
    model = models.create(model_config, rngs=nnx.Rngs(0))
    loss_fn, params = models.split_loss_fn(model, has_aux=True)
    tx = harness.make_optimizer(config)
    step = harness.make_train_step(config, model, loss_fn, tx)
    with jax.numpy_dtype_promotion("standard"):  # optax's schedules promote implicitly
      params, _, _ = step(params, tx.init(params), next(harness.make_data(config,
                                                                           model_config)[0]))
    stepped[weight_decay] = {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(x)
                             for path, x in jax.tree_util.tree_leaves_with_path(params)}
  norms = [name for name in stepped[0.0] if "/scale/" in name]
  assert "blocks/attention_norm/scale/value" in norms and stepped[0.0][norms[0]].ndim == 2
  for name, undecayed in stepped[0.0].items():
    change = np.abs(stepped[0.5][name] - undecayed).max()
    assert (change == 0) if name in norms else (change > 1e-5), (name, change)
