"""Measuring the memory of a training step: compiled reports and the analytic floor.

Every memory number of this project comes from here: XLA's own accounting of a
compiled program (``Compiled.memory_analysis()``), which works on CPU as on a
GPU, quoted in bytes and in units of P, the bytes of one copy of the params.
:func:`memory_report` is also at the top level; the rest is for benchmarks, with
:func:`collective_bytes`, the bytes a compiled step moves between devices.
See ``docs/benchmarks.md``.
"""

from optax_adama._collectives import CollectiveBytes
from optax_adama._collectives import collective_bytes
from optax_adama._memory import MemoryFloor
from optax_adama._memory import MemoryReport
from optax_adama._memory import memory_floor
from optax_adama._memory import memory_report
from optax_adama._memory import tree_bytes

__all__ = ("CollectiveBytes", "MemoryFloor", "MemoryReport", "collective_bytes", "memory_floor",
           "memory_report", "tree_bytes")
