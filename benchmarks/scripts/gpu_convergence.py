"""At scale, on a GPU: GPT-2 small (and a Llama of its size) trained with AdamA
against Adam + accumulation.

    # on the GPU machine, one run at a time (two processes each preallocate
    # 75% of the card and the second runs out of memory while autotuning):
    A="--model gpt --preset gpt2_small --dtype bfloat16 --batch-size 32 \
       --seq-len 256 --steps 2000 --learning-rate 6e-4 --warmup-steps 100 \
       --max-bytes 100000000 --eval-batches 32 --no-progress"
    python -m models.train $A --num-micro-batches 4 --optimizer adam \
        --metrics-out gpu_gpt2_small_adam.json
    python -m models.train $A --num-micro-batches 4 --optimizer adama \
        --nu-estimator mean --metrics-out gpu_gpt2_small_adama_mean.json
    #   ... and --nu-estimator momentum (gpu_gpt2_small_adama_momentum.json) and
    #   --nu-estimator auto (gpu_gpt2_small_adama.json, the default then); at N = 8
    #   the same with --num-micro-batches 8: gpu_gpt2_small_n8_adam.json,
    #   n8_adama_mean.json (--nu-estimator mean) and n8_adama.json (--nu-estimator
    #   momentum, the default then)
    # here: the table and the curves from the raw runs
    PYTHONPATH=. python benchmarks/scripts/gpu_convergence.py

    # more seeds and mini-batches: Adam + accumulation, then the default, one
    # after the other (the N = 8 runs above: 115-126 s of loop and 20-23 s of
    # compile each, at 32 sequences on one H100)
    make gpu-convergence PYTHON=python3 GPU_N=8 GPU_BATCH=64 GPU_SEED=1 GPU_OUT=$OUT
    #   -> gpu_gpt2_small_n8_b64_seed1_adam.json and ..._adama.json, copied into
    #   benchmarks/results/gpu/raw/: every such pair becomes a cell of its own here
    # the same pair on another preset, its cells its own (raw names carry it):
    make gpu-convergence PYTHON=python3 GPU_PRESET=llama_small GPU_SEED=0 GPU_OUT=$OUT
    #   -> gpu_llama_small_n8_b32_seed0_adam.json and ..._adama.json

GPT-2 small (124M) on the offline corpus (Python's standard library, bytes),
bf16 compute with float32 params and moments, sequences of 256 tokens, 2,000
steps, warm-up + cosine from 6e-4. The commands above: 32 sequences per step
(8,192 tokens) in N = 4 or 8 micro-batches, seed 0; `make gpu-convergence`:
GPU_BATCH sequences in GPU_N micro-batches, seed GPU_SEED. Adam +
accumulation is the same mini-batch step at either N (up to the order of the
micro-batch sums), so its two seed-0 runs measure how far one run of the
same math moves by rounding alone. `GPU_PRESET=llama_small` trains
`models.llama`'s preset of GPT-2 small's size (RMSNorm, rotary positions,
grouped-query attention, SwiGLU) with the same data, schedule and mini-batch.
"""

import argparse
import json
import re
import sys
from pathlib import Path

from models import harness

# (N, file stem, the plot's file name): Adam + accumulation first in each cell.
CELLS = (
    (4, ("adam", "adama", "adama_mean", "adama_momentum"), "gpu_convergence.png"),
    (8, ("n8_adam", "n8_adama", "n8_adama_mean"), "gpu_convergence_n8.png"),
)


# A pair `make gpu-convergence` writes: preset, N, sequences per step, seed.
EXTRA_RUN = re.compile(r"gpu_([a-z0-9_]+?)_n(\d+)_b(\d+)_seed(\d+)_adam\.json")
# The plots' and the title's names of the presets; others go by their own.
TITLES = {"gpt2_small": "GPT-2 small", "llama_small": "Llama (GPT-2 small's size)"}


def extra_cells(raw: Path):
  """Every (Adam + accumulation, default AdamA) pair of `make gpu-convergence`
  in ``raw``, as cells: ``(N, [adam, adama], plot name)``, by preset, N, batch, seed."""
  cells = []
  pairs = sorted(((match[1], *map(int, match.groups()[1:])), path)
                 for path in raw.glob("gpu_*_n*_b*_seed*_adam.json")
                 if (match := EXTRA_RUN.fullmatch(path.name)))
  for (preset, n, batch, seed), path in pairs:
    partner = path.with_name(path.name.replace("_adam.json", "_adama.json"))
    if not partner.exists():
      raise FileNotFoundError(f"{path.name} has no AdamA run beside it ({partner.name})")
    runs = [json.loads(path.read_text()), json.loads(partner.read_text())]
    if {r["preset"] for r in runs} != {preset}:
      raise ValueError(f"{path.name} and {partner.name} name {preset} but trained "
                       f"{sorted({r['preset'] for r in runs})}")
    cells.append((n, runs, f"gpu_convergence_{preset}_n{n}_b{batch}_seed{seed}.png"))
  return cells


def title(preset: str) -> str:
  return TITLES.get(preset, preset)


def run_name(run, n) -> str:
  """How a plot names its cell: gpt2_small's by N alone, as it always has."""
  preset = run["preset"]
  return f"N = {n}" if preset == "gpt2_small" else f"{preset}, N = {n}"


def label(run) -> str:
  config = run["config"]
  if config["optimizer"] != "adama":
    return "Adam + accumulation"
  if config["nu_estimator"] == "auto":
    return "AdamA 'auto' ('split' + floor; the default before 'momentum')"
  return f"AdamA nu_estimator={config['nu_estimator']!r}"


def device(run) -> str:
  return run["machine"]["device"]


def markdown(cells) -> str:
  """The table (one row per run, gaps against the cell's Adam) and the plots."""
  presets = {runs[0]["preset"]: runs[0]["param_count"] for _, runs, _ in cells}
  lines = [
      f"# At scale on a GPU: {' and '.join(map(title, presets))}, AdamA against Adam "
      "+ accumulation",
      "",
      ", ".join(f"`{p}` ({count:,} parameters)" for p, count in presets.items())
      + " on the offline corpus, "
      "bf16 compute with float32 params and moments, sequences of 256 tokens, N micro-batches "
      "of each row's tokens per step (N x tokens per micro-batch), 2,000 steps, warm-up "
      "(100) + cosine from 6e-4, one run each, at Adam's learning rate for every arm. "
      "Made by the commands "
      "in `benchmarks/scripts/gpu_convergence.py` (raw runs: `raw/gpu_<preset>_*.json`). Step "
      "times are not compared here (runs shared the card or ran on different ones); "
      "`make bench-gpu` times the steps.",
      "",
      "| preset | N | tokens / micro-batch | seed | run | device | held-out loss | vs Adam "
      "| final training loss (last 5%) | compiled step |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for n, runs, _ in cells:
    adam = runs[0]
    tokens = adam["config"]["batch_size"] * adam["config"]["seq_len"] // n
    for run in runs:
      gap = 100 * (run["eval_loss"] / adam["eval_loss"] - 1)
      memory = run["memory"]["total_bytes"] / run["memory"]["param_bytes"]
      lines.append(f"| {run['preset']} | {n} | {tokens:,} | {run['config']['seed']} "
                   f"| {label(run)} | {device(run)} "
                   f"| {run['eval_loss']:.4f} | {gap:+.2f}% "
                   f"| {run['final_train_loss']:.4f} | {memory:.2f} P |")
  # The first two cells are CELLS': gpt2_small's seed-0 Adam at N = 4 and 8.
  adams = [runs[0] for _, runs, _ in cells[:2]]
  floor = 100 * (adams[1]["eval_loss"] / adams[0]["eval_loss"] - 1)
  lines += ["", f"Adam + accumulation at N = {cells[1][0]} against N = {cells[0][0]} (the same "
            f"math summed in another order, on {device(adams[1])} against "
            f"{device(adams[0])}): {floor:+.2f}%.", ""]
  lines += [f"![training curves, {run_name(runs[0], n)}]({plot})" for n, runs, plot in cells]
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--raw", type=Path, default=Path("benchmarks/results/gpu/raw"))
  parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/gpu"),
                      help="where gpu_convergence.md and its plots are written")
  args = parser.parse_args(argv)
  cells = [(n, [json.loads((args.raw / f"gpu_gpt2_small_{stem}.json").read_text())
                for stem in stems], plot) for n, stems, plot in CELLS]
  cells += extra_cells(args.raw)
  for n, runs, plot in cells:
    tokens = runs[0]["config"]["batch_size"] * runs[0]["config"]["seq_len"] // n
    harness.plot_loss_curves(runs, label, args.out_dir / plot, log=True,
                             title=f"{title(runs[0]['preset'])}, bf16 compute, N = {n} x "
                                   f"{tokens:,} tokens, seed {runs[0]['config']['seed']}")
  markdown_path = args.out_dir / "gpu_convergence.md"
  markdown_path.write_text(markdown(cells))
  print(markdown_path.read_text())


if __name__ == "__main__":
  sys.exit(main())
