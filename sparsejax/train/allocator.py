"""The memory allocator a command runs with: large temporaries reused, not faulted in anew at every step.

XLA's CPU runtime allocates a program's temporaries with ``malloc`` at each call and frees them after it. glibc
serves an allocation above 32 MiB from a fresh ``mmap`` and unmaps it when freed (a pool thread's arena cannot hold
it, whatever ``mallopt`` says), so each call of a program with large temporaries (the dense output layer's
``[B, N]`` logits, an evaluation's scores, a checkpoint's host copies) faults every page in again and the kernel
zeroes it. On 2 cores that was 16-27% of the quick start's CPU time in the kernel (issue 48: 6.3 million page
faults in one quick start). tcmalloc keeps freed memory for reuse (0.9 million faults, kernel time 8%); where it
is not installed, glibc is asked to back its allocations with transparent huge pages (512 times fewer faults).
Figures: benchmarks/RESULTS.md, "The allocator".

Both are chosen before the process starts (the dynamic loader reads ``LD_PRELOAD``, glibc ``GLIBC_TUNABLES``), so a
command that is not running with them yet runs itself again, in the same process (``exec``): same PID, same
arguments and standard streams. ``SPARSEJAX_ALLOCATOR=system`` keeps the process as it started.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping

ENV = "SPARSEJAX_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "system")
# Set in the environment of the command run again: it is never run a third time, and its children (the ranks of
# sparsejax-launch) inherit the allocator without running themselves again.
_APPLIED = "SPARSEJAX_ALLOCATOR_APPLIED"
_TCMALLOC_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")
_HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def find_tcmalloc() -> str | None:
  """The installed tcmalloc's library name for ``LD_PRELOAD`` (e.g. ``libtcmalloc_minimal.so.4``), or None."""
  for name in _TCMALLOC_LIBRARIES:
    found = ctypes.util.find_library(name)
    if found:
      return found
  return None


def environment(environ: Mapping[str, str], tcmalloc: str | None) -> dict[str, str] | None:
  """The environment to run the command again with, or None where it runs as it is.

  Args:
    environ: the process's environment.
    tcmalloc: :func:`find_tcmalloc`'s answer.

  Raises:
    ValueError: ``SPARSEJAX_ALLOCATOR`` is not one of :data:`CHOICES`, or is ``tcmalloc`` where none is installed.
  """
  choice = environ.get(ENV, "auto").strip() or "auto"
  if choice not in CHOICES:
    raise ValueError(f"{ENV}={choice!r}: must be one of {', '.join(CHOICES)}")
  if choice == "tcmalloc" and tcmalloc is None:
    raise ValueError(f"{ENV}=tcmalloc: no tcmalloc library found (Debian and Ubuntu: apt-get install "
                     "libtcmalloc-minimal4)")
  if choice == "system" or environ.get(_APPLIED):
    return None
  preload = environ.get("LD_PRELOAD", "")
  if any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc")):
    return None  # the user's own allocator
  new = dict(environ, **{_APPLIED: "1"})
  if tcmalloc is not None:
    new["LD_PRELOAD"] = f"{tcmalloc} {preload}".strip()
  else:
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
      return None
    new["GLIBC_TUNABLES"] = f"{tunables}:{_HUGE_PAGE_TUNABLE}" if tunables else _HUGE_PAGE_TUNABLE
  return new


def adopt() -> None:
  """Runs the command again with the better allocator where it is not running with one yet (else returns).

  Call it first thing in a command's ``main``, before threads start: ``exec`` replaces the process.
  """
  if not sys.platform.startswith("linux"):
    return
  try:
    new = environment(os.environ, find_tcmalloc())
  except ValueError as e:
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {e}\n")
    sys.exit(2)
  if new is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], new)
