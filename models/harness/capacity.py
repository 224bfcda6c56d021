"""The capacity search: the largest model of a family whose training step fits a budget.

Compile-only: each method's step is compiled for abstract inputs at a family member's
scale (layers, and width with it), its bytes read as ``memory_report`` reads them,
and the largest scale under the budget found by a gallop and a bisection
(``largest_fitting``), over the family ``gpt_family``. ``python -m models.bench capacity``
prints and plots it; ``models.gpu_bench`` and ``benchmarks/scripts/oom_reports.py`` reuse
the search.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

import models
import optax_adama
from models.harness import baselines
from models.harness import batches
from models.harness import memory
from models.harness import reporting


def gpt_family(scale: int, *, remat: str = "none", vocab_size: int = 50257,
               hidden: int | None = None, scan_layers: bool = False,
               dtype: Any = None) -> models.GPTConfig:
  """A GPT-2-shaped model grown in depth and width together.

  ``scale`` = number of layers; width = 64 * scale rounded to a multiple of
  128 (GPT-2 small is scale 12: 12 layers, width 768; scale 24 gives 24 layers
  of width 1536), or ``hidden`` (a multiple of 64: heads of 64) when given.
  ``dtype``: the compute dtype (``None``: the config's default, float32);
  params stay float32.
  """
  if hidden is None:
    hidden = max(128, int(round(64 * scale / 128)) * 128)
  elif hidden % 64:
    raise ValueError(f"hidden={hidden} must be a multiple of 64 (heads of width 64).")
  config = models.GPTConfig(num_layers=scale, hidden=hidden, num_heads=hidden // 64,
                            remat=remat, vocab_size=vocab_size, scan_layers=scan_layers)
  return config if dtype is None else dataclasses.replace(config, dtype=jnp.dtype(dtype))


def total_bytes_at(scale: int, method: str, *, num_micro_batches: int, micro_batch_size: int,
                   seq_len: int, remat: str, vocab_size: int = 50257,
                   mesh: jax.sharding.Mesh | None = None,
                   hidden: int | None = None, scan_layers: bool = False,
                   dtype: Any = None,
                   target: optax_adama.memory.Target | None = None) -> tuple[int, int]:
  """(compiled total bytes, param count) of a method's step on gpt_family(scale).

  With a mesh the bytes are one device's, and every device gets
  ``micro_batch_size`` rows of each micro-batch. ``scan_layers``: the blocks
  stacked under one scan (what the release methods need). ``target``: compiled
  by that machine's compiler, for its first compile-only device, or for
  ``mesh`` (then built over its devices: ``optax_adama.memory.target_mesh``).
  """
  config = gpt_family(scale, remat=remat, vocab_size=vocab_size, hidden=hidden,
                      scan_layers=scan_layers, dtype=dtype)
  loss_fn, params = baselines.split_model(config)
  step, tx = baselines.make_step(method, loss_fn, num_micro_batches=num_micro_batches, mesh=mesh,
                       rank=config.hidden // 4)
  devices = 1 if mesh is None else mesh.size
  batch = batches.abstract_batch(config, micro_batch_size * num_micro_batches * devices, seq_len)
  state = jax.eval_shape(tx.init, params)
  if method in baselines.FSDP_METHODS:  # each device's slices, as the step keeps them
    shardings = baselines.fsdp_shardings(method, loss_fn, params, state, mesh)
    place = lambda tree, sh: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    params, state = place(params, shardings.params), place(state, shardings.opt_state)
  elif target is not None:
    params, state, batch = _on_target((params, state, batch), target, mesh)
  offloaded = method.endswith("_offload")
  total = device_bytes(step, params, state, batch, offloaded=offloaded, target=target)
  if offloaded and method in baselines.RELEASE_METHODS:
    total += release_in_flight_bytes(loss_fn, state)
  return total, models.param_count(config)


def release_in_flight_bytes(staged: optax_adama.StagedLoss, opt_state: Any) -> int:
  """Device bytes of offloaded moments the release step has in flight.

  The CPU backend's transfers are no-ops, so its compile counts none of
  them; on a GPU the step brings in one layer's slice of the stack's m and v
  at a time, and the outer leaves' (embedding, head) for their fold and
  update. Both are added, an upper bound on what is in flight at once.
  """
  state = optax_adama.find_adama_state(opt_state)
  (outer_mu, stacked_mu), (outer_nu, stacked_nu) = map(staged.split, (state.mu, state.nu))
  num_layers = jax.tree.leaves(stacked_mu)[0].shape[0]
  outer = optax_adama.moments.host_state_bytes((outer_mu, outer_nu))
  return outer + optax_adama.moments.host_state_bytes((stacked_mu, stacked_nu)) // num_layers


def _on_target(args: tuple[Any, Any, Any], target: optax_adama.memory.Target,
               mesh: jax.sharding.Mesh | None) -> tuple[Any, Any, Any]:
  """``(params, state, batch)`` placed for a target's compile-only devices: on
  the first without a mesh (``memory.on_target``); on ``mesh``, params and state
  whole on every device and the batch's rows split over ``"data"`` (what a
  data-parallel step takes)."""
  if mesh is None:
    return memory.on_target(args, target)
  spec = jax.sharding.PartitionSpec
  shardings = [jax.sharding.NamedSharding(mesh, spec())] * 2 + [
      jax.sharding.NamedSharding(mesh, spec("data"))]
  return tuple(jax.tree.map(lambda x, s=s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree) for tree, s in zip(args, shardings))


def device_bytes(step: baselines.Step, params: Any, opt_state: Any, batch: Any, *,
                 offloaded: bool = False,
                 target: optax_adama.memory.Target | None = None) -> int:
  """Compiled device bytes of a step (compile only).

  ``offloaded``: the state is placed in host memory (``offload_moments``) and
  its bytes are not counted. The CPU backend's ``memory_analysis()`` counts
  host-memory arguments with the device ones (its ``host_*`` fields are 0);
  there the host state's bytes are taken off the total. Caveat: on CPU the
  transfers are no-ops, so the one leaf's moments in flight on a GPU are not
  in the count. ``target``: compiled with that machine's compiler options
  (the arguments already on its devices).
  """
  if offloaded:
    # A target's params sit on one compile-only device: the state's host copy
    # belongs to it (None: the default device, as on the CPU).
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    device = (next(iter(sharding.device_set))
              if isinstance(sharding, jax.sharding.SingleDeviceSharding) else None)
    opt_state = optax_adama.moments.offloaded_state_shapes(opt_state, device=device)
  compiled = optax_adama.memory.compile_for(step.lower(params, opt_state, batch),
                                            target=target)
  total = optax_adama.memory_report(compiled, param_bytes=1).total_bytes
  if offloaded and compiled.memory_analysis().host_argument_size_in_bytes == 0:
    total -= optax_adama.moments.host_state_bytes(opt_state)
  return total


def largest_fitting(fits: Callable[[int], bool], low: int, high: int,
                    guess: int | None = None) -> int:
  """Largest integer s in [low, high] with fits(s), for a monotone predicate.

  With a ``guess`` near the answer, gallops out from it to bracket the answer
  before bisecting: a compile of a multi-billion-parameter step costs minutes
  on a CPU, and a good guess needs two or three of them instead of log2(range).

  Returns low - 1 if even ``low`` does not fit, ``high`` if everything fits.
  """
  if guess is not None:
    guess = min(max(guess, low), high)
    step = 1
    if fits(guess):
      low = guess
      while low < high:
        probe = min(low + step, high)
        if not fits(probe):
          high = probe - 1
          break
        # Steps 1, 1, 2, 4, ...: an answer one above the guess costs 3 calls.
        low, step = probe, (step if probe == guess + 1 else 2 * step)
      else:
        return low
    else:
      high = guess - 1
      while high >= low:
        probe = max(high - step + 1, low)
        if fits(probe):
          low = probe
          break
        high, step = probe - 1, 2 * step
      else:
        return low - 1
  elif not fits(low):
    return low - 1
  while low < high:
    mid = (low + high + 1) // 2
    if fits(mid):
      low = mid
    else:
      high = mid - 1
  return low


@functools.cache
def family_param_count(scale: int, vocab_size: int = 50257) -> int:
  """Parameters of gpt_family(scale), counted abstractly once per scale."""
  return models.param_count(gpt_family(scale, vocab_size=vocab_size))


def guess_scale(bytes_per_param: float, budget_bytes: float, max_scale: int,
                vocab_size: int = 50257) -> int:
  """Largest scale whose parameters times ``bytes_per_param`` fit the budget."""
  best = 1
  for scale in range(1, max_scale + 1):
    if family_param_count(scale, vocab_size) * bytes_per_param > budget_bytes:
      break  # parameter counts grow with scale
    best = scale
  return best


def measure_capacity(
    budgets_gb: Sequence[float],
    methods: Sequence[str],
    *,
    num_micro_batches: int,
    micro_batch_size: int,
    seq_len: int,
    remat: str,
    max_scale: int,
    vocab_size: int = 50257,
    mesh: jax.sharding.Mesh | None = None,
    progress: bool = True,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
    refine_width: bool = False,
    scan_layers: bool = False,
    dtype: Any = None,
    target: optax_adama.memory.Target | None = None,
) -> list[dict[str, Any]]:
  """For each budget and method, the largest gpt_family model whose step fits.

  With a mesh, the budget is per device. ``on_result`` is called with the
  results so far after each (method, budget), so a long search can be saved
  as it goes. With ``refine_width``, the answer's width is then grown in steps
  of 64 at the same depth while the step fits: the family's width moves in
  steps of 128, too coarse to tell methods apart that differ by less than a
  step.
  """
  cache: dict[tuple[str, int, int | None], tuple[int, int]] = {}

  def measure(method, scale, hidden=None):
    if (method, scale, hidden) not in cache:
      cache[method, scale, hidden] = total_bytes_at(
          scale, method, num_micro_batches=num_micro_batches,
          micro_batch_size=micro_batch_size, seq_len=seq_len, remat=remat,
          vocab_size=vocab_size, mesh=mesh, hidden=hidden, scan_layers=scan_layers,
          dtype=dtype, target=target)
    return cache[method, scale, hidden]

  results = []
  bar = tqdm(total=len(budgets_gb) * len(methods), desc="capacity", disable=not progress,
             file=sys.stderr)
  for method in methods:
    # Fit bytes = a * params + b through two cheap anchor scales: a is the
    # marginal bytes per parameter (params, moments, buffers), b the part that
    # hardly grows (logits, one layer's activations). Extrapolated, it lands
    # within a scale or two, so the gallop costs two or three compiles.
    anchors = sorted({max(1, min(12, max_scale - 1)), min(16, max_scale)})
    points = [measure(method, a) for a in anchors]
    if len(points) == 2 and points[1][1] > points[0][1]:
      slope = (points[1][0] - points[0][0]) / (points[1][1] - points[0][1])
      intercept = points[1][0] - slope * points[1][1]
    else:
      slope, intercept = points[-1][0] / points[-1][1], 0.0
    for budget in budgets_gb:
      budget_bytes = budget * 1e9
      guess = guess_scale(slope, budget_bytes - max(intercept, 0.0), max_scale, vocab_size)
      scale = largest_fitting(
          lambda s: measure(method, s)[0] <= budget_bytes, 1, max_scale, guess=guess)
      total, count = measure(method, scale) if scale >= 1 else (0, 0)
      hidden = gpt_family(scale).hidden if scale >= 1 else 0
      if refine_width and scale >= 1:
        # Bytes grow about linearly in the width at a fixed depth: one step of
        # 64 gives the slope, and the gallop starts where it points.
        wider = lambda steps: measure(method, scale, hidden + 64 * steps)
        if wider(1)[0] <= budget_bytes:
          per_step = max(wider(1)[0] - total, 1)
          steps = largest_fitting(
              lambda k: wider(k)[0] <= budget_bytes, 1, 4 * hidden // 64,
              guess=int((budget_bytes - total) // per_step))
          hidden += 64 * steps
          total, count = measure(method, scale, hidden)
      results.append({"budget_gb": budget, "method": method, "scale": scale,
                      "hidden": hidden, "param_count": count, "total_bytes": total,
                      "compiles": len(cache)})
      if on_result is not None:
        on_result(results)
      bar.update()
  bar.close()
  return sorted(results, key=lambda r: (r["budget_gb"], methods.index(r["method"])))


def capacity_table(results: Sequence[dict[str, Any]]) -> str:
  """Markdown: one row per budget, one column per method, and the ratios.

  Ratios are of parameter counts against data-parallel (or FSDP, or
  single-device) scan accumulation, and for ZeRO-2 AdamA against ZeRO-2
  accumulation too.
  """
  methods = list(dict.fromkeys(r["method"] for r in results))
  budgets = list(dict.fromkeys(r["budget_gb"] for r in results))
  base = next((m for m in ("dp_scan_accumulation", "fsdp_scan_accumulation") if m in methods),
              "scan_accumulation")
  same = "zero2_scan_accumulation"  # AdamA against accumulation with the same sharding
  lines = ["| budget | " + " | ".join(methods) + f" | parameters vs {base} |",
           "|" + "---|" * (len(methods) + 2)]
  for budget in budgets:
    by_method = {r["method"]: r for r in results if r["budget_gb"] == budget}
    ratio = lambda m, b: by_method[m]["param_count"] / by_method[b]["param_count"]
    ratios = []
    if by_method.get(base, {}).get("param_count"):
      ratios += [f"{m}: {ratio(m, base):.2f}x" for m in methods if m != base and m in by_method]
    if by_method.get(same, {}).get("param_count"):
      ratios += [f"{m} vs {same}: {ratio(m, same):.2f}x"
                 for m in methods if m.startswith("zero2_adama") and m in by_method]
    cells = [f"{by_method[m]['param_count'] / 1e6:,.0f}M ({by_method[m]['scale']} layers x "
             f"{by_method[m].get('hidden') or gpt_family(max(by_method[m]['scale'], 1)).hidden})"
             if m in by_method else "" for m in methods]
    lines.append(f"| {budget:g} GB | " + " | ".join(cells) + f" | {'; '.join(ratios)} |")
  return "\n".join(lines)


def plot_capacity(results: Sequence[dict[str, Any]], path: Path) -> None:
  """Parameters that fit against the budget, one line per method."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt


  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for method in dict.fromkeys(r["method"] for r in results):
    points = sorted((r["budget_gb"], r["param_count"] / 1e9)
                    for r in results if r["method"] == method)
    ax.plot(*zip(*points), marker="o", label=method)
  ax.set_xlabel("device memory budget (GB, compile-only memory_analysis)")
  ax.set_ylabel("parameters that fit (billions)")
  ax.set_title("Largest GPT-family model per budget (N = 4, 1 sequence / micro-batch)",
               fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  reporting.save_figure(fig, path)
