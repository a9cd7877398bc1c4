"""--selection_metric=auto: P@5 where a training row has 5 labels or more at the median (P@1 saturates there), else
P@1; decided once on a new run's data, kept as recorded by a continued run (issue 48)."""

import json

import numpy as np
import pytest

from sparsejax.config import Config
from sparsejax.data import LoadedData, XCDataset
from sparsejax.settings import ConfigError, override
from sparsejax.train import plan


def _data(label_counts: list[int]) -> LoadedData:
  """One feature a row, ``label_counts[i]`` labels on row ``i`` (labels 0, 1, ...)."""
  n = len(label_counts)
  label_indptr = np.concatenate([[0], np.cumsum(label_counts)]).astype(np.int64)
  labels = np.concatenate([np.arange(c) for c in label_counts]).astype(np.int32)
  train = XCDataset(np.arange(n + 1, dtype=np.int64), np.zeros(n, np.int32), np.ones(n, np.float32), label_indptr,
                    labels, 1, max(label_counts))
  return LoadedData(train, train, None, None)


@pytest.mark.parametrize("counts, metric", [
    ([1] * 9, "p@1"),
    ([1, 1, 1, 1, 1, 300, 300], "p@1"),  # heavy-tailed: most rows have one label (labels_heavy)
    ([2, 3, 4, 4, 4], "p@1"),  # the median row has 4 (WordNet)
    ([5] * 4, "p@5"),
    ([1, 5, 5, 6, 40], "p@5"),
])
def test_auto_selects_by_p5_where_the_median_row_has_five_labels_or_more(tmp_path, counts, metric):
  data = _data(counts)
  resolved, kept = plan.resolve_selection_metric(Config(), str(tmp_path), data)
  assert resolved.run.selection_metric == metric and kept is data
  assert override(resolved, selection_metric="auto").run.selection_metric == "auto"


def test_a_named_metric_is_kept_and_a_continued_run_keeps_its_recorded_one_without_loading_data(tmp_path):
  named = override(Config(), selection_metric="ndcg@5")
  assert plan.resolve_selection_metric(named, str(tmp_path), None) == (named, None)
  config = Config().to_dict()
  config["run"]["selection_metric"] = "p@5"
  (tmp_path / "config.json").write_text(json.dumps(config))
  resolved, data = plan.resolve_selection_metric(Config(), str(tmp_path), None)  # nothing to load: recorded
  assert resolved.run.selection_metric == "p@5" and data is None


def test_auto_is_a_choice_and_other_values_are_refused():
  assert Config().run.selection_metric == "auto"
  with pytest.raises(ConfigError, match="selection_metric"):
    override(Config(), selection_metric="p@2").validate()


def test_a_multi_label_run_selects_by_p5_and_records_it(tmp_path, small_config):
  from sparsejax.train import train_and_evaluate
  from sparsejax.train.metric_writer import read_records

  config = override(small_config, synthetic_labels_per_sample=5, validation_fraction=0.1, max_steps=20,
                    eval_every=10, selection_metric="auto")
  train_and_evaluate(config, str(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text())["run"]["selection_metric"] == "p@5"
  final = [r for r in read_records(str(tmp_path)) if r.get("final")][-1]
  assert "validation_p@5" in final and "validation_p@1" not in final  # what the best state was selected by
