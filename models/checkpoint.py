"""Checkpoints of a training run: save, resume exactly, survive torn and corrupt ones.

A run's checkpoint is its params and optimizer state (any form AdamA keeps:
float32, bfloat16, 8-bit codes with their scales, low-rank projectors, host-
offloaded or sharded leaves; N and the estimator are static structure) plus a
small JSON record: the step, the run's configuration, the data position and
the losses so far. The data stream and every random draw are functions of the
seed and the step, so (state, step) is all a run needs to continue bitwise as
if it had never stopped.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a process killed mid-save leaves no step behind (orbax lists only
finished ones); a finished checkpoint whose files were damaged later fails to
restore, and :meth:`RunCheckpoints.restore_latest` then warns and takes the
one before. A checkpoint of another run (another model, N, estimator...) is
refused before anything is written.

Restoring onto other devices is orbax's: pass abstract state whose leaves carry
the new shardings (a mesh of another size, one device, host memory), and each
leaf is read straight into them.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import warnings
from collections.abc import Iterable
from typing import Any
from typing import NamedTuple
from typing import Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

# Bumped when the JSON record changes meaning; older checkpoints are refused.
FORMAT_VERSION = 1


class Restored(NamedTuple):
  """What a run resumes from: the step it reached, its state and its record."""

  step: int
  state: Any  # {"params": ..., "opt_state": ...}, placed like the abstract target.
  record: dict[str, Any]


def abstract_like(tree: Any) -> Any:
  """``tree`` as ``jax.ShapeDtypeStruct`` leaves that keep each leaf's sharding.

  The restore target: a leaf comes back with the shape, dtype and placement
  (devices, memory kind) of the state the resuming run built itself.
  """
  def leaf(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(leaf, tree)


def _leaf_name(path) -> str:
  """A leaf's tree path as a plain name (``opt_state.adama.mu.w``): orbax's key."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return ".".join(parts)


def _by_name(tree: Any) -> dict[str, Any]:
  """The leaves of ``tree`` that hold data, by name.

  Flat, so the files on disk name what they hold whatever containers the
  state is made of; empty leaves (a low-rank projector of a leaf that is not
  projected) are left out: orbax refuses to write zero-size arrays, and they
  hold nothing to restore.
  """
  named = {_leaf_name(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
           if math.prod(leaf.shape) > 0}
  if len(named) != sum(math.prod(x.shape) > 0 for x in jax.tree.leaves(tree)):
    raise ValueError("two state leaves share one name; the checkpoint would mix them.")
  return named


def _from_names(named: dict[str, Any], abstract: Any) -> Any:
  """``abstract``'s tree, its leaves from ``named`` (empty ones made anew)."""
  def leaf(path, target):
    if math.prod(target.shape) == 0:
      return jax.device_put(np.zeros(target.shape, target.dtype), target.sharding)
    return named[_leaf_name(path)]
  return jax.tree_util.tree_map_with_path(leaf, abstract)


def _structure_difference(saved: dict[str, tuple], wanted: dict[str, tuple]) -> str:
  missing = sorted(set(wanted) - set(saved))
  extra = sorted(set(saved) - set(wanted))
  changed = [f"{k}: checkpoint {saved[k][0]} {saved[k][1]}, this run {wanted[k][0]} {wanted[k][1]}"
             for k in sorted(set(saved) & set(wanted)) if saved[k] != wanted[k]]
  parts = ([f"not in the checkpoint: {', '.join(missing[:5])}"] if missing else []) + (
      [f"only in the checkpoint: {', '.join(extra[:5])}"] if extra else []) + changed[:5]
  return "; ".join(parts)


def _mismatches(saved: dict[str, Any], current: dict[str, Any],
                ignored: Iterable[str]) -> list[str]:
  keys = sorted((set(saved) | set(current)) - set(ignored))
  return [f"{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}"
          for k in keys if saved.get(k) != current.get(k)]


@dataclasses.dataclass
class RunCheckpoints:
  """The checkpoints of one run in ``directory``: the newest ``keep`` are kept.

  Args:
    directory: where the checkpoints live (created if missing).
    identity: what makes two runs the same run (e.g. the training
      configuration as a dict): a checkpoint whose identity differs is
      refused, naming each differing field.
    keep: how many of the newest checkpoints to keep.
    asynchronous: write in a background thread, so the step loop does not
      wait for the disk (it waits only for the device-to-host copy).
    ignored: identity fields that may differ on resume (e.g. how many
      held-out batches are scored).
  """

  directory: pathlib.Path
  identity: dict[str, Any]
  keep: int = 3
  asynchronous: bool = True
  ignored: tuple[str, ...] = ()

  def __post_init__(self):
    if self.keep < 1:
      raise ValueError(f"keep must be >= 1, got {self.keep}.")
    self.directory = pathlib.Path(self.directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, enable_async_checkpointing=self.asynchronous,
            create=True),
        # Handlers named up front, so a new process can read a checkpoint's
        # metadata (leaf shapes) before it restores anything.
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "record": ocp.JsonCheckpointHandler()})

  def steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
    """Saves ``state`` and ``record`` as checkpoint ``step`` (in the background)."""
    record = {**record, "step": step, "identity": self.identity,
              "format": FORMAT_VERSION}
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_by_name(state)), record=ocp.args.JsonSave(record)),
        force=True)

  def wait(self) -> None:
    """Blocks until every save started has been written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def check_identity(self) -> None:
    """Raises ``ValueError`` if the newest checkpoint belongs to another run.

    Only the record (a small JSON file) is read, so this is cheap; it runs
    before the resuming run writes anything.
    """
    for step in reversed(self.steps()):
      record = self._read_record(step)
      if record is None:
        continue
      if record.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{self.directory} holds checkpoints of format {record.get('format')!r}, "
            f"this version reads format {FORMAT_VERSION}; start a new directory.")
      diff = _mismatches(record.get("identity", {}), self.identity, self.ignored)
      if diff:
        raise ValueError(
            f"{self.directory} holds checkpoints of another run; nothing was "
            f"overwritten. Differing: {'; '.join(diff)}. Use a new --checkpoint-dir "
            "or the checkpoint's settings.")
      return

  def restore_latest(self, abstract_state: Any) -> Optional[Restored]:
    """The newest checkpoint that restores, placed like ``abstract_state``.

    A checkpoint that fails to read (a file truncated or damaged on disk) is
    moved aside (renamed ``<step>.damaged``, so a later save of that step is
    not skipped or shadowed) with a warning, and the one before it is tried.
    ``None`` only where there is no checkpoint at all.

    Raises:
      ValueError: if the checkpoints belong to another run (see
        :meth:`check_identity`), or hold a state of another structure (leaf
        names, shapes or dtypes: the model code changed); nothing is written.
      RuntimeError: if checkpoints exist but none restores.
    """
    self.check_identity()
    steps = self.steps()
    wanted = {name: (tuple(x.shape), np.dtype(x.dtype))
              for name, x in _by_name(abstract_state).items()}
    for step in reversed(steps):
      saved = self._saved_leaves(step)
      if saved is not None and saved != wanted:
        raise ValueError(
            f"{self.directory / str(step)} holds a state of another structure; nothing "
            f"was overwritten. {_structure_difference(saved, wanted)}")
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_by_name(abstract_state)),
            record=ocp.args.JsonRestore()))
        state = _from_names(restored.state, abstract_state)
      except Exception as error:  # orbax raises many types for a damaged file.
        damaged = self._move_aside(step)
        warnings.warn(
            f"checkpoint {self.directory / str(step)} does not restore "
            f"({type(error).__name__}: {str(error)[:200]}); moved to {damaged.name}, "
            "trying an older one.", RuntimeWarning, stacklevel=2)
        continue
      return Restored(step, state, dict(restored.record))
    if steps:
      raise RuntimeError(
          f"none of the checkpoints in {self.directory} restores (each was moved aside "
          "as <step>.damaged); start a new directory, or restore one by hand.")
    return None

  def _saved_leaves(self, step: int) -> Optional[dict[str, tuple]]:
    """Name -> (shape, dtype) of checkpoint ``step``'s state; ``None`` if unreadable."""
    try:
      metadata = self._manager.item_metadata(step)["state"]
      return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in metadata.items()}
    except Exception:  # unreadable metadata: the restore below fails and says why.
      return None

  def _move_aside(self, step: int) -> pathlib.Path:
    damaged = self.directory / f"{step}.damaged"
    suffix = 0
    while damaged.exists():
      suffix += 1
      damaged = self.directory / f"{step}.damaged{suffix}"
    (self.directory / str(step)).rename(damaged)
    self._manager.reload()
    return damaged

  def _read_record(self, step: int) -> Optional[dict[str, Any]]:
    try:
      return dict(self._manager.restore(
          step, args=ocp.args.Composite(record=ocp.args.JsonRestore())).record)
    except Exception:  # a damaged record: restore_latest warns and skips it.
      return None
