"""AdamA's second-moment estimators on the per-update path, as a Flax user meets them.

    python benchmarks/scripts/per_update_estimators.py --seeds 0 1 2 3 4 --steps 300

Flax NNX's data-parallel toy example (flax/examples/nnx_toy_examples/
04_data_parallel_with_jit.py), rebuilt here on one device: ``MLP(1, 64, 1)``,
two ``nnx.Linear`` layers with a ReLU between them, mean squared error on
x ~ U[-2, 2], y = 0.8 x^2 + 0.1 + N(0, 0.1^2), 16 examples per batch, Adam at
1e-2. Here each of those batches is a micro-batch, N = 4 of them make a
mini-batch, and every arm is trained through
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` with one
``optimizer.update(model, grads)`` call per micro-batch gradient:

- ``multisteps``: ``optax.MultiSteps(optax.adamw(lr), every_k_schedule=N)``,
  Adam with gradient accumulation;
- ``mean``, ``sum``, ``momentum``: ``optax_adama.contrib.adamaw(lr, num_micro_batches=N,
  nu_estimator=...)`` ("split" needs the micro-batch's half difference, which
  this path does not pass).

Every arm on a seed starts from the same weights (``nnx.Rngs(seed)``) and sees
the same micro-batches in the same order (``np.random.default_rng(seed)``);
weight decay is both optimizers' default, 1e-4, applied once per mini-batch.
Each run reports its training loss (the mean of the micro-batch losses, each
taken before its update, over the last 10 mini-batches), its held-out loss on
one fixed set (``--heldout-size`` examples drawn from ``--heldout-seed``, the
same for every run) and its function error there (mean squared distance to the
noiseless 0.8 x^2 + 0.1: the held-out loss less the noise, which the relative
gaps of the held-out loss dilute). Gaps are AdamA's against ``multisteps`` on
the same seed and rate, in percent, and their median over seeds.

The rates run beyond those two, to find each arm's best (5 rates, 100 runs):

    python benchmarks/scripts/per_update_estimators.py --seeds 0 1 2 3 4 --steps 300 \
        --learning-rates 1e-2 2e-2 4e-2 8e-2 1.6e-1 \
        --json benchmarks/results/convergence/raw/per_update_estimators_rate_grid.json \
        --markdown benchmarks/results/convergence/per_update_estimators_rate_grid.md

Writes ``--json`` (every run, with its loss curve per mini-batch) and
``--markdown`` (the command, the machine, the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_adama

ROOT = Path(__file__).resolve().parents[2]
# The result pages and their raw rows.
RESULTS = ROOT / "benchmarks" / "results" / "convergence"
BASELINE = "multisteps"
ESTIMATORS = ("mean", "sum", "momentum")
ARMS = (BASELINE, *ESTIMATORS)


class MLP(nnx.Module):
  """The toy example's model: Linear, ReLU, Linear."""

  def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
    self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

  def __call__(self, x):
    return self.linear2(nnx.relu(self.linear1(x)))


def target(x: np.ndarray) -> np.ndarray:
  return 0.8 * x**2 + 0.1


def draw(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
  """`size` examples of the toy's data: x ~ U[-2, 2], y = 0.8 x^2 + 0.1 + N(0, 0.1^2)."""
  x = rng.uniform(-2.0, 2.0, size=(size, 1))
  y = target(x) + rng.normal(0.0, 0.1, size=x.shape)
  return x.astype(np.float32), y.astype(np.float32)


def make_tx(arm: str, learning_rate: float, num_micro_batches: int):
  if arm == BASELINE:
    return optax.MultiSteps(optax.adamw(learning_rate), every_k_schedule=num_micro_batches)
  return optax_adama.contrib.adamaw(learning_rate, num_micro_batches=num_micro_batches,
                            nu_estimator=arm)


def mse(model: MLP, x, y):
  return jnp.mean((y - model(x)) ** 2)


@nnx.jit
def train_micro_batch(model: MLP, optimizer: nnx.Optimizer, x, y):
  loss, grads = nnx.value_and_grad(mse)(model, x, y)
  with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int
    optimizer.update(model, grads)
  return loss


@nnx.jit
def evaluate(model: MLP, x, y, clean_y):
  prediction = model(x)
  return jnp.mean((y - prediction) ** 2), jnp.mean((clean_y - prediction) ** 2)


def train(arm: str, learning_rate: float, seed: int, *, steps: int, num_micro_batches: int,
          micro_batch_size: int, heldout) -> dict:
  """One run: `steps` mini-batches of one arm, one `optimizer.update` per micro-batch."""
  start = time.perf_counter()
  model = MLP(1, 64, 1, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, make_tx(arm, learning_rate, num_micro_batches),
                            wrt=nnx.Param)
  rng = np.random.default_rng(seed)
  curve = []
  for _ in range(steps):
    x, y = draw(rng, num_micro_batches * micro_batch_size)
    losses = [train_micro_batch(model, optimizer,
                                x[i * micro_batch_size:(i + 1) * micro_batch_size],
                                y[i * micro_batch_size:(i + 1) * micro_batch_size])
              for i in range(num_micro_batches)]
    curve.append(float(np.mean(jax.device_get(losses))))
  heldout_loss, function_error = (float(v) for v in evaluate(model, *heldout))
  return {
      "arm": arm, "learning_rate": learning_rate, "seed": seed, "steps": steps,
      "train_loss": float(np.mean(curve[-10:])),
      "last_mini_batch_loss": curve[-1],
      "heldout_loss": heldout_loss,
      "heldout_function_error": function_error,
      "finite": bool(np.isfinite(curve).all() and np.isfinite(heldout_loss)),
      "update_calls": int(optimizer.step[...]),
      "seconds": time.perf_counter() - start,
      "curve": [round(v, 7) for v in curve],
  }


def gap(value: float, reference: float) -> float:
  return 100.0 * (value / reference - 1.0)


def add_gaps(rows: list[dict]) -> None:
  """Each AdamA run's gaps to the baseline of its seed and rate, in percent."""
  base = {(r["seed"], r["learning_rate"]): r for r in rows if r["arm"] == BASELINE}
  for row in rows:
    reference = base.get((row["seed"], row["learning_rate"]))
    if row["arm"] == BASELINE or reference is None:
      continue
    row["gap_pct"] = {key: gap(row[key], reference[key])
                      for key in ("train_loss", "heldout_loss", "heldout_function_error")}


def summarize(rows: list[dict]) -> list[dict]:
  """Per rate and arm: medians over seeds and per-seed ranges."""
  out = []
  for rate in sorted({r["learning_rate"] for r in rows}):
    for arm in ARMS:
      runs = [r for r in rows if r["arm"] == arm and r["learning_rate"] == rate]
      if not runs:
        continue
      entry = {"arm": arm, "learning_rate": rate, "seeds": [r["seed"] for r in runs]}
      for key in ("train_loss", "heldout_loss", "heldout_function_error"):
        values = [r[key] for r in runs]
        entry[key] = {"median": statistics.median(values), "min": min(values),
                      "max": max(values)}
        gaps = [r["gap_pct"][key] for r in runs if "gap_pct" in r]
        if gaps:
          entry[f"gap_pct_{key}"] = {"median": statistics.median(gaps), "min": min(gaps),
                                     "max": max(gaps), "per_seed": gaps}
      out.append(entry)
  return out


def best_rates(rows: list[dict]) -> list[dict]:
  """Each arm at its best rate of those run (lowest median held-out loss over seeds),
  with the paired gaps to the baseline at the baseline's best rate."""
  rates = sorted({r["learning_rate"] for r in rows})

  def median_heldout(arm, rate):
    values = [r["heldout_loss"] for r in rows if r["arm"] == arm and r["learning_rate"] == rate]
    return statistics.median(values) if values else float("inf")

  best = {arm: min(rates, key=lambda rate: median_heldout(arm, rate)) for arm in ARMS
          if any(r["arm"] == arm for r in rows)}
  if BASELINE not in best:
    return []
  base = {r["seed"]: r for r in rows
          if r["arm"] == BASELINE and r["learning_rate"] == best[BASELINE]}
  out = []
  for arm, rate in best.items():
    runs = [r for r in rows if r["arm"] == arm and r["learning_rate"] == rate
            and r["seed"] in base]
    entry = {"arm": arm, "learning_rate": rate,
             "heldout_loss": statistics.median(r["heldout_loss"] for r in runs)}
    if arm != BASELINE:
      gaps = [gap(r["heldout_loss"], base[r["seed"]]["heldout_loss"]) for r in runs]
      entry["gap_pct_heldout_loss"] = {"median": statistics.median(gaps), "min": min(gaps),
                                       "max": max(gaps)}
    out.append(entry)
  return out


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  import flax
  return (f"{cpu}, {os.cpu_count()} cores visible, JAX backend "
          f"{jax.default_backend()} ({jax.device_count()} device); python "
          f"{platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, "
          f"optax {optax.__version__}")


def _range(stats: dict, fmt: str) -> str:
  return f"{stats['median']:{fmt}} ({stats['min']:{fmt}} to {stats['max']:{fmt}})"


def markdown(result: dict) -> str:
  s = result["settings"]
  rates = " and ".join(f"{r:g}" for r in s["learning_rates"])
  lines = [
      "# AdamA's estimators through `nnx.Optimizer`: one update per micro-batch gradient",
      "",
      f"`{result['command']}`",
      "",
      f"Machine: {result['machine']}. Wall time {result['seconds']:.0f} s.",
      "",
      "Flax NNX's data-parallel toy example (`MLP(1, 64, 1)`, ReLU, mean squared error, "
      "x ~ U[-2, 2], y = 0.8 x^2 + 0.1 + N(0, 0.1^2)), "
      f"{s['micro_batch_size']} examples per micro-batch, N = {s['num_micro_batches']} "
      f"micro-batches per mini-batch, {s['steps']} mini-batches, seeds "
      f"{', '.join(map(str, s['seeds']))}, learning rates {rates} (the toy's Adam rate "
      "and twice it) for every arm, constant. Each arm is "
      "`nnx.Optimizer(model, tx, wrt=nnx.Param)` with one `optimizer.update(model, grads)` "
      f"per micro-batch: `{BASELINE}` is "
      f"`optax.MultiSteps(optax.adamw(lr), every_k_schedule={s['num_micro_batches']})`, the "
      "others `optax_adama.contrib.adamaw(lr, num_micro_batches=N, nu_estimator=...)`; weight "
      "decay 1e-4 (both defaults). Same initial weights and micro-batches per seed for every arm.",
      "",
      "Training loss: the mean of the micro-batch losses (each before its update) over "
      "the last 10 mini-batches. Held-out loss: one fixed set of "
      f"{s['heldout_size']} examples (seed {s['heldout_seed']}); its noise floor (the "
      f"noiseless target's loss there) is {result['heldout_noise_floor']:.5f}. Function "
      "error: the held-out mean squared distance to the noiseless 0.8 x^2 + 0.1, i.e. the "
      "learnable part of the held-out loss. Gaps: AdamA against the baseline on the same "
      "seed and rate, in percent (negative: AdamA lower); median over seeds, then the "
      "per-seed range.",
      "",
      "## Medians over seeds (per-seed range in parentheses)",
      "",
      "| rate | arm | held-out loss | held-out gap | function error gap | training loss "
      "| training gap |",
      "|---|---|---|---|---|---|---|",
  ]
  for e in result["summary"]:
    cells = [f"{e['learning_rate']:g}", f"`{e['arm']}`", _range(e["heldout_loss"], ".5f")]
    for key in ("heldout_loss", "heldout_function_error"):
      g = e.get(f"gap_pct_{key}")
      cells.append(_range(g, "+.2f") + " %" if g else "")
    cells.append(_range(e["train_loss"], ".5f"))
    g = e.get("gap_pct_train_loss")
    cells.append(_range(g, "+.2f") + " %" if g else "")
    lines.append("| " + " | ".join(cells) + " |")
  if result["best_rates"]:
    lines += [
        "",
        "## Each arm at its best rate",
        "",
        "Per arm, the rate (of those run) with the lowest median held-out loss over seeds; "
        "gaps paired by seed against the baseline at its own best rate. A best rate at "
        "the edge of the rates run may not be the arm's best.",
        "",
        "| arm | rate | median held-out loss | held-out gap |",
        "|---|---|---|---|",
    ]
    for e in result["best_rates"]:
      g = e.get("gap_pct_heldout_loss")
      lines.append(f"| `{e['arm']}` | {e['learning_rate']:g} | {e['heldout_loss']:.5f} | "
                   + (_range(g, "+.2f") + " %" if g else "") + " |")
  lines += [
      "",
      "## Every run",
      "",
      "| seed | rate | arm | training loss | held-out loss | function error | held-out gap "
      "| function error gap | training gap |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in sorted(result["rows"],
                  key=lambda r: (r["learning_rate"], r["seed"], ARMS.index(r["arm"]))):
    g = r.get("gap_pct", {})
    gaps = [f"{g[k]:+.2f} %" if k in g else ""
            for k in ("heldout_loss", "heldout_function_error", "train_loss")]
    lines.append(f"| {r['seed']} | {r['learning_rate']:g} | `{r['arm']}` | "
                 f"{r['train_loss']:.5f} | {r['heldout_loss']:.5f} | "
                 f"{r['heldout_function_error']:.5f} | " + " | ".join(gaps) + " |")
  return "\n".join(lines) + "\n"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  parser.add_argument("--steps", type=int, default=300, help="mini-batches per run")
  parser.add_argument("--learning-rates", type=float, nargs="+", default=[1e-2, 2e-2])
  parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
  parser.add_argument("--num-micro-batches", type=int, default=4)
  parser.add_argument("--micro-batch-size", type=int, default=16)
  parser.add_argument("--heldout-size", type=int, default=4096)
  parser.add_argument("--heldout-seed", type=int, default=10_000)
  parser.add_argument("--json", type=Path,
                      default=RESULTS / "raw" / "per_update_estimators.json")
  parser.add_argument("--markdown", type=Path, default=RESULTS / "per_update_estimators.md")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.num_micro_batches < 1 or args.micro_batch_size < 1:
    parser.error("--steps, --num-micro-batches and --micro-batch-size must be positive")
  return args


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  start = time.perf_counter()
  heldout_x, heldout_y = draw(np.random.default_rng(args.heldout_seed), args.heldout_size)
  clean_y = target(heldout_x.astype(np.float64)).astype(np.float32)
  heldout = (heldout_x, heldout_y, clean_y)
  rows = []
  runs = [(rate, seed, arm) for rate in args.learning_rates for seed in args.seeds
          for arm in args.arms]
  for i, (rate, seed, arm) in enumerate(runs, 1):
    row = train(arm, rate, seed, steps=args.steps, num_micro_batches=args.num_micro_batches,
                micro_batch_size=args.micro_batch_size, heldout=heldout)
    rows.append(row)
    print(f"[{i}/{len(runs)}] lr {rate:g} seed {seed} {arm:>10}: train {row['train_loss']:.5f}"
          f"  held-out {row['heldout_loss']:.5f}  ({row['seconds']:.1f} s)", flush=True)
  add_gaps(rows)
  result = {
      "command": "python benchmarks/scripts/per_update_estimators.py " + shlex.join(argv),
      "machine": machine(),
      "settings": {"seeds": args.seeds, "steps": args.steps,
                   "learning_rates": args.learning_rates, "arms": args.arms,
                   "num_micro_batches": args.num_micro_batches,
                   "micro_batch_size": args.micro_batch_size,
                   "heldout_size": args.heldout_size, "heldout_seed": args.heldout_seed,
                   "model": "MLP(1, 64, 1): nnx.Linear, relu, nnx.Linear",
                   "data": "x ~ U[-2, 2], y = 0.8 x^2 + 0.1 + N(0, 0.1^2)",
                   "weight_decay": 1e-4},
      "heldout_noise_floor": float(np.mean((heldout_y - clean_y) ** 2)),
      "rows": rows,
      "summary": summarize(rows),
      "best_rates": best_rates(rows),
      "seconds": time.perf_counter() - start,
  }
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(result, indent=1) + "\n")
  args.markdown.parent.mkdir(parents=True, exist_ok=True)
  args.markdown.write_text(markdown(result))
  print(f"wrote {args.json} and {args.markdown} ({result['seconds']:.0f} s)")
  return result


if __name__ == "__main__":
  main()
