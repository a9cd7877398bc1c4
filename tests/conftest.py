"""Shared test helpers and options, as fixtures: the repository's paths, Python subprocesses, small training
configs, the fuzzing budget and a crash-proof runner of op cases.

Tests import the installed package (``--import-mode=importlib``; subprocesses
run ``python -P``), so helpers live here (and in references.py, put on sys.path below).
"""

import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# One persistent XLA compilation cache for the session, shared by every process it starts (they inherit the
# environment): the suite trains the same small networks in well over a hundred processes, and each one compiled
# them again (a 20-step run: about 5 s cold, 2.3-2.5 s warm, benchmarks/startup.py). New for every session, so a
# run never reads what another build compiled; removed at exit. Set before anything imports JAX.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE = tempfile.mkdtemp(prefix="sparsejax-tests-xla-cache-")
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_XLA_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
# Runs without --workdir go to new directories under SPARSEJAX_RUNS (else ~/sparsejax/runs): the session's own.
if "SPARSEJAX_RUNS" not in os.environ:
  _RUNS = tempfile.mkdtemp(prefix="sparsejax-tests-runs-")
  atexit.register(shutil.rmtree, _RUNS, ignore_errors=True)
  os.environ["SPARSEJAX_RUNS"] = _RUNS


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
  """The repository's root directory."""
  return ROOT


@pytest.fixture(scope="session")
def benchmark_module():
  """``benchmark_module(name)``: ``benchmarks/NAME.py`` (or the package ``harness``) imported as running the script
  imports it: with ``benchmarks/`` first on sys.path, where its harness is."""
  import importlib

  folder = str(ROOT / "benchmarks")
  if folder not in sys.path:
    sys.path.insert(0, folder)
  return importlib.import_module


def _run_python(*args: str, code: str | None = None, devices: int | None = None, env: dict | None = None,
                timeout: float = 300, cwd=None, check: bool = True, isolated: bool = True):
  """Runs ``python [-P] [-c code] args`` and returns the CompletedProcess (text).

  Args:
    args: the script and its arguments (or further arguments after ``code``).
    code: a program (dedented) to run with ``-c``.
    devices: virtual CPU devices for JAX (``--xla_force_host_platform_device_count``).
    env: extra environment variables.
    timeout: seconds.
    cwd: working directory.
    check: assert a zero exit status (showing the end of stderr otherwise).
    isolated: ``-P``: do not put the current directory first on the path (import the installed package).
  """
  full_env = dict(os.environ, **(env or {}))
  if devices:
    full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  command = [sys.executable, *(["-P"] if isolated else []), *(["-c", textwrap.dedent(code)] if code else []), *args]
  out = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
  if check:
    assert out.returncode == 0, out.stderr[-4000:]
  return out


@pytest.fixture(scope="session")
def run_python():
  """``run_python(*args, code=None, devices=None, env=None, timeout=300, cwd=None, check=True, isolated=True)``."""
  return _run_python


@pytest.fixture(scope="session")
def installed_command():
  """``installed_command(name)``: the path of a console script installed next to this Python."""
  def path(name: str) -> str:
    found = os.path.join(os.path.dirname(sys.executable), name)
    assert os.path.exists(found), f"{name} is not installed (pip install .)"
    return found
  return path


@pytest.fixture
def info_logs(caplog):
  """absl's INFO lines in caplog (absl's verbosity is process-wide: earlier tests in the process may have lowered
  it)."""
  from absl import logging as absl_logging
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  caplog.set_level("INFO")
  yield caplog
  absl_logging.set_verbosity(verbosity)


@pytest.fixture(scope="session")
def small_config():
  """A config that trains a small synthetic problem in a few seconds (override what a test needs)."""
  from sparsejax.config import Config
  from sparsejax.settings import override

  return override(
      Config(), dataset="synthetic", synthetic_samples=3000, synthetic_features=1000, synthetic_labels=200,
      hidden_dims=(32,), active_k=32, num_tables=8, batch_size=64, max_steps=40, eval_every=20, eval_samples=300,
      log_every=10, checkpoint_every=15, rebuild_period=7, rebuild_growth=1.3, rehash_period=25, reinsert="labels",
      progress=False, learning_rate=3e-3, candidates="lsh", validation_fraction=0.0, softmax="sampled",
      # Raw SimHash rows (the LSH defaults before issue 32): these runs re-insert rows into their tables, which
      # centred, MIPS-reduced tables do not allow.
      lsh_family="simhash", lsh_mips=False, table_policy="fifo")


TESTS = Path(__file__).parent
OP_CASES = TESTS / "op_cases.py"
# Test modules import shared helpers (references.py) from this directory.
sys.path.insert(0, str(TESTS))


def pytest_addoption(parser):
  parser.addoption("--fuzz-long", action="store_true", default=False,
                   help="fuzz with many more examples, from a random seed (for local runs; minutes)")


@pytest.fixture
def fuzz_long(request) -> bool:
  return request.config.getoption("--fuzz-long")


def run_op_cases(cases: list[dict], tmp_path: Path, timeout: float = 600) -> list[dict]:
  """Runs cases through tests/op_cases.py in subprocesses; a crash or hang fails only its case.

  Returns one outcome per case: ``{"i", "status", "message"}`` with status
  ``ok``, ``error`` (a due, well-named error), ``fail``, ``crash`` (the process
  died: signal or abort) or ``hang``. After a crash or hang the rest of the
  cases run in a new process.
  """
  path = tmp_path / "cases.json"
  path.write_text(json.dumps(cases))
  outcomes: dict[int, dict] = {}
  first = 0
  env = {k: v for k, v in os.environ.items() if k != "SPARSEJAX_NUM_THREADS"}
  while first < len(cases):
    # A script's own directory (tests/, with references.py) leads sys.path, not the source tree: the installed
    # sparsejax is imported.
    proc = subprocess.Popen([sys.executable, str(OP_CASES), str(path), str(first)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
      out, err = proc.communicate(timeout=timeout)
      hung = False
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
      hung = True
    started = None
    for line in out.splitlines():
      if line.startswith("start "):
        started = int(line.split()[1])
      elif line.startswith("{"):
        outcome = json.loads(line)
        outcomes[outcome["i"]] = outcome
        started = None
    if started is None:
      missing = [i for i in range(first, len(cases)) if i not in outcomes]
      if proc.returncode == 0 and not missing:
        break
      # Died between cases: blame the next case, or the last one if none is left.
      started = missing[0] if missing else len(cases) - 1
    status = "hang" if hung else "crash"
    outcomes[started] = {"i": started, "status": status,
                         "message": f"exit status {proc.returncode}; stderr: {err[-1500:]}"}
    first = started + 1
  return [outcomes.get(i, {"i": i, "status": "crash", "message": "never ran"}) for i in range(len(cases))]


@pytest.fixture
def op_cases(tmp_path, request):
  """Runs op cases (see run_op_cases), records tallies for the session summary, and returns the outcomes.

  `label` names the tally: a string, or a function of a case (one tally per value).
  """
  def run(cases, label, timeout=600):
    outcomes = run_op_cases(cases, tmp_path, timeout)
    tallies: dict[str, dict[str, int]] = {}
    for case, outcome in zip(cases, outcomes):
      tally = tallies.setdefault(label(case) if callable(label) else label, {})
      tally[outcome["status"]] = tally.get(outcome["status"], 0) + 1
    for name, tally in tallies.items():
      request.config.stash.setdefault(_TALLIES, []).append((name, sum(tally.values()), tally))
    return outcomes
  return run


_TALLIES = pytest.StashKey[list]()


@pytest.fixture
def record_cases(request):
  """``record_cases(label, tally)``: adds a fuzz test's ``{outcome: count}`` to the session summary."""
  def record(label: str, tally: dict[str, int]):
    request.config.stash.setdefault(_TALLIES, []).append((label, sum(tally.values()), dict(tally)))
  return record


def pytest_sessionfinish(session):
  """Under pytest-xdist, a worker hands its tallies to the controller, which prints the session summary."""
  workeroutput = getattr(session.config, "workeroutput", None)
  if workeroutput is not None:
    workeroutput["sparsejax_tallies"] = [list(t) for t in session.config.stash.get(_TALLIES, [])]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  """pytest-xdist's controller: a worker's tallies join the session summary."""
  tallies = getattr(node, "workeroutput", {}).get("sparsejax_tallies", [])
  node.config.stash.setdefault(_TALLIES, []).extend(tuple(t) for t in tallies)


def pytest_collection_modifyitems(config, items):
  """Marks the tests that slow_tests.txt lists ``slow``: ``pytest -m "not slow"`` is the unit tier."""
  from update_tiers import slow_test_ids  # from this directory, put on sys.path above

  slow = slow_test_ids()
  measuring = bool(os.environ.get("SPARSEJAX_TEST_DURATIONS"))
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
    if measuring:  # reaches the controller with the test's reports (pytest-xdist sends user_properties)
      item.user_properties.append((_MODULE_FIXTURES, module_fixtures(item)))


def module_fixtures(item) -> list[str]:
  """The module-scoped fixtures ``item`` uses (directly or through others), as ``"test file::name"``: set up once,
  their seconds are counted on the first test of the file that asks for one."""
  defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
  return sorted(f"{item.nodeid.split('::')[0]}::{name}" for name, chain in defs.items()
                if chain and chain[-1].scope == "module")


_MODULE_FIXTURES = "sparsejax_module_fixtures"
# Where SPARSEJAX_TEST_DURATIONS names a file: test id -> seconds, and test id -> its module-scoped fixtures.
_DURATIONS: dict[str, float] = {}
_FIXTURES: dict[str, list[str]] = {}


def pytest_runtest_logreport(report):
  """Each test's seconds (setup, call and teardown) and module-scoped fixtures, kept where SPARSEJAX_TEST_DURATIONS
  names a file: what sorts the tests into tiers. Under pytest-xdist the controller sees every worker's reports."""
  if os.environ.get("SPARSEJAX_TEST_DURATIONS"):
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    for key, value in report.user_properties:
      if key == _MODULE_FIXTURES:
        _FIXTURES[report.nodeid] = value


def pytest_unconfigure(config):
  path = os.environ.get("SPARSEJAX_TEST_DURATIONS")
  if path and _DURATIONS and not hasattr(config, "workerinput"):  # the controller (or a run without workers)
    with open(path, "w") as f:
      json.dump(dict(sorted(_DURATIONS.items())), f, indent=0)
    from update_tiers import fixtures_path

    with open(fixtures_path(path), "w") as f:
      json.dump(dict(sorted(_FIXTURES.items())), f, indent=0)


def pytest_terminal_summary(terminalreporter, config):
  tallies = config.stash.get(_TALLIES, [])
  if tallies:
    terminalreporter.section("cases tried (fuzzing)")
    for label, n, tally in tallies:
      terminalreporter.write_line(f"{label}: {n} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    total = sum(n for _, n, _ in tallies)
    terminalreporter.write_line(f"total: {total} cases")


FUZZ_LONG_FACTOR = 25  # --fuzz-long: this many times the examples, randomly seeded


@pytest.fixture
def fuzz_settings(request):
  """``fuzz_settings(n)``: hypothesis settings for n examples (derandomized), or 25 n random ones with --fuzz-long."""
  from hypothesis import HealthCheck, settings

  long = request.config.getoption("--fuzz-long")

  def make(max_examples: int):
    return settings(max_examples=max_examples * (FUZZ_LONG_FACTOR if long else 1), derandomize=not long,
                    deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

  return make
