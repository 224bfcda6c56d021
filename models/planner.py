"""The plan search: the N, remat, savers, moments and ZeRO stage that fit a memory budget.

    chosen = planner.plan("gpt2_large", 24e9, batch_size=8)
    chosen.choice.train_overrides()   # the models.train flags of the choice
    planner.plan("llama2_7b", 16e9, batch_size=32, seq_len=2048, devices=8)  # per device

Two commands run it: `python -m models.plan` (which prints the plan, or
surveys and times every setting) and `python -m models.train --plan
BUDGET_GB` (which trains with it). It lives below both, so neither command
imports the other.

`plan` searches the settings this project can switch without changing the
model's forward pass: the number of micro-batches N (the mini-batch is fixed),
the remat policy or AdamA's gradient release (`optax_adama.release_step`), the
few-bit GELU backward and GPT's chunked LM-head loss (`models.savers`) and the
storage of AdamA's moments (float32, bfloat16, 8-bit blocks). Every number
comes from compiling the real AdamA step (`models.harness.make_train_step`:
the `microbatch_step` or `release_step` `models.train` runs, with its
optimizer) for abstract inputs: nothing is allocated or run.

- Memory: `memory_analysis()` of the compiled step; device bytes are argument +
  output + temp - alias, host bytes (what "offload" moves to pinned host
  memory) the same over the host_* fields.
- Time: `flops / peak_flops` with XLA's `cost_analysis()` flops of the step,
  plus the traffic that grows with N and that flops miss: AdamA's fold, which
  reads the gradient and m, v and writes m, v once per micro-batch,
  `N * (param_bytes + 2 * state_bytes) / memory_bandwidth`, and offloaded
  activations, out on the forward and back on the backward,
  `N * 2 * host_bytes / host_bandwidth`. XLA counts a loop body once, so the
  step's flops are taken per micro-batch and multiplied by N, and the layer
  scan's body (the model is planned with `scan_layers`) is completed with the
  flops of one more layer's forward and backward, compiled alone, times L - 1
  (under the release, with remat "full": it recomputes each layer), and the
  chunked loss's scan with one more chunk's, times chunks - 1.
  XLA's "bytes accessed" is recorded but not used: on the CPU backend it counts
  every unfused elementwise op's traffic and ranks remat "full" faster than no
  remat on gpt2_small (a GPU fuses most of that traffic away).

The model is planned with `scan_layers=True`: one block compiled, so a plan of
gpt2_large costs seconds per candidate, and on the CPU backend the remat policy
shows in the compiled memory only under a scan (XLA's CPU scheduler keeps an
unrolled model's activations alive whatever the policy saves).

The search and the predictor are the library's (`optax_adama._search.search`,
`Machine`, `Measurement`: `optax_adama.memory.plan` runs them on a user's own
model); this module adds the zoo's settings to them. Search, per activation
setting (remat policy or release, GELU bits): the
smallest N that fits with float32 moments, by bisection over the divisors of
the batch size (memory falls as N grows, predicted time grows with N: each
micro-batch pays AdamA's fold over all moments); then the memory levers, each
only where it lets a smaller N fit: the loss in chunks (exact, one more head
forward), then bfloat16 and 8-bit moments (with the chunks). Narrower moments
change the optimizer's numerics, so they are a memory lever, not a speed one.
The fastest predicted candidate wins and is compiled once more, uncached, to
verify it fits.

On a mesh (`devices` > 1; the budget is per device, `batch_size` the whole
mini-batch over all devices) each candidate also has a ZeRO stage,
`shard_states` None (data parallel: params and moments whole on every
device), "zero1", "zero2" or "fsdp" (`optax_adama.sharding`), and the step is
`make_train_step(..., mesh=, shard_states=)` compiled for placed abstract
arguments (`harness.train_step_shardings`) on a one-axis mesh of that many
devices (fake CPU devices where the process has them: `python -m
models.plan --devices 8` makes them). Memory is one device's compiled bytes.
N ranges over the divisors that still give every device whole rows of each
micro-batch. A stage is skipped without compiling where what it keeps whole
on every device, whatever N and remat, exceeds the budget (the params under
zero1/zero2, params and moments with no stage); the table says so. The
search above runs per stage, over `MESH_ACTIVATION_SETTINGS` by default. The
predictor adds, per device, the folds of its
share of the moments (1/D under a stage) and the collectives:
`optax_adama.memory.collective_bytes` of the compiled step (which weights
each collective by the trip counts of the loops around it, so every
micro-batch and layer is counted) converted to what one device sends on a
ring (all-reduce 2 (D-1)/D of the array, all-gather, reduce-scatter and
all-to-all (D-1)/D), over `Machine.interconnect_bandwidth`. The terms are
summed, not overlapped: an upper bound where XLA hides collectives behind
compute. Flops are per device (XLA's cost analysis of the partitioned step;
the layer and loss-chunk completions compiled for one device's rows).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

import models
import optax_adama
from models import harness
from models import savers
from optax_adama import _search  # the search and the cost model under memory.plan

# Activation settings: (remat policy, few-bit GELU bits). Few-bit GELU only
# changes what is saved where the GELU input would be saved: with no remat.
# Every other policy saves the matmul outputs (the GELU input among them) or
# recomputes the block. Only 4 bits: 2 bits is +6.3% on one bert_tiny seed of
# five (median -0.19%; benchmarks/savers_convergence.md), as far off as any
# seed of exact BERT, and its code biases every pre-activation outside +-0.5 by
# 4.6%, so the planner does not pick it; `plan --survey` measures it too. The
# sampled projection is left out of the plan for the same reason (+2.9% on
# bert_tiny at keep ratio 0.5, +3.8% on gpt_tiny at 0.25); `plan --survey`
# measures it.
#
# RELEASE is AdamA's gradient release (`optax_adama.release_step`, `models.train
# --release`) in place of a remat policy: it keeps each layer's input only,
# recomputes the layer in the backward scan (remat "full"'s work) and folds and
# drops each layer's gradient there, so the stack's gradient is never whole.
RELEASE = "release"
ACTIVATION_SETTINGS: tuple[tuple[str, int | None], ...] = (
    ("none", None), ("none", 4), ("dots_no_batch", None), ("dots", None),
    ("minimal", None), ("offload", None), ("full", None), (RELEASE, None),
)
# On a mesh, a small default, so a 7-8B plan compiles in minutes: "full" keeps
# each layer's input, "minimal" also its matmul outputs (less recompute), the
# release also drops each layer's gradient. "none" and "dots" keep more than
# "minimal", which already needs 29.6 GB a device for llama2_7b at one
# 2,048-token row (FSDP, N = 4), and every setting costs ~10-25 s a compile
# here per N, stage and moments tried. Measured on 2 shared cores: llama2_7b on
# 8 x 16 GB, 14 compiles in 4.7 min; llama3_8b on 8 x 80 GB, 39 in 11.7 min.
MESH_ACTIVATION_SETTINGS: tuple[tuple[str, int | None], ...] = (
    ("minimal", None), ("full", None), (RELEASE, None))
# Moment storage, most precise first: the planner narrows only to fit.
MOMENT_STORAGES = ("float32", "bfloat16", "8bit")
# ZeRO stages on a mesh (optax_adama.sharding), least split first; one device: None.
SHARD_STAGES: tuple[str | None, ...] = (None, "zero1", "zero2", "fsdp")
# GPT's LM-head loss over this many chunks of tokens (`models.savers.
# chunked_cross_entropy`): the same loss up to summation order, one chunk's
# logits alive instead of all (0.83 P a copy on GPT-2 small at 2,048 tokens), for
# one more forward of the head. A memory lever like narrower moments: tried
# where it lets a smaller N fit, before the moments are narrowed.
LOSS_CHUNKS = 8


# The predictor's rates and a candidate's measurement are the library's
# (`optax_adama.memory.plan` ranks a user's model with the same model).
Machine = optax_adama.memory.Machine
Measurement = optax_adama.memory.Measurement
Considered = optax_adama.memory.Considered
Skipped = optax_adama.memory.Skipped
DEFAULT_MACHINE = _search.DEFAULT_MACHINE


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting of the step: what `models.train` takes as flags."""

  num_micro_batches: int
  remat: str = "none"  # a policy of models.REMAT_POLICIES, or RELEASE
  gelu_bits: int | None = None
  moments: str = "float32"  # one of MOMENT_STORAGES
  loss_chunks: int = 1
  linear_keep_ratio: float | None = None  # sampled MLP projection; plan --survey only
  # ZeRO stage on a mesh: None (data parallel, or one device), "zero1", "zero2", "fsdp".
  shard_states: str | None = None

  def saver_names(self) -> list[str]:
    names = []
    if self.gelu_bits:
      names.append(f"gelu {self.gelu_bits}-bit")
    if self.loss_chunks > 1:
      names.append(f"loss in {self.loss_chunks} chunks")
    if self.linear_keep_ratio:
      names.append(f"sampled dW {self.linear_keep_ratio:g}")
    return names

  def describe(self, *, on_mesh: bool = False) -> str:
    """"N=2 remat=full savers=- moments=float32", with " stage=fsdp" on a mesh
    (" stage=dp" for data parallel: params and moments whole on every device)."""
    activations = RELEASE if self.remat == RELEASE else f"remat={self.remat}"
    stage = ""
    if on_mesh or self.shard_states is not None:
      stage = f" stage={self.shard_states or 'dp'}"
    return (f"N={self.num_micro_batches} {activations} "
            f"savers={' + '.join(self.saver_names()) or '-'} "
            f"moments={self.moments}{stage}")

  def label(self) -> str:
    """The activation setting alone: "none + gelu 4-bit", "release", "full"."""
    return " + ".join([self.remat] + self.saver_names())

  def train_overrides(self) -> dict[str, Any]:
    """The `models.harness.TrainConfig` fields of this setting, and with a ZeRO
    stage `shard_states`: not a field, `harness.make_train_step`'s argument (with
    its `mesh`; `models.train` runs one device). Pop it before `TrainConfig(**...)`.
    """
    narrow = "bfloat16" if self.moments == "bfloat16" else None
    release = self.remat == RELEASE
    stage = {} if self.shard_states is None else {"shard_states": self.shard_states}
    return {"num_micro_batches": self.num_micro_batches,
            "remat": "none" if release else self.remat, "release": release,
            "gelu_bits": self.gelu_bits, "loss_chunks": self.loss_chunks,
            "linear_keep_ratio": self.linear_keep_ratio,
            "mu_dtype": narrow, "nu_dtype": narrow,
            "quantize_moments": self.moments == "8bit", "scan_layers": True, **stage}


@dataclasses.dataclass(frozen=True)
class Plan:
  """The planner's answer and why: every candidate it compiled (and, on a mesh,
  every stage it skipped)."""

  preset: str
  budget_bytes: int  # per device
  batch_size: int  # the whole mini-batch, over all devices
  seq_len: int | None
  choice: Candidate
  verified: Measurement  # the choice compiled again, uncached
  predicted_s: float
  considered: tuple[Considered, ...]
  devices: int = 1
  skipped: tuple[Skipped, ...] = ()

  def table(self) -> str:
    """Markdown: every candidate compiled, best predicted first; the choice marked.

    Memory is one device's; on a mesh in units of P/D, one device's share of
    the params. Stages skipped without compiling come last.
    """
    on_mesh = self.devices > 1
    unit, unit_name = self.verified.param_bytes / self.devices, (
        f"P/{self.devices}" if on_mesh else "P")
    memory = "memory per device" if on_mesh else "device memory"
    lines = [f"| candidate | {memory} | host memory | predicted step | fits |",
             "|---|---|---|---|---|"]
    for row in sorted(self.considered, key=lambda r: (not r.fits, r.predicted_s)):
      mark = " **(chosen)**" if row.candidate == self.choice else ""
      m = row.measurement
      lines.append(
          f"| {row.candidate.describe(on_mesh=on_mesh)}{mark} | {m.device_bytes / 1e9:.4g} GB "
          f"({m.device_bytes / unit:.2f} {unit_name}) | {m.host_bytes / 1e9:.4g} GB "
          f"| {row.predicted_s * 1e3:.4g} ms | {'yes' if row.fits else 'no'}"
          f"{'' if row.measurable else ' (offload not measurable here)'} |")
    for skipped in self.skipped:
      lines.append(f"| {skipped.describe()} | {skipped.replicated_bytes / 1e9:.4g} GB "
                   f"({skipped.replicated_bytes / unit:.2f} {unit_name}) whole, over the "
                   f"{self.budget_bytes / 1e9:.4g} GB budget | - | - | no: skipped, not "
                   "compiled |")
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def model_kind(config: models.Config) -> str:
  """"gpt", "bert", "vit" or "llama": the `models.train --model` of a config."""
  kinds = {models.GPTConfig: "gpt", models.BERTConfig: "bert", models.ViTConfig: "vit",
           models.LlamaConfig: "llama"}
  return kinds[type(config)]


def train_config(preset: str, candidate: Candidate, *, batch_size: int,
                 seq_len: int | None) -> harness.TrainConfig:
  """The `models.train` run of a candidate (so the plan compiles what train runs)."""
  kind = model_kind(models.get_config(preset))
  extra = {} if seq_len is None else {"seq_len": seq_len}
  overrides = candidate.train_overrides()
  overrides.pop("shard_states", None)  # make_train_step's argument, not a field
  return harness.TrainConfig(model=kind, preset=preset, batch_size=batch_size,
                             **extra, **overrides)


def device_mesh(devices: int) -> jax.sharding.Mesh:
  """A one-axis ("data") mesh of `devices` devices: the default backend's where
  it has that many, else the CPU's (fake devices: compile only).

  Raises:
    ValueError: if neither has that many, naming the flag that makes them.
  """
  for backend in (None, "cpu"):
    found = jax.devices(backend)
    if len(found) >= devices:
      return jax.make_mesh((devices,), ("data",), devices=found[:devices],
                           axis_types=(jax.sharding.AxisType.Auto,))
  raise ValueError(
      f"a plan on devices={devices} needs {devices} devices; this process has "
      f"{jax.device_count()}. Start it with XLA_FLAGS=--xla_force_host_platform_device_count="
      f"{devices} (before jax initialises), as `python -m models.plan --devices {devices}` "
      "does.")


def _placed(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _cost(compiled: jax.stages.Compiled) -> tuple[float, float]:
  analysis = compiled.cost_analysis()
  return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def measure(preset: str, candidate: Candidate, *, batch_size: int,
            seq_len: int | None, devices: int = 1) -> Measurement:
  """Compiles a candidate's AdamA step (compile only) and measures it.

  Args:
    preset: a key of `models.PRESETS`.
    candidate: the setting to compile.
    batch_size: the mini-batch (sequences or images); split into N micro-batches.
    seq_len: tokens per sequence (text models); None: the preset's context.
    devices: compiled data parallel on a mesh of this many (`device_mesh`)
      with the candidate's ZeRO stage; memory and flops are one device's.

  Returns:
    Its `Measurement`.
  """
  run = train_config(preset, candidate, batch_size=batch_size, seq_len=seq_len)
  config = harness.model_config_of(run)
  if seq_len is not None and hasattr(config, "max_len"):
    seq_len = min(seq_len, config.max_len)  # as models.train reads its batches
  model = models.create_abstract(config)
  loss_fn, params = models.split_loss_fn(model, has_aux=True)
  tx = harness.make_optimizer(run)
  mesh = None if devices == 1 else device_mesh(devices)
  step = harness.make_train_step(run, model, loss_fn, tx, mesh=mesh,
                                 shard_states=candidate.shard_states)
  batch = harness.abstract_batch(config, batch_size, seq_len)
  state = jax.eval_shape(tx.init, params)
  args = (params, state)
  if mesh is not None:
    shardings = harness.train_step_shardings(run, model, params, state, mesh,
                                             candidate.shard_states)
    args = (_placed(params, shardings.params), _placed(state, shardings.opt_state))
  start = time.perf_counter()
  compiled = _search.compile_for_measurement(step.lower(*args, batch))
  # The layer and chunk completions are one device's share of a micro-batch.
  micro_batch_size = batch_size // run.num_micro_batches // devices
  # XLA counts a loop body once: complete the layer scan (and the loss's chunk
  # scan) with one more body's work, compiled alone, per uncounted iteration.
  # The release recomputes each layer in its backward scan, as remat "full".
  layer_remat = "full" if run.release else candidate.remat
  step_flops, step_bytes = _cost(compiled)
  layer_flops, layer_bytes = _layer_cost(
      preset, layer_remat, candidate.gelu_bits, micro_batch_size, seq_len)
  chunk_flops, chunk_bytes = (0.0, 0.0) if run.loss_chunks == 1 else _loss_chunk_cost(
      preset, run.loss_chunks, micro_batch_size, seq_len)
  compile_s = time.perf_counter() - start
  extra_layers, extra_chunks = config.num_layers - 1, run.loss_chunks - 1
  n = run.num_micro_batches
  return _search.measure_compiled(
      compiled, params=params, opt_state=state,
      flops=n * (step_flops + extra_layers * layer_flops + extra_chunks * chunk_flops),
      bytes_accessed=n * (step_bytes + extra_layers * layer_bytes + extra_chunks * chunk_bytes),
      compile_s=compile_s, devices=devices,
      state_shards=devices if candidate.shard_states is not None else 1)


@functools.cache
def _layer_cost(preset: str, remat: str, gelu_bits: int | None, micro_batch_size: int,
                seq_len: int | None) -> tuple[float, float]:
  """(flops, bytes) of one block's forward and backward under `remat`, compiled alone.

  The program returns the block's output as well as its gradients, so the
  forward is kept (in the model it feeds the next block), and the remat is
  applied with `prevent_cse=True`, so XLA cannot merge the backward's
  recomputation into that forward (inside the model's scan it cannot either).
  """
  config = models.get_config(preset, remat="none", gelu_bits=gelu_bits, scan_layers=True)
  staged, params = models.staged_loss(models.create_abstract(config))
  micro_batch = harness.abstract_batch(config, micro_batch_size, seq_len)
  return _search.block_cost(staged, params, micro_batch,
                                       policy=models.REMAT_POLICIES[remat])


@functools.cache
def _loss_chunk_cost(preset: str, num_chunks: int, micro_batch_size: int,
                     seq_len: int | None) -> tuple[float, float]:
  """(flops, bytes) of the chunked LM-head loss's forward and backward, compiled alone.

  The loss's scans count one chunk (a forward, and a recomputed forward and
  backward): what each of the other num_chunks - 1 chunks adds to the step.
  """
  config = models.get_config(preset)
  tokens = micro_batch_size * (seq_len or config.max_len)
  sds = jax.ShapeDtypeStruct
  features = sds((tokens, config.hidden), jnp.float32)
  table = sds((config.vocab_size, config.hidden), jnp.float32)
  labels = sds((tokens,), jnp.int32)

  def loss_and_grads(features, table, labels):
    loss = lambda f, t: savers.chunked_cross_entropy(f, t, labels, num_chunks=num_chunks)[0]
    return jax.value_and_grad(loss, argnums=(0, 1))(features, table)

  return _cost(_search.compile_for_measurement(
      jax.jit(loss_and_grads).lower(features, table, labels)))


def divisors(n: int) -> list[int]:
  """The divisors of n, increasing: the N that split a batch of n evenly."""
  return [d for d in range(1, n + 1) if n % d == 0]


def plan(
    preset: str,
    budget_bytes: float,
    *,
    batch_size: int,
    seq_len: int | None = None,
    devices: int = 1,
    machine: Machine = DEFAULT_MACHINE,
    activation_settings: Sequence[tuple[str, int | None]] | None = None,
    moment_storages: Sequence[str] = MOMENT_STORAGES,
    loss_chunks: Sequence[int] | None = None,
    shard_stages: Sequence[str | None] | None = None,
    measure_fn: Callable[[Candidate], Measurement] | None = None,
    verify_fn: Callable[[Candidate], Measurement] | None = None,
    replicated_fn: Callable[[str | None, str], int] | None = None,
    progress: bool = False,
) -> Plan:
  """The fastest predicted AdamA step of `preset` that fits `budget_bytes`.

  See the module docstring for the predictor and the search. Compiles are
  cached per candidate in `measure_fn` (default: a fresh cache per call).

  Args:
    preset: a key of `models.PRESETS`.
    budget_bytes: memory budget of each device, bytes.
    batch_size: the mini-batch over all devices; N ranges over its divisors
      that leave every device whole rows of each micro-batch.
    seq_len: tokens per sequence (text models); None: the preset's context.
    devices: plan data parallel on a mesh of this many devices (one process
      needs as many devices: `device_mesh`).
    machine: the rates of the time predictor.
    activation_settings: (remat, gelu_bits) pairs to consider; None:
      `ACTIVATION_SETTINGS` on one device, `MESH_ACTIVATION_SETTINGS` on a mesh.
    moment_storages: moment storages to consider, most precise first.
    loss_chunks: LM-head loss chunk counts to consider, 1 first; None: (1,
      LOSS_CHUNKS) for a causal LM whose sequence length they divide, else (1,).
    shard_stages: ZeRO stages to consider; None: (None,) on one device,
      `SHARD_STAGES` on a mesh.
    measure_fn: `measure_fn(candidate) -> Measurement`; pass a cached one to
      share compiles between calls (tests do).
    verify_fn: measures the choice once more; default: `measure`, uncached.
    replicated_fn: `replicated_fn(shard_states, moments) -> bytes` kept whole
      on every device (a stage is skipped where they exceed the budget);
      default: `replicated_bytes` of the preset. Used on a mesh only.
    progress: print each compile to stderr.

  Returns:
    The `Plan`: its choice was compiled again and fits.

  Raises:
    ValueError: if no candidate fits (the message gives the smallest measured),
      for a batch that gives some device no rows, or for a ZeRO stage on one
      device.
  """
  if devices < 1:
    raise ValueError(f"devices must be >= 1, got {devices}.")
  on_mesh = devices > 1
  if shard_stages is None:
    shard_stages = SHARD_STAGES if on_mesh else (None,)
  for stage in shard_stages:
    if stage not in SHARD_STAGES or (stage is not None and not on_mesh):
      raise ValueError(f"shard_states {stage!r} is not a stage of {devices} device(s): use "
                       f"{SHARD_STAGES if on_mesh else (None,)} (a ZeRO stage needs devices > 1).")
  if activation_settings is None:
    activation_settings = MESH_ACTIVATION_SETTINGS if on_mesh else ACTIVATION_SETTINGS
  if measure_fn is None:
    measure_fn = cached_measure(preset, batch_size=batch_size, seq_len=seq_len, devices=devices)
  if replicated_fn is None:
    replicated_fn = functools.partial(replicated_bytes, preset)
  if loss_chunks is None:
    loss_chunks = default_loss_chunks(preset, seq_len)
  # Each device takes an equal share of every micro-batch's rows.
  splits = [n for n in divisors(batch_size) if (batch_size // n) % devices == 0]
  if not splits:
    raise ValueError(f"batch_size={batch_size} does not give each of {devices} devices whole "
                     f"rows; pass a multiple of {devices}.")
  found = _search.search(
      budget_bytes=budget_bytes, splits=splits, stages=shard_stages,
      activations=activation_settings, moment_storages=moment_storages,
      levers=lambda storages: memory_levers(storages, loss_chunks),
      candidate_of=lambda n, activation, lever, stage: Candidate(
          n, *activation, *lever, shard_states=stage),
      measure=measure_fn, machine=machine, replicated=replicated_fn if on_mesh else None,
      measurable=lambda candidate, m: candidate.remat != "offload" or m.host_bytes > 0,
      describe=lambda candidate: candidate.describe(on_mesh=on_mesh), progress=progress)
  fitting, considered, skipped = found.fitting, found.considered, found.skipped
  where = f" on {devices} devices" if on_mesh else ""
  if not fitting and not considered:
    least = min(skipped, key=lambda s: s.replicated_bytes)
    raise ValueError(
        f"nothing fits {budget_bytes / 1e9:.3g} GB for {preset}{where}: every stage keeps more "
        f"whole on each device, the least {least.describe()} ({least.replicated_bytes / 1e9:.3g} "
        "GB). Raise the budget or add shard_states='fsdp'.")
  if not fitting:
    smallest = min(considered, key=lambda r: r.measurement.device_bytes)
    raise ValueError(
        f"nothing fits {budget_bytes / 1e9:.3g} GB for {preset} at batch {batch_size}{where}: "
        f"the smallest step measured is {smallest.candidate.describe(on_mesh=on_mesh)} at "
        f"{smallest.measurement.device_bytes / 1e9:.3g} GB. Raise the budget or the "
        "batch's divisibility (a larger N), or shorten the sequences.")
  precision = {m: i for i, m in enumerate(MOMENT_STORAGES)}
  best = min(fitting, key=lambda r: (r.predicted_s, precision[r.candidate.moments],
                                     r.candidate.loss_chunks))
  if verify_fn is None:
    verify_fn = functools.partial(measure, preset, batch_size=batch_size, seq_len=seq_len,
                                  devices=devices)
  verified = verify_fn(best.candidate)
  if verified.device_bytes > budget_bytes:
    raise RuntimeError(f"the chosen {best.candidate.describe(on_mesh=on_mesh)} measured "
                       f"{verified.device_bytes:,} B on recompiling, over the budget.")
  return Plan(preset, int(budget_bytes), batch_size, seq_len, best.candidate, verified,
              best.predicted_s, considered, devices, skipped)


def replicated_bytes(preset: str, shard_states: str | None, moments: str) -> int:
  """Bytes a stage keeps whole on every device whatever N and remat: params and
  optimizer state with no stage (data parallel), the params under "zero1" and
  "zero2", none under "fsdp". From abstract shapes: nothing is compiled."""
  if shard_states == "fsdp":
    return 0
  param_bytes, state_bytes = _whole_bytes(preset, moments)
  return param_bytes + state_bytes if shard_states is None else param_bytes


@functools.cache
def _whole_bytes(preset: str, moments: str) -> tuple[int, int]:
  """(params, optimizer state) bytes of `preset` with `moments` storage."""
  run = train_config(preset, Candidate(1, moments=moments), batch_size=1, seq_len=None)
  _, params = models.split_loss_fn(models.create_abstract(harness.model_config_of(run)),
                                   has_aux=True)
  state = jax.eval_shape(harness.make_optimizer(run).init, params)
  return optax_adama.memory.tree_bytes(params), optax_adama.memory.tree_bytes(state)


def default_loss_chunks(preset: str, seq_len: int | None) -> tuple[int, ...]:
  """(1, LOSS_CHUNKS) for a causal LM (GPT, Llama) whose sequences they divide into
  chunks, else (1,)."""
  config = models.get_config(preset)
  if not isinstance(config, (models.GPTConfig, models.LlamaConfig)):
    return (1,)
  return (1, LOSS_CHUNKS) if (seq_len or config.max_len) % LOSS_CHUNKS == 0 else (1,)


def memory_levers(moment_storages: Sequence[str],
                  loss_chunks: Sequence[int]) -> list[tuple[str, int]]:
  """(moment storage, loss chunks) pairs, in the order the planner pulls them.

  Exact levers first: the loss's chunk counts with the most precise moments,
  then narrower moments (which change the numerics) with the most chunks.
  """
  levers = [(moment_storages[0], chunks) for chunks in loss_chunks]
  return levers + [(moments, loss_chunks[-1]) for moments in moment_storages[1:]]


def cached_measure(preset: str, *, batch_size: int, seq_len: int | None,
                   devices: int = 1) -> Callable[[Candidate], Measurement]:
  """`measure` for one preset, batch and mesh size, with each candidate compiled once."""

  @functools.cache
  def measure_candidate(candidate: Candidate) -> Measurement:
    return measure(preset, candidate, batch_size=batch_size, seq_len=seq_len, devices=devices)

  return measure_candidate
