"""How the commands check a user's settings and refuse them: one line naming the flag.

`command_errors` turns a `ValueError` raised while a command checks its
settings into argparse's error (usage, then one line, status 2), with the
settings' Python names written as the command's flags (`as_flags`);
`check_counts` and `check_seq_len` are checks several commands and
`TrainConfig` share.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from collections.abc import Sequence

import models


@contextlib.contextmanager
def command_errors(parser: argparse.ArgumentParser,
                   *errors: type[Exception]) -> Iterator[None]:
  """Ends the command as argparse ends it on a user error: one line, exit 2.

  Wrap only what checks the user's settings (building configs, looking up a
  preset, a checkpoint's identity, the planner's search), not the run: a
  ``ValueError`` (or one of ``errors``) raised inside becomes
  ``parser.error(...)`` (``usage``, then ``prog: error: ...``, status 2),
  with the names of the parser's options in it written as their flags
  (:func:`as_flags`), so the line names the flag to change. Anything else,
  and anything raised outside, is a bug and keeps its traceback.
  """
  try:
    yield
  except (ValueError, *errors) as error:
    parser.error(as_flags(parser, str(error)))


def as_flags(parser: argparse.ArgumentParser, message: str) -> str:
  """``message`` with the parser's option names written as their flags.

  The library and ``TrainConfig`` name settings as Python does
  (``num_micro_batches=3``); the command line knows them as flags
  (``--num-micro-batches 3``). Every ``name=value`` of an option's ``dest``
  is rewritten (a switch's ``name=True`` to its flag, ``name=False`` to
  ``no FLAG``), and a bare ``dest`` with an underscore in it (no English word
  has one) to its flag.
  """
  actions = {a.dest: a for a in parser._actions if a.option_strings}
  for sub in parser._actions:
    if isinstance(sub, argparse._SubParsersAction):
      for child in sub.choices.values():
        actions.update({a.dest: a for a in child._actions
                        if a.option_strings and a.dest not in actions})

  def assignment(match: re.Match) -> str:
    action, value = actions[match[1]], match[3]
    flag = action.option_strings[-1]
    if isinstance(action.const, bool) and action.nargs == 0:  # a switch
      return flag if value == str(action.const) else f"no {flag}"
    return f"{flag} {value}"

  names = "|".join(sorted(map(re.escape, actions), key=len, reverse=True))
  if not names:
    return message
  message = re.sub(rf"\b({names})=(['\"]?)([^\s,;:)'\"]+)\2", assignment, message)
  return re.sub(rf"(?<![-\w])({names})\b(?!=)",
                lambda m: actions[m[1]].option_strings[-1] if "_" in m[1] else m[1], message)


def check_counts(**counts: int | Sequence[int] | None) -> None:
  """Raises ``ValueError`` naming the first count below 1 (None: not given)."""
  for name, values in counts.items():
    for value in values if isinstance(values, (list, tuple)) else [values]:
      if value is not None and value < 1:
        raise ValueError(f"{name}={value}: it must be 1 or more.")


def check_seq_len(preset: str, config: models.Config, seq_len: int | None, *,
                  name: str = "seq_len") -> None:
  """Raises ``ValueError`` if ``seq_len`` (the setting ``name``) is longer than
  the model's context."""
  max_len = getattr(config, "max_len", None)
  if seq_len is not None and max_len is not None and seq_len > max_len:
    raise ValueError(f"{name}={seq_len} is longer than {preset}'s max_len={max_len}; pass "
                     f"--{name.replace('_', '-')} {max_len} or less.")
