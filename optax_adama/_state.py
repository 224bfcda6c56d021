"""The state of AdamA's transformation and the hyperparameters it folds with."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import NamedTuple

import chex
import jax
import optax

# The static fields of ScaleByAdamAState: its configuration, not leaves.
_STATIC_FIELDS = ("num_micro_batches", "nu_estimator")


class _ScaleByAdamALeaves(NamedTuple):
  """The leaves of :class:`ScaleByAdamAState`, its ``NamedTuple`` fields."""

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


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=list(_ScaleByAdamALeaves._fields), meta_fields=list(_STATIC_FIELDS))
class ScaleByAdamAState(_ScaleByAdamALeaves):
  """State of :func:`scale_by_adama`.

  A ``NamedTuple`` of its leaves, as optax's states are, so
  ``optax.tree_utils.tree_get`` and ``tree_set`` find them
  (``tree_get(state, "count")``), and two static fields, AdamA's
  configuration: ``num_micro_batches`` (``N``) and ``nu_estimator``. They are
  part of the tree structure, not leaves (as ``flax.struct.field(
  pytree_node=False)`` or Equinox's ``field(static=True)`` make them), and
  not ``NamedTuple`` fields, so ``tree_get`` does not see them (read
  ``find_adama_state(state).num_micro_batches``) and a state dict of Flax's
  ``serialization`` does not hold them: save and restore the state with
  orbax, docs/checkpointing.md. This is their one home: ``update`` and the
  jitted steps read them from the state they are given, while tracing
  (:func:`microbatch_step` takes ``N`` from here, and whether to hand each
  update the difference of a micro-batch's halves, ``"split"``).

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> state = optax_adama.scale_by_adama(num_micro_batches=4).init({"w": jnp.ones(2)})
    >>> int(state.count), int(state.micro_step), state.num_micro_batches
    (0, 0, 4)
  """

  # Static Python int: N, the update calls per mini-batch.
  num_micro_batches: int
  # Static: the estimator of v ("mean"; contrib's "auto" or one of NU_ESTIMATORS).
  nu_estimator: str

  def __new__(cls, count: chex.Array, micro_step: chex.Array, mu: optax.Updates,
              nu: optax.Updates, nu_floor: Any, mini_batch_accepted: chex.Array,
              num_dropped: chex.Array, num_micro_batches: int,
              nu_estimator: str = "mean") -> ScaleByAdamAState:
    state = super().__new__(cls, count, micro_step, mu, nu, nu_floor, mini_batch_accepted,
                            num_dropped)
    # Written once, here: __setattr__ refuses (the tree structure holds them).
    state.__dict__.update(num_micro_batches=num_micro_batches, nu_estimator=nu_estimator)
    return state

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(f"ScaleByAdamAState is immutable: state._replace({name}=...)")

  def _static_fields(self) -> dict[str, Any]:
    """The static fields, by name: ``{"num_micro_batches": N, "nu_estimator": name}``."""
    return {name: getattr(self, name) for name in _STATIC_FIELDS}

  def _replace(self, **changes: Any) -> ScaleByAdamAState:
    """A copy with ``changes`` to leaves or static fields (``NamedTuple._replace``'s)."""
    return type(self)(**{**self._asdict(), **self._static_fields(), **changes})

  def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # pickle and copy rebuild the state with its static fields.
    return tuple(self), self._static_fields()

  def __repr__(self) -> str:
    static = ", ".join(f"{name}={value!r}" for name, value in self._static_fields().items())
    return f"{super().__repr__()[:-1]}, {static})"


@dataclasses.dataclass(frozen=True, eq=False)
class AdamAConfig:
  """The hyperparameters one AdamA transformation computes with.

  Made once by :func:`scale_by_adama`; its ``update`` closes over them, as
  optax keeps a transformation's hyperparameters, and the steps that fold
  micro-batches themselves (:func:`microbatch_step`, :func:`release_step`)
  read the same object from the transformation
  (``_adama.FoldingParts.config``), so both compute the same math from the
  same values. Not on the state: ``optax.inject_hyperparams`` passes ``b1``,
  ``b2``, ``eps``, ``eps_root`` and ``rounding_seed`` as arrays (traced
  under ``jit``), which static state data cannot hold. ``N`` and the
  estimator fix the state's structure: they are the state's
  (:class:`ScaleByAdamAState`), and only the state's. Compared by identity
  (``eq=False``): the array fields are not hashable.
  """

  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  stochastic_rounding: bool
  rounding_seed: Any
