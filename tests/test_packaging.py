"""The dependency floors in pyproject.toml are the versions `make test-min` runs.

`make test-min` installs .ci/constraints-min.txt, which pins each floor
exactly; a floor raised or lowered in one file and not the other would leave
the floors untested.
"""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
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
