"""FSDP on a plain loss and the out-of-memory reports' table, on 8 CPU devices.

A user's own model is a plain ``loss_fn``: under ``shard_states="fsdp"`` it must stay
split and be gathered a layer at a time inside the model's own scan, so that AdamA
saves the accumulator against FSDP accumulation written by hand
(``benchmarks/scripts/oom_reports.py``, whose smoke run on a 4-layer ``llama_test`` is here).
The moments must follow the params' split however ``init`` is called (optax.MultiSteps'
accumulator, built under ``jax.jit``, lands on one device: llama-2-jax #10). The checks
run in one subprocess with 8 virtual CPU devices (this file run as a script).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import xla_flags

# One worker runs this file's subprocess once (conftest's --dist loadgroup).
pytestmark = pytest.mark.xdist_group("oom_reports")
NUM_DEVICES = 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  import models
  import optax_adama
  sys.path.insert(0, os.path.join(ROOT, "benchmarks", "scripts"))
  import oom_steps

  out = {}
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  config = models.get_config("llama_test", num_layers=4, scan_layers=True, remat="full")
  loss_fn, staged, params = oom_steps.model_parts(config)
  P = optax_adama.memory.tree_bytes(params)
  n = 2
  batch = {"tokens": jax.ShapeDtypeStruct((NUM_DEVICES * n, 33), jnp.int32)}
  for method in ("scan_accumulation", "maxtext_accumulation", "adama", "adama_release"):
    # optax.adam's bias correction (float ** int32) needs implicit promotion.
    with jax.numpy_dtype_promotion("standard" if "accumulation" in method else "strict"):
      compiled, _ = oom_steps.compile_method(method, n, loss_fn, staged, params, batch, mesh)
    out[method] = optax_adama.memory_report(compiled, param_bytes=P).total_bytes
  out["param_bytes"] = P
  # The capacity table's bf16 columns, compiled as it compiles them.
  for method in ("adama_release_offload", "adama_release_offload_bf16"):
    wanted = jnp.bfloat16 if oom_steps.bf16_params(method) else jnp.float32
    loss_fn, staged, params = oom_steps.model_parts(models.get_config(config, param_dtype=wanted))
    compiled, _ = oom_steps.compile_method(method, n, loss_fn, staged, params, batch, mesh)
    out[method] = compiled.memory_analysis().argument_size_in_bytes
    out[f"{method}/dtypes"] = sorted({str(x.dtype) for x in jax.tree.leaves(params)})
  # What the capacity table's _projected columns stand on: this backend
  # gathers bfloat16 as float32.
  spec = jax.sharding.PartitionSpec("data")
  gather = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "data", tiled=True), mesh=mesh,
                                 in_specs=spec, out_specs=jax.sharding.PartitionSpec(),
                                 check_vma=False))
  text = gather.lower(jax.ShapeDtypeStruct(
      (64, 8), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, spec))).compile().as_text()
  out["gathered_dtype"] = re.search(r"= (\w+)\[[^\]]*\]\S* all-gather\(", text).group(1)

  # The plain-loss FSDP step against one device, two steps.
  model = models.create(config, rngs=nnx.Rngs(0))
  loss_fn, init_params = models.split_loss_fn(model)
  tx = optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=n)
  rng = np.random.default_rng(0)
  batches = [{"tokens": jnp.asarray(rng.integers(0, 256, (NUM_DEVICES * n, 33)), jnp.int32)}
             for _ in range(2)]
  runs = {}
  for on_mesh in (False, True):
    params = jax.tree.map(jnp.copy, init_params)  # the step donates its arguments
    state = tx.init(params)
    kwargs = {"mesh": mesh, "shard_states": "fsdp"} if on_mesh else {}
    if on_mesh:
      shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states="fsdp")
      params = jax.device_put(params, shardings.params)
      state = jax.device_put(state, shardings.opt_state)
    step = optax_adama.microbatch_step(loss_fn, tx, **kwargs)
    for batch in batches:
      params, state, metrics = step(params, state, batch)
    runs[on_mesh] = (params, float(metrics["loss"]))
  # In NumPy on the host: eager jnp ops on the mesh's arrays compile once per
  # leaf's shape and sharding.
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                       runs[True][0], runs[False][0])
  out["param_diff"] = max(jax.tree.leaves(diffs))
  out["param_diffs"] = {jax.tree_util.keystr(p): d
                        for p, d in jax.tree_util.tree_leaves_with_path(diffs)}
  out["loss_diff"] = abs(runs[True][1] - runs[False][1])
  q_kernel = runs[True][0]["blocks"]["attention"]["q"]["kernel"]
  out["q_kernel_spec"] = str(q_kernel.sharding.spec)

  # MaxText's way of accumulating and the hand-written loop: a step of SGD at
  # rate 1 each, so the params moved by minus the accumulated gradient.
  sgd = optax.sgd(1.0)
  moved = {}
  for name, accumulation in (("scan", oom_steps.hand_written_accumulation),
                             ("maxtext", oom_steps.maxtext_accumulation)):
    step, shardings = accumulation(loss_fn, sgd, init_params, mesh, n)
    params = jax.device_put(jax.tree.map(jnp.copy, init_params), shardings)
    params, _ = step(params, sgd.init(params), batches[0])
    moved[name] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, init_params)
  largest = lambda tree: max(float(np.max(np.abs(x))) for x in jax.tree.leaves(tree))
  out["maxtext_vs_scan"] = largest(jax.tree.map(np.subtract, moved["maxtext"], moved["scan"]))
  out["scan_gradient"] = largest(moved["scan"])

  # Where init puts the state of FSDP-split params: eagerly and under jax.jit.
  shardings = optax_adama.sharding.step_shardings(init_params, None, mesh, shard_states="fsdp")
  placed = jax.device_put(init_params, shardings.params)
  specs = lambda tree: [str(getattr(x.sharding, "spec", x.sharding)) for x in jax.tree.leaves(tree)]
  for name, tx in (("adama", optax_adama.adama(1e-3, num_micro_batches=n)),
                   ("adama_bf16", optax_adama.adama(1e-3, num_micro_batches=n,
                                                    mu_dtype=jnp.bfloat16)),
                   ("multisteps", optax.MultiSteps(optax.adam(1e-3), every_k_schedule=n))):
    for how, init in (("eager", tx.init), ("jit", jax.jit(tx.init))):
      state = init(placed)
      moments = ((state.adama.mu, state.adama.nu) if name.startswith("adama")
                 else (state.acc_grads,))
      out[f"{name}/{how}"] = {"moments": [specs(m) for m in moments],
                              "params": specs(placed)}
  return out


@pytest.fixture(scope="module")
def eight_devices():
  env = dict(os.environ, XLA_FLAGS=xla_flags(NUM_DEVICES), JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = ROOT + os.pathsep + os.path.join(ROOT, "tests") + os.pathsep + env.get(
      "PYTHONPATH", "")
  result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_adama_on_a_plain_loss_saves_the_accumulator_under_fsdp(eight_devices):
  per_device_params = eight_devices["param_bytes"] / NUM_DEVICES
  # The accumulator AdamA does not keep is one device's share of the params,
  # P/8; at least 0.8 of it must show against hand-written FSDP accumulation.
  saved = eight_devices["scan_accumulation"] - eight_devices["adama"]
  assert saved >= 0.8 * per_device_params, (saved / per_device_params, eight_devices)
  assert eight_devices["adama_release"] < eight_devices["adama"], eight_devices


def test_maxtext_accumulation_is_the_hand_written_step_in_another_form(eight_devices):
  # The same gradients summed over the same micro-batches: only the order of
  # float32 sums (over devices, tokens, micro-batches) differs, a few ulps of
  # the largest entry (float32's epsilon is 1.2e-7); a different micro-batch
  # split or a missed one would differ by a whole gradient's size.
  difference, gradient = eight_devices["maxtext_vs_scan"], eight_devices["scan_gradient"]
  assert gradient > 0
  assert difference < 1e-5 * gradient, (difference, gradient)
  # Its bytes are in the same range as the hand-written loop's on this backend
  # (what a TPU makes of the two is benchmarks/results/memory/oom_easylm_tpu_v3.md's).
  ratio = eight_devices["maxtext_accumulation"] / eight_devices["scan_accumulation"]
  assert 0.8 < ratio < 1.25, ratio


def test_fsdp_on_a_plain_loss_splits_every_layer_and_equals_one_device(eight_devices):
  # Stacked [layers, hidden, heads x head_dim]: split along an axis a layer
  # keeps (its largest), so the model's scan slices a layer of each device's share.
  assert eight_devices["q_kernel_spec"] == "P(None, 'data')", eight_devices
  # The same math as one device but for the order of cross-device sums
  # (float32). A step moves a param by at most the rate (1e-2, two steps); an
  # entry whose gradient is mostly rounding may take a different fraction of
  # it (measured 4e-4 of rate x steps, on the embedding of a byte the batch
  # barely holds), so the bound is 1e-3 of it.
  assert eight_devices["param_diff"] < 1e-3 * 1e-2 * 2, eight_devices["param_diffs"]
  assert eight_devices["loss_diff"] < 1e-5, eight_devices


def test_bfloat16_params_halve_the_params_a_device_takes_in(eight_devices):
  # The capacity table's bf16 methods compile with bfloat16 params: one
  # device's share of them (P/8) is halved in the step's arguments, the float32
  # moments (here counted with them: the CPU keeps offloaded state on the
  # device) unchanged. Their temp is the CPU's (it widens bf16 gathers, below).
  per_device_params = eight_devices["param_bytes"] / NUM_DEVICES
  assert eight_devices["adama_release_offload_bf16/dtypes"] == ["bfloat16"]
  saved = eight_devices["adama_release_offload"] - eight_devices["adama_release_offload_bf16"]
  assert saved == pytest.approx(per_device_params / 2, rel=0.02), saved / per_device_params


def test_the_cpu_backend_gathers_bfloat16_as_float32(eight_devices):
  # Were this to change, the capacity table could compile its bf16 columns
  # (benchmarks/scripts/oom_reports.py's PROJECTED says why it projects them).
  assert eight_devices["gathered_dtype"] == "f32", eight_devices["gathered_dtype"]


@pytest.mark.parametrize("name", ["adama", "adama_bf16"])
@pytest.mark.parametrize("how", ["eager", "jit"])
def test_moments_follow_the_params_split_however_init_is_called(eight_devices, name, how):
  run = eight_devices[f"{name}/{how}"]
  for moment in run["moments"]:
    assert moment == run["params"], run


def test_multisteps_accumulator_lands_on_one_device_under_jit(eight_devices):
  # What llama-2-jax #10 reported, as this optax does it (docs/scale_out.md
  # says so): eagerly its accumulator follows the params; built under
  # jax.jit it lands on one device, whole.
  assert eight_devices["multisteps/eager"]["moments"][0] == eight_devices["multisteps/eager"][
      "params"]
  jit_specs = eight_devices["multisteps/jit"]["moments"][0]
  assert all(spec.startswith("SingleDeviceSharding") for spec in jit_specs), jit_specs


if __name__ == "__main__":
  print(json.dumps(_worker()))
