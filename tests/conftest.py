"""Strict JAX settings for every test, in the style of Equinox's test suite,
and the small MLP most library tests train.

Rank promotion and implicit dtype promotion raise, so library code must say
what it means. Reference optimizers from optax are run under
``jax.numpy_dtype_promotion("standard")`` where they need it (optax's own bias
correction computes ``float ** int32``).
"""

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

# The tests check math and bytes, not speed: XLA compiles them without LLVM's
# costly optimization passes (the compiled HLO, and so every memory analysis,
# is the same; the machine code is slower). Measured on 2 cores: 94 s -> 66 s
# for three compile-bound test functions. The tests' subprocesses inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

# After the line above: jax reads XLA_FLAGS when it is first imported.
import jax  # noqa: E402  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  # pylint: disable=wrong-import-position

# The tiny Llama checkpoints with their own tokenizers, fixtures of every test.
from fixtures_text import llama_bpe_dir  # noqa: E402,F401  # pylint: disable=unused-import
from fixtures_text import llama_sentencepiece_dir  # noqa: E402,F401

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@dataclasses.dataclass(frozen=True)
class MLP:
  """``num_layers`` square tanh layers ``{"layer{i}": {"w", "b"}}`` and a squared error."""

  num_layers: int = 3
  width: int = 8

  def params(self, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), self.num_layers)
    return {
        f"layer{i}": {
            "w": (jax.random.normal(k, (self.width, self.width))
                  / self.width**0.5).astype(dtype),
            "b": jnp.zeros(self.width, dtype),
        }
        for i, k in enumerate(keys)
    }

  def abstract_params(self, dtype=jnp.float32):
    """The params as `jax.ShapeDtypeStruct`s: compile-only tests allocate nothing."""
    return jax.eval_shape(lambda: self.params(dtype))

  def batch(self, seed, size):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (size, self.width)),
            "y": jax.random.normal(ky, (size, self.width))}

  def abstract_batch(self, size):
    shape = jax.ShapeDtypeStruct((size, self.width), jnp.float32)
    return {"x": shape, "y": shape}

  @staticmethod
  def loss(params, batch):
    """Mean squared error of the MLP; computes in the params' dtype."""
    x = batch["x"].astype(params["layer0"]["w"].dtype)
    for i in range(len(params)):
      layer = params[f"layer{i}"]
      x = jnp.tanh(x @ layer["w"] + layer["b"][None, :])
    return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)


@pytest.fixture
def mlp():
  return MLP()


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def update_with_halves(optimizer, model, grad_fn, micro_batch):
  """``optimizer.update`` with what ``nu_estimator="split"`` folds: the mean of
  the micro-batch's two halves' gradients (``grad_fn(model, rows)``) and their
  half difference as the extra ``half_difference`` argument, as the fused
  step takes them."""
  half = len(jax.tree.leaves(micro_batch)[0]) // 2
  g_a, g_b = (grad_fn(model, jax.tree.map(lambda x: x[rows], micro_batch))
              for rows in (slice(None, half), slice(half, None)))
  optimizer.update(model, jax.tree.map(lambda a, b: (a + b) / 2, g_a, g_b),
                   half_difference=jax.tree.map(lambda a, b: (a - b) / 2, g_a, g_b))


REPO = pathlib.Path(__file__).resolve().parents[1]


def load_script(relative_path: str):
  """A script of the repository outside the packages (``benchmarks/scripts/x.py``,
  ``notebooks/build.py``) imported as the module ``<folder>_<file>``, and
  registered in ``sys.modules`` (dataclasses look their module up there)."""
  path = REPO / relative_path
  name = f"{path.parent.name}_{path.stem}"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def xla_flags(num_devices=None) -> str:
  """XLA_FLAGS for a test's subprocess: this run's flags (the fast compiles
  above) without any CPU device count, and ``num_devices`` devices if given."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith(_DEVICE_COUNT_FLAG)]
  if num_devices is not None:
    flags.append(f"{_DEVICE_COUNT_FLAG}={num_devices}")
  return " ".join(flags)


def run_on_devices(script: str | pathlib.Path, devices: int = 8) -> dict:
  """``script`` run as its own process on ``devices`` CPU devices (the device
  count is fixed when jax starts, so a test on a mesh runs its file as a
  script): the JSON of its last line. The script imports conftest: tests/ is
  on its path."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"),
                                       env.get("PYTHONPATH", "")])
  result = subprocess.run([sys.executable, os.path.abspath(script)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
  """One persistent compilation cache for the whole run, in a fresh directory.

  Many tests build the same program again in a new closure or process: the
  trainer of tests/zoo/test_checkpoint.py for each run and resume, and its
  stopped and resumed subprocesses. With the cache, XLA compiles each such
  program once and the others load the executable it wrote (its HLO text and
  memory analysis included), so every check sees what it saw; JAX caches
  compiles of a second or more (jax_persistent_cache_min_compile_time_secs).
  Measured on tests/zoo/test_checkpoint.py (busy cores): 143 s of CPU time
  without it, 117 s with it.
  The directory is made here, before pytest-xdist starts its workers, and
  passed on in the environment, so the workers and every subprocess a test
  starts share it; it is empty at the start of each run and removed at the
  end. A directory already named in the environment is used and kept.
  """
  if os.environ.get(_CACHE_ENV):
    directory = os.environ[_CACHE_ENV]
  else:
    directory = tempfile.mkdtemp(prefix="optax_adama_jax_cache_")
    os.environ[_CACHE_ENV] = directory
    config._jax_cache_to_remove = directory  # pylint: disable=protected-access
  # jax was imported above, before the environment named the directory.
  jax.config.update("jax_compilation_cache_dir", directory)


def pytest_unconfigure(config):
  directory = getattr(config, "_jax_cache_to_remove", None)
  if directory:
    shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """Makes `--dist loadgroup` keep each `xdist_group` on one worker under pytest 9.

  pytest-xdist groups tests by a ``@<group>`` suffix that each worker appends
  to the node ids it reports; it writes ``item._nodeid``, which pytest 9 no
  longer reads (the id lives in ``item._id``), so the suffix never reached the
  scheduler and tests/library/test_sharding.py ran on both workers: the second worker
  sat on the ``eight_devices`` lock for the whole 8-device subprocess. This
  appends the suffix where xdist's rename did not take, and does nothing
  without loadgroup or where it did (pytest 8).
  """
  if not getattr(config.option, "loadgroup", False):
    return
  for item in items:
    groups = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
              for mark in item.iter_markers("xdist_group")}
    suffix = "@" + "_".join(sorted(groups))
    if groups and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
      item._id = type(item._id).parse(item.nodeid + suffix)  # pylint: disable=protected-access
