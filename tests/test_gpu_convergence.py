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
