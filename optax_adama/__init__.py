"""optax_adama: Adam Accumulation (AdamA) for Optax.

AdamA folds each micro-batch gradient straight into Adam's moments, so
gradient accumulation needs no parameter-sized gradient buffer. The top level
holds what a training script types; the subsystems are public submodules:

* :mod:`optax_adama.memory`: compiled memory reports and the analytic floor;
* :mod:`optax_adama.moments`: 8-bit, low-rank and host-offloaded moments;
* :mod:`optax_adama.sharding`: data parallel, ZeRO and FSDP shardings;
* :mod:`optax_adama.schedules`: schedules that count mini-batches;
* :mod:`optax_adama.diagnostics`: does AdamA's v track Adam's on your model?
* :mod:`optax_adama.contrib`: research estimators of v, useful but not settled;
* :mod:`optax_adama.nnx`: train a Flax NNX model in place with the fused step
  (needs Flax, the ``[flax]`` extra; imported on first use).
"""

from optax_adama import contrib
from optax_adama import diagnostics
from optax_adama import memory
from optax_adama import moments
from optax_adama import schedules
from optax_adama import sharding
from optax_adama._adama import ScaleByAdamAState
from optax_adama._adama import find_adama_state
from optax_adama._adama import has_updated
from optax_adama._adama import scale_by_adama
from optax_adama._chain import ClippedState
from optax_adama._chain import MiniBatchChainState
from optax_adama._chain import adama
from optax_adama._chain import adamaw
from optax_adama._chain import mini_batch_chain
from optax_adama._clipping import clipped_by_global_norm
from optax_adama._low_rank import low_rank
from optax_adama._memory import MemoryReport
from optax_adama._memory import memory_report
from optax_adama._microbatch import microbatch_step
from optax_adama._offload import offload_moments
from optax_adama._quantize import BlockQuantization
from optax_adama._release import release_step
from optax_adama._schedules import inject_hyperparams
from optax_adama._schedules import mini_batch_schedule
from optax_adama._staged import StagedLoss

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
  # optax_adama.nnx needs Flax, an optional dependency: it is imported when
  # first asked for, so that `import optax_adama` never imports Flax.
  if name == "nnx":
    import optax_adama.nnx  # pylint: disable=import-outside-toplevel
    return optax_adama.nnx
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = (
    # Optimizers and their states.
    "adama",
    "adamaw",
    "scale_by_adama",
    "mini_batch_chain",
    "clipped_by_global_norm",
    "ScaleByAdamAState",
    "ClippedState",
    "MiniBatchChainState",
    "has_updated",
    "find_adama_state",
    # Training steps.
    "microbatch_step",
    "release_step",
    "StagedLoss",
    # Schedules.
    "inject_hyperparams",
    "mini_batch_schedule",
    # Memory savers for the optimizer state.
    "BlockQuantization",
    "low_rank",
    "offload_moments",
    # Measuring.
    "memory_report",
    "MemoryReport",
    # Submodules.
    "contrib",
    "diagnostics",
    "memory",
    "moments",
    "schedules",
    "sharding",
)
