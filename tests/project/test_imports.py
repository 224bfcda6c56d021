"""The import graph of the repository's packages is acyclic and layered.

Data flows one way: the harness (the commands `python -m models.<command>`
and the library below them) imports the model zoo, the zoo imports
`optax_adama`, and nothing imports back up. The graph is read from the source
with `ast`, lazy (function-level) imports included: a circle closed by an
import inside a function still ties the modules together, it only fails
later, on the first call that reaches it.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("optax_adama", "models")
# The tools' package: the harness below the commands (models/harness/).
HARNESS = "models.harness"
# Harness code outside models/harness/ while it is merged into the library's
# planner (optax_adama.memory.plan); read as a tool where it is still there.
TOOLS_ELSEWHERE = frozenset({"models.planner"})


@dataclasses.dataclass(frozen=True)
class Import:
  """One import statement's target, resolved to a module of the packages."""

  target: str  # dotted module name, e.g. "models.bench"
  line: int
  lazy: bool  # inside a function body: runs on a call, not at import

  def __repr__(self) -> str:
    return f"{self.target} (line {self.line}{', lazy' if self.lazy else ''})"


def module_name(path: Path, root: Path) -> str:
  """`models/bench.py` -> "models.bench"; a package's `__init__.py` -> its name."""
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def package_sources(root: Path, packages: Iterable[str]) -> dict[str, Path]:
  """Module name -> source file, for every .py file of the packages."""
  return {module_name(path, root): path
          for package in packages for path in sorted((root / package).rglob("*.py"))}


class _Collector(ast.NodeVisitor):
  """Every import of a module's source, each marked lazy when a function holds it."""

  def __init__(self, module: str, is_package: bool):
    self.module, self.is_package = module, is_package
    self.depth = 0  # enclosing function bodies
    self.found: list[tuple[str, str | None, int, bool]] = []  # (base, name, line, lazy)

  def _function(self, node: ast.AST) -> None:
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

  def visit_Import(self, node: ast.Import) -> None:
    for alias in node.names:
      self.found.append((alias.name, None, node.lineno, self.depth > 0))

  def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
    base = node.module or ""
    if node.level:  # relative: from the module's package, `level - 1` packages up
      package = self.module.split(".")
      if not self.is_package:
        package.pop()
      package = package[:len(package) - (node.level - 1)]
      base = ".".join(package + ([base] if base else []))
    for alias in node.names:
      self.found.append((base, alias.name, node.lineno, self.depth > 0))


def module_imports(module: str, path: Path, known: Iterable[str]) -> list[Import]:
  """The imports of one module that land in `known` modules.

  `import models` and `from models import PRESETS` are the package's
  `__init__`; `from models import bench` and `import models.bench` are the
  submodule (which Python runs after the package).
  """
  known = set(known)
  collector = _Collector(module, path.name == "__init__.py")
  collector.visit(ast.parse(path.read_text(), filename=str(path)))
  imports = []
  for base, name, line, lazy in collector.found:
    target = f"{base}.{name}" if name is not None and f"{base}.{name}" in known else base
    while target and target not in known:  # `import optax_adama.memory.x`: the longest known
      target = target.rpartition(".")[0]
    if target and (target, line) not in {(i.target, i.line) for i in imports}:
      imports.append(Import(target, line, lazy))
  return imports


def import_graph(root: Path = ROOT,
                 packages: Iterable[str] = PACKAGES) -> dict[str, list[Import]]:
  """Module -> the imports it makes of the packages' modules (lazy ones too)."""
  sources = package_sources(root, packages)
  return {module: module_imports(module, path, sources) for module, path in sources.items()}


def find_cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
  """Circles of `edges` (node -> its successors), each a closed path [a, ..., a].

  Tarjan's algorithm finds the strongly connected components; in each, the
  shortest circle through every member not yet on a reported one, so each
  module caught in a circle shows up in at least one.
  """
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[list[str]] = []

  def connect(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for succ in edges.get(node, ()):
      if succ not in index:
        connect(succ)
        low[node] = min(low[node], low[succ])
      elif succ in on_stack:
        low[node] = min(low[node], index[succ])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      components.append(component)

  def shortest_circle(start: str, members: set[str]) -> list[str]:
    previous: dict[str, str] = {}  # breadth first, inside the component
    frontier = [start]
    while start not in previous:
      successors = []
      for node in frontier:
        for succ in sorted(set(edges.get(node, ()))):
          if succ in members and succ not in previous:
            previous[succ] = node
            successors.append(succ)
      frontier = successors
    path = [start]
    while path[-1] != start or len(path) == 1:
      path.append(previous[path[-1]])
    return path[::-1]

  for node in sorted(edges):
    if node not in index:
      connect(node)
  cycles = []
  for component in components:
    members = set(component)
    if len(component) == 1 and component[0] not in set(edges.get(component[0], ())):
      continue
    covered: set[str] = set()
    for start in sorted(component):
      if start not in covered:
        cycles.append(shortest_circle(start, members))
        covered.update(cycles[-1])
  return sorted(cycles)


def command_modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> set[str]:
  """Modules with an `if __name__ == "__main__":` block: `python -m` commands."""
  commands = set()
  for module, path in package_sources(root, packages).items():
    for node in ast.parse(path.read_text()).body:
      if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
          and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
        commands.add(module)
  return commands


def _edges(graph: Mapping[str, list[Import]]) -> dict[str, list[str]]:
  # A module importing its own name gets itself back (a no-op), not a circle.
  return {module: [i.target for i in imports if i.target != module]
          for module, imports in graph.items()}


def test_no_import_circle():
  graph = import_graph()
  cycles = find_cycles(_edges(graph))

  def describe(cycle):
    lines = lambda a, b: ", ".join(dict.fromkeys(repr(i) for i in graph[a] if i.target == b))
    steps = [f"{a} -> {b} ({lines(a, b)})" for a, b in zip(cycle, cycle[1:])]
    return "\n  ".join(steps)

  assert not cycles, "import circles:\n  " + "\n\n  ".join(map(describe, cycles))


def library_violations(root: Path = ROOT) -> list[str]:
  """Imports of `optax_adama` that reach up: models at any level, flax at import
  time (an optional NNX entry may import flax inside a function)."""
  wrong = []
  for module, path in package_sources(root, ["optax_adama"]).items():
    collector = _Collector(module, path.name == "__init__.py")
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    for base, _, line, lazy in collector.found:
      top = base.split(".")[0]
      if top == "models" or (top == "flax" and not lazy):
        wrong.append(f"{module} imports {base} (line {line}{', lazy' if lazy else ''})")
  return wrong


def test_library_imports_neither_models_nor_flax_at_module_level():
  assert "optax_adama._adama" in package_sources(ROOT, ["optax_adama"])
  wrong = library_violations()
  assert not wrong, "\n".join(wrong)


def test_library_violations_are_found(tmp_path):
  (tmp_path / "optax_adama").mkdir()
  (tmp_path / "optax_adama" / "__init__.py").write_text("import flax.nnx\n")
  (tmp_path / "optax_adama" / "_nnx.py").write_text(
      "def entry():\n  from flax import nnx\n  from models import gpt\n  return nnx, gpt\n")
  assert library_violations(tmp_path) == [
      "optax_adama imports flax.nnx (line 1)",
      "optax_adama._nnx imports models (line 3, lazy)"]


def test_nothing_outside_the_library_imports_its_private_names():
  """models/, benchmarks/, examples/ and the notebooks' code cells use the public
  API: no `optax_adama._x` module and no `_name` from an `optax_adama` module
  (`models.planner` imported `optax_adama._search` before the zoo's planner gave
  its levers to `optax_adama.memory.plan`). tests/ are exempt: white-box tests of
  private functions are allowed."""
  import json  # pylint: disable=import-outside-toplevel

  def private(module: str) -> bool:
    return module.split(".")[0] == "optax_adama" and any(
        part.startswith("_") for part in module.split(".")[1:])

  sources = [(path.relative_to(ROOT).as_posix(), path.read_text())
             for folder in ("models", "benchmarks", "examples")
             for path in sorted((ROOT / folder).rglob("*.py"))]
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    cells = [cell for cell in json.loads(path.read_text())["cells"]
             if cell["cell_type"] == "code"]
    for number, cell in enumerate(cells, 1):
      # IPython's shell and magic lines are no Python: blank, so lines keep their numbers.
      lines = "".join(cell["source"]).splitlines()
      code = "\n".join("" if line.lstrip().startswith(("!", "%")) else line for line in lines)
      sources.append((f"{path.relative_to(ROOT).as_posix()} (code cell {number})", code))
  wrong = []
  for name, code in sources:
    for node in ast.walk(ast.parse(code, filename=name)):
      if isinstance(node, ast.Import):
        wrong += [f"{name}:{node.lineno}: import {alias.name}" for alias in node.names
                  if private(alias.name)]
      elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
        if private(node.module):
          wrong.append(f"{name}:{node.lineno}: from {node.module} import ...")
        elif node.module.split(".")[0] == "optax_adama":
          wrong += [f"{name}:{node.lineno}: from {node.module} import {alias.name}"
                    for alias in node.names if alias.name.startswith("_")]
  assert len(sources) > 20, sources  # the folders were read
  assert not wrong, "private optax_adama names imported:\n" + "\n".join(wrong)


def zoo_and_tools(root: Path = ROOT) -> tuple[set[str], set[str]]:
  """The `models` package read from its layout: (the zoo, the tools).

  The tools are `models.harness` and its modules, and the commands (a module
  with an `if __name__ == "__main__":` block); every other module of
  `models` is the zoo: the models, their layers and their I/O.
  """
  modules = set(package_sources(root, ["models"]))
  tools = {m for m in modules if m == HARNESS or m.startswith(HARNESS + ".")}
  tools |= command_modules(root, ["models"]) | (TOOLS_ELSEWHERE & modules)
  return modules - tools, tools


def test_zoo_imports_no_harness_module():
  graph = import_graph()
  zoo, tools = zoo_and_tools()
  assert {"models", "models.gpt", "models.layers", "models.data"} <= zoo, zoo
  assert {HARNESS, "models.train", "models.gpu_bench"} <= tools, tools
  wrong = [f"{m} imports {i}" for m in sorted(zoo) for i in graph[m] if i.target in tools]
  assert not wrong, "the zoo imports the harness:\n" + "\n".join(wrong)


def test_the_layout_tells_the_zoo_from_the_tools(tmp_path):
  package = tmp_path / "models"
  (package / "harness").mkdir(parents=True)
  for name in ("__init__.py", "gpt.py", "harness/__init__.py", "harness/loop.py"):
    (package / name).write_text("")
  (package / "train.py").write_text("def main():\n  pass\n\n\nif __name__ == '__main__':\n"
                                    "  main()\n")
  assert zoo_and_tools(tmp_path) == ({"models", "models.gpt"},
                                     {"models.harness", "models.harness.loop", "models.train"})


def test_no_module_imports_a_command():
  """Commands sit on top: shared code lives below them, so none imports another."""
  graph = import_graph()
  commands = command_modules()
  assert {"models.train", "models.bench", "models.plan", "models.validate",
          "models.demo", "models.gpu_bench"} <= commands
  wrong = [f"{m} imports the command {i}" for m, imports in sorted(graph.items())
           for i in imports if i.target in commands and i.target != m]
  assert not wrong, "\n".join(wrong)


def test_find_cycles_reports_each_circle():
  assert find_cycles({"a": ["b"], "b": ["c"], "c": []}) == []
  assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": ["a"]}) == [["a", "a"]]
  cycles = find_cycles({"a": ["b"], "b": ["a"], "c": ["d"], "d": ["c"]})
  assert sorted(cycles) == [["a", "b", "a"], ["c", "d", "c"]]


def test_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
  package = tmp_path / "pkg"
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("from pkg import a\n")
  (package / "a.py").write_text("import os\nfrom . import b\n")
  (package / "b.py").write_text(
      "def later():\n  from pkg.sub import c\n  return c\n")
  (package / "sub" / "__init__.py").write_text("")
  (package / "sub" / "c.py").write_text("from ..a import x\nimport pkg\n")
  graph = import_graph(tmp_path, ["pkg"])
  assert {m: [(i.target, i.lazy) for i in imports] for m, imports in graph.items()} == {
      "pkg": [("pkg.a", False)],
      "pkg.a": [("pkg.b", False)],
      "pkg.b": [("pkg.sub.c", True)],
      "pkg.sub": [],
      "pkg.sub.c": [("pkg.a", False), ("pkg", False)],
  }
  assert find_cycles(_edges(graph)) == [["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg"]]


def test_commands_are_found_by_their_main_block(tmp_path):
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "__init__.py").write_text("")
  (tmp_path / "pkg" / "cli.py").write_text(
      "def main():\n  pass\n\n\nif __name__ == '__main__':\n  main()\n")
  (tmp_path / "pkg" / "lib.py").write_text("def main():\n  pass\n")
  assert command_modules(tmp_path, ["pkg"]) == {"pkg.cli"}


def test_library_modules_stay_under_600_lines():
  """A module over 600 lines is split by topic before it grows: the library's, and
  the zoo's and its tools' (``models/`` and its subpackages)."""
  long_modules = {str(path.relative_to(ROOT)): n for package in PACKAGES
                  for path in sorted((ROOT / package).rglob("*.py"))
                  if (n := len(path.read_text().splitlines())) > 600}
  assert not long_modules, f"split by topic: {long_modules}"
