"""bfloat16 params with stochastic rounding: ``contrib.round_params_stochastically``.

The reference is the float32 sum ``p + u``: the rounded param must be one of
its two bfloat16 neighbours, unbiased over many elements, and the same
transform must work where AdamA's steps apply the update (the fused step, the
release a layer at a time with offloaded moments).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adama
from optax_adama import contrib

BF16 = jnp.bfloat16


def neighbours(target):
  """The two bfloat16 values around each float32 ``target`` (equal where it is one)."""
  down = target.astype(BF16).astype(jnp.float32)
  other = jnp.nextafter(target.astype(BF16), jnp.where(down > target, -jnp.inf, jnp.inf))
  other = other.astype(jnp.float32)
  return jnp.minimum(down, other), jnp.maximum(down, other)


def apply(tx, params, updates, state):
  new_updates, state = tx.update(updates, state, params)
  with jax.numpy_dtype_promotion("standard"):  # optax adds bf16 + f32 by promotion
    return optax.apply_updates(params, new_updates), new_updates, state


def test_float32_params_get_their_updates_unchanged():
  tx = contrib.round_params_stochastically()
  params = {"w": jnp.ones(5), "n": jnp.arange(3)}
  updates = {"w": jnp.full(5, 1e-9), "n": jnp.zeros(3, jnp.int32)}
  new_updates, state = tx.update(updates, tx.init(params), params)
  assert new_updates["w"] is updates["w"] and new_updates["n"] is updates["n"]
  assert int(state.count) == 1


def test_the_param_lands_on_a_neighbour_of_the_float32_sum_unbiased():
  tx = contrib.round_params_stochastically(seed=3)
  n = 200_000
  p = jax.random.normal(jax.random.key(0), (n,)).astype(BF16)
  # Updates from far below to above the spacing of p (2**-8 |p| .. 2**-7 |p|).
  u = jax.random.normal(jax.random.key(1), (n,)) * 10.0 ** jax.random.uniform(
      jax.random.key(2), (n,), minval=-5, maxval=-1)
  new, new_u, _ = apply(tx, {"w": p}, {"w": u}, tx.init({"w": p}))
  assert new["w"].dtype == BF16 and new_u["w"].dtype == jnp.float32
  target = p.astype(jnp.float32) + u
  low, high = neighbours(target)
  got = new["w"].astype(jnp.float32)
  assert bool(jnp.all((got == low) | (got == high)))
  # p + u' is exactly the rounded value: no second rounding in the add.
  np.testing.assert_array_equal(np.asarray(p.astype(jnp.float32) + new_u["w"]), np.asarray(got))
  # Unbiased: each element's error is within one spacing (std <= spacing / 2),
  # so the mean error over n elements, in spacings, has std <= 1 / (2 sqrt(n)).
  error = (got - target) / jnp.where(high == low, 1.0, high - low)
  assert abs(float(jnp.mean(error))) < 5 / (2 * n**0.5)
  # Updates under a quarter spacing, which rounding to nearest drops: each
  # moves the param one spacing with probability |u| / spacing (a Bernoulli
  # count, checked within 5 of its standard deviations).
  spacing = np.asarray(high - low)
  small = np.asarray(jnp.abs(u)) < 0.25 * spacing
  assert small.sum() > 10_000
  moved = np.asarray(got != p.astype(jnp.float32))[small]
  chance = np.abs(np.asarray(u))[small] / spacing[small]
  assert abs(moved.sum() - chance.sum()) < 5 * np.sqrt(np.sum(chance * (1 - chance)))
  assert moved.sum() > 1_000


def test_the_noise_changes_every_update_and_with_the_seed_and_is_reproducible():
  p = {"w": jnp.ones(4096, BF16)}
  u = {"w": jnp.full(4096, 1e-3)}  # a quarter of the spacing above 1 (2**-7)
  results = {}
  for seed in (0, 1):
    tx = contrib.round_params_stochastically(seed)
    state = tx.init(p)
    first, _, state = apply(tx, p, u, state)
    second, _, _ = apply(tx, p, u, state)
    results[seed] = (first["w"], second["w"])
  again, _, _ = apply(contrib.round_params_stochastically(0), p, u,
                      contrib.round_params_stochastically(0).init(p))
  np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(results[0][0]))
  assert bool(jnp.any(results[0][0] != results[0][1]))
  assert bool(jnp.any(results[0][0] != results[1][0]))


def test_adam_at_a_small_rate_trains_bfloat16_params_only_with_stochastic_rounding():
  # w ~ 1 in bfloat16 has a spacing of 2**-7; Adam's steps of ~2e-3 are under
  # half of it, so round-to-nearest keeps every param where it started.
  target = jnp.linspace(1.5, 1.7, 64)
  loss = lambda w: jnp.mean((w.astype(jnp.float32) - target) ** 2)
  start = jnp.ones(64, BF16)
  losses = {}
  for name, tail in (("nearest", ()), ("stochastic", (contrib.round_params_stochastically(),)),
                     ("float32", ())):
    w = start.astype(jnp.float32) if name == "float32" else start
    tx = optax.chain(optax.adam(2e-3, mu_dtype=jnp.float32), *tail)
    state = tx.init(w)

    @jax.jit
    def step(w, state, tx=tx):
      with jax.numpy_dtype_promotion("standard"):  # optax.adam's bf16 nu, f32 mu
        updates, state = tx.update(jax.grad(loss)(w), state, w)
        return optax.apply_updates(w, updates), state

    for _ in range(800):
      w, state = step(w, state)
    losses[name] = float(loss(w))
  assert losses["nearest"] == pytest.approx(float(loss(start)))  # never moved
  # 800 steps of at most 2e-3 close the 0.5-0.7 gap in float32 ...
  assert losses["float32"] < 0.01 * float(loss(start))
  # ... and with SR the params follow within a few spacings (2**-7 ~ 0.008 each).
  assert losses["stochastic"] < 4 * 2.0**-14 + losses["float32"]


@jax.custom_vjp
def _bf16_cotangent(x):
  """The identity whose gradient is rounded to bfloat16, as a bfloat16 param's is."""
  return x


_bf16_cotangent.defvjp(lambda x: (x, None),
                       lambda _, g: (g.astype(BF16).astype(g.dtype),))


def _bf16_loss(params, micro_batch):
  h = jnp.tanh(micro_batch["x"] @ params["w1"].astype(jnp.float32))
  return jnp.mean((h @ params["w2"].astype(jnp.float32) - micro_batch["y"]) ** 2)


def _chains(num_micro_batches):
  """AdamA with float32 moments, and the same with stochastic rounding chained."""
  adama = lambda: optax_adama.adama(3e-3, mu_dtype=jnp.float32, nu_dtype=jnp.float32,
                                    num_micro_batches=num_micro_batches)
  return adama(), optax_adama.mini_batch_chain(adama(), contrib.round_params_stochastically())


def test_the_fused_step_lands_on_a_neighbour_of_the_float32_sum():
  n = 4
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(keys[0], (32, 64)).astype(BF16),
            "w2": jax.random.normal(keys[1], (64, 8)).astype(BF16)}
  batch = {"x": jax.random.normal(keys[2], (16, 32)), "y": jax.random.normal(keys[3], (16, 8))}
  plain_tx, rounded_tx = _chains(n)
  # The float32 sum p + u: the same step on float32 copies of the bf16 params,
  # their gradients rounded to bf16 as the bf16 params' are.
  wide = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  wide_loss = lambda p, mb: _bf16_loss(jax.tree.map(_bf16_cotangent, p), mb)
  wide_next, _, _ = optax_adama.microbatch_step(wide_loss, plain_tx, num_micro_batches=n)(
      jax.tree.map(jnp.copy, wide), plain_tx.init(wide), batch)
  step = optax_adama.microbatch_step(_bf16_loss, rounded_tx, num_micro_batches=n)
  state = rounded_tx.init(params)
  assert optax.tree.get(state.inner[1], "count").dtype == jnp.uint32
  got, state, _ = step(jax.tree.map(jnp.copy, params), state, batch)
  for name in params:
    assert got[name].dtype == BF16
    low, high = neighbours(wide_next[name])
    value = got[name].astype(jnp.float32)
    # One float32 ulp of slack: the bf16 and float32 programs fuse differently.
    slack = 2.0**-23 * jnp.abs(wide_next[name])
    assert bool(jnp.all((value >= low - slack) & (value <= high + slack))), name
  assert int(optax.tree.get(state.inner[1], "count")) == 1


def test_the_release_with_offloaded_moments_rounds_a_layer_at_a_time():
  num_layers, width = 6, 32
  staged = optax_adama.StagedLoss(
      lambda outer, mb: mb["x"] @ outer["w_in"].astype(jnp.float32),
      lambda layer, x, mb: jnp.tanh(x @ layer["w"].astype(jnp.float32)),
      lambda outer, x, mb: jnp.mean((x @ outer["w_in"].astype(jnp.float32).T - mb["y"]) ** 2),
      layers=("stack",))
  keys = jax.random.split(jax.random.key(1), 4)
  params = {"w_in": (jax.random.normal(keys[1], (width, width)) / width**0.5).astype(BF16),
            "stack": {"w": (jax.random.normal(keys[0], (num_layers, width, width))
                            / width**0.5).astype(BF16)}}
  batch = {"x": jax.random.normal(keys[2], (8, width)), "y": jax.random.normal(keys[3], (8, width))}
  plain_tx, rounded_tx = _chains(2)
  new = {}
  for name, tx in (("plain", plain_tx), ("rounded", rounded_tx)):
    tx = optax_adama.offload_moments(tx)
    step = optax_adama.release_step(staged, tx)
    new[name], _, metrics = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    assert bool(jnp.isfinite(metrics["loss"]))
  for path, got in jax.tree_util.tree_leaves_with_path(new["rounded"]):
    assert got.dtype == BF16, path
  # Round-to-nearest and stochastic rounding of the same float32 sum are at
  # most one bfloat16 spacing apart.
  plain, rounded = (new[k]["stack"]["w"].astype(jnp.float32) for k in ("plain", "rounded"))
  spacing = jnp.abs(plain) * 2.0**-7 + 2.0**-133
  assert bool(jnp.all(jnp.abs(rounded - plain) <= spacing))
  # ... and differ where the noise rounded away from the nearest, in every layer.
  assert all(bool(jnp.any(rounded[i] != plain[i])) for i in range(num_layers))


def test_bad_input_is_refused_with_the_fix():
  for seed in (-1, 1.5, True, "0"):
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
      contrib.round_params_stochastically(seed)
  tx = contrib.round_params_stochastically()
  with pytest.raises(ValueError, match="needs params"):
    tx.update({"w": jnp.ones(2)}, tx.init(None))
