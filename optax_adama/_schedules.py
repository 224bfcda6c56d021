"""Schedules that count mini-batches, and `optax.inject_hyperparams` for AdamA.

`adama(schedule)` evaluates its schedule at the mini-batch count. Flax loops
that log or change the learning rate build the optimizer through
`optax.inject_hyperparams`, which evaluates a schedule itself, once per
`update` call: with AdamA, once per micro-batch. `mini_batch_schedule` is a
stateful schedule (the protocol `optax.inject_hyperparams` accepts) that
counts calls and divides by N; `inject_hyperparams` applies it to every
scheduled hyperparameter, so a user writes N once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Optional

import chex
import jax
import jax.numpy as jnp
import optax

from optax_adama import _adama
from optax_adama._checks import check_num_micro_batches

__all__ = ["MiniBatchScheduleState", "mini_batch_schedule", "inject_hyperparams"]

_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)

# Arguments of adama / adamaw that are never hyperparameters to inject: N
# fixes the state's structure, and dtypes and masks are callables that
# optax.inject_hyperparams would otherwise take for schedules.
_ALWAYS_STATIC = ("num_micro_batches", "mu_dtype", "nu_dtype", "quantization", "mask")


class MiniBatchScheduleState(NamedTuple):
  """State of :func:`mini_batch_schedule`: the ``update`` calls it has seen.

  Examples:
    >>> import optax, optax_adama
    >>> schedule = optax_adama.mini_batch_schedule(optax.constant_schedule(0.1), 2)
    >>> schedule.init()
    MiniBatchScheduleState(count=Array(0, dtype=int32))
  """

  count: chex.Array  # int32 []: update calls so far (micro-batches).


@dataclasses.dataclass(frozen=True)
class _MiniBatchSchedule:
  """A stateful schedule evaluated at ``calls // num_micro_batches``."""

  schedule: optax.Schedule
  num_micro_batches: int

  def init(self) -> MiniBatchScheduleState:
    return MiniBatchScheduleState(count=jnp.zeros([], jnp.int32))

  def update(self, state: MiniBatchScheduleState, **extra_args: Any) -> MiniBatchScheduleState:
    del extra_args
    return MiniBatchScheduleState(count=optax.safe_increment(state.count))

  def __call__(self, state: MiniBatchScheduleState, **extra_args: Any) -> jax.Array:
    del extra_args
    return self.schedule(state.count // self.num_micro_batches)


def mini_batch_schedule(
    schedule: optax.Schedule, num_micro_batches: int
) -> optax.schedules.StatefulSchedule:
  """``schedule`` counted in mini-batches, for ``optax.inject_hyperparams``.

  ``optax.inject_hyperparams`` advances a schedule on every ``update`` call,
  one per micro-batch with AdamA. This stateful schedule counts those calls
  and evaluates ``schedule(calls // num_micro_batches)``: on the call that
  completes mini-batch ``t`` (counting from 0) it gives ``schedule(t)``, as
  ``adama(schedule)`` does. Every mini-batch counts, dropped ones included.

  Args:
    schedule: a schedule of the mini-batch count.
    num_micro_batches: ``N``, the ``update`` calls per mini-batch.

  Returns:
    A :class:`optax.schedules.StatefulSchedule`.

  Raises:
    TypeError: if ``schedule`` is not callable or ``num_micro_batches`` is not
      an integer.
    ValueError: if ``num_micro_batches < 1``.

  Examples:
    >>> import optax, optax_adama
    >>> schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
    >>> tx = optax.inject_hyperparams(
    ...     optax_adama.adama, static_args=("num_micro_batches",))(
    ...     learning_rate=optax_adama.mini_batch_schedule(schedule, 2),
    ...     num_micro_batches=2)
  """
  if not callable(schedule):
    raise TypeError(f"schedule must be callable, got {schedule!r}.")
  return _MiniBatchSchedule(schedule, check_num_micro_batches(num_micro_batches))


def inject_hyperparams(
    inner_factory: Callable[..., optax.GradientTransformation],
    static_args: str | tuple[str, ...] = (),
    hyperparam_dtype: Optional[jnp.dtype] = None,
) -> Callable[..., optax.GradientTransformation]:
  """``optax.inject_hyperparams`` for AdamA factories: schedules count mini-batches.

  The same wrapper and the same state as ``optax.inject_hyperparams`` (read
  or set ``state.hyperparams["learning_rate"]``), with two differences made
  for AdamA: every callable hyperparameter is wrapped in
  :func:`mini_batch_schedule`, and ``num_micro_batches``, the moment dtypes,
  ``quantization`` and ``mask`` are always static. After the call that
  completes mini-batch ``t``, ``state.hyperparams["learning_rate"]`` holds
  the rate that mini-batch's update used, ``schedule(t)``.

  Args:
    inner_factory: :func:`adama`, :func:`adamaw` or another factory taking
      ``num_micro_batches``.
    static_args: further arguments to keep static, as in optax.
    hyperparam_dtype: as in ``optax.inject_hyperparams``.

  Returns:
    A factory with ``inner_factory``'s signature.

  Raises:
    TypeError: if ``inner_factory`` takes no ``num_micro_batches``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_adama
    >>> schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
    >>> tx = optax_adama.inject_hyperparams(optax_adama.adamaw)(
    ...     learning_rate=schedule, num_micro_batches=2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for _ in range(4):  # two mini-batches
    ...   _, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> print(round(float(state.hyperparams["learning_rate"]), 4))  # mini-batch 1's
    0.9
  """
  signature = inspect.signature(inner_factory)
  if "num_micro_batches" not in signature.parameters:
    raise TypeError(
        f"{getattr(inner_factory, '__name__', inner_factory)!r} takes no "
        "num_micro_batches; use optax.inject_hyperparams for it.")
  static = {static_args} if isinstance(static_args, str) else set(static_args)
  static |= set(_ALWAYS_STATIC) & set(signature.parameters)
  injected = optax.inject_hyperparams(
      inner_factory, static_args=tuple(sorted(static)),
      hyperparam_dtype=hyperparam_dtype)

  @functools.wraps(inner_factory)
  def factory(*args: Any, **kwargs: Any) -> optax.GradientTransformation:
    bound = signature.bind(*args, **kwargs)
    num_micro_batches = check_num_micro_batches(
        bound.arguments.get("num_micro_batches"))
    for name, value in bound.arguments.items():
      if (name not in static and callable(value)
          and not isinstance(value, optax.schedules.StatefulSchedule)):
        bound.arguments[name] = mini_batch_schedule(value, num_micro_batches)
    return injected(*bound.args, **bound.kwargs)

  return factory


def check_schedules_count_mini_batches(opt_state: Any) -> None:
  """Raises if an ``optax.inject_hyperparams`` around AdamA counts micro-batches.

  ``optax.inject_hyperparams(adama, static_args=("num_micro_batches",))``
  with a plain schedule evaluates it once per ``update`` call, one per
  micro-batch. Its state says so: the schedule's state is optax's call
  counter, not a :class:`MiniBatchScheduleState`. The fused steps run this
  on the state they are given while tracing, before any buffer is donated.
  """
  is_inject = lambda x: isinstance(x, _INJECT_STATES)
  for state in jax.tree.leaves(opt_state, is_leaf=is_inject):
    if not is_inject(state) or _adama.find_adama_state(state.inner_state) is None:
      continue
    counting = sorted(name for name, s in getattr(state, "hyperparams_states", {}).items()
                      if not isinstance(s, MiniBatchScheduleState))
    if counting:
      raise ValueError(
          f"optax.inject_hyperparams evaluates the schedule of {counting} once per "
          "update call, i.e. per micro-batch; AdamA's schedules count mini-batches. "
          "Use optax_adama.inject_hyperparams(...) instead (the same state), or pass "
          "the schedule as optax_adama.mini_batch_schedule(schedule, num_micro_batches).")
