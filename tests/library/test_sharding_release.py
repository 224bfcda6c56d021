"""release_step, and FSDP on a StagedLoss, on the 8-device mesh against one device."""

import pytest
import test_sharding
from _sharding_helpers import NUM_DEVICES
from _sharding_helpers import NUM_MICRO
from _sharding_helpers import _assert_split_close
from _sharding_helpers import _largest_operand
from _sharding_helpers import _num_release_layers
from _sharding_release import FLOOR_STAGES
from _sharding_release import RELEASE_CASES
from _sharding_release import RELEASE_STAGES
from _sharding_release import SMOKE_MEMORY_STAGES
from _sharding_release import SMOKE_RELEASE_CASES
from _sharding_release import _stage_params
from jax.sharding import PartitionSpec

# One xdist worker for every test_sharding*.py module (see test_sharding.py).
pytestmark = pytest.mark.xdist_group("eight_devices")
# The 8-device subprocess's results: the session fixture of test_sharding.py.
eight_devices = test_sharding.eight_devices


@pytest.mark.parametrize("estimator,stage", [
    pytest.param(estimator, stage, marks=() if stage in SMOKE_RELEASE_CASES.get(estimator, ())
                 else pytest.mark.slow)
    for estimator, stages in RELEASE_CASES.items() for stage in stages])
def test_release_step_on_a_mesh_equals_one_device(eight_devices, stage, estimator):
  run = eight_devices["release"][f"{estimator}/{stage}"]
  # Same math, cross-device sums in another order (float32); a NaN row in
  # one device's share drops the whole micro-batch on every device.
  if estimator == "split":
    _assert_split_close(run)
  else:
    assert run["max_diff"] < 1e-6, run
  assert run["metrics_diff"] < 1e-6, run
  assert run["num_dropped"] == 1, run
  # Every device holds a slice of every layer's moments; params replicated.
  expected = PartitionSpec() if stage is None else PartitionSpec(None, "data")
  assert run["stack_moment_spec"] == str(expected), run
  # Params replicated, but under FSDP: a slice of every layer on each device.
  assert run["param_spec"] == str(expected if stage == "fsdp" else PartitionSpec()), run


@pytest.mark.parametrize("stage", _stage_params("8bit"))
def test_release_step_with_eight_bit_moments_on_a_mesh_equals_one_device(eight_devices, stage):
  run = eight_devices["release"][f"8bit/{stage}"]
  # Rounded to nearest, each device folds the whole blocks of its slice as
  # one device folds them: the same codes (measured: all of them; the
  # cross-device sum rounds in another order, and a value an ulp from a code
  # boundary may round the other way) and the same step up to float32
  # rounding of the update (one step, the one with a dropped micro-batch).
  assert run["fraction_codes_differ"] < 1e-3, run
  assert run["param_diff"] < 1e-6, run
  assert run["num_dropped"] == 1, run
  assert run["codes_shape"] == [8, 16, 256], run  # [layers, blocks, block_len]
  # A slice of every layer's blocks on each device; of the biases (one
  # block per layer) a part of every block.
  split = str(PartitionSpec() if stage is None else PartitionSpec(None, "data"))
  assert run["codes_spec"] == split, run
  assert run["bias_codes_spec"] == str(
      PartitionSpec() if stage is None else PartitionSpec(None, None, "data")), run
  assert run["param_spec"] == (split if stage == "fsdp" else str(PartitionSpec())), run


@pytest.mark.slow  # each device's own rounding noise: the full run only
def test_release_step_with_stochastic_eight_bit_moments_on_a_mesh_trains_like_one_device(
    eight_devices):
  run = eight_devices["release"]["8bit_stochastic/fsdp"]
  # Each device draws its own rounding noise, so the mesh's params are another
  # draw of one device's: as far from them as rounding to nearest is (a bias,
  # a fold of the wrong blocks, or a misplaced slice would be several times
  # further), and both far below the params' movement in training.
  assert run["rms_to_one_device"] < 2 * run["rms_rounding"], run
  assert run["rms_rounding"] < 0.2 * run["rms_movement"], run


@pytest.mark.slow
@pytest.mark.parametrize("stage", FLOOR_STAGES)
def test_release_floor_on_a_mesh_equals_one_device(eight_devices, stage):
  run = eight_devices["release"][f"floor/{stage}"]
  assert run["stack_floor_shapes"] == [[_num_release_layers(), 128]] * 2, run
  assert run["floor_spec"] == str(PartitionSpec()), run  # whole on every device
  # Sums in another order: float32 rounding; params as _assert_split_close.
  assert run["floor_relative_diff"] < 1e-5, run
  assert run["param_diff"] < 2e-4, run


@pytest.mark.parametrize("step", ["microbatch_step", "release_step"])
def test_bad_input_on_a_mesh_is_refused_before_any_buffer_is_donated(eight_devices, step):
  bad = eight_devices["bad_input"]
  rows = bad[f"rows/{step}"]
  assert "batch has 12 rows" in rows["error"] and "multiple of N x 8 = 32" in rows["error"]
  assert not rows["donated"]
  assert "data_axis 'batch' is not in the mesh axes ('data',)" in bad[f"axis/{step}"]
  if step == "release_step":
    layers = bad["layers/release_step"]
    assert "same leading (layer) axis" in layers["error"], layers
    assert f"{_num_release_layers() - 1} for ['b']" in layers["error"], layers
    assert not layers["donated"]
    placement = bad["placement/release_step"]
    assert "opt_state.adama.mu['body']['stack']['b'] is placed as P('data',)" in (
        placement["error"]), placement
    assert "release_shardings for release_step" in placement["error"]
    assert not placement["donated"]
    blocks = bad["blocks/release_step"]
    assert "['stack']['w'] (shape (8, 3, 1024), codes (8, 16, 192))" in (
        blocks["error"]), blocks
    assert "layer_aligned=True" in blocks["error"] and "min_size" in blocks["error"], blocks
    assert not blocks["donated"]
    memory = bad["memory/release_step"]
    assert ("opt_state.adama.mu['body']['stack']['b'] is placed as P(None, 'data') in "
            "device memory but this step keeps it as P(None, 'data') in pinned_host "
            "memory") in memory["error"], memory
    assert "under offload_moments, from the state its init returns" in memory["error"], memory
    assert not memory["donated"]


def test_fsdp_on_a_staged_loss_gathers_one_layer_at_a_time(eight_devices):
  run = eight_devices["fsdp_staged"]
  assert run["param_spec"] == str(PartitionSpec(None, "data")), run  # every layer split
  # The default estimator: the same math as one device but for the order of
  # the cross-device sums (measured: params 6e-8, moments 3.5e-7 of their
  # largest entry), as the other mesh steps.
  assert run["param_diff"] < 1e-6, run
  assert run["moment_relative_diff"] < 1e-5, run
  assert run["loss_diff"] < 1e-6, run
  # Per device, 8 layers: each step holds about a layer of gathered params,
  # the stages' gathered inside their scan, the plain loss's by GSPMD inside
  # the loss's own scan (leaves split along their largest axis). Gathering
  # every leaf for the whole micro-batch held the whole model: 3.39 P at
  # width 512, against 1.08 P gathered layer by layer.
  P = run["param_bytes"]
  assert run["per_layer_bytes"] < 1.5 * P, (run, P)
  assert run["plain_bytes"] < 1.5 * P, (run, P)


def test_release_step_on_a_mesh_holds_one_layer_at_a_time(eight_devices):
  memory = eight_devices["release"]["memory"]
  P = memory["param_bytes"]
  in_p = lambda key: memory[key]["total_bytes"] / P
  layer = 512 * 512  # elements of one layer's weight
  # The stages that split the state in the default run, every one with the
  # slow tests.
  stages = [stage for stage in RELEASE_STAGES if f"release/{stage}" in memory]
  assert stages == list(RELEASE_STAGES if eight_devices["full"] else SMOKE_MEMORY_STAGES)
  # No collective moves more than one layer: gradients are reduced and
  # updated params gathered layer by layer.
  for stage in stages:
    for operands in memory[f"release/{stage}"]["collectives"].values():
      assert _largest_operand(operands) <= layer, (stage, operands)
  zero2 = memory["release/zero2"]["collectives"]
  assert _largest_operand(zero2["reduce-scatter"]) == layer // NUM_DEVICES
  # Measured per device (P = params): release 3.55 / 1.58 / 1.53 P against
  # the fused step's 5.03 / 3.28 / 2.46 P (plain, ZeRO-1, ZeRO-2). ZeRO
  # floor: params + m + v split 8 ways + one layer's gradient = 1.375 P.
  for stage, bound in ((None, 3.6), ("zero1", 1.65), ("zero2", 1.6)):
    if stage in stages:
      assert in_p(f"release/{stage}") < bound, (stage, in_p(f"release/{stage}"))
      assert in_p(f"fused/{stage}") - in_p(f"release/{stage}") > 0.85, stage
  # FSDP, both steps gathering layer by layer: release 0.60 P, fused 0.69 P.
  # Floor: params + m + v split 8 ways + one layer, gathered or as its
  # gradient (not both: the weight's gradient does not need the gathered
  # weight) = 0.375 + 0.125 = 0.5 P.
  assert in_p("release/fsdp") < 0.65, in_p("release/fsdp")
  assert in_p("release/fsdp") < in_p("fused/fsdp") < 0.75, in_p("fused/fsdp")
  assert _largest_operand(memory["release/fsdp"]["collectives"]["all-gather"]) == layer


@pytest.mark.parametrize("name", ["release", "fused"])
def test_fsdp_moves_the_ideal_collective_bytes(eight_devices, name):
  # FSDP's ideal per micro-batch: the params all-gathered twice (forward,
  # backward) and the gradient reduce-scattered once: 3 P, N times a step.
  # The trip counts of the scans weigh each collective (collective_bytes);
  # a collective of the whole stack, or one per micro-batch and layer too
  # many, would move the total by at least 1 P per micro-batch.
  memory = eight_devices["release"]["memory"]
  P, by_kind = memory["param_bytes"], memory[f"{name}/fsdp"]["collective_bytes"]
  assert by_kind["all-gather"] == pytest.approx(2 * NUM_MICRO * P, rel=0.01), by_kind
  assert by_kind["reduce-scatter"] == pytest.approx(NUM_MICRO * P, rel=0.01), by_kind
  assert sum(by_kind.values()) / (3 * NUM_MICRO * P) < 1.01, by_kind
