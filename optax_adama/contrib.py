"""Research for AdamA: estimators of v, and narrow params. Useful, not settled.

The main transforms (:func:`optax_adama.adama`, :func:`~optax_adama.adamaw`,
:func:`~optax_adama.scale_by_adama`) fold the paper's estimator of v,
``"mean"``: each micro-batch adds :math:`(1-\\beta_2)/N\\, g_i^2`, so
:math:`E[v] = \\mu^2 + \\sigma^2` (:math:`\\mu` the mean gradient, :math:`\\sigma^2`
one micro-batch's gradient variance), larger than Adam's
:math:`\\mu^2 + \\sigma^2/N`, and steps are never larger than Adam's. At scale it
is nearest Adam (GPT-2 small, 2,000 steps at Adam's rate against Adam +
accumulation: -0.61% at N = 4, +0.40% at N = 8). The estimators here were each
closer somewhere and further elsewhere (docs/estimators.md has the evidence);
as optax keeps its own such work in ``optax.contrib``, they live here until
one beats ``"mean"`` at scale.

``nu_estimator`` (each is exactly Adam at ``N = 1``, none costs memory beyond
m and v but ``"split"``'s floor):

* ``"mean"``: the default, the paper's.
* ``"sum"``: :math:`g_i^2/N^2`, :math:`E = (\\mu^2 + \\sigma^2)/N`: a PyTorch loop
  dividing each micro-batch loss by N.
* ``"momentum"``: ``"sum"`` plus :math:`(1-\\beta_2)(1-1/N)\\hat m^2` once per
  mini-batch; :math:`E \\approx` Adam's where the mean gradient is steady over
  m's ~10 steps, short where it is not (steps then run long).
* ``"split"``: each micro-batch's gradient as the mean :math:`g_i` and half
  difference :math:`d_i = (g_a - g_b)/2` of its two halves' gradients (one
  vmapped backward), folding :math:`(g_i^2 - (1-1/N) d_i^2)/N`, unbiased for
  Adam's :math:`E[\\bar g^2]`. This v can dip below zero where noise
  dominates, so :math:`\\hat v` is read as at least :math:`\\hat m^2` and, with
  ``split_floor=True``, at least a floor: an EMA of the ``"sum"`` fold kept
  factored as Adafactor keeps its second moment (row and column sums, 0.26% of
  P on GPT-2 small). Needs ``update(g_i, state, half_difference=d_i)``, which
  :func:`optax_adama.microbatch_step` and :func:`optax_adama.release_step`
  pass; the halves' backward is paid only here.
* ``"auto"``: ``"split"`` where the step hands over a half difference (fused
  steps, micro-batches of an even number of rows), ``"mean"`` where none comes.

:func:`clip_by_sketched_global_norm` clips the mini-batch gradient's global
norm without a gradient buffer, from a 2^16-float sketch, one mini-batch late
(benchmarks/results/convergence/clipping.md has the evidence, and what it misses).

:func:`round_params_stochastically` keeps bfloat16 params training where
round-to-nearest would drop small updates (half the params' bytes, for the
devices' share of a model; evidence on the tiny GPT only, so here too).

Examples:
  >>> import jax.numpy as jnp, optax_adama
  >>> from optax_adama import contrib
  >>> tx = contrib.adama(1e-3, num_micro_batches=4, nu_estimator="momentum")
  >>> optax_adama.find_adama_state(tx.init({"w": jnp.ones(2)})).nu_estimator
  'momentum'
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_adama import _adama
from optax_adama import _chain
from optax_adama import _checks
from optax_adama import _estimators
from optax_adama._clipping import SketchedClipState
from optax_adama._clipping import clip_by_sketched_global_norm
from optax_adama._estimators import NU_ESTIMATORS
from optax_adama._floor import zero_floor
from optax_adama._param_rounding import RoundParamsStochasticallyState
from optax_adama._param_rounding import round_params_stochastically

__all__ = ("NU_ESTIMATORS", "adama", "adamaw", "scale_by_adama", "round_params_stochastically",
           "RoundParamsStochasticallyState", "clip_by_sketched_global_norm",
           "SketchedClipState")


def _with_estimator(tx: optax.GradientTransformation, nu_estimator: str,
             split_floor: bool) -> optax.GradientTransformation:
  """``tx``, made by a main factory, with ``init`` making a state that folds
  ``nu_estimator``.

  The estimator is the state's static configuration (with ``"split"``'s
  floor, a leaf of it): ``update`` and the fused steps read it from there,
  so ``tx``'s ``update`` and what the fused steps fold by
  (:class:`_adama.FoldingParts`) serve every estimator unchanged.
  """
  _estimators.check_estimator(nu_estimator, split_floor)

  def init_fn(params: optax.Params) -> optax.OptState:
    state = tx.init(params)
    _estimators.check_real_for_halves(params, nu_estimator)
    adama_state = _chain.adama_of(state)
    floors = (split_floor and nu_estimator in ("auto", "split")
              and adama_state.num_micro_batches > 1)
    adama_state = adama_state._replace(
        nu_estimator=nu_estimator,
        nu_floor=jax.tree.map(lambda p: zero_floor(jnp.shape(p)), params) if floors else ())
    return _chain.with_adama(state, adama_state, _chain.inner_of(state))

  return _adama.FoldingTransformation(init_fn, tx.update, _adama.folding_parts(tx))


@_checks.takes_arguments_of(_adama.scale_by_adama)
def scale_by_adama(*, nu_estimator: str, split_floor: bool = True,
                   **main_arguments: Any) -> optax.GradientTransformation:
  """:func:`optax_adama.scale_by_adama` with a research estimator of v.

  Args:
    b1, b2, eps, eps_root, mu_dtype, num_micro_batches, nesterov, nu_dtype,
      quantization, stochastic_rounding, rounding_seed: as in
      :func:`optax_adama.scale_by_adama`.
    nu_estimator: ``"mean"``, ``"sum"``, ``"momentum"``, ``"split"`` or
      ``"auto"`` (this module's docstring says what each folds).
    split_floor: whether ``"split"`` (and ``"auto"`` where it reads
      ``"split"``) keeps its factored floor in the state and reads
      :math:`\\hat v` as at least it. ``False`` keeps none: closer to Adam on
      short runs, with steps up to 59x Adam's on 0.1% of coordinates
      (docs/estimators.md).

  Returns:
    A :class:`optax.GradientTransformation` with state
    :class:`optax_adama.ScaleByAdamAState`.

  Raises:
    ValueError: if ``nu_estimator`` names no estimator, or (at ``update``)
      ``"split"`` gets no ``half_difference`` at ``N > 1``; and as
      :func:`optax_adama.scale_by_adama` raises.
    TypeError: if ``split_floor`` is not a bool, or (at ``init``) a leaf is
      complex under ``"split"`` / ``"auto"``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_adama import contrib
    >>> tx = contrib.scale_by_adama(num_micro_batches=2, nu_estimator="sum")
    >>> tx.init({"w": jnp.ones(3)}).nu_estimator
    'sum'
  """
  return _with_estimator(_adama.scale_by_adama(**main_arguments), nu_estimator, split_floor)


@_checks.takes_arguments_of(_chain.adama)
def adama(*, nu_estimator: str, split_floor: bool = True,
          **main_arguments: Any) -> optax.GradientTransformation:
  """:func:`optax_adama.adama` with a research estimator of v.

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype,
      num_micro_batches, nesterov, nu_dtype, quantization, stochastic_rounding:
      as in :func:`optax_adama.adama`.
    nu_estimator, split_floor: as in :func:`scale_by_adama`.

  Returns:
    A :class:`optax.GradientTransformation` with state
    :class:`optax_adama.MiniBatchChainState`.

  Raises:
    As :func:`scale_by_adama` and :func:`optax_adama.adama` raise.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_adama import contrib
    >>> tx = contrib.adama(1e-3, num_micro_batches=2, nu_estimator="sum")
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> for _ in range(2):  # one mini-batch of equal gradients: v_hat = g**2 / N
    ...   u, state = tx.update({"w": jnp.ones(2)}, state)
    >>> print(u["w"].round(6))  # -1e-3 * 1 / sqrt(1 / 2)
    [-0.001414 -0.001414]
  """
  return _with_estimator(_chain.adama(**main_arguments), nu_estimator, split_floor)


@_checks.takes_arguments_of(_chain.adamaw)
def adamaw(*, nu_estimator: str, split_floor: bool = True,
           **main_arguments: Any) -> optax.GradientTransformation:
  """:func:`optax_adama.adamaw` with a research estimator of v.

  Args:
    nu_estimator, split_floor: as in :func:`scale_by_adama`; the other
      arguments (``learning_rate`` to ``mask``, ``num_micro_batches`` and
      the rest) as in :func:`optax_adama.adamaw`, in its order.

  Returns:
    :func:`optax_adama.adamaw`'s transformation, whose ``init`` makes a
    :class:`optax_adama.MiniBatchChainState` folding ``nu_estimator`` (with
    ``"split"``'s floor where it keeps one).

  Raises:
    As :func:`optax_adama.adamaw` and :func:`scale_by_adama` raise.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_adama import contrib
    >>> tx = contrib.adamaw(1e-3, weight_decay=0.1, num_micro_batches=4, nu_estimator="split")
    >>> state = tx.init({"w": jnp.ones((4, 4))})
    >>> state.adama.nu_estimator, type(state.adama.nu_floor["w"]).__name__
    ('split', 'FactoredSquares')
  """
  return _with_estimator(_chain.adamaw(**main_arguments), nu_estimator, split_floor)
