"""The launcher (sparsejax.distributed.launch): logs, failure reports, stopping, orphans. Dummy ranks, no JAX."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from sparsejax import flagfiles
from sparsejax.distributed import launch, ranks

# A stand-in for a training rank. Ranks hold an flock on their own file for
# their lifetime; a peer's death is noticed when its lock can be taken, as a
# killed rank's socket closes and its peers' next collective fails.
RANK = textwrap.dedent("""
    import fcntl, os, signal, sys, time
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    rank, size, mode = int(args["process_id"]), int(args["num_processes"]), args["mode"]
    run = args["workdir"]
    me = open(os.path.join(run, f"alive{rank}"), "w")
    fcntl.flock(me, fcntl.LOCK_EX)
    open(os.path.join(run, f"pid{rank}"), "w").write(str(os.getpid()))
    print(f"rank {rank} of {size} at {args['coordinator_address']} starts", flush=True)

    def peer_died():
      for r in range(size):
        if r != rank and os.path.exists(os.path.join(run, f"pid{r}")):
          with open(os.path.join(run, f"alive{r}"), "w") as f:
            try:
              fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
              return r
            except BlockingIOError:
              pass
      return None

    def deep(n, error=RuntimeError(f"rank {rank}: collective failed: Connection reset by peer")):
      if n == 0:  # a long traceback, as a failing collective gives
        raise error
      deep(n - 1, error)

    if mode == "checkpoint_on_sigterm":
      def on_term(signum, frame):
        print(f"rank {rank}: checkpoint saved at step 7", flush=True)
        sys.exit(0)
      signal.signal(signal.SIGTERM, on_term)
    else:  # as JAX's preemption notifier does in a multi-process rank
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for step in range(10**6):
      if mode == "ok" and step == 3:
        print(f"rank {rank} done", flush=True)
        sys.exit(0)
      if mode == "preempted" and step == 3:  # as sparsejax-train's ranks end on a signal sent to them
        print(f"sparsejax-train: error: stopped by SIGTERM after step 3: checkpoint saved in {run}/checkpoints; "
              "run the same command again to continue", flush=True)
        sys.exit(0)
      if rank == 1 and step == 5:
        if mode == "kill":  # a killed process's sockets close a while before it can be reaped
          fcntl.flock(me, fcntl.LOCK_UN)
          time.sleep(0.5)
          os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
          deep(3, ValueError("rank 1: bad data in line 7"))
        if mode == "stop":
          os.kill(os.getpid(), signal.SIGSTOP)
      if rank != 1 and mode in ("kill", "raise") and peer_died() is not None:
        deep(30)
      if rank == 0 and mode == "raise0" and step == 5:
        raise ValueError("rank 0: bad data in line 7")
      if rank == 1 and mode == "raise0" and peer_died() is not None:
        deep(30)
      if rank != 1 and mode == "stop" and step == 5 + 100:  # a heartbeat timeout of ~5 s
        print("F0101 client.h:80] Terminating process: UNAVAILABLE: tasks stopped sending heartbeats: 1", flush=True)
        os.abort()
      print(f"rank {rank} step {step}", flush=True)
      time.sleep(0.05)
""")


@pytest.fixture
def rank_script(tmp_path):
  path = tmp_path / "rank.py"
  path.write_text(RANK)
  return str(path)


def _start(script, workdir, mode, n=2, *launcher_args):
  cmd = [sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", str(n), *launcher_args, script,
         f"--mode={mode}", f"--workdir={workdir}"]
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(script, workdir, mode, n=2, *launcher_args, timeout=60):
  proc = _start(script, workdir, mode, n, *launcher_args)
  out, _ = proc.communicate(timeout=timeout)
  return proc.returncode, out


def _launch_lines(out):
  return [l for l in out.splitlines() if l.startswith("[launch]")]


def _wait_for(path, timeout=30):
  deadline = time.time() + timeout
  while not os.path.exists(path) or not open(path).read():
    assert time.time() < deadline, f"{path} never appeared"
    time.sleep(0.05)
  return int(open(path).read())


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return ranks.process_state(pid) not in (None, "Z")


def test_rank0_on_console_every_rank_in_its_log(tmp_path, rank_script):
  code, out = _run(rank_script, tmp_path, "ok", 3)
  assert code == 0, out
  assert "rank 0 done" in out and "rank 1" not in out.replace("[launch]", "") and "rank 2 step" not in out
  assert not re.search(r"^\[rank", out, re.M)  # rank 0 alone: no prefix
  for r in range(3):
    log = (tmp_path / "logs" / f"rank{r}.log").read_text()
    assert f"rank {r} of 3 at 127.0.0.1:" in log and f"rank {r} done" in log
  assert f"{tmp_path}/logs/rank{{i}}.log" in _launch_lines(out)[0]


def test_a_closed_console_leaves_the_job_running(tmp_path, rank_script):
  """`sparsejax-launch ... | head`: the launcher died of a BrokenPipeError at its next line, taking the ranks."""
  cmd = [sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", "2", rank_script, "--mode=ok",
         f"--workdir={tmp_path}"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  proc.stdout.close()  # the reader is gone before the first line
  err = proc.stderr.read()
  assert proc.wait(timeout=60) == 0, err
  assert "Traceback" not in err and "[launch] 2 ranks" in err
  for r in range(2):  # every rank ran to its end, its output in its log
    assert f"rank {r} done" in (tmp_path / "logs" / f"rank{r}.log").read_text()


def test_console_all_prefixes_and_log_dir_option(tmp_path, rank_script):
  logs = tmp_path / "elsewhere"
  code, out = _run(rank_script, tmp_path, "ok", 2, "--console=all", f"--log_dir={logs}")
  assert code == 0, out
  assert "[rank 0] rank 0 done" in out and "[rank 1] rank 1 done" in out
  assert (logs / "rank1.log").exists() and not (tmp_path / "logs").exists()
  # A second run appends to the logs (a resumed job keeps the first one's).
  _run(rank_script, tmp_path, "ok", 2, f"--log_dir={logs}")
  assert (logs / "rank1.log").read_text().count("rank 1 done") == 2


def test_killed_rank_is_named_first_and_survivor_traceback_is_short(tmp_path, rank_script):
  """Old launcher: the survivor's 30-frame traceback came before 'rank 1 failed'."""
  code, out = _run(rank_script, tmp_path, "kill")
  assert code == 128 + signal.SIGKILL, out
  first = next(l for l in out.splitlines()[1:] if not l.startswith("rank 0 "))
  assert first == f"[launch] rank 1 died (killed by signal 9 (SIGKILL)); log: {tmp_path}/logs/rank1.log", out
  assert "Traceback" not in out and out.count('File "') == 0  # rank 0's traceback: one summary line
  summary = [l for l in _launch_lines(out) if l.startswith("[launch] rank 0 ")]
  assert len(summary) == 1 and "collective failed" in summary[0] and "rank0.log" in summary[0], out
  assert out.splitlines()[-1].startswith("[launch] job failed: rank 1 killed by signal 9")
  assert "Traceback" in (tmp_path / "logs" / "rank0.log").read_text()  # in full in its log


def test_failing_rank_error_is_shown_with_its_tail(tmp_path, rank_script):
  code, out = _run(rank_script, tmp_path, "raise")
  assert code == 1, out
  lines = _launch_lines(out)
  assert lines[1] == f"[launch] rank 1 failed (exit status 1); log: {tmp_path}/logs/rank1.log", out
  assert "[rank 1] ValueError: rank 1: bad data in line 7" in out  # its last lines, under the naming line
  assert out.index("[launch] rank 1 failed") < out.index("[rank 1] ValueError")
  assert "Traceback" not in out.replace("[rank 1] Traceback", "")  # not rank 0's


def test_console_rank_own_error_is_shown_in_full(tmp_path, rank_script):
  code, out = _run(rank_script, tmp_path, "raise0")
  assert code == 1, out
  assert "Traceback (most recent call last)" in out and "ValueError: rank 0: bad data in line 7" in out
  assert out.index("ValueError: rank 0: bad") < out.index("[launch] rank 0 failed (exit status 1)")
  assert "collective failed" not in out.split("[launch] rank 0 failed")[0]
  assert "[launch] rank 1 exited with" not in out


def test_stopped_rank_is_named_as_not_answering(tmp_path, rank_script):
  """Old launcher: 'rank 0 failed (signal 6)' when rank 1 was the one stopped."""
  proc = _start(rank_script, tmp_path, "stop")
  try:
    out, _ = proc.communicate(timeout=60)
  finally:
    pid = _wait_for(tmp_path / "pid1")
    if _alive(pid):
      os.kill(pid, signal.SIGKILL)
  lines = _launch_lines(out)
  assert lines[1].startswith("[launch] rank 1 is not answering: its process") and "stopped" in lines[1], out
  assert "rank 0 failed" not in out and "rank 0 died" not in out
  assert "rank 0 killed by signal 6 (SIGABRT) after rank 1 stopped answering" in out
  assert lines[-1].startswith("[launch] job failed: rank 1 stopped answering"), out
  assert proc.returncode == 1


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_lets_ranks_checkpoint_then_exit(tmp_path, rank_script, signum):
  proc = _start(rank_script, tmp_path, "checkpoint_on_sigterm", 2, "--stop_timeout=20")
  pids = [_wait_for(tmp_path / f"pid{r}") for r in range(2)]
  time.sleep(0.5)
  t0 = time.time()
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=30)
  assert time.time() - t0 < 5, out
  assert proc.returncode == 128 + signum
  assert "rank 0: checkpoint saved at step 7" in out
  assert "rank 1: checkpoint saved" in (tmp_path / "logs" / "rank1.log").read_text()
  assert out.splitlines()[-1] == "[launch] stopped: every rank exited", out
  assert not any(map(_alive, pids))


def test_ranks_that_ignore_sigterm_are_killed_after_the_stop_timeout(tmp_path, rank_script):
  proc = _start(rank_script, tmp_path, "ignore_sigterm", 2, "--stop_timeout=2")
  pids = [_wait_for(tmp_path / f"pid{r}") for r in range(2)]
  t0 = time.time()
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=30)
  assert 2 <= time.time() - t0 < 6, out
  assert proc.returncode == 130 and not any(map(_alive, pids))
  # A second Ctrl-C does not wait for the timeout.
  (tmp_path / "again").mkdir()
  proc = _start(rank_script, tmp_path / "again", "ignore_sigterm", 2, "--stop_timeout=60")
  pids = [_wait_for(tmp_path / "again" / f"pid{r}") for r in range(2)]
  t0 = time.time()
  proc.send_signal(signal.SIGINT)
  time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=30)
  assert time.time() - t0 < 4 and "killing every rank now" in out, out
  assert not any(map(_alive, pids))


def test_kill_9_on_the_launcher_leaves_no_orphans(tmp_path, rank_script):
  """Old launcher: the ranks kept running (new sessions, nothing tied them to it)."""
  proc = _start(rank_script, tmp_path, "sleep", 3)
  pids = [_wait_for(tmp_path / f"pid{r}") for r in range(3)]
  assert all(map(_alive, pids))
  proc.kill()
  proc.wait()
  deadline = time.time() + 5
  while any(map(_alive, pids)) and time.time() < deadline:
    time.sleep(0.05)
  assert not any(map(_alive, pids))


def test_helpers():
  cmd = ["x.py", "--workdir=/a", "--other", "--workdir", "/b", "-n=3"]
  assert flagfiles.flag_value(cmd, "workdir") == "/b" and flagfiles.flag_value(cmd, "n") == "3"
  assert flagfiles.flag_value(cmd, "missing") is None
  assert launch.log_directory(["x.py", "--workdir=/w"], None) == "/w/logs"
  assert launch.log_directory(["x.py", "--workdir=/w"], "/l") == "/l"
  assert launch.log_directory(["x.py"], None).startswith(os.path.join(os.path.realpath("/tmp"), "")) or True
  assert ranks.describe_exit(-9) == "killed by signal 9 (SIGKILL)" and ranks.describe_exit(2) == "exit status 2"
  tail = ["step 1\n", "Traceback (most recent call last):\n", '  File "x", line 1\n', "ValueError: bad x\n",
          "\n"]
  assert ranks.error_summary(tail) == "ValueError: bad x"
  fatal = ["F1123 00:32:00.187509   31980 client.h:80] Terminating process because the JAX distributed service "
           "detected fatal errors. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
           "heartbeats):\n", "1\n", "The tasks have crashed.\n", "*** Check failure stack trace: ***\n",
           "    @     0x7f1c2da40634  absl::LogMessage\n"]
  assert ranks.error_summary(fatal) == ("UNAVAILABLE: The following tasks are unhealthy (stopped sending "
                                        "heartbeats): 1")
  assert ranks.process_state(os.getpid()) in ("R", "S")
  # A survivor's error where a peer died (as gloo reported it over emulated hosts): the line that says so, bare.
  gloo = ("INTERNAL: Error dispatching computation: Error dispatching computation: Gloo all-reduce failed: "
          "[external/gloo/gloo/transport/tcp/pair.cc:538] Read error [10.77.0.2]:28390: Connection reset by peer")
  assert ranks.lost_peer("Traceback\n" + gloo + "\n") == ("Gloo all-reduce failed: [external/gloo/gloo/transport/"
                                                           "tcp/pair.cc:538] Read error [10.77.0.2]:28390: "
                                                           "Connection reset by peer")
  assert ranks.lost_peer("INTERNAL: Error dispatching computation: out of memory") is None


def test_ranks_stopped_by_a_signal_sent_to_them_end_the_job_as_stopped(tmp_path, rank_script):
  """A fresh-user review: ranks preempted by a scheduler (the signal sent to them, not to the launcher) save a
  checkpoint and exit 0, and the launcher exited 0 with no line, as if the job had finished."""
  code, out = _run(rank_script, tmp_path, "preempted", 2)
  assert code == 128 + signal.SIGTERM, out
  assert _launch_lines(out)[-1] == ("[launch] stopped: the ranks were stopped by SIGTERM after step 3 and saved a "
                                    "checkpoint; run the same command again to continue"), out


def test_helpers_read_flagfiles(tmp_path):
  """The launcher put a --workdir given in a --flagfile nowhere: its logs went to a temporary directory."""
  (tmp_path / "inner.flags").write_text("# where\n--workdir=/from/inner\n")
  (tmp_path / "run.flags").write_text(f"--dataset=synthetic\n--flagfile={tmp_path / 'inner.flags'}\n")
  assert launch.log_directory(["x.py", f"--flagfile={tmp_path / 'run.flags'}"], None) == "/from/inner/logs"
  command = ["x.py", f"--flagfile={tmp_path / 'run.flags'}", "--workdir=/later"]
  assert flagfiles.flag_value(command, "workdir") == "/later"


def test_cli_errors(tmp_path):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    (tmp_path / "file").write_text("")
    for argv, fragment in (
        (["-n", "0", "x.py"], "-n must be >= 1"), (["-n", "2"], "give the script"),
        (["-n", "2", "--console=some", "x.py"], "invalid choice"),
        (["-n", "2", "--port=99999", "x.py"], "--port must be in [1, 65535], got 99999"),
        (["-n", "2", f"--port={port}", "x.py"], f"--port={port}: cannot listen there"),
        (["-n", "2", "no_such_program_xyz"], "cannot run 'no_such_program_xyz': no such program")):
      out = subprocess.run([sys.executable, "-P", "-m", "sparsejax.distributed.launch", *argv], capture_output=True,
                           text=True)
      assert out.returncode == 2 and fragment in out.stderr and "Traceback" not in out.stderr, out.stderr
  # A log directory that cannot be made: one line naming it (was a traceback from os.makedirs).
  out = subprocess.run([sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", "2",
                        f"--log_dir={tmp_path}/file/logs", "x.py"], capture_output=True, text=True)
  assert out.returncode == 1 and out.stderr.strip().splitlines() == [
      f"sparsejax-launch: error: cannot create the log directory {tmp_path}/file/logs (Not a directory)"], out.stderr
