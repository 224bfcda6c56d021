"""The training loop: one run of a `TrainConfig`, checkpointed, resumed and measured.

`train` builds the model, its data and the jitted step (`make_train_step`:
`optax_adama.microbatch_step`, or `release_step` on the model's stages), runs
the steps (saving every `CheckpointOptions.every` and on SIGTERM / SIGINT,
resuming from the newest checkpoint) and returns the run's metrics: losses,
held-out metrics, step time, compiled memory and the machine.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models import checkpoint as checkpointing
from models import data
from models import llama_checkpoint
from models import llama_hf_config
from models.harness import devices
from models.harness.batches import packed_text_batches
from models.harness.batches import tokens_per_example
from models.harness.batches import uses_packed_text
from models.harness.batches import weigh_targets
from models.harness.reporting import machine_info
from models.harness.settings import CAUSAL_LM_KINDS
from models.harness.settings import TrainConfig
from models.harness.settings import make_optimizer
from models.harness.settings import model_config_of


def make_train_step(config: TrainConfig, model: nnx.Module, loss_fn: Callable,
                    tx: optax.GradientTransformation, *,
                    mesh: jax.sharding.Mesh | None = None,
                    shard_states: str | None = None) -> Callable:
  """The jitted training step: `release_step` on the model's stages, or `microbatch_step`.

  Both take and return the same (params, opt_state, batch) and metrics with
  "loss"; the release's loss is the head's (it has no accuracy aux).

  With `mesh` the step is data parallel over its "data" axis and
  `shard_states` picks the ZeRO stage (None, "zero1", "zero2", "fsdp"; see
  `optax_adama.sharding`). The plain loss is used under FSDP too: GSPMD
  gathers each layer where the model's own scan reads it. Place params and
  state first with `train_step_shardings`.
  """
  if mesh is None and shard_states is not None:
    raise ValueError(f"shard_states={shard_states!r} splits state over a mesh; pass mesh= "
                     "(a jax.sharding.Mesh with a 'data' axis) or shard_states=None.")
  on_mesh = {} if mesh is None else {"mesh": mesh, "shard_states": shard_states}
  if config.release:
    staged, _ = models.staged_loss(model)
    return optax_adama.release_step(staged, tx, **on_mesh)
  return optax_adama.microbatch_step(
      loss_fn, tx, num_micro_batches=config.num_micro_batches, has_aux=True,
      accumulation_dtype=config.accumulation_dtype, **on_mesh)


def train_step_shardings(config: TrainConfig, model: nnx.Module, params: Any, opt_state: Any,
                         mesh: jax.sharding.Mesh,
                         shard_states: str | None) -> optax_adama.sharding.StepShardings:
  """Where `make_train_step(..., mesh=mesh, shard_states=...)` keeps params and state.

  The release splits a stacked leaf off its layer axis (`release_shardings`),
  `microbatch_step` along its largest axis under FSDP (`step_shardings`).
  """
  if config.release:
    staged, _ = models.staged_loss(model)
    return optax_adama.sharding.release_shardings(staged, params, opt_state, mesh,
                                                  shard_states=shard_states)
  return optax_adama.sharding.step_shardings(params, opt_state, mesh, shard_states=shard_states)


def make_data(config: TrainConfig, model_config: Any) -> tuple[Iterator[dict], list[dict]]:
  """(training batch stream, fixed list of held-out batches) for a run."""
  if config.model == "vit":
    # The preset's input size names the data set: 8x8 digits for vit_tiny and
    # vit_test, 28x28 MNIST-5k for vit_mnist.
    images = data.load_images_for(model_config.image_size)
    train = data.image_batches(
        images.train_images, images.train_labels, batch_size=config.batch_size,
        seed=config.seed)
    if model_config.image_size == 8:
      # Capped at the held-out split (359 digits), so a mini-batch larger than
      # it is scored on the whole split, in one batch; smaller ones as before.
      valid_batch_size = min(config.batch_size, len(images.valid_labels))
    else:
      # MNIST-5k: all 1,000 held-out images in 5 batches of 200 whatever the
      # mini-batch (within the default 16 eval batches), so a run's held-out
      # loss does not depend on which part of the split its batch size reaches.
      valid_batch_size = len(images.valid_labels) // 5
    valid = data.image_batches(
        images.valid_images, images.valid_labels, batch_size=valid_batch_size,
        shuffle=False, epochs=1)
  elif uses_packed_text(config.model, config.init_from, config.data_path):
    seq_len = min(config.seq_len, model_config.max_len)
    train, valid, _ = packed_text_batches(
        model_config, init_from=config.init_from, data_path=config.data_path,
        max_bytes=config.max_bytes, batch_size=config.batch_size, seq_len=seq_len,
        seed=config.seed)
    # Each target weighs its micro-batch's share, so a mesh trains one device's loss.
    train = (weigh_targets(batch, config.num_micro_batches) for batch in train)
  else:
    text = (data.load_text(config.data_path) if config.data_path
            else data.load_stdlib_text(max_bytes=config.max_bytes))
    seq_len = min(config.seq_len, model_config.max_len)
    batches = data.lm_batches if config.model in CAUSAL_LM_KINDS else data.mlm_batches
    train = batches(text.train, batch_size=config.batch_size, seq_len=seq_len,
                    seed=config.seed)
    # Held-out masks are drawn from a fixed seed: every run scores the same task.
    valid = batches(text.valid, batch_size=config.batch_size, seq_len=seq_len,
                    seed=1234, shuffle=False, epochs=1)
  eval_batches = [b for _, b in zip(range(config.eval_batches), valid)]
  if not eval_batches:
    raise ValueError("the held-out split is too small for one batch.")
  return train, eval_batches


def evaluate(loss_fn, params, batches: Sequence[dict]) -> dict[str, float]:
  """Mean loss and aux metrics over held-out batches."""
  eval_step = jax.jit(loss_fn)
  totals: dict[str, float] = {}
  for batch in batches:
    loss, aux = eval_step(params, batch)
    for name, value in {"loss": loss, **aux}.items():
      totals[name] = totals.get(name, 0.0) + float(value)
  return {name: value / len(batches) for name, value in totals.items()}


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
  """Where and how often a run saves itself (`--checkpoint-dir` and friends)."""

  directory: str
  every: int = 100  # steps between saves; the last step and a stop signal save too.
  keep: int = 3  # the newest checkpoints kept.

  def __post_init__(self):
    if self.every < 1:
      raise ValueError(f"checkpoint every must be >= 1 steps, got {self.every}.")
    if self.keep < 1:
      raise ValueError(f"keep must be >= 1, got {self.keep}.")


# A held-out batch count changes what is scored, not what is trained.
# A run resumed with a larger `steps` continues: its warm-up + cosine schedule is
# rebuilt over the new total, so from the resumed step on the rate follows the
# longer schedule (it rises to the longer cosine's value there, as optax's
# schedules are functions of the step count and the total).
# The mesh and its stage: the state is read onto the new run's shardings (orbax
# reshards) and the run continues; a causal LM's mesh trains the one-device loss,
# so it equals the uninterrupted run to float32 round-off (bitwise on its mesh).
_RESUMABLE_CHANGES = ("eval_batches", "steps", "mesh_devices", "shard_states")


class _StopSignals:
  """SIGTERM / SIGINT set a flag the step loop reads after each step.

  The loop then saves and exits, instead of dying mid-step: the preemption
  notice of a shared or spot machine. Installed only in the main thread (the
  only one Python delivers signals to); the previous handlers come back on exit.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, active: bool):
    self.active = active  # without checkpoints there is nothing to save first.
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self):
    if self.active and threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signum
    # A second signal while the checkpoint is written acts as it always does.
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _run_checkpoints(config: TrainConfig,
                     checkpoint: CheckpointOptions | None) -> checkpointing.RunCheckpoints | None:
  """The checkpoints of the run of ``config`` (None: the run saves none)."""
  if checkpoint is None:
    return None
  return checkpointing.RunCheckpoints(
      Path(checkpoint.directory), identity=dataclasses.asdict(config),
      keep=checkpoint.keep, ignored=_RESUMABLE_CHANGES)


def check_run(config: TrainConfig, checkpoint: CheckpointOptions | None = None) -> None:
  """Raises ``ValueError`` (``OSError`` for a missing file) where ``train`` would
  refuse ``config`` after its start: the model's settings (``model_config_of``),
  a ``data_path`` that is not there, and checkpoints of another run in
  ``checkpoint.directory``. Reads no data and builds no model, so a command
  checks every run it was asked for before training the first.
  """
  model_config_of(config)
  if config.mesh_devices > 1:
    devices.check_devices(config.mesh_devices)
  if config.data_path is not None and not Path(config.data_path).exists():
    raise FileNotFoundError(f"data_path={config.data_path} does not exist; pass a text "
                            "file or a directory of them.")
  run_checkpoints = _run_checkpoints(config, checkpoint)
  if run_checkpoints is not None:
    try:
      run_checkpoints.check_identity()
      done = max(run_checkpoints.steps(), default=0)
      if done > config.steps:
        raise ValueError(f"{run_checkpoints.directory} holds step {done}, past steps="
                         f"{config.steps}; pass steps={done} or more to continue the run.")
    finally:
      run_checkpoints.close()


def _resume(run_checkpoints, params, opt_state, config):
  """``(params, opt_state, first step, losses so far)``, from the newest checkpoint."""
  if run_checkpoints is None:
    return params, opt_state, 0, []
  restored = run_checkpoints.restore_latest(
      checkpointing.abstract_like({"params": params, "opt_state": opt_state}))
  if restored is None:
    return params, opt_state, 0, []
  before = restored.record.get("identity", {}).get("steps", config.steps)
  extended = (f" (the run had {before} steps: the warm-up + cosine schedule now spans "
              f"{config.steps}, and the rate from here follows it)"
              if before != config.steps else "")
  print(f"resuming from {run_checkpoints.directory / str(restored.step)}: "
        f"step {restored.step} of {config.steps}{extended}", file=sys.stderr)
  return (restored.state["params"], restored.state["opt_state"],
          int(restored.record["data_position"]), list(restored.record["train_loss"]))


@dataclasses.dataclass
class _RunState:
  """Where a run stands: its state, the steps done, their losses and this process's times."""

  params: Any
  opt_state: Any
  done: int
  train_loss: list[float]
  step_times: list[float] = dataclasses.field(default_factory=list)

  def save(self, run_checkpoints) -> None:
    if run_checkpoints is not None and self.done not in run_checkpoints.steps():
      run_checkpoints.save(
          self.done, {"params": self.params, "opt_state": self.opt_state},
          # A copy: the save runs in the background while the next steps
          # append to the live list (a SIGKILL test caught a checkpoint of
          # step k carrying step k + 1's loss).
          {"train_loss": list(self.train_loss), "data_position": self.done})


def _run_steps(config, compiled, batches, first, run: _RunState, run_checkpoints,
               every: int | None, tokens_per_step: int, show: bool) -> None:
  """Steps ``run`` to ``config.steps``, saving every ``every`` and on a stop signal."""
  bar = tqdm(total=config.steps, initial=run.done, disable=not show,
             desc=f"{config.preset_name}/{config.optimizer}", dynamic_ncols=True,
             file=sys.stderr)
  batch = first
  with _StopSignals(active=run_checkpoints is not None) as stop:
    while run.done < config.steps:
      begin = time.perf_counter()
      run.params, run.opt_state, metrics = compiled(
          run.params, run.opt_state, batch)
      loss = float(metrics["loss"])  # blocks: the timing covers the step
      run.step_times.append(time.perf_counter() - begin)
      run.train_loss.append(loss)
      run.done += 1
      bar.set_postfix(loss=f"{loss:.3f}",
                      tok_s=f"{tokens_per_step / run.step_times[-1]:,.0f}")
      bar.update()
      if every is not None and (run.done % every == 0 or run.done == config.steps
                                or stop.received is not None):
        run.save(run_checkpoints)
      if stop.received is not None:
        bar.close()
        run_checkpoints.close()
        print(f"{signal.Signals(stop.received).name} at step {run.done}: saved "
              f"{run_checkpoints.directory / str(run.done)}; run the same command "
              "again to resume", file=sys.stderr)
        raise SystemExit(128 + stop.received)
      if run.done < config.steps:
        batch = next(batches)
  bar.close()


def _placed_state(config: TrainConfig, model_config: Any, tx: optax.GradientTransformation,
                  mesh: jax.sharding.Mesh | None) -> tuple[nnx.Module, Any, Any]:
  """(model, params, optimizer state), placed where the run's step keeps them.

  On a mesh, params and state go to `train_step_shardings`' places; a
  checkpoint (``init_from``) is read there directly, each device its slice.
  """
  from_checkpoint = config.init_from is not None
  model = (models.create_abstract(model_config) if from_checkpoint
           else models.create(model_config, rngs=nnx.Rngs(config.seed)))
  params = nnx.state(model, nnx.Param)
  shardings = None
  if mesh is not None:
    shardings = train_step_shardings(config, model, params, jax.eval_shape(tx.init, params),
                                     mesh, config.shard_states)
  if from_checkpoint:  # the checkpoint's weights in place of an initialisation
    params = llama_checkpoint.load_hf_params(
        config.init_from, model_config, shardings=None if shardings is None else shardings.params)
    nnx.update(model, params)
  elif shardings is not None:
    params = jax.device_put(params, shardings.params)
  opt_state = tx.init(params)
  if shardings is not None:
    opt_state = jax.device_put(opt_state, shardings.opt_state)
  return model, params, opt_state


def train(config: TrainConfig, *, progress: bool = True,
          checkpoint: CheckpointOptions | None = None,
          hf_directory: str | Path | None = None) -> dict[str, Any]:
  """Trains one model and returns its metrics.

  The metrics: the config, the preset and its parameter count, every step's
  training loss (``train_loss``, restored ones first after a resume) and the
  mean of the last 5% (``final_train_loss``), the held-out loss and metrics
  (``eval_loss``, ``eval_metrics``), the median step time and throughput, the
  compile time, the step loop's wall time (``loop_s``: this process's steps,
  saves included), the compiled step's memory, the micro-batches AdamA
  dropped, the step it resumed from (``resumed_from``) and the machine.
  ``progress`` shows a progress bar.

  With ``checkpoint`` the run saves params, optimizer state and its record
  (step, data position, losses) every ``checkpoint.every`` steps, at the last
  step and when SIGTERM or SIGINT arrives (then it exits with status 128 +
  the signal); started again with the same directory it resumes from the
  newest complete checkpoint and ends bitwise where the uninterrupted run
  would have (the data stream and all randomness are functions of the seed
  and the step).

  With ``hf_directory`` (a Llama) the trained model is written there as a
  Hugging Face checkpoint (`models.llama_checkpoint.save_hf_checkpoint`),
  with ``init_from``'s tokenizer files and special token ids.
  """
  model_config = model_config_of(config)
  mesh = devices.make_mesh(config.mesh_devices, config.shard_states)
  tx = make_optimizer(config)
  model, params, opt_state = _placed_state(config, model_config, tx, mesh)
  loss_fn, _ = models.split_loss_fn(model, has_aux=True)
  step = make_train_step(config, model, loss_fn, tx, mesh=mesh,
                         shard_states=config.shard_states)
  del model  # the loss merges params back into a fresh module each call
  train_batches, eval_batches = make_data(config, model_config)
  run_checkpoints = _run_checkpoints(config, checkpoint)
  # Restored onto the placed state's shardings: each device reads its own
  # shards of a checkpoint saved on the same mesh.
  run = _RunState(*_resume(run_checkpoints, params, opt_state, config))
  start = run.done
  for _ in range(start):  # the data position: one batch per step done.
    next(train_batches)
  if mesh is not None:
    train_batches = (devices.place_batch(b, mesh) for b in train_batches)

  first = next(train_batches)
  compile_start = time.perf_counter()
  compiled = step.lower(run.params, run.opt_state, first).compile()
  compile_s = time.perf_counter() - compile_start
  memory = optax_adama.memory_report(
      compiled, param_bytes=optax_adama.memory.tree_bytes(run.params))
  tokens_per_step = config.batch_size * tokens_per_example(model_config, first)

  loop_start = time.perf_counter()
  _run_steps(config, compiled, train_batches, first, run, run_checkpoints,
             None if checkpoint is None else checkpoint.every, tokens_per_step, progress)
  if run_checkpoints is not None:
    run_checkpoints.close()  # the last save written: part of the run's cost.
  loop_s = time.perf_counter() - loop_start

  eval_metrics = evaluate(loss_fn, run.params, eval_batches)
  if hf_directory is not None:  # the way back: a Hugging Face directory, tokenizer included
    # Several processes: each gathers the sharded params, process 0 writes them.
    hf_params = devices.gathered(run.params)
    if jax.process_index() == 0:
      llama_checkpoint.save_hf_checkpoint(hf_params, model_config, hf_directory)
      if config.init_from is not None:
        llama_hf_config.copy_hf_extras(config.init_from, hf_directory)
  # The first steps include one-off work (allocation, caches): time the rest.
  steady = run.step_times[len(run.step_times) // 10:] or run.step_times or [float("nan")]
  median_step_s = float(np.median(steady))
  adama_state = optax_adama.find_adama_state(run.opt_state)
  return {
      "config": dataclasses.asdict(config),
      "preset": config.preset_name,
      "param_count": models.param_count(model_config),
      "train_loss": run.train_loss,
      "final_train_loss": float(np.mean(run.train_loss[-max(1, config.steps // 20):])),
      "eval_loss": eval_metrics["loss"],
      "eval_metrics": eval_metrics,
      "median_step_s": median_step_s,
      "steps_per_s": 1.0 / median_step_s,
      "tokens_per_s": tokens_per_step / median_step_s,
      "compile_s": compile_s,
      "loop_s": loop_s,  # wall time of the steps this process ran, saves included.
      "memory": memory.to_dict(),
      "num_dropped": None if adama_state is None else int(adama_state.num_dropped),
      "resumed_from": start or None,
      "machine": machine_info(),
  }
