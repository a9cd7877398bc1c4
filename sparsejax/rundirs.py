"""Where a run goes without ``--workdir``: a new directory of its own under a per-user base.

``sparsejax-train`` without ``--workdir`` creates ``RUNS/<UTC start>-<dataset>`` (``20250614T153012Z-icd10``), where
``RUNS`` is ``$SPARSEJAX_RUNS``, else ``~/sparsejax/runs``. Every run gets its own, so a second experiment is never
refused as "trained with other settings", and continuing one names it: ``--workdir=THAT_DIR``. The names sort by
start time, so the newest run is the last one (:func:`newest_run_directory`).
"""

import json
import os
import re
import time

from sparsejax import flagfiles

RUNS_ENV = "SPARSEJAX_RUNS"
# Set by sparsejax-launch for its ranks when the command gives no --workdir: every rank must write to the same one.
LAUNCH_WORKDIR_ENV = "SPARSEJAX_LAUNCH_WORKDIR"
# Set by sparsejax-launch for its ranks: a file where it writes the signal it was stopped by (Ctrl-C: SIGINT) before
# passing the stop on to them as SIGTERM, so that they report the signal the user sent.
LAUNCH_STOP_FILE_ENV = "SPARSEJAX_LAUNCH_STOP_FILE"
_NAME = re.compile(r"^\d{8}T\d{6}Z-")


def runs_base() -> str:
  """The directory that new runs go under: ``$SPARSEJAX_RUNS``, else ``~/sparsejax/runs`` (absolute)."""
  return os.path.abspath(os.path.expanduser(os.environ.get(RUNS_ENV) or os.path.join("~", "sparsejax", "runs")))


def run_name(dataset: str, now: float | None = None) -> str:
  """``<UTC date and time>-<dataset>``, e.g. ``20250614T153012Z-icd10`` (ISO 8601 basic format: no colons)."""
  return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}-{dataset}"


def new_run_directory(dataset: str, base: str | None = None, now: float | None = None) -> str:
  """Creates and returns a new, empty run directory under ``base`` (default :func:`runs_base`).

  Two runs started in the same second get ``NAME`` and ``NAME-2``: the directory is created exclusively, so two
  processes never share one.

  Raises:
    OSError: the base cannot be created or written.
  """
  base = base or runs_base()
  os.makedirs(base, exist_ok=True)
  name = run_name(dataset, now)
  for count in range(1, 10_000):
    path = os.path.join(base, name if count == 1 else f"{name}-{count}")
    try:
      os.mkdir(path)
      return path
    except FileExistsError:
      continue
  raise FileExistsError(f"{base}: too many runs named {name}")


def newest_run_directory(base: str | None = None) -> str | None:
  """The run directory under ``base`` (default :func:`runs_base`) that started last, or None."""
  base = base or runs_base()
  try:
    names = [n for n in os.listdir(base) if _NAME.match(n) and os.path.isdir(os.path.join(base, n))]
  except OSError:
    return None
  # NAME-2 started after NAME (the same second): order by the suffix's number after the name.
  def start_order(name: str) -> tuple[str, int]:
    stem, _, count = name.rpartition("-")
    return (stem, int(count)) if count.isdigit() else (name, 1)
  return os.path.join(base, max(names, key=start_order)) if names else None


def newest_run_hint() -> str:
  """`` (the newest run: DIR)``, or `` (no run under BASE yet)``: for errors that need a work directory."""
  newest = newest_run_directory()
  return f" (the newest run: {newest})" if newest else f" (no run under {runs_base()} yet)"


def dataset_of_command(command: list[str], default: str = "icd10") -> str:
  """The ``--dataset`` of a training command line (its flagfiles and ``--config`` file included), for a name."""
  dataset = flagfiles.flag_value(command, "dataset")
  if dataset:
    return dataset
  config = flagfiles.flag_value(command, "config")
  if config:
    try:
      with open(config) as f:
        return str(json.load(f)["data"]["dataset"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # the command names what is wrong with it
      pass
  return default
