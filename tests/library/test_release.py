"""Gradient release for scanned stacks: `release_step` against `microbatch_step`.

The model is an 8-layer tanh MLP whose layers are stacked under one scan, with
an input matrix tied to the head (so one outer leaf gets two gradients).
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adama

NUM_LAYERS = 8


def embed(outer, micro_batch):
  return micro_batch["x"] @ outer["w_in"]


def block(layer, x, micro_batch):
  del micro_batch
  return jnp.tanh(x @ layer["w"] + layer["b"][None, :])


def head(outer, x, micro_batch):
  # w_in again, transposed: a tied weight gets the embed's and the head's gradient.
  y = x @ outer["w_in"].T + outer["b_out"][None, :]
  loss = jnp.mean((y - micro_batch["y"]) ** 2)
  return loss, {"mean_y": jnp.mean(y)}


def staged_loss(block_fn=block, has_aux=False):
  head_fn = head if has_aux else (lambda o, x, b: head(o, x, b)[0])
  return optax_adama.StagedLoss(embed, block_fn, head_fn, layers=("body", "stack"))


def make_params(width=64, seed=0):
  k_in, k_stack = jax.random.split(jax.random.key(seed))
  return {
      "w_in": jax.random.normal(k_in, (width, width)) / width**0.5,
      "b_out": jnp.zeros(width),
      "body": {"stack": {
          "w": jax.random.normal(k_stack, (NUM_LAYERS, width, width)) / width**0.5,
          "b": jnp.zeros((NUM_LAYERS, width)),
      }},
  }


def make_batch(seed, size=12, width=64):
  kx, ky = jax.random.split(jax.random.key(100 + seed))
  return {"x": jax.random.normal(kx, (size, width)), "y": jax.random.normal(ky, (size, width))}


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-7):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
               actual, expected)


def run_both(tx, batches, *, has_aux=False):
  """(params, state, metrics) of release_step and of microbatch_step, same tx."""
  staged = staged_loss(has_aux=has_aux)
  results = []
  for make_step in (optax_adama.release_step, optax_adama.microbatch_step):
    step = make_step(staged, tx, has_aux=has_aux)
    params = make_params()
    state = tx.init(params)
    for batch in batches:
      params, state, metrics = step(params, state, batch)
    results.append((params, state, metrics))
  return results


# Every estimator at N = 3 (odd: "split" halves 8 rows into two of 4) in the
# default run, and N = 1 (Adam's case) with the default ("mean"); the others,
# N = 4 included (N = 3 keeps its smoke), with the slow tests (3-9 s each).
@pytest.mark.parametrize("num_micro_batches, nu_estimator", [
    pytest.param(n, estimator, marks=() if n == 3 or (n == 1 and estimator == "mean")
                 else pytest.mark.slow)
    for n in (1, 3, 4) for estimator in optax_adama.contrib.NU_ESTIMATORS])
def test_equals_microbatch_step(num_micro_batches, nu_estimator):
  tx = optax_adama.contrib.adamaw(
      1e-2, weight_decay=0.1, num_micro_batches=num_micro_batches, nu_estimator=nu_estimator)
  # 24 rows: micro-batches of 24, 8 and 6, each of two halves for "split".
  batches = [make_batch(seed, size=24) for seed in range(3)]
  (params, state, metrics), (ref_params, ref_state, ref_metrics) = run_both(tx, batches)
  assert_trees_close(params, ref_params)
  assert_trees_close(state, ref_state)
  assert_trees_close(metrics, ref_metrics)
  assert int(state.adama.count) == 3 and int(state.adama.micro_step) == 0
  assert not np.allclose(params["body"]["stack"]["w"], make_params()["body"]["stack"]["w"])


@pytest.mark.parametrize("make_tx", [
    lambda: optax_adama.scale_by_adama(num_micro_batches=2),
    lambda: optax_adama.adama(optax.linear_schedule(1e-2, 0.0, 4), num_micro_batches=2,
                              mu_dtype=jnp.bfloat16, stochastic_rounding=False),
    lambda: optax_adama.mini_batch_chain(
        optax_adama.scale_by_adama(num_micro_batches=2), optax.scale(-1e-2)),
], ids=["scale_by_adama", "adama-schedule-bf16-mu", "mini_batch_chain"])
def test_every_adama_form_and_aux_equal_microbatch_step(make_tx):
  batches = [make_batch(seed) for seed in range(2)]
  (params, state, metrics), (ref_params, ref_state, ref_metrics) = run_both(
      make_tx(), batches, has_aux=True)
  assert_trees_close(params, ref_params)
  assert_trees_close(jax.tree.map(lambda x: x.astype(jnp.float32), state),
                     jax.tree.map(lambda x: x.astype(jnp.float32), ref_state))
  assert_trees_close(metrics, ref_metrics)
  assert metrics["aux"]["mean_y"].shape == (2,)


def test_nonfinite_micro_batch_is_dropped_and_counted():
  tx = optax_adama.adama(1e-2, num_micro_batches=3)
  bad = make_batch(0)
  bad["x"] = bad["x"].at[1].set(jnp.nan)  # row 1: micro-batch 1 of 3
  batches = [bad, make_batch(1)]
  (params, state, metrics), (ref_params, ref_state, _) = run_both(tx, batches)
  assert int(state.adama.num_dropped) == 1
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((params, state)))
  assert_trees_close(params, ref_params)
  assert_trees_close(state, ref_state)
  step = optax_adama.release_step(staged_loss(), tx)
  _, state, metrics = step(make_params(), tx.init(make_params()), bad)
  assert int(metrics["num_dropped"]) == 1 and int(metrics["num_nonfinite_losses"]) == 1
  assert int(state.adama.mini_batch_accepted) == 2


def test_donation_without_warning_or_recompilation():
  tx = optax_adama.adama(1e-2, num_micro_batches=2)
  chex.clear_trace_counter()  # the counter is keyed by source
  # The step traces the block twice: in the forward scan and in the
  # release scan's vjp. A recompilation would trace it again.
  traced_block = chex.assert_max_traces(lambda p, x, b: block(p, x, b), n=2)
  step = optax_adama.release_step(staged_loss(traced_block), tx)
  params = make_params()
  state = tx.init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "donated buffers were not usable" fails
    for seed in range(3):
      new_params, new_state, _ = step(params, state, make_batch(seed))
      assert all(x.is_deleted() for x in jax.tree.leaves((params, state)))
      params, state = new_params, new_state


def test_unsupported_combinations_raise():
  staged = staged_loss()
  params = make_params()
  with pytest.raises(TypeError, match="AdamA transformation"):
    optax_adama.release_step(staged, optax.adam(1e-2))
  with pytest.raises(TypeError, match="AdamA transformation"):
    optax_adama.release_step(staged, optax.chain(optax_adama.adama(1e-2, num_micro_batches=2)))
  with pytest.raises(ValueError, match="needs a mesh"):
    optax_adama.release_step(
        staged, optax_adama.adama(1e-2, num_micro_batches=2), shard_states="zero1")
  split_tx = optax_adama.contrib.adama(1e-2, num_micro_batches=4, nu_estimator="split")
  with pytest.raises(ValueError, match="micro-batch size must be even, got 3"):
    optax_adama.release_step(staged, split_tx)(params, split_tx.init(params), make_batch(0))
  # The stacked bias [8, 64] in the flat layout is one block of 512, straddling
  # the layers: one device folds it through a float32 copy (on a mesh it is
  # refused: tests/library/test_release_quantized.py); the default layout tiles layers.
  for layer_aligned in (False, None):
    tx = optax_adama.adama(1e-2, num_micro_batches=2, quantization=optax_adama.BlockQuantization(
        min_size=16, layer_aligned=layer_aligned))
    fresh = jax.tree.map(jnp.copy, params)  # the step donates its params
    _, _, metrics = optax_adama.release_step(staged, tx)(fresh, tx.init(fresh), make_batch(0))
    assert np.isfinite(metrics["loss"])
  with pytest.raises(ValueError, match="no key 'stack'"):
    optax_adama.StagedLoss(embed, block, head, layers=("body", "stack"))({"body": {}}, None)


LAYER_ALIGNED = optax_adama.BlockQuantization(block_size=256, min_size=256, layer_aligned=True)


def test_eight_bit_layer_aligned_moments_equal_microbatch_step():
  # Round to nearest: each layer's run of blocks is folded exactly as the
  # whole leaf's blocks are; the direction is fused differently (float
  # rounding of the update, a few 1e-6 relative).
  tx = optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=3,
                          quantization=LAYER_ALIGNED, stochastic_rounding=False)
  batches = [make_batch(seed) for seed in range(3)]
  (params, state, _), (ref_params, ref_state, _) = run_both(tx, batches)
  stack_mu = state.adama.mu["body"]["stack"]["w"]
  assert isinstance(stack_mu, optax_adama.moments.QuantizedArray)
  assert stack_mu.codes.shape == (NUM_LAYERS, 64 * 64 // 256, 256)  # [layers, blocks, len]
  # Once the params differ by an ulp a code may round the other way (a
  # float8 step is 1/8 of the value): that element's update moves by a
  # fraction of the learning rate (1e-2). Few do.
  assert_trees_close(params, ref_params, rtol=0, atol=1e-3)
  for leaf, ref_leaf in zip(jax.tree.leaves((params, state)),
                            jax.tree.leaves((ref_params, ref_state))):
    leaf, ref_leaf = np.asarray(leaf, np.float32), np.asarray(ref_leaf, np.float32)
    assert np.mean(~np.isclose(leaf, ref_leaf, rtol=1e-5, atol=1e-7)) < 0.01


def test_eight_bit_stochastic_rounding_trains_like_microbatch_step():
  """The release step's rounding noise is another draw of microbatch_step's.

  Stochastic rounding draws each layer's noise from its own seed (the layer
  index mixed in), not the whole leaf's: the same distribution, other draws. So
  after 20 steps the release step should sit as far from microbatch_step as
  microbatch_step with another rounding seed does (measured: 0.0059-0.0062 rms
  against 0.0061-0.0062, with 0.035 rms of movement from the init); a bias in
  its noise, or none at all, would move it outside [0.5, 1.5] of that.
  """
  batches = [make_batch(seed) for seed in range(20)]

  def final_params(make_step, rounding_seed):
    tx = optax_adama.mini_batch_chain(
        optax_adama.scale_by_adama(num_micro_batches=2, quantization=LAYER_ALIGNED,
                                   rounding_seed=rounding_seed),
        optax.scale_by_learning_rate(1e-2))
    step, params = make_step(staged_loss(), tx), make_params()
    state = tx.init(params)
    for batch in batches:
      params, state, _ = step(params, state, batch)
    return params

  def rms(a, b):
    return float(np.sqrt(np.mean(np.concatenate(
        [np.ravel(x - y) ** 2 for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))))

  reference = final_params(optax_adama.microbatch_step, 0)
  other_draw = rms(final_params(optax_adama.microbatch_step, 1), reference)
  assert 0 < other_draw < 0.3 * rms(reference, make_params())
  released = final_params(optax_adama.release_step, 0)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(released))
  assert 0.5 * other_draw < rms(released, reference) < 1.5 * other_draw
  # And the noise is drawn, from the rounding seed: round to nearest would sit
  # as far from the reference (0.0054 rms), but not move with the seed.
  assert rms(final_params(optax_adama.release_step, 1), released) > 0.5 * other_draw


def _decay_matrices(params):
  # Rank-based, as users write masks: the stacked biases [L, D] count as
  # matrices here, in the full tree and in the [1, D] layer slices alike.
  return jax.tree.map(lambda p: p.ndim > 1, params)


@pytest.mark.parametrize("make_tx", [
    lambda: optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=3,
                               mask=_decay_matrices),
    lambda: optax_adama.adama(optax.linear_schedule(1e-2, 0.0, 4), num_micro_batches=2,
                              quantization=LAYER_ALIGNED),
    lambda: optax_adama.contrib.scale_by_adama(num_micro_batches=2, nu_estimator="momentum"),
], ids=["adamaw-mask", "adama-8bit-schedule", "scale_by_adama-momentum"])
def test_offloaded_moments_equal_on_device_moments(make_tx):
  """Moments in host memory, a layer's slice brought in per fold and update:
  the same arithmetic, so the same bits (stochastic rounding included)."""
  batches = [make_batch(seed) for seed in range(3)]
  bad = make_batch(3)
  bad["x"] = bad["x"].at[0].set(jnp.inf)  # one dropped micro-batch
  results = []
  for tx in (make_tx(), optax_adama.offload_moments(make_tx(), min_size=256)):
    step = optax_adama.release_step(staged_loss(), tx)
    params = make_params()
    state = tx.init(params)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # donation must still work
      for batch in batches + [bad]:
        params, state, metrics = step(params, state, batch)
    results.append(jax.device_get((params, state, metrics)))
  (params, state, metrics), offloaded = results
  chex.assert_trees_all_equal(offloaded, (params, state, metrics))
  assert int(optax_adama.find_adama_state(state).num_dropped) == 1
  assert not np.allclose(params["body"]["stack"]["w"], make_params()["body"]["stack"]["w"])


def test_offloaded_moments_stay_in_host_memory():
  tx = optax_adama.offload_moments(optax_adama.adama(1e-2, num_micro_batches=2),
                                   min_size=256)
  step = optax_adama.release_step(staged_loss(), tx)
  params = make_params()
  params, state, _ = step(params, tx.init(params), make_batch(0))
  mu = optax_adama.find_adama_state(state).mu
  assert mu["body"]["stack"]["w"].sharding.memory_kind == "pinned_host"  # 8 x 64 x 64
  assert mu["body"]["stack"]["b"].sharding.memory_kind == "pinned_host"  # 8 x 64
  assert mu["b_out"].sharding.memory_kind == "device"  # 64 < min_size
  assert params["body"]["stack"]["w"].sharding.memory_kind == "device"


def _plateau_after_one_step():
  # rtol 0.9: after the first mini-batch no loss counts as an improvement, so
  # with patience 1 the scale halves on the second, and the best value stays
  # the first mini-batch's loss.
  return optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.9)


def _without_kwargs():
  # Extra-argument support without **kwargs, as optax.contrib.sam's update.
  return optax.GradientTransformationExtraArgs(
      lambda params: optax.EmptyState(), lambda updates, state, params=None: (updates, state))


@pytest.mark.parametrize("make_step", [optax_adama.release_step, optax_adama.microbatch_step])
@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "offloaded"])
def test_transforms_after_adama_read_the_mini_batch_loss_as_value(make_step, offload):
  # Both fused steps pass value= the mini-batch's loss to the transforms after
  # AdamA (with offloaded moments release_step runs them a layer at a time),
  # each transform getting only the extra arguments its update takes.
  tx = optax_adama.mini_batch_chain(
      optax_adama.scale_by_adama(num_micro_batches=2), optax.scale(-1e-2),
      _without_kwargs(), _plateau_after_one_step())
  if offload:
    tx = optax_adama.offload_moments(tx)
  step, params = make_step(staged_loss(), tx), make_params()
  state, losses = tx.init(params), []
  with jax.numpy_dtype_promotion("standard"):  # optax's transform adds float and int
    for seed in range(3):
      params, state, metrics = step(params, state, make_batch(seed))
      losses.append(float(metrics["loss"]))
  assert float(optax.tree.get(state, "best_value")) == pytest.approx(losses[0], rel=1e-6)
  assert float(optax.tree.get(state, "scale")) == 0.25  # halved on mini-batches 2 and 3


def test_offloaded_moments_refuse_what_the_layer_loop_cannot_run():
  staged = staged_loss()
  params = make_params()
  # optax.trace keeps a momentum per parameter: it cannot run layer by layer.
  tx = optax_adama.offload_moments(optax_adama.mini_batch_chain(
      optax_adama.scale_by_adama(num_micro_batches=2), optax.trace(0.9)))
  with pytest.raises(NotImplementedError, match="per-parameter state"):
    optax_adama.release_step(staged, tx)(params, tx.init(params), make_batch(0))


def test_release_memory_is_well_below_the_fused_step():
  """Compile only: an 8-layer D=512 MLP, B=32, N=4, layers stacked under one scan."""
  width, batch_size = 512, 32
  staged = optax_adama.StagedLoss(
      embed=lambda outer, b: b["x"],
      block=block,
      head=lambda outer, x, b: jnp.mean((x - b["y"]) ** 2),
      layers="stack")
  shape = jax.ShapeDtypeStruct
  params = {"stack": {"w": shape((NUM_LAYERS, width, width), jnp.float32),
                      "b": shape((NUM_LAYERS, width), jnp.float32)}}
  batch = {"x": shape((batch_size, width), jnp.float32),
           "y": shape((batch_size, width), jnp.float32)}
  # The floor below is "mean"'s; the default's halves add a layer's second
  # gradient in the release, the stack's in the fused step (test_defaults.py).
  tx = optax_adama.adama(1e-3, num_micro_batches=4)
  state = jax.eval_shape(tx.init, params)
  release = optax_adama.memory_report(optax_adama.release_step(staged, tx), params, state, batch)
  fused = optax_adama.memory_report(optax_adama.microbatch_step(staged, tx), params, state, batch)
  # Measured: 3.45 P against 4.28 P. The floor is params + m + v + one
  # layer's gradient, 3 + 1/8 P; above it sit the layer's m and v slices
  # being folded (2/8 P) and the saved layer inputs (under 0.01 P). The
  # fused step holds the whole stack's gradient (1 P) instead.
  assert release.in_p(release.total_bytes) < 3.5
  assert fused.in_p(fused.total_bytes) - release.in_p(release.total_bytes) > 0.75
  # 8-bit moments, blocks laid out per layer: m and v are 2 bytes a
  # parameter (+ a scale per 2048) instead of 8, about 1.5 P less.
  tx_8bit = optax_adama.adama(
      1e-3, num_micro_batches=4,
      quantization=optax_adama.BlockQuantization(layer_aligned=True))
  state_8bit = jax.eval_shape(tx_8bit.init, params)
  release_8bit = optax_adama.memory_report(
      optax_adama.release_step(staged, tx_8bit), params, state_8bit, batch)
  # Measured 2.05 P: params + 0.5 P of codes and scales + one layer's
  # folding slices and the saved inputs.
  assert release.in_p(release.total_bytes) - release_8bit.in_p(release_8bit.total_bytes) > 1.4
  # The same moments in host memory: the device holds params and temps.
  # The CPU backend counts host arguments as device ones, and its transfers
  # are no-ops, so the codes' bytes are taken off; the temps must not grow
  # (measured equal, 0.53 P: no stack-sized copy of the codes in the update).
  tx_offloaded = optax_adama.offload_moments(tx_8bit)
  state_offloaded = optax_adama.moments.offloaded_state_shapes(
      jax.eval_shape(tx_offloaded.init, params))
  offloaded = optax_adama.memory_report(
      optax_adama.release_step(staged, tx_offloaded), params, state_offloaded, batch)
  host_bytes = optax_adama.moments.host_state_bytes(state_offloaded)
  assert offloaded.in_p(host_bytes) > 0.49  # the codes of both moments
  assert offloaded.temp_bytes <= release_8bit.temp_bytes * 1.01
  assert offloaded.in_p(offloaded.total_bytes - host_bytes) < 1.6  # measured 1.55 P


def test_bench_memory_scan_layers_smoke():
  from models import bench  # pylint: disable=g-import-not-at-top

  with jax.numpy_dtype_promotion("standard"):  # optax.adam, the baseline
    result = bench.main([
        "memory", "--scan-layers", "--presets", "gpt_test", "--num-micro-batches", "2",
        "--methods", "scan_accumulation", "--no-progress"])
  rows = {r["method"]: r for r in result["rows"]}
  assert set(rows) == {"scan_accumulation", "adama_release"}
  assert rows["adama_release"]["preset"] == "gpt_test (scanned)"
  totals = {m: r["report"]["total_bytes"] for m, r in rows.items()}
  assert totals["adama_release"] < totals["scan_accumulation"]


def test_release_floor_is_the_scanned_remat_full_one_with_a_layer_slice():
  import models  # pylint: disable=g-import-not-at-top
  from models import bench  # pylint: disable=g-import-not-at-top
  from models import harness  # pylint: disable=g-import-not-at-top

  config = models.get_config("gpt_test", scan_layers=True)
  batch = harness.abstract_batch(config, 4, None)
  adama = harness.floor_for("adama", config, batch, 4)
  release = harness.floor_for("adama_release", config, batch, 4)
  _, params = harness.split_model(config)
  slices = [optax_adama.memory.tree_bytes(x) // config.num_layers
            for x in jax.tree.leaves(params["blocks"])]
  outer = [optax_adama.memory.tree_bytes(x) for k, v in params.items() if k != "blocks"
           for x in jax.tree.leaves(v)]
  assert release.largest_gradient_bytes == max(slices + outer)
  # Same params, state and batch; only activations and the gradient term differ.
  assert (release.param_bytes, release.opt_state_bytes, release.batch_bytes) == (
      adama.param_bytes, adama.opt_state_bytes, adama.batch_bytes)
  table = bench.memory_table([
      bench.MemoryRow("gpt_test (scanned)", m, 4, 1, 1, {"total_bytes": 4 * f.param_bytes,
                      "total_p": 4.0}, f.to_dict(), 0.0)
      for m, f in (("adama", adama), ("adama_release", release))])
  assert "release vs its floor (remat full)" in table
  assert f"({release.to_dict()['total_p']:.2f} P)" in table


def test_bfloat16_params_with_float32_moments_update_as_the_fused_step():
  # optax.adam's dtype rule on every path: bf16 params with f32 moments get a
  # float32 update, added to the params before they are rounded once.
  tx = optax_adama.adama(1e-2, num_micro_batches=2, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  staged = staged_loss()
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
  loss_fn = lambda p, b: staged(jax.tree.map(lambda x: x.astype(jnp.float32), p), b)
  results = []
  for step in (optax_adama.release_step(
      optax_adama.StagedLoss(
          lambda o, b: embed(jax.tree.map(lambda x: x.astype(jnp.float32), o), b),
          lambda l, x, b: block(jax.tree.map(lambda y: y.astype(jnp.float32), l), x, b),
          lambda o, x, b: head(jax.tree.map(lambda y: y.astype(jnp.float32), o), x, b)[0],
          layers=("body", "stack")), tx),
               optax_adama.microbatch_step(loss_fn, tx)):
    new, _, _ = step(jax.tree.map(jnp.copy, params), tx.init(params), make_batch(0))
    results.append(new)
  for leaf in jax.tree.leaves(results[0]):
    assert leaf.dtype == jnp.bfloat16
  # The same float32 update on both paths, each rounded once to bfloat16.
  assert_trees_close(jax.tree.map(lambda x: x.astype(jnp.float32), results[0]),
                     jax.tree.map(lambda x: x.astype(jnp.float32), results[1]),
                     rtol=1e-2, atol=1e-2)
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), results[0], params)
  assert all(jax.tree.leaves(moved))
