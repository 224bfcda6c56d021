"""How v sees the micro-batch gradients: the default and the research estimators.

``"mean"`` (the default, the paper's) needs nothing beyond the fold. The
research estimators of :mod:`optax_adama.contrib` hook in here: ``"momentum"``
adds a term once per mini-batch, ``"split"`` folds each micro-batch's half
difference (the steps compute it only when the state asks: :func:`wants_halves`)
and keeps a factored floor. docs/estimators.md has the evidence.
"""

from __future__ import annotations

from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp

from optax_adama import _checks
from optax_adama import _floor
from optax_adama import _fold
from optax_adama._floor import FactoredSquares
from optax_adama._quantize import QuantizedArray
from optax_adama._state import AdamAConfig
from optax_adama._state import ScaleByAdamAState

# The estimators of v, by name (``nu_estimator=``); see scale_by_adama and
# docs/estimators.md. "auto" is "split" where the step hands over each
# micro-batch's half difference and "mean" where it cannot.
NU_ESTIMATORS = ("mean", "sum", "momentum", "split")
NU_ESTIMATOR_NAMES = ("auto",) + NU_ESTIMATORS
# The default: runs on every path and shape at no memory beyond m and v, and
# its v is never below Adam's in expectation (E = mu**2 + sigma**2), so no
# coordinate steps further than Adam's would. At Adam's learning rate it is
# the estimator nearest Adam almost everywhere it was measured: GPT-2 small on
# a GPU, 2,000 steps, -0.61% (N = 4) and +0.40% (N = 8) held-out against
# Adam + accumulation, where "momentum" was +0.29% and +4.44%
# (benchmarks/results/gpu/gpu_convergence.md; docs/estimators.md has the tiny models).
DEFAULT_NU_ESTIMATOR = "mean"


def check_estimator(nu_estimator: Any, split_floor: Any) -> None:
  """Raises for an ``nu_estimator`` that names none, or a non-bool ``split_floor``."""
  if nu_estimator not in NU_ESTIMATOR_NAMES:
    raise ValueError(
        f"nu_estimator must be one of {NU_ESTIMATOR_NAMES}, got {nu_estimator!r}.")
  if not isinstance(split_floor, bool):
    raise TypeError(f"split_floor must be True or False, got {split_floor!r}.")


def check_real_for_halves(params: Any, nu_estimator: str) -> None:
  """Raises a ``TypeError`` naming the complex leaves ``"split"`` would take:
  its halves' squared differences are real only."""
  complex_leaves = _checks.complex_leaf_names(params)
  if complex_leaves and nu_estimator in ("split", "auto"):
    raise TypeError(
        f"nu_estimator={nu_estimator!r} takes halves' squared differences, real "
        f"only; these leaves are complex: {', '.join(complex_leaves)}. "
        "Pass nu_estimator=\"mean\" (the default).")


def floor_increment(grad: jax.Array,
                    half_difference: Any,  # an array; callers' lists type it Optional
                    state: ScaleByAdamAState, config: AdamAConfig,
                    leaf_shape: tuple[int, ...]) -> FactoredSquares:
  """The floor's increment from one gradient leaf (or one layer's slice of one).

  The ``"sum"`` estimator's fold ``(1 - b2) / N**2 * g**2`` of the entries
  :func:`fold_leaf` folds (non-finite ones as zero), factored.
  """
  is_finite = jnp.isfinite(grad) & jnp.isfinite(half_difference)
  dtype = _fold.compute_dtype(jnp.dtype(grad.dtype))
  g = jnp.where(is_finite, grad, jnp.zeros_like(grad)).astype(dtype)
  weight = jnp.asarray(_fold.nu_weight(config.b2, state.num_micro_batches, "sum")).astype(dtype)
  return jax.tree.map(lambda x: x.astype(jnp.float32),
                      _floor.factor_squares(weight * g * g, leaf_shape))


def decayed_floor(state: ScaleByAdamAState, config: AdamAConfig) -> Any:
  """``state.nu_floor``, decayed by ``b2`` on a mini-batch's first micro-batch."""
  decay = jnp.where(state.micro_step == 0, jnp.asarray(config.b2), 1.0).astype(jnp.float32)
  return jax.tree.map(lambda x: decay * x, state.nu_floor)


def adds_momentum_after_fold(state: ScaleByAdamAState, per_layer_offload: bool) -> bool:
  """Whether a step that folds a whole mini-batch may fold ``"momentum"`` as
  ``"sum"`` and add its ``m_hat**2`` term once, after: float32 moments (the
  term then lands on the same unrounded v) that are whole on the device
  after the fold (not host-offloaded moments brought in a layer at a time)."""
  return (state.nu_estimator == "momentum" and state.num_micro_batches > 1
          and not per_layer_offload
          and all(not isinstance(x, QuantizedArray) and jnp.dtype(x.dtype) == jnp.float32
                  for x in jax.tree.leaves((state.mu, state.nu),
                                           is_leaf=lambda x: isinstance(x, QuantizedArray))))


def add_momentum_term(state: ScaleByAdamAState, config: AdamAConfig) -> ScaleByAdamAState:
  """``state`` after a mini-batch folded as ``"sum"``, with ``"momentum"``'s
  ``(1 - b2)(1 - 1/N) m_hat**2`` added to v: :func:`add_squared_momentum`
  on every leaf at once, outside the fold's layer scan (where, fused with
  the fold, XLA copied a whole layer stack's m: +0.68 P on GPT-2 small's
  release step)."""
  n = state.num_micro_batches
  # The same arithmetic as the fold's (b2 as given, b1 in float32): the
  # two ways then round alike.
  t = jnp.asarray(state.count).astype(jnp.float32)  # the completed mini-batch
  weight = (1 - config.b2) * (1 - 1 / n) / (
      1 - jnp.asarray(config.b1).astype(jnp.float32) ** t) ** 2
  weight = jnp.asarray(weight).astype(jnp.float32)
  nu = jax.tree.map(lambda m, v: v + weight * (m * m), state.mu, state.nu)
  return state._replace(nu=nu)


def takes_halves(state: ScaleByAdamAState) -> bool:
  """Whether ``update`` folds a half difference: "split" at ``N > 1`` (at
  ``N = 1`` the estimator is Adam's g**2 and needs none)."""
  return state.nu_estimator == "split" and state.num_micro_batches > 1


def wants_halves(state: ScaleByAdamAState) -> bool:
  """Whether a fused step should take each micro-batch's halves for ``state``:
  "split" (which needs them) or "auto" (which uses them where they exist)."""
  return state.nu_estimator in ("auto", "split") and state.num_micro_batches > 1


def with_estimator(state: Any, nu_estimator: str) -> Any:
  """``state`` (a :class:`ScaleByAdamAState`, or one of its shardings) with
  another static ``nu_estimator``; the leaves are shared, not copied."""
  return state._replace(nu_estimator=nu_estimator)


def resolve_estimator(state: ScaleByAdamAState, halves: bool) -> ScaleByAdamAState:
  """``state`` with "auto" read as the estimator this call computes.

  "auto" is "split" where the caller hands over each micro-batch's half
  difference (``halves``) and "mean" where it cannot; the other names stand.
  A step resolves once, folds and reads the direction from the resolved
  state, and hands back its state under the name it came with
  (:func:`with_estimator`), so the state's structure never changes.
  """
  if state.nu_estimator != "auto":
    return state
  split = halves and state.num_micro_batches > 1
  return with_estimator(state, "split" if split else "mean")


def half_differences(half_difference: Any,  # a pytree like the updates, or None
                     treedef: jax.tree_util.PyTreeDef,
                     state: ScaleByAdamAState) -> list[Optional[jax.Array]]:
  """The "split" estimator's half differences, one per leaf (``None``: unused)."""
  if not takes_halves(state):
    return [None] * treedef.num_leaves
  if half_difference is None:
    raise ValueError(
        "nu_estimator='split' needs update(..., half_difference=d) with "
        "d = (g_a - g_b) / 2, g_a and g_b the gradients of the micro-batch's two "
        "halves (and updates = (g_a + g_b) / 2); optax_adama.microbatch_step "
        "passes it.")
  return treedef.flatten_up_to(half_difference)


def floors_split(state: ScaleByAdamAState) -> bool:
  """Whether this call folds and reads "split"'s floor: "split" with a floor in
  the state (``split_floor=False`` keeps none)."""
  return takes_halves(state) and bool(jax.tree.leaves(state.nu_floor))


def leaf_floors(state: ScaleByAdamAState,
                treedef: jax.tree_util.PyTreeDef) -> list[Optional[FactoredSquares]]:
  """Per leaf of ``treedef``, the floor the direction reads (``None``: none)."""
  if not floors_split(state):
    return [None] * treedef.num_leaves
  return treedef.flatten_up_to(state.nu_floor)
