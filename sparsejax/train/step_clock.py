"""The training loop's clocks: its seconds (training and evaluations apart), the measured step time that the recipe
search plans from, and the step fields of its log records."""

import time

import jax
import numpy as np

from sparsejax.distributed import collectives
from sparsejax.train import compile_clock

# The first steps of a run, each timed on its own (waited for): the median of those that compiled nothing bounds the
# measured step time from below. Subtracting the compilations from the wall time took too much where a run compiles a
# program per new batch width while earlier steps still run: on the suite's labels_heavy the search measured its
# candidates at 3.9-6.2 ms a step where they took 13-22 ms, and planned rounds 3x too long. Costs a few ms of overlap.
TIMED_STEPS = 20


class LoopClock:
  """The training loop's seconds: since it started, and those of its evaluations (not training time; the
  compilations inside them are not subtracted from the measured step time twice)."""

  def __init__(self):
    self.start = time.time()
    self.eval_seconds, self.eval_compiling, self.last_eval_seconds = 0.0, 0.0, 0.0

  def elapsed(self) -> float:
    return time.time() - self.start

  def train_seconds(self) -> float:
    return self.elapsed() - self.eval_seconds

  def evaluated(self, seconds: float, compiling: float) -> None:
    self.last_eval_seconds = seconds
    self.eval_seconds += seconds
    self.eval_compiling += compiling


class StepTimer:
  """The steady step time that the recipe search plans from: the loop's training seconds less its first step
  (compiled then) and later compilations, per step, bounded below by the median of the first :data:`TIMED_STEPS`
  steps that compiled nothing, each timed on its own (compilations overlap the steps dispatched before them, so
  the subtraction alone can take too much)."""

  def __init__(self, start_step: int, t_start: float):
    self.start_step, self.timed = start_step, []
    self.t_start, self.first_step_seconds, self.compiled_before = t_start, None, 0.0
    self._t_step, self._compiled_at_step = None, None

  def begin(self, step: int) -> None:
    self._t_step = None
    if step - self.start_step < TIMED_STEPS:
      self._t_step, self._compiled_at_step = time.time(), compile_clock.seconds()

  def end(self, step: int, metrics) -> None:
    if self._t_step is not None:
      jax.block_until_ready(metrics["loss"])
      if compile_clock.seconds() == self._compiled_at_step:
        self.timed.append(time.time() - self._t_step)

  def after_step(self, metrics) -> None:
    """After the step's maintenance: the first step's seconds, since the loop started."""
    if self.first_step_seconds is None:  # waits for the first step: its compilation is not the step's time
      jax.block_until_ready(metrics["loss"])
      self.first_step_seconds, self.compiled_before = time.time() - self.t_start, compile_clock.seconds()

  def step_seconds(self, train_seconds: float, step: int, eval_compiling: float) -> float | None:
    """Seconds per step after the first (None: fewer than two steps trained)."""
    if self.first_step_seconds is None or step - self.start_step <= 1:
      return None
    # Nor are later compilations (a batch of a new width): a measured plan would take them for step time.
    compiling = compile_clock.seconds() - self.compiled_before - eval_compiling
    seconds = max(train_seconds - self.first_step_seconds - compiling, 0.0) / (step - self.start_step - 1)
    if self.timed:
      seconds = max(seconds, float(np.median(self.timed)))
    return seconds


class StepMeans:
  """The always-on step fields of a log record (:meth:`sparsejax.train.loop.Loop._log_record`), nearly free: two
  timestamps a step, no sync. ``step_seconds_mean`` is the wall time since the previous record's first step over the
  steps taken since (exact: the loop waited for the last step's loss); with the step's compiled collectives
  (:func:`sparsejax.distributed.collectives.compile_step`) ``collective_bytes_per_step`` and ``wire_bytes_per_step``
  (the ring bytes one process sends)."""

  def __init__(self):
    self._t0, self._steps = None, 0

  def begin(self) -> None:
    if self._t0 is None:
      self._t0 = time.perf_counter()

  def end(self) -> None:
    self._steps += 1

  def record(self, compiled: "collectives.CompiledStep | None", observed: dict) -> dict:
    """The fields since the previous record (``observed``: the step observer's, placed before the bytes); empty if
    no step was taken since."""
    steps, t0 = self._steps, self._t0
    self._t0, self._steps = None, 0
    if not steps or t0 is None:
      return {}
    record = {"step_seconds_mean": (time.perf_counter() - t0) / steps, "steps_timed": steps, **observed}
    if compiled is not None:
      record["collective_bytes_per_step"] = sum(c.operand_bytes for c in compiled.collectives)
      record["wire_bytes_per_step"] = sum(c.wire_bytes(jax.process_count()) for c in compiled.collectives)
    return record
