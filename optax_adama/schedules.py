"""Schedules that count mini-batches, and ``inject_hyperparams`` for AdamA.

:func:`inject_hyperparams` and :func:`mini_batch_schedule` are also at the top
level. See ``docs/usage.md`` (schedules and ``inject_hyperparams``).
"""

from optax_adama._schedules import MiniBatchScheduleState
from optax_adama._schedules import inject_hyperparams
from optax_adama._schedules import mini_batch_schedule

__all__ = ("MiniBatchScheduleState", "inject_hyperparams", "mini_batch_schedule")
