"""Host-offloaded moments on the 8-device mesh: microbatch_step and release_step."""

import pytest
import test_sharding
from _sharding_helpers import _largest_operand
from _sharding_release import OFFLOAD_MIN_SIZE
from _sharding_release import _stage_params
from jax.sharding import PartitionSpec
from test_sharding import OFFLOADED_STAGES
from test_sharding import SMOKE_OFFLOADED_STAGES

# One xdist worker for every test_sharding*.py module (see test_sharding.py).
pytestmark = pytest.mark.xdist_group("eight_devices")
# The 8-device subprocess's results: the session fixture of test_sharding.py.
eight_devices = test_sharding.eight_devices


@pytest.mark.parametrize("stage, moments", _stage_params("offload_float32", "float32")
                         + _stage_params("offload_8bit", "8bit"))
def test_release_step_with_offloaded_moments_on_a_mesh_equals_one_device(
    eight_devices, stage, moments):
  run = eight_devices["release"][f"offload_{moments}/{stage}"]
  # Against one device with the moments on it: the tolerances of the
  # on-device checks above (float32: three steps; 8-bit: one step), for the
  # same reason (cross-device sums in another order).
  if moments == "float32":
    assert run["max_diff"] < 1e-6, run
    assert run["metrics_diff"] < 1e-6, run
  else:
    assert run["fraction_codes_differ"] < 1e-3, run
    assert run["param_diff"] < 1e-6, run
  assert run["num_dropped"] == 1, run
  # Against the mesh with the moments on the devices: the same fold of the
  # same slices, brought in and sent back (copies), so the same bits but
  # for the update, whose direction each device computes a layer at a time
  # from its slices (on the device, GSPMD computes it whole): the same
  # elementwise arithmetic, fused otherwise. Measured:
  # equal bit for bit but ZeRO-1/2 float32, 3e-8 (under an ulp of the params).
  assert run["to_on_device_mesh"] < 1e-7, run
  # Each device keeps its slice of every layer's moments, in host memory.
  expected = PartitionSpec() if stage is None else PartitionSpec(None, "data")
  assert run["stack_moment_spec"] == str(expected), run
  kinds = run["state_memory"]
  host = {path for path, (_, size) in kinds.items() if size >= OFFLOAD_MIN_SIZE}
  assert host and len(host) < len(kinds), kinds  # some of each
  assert all(kinds[path][0] == "pinned_host" for path in host), kinds
  assert all(kind == "device" for path, (kind, _) in kinds.items() if path not in host), kinds
  assert run["param_memory"] == ["device"], run


# FSDP with the slow tests; its smoke: the zero2 case here, and
# test_release_step_with_offloaded_moments_on_a_mesh_equals_one_device[fsdp-8bit] (FSDP).
@pytest.mark.parametrize("stage", [
    stage if stage in SMOKE_OFFLOADED_STAGES else pytest.param(stage, marks=pytest.mark.slow)
    for stage in OFFLOADED_STAGES])
def test_microbatch_step_with_offloaded_moments_on_a_mesh_equals_one_device(
    eight_devices, stage):
  # A fresh offload_moments state, placed by the step, trains as tx on one
  # device with its moments on the device: the same math, only the order of
  # the cross-device sums differs (float32), as in the on-device mesh steps.
  result = eight_devices["offloaded"][stage]
  assert result["max_diff"] < 1e-6, result
  assert result["memory_kind"] == "pinned_host", result
  assert "data" in result["spec"], result


def test_microbatch_step_refuses_offloaded_moments_placed_in_device_memory(eight_devices):
  result = eight_devices["offloaded"]["device_placed"]
  assert "pinned_host" in result["error"] and "offload_moments" in result["error"], result
  assert result["intact"], result


def test_release_step_places_a_fresh_offloaded_state_on_the_mesh(eight_devices):
  run = eight_devices["release"]["offload_fresh/zero2"]
  assert run["stack_moment_spec"] == str(PartitionSpec(None, "data")), run
  kinds = run["state_memory"]
  assert kinds[".adama.mu['body']['stack']['w']"][0] == "pinned_host", kinds
  assert kinds[".adama.mu['b_out']"][0] == "device", kinds


def test_release_step_with_offloaded_moments_moves_one_layer_at_a_time(eight_devices):
  collectives = eight_devices["release"]["offload_collectives/zero2"]
  # ZeRO-2: each layer's gradient reduce-scattered, each layer's updated
  # params gathered as the update reaches it (a [1, 64, 64] slice); nothing
  # the size of the stack (left to GSPMD, the update gathered all 8 layers).
  layer = 64 * 64  # one layer of the stack's kernels (test_release.make_params)
  assert set(collectives) >= {"reduce-scatter", "all-gather"}, collectives
  for operands in collectives.values():
    assert _largest_operand(operands) <= layer, collectives
