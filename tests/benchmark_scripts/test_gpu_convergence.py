"""benchmarks/scripts/gpu_convergence.py renders its table and plots from the committed runs,
and `make gpu-convergence` trains the pair it tables, on any causal LM preset."""

import json
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import REPO as ROOT
from conftest import load_script

# The committed raw runs the script tables.
RAW = ROOT / "benchmarks" / "results" / "gpu" / "raw"
# The page with the waiting list and the bf16-params run's command.
LIVE_RUNS = ROOT / "benchmarks" / "results" / "gpu" / "live_runs.md"


def committed_gpt2_small_runs(raw):
  """benchmarks/results/gpu/raw's gpt2_small runs (the script's fixed cells) copied into ``raw``."""
  shutil.copytree(RAW, raw,
                  ignore=lambda d, names: [n for n in names if not n.startswith("gpu_gpt2_small")])


def test_the_table_gaps_are_each_cell_s_runs_against_its_own_adam(tmp_path):
  script = load_script("benchmarks/scripts/gpu_convergence.py")
  script.main(["--raw", str(RAW), "--out-dir", str(tmp_path)])
  for _, _, plot in script.CELLS:
    assert (tmp_path / plot).stat().st_size > 0
  text = (tmp_path / "gpu_convergence.md").read_text()
  raw = lambda stem: json.loads((RAW
                                 / f"gpu_gpt2_small_{stem}.json").read_text())
  adam, mean = raw("n8_adam"), raw("n8_adama_mean")
  assert mean["config"]["num_micro_batches"] == adam["config"]["num_micro_batches"] == 8
  gap = 100 * (mean["eval_loss"] / adam["eval_loss"] - 1)
  row = next(l for l in text.splitlines()
             if l.startswith("| gpt2_small | 8 |") and "'mean'" in l)
  assert f"| {mean['eval_loss']:.4f} | {gap:+.2f}% |" in row
  # Every run of a cell has the same mini-batch as its Adam row.
  for n, stems, _ in script.CELLS:
    runs = [raw(stem) for stem in stems]
    assert {(r["config"]["batch_size"], r["config"]["seq_len"], r["config"]["steps"],
             r["config"]["num_micro_batches"]) for r in runs} == {(32, 256, 2000, n)}


def test_pairs_of_make_gpu_convergence_become_cells_of_their_own(tmp_path):
  script = load_script("benchmarks/scripts/gpu_convergence.py")
  raw = tmp_path / "raw"
  committed_gpt2_small_runs(raw)
  # A second seed at N = 8, as `make gpu-convergence GPU_SEED=1` names it.
  adam_loss = json.loads((raw / "gpu_gpt2_small_n8_adam.json").read_text())["eval_loss"]
  for stem, new in (("n8_adam", "adam"), ("n8_adama_mean", "adama")):
    run = json.loads((raw / f"gpu_gpt2_small_{stem}.json").read_text())
    run["config"]["seed"] = 1
    run["eval_loss"] = adam_loss * (1.01 if new == "adama" else 1.0)
    (raw / f"gpu_gpt2_small_n8_b32_seed1_{new}.json").write_text(json.dumps(run))
  script.main(["--raw", str(raw), "--out-dir", str(tmp_path)])
  assert (tmp_path / "gpu_convergence_gpt2_small_n8_b32_seed1.png").stat().st_size > 0
  rows = [l for l in (tmp_path / "gpu_convergence.md").read_text().splitlines()
          if l.startswith("| gpt2_small | 8 | 1,024 | 1 |")]
  assert len(rows) == 2 and "| +1.00% |" in rows[1] and "| +0.00% |" in rows[0], rows
  (raw / "gpu_gpt2_small_n8_b32_seed1_adama.json").unlink()
  with pytest.raises(FileNotFoundError, match="no AdamA run beside it"):
    script.main(["--raw", str(raw), "--out-dir", str(tmp_path)])


def make_gpu_convergence(*variables, dry=True):
  """`make gpu-convergence VARIABLES`: with ``dry``, the models.train arguments of
  its last run as the recipe's shell expands them (``echo`` in Python's place, so
  the loop's variables are the shell's, not a guess); else its output, run."""
  command = ["make", "-s", "gpu-convergence", *variables, *(["PYTHON=echo"] if dry else [])]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
  if not dry:
    return done.stdout
  words = shlex.split(done.stdout.strip().splitlines()[-1])
  return words[words.index("models.train") + 1:]


def test_make_gpu_convergence_passes_models_train_valid_arguments():
  from models import train

  argv = make_gpu_convergence("PYTHON=python3", "GPU_N=8", "GPU_BATCH=64", "GPU_SEED=2",
                              "GPU_OUT=/out")
  config = train.train_config(argv)
  # The preset's default is GPT-2 small, with the raw names of before.
  assert (config.num_micro_batches, config.batch_size, config.seed, config.optimizer,
          config.model, config.preset, config.dtype) == (
              8, 64, 2, "adama", "gpt", "gpt2_small", "bfloat16")
  out = argv[argv.index("--metrics-out") + 1]
  assert out == "/out/gpu_gpt2_small_n8_b64_seed2_adama.json"
  assert script_pattern_matches(out.rsplit("/", 1)[1].replace("_adama", "_adam"))


def test_the_waiting_llama_small_command_is_the_gpt2_small_pair_on_a_llama():
  from models import train

  text = LIVE_RUNS.read_text()
  section = text.split("\n## Waiting for a GPU\n", 1)[1].split("\n## ", 1)[0]
  [line] = [l.strip() for l in section.splitlines()
            if l.strip().startswith("make gpu-convergence ") and "llama_small" in l]
  argv = make_gpu_convergence(*shlex.split(line)[2:], "GPU_OUT=/out")
  llama = train.train_config(argv)
  gpt = train.train_config(make_gpu_convergence("PYTHON=python3", "GPU_SEED=0"))
  assert (llama.model, llama.preset, llama.seed) == ("llama", "llama_small", 0)
  # Everything else is the gpt2_small N = 8 cell's run: data, schedule, mini-batch.
  same = lambda c: {k: v for k, v in vars(c).items() if k not in ("model", "preset")}
  assert same(llama) == same(gpt)
  assert (llama.steps, llama.num_micro_batches, llama.batch_size, llama.seq_len) == (
      2000, 8, 32, 256)
  out = argv[argv.index("--metrics-out") + 1]
  assert out == "/out/gpu_llama_small_n8_b32_seed0_adama.json"
  assert script_pattern_matches(out.rsplit("/", 1)[1].replace("_adama", "_adam"))


def test_the_bf16_params_command_is_the_seed_0_default_run_with_bf16_params():
  from models import train

  text = LIVE_RUNS.read_text()
  section = text.split("\n### bfloat16 params at GPT-2 small's scale", 1)[1].split("\n## ", 1)[0]
  start = section.index("make gpu-convergence PYTHON=python3 GPU_SEED=0 GPU_OPTIMIZERS=adama")
  command = section[start:section.index("```", start)].replace("\\\n", " ")
  variables = shlex.split(command)[2:]
  dry = subprocess.run(["make", "-s", "-n", "gpu-convergence", *variables], cwd=ROOT,
                       capture_output=True, text=True, check=True).stdout
  assert "for optimizer in adama;" in dry  # no Adam run: its seed-0 run is committed
  argv = make_gpu_convergence(*variables, "GPU_OUT=/out")
  bf16 = train.train_config(argv)
  default = train.train_config(make_gpu_convergence("PYTHON=python3", "GPU_SEED=0"))
  assert (bf16.param_dtype, bf16.param_rounding, bf16.mu_dtype, bf16.nu_dtype) == (
      "bfloat16", "stochastic", "float32", "float32")
  changed = {"param_dtype", "mu_dtype", "nu_dtype"}
  same = lambda c: {k: v for k, v in vars(c).items() if k not in changed}
  assert same(bf16) == same(default)
  assert argv[argv.index("--metrics-out") + 1] == (
      "/out/gpu_gpt2_small_n8_b32_seed0_adama_bf16_params.json")


@pytest.mark.slow  # 48 s on 2 cores; the pair's command is checked by the parse test above
def test_make_gpu_convergence_trains_a_llama_pair_that_tables_as_its_own_cell(tmp_path):
  # The target itself on llama_test, two steps of N = 2 x 2 sequences of 16 tokens.
  raw = tmp_path / "raw"
  committed_gpt2_small_runs(raw)
  make_gpu_convergence(
      f"PYTHON={sys.executable}", "GPU_PRESET=llama_test", "GPU_N=2", "GPU_BATCH=4",
      "GPU_SEED=0", f"GPU_OUT={raw}",
      "GPU_EXTRA_ARGS=--steps 2 --seq-len 16 --warmup-steps 1 --eval-batches 1 "
      "--max-bytes 200000", dry=False)
  adam, adama = (json.loads((raw / f"gpu_llama_test_n2_b4_seed0_{o}.json").read_text())
                 for o in ("adam", "adama"))
  for run, optimizer in ((adam, "adam"), (adama, "adama")):
    assert (run["preset"], run["config"]["model"], run["config"]["optimizer"],
            run["config"]["steps"], run["config"]["dtype"]) == (
                "llama_test", "llama", optimizer, 2, "bfloat16")
  assert adama["config"]["nu_estimator"] == train_default_estimator()
  script = load_script("benchmarks/scripts/gpu_convergence.py")
  script.main(["--raw", str(raw), "--out-dir", str(tmp_path)])
  assert (tmp_path / "gpu_convergence_llama_test_n2_b4_seed0.png").stat().st_size > 0
  text = (tmp_path / "gpu_convergence.md").read_text()
  rows = [l for l in text.splitlines() if l.startswith("| llama_test | 2 | 32 | 0 |")]
  gap = 100 * (adama["eval_loss"] / adam["eval_loss"] - 1)
  assert len(rows) == 2 and "| Adam + accumulation |" in rows[0] and "| +0.00% |" in rows[0]
  assert f"| {adama['eval_loss']:.4f} | {gap:+.2f}% |" in rows[1]
  # The gpt2_small cells and their N = 8 against N = 4 line stand beside it.
  assert text.startswith("# At scale on a GPU: GPT-2 small and llama_test,")
  assert "`llama_test` (" in text and "Adam + accumulation at N = 8 against N = 4" in text
  assert sum(l.startswith("| gpt2_small |") for l in text.splitlines()) == 7


def train_default_estimator():
  from models import harness
  return harness.DEFAULT_NU_ESTIMATOR


def script_pattern_matches(name):
  return load_script("benchmarks/scripts/gpu_convergence.py").EXTRA_RUN.fullmatch(name) is not None
