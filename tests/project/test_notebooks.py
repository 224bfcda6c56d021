"""Executes every notebook on its smallest setting, so none of them rots."""

import pytest
from conftest import REPO
from conftest import load_script

NOTEBOOKS = REPO / "notebooks"
build = load_script("notebooks/build.py")


# One notebook runs in the default suite (the shortest, 33 s on 2 cores); the
# others, 38-59 s each, run with the slow tests. Every committed notebook's
# sources are checked against build.py below either way.
SMOKE_NOTEBOOK = "scale_out.ipynb"


@pytest.mark.parametrize("name", [
    name if name == SMOKE_NOTEBOOK else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(build.NOTEBOOKS)])
def test_notebook_runs_top_to_bottom(name, monkeypatch):
  monkeypatch.setenv("NOTEBOOK_SMOKE", "1")  # the kernel inherits it
  nb = build.execute(build.to_notebook(build.NOTEBOOKS[name]), timeout=600)
  errors = [o for cell in nb.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
  # Plots are stored as images so the notebook reads well on GitHub.
  assert any("image/png" in o.get("data", {}) for cell in nb.cells
             if cell.cell_type == "code" for o in cell.get("outputs", []))


@pytest.mark.parametrize("name", sorted(build.NOTEBOOKS))
def test_committed_notebook_matches_its_source(name):
  import nbformat
  committed = nbformat.read(NOTEBOOKS / name, as_version=4)
  sources = [c.source for c in committed.cells]
  assert sources == [src for _, src in build.NOTEBOOKS[name]], (
      f"{name} is stale: run `python notebooks/build.py {name}`")
