"""Shared test options and fixtures: the fuzzing budget and a crash-proof runner of op cases."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def pytest_terminal_summary(terminalreporter, config):
  tallies = config.stash.get(_TALLIES, [])
  if tallies:
    terminalreporter.section("op cases tried (fuzzing)")
    for label, n, tally in tallies:
      terminalreporter.write_line(f"{label}: {n} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    total = sum(n for _, n, _ in tallies)
    terminalreporter.write_line(f"total: {total} cases")
