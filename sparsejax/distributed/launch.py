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
import os
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
from sparsejax.distributed.ranks import Rank, die_with_parent
from sparsejax.distributed.supervisor import Supervisor


def free_port() -> int:
  """A TCP port that is free on 127.0.0.1 right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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
  job = Supervisor([], console, stop_timeout, failure_grace, out, err)
  stop_fd, job.stop_file = tempfile.mkstemp(prefix="sparsejax-launch-stop-")
  os.close(stop_fd)
  proc_env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1", **{rundirs.LAUNCH_STOP_FILE_ENV: job.stop_file})
  if workdir:
    proc_env[rundirs.LAUNCH_WORKDIR_ENV] = workdir
    job.how_to_continue = f"add --workdir={workdir} to the command to continue"
    job.say(f"work directory: {workdir} (a new run; {job.how_to_continue})")
  preexec = die_with_parent()
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
      job.ranks.append(Rank(r, proc, path))
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
