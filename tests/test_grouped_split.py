"""The grouped validation split and the test for a grouped test set (sparsejax.data.grouped_split), against brute
force and against the random split; and a run's choice between them (sparsejax.train.plan)."""

import numpy as np
import pytest
import scipy.sparse as sp

from sparsejax import unused_settings
from sparsejax.config import Config
from sparsejax.data import LoadedData, XCDataset, grouped_split, train_test_split
from sparsejax.settings import override
from sparsejax.train import model_selection, plan


def _dataset(x: sp.csr_matrix, labels: np.ndarray | None = None) -> XCDataset:
  """Rows ``x``, one label each (``labels``: by default the row's number mod 5)."""
  x = sp.csr_matrix(x, dtype=np.float32)
  n = x.shape[0]
  labels = np.arange(n) % 5 if labels is None else labels
  return XCDataset(x.indptr.astype(np.int64), x.indices.astype(np.int32), x.data, np.arange(n + 1, dtype=np.int64),
                   labels.astype(np.int32), x.shape[1], int(labels.max()) + 1)


def _groups(rng, num_groups: int, size: int, num_features: int = 400, noise: float = 0.05):
  """``num_groups`` groups of ``size`` near-duplicate rows each (a shared random direction plus a little noise; the
  groups' directions nearly orthogonal), and each row's group."""
  centres = sp.random(num_groups, num_features, density=0.03, random_state=rng, format="csr").toarray()
  rows = np.repeat(centres, size, axis=0)
  rows = rows + noise * (rng.random(rows.shape) < 0.01) * rng.random(rows.shape)
  return sp.csr_matrix(rows), np.repeat(np.arange(num_groups), size)


def _cosines(x: sp.csr_matrix, y: sp.csr_matrix) -> np.ndarray:
  a, b = x.toarray().astype(np.float64), y.toarray().astype(np.float64)
  a /= np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-30)
  b /= np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-30)
  return a @ b.T


def test_neighbour_counts_match_brute_force_cosines():
  rng = np.random.default_rng(0)
  x = sp.random(150, 30, density=0.2, random_state=rng, format="lil")
  x[7] = 0  # a row without features: no one's neighbour, none of its own
  x = sp.csr_matrix(x)
  data = _dataset(x)
  units = grouped_split.unit_rows(data)
  cos = _cosines(x, x)
  for threshold in (0.3, 0.6):
    np.testing.assert_array_equal(grouped_split.neighbour_counts(units[:40], units.T.tocsr(), threshold),
                                  (cos[:40] >= threshold - 1e-6).sum(1))
    own = np.arange(40, 150, 3)
    expected = (cos[own] >= threshold - 1e-6).sum(1) - (cos[own, own] >= threshold - 1e-6)
    np.testing.assert_array_equal(grouped_split.neighbour_counts(units[own], units.T.tocsr(), threshold, own=own),
                                  expected)


def test_without_near_duplicates_the_grouped_split_is_the_random_one():
  data = _dataset(sp.identity(300, format="csr"))  # no two rows share a feature
  for seed in (0, 3):
    (a, b), (c, d) = grouped_split.grouped_split(data, 0.1, seed=seed), train_test_split(data, 0.1, seed=seed)
    np.testing.assert_array_equal(a.indices, c.indices)
    np.testing.assert_array_equal(b.indices, d.indices)
    assert len(b) == 30


def test_a_group_is_held_out_whole_and_the_split_is_deterministic():
  rng = np.random.default_rng(1)
  x, group = _groups(rng, 60, 5)
  order = rng.permutation(len(group))  # the groups' rows spread through the set
  x, group = x[order], group[order]
  data = _dataset(x, labels=group)  # a row's label names its group
  train, validation = grouped_split.grouped_split(data, 0.1, seed=2)
  assert 30 <= len(validation) <= 33 and len(train) + len(validation) == 300
  held = np.unique(validation.label_indices)
  assert len(held) * 5 == len(validation)  # whole groups
  assert not np.isin(train.label_indices, held).any()
  assert _cosines(validation.feature_matrix(), train.feature_matrix()).max() < grouped_split.NEIGHBOUR_COSINE
  # The random split leaves most held-out rows' siblings in training.
  random_train, random_validation = train_test_split(data, 0.1, seed=2)
  assert np.isin(random_validation.label_indices, random_train.label_indices).mean() > 0.9
  again = grouped_split.grouped_split(_dataset(x, labels=group), 0.1, seed=2)[1]  # another object: computed afresh
  np.testing.assert_array_equal(again.indptr, validation.indptr)
  np.testing.assert_array_equal(again.values, validation.values)
  other = grouped_split.grouped_split(data, 0.1, seed=3)[1]
  assert not np.array_equal(other.values, validation.values)


@pytest.mark.parametrize("exponent", [0.0, grouped_split.SEED_EXPONENT, 1.0])
def test_a_group_is_drawn_as_often_as_its_size_to_the_power_one_less_the_seed_exponent(monkeypatch, exponent):
  # 40 groups of 9 near-duplicates and 360 single rows: a drawn row seeds its group with probability 9^-exponent,
  # so a group is drawn 9^(1 - exponent) times as often as a single row, and the groups' share of the held-out rows
  # is 360 g / (360 g + 360), g = 9^(1 - exponent): 0.9 where every drawn row seeds (0), 0.5 where each group is
  # drawn alike (1), 0.75 at 0.5. Measured over 30 seeds: 0.888, 0.483, 0.720 (a group's rows drawn without seeding
  # are not drawn again, and the overshoot rule skips groups near the end: both lower it; standard error ~0.012).
  monkeypatch.setattr(grouped_split, "SEED_EXPONENT", exponent)
  rng = np.random.default_rng(5)
  x, group = _groups(rng, 40, 9, num_features=1200)
  x = sp.block_diag([x, sp.identity(360) * 0.5], format="csr")  # the single rows on features of their own
  order = rng.permutation(720)
  data = _dataset(x[order], labels=np.concatenate([group, np.arange(40, 400)])[order])  # label: the row's group
  shares = []
  for seed in range(30):
    validation = grouped_split.grouped_split(data, 0.2, seed=seed)[1]
    assert 144 <= len(validation) <= 158
    held, sizes = np.unique(validation.label_indices, return_counts=True)
    assert np.all(sizes[held < 40] == 9) and np.all(sizes[held >= 40] == 1)  # whole groups
    shares.append(np.mean(validation.label_indices < 40))
  g = 9 ** (1 - exponent)
  assert abs(np.mean(shares) - g / (g + 1)) < 0.06, (np.mean(shares), g / (g + 1))  # the exponents 0.17-0.24 apart


def test_a_group_far_larger_than_the_split_stays_in_training():
  rng = np.random.default_rng(2)
  big, _ = _groups(rng, 1, 40)
  data = _dataset(sp.block_diag([big, sp.identity(200) * 0.5], format="csr"))
  train, validation = grouped_split.grouped_split(data, 0.1, seed=0)
  assert len(validation) == 24  # singles only: the 40-row group would take the split far past its 24 rows
  assert validation.feature_matrix()[:, :400].nnz == 0


def test_looks_grouped_tells_a_split_by_groups_from_a_random_one():
  rng = np.random.default_rng(3)
  x, group = _groups(rng, 300, 4)
  data = _dataset(x)
  by_group = np.isin(group, rng.choice(300, 60, replace=False))
  grouped = grouped_split.looks_grouped(data.subset(np.flatnonzero(~by_group)), data.subset(np.flatnonzero(by_group)),
                                        sample=400)
  assert grouped.grouped and grouped.test_rate < 0.05 and grouped.train_rate > 0.95
  train, test = train_test_split(data, 0.2, seed=0)
  at_random = grouped_split.looks_grouped(train, test, sample=400)
  assert not at_random.grouped and at_random.test_rate > 0.9


def test_a_run_resolves_auto_by_its_test_set_and_a_grouped_split_never_stops_early():
  rng = np.random.default_rng(4)
  x, group = _groups(rng, 200, 4)
  data = _dataset(x)
  by_group = group >= 160
  grouped_data = LoadedData(data.subset(np.flatnonzero(~by_group)), data.subset(np.flatnonzero(by_group)), None, None)
  config = override(Config(), dataset="files", max_seconds=60.0)
  assert model_selection.stale_ratio(config) == 2.0
  resolved, record = plan.resolve_validation_split(config, grouped_data)
  assert resolved.data.validation_split == "grouped" and record["validation_split"] == "grouped"
  assert record["near_neighbours"]["test"] < record["near_neighbours"]["train"]
  assert model_selection.stale_ratio(resolved) is None
  train, validation = plan.validation_split(resolved, grouped_data.train, seed=1)
  assert _cosines(validation.feature_matrix(), train.feature_matrix()).max() < grouped_split.NEIGHBOUR_COSINE
  assert any("early_stopping_ratio" in line for line in
             unused_settings.of(override(resolved, early_stopping_ratio=3.0)))
  random_data = LoadedData(*train_test_split(data, 0.2, seed=0), None, None)
  resolved, record = plan.resolve_validation_split(config, random_data)
  assert resolved.data.validation_split == "random" and model_selection.stale_ratio(resolved) == 2.0
  named = override(config, validation_split="random")
  assert plan.resolve_validation_split(named, grouped_data) == (named, {})
  with pytest.raises(ValueError, match="fraction"):
    grouped_split.grouped_split(data, 1.5)


def test_where_every_group_is_too_large_the_split_is_filled_at_random():
  rows = sp.csr_matrix(np.ones((200, 3)))  # one group of 200 identical rows
  train, validation = grouped_split.grouped_split(_dataset(rows), 0.1, seed=0)
  assert (len(train), len(validation)) == (180, 20)


def test_a_continued_run_keeps_its_recorded_split_without_loading_data(tmp_path):
  import json

  from sparsejax.train import driver

  config = override(Config(), dataset="files", max_seconds=60.0)
  rng = np.random.default_rng(5)
  x, group = _groups(rng, 100, 4)
  data = _dataset(x)
  by_group = group >= 80
  loaded = LoadedData(data.subset(np.flatnonzero(~by_group)), data.subset(np.flatnonzero(by_group)), None, None)
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  resolved, kept, record = driver._with_validation_split(config, str(fresh), loaded)  # a new run: measured
  assert resolved.data.validation_split == "grouped" and kept is loaded and record["validation_split"] == "grouped"
  for recorded, expected in (({"validation_split": "grouped"}, "grouped"), ({}, "auto"), (None, "auto")):
    workdir = tmp_path / f"run{expected}{len(recorded or {})}{recorded is None}"
    (workdir / "checkpoints" / "40").mkdir(parents=True)
    if recorded is not None:
      (workdir / "config.json").write_text(json.dumps({"data": recorded}))
    resolved, data, record = driver._with_validation_split(config, str(workdir), None)
    assert (resolved.data.validation_split, data, record) == (expected, None, {})
  named = override(config, validation_split="random")
  assert driver._with_validation_split(named, str(tmp_path / "rungrouped1False"), None)[0] is named
