"""Seals: what a work directory's served files are (checksums) and whose they are (the run, the step).

A seal is a JSON file next to the files it covers::

  {"run_id": "3f0c...", "step": 200, "files": {"state/d/0a1b": [4096, "<sha256>"], ...}}

``run_id`` names the run that wrote the files: drawn at a run's first start and recorded in every checkpoint's
``meta`` (:func:`sparsejax.workdir.checkpoint.make_meta`), so that a resumed run keeps it. ``step`` (where the files are
one training step's state) says which. Training writes the seals of ``best_checkpoint/<step>/`` and ``assets/``
once the files are on disk; :func:`sparsejax.load`, ``sparsejax-predict`` and a resumed run check them before they
read a byte of what they cover, so that a flipped bit, a truncated file or another run's directory copied in is
refused by name (:class:`IntegrityError`) instead of served.
"""

import contextlib
import errno
import glob
import hashlib
import json
import os
import secrets
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class IntegrityError(ValueError):
  """A work directory's file is damaged, missing or not this run's (another run's, another step's); the message
  names the file and what is wrong with it."""


class WriteError(RuntimeError):
  """A file of the work directory could not be written (e.g. a full disk); the message names it and why. What was
  saved before it stays as it was (files are replaced whole, by a rename)."""


class UnverifiedWarning(UserWarning):
  """A work directory written before sparsejax sealed its files: loaded without checking them."""


def new_run_id() -> str:
  """A new run's identity: 128 random bits as hex, the same on every process (process 0's)."""
  words = np.frombuffer(secrets.token_bytes(16), np.uint32)
  if jax.process_count() > 1:
    words = np.asarray(multihost_utils.broadcast_one_to_all(words), np.uint32)
  return words.tobytes().hex()


def sha256_file(path: str) -> str:
  """SHA-256 of a file, read in 1 MiB chunks (a GB-sized state file never sits in memory whole)."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      digest.update(chunk)
  return digest.hexdigest()


def file_entry(path: str) -> list:
  """``[size, sha256]`` of a file, as a seal records it."""
  return [os.path.getsize(path), sha256_file(path)]


def is_full_disk(error: BaseException | str) -> bool:
  """Whether an error (or its message: TensorStore's name the errno in words) is a full disk's."""
  return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error)


def failure_reason(error: Exception) -> str:
  """Why a write failed, in a few words (a full disk says so)."""
  text = str(error)
  if is_full_disk(error):
    return "no space left on device: the disk is full"
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
  return first if len(first) <= 300 else first[:300] + "..."


@contextlib.contextmanager
def writing(path: str, partial: str | None = None):
  """Turns an OSError while ``path`` is written into one :class:`WriteError` line naming it (a full disk, a
  read-only directory: numpy and ``open`` raise it bare, with no path); removes ``partial``, the file that was to
  replace ``path``."""
  try:
    yield
  except OSError as e:
    if partial is not None:
      with contextlib.suppress(OSError):
        os.remove(partial)
    raise WriteError(f"saving {path} failed ({failure_reason(e)}). The checkpoints and files saved before it are "
                     "intact") from None


def write_json_atomically(path: str, value: Any, indent: int | None = None) -> None:
  """Writes ``value`` as JSON to ``path`` whole or not at all (a rename): a crash leaves the old file or the new, a
  failed write (:class:`WriteError`) the old."""
  partial = path + ".partial"
  with writing(path, partial):
    with open(partial, "w") as f:
      json.dump(value, f, indent=indent)
      f.flush()
      os.fsync(f.fileno())
    os.replace(partial, path)


def file_checksums(directory: str) -> dict[str, list]:
  """``{path relative to directory: [size, sha256]}`` of every file below ``directory`` but the checksum files
  (``checksums.*``)."""
  files = {}
  for parent, _, names in os.walk(directory):
    for name in names:
      if not name.startswith("checksums."):
        path = os.path.join(parent, name)
        files[os.path.relpath(path, directory)] = file_entry(path)
  return files


def seal_directory(directory: str, seal_name: str, run_id: str, step: int | None = None) -> None:
  """Writes ``directory/seal_name``: the checksums of every file below ``directory`` (but seals) and the identity.
  """
  write_json_atomically(os.path.join(directory, seal_name),
                        {"run_id": run_id, "step": step, "files": file_checksums(directory)})


def read_seal(path: str) -> dict:
  """The seal at ``path``; raises :class:`IntegrityError` for one that is unreadable or not a seal."""
  try:
    with open(path, "rb") as f:
      seal = json.loads(f.read().decode("utf-8"))
  except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
    raise IntegrityError(f"{path}: unreadable ({e})") from None
  files = seal.get("files") if isinstance(seal, dict) else None
  if not isinstance(files, dict) or not all(_is_entry(entry) for entry in files.values()):
    raise IntegrityError(f"{path}: not a seal of sparsejax's (no list of files with sizes and checksums)")
  return seal


def _is_entry(entry) -> bool:
  return (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and isinstance(entry[1], str))


def check_file(directory: str, name: str, seal: dict, seal_path: str) -> None:
  """Raises :class:`IntegrityError` unless ``directory/name`` is the file that ``seal`` recorded."""
  path = os.path.join(directory, name)
  entry = seal["files"].get(name)
  if entry is None:
    raise IntegrityError(f"{path}: not recorded in {seal_path}: not written by the run that wrote the others")
  size, digest = entry
  if not os.path.isfile(path):
    raise IntegrityError(f"{path}: missing (its run recorded it in {seal_path})")
  actual = os.path.getsize(path)
  if actual != size:
    raise IntegrityError(f"{path}: truncated or replaced ({actual} bytes; its run recorded {size} in "
                         f"{seal_path})")
  if sha256_file(path) != digest:
    raise IntegrityError(f"{path}: corrupted (its SHA-256 differs from the one its run recorded in {seal_path})")


def check_identity(seal: dict, seal_path: str, what: str, run_id: str, step: int | None = None) -> None:
  """Raises :class:`IntegrityError` unless ``seal`` (of ``what``, a path) names run ``run_id`` (and ``step``)."""
  if seal.get("run_id") != run_id:
    raise IntegrityError(f"{what}: from another run ({seal_path} names run {seal.get('run_id')}; this work "
                         f"directory's checkpoints are of run {run_id})")
  if step is not None and seal.get("step") != step:
    raise IntegrityError(f"{what}: from another step ({seal_path} says step {seal.get('step')}; it is kept as the "
                         f"state of step {step})")


def check_sealed_directory(directory: str, run_id: str, step: int | None = None) -> None:
  """Raises :class:`IntegrityError` unless every ``checksums.p<process>.json`` seal in ``directory`` names run
  ``run_id`` (and ``step``) and every file they record is unchanged. A directory without a seal is refused."""
  seal_paths = sorted(glob.glob(os.path.join(glob.escape(directory), "checksums.p*.json")))
  if not seal_paths:
    raise IntegrityError(f"{directory}: has no checksums (checksums.p0.json is missing): its run sealed it once "
                         "saved, so it was changed since, or its save was interrupted")
  for seal_path in seal_paths:
    seal = read_seal(seal_path)
    check_identity(seal, seal_path, directory, run_id, step)
    for name in sorted(seal["files"]):
      check_file(directory, name, seal, seal_path)

