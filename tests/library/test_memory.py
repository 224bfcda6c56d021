"""Compiled memory of the fused step, from XLA's memory_analysis() on CPU."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import MLP

import optax_adama

# Eight unrolled 256x256 layers: P = 2.1 MB, the largest leaf P/8, and a
# micro-batch of 8 rows keeps activations small (about P/130), so the floor
# is dominated by params + m + v + one layer's gradient.
NUM_LAYERS, WIDTH, BATCH, NUM_MICRO = 8, 256, 32, 4


MODEL = MLP(num_layers=NUM_LAYERS, width=WIDTH)
loss_fn = MODEL.loss


@pytest.fixture(scope="module")
def setup():
  # Compile only: nothing is allocated.
  return MODEL.abstract_params(), MODEL.abstract_batch(BATCH)


def _report(tx, params, batch):
  state = jax.eval_shape(tx.init, params)
  step = optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=NUM_MICRO)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
    return optax_adama.memory_report(step, params, state, batch), state


def test_adama_step_is_at_the_floor_and_below_accumulation(setup):
  params, batch = setup
  # The floor is "mean"'s: "split" (the default here) holds a leaf's two
  # halves' gradients at its fold, one leaf more (test_defaults.py).
  adama, adama_state = _report(
      optax_adama.adama(1e-3, num_micro_batches=NUM_MICRO),
      params, batch)
  accumulation, _ = _report(optax.adam(1e-3), params, batch)
  multisteps, _ = _report(optax.MultiSteps(optax.adam(1e-3), NUM_MICRO), params, batch)
  floor = optax_adama.memory.memory_floor(
      loss_fn, params, adama_state, batch, num_micro_batches=NUM_MICRO)
  P = adama.param_bytes
  assert P == floor.param_bytes == NUM_LAYERS * (WIDTH * WIDTH + WIDTH) * 4
  assert adama.in_p(P) == 1.0
  # Donation aliases params and m, v: at least 3 P of outputs reuse inputs.
  assert adama.alias_bytes >= 3 * P
  assert floor.largest_gradient_bytes == WIDTH * WIDTH * 4
  # The contract: within 5% of params + m + v + batch + activations +
  # the largest gradient leaf (measured: +2.9%).
  assert adama.total_bytes <= 1.05 * floor.total_bytes, (adama, floor.to_dict())
  assert adama.total_bytes >= floor.param_bytes + floor.opt_state_bytes
  # The gradient accumulator is gone: at least 0.8 P below the scan baseline
  # (measured 0.98 P), and two P below MultiSteps (measured 2.8 P).
  assert accumulation.total_bytes - adama.total_bytes >= 0.8 * P
  assert multisteps.total_bytes - adama.total_bytes >= 2.0 * P


def test_memory_report_total_of_a_step_whose_bytes_are_known():
  """An elementwise update of a tree of known size: donated, it runs in place."""
  params = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32),
            "b": jax.ShapeDtypeStruct((512,), jnp.float32)}
  P = (256 * 512 + 512) * 4  # 526,336 bytes
  update = lambda p: jax.tree.map(lambda x: 0.5 * x, p)
  in_place = optax_adama.memory_report(jax.jit(update, donate_argnums=0), params)
  copied = optax_adama.memory_report(jax.jit(update), params)
  assert in_place.param_bytes == copied.param_bytes == P
  # One copy of the tree when donated, two (input and output) when not; the
  # slack is the output tuple's index table.
  assert P <= in_place.total_bytes <= P + 1024, in_place
  assert 2 * P <= copied.total_bytes <= 2 * P + 1024, copied
  assert in_place.in_p(in_place.total_bytes) == pytest.approx(1.0, abs=0.01)
  assert in_place.to_dict()["total_p"] == pytest.approx(1.0, abs=0.01)
  assert "P =" in str(in_place)


def test_memory_report_accepts_lowered_and_compiled():
  f = jax.jit(lambda x: x * 2.0)
  x = jnp.ones(1000)
  lowered = f.lower(x)
  a = optax_adama.memory_report(lowered, param_bytes=4000)
  b = optax_adama.memory_report(lowered.compile(), param_bytes=4000)
  c = optax_adama.memory_report(f, x)
  assert a.total_bytes == b.total_bytes == c.total_bytes
  assert c.param_bytes == 4000
  with pytest.raises(TypeError, match="jitted function"):
    optax_adama.memory_report(lambda x: x, x)
  with pytest.raises(ValueError, match="param_bytes"):
    optax_adama.memory_report(lowered)


def test_scanned_layers_make_the_stack_one_gradient_leaf():
  """Layers stacked under lax.scan: the stack's gradient is one leaf of ~1 P.

  AdamA can only free a gradient leaf once it exists whole, so its floor rises
  by that leaf (the README's advice: unroll layers). It still saves the
  accumulator against gradient accumulation.
  """
  def stacked_loss(params, batch):
    def layer(x, w):
      return jnp.tanh(x @ w["w"] + w["b"][None, :]), None
    x, _ = jax.lax.scan(layer, batch["x"], params)
    return jnp.mean((x - batch["y"]) ** 2)

  params = {"w": jax.ShapeDtypeStruct((NUM_LAYERS, WIDTH, WIDTH), jnp.float32),
            "b": jax.ShapeDtypeStruct((NUM_LAYERS, WIDTH), jnp.float32)}
  batch = {"x": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
           "y": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)}
  reports = {}
  # "mean": with "split" the stack's two halves' gradients are two such leaves.
  for name, tx in [("adama", optax_adama.adama(1e-3, num_micro_batches=NUM_MICRO)),
                   ("accumulation", optax.adam(1e-3))]:
    step = optax_adama.microbatch_step(stacked_loss, tx, num_micro_batches=NUM_MICRO)
    with jax.numpy_dtype_promotion("standard"):
      reports[name] = optax_adama.memory_report(
          step, params, jax.eval_shape(tx.init, params), batch)
  P = reports["adama"].param_bytes
  floor = optax_adama.memory.memory_floor(
      stacked_loss, params,
      jax.eval_shape(optax_adama.adama(1e-3, num_micro_batches=NUM_MICRO).init, params),
      batch, num_micro_batches=NUM_MICRO)
  assert floor.largest_gradient_bytes >= 0.99 * P  # the stacked weights
  assert reports["adama"].total_bytes <= 1.05 * floor.total_bytes  # measured 4.31 P
  assert reports["accumulation"].total_bytes - reports["adama"].total_bytes >= 0.8 * P


# A module as XLA prints it, cut to what collective_bytes reads: a loop of 4
# micro-batches around a loop of 3 layers, each layer gathering 1 KiB and
# reduce-scattering 256 B to each of 4 devices, and one all-reduce outside.
_LOOPED_HLO = (
    "HloModule step\n"
    "\n"
    "%layer_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {\n"
    "  %all-gather.1 = f32[256]{0} all-gather(%x), channel_id=1, replica_groups=[1,4]<=[4],"
    " dimensions={0}\n"
    "  %reduce-scatter.2 = f32[64]{0} reduce-scatter(%y), channel_id=2,"
    " replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add\n"
    "}\n"
    "\n"
    "%micro_batch_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {\n"
    "  %while.1 = (s32[], f32[64]{0}) while(%t), condition=%cond, body=%layer_body,"
    ' backend_config={"known_trip_count":{"n":"3"}}\n'
    "}\n"
    "\n"
    "ENTRY %main (a: f32[64]) -> f32[64] {\n"
    "  %while.2 = (s32[], f32[64]{0}) while(%t), condition=%cond, body=%micro_batch_body,"
    ' backend_config={"known_trip_count":{"n":"4"}}\n'
    "  %all-reduce.3 = f32[8]{0} all-reduce(%z), channel_id=3, replica_groups={{0,1,2,3}},"
    " to_apply=%add\n"
    "}\n"
)


def test_collective_bytes_weighs_each_collective_by_its_loops():
  counted = optax_adama.memory.collective_bytes(_LOOPED_HLO)
  assert counted.by_kind == {"all-gather": 12 * 1024, "reduce-scatter": 12 * 1024,
                             "all-reduce": 32}
  assert counted.total == 24 * 1024 + 32 and counted.uncounted_loops == 0
  # Without a recorded trip count a loop counts once, and says so.
  unknown = optax_adama.memory.collective_bytes(
      _LOOPED_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', ""))
  assert unknown.by_kind["all-gather"] == 3 * 1024 and unknown.uncounted_loops == 1
