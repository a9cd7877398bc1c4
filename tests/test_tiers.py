"""The test tiers (issue 46): the slow tier is the fewest, longest tests that leave the unit tier within its budget."""

import itertools

import numpy as np
from update_tiers import slow_test_ids, slow_tier


def test_the_slow_tier_is_the_fewest_tests_that_leave_the_budget():
  rng = np.random.default_rng(0)
  for _ in range(200):
    durations = {f"t{i}": float(rng.exponential(2.0)) for i in range(rng.integers(1, 8))}
    budget = float(rng.uniform(0, sum(durations.values()) * 1.2))
    slow = slow_tier(durations, budget)
    assert sum(v for t, v in durations.items() if t not in slow) <= budget + 1e-9
    fewest = next(n for n in range(len(durations) + 1) for removed in itertools.combinations(durations, n)
                  if sum(v for t, v in durations.items() if t not in removed) <= budget + 1e-9)
    assert len(slow) == fewest  # brute force: no smaller set of tests will do
  assert slow_tier({"a": 5.0, "b": 1.0, "c": 3.0}, 4.0) == ["a"] and slow_tier({"a": 1.0}, 2.0) == []


def test_the_slow_list_reads_ids_and_skips_comments(tmp_path):
  listed = tmp_path / "slow_tests.txt"
  listed.write_text("# header\ntests/test_a.py::test_x[1]  # 12.5 s\n\n  tests/test_b.py::test_y  \n")
  assert slow_test_ids(listed) == {"tests/test_a.py::test_x[1]", "tests/test_b.py::test_y"}
  assert slow_test_ids(tmp_path / "missing.txt") == set()
