"""Why AdamA's unrolled step sits above its floor: forward residuals, not gradients.

    PYTHONPATH=. python benchmarks/scripts/unrolled_residuals.py \
        --presets bert_base gpt2_small vit_base

For each preset, one micro-batch (one sequence or image), compile only, it
compiles three programs on the same loss and reads their temp memory and the
buffers live at the temp peak from XLA's own buffer assignment (a dump of the
compiled modules):

  grad   ``jax.grad(loss_fn)``: the floor's activation term (the gradient is
         the output, not temp);
  fold   the same gradient folded into donated m and v in the same program
         (AdamA's fold of one micro-batch, no loop, no update);
  step   ``fold`` under ``lax.scan`` over 4 micro-batches (what
         ``microbatch_step`` compiles, less the params update).

``fold - grad`` is what folding costs beyond the floor's activations. If it
were gradients kept alive, the buffers live at the peak would be
parameter-shaped; the table lists them by shape, so one can see what they are.
Results: benchmarks/results/memory/compiled_memory.md ("Unrolled presets: where the
bytes above the floor are").
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="xla_dump_")
atexit.register(shutil.rmtree, DUMP, ignore_errors=True)  # ~100 MB of HLO text a run
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)

import models  # noqa: E402
from models import harness  # noqa: E402


def programs(loss_fn):
  """The three programs of the module docstring, as functions to jit."""

  def fold(params, mu, nu, micro_batch):
    grads = jax.grad(loss_fn)(params, micro_batch)
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, mu, grads)
    nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, nu, grads)
    return mu, nu

  def step(params, mu, nu, micro_batches):
    def body(moments, micro_batch):
      return fold(params, *moments, micro_batch), None
    return jax.lax.scan(body, (mu, nu), micro_batches)[0]

  return {"grad": (jax.grad(loss_fn), ()), "fold": (fold, (1, 2)), "step": (step, (1, 2))}


def live_at_peak(module_prefix: str) -> dict[str, int]:
  """Bytes by buffer shape of the temp allocation's values live at its peak."""
  assignment = Path(module_prefix + "-buffer-assignment.txt").read_text().splitlines()
  live_range = Path(module_prefix + "-live-range.txt").read_text().splitlines()
  allocations, current = {}, None
  for line in assignment:
    if match := re.match(r"allocation (\d+): size (\d+)(.*)", line):
      current = int(match[1])
      allocations[current] = (int(match[2]), "temp" in match[3], [])
    elif (match := re.match(r"\s+value: <\d+ (\S+) @0> \(size=(\d+),offset=\d+\): (\S+)",
                            line)) and current is not None:
      allocations[current][2].append((match[1], int(match[2]), match[3].split("{")[0]))
  temp = max((a for a in allocations.values() if a[1]), key=lambda a: a[0])
  start = live_range.index("  BufferLiveRange:")
  ranges = {}
  for line in live_range[start + 1:]:
    if not (match := re.match(r"\s+(\S+?)(?:\{\})?:(\d+)-(\d+)", line)):
      break
    ranges[match[1]] = (int(match[2]), int(match[3]))
  values = [(size, shape, ranges[name]) for name, size, shape in temp[2] if name in ranges]
  usage = collections.Counter()
  for size, _, (first, last) in values:
    for t in range(first, last + 1):
      usage[t] += size
  peak = max(usage, key=usage.get)
  by_shape = collections.Counter()
  for size, shape, (first, last) in values:
    if first <= peak <= last:
      by_shape[shape] += size
  return dict(by_shape.most_common())


def measure(preset: str, num_micro_batches: int = 4) -> dict:
  config = models.get_config(preset)
  loss_fn, params = harness.split_model(config)
  micro_batch = harness.abstract_batch(config, 1, None)
  micro_batches = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((num_micro_batches, *x.shape), x.dtype), micro_batch)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  result = {"preset": preset, "param_bytes": param_bytes}
  for name, (fn, donate) in programs(loss_fn).items():
    before = set(os.listdir(DUMP))
    args = (params, micro_batch) if name == "grad" else (
        params, params, params, micro_batches if name == "step" else micro_batch)
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    dumped = sorted(f for f in set(os.listdir(DUMP)) - before
                    if f.endswith("after_optimizations-live-range.txt"))
    peak = live_at_peak(str(Path(DUMP) / dumped[-1].removesuffix("-live-range.txt")))
    result[name] = {
        "temp_p": compiled.memory_analysis().temp_size_in_bytes / param_bytes,
        "live_at_peak_p": {shape: size / param_bytes for shape, size in peak.items()
                           if size / param_bytes >= 0.01},
    }
  return result


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["bert_base"])
  parser.add_argument("--json", type=Path, help="write the results here")
  args = parser.parse_args(argv)
  results = []
  for preset in args.presets:
    result = measure(preset)
    results.append(result)
    print(f"{preset}: temp grad {result['grad']['temp_p']:.3f} P, fold "
          f"{result['fold']['temp_p']:.3f} P, step {result['step']['temp_p']:.3f} P")
    for name in ("grad", "fold", "step"):
      shapes = ", ".join(f"{shape} {p:.2f}" for shape, p in result[name]["live_at_peak_p"].items())
      print(f"  live at {name}'s peak (P): {shapes}")
  if args.json:
    args.json.write_text(json.dumps(results, indent=1))
  return results


if __name__ == "__main__":
  main()
