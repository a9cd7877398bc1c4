"""The filters that keep orbax quiet in the log and on stderr: its INFO lines, its threads' reports of a full disk,
the closed event loop of a save that failed (reported once, as :class:`sparsejax.workdir.checkpoint.CheckpointError`)
and its warnings about read-only directories."""

import contextlib
import logging as pylogging
import sys
import traceback

from absl import logging

from sparsejax.workdir.seals import is_full_disk


class _QuietOrbax:
  """absl's logger's filter (whichever handler prints: absl's under the commands, Python's under a script): orbax
  logs every step of every save at INFO, and a save that a full disk stops in each of its threads, with a
  traceback (4-5 of them, about 350 lines); :class:`~sparsejax.workdir.checkpoint.CheckpointError` reports that in
  one line."""

  def filter(self, record) -> bool:
    if "orbax" not in record.pathname:
      return True
    if record.levelno <= pylogging.INFO:
      return False
    error = record.exc_info[1] if record.exc_info else None
    return not (is_full_disk(record.getMessage()) or (error is not None and is_full_disk(error)))


def quiet_orbax_logs() -> None:
  """Keeps orbax's INFO lines and its threads' reports of a full disk out of the log (other warnings and errors
  still show), and the closed event loop of a save that failed out of stderr (:func:`_drop_closed_loop_reports`)."""
  logger = logging.get_absl_logger()
  if not any(isinstance(f, _QuietOrbax) for f in logger.filters):
    logger.addFilter(_QuietOrbax())
  if not getattr(sys.unraisablehook, "drops_closed_loop_reports", False):
    sys.unraisablehook = _drop_closed_loop_reports(sys.unraisablehook)


def _drop_closed_loop_reports(hook):
  """``hook`` (a ``sys.unraisablehook``) but for TensorStore's writes that end after orbax closed the event loop of
  their failed save (a full disk): each calls ``loop.call_soon_threadsafe`` from C++, which raises "Event loop is
  closed" as an unraisable error (``Exception ignored in: None`` and a traceback, before or after the one line that
  reports the failure). Any other report goes to ``hook``."""

  def unraisable(report) -> None:
    frames = traceback.extract_tb(report.exc_traceback) if report.exc_traceback is not None else []
    if not (report.object is None and isinstance(report.exc_value, RuntimeError)
            and str(report.exc_value) == "Event loop is closed"
            and [frame.name for frame in frames[-2:]] == ["call_soon_threadsafe", "_check_closed"]):
      hook(report)

  unraisable.drops_closed_loop_reports = True
  return unraisable


@contextlib.contextmanager
def quiet(level: int = pylogging.ERROR):
  """Raises absl's threshold (a Python logging level) for a while: orbax warns about read-only directories."""
  logger = logging.get_absl_logger()
  previous = logger.level
  logger.setLevel(max(level, previous))
  try:
    yield
  finally:
    logger.setLevel(previous)
