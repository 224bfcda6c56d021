"""Where a result was measured, and how the tools write it: bytes, figures, loss curves.

Every command and tool of the harness reports through these: `machine_info`
(the record of the machine beside each number), `format_bytes`, `save_figure`
and the training curves of `models.train` runs (`plot_loss_curves`).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

# Where a result was measured.


def cpu_name() -> str:
  """The CPU model, e.g. 'AMD EPYC 7B13', from /proc/cpuinfo where there is one."""
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
  """Where a result was measured: backend, device, CPU, versions."""
  device = jax.devices()[0]
  return {
      "backend": jax.default_backend(),
      "device": getattr(device, "device_kind", str(device)),
      "num_devices": jax.device_count(),
      "cpu": cpu_name(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "optax": optax.__version__,
  }


# Output.

GIB = 2**30


def format_bytes(num_bytes: float) -> str:
  """GiB, or MiB below a tenth of a GiB (the tiny models' steps)."""
  if abs(num_bytes) >= 0.1 * GIB:
    return f"{num_bytes / GIB:.2f} GiB"
  return f"{num_bytes / 2**20:.2f} MiB"


def save_figure(fig: Any, path: Path, *, rect: Any = None) -> None:
  """Lays out (within ``rect``, figure fractions, if given), writes (creating
  the folder) and closes a matplotlib figure."""
  import matplotlib.pyplot as plt

  fig.tight_layout(rect=rect)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def running_mean(values: Sequence[float], window: int = 50) -> np.ndarray:
  """The mean over the last ``window`` values at each point (fewer at the start)."""
  values = np.asarray(values, np.float64)
  sums = np.cumsum(np.concatenate([[0.0], values]))
  ends = np.arange(1, len(values) + 1)
  starts = np.maximum(ends - window, 0)
  return (sums[1:] - sums[starts]) / (ends - starts)


def plot_loss_curves(runs: Sequence[dict[str, Any]], label: Callable[[dict], str], path: Path,
                     *, title: str = "whole run", window: int = 50, log: bool = False,
                     style: Callable[[dict], dict[str, Any]] | None = None) -> None:
  """Training curves (running means) of ``models.train`` runs: the whole run and its
  second half, each labelled with ``label(run)`` and the held-out loss, drawn with
  matplotlib's ``style(run)`` (colour, line style...; default: its colour cycle)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (full, tail) = plt.subplots(1, 2, figsize=(11.5, 4.2))
  for run in runs:
    curve = running_mean(run["train_loss"], window)
    steps = np.arange(1, len(curve) + 1)
    text = f"{label(run)}: held-out {run['eval_loss']:.4f}"
    kwargs = {} if style is None else style(run)
    full.plot(steps, curve, label=text, **kwargs)
    tail.plot(steps[len(curve) // 2:], curve[len(curve) // 2:], label=text, **kwargs)
  full.set(xlabel="step", ylabel=f"training loss (mean of {window} steps)", title=title,
           yscale="log" if log else "linear")
  tail.set(xlabel="step", title="second half")
  full.legend(fontsize=8)
  save_figure(fig, path)
