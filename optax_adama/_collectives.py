"""The bytes a compiled step moves in collectives, read from its HLO.

A compiled program's collectives sit in loops (the scan over micro-batches,
the scan over layers), so counting the instructions of its text undercounts:
each is weighted here by the trip counts of the loops around it, which XLA
records on every ``while`` it can count (``known_trip_count``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

__all__ = ["CollectiveBytes", "collective_bytes"]

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(
    r"= (.+?) (" + "|".join(_KINDS) + r")(?:-start)?\((.*)$")
_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(?:body|to_apply|calls|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ITEMSIZE = {"pred": 1, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
  """Bytes moved by one call of a compiled program, per collective kind.

  Each collective counts the bytes of the whole array it makes or takes
  apart, once per execution: an all-gather its gathered result, a
  reduce-scatter its input before the scatter, an all-reduce its array.
  ``uncounted_loops``: loops whose trip count XLA did not record (counted
  once; a result with any is a lower bound). :func:`collective_bytes`'s
  example shows one.
  """

  by_kind: dict[str, int]
  uncounted_loops: int

  @property
  def total(self) -> int:
    return sum(self.by_kind.values())


def _array_bytes(text: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(text):
    itemsize = _ITEMSIZE.get(dtype) or int(dtype[1:]) // 8 * (2 if dtype[0] == "c" else 1)
    sizes.append(math.prod(int(d) for d in dims.split(",") if d) * itemsize)
  return sizes


def _group_size(line: str) -> int:
  """Devices in each replica group: ``{{0,1,2,3}}`` or the iota ``[1,4]<=[4]``."""
  listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if listed:
    return len(listed.group(1).split(","))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  return int(iota.group(2)) if iota else 1


def _instruction_bytes(kind: str, result: str, line: str) -> int:
  nbytes = sum(_array_bytes(result))
  # The compiled text names operands without their shapes: a reduce-scatter's
  # input is its result times the group.
  return nbytes * _group_size(line) if kind == "reduce-scatter" else nbytes


def collective_bytes(compiled: Any) -> CollectiveBytes:
  """The collective bytes of one call of ``compiled`` (a ``jax.stages.Compiled``).

  Args:
    compiled: ``jax.jit(f).lower(...).compile()``, or its HLO text.

  Returns:
    A :class:`CollectiveBytes`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_adama
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> optax_adama.memory.collective_bytes(compiled)  # one device: none
    CollectiveBytes(by_kind={}, uncounted_loops=0)
  """
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
  calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  uncounted = 0
  entry, current = None, None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header and "=" not in line.split("{")[0].split("(")[0]:
      current = header.group(1)
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    match = _INSTRUCTION.search(line)
    if match and "-done(" not in line:
      result, kind, _ = match.groups()
      own[current][kind] += _instruction_bytes(kind, result, line)
    times = 1
    if " while(" in line:
      trip = _TRIP_COUNT.search(line)
      if trip is None:
        uncounted += 1
      else:
        times = int(trip.group(1))
    for callee in _CALLS.findall(line):
      calls[current].append((callee, times))
    for branches in _BRANCHES.findall(line):
      for callee in branches.split(","):
        calls[current].append((callee.strip().lstrip("%"), 1))
  memo: dict[str, collections.Counter] = {}

  def total(name: str) -> collections.Counter:
    if name not in memo:
      memo[name] = collections.Counter()  # cycles cannot occur; guards recursion
      counts: collections.Counter[str] = collections.Counter(own[name])
      for callee, times in calls[name]:
        for kind, nbytes in total(callee).items():
          counts[kind] += times * nbytes
      memo[name] = counts
    return memo[name]

  by_kind = dict(total(entry)) if entry else {}
  return CollectiveBytes({k: int(v) for k, v in by_kind.items() if v}, uncounted)
