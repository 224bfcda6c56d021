"""One micro-batch of the release: the reverse layer scan and its folds.

From each layer's saved input, the `jax.vjp` of that layer; its parameter
cotangent folded into the layer's slice of m and v (`_fold.fold_leaf`, 8-bit
and offloaded moments too), its input cotangent passed on. On one device as
it is; on a mesh inside `shard_map`, each device on its rows, with the
collectives of its ZeRO stage handed in as :class:`Reductions`
(:mod:`optax_adama._release_mesh`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from optax_adama import _adama
from optax_adama import _estimators
from optax_adama import _floor
from optax_adama import _fold
from optax_adama import _offload
from optax_adama import _quantize
from optax_adama import _staged
from optax_adama import _steps
from optax_adama._adama import ScaleByAdamAState
from optax_adama._clipping import SliceSketcher

is_quantized = lambda x: isinstance(x, _quantize.QuantizedArray)

# An AdamA transformation's _adama.FoldingParts (`.config`, `.offload_min_size`),
# loose while the restructuring of _adama may rename that class.
FoldingParts = Any


def check_moments(staged: _staged.StagedLoss, params: optax.Params,
                  state: ScaleByAdamAState) -> None:
  """On a mesh: raises for 8-bit stacked moments whose blocks straddle layers
  (one device folds those through a float32 copy: :func:`_straddling_in_float32`;
  :func:`release_shardings` checks that each device holds whole blocks)."""
  _, stacked_params = staged.split(params)
  for moment in (state.mu, state.nu):
    _, stacked = staged.split(moment)
    leaves = jax.tree.structure(stacked_params).flatten_up_to(stacked)
    for param, leaf in zip(jax.tree.leaves(stacked_params), leaves):
      if straddles(leaf, jnp.shape(param)):
        raise NotImplementedError(
            "release_step(mesh=...) folds each device's part of a layer's slice "
            "of the stack's moments, and the 8-bit blocks of a stacked leaf of "
            f"shape {jnp.shape(param)} straddle layers (its layers are narrower "
            "than block_size // 8, or BlockQuantization(layer_aligned=False)). "
            "Keep that leaf's moments dense (BlockQuantization(min_size=...) above "
            "its size) or lay its blocks out per layer with "
            "BlockQuantization(layer_aligned=True).")


# moment: a _fold.Moment, loose since the is_quantized lambda narrows nothing for mypy.
def straddles(moment: Any, shape: tuple[int, ...]) -> bool:
  """Whether ``moment`` is 8-bit with blocks that straddle the layers of a
  stacked leaf of ``shape`` (not :class:`BlockQuantization`'s layer-aligned
  layout)."""
  return is_quantized(moment) and not _layer_aligned(moment, shape)


def _layer_aligned(moment: _quantize.QuantizedArray, shape: tuple[int, ...]) -> bool:
  # BlockQuantization(layer_aligned=True)'s layout: [layers, blocks, block_len].
  codes_shape = moment.codes.shape
  return (len(codes_shape) == 3 and codes_shape[0] == shape[0]
          and codes_shape[1] * codes_shape[2] == math.prod(shape[1:]))


def on_device_whole(moments: list, offloaded: list) -> tuple[list, list, list]:
  """``(moments, flags, moved)``: each dense 2-D stack that lives in host memory
  (its ``offloaded`` flag) brought to the device whole, its flag cleared, and
  which were (``moved``, for :func:`_offload.to_host` after).

  A scan that reads and writes one row of a host-memory ``[layers, width]``
  stack aborts libtpu 0.0.42.1's compiler for a TPU v3 (a failed sublane check;
  ``benchmarks/scripts/libtpu_offload_abort.py`` reduces it). Such stacks are a
  scanned model's norm scales and biases, a width a layer, so the layer scans
  fold and read them on the device.
  """
  # An 8-bit moment's flags are a tree like it: it is never moved here.
  moved = [not is_quantized(m) and jnp.ndim(m) == 2 and off is True
           for m, off in zip(moments, offloaded)]
  return ([_offload.to_device(m, True) if r else m for m, r in zip(moments, moved)],
          [False if r else off for off, r in zip(offloaded, moved)], moved)


def layer_slice(moment: _fold.Moment, layer: jax.Array, num_layers: int,
                keepdims: bool = False) -> _fold.Moment:
  """Layer ``layer``'s slice of a stacked moment (its blocks if 8-bit)."""
  del num_layers
  if isinstance(moment, _quantize.QuantizedArray):
    return jax.tree.map(
        lambda x: _as_stored(jax.lax.dynamic_index_in_dim(_as_bytes(x), layer, keepdims=False),
                             x.dtype), moment)
  return jax.lax.dynamic_index_in_dim(moment, layer, keepdims=keepdims)


def _as_bytes(x: jax.Array) -> jax.Array:
  # Sliced as raw bytes: the CPU backend widens float8 to float16 before any
  # op on it, and for moments read-only in a loop (the update by layer) it
  # hoists that widening out of the loop: the whole stack's codes in float16
  # (measured: +0.47 P on an 8-layer MLP). A bitcast leaves nothing to widen.
  return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize == 1 else x


def _as_stored(x: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _with_layer_slice(moment: _fold.Moment, value: _fold.Moment,
                      layer: jax.Array) -> _fold.Moment:
  """``moment`` with layer ``layer``'s slice replaced by ``value``, in place."""
  if isinstance(moment, _quantize.QuantizedArray):
    return jax.tree.map(
        lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v, layer, 0), moment, value)
  return jax.lax.dynamic_update_index_in_dim(moment, value, layer, 0)


class Reductions(NamedTuple):
  """How one device's share of a micro-batch becomes the whole micro-batch's.

  The identity on one device; under ``shard_map`` the collectives of the
  ZeRO stage (:func:`_data_parallel_reductions`).
  """

  loss: Callable[[jax.Array], jax.Array]
  aux: Callable[[Any], Any]
  # Flat lists of gradient leaves (outer leaves, or one layer's slices) in
  # the order of `specs`: each reduced and placed like its moment.
  outer_grads: Callable[[list[jax.Array]], list[jax.Array]]
  layer_grads: Callable[[list[jax.Array]], list[jax.Array]]
  all_finite: Callable[[jax.Array], jax.Array]
  # ("outer" or "layer", leaf index) -> the fold's whole_block_absmax for it
  # (see _fold.fold_leaf): a pmax where the mesh splits the leaf's blocks.
  whole_block_absmax: Callable[[str, int], Callable[[jax.Array], jax.Array]]
  # Lists of (m, v) seed pairs, one per leaf (the stack's, or the stack's
  # then the outer leaves'): each device's own where it holds a slice.
  layer_seeds: Callable[[list], list]
  outer_seeds: Callable[[list], list]
  # Flat lists of "split"'s floor increments (FactoredSquares) from the
  # reduced gradient leaves above, each made whole; with the leaves' shapes.
  outer_floors: Callable[[list, list[tuple[int, ...]]], list]
  layer_floors: Callable[[list, list[tuple[int, ...]]], list]
  # FSDP: this device's slices of the outer params, or of one layer's, made
  # whole (gathered); the identity where params are whole on every device.
  outer_params: Callable[[Any], Any]
  layer_params: Callable[[Any], Any]


identity = lambda x: x


_increments = lambda increments, leaf_shapes: increments


ONE_DEVICE = Reductions(identity, identity, identity, identity, identity,
                        lambda kind, i: identity, identity, identity,
                        _increments, _increments, identity, identity)


def release_micro_batch(staged: _staged.StagedLoss, parts: FoldingParts, has_aux: bool,
                        params: optax.Params, state: ScaleByAdamAState,
                        micro_batch: _staged.Batch, offloaded: tuple[Any, Any, Any],
                        reductions: Reductions = ONE_DEVICE,
                        clip: Optional[tuple[SliceSketcher, list[jax.Array]]] = None,
                        ) -> tuple[ScaleByAdamAState, jax.Array, Any, Optional[list]]:
  """One micro-batch: forward, then a backward that folds layer by layer.

  ``clip``: ``clipped_by_global_norm``'s sketcher of this mini-batch and its
  sketch totals (a list in the params' tree order): each gradient (slice) is
  scaled before its fold and sketched; the new totals are returned last
  (``None`` without a clip).

  ``offloaded``: which leaves of m, v and the floor live in host memory
  (:func:`offloaded_state`, taken from the whole leaves: under
  ``shard_map`` ``state`` holds this device's slices).

  For AdamA's "split" estimator ``micro_batch`` comes as its two halves
  (``[2, B / 2, ...]`` leaves) and each stage runs on both (vmapped, the
  same FLOPs): activations and cotangents carry the leading axis of two, and
  each gradient leaf is taken per half, folded as their mean and half
  difference and dropped.
  """
  halves = _estimators.takes_halves(state)
  per_half = lambda fn, in_axes: jax.vmap(fn, in_axes) if halves else fn
  outer, stacked = staged.split(params)
  outer = reductions.outer_params(outer)  # FSDP: gathered for the micro-batch
  x = per_half(staged.embed, (None, 0))(outer, micro_batch)
  block = per_half(staged.block, (None, 0, 0))
  # FSDP: each layer gathered as the scan reaches it, and again in the release.
  x, layer_inputs = jax.lax.scan(
      lambda x, layer_params: (block(reductions.layer_params(layer_params), x, micro_batch), x),
      x, stacked)
  head = functools.partial(_head_loss_and_grads, staged.head, has_aux)
  loss, aux, (outer_grads, x_grad) = per_half(head, (None, 0, 0))(outer, x, micro_batch)
  if halves:
    loss, aux = _steps.combine_halves((loss, aux))
  # The gradients below are of this device's mean loss; each is reduced to
  # the micro-batch's before it is folded, so the guard reads the global loss.
  loss = reductions.loss(loss)
  aux = None if aux is None else reductions.aux(aux)

  mu_outer, mu_stacked = staged.split(state.mu)
  nu_outer, nu_stacked = staged.split(state.nu)
  (mu_off_outer, mu_off_stacked), (nu_off_outer, nu_off_stacked) = map(
      staged.split, offloaded[:2])
  # "split"'s floor: decayed once here, then each gradient adds its part
  # (on the device throughout: offloaded, it comes in whole).
  floor_offloaded = offloaded[2]
  floor_outer, floor_stacked = None, None
  if _estimators.floors_split(state):
    floor_outer, floor_stacked = staged.split(_estimators.decayed_floor(state._replace(
        nu_floor=_offload.to_device(state.nu_floor, floor_offloaded)), parts.config))
  layer_pullback = per_half(functools.partial(_pullback, staged.block), ((None, 0), 0, 0))
  # The clip's sketches, split as the params are: (leaf index, sketch) pairs.
  clip_outer = clip_stacked = None
  if clip is not None:
    indexed = jax.tree.structure(params).unflatten(
        [(i, sketch) for i, sketch in enumerate(clip[1])])
    clip_outer, clip_stacked = (
        (clip[0], jax.tree.leaves(part, is_leaf=lambda x: isinstance(x, tuple)))
        for part in staged.split(indexed))
  x_grad, mu_stacked, nu_stacked, floor_stacked, stack_finite, clip_stacked = _release_stack(
      parts, state, micro_batch, loss, stacked, layer_inputs, x_grad,
      mu_stacked, nu_stacked, floor_stacked, (mu_off_stacked, nu_off_stacked),
      reductions, layer_pullback, halves, clip_stacked)
  embed_pullback = per_half(functools.partial(_pullback, staged.embed),
                            ((None,), 0, 0))
  (embed_grads,) = embed_pullback((outer,), micro_batch, x_grad)
  outer_grads = jax.tree.map(operator.add, outer_grads, embed_grads)
  stacked_def = jax.tree.structure(stacked)
  mu_outer, nu_outer, floor_outer, outer_finite, clip_outer = _fold_outer(
      parts, state, loss, outer_grads, mu_outer, nu_outer, floor_outer,
      [jnp.shape(p) for p in jax.tree.leaves(outer)],
      stacked_def.flatten_up_to(mu_stacked), stacked_def.flatten_up_to(nu_stacked),
      (mu_off_outer, nu_off_outer), reductions, halves, clip_outer)
  all_finite = reductions.all_finite(outer_finite & stack_finite)
  mu = _staged.like(state.mu, staged.merge(mu_outer, mu_stacked))
  nu = _staged.like(state.nu, staged.merge(nu_outer, nu_stacked))
  floor = None if floor_outer is None else _offload.to_host(
      _staged.like(state.nu_floor, staged.merge(floor_outer, floor_stacked)), floor_offloaded)
  sketch = None
  if clip_outer is not None and clip_stacked is not None:
    sketch = [x for _, x in sorted(clip_outer[1] + clip_stacked[1], key=lambda pair: pair[0])]
  return _adama.advance_counters(state, mu, nu, all_finite, floor), loss, aux, sketch


# The clip inside the release: the sketcher, and (leaf index, sketch) per leaf.
_Clip = Optional[tuple[SliceSketcher, list[tuple[int, jax.Array]]]]


def _head_loss_and_grads(head: Callable[..., Any], has_aux: bool, outer: optax.Params, x: Any,
                         micro_batch: _staged.Batch) -> tuple[jax.Array, Any, Any]:
  """``(loss, aux, (outer cotangent, x cotangent))`` of the head stage."""
  if has_aux:
    loss, head_vjp, aux = jax.vjp(lambda o, x: head(o, x, micro_batch), outer, x,
                                  has_aux=True)
  else:
    (loss, head_vjp), aux = jax.vjp(lambda o, x: head(o, x, micro_batch), outer, x), None
  return loss, aux, head_vjp(jnp.ones_like(loss))


def _pullback(stage: Callable[..., Any], primals: tuple[Any, ...], micro_batch: _staged.Batch,
              cotangent: Any) -> tuple[Any, ...]:
  """Cotangents of ``stage(*primals, micro_batch)`` for ``cotangent``.

  The stage's forward is recomputed from ``primals``: only they were kept.
  """
  _, stage_vjp = jax.vjp(lambda *p: stage(*p, micro_batch), *primals)
  return stage_vjp(cotangent)


def _gradient_and_difference(grads: list, halves: bool,
                             reduce: Callable[[list[jax.Array]], list[jax.Array]],
                             ) -> tuple[list, list]:
  """Flat gradient leaves as folded: ``(g, d)``, both reduced by ``reduce``.

  With ``halves`` each leaf is ``[2, ...]``, one gradient per half; ``g`` is
  their mean and ``d`` their half difference (reductions are linear, so on a
  mesh ``d`` is the half difference of the whole micro-batch's halves).
  Otherwise ``d`` is ``None`` per leaf.
  """
  if not halves:
    return reduce(grads), [None] * len(grads)
  return reduce(_steps.mean_of_halves(grads)), reduce(_steps.half_difference(grads))


def _release_stack(parts: FoldingParts, state: ScaleByAdamAState, micro_batch: _staged.Batch,
                   loss: jax.Array, stacked: optax.Params, layer_inputs: Any, x_grad: Any,
                   mu_stacked: optax.Updates, nu_stacked: optax.Updates, floor_stacked: Any,
                   # (m's, v's) flag trees, a name the body reuses for per-leaf pairs.
                   offloaded: Sequence[Any], reductions: Reductions,
                   layer_pullback: Callable[..., tuple[Any, Any]], halves: bool,
                   clip: _Clip = None,
                   ) -> tuple[Any, optax.Updates, optax.Updates, Any, jax.Array, _Clip]:
  """The backward through the stack as a reverse scan over its layers.

  Each step takes one layer's vjp from its saved input, folds that layer's
  gradient into its slice of m and v (in place in the carry) and passes the
  input cotangent down; one layer's gradient is alive at a time.
  ``layer_pullback((layer_params, layer_input), micro_batch, x_grad)`` gives
  ``(layer cotangent, input cotangent)``, per half with ``halves``.
  ``offloaded``: the stack's ``(m, v)`` host-memory flags.

  Returns:
    The cotangent of the stack's input, the new stacked m, v and floor
    (``None`` without halves), and whether every layer's gradient was finite.
  """
  stacked_def = jax.tree.structure(stacked)
  mu_leaves = stacked_def.flatten_up_to(mu_stacked)
  nu_leaves = stacked_def.flatten_up_to(nu_stacked)
  floor_leaves = None if floor_stacked is None else stacked_def.flatten_up_to(floor_stacked)
  # One seed pair per leaf, as scale_by_adama draws them; a layer's slice
  # mixes in its index so no two layers share rounding noise.
  seeds = reductions.layer_seeds(_fold.leaf_seeds(parts.config, state, mu_leaves, nu_leaves))
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  offloaded = list(zip(*map(stacked_def.flatten_up_to, offloaded)))
  # On one device, 8-bit leaves whose blocks straddle layers are folded
  # through float32 copies (see _straddling_in_float32); a mesh refuses them.
  shapes = [jnp.shape(p) for p in jax.tree.leaves(stacked)]
  whole = [reductions is ONE_DEVICE and straddles(m, shape)
           for m, shape in zip(mu_leaves, shapes)]
  stored = (mu_leaves, nu_leaves)
  mu_leaves, nu_leaves = (
      _straddling_in_float32(moments, shapes, [flags[k] for flags in offloaded], whole, order)
      for k, (moments, order) in enumerate(zip(stored, (1, 2))))
  offloaded_stored = offloaded
  offloaded = [(False, False) if w else flags for w, flags in zip(whole, offloaded)]
  (mu_leaves, mu_in_loop, mu_moved), (nu_leaves, nu_in_loop, nu_moved) = (
      on_device_whole(moments, [flags[k] for flags in offloaded])
      for k, moments in enumerate((mu_leaves, nu_leaves)))
  offloaded = list(zip(mu_in_loop, nu_in_loop))

  def release_layer(carry: tuple[Any, list, list, Optional[list], Optional[list]],
                    xs: tuple[jax.Array, Any, Any]) -> tuple[tuple, jax.Array]:
    x_grad, mus, nus, floors, sketches = carry
    layer, layer_params, layer_input = xs
    layer_params = reductions.layer_params(layer_params)
    # The whole leaves' shapes (under FSDP `stacked` holds this device's slices).
    leaf_shapes = [(num_layers,) + jnp.shape(x) for x in jax.tree.leaves(layer_params)]
    layer_grads, x_grad = layer_pullback((layer_params, layer_input), micro_batch, x_grad)
    layer_grads, differences = _gradient_and_difference(
        stacked_def.flatten_up_to(_steps.poison_if_loss_nonfinite(loss, layer_grads)), halves,
        reductions.layer_grads)
    if clip is not None and sketches is not None:
      sketches = [clip[0].add(index, sketch, g, layer)
                  for (index, _), sketch, g in zip(clip[1], sketches, layer_grads)]
      layer_grads = [clip[0].scaled(g) for g in layer_grads]
      differences = [clip[0].scaled(d) for d in differences]
    new_mus, new_nus, finite = [], [], []
    for i, (grad, d, mu, nu, (mu_off, nu_off), leaf_seeds) in enumerate(zip(
        layer_grads, differences, mus, nus, offloaded, seeds)):
      layer_seeds = tuple(
          None if s is None else _quantize.mix_seed(s, layer) for s in leaf_seeds)
      # Offloaded moments: only this layer's slice comes to the device.
      m, v, leaf_finite = _fold.fold_leaf(
          grad, _offload.to_device(layer_slice(mu, layer, num_layers), mu_off),
          _offload.to_device(layer_slice(nu, layer, num_layers), nu_off),
          state, parts.config, layer_seeds, d,
          whole_block_absmax=reductions.whole_block_absmax("layer", i))
      new_mus.append(_with_layer_slice(mu, _offload.to_host(m, mu_off), layer))
      new_nus.append(_with_layer_slice(nu, _offload.to_host(v, nu_off), layer))
      finite.append(leaf_finite)
    if floors is not None:
      increments = reductions.layer_floors(
          [_estimators.floor_increment(g, d, state, parts.config, n)
           for g, d, n in zip(layer_grads, differences, leaf_shapes)], leaf_shapes)
      floors = [_floor.add_layer_floor(f, inc, layer) for f, inc in zip(floors, increments)]
    # The flags leave as scan outputs, not carry: under shard_map they vary
    # over devices, a carry that starts as a constant does not.
    return (x_grad, new_mus, new_nus, floors, sketches), functools.reduce(operator.and_, finite)

  sketches = None if clip is None else [sketch for _, sketch in clip[1]]
  (x_grad, mu_leaves, nu_leaves, floor_leaves, sketches), layer_finite = jax.lax.scan(
      release_layer, (x_grad, mu_leaves, nu_leaves, floor_leaves, sketches),
      (jnp.arange(num_layers, dtype=jnp.int32), stacked, layer_inputs), reverse=True)
  if clip is not None and sketches is not None:
    clip = (clip[0], [(index, sketch) for (index, _), sketch in zip(clip[1], sketches)])
  floor_stacked = None if floor_leaves is None else stacked_def.unflatten(floor_leaves)
  mu_leaves, nu_leaves = (
      _restored(folded, like, [flags[k] for flags in offloaded_stored], whole, order,
                [pair[k] for pair in seeds])
      for k, (folded, like, order) in enumerate(zip(
          (mu_leaves, nu_leaves), stored, (1, 2))))
  mu_leaves, nu_leaves = ([_offload.to_host(x, True) if m else x for x, m in zip(leaves, moved)]
                          for leaves, moved in ((mu_leaves, mu_moved), (nu_leaves, nu_moved)))
  return (x_grad, stacked_def.unflatten(mu_leaves), stacked_def.unflatten(nu_leaves),
          floor_stacked, jnp.all(layer_finite), clip)


def _straddling_in_float32(moments: list, shapes: list, offloaded: list, whole: list,
                           order: int) -> list:
  """The stacked moment leaves, those marked ``whole`` as float32 values in
  their param's shape (v, not its stored root), on the device.

  Their 8-bit blocks straddle layers, so a layer's slice cannot be folded and
  requantized in place: the layer scan folds the float32 copy (a leaf's
  worth of float32 while the micro-batch runs: the default layout leaves
  only layers narrower than ``block_size // 8`` so) and :func:`_restored`
  quantizes it once, after the scan, as the fused step does each fold.
  """
  return [_quantize.from_blocks(_fold.load(_offload.to_device(m, off), order), shape)
          if w else m for m, shape, off, w in zip(moments, shapes, offloaded, whole)]


def _restored(folded: list, stored: list, offloaded: list, whole: list, order: int,
              seeds: list) -> list:
  """Inverse of :func:`_straddling_in_float32` after the fold: each ``whole``
  leaf quantized like its ``stored`` moment (with the leaf's own seed, as
  ``scale_by_adama`` rounds it) and sent back where it lives."""
  def quantized(value: jax.Array, like: _quantize.QuantizedArray, off: bool,
                seed: Optional[jax.Array]) -> _quantize.QuantizedArray:
    blocks = _quantize.to_blocks(value, *like.codes.shape)
    absmax = _quantize.block_absmax(blocks)
    return _offload.to_host(_fold._store(blocks, like, order, seed, absmax), off)

  return [quantized(x, like, off, seed) if w else x
          for x, like, off, w, seed in zip(folded, stored, offloaded, whole, seeds)]


def _fold_outer(parts: FoldingParts, state: ScaleByAdamAState, loss: jax.Array,
                outer_grads: optax.Updates, mu_outer: optax.Updates, nu_outer: optax.Updates,
                floor_outer: Any, leaf_shapes: list[tuple[int, ...]], stacked_mus: list,
                stacked_nus: list, offloaded: tuple[Any, Any], reductions: Reductions,
                halves: bool, clip: _Clip = None,
                ) -> tuple[optax.Updates, optax.Updates, Any, jax.Array, _Clip]:
  """Folds the unstacked leaves' gradients (embedding, head) whole.

  ``leaf_shapes``: the outer params' (whole) shapes, which decide how the
  floor is factored (on a mesh a gradient here may be a device's slice).
  ``stacked_mus`` / ``stacked_nus``: the stack's moment leaves, whose seeds
  come first. ``offloaded``: the outer ``(m, v)`` host-memory flags.
  Returns the new outer m, v and floor (``None`` without
  halves) and whether every gradient was finite.
  """
  outer_grads = _steps.poison_if_loss_nonfinite(loss, outer_grads)
  grads, outer_def = jax.tree.flatten(outer_grads)
  grads, differences = _gradient_and_difference(grads, halves, reductions.outer_grads)
  if clip is not None:
    clip = (clip[0], [(index, clip[0].add(index, sketch, g))
                      for (index, sketch), g in zip(clip[1], grads)])
    grads = [clip[0].scaled(g) for g in grads]
    differences = [clip[0].scaled(d) for d in differences]
  mus, nus = outer_def.flatten_up_to(mu_outer), outer_def.flatten_up_to(nu_outer)
  flags = list(zip(*map(outer_def.flatten_up_to, offloaded)))
  # Seeds past the stack's, so outer leaves never reuse a stacked leaf's.
  num_stacked = len(stacked_mus)
  outer_seeds = reductions.outer_seeds(_fold.leaf_seeds(
      parts.config, state, stacked_mus + mus, stacked_nus + nus))
  folded = [
      _fold_offloaded_leaf(g, m, v, flag, state, parts, leaf_seeds, d,
                           reductions.whole_block_absmax("outer", i))
      for i, (g, d, m, v, flag, leaf_seeds) in enumerate(zip(
          grads, differences, mus, nus, flags, outer_seeds[num_stacked:]))]
  new_mus, new_nus, finite = zip(*folded) if folded else ((), (), ())
  if floor_outer is not None:
    increments = reductions.outer_floors(
        [_estimators.floor_increment(g, d, state, parts.config, n)
         for g, d, n in zip(grads, differences, leaf_shapes)], leaf_shapes)
    floor_outer = outer_def.unflatten([
        _floor.add_floor(f, inc)
        for f, inc in zip(outer_def.flatten_up_to(floor_outer), increments)])
  return (outer_def.unflatten(new_mus), outer_def.unflatten(new_nus), floor_outer,
          functools.reduce(operator.and_, finite, jnp.array(True)), clip)


def offloaded_state(state: ScaleByAdamAState, parts: FoldingParts) -> tuple[Any, Any, Any]:
  """``(m's, v's, the floor's)`` flags of :func:`_offload.offloaded_leaves`:
  per leaf, whether it lives in host memory. Taken from the whole leaves of
  ``state`` (under ``shard_map`` a device sees slices, smaller than
  ``min_size`` where the whole leaf is not)."""
  return _offload.offloaded_leaves((state.mu, state.nu, state.nu_floor),
                                   parts.offload_min_size)


def _fold_offloaded_leaf(grad: jax.Array, mu: _fold.Moment, nu: _fold.Moment,
                         offloaded: tuple[bool, bool], state: ScaleByAdamAState,
                         parts: FoldingParts, seeds: Sequence[Optional[jax.Array]],
                         half_difference: Optional[jax.Array] = None,
                         whole_block_absmax: Callable[[jax.Array], jax.Array] = identity,
                         ) -> tuple[_fold.Moment, _fold.Moment, jax.Array]:
  """:func:`_fold.fold_leaf` of a whole leaf (or this device's slice of it),
  its moments brought in and sent back where ``offloaded = (m's, v's flags)``
  says they live in host memory."""
  mu_off, nu_off = offloaded
  m, v, finite = _fold.fold_leaf(
      grad, _offload.to_device(mu, mu_off), _offload.to_device(nu, nu_off), state,
      parts.config, seeds, half_difference, whole_block_absmax)
  return _offload.to_host(m, mu_off), _offload.to_host(v, nu_off), finite
