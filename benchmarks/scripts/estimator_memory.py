"""Compile-only step memory of each AdamA estimator, in units of P.

    PYTHONPATH=. python benchmarks/scripts/estimator_memory.py --presets gpt_test gpt2_small
    PYTHONPATH=. python benchmarks/scripts/estimator_memory.py --presets gpt2_small \
        --scan-layers --remat full [--loss-chunks 8]

`adama(nu_estimator=...)`, N = 4, `memory_analysis()` on the default backend.
Unrolled layers: `microbatch_step`. With `--scan-layers` the layers are stacked
under one scan and each estimator is compiled twice: `microbatch_step`
("fused", where the stack's gradient is one leaf) and `release_step`
("release", one layer's gradient at a time). "split" takes each micro-batch as
its two halves, so the batch must give micro-batches of an even size (default
8: 2 sequences).
"""

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import models
import optax_adama
from models import harness


def estimator_totals(preset: str, batch_size: int, num_micro_batches: int = 4, *,
                     scan_layers: bool = False, remat: str = "none",
                     estimators: Sequence[str] = optax_adama.contrib.NU_ESTIMATORS,
                     **overrides) -> dict[str, int]:
  """Compiled total bytes of one step per estimator (and step, if scanned).

  Keys are the estimator names, and with ``scan_layers`` also
  ``"<estimator>/release"`` for :func:`optax_adama.release_step`.
  ``overrides``: other config fields (``num_layers=6``).
  """
  config = models.get_config(preset, scan_layers=scan_layers, remat=remat, **overrides)
  model = nnx.eval_shape(lambda: models.create(config, rngs=nnx.Rngs(0)))
  if scan_layers:
    loss_fn, params = models.staged_loss(model)
  else:
    loss_fn, params = models.split_loss_fn(model)
  batch = harness.abstract_batch(config, batch_size, None)
  totals = {}
  for estimator in estimators:
    tx = optax_adama.contrib.adama(1e-3, num_micro_batches=num_micro_batches,
                                   nu_estimator=estimator)
    state = jax.eval_shape(tx.init, params)
    steps = {estimator: optax_adama.microbatch_step(loss_fn, tx)}
    if scan_layers:
      steps[f"{estimator}/release"] = optax_adama.release_step(loss_fn, tx)
    for name, step in steps.items():
      totals[name] = optax_adama.memory_report(step, params, state, batch).total_bytes
  return totals


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["gpt_test"])
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--scan-layers", action="store_true",
                      help="stack the layers under one scan; compile release_step too")
  parser.add_argument("--remat", default="none", help="the models' remat policy")
  parser.add_argument("--loss-chunks", type=int, default=1,
                      help="gpt presets: the LM head's loss over this many chunks of tokens")
  parser.add_argument("--dtype", choices=models.COMPUTE_DTYPES, default="float32",
                      help="compute dtype (params and moments float32)")
  parser.add_argument("--estimators", nargs="+", default=list(optax_adama.contrib.NU_ESTIMATORS),
                      choices=("auto",) + optax_adama.contrib.NU_ESTIMATORS)
  args = parser.parse_args()
  for preset in args.presets:
    totals = estimator_totals(preset, args.batch_size, scan_layers=args.scan_layers,
                              remat=args.remat, estimators=args.estimators,
                              dtype=jnp.dtype(args.dtype),
                              **({"loss_chunks": args.loss_chunks}
                                 if args.loss_chunks != 1 else {}))
    params = nnx.eval_shape(lambda: models.create(models.get_config(preset), rngs=nnx.Rngs(0)))
    param_bytes = optax_adama.memory.tree_bytes(nnx.state(params, nnx.Param))
    print(preset)
    for name, total in totals.items():
      print(f"  {name:<18} {total / param_bytes:.3f} P ({total:,} B)")


if __name__ == "__main__":
  main()
