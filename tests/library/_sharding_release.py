"""The 8-device subprocess's release_step runs (test_sharding.py), with their stages and cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _sharding_helpers import NUM_MICRO
from _sharding_helpers import _collectives
from _sharding_helpers import _max_diff
from _sharding_helpers import _max_relative_diff

import optax_adama

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
