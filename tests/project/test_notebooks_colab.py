"""The notebooks' first cell, inside a clone and where only the notebook exists (Colab).

Inside a clone the cell finds it from the working directory up. Elsewhere
``OPTAX_ADAMA_REPO`` names a clone or the repository's git URL; the cell must
make ``import models`` work, though the wheel built from the repository holds
``optax_adama`` alone. Checked in a fresh virtual environment outside the
checkout: its packages are the project's dependencies (this environment's, as
Colab comes with jax and flax), but neither ``optax_adama`` nor ``models`` is
importable, and pip may not download anything (``PIP_NO_INDEX``). The URL is
a ``git+file://`` one of this repository, so the cell clones its HEAD. With
neither a clone nor the variable, the cell says what to set in one line and
stops the notebook, in Python and in a Jupyter kernel, without a traceback.
"""

import os
import pathlib
import shutil
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


def _without_the_variable() -> dict[str, str]:
  env = _env()
  del env["OPTAX_ADAMA_REPO"]
  return env


def _cell(python: pathlib.Path | str, cwd: pathlib.Path, env: dict[str, str],
          then: str) -> subprocess.CompletedProcess:
  return subprocess.run([python, "-c", build.INSTALL + "\n" + then], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def _clone_as_the_cell_sees_it(where: pathlib.Path) -> pathlib.Path:
  """A folder the cell takes for a clone: the pyproject.toml, models/ and optax_adama/."""
  where.mkdir()
  shutil.copy(REPO / "pyproject.toml", where)
  for package in ("models", "optax_adama"):
    (where / package).symlink_to(REPO / package)
  return where


# The shipped cell took "..": right from notebooks/ alone, and a missing
# pyproject.toml (a traceback) from the clone's root or any deeper folder.
@pytest.mark.parametrize("inside", [".", "notebooks", "docs/deeper"])
def test_first_cell_opened_inside_a_clone_uses_that_clone(fresh_python, tmp_path, inside):
  clone = _clone_as_the_cell_sees_it(tmp_path / "clone")
  cwd = clone / inside
  cwd.mkdir(parents=True, exist_ok=True)
  result = _cell(fresh_python, cwd, _without_the_variable(), FOUND)
  assert result.returncode == 0, result.stderr[-3000:]
  _found_in_the_clone(result.stdout, clone)


WHAT_TO_SET = ("set OPTAX_ADAMA_REPO to a clone's path or to the git URL you cloned it from "
               "(`git remote get-url origin` in your clone)")


def _outside_any_clone(folder: pathlib.Path) -> pathlib.Path:
  assert not any((f / "pyproject.toml").exists() for f in (folder, *folder.parents))
  return folder


@pytest.mark.parametrize("variable", [None, "a folder that is no clone"])
def test_first_cell_outside_a_clone_says_what_to_set_in_one_line(fresh_python, tmp_path,
                                                                  variable):
  env = _without_the_variable()
  if variable is not None:
    env["OPTAX_ADAMA_REPO"] = str(tmp_path)
  result = _cell(fresh_python, _outside_any_clone(tmp_path), env, "print('the next cell ran')")
  # Unset, the shipped cell raised FileNotFoundError: .../pyproject.toml.
  assert (result.returncode, result.stdout) == (1, ""), result.stderr[-3000:]
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and WHAT_TO_SET in lines[0], result.stderr[-3000:]


def test_in_a_notebook_the_first_cell_stops_the_run_with_one_line(tmp_path, monkeypatch):
  # What Jupyter and Colab show: the cell fails (so "Run all" stops there)
  # with the one line as its whole error output, and the next cell never runs.
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError

  monkeypatch.delenv("OPTAX_ADAMA_REPO", raising=False)  # the kernel inherits the rest
  nb = build.to_notebook([("code", build.INSTALL), ("code", "print('the next cell ran')")])
  client = NotebookClient(nb, timeout=120, kernel_name="python3",
                          resources={"metadata": {"path": str(_outside_any_clone(tmp_path))}})
  with pytest.raises(CellExecutionError):
    client.execute()
  first, following = nb.cells
  assert [o.output_type for o in first.outputs] == ["error"]
  (line,) = first.outputs[0].traceback
  assert line.startswith("Not in a clone of optax_adama: ") and WHAT_TO_SET in line
  assert following.outputs == [] and following.execution_count is None


def test_every_notebook_starts_with_the_cell():
  for name, cells in build.NOTEBOOKS.items():
    first = next(source for kind, source in cells if kind == "code")
    assert first.startswith(build.INSTALL), name


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
