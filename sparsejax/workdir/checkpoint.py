"""A work directory's checkpoints (orbax): the state, the data position, and what made them.

``WORKDIR/checkpoints/<step>/`` holds one checkpoint: ``state`` (every array of
the training state; each process writes its shards), ``data`` (the batch
iterator's position) and ``meta`` (the run's config, the sparsejax version, the
process count and the data's sizes). A save runs in the background; one
interrupted by a crash never replaces the last complete checkpoint.

Each process seals the checkpoints it saved: once a save is on disk it writes
``checksums.p<process>.json`` there (size and SHA-256 of every file it sees).
:meth:`Checkpoints.latest_good_step` verifies them before a resume: a
checkpoint that is empty, truncated, corrupted or unreadable is named in a
warning and set aside (renamed ``<step>.corrupt``), and the run resumes from
the newest good one. A save that fails (a full disk) raises
:class:`CheckpointError`; the checkpoints already on disk stay as they were.

Before a run resumes, :func:`check_resume` compares the newest checkpoint's
``meta`` with the new run and refuses a resume that would not continue the same
run (other settings, another process count), naming what differs.

Within :func:`held_in_memory` (a recipe search's candidates), a checkpoint is
kept in memory instead of written, and read back from there
(:mod:`sparsejax.workdir.held`).
"""

import contextlib
import functools
import importlib.metadata
import json
import logging as pylogging
import os
import shutil
import socket
import tempfile
import time
import weakref
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from sparsejax.config import Config, identity_fields
from sparsejax.settings import ConfigError, flat_items, format_value
from sparsejax.workdir import held, saved_state
from sparsejax.workdir.orbax_logs import quiet
from sparsejax.workdir.seals import (
  WriteError,
  failure_reason,
  file_checksums,
  sha256_file,
  write_json_atomically,
)

# Every live orbax CheckpointManager of this process. A save first waits for the others' background saves: orbax
# synchronizes each save across processes with a barrier of the same name, and two managers saving at once
# (the run's checkpoints and the best state) fail with "Barrier ... is already ongoing" under load.
MANAGERS = weakref.WeakSet()


def item_handlers(ocp, *json_items: str) -> dict[str, Any]:
  """The items' handlers: ``json_items`` as JSON, and ``state`` by orbax's standard handler writing arrays without
  zstd compression.

  Weights and Adam moments are near-random floats that zstd shrinks by a few percent, yet compressing them was
  a tenth of a quick start's CPU time (its TensorStore threads at 15%, mostly zstd, in a perf profile of
  2026-11-28). Checkpoints written compressed (by older versions) restore as before: the codec is recorded per
  array. Where an orbax version lacks the option, its default (compressed) handler is kept.
  """
  handler = ocp.StandardCheckpointHandler()
  # On the instance: orbax matches a handler's class to its arguments' (a subclass would match none).
  handler.restore = functools.partial(_restore_with_placeholders, handler, handler.restore)
  impl = getattr(handler, "_impl", None)
  try:
    handler._impl = type(impl)(use_compression=False, use_ocdbt=True)
  except TypeError:  # another orbax: its own defaults
    handler._impl = impl
  return {"state": handler} | {name: ocp.JsonCheckpointHandler() for name in json_items}


def _restore_with_placeholders(handler, restore, directory, item=None, args=None):
  """``handler.restore`` (orbax's standard handler's), also for a target whose arrays are in part ``ocp.PLACEHOLDER``
  (not read: :func:`sparsejax.workdir.saved_state.restore_in_stages`), which the standard handler's checks refuse."""
  target = args.item if args is not None else item
  if not any(leaf is ocp.PLACEHOLDER for leaf in jax.tree.leaves(target)):
    return restore(directory, item, args)
  restore_args = jax.tree.map(lambda x: x if x is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(
      sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), target)
  return handler._impl.restore(directory, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))


def finish_other_saves(manager) -> None:
  for other in list(MANAGERS):
    if other is not manager:
      with save_errors(f"a checkpoint in {other.directory}"):
        other.wait_until_finished()


@contextlib.contextmanager
def save_errors(what: str):
  """Turns a failed orbax save (raised by the save or by a later wait) into one :class:`CheckpointError` line."""
  try:
    yield
  except CheckpointError:
    raise
  except Exception as e:  # noqa: BLE001 -- orbax and tensorstore raise OSError, ValueError, ...
    raise CheckpointError(f"saving {what} failed ({failure_reason(e)}). The checkpoints saved before it are "
                          "intact") from None


class CheckpointError(WriteError):
  """A checkpoint could not be written (e.g. a full disk); the message names it and the reason."""


# Room kept beside a save's arrays for orbax's metadata and the seal.
SAVE_MARGIN_BYTES = 16 << 20


def written_bytes(tree) -> int:
  """Bytes of ``tree``'s arrays that this process writes in a save: its shards of each array, one replica of each
  (orbax writes the replica 0 of a replicated array, on one process)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      total += sum(shard.data.nbytes for shard in leaf.addressable_shards if shard.replica_id == 0)
    else:
      total += getattr(leaf, "nbytes", 0)
  return total


def check_disk_space(directory: str, tree, what: str) -> None:
  """Raises :class:`CheckpointError` on every process (each of them) unless the file systems of ``directory`` have
  room for what the processes will write of ``tree`` there. A save that filled the disk hung the 10^9-parameter
  run's four processes at orbax's barriers, with no error (9 of its 12.7 GB written); the processes of a machine
  that share a file system are counted together."""
  os.makedirs(directory, exist_ok=True)
  # In KiB, as int32 (JAX's collectives without x64): a file system of up to 2 TiB counted exactly, a larger one as
  # 2 TiB free.
  place = zlib.crc32(f"{socket.gethostname()}:{os.stat(directory).st_dev}".encode()) & 0x7FFFFFFF
  free_kib = min(shutil.disk_usage(directory).free >> 10, 2**31 - 1)
  needed_kib = min(-(-(written_bytes(tree) + SAVE_MARGIN_BYTES) >> 10), 2**31 - 1)
  mine = np.array([place, free_kib, needed_kib], np.int32)
  if jax.process_count() == 1:
    rows = mine[None].astype(np.int64)
  else:
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 3).astype(np.int64)
  for place in np.unique(rows[:, 0]):
    here = rows[rows[:, 0] == place]
    needed, free = int(here[:, 2].sum()) << 10, int(here[:, 1].min()) << 10
    if needed > free:
      raise CheckpointError(f"saving {what} failed (no space left on device: the disk is full). It needs "
                            f"{_size(needed)} and {_size(free)} are free: nothing was written. The checkpoints saved "
                            "before it are intact")


def _size(nbytes: int) -> str:
  return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class ResumeError(RuntimeError):
  """The work directory holds a run that this one must not continue (the message says why and what to do)."""


def package_version() -> str:
  try:
    return importlib.metadata.version("sparsejax")
  except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    return "unknown"


def check_writable(directory: str, flag: str = "workdir") -> None:
  """Creates ``directory`` and writes a file there, or raises a ConfigError naming ``flag``.

  A checkpoint directory that cannot be written used to stall the first save
  for minutes and then fail with an unrelated timeout.
  """
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
      pass
  except OSError as e:
    raise ConfigError(flag, directory, f"cannot write there ({e.strerror or e})") from None


@contextlib.contextmanager
def new_directories_removed_on_failure(*directories: str):
  """Removes again, if the block raises, those of ``directories`` that did not exist before it and are empty.

  Listed parent first. A run refused at its start (bad data, a setting that does not fit) otherwise left an
  empty ``WORKDIR/checkpoints`` behind, which looks like a run that started.
  """
  new = [d for d in directories if not os.path.exists(d)]
  try:
    yield
  except BaseException:
    for directory in reversed(new):
      try:
        os.rmdir(directory)
      except OSError:  # not empty (something was saved after all) or already gone
        pass
    raise


class Checkpoints:
  """Save and restore training states in ``WORKDIR/checkpoints``.

  Args:
    workdir: the run's work directory.
    keep: newest checkpoints kept (None: all).
    writable: for saving (the directory is created and checked); False: read only.
  """

  def __init__(self, workdir: str, keep: int | None = None, *, writable: bool = True):

    self._ocp = ocp
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    if writable:
      check_writable(self.directory)
    elif not os.path.isdir(self.directory):
      raise FileNotFoundError(f"{self.directory}: no checkpoints (nothing was trained with --workdir={workdir})")
    self._keep = keep
    with quiet(pylogging.ERROR if not writable else pylogging.WARNING):
      options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=writable, read_only=not writable)
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            item_handlers=item_handlers(ocp, "data", "meta"))
    MANAGERS.add(self._manager)

    self._unsealed: list[int] = []  # saved by this object, checksums not written yet
    self._resume_step: int | None = None
    self._writable = writable
    self._holds = writable and held.holds(self.directory)

  def _held(self, step: int | None = None) -> held.Held | None:
    """The checkpoint held in memory for this directory (of ``step``, where given), if any: always the newest (a
    save to disk drops it). One restored and trained on is gone (its arrays donated to the training's steps)."""
    entry = held.get(self.directory) if self._holds else None
    if entry is not None and held.spent(entry):
      held.pop(self.directory)
      entry = None
    return entry if entry is not None and (step is None or step == entry.step) else None

  def would_hold(self, state, nbytes: int | None = None) -> bool:
    """Whether a save of ``state`` (``nbytes``: its :func:`written_bytes`, where known) would be held in memory
    (instant) rather than written."""
    return self._holds and held.fits(self.directory, written_bytes(state) if nbytes is None else nbytes)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step (None: none yet)."""
    entry = self._held()
    return entry.step if entry is not None else self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of the complete checkpoints, ascending."""
    entry = self._held()
    return sorted(set(self._manager.all_steps()) | ({entry.step} if entry is not None else set()))

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def latest_good_step(self) -> int | None:
    """The newest checkpoint that passes :meth:`verify` (None: none); the ones after it are set aside.

    Each bad one is named in a warning and renamed ``<step>.corrupt`` (by process 0), so that the run goes on
    from the good one and may save those steps again. Later :meth:`restore` calls restore this step.
    """
    entry = self._held()
    if entry is not None:  # newer than any on disk, and never damaged there
      self._resume_step = entry.step
      return entry.step
    steps = sorted(self._manager.all_steps(), reverse=True)
    good = None
    for i, step in enumerate(steps):
      problem = self.verify(step)
      if problem is None:
        good = step
        break
      older = next(iter(steps[i + 1:]), None)
      logging.warning("checkpoint %s %s: %s", self._step_dir(step), problem,
                      f"falling back to step {older}" if older is not None else "no older checkpoint: starting anew")
      if jax.process_index() == 0:
        os.replace(self._step_dir(step), f"{self._step_dir(step)}.corrupt.{int(time.time())}")
    if good != (steps[0] if steps else None):
      self._manager.reload()
    self._resume_step = good
    return good

  def is_sealed(self, step: int) -> bool:
    """Whether checkpoint ``step`` holds this process's checksums (else :meth:`verify` could only read it)."""
    if self._held(step) is not None:
      return True
    return os.path.exists(os.path.join(self._step_dir(step), checksums_name()))

  def verify(self, step: int) -> str | None:
    """What is wrong with checkpoint ``step`` (empty, a file missing, truncated or changed, unreadable), or None.

    A checkpoint without this process's checksums (an older sparsejax, or a crash right after the save) is only
    checked for being readable.
    """
    if self._held(step) is not None:
      return None
    directory = self._step_dir(step)
    if not os.path.isdir(directory) or not os.listdir(directory):
      return "is empty"
    path = os.path.join(directory, checksums_name())
    if os.path.exists(path):
      try:
        with open(path) as f:
          recorded = json.load(f)
      except (OSError, ValueError) as e:
        return f"has an unreadable {path}: {e}"
      for name, (size, digest) in sorted(recorded.items()):
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
          return f"lacks its file {name}"
        actual = os.path.getsize(file)
        if actual != size:
          return f"has a truncated file {name} ({actual} of {size} bytes)"
        if sha256_file(file) != digest:
          return f"has a corrupted file {name} (its SHA-256 differs from the one recorded at the save)"
    try:
      self.meta(step)
      self._manager.restore(step, args=self._ocp.args.Composite(data=self._ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 -- any failure to read it makes it unusable
      return f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None

  def _seal(self) -> None:
    """Writes the checksums of this object's finished saves (atomically: a crash leaves none or all)."""
    for step in self._unsealed:
      directory = self._step_dir(step)
      if not os.path.isdir(directory):  # already deleted (keep_checkpoints)
        continue
      path = os.path.join(directory, checksums_name())
      try:
        write_json_atomically(path, file_checksums(directory))
      except WriteError as e:  # the seal itself (a full disk): its message names it
        raise CheckpointError(str(e)) from None
      except OSError as e:  # reading the files it covers
        raise CheckpointError(f"cannot write {path}: {failure_reason(e)}") from None
    self._unsealed = []

  def meta(self, step: int | None = None) -> dict[str, Any] | None:
    """The ``meta`` record of checkpoint ``step`` (default: the newest); None if it has none."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    entry = self._held(step)
    if entry is not None:
      return _json_copy(entry.meta)
    try:
      return self._manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore()))["meta"]
    except KeyError:  # written before checkpoints recorded their config
      return None

  def position(self, step: int) -> dict[str, Any]:
    """The ``data`` record of checkpoint ``step``: the data position and, with a validation split, the model
    selection's state (``selection``: its best step and value)."""
    entry = self._held(step)
    if entry is not None:
      return _json_copy(entry.data)
    return self._manager.restore(step, args=self._ocp.args.Composite(data=self._ocp.args.JsonRestore()))["data"]

  def save(self, step: int, state, data_state: dict, meta: dict, *, wait: bool = False, last: bool = False) -> None:
    """Saves ``state``, the data position and ``meta`` as checkpoint ``step`` (in the background unless ``wait``).

    Within :func:`held_in_memory` it is held in memory instead, where it fits: ``state`` itself where ``last`` (the
    caller trains it no further), else a copy.
    """
    nbytes = written_bytes(state)
    if self.would_hold(state, nbytes):
      self.wait()
      held.pop(self.directory)  # (its copy freed before the new one is made)
      held.put(self.directory, held.Held(step, state if last else copy_arrays(state), _json_copy(data_state),
                                         _json_copy(meta), self._keep, nbytes))
      return
    ocp = self._ocp
    self.wait()  # the previous save first (orbax would wait for it too): its checksums are written now
    finish_other_saves(self._manager)
    check_disk_space(self.directory, state, f"checkpoint {self._step_dir(step)}")
    with save_errors(f"checkpoint {self._step_dir(step)}"):
      self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       data=ocp.args.JsonSave(data_state),
                                                       meta=ocp.args.JsonSave(meta)))
    self._unsealed.append(step)
    if wait:
      self.wait()
    held.pop(self.directory)  # superseded by this one on disk

  def restore(self, abstract_state):
    """``(state, data_state)`` of the newest checkpoint, or None if there is none.

    Args:
      abstract_state: shapes, dtypes and shardings to restore into.
    """
    step = self._resume_step if self._resume_step is not None else self.latest_step()
    if step is None:
      return None
    entry = self._held(step)
    if entry is not None and jax.tree.structure(entry.state) == jax.tree.structure(abstract_state):
      # The arrays themselves: held until the training's first step donates them (then spent, see _held).
      return entry.state, _json_copy(entry.data)
    self.write_held()  # (another structure: the disk's layout conversions apply)
    ocp = self._ocp
    target, as_state = saved_state.in_saved_layout(abstract_state,
                                                   saved_state.top_level_fields(ocp, self._step_dir(step)))
    args = ocp.args
    state, restored = saved_state.restore_in_stages(ocp, lambda part: self._manager.restore(step, args=args.Composite(
        state=args.StandardRestore(part), data=args.JsonRestore())), target)
    return as_state(state), restored["data"]

  def restore_arrays(self, step: int | None = None):
    """The newest (or ``step``'s) state as a plain tree of host arrays, whatever the run's layout.

    Sharded arrays come back whole (global shape); named tuples come back as dicts and tuples as lists.
    """
    self.write_held()
    step = self.latest_step() if step is None else step
    return saved_state.restore_arrays(self._ocp, os.path.join(self.directory, str(step), "state"))

  def shape_differences(self, step: int, abstract_state) -> list[str]:
    """How the arrays saved in checkpoint ``step`` differ in shape from ``abstract_state``'s (empty: they fit).

    Read from the checkpoint's metadata, so that a restore that could not fit is never started.
    """
    shapes = lambda tree: {saved_state.path_name(p): tuple(x.shape)  # noqa: E731
                           for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    entry = self._held(step)
    if entry is not None:  # (held in today's layout)
      before, now = shapes(entry.state), shapes(abstract_state)
    else:
      with quiet():
        saved = self._ocp.StandardCheckpointer().metadata(
            os.path.join(self.directory, str(step), "state")).item_metadata.tree
      before, now = shapes(saved), shapes(saved_state.in_saved_layout(abstract_state, saved.keys())[0])
    return [f"{name}: saved {before.get(name, 'none')}, now {now.get(name, 'none')}"
            for name in sorted(before.keys() | now.keys(), key=saved_state.parameters_first)
            if before.get(name) != now.get(name)]

  def write_held(self) -> None:
    """Writes the checkpoint held in memory for this directory, if any (it is then on disk only; held until then)."""
    if not self._writable:  # (a reader leaves what a run in the directory holds)
      return
    entry = held.get(self.directory)
    if entry is None or held.spent(entry):
      held.pop(self.directory)
      return
    holds, self._holds = self._holds, False
    try:
      self.save(entry.step, entry.state, entry.data, entry.meta, wait=True)
    finally:
      self._holds = holds

  def wait(self) -> None:
    """Blocks until background saves are on disk (and sealed with their checksums).

    Raises:
      CheckpointError: a save failed (e.g. a full disk); the checkpoints saved before it are intact.
    """
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- orbax and tensorstore raise OSError, ValueError, ...
      steps = ", ".join(self._step_dir(s) for s in self._unsealed)
      self._unsealed = []
      raise CheckpointError(f"saving checkpoint {steps} failed ({failure_reason(e)}). The checkpoints saved before "
                            "it are intact") from None
    self._seal()


@contextlib.contextmanager
def held_in_memory(root: str):
  """Holds the checkpoints saved under ``root`` in memory (:mod:`sparsejax.workdir.held`) for the block; those still
  held when it ends, as it ends or raises, are written then (where their run directory is still there)."""
  held.add_root(root)
  try:
    yield
  finally:
    held.remove_root(root)
    _write_held_under(root)


def _write_held_under(root: str) -> None:
  """Writes the checkpoints held under ``root`` (each tried; none held afterwards); raises the first failure."""
  failure = None
  try:
    directories = [d for d in held.under(root) if os.path.isdir(os.path.dirname(d))]  # (else removed with its run)
    if directories:
      logging.info("writing %d checkpoint(s) held in memory (%.0f MB): %s", len(directories),
                   sum(held.get(d).nbytes for d in directories) / 2**20, ", ".join(directories))
    for directory in directories:
      try:
        Checkpoints(os.path.dirname(directory), held.get(directory).keep).write_held()
      except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 -- the others are written all the same
        failure = failure or e
  finally:
    held.drop(root)
  if failure is not None:
    raise failure


def copy_arrays(tree):
  """``tree`` with each JAX array copied (a state kept while the training donates its own buffers)."""
  return jax.tree.map(lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a, tree)


def _json_copy(record: dict) -> dict:
  """``record`` as a JSON checkpoint item gives it back (a fresh copy: tuples as lists, keys as strings)."""
  return json.loads(json.dumps(record))


def checksums_name() -> str:

  return f"checksums.p{jax.process_index()}.json"


def make_meta(config: Config, num_shards: int, num_processes: int, data: dict[str, int],
              run_id: str | None = None) -> dict[str, Any]:
  """What a checkpoint records about the run that wrote it (``run_id``: its identity, see
  :mod:`sparsejax.workdir.seals`)."""
  return {"config": config.to_dict(), "version": package_version(), "num_shards": num_shards,
          "num_processes": num_processes, "data": data, "run_id": run_id}


def check_resume(meta: dict[str, Any] | None, step: int, config: Config, num_shards: int, workdir: str) -> list[str]:
  """Raises :class:`ResumeError` unless the run of ``config`` may continue from checkpoint ``step``.

  Args:
    meta: the checkpoint's record (None for checkpoints that have none: not checked).
    step: the checkpoint's step.
    config: the new run's settings (``config.checkpoint.resume``: ``auto`` refuses a change of the settings that
      define the run, ``force`` names them in a warning and goes on, ``never`` refuses any checkpoint).
    num_shards: the new run's output layer split.
    workdir: named in the messages.

  Returns:
    The names of the settings that differ from the checkpoint's: budgets and other settings free to change, and
    under ``force`` also those that define the run (each of these named in a warning).
  """
  where = os.path.join(workdir, "checkpoints", str(step))
  policy = config.checkpoint.resume
  if policy == "never":
    raise ResumeError(f"{where} exists and --resume=never: use another --workdir for a new run "
                      "(or --resume=auto to continue this one)")
  if meta is None:
    logging.warning("%s records no settings (an older sparsejax wrote it): resuming without checking them", where)
    return []
  if meta.get("num_shards") != num_shards:
    raise ResumeError(f"{where} was written by a run over {meta.get('num_processes')} process(es) with the output "
                      f"layer split {meta.get('num_shards')} way(s); this one splits it {num_shards} way(s). Resume "
                      f"it with {meta.get('num_processes')} process(es), or use another --workdir")
  saved = flat_items(Config.from_dict(meta["config"]))
  now = flat_items(config)
  changed = [name for name in sorted(now) if saved[name] != now[name]]
  differ = [name for name in changed if name in identity_fields()]
  changes = ", ".join(f"--{n}={format_value(saved[n])} (now {format_value(now[n])})" for n in differ)
  if policy == "force":
    if differ:
      logging.warning("--resume=force: continuing %s with other settings: %s", where, changes)
    return changed
  if differ:
    raise ResumeError(f"{where} was trained with other settings: {changes}. Give the same settings to resume it "
                      f"(--config={os.path.join(workdir, 'config.json')} has them), use another --workdir for a new "
                      f"run, or --resume=force to continue it with the new ones")
  return changed
