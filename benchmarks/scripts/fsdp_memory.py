"""Per-device step memory under FSDP on 8 devices, compile-only: release against accumulation.

    python benchmarks/scripts/fsdp_memory.py --presets gpt2_small gpt2_medium

Fakes 8 CPU devices (``--devices``), builds each preset with its layers
scanned and ``remat="full"``, and compiles (nothing is allocated) one
training step on a data-parallel mesh, N = 4 micro-batches, ``--rows``
sequences of ``--seq-len`` tokens per device in each micro-batch, for:

- ``fsdp_scan_accumulation``: ``optax.adamw`` through ``microbatch_step``
  (a float32 gradient accumulator, split like the params);
- ``fsdp_adama``: AdamA's default through ``microbatch_step``;
- ``fsdp_adama_release`` / ``..._bf16`` / ``..._8bit``: AdamA's default
  through ``release_step``, float32 / bfloat16 / 8-bit moments
  (``BlockQuantization(layer_aligned=True)``: each device holds the whole
  blocks of its slice of every layer).

All take the model as a ``StagedLoss`` under ``shard_states="fsdp"``, so each
layer's params are gathered inside the layer scan. Each row gives the
compiled per-device bytes (``memory_analysis()``), in P (the bytes of the
whole float32 params) and against the method's per-device floor: params and
its optimizer state split D ways, one layer's params gathered and the
gradient of its largest leaf (each leaf's gradient is reduce-scattered as it
is made, as ``memory_floor`` counts the largest gradient leaf on one device),
and one micro-batch's activations on one device
(``memory_floor``); and the bytes its collectives move per step
(``optax_adama.memory.collective_bytes``) against FSDP's ideal, the params
gathered twice and the gradient reduce-scattered once per micro-batch
(3 N P). Writes ``--json`` and ``--markdown``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

# The result page and its raw rows, from the checkout's root.
RESULTS = Path("benchmarks/results/memory")


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["gpt2_small"])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--num-micro-batches", type=int, default=4)
  parser.add_argument("--rows", type=int, default=2, help="sequences per device per micro-batch")
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--json", type=Path, default=RESULTS / "raw" / "fsdp_memory.json")
  parser.add_argument("--markdown", type=Path, default=RESULTS / "fsdp_memory.md")
  return parser.parse_args(argv)


METHODS = ("fsdp_scan_accumulation", "fsdp_adama", "fsdp_adama_release",
           "fsdp_adama_release_bf16", "fsdp_adama_release_8bit")


def _optimizer(method, num_micro_batches):
  import jax.numpy as jnp
  import optax

  import optax_adama
  if method == "fsdp_scan_accumulation":
    return optax.adamw(1e-4)
  moments = {"fsdp_adama_release_bf16": {"nu_dtype": jnp.bfloat16, "mu_dtype": jnp.bfloat16},
             "fsdp_adama_release_8bit": {"quantization": optax_adama.BlockQuantization(
                 layer_aligned=True)}}.get(method, {})
  return optax_adama.adamaw(1e-4, num_micro_batches=num_micro_batches, **moments)


def measure(preset, args):
  import jax
  import optax
  from flax import nnx

  import models
  import optax_adama
  from models import harness

  mesh = jax.make_mesh((args.devices,), ("data",))
  config = models.get_config(preset, scan_layers=True, remat="full")
  staged, params = models.staged_loss(
      nnx.eval_shape(lambda: models.create(config, rngs=nnx.Rngs(0))))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  n = args.num_micro_batches
  batch = harness.abstract_batch(config, args.rows * args.devices * n, args.seq_len)
  P = optax_adama.memory.tree_bytes(params)
  _, stacked = staged.split(params)
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  layer = optax_adama.memory.tree_bytes(stacked) // num_layers
  largest_leaf = max(optax_adama.memory.tree_bytes(x) // num_layers
                     for x in jax.tree.leaves(stacked))
  # One device's micro-batch activations, as XLA schedules its forward and
  # backward on one device (optax_adama.memory.memory_floor).
  one_device = optax.adam(1e-4)
  activations = optax_adama.memory.memory_floor(
      staged, params, jax.eval_shape(one_device.init, params),
      harness.abstract_batch(config, args.rows, args.seq_len), num_micro_batches=1
  ).activation_bytes
  rows = []
  for method in METHODS:
    tx = _optimizer(method, n)
    state = jax.eval_shape(tx.init, params)
    state_bytes = optax_adama.memory.tree_bytes(state)
    floor = (P + state_bytes) / args.devices + layer + largest_leaf + activations
    if "release" in method:
      step = optax_adama.release_step(staged, tx, mesh=mesh, shard_states="fsdp")
      shardings = optax_adama.sharding.release_shardings(
          staged, params, state, mesh, shard_states="fsdp")
    else:
      step = optax_adama.microbatch_step(staged, tx, num_micro_batches=n, mesh=mesh,
                                         shard_states="fsdp")
      shardings = optax_adama.sharding.stack_shardings(
          staged, params, state, mesh, shard_states="fsdp")
    place = lambda tree, sh: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    compiled = step.lower(place(params, shardings.params), place(state, shardings.opt_state),
                          batch).compile()
    total = optax_adama.memory_report(compiled, param_bytes=1).total_bytes
    collectives = optax_adama.memory.collective_bytes(compiled)
    ideal = 3 * n * P
    rows.append({"preset": preset, "method": method, "devices": args.devices,
                 "num_micro_batches": n, "tokens_per_device_per_micro_batch":
                     args.rows * args.seq_len,
                 "param_bytes": P, "per_device_bytes": int(total),
                 "per_device_p": total / P, "floor_bytes": int(floor),
                 "activation_bytes": int(activations), "layer_bytes": int(layer),
                 "state_bytes": int(state_bytes), "over_floor": total / floor - 1,
                 "collective_bytes": collectives.by_kind,
                 "uncounted_loops": collectives.uncounted_loops,
                 "ideal_collective_bytes": ideal,
                 "collective_ratio": collectives.total / ideal})
    print(f"{preset} {method}: {total / 2**30:.3f} GiB = {total / P:.3f} P per device "
          f"(floor {floor / P:.3f} P, {100 * (total / floor - 1):+.0f}%), collectives "
          f"{collectives.total / ideal:.3f}x the ideal", flush=True)
  return rows


def markdown(rows, command):
  lines = ["# FSDP on 8 devices: per-device step memory, compile-only", "",
           f"Made by `{command}` on CPU ({rows[0]['devices']} fake devices). Layers "
           "scanned, `remat=\"full\"`, N = "
           f"{rows[0]['num_micro_batches']}, {rows[0]['tokens_per_device_per_micro_batch']:,} "
           "tokens per device per micro-batch, the default estimator, float32 params. P: "
           "the bytes of the whole params. Floor: params and the method's optimizer state "
           "split over the devices, one layer's params gathered and its largest leaf's "
           "gradient (each leaf's is reduce-scattered as it is made), and one "
           "device's micro-batch activations (`optax_adama.memory.memory_floor`). "
           "Collectives: the bytes all-gathered, reduce-scattered and all-reduced per step "
           "(`optax_adama.memory.collective_bytes`, each weighted by the trip counts of "
           "its loops) against FSDP's ideal, the params gathered twice and the gradient "
           "reduce-scattered once per micro-batch (3 N P).",
           "", "| preset | method | per device | in P | floor | against the floor "
           "| collectives / ideal |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['preset']} | {r['method']} | {r['per_device_bytes'] / 2**30:.3f} GiB "
                 f"| {r['per_device_p']:.3f} P | {r['floor_bytes'] / r['param_bytes']:.3f} P "
                 f"| {100 * r['over_floor']:+.0f}% | {r['collective_ratio']:.3f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  args = _parse(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}")
  sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
  rows = [r for preset in args.presets for r in measure(preset, args)]
  command = ("python benchmarks/scripts/fsdp_memory.py "
             + " ".join(argv if argv is not None else sys.argv[1:]))
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
  args.markdown.write_text(markdown(rows, command.strip()))
  print(args.markdown.read_text())


if __name__ == "__main__":
  main()
