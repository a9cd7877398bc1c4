"""What a command does before its first step: JAX's persistent compilation cache (on by default, per user) and the
work directory of a run started without ``--workdir`` (a new one per run)."""

import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from sparsejax import rundirs
from sparsejax.distributed import launch
from sparsejax.train import compilation_cache

# A run whose time is nearly all start-up: a few seconds.
TINY = ["--dataset=synthetic", "--synthetic_samples=600", "--synthetic_features=200", "--synthetic_labels=30",
        "--hidden_dims=8", "--active_k=30", "--batch_size=32", "--max_steps=4", "--eval_every=1000",
        "--eval_samples=32", "--log_every=2", "--checkpoint_every=1000", "--noprogress", "--learning_rate=0.01",
        "--validation_fraction=0"]


def _environment(tmp_path, **extra) -> dict:
  """The test's environment without the suite's cache: JAX's cache and sparsejax's runs in ``tmp_path``."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), SPARSEJAX_RUNS=str(tmp_path / "runs"), **extra)
  return env


def _train(installed_command, env, *args) -> subprocess.CompletedProcess:
  out = subprocess.run([installed_command("sparsejax-train"), *TINY, *args], capture_output=True, text=True,
                       timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def _entries(directory) -> list[str]:
  return [name for _, _, names in os.walk(directory) for name in names if name.endswith("-cache")]


def test_runs_fill_the_compilation_cache_they_are_given_and_none_turns_it_off(tmp_path, installed_command):
  """Issue 33: every run compiled its programs again (JAX's persistent cache was off unless set up by hand)."""
  env = _environment(tmp_path)
  _train(installed_command, env, f"--compilation_cache={tmp_path / 'cache'}")
  entries = _entries(tmp_path / "cache")
  assert any(name.startswith("jit_train_step-") for name in entries), entries
  # Small programs too (JAX's default skips compilations under 1 s: here, all of them).
  assert len(entries) >= 10, entries
  # none: nothing written, neither in the per-user default nor where JAX's own variable points.
  env = _environment(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env-cache"))
  _train(installed_command, env, "--compilation_cache=none")
  assert _entries(tmp_path / "xdg") == [] and _entries(tmp_path / "env-cache") == []
  # auto (the default): JAX's variable where it is set ...
  _train(installed_command, env)
  assert _entries(tmp_path / "env-cache") and _entries(tmp_path / "xdg") == []
  # ... else the per-user directory, private, one subdirectory per CPU.
  _train(installed_command, _environment(tmp_path))
  default = tmp_path / "xdg" / "sparsejax" / "jax" / compilation_cache.cpu_id()
  assert _entries(default) and stat.S_IMODE(default.stat().st_mode) == 0o700


def test_every_rank_of_a_multiprocess_run_caches_its_programs(tmp_path, installed_command):
  """JAX writes cache entries from process 0 only, and a CPU program's key is its process's own (it hashes the
  process's topology): rank 1 compiled all its programs again in every run, and rank 0 waited for it. A second run
  of the same job now compiles nothing on any rank."""
  env = _environment(tmp_path, JAX_DEBUG_LOG_MODULES="jax._src.compiler")
  cache = tmp_path / "cache"
  misses = []
  for run in ("first", "second"):
    workdir = tmp_path / run
    out = subprocess.run([sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", "2",
                          installed_command("sparsejax-train"), *TINY, f"--compilation_cache={cache}",
                          f"--workdir={workdir}"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    logs = [(workdir / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    misses.append([log.count("PERSISTENT COMPILATION CACHE MISS") for log in logs])
    assert all("Persistent compilation cache hit" in log or "CACHE MISS" in log for log in logs)  # logged at all
  assert min(misses[0]) >= 10, misses  # the first run compiled on both ranks ...
  assert misses[1] == [0, 0], misses  # ... and each rank wrote its own: the second compiled nothing


def test_a_run_killed_while_caching_does_not_stop_later_runs_from_caching(tmp_path, installed_command):
  """JAX writes a cache entry, then its access time; a run killed between the two left an entry without one, and
  every later write to the per-user cache failed in JAX's eviction (FileNotFoundError, a warning per program:
  nothing was cached again). Seen on this machine after the suite's kill tests. The default cache is bounded, so
  entries get access times, where filelock is installed (JAX needs it to bound a cache)."""
  pytest.importorskip("filelock", reason="without filelock the default cache is unbounded: no access-time files")
  env = _environment(tmp_path)
  _train(installed_command, env)
  default = tmp_path / "xdg" / "sparsejax" / "jax" / compilation_cache.cpu_id()
  orphan = sorted(default.glob("jit_train_step-*-atime"))[0]
  orphan.unlink()  # as a kill after the entry, before its time, leaves it
  before = set(_entries(default))
  out = _train(installed_command, env, "--hidden_dims=12")  # new shapes: new programs to cache
  assert "Error writing persistent compilation cache" not in out.stderr, out.stderr[-3000:]
  after = set(_entries(default))
  assert any(name.startswith("jit_train_step-") for name in after - before), sorted(after - before)
  assert orphan.exists() and all((default / name.replace("-cache", "-atime")).exists() for name in after)


def test_an_unusable_cache_directory_is_a_warning_not_a_failure(tmp_path, installed_command):
  (tmp_path / "file").write_text("")
  out = _train(installed_command, _environment(tmp_path), f"--compilation_cache={tmp_path / 'file' / 'cache'}")
  assert (f"sparsejax-train: warning: compilation cache {tmp_path / 'file' / 'cache'}: cannot write there (Not a "
          "directory); compiling without it") in out.stderr.splitlines()
  assert out.stdout.startswith("step 4 ")


def test_the_default_cache_must_be_the_user_s_own(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.delenv(compilation_cache.DIR_ENV, raising=False)
  directory, is_default = compilation_cache.resolve("auto")
  assert is_default and directory == str(tmp_path / "sparsejax" / "jax" / compilation_cache.cpu_id())
  assert compilation_cache.unusable(directory, private=True) is None
  os.chmod(directory, 0o777)  # others could put code there
  assert compilation_cache.unusable(directory, private=True) == "others can write to it"
  monkeypatch.setenv(compilation_cache.DIR_ENV, "/elsewhere")
  assert compilation_cache.resolve("auto") == ("/elsewhere", False)
  assert compilation_cache.resolve("NONE") == (None, False)
  assert compilation_cache.resolve("~/x") == (os.path.expanduser("~/x"), False)


def _work_directories(out: subprocess.CompletedProcess) -> tuple[str, str]:
  """The work directory a run names in its first log line and in its last line."""
  first = re.search(r"\] work directory: (\S+) \(a new run: add --workdir=(\S+) to the command to continue\)",
                    out.stderr.splitlines()[0])
  assert first and first[1] == first[2], out.stderr[:2000]
  last = re.fullmatch(r"step \d+ .*  in (\S+)", out.stdout.strip().splitlines()[-1])
  assert last, out.stdout
  return first[1], last[1]


def test_two_different_runs_without_a_workdir_both_run_each_in_its_own(tmp_path, installed_command):
  """Issue 33: every run without --workdir used /tmp/sparsejax, and the second, different experiment was refused
  ("was trained with other settings")."""
  env = _environment(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
  first = _work_directories(_train(installed_command, env))
  second = _work_directories(_train(installed_command, env, "--learning_rate=0.02"))
  assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]
  for workdir in (first[0], second[0]):
    assert os.path.dirname(workdir) == str(tmp_path / "runs")
    assert re.fullmatch(r"\d{8}T\d{6}Z-synthetic(-\d+)?", os.path.basename(workdir))
    assert os.path.exists(os.path.join(workdir, "metrics.jsonl"))
  # The one it names continues: the same command with --workdir.
  out = _train(installed_command, env, "--learning_rate=0.02", f"--workdir={second[0]}", "--max_steps=6")
  assert out.stdout.startswith("step 6 ") and out.stdout.strip().endswith(f"  in {second[0]}")
  assert sorted(os.listdir(tmp_path / "runs")) == sorted(os.path.basename(w) for w in (first[0], second[0]))


def test_a_refused_start_leaves_no_empty_run_directory(tmp_path, installed_command):
  (tmp_path / "train.txt").write_text("1 4 2\n0 9:1\n")  # feature 9 of 4
  out = subprocess.run([installed_command("sparsejax-train"), "--dataset=files", f"--train_file={tmp_path}/train.txt",
                        f"--test_file={tmp_path}/train.txt", "--noprogress"], capture_output=True, text=True,
                       timeout=300, env=_environment(tmp_path))
  assert out.returncode == 1 and "error: " in out.stderr.splitlines()[-1], out.stderr[-2000:]
  assert os.listdir(tmp_path / "runs") == []


def test_run_directories_are_new_and_sort_by_start(tmp_path):
  now = 1_750_000_000.0  # 2025-06-15 15:06:40 UTC
  first = rundirs.new_run_directory("icd10", str(tmp_path), now)
  same_second = rundirs.new_run_directory("icd10", str(tmp_path), now)
  assert os.path.basename(first) == "20250615T150640Z-icd10"
  assert os.path.basename(same_second) == "20250615T150640Z-icd10-2"  # never shared
  rundirs.new_run_directory("synthetic", str(tmp_path), now - 1)
  (tmp_path / "not-a-run").mkdir()
  assert rundirs.newest_run_directory(str(tmp_path)) == same_second
  assert rundirs.newest_run_directory(str(tmp_path / "none")) is None


def test_the_launcher_gives_its_ranks_one_new_work_directory(tmp_path, monkeypatch):
  """Each rank would have made its own; the launcher makes one for a training command without --workdir."""
  monkeypatch.setenv("SPARSEJAX_RUNS", str(tmp_path))
  (tmp_path / "run.json").write_text('{"data": {"dataset": "wordnet"}}')
  assert launch.trains(["/venv/bin/python3", "-u", "examples/train.py"]) and launch.trains(["sparsejax-train"])
  assert not launch.trains(["python", "-m", "sparsejax.netanalysis", "probe"])
  assert launch.new_workdir(["sparsejax-train", "--workdir=/w"]) is None
  assert launch.new_workdir(["python", "-m", "sparsejax.netanalysis", "probe"]) is None
  made = launch.new_workdir(["sparsejax-train", f"--config={tmp_path / 'run.json'}"])
  assert os.path.isdir(made) and made.endswith("Z-wordnet") and os.path.dirname(made) == str(tmp_path)
  assert launch.log_directory(["sparsejax-train"], None, made) == os.path.join(made, "logs")


@pytest.mark.parametrize("stopped_by", ["SIGINT", ""])
def test_a_rank_reports_the_signal_the_launcher_was_stopped_by(tmp_path, monkeypatch, stopped_by):
  """Issue 33: Ctrl-C on sparsejax-launch was reported by its ranks as "stopped by SIGTERM" (the preemption notice
  it sends them)."""
  from sparsejax.cli.train_run import _launcher_stop_signal

  (tmp_path / "stop").write_text(stopped_by)
  monkeypatch.setenv(rundirs.LAUNCH_STOP_FILE_ENV, str(tmp_path / "stop"))
  want = signal.SIGINT if stopped_by else signal.SIGTERM  # empty: a signal sent to the ranks themselves
  assert _launcher_stop_signal(signal.SIGTERM) == want
  assert _launcher_stop_signal(signal.SIGINT) == signal.SIGINT


STOP_REPORTER = """
import os, signal, sys, time
def on_term(signum, frame):
  with open(os.environ["SPARSEJAX_LAUNCH_STOP_FILE"]) as f:
    print("stopped by", f.read(), flush=True)
  sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
with open(sys.argv[1], "w") as f:
  f.write(str(os.getpid()))
while True:
  time.sleep(0.05)
"""


def test_the_launcher_tells_its_ranks_which_signal_stopped_it(tmp_path):
  (tmp_path / "rank.py").write_text(STOP_REPORTER)
  proc = subprocess.Popen([sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", "1",
                           f"--log_dir={tmp_path}", str(tmp_path / "rank.py"), str(tmp_path / "pid")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 60
  while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
    assert time.time() < deadline and proc.poll() is None, proc.communicate()[0]
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=60)
  assert "stopped by SIGINT" in out.splitlines(), out  # the rank got SIGTERM, and knows it was a Ctrl-C
  assert proc.returncode == 130


def test_the_launcher_names_runs_of_any_config_file(tmp_path):
  """Issue 35: sparsejax-launch read --config's dataset for the run's name and a deeply nested JSON file ended it in
  a RecursionError traceback; now it names the run by the default and the command names the file's problem."""
  (tmp_path / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
  (tmp_path / "files.json").write_text('{"data": {"dataset": "files"}}')
  for name, dataset in (("nested.json", "icd10"), ("files.json", "files"), ("missing.json", "icd10")):
    assert rundirs.dataset_of_command(["sparsejax-train", f"--config={tmp_path / name}"]) == dataset
