"""Writes tests/slow_tests.txt from measured test durations: the slow tier is the longest tests, as few as leave the
rest (the unit tier, ``pytest -m "not slow"``) within a budget of test seconds.

Measure the whole suite as CI runs it, then update::

  SPARSEJAX_TEST_DURATIONS=/tmp/durations.json pytest -n 2 --dist loadfile
  python tests/update_tiers.py /tmp/durations.json            # --budget 150: test seconds left in the unit tier

The budget is the sum of the unit tier's tests' seconds (setup, call and teardown as measured on 2 busy workers):
150 test seconds on two workers ran in 2 min 45 s of wall time on 2026-11-29 (178: 3 min 2 s; workers start, files
do not split evenly).
"""

import argparse
import json
import pathlib

SLOW_TESTS = pathlib.Path(__file__).parent / "slow_tests.txt"


def slow_test_ids(path: pathlib.Path = SLOW_TESTS) -> set[str]:
  """The test ids that ``path`` (slow_tests.txt) lists (``#`` starts a comment)."""
  if not path.exists():
    return set()
  return {line.split("#", 1)[0].strip() for line in path.read_text().splitlines()} - {""}


def slow_tier(durations: dict[str, float], budget: float) -> list[str]:
  """The longest tests, as few as leave the others' seconds within ``budget`` (ids in the order of their time)."""
  ordered = sorted(durations, key=lambda test: (-durations[test], test))
  left, slow = sum(durations.values()), []
  for test in ordered:
    if left <= budget:
      break
    slow.append(test)
    left -= durations[test]
  return slow


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("durations", help="the JSON that SPARSEJAX_TEST_DURATIONS named: {test id: seconds}")
  parser.add_argument("--budget", type=float, default=150.0, help="test seconds left in the unit tier")
  args = parser.parse_args()
  durations = json.loads(pathlib.Path(args.durations).read_text())
  slow = slow_tier(durations, args.budget)
  fast = sum(durations.values()) - sum(durations[t] for t in slow)
  SLOW_TESTS.write_text(
      "# The slow tier: left out of `pytest -m \"not slow\"` (tests/conftest.py marks them). Written by\n"
      f"# tests/update_tiers.py from measured durations: {len(slow)} of {len(durations)} tests, "
      f"{sum(durations.values()) - fast:.0f} of {sum(durations.values()):.0f} test seconds; the unit tier "
      f"{fast:.0f} s.\n" + "".join(f"{test}  # {durations[test]:.1f} s\n" for test in slow))
  print(f"{SLOW_TESTS}: {len(slow)} slow tests; the unit tier: {len(durations) - len(slow)} tests, {fast:.0f} s")


if __name__ == "__main__":
  main()
