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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ("SketchedClipState", "clip_by_sketched_global_norm")

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


def _negative(start: int, size: int, salt: jax.Array) -> jax.Array:
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
  h = jnp.arange(size, dtype=jnp.uint32) + (jnp.uint32(start % 2**32) + salt)
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


def _sketch_leaf(leaf: jax.Array, buckets: int, start: int, salt: jax.Array) -> jax.Array:
  """The leaf's own sketch: entry ``j`` signed and added to bucket ``j mod buckets``.

  Each leaf has its own buckets (not a slice of one shared array): no leaf's
  sketch waits on another's, so each gradient leaf dies as soon as it is
  folded (a shared array serialized them in tree order, and on the 8-layer
  test MLP kept the whole gradient alive: 5.77 P against AdamA's 3.36 P).
  """
  size = leaf.size
  # Signs that depend on the salt alone would be computed as soon as the step
  # starts, all leaves' at once, and kept until their gradients arrive: tying
  # them to the leaf (a term that is 0 unless the leaf's sketch is dropped
  # below anyway) makes each wait for its own gradient.
  first = leaf.reshape(-1)[0]
  salt = salt + (first != first).astype(jnp.uint32)
  signs = 1.0 - 2.0 * _negative(start, size, salt).astype(jnp.float32)
  flat = leaf.reshape(-1).astype(jnp.float32) * signs
  rows = -(-size // buckets)
  sketch = jnp.pad(flat, (0, rows * buckets - size)).reshape(rows, buckets).sum(axis=0)
  # A leaf with a non-finite entry adds nothing (AdamA folds that entry as zero):
  # tested on the leaf's sketch, so the gradient is read once.
  return jnp.where(jnp.all(jnp.isfinite(sketch)), sketch, 0.0)


def sketch_tree(tree: optax.Updates, sketch_size: int, salt: jax.Array) -> list[jax.Array]:
  """S(tree): a linear map to about ``sketch_size`` floats with E||S(x)||^2 = ||x||^2.

  Each entry gets a random sign and a bucket of its leaf's sketch
  (:func:`bucket_counts`); :math:`\\|S(x)\\|^2` is unbiased for
  :math:`\\|x\\|^2` with variance :math:`2\\sum_b[(\\sum_{i\\in b}x_i^2)^2 -
  \\sum_{i\\in b}x_i^4]`, a relative standard deviation of about
  :math:`\\sqrt{2/k}` for ``k`` buckets evenly filled (0.55% at 2^16).
  """
  leaves = jax.tree.leaves(tree)
  counts = bucket_counts([leaf.size for leaf in leaves], sketch_size)
  starts = np.cumsum([0] + [leaf.size for leaf in leaves])
  return [_sketch_leaf(leaf, buckets, int(start), salt) if leaf.size
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
  more. The compiled step can hold more: on the CPU backend some gradient leaves
  and their int8 signs stay alive until sketched (+0.25 P on a 4-layer Llama,
  benchmarks/results/convergence/clipping.md). In the fused steps AdamA wrapped
  in a chain is updated once per micro-batch (``microbatch_step``'s per-call
  path); ``release_step`` refuses it.

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
    micro_step = state.micro_step + 1
    completed = micro_step == num_micro_batches
    norm = jnp.sqrt(_squared_norm(sketch)) / num_micro_batches
    next_scale = jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1.0), 1.0)
    new_state = SketchedClipState(
        micro_step=jnp.where(completed, 0, micro_step).astype(jnp.int32),
        mini_batch_count=state.mini_batch_count + completed.astype(jnp.int32),
        sketch=[jnp.where(completed, jnp.zeros_like(s), s) for s in sketch],
        scale=jnp.where(completed, next_scale, state.scale).astype(jnp.float32),
        norm_estimate=jnp.where(completed, norm, state.norm_estimate).astype(jnp.float32))
    return scaled, new_state

  return optax.GradientTransformation(init_fn, update_fn)
