"""Gradient release for a scanned layer stack: AdamA folds one layer at a time.

With the layers' params stacked on a leading axis and applied under one
`jax.lax.scan`, the backward scan of autodiff emits the whole stack's gradient
as one array, and AdamA has to keep a stack-sized gradient alive to fold it.
`release_step` owns the backward instead: a reverse scan over the layers that,
from each layer's saved input, takes the `jax.vjp` of that layer, folds its
parameter cotangent into the layer's slice of m and v (in place, in the scan
carry) and passes the input cotangent on. One layer's gradient is alive at a
time. The math is `scale_by_adama`'s, leaf by leaf (`_adama.fold_leaf`, the fold kernel), and so are
the counters and the emitted direction.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import operator
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax_adama import _adama
from optax_adama import _floor
from optax_adama import _offload
from optax_adama import _quantize
from optax_adama import _sharding
from optax_adama import _steps
from optax_adama._adama import MiniBatchChainState
from optax_adama._adama import ScaleByAdamAState

__all__ = ["StagedLoss", "release_shardings", "release_step"]

Batch = Any
Metrics = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StagedLoss:
  """A loss in three stages around a stack of layers with stacked params.

  ``params[layers]`` (a key, or a tuple of keys into nested mappings: dicts,
  ``flax.nnx.State``, ``FrozenDict``) holds the stack: every leaf has a leading
  layer axis of the same length. The other params, ``outer`` (the same tree
  with that entry removed), belong to the embedding and the head; a leaf both
  use (a tied embedding) gets the sum of both gradients, as in autodiff.

  Attributes:
    embed: ``embed(outer, micro_batch) -> x``, the first layer's input.
    block: ``block(layer_params, x, micro_batch) -> x``: one layer, given its
      slice of the stack; ``x`` is an array or a pytree of arrays that keeps
      its shapes from layer to layer. ``micro_batch`` is a side input (e.g.
      for an attention mask) and gets no gradient.
    head: ``head(outer, x, micro_batch) -> loss`` (the micro-batch *mean*
      loss), or ``-> (loss, aux)``.
    layers: where the stack is in params.

  Called as ``staged(params, micro_batch)`` it is the plain loss (the blocks
  under one ``jax.lax.scan``): the ``loss_fn`` of :func:`microbatch_step`.

  Examples:
    >>> import jax.numpy as jnp, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"] @ outer["w_in"],
    ...     block=lambda layer, x, b: jnp.tanh(x @ layer["w"]),
    ...     head=lambda outer, x, b: jnp.mean((x @ outer["w_out"] - b["y"]) ** 2),
    ...     layers="stack")
    >>> params = {"w_in": jnp.ones((2, 4)), "stack": {"w": jnp.zeros((3, 4, 4))},
    ...           "w_out": jnp.ones((4, 1))}
    >>> float(staged(params, {"x": jnp.ones((5, 2)), "y": jnp.ones((5, 1))}))
    1.0
  """

  embed: Callable[[Any, Batch], Any]
  block: Callable[[Any, Any, Batch], Any]
  head: Callable[[Any, Any, Batch], Any]
  layers: Union[str, tuple[str, ...]] = "layers"

  @property
  def path(self) -> tuple[Any, ...]:
    return self.layers if isinstance(self.layers, tuple) else (self.layers,)

  def split(self, params: Any) -> tuple[Any, Any]:
    """``(outer, stacked)``: the params without the stack, and the stack."""
    return _split(params, self.path, self.path)

  def check_stack(self, params: Any) -> int:
    """The stack's layer count; raises unless every stacked leaf has it."""
    _, stacked = self.split(params)
    sizes: dict[Any, list[str]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
      size = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
      sizes.setdefault(size, []).append(jax.tree_util.keystr(path))
    if len(sizes) != 1 or None in sizes:
      found = "; ".join(f"{'no axis' if size is None else size} for {', '.join(paths)}"
                        for size, paths in sizes.items())
      raise ValueError(
          f"StagedLoss(layers={self.layers!r}): every leaf of the stack needs the "
          f"same leading (layer) axis, got {found or 'no leaves'}. Stack each "
          "layer's params along axis 0 (nnx.vmap / nnx.scan over the layers "
          "does), and keep per-model params out of params[layers].")
    (size,) = sizes
    return size

  def merge(self, outer: Any, stacked: Any) -> Any:
    """The inverse of :meth:`split`."""
    return _merge(outer, stacked, self.path)

  def __call__(self, params: Any, micro_batch: Batch) -> Any:
    self.check_stack(params)
    outer, stacked = self.split(params)
    x = self.embed(outer, micro_batch)
    x, _ = jax.lax.scan(
        lambda x, layer_params: (self.block(layer_params, x, micro_batch), None),
        x, stacked)
    return self.head(outer, x, micro_batch)


def _split(tree, path, full_path):
  key, rest = path[0], path[1:]
  if not isinstance(tree, collections.abc.Mapping) or key not in tree:
    raise ValueError(
        f"StagedLoss(layers={full_path!r}): no key {key!r} in a "
        f"{type(tree).__name__} of params.")
  if not rest:
    return type(tree)({k: v for k, v in tree.items() if k != key}), tree[key]
  inner, stacked = _split(tree[key], rest, full_path)
  return type(tree)({**tree, key: inner}), stacked


def _merge(outer, stacked, path):
  key, rest = path[0], path[1:]
  value = stacked if not rest else _merge(outer[key], stacked, rest)
  return type(outer)({**outer, key: value})


def release_step(
    staged: StagedLoss,
    tx: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    mesh: Optional[jax.sharding.Mesh] = None,
    shard_states: Optional[str] = None,
    data_axis: _sharding.AxisName = "data",
) -> Callable[[optax.Params, optax.OptState, Batch], tuple[optax.Params, optax.OptState, Metrics]]:
  r"""A :func:`microbatch_step` for a scanned layer stack, with gradient release.

  ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, jitted
  with ``params`` and ``opt_state`` donated, splits ``batch`` into the ``N``
  micro-batches of the AdamA state and, for each, runs the forward pass (the
  blocks under a ``jax.lax.scan`` that saves each layer's input), then owns
  the backward: a reverse scan over the layers that recomputes layer
  :math:`l` from its input, takes its ``jax.vjp``, folds the parameter
  cotangent into rows :math:`l` of m and v and passes the input cotangent on.
  The head's and the embedding's gradients are folded once, summed. So one
  layer's gradient is alive at a time instead of the whole stack's.

  Params, state and metrics equal :func:`microbatch_step` on ``staged``
  (float rounding aside) with the same ``tx``: the same fold, non-finite
  guard, ``nu_estimator``, counters, direction, and the transforms of
  :func:`mini_batch_chain` (learning rate, weight decay) on the emitted
  direction. Each layer's forward is computed twice (as with
  ``remat="full"``): the price of keeping only its input. With
  ``nu_estimator="split"`` every stage runs on the micro-batch's two halves
  at once (vmapped) and each layer's gradient is taken per half, folded as
  their mean and half difference and dropped: the stack's gradient is never
  held, twice or once.

  What it asks of the model: a :class:`StagedLoss`, i.e. the loss written
  as embed, one block, head, with the block's params stacked. Flax NNX models
  built with ``nnx.vmap`` / ``nnx.scan`` over layers and MaxText's
  ``scan_layers`` already keep them so (``models.staged_loss`` does it for
  this project's models).

  Args:
    staged: the model's loss in stages.
    tx: an AdamA transformation: :func:`adama`, :func:`adamaw`,
      :func:`scale_by_adama`, or :func:`mini_batch_chain` of one; moments
      dense (float32, bfloat16) or 8-bit with
      ``BlockQuantization(layer_aligned=True)``, whose blocks tile each
      layer's slice (on a mesh each device holds its slice's codes: see
      :func:`release_shardings`). It may be under :func:`offload_moments`:
      the moments stay in host memory and each layer's slice is brought in
      for its fold and for its update, so the device holds one layer's
      moments at a time (and the outer leaves' while they are folded); on a
      mesh each device keeps its slice of them in host memory and brings in
      its part of each layer's (place the state with
      :func:`release_shardings` of ``tx.init(params)``, which keeps the
      leaves' memory kinds).
      Then the transforms of :func:`mini_batch_chain` run on one layer's
      slice at a time (each stacked leaf as a ``[1, ...]`` slice, so its rank
      is kept): they must act elementwise with a state of scalars, as the
      learning rate, schedules and weight decay of :func:`adama` and
      :func:`adamaw` do; a transform that reads the whole update (a
      global-norm clip) would see one layer.
    has_aux: whether ``staged.head`` returns ``(loss, aux)``.
    mesh: a :class:`jax.sharding.Mesh` to run data parallel on (each device
      folds its rows of every micro-batch; GSPMD and ``shard_map``, as
      :func:`microbatch_step` with ``mesh``); ``None`` runs on one device.
    shard_states: with ``mesh``: ``None`` (params and moments replicated,
      each layer's gradient all-reduced), ``"zero1"`` (moments split over
      the devices, each layer's gradient all-reduced and each device folds
      its slice), ``"zero2"`` (moments split, each layer's gradient
      reduce-scattered) or ``"fsdp"`` (params split too: each layer's are
      gathered as the forward scan reaches it and again in the release
      scan, so no device holds more than one layer of them gathered). A
      stacked leaf is split along a dimension other than the layer axis, so
      that every device holds a slice of every layer: place params and
      state with :func:`release_shardings`, not :func:`step_shardings`.
    data_axis: the mesh axis (or axes) the batch is split over.

  Returns:
    The jitted step, with ``.lower(params, opt_state, batch)``. Metrics as
    :func:`microbatch_step`'s: ``loss``, ``num_nonfinite_losses``,
    ``num_dropped`` and, with ``has_aux``, ``aux``.

  Raises:
    TypeError: if ``tx`` is not an AdamA transformation.
    ValueError: for ``shard_states`` without a mesh, or an unknown stage;
      at the first call, for ``nu_estimator="split"`` and micro-batches that
      do not split into two halves (of rows for every device, on a mesh),
      and on a mesh for 8-bit moments that do not split into whole blocks
      per device (:func:`release_shardings`), or for params or state placed
      on the mesh with other shardings or memory kinds than the step keeps
      them in (offloaded moments in device memory), before any buffer is
      donated.
    NotImplementedError: (at the first call) for a chained transform with a
      per-parameter state under :func:`offload_moments`, or for 8-bit
      moments of a stacked leaf whose blocks straddle layers
      (``layer_aligned=False``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"] @ outer["w_in"],
    ...     block=lambda layer, x, b: jnp.tanh(x @ layer["w"]),
    ...     head=lambda outer, x, b: jnp.mean((x @ outer["w_out"] - b["y"]) ** 2),
    ...     layers="stack")
    >>> keys = jax.random.split(jax.random.key(0), 3)
    >>> params = {"w_in": jax.random.normal(keys[0], (2, 4)),
    ...           "stack": {"w": jax.random.normal(keys[1], (8, 4, 4)) / 2},
    ...           "w_out": jax.random.normal(keys[2], (4, 1))}
    >>> tx = optax_adama.adamaw(1e-2, num_micro_batches=2)
    >>> step = optax_adama.release_step(staged, tx)
    >>> state = tx.init(params)
    >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}
    >>> params, state, metrics = step(params, state, batch)
    >>> int(state.adama.count), int(metrics["num_dropped"])
    (1, 0)

  References:
    Zhang et al., `Adam Accumulation ... <https://arxiv.org/abs/2305.19982>`_,
    section 3 ("gradient release").
  """
  _check_release_stage(mesh, shard_states)
  parts = _adama.folding_parts(tx, "release_step")
  if mesh is not None:
    mesh = _sharding.auto_mesh(mesh)

  def step(params, opt_state, batch):
    staged.check_stack(params)
    _check_is_state_of_tx(opt_state, parts.inner)
    _check_moments(staged, params, _adama.adama_of(opt_state))
    shardings = slices = None
    if mesh is not None:
      shardings = _step_shardings(staged, parts, params, opt_state, mesh, shard_states,
                                  data_axis)
      slices = _moment_slices(staged, params, opt_state, _sharding.auto_mesh(mesh),
                              shard_states, data_axis)
      params, opt_state = _constrained((params, opt_state), shardings)
    state = _adama.adama_of(opt_state)
    micro_batches = _micro_batches(state, batch, mesh, data_axis)
    resolved, _ = _steps.resolve_halves(
        state, micro_batches, 1 if mesh is None else _sharding.num_devices(mesh, data_axis))
    momentum_after = _adama.adds_momentum_after_fold(
        resolved, per_layer_offload=parts.offload_min_size is not None)
    fold_parts = parts
    if momentum_after:  # fold as "sum"; the m_hat**2 term follows the scan
      fold_parts = dataclasses.replace(
          parts, config=dataclasses.replace(parts.config, nu_estimator="sum"))
    offloaded = _offloaded_state(state, parts)
    fold = _scan_body(staged, fold_parts, has_aux, params, mesh, shard_states,
                      data_axis, shardings, slices, offloaded)
    folded, (losses, aux) = jax.lax.scan(fold, resolved, micro_batches)
    if momentum_after:
      folded = _adama.add_momentum_term(folded, parts.config)
    params, inner_state = _apply_emitted(
        staged, parts, params, folded, _adama.inner_of(opt_state),
        _sharded_update(staged, slices, shard_states, mesh, data_axis), offloaded,
        None if mesh is None else _split_by_layer(
            staged, slices, _specs(_adama.adama_of(shardings.opt_state)), mesh, data_axis))
    opt_state = _adama.with_adama(
        opt_state, _adama.with_estimator(folded, state.nu_estimator), inner_state)
    if shardings is not None:
      # Back where they started: params replicated (the sharded update is
      # all-gathered once per step), moments split.
      params, opt_state = _constrained((params, opt_state), shardings)
    metrics = _steps.step_metrics(
        losses, folded.num_dropped - state.num_dropped, aux if has_aux else None)
    return params, opt_state, metrics

  if mesh is None:
    return _steps.with_distinct_buffers(jax.jit(step, donate_argnums=(0, 1)))
  jitted = jax.jit(step, donate_argnums=(0, 1),
                   in_shardings=(None, None, _sharding.batch_sharding(mesh, data_axis)))
  def expected_shardings(params, opt_state):
    shardings = _step_shardings(staged, parts, params, opt_state, mesh, shard_states,
                                data_axis)
    return shardings.params, shardings.opt_state

  return _steps.with_distinct_buffers(
      jitted, _sharding.num_devices(mesh, data_axis), data_axis,
      expected_shardings=expected_shardings)


def _step_shardings(staged, parts, params, opt_state, mesh, shard_states, data_axis):
  """:func:`release_shardings` as the step keeps them: under
  :func:`offload_moments` the state leaves it offloads in host memory (decided
  by each whole leaf's size, as ``init`` places them, not by where they are)."""
  _check_moments(staged, params, _adama.adama_of(opt_state))
  shardings = _stage_shardings(staged, params, opt_state, mesh, shard_states, data_axis,
                               align_blocks=True)
  return _offload.keep_offloaded(shardings, opt_state, parts.offload_min_size)


def _check_is_state_of_tx(opt_state, inner) -> None:
  chained = isinstance(opt_state, MiniBatchChainState)
  if not isinstance(_adama.adama_of(opt_state), ScaleByAdamAState) or chained != (inner is not None):
    raise TypeError(
        f"opt_state ({type(opt_state).__name__}) is not the state of tx: "
        "pass tx.init(params).")


def _constrained(params_and_state, shardings):
  return jax.lax.with_sharding_constraint(
      params_and_state, (shardings.params, shardings.opt_state))


def _scan_body(staged, parts, has_aux, params, mesh, shard_states, data_axis,
               shardings, slices, offloaded):
  """The scan body ``(state, micro_batch) -> (state, (loss, aux))``.

  ``offloaded``: :func:`_offloaded_state` of the whole state.
  """
  def fold(state, micro_batch):
    if _adama.takes_halves(state):
      # Halved before the devices take their rows: each device then holds
      # rows of both halves, and the halves are the micro-batch's own.
      micro_batch = _steps.halves(micro_batch)
    if mesh is None:
      state, loss, aux = _release_micro_batch(
          staged, parts, has_aux, params, state, micro_batch, offloaded)
    else:
      state, loss, aux = _data_parallel_fold(
          staged, parts, has_aux, mesh, shard_states, data_axis,
          _adama.with_estimator(_specs(_adama.adama_of(shardings.opt_state)),
                                state.nu_estimator),
          _specs(shardings.params), _specs(slices), offloaded, params, state,
          micro_batch)
    return state, (loss, aux)
  return fold


def _sharded_update(staged, slices, shard_states, mesh, data_axis):
  """``(params, updates) -> params`` for updates split like ZeRO's moments
  (``slices``: :func:`_moment_slices`).

  ``None`` where params and updates are whole on every device.
  """
  if shard_states in (None, "fsdp"):  # FSDP: params split as the update is
    return None
  return lambda params, updates: _apply_sharded_updates(
      staged, params, updates, slices, mesh, data_axis)


def _micro_batches(state, batch, mesh, data_axis):
  """The state's ``N`` micro-batches of ``batch``, placed."""
  micro_batches = _steps.split_micro_batches(batch, state.num_micro_batches)
  if mesh is None:
    return micro_batches
  return _sharding.place_micro_batch_rows(micro_batches, mesh, data_axis)


RELEASE_SHARD_STATES = (None, "zero1", "zero2", "fsdp")


def _check_release_stage(mesh, shard_states) -> None:
  _sharding.check_shard_states(shard_states)
  if mesh is None and shard_states is not None:
    raise ValueError(f"shard_states={shard_states!r} needs a mesh.")
  if shard_states not in RELEASE_SHARD_STATES:
    raise NotImplementedError(
        f"release_step supports shard_states in {RELEASE_SHARD_STATES}, got "
        f"{shard_states!r}.")


def release_shardings(
    staged: StagedLoss,
    params: Any,
    opt_state: Any,
    mesh: jax.sharding.Mesh,
    *,
    shard_states: Optional[str] = "zero2",
    data_axis: _sharding.AxisName = "data",
) -> _sharding.StepShardings:
  """Where :func:`release_step` keeps params, optimizer state and gradients.

  :func:`step_shardings`' rule (a leaf split along the first dimension the
  data axis divides), except that a leaf of the stack is split along its
  first dimension *after* the layer axis: the release folds one layer at a
  time, and every device must hold its slice of that layer's moments.

  Args:
    staged: the model's :class:`StagedLoss` (where the stack is).
    params: a params tree (arrays or `jax.ShapeDtypeStruct`).
    opt_state: the AdamA state of ``params`` (``tx.init(params)``, or its
      ``jax.eval_shape``).
    mesh: the device mesh.
    shard_states: ``None``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
    data_axis: the mesh axis (or axes) the batch is split over.

  A state leaf in host memory (:func:`offload_moments`' ``init`` puts its
  large leaves there; :func:`moments.offloaded_state_shapes` for
  ``jax.eval_shape``) keeps its memory kind: each device holds its slice of
  it in host memory.

  8-bit moments (:class:`BlockQuantization`) are split where their params
  are: each device holds the whole blocks of its slice (a layer-aligned
  leaf's blocks of every layer, or a leaf's first axis) or, where each row
  is one block (a layer norm's scales; an embedding split along its width),
  a part of every block, whose scale the fold puts together across the
  devices. A leaf that fits neither way and has fewer blocks (per layer)
  than devices is kept whole on every device, its param and gradient too.

  Returns:
    A :class:`StepShardings`: ``jax.device_put(params, s.params)`` and
    ``jax.device_put(opt_state, s.opt_state)`` before the first step let the
    step donate them in place.

  Raises:
    ValueError: for an unknown ``shard_states``, or for an 8-bit moment with
      a block for each device that still does not split into whole blocks
      (the error names the leaf and the fix).
    NotImplementedError: for 8-bit moments of a stacked leaf whose blocks
      straddle layers (``layer_aligned=False``).

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"], block=lambda layer, x, b: x @ layer["w"],
    ...     head=lambda outer, x, b: jnp.mean(x ** 2), layers="stack")
    >>> params = {"stack": {"w": jnp.zeros((4, 8, 8))}}
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=2)
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> s = optax_adama.sharding.release_shardings(staged, params, tx.init(params), mesh)
    >>> tuple(s.opt_state.adama.mu["stack"]["w"].spec)  # each device: a slice of every layer
    (None, 'data')
  """
  _check_release_stage(mesh, shard_states)
  state = _adama.adama_of(opt_state)
  if isinstance(state, ScaleByAdamAState):
    _check_moments(staged, params, state)
  shardings = _stage_shardings(staged, params, opt_state, mesh, shard_states, data_axis,
                               align_blocks=True)
  # Offloaded leaves (offload_moments' init puts them in host memory) stay there.
  return shardings._replace(opt_state=_offload.in_host_memory(
      shardings.opt_state, _offload.host_leaves(opt_state)))


def stack_shardings(
    staged: StagedLoss,
    params: Any,
    opt_state: Any,
    mesh: jax.sharding.Mesh,
    *,
    shard_states: Optional[str] = "zero2",
    data_axis: _sharding.AxisName = "data",
) -> _sharding.StepShardings:
  """:func:`step_shardings` for a model in stages: stacked leaves split after the layer axis.

  What :func:`release_step` places (:func:`release_shardings`) and what
  :func:`microbatch_step` places for a :class:`StagedLoss` under
  ``shard_states="fsdp"``, where every device holds a slice of every layer
  and each layer's params are gathered inside the layer scan, one layer at
  a time. Any optimizer's state (its leaves shaped like params are split
  like them).

  Args:
    staged: the model's :class:`StagedLoss` (where the stack is).
    params: a params tree (arrays or `jax.ShapeDtypeStruct`).
    opt_state: its optimizer state (or its ``jax.eval_shape``).
    mesh: the device mesh.
    shard_states: ``None``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
    data_axis: the mesh axis (or axes) the batch is split over.

  Returns:
    A :class:`StepShardings`.

  Examples:
    >>> import jax, jax.numpy as jnp, numpy as np, optax_adama
    >>> staged = optax_adama.StagedLoss(
    ...     embed=lambda outer, b: b["x"], block=lambda layer, x, b: x @ layer["w"],
    ...     head=lambda outer, x, b: jnp.mean(x ** 2), layers="stack")
    >>> params = {"stack": {"w": jnp.zeros((4, 8, 8))}}
    >>> tx = optax_adama.adama(1e-3, num_micro_batches=2)
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    >>> s = optax_adama.sharding.stack_shardings(
    ...     staged, params, tx.init(params), mesh, shard_states="fsdp")
    >>> tuple(s.params["stack"]["w"].spec)  # a slice of every layer on each device
    (None, 'data')
  """
  return _stage_shardings(staged, params, opt_state, mesh, shard_states, data_axis,
                          align_blocks=False)


def _stage_shardings(staged, params, opt_state, mesh, shard_states, data_axis,
                     align_blocks: bool) -> _sharding.StepShardings:
  """:func:`stack_shardings`; ``align_blocks``: as :func:`release_step` folds 8-bit moments.

  The release folds each device's slice of a leaf inside ``shard_map``, so an
  8-bit moment must be split where its param is, whole blocks on each device
  (:func:`_sharding.quantized_sharding`); GSPMD (``microbatch_step``) takes
  the alignment of :func:`_sharding.step_shardings`, where a leaf that cannot
  split into whole blocks keeps its own split.
  """
  base = _sharding.step_shardings(
      params, opt_state, mesh, shard_states=shard_states, data_axis=data_axis)
  if shard_states is None:
    return base
  split = lambda tree: _stack_aware_shardings(staged, tree, mesh, data_axis)
  state = _adama.adama_of(opt_state)
  slices = split(params)
  if isinstance(state, ScaleByAdamAState):
    if align_blocks:
      slices = _moment_slices(staged, params, opt_state, mesh, shard_states, data_axis)
      moments = lambda tree: _moment_shardings(slices, params, tree)
    else:
      moments = split
    state_shardings = _adama.adama_of(base.opt_state)._replace(
        mu=moments(state.mu), nu=moments(state.nu))
    if not align_blocks:
      state_shardings = _sharding.block_aligned_moments(
          state_shardings, state, params, slices, mesh, data_axis)
    opt_state_shardings = _adama.with_adama(
        base.opt_state, state_shardings, _adama.inner_of(base.opt_state))
  else:
    opt_state_shardings = base.opt_state
  grads = slices if shard_states in ("zero2", "fsdp") else base.grads
  param_shardings = slices if shard_states == "fsdp" else base.params
  return _sharding.StepShardings(param_shardings, opt_state_shardings, grads)


_is_quantized = lambda x: isinstance(x, _quantize.QuantizedArray)


def _moment_slices(staged, params, opt_state, mesh, shard_states, data_axis):
  """Per param, how the release splits its moments, in the param's layout:
  what each device folds (its gradient's slice) and updates."""
  if shard_states is None:
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
  slices = _stack_aware_shardings(staged, params, mesh, data_axis)
  state = _adama.adama_of(opt_state)
  return _block_aligned_slices(staged, slices, params, state.mu, mesh, data_axis)


def _splits_blocks(codes_spec: PartitionSpec) -> bool:
  """Whether the devices each hold a part of every block (the codes' last axis)."""
  dim = _sharding.split_dim(codes_spec)
  return dim is not None and dim == len(codes_spec) - 1


def _block_aligned_slices(staged, slices, params, mu, mesh, data_axis):
  """``slices`` (each param's split) with the 8-bit moments' leaves that
  cannot split whole blocks kept whole on every device, or an error for
  those with a block for each device (where keeping them whole costs memory)."""
  num_devices = _sharding.num_devices(mesh, data_axis)
  replicated = NamedSharding(mesh, PartitionSpec())

  def align(path, sharding, param, moment):
    if not _is_quantized(moment):
      return sharding
    shape = jnp.shape(param)
    if _sharding.quantized_sharding(moment, shape, sharding) is not None:
      return sharding
    blocks = moment.codes.shape[-2]
    if blocks < num_devices:
      return replicated
    raise ValueError(
        f"release_step(mesh=...) folds each device's slice of a leaf, and the "
        f"8-bit blocks of the moment of {jax.tree_util.keystr(path)} (shape {shape}, "
        f"codes {moment.codes.shape}) do not split into whole blocks along "
        f"{sharding.spec}: pass BlockQuantization(layer_aligned=True) and give the "
        f"dimension the devices split ({num_devices}) a size with whole blocks per "
        "device (e.g. pad it), or keep that leaf's moments dense (a larger min_size).")

  return jax.tree_util.tree_map_with_path(align, slices, params, mu,
                                          is_leaf=_is_quantized)


def _moment_shardings(slices, params, moment):
  """A moment's shardings from its params' (``slices``, block-aligned)."""
  def place(sharding, param, leaf):
    if _is_quantized(leaf):
      return _sharding.quantized_sharding(leaf, jnp.shape(param), sharding)
    return sharding
  return jax.tree.map(place, slices, params, moment, is_leaf=_is_quantized)


def _stack_aware_shardings(staged, tree, mesh, data_axis):
  mesh = _sharding.auto_mesh(mesh)
  axis_size = _sharding.num_devices(mesh, data_axis)
  outer, stacked = staged.split(tree)
  outer = _sharding.sharded_tree_shardings(outer, mesh, data_axis=data_axis)
  stacked = jax.tree.map(
      lambda x: NamedSharding(mesh, PartitionSpec(
          None, *_sharding.shard_leaf_spec(jnp.shape(x)[1:], axis_size, data_axis))),
      stacked)
  return _like(tree, staged.merge(outer, stacked))


def _data_parallel_fold(staged, parts, has_aux, mesh, shard_states, data_axis,
                        state_specs, param_specs, slice_specs, offloaded, params, state,
                        micro_batch):
  """:func:`_release_micro_batch` with each device on its rows, under ``shard_map``.

  Offloaded state leaves come in and leave in host memory, each device's
  slice of them (``shard_map`` keeps an operand's memory kind).
  """
  reductions = _data_parallel_reductions(
      staged, state_specs, param_specs, slice_specs, mesh, shard_states, data_axis)
  axis_names = _sharding.axis_names(data_axis)

  def local(params, state, micro_batch):
    if shard_states != "fsdp":
      # Replicated params, gradients that differ per device: marked varying,
      # the backward leaves the reduction to `reductions`.
      params = jax.tree.map(lambda p: _sharding.to_varying(p, axis_names), params)
    return _release_micro_batch(staged, parts, has_aux, params, state, micro_batch,
                                offloaded, reductions)

  replicated = PartitionSpec()
  halves = _adama.takes_halves(state)  # [2, rows, ...]: each half's rows split
  rows = PartitionSpec(None, data_axis) if halves else PartitionSpec(data_axis)
  return jax.shard_map(
      local, mesh=mesh, in_specs=(param_specs, state_specs, rows),
      out_specs=(state_specs, replicated, replicated))(params, state, micro_batch)


def _data_parallel_reductions(staged, state_specs, param_specs, slice_specs, mesh,
                              shard_states, data_axis):
  """The collectives of a ZeRO stage, for :func:`_release_micro_batch` in ``shard_map``.

  ``slice_specs``: each leaf's split in its param's layout (:func:`_moment_slices`).
  """
  num_devices = _sharding.num_devices(mesh, data_axis)
  outer_specs, stacked_specs = staged.split(slice_specs)
  is_spec = lambda x: isinstance(x, PartitionSpec)
  is_moment_spec = lambda x: is_spec(x) or _is_quantized(x)
  # Per leaf, whether each device holds a part of every 8-bit block.
  splits_blocks = {kind: [_is_quantized(x) and _splits_blocks(x.codes)
                          for x in jax.tree.leaves(tree, is_leaf=is_moment_spec)]
                   for kind, tree in zip(("outer", "layer"), staged.split(state_specs.mu))}
  pmax = lambda absmax: jax.lax.pmax(absmax, data_axis)
  outer_specs = jax.tree.leaves(outer_specs, is_leaf=is_spec)
  # A layer's slice is placed as its stacked moment, less the layer axis.
  layer_specs = [PartitionSpec(*spec[1:])
                 for spec in jax.tree.leaves(stacked_specs, is_leaf=is_spec)]

  axis_names = _sharding.axis_names(data_axis)
  outer_param_specs, stacked_param_specs = staged.split(param_specs)
  layer_param_specs = jax.tree.map(lambda s: PartitionSpec(*s[1:]), stacked_param_specs,
                                   is_leaf=is_spec)

  def gather(p, spec):
    # FSDP: this device's slice made whole (marked varying: its gradient is
    # reduced by `reduce`, not by the gather's transpose).
    dim = _sharding.split_dim(spec)
    if dim is not None:
      p = jax.lax.all_gather(p, data_axis, axis=dim, tiled=True)
    return _sharding.to_varying(p, axis_names)

  def reduce(grad, spec):
    if shard_states in ("zero2", "fsdp"):
      return _sharding.reduce_gradient(grad, spec, data_axis, num_devices)
    grad = _sharding.reduce_gradient(grad, PartitionSpec(), data_axis, num_devices)
    return _local_slice(grad, spec, data_axis, num_devices)

  def all_finite(finite):
    # A non-finite entry may sit in another device's slice.
    return jax.lax.psum((~finite).astype(jnp.int32), data_axis) == 0

  def seed(s, spec):
    # Each device rounds its own slice: its own noise. A leaf whole on every
    # device is rounded alike on each, so that it stays the same everywhere.
    if s is None or _sharding.split_dim(spec) is None:
      return s
    return _quantize.mix_seed(s, jax.lax.axis_index(data_axis).astype(jnp.uint32))

  def seeds(pairs, specs):
    return [tuple(seed(s, spec) for s in pair) for pair, spec in zip(pairs, specs)]

  def floor(increment, spec, leaf_shape, slice_ndim):
    # Computed from this device's block of the gradient: whole again (and
    # the same on every device, as the state's replicated floor must be).
    dim = _sharding.split_dim(spec)
    if dim is None:
      return increment
    axes = _floor.factored_axes(dim, slice_ndim, leaf_shape)
    return _floor.FactoredSquares(*(
        _assembled(x, axis, data_axis, num_devices) for x, axis in zip(increment, axes)))

  def floors(increments, leaf_shapes, specs, layered):
    return [floor(inc, spec, shape, len(shape) - layered)
            for inc, spec, shape in zip(increments, specs, leaf_shapes)]

  return _Reductions(
      loss=lambda loss: jax.lax.pmean(loss, data_axis),
      aux=lambda aux: jax.tree.map(lambda x: _sharding.reduce_aux(x, data_axis), aux),
      outer_grads=lambda grads: list(map(reduce, grads, outer_specs)),
      layer_grads=lambda grads: list(map(reduce, grads, layer_specs)),
      all_finite=all_finite,
      whole_block_absmax=lambda kind, i: pmax if splits_blocks[kind][i] else _identity,
      layer_seeds=lambda pairs: seeds(pairs, layer_specs),
      # The outer leaves' seeds follow the stack's (see _fold_outer).
      outer_seeds=lambda pairs: seeds(pairs, layer_specs + outer_specs),
      outer_floors=lambda incs, shapes: floors(incs, shapes, outer_specs, False),
      layer_floors=lambda incs, shapes: floors(incs, shapes, layer_specs, True),
      outer_params=(lambda outer: jax.tree.map(gather, outer, outer_param_specs))
      if shard_states == "fsdp" else _identity,
      layer_params=(lambda layer: jax.tree.map(gather, layer, layer_param_specs))
      if shard_states == "fsdp" else _identity)


def _assembled(x, axis, data_axis, num_devices):
  """Inside ``shard_map``: the sum over devices of ``x``, each device's block
  placed at its offset along ``axis`` first (``None``: added as is)."""
  if axis is not None:
    size = x.shape[axis]
    whole = jnp.zeros(x.shape[:axis] + (size * num_devices,) + x.shape[axis + 1:], x.dtype)
    x = jax.lax.dynamic_update_slice_in_dim(
        whole, x, jax.lax.axis_index(data_axis) * size, axis)
  return jax.lax.psum(x, data_axis)


def _local_slice(x, spec, data_axis, num_devices):
  """Inside ``shard_map``: this device's block of a replicated ``x`` under ``spec``."""
  dim = _sharding.split_dim(spec)
  if dim is None:
    return x
  size = x.shape[dim] // num_devices
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(data_axis) * size, size, dim)


def _apply_sharded_updates(staged, params, updates, slices, mesh, data_axis):
  """Replicated params plus updates split like the moments, gathered in pieces.

  Each device adds its slice of the update to its slice of the params and
  all-gathers the sum into the params, the stack one layer at a time (a scan
  that updates the donated params in place): gathering the whole update
  first, as GSPMD does for ``params + updates``, keeps a parameter-sized
  buffer alive beside the params.
  """
  num_devices = _sharding.num_devices(mesh, data_axis)
  update_specs = _specs(slices)
  outer_specs, stacked_specs = staged.split(update_specs)

  def apply(p, u, spec):
    new = _steps.apply_updates(_local_slice(p, spec, data_axis, num_devices), u)
    dim = _sharding.split_dim(spec)
    return new if dim is None else jax.lax.all_gather(new, data_axis, axis=dim, tiled=True)

  def apply_layer(stacked, xs):
    layer, layer_updates = xs
    layer_params = jax.tree.map(
        lambda p: jax.lax.dynamic_index_in_dim(p, layer, keepdims=False), stacked)
    new = jax.tree.map(lambda p, u, spec: apply(p, u, PartitionSpec(*spec[1:])),
                       layer_params, layer_updates, stacked_specs)
    return jax.tree.map(lambda p, n: jax.lax.dynamic_update_index_in_dim(p, n, layer, 0),
                        stacked, new), None

  def local(params, updates):
    (outer, stacked), (outer_updates, stacked_updates) = map(staged.split, (params, updates))
    outer = jax.tree.map(apply, outer, outer_updates, outer_specs)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    stacked, _ = jax.lax.scan(
        apply_layer, stacked, (jnp.arange(num_layers, dtype=jnp.int32), stacked_updates))
    return _like(params, staged.merge(outer, stacked))

  # Gathered leaves are the same on every device; shard_map's type check
  # cannot tell (all_gather's result counts as device-varying).
  return jax.shard_map(
      local, mesh=mesh, in_specs=(PartitionSpec(), update_specs),
      out_specs=PartitionSpec(), check_vma=False)(params, updates)


def _specs(shardings):
  return jax.tree.map(lambda s: s.spec, shardings)


def _check_moments(staged: StagedLoss, params, state: ScaleByAdamAState) -> None:
  """Raises for 8-bit stacked moments whose blocks straddle layers (on a mesh,
  :func:`release_shardings` checks that each device holds whole blocks)."""
  is_quantized = _is_quantized
  _, stacked_params = staged.split(params)
  for moment in (state.mu, state.nu):
    _, stacked = staged.split(moment)
    leaves = jax.tree.structure(stacked_params).flatten_up_to(stacked)
    for param, leaf in zip(jax.tree.leaves(stacked_params), leaves):
      if is_quantized(leaf) and not _layer_aligned(leaf, jnp.shape(param)):
        raise NotImplementedError(
            "release_step folds the stack's moments one layer slice at a time, "
            f"and the 8-bit blocks of a stacked leaf of shape {jnp.shape(param)} "
            "straddle layers. Lay the blocks out per layer with "
            "BlockQuantization(layer_aligned=True), or keep the stack's moments "
            "dense (mu_dtype / nu_dtype float32 or bfloat16).")


def _layer_aligned(moment: _quantize.QuantizedArray, shape) -> bool:
  # BlockQuantization(layer_aligned=True)'s layout: [layers, blocks, block_len].
  codes_shape = moment.codes.shape
  return (len(codes_shape) == 3 and codes_shape[0] == shape[0]
          and codes_shape[1] * codes_shape[2] == math.prod(shape[1:]))


def _layer_slice(moment, layer, num_layers, keepdims=False):
  """Layer ``layer``'s slice of a stacked moment (its blocks if 8-bit)."""
  del num_layers
  if isinstance(moment, _quantize.QuantizedArray):
    return jax.tree.map(
        lambda x: _as_stored(jax.lax.dynamic_index_in_dim(_as_bytes(x), layer, keepdims=False),
                             x.dtype), moment)
  return jax.lax.dynamic_index_in_dim(moment, layer, keepdims=keepdims)


def _as_bytes(x):
  # Sliced as raw bytes: the CPU backend widens float8 to float16 before any
  # op on it, and for moments read-only in a loop (the update by layer) it
  # hoists that widening out of the loop: the whole stack's codes in float16
  # (measured: +0.47 P on an 8-layer MLP). A bitcast leaves nothing to widen.
  return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype.itemsize == 1 else x


def _as_stored(x, dtype):
  return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _with_layer_slice(moment, value, layer):
  """``moment`` with layer ``layer``'s slice replaced by ``value``, in place."""
  if isinstance(moment, _quantize.QuantizedArray):
    return jax.tree.map(
        lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v, layer, 0), moment, value)
  return jax.lax.dynamic_update_index_in_dim(moment, value, layer, 0)


class _Reductions(NamedTuple):
  """How one device's share of a micro-batch becomes the whole micro-batch's.

  The identity on one device; under ``shard_map`` the collectives of the
  ZeRO stage (:func:`_data_parallel_reductions`).
  """

  loss: Callable[[jax.Array], jax.Array]
  aux: Callable[[Any], Any]
  # Flat lists of gradient leaves (outer leaves, or one layer's slices) in
  # the order of `specs`: each reduced and placed like its moment.
  outer_grads: Callable[[list[jax.Array]], list[jax.Array]]
  layer_grads: Callable[[list[jax.Array]], list[jax.Array]]
  all_finite: Callable[[jax.Array], jax.Array]
  # ("outer" or "layer", leaf index) -> the fold's whole_block_absmax for it
  # (see _adama.fold_leaf): a pmax where the mesh splits the leaf's blocks.
  whole_block_absmax: Callable[[str, int], Callable[[jax.Array], jax.Array]]
  # Lists of (m, v) seed pairs, one per leaf (the stack's, or the stack's
  # then the outer leaves'): each device's own where it holds a slice.
  layer_seeds: Callable[[list], list]
  outer_seeds: Callable[[list], list]
  # Flat lists of "split"'s floor increments (FactoredSquares) from the
  # reduced gradient leaves above, each made whole; with the leaves' shapes.
  outer_floors: Callable[[list, list[int]], list]
  layer_floors: Callable[[list, list[int]], list]
  # FSDP: this device's slices of the outer params, or of one layer's, made
  # whole (gathered); the identity where params are whole on every device.
  outer_params: Callable[[Any], Any]
  layer_params: Callable[[Any], Any]


_identity = lambda x: x
_increments = lambda increments, leaf_shapes: increments
_ONE_DEVICE = _Reductions(_identity, _identity, _identity, _identity, _identity,
                          lambda kind, i: _identity, _identity, _identity,
                          _increments, _increments, _identity, _identity)




def _release_micro_batch(staged, parts, has_aux, params, state, micro_batch, offloaded,
                         reductions: _Reductions = _ONE_DEVICE):
  """One micro-batch: forward, then a backward that folds layer by layer.

  ``offloaded``: which leaves of m, v and the floor live in host memory
  (:func:`_offloaded_state`, taken from the whole leaves: under
  ``shard_map`` ``state`` holds this device's slices).

  For AdamA's "split" estimator ``micro_batch`` comes as its two halves
  (``[2, B / 2, ...]`` leaves) and each stage runs on both (vmapped, the
  same FLOPs): activations and cotangents carry the leading axis of two, and
  each gradient leaf is taken per half, folded as their mean and half
  difference and dropped.
  """
  halves = _adama.takes_halves(state)
  per_half = lambda fn, in_axes: jax.vmap(fn, in_axes) if halves else fn
  outer, stacked = staged.split(params)
  outer = reductions.outer_params(outer)  # FSDP: gathered for the micro-batch
  x = per_half(staged.embed, (None, 0))(outer, micro_batch)
  block = per_half(staged.block, (None, 0, 0))
  # FSDP: each layer gathered as the scan reaches it, and again in the release.
  x, layer_inputs = jax.lax.scan(
      lambda x, layer_params: (block(reductions.layer_params(layer_params), x, micro_batch), x),
      x, stacked)
  head = functools.partial(_head_loss_and_grads, staged.head, has_aux)
  loss, aux, (outer_grads, x_grad) = per_half(head, (None, 0, 0))(outer, x, micro_batch)
  if halves:
    loss, aux = _steps.combine_halves((loss, aux))
  # The gradients below are of this device's mean loss; each is reduced to
  # the micro-batch's before it is folded, so the guard reads the global loss.
  loss = reductions.loss(loss)
  aux = None if aux is None else reductions.aux(aux)

  mu_outer, mu_stacked = staged.split(state.mu)
  nu_outer, nu_stacked = staged.split(state.nu)
  (mu_off_outer, mu_off_stacked), (nu_off_outer, nu_off_stacked) = map(
      staged.split, offloaded[:2])
  # "split"'s floor: decayed once here, then each gradient adds its part
  # (on the device throughout: offloaded, it comes in whole).
  floor_offloaded = offloaded[2]
  floor_outer, floor_stacked = (None, None) if not _adama.floors_split(state) else staged.split(
      _adama.decayed_floor(state._replace(
          nu_floor=_offload.to_device(state.nu_floor, floor_offloaded)), parts.config))
  layer_pullback = per_half(functools.partial(_pullback, staged.block), ((None, 0), 0, 0))
  x_grad, mu_stacked, nu_stacked, floor_stacked, stack_finite = _release_stack(
      parts, state, micro_batch, loss, stacked, layer_inputs, x_grad,
      mu_stacked, nu_stacked, floor_stacked, (mu_off_stacked, nu_off_stacked),
      reductions, layer_pullback, halves)
  embed_pullback = per_half(functools.partial(_pullback, staged.embed),
                            ((None,), 0, 0))
  (embed_grads,) = embed_pullback((outer,), micro_batch, x_grad)
  outer_grads = jax.tree.map(operator.add, outer_grads, embed_grads)
  stacked_def = jax.tree.structure(stacked)
  mu_outer, nu_outer, floor_outer, outer_finite = _fold_outer(
      parts, state, loss, outer_grads, mu_outer, nu_outer, floor_outer,
      [jnp.shape(p) for p in jax.tree.leaves(outer)],
      stacked_def.flatten_up_to(mu_stacked), stacked_def.flatten_up_to(nu_stacked),
      (mu_off_outer, nu_off_outer), reductions, halves)
  all_finite = reductions.all_finite(outer_finite & stack_finite)
  mu = _like(state.mu, staged.merge(mu_outer, mu_stacked))
  nu = _like(state.nu, staged.merge(nu_outer, nu_stacked))
  floor = None if floor_outer is None else _offload.to_host(
      _like(state.nu_floor, staged.merge(floor_outer, floor_stacked)), floor_offloaded)
  return _adama.advance_counters(state, mu, nu, all_finite, floor), loss, aux


def _head_loss_and_grads(head, has_aux, outer, x, micro_batch):
  """``(loss, aux, (outer cotangent, x cotangent))`` of the head stage."""
  if has_aux:
    loss, head_vjp, aux = jax.vjp(lambda o, x: head(o, x, micro_batch), outer, x,
                                  has_aux=True)
  else:
    (loss, head_vjp), aux = jax.vjp(lambda o, x: head(o, x, micro_batch), outer, x), None
  return loss, aux, head_vjp(jnp.ones_like(loss))


def _pullback(stage, primals, micro_batch, cotangent):
  """Cotangents of ``stage(*primals, micro_batch)`` for ``cotangent``.

  The stage's forward is recomputed from ``primals``: only they were kept.
  """
  _, stage_vjp = jax.vjp(lambda *p: stage(*p, micro_batch), *primals)
  return stage_vjp(cotangent)


def _gradient_and_difference(grads: list, halves: bool, reduce) -> tuple[list, list]:
  """Flat gradient leaves as folded: ``(g, d)``, both reduced by ``reduce``.

  With ``halves`` each leaf is ``[2, ...]``, one gradient per half; ``g`` is
  their mean and ``d`` their half difference (reductions are linear, so on a
  mesh ``d`` is the half difference of the whole micro-batch's halves).
  Otherwise ``d`` is ``None`` per leaf.
  """
  if not halves:
    return reduce(grads), [None] * len(grads)
  return reduce(_steps.mean_of_halves(grads)), reduce(_steps.half_difference(grads))


def _release_stack(parts, state, micro_batch, loss, stacked, layer_inputs,
                   x_grad, mu_stacked, nu_stacked, floor_stacked, offloaded, reductions,
                   layer_pullback, halves):
  """The backward through the stack as a reverse scan over its layers.

  Each step takes one layer's vjp from its saved input, folds that layer's
  gradient into its slice of m and v (in place in the carry) and passes the
  input cotangent down; one layer's gradient is alive at a time.
  ``layer_pullback((layer_params, layer_input), micro_batch, x_grad)`` gives
  ``(layer cotangent, input cotangent)``, per half with ``halves``.
  ``offloaded``: the stack's ``(m, v)`` host-memory flags.

  Returns:
    The cotangent of the stack's input, the new stacked m, v and floor
    (``None`` without halves), and whether every layer's gradient was finite.
  """
  stacked_def = jax.tree.structure(stacked)
  mu_leaves = stacked_def.flatten_up_to(mu_stacked)
  nu_leaves = stacked_def.flatten_up_to(nu_stacked)
  floor_leaves = None if floor_stacked is None else stacked_def.flatten_up_to(floor_stacked)
  # One seed pair per leaf, as scale_by_adama draws them; a layer's slice
  # mixes in its index so no two layers share rounding noise.
  seeds = reductions.layer_seeds(_adama.leaf_seeds(parts.config, state, mu_leaves, nu_leaves))
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  offloaded = list(zip(*map(stacked_def.flatten_up_to, offloaded)))

  def release_layer(carry, xs):
    x_grad, mus, nus, floors = carry
    layer, layer_params, layer_input = xs
    layer_params = reductions.layer_params(layer_params)
    # The whole leaves' shapes (under FSDP `stacked` holds this device's slices).
    leaf_shapes = [(num_layers,) + jnp.shape(x) for x in jax.tree.leaves(layer_params)]
    layer_grads, x_grad = layer_pullback((layer_params, layer_input), micro_batch, x_grad)
    layer_grads, differences = _gradient_and_difference(
        stacked_def.flatten_up_to(_steps.poison_if_loss_nonfinite(loss, layer_grads)), halves,
        reductions.layer_grads)
    new_mus, new_nus, finite = [], [], []
    for i, (grad, d, mu, nu, (mu_off, nu_off), leaf_seeds) in enumerate(zip(
        layer_grads, differences, mus, nus, offloaded, seeds)):
      layer_seeds = tuple(
          None if s is None else _quantize.mix_seed(s, layer) for s in leaf_seeds)
      # Offloaded moments: only this layer's slice comes to the device.
      m, v, leaf_finite = _adama.fold_leaf(
          grad, _offload.to_device(_layer_slice(mu, layer, num_layers), mu_off),
          _offload.to_device(_layer_slice(nu, layer, num_layers), nu_off),
          state, parts.config, layer_seeds, d,
          whole_block_absmax=reductions.whole_block_absmax("layer", i))
      new_mus.append(_with_layer_slice(mu, _offload.to_host(m, mu_off), layer))
      new_nus.append(_with_layer_slice(nu, _offload.to_host(v, nu_off), layer))
      finite.append(leaf_finite)
    if floors is not None:
      increments = reductions.layer_floors(
          [_adama.floor_increment(g, d, state, parts.config, n)
           for g, d, n in zip(layer_grads, differences, leaf_shapes)], leaf_shapes)
      floors = [_floor.add_layer_floor(f, inc, layer) for f, inc in zip(floors, increments)]
    # The flags leave as scan outputs, not carry: under shard_map they vary
    # over devices, a carry that starts as a constant does not.
    return (x_grad, new_mus, new_nus, floors), functools.reduce(operator.and_, finite)

  (x_grad, mu_leaves, nu_leaves, floor_leaves), layer_finite = jax.lax.scan(
      release_layer, (x_grad, mu_leaves, nu_leaves, floor_leaves),
      (jnp.arange(num_layers, dtype=jnp.int32), stacked, layer_inputs), reverse=True)
  floor_stacked = None if floor_leaves is None else stacked_def.unflatten(floor_leaves)
  return (x_grad, stacked_def.unflatten(mu_leaves), stacked_def.unflatten(nu_leaves),
          floor_stacked, jnp.all(layer_finite))


def _fold_outer(parts, state, loss, outer_grads, mu_outer, nu_outer, floor_outer,
                leaf_shapes, stacked_mus, stacked_nus, offloaded, reductions, halves):
  """Folds the unstacked leaves' gradients (embedding, head) whole.

  ``leaf_shapes``: the outer params' (whole) shapes, which decide how the
  floor is factored (on a mesh a gradient here may be a device's slice).
  ``stacked_mus`` / ``stacked_nus``: the stack's moment leaves, whose seeds
  come first. ``offloaded``: the outer ``(m, v)`` host-memory flags.
  Returns the new outer m, v and floor (``None`` without
  halves) and whether every gradient was finite.
  """
  outer_grads = _steps.poison_if_loss_nonfinite(loss, outer_grads)
  grads, outer_def = jax.tree.flatten(outer_grads)
  grads, differences = _gradient_and_difference(grads, halves, reductions.outer_grads)
  mus, nus = outer_def.flatten_up_to(mu_outer), outer_def.flatten_up_to(nu_outer)
  flags = list(zip(*map(outer_def.flatten_up_to, offloaded)))
  # Seeds past the stack's, so outer leaves never reuse a stacked leaf's.
  num_stacked = len(stacked_mus)
  outer_seeds = reductions.outer_seeds(_adama.leaf_seeds(
      parts.config, state, stacked_mus + mus, stacked_nus + nus))
  folded = [
      _fold_offloaded_leaf(g, m, v, flag, state, parts, leaf_seeds, d,
                           reductions.whole_block_absmax("outer", i))
      for i, (g, d, m, v, flag, leaf_seeds) in enumerate(zip(
          grads, differences, mus, nus, flags, outer_seeds[num_stacked:]))]
  new_mus, new_nus, finite = zip(*folded) if folded else ((), (), ())
  if floor_outer is not None:
    increments = reductions.outer_floors(
        [_adama.floor_increment(g, d, state, parts.config, n)
         for g, d, n in zip(grads, differences, leaf_shapes)], leaf_shapes)
    floor_outer = outer_def.unflatten([
        _floor.add_floor(f, inc)
        for f, inc in zip(outer_def.flatten_up_to(floor_outer), increments)])
  return (outer_def.unflatten(new_mus), outer_def.unflatten(new_nus), floor_outer,
          functools.reduce(operator.and_, finite, jnp.array(True)))


def _offloaded_state(state, parts):
  """``(m's, v's, the floor's)`` flags of :func:`_offload.offloaded_leaves`:
  per leaf, whether it lives in host memory. Taken from the whole leaves of
  ``state`` (under ``shard_map`` a device sees slices, smaller than
  ``min_size`` where the whole leaf is not)."""
  return _offload.offloaded_leaves((state.mu, state.nu, state.nu_floor),
                                   parts.offload_min_size)


def _fold_offloaded_leaf(grad, mu, nu, offloaded, state, parts, seeds, half_difference=None,
                         whole_block_absmax=_identity):
  """:func:`_adama.fold_leaf` of a whole leaf (or this device's slice of it),
  its moments brought in and sent back where ``offloaded = (m's, v's flags)``
  says they live in host memory."""
  mu_off, nu_off = offloaded
  m, v, finite = _adama.fold_leaf(
      grad, _offload.to_device(mu, mu_off), _offload.to_device(nu, nu_off), state,
      parts.config, seeds, half_difference, whole_block_absmax)
  return _offload.to_host(m, mu_off), _offload.to_host(v, nu_off), finite


def _like(reference: Any, tree: Any) -> Any:
  """``tree``'s leaves in ``reference``'s tree structure.

  Splitting and merging may change container types along the way (indexing an
  ``nnx.State`` wraps nested dicts in ``State``); mappings flatten in key
  order either way, so the leaves line up.
  """
  treedef, leaves = jax.tree.structure(reference), jax.tree.leaves(tree)
  if treedef.num_leaves != len(leaves):
    raise ValueError(
        f"StagedLoss.merge rebuilt {len(leaves)} leaves, the params have "
        f"{treedef.num_leaves}.")
  return treedef.unflatten(leaves)


def _apply_emitted(staged, parts, params, state, inner_state, sharded_update,
                   offloaded=None, split=None):
  """``(params, inner_state)`` after the mini-batch's update (zero unless it emits).

  ``sharded_update(params, updates)`` applies an update split like the
  moments (ZeRO); ``None``: params and update are whole on every device.
  Offloaded moments (``offloaded``: :func:`_offloaded_state`) are applied a
  layer at a time; ``split(apply_by_layer) -> (params, inner_state)`` runs
  that on a ZeRO-1/2 mesh (:func:`_split_by_layer`).
  """
  if parts.offload_min_size is not None:
    apply = functools.partial(_apply_by_layer, staged, parts, offloaded=offloaded)
    if sharded_update is None or split is None:
      return apply(params, state, inner_state)
    return split(apply, params, state, inner_state)
  updates = _adama.emitted_direction(state, params, parts.config)
  if parts.inner is not None:
    updates, inner_state = _adama.per_mini_batch_update(
        parts.inner, updates, state, inner_state, params)
  if sharded_update is None:
    return _steps.apply_updates(params, updates), inner_state
  return sharded_update(params, updates), inner_state


class _Split(NamedTuple):
  """Inside ``shard_map`` under ZeRO-1/2: each device's slices of whole
  params and the gather back, for the outer leaves and for ``[1, ...]``
  layer slices (flat lists of leaves)."""

  outer: Callable[[list], list]
  outer_whole: Callable[[list], list]
  layer: Callable[[list], list]
  layer_whole: Callable[[list], list]


_WHOLE = _Split(_identity, _identity, _identity, _identity)


def _split_by_layer(staged, slices, state_specs, mesh, data_axis):
  """``(apply_by_layer, params, state, inner_state) -> (params, inner_state)``
  for offloaded moments under ZeRO-1/2: :func:`_apply_by_layer` in
  ``shard_map``, each device on its slice of each layer's moments (brought
  in from host memory), adding it to its slice of the params and gathering
  the layer, as :func:`_apply_sharded_updates` does."""
  num_devices = _sharding.num_devices(mesh, data_axis)
  outer_specs, stacked_specs = (jax.tree.leaves(tree, is_leaf=_is_spec)
                                for tree in staged.split(_specs(slices)))

  def local(leaves, specs):
    return [_local_slice(x, spec, data_axis, num_devices) for x, spec in zip(leaves, specs)]

  def whole(leaves, specs):
    gather = lambda x, dim: jax.lax.all_gather(x, data_axis, axis=dim, tiled=True)
    return [x if _sharding.split_dim(spec) is None else gather(x, _sharding.split_dim(spec))
            for x, spec in zip(leaves, specs)]

  split = _Split(outer=lambda leaves: local(leaves, outer_specs),
                 outer_whole=lambda leaves: whole(leaves, outer_specs),
                 layer=lambda leaves: local(leaves, stacked_specs),
                 layer_whole=lambda leaves: whole(leaves, stacked_specs))

  def run(apply_by_layer, params, state, inner_state):
    replicated = jax.tree.map(lambda _: PartitionSpec(), inner_state)
    specs = _adama.with_estimator(state_specs, state.nu_estimator)
    # Gathered leaves are the same on every device (see _apply_sharded_updates).
    return jax.shard_map(
        lambda p, st, i: apply_by_layer(p, st, i, split=split), mesh=mesh,
        in_specs=(PartitionSpec(), specs, replicated),
        out_specs=(PartitionSpec(), replicated), check_vma=False)(params, state, inner_state)

  return run


_is_spec = lambda x: isinstance(x, PartitionSpec)


def _apply_by_layer(staged, parts, params, state, inner_state, offloaded=None,
                    split: _Split = _WHOLE):
  """``(params, inner_state)`` after the emitted update, a layer at a time.

  For offloaded moments: the direction of a whole stacked leaf would bring
  the stack's moments to the device at once. Here the outer leaves are
  updated first, then a scan over the layers brings in one layer's slice of
  m and v, computes its direction, runs ``inner`` on it and adds it to the
  layer's params in place. ``inner`` sees params-shaped trees whose other
  leaves are zeros it does not use (elementwise transforms, checked by their
  state); its state advances once, from the outer call. ``offloaded``:
  :func:`_offloaded_state` of the whole state (``None``: of ``state``);
  ``split``: under ZeRO-1/2 in ``shard_map``, each device's slices
  (:func:`_split_by_layer`).
  """
  inner = parts.inner
  if inner is not None and any(jnp.ndim(x) > 0 for x in jax.tree.leaves(inner_state)):
    raise NotImplementedError(
        "release_step with offload_moments runs the transforms chained after "
        "AdamA one layer at a time, which needs them elementwise with a state "
        "of scalars (learning rate, schedule, weight decay); this chain keeps "
        "per-parameter state.")
  if offloaded is None:
    offloaded = _offloaded_state(state, parts)
  emit = _adama.emitted(state)
  direction = _adama.direction_args(state, parts.config)

  def leaf_direction(m, v, p, floor, m_offloaded, v_offloaded):
    m, v = _offload.to_device(m, m_offloaded), _offload.to_device(v, v_offloaded)
    return _adama.gated_direction_of_leaf(m, v, p, emit, direction, floor)

  def chained(outer, stacked, outer_params, stacked_params):
    """``inner`` on the tree of ``outer`` and ``stacked`` updates."""
    updates = _like(params, staged.merge(outer, stacked))
    if inner is None:
      return updates, inner_state
    return _adama.per_mini_batch_update(
        inner, updates, state, inner_state,
        _like(params, staged.merge(outer_params, stacked_params)))

  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  outer, stacked = staged.split(params)
  (mu_outer, mu_stacked), (nu_outer, nu_stacked) = map(staged.split, (state.mu, state.nu))
  (mu_off_outer, mu_off_stacked), (nu_off_outer, nu_off_stacked) = map(
      staged.split, offloaded[:2])
  outer_def, stacked_def = jax.tree.structure(outer), jax.tree.structure(stacked)
  if _adama.floors_split(state):
    floor_outer, floor_stacked = staged.split(_offload.to_device(state.nu_floor, offloaded[2]))
    outer_floors = split.outer(
        [_floor.floor_estimate(f) for f in outer_def.flatten_up_to(floor_outer)])
    stacked_floors = stacked_def.flatten_up_to(floor_stacked)
  else:
    outer_floors, stacked_floors = [None] * outer_def.num_leaves, None
  # Under ZeRO-1/2 this device's slices of the (whole) outer params.
  local_outer = outer_def.unflatten(split.outer(jax.tree.leaves(outer)))
  outer_dirs = outer_def.unflatten([
      leaf_direction(m, v, p, f, m_off, v_off)
      for m, v, p, f, m_off, v_off in zip(
          outer_def.flatten_up_to(mu_outer), outer_def.flatten_up_to(nu_outer),
          jax.tree.leaves(local_outer), outer_floors,
          outer_def.flatten_up_to(mu_off_outer), outer_def.flatten_up_to(nu_off_outer))])
  updates, new_inner_state = chained(outer_dirs, zeros(stacked), local_outer, stacked)
  new_outer = outer_def.unflatten(split.outer_whole(jax.tree.leaves(
      _steps.apply_updates(local_outer, staged.split(updates)[0]))))

  mus, nus = stacked_def.flatten_up_to(mu_stacked), stacked_def.flatten_up_to(nu_stacked)
  flags = list(zip(stacked_def.flatten_up_to(mu_off_stacked),
                   stacked_def.flatten_up_to(nu_off_stacked)))
  num_layers = jax.tree.leaves(stacked)[0].shape[0]

  def update_layer(stacked, layer):
    # [1, ...] slices: the chained transforms see each leaf at its rank.
    layer_params = stacked_def.unflatten(split.layer([
        jax.lax.dynamic_slice_in_dim(p, layer, 1, 0) for p in jax.tree.leaves(stacked)]))
    floors = ([None] * len(mus) if stacked_floors is None else
              split.layer([_floor.floor_layer_estimate(f, layer) for f in stacked_floors]))
    dirs = stacked_def.unflatten([
        leaf_direction(_layer_slice(m, layer, num_layers, keepdims=True),
                       _layer_slice(v, layer, num_layers, keepdims=True), p, f, *flag)
        for m, v, p, f, flag in zip(mus, nus, jax.tree.leaves(layer_params), floors, flags)])
    updates, _ = chained(zeros(local_outer), dirs, local_outer, layer_params)
    new = split.layer_whole(jax.tree.leaves(
        _steps.apply_updates(layer_params, staged.split(updates)[1])))
    return stacked_def.unflatten([
        jax.lax.dynamic_update_slice_in_dim(p, n, layer, 0)
        for p, n in zip(jax.tree.leaves(stacked), new)]), None

  stacked, _ = jax.lax.scan(update_layer, stacked, jnp.arange(num_layers, dtype=jnp.int32))
  return _like(params, staged.merge(new_outer, stacked)), new_inner_state
