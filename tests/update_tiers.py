"""Writes tests/slow_tests.txt from measured test durations: the slow tier is the costliest tests, as few as leave the
rest (the unit tier, ``pytest -m "not slow"``) within a budget of test seconds.

Measure the whole suite as CI runs it (or the unit tier alone: the tests not measured keep their tier), then update::

  SPARSEJAX_TEST_DURATIONS=/tmp/durations.json pytest -n 2 --dist loadfile
  python tests/update_tiers.py /tmp/durations.json            # --budget 150: test seconds left in the unit tier

The measuring also writes ``/tmp/durations.fixtures.json``: each test's module-scoped fixtures. A fixture's setup
(a trained run that a file's tests share) is counted on whichever of its users runs first, so tests are moved by
those groups: tests joined by module-scoped fixtures go to a tier together (moving the first user alone would move
the setup onto the next one: a unit tier tiered test by test measured 548 test seconds against 149
predicted, 2026-12-07).

The budget is the sum of the unit tier's tests' seconds (setup, call and teardown as measured on 2 busy workers):
150 test seconds on two workers ran in 2 min 45 s of wall time on 2026-11-29 (178: 3 min 2 s; workers start, files
do not split evenly).
"""

import argparse
import json
import pathlib

SLOW_TESTS = pathlib.Path(__file__).parent / "slow_tests.txt"


def slow_test_lines(path: pathlib.Path = SLOW_TESTS) -> dict[str, str]:
  """``{test id: its line}`` of the tests that ``path`` (slow_tests.txt) lists (``#`` starts a comment)."""
  if not path.exists():
    return {}
  lines = ((line.split("#", 1)[0].strip(), line) for line in path.read_text().splitlines())
  return {test: line for test, line in lines if test}


def slow_test_ids(path: pathlib.Path = SLOW_TESTS) -> set[str]:
  """The test ids that ``path`` (slow_tests.txt) lists (``#`` starts a comment)."""
  return set(slow_test_lines(path))


def fixtures_path(durations_path: str) -> str:
  """Where the measuring writes the tests' module-scoped fixtures, beside ``durations_path`` (``X.json``:
  ``X.fixtures.json``)."""
  path = pathlib.Path(durations_path)
  return str(path.with_name(path.stem + ".fixtures.json"))


def groups(durations: dict[str, float], fixtures: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
  """The tests that go to a tier together: those joined by module-scoped fixtures (two tests that share one, and
  so on through the others they share; the key: the smallest fixture name), else each test alone (its key: its
  id). Without ``fixtures``, every test alone."""
  parent: dict[str, str] = {}  # union-find over fixture names

  def root(name: str) -> str:
    while parent.setdefault(name, name) != name:
      parent[name] = parent[parent[name]]
      name = parent[name]
    return name

  for shared in (fixtures or {}).values():
    for name in shared[1:]:
      a, b = root(shared[0]), root(name)
      parent[max(a, b)] = min(a, b)
  out: dict[str, list[str]] = {}
  for test in durations:
    shared = (fixtures or {}).get(test) or []
    out.setdefault(root(shared[0]) if shared else test, []).append(test)
  return out


def slow_tier(durations: dict[str, float], budget: float, fixtures: dict[str, list[str]] | None = None) -> list[str]:
  """The costliest groups of tests (:func:`groups`), as few as leave the others' seconds within ``budget`` (ids in
  the order of their group's time, then of their own)."""
  by_group = groups(durations, fixtures)
  cost = {key: sum(durations[t] for t in tests) for key, tests in by_group.items()}
  left, slow = sum(durations.values()), []
  for key in sorted(cost, key=lambda key: (-cost[key], key)):
    if left <= budget:
      break
    slow.extend(sorted(by_group[key], key=lambda test: (-durations[test], test)))
    left -= cost[key]
  return slow


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("durations", help="the JSON that SPARSEJAX_TEST_DURATIONS named: {test id: seconds}")
  parser.add_argument("--budget", type=float, default=150.0, help="test seconds left in the unit tier")
  args = parser.parse_args()
  durations = json.loads(pathlib.Path(args.durations).read_text())
  fixtures_file = pathlib.Path(fixtures_path(args.durations))
  fixtures = json.loads(fixtures_file.read_text()) if fixtures_file.exists() else None
  # The slow tests not measured (a unit tier's durations) keep their tier and their line.
  kept = {test: line for test, line in slow_test_lines().items() if test not in durations}
  slow = slow_tier(durations, args.budget, fixtures)
  fast = sum(durations.values()) - sum(durations[t] for t in slow)
  SLOW_TESTS.write_text(
      "# The slow tier: left out of `pytest -m \"not slow\"` (tests/conftest.py marks them). Written by\n"
      f"# tests/update_tiers.py from measured durations: {len(slow)} of {len(durations)} tests measured, "
      f"{sum(durations.values()) - fast:.0f} of {sum(durations.values()):.0f} test seconds, and {len(kept)} not "
      f"measured; the unit tier {fast:.0f} s.\n"
      + "".join(f"{test}  # {durations[test]:.1f} s\n" for test in slow)
      + "".join(f"{line}\n" for line in kept.values()))
  print(f"{SLOW_TESTS}: {len(slow) + len(kept)} slow tests; the unit tier: {len(durations) - len(slow)} tests, "
        f"{fast:.0f} s")


if __name__ == "__main__":
  main()
