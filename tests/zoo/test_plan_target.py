"""`python -m models.plan --target`: the plan compiled by a TPU's or GPU's own compiler."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from models import plan

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _error_of(argv, capsys):
  with pytest.raises(SystemExit) as exit_info:
    plan.main(["--preset", "gpt_test", *argv])
  assert exit_info.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


def test_an_unknown_target_lists_the_known_ones(capsys):
  error = _error_of(["--target", "tpu:v9"], capsys)
  assert "invalid choice: 'tpu:v9'" in error and "tpu:v3-8" in error and "gpu:h100" in error


def test_a_target_plans_and_does_not_survey(capsys):
  error = _error_of(["--target", "tpu:v3-8", "--survey"], capsys)
  assert "--target plans; --survey and --frontier measure this machine" in error


@pytest.mark.skipif(HAS_LIBTPU, reason="libtpu installed: the compiler is there")
def test_without_libtpu_the_plan_says_how_to_get_it_in_one_line(capsys):
  error = _error_of(["--target", "tpu:v3-8"], capsys)
  assert error.startswith("python -m models.plan: error: tpu:v3-8 needs libtpu")
  assert "make venv-tpu" in error


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU,
                    reason="no libtpu in this Python: `make venv-tpu`, then run with .venv-tpu")
def test_the_plan_is_compiled_by_libtpu_for_a_v3_8(tmp_path):
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
  out = tmp_path / "plan.json"
  base = [sys.executable, "-m", "models.plan", "--preset", "gpt_test", "--target", "tpu:v3-8",
          "--batch-size", "8", "--seq-len", "64"]
  too_much = subprocess.run([*base, "--budget-gb", "99"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600, check=False)
  assert too_much.returncode == 2
  assert "a tpu:v3-8 device can use 16.62 GB" in too_much.stderr.strip().splitlines()[-1]
  result = subprocess.run([*base, "--devices", "8", "--json", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  chosen = json.loads(out.read_text())
  # The budget defaults to a v3 core's usable 15.48 GiB; libtpu made the bytes.
  assert chosen["compiled_by"].startswith("libtpu ") and "TPU v3-8" in chosen["compiled_by"]
  assert abs(chosen["plan"]["budget_bytes"] - 15.48 * 2**30) < 2**20
  assert chosen["plan"]["devices"] == 8
  assert 0 < chosen["plan"]["verified"]["device_bytes"] <= chosen["plan"]["budget_bytes"]
  assert "compiled by libtpu" in result.stdout
