"""One rank of a local job (:mod:`.launch`): its process, the tail of its output, and what they say of its failure.

A rank's output is read for the line that says why it failed (:func:`error_summary`), its process state for a stop
(:func:`process_state`), and of several failed ranks :func:`likely_cause` picks the one whose failure the others
follow from.
"""

import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading

_TAIL_LINES = 40  # lines of each rank's output kept in memory for failure reports
_PR_SET_PDEATHSIG = 1
# The line of a failed process's output that says why: a Python exception, an absl FATAL or ERROR line.
_ERROR_LINE = re.compile(r"^(\w[\w.]*(Error|Exception|Exit|Interrupt)\b|[FE]\d{4} )")
# Lines that start a failure report: a Python traceback, an absl FATAL or ERROR line.
FAILURE_START = re.compile(r"^(Traceback \(most recent call last\)|[FE]\d{4} )")
_ABSL_PREFIX = re.compile(r"^[FEWI]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] (\[\d+\] )?")
# The last line of a rank that a signal stopped after it saved a checkpoint (stopping.Interrupted).
STOPPED_LINE = re.compile(r"error: stopped by (SIGTERM|SIGINT) after step (\d+): checkpoint saved")
# Errors that say a peer was lost (gloo, the coordination service): consequences, not causes.
_LOST_PEER = re.compile(r"Connection reset by peer|Connection closed by peer|stopped sending heartbeats|"
                        r"another task died|unexpectedly tried to connect|Socket closed|Broken pipe", re.I)


def lost_peer(message: str) -> str | None:
  """The line of an error ``message`` that says a peer process was lost (a gloo connection closed, heartbeats
  stopped), without JAX's repeated ``Error dispatching computation:`` prefixes; None where no line says so."""
  for line in message.splitlines():
    if found := _LOST_PEER.search(line):
      line = re.sub(r"^(.*?Error dispatching computation: )+", "", line).strip()
      # Shortened, the words that say so kept (the launcher tells a lost peer from a cause by them).
      return line if len(line) <= 300 else f"{line[:200]} ... {found.group(0)}"
  return None


def signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return f"signal {signum}"


def describe_exit(code: int) -> str:
  """``'exit status 1'`` or ``'killed by signal 9 (SIGKILL)'`` for a Popen return code."""
  return f"killed by signal {-code} ({signal_name(-code)})" if code < 0 else f"exit status {code}"


def error_summary(lines) -> str:
  """The line of a process's output that best says why it failed (its last error line, else its last line).

  An absl log line loses its prefix, and JAX's fatal "Terminating process ..."
  preamble is cut down to the status it reports.
  """
  lines = [l.rstrip() for l in lines if l.strip() and not l.lstrip().startswith(("@ ", "***"))]
  for i in range(len(lines) - 1, -1, -1):
    if _ERROR_LINE.match(lines[i]):
      line = _ABSL_PREFIX.sub("", lines[i])
      line = line.split("absl::Status: ", 1)[-1]
      if line.endswith(":") and i + 1 < len(lines):  # a status continues on the next line
        line += " " + lines[i + 1].strip()
      return line
  return lines[-1] if lines else "(no output)"


def die_with_parent():
  """A ``preexec_fn`` that makes the child get SIGKILL when the launcher dies, however it dies."""
  if not sys.platform.startswith("linux"):
    return None
  libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not between fork and exec
  parent = os.getpid()

  def preexec():
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before prctl took effect
      os.kill(os.getpid(), signal.SIGKILL)

  return preexec


def process_state(pid: int) -> str | None:
  """The one-letter state of a process from ``/proc/PID/stat`` (R, S, D, T, t, Z...), None if unknown."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
  except OSError:
    return None
  # The command name (field 2) is in parentheses and may contain spaces.
  return stat[stat.rfind(b")") + 2:][:1].decode() or None


class Rank:
  """One child process, its log file and the recent lines of its output."""

  def __init__(self, rank: int, proc: subprocess.Popen, log_path: str):
    self.rank, self.proc, self.log_path = rank, proc, log_path
    self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    self.code: int | None = None  # return code once it has exited
    self.exited_at: float | None = None  # time.monotonic() when its exit was seen
    self.error_at: float | None = None  # ...when the first traceback or FATAL line of its output was
    self.held: list[str] = []  # console lines held back from its error on (see :mod:`.supervisor`)
    self.hold_until: float | None = None
    self.stopped_since: float | None = None
    self.reported_stopped = False
    self.pump: threading.Thread | None = None

  @property
  def running(self) -> bool:
    return self.code is None

  @property
  def failed_at(self) -> float:
    return min(t for t in (self.error_at, self.exited_at, float("inf")) if t is not None)

  def failure_kind(self) -> int:
    """How likely this rank's failure is the cause of a job's failure: 0 (surely) to 3 (a consequence)."""
    if self.running and self.stopped_since is not None:
      return 0  # stopped: its peers give up on it
    if self.code is not None and self.code < 0 and self.code != -signal.SIGABRT:
      return 1  # killed by an outside signal
    if self.code == -signal.SIGABRT or _LOST_PEER.search(error_summary(self.tail)):
      return 3  # JAX aborts a process whose peer is lost; gloo reports a closed connection
    return 2

  def signal(self, signum: int) -> None:
    """Sends ``signum`` to the rank's process group (it is a session leader)."""
    if self.code is None:
      try:
        os.killpg(self.proc.pid, signum)
      except (ProcessLookupError, PermissionError):
        pass


def likely_cause(candidates: list[Rank]) -> Rank:
  """Which of the failed ranks is the cause of the job's failure: the surest kind first, then the earliest."""
  return min(candidates, key=lambda r: (r.failure_kind(), r.failed_at, r.rank))
