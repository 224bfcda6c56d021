"""The fused micro-batch step: equivalences, donation, dtypes and bad input."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP
from flax import nnx

import models
import optax_adama
from models import harness
from optax_adama import _microbatch
from optax_adama import _steps

MODEL = MLP(num_layers=3, width=8)
BATCH, WIDTH = 12, MODEL.width
_params = MODEL.params
loss_fn = MODEL.loss


def _batch(seed=1, size=BATCH):
  return MODEL.batch(seed, size)


def _copy(tree):
  return jax.tree.map(jnp.array, tree)


def _per_micro_batch_reference(tx, params, state, batch, num_micro_batches):
  """The plain optax path: one update per micro-batch, micro-batch i = rows i::N."""
  for i in range(num_micro_batches):
    micro = jax.tree.map(lambda x: x[i::num_micro_batches], batch)
    grads = jax.grad(loss_fn)(params, micro)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("num_micro_batches", [1, 3, 4])
def test_fused_step_equals_per_micro_batch_path(num_micro_batches):
  # Both sides run "mean": the reference passes no half difference, and
  # "auto" would read "split" in the fused step (test_defaults.py).
  tx = optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=num_micro_batches)
  params = _params()
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=num_micro_batches)
  fused_params, fused_state = _copy(params), tx.init(params)
  ref_params, ref_state = params, tx.init(params)
  for seed in range(3):
    batch = _batch(seed)
    fused_params, fused_state, metrics = step(fused_params, fused_state, batch)
    ref_params, ref_state = _per_micro_batch_reference(
        tx, ref_params, ref_state, batch, num_micro_batches)
  # Same ops in the same order, but XLA fuses them differently inside the scan:
  # float32 rounding only (1e-6 relative per op, a few steps).
  chex.assert_trees_all_close(fused_params, ref_params, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(fused_state, ref_state, rtol=1e-5, atol=1e-7)
  assert int(metrics["num_dropped"]) == 0


# N = 3 (odd) keeps the smoke in the default run; N = 2 with the slow tests.
@pytest.mark.parametrize("num_micro_batches", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_split_estimator_step_equals_per_micro_batch_halves(num_micro_batches):
  tx = optax_adama.contrib.adamaw(1e-2, weight_decay=0.1, num_micro_batches=num_micro_batches,
                          nu_estimator="split")
  params = _params()
  step = optax_adama.microbatch_step(loss_fn, tx)
  fused_params, fused_state = _copy(params), tx.init(params)
  ref_params, ref_state = params, tx.init(params)
  for seed in range(3):
    batch = _batch(seed)
    fused_params, fused_state, metrics = step(fused_params, fused_state, batch)
    for i in range(num_micro_batches):
      micro = jax.tree.map(lambda x: x[i::num_micro_batches], batch)
      half = len(micro["x"]) // 2
      g_a, g_b = (jax.grad(loss_fn)(ref_params, jax.tree.map(lambda x: x[rows], micro))
                  for rows in (slice(None, half), slice(half, None)))
      updates, ref_state = tx.update(
          jax.tree.map(lambda a, b: (a + b) / 2, g_a, g_b), ref_state, ref_params,
          half_difference=jax.tree.map(lambda a, b: (a - b) / 2, g_a, g_b))
      ref_params = optax.apply_updates(ref_params, updates)
  # float32 rounding only, as in the test above.
  chex.assert_trees_all_close(fused_params, ref_params, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(fused_state, ref_state, rtol=1e-5, atol=1e-7)
  assert int(metrics["num_dropped"]) == 0


@pytest.mark.parametrize("nu_estimator", ["mean", "momentum", "split"])
def test_bare_adama_folds_then_updates_once_as_chained_adama_updates_per_micro_batch(
    nu_estimator):
  # A bare AdamA is folded in the scan and updated once after it; inside
  # optax.chain the step cannot see it and calls tx.update per micro-batch.
  # The same results (float32 rounding, as above), a dropped micro-batch and
  # a schedule included.
  schedule = optax.linear_schedule(1e-2, 1e-3, 4)
  bare = optax_adama.contrib.adamaw(schedule, weight_decay=0.1, num_micro_batches=3,
                            nu_estimator=nu_estimator)
  chained = optax.chain(optax_adama.contrib.adamaw(schedule, weight_decay=0.1, num_micro_batches=3,
                                           nu_estimator=nu_estimator))
  results = []
  for tx in (bare, chained):
    step = optax_adama.microbatch_step(loss_fn, tx)
    params = _copy(_params())
    state = tx.init(params)
    for seed in range(4):
      batch = _batch(seed)
      if seed == 2:
        batch = _poison_micro_batch(batch, 1, 3)
      params, state, metrics = step(params, state, batch)
      assert int(metrics["num_dropped"]) == (seed == 2)
    results.append((params, optax_adama.find_adama_state(state)))
  (bare_params, bare_state), (chained_params, chained_state) = results
  chex.assert_trees_all_close(bare_params, chained_params, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(bare_state, chained_state, rtol=1e-5, atol=1e-7)


def _scan_carry_sizes(fn, *args):
  """``num_carry`` of every ``lax.scan`` in ``fn``'s jaxpr, nested ones included."""
  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        yield eqn.params["num_carry"]
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns"):
          yield from visit(inner)
  return list(visit(jax.make_jaxpr(fn)(*args).jaxpr))


def test_bare_adama_scan_carries_the_state_not_the_params():
  # Params are a constant of the fold scan: no params-sized read and write
  # per micro-batch, and never more memory than the per-micro-batch path.
  model = MLP(num_layers=8, width=256)
  params, batch = model.abstract_params(), model.abstract_batch(32)
  carries, totals = {}, {}
  # "mean" on both: the chained path takes one update per micro-batch, where
  # "auto" reads "mean"; the bare fold would read "split".
  make = lambda: optax_adama.adama(1e-3, num_micro_batches=4)
  for name, tx in {"bare": make(), "chained": optax.chain(make())}.items():
    step = optax_adama.microbatch_step(model.loss, tx)
    state = jax.eval_shape(tx.init, params)
    carries[name] = set(_scan_carry_sizes(step, params, state, batch))
    totals[name] = optax_adama.memory_report(step, params, state, batch).total_bytes
  num_params = len(jax.tree.leaves(params))
  assert carries["bare"] == {c - num_params for c in carries["chained"]}
  assert totals["bare"] <= totals["chained"]


def test_split_estimator_needs_even_micro_batches():
  tx = optax_adama.contrib.adama(1e-2, num_micro_batches=4, nu_estimator="split")
  step = optax_adama.microbatch_step(loss_fn, tx)
  params = _params()
  with pytest.raises(ValueError, match="micro-batch size must be even, got 3"):
    step(params, tx.init(params), _batch(size=12))


def test_accumulation_baseline_equals_full_batch_adam():
  tx = optax.adam(1e-2)
  params = _params()
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=4)
  state = tx.init(params)
  ref_params, ref_state = params, tx.init(params)
  params = _copy(params)
  for seed in range(3):
    batch = _batch(seed)
    with jax.numpy_dtype_promotion("standard"):  # optax.adam needs it
      params, state, metrics = step(params, state, batch)
      loss, grads = jax.value_and_grad(loss_fn)(ref_params, batch)
      updates, ref_state = tx.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    # Equal-sized micro-batches: the mean of micro-batch means is the mean.
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)
  assert int(metrics["num_dropped"]) == 0


def test_multisteps_runs_one_update_per_micro_batch():
  tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)
  assert _microbatch.updates_every_micro_batch(tx.init(_params()))
  params = _params()
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=3)
  state = tx.init(params)
  ref_params, ref_state = params, tx.init(params)
  params = _copy(params)
  for seed in range(2):
    batch = _batch(seed)
    with jax.numpy_dtype_promotion("standard"):  # optax.adam needs it
      params, state, _ = step(params, state, batch)
      ref_params, ref_state = _per_micro_batch_reference(
          tx, ref_params, ref_state, batch, 3)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)


def test_adama_inside_chain_is_detected():
  tx = optax.chain(optax.identity(), optax_adama.adama(1e-2, num_micro_batches=2))
  assert _microbatch.updates_every_micro_batch(tx.init(_params()))
  assert not _microbatch.updates_every_micro_batch(optax.adam(1e-2).init(_params()))


def test_micro_batches_are_column_major():
  batch = {"x": jnp.arange(12).reshape(12, 1)}
  micro = _steps.split_micro_batches(batch, 3)
  np.testing.assert_array_equal(micro["x"][1, :, 0], [1, 4, 7, 10])


def test_batch_that_does_not_split_raises_value_error_naming_both():
  tx = optax_adama.adama(1e-2, num_micro_batches=5)
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=5)
  params = _params()
  with pytest.raises(ValueError, match=r"batch size 12 .*num_micro_batches=5.*of a "
                     r"multiple of 5 rows \(e\.g\. 10\)"):
    step(params, tx.init(params), _batch())
  with pytest.raises(ValueError, match=r"batch size 3 .*\(e\.g\. 5\)"):  # fewer rows than N
    step(params, tx.init(params), jax.tree.map(lambda x: x[:3], _batch()))
  # Nothing was lost: the failed call did not consume the donated buffers.
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_batch_leaves_must_share_batch_size():
  with pytest.raises(ValueError, match="share one leading batch size"):
    _steps.split_micro_batches({"a": jnp.zeros((4, 2)), "b": jnp.zeros(6)}, 2)


def test_num_micro_batches_below_one_raises_at_construction():
  with pytest.raises(ValueError, match="num_micro_batches must be >= 1, got 0"):
    optax_adama.microbatch_step(loss_fn, optax.adam(1.0), num_micro_batches=0)


@pytest.mark.parametrize("make_tx", [
    lambda: optax_adama.adama(1e-2, num_micro_batches=2),
    lambda: optax.adam(1e-2),
], ids=["adama", "accumulation"])
def test_donation_deletes_inputs_without_warning_or_recompilation(make_tx):
  tx = make_tx()
  # Counts traces through a public route: a recompilation retraces the loss.
  chex.clear_trace_counter()  # the counter is keyed by source, shared by params
  traced_loss = chex.assert_max_traces(lambda p, b: loss_fn(p, b), n=1)
  step = optax_adama.microbatch_step(traced_loss, tx, num_micro_batches=2)
  params = _params()
  state = tx.init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "donated buffers were not usable" fails
    with jax.numpy_dtype_promotion("standard"):
      new_params, new_state, _ = step(params, state, _batch(0))
      assert all(x.is_deleted() for x in jax.tree.leaves((params, state)))
      new_params, new_state, _ = step(new_params, new_state, _batch(1))


def test_bf16_params_with_float32_moments_in_scan():
  tx = optax_adama.adama(1e-2, num_micro_batches=4, mu_dtype=jnp.float32,
                         nu_dtype=jnp.float32)
  params = _params(jnp.bfloat16)
  state = tx.init(params)
  dtypes = jax.tree.map(lambda x: x.dtype, (params, state))
  chex.clear_trace_counter()
  step = optax_adama.microbatch_step(
      chex.assert_max_traces(lambda p, b: loss_fn(p, b), n=1), tx,
      num_micro_batches=4)
  losses = []
  for _seed in range(5):
    params, state, metrics = step(params, state, _batch(0))
    losses.append(float(metrics["loss"]))
    assert jax.tree.map(lambda x: x.dtype, (params, state)) == dtypes
  adama_state = optax_adama.find_adama_state(state)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adama_state.mu))
  assert losses[-1] < losses[0]  # it trains in bf16; and compiled once


def test_nonfinite_loss_micro_batch_is_dropped_whole():
  # Against a per-update reference without halves: "mean" on both sides.
  tx = optax_adama.adama(1e-2, num_micro_batches=3)
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=3)
  batch = _batch(0)
  # Row 1 goes to micro-batch 1 (rows 1::3): a NaN input poisons its loss.
  poisoned = {**batch, "y": batch["y"].at[1, 0].set(jnp.nan)}
  params = _params()
  params, state, metrics = step(_copy(params), tx.init(params), poisoned)
  assert int(metrics["num_dropped"]) == 1
  assert int(metrics["num_nonfinite_losses"]) == 1
  assert np.isfinite(float(metrics["loss"]))
  for leaf in jax.tree.leaves((params, state)):
    assert bool(jnp.all(jnp.isfinite(leaf)))
  # Equals the same step on the two healthy micro-batches plus a zero gradient.
  ref_params = _params()
  ref_state = tx.init(ref_params)
  for i in range(3):
    micro = jax.tree.map(lambda x: x[i::3], batch)
    grads = jax.grad(loss_fn)(ref_params, micro)
    if i == 1:
      grads = jax.tree.map(jnp.zeros_like, grads)
    updates, ref_state = tx.update(grads, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_tx", [
    lambda: optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=2),
    lambda: optax.adamw(1e-2, weight_decay=0.5),
], ids=["adama", "accumulation"])
def test_all_micro_batches_dropped_leaves_params_unchanged(make_tx):
  tx = make_tx()
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=2)
  params = _params()
  with jax.numpy_dtype_promotion("standard"):  # optax.adamw needs it
    params, state, _ = step(params, tx.init(params), _batch(0))
    before = _copy(params)
    nan_batch = {**_batch(1), "x": jnp.full((BATCH, WIDTH), jnp.nan)}
    params, state, metrics = step(params, state, nan_batch)
  chex.assert_trees_all_equal(params, before)
  assert int(metrics["num_dropped"]) == 2
  assert np.isnan(float(metrics["loss"]))  # no finite loss to average
  if optax_adama.find_adama_state(state) is not None:
    assert not bool(optax_adama.has_updated(state))


def test_has_aux_returns_stacked_aux():
  def loss_with_aux(params, batch):
    loss = loss_fn(params, batch)
    return loss, {"loss_copy": loss, "rows": jnp.asarray(batch["x"].shape[0])}

  tx = optax_adama.adama(1e-2, num_micro_batches=3)
  step = optax_adama.microbatch_step(
      loss_with_aux, tx, num_micro_batches=3, has_aux=True)
  params = _params()
  _, _, metrics = step(params, tx.init(params), _batch(0))
  np.testing.assert_array_equal(metrics["aux"]["rows"], [4, 4, 4])
  np.testing.assert_allclose(
      jnp.mean(metrics["aux"]["loss_copy"]), metrics["loss"], rtol=1e-6)


def test_num_micro_batches_is_taken_from_the_adama_state():
  tx = optax_adama.adama(1e-2, num_micro_batches=3)
  implicit = optax_adama.microbatch_step(loss_fn, tx)
  explicit = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=3)
  params = _params()
  got, _, _ = implicit(_copy(params), tx.init(params), _batch(0))
  want, _, _ = explicit(_copy(params), tx.init(params), _batch(0))
  chex.assert_trees_all_equal(got, want)


def test_num_micro_batches_mismatch_raises_before_any_buffer_is_used():
  tx = optax_adama.adama(1e-2, num_micro_batches=4)
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=2)
  params = _params()
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"num_micro_batches=2.*num_micro_batches=4"):
    step(params, state, _batch(0))
  assert not any(x.is_deleted() for x in jax.tree.leaves((params, state)))


def test_num_micro_batches_needed_without_adama():
  step = optax_adama.microbatch_step(loss_fn, optax.adam(1e-2))
  params = _params()
  with pytest.raises(ValueError, match="needs num_micro_batches"):
    step(params, optax.adam(1e-2).init(params), _batch(0))


def _poison_micro_batch(batch, micro, num_micro_batches):
  """NaN in one row of micro-batch ``micro`` (rows micro::N)."""
  return {**batch, "y": batch["y"].at[micro, 0].set(jnp.nan)}


def test_accumulation_drops_a_nonfinite_micro_batch_and_counts_it():
  tx = optax.adam(1e-2)
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=3)
  batch = _batch(0)
  params = _params()
  with jax.numpy_dtype_promotion("standard"):  # optax.adam needs it
    got, _, metrics = step(_copy(params), tx.init(params),
                           _poison_micro_batch(batch, 1, 3))
    # Reference: the mean over N of the healthy micro-batch gradients, with a
    # zero gradient in place of the dropped one (AdamA's rule).
    grads = [jax.grad(loss_fn)(params, jax.tree.map(lambda x: x[i::3], batch))
             for i in (0, 2)]
    mean = jax.tree.map(lambda a, b: (a + b) / 3, *grads)
    updates, _ = tx.update(mean, tx.init(params), params)
  chex.assert_trees_all_close(got, optax.apply_updates(params, updates),
                              rtol=1e-5, atol=1e-6)
  assert int(metrics["num_dropped"]) == 1
  assert int(metrics["num_nonfinite_losses"]) == 1


@pytest.mark.parametrize("make_tx", [
    lambda: optax.adam(1e-2),
    lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
], ids=["accumulation", "multisteps"])
def test_baselines_never_turn_params_nonfinite(make_tx):
  tx = make_tx()
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=2)
  params = _params()
  state = tx.init(params)
  with jax.numpy_dtype_promotion("standard"):
    params, state, _ = step(params, state, _batch(0))
    params, state, metrics = step(params, state, _poison_micro_batch(_batch(1), 0, 2))
  assert int(metrics["num_dropped"]) == 1
  for leaf in jax.tree.leaves((params, state)):
    assert bool(jnp.all(jnp.isfinite(leaf)))


def test_params_sharing_one_buffer_raise_a_clear_error():
  tx = optax_adama.adama(1e-2, num_micro_batches=2)
  step = optax_adama.microbatch_step(loss_fn, tx)
  params = _params()
  params["layer2"]["b"] = params["layer1"]["b"]  # one jnp.zeros, two leaves
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"params\['layer1'\]\['b'\] and "
                     r"params\['layer2'\]\['b'\] are the same array"):
    step(params, state, _batch(0))
  assert not any(x.is_deleted() for x in jax.tree.leaves((params, state)))
  # The fix the message gives works.
  params = jax.tree.map(jnp.copy, params)
  step(params, tx.init(params), _batch(0))


def test_lower_is_available_for_compile_only_use():
  tx = optax_adama.adama(1e-2, num_micro_batches=2)
  step = optax_adama.microbatch_step(loss_fn, tx)
  params = MODEL.abstract_params()
  state = jax.eval_shape(tx.init, params)
  compiled = step.lower(params, state, MODEL.abstract_batch(BATCH)).compile()
  assert compiled.memory_analysis() is not None


def test_bfloat16_accumulator_is_adam_up_to_its_rounding():
  tx = optax.adam(1e-2)
  params = _params()
  steps = {dtype: optax_adama.microbatch_step(
      loss_fn, tx, num_micro_batches=4, accumulation_dtype=dtype)
      for dtype in (None, jnp.bfloat16)}
  with jax.numpy_dtype_promotion("standard"):  # optax.adam needs it
    got32, _, _ = steps[None](_copy(params), tx.init(params), _batch(0))
    got16, _, _ = steps[jnp.bfloat16](_copy(params), tx.init(params), _batch(0))
  # One Adam step moves each entry by lr * m_hat / sqrt(v_hat) = lr * sign(g)
  # exactly, whatever the gradient's rounding: equal except where rounding in
  # bf16 (8 bits) flips a tiny gradient's sign.
  diff = jax.tree.map(lambda a, b: jnp.mean((jnp.abs(a - b) > 1e-6).astype(jnp.float32)),
                      got32, got16)
  assert max(float(d) for d in jax.tree.leaves(diff)) < 0.05


def test_bfloat16_accumulator_halves_the_accumulator():
  model = MLP(num_layers=8, width=256)  # P = 2.1 MB; activations ~P/130
  params, batch = model.abstract_params(), model.abstract_batch(32)
  tx = optax.adam(1e-3)
  state = jax.eval_shape(tx.init, params)
  P = optax_adama.memory.tree_bytes(params)
  def total(dtype):
    step = optax_adama.microbatch_step(
        model.loss, tx, num_micro_batches=4, accumulation_dtype=dtype)
    with jax.numpy_dtype_promotion("standard"):  # optax.adam
      return optax_adama.memory_report(step, params, state, batch).total_bytes
  # A float32 accumulator is P, a bf16 one P / 2.
  assert total(None) - total(jnp.bfloat16) >= 0.4 * P


def _estimator_totals(loss_fn, params, batch, estimators):
  def total(nu_estimator):
    tx = optax_adama.contrib.adama(1e-3, num_micro_batches=4, nu_estimator=nu_estimator)
    step = optax_adama.microbatch_step(loss_fn, tx)
    return optax_adama.memory_report(step, params, jax.eval_shape(tx.init, params),
                                     batch).total_bytes
  return {e: total(e) for e in estimators}


def test_every_nu_estimator_steps_in_the_same_memory():
  model = MLP(num_layers=8, width=256)  # one layer's leaf is P / 8
  params, batch = model.abstract_params(), model.abstract_batch(32)
  P = optax_adama.memory.tree_bytes(params)
  totals = _estimator_totals(model.loss, params, batch, optax_adama.contrib.NU_ESTIMATORS)
  # 1% of P allows scalars, not a leaf.
  assert abs(totals["sum"] - totals["mean"]) < 0.01 * P
  # The momentum term reads the folded m of a leaf beside its in-place
  # update: on this MLP, whose activations are tiny, that is one more leaf
  # (P / 8) at most; in the transformers below it is hidden in the step.
  assert totals["momentum"] - totals["mean"] <= P / 8 + 0.01 * P


def test_split_estimator_costs_at_most_two_leaves_in_an_mlp():
  # The halves' two gradients of a leaf live until its fold (one more leaf,
  # P / 8 here), and the floor's row and column sums read the leaf's
  # micro-batch gradient beside the fold (one more) where activations are
  # too small to hide them; plus the floor itself. On GPT-2 small (micro-
  # batches of 2 sequences) the step measured 17.286 P for "mean" and
  # 17.288 P for "split": the floor's 0.26% of P only.
  model = MLP(num_layers=8, width=256)
  params, batch = model.abstract_params(), model.abstract_batch(32)
  P = optax_adama.memory.tree_bytes(params)
  tx = optax_adama.contrib.adama(1e-3, num_micro_batches=4, nu_estimator="split")
  floor_bytes = optax_adama.memory.tree_bytes(jax.eval_shape(tx.init, params).adama.nu_floor)
  # Rows and columns of each w, each b whole: 1.2% of P at width 256.
  assert 8 * (256 + 256 + 256) * 4 <= floor_bytes < 0.013 * P
  totals = _estimator_totals(model.loss, params, batch, ("mean", "split"))
  assert totals["split"] - totals["mean"] <= 2 * P / 8 + floor_bytes + 0.01 * P


@pytest.mark.parametrize("preset", [
    "gpt_test", pytest.param("bert_test", marks=pytest.mark.slow)])  # 14 s on 2 cores
def test_momentum_estimator_costs_no_memory_in_a_transformer(preset):
  model = models.create(models.get_config(preset), rngs=nnx.Rngs(0))
  loss_fn, params = models.split_loss_fn(model)
  batch = harness.abstract_batch(models.get_config(preset), 4, None)
  totals = _estimator_totals(loss_fn, jax.eval_shape(lambda: params), batch,
                             ("mean", "momentum"))
  # Less than any weight matrix: at most a small leaf's folded m kept beside
  # its update (the 32 x 128 position table here, 0.017 P; on GPT-2 small and
  # BERT-base, N = 4, 0.000 P and 0.002 P).
  hidden = models.get_config(preset).hidden
  assert totals["momentum"] - totals["mean"] < hidden * hidden * 4


