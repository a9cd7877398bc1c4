"""Training progress on the console: a progress bar on a terminal, plain log lines elsewhere.

With a bar (a terminal, or a Jupyter notebook's cell), absl log lines
(evaluations, warnings) are printed above it through ``tqdm.write`` instead of
being glued onto it. Without one (a log file, a pipe, ``--noprogress``) a plain
line reports the step, the training loss and the throughput every
``log_every`` steps.

``sparsejax-train`` logs through absl's handler, which ``absl.app`` sets up. A
Python caller (a notebook, a script: :func:`sparsejax.fit`,
``train_and_evaluate(..., verbose=True)``) has none: :func:`log_to_console`
shows the same lines on stderr while it trains.
"""

import contextlib
import logging as python_logging
import os
import sys
from collections.abc import Iterator

from absl import logging
from tqdm.auto import tqdm

from sparsejax.settings import format_value, non_default_settings

# The handler that log_to_console installed, while it is active: the bar writes the log lines through it.
_console_handler: python_logging.StreamHandler | None = None


class _CurrentStderr:
  """``sys.stderr`` as it is at each write: a notebook's output of the cell running, pytest's capture."""

  def write(self, text: str) -> None:
    sys.stderr.write(text)

  def flush(self) -> None:
    sys.stderr.flush()


@contextlib.contextmanager
def log_to_console() -> Iterator[None]:
  """sparsejax's log lines (absl's logger, INFO and up) on stderr while the block runs, as ``sparsejax-train`` writes
  them: the work directory, progress, evaluations, warnings, the final evaluation.

  For callers that no ``absl.app`` set up logging for (a notebook, a script). The lines go to this handler only,
  not on to the root logger's (a notebook's or ``logging.basicConfig``'s would print each one twice); absl's
  verbosity, the logger's handlers and its propagation are as they were afterwards. Nested blocks use the outer
  one's handler.
  """
  global _console_handler
  if _console_handler is not None:
    yield
    return
  absl_logger = logging.get_absl_logger()
  verbosity, propagate, level = logging.get_verbosity(), absl_logger.propagate, absl_logger.level
  handler = python_logging.StreamHandler(_CurrentStderr())
  handler.setFormatter(logging.PythonFormatter())
  # absl's handler's filters too, whenever they are added (sparsejax.workdir.checkpoint keeps orbax's INFO lines out).
  handler.addFilter(lambda record: logging.get_absl_handler().filter(record))
  absl_logger.addHandler(handler)
  absl_logger.propagate = False
  if verbosity < logging.INFO:
    logging.set_verbosity(logging.INFO)
  _console_handler = handler
  try:
    yield
  finally:
    _console_handler = None
    absl_logger.removeHandler(handler)
    absl_logger.propagate = propagate
    logging.set_verbosity(verbosity)
    absl_logger.setLevel(level)  # set_verbosity gives the logger a level: it may have had none (the root's)


def log_settings(config) -> None:
  """Logs the settings of ``config`` that are not at their defaults (a :class:`sparsejax.config.Config`)."""
  changed = [f"--{k}={format_value(v)}" for k, v in non_default_settings(config).items()]
  logging.info("settings not at their defaults: %s (all of them: WORKDIR/config.json)", " ".join(changed) or "none")


def final_line(final: dict, workdir: str | None = None) -> str:
  """The one summary line of a finished run's final evaluation ``final`` (ending with its work directory, where
  given): ``step 40  P@1 0.7000  ...  (1,234 samples/s)  in WORKDIR``."""
  keys = ["p@1", "p@3", "p@5", "ndcg@5", "psp@5", "sampled_p@1", "sampled_p@5"]
  trained = final.get("train_seconds", 1.0) > 0  # else a finished run's final evaluation, done again
  return (f"step {final['step']}  " + "  ".join(f"{k.upper()} {final[k]:.4f}" for k in keys if k in final)
          + (f"  ({final['samples_per_sec']:,.0f} samples/s)" if trained else "")
          + (f"  in {workdir}" if workdir else ""))


class _AboveTheBar:
  """A stream for absl's handler that prints through ``tqdm.write`` (the bar is redrawn below)."""

  def __init__(self, stream):
    self.stream = stream

  def write(self, text: str) -> None:
    tqdm.write(text.rstrip("\n"), file=self.stream)

  def flush(self) -> None:
    self.stream.flush()


def _terminal_columns(stream) -> int:
  """The width of the terminal ``stream`` writes to; 0 where it is not a terminal or reports no size."""
  try:
    return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
  except (AttributeError, OSError, ValueError):
    return 0


def _in_notebook() -> bool:
  """Whether this process is a Jupyter kernel (IPython's, as tqdm.auto tells): its cells show a bar (a widget where
  ipywidgets is installed), though its stderr is no terminal."""
  ipython = sys.modules.get("IPython")
  shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
  try:
    return shell is not None and "IPKernelApp" in shell.config
  except TypeError:  # a config that is no mapping
    return False


class Progress:
  """Reports training progress.

  Args:
    bar: show a tqdm bar if stderr is a terminal or the process a Jupyter kernel (else: log lines).
    total: the step budget (None: unknown).
    initial: the step the run starts from.
  """

  def __init__(self, bar: bool, total: int | None, initial: int):
    self.total, self.bar, self._handler, self._stream = total, None, None, None
    # A terminal of no width (no stty size) would show nothing.
    if bar and (_terminal_columns(sys.stderr) > 0 or _in_notebook()):
      self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0, file=sys.stderr)
      self._handler = _console_handler or getattr(logging.get_absl_handler(), "python_handler", None)
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
