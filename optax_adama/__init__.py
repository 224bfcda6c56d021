"""optax_adama: Adam Accumulation (AdamA) for Optax.

AdamA folds each micro-batch gradient straight into Adam's moments, so
gradient accumulation needs no parameter-sized gradient buffer.
"""

from optax_adama._adama import ScaleByAdamAState
from optax_adama._adama import MiniBatchChainState
from optax_adama._adama import NU_ESTIMATORS
from optax_adama._adama import adama
from optax_adama._adama import adamaw
from optax_adama._adama import find_adama_state
from optax_adama._adama import has_updated
from optax_adama._adama import mini_batch_chain
from optax_adama._adama import scale_by_adama
from optax_adama._diagnose import SecondMomentDiagnosis
from optax_adama._diagnose import diagnose_second_moment
from optax_adama._memory import MemoryFloor
from optax_adama._memory import MemoryReport
from optax_adama._memory import memory_floor
from optax_adama._memory import memory_report
from optax_adama._memory import tree_bytes
from optax_adama._quantize import BlockQuantization
from optax_adama._quantize import QuantizedArray
from optax_adama._quantize import dequantize_blocks
from optax_adama._quantize import quantize_blocks
from optax_adama._quantize import stochastic_round
from optax_adama._schedules import MiniBatchScheduleState
from optax_adama._schedules import inject_hyperparams
from optax_adama._schedules import mini_batch_schedule
from optax_adama._sharding import StepShardings
from optax_adama._sharding import batch_sharding
from optax_adama._sharding import sharded_tree_shardings
from optax_adama._sharding import step_shardings
from optax_adama._microbatch import microbatch_step
from optax_adama._microbatch import split_micro_batches
from optax_adama._microbatch import updates_every_micro_batch
from optax_adama._release import StagedLoss
from optax_adama._release import release_shardings
from optax_adama._release import release_step
from optax_adama._low_rank import low_rank
from optax_adama._low_rank import low_rank_mask
from optax_adama._offload import host_state_bytes
from optax_adama._offload import offload_moments
from optax_adama._offload import offloaded_state_shapes

__version__ = "0.1.0"

__all__ = (
    "BlockQuantization",
    "MemoryFloor",
    "MemoryReport",
    "MiniBatchChainState",
    "MiniBatchScheduleState",
    "NU_ESTIMATORS",
    "QuantizedArray",
    "ScaleByAdamAState",
    "SecondMomentDiagnosis",
    "StagedLoss",
    "StepShardings",
    "adama",
    "adamaw",
    "batch_sharding",
    "dequantize_blocks",
    "diagnose_second_moment",
    "find_adama_state",
    "has_updated",
    "host_state_bytes",
    "inject_hyperparams",
    "low_rank",
    "low_rank_mask",
    "memory_floor",
    "memory_report",
    "microbatch_step",
    "mini_batch_chain",
    "mini_batch_schedule",
    "offload_moments",
    "offloaded_state_shapes",
    "quantize_blocks",
    "release_shardings",
    "release_step",
    "scale_by_adama",
    "sharded_tree_shardings",
    "split_micro_batches",
    "step_shardings",
    "stochastic_round",
    "tree_bytes",
    "updates_every_micro_batch",
)
