"""absl's ``--flagfile``: the arguments a command line stands for, each with the file and line it came from.

absl reads a flagfile's lines (one flag each; ``#`` and ``//`` start comments) where its ``--flagfile`` stands,
nested flagfiles included. Its errors name a flag but not the file it came from, and tools that look for a flag
in a command line (``sparsejax-launch``'s ``--workdir``) must see the flags inside flagfiles too (:func:`flag_value`).
"""

import os
import re
from collections.abc import Iterator

_MAX_DEPTH = 8  # absl refuses deeper nesting itself


def expand(args: list[str], depth: int = 0) -> Iterator[tuple[tuple[str, int] | None, str]]:
  """Yields ``(origin, arg)`` for the arguments ``args`` stand for: origin ``None`` for one on the command line,
  ``(file, line)`` for one read from a flagfile (a file that cannot be read contributes nothing: absl names it)."""
  pending = iter(args)
  for arg in pending:
    path = None
    if re.match(r"^--?flagfile=", arg):
      path = arg.split("=", 1)[1]
    elif arg in ("--flagfile", "-flagfile"):
      path = next(pending, None)
    if path is None:
      yield None, arg
      continue
    if depth >= _MAX_DEPTH:
      continue
    try:
      with open(os.path.expanduser(path)) as f:
        lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
      continue
    for number, line in enumerate(lines, 1):
      line = line.strip()
      if not line or line.startswith(("#", "//")):
        continue
      for origin, inner in expand([line], depth + 1):
        yield origin or (path, number), inner


def undecodable(args: list[str], depth: int = 0) -> tuple[str, UnicodeDecodeError] | None:
  """The first flagfile that ``args`` name (nested ones included, in absl's order) that is not UTF-8 text, with the
  error decoding it; None if every one decodes."""
  pending = iter(args)
  for arg in pending:
    path = arg.split("=", 1)[1] if re.match(r"^--?flagfile=", arg) else (
        next(pending, None) if arg in ("--flagfile", "-flagfile") else None)
    if path is None or depth >= _MAX_DEPTH:
      continue
    try:
      with open(os.path.expanduser(path), "rb") as f:
        text = f.read().decode("utf-8")
    except OSError:
      continue
    except UnicodeDecodeError as e:
      return path, e
    for line in text.splitlines():
      line = line.strip()
      if line and not line.startswith(("#", "//")):
        found = undecodable([line], depth + 1)
        if found:
          return found
  return None


def flag_value(command: list[str], name: str) -> str | None:
  """The value of ``--name=V`` or ``--name V`` in ``command`` or its flagfiles (the last one wins, as in absl), else
  None."""
  value = None
  command = [arg for _, arg in expand(command)]
  for i, arg in enumerate(command):
    for prefix in (f"--{name}", f"-{name}"):
      if arg.startswith(prefix + "="):
        value = arg[len(prefix) + 1:]
      elif arg == prefix and i + 1 < len(command):
        value = command[i + 1]
  return value
