"""Sharding specs and option checks on one device, in this process (no subprocess)."""

import chex
import jax
import jax.numpy as jnp
import pytest
from _sharding_helpers import MODEL
from _sharding_helpers import NUM_MICRO
from _sharding_helpers import _params
from _sharding_helpers import _run
from _sharding_helpers import loss_fn
from jax.sharding import PartitionSpec

import optax_adama

# One xdist worker for every test_sharding*.py module (see test_sharding.py).
pytestmark = pytest.mark.xdist_group("eight_devices")


# Single-device checks, in this process.


def test_step_shardings_per_stage():
  mesh = jax.make_mesh((1,), ("data",))
  params = {"w": jnp.zeros((4, 3)), "scalar": jnp.zeros(())}
  tx = optax_adama.adama(1e-3, num_micro_batches=2)
  state = tx.init(params)
  specs = lambda tree: [s.spec for s in jax.tree.leaves(tree)]
  for stage in (None, "zero1", "zero2", "fsdp"):
    shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states=stage)
    chex.assert_trees_all_equal_structs(shardings.opt_state, state)
    moment_specs = specs(optax_adama.find_adama_state(shardings.opt_state).mu)
    # Leaves in tree order: "scalar", then "w".
    assert moment_specs == ([PartitionSpec()] * 2 if stage is None
                            else [PartitionSpec(), PartitionSpec("data")])
    assert specs(shardings.params)[1] == (
        PartitionSpec("data") if stage == "fsdp" else PartitionSpec())
  # A dimension the axis size does not divide is not split.
  shard_leaf_spec = optax_adama._sharding.shard_leaf_spec
  assert shard_leaf_spec((3, 16), 8) == PartitionSpec(None, "data")
  assert shard_leaf_spec((3, 5), 8) == PartitionSpec()



@pytest.mark.parametrize("stage", ["zero1", "zero2", "fsdp"])
def test_eight_bit_moments_are_split_where_their_gradients_are(stage):
  # Each device quantizes the blocks of its own gradient slice. Codes split
  # any other way made GSPMD reshard them in every micro-batch ("Involuntary
  # full rematerialization" of a 4,096-element leaf with 2 blocks on 8 devices).
  mesh = jax.sharding.AbstractMesh((8,), ("data",))  # specs only: no devices needed
  params = {
      "kernel": jnp.zeros((512, 256)),  # rows split: 8 whole blocks per device
      "few_blocks": jnp.zeros((4096,)),  # 2 blocks of 2,048: fewer than devices
      "straddling": jnp.zeros((3, 8 * 2048)),  # split along columns: 24 blocks, none whole
      "odd": jnp.zeros((3, 5 * 2048 + 2)),  # no dimension divides by 8: the param is whole
  }
  # The flat layout (blocks over the whole leaf), whose splits are checked here.
  tx = optax_adama.adamaw(1e-3, num_micro_batches=2,
                          quantization=optax_adama.BlockQuantization(layer_aligned=False))
  state = jax.eval_shape(tx.init, params)
  shardings = optax_adama.sharding.step_shardings(params, state, mesh, shard_states=stage)
  adama = optax_adama.find_adama_state(shardings.opt_state)
  split_dim = optax_adama._sharding.split_dim
  for moment in (adama.mu, adama.nu):
    # The blocks' axis (a spec may or may not spell out trailing Nones).
    assert split_dim(moment["kernel"].codes.spec) == 0
    assert split_dim(moment["kernel"].scale.spec) == 0
    # A few blocks: kept whole on every device (8 KiB of codes at most).
    assert moment["few_blocks"].codes.spec == PartitionSpec()
    # No split gives each device whole blocks of its slice: the leaf keeps
    # the split of its own codes, 3 blocks per device.
    assert split_dim(moment["straddling"].codes.spec) == 0
    # A gradient whole on every device: its moment keeps its own split (16
    # blocks, 2 per device), each device slicing what it folds.
    assert split_dim(moment["odd"].codes.spec) == 0
  assert shardings.grads["straddling"].spec == (
      PartitionSpec() if stage == "zero1" else PartitionSpec(None, "data"))
  assert shardings.grads["odd"].spec == PartitionSpec()
  # Layer-aligned blocks (each row its own) split with the row's columns.
  aligned = optax_adama.adamaw(1e-3, num_micro_batches=2, quantization=(
      optax_adama.BlockQuantization(layer_aligned=True)))
  embedding = {"embedding": jnp.zeros((1001, 64))}  # rows not divisible by 8
  shardings = optax_adama.sharding.step_shardings(
      embedding, jax.eval_shape(aligned.init, embedding), mesh, shard_states=stage)
  codes = optax_adama.find_adama_state(shardings.opt_state).mu["embedding"].codes
  assert codes.spec == PartitionSpec(None, None, "data")  # codes [1001, 1, 64]

@pytest.mark.parametrize("stage", ["zero2", "fsdp"])
def test_one_device_mesh_equals_plain_step(stage):
  mesh = jax.make_mesh((1,), ("data",))
  # "mean": equal to 1e-6; "split"'s cancellation amplifies the rounding of
  # the sums (its mesh equality: zero2_split's tolerance).
  tx = optax_adama.adamaw(1e-2, weight_decay=0.1, num_micro_batches=NUM_MICRO)
  ref = _run(tx, _params(), steps=2)
  got = _run(tx, _params(), steps=2, mesh=mesh, shard_states=stage)
  chex.assert_trees_all_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(got[1], ref[1], rtol=1e-6, atol=1e-7)


def test_bad_sharding_options_are_rejected():
  tx = optax_adama.adama(1e-3, num_micro_batches=2)
  with pytest.raises(ValueError, match="needs a mesh"):
    optax_adama.microbatch_step(loss_fn, tx, num_micro_batches=2, shard_states="zero2")
  mesh = jax.make_mesh((1,), ("data",))
  with pytest.raises(ValueError, match="shard_states"):
    optax_adama.microbatch_step(
        loss_fn, tx, num_micro_batches=2, mesh=mesh, shard_states="zero4")
  with pytest.raises(ValueError, match="not in the mesh"):
    optax_adama.sharding.step_shardings(_params(), None, mesh, data_axis="batch")
  split = optax_adama.contrib.adama(1e-3, num_micro_batches=NUM_MICRO, nu_estimator="split")
  step = optax_adama.microbatch_step(loss_fn, split, mesh=mesh)
  with pytest.raises(ValueError, match="micro-batch size must be even, got 3"):
    step(_params(), split.init(_params()), MODEL.batch(0, 3 * NUM_MICRO))


def test_release_step_rejects_what_it_does_not_support():
  import test_release  # pylint: disable=g-import-not-at-top

  staged = test_release.staged_loss()
  tx = optax_adama.adama(1e-2, num_micro_batches=2)
  mesh = jax.make_mesh((1,), ("data",))
  with pytest.raises(ValueError, match="needs a mesh"):
    optax_adama.release_step(staged, tx, shard_states="zero2")
  with pytest.raises(ValueError, match="shard_states"):
    optax_adama.release_step(staged, tx, mesh=mesh, shard_states="zero3")
  quantized = optax_adama.adama(
      1e-2, num_micro_batches=2, quantization=optax_adama.BlockQuantization(min_size=16))
  params = {"w_in": jnp.zeros((64, 64)), "b_out": jnp.zeros(64),
            "body": {"stack": {"w": jnp.zeros((8, 4, 4)), "b": jnp.zeros((8, 4))}}}
  step = optax_adama.release_step(staged, quantized, mesh=mesh, shard_states="zero2")
  with pytest.raises(NotImplementedError, match="layer_aligned=True"):
    step(params, quantized.init(params), test_release.make_batch(0, width=64))
