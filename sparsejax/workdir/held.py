"""Checkpoints held in this process's memory instead of written: a recipe search's candidates between their rounds.

A search trains each candidate in several calls (its measured steps, then each round), each ending with a checkpoint
that the candidate's next call resumes from, and most candidates are eliminated with their checkpoints unread. On the
quick start those checkpoints were most of the 4.4 GB it wrote, and writing them most of its system time (2026-12-07,
a 2-core AMD EPYC VM: issue 48). Within :func:`sparsejax.workdir.checkpoint.held_in_memory`, a checkpoint saved in a
directory under the block's root is kept here (at most :func:`limit_bytes` in all; a larger one is written), and the
next run in that directory resumes from it as from the disk. The block writes those still held when it ends (the
winner, or every candidate left where a signal or an error ends the search), so that a stopped search continues; a
process killed outright loses them, and a continued search trains those candidates again from their last written
checkpoint or from the start.

One process only (a search runs in one): the registry is this process's.
"""

import os
from typing import Any, NamedTuple

import jax

from sparsejax import memory

# The most that the held checkpoints may take in all (and at most an eighth of the machine's memory): the quick
# start's three candidates hold 1.2 GB. A quarter of memory, up to 8 GiB, held a 200K-label search's candidates
# (their rounds 40 s instead of 77), but faster rounds let labels_heavy's search run its second round: 1,500 fewer
# final steps, test P@1 0.9746 against 0.9766 (2026-12-07, 2-core Zen 3 VM, HISTORY.md): not kept.
HELD_BYTES = 2 << 30


class Held(NamedTuple):
  """A checkpoint held in memory: what :meth:`sparsejax.workdir.checkpoint.Checkpoints.save` would have written."""
  step: int
  state: Any  # the training state's arrays, not referenced by a training any more (a copy, or its last state)
  data: dict  # the data position and selection record, as JSON would give them back
  meta: dict
  keep: int | None  # the directory's newest checkpoints kept, for its write
  nbytes: int


_roots: list[str] = []
_held: dict[str, Held] = {}


def add_root(root: str) -> None:
  _roots.append(os.path.abspath(root))


def remove_root(root: str) -> None:
  _roots.remove(os.path.abspath(root))


def holds(directory: str) -> bool:
  """Whether checkpoints saved in ``directory`` are held (it is under a root, in a process of one)."""
  directory = os.path.abspath(directory)
  return jax.process_count() == 1 and any(directory.startswith(root + os.sep) for root in _roots)


def limit_bytes() -> int:
  return memory.share_of_memory(HELD_BYTES)


def fits(directory: str, nbytes: int) -> bool:
  """Whether a checkpoint of ``nbytes`` in ``directory`` may be held (in place of the one held there, if any)."""
  others = sum(entry.nbytes for name, entry in _held.items() if name != directory)
  return others + nbytes <= limit_bytes()


def spent(entry: Held) -> bool:
  """Whether a held checkpoint's arrays were donated to a training's step (restored and trained on: gone)."""
  return any(a.is_deleted() for a in jax.tree.leaves(entry.state) if isinstance(a, jax.Array))


def get(directory: str) -> Held | None:
  return _held.get(directory)


def put(directory: str, entry: Held) -> None:
  _held[directory] = entry


def pop(directory: str) -> Held | None:
  return _held.pop(directory, None)


def under(root: str) -> list[str]:
  """The directories under ``root`` that hold a checkpoint here."""
  root = os.path.abspath(root)
  return [name for name in _held if name.startswith(root + os.sep)]


def drop(root: str) -> None:
  """Forgets the checkpoints held under ``root`` (its states removed: an eliminated candidate)."""
  for name in under(root):
    del _held[name]
