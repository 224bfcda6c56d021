"""How far AdamA's second moment is from Adam's, on your model and data.

AdamA cannot form the mini-batch mean gradient, so its v differs from Adam's
(docs/design.md, "The second-moment question"). Per coordinate, write
rho = v_estimator / v_adam: AdamA's step is Adam's times 1/sqrt(rho). rho is 1
where the mean gradient dominates and up to N (for ``"mean"``) where
micro-batch noise does, and it drifts as training goes on.
:func:`diagnose_second_moment` follows Adam's own path for a few mini-batches,
keeping what AdamA never keeps (the mean gradient), and measures rho for every
estimator of :func:`scale_by_adama`, so a user can pick one, and a learning
rate, before a long run.

rho's 5th percentile says nothing of the one coordinate in a hundred or a
thousand whose step runs furthest from Adam's, and rho leaves eps out, so the
diagnosis also records the step ratio |u_estimator| / |u_adam| of the actual
directions u = m_hat / (sqrt(v_hat) + eps), v_hat as AdamA reads it, up to
its 99.9th percentile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any
from typing import ClassVar
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adama import _floor
from optax_adama import _steps
from optax_adama._checks import check_num_micro_batches
from optax_adama._checks import complex_leaf_names
from optax_adama._estimators import DEFAULT_NU_ESTIMATOR
from optax_adama._estimators import NU_ESTIMATORS

__all__ = ["SecondMomentDiagnosis", "diagnose_second_moment"]

# The tails matter as much as the median: a coordinate with rho = 0.25 takes
# twice Adam's step, which is where training at Adam's rate goes unstable.
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
# The step ratio's upper tail: a requirement on "no coordinate runs away from
# Adam" is stated at the 99th and 99.9th percentile of coordinates.
STEP_QUANTILES = (0.5, 0.99, 0.999)
# Outside these median rhos the default's steps differ from Adam's by over
# 5%: the summary says so and what it means (docs/estimators.md). Below the
# floor they run longer than Adam's (the rate scaled by sqrt(rho) matches
# them); above the ceiling shorter, which "mean" (the default) can only be.
DEFAULT_RHO_FLOOR = 0.9
DEFAULT_RHO_CEILING = 1.1
# The estimators that need each micro-batch's halves, which only the fused
# steps (microbatch_step, release_step) take.
FUSED_ONLY = ("split",)


@dataclasses.dataclass(frozen=True)
class SecondMomentDiagnosis:
  """rho = v_estimator / v_adam along a path (Adam's or an estimator's), per mini-batch.

  Attributes:
    num_micro_batches: ``N``.
    rho: estimator name -> float array ``[steps, len(QUANTILES)]``: the 5th,
      25th, 50th, 75th and 95th percentile of rho over all coordinates after
      each mini-batch.
    losses: the mean loss of each mini-batch.
    step_ratio: estimator name -> float array ``[steps, len(STEP_QUANTILES)]``:
      the 50th, 99th and 99.9th percentile, over the coordinates where Adam's
      direction is nonzero, of |u_estimator| / |u_adam| after each mini-batch,
      with u = m_hat / (sqrt(v_hat) + eps) and v_hat as AdamA reads it
      (``"split"``'s at least ``m_hat**2``). Empty where the diagnosis was
      made without it.

  Made by :func:`diagnose_second_moment`, whose example shows one.
  """

  num_micro_batches: int
  rho: dict[str, np.ndarray]
  losses: np.ndarray
  step_ratio: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  QUANTILES: ClassVar[tuple[float, ...]] = QUANTILES  # the columns of each rho array
  STEP_QUANTILES: ClassVar[tuple[float, ...]] = STEP_QUANTILES  # ... of each step_ratio array

  def quantile(self, estimator: str, q: float = 0.5) -> float:
    """rho's ``q`` quantile (one of ``QUANTILES``) over coordinates, taken as
    its median over the second half of the run (rho drifts early on)."""
    if q not in QUANTILES:
      raise ValueError(f"q must be one of {QUANTILES}, got {q!r}.")
    per_step = self.rho[estimator][:, QUANTILES.index(q)]
    return float(np.median(per_step[len(per_step) // 2:]))

  def step_quantile(self, estimator: str, q: float = 0.5) -> float:
    """The step ratio |u_estimator| / |u_adam| at quantile ``q`` over coordinates.

    Taken, as :meth:`quantile` takes rho's, as its median over the second
    half of the run.

    Args:
      estimator: a key of ``step_ratio``.
      q: one of ``STEP_QUANTILES``.

    Returns:
      The ratio: 1.0 where the estimator steps as Adam does.

    Raises:
      ValueError: if ``q`` is not one of ``STEP_QUANTILES``.
      KeyError: if the diagnosis holds no step ratio of ``estimator``.
    """
    if q not in STEP_QUANTILES:
      raise ValueError(f"q must be one of {STEP_QUANTILES}, got {q!r}.")
    per_step = self.step_ratio[estimator][:, STEP_QUANTILES.index(q)]
    return float(np.median(per_step[len(per_step) // 2:]))

  def median(self, estimator: str) -> float:
    """Median rho over the coordinates and the second half of the run."""
    return self.quantile(estimator, 0.5)

  def suggested_estimator(self) -> str:
    """The estimator whose rho is closest to 1 (Adam's v), on a log scale."""
    return min(self.rho, key=lambda name: abs(np.log(self.median(name))))

  def summary(self, learning_rate: float | None = None) -> str:
    """What the measurement means, in sentences."""
    steps = len(self.losses)
    lines = [f"rho = v / v_adam after {steps} mini-batches of N = "
             f"{self.num_micro_batches} (median over coordinates, second half):"]
    for name in self.rho:
      rho = self.median(name)
      middle = QUANTILES.index(0.5)
      first, last = self.rho[name][0, middle], self.rho[name][-1, middle]
      low = self.quantile(name, QUANTILES[0])
      lines.append(
          f"  {name:>8}: rho {rho:.2f} (from {first:.2f} to {last:.2f}): steps "
          f"{1 / np.sqrt(rho):.2f}x Adam's; {1 / np.sqrt(low):.2f}x or more on "
          f"{QUANTILES[0]:.0%} of coordinates")
      if name in self.step_ratio:
        p50, p99, p999 = (self.step_quantile(name, q) for q in STEP_QUANTILES)
        lines.append(
            f"  {'':>8}  step |u| / |u_adam|: {p50:.2f}x (median), {p99:.2f}x "
            f"(99th percentile), {p999:.2f}x (99.9th) of coordinates")
    best = self.suggested_estimator()
    factor = np.sqrt(self.median(best))
    where = (" (in microbatch_step or release_step, which take each micro-batch's "
             "halves)") if best in FUSED_ONLY else ""
    lines.append(f"Suggested: nu_estimator={best!r}{where}.")
    if best != DEFAULT_NU_ESTIMATOR:
      lines.append(f"  A research estimator: optax_adama.contrib.adamaw(..., "
                   f"nu_estimator={best!r}) (or contrib.adama, contrib.scale_by_adama).")
    rescaled = abs(np.log(factor)) > np.log(1.05)
    if rescaled:
      rate = "" if learning_rate is None else f" ({learning_rate * factor:.3g})"
      lines.append(
          f"Its steps are {1 / factor:.2f}x Adam's: scale Adam's learning rate by "
          f"{factor:.2f}{rate} to match them, or expect training like Adam's at a "
          "learning rate that much smaller. rho drifts during training; measure "
          "again later in the run.")
    # A suggested default whose rate was just scaled: the default's line would
    # say the same again.
    default_line = None if rescaled and best == DEFAULT_NU_ESTIMATOR else self._default_line()
    return "\n".join(lines + ([default_line] if default_line else []))

  def _default_line(self) -> str | None:
    """What the default's rho means, where its steps differ from Adam's by over 5%."""
    default = DEFAULT_NU_ESTIMATOR
    if default not in self.rho:
      return None
    rho = self.median(default)
    if rho < DEFAULT_RHO_FLOOR:
      return (f"The default ({default!r}) keeps v at {rho:.2f}x Adam's, so its steps run "
              f"{1 / np.sqrt(rho):.2f}x Adam's: scale the learning rate by "
              f"{np.sqrt(rho):.2f}.")
    if rho <= DEFAULT_RHO_CEILING:
      return None
    line = (f"The default ({default!r}) keeps v at {rho:.2f}x Adam's, so its steps are "
            f"{1 / np.sqrt(rho):.2f}x Adam's at the median coordinate and no "
            "coordinate's runs longer than Adam's would: at Adam's rate it trains as Adam "
            "at a smaller rate. Where that trails Adam: the rate times "
            f"{np.sqrt(rho):.2f} gives Adam's median step")
    # Named only where it was measured here and tracks Adam's v.
    tracking = [name for name in FUSED_ONLY if name in self.rho
                and DEFAULT_RHO_FLOOR <= self.median(name) <= DEFAULT_RHO_CEILING]
    for name in tracking[:1]:
      line += (f", and nu_estimator={name!r} in microbatch_step or release_step keeps v at "
               f"{self.median(name):.2f}x Adam's here")
    return line + " (docs/estimators.md)."


def diagnose_second_moment(
    loss_fn: Callable[..., Any],
    params: optax.Params,
    batches: Iterable[Any],
    *,
    num_micro_batches: int,
    learning_rate: float = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    has_aux: bool = False,
    follow: str = "adam",
) -> SecondMomentDiagnosis:
  r"""Measures rho = v / v_Adam for every AdamA estimator along Adam's path (or AdamA's).

  For each mini-batch of ``batches`` (each split into ``N`` micro-batches as
  :func:`microbatch_step` splits it), computes the micro-batch gradients,
  takes one Adam step on their mean (so rho is measured where Adam would go),
  and updates, beside Adam's :math:`v`, the :math:`v` of each estimator of
  :func:`scale_by_adama` from the same gradients (``"split"`` from each
  micro-batch's two halves, where micro-batches have an even number of rows;
  left out otherwise). Beside rho it records the step ratio |u| / |u_adam| of
  each estimator's direction against Adam's (the same ``m_hat``, ``eps``
  included), whose upper tail is where a coordinate would outrun Adam. It
  holds the mean gradient and five second moments: a diagnostic, run it for
  tens to hundreds of mini-batches, not as the optimizer.

  Args:
    loss_fn: ``loss_fn(params, micro_batch)``, the micro-batch mean loss (or
      ``(loss, aux)`` with ``has_aux``).
    params: the initial params.
    batches: an iterable of mini-batches (pytrees with a leading batch axis).
    num_micro_batches: ``N``.
    learning_rate: Adam's learning rate along the path.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    follow: whose steps the path takes: ``"adam"`` (Adam's, the default) or an
      estimator's (AdamA's path with that ``nu_estimator``; ``"split"`` read as
      AdamA reads it, at least ``m_hat**2``). rho is always against Adam's v
      from the same gradients.

  Returns:
    A :class:`SecondMomentDiagnosis`; ``print(diagnosis.summary())``.

  Raises:
    ValueError: if ``batches`` is empty, or ``follow`` names no estimator.
    TypeError: if a param leaf is complex.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> keys = jax.random.split(jax.random.key(0), 20)
    >>> batches = [{"x": jax.random.normal(k, (32, 4)), "y": jnp.ones((32,))}
    ...            for k in keys]
    >>> d = optax_adama.diagnostics.diagnose_second_moment(
    ...     loss_fn, {"w": jnp.zeros(4)}, batches, num_micro_batches=4)
    >>> d.median("mean") > d.median("sum")
    True
  """
  num_micro_batches = check_num_micro_batches(num_micro_batches)
  complex_leaves = complex_leaf_names(params)
  if complex_leaves:  # its "split" and rho read real squares
    raise TypeError(f"diagnose_second_moment measures real params; these are complex: "
                    f"{', '.join(complex_leaves)}.")
  if follow not in ("adam",) + NU_ESTIMATORS:
    raise ValueError(f"follow must be 'adam' or one of {NU_ESTIMATORS}, got {follow!r}.")
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)
  step = jax.jit(lambda p, s, b: _adam_step_with_estimators(
      value_and_grad, has_aux, p, s, b, num_micro_batches,
      learning_rate, b1, b2, eps, follow))
  zeros = lambda: jax.tree.map(jnp.zeros_like, params)
  state = {"count": jnp.zeros([], jnp.int32), "m": zeros(), "adam": zeros(),
           **{name: zeros() for name in NU_ESTIMATORS}}
  losses = []
  rho: dict[str, list[Any]] = {name: [] for name in NU_ESTIMATORS}
  step_ratio: dict[str, list[Any]] = {name: [] for name in NU_ESTIMATORS}
  for batch in batches:
    params, state, loss, (rho_quantiles, step_quantiles) = step(params, state, batch)
    losses.append(float(loss))
    for name, values in rho_quantiles.items():
      rho[name].append(np.asarray(values))
    for name, values in step_quantiles.items():
      step_ratio[name].append(np.asarray(values))
  if not losses:
    raise ValueError("batches is empty: nothing to measure.")
  return SecondMomentDiagnosis(
      num_micro_batches=num_micro_batches,
      rho={name: np.stack(values) for name, values in rho.items() if values},
      losses=np.asarray(losses),
      step_ratio={name: np.stack(values) for name, values in step_ratio.items() if values})


# value_and_grad: (params, micro_batch) -> (loss or (loss, aux), grads); state:
# count, m and every second moment by name (diagnose_second_moment's dict).
def _adam_step_with_estimators(
    value_and_grad: Callable[[optax.Params, Any], tuple[Any, optax.Updates]], has_aux: bool,
    params: optax.Params, state: dict[str, Any], batch: Any, n: int, learning_rate: float,
    b1: float, b2: float, eps: float, follow: str = "adam",
) -> tuple[optax.Params, dict[str, Any], jax.Array,
           tuple[dict[str, jax.Array], dict[str, jax.Array]]]:
  micro_batches = _steps.split_micro_batches(batch, n)
  # "split" needs each micro-batch's two halves: measured where they exist.
  halves = jax.tree.leaves(micro_batches)[0].shape[1] % 2 == 0
  if follow == "split" and not halves:
    raise ValueError("follow='split' needs micro-batches of an even number of rows.")

  def loss_and_grads(params: optax.Params,
                     micro_batch: Any) -> tuple[jax.Array, None, optax.Updates]:
    out, grads = value_and_grad(params, micro_batch)
    return (out[0] if has_aux else out), None, grads

  def body(sums: tuple[optax.Updates, optax.Updates, Optional[optax.Updates]],
           micro_batch: Any) -> tuple[tuple[Any, Any, Any], jax.Array]:
    grad_sum, square_sum, split_sum = sums
    if halves:  # as microbatch_step takes them; g**2 - (1 - 1/N) d**2
      loss, _, grads, difference = _steps.loss_and_half_grads(loss_and_grads, params, micro_batch)
      split_sum = jax.tree.map(lambda s, g, d: s + g * g - (1 - 1 / n) * d * d,
                               split_sum, grads, difference)
    else:
      loss, _, grads = loss_and_grads(params, micro_batch)
    return (jax.tree.map(jnp.add, grad_sum, grads),
            jax.tree.map(lambda s, g: s + g * g, square_sum, grads), split_sum), loss

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grad_sum, square_sum, split_sum), losses = jax.lax.scan(  # no "split" sum: None
      body, (zeros, zeros, zeros if halves else None), micro_batches)
  mean = jax.tree.map(lambda s: s / n, grad_sum)
  mean_square = jax.tree.map(lambda s: s / n, square_sum)
  ema = lambda v, x: jax.tree.map(lambda a, b: b2 * a + (1 - b2) * b, v, x)
  count = state["count"] + 1
  t = count.astype(jnp.float32)
  m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, state["m"], mean)
  m_hat = jax.tree.map(lambda a: a / (1 - b1**t), m)
  adam = ema(state["adam"], jax.tree.map(jnp.square, mean))
  by_n = jax.tree.map(lambda x: x / n, mean_square)
  new_state = {
      "count": count, "m": m, "adam": adam,
      "mean": ema(state["mean"], mean_square),
      "sum": ema(state["sum"], by_n),
      "momentum": ema(state["momentum"], jax.tree.map(
          lambda x, mh: x + (1 - 1 / n) * mh * mh, by_n, m_hat)),
      "split": (ema(state["split"], jax.tree.map(lambda s: s / n, split_sum))
                if halves else state["split"]),
  }
  # "split"'s v as AdamA reads it (in raw-moment units; rho's bias
  # corrections cancel): v_hat floored at m_hat**2 and at its floor, the
  # "sum" EMA read factored (the floor AdamA keeps is exactly that EMA's row
  # and column sums). The stored EMA stays unfloored.
  floor = lambda x: _floor.floor_estimate(_floor.factor_squares(x, jnp.shape(x)))
  read = {**new_state, "split": jax.tree.map(
      lambda v, mh, s: jnp.maximum(jnp.maximum(v, (1 - b2**t) * mh * mh), floor(s)),
      new_state["split"], m_hat, new_state["sum"])}
  direction = lambda v: jax.tree.map(
      lambda mh, x: mh / (jnp.sqrt(x / (1 - b2**t)) + eps), m_hat, v)
  params = jax.tree.map(lambda p, u: p - learning_rate * u, params, direction(read[follow]))
  names = NU_ESTIMATORS if halves else tuple(e for e in NU_ESTIMATORS if e != "split")
  quantiles = (_rho_quantiles(read, names),
               _step_quantiles(direction(read["adam"]),
                               {name: direction(read[name]) for name in names}))
  return params, new_state, jnp.mean(losses), quantiles


def _rho_quantiles(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, jax.Array]:
  """Quantiles of v_estimator / v_adam over the coordinates where v_adam > 0."""
  adam = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(state["adam"])])
  positive = adam > 0
  out = {}
  for name in names:
    v = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(state[name])])
    ratio = jnp.where(positive, v / jnp.where(positive, adam, 1.0), jnp.nan)
    out[name] = _nanquantiles(ratio, QUANTILES)
  return out


def _step_quantiles(adam_direction: optax.Updates,
                    directions: dict[str, optax.Updates]) -> dict[str, jax.Array]:
  """Quantiles of |u_estimator| / |u_adam| over the coordinates where u_adam != 0."""
  flat = lambda tree: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])
  adam = jnp.abs(flat(adam_direction))
  moving = adam > 0
  out = {}
  for name, direction in directions.items():
    ratio = jnp.where(moving, jnp.abs(flat(direction)) / jnp.where(moving, adam, 1.0),
                      jnp.nan)
    out[name] = _nanquantiles(ratio, STEP_QUANTILES)
  return out


def _nanquantiles(x: jax.Array, qs: tuple[float, ...]) -> jax.Array:
  """``jnp.nanquantile(x, qs)`` (linear interpolation) of a 1-D float array.

  By bisection on the floats' bit patterns, not by sorting: XLA's sort of a
  few hundred thousand floats on a CPU takes longer than the tiny models'
  whole step, and this diagnostic takes eight quantile sets a step. The
  order statistics are exact; the interpolation between them may round
  differently from jnp.nanquantile's in the last bit.

  Args:
    x: a 1-D float array; NaNs are left out.
    qs: the quantiles, in [0, 1].

  Returns:
    A float32 (float64 for float64 ``x``) array ``[len(qs)]``; NaN where
    every entry of ``x`` is NaN.
  """
  dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  int_dtype, bits = (jnp.int64, 64) if dtype == jnp.float64 else (jnp.int32, 32)
  top = jnp.asarray(jnp.iinfo(int_dtype).max, int_dtype)
  x = x.astype(dtype)
  valid = ~jnp.isnan(x)
  # Integers that order as the floats do (negatives' magnitude bits
  # reflected), NaNs last. -0.0 sorts just below +0.0: equal values anyway.
  raw = jax.lax.bitcast_convert_type(x, int_dtype)
  key = jnp.where(valid, jnp.where(raw < 0, raw ^ top, raw), top)
  count = jnp.sum(valid, dtype=dtype)
  # jnp.nanquantile's positions and weights.
  position = jnp.asarray(qs, dtype) * (count - 1)
  low, high = jnp.floor(position), jnp.ceil(position)
  high_weight = position - low
  rank = jnp.clip(low, 0, jnp.maximum(count - 1, 0)).astype(int_dtype)

  def halve(_: jax.Array,  # the smallest key with more than `rank` keys at or below it
            bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (lo + hi) // 2 without overflow
    enough = jnp.sum(key[None, :] <= mid[:, None], axis=1, dtype=int_dtype) > rank
    return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

  start = (jnp.full(rank.shape, jnp.iinfo(int_dtype).min, int_dtype),
           jnp.full(rank.shape, top - 1, int_dtype))
  low_key, _ = jax.lax.fori_loop(0, bits, halve, start)
  # The next order statistic: the same value where it repeats, else the
  # smallest key above it.
  repeats = jnp.sum(key[None, :] <= low_key[:, None], axis=1, dtype=int_dtype) > rank + 1
  above = jnp.min(jnp.where(key[None, :] > low_key[:, None], key[None, :], top), axis=1)
  high_key = jnp.where(repeats | (high == low), low_key, above)
  value = lambda k: jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ top, k), dtype)
  out = value(low_key) * (1 - high_weight) + value(high_key) * high_weight
  return jnp.where(count > 0, out, jnp.nan)
