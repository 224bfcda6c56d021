"""The release step's compiled layer loop: only in-place writes of the stack's buffers.

`release_step` folds each layer's gradient into its slice of the stacked m
and v inside the reverse layer scan. The fold must update that slice in
place (a dynamic-update-slice fusion): a copy of a whole stacked buffer, or
any whole-stack elementwise op, inside the loop costs the stack's bytes once
per layer (L times the work) and makes the step slower as the model deepens.
These tests read the optimized HLO of a small scanned stack and check every
instruction of every loop body that produces a buffer of a stacked shape.
"""

import collections
import re

import jax
import jax.numpy as jnp
import optax

try:  # run as a script (the census below) where pytest is not installed
  import pytest
  _expected_failure = pytest.mark.xfail
except ImportError:
  _expected_failure = lambda **kwargs: (lambda test: test)

import optax_adama

NUM_LAYERS = 6
WIDTH = 128

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(
    r"^(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(.*?(?:calls=%?([\w.\-]+))?")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Instruction lines of each computation of an HLO module's text."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match and not line.startswith(" "):
      current = comps.setdefault(match.group(1), [])
    elif current is not None and line.startswith("  ") and " = " in line:
      current.append(line.strip())
  return comps


def loop_body_writes(hlo_text: str, stacked_shapes: set) -> collections.Counter:
  """``(opcode, root opcode)`` counts of the loop bodies' instructions whose
  result has one of ``stacked_shapes`` (a fusion's root opcode: its kind of
  write; an in-place layer write is a ``dynamic-update-slice``)."""
  comps = computations(hlo_text)
  bodies = {m.group(1) for lines in comps.values() for line in lines
            for m in [re.search(r" while\(.*body=%?([\w.\-]+)", line)] if m}
  writes = collections.Counter()
  for body in bodies:
    for line in comps[body]:
      match = _INSTRUCTION.match(line)
      if not match or match.group(4) in ("parameter", "get-tuple-element", "bitcast"):
        continue
      shape = tuple(int(d) for d in match.group(3).split(",") if d)
      if shape not in stacked_shapes:
        continue
      calls = re.search(r"calls=%?([\w.\-]+)", line)
      root = ""
      if calls:
        root_line = next(x for x in comps[calls.group(1)] if x.startswith("ROOT"))
        root = _INSTRUCTION.match(root_line).group(4)
      writes[match.group(4), root] += 1
  return writes


def _staged_mlp():
  return optax_adama.StagedLoss(
      embed=lambda outer, b: b["x"],
      block=lambda layer, x, b: jnp.tanh(x @ layer["w"] + layer["b"][None, :]),
      head=lambda outer, x, b: jnp.mean((x - b["y"]) ** 2), layers="stack")


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


PARAMS = _abstract({"stack": {"w": jnp.zeros((NUM_LAYERS, WIDTH, WIDTH)),
                              "b": jnp.zeros((NUM_LAYERS, WIDTH))}})
BATCH = _abstract({"x": jnp.zeros((32, WIDTH)), "y": jnp.zeros((32, WIDTH))})
STACKED = {(NUM_LAYERS, WIDTH, WIDTH), (NUM_LAYERS, WIDTH)}


def _compiled(step, tx):
  return _compiled_for(step, PARAMS, jax.eval_shape(tx.init, PARAMS), BATCH)


def test_release_loop_bodies_write_the_stack_in_place_only():
  tx = optax_adama.adama(1e-3, num_micro_batches=4)
  text = _compiled(optax_adama.release_step(_staged_mlp(), tx), tx).as_text()
  writes = loop_body_writes(text, STACKED)
  # m and v of both stacked leaves, each layer's slice written in place (and
  # the forward scan's saved inputs, which have another shape).
  assert writes[("fusion", "dynamic-update-slice")] >= 4, writes
  assert set(writes) == {("fusion", "dynamic-update-slice")}, writes


@_expected_failure(strict=True, reason=(
    "8-bit moments: the CPU backend widens a float8 stack to float16 to update one "
    "layer's codes (a whole-stack convert fusion and copy per leaf in the loop); "
    "see docs/release.md, 'Step time'"))
def test_eight_bit_release_loop_bodies_write_the_stacked_codes_in_place_only():
  quantization = optax_adama.BlockQuantization(block_size=256, min_size=256)
  tx = optax_adama.adama(1e-3, num_micro_batches=4, quantization=quantization)
  state = jax.eval_shape(tx.init, PARAMS)
  codes = {x.shape for x in jax.tree.leaves((state.adama.mu, state.adama.nu)) if x.ndim == 3}
  assert (NUM_LAYERS, WIDTH * WIDTH // 256, 256) in codes
  text = _compiled(optax_adama.release_step(_staged_mlp(), tx), tx).as_text()
  writes = loop_body_writes(text, STACKED | codes)
  assert writes[("fusion", "dynamic-update-slice")] >= 4, writes
  assert set(writes) <= {("fusion", "dynamic-update-slice"), ("dynamic-update-slice", "")}, writes


def test_the_check_sees_a_whole_stack_update_in_a_loop():
  # The reference the check must catch: a loop that rewrites the whole stack
  # each iteration (what scan accumulation does once per micro-batch, adding
  # the stack's gradient into its accumulator).
  tx = optax.adam(1e-3)
  step = optax_adama.microbatch_step(_staged_mlp(), tx, num_micro_batches=4,
                                     update_every_micro_batch=False)
  writes = loop_body_writes(_compiled(step, tx).as_text(), STACKED)
  assert set(writes) - {("fusion", "dynamic-update-slice")}, writes


def test_release_costs_no_more_flops_than_scan_accumulation():
  # Each layer's forward is recomputed in the release's backward, as remat
  # "full" recomputes it; nothing more (XLA counts a loop body once).
  tx = optax_adama.adama(1e-3, num_micro_batches=4)
  release = _compiled(optax_adama.release_step(_staged_mlp(), tx), tx)
  adam = optax.adam(1e-3)
  remat_block = jax.checkpoint(_staged_mlp().block)
  staged = optax_adama.StagedLoss(_staged_mlp().embed, remat_block, _staged_mlp().head,
                                  layers="stack")
  accumulation = _compiled(optax_adama.microbatch_step(
      staged, adam, num_micro_batches=4, update_every_micro_batch=False), adam)
  flops = lambda compiled: compiled.cost_analysis()["flops"]
  assert flops(release) <= 1.02 * flops(accumulation), (flops(release), flops(accumulation))


def census(preset: str) -> list[str]:
  """Scan accumulation against the release on a scanned GPT, compiled (remat
  full, N = 4 micro-batches of one sequence): flops and bytes (XLA counts a
  loop body once), memory, and per loop body its fusions and the layer slices
  it copies out of stacked buffers (``dynamic-slice`` fusions of ``[1, ...]``)."""
  import models  # pylint: disable=g-import-not-at-top
  from models import harness  # pylint: disable=g-import-not-at-top

  config = models.get_config(preset, remat="full", scan_layers=True)
  loss_fn, params = harness.split_model(config)
  batch = harness.abstract_batch(config, 4, None)
  lines = []
  for method in ("scan_accumulation", "adama_release"):
    step, tx = harness.make_step(method, loss_fn, num_micro_batches=4)
    compiled = _compiled_for(step, params, jax.eval_shape(tx.init, params), batch)
    cost = compiled.cost_analysis()
    report = optax_adama.memory_report(compiled, param_bytes=4 * models.param_count(config))
    comps = computations(compiled.as_text())
    bodies = [m.group(1) for lines_ in comps.values() for line in lines_
              for m in [re.search(r" while\(.*body=%?([\w.\-]+)", line)] if m]
    per_body = [(sum(" fusion(" in line for line in comps[body]),
                 sum(bool(re.search(r"dynamic-slice_fusion[.\d]* = f32\[1,", line))
                     for line in comps[body])) for body in bodies]
    lines.append(f"{preset} {method}: {cost['flops'] / 1e9:.1f} GFLOP, "
                 f"{cost['bytes accessed'] / 1e9:.1f} GB accessed (loop bodies once), "
                 f"{report.in_p(report.total_bytes):.2f} P; per loop body (fusions, layer "
                 f"slices copied): {per_body}")
  return lines


def _compiled_for(step, params, opt_state, batch):
  # optax's own bias correction computes float ** int32 (see conftest).
  with jax.numpy_dtype_promotion("standard"):
    return step.lower(params, opt_state, batch).compile()


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top

  for _preset in sys.argv[1:] or ["gpt2_small"]:
    print("\n".join(census(_preset)), flush=True)
