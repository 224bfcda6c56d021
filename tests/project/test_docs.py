"""Every ```python block of README.md and docs/*.md runs, extracted from the page.

One case per page: its python blocks, in order, run in one fresh namespace (a
block may set up names the next one uses). Shell commands are ```bash blocks
and output is ```text; neither runs. A page that needs several devices says so
in a comment, ``<!-- test_docs: devices=8 ... -->``; it then runs in a
subprocess with that many virtual CPU devices (the device count is fixed when
JAX starts, and this process has started it with one), with warnings as
errors, as here.

The blocks run under JAX's default promotion rules, not the strict ones of
``conftest.py``: they are the code a user types, in a user's JAX (optax's own
transformations, which the pages use as baselines, need standard promotion).

Run one page by hand: ``python tests/project/test_docs.py docs/usage.md``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A fence opens with ``` and a language at the start of a line and closes with
# the next bare ``` line.
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_DEVICES = re.compile(r"<!--\s*test_docs:\s*devices=(\d+)")
_LANGUAGES = ("python", "bash", "text")


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
  """``(language, first code line, code)`` of every fenced block, in order."""
  return [(m.group(1), text.count("\n", 0, m.start(2)) + 1, m.group(2))
          for m in _FENCE.finditer(text)]


def python_blocks(text: str) -> list[tuple[int, str]]:
  return [(line, code) for language, line, code in fenced_blocks(text)
          if language == "python"]


def run_page(path: pathlib.Path) -> int:
  """Runs the page's python blocks in order in one namespace; returns how many.

  Each block is compiled with the page as its file name and padded to its line
  there, so a traceback points at the line of the page that raised.
  """
  import jax  # pylint: disable=import-outside-toplevel

  namespace = {"__name__": f"docs.{path.stem}"}
  blocks = python_blocks(path.read_text())
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    for line, code in blocks:
      exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
  return len(blocks)


def _page_id(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


# The heaviest pages run with the slow tests; what their code calls keeps its
# smoke in the default run (fit: tests/library/test_plan.py; the release step:
# tests/library/test_release.py; 8 devices: tests/library/test_sharding.py,
# tests/project/test_examples.py; nnx: tests/library/test_nnx_entry.py), as does this
# runner on the other pages.
_SLOW_PAGES = ("docs/fit.md", "docs/release.md", "docs/scale_out.md", "docs/nnx.md")


@pytest.mark.parametrize("path", [
    pytest.param(path, marks=pytest.mark.slow) if _page_id(path) in _SLOW_PAGES else path
    for path in PAGES], ids=_page_id)
def test_python_blocks_run(path):
  match = _DEVICES.search(path.read_text())
  if match is None:
    run_page(path)
    return
  # Imported here: run as a script (the page's subprocess) this file must not
  # load conftest's strict promotion settings.
  from conftest import xla_flags  # pylint: disable=import-outside-toplevel
  python_path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": xla_flags(int(match.group(1))),
         "PYTHONPATH": os.pathsep.join(filter(None, python_path))}
  result = subprocess.run(
      [sys.executable, "-W", "error", __file__, str(path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, (
      f"{_page_id(path)} failed with {match.group(1)} devices:\n"
      f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}")


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_fences_name_a_language(path):
  """Untagged or misspelled fences would be skipped silently; every fence says
  what it is, and pages that show code have some python to run."""
  languages = [language for language, _, _ in fenced_blocks(path.read_text())]
  assert set(languages) <= set(_LANGUAGES), (_page_id(path), languages)


def test_every_page_is_found_and_has_python():
  names = {_page_id(path) for path in PAGES}
  assert {"README.md", "docs/usage.md", "docs/design.md"} <= names
  # The two index pages (of the docs, of the benchmark files) hold links only.
  indexes = {"docs/README.md", "docs/benchmarks.md"}
  assert all(python_blocks(path.read_text()) for path in PAGES
             if _page_id(path) not in indexes), "a page lost its python blocks"


def _heading_anchors(path: pathlib.Path) -> set[str]:
  """GitHub's anchors of a page's headings (code blocks left out)."""
  text = _FENCE.sub("", path.read_text())
  headings = re.findall(r"^#+\s+(.*?)\s*$", text, re.MULTILINE)
  return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
          for heading in headings}


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_relative_links_resolve(path):
  """Links to files of the repository, and to their headings, exist."""
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
    if re.match(r"[a-z]+://", target):
      continue
    file_part, _, anchor = target.partition("#")
    linked = (path.parent / file_part).resolve() if file_part else path
    if not linked.exists() or (
        anchor and linked.suffix == ".md" and anchor not in _heading_anchors(linked)):
      broken.append(target)
  assert not broken, f"{_page_id(path)}: broken links {broken}"


def test_the_api_reference_lists_every_public_name():
  import optax_adama  # pylint: disable=import-outside-toplevel

  usage = (ROOT / "docs" / "api.md").read_text()
  modules = {"optax_adama": optax_adama, **{
      f"optax_adama.{name}": getattr(optax_adama, name)
      for name in ("memory", "moments", "sharding", "schedules", "diagnostics", "contrib")}}
  missing = [f"{module_name}.{name}" for module_name, module in modules.items()
             for name in module.__all__
             if not isinstance(getattr(module, name), type(optax_adama))
             and f"`{name}" not in usage]
  assert not missing, f"docs/api.md does not list {missing}"


def test_a_block_that_raises_fails_its_page(tmp_path):
  page = tmp_path / "broken.md"
  page.write_text(textwrap.dedent("""\
      # A page

      ```python
      value = 1
      ```

      ```bash
      this is not run
      ```

      ```python
      assert value == 2, "the second block sees the first block's names"
      ```
      """))
  with pytest.raises(AssertionError, match="second block") as info:
    run_page(page)
  # The traceback names the page and the line of the failing block.
  assert any(entry.path == page and entry.lineno + 1 == 12
             for entry in info.traceback), info.traceback


if __name__ == "__main__":
  # The subprocess of a page that needs several devices: XLA_FLAGS is set
  # before JAX starts.
  sys.exit(0 if run_page(pathlib.Path(sys.argv[1])) >= 0 else 1)


def _readme_blocks() -> list[tuple[int, str]]:
  return python_blocks((ROOT / "README.md").read_text())


@pytest.mark.parametrize("index", range(len(_readme_blocks())), ids=lambda i: f"block{i}")
def test_each_readme_block_runs_alone(index):
  """A reader copies one quick start, not the page: each block is whole."""
  line, code = _readme_blocks()[index]
  with jax_standard_promotion():
    exec(compile("\n" * (line - 1) + code, str(ROOT / "README.md"), "exec"),
         {"__name__": f"readme_block{index}"})


def jax_standard_promotion():
  import contextlib  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  stack = contextlib.ExitStack()
  stack.enter_context(jax.numpy_dtype_promotion("standard"))
  stack.enter_context(jax.numpy_rank_promotion("allow"))
  return stack


def _linked_pages(text: str, prefix: str) -> list[str]:
  """The .md pages a markdown list links, in order, each once."""
  pages = re.findall(rf"\]\({re.escape(prefix)}([\w.-]+\.md)\)", text)
  return list(dict.fromkeys(pages))


def test_docs_index_lists_every_page_and_the_readme_matches_it():
  """docs/README.md indexes every page of docs/; the README's documentation list
  links the index and then the same pages, in the index's order."""
  pages = {page.name for page in (ROOT / "docs").glob("*.md")} - {"README.md"}
  indexed = _linked_pages((ROOT / "docs" / "README.md").read_text(), "")
  assert sorted(indexed) == sorted(pages), (
      f"docs/README.md leaves out {sorted(pages - set(indexed))}, "
      f"links missing pages {sorted(set(indexed) - pages)}")
  readme = (ROOT / "README.md").read_text()
  listed = _linked_pages(readme[readme.index("## Documentation"):].split("\n## ", 1)[0],
                         "docs/")
  assert listed == ["README.md", *indexed], listed


def test_pages_keep_to_their_length():
  """The README is a front page (about 200 lines); a docs page is one topic (400)."""
  assert len((ROOT / "README.md").read_text().splitlines()) <= 200
  long_pages = {_page_id(page): n for page in (ROOT / "docs").glob("*.md")
                if (n := len(page.read_text().splitlines())) > 400}
  assert not long_pages, f"split by topic: {long_pages}"


def test_quoted_plan_search_times_are_the_recorded_ones():
  """A plan's search time on a page is the one its JSON recorded (models.plan
  writes "seconds"), not a number left from an older revision."""
  page = (ROOT / "docs" / "activation_memory.md").read_text()
  checked = 0
  for row in re.findall(
      r"^\|.*\]\(\.\./benchmarks/results/memory/plan_[^)]*\).*$|^\| `\w+`, \d+ GB \|.*$",
      page, re.MULTILINE):
    preset = re.match(r"\| `(\w+)`, (\d+) GB", row)
    if preset is None:
      continue
    plans = (ROOT / "benchmarks" / "results" / "memory").glob(f"plan_{preset[1]}_*gb.json")
    (raw,) = [path for path in plans
              if f"x{preset[2]}gb" in path.name or f"_{preset[2]}gb" in path.name]
    recorded = json.loads(raw.read_text()).get("seconds")
    if recorded is None:
      continue
    quoted = re.findall(r"\| (\d+(?:\.\d+)?) (s|min) \|\s*$", row)
    assert quoted, f"{raw.name} recorded {recorded} s; the row quotes no search time: {row}"
    value, unit = quoted[0]
    assert abs(float(value) * (60 if unit == "min" else 1) - recorded) <= 1, (row, recorded)
    checked += 1
  assert checked, "no plan row with a recorded search time"


def test_the_api_reference_gives_micro_batch_optimizer_update_whole():
  import inspect  # pylint: disable=import-outside-toplevel

  from optax_adama import nnx as adama_nnx  # pylint: disable=import-outside-toplevel

  signature = inspect.signature(adama_nnx.MicroBatchOptimizer.update)
  names = [("*" if p.kind == p.VAR_POSITIONAL else "") + p.name
           for p in signature.parameters.values() if p.name != "self"]
  documented = re.search(r"`\.update\(([^)]*)\)", (ROOT / "docs" / "api.md").read_text())
  assert documented, "docs/api.md gives no MicroBatchOptimizer.update"
  given = [part.strip().split("=")[0] for part in documented[1].split(",")]
  assert [name for name in given if name != "*"] == names, (given, names)


def _documented_commands(module: str) -> list[list[str]]:
  """The argv of every ``python -m <module>`` line in the pages' bash blocks."""
  import shlex  # pylint: disable=import-outside-toplevel

  commands = []
  for page in PAGES:
    for language, _, code in fenced_blocks(page.read_text()):
      if language != "bash":
        continue
      for command in code.replace("\\\n", " ").splitlines():
        if f"python -m {module} " not in f"{command} ":
          continue
        words = shlex.split(command, comments=True)
        start = words.index("python")  # after any VAR=value prefixes
        commands.append(words[start + 3:])
  return commands


def test_a_page_shows_how_to_train_the_small_llamas_and_the_command_parses():
  from models import train  # pylint: disable=import-outside-toplevel

  commands = _documented_commands("models.train")
  presets = {argv[argv.index("--preset") + 1] for argv in commands if "--preset" in argv}
  assert {"llama_test", "llama_tiny"} <= presets, presets
  for argv in commands:
    if "--init-from" not in argv:  # a placeholder DIR
      args = train.build_parser().parse_args(argv)
      assert args.model in (None, "gpt", "bert", "vit", "llama"), argv


def test_install_lines_name_what_can_be_installed():
  """optax_adama is not on PyPI: every `pip install` of it is from a clone (`-e`) or
  a git URL, and the Install section says what `import models` needs."""
  from_pypi = []
  for page in PAGES + sorted((ROOT / "optax_adama").glob("*.py")):
    for line in page.read_text().splitlines():
      if re.search(r"pip install\b.*['\"]?optax_adama\b", line) and not re.search(
          r"-e\b|@ git\+", line):
        from_pypi.append(f"{_page_id(page)}: {line.strip()}")
  assert not from_pypi, from_pypi
  readme = (ROOT / "README.md").read_text()
  install = readme[readme.index("## Install"):].split("\n## ", 1)[0]
  assert "`import models`" in install and "`[models]` extra" in install
  assert '".[flax]"' in install and "optax_adama.nnx" in install
