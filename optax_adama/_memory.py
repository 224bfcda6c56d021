"""Compiled-memory reports and the analytic memory floor of a training step.

Every memory claim of this project comes from here: XLA's own accounting of a
compiled program (`Compiled.memory_analysis()`), which works on CPU as on GPU,
quoted in bytes and in units of P, the bytes of one copy of the parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Optional

import jax
import numpy as np

from optax_adama import _steps

__all__ = ["MemoryReport", "MemoryFloor", "tree_bytes", "memory_report", "memory_floor"]


def tree_bytes(tree: Any) -> int:
  """Bytes held by the array leaves of ``tree``; nothing is allocated.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. from
      ``jax.eval_shape``).

  Returns:
    The bytes, as an int.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> shapes = jax.eval_shape(
    ...     lambda: {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(8, jnp.bfloat16)})
    >>> optax_adama.memory.tree_bytes(shapes)
    4194320
  """
  return int(sum(
      int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
      for leaf in jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """XLA's memory accounting of one compiled program.

  ``total_bytes = argument + output + temp - alias``: the bytes live at the
  program's peak when donated arguments are reused for outputs.

  Examples:
    >>> from optax_adama.memory import MemoryReport
    >>> r = MemoryReport(argument_bytes=300, output_bytes=300, temp_bytes=50,
    ...                  alias_bytes=300, param_bytes=100)
    >>> r.total_bytes, r.in_p(r.total_bytes)
    (350, 3.5)
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  param_bytes: int  # P: bytes of one copy of the parameters.

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  def in_p(self, num_bytes: int) -> float:
    """``num_bytes`` in units of P."""
    return num_bytes / self.param_bytes if self.param_bytes else float("nan")

  def to_dict(self) -> dict[str, float]:
    """All fields in bytes, plus each in P (keys ending in ``_p``)."""
    out: dict[str, float] = {}
    for name in ("argument", "output", "temp", "alias", "total"):
      value = getattr(self, f"{name}_bytes")
      out[f"{name}_bytes"] = value
      out[f"{name}_p"] = self.in_p(value)
    out["param_bytes"] = self.param_bytes
    return out

  def __str__(self) -> str:
    rows = [
        f"{name:>9}: {getattr(self, name + '_bytes'):>14,d} B  "
        f"{self.in_p(getattr(self, name + '_bytes')):7.3f} P"
        for name in ("argument", "output", "temp", "alias", "total")
    ]
    return f"P = {self.param_bytes:,d} B\n" + "\n".join(rows)


def _compile(fn: Any, args: tuple[Any, ...]) -> jax.stages.Compiled:
  if isinstance(fn, jax.stages.Compiled):
    return fn
  if isinstance(fn, jax.stages.Lowered):
    return fn.compile()
  if hasattr(fn, "lower"):
    return fn.lower(*args).compile()
  raise TypeError(
      "memory_report expects a jitted function (with .lower), a Lowered or a "
      f"Compiled object, got {type(fn).__name__}.")


def memory_report(
    fn: Any, *args: Any, param_bytes: Optional[int] = None
) -> MemoryReport:
  """Compiles ``fn`` for ``args`` (compile only, nothing runs) and reports memory.

  Args:
    fn: a ``jax.jit``-ed function (e.g. from :func:`microbatch_step`), a
      ``Lowered`` or a ``Compiled``.
    *args: arguments to lower with; arrays or ``jax.ShapeDtypeStruct`` (so a
      step too big for the host can still be measured). Unused if ``fn`` is
      already compiled.
    param_bytes: P; by default the bytes of ``args[0]`` (the params of a step).

  Returns:
    A :class:`MemoryReport`.

  Raises:
    TypeError: if ``fn`` cannot be lowered for ``args`` (not jitted).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=4)
    >>> params = {"w": jnp.zeros((256, 256))}
    >>> state = tx.init(params)
    >>> batch = {"x": jnp.zeros((64, 256))}
    >>> step = optax_adama.microbatch_step(loss_fn, tx)
    >>> report = optax_adama.memory_report(step, params, state, batch)
    >>> report.param_bytes  # P: one float32 copy of w
    262144
    >>> round(report.in_p(report.argument_bytes), 2)  # params, m, v, the batch
    3.25
  """
  compiled = _compile(fn, args)
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError("this backend reports no memory_analysis().")
  if param_bytes is None:
    if not args:
      raise ValueError("pass param_bytes, or the step's arguments (params first).")
    param_bytes = tree_bytes(args[0])
  return MemoryReport(
      argument_bytes=int(analysis.argument_size_in_bytes),
      output_bytes=int(analysis.output_size_in_bytes),
      temp_bytes=int(analysis.temp_size_in_bytes),
      alias_bytes=int(analysis.alias_size_in_bytes),
      param_bytes=int(param_bytes),
  )


@dataclasses.dataclass(frozen=True)
class MemoryFloor:
  """AdamA's analytic memory floor of one training step, in bytes.

  params + optimizer state (m, v) + the mini-batch + one micro-batch's
  activations + the gradient of the largest parameter leaf. Made by
  :func:`memory_floor`, whose example shows one.
  """

  param_bytes: int
  opt_state_bytes: int
  batch_bytes: int
  activation_bytes: int  # temp bytes of a gradient-only program on one micro-batch.
  largest_gradient_bytes: int

  @property
  def total_bytes(self) -> int:
    return (self.param_bytes + self.opt_state_bytes + self.batch_bytes
            + self.activation_bytes + self.largest_gradient_bytes)

  def in_p(self, num_bytes: int) -> float:
    return num_bytes / self.param_bytes if self.param_bytes else float("nan")

  def to_dict(self) -> dict[str, float]:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["total_bytes"] = self.total_bytes
    out["total_p"] = self.in_p(self.total_bytes)
    return out


def memory_floor(
    loss_fn: Callable[..., Any],
    params: Any,
    opt_state: Any,
    batch: Any,
    *,
    num_micro_batches: int,
    has_aux: bool = False,
) -> MemoryFloor:
  """The analytic floor of an AdamA step, with activations measured by XLA.

  The activation term is the temp memory of ``jax.grad(loss_fn)`` compiled on
  one micro-batch: the program's output is the whole gradient (not counted),
  its temp is what the forward and backward passes keep alive.

  Args:
    loss_fn: ``loss_fn(params, micro_batch)``, as for :func:`microbatch_step`.
    params, opt_state, batch: the step's arguments (arrays or
      ``jax.ShapeDtypeStruct``; nothing is allocated).
    num_micro_batches: ``N``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    A :class:`MemoryFloor`.

  Raises:
    ValueError: if the backend reports no memory analysis of the compiled
      gradient.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=4)
    >>> params = {"w": jnp.zeros((256, 256))}
    >>> state = tx.init(params)
    >>> batch = {"x": jnp.zeros((64, 256))}
    >>> floor = optax_adama.memory.memory_floor(
    ...     loss_fn, params, state, batch, num_micro_batches=4)
    >>> # params, m, v, one gradient of w
    >>> kept = floor.param_bytes + floor.opt_state_bytes + floor.largest_gradient_bytes
    >>> round(floor.in_p(kept), 2)
    4.0
  """
  micro_batch = jax.eval_shape(
      lambda b: jax.tree.map(lambda x: x[0], _steps.split_micro_batches(b, num_micro_batches)),
      batch)
  grad_fn = jax.jit(jax.grad(loss_fn, has_aux=has_aux))
  grad_memory = grad_fn.lower(params, micro_batch).compile().memory_analysis()
  if grad_memory is None:
    raise ValueError(f"the {jax.default_backend()} backend reports no memory analysis.")
  return MemoryFloor(
      param_bytes=tree_bytes(params),
      opt_state_bytes=tree_bytes(opt_state),
      batch_bytes=tree_bytes(batch),
      activation_bytes=int(grad_memory.temp_size_in_bytes),
      largest_gradient_bytes=max(
          (tree_bytes(leaf) for leaf in jax.tree.leaves(params)), default=0),
  )
