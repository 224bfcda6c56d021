"""The public surface: what a training script types, documented as optax documents it."""

import inspect
import pathlib
import re

import pytest

import optax_adama

SUBMODULES = ("diagnostics", "memory", "moments", "schedules", "sharding")
# Helpers that only tests use: private, reachable from their modules only.
PRIVATE = ("quantize_blocks", "dequantize_blocks", "stochastic_round",
           "split_micro_batches", "updates_every_micro_batch", "sharded_tree_shardings")
SOURCE = pathlib.Path(optax_adama.__file__).parent


def _public_objects():
  modules = [optax_adama] + [getattr(optax_adama, name) for name in SUBMODULES]
  for module in modules:
    for name in module.__all__:
      obj = getattr(module, name)
      if not inspect.ismodule(obj) and (callable(obj) or inspect.isclass(obj)):
        yield f"{module.__name__}.{name}", obj


def test_top_level_holds_what_a_training_script_types():
  names = [n for n in optax_adama.__all__ if n not in SUBMODULES]
  assert len(names) <= 22, names
  for name in optax_adama.__all__:
    assert hasattr(optax_adama, name), name
  for name in PRIVATE:
    assert not hasattr(optax_adama, name), name
    assert all(name not in getattr(optax_adama, m).__all__ for m in SUBMODULES), name


@pytest.mark.parametrize("qualname, obj", list(_public_objects()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_public_name_is_documented_with_an_example(qualname, obj):
  doc = inspect.getdoc(obj) or ""
  summary = doc.split("\n", 1)[0]
  assert summary and summary[-1] in ".:", f"{qualname}: no one-line summary"
  if inspect.isclass(obj):
    # A state or result type: its own example, or its maker's.
    assert "Examples:" in doc or re.search(r"examples? shows? one", doc), qualname
    return
  for section in ("Args:", "Returns:", "Examples:"):
    assert section in doc, f"{qualname} has no {section}"
  raises = re.search(r"^\s*raise \w", inspect.getsource(obj), re.M)
  if raises:
    assert "Raises:" in doc, f"{qualname} raises but documents no Raises:"


def test_no_stack_frames_and_no_function_attributes_in_the_library():
  for path in SOURCE.glob("*.py"):
    text = path.read_text()
    for pattern in (r"sys\._getframe", r"inspect\.(currentframe|stack)\(", r"\.f_back\b",
                    r"^\s*\w+_fn\.\w+\s*=", r"^\s*update\.\w+\s*="):
      assert not re.search(pattern, text, re.M), f"{path.name}: {pattern}"


def test_design_citations_point_at_files_in_the_repository():
  root = SOURCE.parent
  for folder in ("optax_adama", "models"):
    for path in (root / folder).glob("*.py"):
      for cited in re.findall(r"\b([\w/]*DESIGN\.md|docs/[\w/]+\.md)", path.read_text()):
        assert (root / cited).exists(), f"{path.name} cites {cited}, not in the repository"
