"""Runs the "Waiting for a GPU" commands of benchmarks/results/gpu/live_runs.md in order,
within a deadline.

    python3 benchmarks/scripts/run_waiting.py --list       # the items and their commands
    python3 benchmarks/scripts/run_waiting.py --items 1 2 --deadline-s 560 --out "$OUT"  # on a GPU
    python3 benchmarks/scripts/run_waiting.py --prepared finetune_llama32_1b \
        clip_step_time_llama32_1b --out "$OUT"        # issue 60: live fine-tuning, clip time

On a lent GPU machine every minute counts and a call has one fixed limit, so the
waiting items run as one prepared command: one after another, each alone on the
machine (three trainings sharing one H200 once finished none in 341 s), each
command given the time left before the deadline and stopped (its whole process
group) when that runs out. What the commands write under ``benchmarks/`` is
packed into ``OUT/results.tgz`` with each command's log (a stopped command's
partial files too: the GPU bench appends each task as it finishes); each log's
last lines are printed as its command ends, and a summary (exit status and
seconds per command) is printed last and written to ``OUT/summary.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The page that lists the waiting commands (its "Waiting for a GPU" section).
WAITING_PAGE = ROOT / "benchmarks" / "results" / "gpu" / "live_runs.md"
SECTION = "## Waiting for a GPU"
# A command started with less time than this left is not started.
MIN_START_S = 30.0
# The lines of each command's log printed when it ends.
TAIL_LINES = 15
# Llama 3.2 1B fine-tuned live in a 24 GiB slice of the lent GPU (issue 60's
# item 6 c): 200 steps of 2 x 8 x 1,024 tokens, about 0.5 s each on an H100/H200
# class card plus a minute of compile, AdamA first; accumulation's 20 steps only
# say whether it runs at all. Within the default 560 s deadline.
FINETUNE_STEPS = 200
FINETUNE_MEMORY_GIB = 24
FINETUNE_RAW = "benchmarks/results/gpu/raw/finetune_llama32_1b_24gib"


@dataclasses.dataclass(frozen=True)
class Item:
  """One numbered item of the waiting list: its first line and its commands."""
  number: int
  title: str
  commands: tuple[str, ...]


def memory_fraction_of(memory_gib: float) -> str:
  """A shell expression: the fraction of GPU 0's memory that is ``memory_gib`` GiB, for
  XLA_PYTHON_CLIENT_MEM_FRACTION (nvidia-smi reports the card's total in MiB)."""
  return ("$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | "
          f"awk '{{printf \"%.4f\", {memory_gib * 1024:g} / $1}}')")


def finetune_llama32_1b(steps: int = FINETUNE_STEPS,
                        memory_gib: float = FINETUNE_MEMORY_GIB) -> Item:
  """The prepared live fine-tuning of Llama 3.2 1B in ``memory_gib`` of the card.

  No weights can be downloaded on the lent machine: the model is a random-
  initialised ``llama32_1b`` (its real shapes and memory), trained on the Python
  standard library's text as bytes (local text). AdamA (the gradient release,
  bf16 compute, remat "full") trains ``steps`` steps and writes its loss curve
  (``models.train --metrics-out`` JSON, then a png beside it); gradient
  accumulation (``--optimizer adam``, the same model and micro-batch) is
  expected to run out of memory there, so it is asked for 20 steps only.
  """
  fraction = f"XLA_PYTHON_CLIENT_MEM_FRACTION={memory_fraction_of(memory_gib)}"
  train = ("python3 -m models.train --model llama --preset llama32_1b --scan-layers "
           "--remat full --dtype bfloat16 --batch-size 16 --num-micro-batches 2 "
           "--seq-len 1024 --learning-rate 3e-4 --warmup-steps 20 --eval-batches 4 "
           "--no-progress")
  return Item(0, f"Llama 3.2 1B (random-initialised) fine-tuned live for {steps} steps in "
              f"{memory_gib:g} GiB of the card: AdamA trains, accumulation runs out of memory",
              (f"{fraction} {train} --optimizer adama --release --steps {steps} "
               f"--metrics-out {FINETUNE_RAW}_adama.json",
               f"PYTHONPATH=. python3 benchmarks/scripts/finetune_memory.py "
               f"--plot-live {FINETUNE_RAW}_adama.json",
               f"{fraction} {train} --optimizer adam --steps 20 "
               f"--metrics-out {FINETUNE_RAW}_accumulation.json"))


CLIP_STEPS = 40
CLIP_RAW = "benchmarks/results/gpu/raw/clip_step_time_llama32_1b"


def clip_step_time_llama32_1b(steps: int = CLIP_STEPS) -> Item:
  """The step time of ``optax_adama.clipped_by_global_norm`` on a GPU (issue 60's
  +5% bar, timed on the CPU only): Llama 3.2 1B (random-initialised), AdamA's
  fused step (the clip does not take the release) with and without
  ``--clip-norm 1.0``, the same model, micro-batches and steps; each run's
  ``median_step_s`` (after the first tenth of the steps) in its ``--metrics-out``."""
  train = ("python3 -m models.train --model llama --preset llama32_1b --remat full "
           "--dtype bfloat16 --batch-size 16 --num-micro-batches 4 --seq-len 1024 "
           f"--optimizer adama --steps {steps} --eval-batches 1 --no-progress")
  return Item(0, f"Llama 3.2 1B, AdamA's fused step with and without the sketched clip "
              f"(--clip-norm 1.0), {steps} steps each: the clip's step time on a GPU",
              (f"{train} --metrics-out {CLIP_RAW}_bare.json",
               f"{train} --clip-norm 1.0 --metrics-out {CLIP_RAW}_clipped.json"))


# Items prepared in this script (not on the waiting page), run by name with --prepared.
PREPARED = {"finetune_llama32_1b": finetune_llama32_1b,
            "clip_step_time_llama32_1b": clip_step_time_llama32_1b}


def checkout_root(page: Path) -> Path:
  """The checkout a page under ``benchmarks/`` belongs to: the commands run from
  there, and what they write under its ``benchmarks/`` is packed."""
  page = page.resolve()
  return next(folder.parent for folder in page.parents if folder.name == "benchmarks")


def waiting_items(readme: str) -> list[Item]:
  """The numbered items of ``readme``'s waiting section, with the lines of their
  ``bash`` blocks (a line ending in a backslash joined to the next) as commands."""
  if f"\n{SECTION}\n" not in readme:
    raise ValueError(f"no '{SECTION}' section")
  section = readme.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
  parts = re.split(r"^(\d+)\. ", section, flags=re.M)
  items = []
  for number, body in zip(parts[1::2], parts[2::2]):
    blocks = re.findall(r"```bash\n(.*?)\n\s*```", body, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    commands = tuple(" ".join(line.split()) for line in lines if line.strip())
    items.append(Item(int(number), body.splitlines()[0].strip(), commands))
  return items


def _run_until(command: str, deadline: float, log: Path, cwd: Path) -> tuple[int | None, float]:
  """Runs ``command`` in a shell of its own process group until it ends or the
  deadline passes (then the group is stopped); its exit status (``None``: stopped)
  and seconds."""
  start = time.monotonic()
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  with log.open("w") as out:
    process = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
      return process.wait(timeout=max(deadline - time.monotonic(), 0.0)), time.monotonic() - start
    except subprocess.TimeoutExpired:
      _signal_group(process.pid, signal.SIGTERM)
      try:
        process.wait(timeout=10.0)  # a grace to write what it has
      except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
      return None, time.monotonic() - start


def _signal_group(pid: int, sig: int) -> None:
  """Sends ``sig`` to the process group ``pid`` leads, if it still exists."""
  with contextlib.suppress(ProcessLookupError):
    os.killpg(pid, sig)


def run(items: list[Item], *, deadline_s: float, out: Path, root: Path = ROOT) -> list[str]:
  """Runs ``items`` in order until ``deadline_s`` seconds have passed; returns the
  summary lines. ``out`` gets two files (a lent machine sends back only a few):
  ``results.tgz``, with what the commands wrote under ``root/benchmarks`` and
  their logs (``logs/item<k>_<j>.log``), and ``summary.txt``. Each log's last
  lines are printed as its command ends."""
  out.mkdir(parents=True, exist_ok=True)
  summary = []
  with tempfile.TemporaryDirectory(prefix="run_waiting_") as scratch:
    logs = Path(scratch)
    # The file system's clock, not time.time(): its coarse ticks can stamp a
    # file written just after the start earlier than time.time() reads it.
    marker = logs / "started"
    marker.write_text("")
    start_wall, start = marker.stat().st_mtime, time.monotonic()
    deadline = start + deadline_s
    for item in items:
      for j, command in enumerate(item.commands, 1):
        left = deadline - time.monotonic()
        if left < MIN_START_S:
          summary.append(f"item {item.number}.{j}: not started ({left:.0f} s left): {command}")
          continue
        log = logs / f"item{item.number}_{j}.log"
        status, seconds = _run_until(command, deadline, log, root)
        ended = "stopped at the deadline" if status is None else f"exit {status}"
        summary.append(f"item {item.number}.{j}: {ended} after {seconds:.0f} s: {command}")
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        print(f"--- {summary[-1]}\n" + "\n".join(tail), flush=True)
    written = sorted(p for p in (root / "benchmarks").rglob("*")
                     if p.is_file() and p.stat().st_mtime >= start_wall)
    with tarfile.open(out / "results.tgz", "w:gz") as tar:
      for path in written:
        tar.add(path, arcname=str(path.relative_to(root)))
      for log in sorted(logs.glob("*.log")):
        tar.add(log, arcname=f"logs/{log.name}")
  summary.append(f"{len(written)} files written under benchmarks/, in {out / 'results.tgz'} "
                 f"with the logs; {time.monotonic() - start:.0f} s in all")
  (out / "summary.txt").write_text("\n".join(summary) + "\n")
  return summary


def main(argv: list[str] | None = None) -> list[str]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--items", type=int, nargs="+", default=None,
                      help="item numbers, in the order to run them; default: all, in order")
  parser.add_argument("--deadline-s", type=float, default=560.0,
                      help="seconds from the start after which nothing runs")
  parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                      help="where the logs and results.tgz go; default: $OUT")
  parser.add_argument("--readme", type=Path, default=WAITING_PAGE,
                      help="the page whose waiting section lists the items")
  parser.add_argument("--prepared", nargs="+", choices=sorted(PREPARED), default=(),
                      help="items prepared in this script, run after --items (alone "
                           "without --items)")
  parser.add_argument("--list", action="store_true", help="print the items and stop")
  args = parser.parse_args(argv)
  items = waiting_items(args.readme.read_text())
  by_number = {item.number: item for item in items}
  if args.items is not None:
    unknown = sorted(set(args.items) - set(by_number))
    if unknown:
      parser.error(f"--items {unknown}: the waiting list has items {sorted(by_number)}")
    items = [by_number[n] for n in args.items]
  elif args.prepared:
    items = []
  # Numbered after the page's items, so their logs and summary lines keep apart.
  items += [dataclasses.replace(PREPARED[name](), number=len(by_number) + k)
            for k, name in enumerate(args.prepared, 1)]
  if args.deadline_s <= 0:
    parser.error("--deadline-s must be positive")
  if args.list:
    lines = [f"{item.number}. {item.title}\n" + "".join(f"   {c}\n" for c in item.commands)
             for item in items]
    print("".join(lines), end="")
    return lines
  if args.out is None:
    parser.error("--out is needed (or OUT in the environment)")
  summary = run(items, deadline_s=args.deadline_s, out=Path(args.out),
                root=checkout_root(args.readme))
  print("\n".join(summary))
  return summary


if __name__ == "__main__":
  main()
