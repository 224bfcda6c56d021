"""benchmarks/scripts/run_waiting.py: the waiting GPU commands, in order, within a deadline."""

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
