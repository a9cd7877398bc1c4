"""Training progress on the console: a progress bar on a terminal, plain log lines elsewhere.

With a bar, absl log lines (evaluations, warnings) are printed above it
through ``tqdm.write`` instead of being glued onto it. Without a terminal (a
log file, a pipe, ``--noprogress``) a plain line reports the step, the
training loss and the throughput every ``log_every`` steps.
"""

import os
import sys

from absl import logging


class _AboveTheBar:
  """A stream for absl's handler that prints through ``tqdm.write`` (the bar is redrawn below)."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(text.rstrip("\n"), file=self.stream)

  def flush(self) -> None:
    self.stream.flush()


def _terminal_columns(stream) -> int:
  """The width of the terminal ``stream`` writes to; 0 where it is not a terminal or reports no size."""
  try:
    return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
  except (AttributeError, OSError, ValueError):
    return 0


class Progress:
  """Reports training progress.

  Args:
    bar: show a tqdm bar if stderr is a terminal (else: log lines).
    total: the step budget (None: unknown).
    initial: the step the run starts from.
  """

  def __init__(self, bar: bool, total: int | None, initial: int):
    self.total, self.bar, self._handler, self._stream = total, None, None, None
    if bar and _terminal_columns(sys.stderr) > 0:  # a terminal of no width (no stty size) would show nothing
      from tqdm.auto import tqdm

      self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0, file=sys.stderr)
      self._handler = getattr(logging.get_absl_handler(), "python_handler", None)
      if self._handler is not None:
        self._stream = self._handler.stream
        self._handler.stream = _AboveTheBar(self._stream)

  def step(self, step: int, loss: float | None = None, samples_per_sec: float | None = None) -> None:
    """Called after every step; ``loss`` and throughput when they were measured (every ``log_every`` steps)."""
    if self.bar is not None:
      if loss is not None:
        self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples_per_sec:,.0f}", refresh=False)
      self.bar.update(1)
    elif loss is not None:
      of = f"/{self.total}" if self.total is not None else ""
      logging.info("step %d%s: loss %.4f, %.0f samples/s", step, of, loss, samples_per_sec)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None
    if self._handler is not None:
      self._handler.stream = self._stream
      self._handler = None
