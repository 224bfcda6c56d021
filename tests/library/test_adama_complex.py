"""AdamA on complex params and moments."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _adama_helpers import ATOL
from _adama_helpers import RTOL
from _adama_helpers import _adama_state
from _adama_helpers import _grads
from _adama_helpers import _params
from _adama_helpers import _run_adama
from _adama_helpers import _run_optax

import optax_adama


def _complex_params():
  w = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  return {"w": jax.lax.complex(w, w[::-1]), "b": jnp.zeros(3)}


def _complex_grads(params, step, micro=0):
  return jax.tree.map(lambda p: (jnp.sin(3.0 * p + 0.7 * step + 1.3 * micro)
                                 + 0.1 * micro).astype(p.dtype), params)


# optax.adam moves complex params with v the EMA of |g|**2 (stored complex,
# imaginary part zero); AdamA does the same, so upstream code written for
# complex params runs unchanged (optax's alias tests run every optimizer on
# a complex parabola).
@pytest.mark.parametrize("nu_estimator", ["mean", "sum", "momentum"])
def test_complex_params_step_as_optax_adam(nu_estimator):
  params = _complex_params()
  ours = optax_adama.contrib.adama(0.05, num_micro_batches=1, nu_estimator=nu_estimator)
  got, state = _run_adama(ours, params, 25, 1, _complex_grads)
  want = _run_optax(optax.adam(0.05), params, 25, lambda p, s: _complex_grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)
  adama_state = _adama_state(state)
  want_state = optax.adam(0.05).init(params)[0]
  dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)
  for ours_moment, optax_moment in ((adama_state.mu, want_state.mu),
                                    (adama_state.nu, want_state.nu)):
    assert dtypes(ours_moment) == dtypes(optax_moment)
  assert float(jnp.max(jnp.abs(adama_state.nu["w"].imag))) == 0.0


def test_complex_params_fold_the_mean_of_absolute_squares_float64_reference():
  """N = 3 distinct micro-batches against the fold written out in complex128."""
  params = _complex_params()
  lr, b1, b2, eps, n = 0.05, 0.9, 0.999, 1e-8, 3
  got, _ = _run_adama(optax_adama.adama(lr, num_micro_batches=n), params, 6, n,
                      _complex_grads)
  want = jax.tree.map(
      lambda p: np.asarray(p, np.complex128 if jnp.iscomplexobj(p) else np.float64), params)
  m = jax.tree.map(np.zeros_like, want)
  v = jax.tree.map(lambda p: np.zeros(p.shape), want)
  for step in range(6):
    # _complex_grads, in float64 / complex128 at the reference's own params.
    grads = [{key: np.sin(3.0 * p + 0.7 * step + 1.3 * micro) + 0.1 * micro
              for key, p in want.items()} for micro in range(n)]
    for key in want:
      gs = [g[key] for g in grads]
      m[key] = b1 * m[key] + (1 - b1) * sum(gs) / n
      v[key] = b2 * v[key] + (1 - b2) * sum(np.abs(g) ** 2 for g in gs) / n
      m_hat, v_hat = m[key] / (1 - b1 ** (step + 1)), v[key] / (1 - b2 ** (step + 1))
      want[key] = want[key] - lr * m_hat / (np.sqrt(v_hat) + eps)
  # float32 against float64 over 6 steps of O(lr) updates: rounding ~1e-7 per op.
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), want, rtol=RTOL, atol=ATOL)


def test_real_params_with_complex_moments_match_optax_without_warnings():
  # optax's upstream dtype tests pass mu_dtype=complex64 with real params; the
  # suite's filterwarnings=error turns any complex-to-real cast into a failure,
  # and AdamA runs under strict promotion (only optax's own update needs the
  # standard one).
  params = _params()
  ours = optax_adama.adama(0.05, num_micro_batches=1, mu_dtype=jnp.complex64)
  ref = optax.adam(0.05, mu_dtype=jnp.complex64)
  state, ref_state = ours.init(params), ref.init(params)
  grads = _grads(params, 0)
  for _ in range(3):
    updates, state = ours.update(grads, state, params)
    with jax.numpy_dtype_promotion("standard"):
      ref_updates, ref_state = ref.update(grads, ref_state, params)
  chex.assert_trees_all_close(updates, ref_updates, rtol=RTOL, atol=ATOL)
  dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)
  assert dtypes(updates) == dtypes(ref_updates)
  # "momentum" at N > 1 adds |m_hat|**2 of the complex m to the real v.
  momentum = optax_adama.contrib.adama(0.05, num_micro_batches=3, mu_dtype=jnp.complex64,
                               nu_estimator="momentum")
  state = momentum.init(params)
  for micro in range(6):
    updates, state = momentum.update(_grads(params, 0, micro), state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("nu_estimator", ["mean", "sum", "momentum"])
def test_complex_updates_turn_with_the_gradients_phase(nu_estimator):
  """Gradients times e^{i theta}: m turns with them, v (|g|**2, |m_hat|**2)
  does not, so every update turns by the same phase. A v of g**2 (or m**2)
  would turn by twice the phase and break it."""
  params = _complex_params()
  phase = jax.lax.complex(jnp.cos(0.7), jnp.sin(0.7))
  turn = lambda tree: jax.tree.map(
      lambda g: g * phase.astype(g.dtype) if jnp.iscomplexobj(g) else g, tree)
  grads = [_complex_grads(params, step, micro) for step in range(3) for micro in range(3)]
  runs = []
  for make_grads in (lambda g: g, turn):
    tx = optax_adama.contrib.adama(0.05, num_micro_batches=3, nu_estimator=nu_estimator)
    state, total = tx.init(params), jax.tree.map(jnp.zeros_like, params)
    for g in grads:
      updates, state = tx.update(make_grads(g), state, params)
      total = jax.tree.map(jnp.add, total, updates)
    runs.append(total)
  chex.assert_trees_all_close(runs[1], turn(runs[0]), rtol=RTOL, atol=ATOL)


def test_complex_params_with_a_real_second_moment_fold_absolute_squares():
  # v is real even for complex params: nu_dtype=float32 halves its bytes and
  # must step as the complex v does (|g|**2, not Re(g)**2).
  params = _complex_params()
  runs = []
  for nu_dtype in (None, jnp.float32):
    tx = optax_adama.adama(0.05, num_micro_batches=2, nu_dtype=nu_dtype)
    got, state = _run_adama(tx, params, 5, 2, _complex_grads)
    runs.append(got)
  assert _adama_state(state).nu["w"].dtype == jnp.float32
  chex.assert_trees_all_close(runs[1], runs[0], rtol=RTOL, atol=ATOL)


def test_inject_hyperparams_takes_complex_params():
  # optax casts the hyperparameters to the params' widest dtype, complex64 here
  # (its choice of that dtype promotes float32 with complex64: standard mode).
  params = _complex_params()
  tx = optax_adama.inject_hyperparams(optax_adama.adama)(
      learning_rate=0.05, num_micro_batches=1)
  with jax.numpy_dtype_promotion("standard"):
    got, _ = _run_adama(tx, params, 5, 1, _complex_grads)
  want = _run_optax(optax.adam(0.05), params, 5, lambda p, s: _complex_grads(p, s))
  chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_complex_params_train_through_microbatch_step_as_per_micro_batch_updates():
  target = jnp.asarray([1 + 2j, -1j, 0.5], jnp.complex64)
  def loss_fn(params, batch):
    residual = batch["x"] @ params["w"] + (params["b"].astype(jnp.complex64) - target)[None]
    return jnp.mean(jnp.abs(residual) ** 2)
  params = _complex_params()
  batch = {"x": jax.random.normal(jax.random.key(0), (8, 2)).astype(jnp.complex64)}
  tx = optax_adama.adama(0.05, num_micro_batches=4)
  step = optax_adama.microbatch_step(loss_fn, tx)
  fused = jax.tree.map(jnp.copy, params)  # the step donates its params
  state = tx.init(fused)
  for _ in range(3):
    fused, state, metrics = step(fused, state, batch)
  loop, loop_state = params, tx.init(params)
  for _ in range(3):
    for i in range(4):  # micro-batch i: rows i, i + 4 (microbatch_step's split)
      grads = jax.grad(loss_fn)(loop, jax.tree.map(lambda x, i=i: x[i::4], batch))
      updates, loop_state = tx.update(grads, loop_state, loop)
      loop = optax.apply_updates(loop, updates)
  chex.assert_trees_all_close(fused, loop, rtol=RTOL, atol=ATOL)
  assert float(metrics["loss"]) < float(loss_fn(params, batch))


def test_complex_params_refuse_eight_bit_moments_and_split_naming_the_leaf():
  params = _complex_params()
  eight_bit = optax_adama.adama(0.05, num_micro_batches=2, quantization=(
      optax_adama.BlockQuantization(block_size=2, min_size=2)))
  with pytest.raises(TypeError, match=r"\['w'\] \(complex64\).*quantization=None"):
    eight_bit.init(params)
  for estimator in ("split", "auto"):
    with pytest.raises(TypeError, match=r"\['w'\] \(complex64\).*nu_estimator=\"mean\""):
      optax_adama.contrib.adama(0.05, num_micro_batches=2, nu_estimator=estimator).init(params)
  wide = {"w": jax.lax.complex(jnp.ones((8, 8)), jnp.ones((8, 8)))}
  with pytest.raises(TypeError, match=r"low_rank projects real matrices.*\['w'\]"):
    optax_adama.low_rank(optax_adama.adama(0.05, num_micro_batches=2), rank=2,
                         refresh_period=10, min_size=16).init(wide)
  with pytest.raises(TypeError, match=r"measures real params.*\['w'\]"):
    optax_adama.diagnostics.diagnose_second_moment(
        lambda p, b: 0.0, params, [], num_micro_batches=2)
