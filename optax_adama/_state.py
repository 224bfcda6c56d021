"""The state of AdamA's transformation and the hyperparameters it folds with."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import NamedTuple

import chex
import jax
import optax


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["count", "micro_step", "mu", "nu", "nu_floor",
                 "mini_batch_accepted", "num_dropped"],
    meta_fields=["num_micro_batches", "nu_estimator"])
class ScaleByAdamAState(NamedTuple):
  """State of :func:`scale_by_adama`.

  A ``NamedTuple``, as optax's states are, so ``optax.tree_utils.tree_get``
  and ``tree_set`` find its leaves (``tree_get(state, "count")``).
  ``num_micro_batches`` and ``nu_estimator`` are static (registered as part of
  the tree structure, not leaves, and not in ``_fields``: ``tree_get`` does
  not see them, read ``find_adama_state(state).num_micro_batches``, and a
  state dict of Flax's ``serialization`` does not hold them, so save and
  restore the state with orbax, docs/checkpointing.md), so a jitted step can
  read them while tracing: :func:`microbatch_step` takes ``N`` from here, and whether to hand
  each update the difference of a micro-batch's halves (``"split"``), so a
  mismatch cannot happen.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> state = optax_adama.scale_by_adama(num_micro_batches=4).init({"w": jnp.ones(2)})
    >>> int(state.count), int(state.micro_step), state.num_micro_batches
    (0, 0, 4)
  """

  # int32 []: mini-batches completed, dropped ones included; bias correction
  # and schedules count these.
  count: chex.Array
  # int32 []: micro-batches folded into the current mini-batch, in [0, N).
  micro_step: chex.Array
  # Like params (dtype mu_dtype): the first moment; with quantization, a
  # QuantizedArray per large leaf.
  mu: optax.Updates
  # Like params (dtype nu_dtype): the second moment, mean of g_i**2; with
  # quantization, a QuantizedArray of sign(v) sqrt(|v|) per large leaf.
  nu: optax.Updates
  # contrib's "auto"/"split" at N > 1: a FactoredSquares per param leaf
  # (float32 row and column sums, 0.26% of P on GPT-2 small), the floor of
  # "split"'s v; otherwise () (nothing).
  nu_floor: Any
  # int32 []: micro-batches of the current (or just completed) mini-batch with
  # an all-finite gradient.
  mini_batch_accepted: chex.Array
  # int32 []: micro-batches with any non-finite gradient entry, since init.
  num_dropped: chex.Array
  # Static Python int: N, the update calls per mini-batch.
  num_micro_batches: int
  # Static: the estimator of v ("mean"; contrib's "auto" or one of NU_ESTIMATORS).
  nu_estimator: str = "mean"


# `_fields` names the pytree children only: optax's tree_get / tree_set walk a
# NamedTuple state's `_fields` as its subtrees, and a static field there is a
# leaf they count that jax's flattening does not (tree_set then failed on any
# state holding this one: inject_hyperparams, chain). `_replace`, repr and
# pickling keep every field.
ScaleByAdamAState._fields = ("count", "micro_step", "mu", "nu", "nu_floor",  # type: ignore[assignment]
                             "mini_batch_accepted", "num_dropped")


@dataclasses.dataclass(frozen=True, eq=False)
class AdamAConfig:
  """The hyperparameters of one AdamA transformation, fixed when it is built.

  Made once by :func:`scale_by_adama`, read by its ``update`` and by the steps
  that fold micro-batches themselves (:func:`microbatch_step`,
  :func:`release_step`), so both compute the same math from the same values.
  ``b1``, ``b2``, ``eps``, ``eps_root`` and ``rounding_seed`` may be arrays
  (traced under ``inject_hyperparams``); the rest are static Python values.
  Compared by identity (``eq=False``): the array fields are not hashable.
  """

  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  num_micro_batches: int
  nu_estimator: str
  stochastic_rounding: bool
  rounding_seed: Any
