"""Starts P local processes of a script as one jax.distributed job.

  sparsejax-launch -n 4 examples/train.py --dataset=synthetic --workdir=/tmp/run ...
  python -m sparsejax.distributed.launch -n 4 examples/train.py ...          # the same

Each process (rank) gets ``--coordinator_address``, ``--num_processes`` and
``--process_id`` appended to its arguments. On real hosts, run the script on
each host with those three flags yourself (or under SLURM / mpirun, where JAX
detects them).

Console and logs: rank 0's output goes to the console (every rank's, prefixed
``[rank i]``, with ``--console=all``); every rank's full output goes to
``LOG_DIR/rank{i}.log``. ``LOG_DIR`` is ``--log_dir``, else ``WORKDIR/logs``
for the command's ``--workdir``, else a new temporary directory (the launcher
prints where). Logs are appended to, so a resumed job keeps the earlier ones.

Failures: the first line printed after a rank dies names it, with its exit
status or signal and its log file, followed by the last lines of its output
(when they were not on the console). The other ranks are stopped within a few
seconds; their errors, consequences of the first, are summed up in one line
each (full text in their logs). A rank that is stopped (SIGSTOP, a debugger)
is named as not answering as soon as that is seen, and as the cause when its
peers give up on it.

Stopping: Ctrl-C or SIGTERM on the launcher sends SIGTERM to every rank (the
preemption notice that the training loop answers by saving a checkpoint and
exiting) and kills with SIGKILL the ranks still running after
``--stop_timeout`` seconds; a second Ctrl-C kills them at once. The ranks die
with the launcher, also when it is killed with SIGKILL (Linux
``PR_SET_PDEATHSIG``). A signal sent to the ranks themselves (a scheduler's
preemption) ends the job the same way: the launcher exits 128 + N.
"""

import argparse
import collections
import ctypes
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from sparsejax import flagfiles, rundirs

_TAIL_LINES = 40  # lines of each rank's output kept in memory for failure reports
_REPORT_LINES = 12  # of which at most this many are printed for the failing rank
# A console rank's error (traceback, FATAL line) is held back this long: if a peer's death shows up meanwhile, the
# error is a consequence (a killed process's sockets close before it can be reaped) and is not printed.
_HOLD_ERRORS_SECONDS = 2.0
_STOPPED_REPORT_SECONDS = 2.0  # a rank stopped this long is reported as not answering
_STATE_POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1
# The line of a failed process's output that says why: a Python exception, an absl FATAL or ERROR line.
_ERROR_LINE = re.compile(r"^(\w[\w.]*(Error|Exception|Exit|Interrupt)\b|[FE]\d{4} )")
# Lines that start a failure report: a Python traceback, an absl FATAL or ERROR line.
_FAILURE_START = re.compile(r"^(Traceback \(most recent call last\)|[FE]\d{4} )")
_ABSL_PREFIX = re.compile(r"^[FEWI]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] (\[\d+\] )?")
# The last line of a rank that a signal stopped after it saved a checkpoint (stopping.Interrupted).
_STOPPED_LINE = re.compile(r"error: stopped by (SIGTERM|SIGINT) after step (\d+): checkpoint saved")
# Errors that say a peer was lost (gloo, the coordination service): consequences, not causes.
_LOST_PEER = re.compile(r"Connection reset by peer|Connection closed by peer|stopped sending heartbeats|"
                        r"another task died|unexpectedly tried to connect|Socket closed|Broken pipe", re.I)


def free_port() -> int:
  """A TCP port that is free on 127.0.0.1 right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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


def _die_with_parent():
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


class _Rank:
  """One child process, its log file and the recent lines of its output."""

  def __init__(self, rank: int, proc: subprocess.Popen, log_path: str):
    self.rank, self.proc, self.log_path = rank, proc, log_path
    self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    self.code: int | None = None  # return code once it has exited
    self.exited_at: float | None = None  # time.monotonic() when its exit was seen
    self.error_at: float | None = None  # ...when the first traceback or FATAL line of its output was
    self.held: list[str] = []  # console lines held back from its error on (see _HOLD_ERRORS_SECONDS)
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


class _Console:
  """A console stream that drops what is written once its reader has gone (a closed pipe: ``... | head``): the
  job goes on, every rank's output still in its log file, instead of the launcher dying of a BrokenPipeError."""

  def __init__(self, stream):
    self.stream = stream

  def _call(self, method: str, *args) -> None:
    if self.stream is None:
      return
    try:
      getattr(self.stream, method)(*args)
    except BrokenPipeError:
      try:  # Python's own flush at exit would raise it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
      except (AttributeError, OSError, ValueError):
        pass
      self.stream = None

  def write(self, text: str) -> None:
    self._call("write", text)

  def writelines(self, lines) -> None:
    self._call("writelines", list(lines))

  def flush(self) -> None:
    self._call("flush")


class _Job:
  """The launcher's event loop: echoes output, notices deaths, stopped ranks and stop requests."""

  def __init__(self, ranks: list[_Rank], console: str, stop_timeout: float, failure_grace: float, out, err):
    self.ranks, self.console, self.out, self.err = ranks, console, out, err
    self.stop_timeout, self.failure_grace = stop_timeout, failure_grace
    self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
    self.stop_signals: list[int] = []  # signals received by the launcher, in order
    self.signals_handled = 0
    self.stop_requested_at: float | None = None
    self.kill_deadline: float | None = None
    self.cause: _Rank | None = None  # the rank whose failure ended the job
    self.cause_stopped = False  # ...by being stopped (its peers gave up on it)
    self.pending: list[_Rank] = []  # failed ranks whose errors say they lost a peer: waiting for the peer's
    self.next_state_poll = 0.0
    self.stop_file: str | None = None  # where the signal that stopped the launcher is written for the ranks
    self.how_to_continue = "run the same command again to continue"

  # --- Output ---------------------------------------------------------------------

  def pump(self, rank: _Rank, log) -> None:
    """Thread body: the rank's output, line by line, to its log file, its tail and the console queue."""
    with log:
      for raw in iter(rank.proc.stdout.readline, b""):
        log.write(raw)
        log.flush()
        line = raw.decode(errors="replace")
        rank.tail.append(line)
        if rank.error_at is None and _FAILURE_START.match(line):
          rank.error_at = time.monotonic()
        self.lines.put((rank.rank, line))

  def say(self, message: str) -> None:
    self.out.flush()
    self.err.write(f"[launch] {message}\n")
    self.err.flush()

  def on_console(self, rank: _Rank) -> bool:
    return self.console == "all" or rank.rank == 0

  def write(self, rank: _Rank, lines) -> None:
    prefix = f"[rank {rank.rank}] " if self.console == "all" else ""
    self.out.writelines(prefix + line for line in lines)

  def echo(self, batch, now: float) -> None:
    """Prints console ranks' lines; holds back a running rank's error, and drops the others' once the job failed."""
    for r, line in batch:
      rank = self.ranks[r]
      if not self.on_console(rank) or (self.cause is not None and rank is not self.cause):
        continue
      if rank.hold_until is None and self.cause is None and _FAILURE_START.match(line):
        rank.hold_until = now + _HOLD_ERRORS_SECONDS
      if rank.hold_until is not None:
        rank.held.append(line)
      else:
        self.write(rank, [line])
    self.out.flush()

  def release(self, rank: _Rank) -> None:
    """Prints what was held back of ``rank``'s output."""
    self.write(rank, rank.held)
    self.out.flush()
    rank.held, rank.hold_until = [], None

  def drain(self, timeout: float) -> list[tuple[int, str]]:
    batch = []
    try:
      batch.append(self.lines.get(timeout=timeout))
      while True:
        batch.append(self.lines.get_nowait())
    except queue.Empty:
      pass
    return batch

  # --- Events ---------------------------------------------------------------------

  def request_stop(self, signum: int, frame=None) -> None:
    """Signal handler: only records; the loop acts."""
    del frame
    self.stop_signals.append(signum)

  def handle_stop_requests(self, now: float) -> None:
    new = self.stop_signals[self.signals_handled:]
    if not new:
      return
    self.signals_handled += len(new)
    if self.stop_requested_at is None:
      self.stop_requested_at = now
      self.kill_deadline = now + self.stop_timeout
      self.say(f"{signal_name(new[0])}: asking every rank to save a checkpoint and exit (SIGTERM); ranks still "
               f"running in {self.stop_timeout:g} s are killed (Ctrl-C again: kill now)")
      self.note_stop_signal(new[0])
      self.signal_all(signal.SIGTERM)
      new = new[1:]
    if new and self.kill_deadline > now:
      self.say(f"{signal_name(new[-1])} again: killing every rank now (SIGKILL)")
      self.kill_deadline = now

  def note_stop_signal(self, signum: int) -> None:
    """Writes the stop's signal where the ranks read it: they get SIGTERM (the preemption notice every rank answers
    at the same step) and report the signal the user sent (Ctrl-C: SIGINT), not SIGTERM."""
    if self.stop_file is None:
      return
    try:
      with open(self.stop_file, "w") as f:
        f.write(signal.Signals(signum).name)
    except OSError:  # the ranks then name SIGTERM: nothing worse
      pass

  def signal_all(self, signum: int) -> None:
    for rank in self.ranks:
      rank.signal(signum)
      if signum != signal.SIGKILL:
        rank.signal(signal.SIGCONT)  # a stopped rank could not act on it

  def watch_states(self, now: float) -> None:
    """Names ranks that are stopped (SIGSTOP, a debugger): they stop answering their peers."""
    if now < self.next_state_poll:
      return
    self.next_state_poll = now + _STATE_POLL_SECONDS
    for rank in self.ranks:
      state = process_state(rank.proc.pid) if rank.running else None
      if state in ("T", "t"):
        rank.stopped_since = rank.stopped_since or now
        if not rank.reported_stopped and now - rank.stopped_since >= _STOPPED_REPORT_SECONDS:
          rank.reported_stopped = True
          self.say(f"rank {rank.rank} is not answering: its process {rank.proc.pid} is stopped "
                   f"(state {state}: SIGSTOP or a debugger) since {now - rank.stopped_since:.0f} s; its peers "
                   f"give up on it after their heartbeat timeout; log: {rank.log_path}")
      elif rank.stopped_since is not None:
        if rank.reported_stopped and rank.running and self.cause is None and self.stop_requested_at is None:
          self.say(f"rank {rank.rank} is running again")
        rank.stopped_since, rank.reported_stopped = None, False

  def reap(self, now: float) -> list[_Rank]:
    """Ranks that exited since the last call."""
    dead = []
    for rank in self.ranks:
      if rank.running and rank.proc.poll() is not None:
        rank.code, rank.exited_at = rank.proc.returncode, now
        dead.append(rank)
    return dead

  def on_failure(self, failed: list[_Rank], batch, now: float) -> None:
    """The job failed (``failed`` exited non-zero): names the cause first, stops the others.

    Of the lines in ``batch``, prints the cause's (they came before its death is reported).
    """
    candidates = failed + [r for r in self.ranks if r.running and (r.error_at or r.stopped_since)]
    self.cause = cause = likely_cause(candidates)
    self.cause_stopped = cause.failure_kind() == 0
    self.release(cause)  # its own last words come before its death
    self.echo([(r, l) for r, l in batch if r == cause.rank], now)
    for rank in self.ranks:
      if rank is not cause:
        rank.held, rank.hold_until = [], None
    if self.cause_stopped:
      if not cause.reported_stopped:
        self.say(f"rank {cause.rank} is not answering: its process {cause.proc.pid} is stopped (SIGSTOP or a "
                 f"debugger); its peers gave up on it; log: {cause.log_path}")
    elif cause.running:
      self.say(f"rank {cause.rank} failed: {error_summary(cause.tail)[:300]}; log: {cause.log_path}")
    else:
      self.say(f"rank {cause.rank} {'died' if cause.code < 0 else 'failed'} ({describe_exit(cause.code)}); "
               f"log: {cause.log_path}")
      if not self.on_console(cause) and cause.code != -signal.SIGKILL:
        lines = [l.rstrip("\n") for l in cause.tail if l.strip()][-_REPORT_LINES:]
        self.err.write("".join(f"  [rank {cause.rank}] {l}\n" for l in lines))
    others = ", ".join(str(r.rank) for r in self.ranks if r is not cause and r.running)
    if others:
      self.say(f"stopping the other ranks ({others}); their errors follow from rank {cause.rank}'s and are "
               "summed up in one line each")
    for rank in failed:
      if rank is not cause:
        self.report_consequence(rank)
    self.kill_deadline = now + self.failure_grace
    self.signal_all(signal.SIGTERM)

  def report_consequence(self, rank: _Rank) -> None:
    if rank.code == 0:
      self.say(f"rank {rank.rank} exited (exit status 0)")
      return
    killed_here = self.kill_deadline is not None and rank.code == -signal.SIGKILL
    what = "killed by the launcher" if killed_here else describe_exit(rank.code)
    after = ""
    if self.cause is not None:
      after = f" after rank {self.cause.rank} {'stopped answering' if self.cause_stopped else 'failed'}"
    self.say(f"rank {rank.rank} {what}{after}: {error_summary(rank.tail)[:300]}  (log: {rank.log_path})")

  # --- Loop -----------------------------------------------------------------------

  def step(self, batch, now: float) -> None:
    """One turn of the loop: ``batch`` holds the lines that arrived since the last."""
    self.handle_stop_requests(now)
    self.watch_states(now)
    dead = self.reap(now)  # after taking the lines: a death that caused them is visible now
    for rank in dead:
      if rank.pump is not None:
        rank.pump.join(timeout=1.0)  # its last lines
    if dead:
      batch = batch + self.drain(0)
    failed = [r for r in dead if r.code != 0]
    reported = []
    if self.cause is None and self.stop_requested_at is None:
      self.pending += failed
      if self.pending:
        candidates = self.pending + [r for r in self.ranks if r.running and (r.error_at or r.stopped_since)]
        best = likely_cause(candidates)
        # A rank that lost a peer waits a moment for the peer's own failure to show up.
        if best.failure_kind() < 3 or now >= best.failed_at + _HOLD_ERRORS_SECONDS:
          self.on_failure(self.pending, batch, now)
          batch = [(r, l) for r, l in batch if r != self.cause.rank]
          reported = self.pending
    self.echo(batch, now)
    for rank in self.ranks:
      if (rank.hold_until is not None and self.cause is None and rank not in self.pending
          and (now >= rank.hold_until or rank.code == 0)):
        self.release(rank)  # no peer died meanwhile: its own error
    if self.cause is not None or self.stop_requested_at is not None:
      for rank in dead:
        if rank is not self.cause and rank not in reported:
          self.report_consequence(rank)
    if self.kill_deadline is not None and now >= self.kill_deadline:
      self.signal_all(signal.SIGKILL)
      self.kill_deadline = float("inf")

  def run(self) -> int:
    while any(rank.running for rank in self.ranks):
      self.step(self.drain(timeout=0.05), time.monotonic())
    for rank in self.ranks:
      if rank.pump is not None:
        rank.pump.join(timeout=2.0)
    batch = self.drain(0)
    if self.pending and self.cause is None:
      self.on_failure(self.pending, batch, time.monotonic())
    self.echo(batch, time.monotonic())
    for rank in self.ranks:
      if rank.held:
        self.release(rank)
    return self.status()

  def status(self) -> int:
    if self.cause is not None:
      cause, logs = self.cause, os.path.dirname(self.cause.log_path)
      if self.cause_stopped:
        self.say(f"job failed: rank {cause.rank} stopped answering; logs: {logs}")
        return 1
      self.say(f"job failed: rank {cause.rank} {describe_exit(cause.code)}; logs: {logs}")
      return cause.code if cause.code > 0 else 128 - cause.code
    if self.stop_requested_at is not None:
      unclean = [f"rank {r.rank} {describe_exit(r.code)}" for r in self.ranks if r.code != 0]
      self.say("stopped" + (f"; not exited cleanly: {', '.join(unclean)}" if unclean else ": every rank exited")
               + ("" if self.how_to_continue.startswith("run the same") else f"; {self.how_to_continue}"))
      return 128 + self.stop_signals[-1]
    # A signal sent to the ranks themselves (a scheduler's preemption notice): they saved a checkpoint and exited
    # 0, as a finished job's do; their last line says which it was.
    stopped = next((m for r in self.ranks for m in map(_STOPPED_LINE.search, reversed(r.tail)) if m), None)
    if stopped is not None:
      self.say(f"stopped: the ranks were stopped by {stopped[1]} after step {stopped[2]} and saved a checkpoint; "
               f"{self.how_to_continue}")
      return 128 + signal.Signals[stopped[1]]
    return 0


def likely_cause(candidates: list[_Rank]) -> _Rank:
  """Which of the failed ranks is the cause of the job's failure: the surest kind first, then the earliest."""
  return min(candidates, key=lambda r: (r.failure_kind(), r.failed_at, r.rank))


def log_directory(command: list[str], log_dir: str | None, workdir: str | None = None) -> str:
  """Where the ranks' logs go: ``log_dir``, else ``WORKDIR/logs`` of the command's ``--workdir`` (or of
  ``workdir``, the one the launcher made for the ranks), else a temp dir."""
  if log_dir:
    return log_dir
  workdir = flagfiles.flag_value(command, "workdir") or workdir
  if workdir:
    return os.path.join(workdir, "logs")
  return os.path.join(tempfile.mkdtemp(prefix="sparsejax-launch-"), "logs")


_TRAINING_PROGRAMS = ("sparsejax-train", "train.py")  # the installed command, examples/train.py


def trains(command: list[str]) -> bool:
  """Whether ``command`` runs sparsejax's training command (``sparsejax-train`` or a ``train.py`` script)."""
  program = next((arg for arg in command if not os.path.basename(arg).startswith("python") and arg != "-u"), "")
  return os.path.basename(program) in _TRAINING_PROGRAMS


def new_workdir(command: list[str]) -> str | None:
  """A new run directory for a training command without ``--workdir`` (every rank must write to the same one, and
  each would make its own), else None.

  Raises:
    LaunchError: it cannot be made.
  """
  if not trains(command) or flagfiles.flag_value(command, "workdir"):
    return None
  try:
    return rundirs.new_run_directory(rundirs.dataset_of_command(command))
  except OSError as e:
    raise LaunchError(f"cannot make a work directory under {rundirs.runs_base()} ({e.strerror or e}): give the "
                      f"command --workdir, or set {rundirs.RUNS_ENV} to a directory where runs may go") from None


def launch(num_processes: int, command: list[str], *, port: int | None = None, log_dir: str | None = None,
           console: str = "rank0", stop_timeout: float = 30.0, failure_grace: float = 3.0, env: dict | None = None,
           out=None, err=None) -> int:
  """Runs ``command`` P times as the ranks of one job; returns the job's exit status.

  Args:
    num_processes: P.
    command: the program and its arguments (``python -u`` is prepended for a ``.py``).
    port: coordinator port on 127.0.0.1 (default: a free one).
    log_dir: directory of the ``rank{i}.log`` files (default: see :func:`log_directory`).
    console: ``"rank0"`` (rank 0's output on the console) or ``"all"`` (every rank's, prefixed).
    stop_timeout: after Ctrl-C / SIGTERM, seconds the ranks get to checkpoint and exit before SIGKILL.
    failure_grace: after a rank fails, seconds the others get to exit on SIGTERM before SIGKILL.
    env: extra environment variables for every rank.
    out: stream for the ranks' output (default ``sys.stdout``).
    err: stream for the launcher's own lines (default ``sys.stderr``).

  Returns:
    0 if every rank exited 0; else the failing rank's exit status (128 + N
    for a signal N), or 128 + N when the launcher was stopped by signal N.
  """
  if console not in ("rank0", "all"):
    raise ValueError(f"console must be 'rank0' or 'all', got {console!r}")
  out, err = _Console(out or sys.stdout), _Console(err or sys.stderr)
  if command and command[0].endswith(".py"):
    command = [sys.executable, "-u"] + command
  workdir = new_workdir(command)
  log_dir = os.path.abspath(log_directory(command, log_dir, workdir))
  try:
    os.makedirs(log_dir, exist_ok=True)
  except OSError as e:
    raise LaunchError(f"cannot create the log directory {log_dir} ({e.strerror or e})") from None
  address = f"127.0.0.1:{port or free_port()}"
  job = _Job([], console, stop_timeout, failure_grace, out, err)
  stop_fd, job.stop_file = tempfile.mkstemp(prefix="sparsejax-launch-stop-")
  os.close(stop_fd)
  proc_env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1", **{rundirs.LAUNCH_STOP_FILE_ENV: job.stop_file})
  if workdir:
    proc_env[rundirs.LAUNCH_WORKDIR_ENV] = workdir
    job.how_to_continue = f"add --workdir={workdir} to the command to continue"
    job.say(f"work directory: {workdir} (a new run; {job.how_to_continue})")
  preexec = _die_with_parent()
  # Handlers first: a Ctrl-C while the ranks start is a stop request like any other.
  in_main = threading.current_thread() is threading.main_thread()
  previous = {s: signal.signal(s, job.request_stop) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
  logs = []
  try:
    for r in range(num_processes):
      args = command + [f"--coordinator_address={address}", f"--num_processes={num_processes}", f"--process_id={r}"]
      path = os.path.join(log_dir, f"rank{r}.log")
      logs.append(open(path, "ab"))
      logs[-1].write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} sparsejax-launch: rank {r} of {num_processes}: "
                     f"{shlex.join(args)}\n".encode())
      proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=proc_env, start_new_session=True, preexec_fn=preexec)
      job.ranks.append(_Rank(r, proc, path))
    shown = "every rank" if console == "all" else "rank 0"
    job.say(f"{num_processes} ranks (pids {', '.join(str(r.proc.pid) for r in job.ranks)}), coordinator {address}; "
            f"{shown} on the console, each rank's output in {log_dir}/rank{{i}}.log")
    for rank, log in zip(job.ranks, logs):  # threads only now: no fork while they run
      rank.pump = threading.Thread(target=job.pump, args=(rank, log), daemon=True)
      rank.pump.start()
    logs = []  # the pumps close them
    return job.run()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for log in logs:
      log.close()
    try:
      os.unlink(job.stop_file)
    except OSError:
      pass
    for rank in job.ranks:  # only after an unexpected error in the launcher itself
      if rank.proc.poll() is None:
        rank.signal(signal.SIGKILL)
        rank.proc.wait()


class LaunchError(Exception):
  """The job could not be started (its message says why, in one line)."""


class _ArgumentParser(argparse.ArgumentParser):
  """argparse, but a usage error is one line (naming the flag) and exit status 2, as sparsejax-train's."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def argument_parser() -> argparse.ArgumentParser:
  """The launcher's command line: its own flags, then the command to run (``command``: the script and its
  arguments)."""
  parser = _ArgumentParser(prog="sparsejax-launch", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-n", "--num_processes", type=int, required=True, help="Number of ranks to start.")
  parser.add_argument("--port", type=int, default=None, help="Coordinator port on 127.0.0.1 (default: a free one).")
  parser.add_argument("--log_dir", default=None,
                      help="Directory of the rank{i}.log files (default: WORKDIR/logs for the command's --workdir, "
                      "else a new temporary directory).")
  parser.add_argument("--console", choices=("rank0", "all"), default="rank0",
                      help="Whose output goes to the console: rank 0's (default) or every rank's, prefixed.")
  parser.add_argument("--stop_timeout", type=float, default=30.0,
                      help="After Ctrl-C or SIGTERM, seconds the ranks get to save a checkpoint and exit before "
                      "they are killed (default: %(default)s).")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="The script and its arguments.")
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = argument_parser()
  args = parser.parse_args(argv)
  if args.command[:1] == ["--"]:
    args.command = args.command[1:]
  if not args.command:
    parser.error("give the script to run, e.g. examples/train.py --dataset=synthetic")
  if args.num_processes < 1:
    parser.error(f"-n must be >= 1, got {args.num_processes}")
  if args.stop_timeout < 0:
    parser.error(f"--stop_timeout must be >= 0, got {args.stop_timeout}")
  if args.port is not None:
    if not 1 <= args.port <= 65535:
      parser.error(f"--port must be in [1, 65535], got {args.port}")
    try:  # else rank 0 fails with a traceback that names no port ("Failed to start RPC server")
      with socket.socket() as s:
        s.bind(("127.0.0.1", args.port))
    except OSError as e:
      parser.error(f"--port={args.port}: cannot listen there ({e.strerror or e}): give another, or none for a free "
                   "one")
  program = args.command[0]
  if not program.endswith(".py") and shutil.which(program) is None:
    parser.error(f"cannot run {program!r}: no such program (give a sparsejax command such as sparsejax-train, or a "
                 "script.py)")
  try:
    return launch(args.num_processes, args.command, port=args.port, log_dir=args.log_dir, console=args.console,
                  stop_timeout=args.stop_timeout)
  except LaunchError as e:
    sys.stderr.write(f"sparsejax-launch: error: {e}\n")
    return 1


if __name__ == "__main__":
  sys.exit(main())
