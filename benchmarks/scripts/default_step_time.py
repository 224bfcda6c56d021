"""Step time of AdamA's "momentum" estimator against "mean" (the default).

    PYTHONPATH=. python benchmarks/scripts/default_step_time.py \
        --presets gpt_tiny bert_tiny vit_tiny

"momentum" (the default until "mean" replaced it;
benchmarks/results/step_time/default_step_time.md
was made then) folds g^2 / N^2 per micro-batch, as "mean" folds g^2 / N, and adds
(1 - 1/N) m_hat^2 once per mini-batch; this measures what that term costs.
Each preset, N = 4 micro-batches of ``--micro-batch-size`` examples, through
``microbatch_step`` (unrolled layers) and ``release_step`` (scanned layers):
median step time over ``--rounds`` interleaved rounds of ``--steps-per-round``
steps (round 0 warms up, untimed), so a drift of the machine hits both alike.
Writes ``--json`` and ``--markdown``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import models
import optax_adama
from models import harness

# None: the library's default, as a user gets it (adama() without the argument).
ESTIMATORS = (None, "momentum")
DEFAULT = harness.DEFAULT_NU_ESTIMATOR
OTHER = ESTIMATORS[1]


def _compiled_steps(preset: str, micro_batch_size: int, num_micro_batches: int):
  """{(step kind, estimator): [compiled, params, state]} and the batch."""
  runners, batch = {}, None
  for kind, scan in (("microbatch_step", False), ("release_step", True)):
    config = models.get_config(preset, scan_layers=scan, remat="full" if scan else "none")
    model = models.create(config, rngs=nnx.Rngs(0))
    loss_fn, params = (models.staged_loss if scan else models.split_loss_fn)(model)
    batch = harness.random_batch(
        config, harness.abstract_batch(config, micro_batch_size * num_micro_batches, None))
    for estimator in ESTIMATORS:
      chosen = {} if estimator is None else {"nu_estimator": estimator}
      tx = optax_adama.adama(1e-4, num_micro_batches=num_micro_batches, **chosen)
      make = optax_adama.release_step if scan else optax_adama.microbatch_step
      step = make(loss_fn, tx)
      p = jax.tree.map(jnp.array, params)
      state = tx.init(p)
      runners[(kind, estimator)] = [step.lower(p, state, batch).compile(), p, state, batch]
  return runners


def time_preset(preset: str, micro_batch_size: int, num_micro_batches: int, rounds: int,
                steps_per_round: int, progress: bool = True) -> list[dict]:
  runners = _compiled_steps(preset, micro_batch_size, num_micro_batches)
  times = {key: [] for key in runners}
  with tqdm(total=rounds * len(runners), desc=preset, disable=not progress,
            file=sys.stderr) as bar:
    for round_index in range(rounds + 1):
      for key, runner in runners.items():
        compiled, params, state, batch = runner
        start = time.perf_counter()
        for _ in range(steps_per_round):
          params, state, metrics = compiled(params, state, batch)
        jax.block_until_ready((params, state, metrics))
        runner[1:3] = [params, state]
        if round_index:
          times[key].append((time.perf_counter() - start) / steps_per_round)
          bar.update()
  rows = []
  for kind in ("microbatch_step", "release_step"):
    default, other = (float(np.median(times[(kind, e)])) for e in ESTIMATORS)
    rows.append({"preset": preset, "step": kind, "num_micro_batches": num_micro_batches,
                 "micro_batch_size": micro_batch_size, "default": DEFAULT,
                 "default_s": default, "estimator": OTHER, "estimator_s": other,
                 "ratio": other / default, "rounds": rounds,
                 "steps_per_round": steps_per_round})
  return rows


def markdown(rows: list[dict], command: str) -> str:
  lines = [
      f"# Step time of \"{OTHER}\" against the default (\"{DEFAULT}\", CPU)", "",
      f"    {command}", "",
      f"{harness.machine_info()['cpu']}, jax {jax.__version__}; median of interleaved rounds.",
      "`microbatch_step`: unrolled layers, no remat; `release_step`: scanned, remat full.", "",
      f"| preset | step | N x examples | default (`\"{DEFAULT}\"`) ms | `\"{OTHER}\"` ms "
      f"| {OTHER} / default |",
      "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['preset']} | `{r['step']}` | {r['num_micro_batches']} x {r['micro_batch_size']} "
        f"| {1e3 * r['default_s']:.1f} | {1e3 * r['estimator_s']:.1f} | {r['ratio']:.3f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["gpt_tiny"])
  parser.add_argument("--micro-batch-size", type=int, default=8)
  parser.add_argument("--num-micro-batches", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps-per-round", type=int, default=3)
  parser.add_argument("--json", type=Path, default=None)
  parser.add_argument("--markdown", type=Path, default=None)
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  rows = [row for preset in args.presets for row in time_preset(
      preset, args.micro_batch_size, args.num_micro_batches, args.rounds,
      args.steps_per_round, progress=not args.no_progress)]
  command = "PYTHONPATH=. python benchmarks/scripts/default_step_time.py " + " ".join(
      argv if argv is not None else sys.argv[1:])
  table = markdown(rows, command)
  print(table)
  if args.json:
    args.json.write_text(json.dumps({"command": command, "machine": harness.machine_info(),
                                     "rows": rows}, indent=1))
  if args.markdown:
    args.markdown.write_text(table)


if __name__ == "__main__":
  main()
