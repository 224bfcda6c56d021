"""GPU step time of AdamA's second-moment estimators and 8-bit moments.

    PYTHONPATH=. python benchmarks/scripts/gpu_estimator_step_time.py   # on a GPU machine

gpt2_small, N = 4 micro-batches of one 1,024-token sequence, unrolled and
scanned blocks: scan accumulation (`optax.adam`), AdamA with the "mean" and
"momentum" estimators, each with float32 and 8-bit block moments, and on the
scanned stack the gradient-release step. Compile-only memory
(`memory_analysis()`) and median step time over 7 interleaved rounds of 3
steps. Writes `$OUT/variants.json` (or /tmp). Results:
benchmarks/results/gpu/raw/gpu_estimator_step_time_h100.json.
"""
import json
import os
import time

import jax
import numpy as np
from flax import nnx

import models
import optax_adama
from models import harness


def build(case, method, lr=1e-4):
  preset, n, scan = case
  config = models.get_config(preset, scan_layers=scan)
  model = models.create(config, rngs=nnx.Rngs(0))
  release = method == "release"
  loss_fn, params = (models.staged_loss if release else models.split_loss_fn)(model)
  batch = harness.random_batch(config, harness.abstract_batch(config, n, None))
  if method == "scan_accumulation":
    step, tx = harness.make_step("scan_accumulation", loss_fn, num_micro_batches=n)
  elif release:
    tx = optax_adama.adama(lr, num_micro_batches=n)
    step = optax_adama.release_step(loss_fn, tx)
  else:
    storage, estimator = method.split(":")
    quantization = optax_adama.BlockQuantization() if storage == "8bit" else None
    tx = optax_adama.contrib.adama(lr, num_micro_batches=n, nu_estimator=estimator,
                           quantization=quantization)
    step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=n)
  state = tx.init(params)
  start = time.perf_counter()
  compiled = step.lower(params, state, batch).compile()
  compile_s = time.perf_counter() - start
  report = optax_adama.memory_report(compiled, param_bytes=optax_adama.memory.tree_bytes(params))
  return dict(compiled=compiled, params=params, state=state, batch=batch, compile_s=compile_s,
              total_P=report.total_bytes / report.param_bytes, total_bytes=report.total_bytes)


def main():
  preset = "gpt_test" if os.environ.get("DRY") else "gpt2_small"
  methods = ["scan_accumulation", "float32:mean", "float32:momentum", "8bit:mean",
             "8bit:momentum"]
  cases = {(preset, 4, False): methods, (preset, 4, True): methods + ["release"]}
  out = {}
  for case, case_methods in cases.items():
    runners = {m: build(case, m) for m in case_methods}
    times = {m: [] for m in case_methods}
    for round_index in range(8):  # round 0 warms up
      for m in case_methods:
        r = runners[m]
        start = time.perf_counter()
        for _ in range(3):
          r["params"], r["state"], metrics = r["compiled"](r["params"], r["state"], r["batch"])
        jax.block_until_ready((r["params"], r["state"], metrics))
        if round_index:
          times[m].append((time.perf_counter() - start) / 3)
    reference = np.median(times["scan_accumulation"])
    for m in case_methods:
      median = float(np.median(times[m]))
      print(f"{case} {m:20s} {1e3 * median:7.2f} ms {100 * (median / reference - 1):+6.2f}% "
            f"{runners[m]['total_P']:.3f} P compile {runners[m]['compile_s']:.1f}s", flush=True)
      out[f"{case}|{m}"] = dict(median_s=median, all_s=times[m], total_P=runners[m]["total_P"],
                               total_bytes=runners[m]["total_bytes"],
                               compile_s=runners[m]["compile_s"])
  path = os.path.join(os.environ.get("OUT", "/tmp"), "variants.json")
  with open(path, "w") as f:
    json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "results": out}, f, indent=1)


if __name__ == "__main__":
  main()
