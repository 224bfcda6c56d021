"""Flax NNX: the fused, buffer-donating AdamA step for an ``nnx.Module``.

:class:`MicroBatchOptimizer` is :func:`optax_adama.microbatch_step` with
``nnx.Optimizer``'s ergonomics: made from a model, a transformation and a
``wrt`` filter, it trains the model in place, one call of
``update(model, loss_fn, batch)`` per mini-batch of ``N`` micro-batches, and
keeps the model's dropout streams and batch statistics right across them.
See ``docs/nnx.md``.

Flax is an optional dependency (``pip install 'flax>=0.12.2'``, the ``[flax]`` extra):
``import optax_adama`` never imports it, and this module imports it on first
use of :class:`MicroBatchOptimizer` (a subclass of ``nnx.Pytree``, so the
class itself is made then).
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable
from collections.abc import Hashable
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from optax_adama import _microbatch

__all__ = ("MicroBatchOptimizer",)  # noqa: F822 (made on first use: __getattr__ below)

Batch = Any
Metrics = dict[str, Any]
Filter = Any  # a flax.nnx filter: a Variable type, a path string, a predicate...

_INSTALL = "pip install 'flax>=0.12.2' (the [flax] extra: pip install -e '.[flax]' in a clone)"


def _flax_is_installed() -> bool:
  try:
    return importlib.util.find_spec("flax") is not None
  except (ImportError, ValueError):  # `sys.modules["flax"] = None`: imports of it blocked
    return False


# Fail at `import optax_adama.nnx`, not at first use, when Flax is missing; the
# check finds Flax without importing it.
if not _flax_is_installed():
  raise ImportError(f"optax_adama.nnx needs Flax: {_INSTALL}")


def _nnx() -> types.ModuleType:
  """``flax.nnx``, imported on first use: importing this module stays cheap."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return nnx


class _MicroBatchOptimizer:
  """Trains an ``nnx.Module`` with one fused, donating step per mini-batch.

  ``nnx.Optimizer`` for :func:`optax_adama.microbatch_step`. Like
  ``nnx.Optimizer`` it is an ``nnx.Pytree`` holding ``step`` (an
  ``nnx.OptState`` counting mini-batches), ``opt_state`` (the transformation's
  state, each leaf an ``nnx.OptArray``), ``tx`` and ``wrt``, but not the
  model: ``update(model, loss_fn, batch)`` splits ``batch`` into ``N``
  micro-batches, folds each micro-batch's gradient of ``loss_fn`` with respect
  to the ``wrt`` Variables into AdamA's moments (one jitted call), and writes
  the new params, statistics and RNG counts back into ``model`` in place.
  Checkpoint it as ``nnx.Optimizer``: ``nnx.state(opt)`` is a pytree of arrays
  that orbax saves, and ``nnx.update(opt, restored)`` puts one back.

  The model's other state is handled per micro-batch:

  * **RNG streams** (``nnx.Rngs``, e.g. ``nnx.Dropout``'s): each micro-batch
    (each half, under AdamA's ``"split"`` estimator) draws from its own key,
    the stream's key folded with its count and with the micro-batch's first
    row index, so no two draw the same masks; each stream's count advances by
    one per step, so the next step draws new ones.
  * **Running statistics** (``mutable``, ``nnx.BatchStat`` by default: e.g.
    ``nnx.BatchNorm`` in training mode): every micro-batch starts from the
    statistics the step started with, and the model gets the mean of the
    micro-batches' updated statistics, one update per mini-batch (micro-batches
    whose loss is not finite left out). They must be floating point.
  * Anything else the loss changes (an integer counter, a frozen param) would
    be lost: the first call raises instead, naming the Variable.

  ``params`` and the optimizer state are donated to the step and replaced in
  ``model`` and here by the step's outputs: an array taken out of a Variable
  before the call (``w = model.linear.kernel[...]``) is deleted by it, while
  the Variables themselves always hold live arrays.

  Args:
    model: the ``flax.nnx.Module`` to train; only its ``wrt`` Variables'
      shapes are read here, to make the optimizer state.
    tx: an optax transformation, normally AdamA (``optax_adama.adamaw``,
      ``optax_adama.adama``, ...), whose state sets ``N``; any other (e.g.
      ``optax.adamw``) accumulates gradients over ``num_micro_batches``.
    wrt: the ``nnx`` filter of the Variables to train, as
      ``nnx.Optimizer``'s (``nnx.Param``); the others stay fixed.
    mutable: the ``nnx`` filter of the floating-point state the loss updates
      in place, averaged over micro-batches; ``None`` is ``nnx.BatchStat``.
    num_micro_batches: ``N``, for a ``tx`` that holds no AdamA state; with
      AdamA leave it out (given, it must agree).

  Raises:
    TypeError: if ``model`` is not an ``nnx.Module`` or ``tx`` not an optax
      ``GradientTransformation``.
    ValueError: if ``wrt`` selects none of the model's Variables.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> from flax import nnx
    >>> from optax_adama.nnx import MicroBatchOptimizer
    >>> model = nnx.Sequential(
    ...     nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Dropout(0.1, rngs=nnx.Rngs(1)),
    ...     nnx.Linear(8, 1, rngs=nnx.Rngs(2)))
    >>> tx = optax_adama.adamaw(1e-2, num_micro_batches=4)
    >>> opt = MicroBatchOptimizer(model, tx, wrt=nnx.Param)
    >>> def loss_fn(model, micro_batch):  # the mean loss of one micro-batch
    ...   return jnp.mean((model(micro_batch["x"]) - micro_batch["y"]) ** 2)
    >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 1))}
    >>> for _ in range(2):
    ...   metrics = opt.update(model, loss_fn, batch)  # 4 micro-batches of 4
    >>> int(opt.step[...]), int(metrics["num_dropped"])
    (2, 0)
  """

  def __init__(
      self,
      model: Any,
      tx: optax.GradientTransformation,
      *,
      wrt: Filter,
      mutable: Optional[Filter] = None,
      num_micro_batches: Optional[int] = None,
  ) -> None:
    nnx = _nnx()
    _check_module(model, "MicroBatchOptimizer")
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(
          "MicroBatchOptimizer needs an optax.GradientTransformation as tx, e.g. "
          f"optax_adama.adamaw(1e-3, num_micro_batches=4); got {type(tx).__name__}.")
    params = _pure(nnx.state(model, wrt))
    if not jax.tree.leaves(params):
      raise ValueError(
          f"wrt={wrt!r} selects none of the model's Variables: nothing to train. "
          "Pass the filter nnx.Optimizer takes, e.g. wrt=nnx.Param.")
    self.step = nnx.OptState(jnp.array(0, dtype=jnp.uint32))
    self.tx = tx
    self.opt_state = nnx.data(jax.tree.map(nnx.OptArray, tx.init(params)))
    self.wrt = wrt
    self.mutable = nnx.BatchStat if mutable is None else mutable
    self.num_micro_batches = num_micro_batches
    self._params_structure = jax.tree.structure(params)
    self._steps = _StepCache()

  def update(self, model: Any, loss_fn: Callable[..., Any], batch: Batch, *args: Any,
             has_aux: bool = False, rngs: Any = None) -> Metrics:
    """Trains ``model`` on one mini-batch: ``N`` micro-batches, one update.

    The step is compiled once per ``(loss_fn, has_aux)``, model structure
    (``model.train()`` and ``model.eval()`` are two) and ``rngs`` structure,
    then reused: pass the same ``loss_fn`` object every call, not a new lambda.

    Args:
      model: the model this optimizer was made for; updated in place.
      loss_fn: ``loss_fn(model, micro_batch, *args)`` returning the
        micro-batch's *mean* loss, or ``(loss, aux)`` with ``has_aux``; with
        ``rngs``, ``loss_fn(model, micro_batch, *args, micro_batch_rngs)``.
      batch: a pytree of arrays with a leading batch axis that ``N`` divides.
        Micro-batch ``i`` holds rows ``i, i + N, ...``, as in
        :func:`optax_adama.microbatch_step`.
      *args: pytrees of arrays (or Python scalars) handed to every
        micro-batch's loss as they are, e.g. a temperature; not ``nnx``
        objects (an ``nnx.Rngs`` goes in ``rngs``).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; the aux must be
        floating point under AdamA's ``"split"`` estimator, which averages
        the two halves'.
      rngs: an ``nnx.Rngs`` outside the model, for a loss that takes its
        random streams as an argument (Flax's ``grad_fn(model, rngs.fork())``).
        Each micro-batch (each half, under ``"split"``) gets an ``nnx.Rngs``
        of its own, passed last: every stream's key is ``fold_in(fold_in(key,
        count), first_row)`` (``first_row`` the micro-batch's first row index
        in ``batch``, so ``i`` for micro-batch ``i``) and its count starts at
        0. ``rngs``'s counts then advance by one, so the next step draws anew.

    Returns:
      :func:`optax_adama.microbatch_step`'s metrics: ``"loss"`` (the mean of
      the finite micro-batch losses), ``"num_nonfinite_losses"``,
      ``"num_dropped"``, and with ``has_aux`` ``"aux"``, each micro-batch's
      aux stacked.

    Raises:
      TypeError: if ``model`` is not an ``nnx.Module``, ``rngs`` not an
        ``nnx.Rngs``, or one of ``args`` an ``nnx`` object.
      ValueError: if ``model``'s ``wrt`` Variables are not the ones this
        optimizer was made for, if ``mutable`` selects state that is not
        floating point, if two Variables hold the same array, or at the first
        call of a ``loss_fn``: if ``N`` does not divide the batch (or, with
        ``"split"``, the micro-batch is odd), or if ``loss_fn`` changes a
        Variable outside ``wrt`` and ``mutable``.
    """
    nnx = _nnx()
    _check_module(model, "MicroBatchOptimizer.update")
    _check_loss_args(args, rngs)
    rngs_graphdef, rngs_state = (None, None) if rngs is None else nnx.split(rngs)
    rngs_state = _pure(rngs_state)
    graphdef, params, stats, counts, rest = nnx.split(
        model, self.wrt, self._stats_filter(), nnx.RngCount, ...)
    params, stats, counts, rest = map(_pure, (params, stats, counts, rest))
    if jax.tree.structure(params) != self._params_structure:
      raise ValueError(
          "model's wrt Variables are not those this optimizer was made for: "
          "make one MicroBatchOptimizer per model.")
    _check_floating(stats, self.mutable)
    opt_state = _pure(self.opt_state)
    _check_distinct_buffers(params=params, opt_state=opt_state, stats=stats,
                            counts=counts, rest=rest)
    step = self._steps.get(
        (graphdef, loss_fn, has_aux, rngs_graphdef),
        lambda: self._build(graphdef, loss_fn, has_aux, rngs_graphdef))
    params, opt_state, stats, counts, count, metrics = step(
        params, opt_state, stats, counts, rest, self.step.get_value(), batch, args, rngs_state)
    # The donated buffers are gone: every Variable that held one gets its
    # successor before anything can read it.
    nnx.update(model, params, stats, counts)
    if rngs is not None:
      _advance_counts(rngs)
    for variable, value in zip(_variables(self.opt_state), jax.tree.leaves(opt_state)):
      variable.set_value(value)
    self.step.set_value(count)
    return metrics

  def _stats_filter(self) -> Filter:
    """``mutable`` less what ``wrt`` trains and the RNG state the step owns."""
    nnx = _nnx()
    return nnx.All(self.mutable, nnx.Not(self.wrt), nnx.Not(nnx.RngState))

  # graphdef / rngs_graphdef: nnx.GraphDef (Any: Flax is imported on first use only).
  def _build(self, graphdef: Any, loss_fn: Callable[..., Any], has_aux: bool,
             rngs_graphdef: Optional[Any]) -> jax.stages.Wrapped:
    """The jitted ``(params, opt_state, stats, counts, rest, step, batch, args,
    rngs_state)`` step."""
    nnx = _nnx()
    tx, num_micro_batches = self.tx, self.num_micro_batches
    stats_filter = self._stats_filter()
    fixed = nnx.All(nnx.Not(self.wrt), nnx.Not(stats_filter), nnx.Not(nnx.RngState))

    # stats, counts, rest, rngs_state: pure nnx.State trees of arrays.
    def step(params: optax.Params, opt_state: optax.OptState, stats: Any, counts: Any,
             rest: Any, count: jax.Array, batch: Batch, args: tuple[Any, ...],
             rngs_state: Any) -> tuple[optax.Params, optax.OptState, Any, Any, jax.Array,
                                       Metrics]:
      # -> (loss, (aux, the mutable state after the loss, loss)).
      def micro_batch_loss(params: optax.Params, rows_and_micro_batch: tuple[jax.Array, Batch],
                           ) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
        rows, micro_batch = rows_and_micro_batch
        model = nnx.merge(graphdef, params, stats, counts, rest)
        _seed_streams(model, rows[0])
        loss_args = args
        if rngs_graphdef is not None:  # this micro-batch's own streams, built in the trace
          micro_batch_rngs = nnx.merge(rngs_graphdef, rngs_state)
          _seed_streams(micro_batch_rngs, rows[0], restart=True)
          loss_args = (*args, micro_batch_rngs)
        before = _pure(nnx.state(model, fixed))
        out = loss_fn(model, micro_batch, *loss_args)
        loss, aux = out if has_aux else (out, None)
        _check_unchanged(before, nnx.state(model, fixed))
        # Only floats travel: "split" averages aux over the two halves.
        return loss, (aux, _pure(nnx.state(model, stats_filter)), loss)

      inner = _microbatch.microbatch_step(
          micro_batch_loss, tx, has_aux=True, num_micro_batches=num_micro_batches)
      params, opt_state, metrics = inner(params, opt_state, (_row_indices(batch), batch))
      aux, new_stats, losses = metrics.pop("aux")
      if has_aux:
        metrics["aux"] = aux
      stats = _mean_over_finite(new_stats, stats, jnp.isfinite(losses))
      counts = jax.tree.map(lambda c: c + 1, counts)
      return params, opt_state, stats, counts, count + 1, metrics

    # As microbatch_step's: params and state buffers become the outputs'.
    return jax.jit(step, donate_argnums=(0, 1))


class _StepCache:
  """Jitted steps by (graphdef, loss_fn, has_aux).

  A static attribute of the optimizer: hashed and compared by identity, so
  ``nnx.split(opt)`` works and two optimizers never share steps.
  """

  def __init__(self) -> None:
    self._steps: dict[Any, Callable[..., Any]] = {}

  def get(self, key: Hashable,
          build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    if key not in self._steps:
      self._steps[key] = build()
    return self._steps[key]


def _check_module(model: Any, caller: str) -> None:
  nnx = _nnx()
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f"{caller} needs a flax.nnx.Module as model, got {type(model).__name__}. "
        "Make the model an nnx.Module subclass (e.g. hold the parts as "
        "attributes of one).")


def _variables(tree: Any) -> list[Any]:  # any tree holding nnx.Variables
  nnx = _nnx()
  return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _pure(tree: Any) -> Any:  # any tree, nnx.Variables in it
  """``tree`` with each ``nnx.Variable`` replaced by its array.

  ``nnx.as_pure`` does this from Flax 0.12.8 on and ``nnx.pure`` before (and
  warns since); this works on both.
  """
  nnx = _nnx()
  return jax.tree.map(
      lambda x: x.get_value() if isinstance(x, nnx.Variable) else x, tree,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def _check_floating(stats: Any, mutable: Filter) -> None:  # stats: a pure nnx.State
  for path, leaf in jax.tree_util.tree_leaves_with_path(stats):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise ValueError(
          f"mutable={mutable!r} selects {jax.tree_util.keystr(path)} of dtype "
          f"{jnp.result_type(leaf)}: the step averages that state over the "
          "micro-batches, which takes floating point. Narrow mutable.")


def _check_distinct_buffers(**trees: Any) -> None:  # pytrees of arrays by name
  """Raises if a donated array is also another leaf (XLA would refuse it, cryptically)."""
  donated = ("params", "opt_state")
  seen: dict[int, tuple[str, str]] = {}  # id -> (tree name, leaf path)
  for name, tree in trees.items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      where = name + jax.tree_util.keystr(path)
      first = seen.setdefault(id(leaf), (name, where))
      if first[1] != where and (name in donated or first[0] in donated):
        raise ValueError(
            f"{first[1]} and {where} are the same array, and the step donates "
            "params and optimizer state: give each Variable its own array "
            "(e.g. jnp.zeros(...) per Variable, or jnp.copy).")


def _row_indices(batch: Batch) -> Optional[jax.Array]:
  """``arange(B)``: split with the batch, each micro-batch's first row seeds its RNG.

  ``None`` when the batch has no leading axis to read B from: the step then
  raises its own error about the batch.
  """
  leaves = jax.tree.leaves(batch)
  if not leaves or not jnp.ndim(leaves[0]):
    return None
  return jnp.arange(jnp.shape(leaves[0])[0], dtype=jnp.uint32)


def _fold_in(keys: jax.Array, data: jax.Array) -> jax.Array:
  """``jax.random.fold_in`` for a key array of any shape (a split stream's)."""
  fold = jax.random.fold_in
  for _ in range(keys.ndim):
    fold = jax.vmap(fold)
  return fold(keys, jnp.broadcast_to(data, keys.shape))


# node_tree: Any, as Flax's types are only known once Flax is imported.
def _seed_streams(node_tree: Any, row: jax.Array, *, restart: bool = False) -> None:
  """Gives each RNG stream of ``node_tree`` (a model, an ``nnx.Rngs``) this
  micro-batch's own key.

  The stream's key folded with its count (new every step) and the first row
  index of the micro-batch or half (distinct within a step); draws then fold
  the count in again, as ``nnx.RngStream`` does. ``restart``: the count
  starts again at 0, as a freshly made ``nnx.Rngs`` of that key would.
  """
  nnx = _nnx()
  for _, node in nnx.iter_graph(node_tree):
    if isinstance(node, nnx.RngStream):
      count = node.count.get_value()
      node.key.set_value(_fold_in(_fold_in(node.key.get_value(), count), row))
      if restart:
        node.count.set_value(jnp.zeros_like(count))


def _advance_counts(rngs: Any) -> None:  # an nnx.Rngs (Flax imported on first use)
  """Moves each stream of ``rngs`` (an ``nnx.Rngs``) on by one draw."""
  nnx = _nnx()
  for _, node in nnx.iter_graph(rngs):
    if isinstance(node, nnx.RngStream):
      node.count.set_value(node.count.get_value() + 1)


def _check_loss_args(args: tuple[Any, ...], rngs: Any) -> None:
  """Refuses what the jitted step cannot hand the loss, naming what to pass instead."""
  nnx = _nnx()
  if rngs is not None and not isinstance(rngs, nnx.Rngs):
    raise TypeError(
        f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(dropout=0)), got {type(rngs).__name__}; "
        "each micro-batch's loss gets its own, forked from it.")
  for position, arg in enumerate(args):
    nodes = jax.tree.leaves(arg, is_leaf=lambda x: isinstance(x, (nnx.Variable, nnx.Pytree)))
    if any(isinstance(x, (nnx.Variable, nnx.Pytree)) for x in nodes):
      raise TypeError(
          f"update's extra argument {position} holds an nnx object "
          f"({type(arg).__name__}): the step hands its loss arrays only. Pass an "
          "nnx.Rngs as update(..., rngs=rngs) (each micro-batch gets its own), and "
          "keep other state in the model.")


def _check_unchanged(before: Any, after: Any) -> None:  # pure trees / nnx.State
  """Raises if the loss assigned to a Variable whose change the step would drop.

  At trace time, by identity: a Variable the loss did not write still holds
  the very array it was merged with. Variables the loss creates (``sow``'s
  intermediates) are not the model's state and go unchecked.
  """
  old_leaves = {jax.tree_util.keystr(path): leaf
                for path, leaf in jax.tree_util.tree_leaves_with_path(before)}
  for path, new in jax.tree_util.tree_leaves_with_path(_pure(after)):
    where = jax.tree_util.keystr(path)
    if where in old_leaves and new is not old_leaves[where]:
      raise ValueError(
          f"loss_fn changed the model's {where}, which is "
          "neither trained (wrt) nor averaged over micro-batches (mutable): the "
          "step would drop the change. Add its Variable type to mutable= if it "
          "is floating point, or keep it out of the loss.")


# stacked / old: pure nnx.State trees of the mutable state, [N, ...] and one.
def _mean_over_finite(stacked: Any, old: Any, finite: jax.Array) -> Any:
  """The mean over micro-batches of ``[N, ...]`` leaves, finite-loss rows only.

  Taken as ``old`` plus the mean change, so state the loss leaves alone comes
  back bitwise; ``old`` where every loss is non-finite.
  """
  num_finite = jnp.sum(finite.astype(jnp.int32))

  def mean(new: jax.Array, previous: jax.Array) -> jax.Array:
    keep = finite.reshape(finite.shape + (1,) * previous.ndim)
    change = jnp.where(keep, new - previous[None], jnp.zeros_like(new))
    mean_change = jnp.sum(change, axis=0) / jnp.maximum(num_finite, 1).astype(new.dtype)
    return previous + mean_change

  return jax.tree.map(mean, stacked, old)


def __dir__() -> list[str]:
  return sorted({*globals(), "MicroBatchOptimizer"})


def __getattr__(name: str) -> Any:
  # The public class derives from nnx.Pytree, so it is made on first use, when
  # Flax is imported; `from optax_adama.nnx import MicroBatchOptimizer` lands here.
  if name == "MicroBatchOptimizer":
    pytree: Any = _nnx().Pytree  # a class only known once Flax is imported

    class MicroBatchOptimizer(_MicroBatchOptimizer, pytree):
      __doc__ = _MicroBatchOptimizer.__doc__

    MicroBatchOptimizer.__module__ = __name__
    MicroBatchOptimizer.__qualname__ = name
    globals()[name] = MicroBatchOptimizer
    return MicroBatchOptimizer
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
