"""Shardings for AdamA on a ``jax.sharding.Mesh``: data parallel, ZeRO-1/2, FSDP.

The multi-device engine is JAX's own: :func:`optax_adama.microbatch_step` and
:func:`optax_adama.release_step` with ``mesh=`` jit the step with these
``NamedSharding`` trees and let GSPMD insert the collectives. Use these to
place params and optimizer state before the first step (or to restore a
checkpoint onto a mesh). See ``docs/scale_out.md``.
"""

from optax_adama._release_mesh import release_shardings
from optax_adama._release_mesh import stack_shardings
from optax_adama._sharding import SHARD_STATES
from optax_adama._sharding import StepShardings
from optax_adama._sharding import batch_sharding
from optax_adama._sharding import step_shardings

__all__ = ("SHARD_STATES", "StepShardings", "batch_sharding", "release_shardings",
           "stack_shardings", "step_shardings")
