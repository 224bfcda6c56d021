"""Compile-only step memory of each AdamA estimator, in units of P.

    PYTHONPATH=. python benchmarks/estimator_memory.py --presets gpt_test gpt2_small

`microbatch_step` with `adama(nu_estimator=...)`, N = 4, unrolled layers, no remat,
`memory_analysis()` on the default backend. "split" takes each micro-batch as its two
halves, so the batch must give micro-batches of an even size (default 8: 2 sequences).
"""

import argparse

import jax
from flax import nnx

import models
import optax_adama
from models import bench


def estimator_totals(preset: str, batch_size: int, num_micro_batches: int = 4) -> dict[str, int]:
  """Compiled total bytes of one step per estimator."""
  config = models.get_config(preset)
  model = nnx.eval_shape(lambda: models.create(config, rngs=nnx.Rngs(0)))
  loss_fn, params = models.split_loss_fn(model)
  batch = bench.abstract_batch(config, batch_size, None)
  totals = {}
  for estimator in optax_adama.NU_ESTIMATORS:
    tx = optax_adama.adama(1e-3, num_micro_batches=num_micro_batches, nu_estimator=estimator)
    step = optax_adama.microbatch_step(loss_fn, tx)
    report = optax_adama.memory_report(step, params, jax.eval_shape(tx.init, params), batch)
    totals[estimator] = report.total_bytes
  return totals


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["gpt_test"])
  parser.add_argument("--batch-size", type=int, default=8)
  args = parser.parse_args()
  for preset in args.presets:
    totals = estimator_totals(preset, args.batch_size)
    params = nnx.eval_shape(lambda: models.create(models.get_config(preset), rngs=nnx.Rngs(0)))
    param_bytes = optax_adama.tree_bytes(nnx.state(params, nnx.Param))
    print(preset, " ".join(f"{name} {total / param_bytes:.3f} P ({total:,} B)"
                           for name, total in totals.items()))


if __name__ == "__main__":
  main()
