"""The public surface: what a training script types, documented as optax documents it."""

import dataclasses
import importlib
import inspect
import pathlib
import re

import jax.numpy as jnp
import pytest

import optax_adama

SUBMODULES = ("contrib", "diagnostics", "memory", "moments", "schedules", "sharding")
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


@pytest.mark.parametrize("qualname, obj", list(_public_objects()),
                         ids=lambda x: x if isinstance(x, str) else "")
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


_REQUIRED = "(no default)"


def _documented_signatures():
  """(module, name, [(parameter, default text or None)]) for every
  ``- `name(params)` `` line of docs/api.md, the API reference."""
  text = (SOURCE.parent / "docs" / "api.md").read_text()
  module = "optax_adama"
  for line in text[text.index("# API reference"):].splitlines():
    heading = re.match(r"## `(optax_adama(?:\.\w+)?)`", line)
    if heading:
      module = heading.group(1)
    entry = re.match(r"- `(\w+)\((.*?)\)(?: -> [^`]+)?`", line)
    if entry:
      params = [p.strip() for p in entry.group(2).split(",") if p.strip()]
      yield module, entry.group(1), [tuple(p.split("=", 1)) if "=" in p else (p, _REQUIRED)
                                     for p in params]


def test_every_public_name_is_in_the_api_reference_under_its_module():
  text = (SOURCE.parent / "docs" / "api.md").read_text()
  for module in ["optax_adama"] + [f"optax_adama.{m}" for m in SUBMODULES]:
    start = text.index(f"## `{module}`")
    section = text[start:text.find("\n## `", start + 1)]
    for name in importlib.import_module(module).__all__:
      if name not in SUBMODULES:
        assert re.search(rf"`{name}[`(]", section), f"docs/api.md has no {module}.{name}"


def test_every_signature_line_of_the_api_reference_is_read():
  text = (SOURCE.parent / "docs" / "api.md").read_text()
  listed = re.findall(r"^- `\w+\(", text[text.index("# API reference"):], re.M)
  assert len(listed) == len(list(_documented_signatures())) >= 30


@pytest.mark.parametrize("module, name, documented", list(_documented_signatures()),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_the_api_reference_states_each_signature_as_the_code_has_it(module, name, documented):
  obj = getattr(importlib.import_module(module), name)
  prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
  # A class whose __init__ this library writes (nnx.Pytree's metaclass hides
  # it behind *args, **kwargs): that __init__'s parameters after self.
  own_init = inspect.isclass(obj) and any(
      "__init__" in vars(c) and c.__module__.startswith("optax_adama") for c in obj.__mro__)
  parameters = (list(inspect.signature(obj.__init__).parameters.values())[1:] if own_init
                else inspect.signature(obj).parameters.values())
  factories = ({f.name: f.default_factory() for f in dataclasses.fields(obj)
                if f.default_factory is not dataclasses.MISSING}
               if dataclasses.is_dataclass(obj) else {})
  want, keyword_only = [], False
  for p in parameters:
    if p.kind == p.KEYWORD_ONLY and not keyword_only:
      want.append(("*", _REQUIRED))  # the bare * before the first keyword-only one
    keyword_only |= p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
    default = factories[p.name] if p.name in factories else p.default
    want.append((prefix.get(p.kind, "") + p.name, _REQUIRED if default is p.empty else default))
  evaluate = lambda text: eval(text, {"jnp": jnp})  # pylint: disable=eval-used
  got = [(p, default if default is _REQUIRED else evaluate(default)) for p, default in documented]
  # With each default's type: a documented 0 is not the code's False.
  typed = lambda pairs: [(p, type(default), default) for p, default in pairs]
  assert typed(got) == typed(want), f"docs/api.md's {module}.{name} is stale"
