"""benchmarks/scripts/run_waiting.py: the waiting GPU commands, in order, within a deadline."""

import dataclasses
import os
import tarfile
import time

import pytest
from conftest import load_script

run_waiting = load_script("benchmarks/scripts/run_waiting.py")


def test_every_waiting_item_has_commands_and_the_numbers_run_in_order():
  items = run_waiting.waiting_items(run_waiting.WAITING_PAGE.read_text())
  assert [item.number for item in items] == list(range(1, len(items) + 1))
  assert all(item.commands for item in items), [i.number for i in items if not i.commands]
  # The Llama pair first (the order the issues ask for), its table after it.
  assert items[0].commands == (
      "make gpu-convergence PYTHON=python3 GPU_PRESET=llama_small GPU_SEED=0",
      "PYTHONPATH=. python3 benchmarks/scripts/gpu_convergence.py")
  # Every command is one line, from the repository root.
  for item in items:
    for command in item.commands:
      assert "\\" not in command and not command.startswith(" ")


README = """# Benchmarks

## Waiting for a GPU

Text.

1. Writes a file, about 1 minute:

   ```bash
   mkdir -p benchmarks/raw && echo one \\
       > benchmarks/raw/one.txt
   ```

2. Never ends:

   ```bash
   sleep 600; echo late > benchmarks/raw/late.txt
   ```

3. Starts too late:

   ```bash
   echo never > benchmarks/raw/never.txt
   ```

## Another section

```bash
echo not an item
```
"""


def test_items_run_in_order_until_the_deadline_and_their_files_are_packed(tmp_path, monkeypatch):
  root = tmp_path / "repo"
  (root / "benchmarks").mkdir(parents=True)
  (root / "benchmarks" / "README.md").write_text(README)
  old = root / "benchmarks" / "old.txt"
  old.write_text("before the run")
  os.utime(old, (time.time() - 60, time.time() - 60))
  items = run_waiting.waiting_items(README)
  assert [(i.number, len(i.commands)) for i in items] == [(1, 1), (2, 1), (3, 1)]
  assert items[0].commands == ("mkdir -p benchmarks/raw && echo one > benchmarks/raw/one.txt",)
  out = tmp_path / "out"
  monkeypatch.setattr(run_waiting, "MIN_START_S", 1.0)  # a deadline of seconds here
  start = time.monotonic()
  summary = run_waiting.run(items, deadline_s=3.0, out=out, root=root)
  # The sleep is stopped at the deadline (its whole process group), not after 600 s.
  assert time.monotonic() - start < 30
  assert summary[0].startswith("item 1.1: exit 0")
  assert summary[1].startswith("item 2.1: stopped at the deadline")
  assert summary[2].startswith("item 3.1: not started")
  assert not (root / "benchmarks" / "raw" / "late.txt").exists()
  # What the run wrote (nothing older) and the logs, in two files.
  with tarfile.open(out / "results.tgz") as tar:
    assert tar.getnames() == ["benchmarks/raw/one.txt", "logs/item1_1.log", "logs/item2_1.log"]
  assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.txt"]
  assert (out / "summary.txt").read_text().splitlines() == summary


def test_the_command_line_lists_and_refuses_unknown_items(tmp_path, capsys, monkeypatch):
  readme = tmp_path / "benchmarks" / "README.md"
  readme.parent.mkdir()
  readme.write_text(README)
  run_waiting.main(["--readme", str(readme), "--list", "--items", "3", "1"])
  printed = capsys.readouterr().out
  assert printed.index("3. Starts too late") < printed.index("1. Writes a file")
  with pytest.raises(SystemExit):
    run_waiting.main(["--readme", str(readme), "--items", "7"])
  assert "the waiting list has items [1, 2, 3]" in capsys.readouterr().err
  monkeypatch.delenv("OUT", raising=False)
  with pytest.raises(SystemExit):
    run_waiting.main(["--readme", str(readme), "--items", "1"])
  assert "--out is needed" in capsys.readouterr().err
  with pytest.raises(ValueError, match="no '## Waiting for a GPU' section"):
    run_waiting.waiting_items("# Benchmarks\n")


def test_the_prepared_llama32_1b_fine_tuning_builds_the_trainers_runs(tmp_path, capsys):
  import shlex
  import subprocess

  from models import train

  item = run_waiting.PREPARED["finetune_llama32_1b"]()
  adama, plot, accumulation = item.commands
  fraction = run_waiting.memory_fraction_of(24)
  prefix = f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} python3 -m models.train "
  assert adama.startswith(prefix) and accumulation.startswith(prefix)
  # What models.train makes of each command's flags: AdamA with the release for
  # 200 steps, accumulation (adam) on the same model and micro-batch, 20 steps.
  runs = {name: train.train_config(shlex.split(command[len(prefix):]))
          for name, command in (("adama", adama), ("accumulation", accumulation))}
  for config in runs.values():
    assert (config.preset, config.remat, config.dtype, config.scan_layers) == (
        "llama32_1b", "full", "bfloat16", True)
    assert (config.batch_size, config.num_micro_batches, config.seq_len) == (16, 2, 1024)
    assert config.init_from is None and config.data_path is None  # random init, local text
  assert (runs["adama"].optimizer, runs["adama"].release, runs["adama"].steps) == (
      "adama", True, 200)
  assert (runs["accumulation"].optimizer, runs["accumulation"].steps) == ("adam", 20)
  metrics = "benchmarks/results/gpu/raw/finetune_llama32_1b_24gib_adama.json"
  assert adama.endswith(f"--metrics-out {metrics}")
  assert plot == f"PYTHONPATH=. python3 benchmarks/scripts/finetune_memory.py --plot-live {metrics}"
  # The fraction is 24 GiB of what nvidia-smi reports (MiB), here a stand-in for it.
  (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 143771\n")
  (tmp_path / "nvidia-smi").chmod(0o755)
  value = subprocess.run(["bash", "-c", f"echo {fraction}"], capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, check=True).stdout
  assert float(value) == pytest.approx(24 * 1024 / 143771, abs=1e-4)
  # Listed and numbered after the page's items; alone without --items.
  run_waiting.main(["--prepared", "finetune_llama32_1b", "--list"])
  pages = run_waiting.waiting_items(run_waiting.WAITING_PAGE.read_text())
  printed = capsys.readouterr().out
  assert printed.startswith(f"{len(pages) + 1}. Llama 3.2 1B (random-initialised)")
  assert printed.count("python3 -m models.train") == 2


def test_the_prepared_clip_timing_differs_only_by_the_clip():
  import shlex

  from models import train

  bare, clipped = run_waiting.PREPARED["clip_step_time_llama32_1b"]().commands
  prefix = "python3 -m models.train "
  configs = [train.train_config(shlex.split(c[len(prefix):].split(" --metrics-out")[0]))
             for c in (bare, clipped)]
  assert configs[0].clip_norm is None and configs[1].clip_norm == 1.0
  assert configs[1] == dataclasses.replace(configs[0], clip_norm=1.0)
  assert (configs[0].preset, configs[0].optimizer, configs[0].release) == (
      "llama32_1b", "adama", False)
  assert bare.endswith("_bare.json") and clipped.endswith("_clipped.json")
