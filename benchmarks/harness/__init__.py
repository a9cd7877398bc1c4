"""The benchmarks' shared harness: argument conventions, timing, the machine a figure was measured on, JSON output.

Every ``benchmarks/*.py`` is a script run as ``python benchmarks/NAME.py``: Python puts ``benchmarks/`` first on
``sys.path``, so a script imports this package as ``import harness`` (no benchmark imports another). What several
benchmarks need beyond these concerns lives in this package too (``harness.finished_runs``: the runs of
``benchmarks/accuracy.py`` that others restore).

Conventions:

* ``parser(__doc__)``: the script's docstring is its ``--help``; ``--json PATH`` (:func:`add_json_flag`) writes
  its results, through :func:`write_json`, which records :func:`machine` beside them.
* Timing: :func:`time_calls` (per-call milliseconds, one figure per repeat) with :func:`timing_summary`, or
  :func:`median_seconds` of single calls; both wait for JAX's outputs.
"""

import argparse
import datetime
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def portable_path(value: str) -> str:
  """An absolute path as a result file keeps it: relative to the repository where it lies in it, else with the
  system's temporary directory as ``$TMPDIR`` and the home directory as ``~`` (the machine's own prefixes);
  anything else unchanged."""
  import tempfile

  if not os.path.isabs(value):
    return value
  path = os.path.normpath(value)
  for root, name in ((REPOSITORY, None), (tempfile.gettempdir(), "$TMPDIR"), (os.path.expanduser("~"), "~")):
    root = os.path.normpath(root)
    if root != os.sep and (path == root or path.startswith(root + os.sep)):
      rest = os.path.relpath(path, root)
      return rest if name is None else os.path.join(name, rest) if rest != "." else name
  return value


def local_paths(result):
  """The inverse of :func:`portable` for this machine: ``$TMPDIR/...`` and ``~/...`` strings expanded (a result
  read back to find the run directories it names)."""
  import tempfile

  if isinstance(result, dict):
    return {key: local_paths(value) for key, value in result.items()}
  if isinstance(result, list):
    return [local_paths(value) for value in result]
  if isinstance(result, str) and (result == "$TMPDIR" or result.startswith("$TMPDIR" + os.sep)):
    return tempfile.gettempdir() + result[len("$TMPDIR"):]
  if isinstance(result, str) and (result == "~" or result.startswith("~" + os.sep)):
    return os.path.expanduser(result)
  return result


def portable(result):
  """``result`` with every string that is an absolute path made :func:`portable_path` (dicts and lists walked)."""
  if isinstance(result, dict):
    return {key: portable(value) for key, value in result.items()}
  if isinstance(result, (list, tuple)):
    return [portable(value) for value in result]
  return portable_path(result) if isinstance(result, str) else result


def parser(doc: str) -> argparse.ArgumentParser:
  """A benchmark's argument parser: ``doc`` (its module docstring, with the commands to run it) as ``--help``."""
  return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_json_flag(parser: argparse.ArgumentParser, help: str = "write the results here (with the machine)") -> None:
  """``--json PATH``: where :func:`write_json` puts the results (none by default)."""
  parser.add_argument("--json", default=None, metavar="PATH", help=help)


# The output layer the kernel micro-benchmarks time by default: GCIDE cloze's (N = 20,912, B = 128, k = 1024, d = 128).
SHAPE_FLAGS = {
    "num_labels": (int, 20_912, "N, the output rows"),
    "batch_size": (int, 128, "B, samples per batch"),
    "active_k": (int, 1024, "k, active outputs per sample"),
    "dim": (int, 128, "d, the width of an output row"),
    "zipf": (float, 0.6, "id frequency ~ 1 / rank^zipf; 0: uniform"),
}


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
  """``--coordinator_address``, ``--num_processes``, ``--process_id``: set by ``sparsejax.distributed.launch`` for a
  benchmark run under it (none: one process)."""
  for name in ("coordinator_address", "num_processes", "process_id"):
    parser.add_argument(f"--{name}", type=int if name != "coordinator_address" else str, help="set by the launcher")


def add_shape_flags(parser: argparse.ArgumentParser, *names: str, **defaults) -> None:
  """The named flags of :data:`SHAPE_FLAGS` (``--num_labels``, ``--dim``, ...), with ``defaults`` replacing theirs."""
  for name in names:
    kind, default, help = SHAPE_FLAGS[name]
    parser.add_argument(f"--{name}", type=kind, default=defaults.get(name, default), help=help)


def usable_cores() -> int:
  """Cores this process may run on (taskset's mask), else the machine's."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


@functools.cache
def sparsejax_commit() -> str | None:
  """The git commit of the sparsejax sources imported (``+dirty`` with uncommitted changes), else None."""
  import sparsejax

  source = os.path.dirname(os.path.abspath(sparsejax.__file__))
  try:
    commit = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], capture_output=True, text=True,
                            timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", source, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None  # an installed wheel: its version says which
  return commit + ("+dirty" if dirty else "")


def machine(**extra) -> dict:
  """What a result was measured on and with, as every benchmark's JSON records it under ``"machine"``.

  Args:
    **extra: further entries (e.g. ``device=`` the accelerator a run used).

  Returns:
    ``platform``, ``node`` (host name), ``cpu`` (model), ``cpus`` (the machine's), ``usable_cores`` (this
    process's), ``load_average`` (1, 5, 15 min, at the time of writing), ``python``, ``jax``, ``sparsejax``
    (version) and ``sparsejax_commit``, ``date`` (UTC, ISO 8601) and ``device`` (JAX's first device, e.g. an
    H100 for a benchmark that ran on its GPU; "cpu" otherwise), then ``extra``.
  """
  import jax

  import sparsejax

  extra.setdefault("device", jax.devices()[0].device_kind)
  return {"platform": platform.platform(), "node": platform.node(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
          "usable_cores": usable_cores(),
          "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
          "python": sys.version.split()[0], "jax": jax.__version__, "sparsejax": sparsejax.__version__,
          "sparsejax_commit": sparsejax_commit(),
          "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **extra}


def write_json(path: str | None, result: dict, *, indent: int = 1, record_machine: bool = True) -> None:
  """Writes ``result`` to ``path`` (nothing if None), with :func:`machine` under ``"machine"`` unless it has one
  or ``record_machine`` is False (a summary of results measured elsewhere, each with its own).

  Folders are made as needed; numpy scalars are written as floats; absolute paths are written as
  :func:`portable_path` gives them (relative to the repository, ``$TMPDIR/...``, ``~/...``).
  """
  if path is None:
    return
  if record_machine and "machine" not in result:
    result = {**result, "machine": machine()}
  result = portable(result)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=indent, default=float)


def time_calls(call, iters: int, repeats: int, warmup: int = 1) -> list[float]:
  """Milliseconds per ``call()`` (which returns what to wait for), one figure per repeat of ``iters`` calls,
  after ``warmup`` calls."""
  import jax

  for _ in range(warmup):
    out = call()
  jax.block_until_ready(out)
  ms = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = call()
    jax.block_until_ready(out)
    ms.append((time.perf_counter() - start) / iters * 1e3)
  return ms


def timing_summary(ms: list[float]) -> dict:
  """``min_ms``, ``median_ms`` and every figure ``ms`` of :func:`time_calls`, as the benchmarks' JSON holds them."""
  return dict(min_ms=min(ms), median_ms=float(np.median(ms)), ms=ms)


def median_seconds(fn, *args, repeats: int = 10, warmup: int = 2) -> float:
  """Median wall time of ``fn(*args)`` in seconds, one call per figure (outputs waited for)."""
  ms = time_calls(functools.partial(fn, *args), 1, repeats, warmup=warmup)
  return float(np.median(ms)) / 1e3


def checksum(*arrays) -> str:
  """16 hex digits of the SHA-256 of the arrays' bytes, in turn: equal outputs of two builds, equal checksums."""
  digest = hashlib.sha256()
  for a in arrays:
    digest.update(np.asarray(a).tobytes())
  return digest.hexdigest()[:16]


def draw_ids(rng: np.random.Generator, num_labels: int, batch_size: int, active_k: int, zipf: float) -> np.ndarray:
  """``[batch_size, active_k]`` int32 ids, distinct within a sample, drawn with probability ~ 1 / rank^zipf
  (the rows of frequent labels repeat across samples), or uniformly for ``zipf`` = 0."""
  p = None
  if zipf > 0:
    p = 1.0 / np.arange(1, num_labels + 1) ** zipf
    p /= p.sum()
  return np.stack([rng.choice(num_labels, active_k, replace=False, p=p) for _ in range(batch_size)]).astype(np.int32)
