"""At scale, on a GPU: GPT-2 small trained with AdamA against Adam + accumulation.

    # on the GPU machine (two runs at a time share it; their speeds are not compared):
    A="--model gpt --preset gpt2_small --dtype bfloat16 --num-micro-batches 4 \
       --batch-size 32 --seq-len 256 --steps 2000 --learning-rate 6e-4 \
       --warmup-steps 100 --max-bytes 100000000 --eval-batches 32"
    python -m models.train $A --optimizer adam  --metrics-out gpu_gpt2_small_adam.json
    python -m models.train $A --optimizer adama --metrics-out gpu_gpt2_small_adama.json
    python -m models.train $A --optimizer adama --nu-estimator mean \
        --metrics-out gpu_gpt2_small_adama_mean.json   # and momentum
    # here: the table and the curves from the raw runs
    PYTHONPATH=. python benchmarks/gpu_convergence.py

GPT-2 small (124M) on the offline corpus (Python's standard library, bytes),
bf16 compute with float32 params and moments, N = 4 micro-batches of 8
sequences x 256 tokens, 2,000 steps, warm-up + cosine from 6e-4, seed 0.
"""

import argparse
import json
import sys
from pathlib import Path

from models import harness

RUNS = ("adam", "adama", "adama_mean", "adama_momentum")
def label(run) -> str:
  config = run["config"]
  if config["optimizer"] != "adama":
    return "Adam + accumulation"
  if config["nu_estimator"] == "auto":
    return "AdamA 'auto' ('split' + floor; the default then)"
  return f"AdamA nu_estimator={config['nu_estimator']!r}"


def markdown(runs, plot_path: Path) -> str:
  adam = runs[0]
  lines = [
      "# At scale on a GPU: GPT-2 small, AdamA against Adam + accumulation",
      "",
      f"`{adam['preset']}` ({adam['param_count']:,} parameters) on the offline corpus, "
      "bf16 compute with float32 params and moments, N = 4 micro-batches of 8 sequences "
      "x 256 tokens (8,192 tokens per step), 2,000 steps, warm-up (100) + cosine from "
      f"6e-4, seed 0, one run each, on {adam['machine']['device']}. Two runs shared the "
      "GPU at a time, so the step times are not comparable. Made by the commands in "
      "`benchmarks/gpu_convergence.py` (raw runs: `raw/gpu_gpt2_small_*.json`).",
      "",
      "| run | held-out loss | vs Adam | final training loss (last 5%) | compiled step |",
      "|---|---|---|---|---|",
  ]
  for run in runs:
    gap = 100 * (run["eval_loss"] / adam["eval_loss"] - 1)
    memory = run["memory"]["total_bytes"] / run["memory"]["param_bytes"]
    lines.append(f"| {label(run)} | {run['eval_loss']:.4f} | {gap:+.2f}% "
                 f"| {run['final_train_loss']:.4f} | {memory:.2f} P |")
  lines += ["", f"![training curves]({plot_path.name})", ""]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--raw", type=Path, default=Path("benchmarks/raw"))
  parser.add_argument("--plot", type=Path, default=Path("benchmarks/gpu_convergence.png"))
  parser.add_argument("--markdown", type=Path, default=Path("benchmarks/gpu_convergence.md"))
  args = parser.parse_args(argv)
  runs = [json.loads((args.raw / f"gpu_gpt2_small_{name}.json").read_text()) for name in RUNS]
  harness.plot_loss_curves(runs, label, args.plot, log=True,
                           title="GPT-2 small, bf16 compute, N = 4 x 2,048 tokens")
  args.markdown.write_text(markdown(runs, args.plot))
  print(args.markdown.read_text())


if __name__ == "__main__":
  sys.exit(main())
