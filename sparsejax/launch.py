"""Starts P local processes of a script as one jax.distributed job.

  python -m sparsejax.launch -n 4 examples/train.py --dataset=synthetic ...

Each process gets ``--coordinator_address``, ``--num_processes`` and
``--process_id`` appended to its arguments, and its output lines are
prefixed with ``[rank i]``. If any process exits with an error, the others
are stopped and the launcher exits non-zero, naming the rank and its exit
status. On real hosts, run the script on each host with those three flags
yourself (or under SLURM / mpirun, where JAX detects them).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, b""):
    out.write(prefix + line.decode(errors="replace"))
    out.flush()


def launch(num_processes: int, command: list[str], *, port: int | None = None, grace_seconds: float = 5.0,
           env: dict | None = None) -> int:
  """Runs ``command`` P times as ranks of one job; returns the job's exit status.

  Args:
    num_processes: P.
    command: the program and its arguments (``python`` is prepended for a ``.py``).
    port: coordinator port on 127.0.0.1 (default: a free one).
    grace_seconds: after a failure, how long the others get to exit on
      SIGTERM before SIGKILL.
    env: extra environment variables for every rank.

  Returns:
    0 if every rank exited 0, else the first failing rank's status (or 1).
  """
  if command and command[0].endswith(".py"):
    command = [sys.executable, "-u"] + command
  address = f"127.0.0.1:{port or free_port()}"
  procs = []
  for rank in range(num_processes):
    args = command + [f"--coordinator_address={address}", f"--num_processes={num_processes}",
                      f"--process_id={rank}"]
    proc_env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=proc_env,
                         start_new_session=True)
    threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] ", sys.stdout), daemon=True).start()
    procs.append(p)

  def stop_all(sig=signal.SIGTERM):
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass

  def on_signal(signum, frame):
    stop_all()
    raise SystemExit(128 + signum)

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  status = 0
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        rank, code = failed[0]
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        sys.stderr.write(f"[launch] rank {rank} failed ({how}); stopping the other ranks\n")
        stop_all()
        deadline = time.time() + grace_seconds
        while time.time() < deadline and any(p.poll() is None for p in procs):
          time.sleep(0.05)
        stop_all(signal.SIGKILL)
        status = code if code > 0 else 1
        break
      if all(c == 0 for c in codes):
        break
      time.sleep(0.05)
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
    for p in procs:
      p.wait()
  return status


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m sparsejax.launch", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-n", "--num_processes", type=int, required=True)
  parser.add_argument("--port", type=int, default=None)
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  if not args.command:
    parser.error("give the script to run, e.g. examples/train.py --dataset=synthetic")
  if args.num_processes < 1:
    parser.error("-n must be >= 1")
  return launch(args.num_processes, args.command, port=args.port)


if __name__ == "__main__":
  sys.exit(main())
