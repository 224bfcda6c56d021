"""Host-offloaded optimizer state: m and v live in host memory between steps.

AdamA folds one micro-batch gradient leaf by leaf, so each moment leaf is
needed on the device only for its own fold: bring it in, fold, send it back
(ZeRO-Offload's and SSDTrain's idea, here with JAX memory kinds). On a GPU
this trades PCIe traffic for device memory; on the CPU backend host and
device are the same RAM, the transfers are no-ops and ``memory_analysis()``
counts host arrays as device arrays (its ``host_*`` fields are zero there), so
:func:`host_state_bytes` gives the bytes to take off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any
from typing import Optional

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from optax_adama import _adama

__all__ = ["offload_moments", "offloaded_state_shapes", "host_state_bytes"]

HOST_MEMORY_KIND = "pinned_host"


def _offloads(leaf: Any, min_size: int) -> bool:
  # Counters and other small leaves stay on the device: a transfer per call
  # would cost more than the bytes it frees.
  return math.prod(jax.numpy.shape(leaf)) >= max(min_size, 1)


def offloaded_leaves(tree: Any, min_size: Optional[int]) -> Any:
  """Per leaf of ``tree``, whether :func:`offload_moments` keeps it in host
  memory (``min_size=None``: nothing is offloaded)."""
  return jax.tree.map(lambda x: min_size is not None and _offloads(x, min_size), tree)


def host_leaves(tree: Any) -> Any:
  """Per leaf of ``tree``: whether it is in host memory (arrays,
  ``jax.ShapeDtypeStruct`` with a sharding, or tracers of either)."""
  def in_host(leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      return getattr(sharding, "memory_kind", None) == HOST_MEMORY_KIND
    if isinstance(leaf, jax.core.Tracer):  # inside jit the type says where
      return jax.typeof(leaf).memory_space == jax.memory.Space.Host
    return False
  return jax.tree.map(in_host, tree)


def in_host_memory(shardings: Any, in_host: Any) -> Any:
  """``shardings`` with those flagged in ``in_host`` in host memory."""
  return jax.tree.map(
      lambda s, host: s.with_memory_kind(HOST_MEMORY_KIND) if host else s,
      shardings, in_host)


def keep_offloaded(shardings: Any, opt_state: Any, min_size: Optional[int]) -> Any:
  """A step's ``StepShardings`` with the state leaves that
  :func:`offload_moments` (``min_size``; ``None``: none) offloads in host
  memory: decided by each whole leaf's size, as its ``init`` places them, not
  by where they are, so a state placed in device memory is refused."""
  if min_size is None or shardings is None or opt_state is None:
    return shardings
  return shardings._replace(opt_state=in_host_memory(
      shardings.opt_state, offloaded_leaves(opt_state, min_size)))


def _move(tree: Any, offloaded: Any, space: Any) -> Any:
  return jax.tree.map(
      lambda x, off: jax.device_put(x, space) if off else x, tree, offloaded)


def put(tree: Any, space: Any, min_size: int) -> Any:
  """``tree`` with its leaves of at least ``min_size`` elements moved to ``space``."""
  return _move(tree, offloaded_leaves(tree, min_size), space)


def to_device(tree: Any, offloaded: Any) -> Any:
  """The leaves of ``tree`` flagged in ``offloaded`` brought to the device.

  ``tree`` may be a slice of the tree the flags were taken from (one layer
  of a stacked moment): the flags follow the whole leaf, not the slice.
  """
  return _move(tree, offloaded, jax.memory.Space.Device)


def to_host(tree: Any, offloaded: Any) -> Any:
  """The inverse of :func:`to_device`: flagged leaves sent back to the host."""
  return _move(tree, offloaded, jax.memory.Space.Host)


def moves(min_size: Optional[int]) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
  """``(to_device, to_host)`` of ``offload_moments``' state leaves; identities
  without (``min_size`` ``None``: nothing offloaded)."""
  if min_size is None:
    return (lambda tree: tree), (lambda tree: tree)
  return (lambda tree: put(tree, jax.memory.Space.Device, min_size),
          lambda tree: put(tree, jax.memory.Space.Host, min_size))


def offload_moments(
    inner: optax.GradientTransformation, *, min_size: int = 4096,
) -> optax.GradientTransformation:
  r"""Keeps ``inner``'s state (AdamA's m and v) in host memory between calls.

  Every state leaf with at least ``min_size`` elements (moments, 8-bit codes,
  low-rank projectors) is placed in host memory (``memory_kind="pinned_host"``)
  by ``init``; ``update`` brings each to the device, runs ``inner`` and sends
  the new state back. Inside a jitted step (:func:`microbatch_step`) the state
  argument and output stay in host memory and alias each other when donated;
  each leaf is on the device only around its own fold. Under
  :func:`release_step` (a scanned stack) only one layer's slice of a stacked
  leaf comes in at a time, for its fold and for its update. The math is
  ``inner``'s, unchanged:

  .. math::

    (u, s_{t+1}) = \mathrm{inner.update}(g, \mathrm{device}(s_t)),\qquad
    s_{t+1} \to \mathrm{host}

  Args:
    inner: any transformation, e.g. :func:`adama`, or
      :func:`low_rank` around it.
    min_size: the fewest elements an offloaded state leaf has.

  Returns:
    A :class:`optax.GradientTransformation` with ``inner``'s state.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.offload_moments(
    ...     optax_adama.adama(1e-3, num_micro_batches=2), min_size=4)
    >>> state = tx.init({"w": jnp.ones((4, 4))})
    >>> print(optax_adama.find_adama_state(state).mu["w"].sharding.memory_kind)
    pinned_host

  References:
    Ren et al., `ZeRO-Offload: Democratizing Billion-Scale Model Training
    <https://arxiv.org/abs/2101.06840>`_, 2021;
    Zhang et al., `Adam Accumulation ... <https://arxiv.org/abs/2305.19982>`_,
    2023.
  """

  def init_fn(params: optax.Params) -> optax.OptState:
    return put(inner.init(params), jax.memory.Space.Host, min_size)

  def update_fn(updates: optax.Updates, state: optax.OptState,
                params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, optax.OptState]:
    # Extra arguments (AdamA's half_difference) go on to inner.
    on_device = put(state, jax.memory.Space.Device, min_size)
    new_updates, new_state = optax.with_extra_args_support(inner).update(
        updates, on_device, params, **extra_args)
    return new_updates, put(new_state, jax.memory.Space.Host, min_size)

  parts = _adama.folding_parts(inner)
  if parts is None:
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
  # The fused steps fold themselves and bring each leaf (under release_step,
  # each layer's slice) to the device around its own fold.
  return _adama.FoldingTransformation(
      init_fn, update_fn, dataclasses.replace(parts, offload_min_size=min_size))


def offloaded_state_shapes(
    state_shapes: Any, *, min_size: int = 4096,
    device: jax.Device | None = None,
) -> Any:
  """The abstract state of :func:`offload_moments`, placed in host memory.

  ``jax.eval_shape(tx.init, params)`` drops memory kinds; lower a step with
  these instead to measure it compile-only (nothing is allocated).

  Args:
    state_shapes: ``jax.eval_shape(tx.init, params)`` of the offloaded
      transformation.
    min_size: as given to :func:`offload_moments`.
    device: the device of the step; ``None``: the default device.

  Returns:
    ``state_shapes`` with each offloaded leaf a ``jax.ShapeDtypeStruct`` with a
    ``pinned_host`` sharding.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.offload_moments(
    ...     optax_adama.adama(1e-3, num_micro_batches=2), min_size=16)
    >>> shapes = jax.eval_shape(tx.init, {"w": jnp.zeros((8, 8))})
    >>> host = optax_adama.moments.offloaded_state_shapes(shapes, min_size=16)
    >>> optax_adama.find_adama_state(host).mu["w"].sharding.memory_kind
    'pinned_host'
  """
  device = device or jax.devices()[0]
  # A NamedSharding: jit reads a ShapeDtypeStruct's memory space from that
  # kind of sharding only (a SingleDeviceSharding's memory kind is dropped).
  host = NamedSharding(Mesh(np.array([device]), ("device",)), PartitionSpec(),
                       memory_kind=HOST_MEMORY_KIND)
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=host)
      if _offloads(s, min_size) else s, state_shapes)


def host_state_bytes(state: Any, *, min_size: int = 4096) -> int:
  """Bytes of the state leaves :func:`offload_moments` keeps in host memory.

  Args:
    state: the state (arrays or ``jax.ShapeDtypeStruct``).
    min_size: as given to :func:`offload_moments`.

  Returns:
    The bytes, as an int.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=2)
    >>> shapes = jax.eval_shape(tx.init, {"w": jnp.zeros((64, 64)), "b": jnp.zeros(64)})
    >>> # m and v of w (b is below min_size: it stays on the device)
    >>> optax_adama.moments.host_state_bytes(shapes, min_size=4096)
    32768
  """
  return int(sum(
      math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(state) if _offloads(x, min_size)))
