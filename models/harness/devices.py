"""The devices a run trains on: its mesh, its ZeRO stage, and several hosts.

The engine is JAX's own: a `jax.sharding.Mesh` with one "data" axis over the
first `mesh_devices` devices, `optax_adama`'s steps with ``mesh=`` and
``shard_states=`` (GSPMD inserts the collectives), and `jax.distributed` to
join several processes into one set of global devices. Batches are global
arrays: every process draws the same mini-batch from the seed and hands over
its own devices' rows (`jax.make_array_from_process_local_data`).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import optax_adama

# `--shard-states`: the library's stages, "none" for its None (plain data
# parallel, replicated state).
SHARD_STATES = tuple(stage or "none" for stage in optax_adama.sharding.SHARD_STATES)


def add_device_args(group: argparse._ArgumentGroup) -> None:
  """`models.train`'s flags for the mesh, the ZeRO stage and several hosts."""
  group.add_argument("--mesh-devices", default=None, metavar="N|all",
                     help="devices on the mesh's 'data' axis, each a slice of every "
                     "micro-batch's rows; 'all': every device of every process. Without a "
                     "--shard-states stage a run takes one device and no mesh, even where 8 "
                     "are visible: spreading it is asked for, as it changes each device's "
                     "rows (the batch must split over them) and memory (default: 1, or all "
                     "with a --shard-states stage)")
  group.add_argument("--shard-states", choices=SHARD_STATES, default="none",
                     help="what the mesh splits besides the batch: none (data parallel), "
                     "zero1 (moments), zero2 (moments and gradients), fsdp (params too); a "
                     "stage needs a mesh of 2 or more devices (default: none)")
  group.add_argument("--distributed", action="store_true",
                     help="several hosts on a cluster JAX detects (Slurm, Cloud TPU, Open MPI, "
                     "Kubernetes): jax.distributed.initialize() finds the coordinator and "
                     "this process; the three flags below override what it finds "
                     "(default: off, one process)")
  group.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                     help="several hosts: jax.distributed.initialize's coordinator (process "
                     "0's address); give the same command on every host with its "
                     "--process-id (default: one process)")
  group.add_argument("--num-processes", type=int, default=None, metavar="P",
                     help="several hosts: the number of processes (default: one process)")
  group.add_argument("--process-id", type=int, default=None, metavar="I",
                     help="several hosts: this process's index, 0 to P - 1 (default: one "
                     "process)")


def start_processes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
  """`jax.distributed.initialize` where the flags ask for several hosts, before any
  device is touched: the three flags together, or `--distributed` (the cluster's
  environment fills in what is not given)."""
  given = [args.coordinator_address, args.num_processes, args.process_id]
  if all(value is None for value in given) and not args.distributed:
    return
  if any(value is None for value in given) and not args.distributed:
    parser.error("several hosts need --coordinator-address, --num-processes and "
                 "--process-id together (or --distributed on a cluster JAX detects)")
  if args.num_processes is not None and args.num_processes < 1:
    parser.error(f"--num-processes {args.num_processes}: it must be >= 1")
  if args.process_id is not None and args.num_processes is not None \
      and not 0 <= args.process_id < args.num_processes:
    parser.error(f"--process-id {args.process_id}: it must be in 0..{args.num_processes - 1}")
  try:
    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes, process_id=args.process_id)
  except (ValueError, RuntimeError) as error:  # no cluster detected; JAX already started
    parser.error(f"jax.distributed.initialize: {str(error).splitlines()[0]}")


def mesh_devices_of(value: str | None, parser: argparse.ArgumentParser,
                    shard_states: str | None = None) -> int:
  """`--mesh-devices`' count: a number, or "all" for `jax.device_count()`; not given,
  1 without a stage and all devices with one (`shard_states`)."""
  if value is None:
    value = "1" if stage_of(shard_states) is None else "all"
  if value == "all":
    return jax.device_count()
  try:
    count = int(value)
  except ValueError:
    count = 0
  if count < 1:
    parser.error(f"--mesh-devices {value}: give a number of devices >= 1, or 'all'")
  return count


def stage_of(shard_states: str | None) -> str | None:
  """The library's ``shard_states=`` of a `--shard-states` value ("none" is None)."""
  return None if shard_states in (None, "none") else shard_states


def check_devices(mesh_devices: int) -> None:
  """Raises ValueError where the mesh asks for more devices than there are."""
  available = jax.device_count()
  if mesh_devices > available:
    raise ValueError(
        f"mesh_devices={mesh_devices} but this run sees {available} device(s) "
        f"({jax.devices()[0].platform}); pass --mesh-devices {available} or fewer (on the "
        "CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices).")


def make_mesh(mesh_devices: int, shard_states: str | None) -> Mesh | None:
  """The run's mesh: None for one device without a stage, else a "data" axis."""
  if mesh_devices == 1 and stage_of(shard_states) is None:
    return None
  check_devices(mesh_devices)
  return Mesh(np.array(jax.devices()[:mesh_devices]), ("data",))


def place_batch(batch: dict, mesh: Mesh | None) -> Any:
  """A mini-batch as global arrays, rows split over the mesh's "data" axis.

  Every process holds the same numpy batch (drawn from the seed); each hands
  over the rows of its own devices.
  """
  if mesh is None:
    return batch
  sharding = optax_adama.sharding.batch_sharding(mesh)
  return {name: jax.make_array_from_callback(value.shape, sharding,
                                             lambda index, value=value: value[index])
          for name, value in batch.items()}


def gathered(tree: Any) -> Any:
  """``tree`` whole on every process (numpy leaves), for a process to write out.

  One process: ``tree`` as it is (its arrays fetch themselves). Several:
  each process holds only its devices' shards, so they are all-gathered.
  """
  if jax.process_count() == 1:
    return tree
  return multihost_utils.process_allgather(tree, tiled=True)
