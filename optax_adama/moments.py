"""Smaller optimizer state: 8-bit, low-rank and host-offloaded moments.

AdamA touches one micro-batch gradient one leaf at a time, so every saver that
acts per leaf composes with it. :class:`BlockQuantization`, :func:`low_rank`
and :func:`offload_moments` are also at the top level; the helpers that size
and plan such state live here. See ``docs/optimizer_state.md``.
"""

from optax_adama._low_rank import low_rank
from optax_adama._low_rank import low_rank_mask
from optax_adama._offload import host_state_bytes
from optax_adama._offload import offload_moments
from optax_adama._offload import offloaded_state_shapes
from optax_adama._quantize import BlockQuantization
from optax_adama._quantize import QuantizedArray

__all__ = (
    "BlockQuantization",
    "QuantizedArray",
    "host_state_bytes",
    "low_rank",
    "low_rank_mask",
    "offload_moments",
    "offloaded_state_shapes",
)
