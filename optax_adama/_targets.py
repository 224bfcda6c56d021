"""Compile-only targets: a TPU topology or a GPU's description, with no such device here.

XLA's CPU backend is a stand-in for the memory of a step: it assigns buffers its
own way and widens bfloat16 collectives to float32. A claim about a TPU or a GPU
is made by that platform's compiler, which can compile for devices it is only
told about: libtpu (``jax[tpu]``, from PyPI) for a TPU topology, XLA's GPU
compiler (``jax[cuda12-local]`` with ``ptxas``) for a ``GpuTargetConfigProto``.
A :class:`Target` names one such machine, how much memory a device of it can
use, and how to compile for it (:func:`target_devices`, :func:`compile_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import importlib.util
import math
import os
import re
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Optional

import jax

__all__ = ["Target", "TARGET_NAMES", "TargetUnavailableError", "parse_target",
           "target_devices", "target_mesh", "compile_for", "compiled_by"]

_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class _TpuSpec:
  topology: str
  kwargs: tuple[tuple[str, Any], ...]
  device_kind: str
  num_devices: int
  memory_gib: float


# Each topology as MaxText builds its compile-only devices. Usable memory: what
# libtpu 0.0.42.1 itself reports available when a program does not fit ("exceeds
# available HBM (15.48G)", a program of 36 GiB compiled for each topology); v3's
# 15.48 GiB is also EasyLM #36's "Used 23.43G of 15.48G hbm". Of the physical
# 8 (v2), 16 (v3), 32 (v4, a megacore chip of two cores) and 16 GiB (v5e).
_TPUS = {
    "v2-8": _TpuSpec("v2:2x2", (), "TPU v2", 8, 7.48),
    "v3-8": _TpuSpec("v3:2x2", (), "TPU v3", 8, 15.48),
    # A v4-8 is 4 chips: its 8 TensorCores pair into 4 megacore devices.
    "v4-8": _TpuSpec("v4:2x2x1", (("chip_config_name", "megacore"),
                                  ("chips_per_host_bounds", (2, 2, 1)),
                                  ("wrap", (False, False, False))), "TPU v4", 4, 30.75),
    "v5e-8": _TpuSpec("v5e:2x4", (("chip_config_name", "default"),), "TPU v5 lite", 8, 15.75),
}
# GpuTargetConfigProto text files shipped in optax_adama/gpu_specs/ (each
# says where it comes from). Usable memory: the file's device_memory_size, what
# CUDA reports as the device's total; a process gets less (the CUDA context,
# and jax preallocates 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise).
_GPUS = {"h100": "h100_sxm.txtpb", "a100": "a100_sxm_80.txtpb", "h200": "h200.txtpb",
         "rtx4090": "rtx4090.txtpb"}
TARGET_NAMES = tuple([f"tpu:{name}" for name in _TPUS] + [f"gpu:{name}" for name in _GPUS])
TPU_OPTIONS = (("xla_tpu_no_crash_on_oom", "true"),)


class TargetUnavailableError(RuntimeError):
  """This environment cannot compile for the target (libtpu or the CUDA plugin absent).

  Examples:
    >>> from optax_adama.memory import TargetUnavailableError
    >>> issubclass(TargetUnavailableError, RuntimeError)
    True
  """


@dataclasses.dataclass(frozen=True)
class Target:
  """A machine compiled for without its devices: its platform, devices and memory.

  Made by :func:`parse_target`, whose example shows one.
  """

  name: str  # canonical: "tpu:v3-8", "gpu:h100x8"
  platform: str  # "tpu" or "gpu"
  chip: str  # "v3-8", "h100": the key of its TPU topology or GPU spec file
  device_kind: str  # as jax names the devices: "TPU v3", "NVIDIA H100 80GB HBM3"
  num_devices: int
  memory_bytes: int  # what one device can use
  memory_source: str  # where memory_bytes comes from
  options: tuple[tuple[str, str], ...] = ()

  @property
  def compiler_options(self) -> dict[str, str]:
    """Options for ``Lowered.compile``: a TPU program over HBM still reports its bytes."""
    return dict(self.options)

  def fits(self, num_bytes: int) -> bool:
    """Whether ``num_bytes`` on one device fit its usable memory."""
    return num_bytes <= self.memory_bytes


def _gpu_spec_text(chip: str) -> str:
  return (importlib.resources.files("optax_adama") / "gpu_specs" / _GPUS[chip]).read_text()


def parse_target(name: str, num_devices: Optional[int] = None) -> Target:
  """The :class:`Target` named ``name``: ``tpu:v3-8``, ``gpu:h100``, ``gpu:h100x8``, ...

  A TPU's device count is in its name (a v4-8 is 4 megacore devices). A GPU name
  takes one as ``x<count>``; without it, ``num_devices`` (1 by default).

  Args:
    name: one of ``TARGET_NAMES``, a GPU one optionally followed by ``x<count>``.
    num_devices: the devices of a GPU name without a count.

  Returns:
    The target; nothing is loaded or compiled.

  Raises:
    ValueError: an unknown name (the message lists the valid ones), a count below
      1, or a ``num_devices`` other than a TPU topology's own.

  Examples:
    >>> from optax_adama.memory import parse_target
    >>> t = parse_target("tpu:v3-8")
    >>> t.platform, t.num_devices, round(t.memory_bytes / 2**30, 2)
    ('tpu', 8, 15.48)
    >>> parse_target("gpu:h100x8").num_devices
    8
  """
  text = name.strip().lower()
  valid = ", ".join(TARGET_NAMES)
  if text.startswith("tpu:") and text[4:] in _TPUS:
    spec = _TPUS[text[4:]]
    if num_devices not in (None, spec.num_devices):
      raise ValueError(f"{text} has {spec.num_devices} devices, not {num_devices}.")
    return Target(
        name=text, platform="tpu", chip=text[4:], device_kind=spec.device_kind,
        num_devices=spec.num_devices,
        memory_bytes=round(spec.memory_gib * _GIB),
        memory_source=f"libtpu's available HBM of a {spec.device_kind} core",
        options=TPU_OPTIONS)
  chip, count = None, 1 if num_devices is None else num_devices
  for known in _GPUS:
    counted = re.fullmatch(rf"gpu:{known}(?:x(\d+))?", text)
    if counted:
      chip, count = known, int(counted[1]) if counted[1] else count
  if chip is None:
    raise ValueError(f"unknown target {name!r}; valid: {valid} (a GPU one with x<count>, "
                     "e.g. gpu:h100x8).")
  if count < 1:
    raise ValueError(f"{name!r}: a target needs at least one device.")
  spec_text = _gpu_spec_text(chip)
  memory = re.search(r"device_memory_size:\s*(\d+)", spec_text)
  kind = re.search(r'device_description_str:\s*"([^"]+)"', spec_text)
  assert memory and kind, _GPUS[chip]
  return Target(
      name=f"gpu:{chip}x{count}" if count > 1 else f"gpu:{chip}", platform="gpu", chip=chip,
      device_kind=kind[1], num_devices=count, memory_bytes=int(memory[1]),
      memory_source=f"device_memory_size of optax_adama/gpu_specs/{_GPUS[chip]}")


def _unavailable(target: Target, package: str, extra: str) -> TargetUnavailableError:
  make = f"venv-{target.platform}"
  return TargetUnavailableError(
      f"{target.name} needs {package}, which this Python lacks: `make {make}` builds "
      f".{make} with jax[{extra}]=={jax.__version__}.")


@functools.cache
def _devices(target: Target) -> tuple[Any, ...]:
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  if target.platform == "tpu":
    if importlib.util.find_spec("libtpu") is None:
      raise _unavailable(target, "libtpu", "tpu")
    # libtpu otherwise takes a machine-wide lock: a second process (a test
    # worker, another benchmark) could not load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    spec = _TPUS[target.chip]
    devices = topologies.get_topology_desc(spec.topology, platform="tpu",
                                           **dict(spec.kwargs)).devices
  else:
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
      raise _unavailable(target, "the CUDA jaxlib plugin", "cuda12-local")
    # With no GPU here, the CUDA plugin registers its compile-only topology
    # only while jax runs on the CPU.
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    config: Any = jax.config  # its flags are attributes mypy does not see
    if not xla_bridge.backends_are_initialized() and not config.jax_platforms:
      jax.config.update("jax_platforms", "cpu")
    try:
      devices = topologies.get_topology_desc(
          platform="cuda", topology=f"1x1x{target.num_devices}",
          target_config=_gpu_spec_text(target.chip)).devices
    except NotImplementedError as e:
      raise TargetUnavailableError(
          f"{target.name}: the CUDA plugin has no compile-only topology here; run with "
          "jax_platforms='cpu' (set before the first jax operation).") from e
  if len(devices) != target.num_devices:
    raise AssertionError(f"{target.name}: {len(devices)} devices, not {target.num_devices}")
  return tuple(devices)


def target_devices(target: Target | str) -> list[Any]:
  """Compile-only devices of ``target``: nothing runs on them, programs compile for them.

  Args:
    target: a :class:`Target` or its name.

  Returns:
    ``target.num_devices`` devices (the same objects on every call).

  Raises:
    TargetUnavailableError: libtpu absent for a TPU (``make venv-tpu``), the
      CUDA plugin absent for a GPU (``make venv-gpu``).

  Examples:
    Needs libtpu (``make venv-tpu``; tests/library/test_targets.py runs it there):

    >>> from optax_adama.memory import target_devices
    >>> devices = target_devices("tpu:v3-8")  # doctest: +SKIP
    >>> len(devices), devices[0].device_kind  # doctest: +SKIP
    (8, 'TPU v3')
  """
  target = parse_target(target) if isinstance(target, str) else target
  return list(_devices(target))


def target_mesh(target: Target | str, axis_shapes: Optional[Sequence[int]] = None,
                axis_names: Optional[Sequence[str]] = None) -> jax.sharding.Mesh:
  """A mesh over ``target``'s compile-only devices (all on one axis by default).

  Args:
    target: a :class:`Target` or its name.
    axis_shapes: the mesh's shape; ``(num_devices,)`` by default.
    axis_names: its axes' names; ``("data",)`` by default.

  Returns:
    A ``jax.sharding.Mesh`` whose axes are ``Auto``, as ``jax.make_mesh`` makes them.

  Raises:
    TargetUnavailableError: as :func:`target_devices`.
    ValueError: if the shape needs more devices than ``target`` has (a smaller
      shape takes its first devices).

  Examples:
    Needs libtpu (``make venv-tpu``; tests/library/test_targets.py runs it there):

    >>> from optax_adama.memory import target_mesh
    >>> dict(target_mesh("tpu:v3-8").shape)  # doctest: +SKIP
    {'data': 8}
  """
  devices = target_devices(target)
  shape = tuple(axis_shapes) if axis_shapes is not None else (len(devices),)
  names = tuple(axis_names) if axis_names is not None else ("data",)
  size = math.prod(shape)
  if size > len(devices):
    name = target if isinstance(target, str) else target.name
    raise ValueError(f"a mesh of shape {shape} needs {size} devices; {name} has "
                     f"{len(devices)}.")
  return jax.make_mesh(shape, names, devices=devices[:size],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def compile_for(fn: Any, *args: Any, target: Optional[Target | str] = None,
                compiler_options: Optional[Mapping[str, Any]] = None) -> jax.stages.Compiled:
  """Compiles a jitted ``fn`` (or a ``Lowered``) with ``target``'s compiler options.

  The arguments' shardings say which devices the program is for (a mesh of
  :func:`target_mesh`); the options keep an oversized TPU program compiling, so
  that :func:`memory_report` of the result says by how much it does not fit.

  Args:
    fn: a ``jax.jit``-ed function or a ``Lowered``.
    *args: arrays or ``jax.ShapeDtypeStruct`` placed on the target's devices.
    target: the :class:`Target` (or its name) whose options to use.
    compiler_options: more options, over the target's.

  Returns:
    The ``Compiled`` program; pass it to :func:`memory_report`.

  Raises:
    TypeError: ``fn`` is neither jitted nor lowered.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> from optax_adama.memory import compile_for
    >>> f = jax.jit(lambda p, x: jnp.sum(x @ p))
    >>> p, x = jnp.zeros((64, 64)), jnp.zeros((8, 64))
    >>> optax_adama.memory_report(compile_for(f, p, x), p, x).argument_bytes
    18432
  """
  if isinstance(target, str):
    target = parse_target(target)
  options = {**(target.compiler_options if target else {}), **(compiler_options or {})}
  if isinstance(fn, jax.stages.Lowered):
    lowered = fn
  elif hasattr(fn, "lower"):
    lowered = fn.lower(*args)
  else:
    raise TypeError(f"compile_for expects a jitted function or a Lowered, got "
                    f"{type(fn).__name__}.")
  return lowered.compile(compiler_options=options or None)


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "?"


def compiled_by(target: Optional[Target | str] = None, num_devices: Optional[int] = None) -> str:
  """Which compiler made a table's numbers, for its "compiled for" line.

  Args:
    target: the :class:`Target` (or its name); ``None`` for XLA's CPU backend.
    num_devices: the CPU backend's (fake) devices, where ``target`` is ``None``.

  Returns:
    One line: the compiler, its version and what it compiled for.

  Examples:
    >>> from optax_adama.memory import compiled_by
    >>> compiled_by("tpu:v3-8").split(" for ")[1]
    'TPU v3-8 (8 devices of 15.48 GiB usable)'
    >>> compiled_by(num_devices=8).startswith("XLA's CPU backend")
    True
  """
  if target is None:
    devices = f", {num_devices} fake devices" if num_devices else ""
    return (f"XLA's CPU backend (jaxlib {_version('jaxlib')}{devices}), a stand-in "
            "for an accelerator's compiler")
  target = parse_target(target) if isinstance(target, str) else target
  devices = f"{target.num_devices} device" + "s" * (target.num_devices > 1)
  memory = f"{devices} of {target.memory_bytes / _GIB:.2f} GiB usable"
  if target.platform == "tpu":
    return f"libtpu {_version('libtpu')} for TPU {target.chip} ({memory})"
  return (f"XLA's GPU compiler (jax-cuda12-plugin {_version('jax-cuda12-plugin')}) for "
          f"{target.device_kind} ({memory})")


# libtpu's refusal of a program over HBM: "Ran out of memory on HBM, the total
# memory required for HLO temporaries (36.41G) exceeds available HBM (15.48G)".
_HLO_TEMPORARIES = re.compile(r"HLO temporaries \((\d+(?:\.\d+)?)([KMGT])\)")


def temporaries_over_memory(lowered: jax.stages.Lowered, error: Exception) -> Optional[int]:
  """The temp bytes libtpu says an over-HBM program needs; None for another error.

  With ``xla_tpu_no_crash_on_oom`` some such programs still fail, as "Invalid TPU
  program" with no bytes; compiled again without the option, libtpu stops at its
  early check and names the temporaries' size (argument bytes not included).

  Args:
    lowered: the program that failed (its ``compile()`` is called again, strictly,
      where the error gave no size).
    error: what compiling it raised.

  Returns:
    The temporaries' bytes libtpu named, or None when ``error`` is no such refusal.

  Examples:
    >>> from optax_adama.memory import temporaries_over_memory
    >>> refusal = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total "
    ...     "memory required for HLO temporaries (1.50G) exceeds available HBM (15.48G).")
    >>> temporaries_over_memory(None, refusal) == int(1.5 * 2**30)
    True
    >>> temporaries_over_memory(None, ValueError("shapes differ")) is None
    True
  """
  message = str(error)
  if "Invalid TPU program" in message:
    try:
      lowered.compile()
    except Exception as strict:  # the strict compile's own refusal names the size
      message = str(strict)
  match = _HLO_TEMPORARIES.search(message)
  if match is None:
    return None
  scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match[2]]
  return int(float(match[1]) * scale)
