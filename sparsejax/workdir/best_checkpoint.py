"""The best state of a run by a validation metric, kept in ``WORKDIR/best_checkpoint`` and sealed by each process
that saved it (:mod:`sparsejax.workdir.seals`)."""

import json
import logging as pylogging
import os
import time

import jax
import orbax.checkpoint as ocp

from sparsejax import memory
from sparsejax.workdir import saved_state
from sparsejax.workdir.checkpoint import (
  MANAGERS,
  CheckpointError,
  check_disk_space,
  checksums_name,
  copy_arrays,
  finish_other_saves,
  item_handlers,
  save_errors,
  written_bytes,
)
from sparsejax.workdir.orbax_logs import quiet
from sparsejax.workdir.seals import IntegrityError, WriteError, check_sealed_directory, failure_reason, seal_directory

# A run's validation score rises at most of its evaluations, and each better state was saved and sealed as it came:
# the quick start wrote 4.8 GB for a 24 MB run directory (2026-12-07, AMD EPYC, perf: writes and their checksums 6%
# of its CPU, most of its kernel time). One process's best state on the CPU of at most this many bytes (and an eighth
# of the machine's memory) is copied where it lies and written at the next wait(), before each checkpoint and the
# final evaluation: of the better states between two checkpoints the last one is written (4.4 GB). A resumed run
# starts from a checkpoint, whose selection names a best state written before it, and evaluates the later steps again.
DEFERRED_BYTES = 1 << 30


def _check_metrics_files(directory: str, metric: str) -> None:
  """Raises :class:`IntegrityError` naming the file unless each kept state's ``metrics/metrics`` in ``directory``
  (``best_checkpoint``) is a JSON object with a number under ``metric``: orbax reads them to pick the best state,
  before any seal is checked, and a damaged one ended in its JSONDecodeError or KeyError, naming no file."""
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name, "metrics", "metrics")
    if not name.isdigit():  # (an interrupted save's temporary directory, a state set aside as .corrupt)
      continue
    if not os.path.isfile(path):  # orbax would pass the state over, as if the run had kept none
      raise IntegrityError(f"{path}: missing: the state kept in {os.path.join(directory, name)} has no score")
    try:
      with open(path, "rb") as f:
        value = json.loads(f.read().decode("utf-8"))[metric]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
      raise IntegrityError(f"{path}: not the validation metrics of a kept state ({type(e).__name__}: "
                           f"{str(e)[:100]})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise IntegrityError(f"{path}: not the validation metrics of a kept state ({metric} is {value!r})")


class BestCheckpoint:
  """The best state by a validation metric, in ``WORKDIR/best_checkpoint`` (orbax ``best_fn``, one kept). Training
  keeps it without optimizer states (``sparsejax.train.model_selection.without_optimizer``).

  Each process seals the states it saved once they are on disk (:meth:`wait`, which training calls before each
  checkpoint save and before the final evaluation): ``checksums.p<process>.json`` in the step's directory records
  every file's checksum, the run's id and the step (:mod:`sparsejax.workdir.seals`). :meth:`check` verifies them.

  Args:
    workdir: the run's work directory.
    metric: the name of the (higher-is-better) metric it is selected by.
    writable: for saving (the directory is created); False: read only (see :meth:`open`).
    run_id: the run's identity, written into the seals (None: read only, nothing is sealed).
  """

  def __init__(self, workdir: str, metric: str, *, writable: bool = True, run_id: str | None = None):

    self._ocp, self.metric, self.run_id = ocp, metric, run_id
    self.directory = os.path.abspath(os.path.join(workdir, "best_checkpoint"))
    with quiet(pylogging.ERROR if not writable else pylogging.WARNING):
      self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
          max_to_keep=1, best_fn=lambda metrics: metrics[metric], best_mode="max", create=writable,
          read_only=not writable), item_handlers=item_handlers(ocp))
    MANAGERS.add(self._manager)
    self._unsealed: list[int] = []
    self._pending = None  # (step, a copy of the state, value): saved, not written yet

  @classmethod
  def open(cls, workdir: str, metric: str) -> "BestCheckpoint | None":
    """The run's best state, read only; None if the run kept none (no validation split, or no evaluation yet)."""
    if not os.path.isdir(os.path.join(workdir, "best_checkpoint")):
      return None
    _check_metrics_files(os.path.join(workdir, "best_checkpoint"), metric)
    best = cls(workdir, metric, writable=False)
    return best if best.best_step() is not None else None

  def step_directory(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def discard_after(self, step: int) -> None:
    """Deletes the kept states of steps after ``step`` (a resumed run trains those steps again)."""
    self.wait()
    for newer in [s for s in self._manager.all_steps() if s > step]:
      self._manager.delete(newer)

  def set_aside(self, step: int) -> None:
    """Moves the kept state of ``step`` out of the way (renamed ``<step>.corrupt.<time>``), as a damaged one."""
    if jax.process_index() == 0:
      os.replace(self.step_directory(step), f"{self.step_directory(step)}.corrupt.{int(time.time())}")
    self._manager.reload()

  def save(self, step: int, state, value: float) -> None:
    """Saves ``state`` of step ``step`` whose metric is ``value`` (orbax keeps the best one); a state already
    kept for ``step`` is replaced. One process's state of at most :data:`DEFERRED_BYTES`, on the CPU, is copied and
    written by :meth:`wait` (a later save before it replaces the copy)."""
    limit = memory.share_of_memory(DEFERRED_BYTES)
    # (One process: several would each decide, and disagree at orbax's barriers. The CPU: the limit is the host's
    # memory, and an accelerator's copy would hold its memory.)
    if jax.process_count() == 1 and jax.default_backend() == "cpu" and written_bytes(state) <= limit:
      self._pending = (step, copy_arrays(state), value)
      return
    self._pending = None
    self._write(step, state, value)

  def _write(self, step: int, state, value: float) -> None:
    finish_other_saves(self._manager)
    check_disk_space(self.directory, state, f"the best state (step {step})")
    with save_errors(f"the best state (step {step}) in {self.directory}"):
      if step in self._manager.all_steps():
        self._manager.wait_until_finished()
        self._manager.delete(step)
      self._manager.save(step, args=self._ocp.args.Composite(state=self._ocp.args.StandardSave(state)),
                         metrics={self.metric: float(value)}, force=True)
    self._unsealed.append(step)

  def best_step(self) -> int | None:
    return self._manager.best_step()

  def check(self, step: int, run_id: str) -> None:
    """Raises :class:`IntegrityError` (naming the file) unless the kept state of ``step`` is the one run ``run_id``
    sealed for that step: every file unchanged, none missing."""
    check_sealed_directory(self.step_directory(step), run_id, step)

  def restore(self, abstract_state):
    """The best state (None if none was saved)."""
    self.wait()
    step = self.best_step()
    if step is None:
      return None
    saved_fields = saved_state.top_level_fields(self._ocp, self.step_directory(step))
    target, as_state = saved_state.in_saved_layout(abstract_state, saved_fields)
    args = self._ocp.args
    state, _ = saved_state.restore_in_stages(self._ocp, lambda part: self._manager.restore(step, args=args.Composite(
        state=args.StandardRestore(part))), target)
    return as_state(state)

  def restore_arrays(self):
    """The best state as a plain tree of host arrays (as
    :meth:`sparsejax.workdir.checkpoint.Checkpoints.restore_arrays`)."""
    return saved_state.restore_arrays(self._ocp, os.path.join(self.directory, str(self.best_step()), "state"))

  def wait(self) -> None:
    """Writes the state :meth:`save` kept a copy of, blocks until the saves are on disk, and seals them."""
    if self._pending is not None:
      step, state, value = self._pending
      self._pending = None
      self._write(step, state, value)
    with save_errors(f"the best state in {self.directory}"):
      self._manager.wait_until_finished()
    self.seal(self._unsealed)
    self._unsealed = []

  def seal(self, steps: list[int]) -> None:
    """Writes this process's seal of the kept states of ``steps`` (those orbax has not replaced since)."""
    kept = set(self._manager.all_steps())
    for step in steps:
      if step in kept and self.run_id is not None:
        try:
          seal_directory(self.step_directory(step), checksums_name(), self.run_id, step)
        except WriteError as e:
          raise CheckpointError(str(e)) from None
        except OSError as e:
          raise CheckpointError(f"cannot seal the best state {self.step_directory(step)}: "
                                f"{failure_reason(e)}") from None
