"""`StagedLoss`: a model as embed, one block over stacked params, and head.

The form :func:`release_step` takes, and :func:`microbatch_step` on a mesh
(FSDP layer by layer): with the blocks' params stacked on a leading axis, the
loss names the stack and the functions around it.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Union

import jax
import jax.numpy as jnp

__all__ = ["StagedLoss"]


Batch = Any
Metrics = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StagedLoss:
  """A loss in three stages around a stack of layers with stacked params.

  ``params[layers]`` (a key, or a tuple of keys into nested mappings: dicts,
  ``flax.nnx.State``, ``FrozenDict``) holds the stack: every leaf has a leading
  layer axis of the same length. The other params, ``outer`` (the same tree
  with that entry removed), belong to the embedding and the head; a leaf both
  use (a tied embedding) gets the sum of both gradients, as in autodiff.

  Attributes:
    embed: ``embed(outer, micro_batch) -> x``, the first layer's input.
    block: ``block(layer_params, x, micro_batch) -> x``: one layer, given its
      slice of the stack; ``x`` is an array or a pytree of arrays that keeps
      its shapes from layer to layer. ``micro_batch`` is a side input (e.g.
      for an attention mask) and gets no gradient.
    head: ``head(outer, x, micro_batch) -> loss`` (the micro-batch *mean*
      loss), or ``-> (loss, aux)``.
    layers: where the stack is in params.

  Called as ``staged(params, micro_batch)`` it is the plain loss (the blocks
  under one ``jax.lax.scan``): the ``loss_fn`` of :func:`microbatch_step`.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"] @ outer["w_in"],
    ...     block=lambda layer, x, b: jnp.tanh(x @ layer["w"]),
    ...     head=lambda outer, x, b: jnp.mean((x @ outer["w_out"] - b["y"]) ** 2),
    ...     layers="stack")
    >>> params = {"w_in": jnp.ones((2, 4)), "stack": {"w": jnp.zeros((3, 4, 4))},
    ...           "w_out": jnp.ones((4, 1))}
    >>> float(staged(params, {"x": jnp.ones((5, 2)), "y": jnp.ones((5, 1))}))
    1.0
  """

  embed: Callable[[Any, Batch], Any]
  block: Callable[[Any, Any, Batch], Any]
  head: Callable[[Any, Any, Batch], Any]
  layers: Union[str, tuple[str, ...]] = "layers"

  @property
  def path(self) -> tuple[Any, ...]:
    return self.layers if isinstance(self.layers, tuple) else (self.layers,)

  def split(self, params: Any) -> tuple[Any, Any]:
    """``(outer, stacked)``: the params without the stack, and the stack."""
    return _split(params, self.path, self.path)

  def check_stack(self, params: Any) -> int:
    """The stack's layer count; raises unless every stacked leaf has it."""
    _, stacked = self.split(params)
    sizes: dict[Any, list[str]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
      size = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
      sizes.setdefault(size, []).append(jax.tree_util.keystr(path))
    if len(sizes) != 1 or None in sizes:
      found = "; ".join(f"{'no axis' if size is None else size} for {', '.join(paths)}"
                        for size, paths in sizes.items())
      raise ValueError(
          f"StagedLoss(layers={self.layers!r}): every leaf of the stack needs the "
          f"same leading (layer) axis, got {found or 'no leaves'}. Stack each "
          "layer's params along axis 0 (nnx.vmap / nnx.scan over the layers "
          "does), and keep per-model params out of params[layers].")
    (size,) = sizes
    return size

  def merge(self, outer: Any, stacked: Any) -> Any:
    """The inverse of :meth:`split`."""
    return _merge(outer, stacked, self.path)

  def __call__(self, params: Any, micro_batch: Batch) -> Any:
    self.check_stack(params)
    outer, stacked = self.split(params)
    x = self.embed(outer, micro_batch)
    x, _ = jax.lax.scan(
        lambda x, layer_params: (self.block(layer_params, x, micro_batch), None),
        x, stacked)
    return self.head(outer, x, micro_batch)


# tree: a mapping of params (dict, nnx.State, FrozenDict) or any pytree that
# turns out not to be one (the error names its type); path: mapping keys.
# type(tree) is that concrete mapping class, built from a dict; mypy knows
# only the abstract Mapping it narrows to, whose constructor takes nothing.
def _split(tree: Any, path: tuple[Any, ...], full_path: tuple[Any, ...]) -> tuple[Any, Any]:
  key, rest = path[0], path[1:]
  if not isinstance(tree, collections.abc.Mapping) or key not in tree:
    raise ValueError(
        f"StagedLoss(layers={full_path!r}): no key {key!r} in a "
        f"{type(tree).__name__} of params.")
  if not rest:
    return type(tree)({k: v for k, v in tree.items() if k != key}), tree[key]  # type: ignore[call-arg]
  inner, stacked = _split(tree[key], rest, full_path)
  return type(tree)({**tree, key: inner}), stacked  # type: ignore[call-arg]


def _merge(outer: Any, stacked: Any, path: tuple[Any, ...]) -> Any:
  key, rest = path[0], path[1:]
  value = stacked if not rest else _merge(outer[key], stacked, rest)
  return type(outer)({**outer, key: value})


def like(reference: Any, tree: Any) -> Any:
  """``tree``'s leaves in ``reference``'s tree structure.

  Splitting and merging may change container types along the way (indexing an
  ``nnx.State`` wraps nested dicts in ``State``); mappings flatten in key
  order either way, so the leaves line up.
  """
  treedef, leaves = jax.tree.structure(reference), jax.tree.leaves(tree)
  if treedef.num_leaves != len(leaves):
    raise ValueError(
        f"StagedLoss.merge rebuilt {len(leaves)} leaves, the params have "
        f"{treedef.num_leaves}.")
  return treedef.unflatten(leaves)
