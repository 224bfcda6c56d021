"""Data-parallel AdamA on a mesh: ZeRO-1/2, FSDP, collectives and memory.

The multi-device checks run in a subprocess with 8 virtual CPU devices
(``--xla_force_host_platform_device_count=8``): the device count is fixed when
JAX starts, and other test modules have started it with one device by the
time this one runs. The subprocess is this file run as a script; it prints
one JSON object that the tests read.
"""

import json
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP
from conftest import xla_flags
from jax.sharding import PartitionSpec

import optax_adama
from optax_adama import _steps

# Keeps this file on one xdist worker (make test: --dist loadgroup; under
# pytest 9 through tests/conftest.py's hook); the `eight_devices` fixture also
# shares its result through a file, should the group ever be split.
pytestmark = pytest.mark.xdist_group("eight_devices")

NUM_DEVICES = 8
NUM_LAYERS, WIDTH, BATCH, NUM_MICRO = 3, 64, 64, 4
STAGES = (None, "zero1", "zero2", "fsdp")


MODEL = MLP(num_layers=NUM_LAYERS, width=WIDTH)
_params = MODEL.params
loss_fn = MODEL.loss


def _batch(seed, size=BATCH):
  return MODEL.batch(100 + seed, size)


def _collectives(hlo_text):
  """{collective kind: [result shapes]} of a compiled HLO module."""
  found = {}
  pattern = (r"= (.+?) (all-reduce|reduce-scatter|all-gather|all-to-all|"
             r"collective-permute)(?:-start)?\(")
  for line in hlo_text.splitlines():
    match = re.search(pattern, line)
    if match:
      found.setdefault(match.group(2), []).append(match.group(1))
  return found


def _largest_operand(shapes):
  """Elements of the largest array in a list of HLO result shapes (tuples too)."""
  sizes = [0]
  for shape in shapes:
    for dims in re.findall(r"\w+\[([\d,]*)\]", shape):
      sizes.append(int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
  return max(sizes)


def _run(tx, params, steps=3, batch_size=BATCH, **step_kwargs):
  step = optax_adama.microbatch_step(
      loss_fn, tx, num_micro_batches=NUM_MICRO, **step_kwargs)
  state = tx.init(params)
  mesh = step_kwargs.get("mesh")
  if mesh is not None:
    shardings = optax_adama.sharding.step_shardings(
        params, state, mesh, shard_states=step_kwargs.get("shard_states"))
    params = jax.device_put(params, shardings.params)
    state = jax.device_put(state, shardings.opt_state)
  compiled = step.lower(params, state, _batch(0, batch_size)).compile()
  for seed in range(steps):
    params, state, metrics = step(params, state, _batch(seed, batch_size))
  return params, state, metrics, compiled


# The differences are taken in NumPy on the host: eager jnp ops on arrays
# placed over 8 devices compile once per leaf's shape and sharding (7 of the
# subprocess's 65 s on 2 cores).
def _leaf_pairs(a, b):
  as_float32 = lambda tree: [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
  return zip(as_float32(a), as_float32(b))


def _max_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in _leaf_pairs(a, b))


def _max_relative_diff(a, b):
  """max |a - b| / max |b|, the worst leaf: for moments whose scales differ."""
  return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in _leaf_pairs(a, b))


def _worker(full):
  """Runs in the 8-device subprocess; returns what the tests check (with
  ``full``, the release's 8-bit and offloaded checks at every stage)."""
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  out = {"full": full, "param_bytes": optax_adama.memory.tree_bytes(_params()),
         "batch_bytes": optax_adama.memory.tree_bytes(_batch(0))}

  # init places each moment as its param is placed, as optax's zeros_like
  # does: a plain loop's jitted update then neither gathers the moments onto
  # one device nor compiles more often than optax.adam's.
  placed = jax.device_put(_params(), jax.sharding.NamedSharding(
      mesh, PartitionSpec("data")))
  out["init_placement"] = {}
  for name, tx in (("adama", optax_adama.adama(1e-2, num_micro_batches=NUM_MICRO)),
                   ("adam", optax.adam(1e-2))):
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
      update = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p))
      states = [tx.init(placed)]
      for _ in range(3):
        states.append(update(placed, states[-1], placed)[1])
    param = placed["layer0"]["w"].sharding
    out["init_placement"][name] = {
        "as_param": [optax.tree.get(st, moment)["layer0"]["w"].sharding.is_equivalent_to(param, 2)
                     for st in states for moment in ("mu", "nu")],
        "compiles": update._cache_size(),
    }

  # The column-major micro-batch split keeps each device's rows local.
  batch = jax.device_put(_batch(0), optax_adama.sharding.batch_sharding(mesh))
  split = jax.jit(lambda b: _steps.split_micro_batches(b, NUM_MICRO))
  out["split_spec"] = str(split(batch)["x"].sharding.spec)
  out["split_collectives"] = _collectives(split.lower(batch).compile().as_text())

  # "mean": the same math on 1 and 8 devices up to the order of the sums.
  # "split" amplifies that rounding where its v cancels; it has its own
  # tolerance below (zero2_split).
  tx = optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO)
  ref = _run(tx, _params())
  for stage in STAGES:
    params, state, metrics, compiled = _run(
        tx, _params(), mesh=mesh, shard_states=stage)
    memory = compiled.memory_analysis()
    adama_state = optax_adama.find_adama_state(state)
    moments = (adama_state.mu, adama_state.nu)
    out[str(stage)] = {
        "max_diff": _max_diff((params, state), ref[:2]),
        "loss_diff": abs(float(metrics["loss"]) - float(ref[2]["loss"])),
        "collectives": _collectives(compiled.as_text()),
        "moment_bytes_per_device": sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(moments)),
        "param_bytes_per_device": sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params)),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "moment_spec": str(adama_state.mu["layer0"]["w"].sharding.spec),
        "param_spec": str(params["layer0"]["w"].sharding.spec),
    }

  # Gradient accumulation under ZeRO-2, the baseline: a sharded accumulator.
  with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
    adam = optax.adam(1e-2)
    adam_ref = _run(adam, _params())
    params, state, _, compiled = _run(adam, _params(), mesh=mesh, shard_states="zero2")
  out["zero2_accumulation"] = {
      "max_param_diff": _max_diff(params, adam_ref[0]),
      "collectives": _collectives(compiled.as_text()),
      "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
  }

  # 8-bit moments under ZeRO-2: quantization blocks are split over devices.
  quantized = optax_adama.adamaw(
      1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO,
      quantization=optax_adama.BlockQuantization(block_size=256, min_size=1024))
  ref8 = _run(quantized, _params())
  params, state, _, compiled = _run(
      quantized, _params(), mesh=mesh, shard_states="zero2")
  out["zero2_8bit"] = {
      "max_param_diff": _max_diff(params, ref8[0]),
      "collectives": _collectives(compiled.as_text()),
      "codes_spec": str(optax_adama.find_adama_state(state).mu["layer0"]["w"]
                        .codes.sharding.spec),
  }
  # "split" under ZeRO-2: each micro-batch's two halves, each half's rows
  # over the devices.
  split = optax_adama.contrib.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO,
                             nu_estimator="split")
  split_ref = _run(split, _params(), steps=2)
  params, state, metrics, _ = _run(
      split, _params(), steps=2, mesh=mesh, shard_states="zero2")
  moments = lambda state: (state.adama.mu, state.adama.nu)
  out["zero2_split"] = {
      "param_diff": _max_diff(params, split_ref[0]),
      "moment_relative_diff": _max_relative_diff(moments(state), moments(split_ref[1])),
      "loss_diff": abs(float(metrics["loss"]) - float(split_ref[2]["loss"])),
      "moved": _max_diff(params, _params()),
  }
  try:  # micro-batches of 8 rows: halves of 4, not a row for each device
    _run(split, _params(), steps=1, mesh=mesh, batch_size=32)
  except ValueError as e:
    out["zero2_split"]["too_few_rows"] = str(e)
  out["offloaded"] = _offloaded_worker(mesh, tx, ref, full)
  out["release"] = _release_worker(mesh, full)
  out["explicit"] = _explicit_worker(full)
  out["bad_input"] = _bad_input_worker(mesh)
  out["fsdp_staged"] = _fsdp_staged_worker(mesh)
  return out


def _explicit_worker(full):
  """The steps on a mesh whose axis is explicit (sharding in types), the batch's
  rows split over it, against the same steps on one device: a reshape there
  must name its output's sharding, so the micro-batch split and the halves of
  "split" take their own path. Without ``full``, the ``EXPLICIT_SMOKE_CASES``."""
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  rows = jax.sharding.NamedSharding(mesh, PartitionSpec("data"))
  replicated = jax.sharding.NamedSharding(mesh, PartitionSpec())

  def run(tx, on_mesh, batch_sharding=rows, release=False):
    if release:
      import test_release  # pylint: disable=g-import-not-at-top
      step = optax_adama.release_step(test_release.staged_loss(), tx)
      params = test_release.make_params()
      batch = lambda seed: test_release.make_batch(seed, size=BATCH)
    else:
      step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO)
      params, batch = _params(), _batch
    if not on_mesh:
      return _steps_of(step, params, tx.init(params), batch)
    with jax.set_mesh(mesh):
      params = jax.device_put(params, replicated)
      return _steps_of(step, params, tx.init(params),
                       lambda seed: jax.device_put(batch(seed), batch_sharding))

  adamaw = lambda estimator: optax_adama.contrib.adamaw(
      1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO, nu_estimator=estimator)
  def diff(case):
    if case == "split":
      # Its halves there are rows 0, 2, 4, ... and 1, 3, 5, ...: other halves than
      # on one device, the same on the mesh whether the rows are split or not.
      return _max_diff(run(adamaw("split"), True),
                       run(adamaw("split"), True, batch_sharding=replicated))
    if case == "release":
      return _max_diff(run(adamaw("mean"), True, release=True),
                       run(adamaw("mean"), False, release=True))
    make_tx = (lambda: adamaw("mean")) if case == "mean" else (lambda: optax.adam(1e-2))
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
      return _max_diff(run(make_tx(), True), run(make_tx(), False))

  with jax.set_mesh(mesh):
    batch = jax.device_put(_batch(0), rows)
    split = jax.jit(lambda b: _steps.split_micro_batches(b, NUM_MICRO))(batch)
  out = {"split_spec": str(jax.typeof(split["x"]).sharding.spec)}
  for case in EXPLICIT_CASES if full else EXPLICIT_SMOKE_CASES:
    try:  # an error fails this case's test, not the whole subprocess
      out[case] = diff(case)
    except Exception as error:  # pylint: disable=broad-exception-caught
      out[case] = f"{type(error).__name__}: {error}"[:500]
  return out


EXPLICIT_CASES = ("mean", "accumulation", "split", "release")
# Gradient accumulation (optax.adam through microbatch_step) splits the
# micro-batches as "mean" does: with the slow tests (two 8-device runs, 4 s of
# the subprocess on 2 cores alone); "mean" keeps the explicit split's smoke.
EXPLICIT_SMOKE_CASES = ("mean", "split", "release")


def _steps_of(step, params, state, batch):
  for seed in range(2):
    params, state, _ = step(params, state, batch(seed))
  return params


# microbatch_step with offloaded moments on the mesh: ZeRO-2 in the default
# run, FSDP too with the slow tests (the release's offloaded smokes run FSDP).
OFFLOADED_STAGES, SMOKE_OFFLOADED_STAGES = ("zero2", "fsdp"), ("zero2",)


def _offloaded_worker(mesh, tx, ref, full):
  """microbatch_step with host-offloaded moments on the mesh, from a fresh
  state (offload_moments' init commits its host leaves to one device: the
  step places them), against ``ref``: ``tx`` on one device, moments on it."""
  offloaded = optax_adama.offload_moments(tx, min_size=256)
  out = {}
  for stage in OFFLOADED_STAGES if full else SMOKE_OFFLOADED_STAGES:
    step = optax_adama.microbatch_step(
        loss_fn, offloaded, num_micro_batches=NUM_MICRO, mesh=mesh, shard_states=stage)
    params, state = _params(), offloaded.init(_params())
    for seed in range(3):
      params, state, _ = step(params, state, _batch(seed))
    mu = optax_adama.find_adama_state(state).mu["layer0"]["w"]
    out[stage] = {"max_diff": _max_diff(jax.device_get((params, state)), ref[:2]),
                  "memory_kind": mu.sharding.memory_kind, "spec": str(mu.sharding.spec)}
  # The same state placed in device memory: refused before donation.
  step = optax_adama.microbatch_step(
      loss_fn, offloaded, num_micro_batches=NUM_MICRO, mesh=mesh, shard_states="zero2")
  params, state = _params(), offloaded.init(_params())
  shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states="zero2")
  on_device = jax.tree.map(lambda s: s.with_memory_kind("device"), shardings.opt_state)
  params = jax.device_put(params, shardings.params)
  state = jax.device_put(state, on_device)
  try:
    step(params, state, _batch(0))
  except ValueError as e:
    out["device_placed"] = {
        "error": str(e), "intact": not any(x.is_deleted() for x in jax.tree.leaves(state))}
  return out


def _fsdp_staged_worker(mesh):
  """microbatch_step on a StagedLoss under FSDP (each layer gathered inside the
  scan) against one device, and its per-device memory against gathering all."""
  import test_release  # pylint: disable=g-import-not-at-top

  staged = test_release.staged_loss(has_aux=True)
  tx = optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO)
  batches = [test_release.make_batch(seed, size=64) for seed in range(2)]
  runs = {}
  for on_mesh in (False, True):
    step = optax_adama.microbatch_step(staged, tx, has_aux=True, mesh=mesh if on_mesh else None,
                                       shard_states="fsdp" if on_mesh else None)
    params = test_release.make_params()
    state = tx.init(params)
    if on_mesh:
      shardings = optax_adama.sharding.stack_shardings(
          staged, params, state, mesh, shard_states="fsdp")
      params = jax.device_put(params, shardings.params)
      state = jax.device_put(state, shardings.opt_state)
    for batch in batches:
      params, state, metrics = step(params, state, batch)
    runs[on_mesh] = (params, state, metrics)
  out = {
      "param_diff": _max_diff(runs[True][0], runs[False][0]),
      "moment_relative_diff": _max_relative_diff(
          (runs[True][1].adama.mu, runs[True][1].adama.nu),
          (runs[False][1].adama.mu, runs[False][1].adama.nu)),
      "loss_diff": abs(float(runs[True][2]["loss"]) - float(runs[False][2]["loss"])),
      "param_spec": str(runs[True][0]["body"]["stack"]["w"].sharding.spec),
  }
  # Per-device compiled memory, 8 layers of 256 x 256 (P = the params).
  width = 256
  params = jax.eval_shape(lambda: test_release.make_params(width=width))
  state = jax.eval_shape(tx.init, params)
  batch = jax.eval_shape(lambda: test_release.make_batch(0, size=64, width=width))
  place = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  for name, loss_fn, shardings in (
      ("plain", lambda p, b: staged(p, b),  # a plain callable: GSPMD gathers its leaves
       optax_adama.sharding.step_shardings(params, state, mesh, shard_states="fsdp")),
      ("per_layer", staged,
       optax_adama.sharding.stack_shardings(staged, params, state, mesh, shard_states="fsdp"))):
    step = optax_adama.microbatch_step(loss_fn, tx, has_aux=True, mesh=mesh, shard_states="fsdp")
    compiled = step.lower(place(params, shardings.params), place(state, shardings.opt_state),
                          batch).compile()
    out[f"{name}_bytes"] = optax_adama.memory_report(compiled, param_bytes=1).total_bytes
  out["param_bytes"] = optax_adama.memory.tree_bytes(params)
  return out


def _bad_input_worker(mesh):
  """The error each bad input gets, and whether any buffer was donated first."""
  import test_release  # pylint: disable=g-import-not-at-top

  staged = test_release.staged_loss()
  tx = optax_adama.adamaw(1e-2, num_micro_batches=NUM_MICRO)
  out = {}

  def refused(name, make_step, params, state, batch):
    try:
      make_step()(params, state, batch)
      out[name] = {"error": None}
    except ValueError as e:
      out[name] = {"error": str(e)}
    out[name]["donated"] = any(x.is_deleted() for x in jax.tree.leaves((params, state)))

  def attempt(name, make_step, params, batch):
    refused(name, make_step, params, tx.init(params), batch)

  rows_12 = test_release.make_batch(0, size=12)  # N = 4 x 8 devices needs 32 rows
  for name, make_step in {
      "rows/microbatch_step": lambda: optax_adama.microbatch_step(
          staged, tx, mesh=mesh, shard_states="zero2"),
      "rows/release_step": lambda: optax_adama.release_step(
          staged, tx, mesh=mesh, shard_states="zero2")}.items():
    attempt(name, make_step, test_release.make_params(), rows_12)
  uneven = test_release.make_params()
  uneven["body"]["stack"]["b"] = uneven["body"]["stack"]["b"][:-1]  # one layer short
  attempt("layers/release_step", lambda: optax_adama.release_step(
      staged, tx, mesh=mesh, shard_states="zero2"), uneven, test_release.make_batch(0, 64))
  # The state placed for microbatch_step (step_shardings: a stacked leaf split
  # along the layer axis) handed to release_step, which splits it after it.
  params = test_release.make_params()
  state = tx.init(params)
  shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states="zero2")
  params = jax.device_put(params, shardings.params)
  state = jax.device_put(state, shardings.opt_state)
  refused("placement/release_step",
          lambda: optax_adama.release_step(staged, tx, mesh=mesh, shard_states="zero2"),
          params, state, test_release.make_batch(0, 64))
  # 8-bit moments whose blocks do not split whole over the devices: a layer
  # of [3, 1024], split along its 1024, is 16 blocks of 192, each across 3 rows.
  eight_bit = optax_adama.adamaw(1e-2, num_micro_batches=NUM_MICRO, quantization=EIGHT_BIT)
  scaled = optax_adama.StagedLoss(
      embed=lambda outer, b: b["x"], block=lambda layer, x, b: x * jnp.mean(layer["w"]),
      head=lambda outer, x, b: jnp.mean(x ** 2), layers="stack")
  params = {"stack": {"w": jnp.ones((test_release.NUM_LAYERS, 3, 1024))}}
  state = eight_bit.init(params)
  refused("blocks/release_step",
          lambda: optax_adama.release_step(scaled, eight_bit, mesh=mesh, shard_states="fsdp"),
          params, state, {"x": jnp.ones((64, 4))})
  # Offloaded moments placed in device memory (shardings taken from the
  # state of the transformation without offload_moments).
  offloaded = optax_adama.offload_moments(tx, min_size=OFFLOAD_MIN_SIZE)
  params = test_release.make_params()
  shardings = optax_adama.sharding.release_shardings(
      staged, params, tx.init(params), mesh, shard_states="zero2")
  state = jax.device_put(offloaded.init(params), shardings.opt_state)
  params = jax.device_put(params, shardings.params)
  refused("memory/release_step",
          lambda: optax_adama.release_step(staged, offloaded, mesh=mesh, shard_states="zero2"),
          params, state, test_release.make_batch(0, 64))
  for name, make in {"axis/microbatch_step": optax_adama.microbatch_step,
                     "axis/release_step": optax_adama.release_step}.items():
    try:
      make(staged, tx, mesh=mesh, shard_states="zero2", data_axis="batch")
      out[name] = None
    except ValueError as e:
      out[name] = str(e)
  return out


RELEASE_STAGES = (None, "zero1", "zero2", "fsdp")
# The estimator's term is elementwise, the same code under every stage: one
# stage checks it.
# The release's 8-bit and offloaded checks at every stage cost about 40 s of
# the subprocess on 2 cores: the default run (-m "not slow") checks one
# stage of each, a run with the slow tests every stage.
SMOKE_STAGES = {"8bit": "fsdp", "offload_float32": "zero2", "offload_8bit": "fsdp"}


def _release_stages(kind, full):
  return RELEASE_STAGES if full else (SMOKE_STAGES[kind],)


def _stage_params(kind, *values):
  """``RELEASE_STAGES`` as test parameters (each followed by ``values``): the
  smoke stage of ``kind`` in the default run, the others slow."""
  return [pytest.param(stage, *values, marks=() if stage == SMOKE_STAGES[kind]
                       else pytest.mark.slow) for stage in RELEASE_STAGES]


RELEASE_CASES = {"mean": RELEASE_STAGES, "momentum": ("zero2",), "split": ("zero2",)}
# The default run checks "mean" (the default) at the stages that split the
# gradient (the others share their fold, less a reduction) and "split" (its
# halves' rows over the devices) at one; a run with the slow tests every case.
SMOKE_RELEASE_CASES = {"mean": ("zero2", "fsdp"), "split": ("zero2",)}
# The release's and the fused step's memory: the stages that split the
# state in the default run, every stage with the slow tests.
SMOKE_MEMORY_STAGES = ("zero2", "fsdp")
# "auto"'s factored floor (opt-in) on the mesh: with the slow tests.
FLOOR_STAGES = ("zero1", "zero2")


def _release_worker(mesh, full):
  """release_step on the mesh against itself on one device, and its memory."""
  import warnings  # pylint: disable=g-import-not-at-top

  import test_release  # the scanned MLP with a tied outer leaf

  staged = test_release.staged_loss(has_aux=True)
  # Micro-batches of 16 rows: for "split", two halves of 8, one row per device.
  batches = [test_release.make_batch(seed, size=64) for seed in range(3)]
  batches[1]["x"] = batches[1]["x"].at[13].set(jnp.nan)  # one micro-batch dropped
  out = {}

  def release_runs(tx, stages, params_fn, batches, reference=True):
    """(the run on one device, or None without ``reference``; {stage: run})."""
    runs = {}
    for stage in ("single",) * reference + stages:
      on_mesh = stage != "single"
      step = optax_adama.release_step(
          staged, tx, has_aux=True, mesh=mesh if on_mesh else None,
          shard_states=stage if on_mesh else None)
      params = params_fn()
      state = tx.init(params)
      if on_mesh:
        shardings = optax_adama.sharding.release_shardings(
            staged, params, state, mesh, shard_states=stage)
        params = jax.device_put(params, shardings.params)
        state = jax.device_put(state, shardings.opt_state)
      with warnings.catch_warnings():
        warnings.simplefilter("error")  # donated buffers must be usable
        for batch in batches:
          params, state, metrics = step(params, state, batch)
      runs[stage] = (params, state, metrics)
    return runs.pop("single", None), runs

  # "auto"'s floor where it is factored (a stack of 128 x 128 kernels,
  # split over the devices along a side): each device's part of a row or
  # column sum is put together inside shard_map. Two steps, as "split".
  tx = optax_adama.contrib.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO,
                          nu_estimator="auto")
  single, runs = release_runs(
      tx, FLOOR_STAGES, lambda: test_release.make_params(width=128),
      [test_release.make_batch(seed, size=64, width=128) for seed in range(2)]
  ) if full else (None, {})
  for stage, run in runs.items():
    out[f"floor/{stage}"] = {
        "floor_relative_diff": _max_relative_diff(run[1].adama.nu_floor,
                                                  single[1].adama.nu_floor),
        "param_diff": _max_diff(run[0], single[0]),
        "stack_floor_shapes": [list(x.shape) for x in run[1].adama.nu_floor["body"]["stack"]["w"]],
        "floor_spec": str(run[1].adama.nu_floor["body"]["stack"]["w"].rows.sharding.spec),
    }

  on_device = {}  # estimator -> (tx, one device's run, the mesh's runs)
  for estimator, stages in (RELEASE_CASES if full else SMOKE_RELEASE_CASES).items():
    tx = optax_adama.contrib.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO,
                            nu_estimator=estimator)
    # "split": two steps (see _assert_split_close), the dropped one first.
    single, runs = release_runs(
        tx, stages, test_release.make_params,
        batches[1::-1] if estimator == "split" else batches)
    on_device[estimator] = (tx, single, runs)
    for stage, run in runs.items():
      out[f"{estimator}/{stage}"] = {
          "max_diff": _max_diff(run[:2], single[:2]),
          "param_diff": _max_diff(run[0], single[0]),
          "moment_relative_diff": _max_relative_diff(
              (run[1].adama.mu, run[1].adama.nu), (single[1].adama.mu, single[1].adama.nu)),
          "metrics_diff": _max_diff(run[2], single[2]),
          "num_dropped": int(run[1].adama.num_dropped),
          "stack_moment_spec": str(run[1].adama.mu["body"]["stack"]["w"].sharding.spec),
          "param_spec": str(run[0]["body"]["stack"]["w"].sharding.spec),
      }
  eight_bit = _eight_bit_release_runs(release_runs, batches, out, full)
  _offloaded_release_runs(mesh, release_runs, batches, on_device["mean"], eight_bit, out,
                          full)
  out["offload_collectives/zero2"] = _offloaded_collectives(mesh, on_device["mean"][0])
  out["memory"] = _release_memory(mesh, RELEASE_STAGES if full else SMOKE_MEMORY_STAGES)
  return out


# Layer-aligned 8-bit moments of the test MLP: the stack's kernels [8, 64, 64]
# as 16 blocks of 256 per layer (2 whole blocks per device), its biases
# [8, 64] one block of 64 per layer (8 elements of it per device, the block's
# scale put together across the devices), w_in [64, 64] one block per row.
EIGHT_BIT = optax_adama.BlockQuantization(block_size=256, min_size=256, layer_aligned=True)


def _eight_bit_release_runs(release_runs, batches, out, full):
  """8-bit moments under every stage against one device, rounded to nearest
  and stochastically (each device its own noise: another draw).

  Returns ``(tx, one device's run, the mesh's runs)`` rounded to nearest.
  """
  import test_release  # pylint: disable=g-import-not-at-top

  def tx(stochastic_rounding):
    return optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO,
                              quantization=EIGHT_BIT, stochastic_rounding=stochastic_rounding)

  # One step (the one with a dropped micro-batch): past it, a code that an
  # ulp of the cross-device sum rounds the other way moves its element's
  # update by a fraction of the rate, and the gradients after it differ.
  nearest, runs = release_runs(tx(False), _release_stages("8bit", full),
                               test_release.make_params, batches[1:2])
  one_step = (tx(False), nearest, runs)
  for stage, run in runs.items():
    mu = run[1].adama.mu
    out[f"8bit/{stage}"] = {
        "param_diff": _max_diff(run[0], nearest[0]),
        "fraction_codes_differ": _fraction_codes_differ(run[1].adama, nearest[1].adama),
        "num_dropped": int(run[1].adama.num_dropped),
        "codes_spec": str(mu["body"]["stack"]["w"].codes.sharding.spec),
        "codes_shape": list(mu["body"]["stack"]["w"].codes.shape),
        "bias_codes_spec": str(mu["body"]["stack"]["b"].codes.sharding.spec),
        "param_spec": str(run[0]["body"]["stack"]["w"].sharding.spec),
    }
  if not full:
    return one_step
  nearest, _ = release_runs(tx(False), (), test_release.make_params, batches)
  stochastic, runs = release_runs(tx(True), ("fsdp",), test_release.make_params, batches)
  out["8bit_stochastic/fsdp"] = {
      "rms_to_one_device": _rms_diff(runs["fsdp"][0], stochastic[0]),
      "rms_rounding": _rms_diff(stochastic[0], nearest[0]),
      "rms_movement": _rms_diff(stochastic[0], test_release.make_params()),
  }
  return one_step


# Offloaded state leaves (at least this many elements): the stack's kernels
# and biases and w_in (m and v, or their 8-bit codes) go to host memory,
# b_out's moments, the 8-bit scales and the counters stay on the device.
OFFLOAD_MIN_SIZE = 256


def _offloaded_release_runs(mesh, release_runs, batches, dense, eight_bit, out, full):
  """Offloaded moments under every stage against one device's on-device
  moments and the mesh's: float32 (the three steps of "mean/...") and 8-bit
  rounded to nearest (the one step of "8bit/...")."""
  import test_release  # pylint: disable=g-import-not-at-top

  for name, (tx, single, on_mesh), steps in (("float32", dense, batches),
                                             ("8bit", eight_bit, batches[1:2])):
    _, runs = release_runs(optax_adama.offload_moments(tx, min_size=OFFLOAD_MIN_SIZE),
                           _release_stages(f"offload_{name}", full),
                           test_release.make_params, steps, reference=False)
    if name == "float32":
      # A state fresh from init (host leaves committed to one device) and
      # params not yet on the mesh: the step places them.
      offloaded = optax_adama.offload_moments(tx, min_size=OFFLOAD_MIN_SIZE)
      step = optax_adama.release_step(test_release.staged_loss(has_aux=True), offloaded,
                                      has_aux=True, mesh=mesh, shard_states="zero2")
      params = test_release.make_params()
      _, state, _ = step(params, offloaded.init(params), steps[0])
      out["offload_fresh/zero2"] = {
          "state_memory": _memory_kinds(state),
          "stack_moment_spec": str(state.adama.mu["body"]["stack"]["w"].sharding.spec)}
    for stage, run in runs.items():
      memory = _memory_kinds(run[1])
      # Host arrays are read back first: jnp ops refuse mixing memory kinds.
      run = jax.device_get(run)
      out[f"offload_{name}/{stage}"] = {
          "param_diff": _max_diff(run[0], single[0]),
          "max_diff": _max_diff(run[:2], single[:2]) if name == "float32" else None,
          "fraction_codes_differ": _fraction_codes_differ(run[1].adama, single[1].adama)
                                   if name == "8bit" else None,
          # (One 8-bit step has only the dropped micro-batch: its loss is NaN.)
          "metrics_diff": _max_diff(run[2], single[2]) if name == "float32" else None,
          "to_on_device_mesh": _max_diff(run[:2], on_mesh[stage][:2]),
          "num_dropped": int(run[1].adama.num_dropped),
          "state_memory": memory,
          "param_memory": sorted({x.sharding.memory_kind for x in jax.tree.leaves(runs[stage][0])}),
          "stack_moment_spec": str(jax.tree.leaves(
              runs[stage][1].adama.mu["body"]["stack"]["w"])[0].sharding.spec),
      }


def _offloaded_collectives(mesh, tx, stage="zero2"):
  """Compile only: the collectives of release_step with offloaded moments."""
  import test_release  # pylint: disable=g-import-not-at-top

  tx = optax_adama.offload_moments(tx, min_size=OFFLOAD_MIN_SIZE)
  staged = test_release.staged_loss(has_aux=True)
  params = test_release.make_params()
  state = tx.init(params)
  shardings = optax_adama.sharding.release_shardings(
      staged, params, state, mesh, shard_states=stage)
  placed = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
  step = optax_adama.release_step(staged, tx, has_aux=True, mesh=mesh, shard_states=stage)
  compiled = step.lower(placed(params, shardings.params), placed(state, shardings.opt_state),
                        test_release.make_batch(0, size=64)).compile()
  return _collectives(compiled.as_text())


def _memory_kinds(tree):
  """{leaf path: [its memory kind, its (whole) size]}."""
  return {jax.tree_util.keystr(path): [leaf.sharding.memory_kind, leaf.size]
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _fraction_codes_differ(state, reference):
  """The fraction of 8-bit codes of m and v that differ between two states."""
  is_quantized = lambda x: isinstance(x, optax_adama.moments.QuantizedArray)
  codes = lambda st: [np.asarray(x.codes, np.float32) for x in jax.tree.leaves(
      (st.mu, st.nu), is_leaf=is_quantized) if is_quantized(x)]
  differ = [a != b for a, b in zip(codes(state), codes(reference))]
  return float(sum(d.sum() for d in differ) / sum(d.size for d in differ))


def _rms_diff(a, b):
  squares = [np.square(np.asarray(x, np.float64) - np.asarray(y, np.float64))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  return float(np.sqrt(sum(x.sum() for x in squares) / sum(x.size for x in squares)))


def _release_memory(mesh, stages):
  """Compile only: an 8-layer D=512 stacked MLP, 256 rows, N=4, per device."""
  import test_release  # pylint: disable=g-import-not-at-top

  width, layers = 512, test_release.NUM_LAYERS
  staged = optax_adama.StagedLoss(
      embed=lambda outer, b: b["x"], block=test_release.block,
      head=lambda outer, x, b: jnp.mean((x - b["y"]) ** 2), layers="stack")
  shape = jax.ShapeDtypeStruct
  params = {"stack": {"w": shape((layers, width, width), jnp.float32),
                      "b": shape((layers, width), jnp.float32)}}
  batch = {"x": shape((256, width), jnp.float32), "y": shape((256, width), jnp.float32)}
  # The release's floor is "mean"'s; the default's halves add one layer's
  # second gradient (test_defaults.py).
  tx = optax_adama.adama(1e-3, num_micro_batches=NUM_MICRO)
  state = jax.eval_shape(tx.init, params)
  placed = lambda tree, shardings: jax.tree.map(
      lambda x, s: shape(x.shape, x.dtype, sharding=s), tree, shardings)
  out = {"param_bytes": optax_adama.memory.tree_bytes(params)}
  for name, make_step, make_shardings in (
      ("release", lambda stage: optax_adama.release_step(
          staged, tx, mesh=mesh, shard_states=stage),
       lambda stage: optax_adama.sharding.release_shardings(
           staged, params, state, mesh, shard_states=stage)),
      ("fused", lambda stage: optax_adama.microbatch_step(
          staged, tx, mesh=mesh, shard_states=stage),
       # A StagedLoss under FSDP is gathered layer by layer: placed as the release.
       lambda stage: optax_adama.sharding.stack_shardings(
           staged, params, state, mesh, shard_states=stage) if stage == "fsdp" else
       optax_adama.sharding.step_shardings(params, state, mesh, shard_states=stage))):
    for stage in stages:
      shardings = make_shardings(stage)
      compiled = make_step(stage).lower(
          placed(params, shardings.params), placed(state, shardings.opt_state),
          batch).compile()
      memory = compiled.memory_analysis()
      out[f"{name}/{stage}"] = {
          "total_bytes": int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                             + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
          "collectives": _collectives(compiled.as_text()),
          "collective_bytes": optax_adama.memory.collective_bytes(compiled).by_kind,
      }
  return out


def _run_on_eight_devices(full):
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags(NUM_DEVICES)
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  # The repository and tests/ (this script imports conftest, one folder up).
  env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests"),
                                       env.get("PYTHONPATH", "")])
  result = subprocess.run(
      [sys.executable, os.path.abspath(__file__)] + ["full"] * full, env=env, cwd=root,
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def eight_devices(request, tmp_path_factory, worker_id):
  """The subprocess's results, computed once per test run.

  Under pytest-xdist each worker has its own session. `--dist loadgroup`
  keeps this file on one worker (tests/conftest.py), and should another
  worker get here, the first runs the subprocess (about 50 s) and the others
  wait on a file lock and read its result from the run's shared temporary
  directory.
  """
  # Slow tests selected (no -m "not slow"): the full run, a superset.
  full = "not slow" not in (request.config.option.markexpr or "")
  if worker_id == "master":  # not under xdist
    return _run_on_eight_devices(full)
  import fcntl  # POSIX; the suite runs on Linux and macOS
  shared = tmp_path_factory.getbasetemp().parent / "eight_devices.json"
  with open(shared.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not shared.exists():
      shared.write_text(json.dumps(_run_on_eight_devices(full)))
  return json.loads(shared.read_text())


@pytest.mark.parametrize("stage", STAGES)
def test_sharded_step_equals_single_device(eight_devices, stage):
  run = eight_devices[str(stage)]
  # Same math; only the order of the cross-device sums differs (float32).
  assert run["max_diff"] < 1e-6, run
  assert run["loss_diff"] < 1e-6, run


def test_init_places_the_moments_as_the_params(eight_devices):
  run = eight_devices["init_placement"]
  # m and v split as the params are, after init and after each update.
  assert all(run["adama"]["as_param"]) and len(run["adama"]["as_param"]) == 8, run
  assert run["adama"]["compiles"] <= run["adam"]["compiles"], run


def test_batch_split_keeps_rows_on_their_device(eight_devices):
  assert eight_devices["split_spec"] == str(PartitionSpec(None, "data"))
  assert eight_devices["split_collectives"] == {}


def test_collectives_match_the_zero_stage(eight_devices):
  full_leaf = WIDTH * WIDTH
  plain, zero1, zero2, fsdp = (eight_devices[str(s)]["collectives"] for s in STAGES)
  # Plain data parallel and ZeRO-1: the whole gradient is all-reduced.
  assert _largest_operand(plain["all-reduce"]) == full_leaf
  assert "reduce-scatter" not in plain
  assert _largest_operand(zero1["all-reduce"]) == full_leaf
  # ZeRO-2: every gradient leaf is reduce-scattered (shard_map's psum_scatter);
  # what is still all-reduced is scalars (the loss, the per-leaf finite flags).
  assert _largest_operand(zero2["reduce-scatter"]) == full_leaf // NUM_DEVICES
  assert _largest_operand(zero2["all-reduce"]) == 1, zero2["all-reduce"]
  # FSDP on a plain loss is GSPMD's (the model's own layer scan gathers a layer
  # at a time): the CPU compiler reduces a gradient leaf as an all-reduce and
  # a slice, GPU and TPU pipelines rewrite that pair as a reduce-scatter.
  # Either way nothing larger than one leaf's gradient is reduced at once.
  reduced = fsdp.get("reduce-scatter", []) + fsdp.get("all-reduce", [])
  assert full_leaf // NUM_DEVICES <= _largest_operand(reduced) <= full_leaf, fsdp
  # ZeRO-1/2 gather the updated params (once per mini-batch, under a cond);
  # FSDP gathers params for the forward pass.
  for stage in (zero1, zero2, fsdp):
    assert _largest_operand(stage["all-gather"]) == full_leaf


def test_moments_are_split_over_the_devices(eight_devices):
  P = eight_devices["param_bytes"]
  batch_per_device = eight_devices["batch_bytes"] // NUM_DEVICES
  plain = eight_devices["None"]
  assert plain["moment_bytes_per_device"] == 2 * P
  for stage in ("zero1", "zero2", "fsdp"):
    run = eight_devices[stage]
    # m and v: 2P / 8 on each device (every leaf here divides by 8).
    assert run["moment_bytes_per_device"] == 2 * P // NUM_DEVICES, run
    assert run["moment_spec"] == str(PartitionSpec("data"))
  # XLA's per-device accounting of the compiled step: params + m + v + batch
  # slice (+ 16 bytes of counters).
  for stage, params_share in (("zero2", P), ("fsdp", P // NUM_DEVICES)):
    run = eight_devices[stage]
    expected = params_share + 2 * P // NUM_DEVICES + batch_per_device
    assert expected <= run["argument_bytes"] <= expected + 64, (stage, run)
  assert eight_devices["fsdp"]["param_bytes_per_device"] == P // NUM_DEVICES
  # ZeRO-2's temp is far below ZeRO-1's: no full gradient is all-reduced.
  assert eight_devices["zero2"]["temp_bytes"] < 0.5 * eight_devices["zero1"]["temp_bytes"]


def test_eight_bit_moments_under_zero2(eight_devices):
  run = eight_devices["zero2_8bit"]
  assert run["codes_spec"] == str(PartitionSpec("data"))
  # No gradient is all-reduced: scalars, and the default estimator's floor
  # (one sum per row or column of a leaf: WIDTH values, a leaf is WIDTH**2).
  assert _largest_operand(run["collectives"]["all-reduce"]) <= WIDTH
  # Same rounding noise on any sharding; cross-device sums may flip a rare
  # rounding decision of a code, moving that element's update by a fraction
  # of the learning rate (1e-2) at most.
  assert run["max_param_diff"] < 1e-2, run


# Single-device checks, in this process.


def test_step_shardings_per_stage():
  mesh = jax.make_mesh((1,), ("data",))
  params = {"w": jnp.zeros((4, 3)), "scalar": jnp.zeros(())}
  tx = optax_adama.adama(1e-3, num_micro_batches=2)
  state = tx.init(params)
  specs = lambda tree: [s.spec for s in jax.tree.leaves(tree)]
  for stage in (None, "zero1", "zero2", "fsdp"):
    shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states=stage)
    chex.assert_trees_all_equal_structs(shardings.opt_state, state)
    moment_specs = specs(optax_adama.find_adama_state(shardings.opt_state).mu)
    # Leaves in tree order: "scalar", then "w".
    assert moment_specs == ([PartitionSpec()] * 2 if stage is None
                            else [PartitionSpec(), PartitionSpec("data")])
    assert specs(shardings.params)[1] == (
        PartitionSpec("data") if stage == "fsdp" else PartitionSpec())
  # A dimension the axis size does not divide is not split.
  shard_leaf_spec = optax_adama._sharding.shard_leaf_spec
  assert shard_leaf_spec((3, 16), 8) == PartitionSpec(None, "data")
  assert shard_leaf_spec((3, 5), 8) == PartitionSpec()



@pytest.mark.parametrize("stage", ["zero1", "zero2", "fsdp"])
def test_eight_bit_moments_are_split_where_their_gradients_are(stage):
  # Each device quantizes the blocks of its own gradient slice. Codes split
  # any other way made GSPMD reshard them in every micro-batch ("Involuntary
  # full rematerialization" of a 4,096-element leaf with 2 blocks on 8 devices).
  mesh = jax.sharding.AbstractMesh((8,), ("data",))  # specs only: no devices needed
  params = {
      "kernel": jnp.zeros((512, 256)),  # rows split: 8 whole blocks per device
      "few_blocks": jnp.zeros((4096,)),  # 2 blocks of 2,048: fewer than devices
      "straddling": jnp.zeros((3, 8 * 2048)),  # split along columns: 24 blocks, none whole
      "odd": jnp.zeros((3, 5 * 2048 + 2)),  # no dimension divides by 8: the param is whole
  }
  # The flat layout (blocks over the whole leaf), whose splits are checked here.
  tx = optax_adama.adamaw(1e-3, num_micro_batches=2,
                          quantization=optax_adama.BlockQuantization(layer_aligned=False))
  state = jax.eval_shape(tx.init, params)
  shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states=stage)
  adama = optax_adama.find_adama_state(shardings.opt_state)
  split_dim = optax_adama._sharding.split_dim
  for moment in (adama.mu, adama.nu):
    # The blocks' axis (a spec may or may not spell out trailing Nones).
    assert split_dim(moment["kernel"].codes.spec) == 0
    assert split_dim(moment["kernel"].scale.spec) == 0
    # A few blocks: kept whole on every device (8 KiB of codes at most).
    assert moment["few_blocks"].codes.spec == PartitionSpec()
    # No split gives each device whole blocks of its slice: the leaf keeps
    # the split of its own codes, 3 blocks per device.
    assert split_dim(moment["straddling"].codes.spec) == 0
    # A gradient whole on every device: its moment keeps its own split (16
    # blocks, 2 per device), each device slicing what it folds.
    assert split_dim(moment["odd"].codes.spec) == 0
  assert shardings.grads["straddling"].spec == (
      PartitionSpec() if stage == "zero1" else PartitionSpec(None, "data"))
  assert shardings.grads["odd"].spec == PartitionSpec()
  # Layer-aligned blocks (each row its own) split with the row's columns.
  aligned = optax_adama.adamaw(1e-3, num_micro_batches=2, quantization=(
      optax_adama.BlockQuantization(layer_aligned=True)))
  embedding = {"embedding": jnp.zeros((1001, 64))}  # rows not divisible by 8
  shardings = optax_adama.sharding.step_shardings(
      embedding, jax.eval_shape(aligned.init, embedding), mesh, shard_states=stage)
  codes = optax_adama.find_adama_state(shardings.opt_state).mu["embedding"].codes
  assert codes.spec == PartitionSpec(None, None, "data")  # codes [1001, 1, 64]

@pytest.mark.parametrize("stage", ["zero2", "fsdp"])
def test_one_device_mesh_equals_plain_step(stage):
  mesh = jax.make_mesh((1,), ("data",))
  # "mean": equal to 1e-6; "split"'s cancellation amplifies the rounding of
  # the sums (its mesh equality: zero2_split's tolerance).
  tx = optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO)
  ref = _run(tx, _params(), steps=2)
  got = _run(tx, _params(), steps=2, mesh=mesh, shard_states=stage)
  chex.assert_trees_all_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(got[1], ref[1], rtol=1e-6, atol=1e-7)


def test_bad_sharding_options_are_rejected():
  tx = optax_adama.adama(1e-3, num_micro_batches=2)
  with pytest.raises(ValueError, match="needs a mesh"):
    optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=2, shard_states="zero2")
  mesh = jax.make_mesh((1,), ("data",))
  with pytest.raises(ValueError, match="shard_states"):
    optax_adama.microbatch_step(
        loss_fn, tx, num_micro_batches=2, mesh=mesh, shard_states="zero4")
  with pytest.raises(ValueError, match="not in the mesh"):
    optax_adama.sharding.step_shardings(_params(), None, mesh, data_axis="batch")
  split = optax_adama.contrib.adama(1e-3, num_micro_batches=NUM_MICRO, nu_estimator="split")
  step = optax_adama.microbatch_step(loss_fn, split, mesh=mesh)
  with pytest.raises(ValueError, match="micro-batch size must be even, got 3"):
    step(_params(), split.init(_params()), MODEL.batch(0, 3 * NUM_MICRO))


def _assert_split_close(run):
  """"split" on a mesh against one device after two steps: its moments to
  float32 rounding, its params within 2% of a step (lr 1e-2).

  Its v is g**2 - (1 - 1/N) d**2, which nearly cancels where noise dominates;
  there the rounding of another summation order (1e-12 in a v of 1e-7) moves
  the direction m_hat / sqrt(v_hat) by about 1% of a step on a handful of
  entries (measured after two steps: params 1.1e-4 apart on the MLP here,
  6.5e-5 on 35 of 32,768 entries of the release's stack; moments 4e-7 of
  their largest entry). From the third step those params' gradients differ
  too and the moments drift apart (6e-5 relative), so two steps are compared.
  """
  assert run["moment_relative_diff"] < 1e-5, run
  assert run["param_diff"] < 2e-4, run


def test_split_estimator_on_a_mesh_equals_one_device(eight_devices):
  run = eight_devices["zero2_split"]
  _assert_split_close(run)
  assert run["loss_diff"] < 1e-6, run
  assert run["moved"] > 1e-3, run
  assert "must be a multiple of 2 x 8 devices, got 8" in run["too_few_rows"], run


@pytest.mark.parametrize("estimator,stage", [
    pytest.param(estimator, stage, marks=() if stage in SMOKE_RELEASE_CASES.get(estimator, ())
                 else pytest.mark.slow)
    for estimator, stages in RELEASE_CASES.items() for stage in stages])
def test_release_step_on_a_mesh_equals_one_device(eight_devices, stage, estimator):
  run = eight_devices["release"][f"{estimator}/{stage}"]
  # Same math, cross-device sums in another order (float32); a NaN row in
  # one device's share drops the whole micro-batch on every device.
  if estimator == "split":
    _assert_split_close(run)
  else:
    assert run["max_diff"] < 1e-6, run
  assert run["metrics_diff"] < 1e-6, run
  assert run["num_dropped"] == 1, run
  # Every device holds a slice of every layer's moments; params replicated.
  expected = PartitionSpec() if stage is None else PartitionSpec(None, "data")
  assert run["stack_moment_spec"] == str(expected), run
  # Params replicated, but under FSDP: a slice of every layer on each device.
  assert run["param_spec"] == str(expected if stage == "fsdp" else PartitionSpec()), run


@pytest.mark.parametrize("stage", _stage_params("8bit"))
def test_release_step_with_eight_bit_moments_on_a_mesh_equals_one_device(eight_devices, stage):
  run = eight_devices["release"][f"8bit/{stage}"]
  # Rounded to nearest, each device folds the whole blocks of its slice as
  # one device folds them: the same codes (measured: all of them; the
  # cross-device sum rounds in another order, and a value an ulp from a code
  # boundary may round the other way) and the same step up to float32
  # rounding of the update (one step, the one with a dropped micro-batch).
  assert run["fraction_codes_differ"] < 1e-3, run
  assert run["param_diff"] < 1e-6, run
  assert run["num_dropped"] == 1, run
  assert run["codes_shape"] == [8, 16, 256], run  # [layers, blocks, block_len]
  # A slice of every layer's blocks on each device; of the biases (one
  # block per layer) a part of every block.
  split = str(PartitionSpec() if stage is None else PartitionSpec(None, "data"))
  assert run["codes_spec"] == split, run
  assert run["bias_codes_spec"] == str(
      PartitionSpec() if stage is None else PartitionSpec(None, None, "data")), run
  assert run["param_spec"] == (split if stage == "fsdp" else str(PartitionSpec())), run


@pytest.mark.parametrize("stage, moments", _stage_params("offload_float32", "float32")
                         + _stage_params("offload_8bit", "8bit"))
def test_release_step_with_offloaded_moments_on_a_mesh_equals_one_device(
    eight_devices, stage, moments):
  run = eight_devices["release"][f"offload_{moments}/{stage}"]
  # Against one device with the moments on it: the tolerances of the
  # on-device checks above (float32: three steps; 8-bit: one step), for the
  # same reason (cross-device sums in another order).
  if moments == "float32":
    assert run["max_diff"] < 1e-6, run
    assert run["metrics_diff"] < 1e-6, run
  else:
    assert run["fraction_codes_differ"] < 1e-3, run
    assert run["param_diff"] < 1e-6, run
  assert run["num_dropped"] == 1, run
  # Against the mesh with the moments on the devices: the same fold of the
  # same slices, brought in and sent back (copies), so the same bits but
  # for the update, whose direction each device computes a layer at a time
  # from its slices (on the device, GSPMD computes it whole): the same
  # elementwise arithmetic, fused otherwise. Measured:
  # equal bit for bit but ZeRO-1/2 float32, 3e-8 (under an ulp of the params).
  assert run["to_on_device_mesh"] < 1e-7, run
  # Each device keeps its slice of every layer's moments, in host memory.
  expected = PartitionSpec() if stage is None else PartitionSpec(None, "data")
  assert run["stack_moment_spec"] == str(expected), run
  kinds = run["state_memory"]
  host = {path for path, (_, size) in kinds.items() if size >= OFFLOAD_MIN_SIZE}
  assert host and len(host) < len(kinds), kinds  # some of each
  assert all(kinds[path][0] == "pinned_host" for path in host), kinds
  assert all(kind == "device" for path, (kind, _) in kinds.items() if path not in host), kinds
  assert run["param_memory"] == ["device"], run


# FSDP with the slow tests; its smoke: the zero2 case here, and
# test_release_step_with_offloaded_moments_on_a_mesh_equals_one_device[fsdp-8bit] (FSDP).
@pytest.mark.parametrize("stage", [
    stage if stage in SMOKE_OFFLOADED_STAGES else pytest.param(stage, marks=pytest.mark.slow)
    for stage in OFFLOADED_STAGES])
def test_microbatch_step_with_offloaded_moments_on_a_mesh_equals_one_device(
    eight_devices, stage):
  # A fresh offload_moments state, placed by the step, trains as tx on one
  # device with its moments on the device: the same math, only the order of
  # the cross-device sums differs (float32), as in the on-device mesh steps.
  result = eight_devices["offloaded"][stage]
  assert result["max_diff"] < 1e-6, result
  assert result["memory_kind"] == "pinned_host", result
  assert "data" in result["spec"], result


def test_microbatch_step_refuses_offloaded_moments_placed_in_device_memory(eight_devices):
  result = eight_devices["offloaded"]["device_placed"]
  assert "pinned_host" in result["error"] and "offload_moments" in result["error"], result
  assert result["intact"], result


def test_release_step_places_a_fresh_offloaded_state_on_the_mesh(eight_devices):
  run = eight_devices["release"]["offload_fresh/zero2"]
  assert run["stack_moment_spec"] == str(PartitionSpec(None, "data")), run
  kinds = run["state_memory"]
  assert kinds[".adama.mu['body']['stack']['w']"][0] == "pinned_host", kinds
  assert kinds[".adama.mu['b_out']"][0] == "device", kinds


def test_release_step_with_offloaded_moments_moves_one_layer_at_a_time(eight_devices):
  collectives = eight_devices["release"]["offload_collectives/zero2"]
  # ZeRO-2: each layer's gradient reduce-scattered, each layer's updated
  # params gathered as the update reaches it (a [1, 64, 64] slice); nothing
  # the size of the stack (left to GSPMD, the update gathered all 8 layers).
  layer = 64 * 64  # one layer of the stack's kernels (test_release.make_params)
  assert set(collectives) >= {"reduce-scatter", "all-gather"}, collectives
  for operands in collectives.values():
    assert _largest_operand(operands) <= layer, collectives


@pytest.mark.slow  # each device's own rounding noise: the full run only
def test_release_step_with_stochastic_eight_bit_moments_on_a_mesh_trains_like_one_device(
    eight_devices):
  run = eight_devices["release"]["8bit_stochastic/fsdp"]
  # Each device draws its own rounding noise, so the mesh's params are another
  # draw of one device's: as far from them as rounding to nearest is (a bias,
  # a fold of the wrong blocks, or a misplaced slice would be several times
  # further), and both far below the params' movement in training.
  assert run["rms_to_one_device"] < 2 * run["rms_rounding"], run
  assert run["rms_rounding"] < 0.2 * run["rms_movement"], run


@pytest.mark.slow
@pytest.mark.parametrize("stage", FLOOR_STAGES)
def test_release_floor_on_a_mesh_equals_one_device(eight_devices, stage):
  run = eight_devices["release"][f"floor/{stage}"]
  assert run["stack_floor_shapes"] == [[_num_release_layers(), 128]] * 2, run
  assert run["floor_spec"] == str(PartitionSpec()), run  # whole on every device
  # Sums in another order: float32 rounding; params as _assert_split_close.
  assert run["floor_relative_diff"] < 1e-5, run
  assert run["param_diff"] < 2e-4, run


def _num_release_layers():
  import test_release  # pylint: disable=g-import-not-at-top
  return test_release.NUM_LAYERS


@pytest.mark.parametrize("step", ["microbatch_step", "release_step"])
def test_bad_input_on_a_mesh_is_refused_before_any_buffer_is_donated(eight_devices, step):
  bad = eight_devices["bad_input"]
  rows = bad[f"rows/{step}"]
  assert "batch has 12 rows" in rows["error"] and "multiple of N x 8 = 32" in rows["error"]
  assert not rows["donated"]
  assert "data_axis 'batch' is not in the mesh axes ('data',)" in bad[f"axis/{step}"]
  if step == "release_step":
    layers = bad["layers/release_step"]
    assert "same leading (layer) axis" in layers["error"], layers
    assert f"{_num_release_layers() - 1} for ['b']" in layers["error"], layers
    assert not layers["donated"]
    placement = bad["placement/release_step"]
    assert "opt_state.adama.mu['body']['stack']['b'] is placed as P('data',)" in (
        placement["error"]), placement
    assert "release_shardings for release_step" in placement["error"]
    assert not placement["donated"]
    blocks = bad["blocks/release_step"]
    assert "['stack']['w'] (shape (8, 3, 1024), codes (8, 16, 192))" in (
        blocks["error"]), blocks
    assert "layer_aligned=True" in blocks["error"] and "min_size" in blocks["error"], blocks
    assert not blocks["donated"]
    memory = bad["memory/release_step"]
    assert ("opt_state.adama.mu['body']['stack']['b'] is placed as P(None, 'data') in "
            "device memory but this step keeps it as P(None, 'data') in pinned_host "
            "memory") in memory["error"], memory
    assert "under offload_moments, from the state its init returns" in memory["error"], memory
    assert not memory["donated"]


def test_fsdp_on_a_staged_loss_gathers_one_layer_at_a_time(eight_devices):
  run = eight_devices["fsdp_staged"]
  assert run["param_spec"] == str(PartitionSpec(None, "data")), run  # every layer split
  # The default estimator: the same math as one device but for the order of
  # the cross-device sums (measured: params 6e-8, moments 3.5e-7 of their
  # largest entry), as the other mesh steps.
  assert run["param_diff"] < 1e-6, run
  assert run["moment_relative_diff"] < 1e-5, run
  assert run["loss_diff"] < 1e-6, run
  # Per device, 8 layers: each step holds about a layer of gathered params,
  # the stages' gathered inside their scan, the plain loss's by GSPMD inside
  # the loss's own scan (leaves split along their largest axis). Gathering
  # every leaf for the whole micro-batch held the whole model: 3.39 P at
  # width 512, against 1.08 P gathered layer by layer.
  P = run["param_bytes"]
  assert run["per_layer_bytes"] < 1.5 * P, (run, P)
  assert run["plain_bytes"] < 1.5 * P, (run, P)


def test_release_step_on_a_mesh_holds_one_layer_at_a_time(eight_devices):
  memory = eight_devices["release"]["memory"]
  P = memory["param_bytes"]
  in_p = lambda key: memory[key]["total_bytes"] / P
  layer = 512 * 512  # elements of one layer's weight
  # The stages that split the state in the default run, every one with the
  # slow tests.
  stages = [stage for stage in RELEASE_STAGES if f"release/{stage}" in memory]
  assert stages == list(RELEASE_STAGES if eight_devices["full"] else SMOKE_MEMORY_STAGES)
  # No collective moves more than one layer: gradients are reduced and
  # updated params gathered layer by layer.
  for stage in stages:
    for operands in memory[f"release/{stage}"]["collectives"].values():
      assert _largest_operand(operands) <= layer, (stage, operands)
  zero2 = memory["release/zero2"]["collectives"]
  assert _largest_operand(zero2["reduce-scatter"]) == layer // NUM_DEVICES
  # Measured per device (P = params): release 3.55 / 1.58 / 1.53 P against
  # the fused step's 5.03 / 3.28 / 2.46 P (plain, ZeRO-1, ZeRO-2). ZeRO
  # floor: params + m + v split 8 ways + one layer's gradient = 1.375 P.
  for stage, bound in ((None, 3.6), ("zero1", 1.65), ("zero2", 1.6)):
    if stage in stages:
      assert in_p(f"release/{stage}") < bound, (stage, in_p(f"release/{stage}"))
      assert in_p(f"fused/{stage}") - in_p(f"release/{stage}") > 0.85, stage
  # FSDP, both steps gathering layer by layer: release 0.60 P, fused 0.69 P.
  # Floor: params + m + v split 8 ways + one layer, gathered or as its
  # gradient (not both: the weight's gradient does not need the gathered
  # weight) = 0.375 + 0.125 = 0.5 P.
  assert in_p("release/fsdp") < 0.65, in_p("release/fsdp")
  assert in_p("release/fsdp") < in_p("fused/fsdp") < 0.75, in_p("fused/fsdp")
  assert _largest_operand(memory["release/fsdp"]["collectives"]["all-gather"]) == layer


@pytest.mark.parametrize("name", ["release", "fused"])
def test_fsdp_moves_the_ideal_collective_bytes(eight_devices, name):
  # FSDP's ideal per micro-batch: the params all-gathered twice (forward,
  # backward) and the gradient reduce-scattered once: 3 P, N times a step.
  # The trip counts of the scans weigh each collective (collective_bytes);
  # a collective of the whole stack, or one per micro-batch and layer too
  # many, would move the total by at least 1 P per micro-batch.
  memory = eight_devices["release"]["memory"]
  P, by_kind = memory["param_bytes"], memory[f"{name}/fsdp"]["collective_bytes"]
  assert by_kind["all-gather"] == pytest.approx(2 * NUM_MICRO * P, rel=0.01), by_kind
  assert by_kind["reduce-scatter"] == pytest.approx(NUM_MICRO * P, rel=0.01), by_kind
  assert sum(by_kind.values()) / (3 * NUM_MICRO * P) < 1.01, by_kind


def test_release_step_rejects_what_it_does_not_support():
  import test_release  # pylint: disable=g-import-not-at-top

  staged = test_release.staged_loss()
  tx = optax_adama.adama(1e-2, num_micro_batches=2)
  mesh = jax.make_mesh((1,), ("data",))
  with pytest.raises(ValueError, match="needs a mesh"):
    optax_adama.release_step(staged, tx, shard_states="zero2")
  with pytest.raises(ValueError, match="shard_states"):
    optax_adama.release_step(staged, tx, mesh=mesh, shard_states="zero3")
  quantized = optax_adama.adama(
      1e-2, num_micro_batches=2, quantization=optax_adama.BlockQuantization(min_size=16))
  params = {"w_in": jnp.zeros((64, 64)), "b_out": jnp.zeros(64),
            "body": {"stack": {"w": jnp.zeros((8, 4, 4)), "b": jnp.zeros((8, 4))}}}
  step = optax_adama.release_step(staged, quantized, mesh=mesh, shard_states="zero2")
  with pytest.raises(NotImplementedError, match="layer_aligned=True"):
    step(params, quantized.init(params), test_release.make_batch(0, width=64))


if __name__ == "__main__":
  print(json.dumps(_worker(full=sys.argv[1:] == ["full"])))


def test_explicit_axes_keep_each_micro_batchs_rows_split(eight_devices):
  # [N, B / N, features]: the rows of every micro-batch over the devices, as on
  # an automatic mesh. (A reshape that does not name its output sharding put
  # the devices on the features.)
  assert eight_devices["explicit"]["split_spec"] == str(PartitionSpec(None, "data", None))


# "accumulation" with the slow tests; its smoke: the "mean" case (EXPLICIT_SMOKE_CASES).
@pytest.mark.parametrize("case", [
    case if case in EXPLICIT_SMOKE_CASES else pytest.param(case, marks=pytest.mark.slow)
    for case in EXPLICIT_CASES])
def test_steps_run_on_a_mesh_with_explicit_axes(eight_devices, case):
  # On one device and on the mesh the same math, the cross-device sums in
  # another order (float32); "split" on the mesh with its rows split or not.
  result = eight_devices["explicit"][case]
  assert isinstance(result, float) and result < 1e-6, result


def test_zero2_gradient_accumulation_keeps_a_sharded_accumulator(eight_devices):
  run = eight_devices["zero2_accumulation"]
  assert run["max_param_diff"] < 1e-6, run
  # Each micro-batch gradient is reduce-scattered into the device's slice of
  # the accumulator; nothing parameter-sized is all-reduced.
  assert "reduce-scatter" in run["collectives"], run
  largest_all_reduce = _largest_operand(run["collectives"].get("all-reduce", []))
  assert largest_all_reduce < WIDTH, run
