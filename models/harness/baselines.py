"""The accumulation methods the benchmarks compare AdamA with, and how each is measured.

`make_step(method, loss_fn, ...)` builds a method's jitted, donating step and
its optimizer (`models.bench` describes each method); `floor_for` is the
memory floor a method is held to, `split_model` a config's pure loss and
abstract params, and `measure_throughput` times methods interleaved round by
round. `models.bench`, `models.gpu_bench`, `models.demo` and the capacity
search (`models.harness.capacity`) build on them.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models.harness.batches import abstract_batch
from models.harness.batches import random_batch
from models.harness.batches import tokens_per_example
from models.harness.settings import DEFAULT_NU_ESTIMATOR
from models.harness.settings import adama_transform

# The accumulation methods of models.bench (its docstring describes each).

METHODS = ("full_batch", "scan_accumulation", "multisteps", "optax_microbatching", "adama")
# Capacity: smaller optimizer state. The careful user's accumulation baseline,
# then AdamA with 8-bit, low-rank (GaLore) and host-offloaded moments.
STATE_METHODS = ("scan_accumulation_bf16_8bit", "adama_8bit", "adama_8bit_lowrank",
                 "adama_8bit_lowrank_offload")
LOW_RANK_REFRESH_PERIOD = 200  # mini-batches, GaLore's default
# Data parallel on a mesh (capacity with a per-device budget): plain data-parallel
# accumulation and AdamA (params, m, v replicated), AdamA with ZeRO-2 (m, v split,
# gradients reduce-scattered), and ZeRO-2 with 8-bit moments.
SHARDED_METHODS = ("dp_scan_accumulation", "dp_adama", "zero2_scan_accumulation",
                   "zero2_adama", "zero2_adama_8bit")
# Needs the model in stages, so only with --scan-layers: the release step with
# float32 moments, with 8-bit ones whose blocks tile each layer, and with those
# kept in host memory (each layer's slice brought in for its fold and update).
RELEASE_METHODS = ("adama_release", "adama_release_8bit", "adama_release_8bit_offload")
# FSDP on a mesh, the model in stages (--scan-layers): every device holds a
# slice of every layer, each layer's params gathered inside the layer scan.
# Scan accumulation (optax.adam, a float32 accumulator split like the params)
# against the release with float32 and with layer-aligned 8-bit moments.
FSDP_METHODS = ("fsdp_scan_accumulation", "fsdp_adama_release", "fsdp_adama_release_8bit")
# AdamA with another second-moment estimator than the default ("mean"), for its
# price against the default (step time, memory) in the same row group.
ESTIMATOR_METHODS = ("adama_momentum",)
Step = Callable[..., Any]


def make_step(
    method: str, loss_fn: Callable, *, num_micro_batches: int, learning_rate: float = 1e-4,
    mesh: jax.sharding.Mesh | None = None, rank: int | None = None,
) -> tuple[Step, optax.GradientTransformation]:
  """(jitted donating step, its optimizer) of a method.

  ``full_batch`` runs the whole mini-batch as one micro-batch; every other
  method scans ``num_micro_batches`` of them. ``rank``: the low-rank methods'
  projection rank.
  """
  check_method(method, scanned=isinstance(loss_fn, optax_adama.StagedLoss),
               mesh=mesh is not None)
  adam = optax.adam(learning_rate)
  if method in FSDP_METHODS:
    return _fsdp_step(method, loss_fn, num_micro_batches, learning_rate, mesh)
  if method in STATE_METHODS:
    return _state_method_step(method, loss_fn, num_micro_batches, learning_rate, rank)
  if method in SHARDED_METHODS:
    quantization = optax_adama.BlockQuantization() if method.endswith("_8bit") else None
    tx = (adam if method.endswith("_scan_accumulation") else optax_adama.adama(
        learning_rate, num_micro_batches=num_micro_batches, quantization=quantization))
    step = optax_adama.microbatch_step(
        loss_fn, tx, num_micro_batches=num_micro_batches, mesh=mesh,
        shard_states="zero2" if method.startswith("zero2") else None)
    return step, tx
  if method == "full_batch":
    return optax_adama.microbatch_step(loss_fn, adam, num_micro_batches=1), adam
  if method in ("scan_accumulation", "scan_accumulation_bf16"):
    # _bf16: the gradient sum carried in bfloat16, as MaxText users run it.
    step = optax_adama.microbatch_step(
        loss_fn, adam, num_micro_batches=num_micro_batches, update_every_micro_batch=False,
        accumulation_dtype=jnp.bfloat16 if method.endswith("_bf16") else None)
    return step, adam
  if method == "multisteps":
    tx = optax.MultiSteps(adam, every_k_schedule=num_micro_batches)
    return optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=num_micro_batches), tx
  if method == "optax_microbatching":
    return _optax_microbatching_step(loss_fn, adam, num_micro_batches), adam
  if method == "adama" or method in ESTIMATOR_METHODS:
    estimator = DEFAULT_NU_ESTIMATOR if method == "adama" else method.removeprefix("adama_")
    tx = adama_transform("adama", learning_rate, num_micro_batches=num_micro_batches,
                         nu_estimator=estimator)
    return optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=num_micro_batches), tx
  if method in RELEASE_METHODS:
    quantization = (optax_adama.BlockQuantization(layer_aligned=True)
                    if "_8bit" in method else None)
    tx = optax_adama.adama(learning_rate, num_micro_batches=num_micro_batches,
                           quantization=quantization)
    if method.endswith("_offload"):
      tx = optax_adama.offload_moments(tx)
    return optax_adama.release_step(loss_fn, tx), tx
  raise AssertionError(f"check_method passed {method!r}, which has no step")


def check_method(method: str, *, scanned: bool, mesh: bool) -> None:
  """Raises ``ValueError`` if ``method`` cannot run on this model and devices.

  ``scanned``: the model is in stages (``--scan-layers``); ``mesh``: the step
  runs on several devices (``--devices``). The release and FSDP methods need
  the stages, the data-parallel and FSDP ones a mesh.
  """
  known = (METHODS + ("scan_accumulation_bf16",) + STATE_METHODS + SHARDED_METHODS
           + RELEASE_METHODS + FSDP_METHODS + ESTIMATOR_METHODS)
  if method not in known:
    raise ValueError(f"unknown method {method!r}; known: {known}")
  needs = []
  if method in RELEASE_METHODS + FSDP_METHODS and not scanned:
    needs.append("a scanned model (--scan-layers)")
  if method in SHARDED_METHODS + FSDP_METHODS and not mesh:
    needs.append("a mesh (--devices 2 or more)")
  if needs:
    raise ValueError(f"method {method} needs {' and '.join(needs)}; add the flag or "
                     "drop the method from --methods.")


def _fsdp_step(method, staged, num_micro_batches, learning_rate, mesh):
  """The steps of FSDP_METHODS (place their arguments with :func:`fsdp_shardings`)."""
  if method == "fsdp_scan_accumulation":
    tx = optax.adam(learning_rate)
    return optax_adama.microbatch_step(staged, tx, num_micro_batches=num_micro_batches,
                                       mesh=mesh, shard_states="fsdp"), tx
  quantization = (optax_adama.BlockQuantization(layer_aligned=True)
                  if method.endswith("_8bit") else None)
  tx = optax_adama.adama(learning_rate, num_micro_batches=num_micro_batches,
                         quantization=quantization)
  return optax_adama.release_step(staged, tx, mesh=mesh, shard_states="fsdp"), tx


def fsdp_shardings(method: str, staged: optax_adama.StagedLoss, params: Any, opt_state: Any,
                   mesh: jax.sharding.Mesh) -> optax_adama.sharding.StepShardings:
  """Where an FSDP method's step keeps params and state (each layer split)."""
  shardings = (optax_adama.sharding.stack_shardings if method == "fsdp_scan_accumulation"
               else optax_adama.sharding.release_shardings)
  return shardings(staged, params, opt_state, mesh, shard_states="fsdp")


def _state_method_step(method, loss_fn, num_micro_batches, learning_rate, rank):
  """The steps of STATE_METHODS: 8-bit, low-rank and offloaded moments."""
  quantization = optax_adama.BlockQuantization()
  if method == "scan_accumulation_bf16_8bit":
    adam_8bit = _without_adama_state(optax_adama.adama(
        learning_rate, num_micro_batches=1, quantization=quantization))
    step = optax_adama.microbatch_step(
        loss_fn, adam_8bit, num_micro_batches=num_micro_batches,
        update_every_micro_batch=False, accumulation_dtype=jnp.bfloat16)
    return step, adam_8bit
  tx = optax_adama.adama(learning_rate, num_micro_batches=num_micro_batches,
                         quantization=quantization)
  if "lowrank" in method:
    if rank is None:
      raise ValueError(f"method {method!r} needs a rank.")
    tx = optax_adama.low_rank(tx, rank=rank, refresh_period=LOW_RANK_REFRESH_PERIOD,
                              projector_dtype=jnp.bfloat16)
  if method.endswith("_offload"):
    tx = optax_adama.offload_moments(tx)
  return optax_adama.microbatch_step(loss_fn, tx), tx


def _without_adama_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` with its state as a flat tuple of arrays.

  AdamA at N = 1 is Adam; with its state flattened, ``microbatch_step`` finds
  no AdamA state and runs it as any optax optimizer, after a gradient-sum
  carry: Adam with 8-bit moments for the accumulation baseline.
  """

  def update_fn(updates, state, params=None):
    treedef = jax.tree.structure(jax.eval_shape(tx.init, params))
    new_updates, new_state = tx.update(updates, treedef.unflatten(state), params)
    return new_updates, tuple(jax.tree.leaves(new_state))

  return optax.GradientTransformation(lambda p: tuple(jax.tree.leaves(tx.init(p))), update_fn)


def _optax_microbatching_step(loss_fn, tx, num_micro_batches):
  """The step a user writes with optax.microbatching: mean gradient, one update."""

  def step(params, opt_state, batch):
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    value_and_grad = optax.microbatching.microbatch(
        jax.value_and_grad(loss_fn), argnums=1,
        microbatch_size=batch_size // num_micro_batches,
        accumulator=optax.microbatching.AccumulationType.MEAN)
    loss, grads = value_and_grad(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  return jax.jit(step, donate_argnums=(0, 1))


def split_model(config: models.Config) -> tuple[Callable, Any]:
  """(pure loss_fn, abstract params) of a config, nothing allocated.

  With ``scan_layers`` the loss is a ``StagedLoss`` (also a plain loss_fn).
  """
  if config.scan_layers:
    return models.staged_loss(models.create_abstract(config))
  graphdef, params, rest = nnx.split(models.create_abstract(config), nnx.Param, ...)
  return models.make_loss_fn(graphdef, rest), params


def adama_floor(config: models.Config, batch: dict,
                num_micro_batches: int) -> optax_adama.memory.MemoryFloor:
  """AdamA's floor on the unrolled model (its largest gradient is one leaf)."""
  loss_fn, params = split_model(dataclasses.replace(config, scan_layers=False))
  state = jax.eval_shape(
      optax_adama.adama(1e-4, num_micro_batches=num_micro_batches).init, params)
  return optax_adama.memory.memory_floor(loss_fn, params, state, batch,
                                  num_micro_batches=num_micro_batches)


def floor_for(method: str, config: models.Config, batch: dict,
              num_micro_batches: int) -> optax_adama.memory.MemoryFloor:
  """The floor a method is held to.

  AdamA's (`adama_floor`): the unrolled model's, whose largest gradient is one
  leaf. The release step's: it recomputes each layer from its saved input in
  the backward pass, so its activations are those of the scanned model with
  every block rematerialized (the layer inputs, one layer's recomputation and
  the head), and its largest gradient is one layer's slice of a stacked leaf
  or an outer leaf.
  """
  if method not in RELEASE_METHODS:
    return adama_floor(config, batch, num_micro_batches)
  config = dataclasses.replace(config, scan_layers=True, remat="full")
  loss_fn, params = split_model(config)
  state = jax.eval_shape(
      optax_adama.adama(1e-4, num_micro_batches=num_micro_batches).init, params)
  floor = optax_adama.memory.memory_floor(loss_fn, params, state, batch,
                                   num_micro_batches=num_micro_batches)
  stack_path = (loss_fn.layers,) if isinstance(loss_fn.layers, str) else tuple(loss_fn.layers)

  def gradient_bytes(path, leaf):
    keys = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
    stacked = keys[:len(stack_path)] == stack_path
    return optax_adama.memory.tree_bytes(leaf) // (config.num_layers if stacked else 1)

  largest = max(gradient_bytes(path, leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(params))
  return dataclasses.replace(floor, largest_gradient_bytes=largest)


def dtype_override(dtype: str | None) -> dict[str, Any]:
  """The config field of a compute dtype (``--dtype``); none for None (the preset's)."""
  return {} if dtype is None else {"dtype": jnp.dtype(dtype)}


def measure_throughput(
    preset: str,
    methods: Sequence[str],
    num_micro_batches: int,
    *,
    micro_batch_size: int,
    seq_len: int | None = None,
    rounds: int = 7,
    steps_per_round: int = 5,
    progress: bool = True,
    dtype: str | None = None,
) -> dict[str, dict[str, float]]:
  """Median step time per method, the methods interleaved round by round.

  Interleaving means slow drift of the machine (other load, thermal state)
  hits every method alike, so their ratio is trustworthy. ``dtype``: the
  compute dtype (params and moments stay float32); None: the preset's.
  """
  config = models.get_config(preset, **dtype_override(dtype))
  model = models.create(config, rngs=nnx.Rngs(0))
  # The release step needs the model in stages (scanned configs only).
  splits = {False: models.split_loss_fn(model)}
  if any(m in RELEASE_METHODS for m in methods):
    splits[True] = models.staged_loss(model)
  batch_size = micro_batch_size * num_micro_batches
  batch = random_batch(config, abstract_batch(config, batch_size, seq_len))
  tokens_per_step = batch_size * tokens_per_example(config, batch)
  runners = {}
  for method in methods:
    loss_fn, init_params = splits[method in RELEASE_METHODS]
    step, tx = make_step(method, loss_fn, num_micro_batches=num_micro_batches)
    params = jax.tree.map(jnp.array, init_params)
    state = tx.init(params)
    compiled = step.lower(params, state, batch).compile()
    runners[method] = [compiled, params, state]
  times: dict[str, list[float]] = {m: [] for m in methods}
  with tqdm(total=rounds * len(methods), desc=f"throughput {preset}", disable=not progress,
            file=sys.stderr) as bar:
    for round_index in range(rounds + 1):  # round 0 warms up, untimed
      for method in methods:
        compiled, params, state = runners[method]
        start = time.perf_counter()
        for _ in range(steps_per_round):
          params, state, metrics = compiled(params, state, batch)
        jax.block_until_ready((params, state, metrics))
        elapsed = (time.perf_counter() - start) / steps_per_round
        runners[method][1:] = [params, state]
        if round_index:
          times[method].append(elapsed)
          bar.update()
  out = {}
  for method in methods:
    median = float(np.median(times[method]))
    out[method] = {"median_step_s": median, "steps_per_s": 1.0 / median,
                   "tokens_per_s": tokens_per_step / median,
                   "step_s_all": times[method]}
  return out
