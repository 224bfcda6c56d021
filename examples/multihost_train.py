"""Data-parallel AdamA on one host or several: ZeRO-2 and 8-bit moments, or
gradient release with FSDP.

Trains the tiny byte-level GPT of `models/` with `optax_adama.microbatch_step`
on a `jax.sharding.Mesh` over every device of every host. JAX's own engine does
the rest: `jax.distributed.initialize()` joins the hosts, `jit` with GSPMD
shardings runs the step, and each micro-batch gradient is reduce-scattered
into the moment slices (ZeRO-2), so no device ever holds a full gradient.
With `--release --shard-states fsdp` the layers are scanned and trained with
`optax_adama.release_step`: each layer's params are gathered as the scans
reach it and its gradient is reduce-scattered and folded as the release
reaches it, so no device holds more than a layer of gathered params or of
gradient.

One host (any number of local devices; on CPU, fake 8 of them):

    python examples/multihost_train.py --num-cpu-devices 8
    python examples/multihost_train.py --num-cpu-devices 8 --release --shard-states fsdp

Several hosts: run the same command on every host. On a cluster JAX detects
(Slurm, Cloud TPU, Open MPI, Kubernetes with the JobSet env), nothing more is
needed; elsewhere name the coordinator and each process:

    python examples/multihost_train.py --coordinator 10.0.0.1:1234 \\
        --num-processes 2 --process-id 0        # on host 0
    python examples/multihost_train.py --coordinator 10.0.0.1:1234 \\
        --num-processes 2 --process-id 1        # on host 1

Each process reads only its own rows of every global batch (a different
stream per process) and hands them to `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--coordinator", default=None,
                      help="host:port of process 0; omit on one host or on a "
                           "cluster JAX detects")
  parser.add_argument("--num-processes", type=int, default=None)
  parser.add_argument("--process-id", type=int, default=None)
  parser.add_argument("--num-cpu-devices", type=int, default=None,
                      help="fake this many CPU devices per process (testing)")
  parser.add_argument("--shard-states", default="zero2",
                      choices=["none", "zero1", "zero2", "fsdp"])
  parser.add_argument("--moments", default="8bit", choices=["float32", "bfloat16", "8bit"])
  parser.add_argument("--preset", default="gpt_tiny")
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--batch-size", type=int, default=64, help="global mini-batch")
  parser.add_argument("--num-micro-batches", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=2e-3)
  parser.add_argument("--release", action="store_true",
                      help="scanned layers through optax_adama.release_step")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> float:
  args = _parse_args(argv)
  if args.num_cpu_devices:
    # Before JAX starts: the device count is fixed at backend start.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.num_cpu_devices}")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import models
  import optax_adama
  from models import data
  from models.harness import warmup_cosine_schedule

  multi_process = args.coordinator is not None or args.num_processes not in (None, 1)
  if multi_process:
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_processes,
        process_id=args.process_id)
  else:
    try:  # a cluster JAX recognises (Slurm, TPU pod, ...): join it
      jax.distributed.initialize()
    except (ValueError, RuntimeError):
      pass  # one host, nothing to join
  process, num_processes = jax.process_index(), jax.process_count()
  log = (lambda *a: print(*a, flush=True)) if process == 0 else (lambda *a: None)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  log(f"{num_processes} process(es), {jax.device_count()} devices "
      f"({jax.local_device_count()} local), mesh {dict(mesh.shape)}")

  rows_per_process, remainder = divmod(args.batch_size, num_processes)
  micro_batch_size, micro_remainder = divmod(args.batch_size, args.num_micro_batches)
  if remainder or micro_remainder or micro_batch_size % jax.device_count():
    raise ValueError(
        f"batch size {args.batch_size} must split into {args.num_micro_batches} equal "
        f"micro-batches whose rows are a multiple of the {jax.device_count()} devices, "
        f"and into equal shares for the {num_processes} process(es).")

  # Same seed everywhere: every process builds the same initial params.
  model_config = models.get_config(args.preset, scan_layers=args.release)
  model = models.create(model_config, rngs=nnx.Rngs(0))
  if args.release:
    loss_fn, params = models.staged_loss(model)
  else:
    loss_fn, params = models.split_loss_fn(model, has_aux=True)
  schedule = warmup_cosine_schedule(args.learning_rate, args.steps, warmup_steps=20)
  moments = {
      "float32": {},
      "bfloat16": {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16},
      # The release folds a layer at a time: blocks laid out per layer.
      "8bit": {"quantization": optax_adama.BlockQuantization(layer_aligned=args.release)},
  }[args.moments]
  tx = optax_adama.adamaw(
      schedule, weight_decay=0.0, num_micro_batches=args.num_micro_batches, **moments)
  shard_states = None if args.shard_states == "none" else args.shard_states
  opt_state = tx.init(params)
  if args.release:
    step = optax_adama.release_step(loss_fn, tx, mesh=mesh, shard_states=shard_states)
    shardings = optax_adama.sharding.release_shardings(
        loss_fn, params, opt_state, mesh, shard_states=shard_states)
  else:
    step = optax_adama.microbatch_step(
        loss_fn, tx, num_micro_batches=args.num_micro_batches, has_aux=True,
        mesh=mesh, shard_states=shard_states)
    shardings = optax_adama.sharding.step_shardings(
        params, opt_state, mesh, shard_states=shard_states)

  # Place the state once, so the step donates and reuses its buffers. The
  # state is built on every process from host values, sliced to its shards.
  params = jax.device_put(params, shardings.params)
  opt_state = jax.device_put(opt_state, shardings.opt_state)
  batch_sharding = optax_adama.sharding.batch_sharding(mesh)

  # Rows: process p holds rows [p * B / num_processes, (p + 1) * B / num_processes)
  # of every global batch, which is what the batch sharding puts on its devices.
  text = data.load_stdlib_text(max_bytes=2_000_000)
  local_batches = data.lm_batches(
      text.train, batch_size=rows_per_process, seq_len=args.seq_len, seed=process)

  def global_batch():
    local = next(local_batches)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(batch_sharding, np.asarray(x)),
        local)

  with jax.numpy_dtype_promotion("standard"):  # optax's schedule
    start = time.perf_counter()
    for i in range(args.steps):
      params, opt_state, metrics = step(params, opt_state, global_batch())
      if i % 10 == 0 or i == args.steps - 1:
        log(f"step {i:4d}  loss {float(metrics['loss']):.4f}")
    elapsed = time.perf_counter() - start
  state = optax_adama.find_adama_state(opt_state)
  moment_bytes = sum(
      shard.data.nbytes for x in jax.tree.leaves((state.mu, state.nu))
      for shard in x.addressable_shards[:1])
  P = optax_adama.memory.tree_bytes(params)
  log(f"{args.steps} steps in {elapsed:.1f} s; m + v per device "
      f"{moment_bytes:,d} B = {moment_bytes / P:.3f} P (P = {P:,d} B)")
  final = float(metrics["loss"])
  if multi_process or num_processes > 1:
    jax.distributed.shutdown()
  return final


if __name__ == "__main__":
  main()
