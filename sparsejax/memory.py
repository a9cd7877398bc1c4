"""Huge-page backing for large, long-lived arrays (Linux; a no-op elsewhere).

A sparse step touches ~10^5 random rows of multi-GB arrays (weights, Adam
moments). With 4 KiB pages nearly every row access misses the TLB; backing
these arrays with 2 MiB pages removes most of those misses. Buffers updated in
place (donated) keep their backing across steps, so this is done once, after
init or restore. Contents are never changed.

The advice is only that (``MADV_HUGEPAGE``: the kernel's khugepaged backs the
range when it gets to it); it no longer collapses the range at once
(``MADV_COLLAPSE``), which copied every page in the calling thread: 0.74 s of
system time per 388 MB on an AMD EPYC VM, paid again at each restore (a
search candidate's every round), for no step time measurable at 10^5 or 10^6
labels (2026-12-07, `benchmarks/results/HISTORY.md`).
"""

import contextlib
import ctypes
import ctypes.util
import os
import sys

_MADV_HUGEPAGE = 14
_HUGE = 1 << 21

_libc = None


def _madvise():
  global _libc
  if _libc is None:
    _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise.restype = ctypes.c_int
  return _libc.madvise


def machine_memory_bytes() -> int | None:
  """This machine's memory in bytes, or a container's limit where lower (cgroup v2 or v1); None if unknown."""
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):  # not a POSIX system that says
    return None
  for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(limit_file) as f:
        limit = f.read().strip()
    except OSError:
      continue
    if limit.isdigit():  # "max": no limit
      total = min(total, int(limit))
  return total


def _process_symbol(name: str):
  """A C function of this process (its allocator's), or None."""
  if not sys.platform.startswith("linux"):
    return None
  return getattr(ctypes.CDLL(None), name, None)


def release_free_memory() -> None:
  """Returns the memory the allocator holds freed to the system: tcmalloc's (``MallocExtension_ReleaseFreeMemory``,
  where the process runs with it, :mod:`sparsejax.train.allocator`), else glibc's (``malloc_trim``)."""
  release = _process_symbol("MallocExtension_ReleaseFreeMemory")
  if release is not None:
    release()
    return
  trim = _process_symbol("malloc_trim")
  if trim is not None:
    trim(0)


@contextlib.contextmanager
def freed_memory_returned():
  """Within it, what the process frees goes back to the system at once, and what the allocator held is returned
  on leaving.

  tcmalloc keeps what a program's temporaries freed, for the next one to reuse: that spares page faults at every
  step, but a stage's temporaries stay resident after it. At 8·10^6 labels over 4 processes the initialisation's
  (random weights, then the index's k-means: 3 GB each beside 1 GB of weights) stayed beside the state: 7.5 GB
  per process instead of 4.6, and the 24 GB machine killed a rank. For stages run once (initialisation,
  restoring a state), not steps: reused memory is what tcmalloc is for. (With glibc, whose large blocks go back
  when freed, only the trim on leaving.)
  """
  set_property = _process_symbol("MallocExtension_SetNumericProperty")
  name = b"tcmalloc.aggressive_memory_decommit"
  if set_property is not None:
    set_property.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    set_property(name, 1)
  try:
    yield
  finally:
    if set_property is not None:
      set_property(name, 0)
    release_free_memory()


def peak_resident_mb(reset: bool = True) -> float | None:
  """This process's peak resident memory (``VmHWM``) in MB since it started or since the last reset; None where
  Linux's ``/proc`` does not say. ``reset``: start counting anew from the memory resident now (``clear_refs``),
  so that the next reading is one stage's peak."""
  try:
    with open("/proc/self/status") as f:
      peak = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
    if reset:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
  except (OSError, ValueError):
    return None
  return None if peak is None else round(peak / 1024, 1)


def share_of_memory(cap_bytes: int) -> int:
  """What a process may keep in memory besides its state: ``cap_bytes``, at most an eighth of this machine's memory
  (0 where unknown)."""
  return min(cap_bytes, (machine_memory_bytes() or 0) // 8)


def advise_huge_pages(tree, min_bytes: int = 64 << 20) -> int:
  """Asks the kernel to back the large CPU arrays in ``tree`` with huge pages.

  Args:
    tree: a pytree of arrays (e.g. a training state).
    min_bytes: arrays smaller than this are left alone.

  Returns:
    Bytes advised (0 where unsupported).
  """
  import jax  # deferred: the config's validation imports this module (before JAX may start)

  if not sys.platform.startswith("linux"):
    return 0
  madvise = _madvise()
  done = 0
  for x in jax.tree.leaves(tree):
    if not isinstance(x, jax.Array) or x.nbytes < min_bytes or x.is_deleted():
      continue
    try:
      (shard,) = x.addressable_shards
      ptr = shard.data.unsafe_buffer_pointer()
    except Exception:  # not a single CPU buffer
      continue
    start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
    end = (ptr + x.nbytes) & ~(_HUGE - 1)
    if end <= start:
      continue
    if madvise(start, end - start, _MADV_HUGEPAGE) == 0:
      done += end - start
  return done
