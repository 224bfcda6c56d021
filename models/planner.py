"""The zoo's levers for the library's planner: remat policies, savers, the loss in chunks.

    chosen = planner.plan("gpt2_large", 24e9, batch_size=8)
    planner.train_overrides(chosen.settings)   # the models.train flags of the choice
    planner.plan("llama2_7b", 16e9, batch_size=32, seq_len=2048, devices=8)  # per device

Two commands run it: `python -m models.plan` (which prints the plan, or
surveys and times every setting) and `python -m models.train --plan
BUDGET_GB` (which trains with it). It lives below both, so neither command
imports the other.

The search, the time predictor and the plan are the library's
(`optax_adama.memory.plan`, docs/fit.md): N, the storage of AdamA's moments
(float32, bfloat16, 8-bit blocks), AdamA's gradient release
(`optax_adama.release_step`) and, on a mesh, the ZeRO stage. This module adds
what only the zoo can switch, as an `optax_adama.memory.ModelLevers`
(`PresetLevers`): the remat policy, the few-bit GELU backward and GPT's
chunked LM-head loss (`models.savers`), each setting a `ModelVariant` of the
preset's model (`PlanSettings.model`). Every candidate is the AdamA step
`models.train` runs for it (`models.harness.make_train_step`'s
`microbatch_step` or `release_step`, with `models.harness.make_optimizer`'s
optimizer), compiled for abstract inputs: nothing is allocated or run.

- Memory: `memory_analysis()` of the compiled step; device bytes are argument +
  output + temp - alias, host bytes (what remat "offload" moves to pinned host
  memory) the same over the host_* fields.
- Time: the library's roofline (`optax_adama.memory.Measurement`): XLA's
  flops of the step over `peak_flops`, AdamA's fold of each micro-batch over
  the moments at `memory_bandwidth` and host traffic at `host_bandwidth`. XLA
  counts a loop body once, so the step's flops are taken per micro-batch and
  multiplied by N, and the layer scan's body (the model is planned with
  `scan_layers`) is completed with the flops of one more layer's forward and
  backward, compiled alone, times L - 1 (under the release, with remat
  "full": it recomputes each layer), and the chunked loss's scan with one
  more chunk's, times chunks - 1 (`PresetLevers.uncounted_cost`). XLA's
  "bytes accessed" is recorded but not used: on the CPU backend it counts
  every unfused elementwise op's traffic and ranks remat "full" faster than
  no remat on gpt2_small (a GPU fuses most of that traffic away).

The model is planned with `scan_layers=True`: one block compiled, so a plan of
gpt2_large costs seconds per candidate, and on the CPU backend the remat policy
shows in the compiled memory only under a scan (XLA's CPU scheduler keeps an
unrolled model's activations alive whatever the policy saves).

Search, per activation setting (remat policy or release, GELU bits): the
smallest N that fits with float32 moments, by bisection over the divisors of
the batch size (memory falls as N grows, predicted time grows with N: each
micro-batch pays AdamA's fold over all moments); then the memory levers, each
only where it lets a smaller N fit: the loss in chunks (exact, one more head
forward), then bfloat16 and 8-bit moments (with the chunks). Narrower moments
change the optimizer's numerics, so they are a memory lever, not a speed one.
Every narrower storage tried is compiled (`bound_narrower_moments` is off), so
the table lists each measured. The fastest predicted candidate wins and is
compiled once more, uncached, to verify it fits.

On a mesh (`devices` > 1; the budget is per device, `batch_size` the whole
mini-batch over all devices) each candidate also has a ZeRO stage,
`shard_states` None (data parallel: params and moments whole on every
device), "zero1", "zero2" or "fsdp" (`optax_adama.sharding`), on a one-axis
"data" mesh of that many devices (fake CPU devices where the process has them:
`python -m models.plan --devices 8` makes them). Memory is one device's
compiled bytes. N ranges over the divisors that still give every device whole
rows of each micro-batch. A stage is skipped without compiling where what it
keeps whole on every device, whatever N and remat, exceeds the budget (the
params under zero1/zero2, params and moments with no stage); the table says
so. The search above runs per stage, over `MESH_ACTIVATION_SETTINGS` by
default. The predictor adds, per device, the folds of its share of the
moments (1/D under a stage) and the collectives:
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
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import models
import optax_adama
from models import harness
from models import savers
from optax_adama.memory import Considered
from optax_adama.memory import Machine
from optax_adama.memory import Measurement
from optax_adama.memory import Plan
from optax_adama.memory import PlanSettings
from optax_adama.memory import Skipped

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
# GPT's LM-head loss over this many chunks of tokens (`models.savers.
# chunked_cross_entropy`): the same loss up to summation order, one chunk's
# logits alive instead of all (0.83 P a copy on GPT-2 small at 2,048 tokens), for
# one more forward of the head. A memory lever like narrower moments: tried
# where it lets a smaller N fit, before the moments are narrowed.
LOSS_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class ModelVariant:
  """A preset's model with the zoo's levers pulled: `PlanSettings.model` of its plans."""

  remat: str | None = "none"  # a policy of models.REMAT_POLICIES; None under the release
  gelu_bits: int | None = None
  loss_chunks: int = 1
  linear_keep_ratio: float | None = None  # sampled MLP projection; plan --survey only

  def saver_names(self) -> list[str]:
    names = []
    if self.gelu_bits:
      names.append(f"gelu {self.gelu_bits}-bit")
    if self.loss_chunks > 1:
      names.append(f"loss in {self.loss_chunks} chunks")
    if self.linear_keep_ratio:
      names.append(f"sampled dW {self.linear_keep_ratio:g}")
    return names

  def __str__(self) -> str:
    """"remat=full savers=-", "savers=loss in 8 chunks" under the release."""
    remat = "" if self.remat is None else f"remat={self.remat} "
    return f"{remat}savers={' + '.join(self.saver_names()) or '-'}"


def step_settings(num_micro_batches: int, remat: str = "none", gelu_bits: int | None = None,
                  moments: str = "float32", loss_chunks: int = 1,
                  linear_keep_ratio: float | None = None,
                  shard_states: str | None = None) -> PlanSettings:
  """The `PlanSettings` of `models.train`'s flags (remat `RELEASE`: the release)."""
  release = remat == RELEASE
  variant = ModelVariant(None if release else remat, gelu_bits, loss_chunks, linear_keep_ratio)
  return PlanSettings(num_micro_batches, moments, release=release, shard_states=shard_states,
                      model=variant)


def flags_of(settings: PlanSettings) -> dict[str, Any]:
  """`step_settings`' arguments of `settings`: the plans' JSON writes them."""
  variant = _variant(settings)
  return {"num_micro_batches": settings.num_micro_batches,
          "remat": RELEASE if settings.release else variant.remat,
          "gelu_bits": variant.gelu_bits, "moments": settings.moments,
          "loss_chunks": variant.loss_chunks, "linear_keep_ratio": variant.linear_keep_ratio,
          "shard_states": settings.shard_states}


def label(settings: PlanSettings) -> str:
  """The activation setting alone: "none + gelu 4-bit", "release", "full"."""
  variant = _variant(settings)
  return " + ".join([RELEASE if settings.release else str(variant.remat)]
                    + variant.saver_names())


def train_overrides(settings: PlanSettings) -> dict[str, Any]:
  """The `models.harness.TrainConfig` fields of `settings`, the ZeRO stage
  (`shard_states`) included: `models.train --plan` on `--mesh-devices` takes it."""
  variant = _variant(settings)
  narrow = "bfloat16" if settings.moments == "bfloat16" else None
  stage = {"shard_states": settings.shard_states}
  return {"num_micro_batches": settings.num_micro_batches,
          "remat": "none" if settings.release else variant.remat,
          "release": settings.release, "gelu_bits": variant.gelu_bits,
          "loss_chunks": variant.loss_chunks, "linear_keep_ratio": variant.linear_keep_ratio,
          "mu_dtype": narrow, "nu_dtype": narrow,
          "quantize_moments": settings.moments == "8bit", "scan_layers": True, **stage}


def train_flags(settings: PlanSettings) -> list[str]:
  """`settings` as `models.train` flags: what the plan chose, without searching again."""
  flags = []
  for name, value in train_overrides(settings).items():
    flag = "--" + name.replace("_", "-")
    if value is True:
      flags.append(flag)
    elif value not in (None, False):
      flags += [flag, str(value)]
  return flags


def _variant(settings: PlanSettings) -> ModelVariant:
  return ModelVariant() if settings.model is None else settings.model


def model_kind(config: models.Config) -> str:
  """"gpt", "bert", "vit" or "llama": the `models.train --model` of a config."""
  kinds = {models.GPTConfig: "gpt", models.BERTConfig: "bert", models.ViTConfig: "vit",
           models.LlamaConfig: "llama"}
  return kinds[type(config)]


def train_config(preset: str, settings: PlanSettings, *, batch_size: int,
                 seq_len: int | None) -> harness.TrainConfig:
  """The `models.train` run of `settings` (so the plan compiles what train runs)."""
  kind = model_kind(models.get_config(preset))
  extra = {} if seq_len is None else {"seq_len": seq_len}
  overrides = train_overrides(settings)
  # The planner compiles the stage on its own mesh (make_train_step's mesh=).
  overrides.pop("shard_states", None)
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


def default_loss_chunks(preset: str, seq_len: int | None) -> tuple[int, ...]:
  """(1, LOSS_CHUNKS) for a causal LM (GPT, Llama) whose sequences they divide into
  chunks, else (1,)."""
  config = models.get_config(preset)
  if not isinstance(config, (models.GPTConfig, models.LlamaConfig)):
    return (1,)
  return (1, LOSS_CHUNKS) if (seq_len or config.max_len) % LOSS_CHUNKS == 0 else (1,)


class PresetLevers(optax_adama.memory.ModelLevers):
  """A preset's levers for `optax_adama.memory.plan`: its remat policies, savers and
  loss chunks, each step compiled as `models.train` runs it.

  `params` and `batch` are the preset's, abstract: `plan`'s arguments.
  """

  # Every narrower storage tried is compiled, as the committed plans
  # (benchmarks/results/memory/plan_*.md) were searched: each is in their tables.
  bound_narrower_moments = False

  def __init__(self, preset: str, *, batch_size: int, seq_len: int | None = None,
               devices: int = 1,
               activation_settings: Sequence[tuple[str, int | None]] | None = None,
               loss_chunks: Sequence[int] | None = None):
    if activation_settings is None:
      activation_settings = MESH_ACTIVATION_SETTINGS if devices > 1 else ACTIVATION_SETTINGS
    self.preset, self.batch_size, self.devices = preset, batch_size, devices
    self.activation_settings = tuple(activation_settings)
    self.loss_chunks = tuple(default_loss_chunks(preset, seq_len) if loss_chunks is None
                             else loss_chunks)
    self.seq_len = seq_len  # as given: models.train's flag
    config = harness.model_config_of(self._run(PlanSettings(1)))
    if seq_len is not None and hasattr(config, "max_len"):
      seq_len = min(seq_len, config.max_len)  # as models.train reads its batches
    self.batch_seq_len = seq_len
    self.num_layers = config.num_layers
    _, self.params = models.split_loss_fn(models.create_abstract(config), has_aux=True)
    self.batch = harness.abstract_batch(config, batch_size, seq_len)

  def activations(self) -> list[tuple[Hashable, bool]]:
    return [(ModelVariant(None), True) if remat == RELEASE else (ModelVariant(remat, bits), False)
            for remat, bits in self.activation_settings]

  def exact(self, variant: Hashable) -> list[Hashable]:
    """The loss in each of `loss_chunks`' chunk counts, 1 first."""
    assert isinstance(variant, ModelVariant)
    return [dataclasses.replace(variant, loss_chunks=chunks) for chunks in self.loss_chunks]

  def loss(self, settings: PlanSettings) -> tuple[Callable[..., Any], bool]:
    """The model's loss with accuracy aux, or its `StagedLoss` under the release."""
    model = models.create_abstract(harness.model_config_of(self._run(settings)))
    if settings.release:
      staged, _ = models.staged_loss(model)
      return staged, False
    loss_fn, _ = models.split_loss_fn(model, has_aux=True)
    return loss_fn, True

  def optimizer(self, settings: PlanSettings) -> optax.GradientTransformation:
    """`models.train`'s optimizer for `settings`."""
    return harness.make_optimizer(self._run(settings))

  def uncounted_cost(self, settings: PlanSettings, params: Any,
                     micro_batch: Any) -> tuple[float, float]:
    """The layers after the first and the loss's chunks after the first."""
    del params
    variant = _variant(settings)
    rows = jax.tree.leaves(micro_batch)[0].shape[0]
    # The release recomputes each layer in its backward scan, as remat "full".
    layer_remat = "full" if settings.release else str(variant.remat)
    layer_flops, layer_bytes = _layer_cost(self.preset, layer_remat, variant.gelu_bits, rows,
                                           self.batch_seq_len)
    chunk_flops, chunk_bytes = (0.0, 0.0) if variant.loss_chunks == 1 else _loss_chunk_cost(
        self.preset, variant.loss_chunks, rows, self.batch_seq_len)
    extra_layers, extra_chunks = self.num_layers - 1, variant.loss_chunks - 1
    return (extra_layers * layer_flops + extra_chunks * chunk_flops,
            extra_layers * layer_bytes + extra_chunks * chunk_bytes)

  def offloads(self, variant: Hashable) -> bool:
    return isinstance(variant, ModelVariant) and variant.remat == "offload"

  def nothing_fits_message(self, considered: Sequence[Considered], skipped: Sequence[Skipped],
                           budget_bytes: float) -> str:
    on_mesh = self.devices > 1
    where = f" on {self.devices} devices" if on_mesh else ""
    if not considered:
      least = min(skipped, key=lambda s: s.replicated_bytes)
      return (f"nothing fits {budget_bytes / 1e9:.3g} GB for {self.preset}{where}: every stage "
              f"keeps more whole on each device, the least {least.describe()} "
              f"({least.replicated_bytes / 1e9:.3g} GB). Raise the budget or add "
              "shard_states='fsdp'.")
    smallest = min(considered, key=lambda r: r.measurement.device_bytes)
    return (f"nothing fits {budget_bytes / 1e9:.3g} GB for {self.preset} at batch "
            f"{self.batch_size}{where}: the smallest step measured is "
            f"{smallest.candidate.describe(on_mesh=on_mesh)} at "
            f"{smallest.measurement.device_bytes / 1e9:.3g} GB. Raise the budget or the "
            "batch's divisibility (a larger N), or shorten the sequences.")

  def _run(self, settings: PlanSettings) -> harness.TrainConfig:
    return train_config(self.preset, settings, batch_size=self.batch_size, seq_len=self.seq_len)


def plan(
    preset: str,
    budget_bytes: float,
    *,
    batch_size: int,
    seq_len: int | None = None,
    devices: int = 1,
    machine: Machine | None = None,
    activation_settings: Sequence[tuple[str, int | None]] | None = None,
    moment_storages: Sequence[str] | None = None,
    loss_chunks: Sequence[int] | None = None,
    shard_stages: Sequence[str | None] | None = None,
    progress: bool = False,
    target: optax_adama.memory.Target | None = None,
) -> Plan:
  """The fastest predicted AdamA step of `preset` that fits `budget_bytes`.

  `optax_adama.memory.plan` on the preset's model with its `PresetLevers`
  (the module docstring says what is searched and how time is predicted).

  Args:
    preset: a key of `models.PRESETS`.
    budget_bytes: memory budget of each device, bytes.
    batch_size: the mini-batch over all devices; N ranges over its divisors
      that leave every device whole rows of each micro-batch.
    seq_len: tokens per sequence (text models); None: the preset's context.
    devices: plan data parallel on a mesh of this many devices (one process
      needs as many devices: `device_mesh`).
    machine: the rates of the time predictor; None: `Machine()`'s.
    activation_settings: (remat, gelu_bits) pairs to consider, remat `RELEASE`
      for the release; None: `ACTIVATION_SETTINGS` on one device,
      `MESH_ACTIVATION_SETTINGS` on a mesh.
    moment_storages: moment storages to consider, most precise first; None:
      float32, bfloat16 and 8-bit.
    loss_chunks: LM-head loss chunk counts to consider, 1 first; None: (1,
      LOSS_CHUNKS) for a causal LM whose sequence length they divide, else (1,).
    shard_stages: ZeRO stages to consider; None: (None,) on one device, all
      four on a mesh.
    progress: print each compile to stderr.
    target: compile for this machine's devices with its own compiler (libtpu,
      XLA's GPU compiler; `optax_adama.memory.parse_target`), on a mesh of
      `devices` of them; None: this process's devices.

  Returns:
    The `optax_adama.memory.Plan`: its settings were compiled again and fit
    (`train_overrides(plan.settings)` are `models.train`'s fields; `table(plan)`).

  Raises:
    ValueError: if no candidate fits (the message gives the smallest measured),
      for a batch that gives some device no rows, or for a ZeRO stage on one
      device.
  """
  if devices < 1:
    raise ValueError(f"devices must be >= 1, got {devices}.")
  for stage in () if devices > 1 or shard_stages is None else shard_stages:
    if stage is not None:
      raise ValueError(f"shard_states {stage!r} is not a stage of {devices} device(s): use "
                       "(None,) (a ZeRO stage needs devices > 1).")
  if batch_size % devices:
    raise ValueError(f"batch_size={batch_size} does not give each of {devices} devices whole "
                     f"rows; pass a multiple of {devices}.")
  levers = PresetLevers(preset, batch_size=batch_size, seq_len=seq_len, devices=devices,
                        activation_settings=activation_settings, loss_chunks=loss_chunks)
  # The zoo's moments stay on the device (models.train has no such flag).
  if target is not None:
    # The target's compile-only devices: the library compiles each candidate
    # for their platform. One device is a mesh of one, with no ZeRO stage.
    mesh: jax.sharding.Mesh | None = optax_adama.memory.target_mesh(target, (devices,))
    shard_stages = (None,) if devices == 1 else shard_stages
  else:
    mesh = None if devices == 1 else device_mesh(devices)
  return optax_adama.memory.plan(
      levers, levers.params, levers.batch, budget_bytes=budget_bytes,
      mesh=mesh, machine=machine,
      moment_storages=moment_storages, offload=False, shard_stages=shard_stages,
      progress=progress)


def measure(preset: str, settings: PlanSettings, *, batch_size: int, seq_len: int | None,
            devices: int = 1) -> Measurement:
  """One setting's AdamA step compiled (compile only) and measured, as `plan` measures it.

  Args:
    preset: a key of `models.PRESETS`.
    settings: the setting to compile (`step_settings`).
    batch_size: the mini-batch (sequences or images); split into N micro-batches.
    seq_len: tokens per sequence (text models); None: the preset's context.
    devices: compiled data parallel on a mesh of this many (`device_mesh`)
      with the setting's ZeRO stage; memory and flops are one device's.

  Returns:
    Its `optax_adama.memory.Measurement`.
  """
  levers = PresetLevers(preset, batch_size=batch_size, seq_len=seq_len, devices=devices)
  mesh = None if devices == 1 else device_mesh(devices)
  return levers.measure(settings, levers.params, levers.batch, mesh=mesh)


def table(chosen: Plan) -> str:
  """Markdown: every candidate compiled, best predicted first; the choice marked.

  Memory is one device's; on a mesh in units of P/D, one device's share of
  the params. Stages skipped without compiling come last.
  """
  devices = 1 if chosen.mesh is None else chosen.mesh.size
  on_mesh = devices > 1
  unit, unit_name = chosen.measurement.param_bytes / devices, (
      f"P/{devices}" if on_mesh else "P")
  memory = "memory per device" if on_mesh else "device memory"
  lines = [f"| candidate | {memory} | host memory | predicted step | fits |",
           "|---|---|---|---|---|"]
  for row in sorted(chosen.considered, key=lambda r: (not r.fits, r.predicted_s)):
    mark = " **(chosen)**" if row.candidate == chosen.settings else ""
    m = row.measurement
    lines.append(
        f"| {row.candidate.describe(on_mesh=on_mesh)}{mark} | {m.device_bytes / 1e9:.4g} GB "
        f"({m.device_bytes / unit:.2f} {unit_name}) | {m.host_bytes / 1e9:.4g} GB "
        f"| {row.predicted_s * 1e3:.4g} ms | {'yes' if row.fits else 'no'}"
        f"{'' if row.measurable else ' (offload not measurable here)'} |")
  for skipped in chosen.skipped:
    lines.append(f"| {skipped.describe()} | {skipped.replicated_bytes / 1e9:.4g} GB "
                 f"({skipped.replicated_bytes / unit:.2f} {unit_name}) whole, over the "
                 f"{chosen.budget_bytes / 1e9:.4g} GB budget | - | - | no: skipped, not "
                 "compiled |")
  return "\n".join(lines)


def considered_dict(row: Considered) -> dict[str, Any]:
  """A compiled candidate as the plans' JSON holds it: its settings as flags."""
  return {"candidate": flags_of(row.candidate), "measurement": dataclasses.asdict(row.measurement),
          "predicted_s": row.predicted_s, "fits": row.fits, "measurable": row.measurable}


def plan_dict(chosen: Plan, *, preset: str, batch_size: int,
              seq_len: int | None) -> dict[str, Any]:
  """The plan as `python -m models.plan --json` writes it."""
  return {"preset": preset, "budget_bytes": chosen.budget_bytes, "batch_size": batch_size,
          "seq_len": seq_len, "choice": flags_of(chosen.settings),
          "verified": dataclasses.asdict(chosen.measurement), "predicted_s": chosen.predicted_s,
          "considered": [considered_dict(row) for row in chosen.considered],
          "devices": 1 if chosen.mesh is None else chosen.mesh.size,
          "skipped": [dataclasses.asdict(skipped) for skipped in chosen.skipped]}


@functools.cache
def _layer_cost(preset: str, remat: str, gelu_bits: int | None, micro_batch_size: int,
                seq_len: int | None) -> tuple[float, float]:
  """(flops, bytes) of one block's forward and backward under `remat`, compiled alone."""
  config = models.get_config(preset, remat="none", gelu_bits=gelu_bits, scan_layers=True)
  staged, params = models.staged_loss(models.create_abstract(config))
  micro_batch = harness.abstract_batch(config, micro_batch_size, seq_len)
  return optax_adama.memory.ModelLevers.block_cost(staged, params, micro_batch,
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

  def loss_and_grads(features: Any, table: Any, labels: Any) -> Any:
    loss = lambda f, t: savers.chunked_cross_entropy(f, t, labels, num_chunks=num_chunks)[0]
    return jax.value_and_grad(loss, argnums=(0, 1))(features, table)

  return optax_adama.memory.ModelLevers.compiled_cost(loss_and_grads, features, table, labels)
