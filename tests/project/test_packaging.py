"""What pyproject.toml promises: the dependency floors `make test-min` runs, and
a wheel and an editable install of exactly two packages.

`make test-min` installs .ci/constraints-min.txt, which pins each floor
exactly; a floor raised or lowered in one file and not the other would leave
the floors untested. The wheel ships `optax_adama`, with its GPU spec files, and
`models` (the Flax zoo and its tools); an editable install maps the same two.
"""

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PINNED = ("jax", "jaxlib", "optax", "chex", "flax")


def _floors() -> dict[str, str]:
  """`name: version` for every `>=` requirement of the package and its extras."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  lines = list(project["dependencies"])
  for extra in project.get("optional-dependencies", {}).values():
    lines += extra
  floors = {}
  for line in lines:
    req = Requirement(line)
    for spec in req.specifier:
      if spec.operator == ">=":
        floors[canonicalize_name(req.name)] = spec.version
  return floors


def _pins() -> dict[str, str]:
  """`name: version` for every `==` line of the constraints file."""
  pins = {}
  text = (ROOT / ".ci" / "constraints-min.txt").read_text()
  for line in text.splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    req = Requirement(line)
    (spec,) = req.specifier
    assert spec.operator == "==", line
    pins[canonicalize_name(req.name)] = spec.version
  return pins


def test_constraints_pin_exactly_the_floors():
  floors, pins = _floors(), _pins()
  assert sorted(pins) == sorted(PINNED)
  for name in PINNED:
    if name == "jaxlib":  # not a direct dependency: jax pins its own jaxlib
      assert pins["jaxlib"] == pins["jax"]
    else:
      assert floors.get(name) == pins[name], (name, floors.get(name), pins[name])


def test_wheel_installs_the_library_and_the_zoo_and_nothing_else(tmp_path):
  # Built as a user's `pip install .` would (isolated, hatchling from the index).
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                  "--wheel-dir", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path)
  (wheel,) = tmp_path.glob("*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  top = {name.split("/")[0] for name in names}
  assert {t for t in top if not t.endswith(".dist-info")} == {"optax_adama", "models"}, sorted(top)
  for package in ("optax_adama", "models"):
    sources = {f"{p.relative_to(ROOT)}" for p in (ROOT / package).rglob("*.py")}
    assert sources <= names, sorted(sources - names)
  # The GPU descriptions optax_adama.memory's targets compile for (package data).
  specs = {f"optax_adama/gpu_specs/{p.name}"
           for p in (ROOT / "optax_adama" / "gpu_specs").glob("*.txtpb")}
  assert len(specs) == 4 and specs <= names, sorted(specs - names)
  # PEP 561: type checkers read the library's annotations from the wheel.
  assert "optax_adama/py.typed" in names


def test_editable_install_exposes_exactly_the_two_packages(tmp_path):
  """`pip install -e .` maps optax_adama and models, not the checkout's root.

  The editable wheel is built by the project's own backend (PEP 660's
  build_editable) and read: its import hook maps exactly the two packages, and
  it holds no path file naming the root, which would make `tests`,
  `benchmarks` and `examples` importable from anywhere.
  """
  from hatchling.build import build_editable  # the build backend, in the test extra

  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    wheel = tmp_path / build_editable(str(tmp_path))
  finally:
    os.chdir(cwd)
  archive = zipfile.ZipFile(wheel)
  texts = {name: archive.read(name).decode() for name in archive.namelist()
           if name.endswith((".pth", ".py"))}
  assert all(text.strip() != str(ROOT) for name, text in texts.items() if name.endswith(".pth"))
  (hook,) = [text for name, text in texts.items() if name.endswith(".py")]
  # editables writes one `F.map_module('name', '/path/to/name/__init__.py')` per package.
  mapped = dict(re.findall(r"map_module\('([A-Za-z_]+)', '([^']+)'\)", hook))
  assert mapped == {name: str(ROOT / name / "__init__.py") for name in ("optax_adama", "models")}
