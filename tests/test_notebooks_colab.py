"""The notebooks' first cell where only the notebook exists (Colab).

There ``OPTAX_ADAMA_REPO`` names the repository's git URL; the cell must make
``import models`` work, though the wheel built from the repository holds
``optax_adama`` alone. Checked in a fresh virtual environment outside the
checkout: its packages are the project's dependencies (this environment's, as
Colab comes with jax and flax), but neither ``optax_adama`` nor ``models`` is
importable, and pip may not download anything (``PIP_NO_INDEX``). The URL is
a ``git+file://`` one of this repository, so the cell clones its HEAD.
"""

import os
import pathlib
import subprocess
import sys
import sysconfig
import venv

import pytest
from conftest import REPO
from conftest import load_script

build = load_script("notebooks/build.py")

# Where the cell found the project, without importing it (jax's import alone
# takes seconds).
FOUND = """
print("REPO", REPO)
for name in ("models", "optax_adama"):
  print(name, importlib.util.find_spec(name).origin)
"""
# The quickstart's own imports: where the wheel-only install failed.
IMPORTS = """
import models, optax_adama
from models import data
from models.harness import warmup_cosine_schedule
""" + FOUND


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory) -> pathlib.Path:
  """A virtual environment with the dependencies but not the project."""
  where = tmp_path_factory.mktemp("colab")
  venv.create(where / "venv", with_pip=False)
  python = where / "venv" / "bin" / "python"
  site = subprocess.run(
      [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      check=True, capture_output=True, text=True).stdout.strip()
  # A path line, not this environment's .pth files: its editable install of
  # the project (which puts the checkout on sys.path) stays out.
  pathlib.Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  return python


def _env() -> dict[str, str]:
  """This process's environment, less what would find the project, with the URL."""
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env.update(OPTAX_ADAMA_REPO=f"git+file://{REPO}", PIP_NO_INDEX="1",
             PIP_DISABLE_PIP_VERSION_CHECK="1")
  return env


def _run_cell(python: pathlib.Path, cwd: pathlib.Path, then: str) -> str:
  """The first cell, then ``then``, with OPTAX_ADAMA_REPO this repository's URL."""
  if subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True).returncode:
    pytest.skip("not a git checkout: nothing to clone")
  result = subprocess.run([python, "-c", build.INSTALL + "\n" + then], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def _found_in_the_clone(out: str, clone: pathlib.Path) -> None:
  assert f"REPO {clone}" in out
  assert f"models {clone / 'models' / '__init__.py'}" in out
  assert f"optax_adama {clone / 'optax_adama' / '__init__.py'}" in out


def test_first_cell_finds_the_project_in_a_clone_of_the_git_url(fresh_python, tmp_path):
  # Without the cell, nothing of the project is found here.
  bare = subprocess.run([fresh_python, "-c", "import models"], cwd=tmp_path, env=_env(),
                        capture_output=True, text=True)
  assert "No module named 'models'" in bare.stderr
  _found_in_the_clone(_run_cell(fresh_python, tmp_path, FOUND), tmp_path / "optax_adama_repo")
  # Run again (a second session on the same machine): the clone is reused.
  _found_in_the_clone(_run_cell(fresh_python, tmp_path, FOUND), tmp_path / "optax_adama_repo")


@pytest.mark.slow  # imports jax and flax in a new process: about 15 s of CPU
def test_first_cell_then_the_quickstarts_imports(fresh_python, tmp_path):
  _found_in_the_clone(_run_cell(fresh_python, tmp_path, IMPORTS), tmp_path / "optax_adama_repo")


def test_every_notebook_starts_with_the_cell():
  for name, cells in build.NOTEBOOKS.items():
    first = next(source for kind, source in cells if kind == "code")
    assert first.startswith(build.INSTALL), name


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
