"""Clipping the mini-batch gradient's global norm without a gradient buffer.

``optax.clip_by_global_norm`` needs the mini-batch gradient :math:`\\bar g` whole,
the buffer AdamA removes. :func:`clip_by_sketched_global_norm` runs before AdamA,
once per micro-batch gradient, and keeps a small random-sign sketch of
:math:`\\bar g` instead (CountSketch; Charikar et al. 2002): each leaf is read once
as it goes by and adds into ``sketch_size`` floats, so no leaf waits on another.
The norm it estimates sets the factor of the *next* mini-batch (lag 1); the
current one would need every micro-batch's gradient before the first is folded,
a second forward and backward pass (as LOMO's clipping does, Lv et al. 2023).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import NamedTuple
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adama import _adama
from optax_adama import _chain
from optax_adama import _offload

__all__ = ("SketchedClipState", "clip_by_sketched_global_norm", "clipped_by_global_norm")

# A hash salt per mini-batch (odd: the multiply below is a bijection of uint32).
_STEP_SALT = 0x9E3779B1


class SketchedClipState(NamedTuple):
  """State of :func:`clip_by_sketched_global_norm`.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> from optax_adama import contrib
    >>> tx = contrib.clip_by_sketched_global_norm(1.0, num_micro_batches=2)
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> [s.shape for s in state.sketch], float(state.scale)
    ([(3,)], 1.0)
  """

  micro_step: jax.Array  # int32 []: micro-batches of the current mini-batch sketched so far.
  mini_batch_count: jax.Array  # int32 []: mini-batches completed; salts the next one's signs.
  # float32 [buckets of each leaf], one per leaf in tree order (about sketch_size
  # floats in all): the sum over this mini-batch's g_i of S(g_i).
  sketch: list[jax.Array]
  scale: jax.Array  # float32 []: the factor this mini-batch's gradients are multiplied by.
  norm_estimate: jax.Array  # float32 []: last completed mini-batch's estimate of ||g_bar||.


def _check(max_norm: float, num_micro_batches: int, sketch_size: int) -> None:
  if not max_norm > 0:
    raise ValueError(f"max_norm must be > 0, got {max_norm!r}.")
  if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) \
      or num_micro_batches < 1:
    raise ValueError(f"num_micro_batches must be an integer >= 1 (AdamA's N), got "
                     f"{num_micro_batches!r}.")
  if isinstance(sketch_size, bool) or not isinstance(sketch_size, int) or sketch_size < 1 \
      or sketch_size & (sketch_size - 1):
    raise ValueError(f"sketch_size must be a power of two >= 1 (e.g. 2**16), got "
                     f"{sketch_size!r}.")


def _negative(start: int | jax.Array, size: int, salt: jax.Array) -> jax.Array:
  """int8 1 where the sign of global flat index ``start + j`` is -1, else 0.

  lowbias32 (Wellons' integer hash) of the index mixed with ``salt``: the signs
  are a function of (index, seed, mini-batch), so they cost no state and
  differ between mini-batches (estimation errors do not repeat step after
  step). int8, not float32: XLA's CPU backend does not fuse the integer hash
  into the reduction and keeps its result for a moment, a quarter of a float32
  leaf so.
  """
  # The salt joins the index before anything else: an index array alone would
  # be loop-invariant, and XLA would keep it in memory (1 P of uint32 on the
  # 8-layer test MLP) instead of computing it inside the reduction.
  first = jnp.uint32(start % 2**32) if isinstance(start, int) else start
  h = jnp.arange(size, dtype=jnp.uint32) + (first + salt)
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  h = h ^ (h >> 16)
  return (h >> 31).astype(jnp.int8)


def bucket_counts(sizes: list[int], sketch_size: int) -> list[int]:
  """Buckets of each leaf's own sketch: about ``sketch_size`` in all, shared in
  proportion to the leaves' sizes, and one per entry for a leaf that small
  (every leaf of up to 256 entries, and every leaf of a tree of at most
  ``sketch_size`` entries: there the sketch's norm is exact)."""
  total = max(1, sum(sizes))
  return [min(size, max(min(size, 256), sketch_size * size // total)) for size in sizes]


def _tied(salt: jax.Array, leaf: jax.Array) -> jax.Array:
  """``salt``, made to wait for ``leaf``.

  The signs depend on the salt alone, which is the same for every micro-batch
  of a mini-batch: in a scan over them XLA hoists the hash out of the loop and
  keeps every leaf's signs for the whole step (int8, a quarter of the
  gradient: +0.29 P on a 4-layer Llama compiled for an H100, against +0.02 P
  tied). GPU and TPU compilers respect an optimization barrier between the
  salt and the leaf's first entry. XLA's CPU backend keeps more alive across
  the barrier (+0.50 P against +0.25 P), so there the salt takes a term that
  is 0 unless the leaf holds a NaN (whose sketch is dropped anyway).
  """
  first = leaf.reshape(-1)[0]

  def barrier() -> jax.Array:
    tied, _ = jax.lax.optimization_barrier((salt, first))
    return tied

  def arithmetic() -> jax.Array:
    return salt + (first != first).astype(jnp.uint32)

  return jax.lax.platform_dependent(cpu=arithmetic, default=barrier)


def _sketch_leaf(leaf: jax.Array, buckets: int, start: int | jax.Array, salt: jax.Array,
                 rotation: Optional[jax.Array] = None) -> jax.Array:
  """The leaf's own sketch: entry ``j`` signed and added to bucket ``j mod buckets``.

  ``rotation``: for a slice of a leaf (one layer of a stack, ``start`` its
  first entry's index), ``offset mod buckets`` of that first entry within the
  leaf, so each entry lands in the bucket it has in the whole leaf's sketch.

  Each leaf has its own buckets (not a slice of one shared array): no leaf's
  sketch waits on another's, so each gradient leaf dies as soon as it is
  folded (a shared array serialized them in tree order, and on the 8-layer
  test MLP kept the whole gradient alive: 5.77 P against AdamA's 3.36 P).
  """
  size = leaf.size
  signs = 1.0 - 2.0 * _negative(start, size, _tied(salt, leaf)).astype(jnp.float32)
  flat = leaf.reshape(-1).astype(jnp.float32) * signs
  # Whole rows of ``buckets`` summed, then the last part row added to the first
  # buckets: padding the leaf to whole rows instead copies it (+0.8 P for a
  # stacked [4, 1024, 1024] leaf compiled for an H100).
  whole = size // buckets * buckets
  sketch = flat[:whole].reshape(-1, buckets).sum(axis=0)
  if whole < size:
    sketch = sketch + jnp.pad(flat[whole:], (0, buckets - (size - whole)))
  if rotation is not None:
    sketch = jnp.roll(sketch, rotation)
  # A leaf with a non-finite entry adds nothing (AdamA folds that entry as zero):
  # tested on the leaf's sketch, so the gradient is read once.
  return jnp.where(jnp.all(jnp.isfinite(sketch)), sketch, 0.0)


def _layout(sizes: list[int], sketch_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Each leaf's first flat index over the leaves in tree order, and its
  bucket count (:func:`bucket_counts`)."""
  starts = tuple(int(x) for x in np.cumsum([0] + sizes)[:-1])
  return starts, tuple(bucket_counts(sizes, sketch_size))


def sketch_tree(tree: optax.Updates, sketch_size: int, salt: jax.Array) -> list[jax.Array]:
  """S(tree): a linear map to about ``sketch_size`` floats with E||S(x)||^2 = ||x||^2.

  Each entry gets a random sign and a bucket of its leaf's sketch
  (:func:`bucket_counts`); :math:`\\|S(x)\\|^2` is unbiased for
  :math:`\\|x\\|^2` with variance :math:`2\\sum_b[(\\sum_{i\\in b}x_i^2)^2 -
  \\sum_{i\\in b}x_i^4]`, a relative standard deviation of about
  :math:`\\sqrt{2/k}` for ``k`` buckets evenly filled (0.55% at 2^16).
  """
  leaves = jax.tree.leaves(tree)
  starts, counts = _layout([leaf.size for leaf in leaves], sketch_size)
  return [_sketch_leaf(leaf, buckets, start, salt) if leaf.size
          else jnp.zeros((0,), jnp.float32)
          for leaf, buckets, start in zip(leaves, counts, starts)]


def _squared_norm(sketch: list[jax.Array]) -> jax.Array:
  return sum((jnp.sum(jnp.square(s)) for s in sketch), jnp.zeros([], jnp.float32))


def _salt(seed: int, count: jax.Array) -> jax.Array:
  return jnp.uint32(seed % 2**32) + count.astype(jnp.uint32) * jnp.uint32(_STEP_SALT)


def clip_by_sketched_global_norm(
    max_norm: float,
    *,
    num_micro_batches: int,
    sketch_size: int = 2**16,
    seed: int = 0,
) -> optax.GradientTransformation:
  """Clips to ``max_norm`` the mini-batch gradient's global norm, one mini-batch late.

  Chained *before* AdamA (``optax.chain(clip, adama(...))``), it gets each
  micro-batch gradient :math:`g_i` of mini-batch :math:`t` in turn, returns it
  scaled by the factor :math:`c_t` and adds its sketch :math:`S(g_i)` (see
  below) to :math:`s_t`. After the ``N``-th:

  .. math::

    \\widehat{\\|\\bar g_t\\|} = \\|s_t\\| / N, \\qquad
    c_{t+1} = \\min\\bigl(1,\\ \\text{max\\_norm} / \\widehat{\\|\\bar g_t\\|}\\bigr),
    \\qquad c_1 = 1.

  :math:`S` gives each entry a sign from an integer hash of its flat index (over
  the leaves in tree order), the seed and :math:`t`, and a bucket of its leaf's
  own share of the sketch (entry ``j`` in bucket ``j mod buckets``; shares in
  proportion to the leaves' sizes, :func:`bucket_counts`): it is linear, so
  :math:`s_t/N = S(\\bar g_t)`, and :math:`\\|S(x)\\|^2` is unbiased for
  :math:`\\|x\\|^2` with a relative standard deviation near
  :math:`\\sqrt{2/\\text{sketch\\_size}}` (the norm's half that, 0.28% at 2^16;
  exact for trees of at most ``sketch_size`` entries). State: about
  ``sketch_size`` float32 (256 KiB at 2^16); each gradient leaf is read once
  more. In the fused steps AdamA wrapped in a chain is updated once per
  micro-batch (``microbatch_step``'s per-call path, which writes the params on
  every micro-batch: +0.81 P on a scanned stack compiled for an H100);
  :func:`clipped_by_global_norm` is this clip inside AdamA, which they fold
  (``release_step`` takes only that, on one device).

  The factor lags one mini-batch behind ``optax.clip_by_global_norm``'s, which
  needs :math:`\\bar g_t` before any :math:`g_i` is folded. With ``N = 1`` and a
  tree of at most ``sketch_size`` entries, the factor applied at step
  :math:`t + 1` is exactly ``clip_by_global_norm``'s at step :math:`t`.
  A leaf with a non-finite entry adds nothing to the sketch (AdamA folds that
  entry as zero); a dropped micro-batch still counts towards ``N``, as in
  AdamA's mean.

  Args:
    max_norm: the largest global norm of the mini-batch mean gradient.
    num_micro_batches: ``N``, AdamA's ``num_micro_batches``: calls per mini-batch.
    sketch_size: buckets of the sketch (about; shared among the leaves), a power
      of two.
    seed: salts the signs.

  Returns:
    A :class:`optax.GradientTransformation` with a :class:`SketchedClipState`.

  Raises:
    ValueError: if ``max_norm <= 0``, ``num_micro_batches < 1`` or
      ``sketch_size`` is not a power of two.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_adama
    >>> tx = optax.chain(
    ...     optax_adama.contrib.clip_by_sketched_global_norm(1.0, num_micro_batches=2),
    ...     optax_adama.adama(1e-3, num_micro_batches=2))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g in (3.0, 5.0):  # one mini-batch: its mean gradient is (4, 4)
    ...   _, state = tx.update({"w": jnp.full(2, g)}, state, params)
    >>> round(float(state[0].norm_estimate), 4), round(float(state[0].scale), 4)
    (5.6569, 0.1768)

  References:
    Charikar, Chen, Farach-Colton, `Finding frequent items in data streams
    <https://doi.org/10.1016/S0304-3975(03)00400-6>`_, 2004 (CountSketch);
    Lv et al., `Full parameter fine-tuning for large language models with
    limited resources <https://arxiv.org/abs/2306.09782>`_, 2023 (a second
    pass for the current norm).
  """
  _check(max_norm, num_micro_batches, sketch_size)

  def init_fn(params: optax.Params) -> SketchedClipState:
    sizes = [int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params)]
    sketch = [jnp.zeros((buckets,), jnp.float32)
              for buckets in bucket_counts(sizes, sketch_size)]
    return SketchedClipState(
        micro_step=jnp.zeros([], jnp.int32), mini_batch_count=jnp.zeros([], jnp.int32),
        sketch=sketch, scale=jnp.ones([], jnp.float32),
        norm_estimate=jnp.zeros([], jnp.float32))

  def update_fn(updates: optax.Updates, state: SketchedClipState,
                params: optax.Params | None = None) -> tuple[optax.Updates, SketchedClipState]:
    del params
    new_sketch = sketch_tree(updates, sketch_size, _salt(seed, state.mini_batch_count))
    sketch = [total + new for total, new in zip(state.sketch, new_sketch)]
    # Each leaf is scaled by a factor known before the mini-batch began. (Tying
    # each leaf's fold to its sketch, to order them, cost more memory on the CPU
    # compile: 8-layer test MLP 4.23 P against 3.98 P.)
    scaled = jax.tree.map(lambda g: g * state.scale.astype(g.dtype), updates)
    return scaled, _advance(state, sketch, max_norm, num_micro_batches)

  return optax.GradientTransformation(init_fn, update_fn)


def _advance(state: SketchedClipState, sketch: list[jax.Array], max_norm: float,
             num_micro_batches: int) -> SketchedClipState:
  """``state`` after one more micro-batch, whose sketch brought the totals to
  ``sketch``; after the ``N``-th, the next mini-batch's factor."""
  micro_step = state.micro_step + 1
  completed = micro_step == num_micro_batches
  norm = jnp.sqrt(_squared_norm(sketch)) / num_micro_batches
  next_scale = jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1.0), 1.0)
  return SketchedClipState(
      micro_step=jnp.where(completed, 0, micro_step).astype(jnp.int32),
      mini_batch_count=state.mini_batch_count + completed.astype(jnp.int32),
      sketch=[jnp.where(completed, jnp.zeros_like(s), s) for s in sketch],
      scale=jnp.where(completed, next_scale, state.scale).astype(jnp.float32),
      norm_estimate=jnp.where(completed, norm, state.norm_estimate).astype(jnp.float32))


class SliceSketcher(NamedTuple):
  """One micro-batch of the clip, leaf by leaf or layer slice by layer slice, as
  ``release_step`` folds: each gradient is scaled by this mini-batch's factor
  and its (unscaled) sketch added to its leaf's, the same numbers as
  :func:`clip_by_sketched_global_norm` on the whole gradient."""

  scale: jax.Array  # float32 []: this mini-batch's factor.
  salt: jax.Array  # uint32 []: this mini-batch's signs.
  starts: tuple[int, ...]  # each leaf's first flat index, in tree order.
  buckets: tuple[int, ...]  # each leaf's bucket count, in tree order.

  def scaled(self, x: Optional[jax.Array]) -> Optional[jax.Array]:
    return None if x is None else x * self.scale.astype(x.dtype)

  def add(self, index: int, sketch: jax.Array, grad: jax.Array,
          layer: Optional[jax.Array] = None) -> jax.Array:
    """``sketch`` plus leaf ``index``'s gradient's (with ``layer``: the gradient
    of that layer's slice of a stacked leaf)."""
    buckets, start = self.buckets[index], self.starts[index]
    if not grad.size:  # an empty leaf has no buckets (as sketch_tree skips it)
      return sketch
    if layer is None:
      return sketch + _sketch_leaf(grad, buckets, start, self.salt)
    size = grad.size  # one layer's slice
    first = (jnp.uint32(start % 2**32)
             + layer.astype(jnp.uint32) * jnp.uint32(size % 2**32))
    rotation = (layer.astype(jnp.int32) * (size % buckets)) % buckets
    return sketch + _sketch_leaf(grad, buckets, first, self.salt, rotation)


@dataclasses.dataclass(frozen=True)
class SketchedClip:
  """The clip :func:`clipped_by_global_norm` puts in AdamA's ``FoldingParts``."""

  max_norm: float
  sketch_size: int
  seed: int

  def transform(self, num_micro_batches: int) -> optax.GradientTransformation:
    """The clip as a transformation of each micro-batch gradient (the fused steps')."""
    return _clip_for(self.max_norm, self.sketch_size, self.seed, num_micro_batches)

  def sketcher(self, state: SketchedClipState, params: optax.Params) -> SliceSketcher:
    sizes = [int(np.prod(jnp.shape(leaf))) for leaf in jax.tree.leaves(params)]
    return SliceSketcher(state.scale, _salt(self.seed, state.mini_batch_count),
                         *_layout(sizes, self.sketch_size))

  def advance(self, state: SketchedClipState, sketch: list[jax.Array],
              num_micro_batches: int) -> SketchedClipState:
    return _advance(state, sketch, self.max_norm, num_micro_batches)


def scaled_extra_args(extra_args: dict[str, Any], scale: jax.Array) -> dict[str, Any]:
  """The extra arguments of a clipped micro-batch: its half difference (the
  "split" estimator's) scaled as its gradient is."""
  if extra_args.get("half_difference") is None:
    return extra_args
  half = jax.tree.map(lambda d: d * scale.astype(d.dtype), extra_args["half_difference"])
  return {**extra_args, "half_difference": half}


def clipped_by_global_norm(
    tx: optax.GradientTransformation,
    max_norm: float,
    *,
    sketch_size: int = 2**16,
    seed: int = 0,
) -> optax.GradientTransformation:
  """AdamA ``tx`` with the mini-batch gradient's global norm clipped to ``max_norm``.

  What ``optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(lr))`` is
  to Adam with gradient accumulation, without the mini-batch gradient it
  clips: each micro-batch gradient is scaled by
  :func:`clip_by_sketched_global_norm`'s factor before it is folded, so the
  norm comes from a sketch of about ``sketch_size`` floats and the factor is
  one mini-batch late (its docstring has the estimator and its error).

  Unlike ``optax.chain(clip_by_sketched_global_norm(...), tx)``, which the
  fused steps run as one ``update`` per micro-batch, the result is still a
  bare AdamA: :func:`optax_adama.microbatch_step` folds it in its scan (the
  clip's work fuses with the fold) and applies the update once. Compiled for
  one H100 (XLA's GPU compiler, no device), a 4-layer, 16 M-param Llama's
  fused step holds 3.628 P against AdamA's 3.619 P
  (benchmarks/results/convergence/clipping.md). :func:`optax_adama.release_step`
  takes it on one device: each layer's gradient is scaled and sketched where
  the whole leaf's entries would be (Llama 3 8B's release compiled for an H100:
  +271 KB, the sketch); on a mesh it refuses it.

  Args:
    tx: a bare AdamA transformation (:func:`adama`, :func:`adamaw`,
      :func:`scale_by_adama`, a :func:`mini_batch_chain`, optionally under
      :func:`offload_moments`).
    max_norm: the largest global norm of the mini-batch mean gradient.
    sketch_size: buckets of the sketch, a power of two.
    seed: salts the sketch's signs.

  Returns:
    An AdamA :class:`optax.GradientTransformation` with state
    :class:`ClippedState`.

  Raises:
    TypeError: if ``tx`` is not a bare AdamA transformation.
    ValueError: if ``max_norm <= 0`` or ``sketch_size`` is not a power of two.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> tx = optax_adama.clipped_by_global_norm(
    ...     optax_adama.adamaw(1e-3, num_micro_batches=2), max_norm=1.0)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g in (3.0, 5.0):  # one mini-batch: its mean gradient is (4, 4)
    ...   _, state = tx.update({"w": jnp.full(2, g)}, state, params)
    >>> round(float(state.clip.norm_estimate), 4), round(float(state.clip.scale), 4)
    (5.6569, 0.1768)
  """
  parts = _adama.folding_parts(tx)
  if parts is None or parts.clip is not None:
    raise TypeError(
        "clipped_by_global_norm takes a bare AdamA transformation (adama, adamaw, "
        "scale_by_adama, mini_batch_chain, optionally under offload_moments), once; "
        f"got {type(tx).__name__}. For other transformations chain "
        "optax_adama.contrib.clip_by_sketched_global_norm before them.")
  _check(max_norm, 1, sketch_size)
  sketched = SketchedClip(float(max_norm), sketch_size, seed)
  clip = sketched.transform
  # Under offload_moments the sketch's large leaves live in host memory too, as
  # the fused steps place every state leaf of offload_moments' min_size.
  to_device, to_host = _offload.moves(parts.offload_min_size)

  def init_fn(params: optax.Params) -> _chain.ClippedState:
    adama_state = tx.init(params)
    return _chain.ClippedState(clip=to_host(clip(1).init(params)), adama=adama_state)

  def update_fn(updates: optax.Updates, state: _chain.ClippedState,
                params: Optional[optax.Params] = None,
                **extra_args: Any) -> tuple[optax.Updates, _chain.ClippedState]:
    clip_state = to_device(state.clip)
    extra_args = scaled_extra_args(extra_args, clip_state.scale)
    num_micro_batches = _chain.adama_of(state.adama).num_micro_batches
    updates, clip_state = clip(num_micro_batches).update(updates, clip_state)
    updates, adama_state = tx.update(updates, state.adama, params, **extra_args)
    return updates, _chain.ClippedState(clip=to_host(clip_state), adama=adama_state)

  return _adama.FoldingTransformation(
      init_fn, update_fn, dataclasses.replace(parts, clip=sketched))


@functools.cache
def _clip_for(max_norm: float, sketch_size: int, seed: int,
              num_micro_batches: int) -> optax.GradientTransformation:
  return clip_by_sketched_global_norm(
      max_norm, num_micro_batches=num_micro_batches, sketch_size=sketch_size, seed=seed)
