"""What :func:`optax_adama.memory.plan` says when nothing fits the budget.

The smallest step compiled is taken apart (params, optimizer state, the batch,
one micro-batch's gradient and activations) and each lever the search did not
already pull is priced on this model: the bytes it would take off that step.
The levers are named in that order, biggest first, so the advice never points
at one that is spent (a larger N at one row per micro-batch) or cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Optional

# The device count a lever that needs more devices is priced at when the plan
# ran on one device: a TPU v3-8 / one 8-GPU host.
_PRICED_DEVICES = 8


class Breakdown(NamedTuple):
  """One device's bytes of the smallest step compiled, by what holds them."""

  total: int
  params: int
  state: int
  batch: int
  largest_param: int  # one layer's gradient: what the release keeps alive

  @property
  def gradient(self) -> int:
    """One micro-batch's gradient, at most the params' size (AdamA folds it leaf by
    leaf, but XLA may keep every leaf until the last fold)."""
    return min(self.params, max(self.total - self.params - self.state - self.batch, 0))

  @property
  def activations(self) -> int:
    """What is left: one micro-batch's activations and XLA's temporaries."""
    return max(self.total - self.params - self.state - self.batch - self.gradient, 0)


def levers_left(settings: Any, parts: Breakdown, *, splits: list[int],
                state_bytes_with: Callable[[str], int], staged: bool,
                devices: int, stage: Optional[str], offload_counts: bool
                ) -> list[tuple[str, int]]:
  """(lever, bytes it would save) for every lever not pulled, biggest first.

  Args:
    settings: the smallest step's ``PlanSettings``.
    parts: that step's bytes, taken apart.
    splits: the N the batch allows.
    state_bytes_with: one device's optimizer-state bytes with other moments
      (a storage name), the rest of ``settings`` as it is.
    staged: whether the loss is a ``StagedLoss`` (the release was searched).
    devices: the mesh's devices (1 without one).
    stage: the smallest step's ZeRO stage.
    offload_counts: whether this backend counts host memory apart.
  """
  levers: list[tuple[str, int]] = []
  if settings.moments != "8bit":
    levers.append(("8-bit moments (moment_storages including '8bit')",
                   parts.state - state_bytes_with("8bit")))
  if not settings.offload_moments:
    where = "" if offload_counts else " on a GPU or TPU (the CPU backend does not count it apart)"
    levers.append((f"moments in host memory (offload=True){where}", parts.state))
  if devices == 1:
    kept = 1 / _PRICED_DEVICES
    levers.append((
        f"a mesh of {_PRICED_DEVICES} devices with shard_states='fsdp' (mesh=): each keeps "
        f"1/{_PRICED_DEVICES} of params, moments and gradient",
        int((parts.params + parts.state + parts.gradient) * (1 - kept))))
  elif stage != "fsdp":
    kept_params = parts.params / devices
    levers.append((f"shard_states='fsdp' on this mesh (the params split {devices} ways too)",
                   int(parts.params - kept_params)))
  if not staged and not settings.release:
    levers.append(("the gradient release (a StagedLoss through release_step: one layer's "
                   "gradient alive, not the whole model's)",
                   max(parts.gradient - parts.largest_param, 0)))
  num_micro_batches, largest_n = settings.num_micro_batches, max(splits)
  if num_micro_batches < largest_n:
    levers.append((f"a larger N (up to {largest_n}: fewer rows per micro-batch)",
                   int(parts.activations * (1 - num_micro_batches / largest_n))))
  levers.append(("remat (jax.checkpoint) inside the model", parts.activations // 2))
  levers.append(("bfloat16 params (optax_adama.contrib.round_params_stochastically)",
                 parts.params // 2))
  ranked = sorted((lever for lever in levers if lever[1] > 0), key=lambda lever: -lever[1])
  return ranked


def nothing_fits_message(budget: str, described: str, parts: Breakdown,
                         levers: list[tuple[str, int]]) -> str:
  """The error of a plan where nothing fits: the smallest step, its parts, the levers."""
  listed = (f"params {parts.params:,} B, optimizer state {parts.state:,} B, "
            f"the batch {parts.batch:,} B, one micro-batch's gradient about "
            f"{parts.gradient:,} B and its activations {parts.activations:,} B")
  priced = "; ".join(f"{name}: -{saved / 1e6:.3g} MB" for name, saved in levers)
  return (f"nothing fits {budget}: the smallest step compiled, {described}, takes "
          f"{parts.total:,} B ({parts.total / 1e9:.3g} GB): {listed}. Levers left, by what "
          f"each would save on this model (estimates): {priced or 'none'}; or a smaller "
          "model, fewer rows or shorter sequences.")
