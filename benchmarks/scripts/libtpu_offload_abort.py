"""libtpu 0.0.42.1 aborts compiling a host-offloaded stack updated one layer at a time (v3).

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv-tpu/bin/python \
        benchmarks/scripts/libtpu_offload_abort.py 32 4096
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv-tpu/bin/python \
        benchmarks/scripts/libtpu_offload_abort.py 32 8 512

What `release_step` over `offload_moments` does to a stacked moment, reduced: an
array of `layers` rows in host memory (`pinned_host`), split over a TPU v3-8's cores
along its last axis, and a scan over the layers that brings one layer's slice to the
device, updates it and writes it back with a dynamic-update-slice. For a 2-D stack
(`layers x width`, the moments of a scanned model's norm scales and biases) libtpu
stops the process in its async-slice lowering:

    async_slice_util.cc:605] Check failed: intermediate_calc.slice_size %
    intermediate_calc.update_detail.num_sublanes_per_chunk == 0 (1 vs. 0) Sublane
    slicing size not multiple of update chunk sublane size.

One layer of a 2-D stack is one row of the second-to-last (sublane) axis: [L, 1, W]
aborts too (XLA drops the unit axis), while the same bytes as [L, 8, W / 8] compile
(exit 0). The workaround is that layout, or keeping such small stacks on the device
(`offload_moments(min_size=...)` above their size). libtpu compiles the original for a
v5e. Exit status 134 (SIGABRT) is the abort.
"""

import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from optax_adama import memory


def main(shape: list[int]) -> None:
  layers = shape[0]
  mesh = memory.target_mesh("tpu:v3-8")
  spec = PartitionSpec(*([None] * (len(shape) - 1)), "data")
  host = NamedSharding(mesh, spec, memory_kind="pinned_host")
  device = NamedSharding(mesh, spec, memory_kind="device")

  def step(moment, grads):
    def body(moment, i):
      layer = jax.device_put(jax.lax.dynamic_index_in_dim(moment, i, keepdims=True), device)
      layer = layer * 0.9 + jax.lax.dynamic_index_in_dim(grads, i, keepdims=True)
      layer = jax.device_put(layer, host)
      return jax.lax.dynamic_update_slice_in_dim(moment, layer, i, axis=0), None

    return jax.lax.scan(body, moment, jnp.arange(layers))[0]

  args = (jax.ShapeDtypeStruct(tuple(shape), jnp.float32, sharding=host),
          jax.ShapeDtypeStruct(tuple(shape), jnp.float32, sharding=device))
  jitted = jax.jit(step, out_shardings=host, donate_argnums=0)
  compiled = memory.compile_for(jitted, *args, target="tpu:v3-8")
  print(f"{shape}: compiled, temp {compiled.memory_analysis().temp_size_in_bytes:,} B")


if __name__ == "__main__":
  main([int(size) for size in sys.argv[1:]])
