"""Public out-of-memory reports of 7B training on 8 devices, reproduced compile-only.

    python benchmarks/scripts/oom_reports.py easylm    # LLaMA-7B, FSDP on a v3-8 / v2-8
    python benchmarks/scripts/oom_reports.py gpt7b     # a 7B-shaped GPT, tried as a new user would
    python benchmarks/scripts/oom_reports.py easylm --preset llama_test --seq-len 64   # seconds
    python benchmarks/scripts/oom_reports.py capacity  # the largest Llama per method, 16 and 80 GB
    python benchmarks/scripts/oom_reports.py easylm --target tpu:v3-8   # libtpu's (make venv-tpu)

The reports (EasyLM #36 and #61, EasyDeL #95, llama-2-jax #10): LLaMA-7B trained with
FSDP over the 8 cores of a TPU v3-8 (16 GiB each, 15.48 GiB usable) runs without
gradient accumulation and runs out of memory with 2 accumulation steps ("Used
23.43G of 15.48G hbm"); on a v2-8 (8 GiB each) it runs out at once. This script
fakes 8 CPU devices, builds the model with its layers scanned, float32 params and
moments (as the reports ran it), ``remat="full"``, one 2,048-token sequence per
device per micro-batch, and compiles (nothing is allocated) one training step per
method:

- ``scan_accumulation``: Adam and a ``lax.scan`` over micro-batches with a
  float32 gradient carry, params split along their largest axis and the gradient
  constrained to the same split: FSDP accumulation as users write it by hand.
  At N = 1 it is the plain step without accumulation.
- ``maxtext_accumulation``: the same Adam step accumulated as MaxText's train
  step does it (the params carried through the scan, nothing constrained in
  its body; ``oom_steps.maxtext_accumulation`` says what it follows).
- ``multisteps``: ``optax.MultiSteps(optax.adam)`` stepped once per micro-batch
  (one jitted call each), its accumulator split like the params.
- ``adama``: AdamA's default through ``optax_adama.microbatch_step(loss_fn, tx,
  mesh=mesh, shard_states="fsdp")`` on the model's plain loss.
- ``adama_per_call``: AdamA's default stepped once per micro-batch (one jitted,
  donating call each, as ``multisteps`` runs): its ``update`` folds the gradient
  and emits zeros until the N-th call, so no accumulator and no scan.
- ``adama_release`` / ``_8bit`` / ``_offload``: AdamA through ``release_step``
  on the model's ``StagedLoss`` under FSDP, with float32, 8-bit
  (``BlockQuantization()``) and host-offloaded moments.
- ``..._bf16``: the same method with bfloat16 params. AdamA's moments stay
  float32 and its updates land with stochastic rounding
  (``optax_adama.contrib.round_params_stochastically``;
  benchmarks/results/convergence/bf16_params.md has its convergence cost);
  ``scan_accumulation_bf16`` is Adam with optax's defaults for bfloat16 params
  (bfloat16 moments, round-to-nearest add) and the float32 accumulator.

Each row gives one device's compiled bytes (``memory_analysis()``: argument +
output + temp - alias), whether it fits a v3 core (15.48 GiB usable) and a v2
core (8 GiB), and its floor: params and optimizer state split 8 ways (the state
on the host for ``_offload``), one layer's params gathered, and what one
device's micro-batch must keep under remat "full": every layer's input and the
float32 logits. What a method holds above its floor is its temp (the ``temp``
column): the recompute of one layer, its gradient, collectives' buffers.
Writes ``--json`` and ``--markdown``.

By default the byte counts are the CPU compiler's: a TPU's compiler schedules and
fuses differently, so the 23.43 GiB of EasyLM #36 is a reference, not a target.
``--target tpu:v3-8`` (any of ``optax_adama.memory.TARGET_NAMES``; run with
.venv-tpu or .venv-gpu) compiles for that machine's compile-only devices with its
own compiler instead, and each row says whether it fits that target's memory.
Every table says which compiler made it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from oom_steps import adama_tx
from oom_steps import bf16_params
from oom_steps import compile_method
from oom_steps import device_bytes
from oom_steps import model_parts
from oom_steps import offloads

SCENARIOS = {
    # EasyLM #36 / #61: LLaMA-7B, FSDP on 8 cores, float32, 2,048 tokens.
    "easylm": {"preset": "llama2_7b", "overrides": {}, "num_micro_batches": (1, 2, 4),
               "methods": ("scan_accumulation", "maxtext_accumulation", "multisteps", "adama",
                           "adama_release", "adama_release_8bit", "adama_release_offload")},
    # A 7B-shaped GPT (GPT-2 XL grown to 32 layers of width 4096, MLP 16384,
    # a 32,000-token vocabulary), FSDP, N = 2.
    "gpt7b": {"preset": "gpt2_xl",
              "overrides": {"num_layers": 32, "hidden": 4096, "num_heads": 32,
                            "mlp_dim": 16384, "vocab_size": 32000, "max_len": 2048},
              "num_micro_batches": (2,),
              "methods": ("scan_accumulation", "adama", "adama_staged", "adama_release",
                          "adama_release_8bit")},
}
# The largest llama_family member each method fits per device (see `capacity`).
CAPACITY = "capacity"
# What an unrolled model runs: the release and staged steps scan a stack.
UNROLLED_METHODS = ("scan_accumulation", "maxtext_accumulation", "multisteps", "adama",
                    "adama_per_call")
METHODS = ("scan_accumulation", "maxtext_accumulation", "multisteps", "adama", "adama_per_call",
           "adama_staged",
           "adama_release", "adama_release_8bit", "adama_release_offload",
           "adama_release_8bit_offload",
           "scan_accumulation_bf16", "adama_release_offload_bf16")
# Where a backend moves bfloat16 natively: the float32-params method's compiled
# bytes less the bytes a parameter its bfloat16 storage saves a device (params
# 4 -> 2; Adam's moments too, as optax stores them in the params' dtype).
# XLA's CPU backend widens bfloat16 all-gathers and dynamic-update-slices to
# float32 (over a whole stack, hoisted out of the layer loop), so the compiled
# `_bf16` methods hold more there than float32 params do; docs/scale_out.md
# shows it. Not compiled: the gathered layer and gradients in bfloat16 would
# save more.
PROJECTED = {"adama_release_offload_bf16_projected": ("adama_release_offload", 2),
             "scan_accumulation_bf16_projected": ("scan_accumulation", 6)}
GIB = 2**30
V3_USABLE_GIB = 15.48  # what XLA reported usable of a v3 core's 16 GiB (EasyLM #36)
V2_GIB = 8.0


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("scenario", choices=sorted(SCENARIOS) + [CAPACITY])
  parser.add_argument("--budgets-gb", type=float, nargs="+", default=[16.0, 80.0],
                      help="capacity: per-device budgets, GB")
  parser.add_argument("--preset", help="another model preset (e.g. llama_test for a smoke run)")
  parser.add_argument("--num-micro-batches", type=int, nargs="+")
  parser.add_argument("--methods", nargs="+", choices=METHODS + tuple(PROJECTED))
  parser.add_argument("--devices", type=int,
                      help="devices (default: the --target's, else 8 fake CPU devices)")
  parser.add_argument("--target",
                      help="compile for this machine with its own compiler, e.g. tpu:v3-8, "
                           "gpu:h100x8 (optax_adama.memory.TARGET_NAMES); default: XLA's CPU "
                           "backend")
  parser.add_argument("--seq-len", type=int, default=2048)
  parser.add_argument("--rows", type=int, default=1, help="sequences per device per micro-batch")
  parser.add_argument("--attention-chunk", type=int,
                      help="a Llama's queries attended this many at a time (LlamaConfig's "
                           "attention_chunk)")
  parser.add_argument("--unrolled", action="store_true",
                      help="the blocks unrolled, each under remat, as EasyLM's LLaMA runs them "
                           "(default: stacked and scanned); the release methods need a scan")
  parser.add_argument("--mu-dtype", choices=("float32", "bfloat16"), default="float32",
                      help="every method's first moment: bfloat16 as EasyLM's default optimizer "
                           "keeps it (bf16_momentum=True)")
  parser.add_argument("--json", type=Path)
  parser.add_argument("--markdown", type=Path)
  args = parser.parse_args(argv)
  args.target_spec = None
  if args.target:
    from optax_adama import memory

    try:
      # A TPU's devices are its topology's; a GPU name without x<count>: 8 of them.
      gpus = None if args.target.lower().startswith("tpu:") else 8
      args.target_spec = memory.parse_target(args.target, num_devices=args.devices or gpus)
    except ValueError as e:
      parser.error(str(e))
    args.devices = args.target_spec.num_devices
  args.devices = args.devices or 8
  if args.seq_len < 1 or args.rows < 1 or args.devices < 1:
    parser.error("--seq-len, --rows and --devices must be positive.")
  if args.attention_chunk is not None and args.attention_chunk < 1:
    parser.error("--attention-chunk must be positive.")
  if min(args.budgets_gb) <= 0:
    parser.error("--budgets-gb must be positive.")
  if args.num_micro_batches and min(args.num_micro_batches) < 1:
    parser.error("--num-micro-batches must be positive.")
  if args.unrolled and any(m not in UNROLLED_METHODS for m in args.methods or ()):
    parser.error(f"--unrolled runs {', '.join(UNROLLED_METHODS)} (the others need a layer "
                 "scan).")
  if args.unrolled and args.scenario == CAPACITY:
    parser.error("--unrolled is for the oom scenarios.")
  if args.scenario != CAPACITY and any(bf16_params(m) or m in PROJECTED
                                      for m in args.methods or ()):
    parser.error("the _bf16 methods are the capacity scenario's (--methods).")
  stem = "capacity_llama_8_devices" if args.scenario == CAPACITY else f"oom_{args.scenario}"
  if args.target_spec:  # tpu:v3-8 -> oom_easylm_tpu_v3, gpu:h100x8 -> ..._gpu_h100x8
    stem += "_" + args.target_spec.name.replace(":", "_").removesuffix("-8")
  stem += "_unrolled" * args.unrolled + "_mu_bf16" * (args.mu_dtype == "bfloat16")
  args.json = args.json or Path(f"benchmarks/results/memory/raw/{stem}.json")
  args.markdown = args.markdown or Path(f"benchmarks/results/memory/{stem}.md")
  return args


def llama_family(scale: int, param_dtype=None):
  """A Llama-3-shaped model grown in depth and width together, as the GPT family of
  benchmarks/results/memory/capacity_fsdp_8_devices.md: ``scale`` layers of width 64 x scale (to a
  multiple of 128), heads of 128, a quarter as many kv heads (the largest divisor
  of the heads at most that), a SwiGLU of 3.5 x width (to 256), Llama 3's 128,256-token
  vocabulary, bf16 compute with float32 params (``param_dtype`` else); scale 64 is 64
  layers of llama3_8b's width."""
  import jax.numpy as jnp

  import models

  hidden = max(128, round(64 * scale / 128) * 128)
  heads = hidden // 128
  kv_heads = max(d for d in range(1, heads + 1) if heads % d == 0 and (4 * d <= heads or d == 1))
  return models.LlamaConfig.llama3_8b(
      num_layers=scale, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
      mlp_dim=round(3.5 * hidden / 256) * 256, scan_layers=True, remat="full",
      dtype=jnp.bfloat16, param_dtype=param_dtype or jnp.float32)


def llama_param_count(config) -> int:
  """A Llama config's parameters in closed form (building 250 abstract models to
  aim the capacity search took minutes; ``tests/zoo/test_llama.py`` checks the form)."""
  d, head = config.hidden, config.head_size
  block = (2 * d * config.num_heads * head + 2 * d * config.num_kv_heads * head
           + 3 * d * config.mlp_dim + 2 * d)
  heads = 1 if config.tie_embeddings else 2
  return heads * config.vocab_size * d + config.num_layers * block + d


CAPACITY_METHODS = ("scan_accumulation", "adama", "adama_release", "adama_release_8bit",
                    "adama_release_offload", "scan_accumulation_bf16",
                    "adama_release_offload_bf16")


def method_family(method: str, scale: int):
  """``llama_family(scale)`` with the params' dtype of ``method``."""
  import jax.numpy as jnp

  return llama_family(scale, jnp.bfloat16 if bf16_params(method) else None)


def _mesh(args):
  """The data axis over the --target's compile-only devices, else over fake CPU ones."""
  import jax

  from optax_adama import memory

  if args.target_spec:
    return memory.target_mesh(args.target_spec)
  return jax.make_mesh((args.devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _mu_dtype(args):
  """None (the params' dtype, as the tables ran before the flag) unless bfloat16."""
  return None if args.mu_dtype == "float32" else args.mu_dtype


def _options(args):
  return args.target_spec.compiler_options if args.target_spec else None


def compiled_for(args) -> str:
  """The compiler a table's bytes come from (``optax_adama.memory.compiled_by``)."""
  from optax_adama import memory

  return memory.compiled_by(args.target_spec, num_devices=args.devices)


def capacity(args):
  """Per method and budget, the largest llama_family scale whose step fits one device."""
  import functools
  import types

  import jax

  import optax_adama
  from models import harness
  from models.harness import capacity as capacity_search

  mesh = _mesh(args)
  n = (args.num_micro_batches or [4])[0]
  methods = args.methods or CAPACITY_METHODS

  count = functools.lru_cache(maxsize=None)(lambda scale: llama_param_count(llama_family(scale)))

  @functools.cache
  def measure(method, scale):
    if method in PROJECTED:
      base, saved_per_param = PROJECTED[method]
      return measure(base, scale) - count(scale) * saved_per_param // args.devices
    config = method_family(method, scale)
    loss_fn, staged, params = model_parts(config)
    batch = harness.abstract_batch(config, args.rows * args.devices * n, args.seq_len)
    start = time.perf_counter()
    try:
      compiled, state = compile_method(method, n, loss_fn, staged, params, batch, mesh,
                                       _options(args))
      total = device_bytes(compiled, state, method, args.devices)
    except jax.errors.JaxRuntimeError as error:
      # A TPU target's program over HBM that libtpu still refuses with its over-HBM
      # option ("Invalid TPU program"): its strict compile names the temporaries,
      # which (with the params' share) are at least what it needs: over any budget
      # it is measured against.
      strict = types.SimpleNamespace(compile=lambda: compile_method(
          method, n, loss_fn, staged, params, batch, mesh, None))
      temporaries = optax_adama.memory.temporaries_over_memory(strict, error)
      if temporaries is None:
        raise
      total = temporaries + optax_adama.memory.tree_bytes(params) // args.devices
    print(f"{method} scale {scale} ({config.num_layers} x {config.hidden}): "
          f"{total / 1e9:.2f} GB per device in {time.perf_counter() - start:.0f} s", flush=True)
    return total

  rows = []
  for method in methods:
    # Bytes are about linear in the parameters: two anchors aim the gallop.
    low, high = 32, 64
    slope = (measure(method, high) - measure(method, low)) / (count(high) - count(low))
    intercept = measure(method, high) - slope * count(high)
    for budget in args.budgets_gb:
      fits = lambda scale: measure(method, scale) <= budget * 1e9
      guess = max((s for s in range(8, 257) if slope * count(s) + intercept <= budget * 1e9),
                  default=8)
      scale = capacity_search.largest_fitting(fits, 8, 256, guess=guess)
      config = llama_family(scale)
      rows.append({"method": method, "budget_gb": budget, "scale": scale,
                   "num_layers": config.num_layers, "hidden": config.hidden,
                   "param_count": count(scale) if scale >= 8 else 0,
                   "per_device_bytes": measure(method, scale) if scale >= 8 else None,
                   "host_bytes_per_device": host_bytes_per_device(
                       PROJECTED.get(method, (method,))[0], scale, args.devices),
                   "projected": method in PROJECTED,
                   "num_micro_batches": n, "seq_len": args.seq_len, "devices": args.devices,
                   "rows_per_device": args.rows, "compiled_for": compiled_for(args)})
      _save_capacity(args, rows)
  return rows


def capacity_markdown(rows, command):
  methods = list(dict.fromkeys(r["method"] for r in rows))
  budgets = sorted({r["budget_gb"] for r in rows})
  first = rows[0]
  lines = [
      f"# The largest Llama each method trains on {first['devices']} devices (FSDP), "
      "compile-only", "",
      f"Made by `{command}`, compiled by "
      + (first.get("compiled_for") or f"XLA's CPU backend ({first['devices']} fake devices)")
      + ". The family of "
      "`benchmarks/scripts/oom_reports.py`'s `llama_family`: `scale` layers of width 64 x scale, "
      "heads of 128, a quarter as many kv heads, SwiGLU 3.5 x width, Llama 3's 128,256-token "
      "vocabulary (scale 64 = 64 layers of llama3_8b's width), bf16 compute, float32 params "
      "(bfloat16 in the `_bf16` columns: AdamA's updates rounded stochastically, Adam's to "
      "nearest) and float32 moments (8-bit in the `_8bit` column; bfloat16, optax's default "
      "for bfloat16 params, in `scan_accumulation_bf16`), remat \"full\", layers scanned; "
      f"N = {first['num_micro_batches']}, "
      f"{first['rows_per_device']} sequence(s) of {first['seq_len']:,} tokens per device per "
      "micro-batch. Budget per device (GB = 1e9 B); the host memory of `_offload` is not in it "
      "(a device's share given beside). The `_projected` columns are not compiled: the "
      "float32-params method's compiled bytes less what bfloat16 storage saves a device "
      "(2 B a parameter / devices for AdamA's params; 6 B for Adam's params, m and v), for "
      "a backend that moves bfloat16 natively; the CPU compiler widens bfloat16 all-gathers "
      "and dynamic-update-slices to float32, which the compiled `_bf16` columns pay.",
      "", "| budget | " + " | ".join(methods) + " | parameters vs scan_accumulation "
      "| AdamA's largest vs the largest baseline |",
      "|---|" + "---|" * (len(methods) + 2)]
  for budget in budgets:
    by_method = {r["method"]: r for r in rows if r["budget_gb"] == budget}
    cells = [_capacity_cell(by_method[m]) if m in by_method else "-" for m in methods]
    base = by_method.get("scan_accumulation", {}).get("param_count")
    ratios = "; ".join(f"{m}: {by_method[m]['param_count'] / base:.2f}x" for m in methods
                       if base and m in by_method and m != "scan_accumulation")
    lines.append(f"| {budget:g} GB | " + " | ".join(cells) + f" | {ratios or '-'} "
                 f"| {_against_the_best_baseline(by_method)} |")
  return "\n".join(lines) + "\n"


def _against_the_best_baseline(by_method):
  """AdamA's largest model against the largest any baseline (every method not
  AdamA's: scan accumulation, MaxText's, MultiSteps, bf16 params) fits, uncompiled
  projections left out: the comparison a user makes."""
  compiled = {m: r for m, r in by_method.items() if m not in PROJECTED and r["param_count"]}
  adama = [m for m in compiled if m.startswith("adama")]
  baselines = [m for m in compiled if not m.startswith("adama")]
  if not adama or not baselines:
    return "-"
  best, base = (max(ms, key=lambda m: compiled[m]["param_count"]) for ms in (adama, baselines))
  return (f"{best} / {base}: "
          f"{compiled[best]['param_count'] / compiled[base]['param_count']:.2f}x")


def host_bytes_per_device(method, scale, devices):
  """One device's share of the state ``method`` keeps in host memory at ``scale``
  (0 where it keeps none)."""
  import jax

  import optax_adama

  if not offloads(method):
    return 0
  _, _, params = model_parts(method_family(method, scale))
  state = jax.eval_shape(adama_tx(method, 1).init, params)
  return optax_adama.moments.host_state_bytes(state) // devices


def _capacity_cell(row):
  """Parameters and shape; host bytes beside where the moments live there."""
  cell = f"{row['param_count'] / 1e6:,.0f}M ({row['num_layers']} x {row['hidden']})"
  if row.get("host_bytes_per_device"):
    cell += f", host {row['host_bytes_per_device'] / 1e9:,.0f} GB a device"
  return cell


def _save_capacity(args, rows):
  """Writes ``rows`` with the rows of methods this run did not measure kept
  from the JSON it updates (their command beside), so one method can be
  added to a table without recompiling the others."""
  args.json.parent.mkdir(parents=True, exist_ok=True)
  command = "python benchmarks/scripts/oom_reports.py " + " ".join(args.argv)
  measured = {r["method"] for r in rows}
  kept, commands = [], [command]
  if args.json.exists():
    previous = json.loads(args.json.read_text())
    kept = [r for r in previous["rows"] if r["method"] not in measured]
    commands = [c for c in previous.get("commands", [previous["command"]])
                if c != command] * bool(kept) + commands
  # Rows saved before the host column: their host bytes, from the state's shapes.
  kept = [r if "host_bytes_per_device" in r else dict(r, host_bytes_per_device=(
      host_bytes_per_device(r["method"], r["scale"], r["devices"]))) for r in kept]
  rows = kept + rows
  args.json.write_text(json.dumps({"command": "; ".join(commands), "commands": commands,
                                   "rows": rows}, indent=1))
  args.markdown.write_text(capacity_markdown(rows, "; ".join(commands)))


def measure(args):
  import jax

  import models
  import optax_adama
  from models import harness

  scenario = SCENARIOS[args.scenario]
  preset = args.preset or scenario["preset"]
  overrides = {} if args.preset else dict(scenario["overrides"])
  if args.attention_chunk is not None:
    overrides["attention_chunk"] = args.attention_chunk
  config = models.get_config(preset, scan_layers=not args.unrolled, remat="full", **overrides)
  if hasattr(config, "max_len") and config.max_len < args.seq_len:
    raise SystemExit(f"error: --seq-len {args.seq_len} is longer than {preset}'s max_len "
                     f"{config.max_len}")
  mesh = _mesh(args)
  loss_fn, staged, params = model_parts(config)
  P = optax_adama.memory.tree_bytes(params)
  num_layers = config.num_layers
  if staged is not None:
    layer = optax_adama.memory.tree_bytes(staged.split(params)[1]) // num_layers
  else:  # unrolled: the blocks are the model's `blocks` list
    layer = optax_adama.memory.tree_bytes(params["blocks"]) // num_layers
  # What any step must hold on a device besides params and state: one layer's
  # params gathered, the block inputs remat "full" saves (every layer's, in
  # the compute dtype) and the micro-batch's float32 logits.
  tokens = args.rows * args.seq_len
  saved_inputs = num_layers * tokens * config.hidden * jax.numpy.dtype(config.dtype).itemsize
  logits = tokens * config.vocab_size * 4
  activations = saved_inputs + logits
  rows = []
  methods = args.methods or [m for m in scenario["methods"]
                              if not args.unrolled or m in UNROLLED_METHODS]
  for n in args.num_micro_batches or scenario["num_micro_batches"]:
    batch = harness.abstract_batch(config, args.rows * args.devices * n, args.seq_len)
    for method in methods:
      if method == "multisteps" and n == 1:
        continue  # MultiSteps every 1 step is Adam: the scan_accumulation row at N = 1
      start = time.perf_counter()
      compiled, state = compile_method(method, n, loss_fn, staged, params, batch, mesh,
                                       _options(args), mu_dtype=_mu_dtype(args))
      report = optax_adama.memory_report(compiled, param_bytes=P)
      total = device_bytes(compiled, state, method, args.devices)
      state_bytes = optax_adama.memory.tree_bytes(state)
      host_bytes = (optax_adama.moments.host_state_bytes(state)
                    if offloads(method) else 0)
      device_state = 0 if offloads(method) else state_bytes
      floor = (P + device_state) / args.devices + layer + activations
      row = {"preset": preset, "overrides": overrides, "method": method,
             "num_micro_batches": n, "devices": args.devices, "seq_len": args.seq_len,
             "rows_per_device": args.rows, "param_count": models.param_count(config),
             "layers": "unrolled" if args.unrolled else "scanned", "mu_dtype": args.mu_dtype,
             "param_bytes": P, "per_device_bytes": int(total),
             "per_device_gib": total / GIB, "per_device_p8": total / (P / args.devices),
             "temp_bytes": report.temp_bytes, "state_bytes": state_bytes,
             "host_state_bytes_per_device": host_bytes // args.devices,
             "floor_bytes": int(floor), "over_floor": total / floor - 1,
             "layer_bytes": layer, "saved_input_bytes": int(saved_inputs),
             "logit_bytes": int(logits),
             "fits_v3": total / GIB <= V3_USABLE_GIB, "fits_v2": total / GIB <= V2_GIB,
             "target": args.target_spec.name if args.target_spec else None,
             "target_memory_bytes": (args.target_spec.memory_bytes if args.target_spec
                                     else None),
             "fits_target": args.target_spec.fits(total) if args.target_spec else None,
             "compiled_for": compiled_for(args),
             "compile_s": time.perf_counter() - start}
      rows.append(row)
      print(f"{preset} N={n} {method}: {total / GIB:.2f} GiB per device "
            f"({row['per_device_p8']:.2f} P/8; floor {floor / GIB:.2f} GiB, "
            f"{100 * row['over_floor']:+.0f}%) in {row['compile_s']:.0f} s", flush=True)
      _save(args, rows)
  return rows


def markdown(rows, command):
  first = rows[0]
  shape = (f"`{first['preset']}`" + (f" with {first['overrides']}" if first["overrides"] else "")
           + f" ({first['param_count']:,} parameters)")
  target = first.get("target")
  if target:
    fits = (f"Fits: {target}, {first['target_memory_bytes'] / GIB:.2f} GiB usable a device "
            "(optax_adama.memory.parse_target says where that number comes from).")
    caveat = ("The compiler is the target's own, with no device: no autotuning, so a "
              "live run still calibrates these bytes.")
    header = f"| fits {target} ({first['target_memory_bytes'] / GIB:.2f} GiB) |"
    mark_row = lambda r: f" {mark(r['fits_target'])} |"
  else:
    fits = f"Fits: v3 core {V3_USABLE_GIB} GiB usable, v2 core {V2_GIB:g} GiB."
    caveat = "The CPU compiler's bytes, not a TPU's: read the columns against each other."
    header = f"| fits v3 ({V3_USABLE_GIB} GiB) | fits v2 ({V2_GIB:g} GiB) |"
    mark_row = lambda r: f" {mark(r['fits_v3'])} | {mark(r['fits_v2'])} |"
  compiled_for = first.get("compiled_for") or (
      f"XLA's CPU backend ({first['devices']} fake devices)")
  lines = [
      f"# Out-of-memory reports reproduced: {shape}", "",
      f"Made by `{command}`, compile-only. Compiled by {compiled_for}.", "",
      f"Layers {first.get('layers', 'scanned')}, `remat=\"full\"`, float32 params and "
      + ("moments" if first.get("mu_dtype", "float32") == "float32"
         else f"second moment, {first['mu_dtype']} first moment") + ", "
      f"{first['rows_per_device']} sequence(s) of {first['seq_len']:,} tokens per device per "
      "micro-batch, FSDP (every device a slice of every leaf). Bytes are one device's "
      "compiled total (argument + output + temp - alias); P/8 is one device's share of the "
      f"params ({first['param_bytes'] / first['devices'] / GIB:.2f} GiB). {fits} Floor: "
      "params and state split over the devices (state on the host for `_offload`), one "
      "layer's params gathered, the layer inputs remat \"full\" keeps and the float32 "
      "logits of one device's micro-batch. Temp: XLA's scratch (activations, one layer's "
      "recompute and gradient, the accumulator where a method keeps one as temp). "
      f"Compile: seconds on this machine. {caveat}", "",
      f"| N | method | per device | in P/8 {header} floor | over the floor | temp | compile |",
      "|---|---|---|---|" + "---|" * header.count("fits") + "---|---|---|---|"]
  mark = lambda ok: "yes" if ok else "**no**"
  for r in rows:
    lines.append(
        f"| {r['num_micro_batches']} | {r['method']} | {r['per_device_gib']:.2f} GiB "
        f"| {r['per_device_p8']:.2f} |{mark_row(r)}"
        f" {r['floor_bytes'] / GIB:.2f} GiB | {100 * r['over_floor']:+.0f}% "
        f"| {r['temp_bytes'] / GIB:.2f} GiB | {r['compile_s']:.0f} s |")
  return "\n".join(lines) + "\n"


def _save(args, rows):
  args.json.parent.mkdir(parents=True, exist_ok=True)
  command = "python benchmarks/scripts/oom_reports.py " + " ".join(args.argv)
  args.json.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
  args.markdown.write_text(markdown(rows, command))


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parse(argv)
  args.argv = argv
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}")
  sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
  rows = capacity(args) if args.scenario == CAPACITY else measure(args)
  print(args.markdown.read_text())
  return rows


if __name__ == "__main__":
  main()
