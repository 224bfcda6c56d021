"""`models.bench memory`'s measurement: each method's compiled step memory against the floor.

Compile-only (`memory_analysis()`), so the largest presets are measured
without a device: `measure_memory` compiles every method's step for a preset
and N (for XLA's CPU backend, or for one device of a `--target` with its own
compiler) beside the floor it is held to; `memory_table` and
`plot_memory_vs_n` show the rows.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

import models
import optax_adama
from models.harness import baselines
from models.harness import batches


@dataclasses.dataclass(frozen=True)
class MemoryRow:
  """One method's compiled step on one preset and N, with the floor it is held to."""

  preset: str
  method: str
  num_micro_batches: int
  micro_batch_size: int
  param_count: int
  report: dict[str, float]
  floor: dict[str, float]
  compile_s: float
  # The compiler of the step (optax_adama.memory.compiled_by); "" in runs saved
  # before the column, all XLA's CPU backend.
  compiled_for: str = ""
  # Whether the step fits one device of the --target; None without one.
  fits: bool | None = None


def measure_memory(
    preset: str | models.Config,
    methods: Sequence[str],
    num_micro_batches: int,
    *,
    micro_batch_size: int,
    seq_len: int | None = None,
    remat: str = "none",
    scan_layers: bool = False,
    dtype: str | None = None,
    target: optax_adama.memory.Target | None = None,
) -> list[MemoryRow]:
  """Compile-only memory of each method's step, and AdamA's floor.

  With ``scan_layers`` the steps run the scanned model and the floor is the
  unrolled model's (the same params; its largest gradient is one layer's).
  ``dtype``: the compute dtype (params and moments stay float32); None: the
  preset's. ``target``: compile each step for one device of that machine with
  its compiler and options (the floor's activations stay the CPU backend's).
  """
  config = models.get_config(preset, remat=remat, scan_layers=scan_layers,
                             **baselines.dtype_override(dtype))
  notes = [note for note, on in (("scanned", scan_layers), (dtype, dtype is not None)) if on]
  name = (preset if isinstance(preset, str) else "custom") + (
      f" ({', '.join(notes)})" if notes else "")
  loss_fn, params = baselines.split_model(config)
  rows = []
  batch = batches.abstract_batch(config, micro_batch_size * num_micro_batches, seq_len)
  floors = {}
  for method in methods:
    check_memory_method(method)
    release = method in baselines.RELEASE_METHODS
    if release not in floors:
      floors[release] = baselines.floor_for(method, config, batch, num_micro_batches).to_dict()
    floor = floors[release]
    step, tx = baselines.make_step(method, loss_fn, num_micro_batches=num_micro_batches,
                                 rank=config.hidden // 4)
    opt_state = jax.eval_shape(tx.init, params)
    start = time.perf_counter()
    args = on_target((params, opt_state, batch), target)
    compiled = optax_adama.memory.compile_for(step, *args, target=target)
    report = optax_adama.memory_report(compiled, *args)
    rows.append(MemoryRow(
        name, method, num_micro_batches, micro_batch_size,
        models.param_count(config), report.to_dict(), floor,
        time.perf_counter() - start, optax_adama.memory.compiled_by(target),
        None if target is None else target.fits(report.total_bytes)))
  return rows


def on_target(tree: Any, target: optax_adama.memory.Target | None) -> Any:
  """``tree``'s shapes placed on the first compile-only device of ``target``
  (what the step then compiles for); ``tree`` itself without one."""
  if target is None:
    return tree
  device = optax_adama.memory.target_devices(target)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def check_memory_method(method: str) -> None:
  """Refuses what the compile-only memory table cannot measure."""
  if method.endswith("_offload"):
    raise ValueError(
        f"method {method}: its state lives in host memory, which this compile-only "
        "table would count as device memory on CPU; measure it with the capacity "
        "command, or drop it from --methods.")


def compiled_for_line(rows: Sequence[MemoryRow]) -> str:
  """The memory table's first line: which compiler made its steps' bytes."""
  compilers = sorted({r.compiled_for or optax_adama.memory.compiled_by() for r in rows})
  return "Compiled by " + "; ".join(compilers) + "."


def memory_table(rows: Sequence[MemoryRow]) -> str:
  """Markdown: one row per (preset, N), one column per method, in GiB and P; the
  line above it names the compiler, and a step over a target's memory says so."""
  methods = [m for m in baselines.METHODS + baselines.RELEASE_METHODS
             if any(r.method == m for r in rows)]
  release = any(r.method in baselines.RELEASE_METHODS for r in rows)
  head = ("| preset | params | N | floor | " + " | ".join(methods) + " | AdamA vs floor |"
          + (" release vs its floor (remat full) |" if release else "")
          + "\n|" + "---|" * (len(methods) + 5 + release))
  lines = [head]
  keys = sorted({(r.preset, r.num_micro_batches) for r in rows},
                key=lambda k: (list(models.PRESETS).index(k[0]) if k[0] in models.PRESETS
                               else 0, k[1]))
  for preset, n in keys:
    group = {r.method: r for r in rows if (r.preset, r.num_micro_batches) == (preset, n)}
    any_row = next((r for r in group.values() if r.method not in baselines.RELEASE_METHODS),
                   next(iter(group.values())))
    floor = any_row.floor
    cells = []
    for method in methods:
      r = group.get(method)
      cells.append("" if r is None else
                   f"{r.report['total_bytes'] / 2**30:.2f} GiB ({r.report['total_p']:.2f} P)"
                   + (" **over**" if r.fits is False else ""))
    def vs_own_floor(method):
      r = group.get(method)
      if r is None:
        return ""
      return (f"{100 * (r.report['total_bytes'] / r.floor['total_bytes'] - 1):+.1f}%"
              + (f" ({r.floor['total_p']:.2f} P)" if method in baselines.RELEASE_METHODS else ""))

    lines.append(
        f"| {preset} | {any_row.param_count / 1e6:.1f}M | {n} "
        f"| {floor['total_bytes'] / 2**30:.2f} GiB ({floor['total_p']:.2f} P) | "
        + " | ".join(cells) + f" | {vs_own_floor('adama')} |"
        + (f" {vs_own_floor('adama_release')} |" if release else ""))
  note = compiled_for_line(rows)
  if any(r.fits is not None for r in rows):
    note += (" Each step for one device of it; **over**: the step does not fit that "
             "device's memory. The floor's activations are the CPU backend's.")
  return note + "\n\n" + "\n".join(lines)


def plot_memory_vs_n(rows: Sequence[MemoryRow], path: Path) -> None:
  """One panel per preset: compiled memory (P) against N, a line per method."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  presets = list(dict.fromkeys(r.preset for r in rows))
  fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
  for ax, preset in zip(axes[0], presets):
    for method in baselines.METHODS:
      points = sorted((r.num_micro_batches, r.report["total_p"])
                      for r in rows if r.preset == preset and r.method == method)
      if points:
        ax.plot(*zip(*points), marker="o", label=method)
    floor = sorted({(r.num_micro_batches, r.floor["total_p"]) for r in rows if r.preset == preset})
    ax.plot(*zip(*floor), "k--", label="AdamA floor")
    # Full-batch memory grows N-fold and would flatten the lines that matter.
    accumulating = [r.report["total_p"] for r in rows
                    if r.preset == preset and r.method != "full_batch"]
    if accumulating:
      low = min(min(accumulating), min(p for _, p in floor))
      ax.set_ylim(low * 0.9, max(accumulating) * 1.15)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per mini-batch (N)")
    ax.set_ylabel("compiled step memory (P)")
    ax.set_title(f"{preset} (full_batch leaves the frame as N grows)")
    ax.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
