"""The supervisor of a local job's ranks (:mod:`.launch`): the launcher's event loop.

It echoes the ranks' output to the console (holding back a rank's error until it is clear that no peer's death
caused it), notices deaths, stopped ranks and stop requests, names the rank whose failure ended the job first and
stops the others, and returns the job's exit status.
"""

import os
import queue
import signal
import time

from sparsejax.distributed.ranks import (
  FAILURE_START,
  STOPPED_LINE,
  Rank,
  describe_exit,
  error_summary,
  likely_cause,
  process_state,
  signal_name,
)

_REPORT_LINES = 12  # of the lines of its output that a rank keeps, at most this many are printed for the failing rank
# A console rank's error (traceback, FATAL line) is held back this long: if a peer's death shows up meanwhile, the
# error is a consequence (a killed process's sockets close before it can be reaped) and is not printed.
_HOLD_ERRORS_SECONDS = 2.0
_STOPPED_REPORT_SECONDS = 2.0  # a rank stopped this long is reported as not answering
_STATE_POLL_SECONDS = 0.5


class Supervisor:
  """The launcher's event loop: echoes output, notices deaths, stopped ranks and stop requests."""

  def __init__(self, ranks: list[Rank], console: str, stop_timeout: float, failure_grace: float, out, err):
    self.ranks, self.console, self.out, self.err = ranks, console, out, err
    self.stop_timeout, self.failure_grace = stop_timeout, failure_grace
    self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
    self.stop_signals: list[int] = []  # signals received by the launcher, in order
    self.signals_handled = 0
    self.stop_requested_at: float | None = None
    self.kill_deadline: float | None = None
    self.cause: Rank | None = None  # the rank whose failure ended the job
    self.cause_stopped = False  # ...by being stopped (its peers gave up on it)
    self.pending: list[Rank] = []  # failed ranks whose errors say they lost a peer: waiting for the peer's
    self.next_state_poll = 0.0
    self.stop_file: str | None = None  # where the signal that stopped the launcher is written for the ranks
    self.how_to_continue = "run the same command again to continue"

  # --- Output ---------------------------------------------------------------------

  def pump(self, rank: Rank, log) -> None:
    """Thread body: the rank's output, line by line, to its log file, its tail and the console queue."""
    with log:
      for raw in iter(rank.proc.stdout.readline, b""):
        log.write(raw)
        log.flush()
        line = raw.decode(errors="replace")
        rank.tail.append(line)
        if rank.error_at is None and FAILURE_START.match(line):
          rank.error_at = time.monotonic()
        self.lines.put((rank.rank, line))

  def say(self, message: str) -> None:
    self.out.flush()
    self.err.write(f"[launch] {message}\n")
    self.err.flush()

  def on_console(self, rank: Rank) -> bool:
    return self.console == "all" or rank.rank == 0

  def write(self, rank: Rank, lines) -> None:
    prefix = f"[rank {rank.rank}] " if self.console == "all" else ""
    self.out.writelines(prefix + line for line in lines)

  def echo(self, batch, now: float) -> None:
    """Prints console ranks' lines; holds back a running rank's error, and drops the others' once the job failed."""
    for r, line in batch:
      rank = self.ranks[r]
      if not self.on_console(rank) or (self.cause is not None and rank is not self.cause):
        continue
      if rank.hold_until is None and self.cause is None and FAILURE_START.match(line):
        rank.hold_until = now + _HOLD_ERRORS_SECONDS
      if rank.hold_until is not None:
        rank.held.append(line)
      else:
        self.write(rank, [line])
    self.out.flush()

  def release(self, rank: Rank) -> None:
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

  def reap(self, now: float) -> list[Rank]:
    """Ranks that exited since the last call."""
    dead = []
    for rank in self.ranks:
      if rank.running and rank.proc.poll() is not None:
        rank.code, rank.exited_at = rank.proc.returncode, now
        dead.append(rank)
    return dead

  def on_failure(self, failed: list[Rank], batch, now: float) -> None:
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

  def report_consequence(self, rank: Rank) -> None:
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
    stopped = next((m for r in self.ranks for m in map(STOPPED_LINE.search, reversed(r.tail)) if m), None)
    if stopped is not None:
      self.say(f"stopped: the ranks were stopped by {stopped[1]} after step {stopped[2]} and saved a checkpoint; "
               f"{self.how_to_continue}")
      return 128 + signal.Signals[stopped[1]]
    return 0
