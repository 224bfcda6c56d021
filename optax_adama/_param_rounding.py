"""Narrow params updated with stochastic rounding: a transform chained last.

``optax.apply_updates`` adds an update to a bfloat16 param in float32 and
rounds the sum to nearest: an update under half the param's spacing
(``|p| * 2**-8`` in bfloat16) is lost, every step, so a small learning rate
stops training (Zamirai et al., arXiv:2010.06192). Rounding the sum up or down
at random, with the probability that makes it exact in expectation, keeps
those updates on average. optax has no hook at the add, so this transform
rewrites the update instead: it returns ``SR(p + u) - p`` in float32, which
every params add (optax's, the fused steps') turns back into exactly
``SR(p + u)`` (two bfloat16 values' difference is exact in float32, and so
is its sum with ``p``).
"""

from __future__ import annotations

from typing import NamedTuple
from typing import Optional

import chex
import jax
import jax.numpy as jnp
import optax

from optax_adama import _quantize


class RoundParamsStochasticallyState(NamedTuple):
  """State of :func:`round_params_stochastically` (its maker's example shows one)."""

  count: chex.Array  # uint32 []: updates so far; each picks its own noise.


def round_params_stochastically(seed: int = 0) -> optax.GradientTransformation:
  r"""Updates that land narrow params on the stochastically rounded sum.

  Chain it last. Where a param is narrower than float32 (bfloat16, float16),
  the update ``u`` becomes

  .. math::

    u' = \mathrm{SR}(p + u) - p, \qquad \mathbb{E}[\mathrm{SR}(x)] = x,

  in float32, so ``optax.apply_updates(params, updates)`` (or a fused step's
  add) gives ``SR(p + u)`` exactly, where it would give ``p + u`` rounded to
  nearest. float32 and wider params get their updates unchanged. The noise is
  a hash of ``seed``, the update count, the leaf, each element's index and the
  param's own bits: no PRNG key to thread, the same rounding however the leaf
  is sharded, and different noise for the same index of different layers when
  a release applies one layer at a time.

  With AdamA put it in :func:`optax_adama.mini_batch_chain` (after the
  learning rate), so that it runs once per mini-batch, on the update that is
  applied; keep the moments float32 (``mu_dtype=jnp.float32``,
  ``nu_dtype=jnp.float32``, or offloaded), since with bfloat16 params they
  would default to bfloat16.

  Args:
    seed: a non-negative integer picking the rounding noise.

  Returns:
    A :class:`optax.GradientTransformation` whose ``update`` needs ``params``.

  Raises:
    ValueError: if ``seed`` is negative or not an integer; at ``update``, if
      ``params`` is not given.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from optax_adama import contrib
    >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
    >>> tx = optax.chain(optax.sgd(1e-3), contrib.round_params_stochastically())
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones(10_000, jnp.float32)}  # each step moves w by -1e-3
    >>> with jax.numpy_dtype_promotion("standard"):  # JAX's default: bf16 + f32
    ...   for _ in range(10):
    ...     updates, state = tx.update(grads, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> # 1e-3 is under half of bfloat16's spacing below 1 (2 ** -8): rounded to
    >>> # nearest, w would stay 1.0; rounded at random it moves 1e-2 on average.
    >>> print(round(float(params["w"].astype(jnp.float32).mean()), 2))
    0.99

  References:
    Zamirai et al., `Revisiting BFloat16 Training
    <https://arxiv.org/abs/2010.06192>`_, 2020.
  """
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
  seed = seed % (1 << 32)

  def init_fn(params: optax.Params) -> RoundParamsStochasticallyState:
    del params
    return RoundParamsStochasticallyState(count=jnp.zeros([], jnp.uint32))

  def update_fn(
      updates: optax.Updates, state: RoundParamsStochasticallyState,
      params: Optional[optax.Params] = None,
  ) -> tuple[optax.Updates, RoundParamsStochasticallyState]:
    if params is None:
      raise ValueError(
          "round_params_stochastically needs params: call tx.update(updates, state, "
          "params).")
    step_seed = _quantize.mix_seed(jnp.uint32(seed), state.count)
    leaves, treedef = jax.tree.flatten(updates, is_leaf=lambda x: x is None)
    param_leaves = treedef.flatten_up_to(params)
    new_leaves = [
        None if u is None else _rounded_update(u, jnp.asarray(p), _quantize.mix_seed(
            step_seed, jnp.uint32(index)))
        for index, (u, p) in enumerate(zip(leaves, param_leaves))]
    count = state.count + jnp.uint32(1)  # wraps at 2**32, as a hash input may
    return treedef.unflatten(new_leaves), RoundParamsStochasticallyState(count=count)

  return optax.GradientTransformation(init_fn, update_fn)


def _rounded_update(update: jax.Array, param: jax.Array, seed: jax.Array) -> jax.Array:
  """``SR(param + update) - param`` in float32 for a narrow float param, else ``update``."""
  if (not jnp.issubdtype(param.dtype, jnp.floating)
      or jnp.finfo(param.dtype).nmant >= jnp.finfo(jnp.float32).nmant):
    return update
  wide = param.astype(jnp.float32)
  # The param's bits in the seed: one layer slice's indices repeat across
  # layers when a release applies the update a layer at a time.
  element_seeds = _quantize.mix_seed(seed, jax.lax.bitcast_convert_type(wide, jnp.uint32))
  rounded = _quantize.stochastic_round(wide + update.astype(jnp.float32), param.dtype,
                                       element_seeds)
  # The cast rounds to nearest only below the narrow type's normal range.
  return rounded.astype(param.dtype).astype(jnp.float32) - wide
