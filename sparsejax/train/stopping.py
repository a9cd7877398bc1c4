"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM: finish the step, save a checkpoint, exit.

One process: a Python handler notes the signal; the loop asks
:meth:`StopRequests.requested` after every step. A second signal of the same
kind acts at once (Ctrl-C twice: KeyboardInterrupt). Several processes:
``jax.distributed`` catches SIGTERM itself (its preemption notifier) and tells
every process, and ``reached_preemption_sync_point`` is true on all of them at
the same step, so they all save the same checkpoint. No Python handler is
installed there: it would replace the notifier and the processes would stop at
different steps. A state too large to save in seconds is not saved again on a stop where a periodic checkpoint is
kept (:func:`stops_on_kept_checkpoint`).
"""

import os
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils


class Interrupted(Exception):
  """The run stopped on a signal after saving a checkpoint at ``step``."""

  def __init__(self, signum: int, step: int, checkpoint_dir: str):
    self.signum, self.step, self.checkpoint_dir = signum, step, checkpoint_dir
    super().__init__(self.describe())

  def describe(self, signal_name: str | None = None,
               how_to_continue: str = "run the same command again to continue") -> str:
    """The message, naming ``signal_name`` (default: the signal's) and saying how to continue the run."""
    name = signal_name or signal.Signals(self.signum).name
    return f"stopped by {name} after step {self.step}: checkpoint saved in {self.checkpoint_dir}; {how_to_continue}"


class SignalInterrupt(KeyboardInterrupt):
  """SIGINT or SIGTERM outside the training loop (loading data, the final evaluation): stops at once."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


# The signal of a SignalInterrupt raised, which may have been lost: Python ignores an exception raised in some
# callbacks (a signal handler runs inside whatever the main thread runs, JAX's garbage-collection callback
# included), and a Ctrl-C while data loaded once went on to train the whole run.
_raised: int | None = None


def raise_on_signals() -> None:
  """Makes SIGINT and SIGTERM raise :class:`SignalInterrupt` in one process (SIGTERM's default kills it without a
  word); :class:`StopRequests` takes them over while steps run. Several processes: left to ``jax.distributed``."""
  global _raised
  if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
    _raised = None
    for signum in (signal.SIGINT, signal.SIGTERM):
      signal.signal(signum, _raise_interrupt)


def _raise_interrupt(signum, frame):
  global _raised
  if frame is not None and frame.f_code.co_name in _SWALLOWING:
    # Python would print the exception and go on: the signal comes again in a moment, to another frame.
    threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
    return
  _raised = signum
  raise SignalInterrupt(signum)


# Functions that run inside whatever the main thread was doing and whose exceptions Python only prints.
_SWALLOWING = frozenset({"_xla_gc_callback", "__del__"})


def raise_if_interrupted() -> None:
  """Raises again a :class:`SignalInterrupt` that a callback may have swallowed."""
  if _raised is not None:
    raise SignalInterrupt(_raised)


class StopRequests:
  """Context manager that turns SIGINT/SIGTERM into a request to stop after the current step."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}
    self._multi = jax.process_count() > 1

  def __enter__(self) -> "StopRequests":
    raise_if_interrupted()  # a signal before the loop: stop now, not after the whole run
    if not self._multi and threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGINT, signal.SIGTERM):
        self._previous[signum] = signal.signal(signum, self._note)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _note(self, signum, frame) -> None:
    del frame
    self.signum = signum
    signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second one acts at once

  def requested(self, step: int) -> bool:
    """Whether to stop after ``step`` (the same answer on every process)."""
    if self._multi:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signum = signal.SIGTERM
        return True
      return False
    return self.signum is not None


# A state larger than this is not saved again when a signal stops the run where a periodic checkpoint is kept: a
# 154M-parameter candidate (1.8 GB with Adam's moments) took 2.5 minutes to save and exit on SIGTERM.
QUICK_STOP_BYTES = 512 << 20


def stops_on_kept_checkpoint(stop_signal: int | None, step: int, checkpoints, state) -> bool:
  """Whether a run stopped by ``stop_signal`` at ``step`` exits on its newest periodic checkpoint (in
  ``checkpoints``, its :class:`sparsejax.workdir.checkpoint.Checkpoints`) instead of saving its state, too large to
  save in seconds; the steps after that checkpoint are trained again by the continued run, as logged."""
  kept = checkpoints.latest_step()
  if stop_signal is None or kept is None or checkpoints.would_hold(state):  # (held in memory: saved at once)
    return False
  size = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
  if size <= QUICK_STOP_BYTES:
    return False
  logging.warning("stopping at once: the state (%.1f GiB) is not saved again; the run continues from checkpoint %d "
                  "(the %d steps after it are trained again)", size / 2**30, kept, step - kept)
  return True
