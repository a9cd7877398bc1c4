"""Ranking metrics of a run's predictions on a test set (exact and LSH-sampled P@k, nDCG@k, PSP@k)."""

from collections.abc import Callable

import numpy as np

from sparsejax import metrics
from sparsejax.data import PAD_ID, XCDataset

Predict = Callable[[object, np.ndarray, np.ndarray], tuple]


class Evaluator:
  """Scores ``predict`` on a test set, in fixed-shape batches (one compilation).

  Args:
    test: the test set.
    inverse_propensity: ``[L]`` PSP weights (:func:`sparsejax.metrics.inverse_propensity` of the training set).
    max_features: features per sample (the training run's padding width).
    batch_size: samples per predict call.
  """

  def __init__(self, test: XCDataset, propensity: np.ndarray, max_features: int, batch_size: int = 1024):
    self.test, self.propensity, self.max_features, self.batch_size = test, propensity, max_features, batch_size

  @classmethod
  def for_run(cls, test: XCDataset, train: XCDataset, max_features: int, a: float, b: float) -> "Evaluator":
    """An evaluator with the training set's propensities (Jain et al. parameters ``a``, ``b``)."""
    propensity = metrics.propensity_scores(train.label_frequencies(), len(train), a, b)
    return cls(test, propensity, max_features)

  def __call__(self, predict: Predict, state, num_samples: int | None = None) -> dict[str, float]:
    """Metrics of ``predict(state, feat_ids, feat_vals) -> (scores, ids, sampled_ids | None)``.

    Args:
      predict: e.g. :attr:`sparsejax.distributed.Run.predict`.
      state: the model state.
      num_samples: the first this many test samples; None: all.

    Returns:
      ``p@k``, ``ndcg@k``, ``psp@k`` (k = 1, 3, 5) and ``sampled_*`` where the prediction has them.
    """
    n = len(self.test) if num_samples is None else min(num_samples, len(self.test))
    exact, approx, labels = [], [], []
    for start in range(0, n, self.batch_size):
      rows = np.arange(start, min(start + self.batch_size, n))
      fi, fv, lab = self.test.to_padded(rows, self.max_features)
      pad = self.batch_size - len(rows)  # one compiled shape for every batch
      fi = np.pad(fi, ((0, pad), (0, 0)), constant_values=PAD_ID)
      fv = np.pad(fv, ((0, pad), (0, 0)))
      _, ids, sampled = predict(state, fi, fv)
      exact.append(ids[:len(rows)])
      if sampled is not None:
        approx.append(sampled[:len(rows)])
      labels.append(lab)
    width = max(l.shape[1] for l in labels)
    labels = np.concatenate([np.pad(l, ((0, 0), (0, width - l.shape[1])), constant_values=PAD_ID) for l in labels])
    result = metrics.evaluate_topk(np.concatenate(exact), labels, self.propensity)
    if approx:
      sampled_result = metrics.evaluate_topk(np.concatenate(approx), labels, self.propensity)
      result.update({f"sampled_{key}": v for key, v in sampled_result.items()})
    return result
