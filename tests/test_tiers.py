"""The test tiers (issue 46): the slow tier is the fewest, longest tests that leave the unit tier within its budget."""

import itertools

import numpy as np
from update_tiers import fixtures_path, groups, slow_test_ids, slow_tier


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


def test_the_users_of_a_module_fixture_change_tiers_together():
  """A file's shared fixture is set up on its first user's seconds: moving that test alone would move the setup onto
  the next one (measured: a unit tier of 548 test seconds where 149 were predicted). Its users move as one group,
  the fewest groups that leave the budget (brute force over the groups)."""
  durations = {"f.py::a": 30.0, "f.py::b": 1.0, "f.py::c": 1.0, "g.py::x": 5.0, "g.py::y": 4.0}
  fixtures = {"f.py::a": ["f.py::run"], "f.py::b": ["f.py::run", "f.py::served"], "f.py::c": ["f.py::run"],
              "g.py::x": [], "g.py::y": []}
  assert groups(durations, fixtures) == {"f.py::run": ["f.py::a", "f.py::b", "f.py::c"], "g.py::x": ["g.py::x"],
                                         "g.py::y": ["g.py::y"]}
  assert slow_tier(durations, 10.0, fixtures) == ["f.py::a", "f.py::b", "f.py::c"]
  # Test by test (no fixtures known): a alone leaves f's setup to b in the unit tier, unseen by the prediction.
  assert slow_tier(durations, 10.0) == ["f.py::a", "g.py::x"]
  assert slow_tier(durations, 4.0, fixtures) == ["f.py::a", "f.py::b", "f.py::c", "g.py::x"]
  rng = np.random.default_rng(1)
  for _ in range(100):
    durations = {f"f{i % 3}.py::t{i}": float(rng.exponential(2.0)) for i in range(rng.integers(1, 9))}
    fixtures = {t: [f"{t.split('::')[0]}::run"] if rng.random() < 0.5 else [] for t in durations}
    budget = float(rng.uniform(0, sum(durations.values()) * 1.2))
    slow, by_group = slow_tier(durations, budget, fixtures), groups(durations, fixtures)
    assert sum(v for t, v in durations.items() if t not in slow) <= budget + 1e-9
    assert all(set(tests) <= set(slow) or not set(tests) & set(slow) for tests in by_group.values())
    cost = {key: sum(durations[t] for t in tests) for key, tests in by_group.items()}
    fewest = next(n for n in range(len(cost) + 1) for removed in itertools.combinations(cost, n)
                  if sum(v for key, v in cost.items() if key not in removed) <= budget + 1e-9)
    assert sum(set(tests) <= set(slow) for tests in by_group.values()) == fewest
  # Joined through a test that uses both: a's run and c's served change tiers together.
  joined = {"f.py::a": ["f.py::run"], "f.py::b": ["f.py::run", "f.py::served"], "f.py::c": ["f.py::served"]}
  assert list(groups({t: 1.0 for t in joined}, joined).values()) == [["f.py::a", "f.py::b", "f.py::c"]]
  assert fixtures_path("/tmp/durations.json") == "/tmp/durations.fixtures.json"


def test_the_slow_list_reads_ids_and_skips_comments(tmp_path):
  listed = tmp_path / "slow_tests.txt"
  listed.write_text("# header\ntests/test_a.py::test_x[1]  # 12.5 s\n\n  tests/test_b.py::test_y  \n")
  assert slow_test_ids(listed) == {"tests/test_a.py::test_x[1]", "tests/test_b.py::test_y"}
  assert slow_test_ids(tmp_path / "missing.txt") == set()
