"""Low-rank (GaLore) moments around AdamA: references, refresh timing, guards."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP

import optax_adama

MODEL = MLP(num_layers=3, width=8)
SQUARE = 8


def _random_grads(rng, diagonal=False):
  """A gradient for {"w": 8 x 8, "b": 8}; ``diagonal``: w is diagonal, distinct."""
  w = rng.normal(size=(SQUARE, SQUARE))
  if diagonal:  # distinct magnitudes, mixed signs: the SVD is a signed permutation
    w = np.diag(np.arange(SQUARE, 0, -1.0) * np.where(np.arange(SQUARE) % 3, 1.0, -1.0))
  return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(rng.normal(size=SQUARE), jnp.float32)}


def _halves_grads(params, micro_batch):
  """``(g_a + g_b) / 2, (g_a - g_b) / 2`` over the micro-batch's two halves."""
  halves = jax.tree.map(lambda x: x.reshape((2, x.shape[0] // 2) + x.shape[1:]), micro_batch)
  pair = jax.vmap(jax.grad(MODEL.loss), in_axes=(None, 0))(params, halves)
  return (jax.tree.map(lambda x: (x[0] + x[1]) / 2, pair),
          jax.tree.map(lambda x: (x[0] - x[1]) / 2, pair))


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "8bit"])
def test_full_rank_signed_permutation_projector_is_adama(quantized):
  # Full rank and a diagonal refresh gradient: P is a signed permutation, and
  # Adam, elementwise and even in the gradient's sign, gives P Adam(P^T g) =
  # Adam(g). Refreshed every mini-batch, so every refresh is checked.
  quantization = (optax_adama.BlockQuantization(block_size=16, min_size=16)
                  if quantized else None)
  num_micro_batches = 3
  make = lambda: optax_adama.adama(
      0.1, num_micro_batches=num_micro_batches, quantization=quantization)
  tx = optax_adama.low_rank(make(), rank=SQUARE, refresh_period=1,
                            mask={"w": True, "b": False})
  reference = make()
  params = {"w": jnp.ones((SQUARE, SQUARE)), "b": jnp.zeros(SQUARE)}
  state, ref_state = tx.init(params), reference.init(params)
  assert isinstance(optax_adama.find_adama_state(state).mu["w"],
                    optax_adama.moments.QuantizedArray) == quantized
  low, ref = params, params
  rng = np.random.default_rng(0)
  update, ref_update = jax.jit(tx.update), jax.jit(reference.update)
  for call in range(4 * num_micro_batches):
    grads = _random_grads(rng, diagonal=call % num_micro_batches == 0)
    updates, state = update(grads, state)
    ref_updates, ref_state = ref_update(grads, ref_state)
    low, ref = optax.apply_updates(low, updates), optax.apply_updates(ref, ref_updates)
  # P's entries are 0 and +-1 (within LAPACK's rounding of a diagonal SVD), so
  # each product is one term: equal to a few float32 ulps. Quantized, the same
  # seeds round the same values the same way.
  chex.assert_trees_all_close(low, ref, rtol=1e-6, atol=1e-7)
  assert float(jnp.max(jnp.abs(low["w"] - params["w"]))) > 0.1  # it trained


def test_one_micro_batch_matches_optax_galore():
  # N = 1: AdamA is Adam, so this is optax's GaLore with the same period.
  params = MODEL.params()
  tx = optax_adama.low_rank(
      optax_adama.adama(1e-2, num_micro_batches=1), rank=3, refresh_period=2,
      min_size=0)
  reference = optax.contrib.galore(
      1e-2, rank=3, update_proj_gap=2, base_optimizer=optax.scale_by_adam())
  state, ref_state = tx.init(params), reference.init(params)
  low, ref = params, params
  update, ref_update = jax.jit(tx.update), jax.jit(reference.update)
  grad = jax.jit(jax.grad(MODEL.loss))
  for step in range(5):
    batch = MODEL.batch(step, 4)
    updates, state = update(grad(low, batch), state)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
      ref_updates, ref_state = ref_update(grad(ref, batch), ref_state, ref)
    low, ref = optax.apply_updates(low, updates), optax.apply_updates(ref, ref_updates)
  assert optax_adama.find_adama_state(state).mu["layer0"]["w"].shape == (3, 8)
  # AdamA at N = 1 equals optax.adam up to float32 rounding (test_adama); the
  # projections are the same ops. 5 steps of lr 1e-2: rounding of ~1e-7 each.
  chex.assert_trees_all_close(low, ref, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(state.projector, ref_state[0].projector, atol=1e-6)


def test_refresh_falls_on_the_first_micro_batch_every_period():
  num_micro_batches, period = 2, 2
  tx = optax_adama.low_rank(
      optax_adama.adama(1e-2, num_micro_batches=num_micro_batches), rank=2,
      refresh_period=period, min_size=0)
  params = {"w": jnp.zeros((6, 4))}
  state = tx.init(params)
  rng = np.random.default_rng(1)
  update = jax.jit(tx.update)
  for call in range(3 * period * num_micro_batches):
    grad = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    before = state.projector["w"]
    _, state = update({"w": grad}, state)
    after = state.projector["w"]
    if call % (period * num_micro_batches) == 0:
      # The top-2 left singular vectors of this micro-batch gradient (signs free).
      u = np.linalg.svd(np.asarray(grad), full_matrices=False)[0][:, :2]
      np.testing.assert_allclose(np.abs(u.T @ np.asarray(after)), np.eye(2), atol=1e-5)
    else:
      np.testing.assert_array_equal(after, before)


def test_nonfinite_refresh_gradient_keeps_the_projector_and_params_finite():
  tx = optax_adama.low_rank(
      optax_adama.adama(1e-2, num_micro_batches=2), rank=2, refresh_period=1,
      min_size=0)
  params = {"w": jnp.ones((6, 4))}
  state = tx.init(params)
  rng = np.random.default_rng(2)
  good = lambda: {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)}
  for _ in range(2):  # one mini-batch: a finite projector
    updates, state = tx.update(good(), state)
  params = optax.apply_updates(params, updates)
  kept = state.projector["w"]
  bad = good()
  bad["w"] = bad["w"].at[0, 0].set(jnp.nan)
  for grads in (bad, good()):  # the refresh sees the NaN
    updates, state = tx.update(grads, state)
  np.testing.assert_array_equal(state.projector["w"], kept)
  assert int(optax_adama.find_adama_state(state).num_dropped) == 1
  assert bool(jnp.all(jnp.isfinite(optax.apply_updates(params, updates)["w"])))


def test_fused_step_equals_update_calls_with_8bit_bf16_projector():
  quantization = optax_adama.BlockQuantization(block_size=16, min_size=16)
  tx = optax_adama.low_rank(
      optax_adama.adama(1e-2, num_micro_batches=2, quantization=quantization),
      rank=4, refresh_period=2, min_size=0, projector_dtype=jnp.bfloat16)
  params = MODEL.params()
  step = optax_adama.microbatch_step(MODEL.loss, tx)
  fused, fused_state = jax.tree.map(jnp.array, params), tx.init(params)
  ref, ref_state = params, tx.init(params)
  update, halves_grads = jax.jit(tx.update), jax.jit(_halves_grads)
  assert fused_state.projector["layer0"]["w"].dtype == jnp.bfloat16
  for seed in range(3):
    batch = MODEL.batch(seed, 8)
    fused, fused_state, metrics = step(fused, fused_state, batch)
    for i in range(2):
      # The step's "auto" estimator is "split": it hands over the half difference.
      grads, difference = halves_grads(ref, jax.tree.map(lambda x: x[i::2], batch))
      updates, ref_state = update(grads, ref_state, half_difference=difference)
      ref = optax.apply_updates(ref, updates)
  # The same ops; XLA fuses them differently inside the scan: float32 rounding
  # only (measured 3e-8 against moves of 3e-2). A rounding flip of one 8-bit
  # code would show as 1e-4 or more.
  chex.assert_trees_all_close(fused, ref, atol=1e-6)
  assert int(metrics["num_dropped"]) == 0
  assert fused_state.projector["layer0"]["w"].dtype == jnp.bfloat16


def test_half_difference_is_projected_with_the_gradients_projector():
  # "split" at N = 2 on a tall, a wide and a 1-D leaf: low_rank's AdamA state
  # is AdamA's fed P^T g and P^T d (g P and d P on the wide leaf), with P the
  # low_rank state's projector, refreshed from g alone.
  make = lambda estimator: optax_adama.contrib.scale_by_adama(
      num_micro_batches=2, nu_estimator=estimator)
  tx = optax_adama.low_rank(make("split"), rank=3, refresh_period=1, min_size=0)
  without_d = optax_adama.low_rank(make("mean"), rank=3, refresh_period=1, min_size=0)
  reference = make("split")
  params = {"tall": jnp.zeros((8, 5)), "wide": jnp.zeros((4, 9)), "b": jnp.zeros(5)}
  state, plain_state = tx.init(params), without_d.init(params)
  ref_state = reference.init(jax.tree.map(
      jnp.zeros_like, optax_adama.find_adama_state(state).mu))
  update, plain_update = jax.jit(tx.update), jax.jit(without_d.update)
  ref_update = jax.jit(reference.update)
  rng = np.random.default_rng(3)
  normal = lambda: jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  for _ in range(6):  # 3 mini-batches: each refreshes P at its first micro-batch
    grads, difference = normal(), normal()
    updates, state = update(grads, state, half_difference=difference)
    _, plain_state = plain_update(grads, plain_state)
    chex.assert_trees_all_equal(state.projector, plain_state.projector)
    proj = state.projector
    project = lambda x: {"tall": proj["tall"].T @ x["tall"],
                         "wide": x["wide"] @ proj["wide"], "b": x["b"]}
    ref_updates, ref_state = ref_update(
        project(grads), ref_state, half_difference=project(difference))
    adama_state = optax_adama.find_adama_state(state)
    # The same ops, compiled apart: float32 rounding at most.
    chex.assert_trees_all_close((adama_state.mu, adama_state.nu),
                                (ref_state.mu, ref_state.nu), rtol=1e-6, atol=1e-7)
    back = {"tall": proj["tall"] @ ref_updates["tall"],
            "wide": ref_updates["wide"] @ proj["wide"].T, "b": ref_updates["b"]}
    # Directions of size ~1, each entry a sum of r products: rounding ~1e-7.
    chex.assert_trees_all_close(updates, back, rtol=1e-6, atol=1e-6)
  assert int(adama_state.count) == 3
  assert float(jnp.max(jnp.abs(updates["tall"]))) > 0.1  # the N-th emits


def test_fused_step_hands_the_half_difference_through():
  # Under microbatch_step "auto" gets the halves through low_rank: it folds
  # "split" bit for bit, and not "mean".
  params = MODEL.params()

  def run(**estimator):
    tx = optax_adama.low_rank(
        optax_adama.contrib.adama(1e-2, num_micro_batches=2, **estimator), rank=3,
        refresh_period=2, min_size=0)
    step = optax_adama.microbatch_step(MODEL.loss, tx)
    p, state = jax.tree.map(jnp.array, params), tx.init(params)
    for seed in range(2):
      p, state, _ = step(p, state, MODEL.batch(seed, 8))
    return p, optax_adama.find_adama_state(state).nu

  auto, split, mean = (run(nu_estimator=name) for name in ("auto", "split", "mean"))
  assert auto[1]["layer0"]["w"].shape == (3, 8)
  chex.assert_trees_all_equal(auto, split)
  assert not np.allclose(auto[1]["layer0"]["w"], mean[1]["layer0"]["w"], rtol=1e-3)
  assert not np.allclose(auto[1]["layer0"]["b"], mean[1]["layer0"]["b"], rtol=1e-3)


def test_state_is_low_rank_and_small_leaves_stay_full():
  params = {"w": jnp.zeros((256, 64)), "wide": jnp.zeros((64, 256)),
            "small": jnp.zeros((16, 16)), "b": jnp.zeros(256)}
  tx = optax_adama.low_rank(
      optax_adama.adama(1e-3, num_micro_batches=4), rank=8, refresh_period=10)
  state = tx.init(params)
  mu = optax_adama.find_adama_state(state).mu
  assert {k: v.shape for k, v in mu.items()} == {
      "w": (8, 64), "wide": (64, 8), "small": (16, 16), "b": (256,)}
  assert state.projector["w"].shape == (256, 8)
  assert state.projector["wide"].shape == (256, 8)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_rank_and_period_must_be_positive_ints(bad):
  inner = optax_adama.adama(1e-3, num_micro_batches=2)
  with pytest.raises(ValueError, match="rank"):
    optax_adama.low_rank(inner, rank=bad, refresh_period=1)
  with pytest.raises(ValueError, match="refresh_period"):
    optax_adama.low_rank(inner, rank=1, refresh_period=bad)


def test_extra_arguments_reach_the_transforms_after_adama():
  # optax's GaLore calls its base without extra arguments; low_rank binds them,
  # so optax.contrib.reduce_on_plateau after AdamA reads the completing call's
  # value. rtol 0.9: no later value counts as an improvement.
  tx = optax_adama.low_rank(
      optax_adama.mini_batch_chain(
          optax_adama.scale_by_adama(num_micro_batches=2), optax.scale(-1e-2),
          optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=0.9)),
      rank=2, refresh_period=10, min_size=0)
  params = {"w": jnp.ones((8, 4))}
  state = tx.init(params)
  with jax.numpy_dtype_promotion("standard"):  # optax's transforms need it
    for call in range(6):
      grads = {"w": jnp.full((8, 4), 0.1 * (call + 1))}
      _, state = tx.update(grads, state, params, value=jnp.asarray(10.0 - call))
  assert float(optax.tree.get(state, "best_value")) == 9.0
  assert float(optax.tree.get(state, "scale")) == 0.25
