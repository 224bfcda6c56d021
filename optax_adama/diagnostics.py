"""Whether AdamA's second moment tracks Adam's on your model and data.

:func:`diagnose_second_moment` runs Adam with gradient accumulation and, along
its path, every AdamA estimator of v, and reports rho = v_estimator / v_Adam
per coordinate (AdamA's step is Adam's times 1/sqrt(rho)). The research
estimators it compares are in :mod:`optax_adama.contrib`. See
``docs/estimators.md``.
"""

from optax_adama._diagnose import SecondMomentDiagnosis
from optax_adama._diagnose import diagnose_second_moment

__all__ = ("SecondMomentDiagnosis", "diagnose_second_moment")
