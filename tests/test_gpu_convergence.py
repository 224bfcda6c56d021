"""benchmarks/gpu_convergence.py renders its table and plots from the committed runs."""

import json

from conftest import REPO as ROOT, load_script


def test_the_table_gaps_are_each_cell_s_runs_against_its_own_adam(tmp_path):
  script = load_script("benchmarks/gpu_convergence.py")
  script.main(["--raw", str(ROOT / "benchmarks" / "raw"), "--out-dir", str(tmp_path)])
  for _, _, plot in script.CELLS:
    assert (tmp_path / plot).stat().st_size > 0
  text = (tmp_path / "gpu_convergence.md").read_text()
  raw = lambda stem: json.loads((ROOT / "benchmarks" / "raw"
                                 / f"gpu_gpt2_small_{stem}.json").read_text())
  adam, mean = raw("n8_adam"), raw("n8_adama_mean")
  assert mean["config"]["num_micro_batches"] == adam["config"]["num_micro_batches"] == 8
  gap = 100 * (mean["eval_loss"] / adam["eval_loss"] - 1)
  row = next(l for l in text.splitlines()
             if l.startswith("| 8 |") and "'mean'" in l)
  assert f"| {mean['eval_loss']:.4f} | {gap:+.2f}% |" in row
  # Every run of a cell has the same mini-batch as its Adam row.
  for n, stems, _ in script.CELLS:
    runs = [raw(stem) for stem in stems]
    assert {(r["config"]["batch_size"], r["config"]["seq_len"], r["config"]["steps"],
             r["config"]["num_micro_batches"]) for r in runs} == {(32, 256, 2000, n)}


def test_pairs_of_make_gpu_convergence_become_cells_of_their_own(tmp_path):
  import shutil
  import pytest

  script = load_script("benchmarks/gpu_convergence.py")
  raw = tmp_path / "raw"
  shutil.copytree(ROOT / "benchmarks" / "raw", raw,
                  ignore=lambda d, names: [n for n in names if not n.startswith("gpu_gpt2_small")])
  # A second seed at N = 8, as `make gpu-convergence GPU_SEED=1` names it.
  adam_loss = json.loads((raw / "gpu_gpt2_small_n8_adam.json").read_text())["eval_loss"]
  for stem, new in (("n8_adam", "adam"), ("n8_adama_mean", "adama")):
    run = json.loads((raw / f"gpu_gpt2_small_{stem}.json").read_text())
    run["config"]["seed"] = 1
    run["eval_loss"] = adam_loss * (1.01 if new == "adama" else 1.0)
    (raw / f"gpu_gpt2_small_n8_b32_seed1_{new}.json").write_text(json.dumps(run))
  script.main(["--raw", str(raw), "--out-dir", str(tmp_path)])
  assert (tmp_path / "gpu_convergence_n8_b32_seed1.png").stat().st_size > 0
  rows = [l for l in (tmp_path / "gpu_convergence.md").read_text().splitlines()
          if l.startswith("| 8 | 1,024 | 1 |")]
  assert len(rows) == 2 and "| +1.00% |" in rows[1] and "| +0.00% |" in rows[0], rows
  (raw / "gpu_gpt2_small_n8_b32_seed1_adama.json").unlink()
  with pytest.raises(FileNotFoundError, match="no AdamA run beside it"):
    script.main(["--raw", str(raw), "--out-dir", str(tmp_path)])


def test_make_gpu_convergence_passes_models_train_valid_arguments():
  import shlex
  import subprocess

  from models import train

  dry = subprocess.run(["make", "-s", "-n", "gpu-convergence", "PYTHON=python3",
                        "GPU_N=8", "GPU_BATCH=64", "GPU_SEED=2", "GPU_OUT=/out"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  words = shlex.split(dry.replace("\\\n", " "))
  start = words.index("models.train") + 1
  argv = words[start:words.index("--metrics-out", start) + 2]
  argv = [w.replace("$optimizer", "adama") for w in argv]
  config = train.train_config(argv)
  assert (config.num_micro_batches, config.batch_size, config.seed, config.optimizer,
          config.preset, config.dtype) == (8, 64, 2, "adama", "gpt2_small", "bfloat16")
  out = argv[argv.index("--metrics-out") + 1]
  assert out == "/out/gpu_gpt2_small_n8_b64_seed2_adama.json"
  assert script_pattern_matches(out.rsplit("/", 1)[1].replace("_adama", "_adam"))


def script_pattern_matches(name):
  return load_script("benchmarks/gpu_convergence.py").EXTRA_RUN.fullmatch(name) is not None
