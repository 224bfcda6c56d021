"""Measuring the memory of a training step: compiled reports, the analytic floor, the plan.

Every memory number of this project comes from here: XLA's own accounting of a
compiled program (``Compiled.memory_analysis()``), which works on CPU as on a
GPU, quoted in bytes and in units of P, the bytes of one copy of the params.
:func:`memory_report` is also at the top level. :func:`plan` answers "will my
model fit, and how?": the AdamA step (N, moments, release, ZeRO stage) that
fits a memory budget, found by compiling each candidate (see ``docs/fit.md``).
A :class:`ModelLevers` in place of the loss adds the model's own levers (remat
policies, savers, a loss in chunks) to that search: ``models.planner`` gives
the model zoo's that way. The rest is for benchmarks, with
:func:`collective_bytes`, the bytes a compiled step moves between devices, and
the time predictor's rates (:class:`Machine`). :func:`parse_target` names a
TPU or a GPU to compile for without one (``make venv-tpu`` / ``make
venv-gpu``): :func:`target_mesh`,
:func:`compile_for` with its compiler options, then :func:`memory_report`;
:func:`compiled_by` says which compiler a table's numbers come from.
"""

from optax_adama._collectives import CollectiveBytes
from optax_adama._collectives import collective_bytes
from optax_adama._levers import ModelLevers
from optax_adama._memory import MemoryFloor
from optax_adama._memory import MemoryReport
from optax_adama._memory import memory_floor
from optax_adama._memory import memory_report
from optax_adama._memory import tree_bytes
from optax_adama._plan import Plan
from optax_adama._plan import plan
from optax_adama._search import Considered
from optax_adama._search import Machine
from optax_adama._search import Measurement
from optax_adama._search import PlanSettings
from optax_adama._search import Skipped
from optax_adama._targets import TARGET_NAMES
from optax_adama._targets import Target
from optax_adama._targets import TargetUnavailableError
from optax_adama._targets import compile_for
from optax_adama._targets import compiled_by
from optax_adama._targets import parse_target
from optax_adama._targets import target_devices
from optax_adama._targets import target_mesh
from optax_adama._targets import temporaries_over_memory

__all__ = ("TARGET_NAMES", "CollectiveBytes", "Considered", "Machine", "Measurement",
           "MemoryFloor", "MemoryReport", "ModelLevers", "Plan", "PlanSettings", "Skipped",
           "Target", "TargetUnavailableError", "collective_bytes", "compile_for", "compiled_by",
           "memory_floor", "memory_report", "parse_target", "plan", "target_devices",
           "target_mesh", "temporaries_over_memory", "tree_bytes")
