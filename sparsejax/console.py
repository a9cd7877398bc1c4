"""Training progress on the console: a progress bar on a terminal, plain log lines elsewhere.

With a bar, absl log lines (evaluations, warnings) are printed above it
through ``tqdm.write`` instead of being glued onto it. Without a terminal (a
log file, a pipe, ``--noprogress``) a plain line reports the step, the
training loss and the throughput every ``log_every`` steps.
"""

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


class Progress:
  """Reports training progress.

  Args:
    bar: show a tqdm bar if stderr is a terminal (else: log lines).
    total: the step budget (None: unknown).
    initial: the step the run starts from.
  """

  def __init__(self, bar: bool, total: int | None, initial: int):
    self.total, self.bar, self._handler, self._stream = total, None, None, None
    if bar and sys.stderr.isatty():
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
