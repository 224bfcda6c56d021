"""Compile-only memory of fine-tuning Llama 3.2 1B and Llama 3 8B, with the trainer's own step.

    .venv-gpu/bin/python benchmarks/scripts/finetune_memory.py --cases llama32_1b_24gb \\
        llama3_8b_80gb
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv-tpu/bin/python benchmarks/scripts/finetune_memory.py \\
        --cases llama3_8b_8x16gb
    python3 benchmarks/scripts/finetune_memory.py --plot-live RUN.json   # a live run's curve

Each case is a preset, a target (a machine compiled for without its devices,
`optax_adama.memory.parse_target`) and the run's settings. AdamA's step is
`models.harness.make_train_step` for a `TrainConfig` (bf16 compute, remat
"full", scanned layers, the gradient release, 8-bit moments where float32 ones
do not fit), on the target's mesh with FSDP where the case has several devices.
Gradient accumulation is the hand-written scan of `models.harness.baselines`
(`scan_accumulation`, `fsdp_scan_accumulation`) on the same model, dtypes,
remat and micro-batch. Every number is `memory_analysis()` of the program the
target's compiler made, per device; P is one float32 copy of the whole model's
params. The results go to `benchmarks/results/memory/raw/finetune_llama.json`
(one case updated at a time, so the GPU and TPU compilers can run apart) and
the table page `benchmarks/results/memory/finetune_llama.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "benchmarks" / "results" / "memory" / "raw" / "finetune_llama.json"
PAGE = ROOT / "benchmarks" / "results" / "memory" / "finetune_llama.md"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Case:
  """A fine-tuning run compiled for a target: the preset, the machine and the batch."""

  preset: str
  target: str  # an optax_adama.memory target name; "cpu": XLA's CPU backend (the smoke).
  micro_batch_size: int  # rows of one micro-batch, over all devices.
  seq_len: int
  num_micro_batches: int
  quantize_moments: bool  # AdamA's moments in 8-bit blocks.
  shard_states: str | None = None  # "fsdp" on a mesh; None on one device.
  why: str = ""  # why these settings, for the page.


CASES = {
    "llama32_1b_24gb": Case(
        "llama32_1b", "gpu:rtx4090", micro_batch_size=8, seq_len=1024, num_micro_batches=4,
        quantize_moments=False,
        why="float32 moments: params and both moments (3 P = 13.8 GiB) leave room for "
            "activations on a 24 GiB card, so nothing narrower is needed"),
    "llama3_8b_80gb": Case(
        "llama3_8b", "gpu:h100", micro_batch_size=2, seq_len=2048, num_micro_batches=8,
        quantize_moments=True,
        why="8-bit moments: float32 params and moments alone are 3 P = 89.7 GiB, over "
            "80 GB; 8-bit blocks make them 1.5 P"),
    "llama3_8b_8x16gb": Case(
        "llama3_8b", "tpu:v3-8", micro_batch_size=8, seq_len=2048, num_micro_batches=4,
        quantize_moments=True, shard_states="fsdp",
        why="a TPU v3-8 (16 GiB per core), the machine of the LLaMA-7B reports this "
            "project answered, compiled by libtpu; FSDP (each layer's params and moments "
            "split over the 8 cores) and 8-bit moments: float32 ones are 3 P / 8 = "
            "11.2 GiB a core before any activation"),
    # The smoke's: a tiny Llama on XLA's CPU backend, in seconds.
    "llama_test_cpu": Case(
        "llama_test", "cpu", micro_batch_size=2, seq_len=32, num_micro_batches=2,
        quantize_moments=True),
}


def methods_of(case: Case) -> tuple[str, ...]:
  """The steps compiled for ``case``. With 8-bit moments on one device, accumulation is
  also compiled with AdamA's moment storage (8-bit blocks) and a bfloat16 carry, as
  MaxText users run it; the baselines have no such step under FSDP."""
  narrow = case.quantize_moments and case.shard_states is None
  # Where the case picks 8-bit moments, AdamA with float32 ones shows why. On one
  # device also AdamA with `--clip-norm` (release_step takes the clip there).
  return (("accumulation",) + ("accumulation_8bit",) * narrow
          + ("adama_float32_moments",) * case.quantize_moments + ("adama",)
          + ("adama_clipped",) * (case.shard_states is None))


def train_config(case: Case, num_devices: int) -> Any:
  """The `TrainConfig` of AdamA's step of ``case`` (what `models.train` would run)."""
  from models import harness

  return harness.TrainConfig(
      model="llama", preset=case.preset, optimizer="adama",
      num_micro_batches=case.num_micro_batches,
      batch_size=case.micro_batch_size * case.num_micro_batches, seq_len=case.seq_len,
      remat="full", dtype="bfloat16", scan_layers=True, release=True,
      quantize_moments=case.quantize_moments, mesh_devices=num_devices,
      shard_states=case.shard_states)


def _placed(tree: Any, shardings: Any) -> Any:
  """``tree``'s shapes with ``shardings`` (a tree like it, or one sharding for all)."""
  import jax

  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def measure_case(name: str, case: Case, progress: Any = None) -> list[dict[str, Any]]:
  """Both methods' compiled step of ``case``: one row each, bytes per device."""
  import jax

  import models
  import optax_adama
  from models import harness
  from models.harness import memory as harness_memory

  target = None if case.target == "cpu" else optax_adama.memory.parse_target(case.target)
  devices = (jax.devices()[:1] if target is None
             else optax_adama.memory.target_devices(target))
  mesh = (optax_adama.memory.target_mesh(target)
          if target is not None and target.num_devices > 1 else None)
  config = train_config(case, len(devices) if mesh is not None else 1)
  model_config = harness.model_config_of(config)
  model = models.create_abstract(model_config)
  loss_fn, params = harness.split_model(model_config)
  batch = harness.abstract_batch(model_config, config.batch_size, case.seq_len)
  rows = []
  for method in methods_of(case):
    start = time.perf_counter()
    if method.startswith("adama"):
      run = (dataclasses.replace(config, quantize_moments=False)
             if method == "adama_float32_moments"
             else dataclasses.replace(config, clip_norm=1.0)
             if method == "adama_clipped" else config)
      tx = harness.make_optimizer(run)
      # The fused step takes the model's own loss (with its accuracy aux), as
      # models.train hands it; the release reads the stages off the model.
      step = harness.make_train_step(run, model, models.split_loss_fn(model, has_aux=True)[0],
                                     tx, mesh=mesh, shard_states=case.shard_states)
      label = ("AdamA with `--clip-norm 1.0` (`make_train_step`, release), "
               if run.clip_norm is not None else "AdamA (`make_train_step`, release), ") + (
          "8-bit moments" if run.quantize_moments else "float32 moments")
    else:
      baseline = ("scan_accumulation_bf16_8bit" if method == "accumulation_8bit"
                  else "fsdp_scan_accumulation" if mesh is not None else "scan_accumulation")
      step, tx = harness.make_step(baseline, loss_fn, num_micro_batches=case.num_micro_batches,
                                   mesh=mesh)
      label = (f"accumulation (`{baseline}`), bfloat16 carry and 8-bit moments"
               if method == "accumulation_8bit"
               else f"accumulation (`{baseline}`), float32 carry and moments")
    opt_state = jax.eval_shape(tx.init, params)
    if mesh is not None:
      shardings = (harness.train_step_shardings(config, model, params, opt_state, mesh,
                                                case.shard_states) if method == "adama"
                   else harness.fsdp_shardings("fsdp_scan_accumulation", loss_fn, params,
                                               opt_state, mesh))
      args = (_placed(params, shardings.params), _placed(opt_state, shardings.opt_state),
              _placed(batch, optax_adama.sharding.batch_sharding(mesh)))
    else:
      args = harness_memory.on_target((params, opt_state, batch), target)
    compiled = optax_adama.memory.compile_for(step, *args, target=target)
    report = optax_adama.memory_report(compiled, *args, param_bytes=models.param_count(
        model_config) * 4)
    rows.append({
        "case": name, "preset": case.preset, "method": method, "label": label,
        "target": case.target,
        "compiled_by": optax_adama.memory.compiled_by(target),
        "num_devices": len(devices) if mesh is not None else 1,
        "shard_states": case.shard_states, "micro_batch_size": case.micro_batch_size,
        "seq_len": case.seq_len, "num_micro_batches": case.num_micro_batches,
        "param_count": models.param_count(model_config),
        "report": report.to_dict(),
        "memory_bytes": None if target is None else target.memory_bytes,
        "fits": None if target is None else target.fits(report.total_bytes),
        "compile_s": time.perf_counter() - start, "why": case.why,
    })
    if progress is not None:
      progress.update()
  return rows


def python_of(case: Case) -> str:
  """The Python whose jax compiles for ``case``'s target (`make venv-gpu` / `venv-tpu`)."""
  if case.target.startswith("tpu"):
    return "ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv-tpu/bin/python"
  return ".venv-gpu/bin/python" if case.target.startswith("gpu") else ".venv/bin/python"


def _cell(row: dict[str, Any]) -> str:
  report = row["report"]
  fits = {None: "", True: ": fits", False: ": **over**"}[row["fits"]]
  return f"{report['total_bytes'] / GIB:.2f} GiB ({report['total_p']:.2f} P){fits}"


# What the page says of the GPU numbers against a live run (one measured before).
LIVE_NOTE = (
    "XLA's GPU compiler without a GPU has no autotuning: for Llama 3.2 1B it came out "
    "1.94 GiB under the program compiled on an H200 itself, for every method alike "
    "([gpu_compiled_llama32_1b.md](gpu_compiled_llama32_1b.md)). Added to the 24 GiB "
    "case, AdamA's step would be about 22.7 GiB, still under 24 GiB, and accumulation "
    "further over. The live check is prepared, not run: `python3 "
    "benchmarks/scripts/run_waiting.py --prepared finetune_llama32_1b --out \"$OUT\"` "
    "trains a random-initialised Llama 3.2 1B for 200 steps in 24 GiB of a lent GPU "
    "(`XLA_PYTHON_CLIENT_MEM_FRACTION`) and runs accumulation there, and writes the loss "
    "curve under `benchmarks/results/gpu/raw/`.")


def markdown(rows: list[dict[str, Any]], command: str) -> str:
  """The table page: a line per step of each case, against its float32 accumulation."""
  lines = [
      "# Fine-tuning Llama 3.2 1B and Llama 3 8B: compiled memory per device",
      "",
      "Compile-only: each step compiled for the target by its own compiler (named per "
      "row), for abstract inputs, with no such device here; `memory_analysis()` total = "
      "argument + output + temp - alias, per device. P = one float32 copy of the whole "
      "model's params (under FSDP a device holds an eighth of it). AdamA's step is the "
      "trainer's (`models.harness.make_train_step` of a `TrainConfig`: scanned layers, "
      "the gradient release, remat \"full\", bf16 compute, float32 params); accumulation "
      "is `models.harness.baselines`' hand-written scan on the same model, remat, dtypes "
      "and micro-batch, with float32 Adam moments and carry. The weights are abstract "
      "(random-initialised shapes): a step's bytes do not depend on the values.",
      "",
      "```bash",
      command,
      "```",
      "",
      "| model, target | micro-batch x seq, N | step | per device | vs accumulation "
      "| compiled by |",
      "|---|---|---|---|---|---|",
  ]
  notes = []
  for name in dict.fromkeys(r["case"] for r in rows):
    group = [r for r in rows if r["case"] == name]
    acc = next(r for r in group if r["method"] == "accumulation")
    memory = ("" if acc["memory_bytes"] is None
              else f" ({acc['memory_bytes'] / GIB:.2f} GiB usable)")
    mesh = f", {acc['num_devices']} devices, {acc['shard_states']}" \
        if acc["num_devices"] > 1 else ""
    model = (f"{acc['preset']} ({acc['param_count'] / 1e9:.2f}B), {acc['target']}{mesh}"
             f"{memory}")
    batch = f"{acc['micro_batch_size']} x {acc['seq_len']}, N = {acc['num_micro_batches']}"
    for row in group:
      saved = acc["report"]["total_bytes"] - row["report"]["total_bytes"]
      versus = ("" if row is acc else
                f"{-saved / GIB:+.2f} GiB ({-saved / row['report']['param_bytes']:+.2f} P)")
      lines.append(f"| {model} | {batch} | {row['label']} | {_cell(row)} | {versus} "
                   f"| {row['compiled_by']} |")
      model = batch = ""  # a case's first line names it
    why = CASES[name].why if name in CASES else acc["why"]  # the case's current text
    if why:
      notes.append(f"- {name}: {why}.")
  lines += ["", "Why each case's settings:", "", *notes, "", LIVE_NOTE, ""]
  return "\n".join(lines)


def plot_live(metrics: Path) -> Path:
  """Draws a live run's loss curve (a `models.train --metrics-out` JSON) beside it."""
  from models import harness

  run = json.loads(metrics.read_text())
  png = metrics.with_suffix(".png")
  harness.plot_loss_curves(
      [run], lambda r: f"{r['preset']}/{r['config']['optimizer']}", png,
      title=f"{run['preset']}, {len(run['train_loss'])} steps", window=10)
  return png


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", choices=sorted(CASES),
                      default=["llama32_1b_24gb", "llama3_8b_80gb"],
                      help="what to compile, one case after another (default: the GPU ones)")
  parser.add_argument("--raw", type=Path, default=RAW, help="the JSON the rows are kept in")
  parser.add_argument("--page", type=Path, default=PAGE, help="the markdown page written")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument("--page-only", action="store_true",
                      help="compile nothing: rewrite the page from the rows in --raw")
  parser.add_argument("--plot-live", type=Path, default=None, metavar="RUN_JSON",
                      help="only draw a live run's loss curve (models.train --metrics-out) "
                           "as a png beside it")
  args = parser.parse_args(argv)
  if args.plot_live is not None:
    print(f"wrote {plot_live(args.plot_live)}")
    return []
  from tqdm import tqdm

  kept = json.loads(args.raw.read_text())["rows"] if args.raw.exists() else []
  rows = []
  measured = [] if args.page_only else args.cases
  with tqdm(total=sum(len(methods_of(CASES[c])) for c in measured), desc="compiles",
            disable=args.no_progress, file=sys.stderr) as progress:
    for name in measured:
      rows += measure_case(name, CASES[name], progress)
  rows = [r for r in kept if r["case"] not in measured] + rows
  order = ("accumulation", "accumulation_8bit", "adama_float32_moments", "adama",
           "adama_clipped")
  rows.sort(key=lambda r: (list(CASES).index(r["case"]), order.index(r["method"])))
  args.raw.parent.mkdir(parents=True, exist_ok=True)
  args.raw.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
  command = "\n".join(f"{python_of(CASES[c])} benchmarks/scripts/finetune_memory.py --cases {c}"
                      for c in dict.fromkeys(r["case"] for r in rows))
  args.page.write_text(markdown(rows, command))
  for row in rows:
    print(f"{row['case']:>18} {row['method']:>12}: {_cell(row)} ({row['compile_s']:.0f} s)")
  return rows


if __name__ == "__main__":
  main()
