"""Ranking metrics of a run's predictions on a test set and retrieval diagnostics.

Exact and sampled P@k, nDCG@k and PSP@k; label and top-k recall of the candidate sets.
"""

from collections.abc import Callable

import numpy as np

from sparsejax import metrics, retrieval
from sparsejax.data import PAD_ID, XCDataset

Predict = Callable[[object, np.ndarray, np.ndarray], tuple]


class Evaluator:
  """Scores ``predict`` on a test set, in fixed-shape batches (one compilation).

  Args:
    test: the test set.
    propensity: ``[L]`` label propensities (:func:`sparsejax.metrics.propensity_scores` of the training set).
    feature_limit: features kept per sample, those of largest |value| (the run's ``--max_features``); None: all
      of them (see :func:`padded_width`).
    batch_size: samples per predict call.
  """

  def __init__(self, test: XCDataset, propensity: np.ndarray, feature_limit: int | None, batch_size: int = 1024):
    self.test, self.propensity, self.batch_size = test, propensity, batch_size
    self.max_features = padded_width(test, feature_limit)  # one feature width: one compiled shape
    self.max_labels = max(test.max_labels_per_sample(), 1)  # one label width too

  @classmethod
  def for_run(cls, test: XCDataset, train: XCDataset, feature_limit: int | None, a: float, b: float) -> "Evaluator":
    """An evaluator with the training set's propensities (Jain et al. parameters ``a``, ``b``)."""
    propensity = metrics.propensity_scores(train.label_frequencies(), len(train), a, b)
    return cls(test, propensity, feature_limit)

  def __call__(self, predict: Predict, state, num_samples: int | None = None, diagnose=None) -> dict[str, float]:
    """Metrics of ``predict(state, feat_ids, feat_vals) -> (scores, ids, sampled_ids | None)``.

    Args:
      predict: e.g. :attr:`sparsejax.distributed.Run.predict`.
      state: the model state.
      num_samples: the first this many test samples; None: all.
      diagnose: optional :attr:`sparsejax.distributed.Run.diagnose`, used instead of ``predict``: it also
        gives sampled inference at other active set sizes and retrieval diagnostics.

    Returns:
      ``p@k``, ``ndcg@k``, ``psp@k`` (k = 1, 3, 5), ``sampled_*`` (and ``sampled_k{K}_*``) where the prediction
      has them, and with ``diagnose`` the retrieval diagnostics (:func:`sparsejax.retrieval.summarize`).
    """
    n = len(self.test) if num_samples is None else min(num_samples, len(self.test))
    exact, approx, labels, diagnostics = [], {}, [], []
    for start in range(0, n, self.batch_size):
      rows = np.arange(start, min(start + self.batch_size, n))
      fi, fv, lab = self.test.to_padded(rows, self.max_features, self.max_labels)
      pad = self.batch_size - len(rows)  # one compiled shape for every batch
      fi = np.pad(fi, ((0, pad), (0, 0)), constant_values=PAD_ID)
      fv = np.pad(fv, ((0, pad), (0, 0)))
      extra = {"sampled": {}}
      if diagnose is None:
        _, ids, sampled = predict(state, fi, fv)
      else:
        _, ids, sampled, extra = diagnose(state, fi, fv, np.pad(lab, ((0, pad), (0, 0)), constant_values=PAD_ID))
        diagnostics.append({key: v[:len(rows)] for key, v in extra["retrieval"].items()})
      exact.append(ids[:len(rows)])
      for name, top in (({"sampled": sampled} if sampled is not None else {}) | extra["sampled"]).items():
        approx.setdefault(name, []).append(top[:len(rows)])
      labels.append(lab)
    labels = np.concatenate(labels)
    result = metrics.evaluate_topk(_ranked(exact), labels, self.propensity)
    for name, tops in approx.items():
      sampled_result = metrics.evaluate_topk(_ranked(tops), labels, self.propensity)
      result.update({f"{name}_{key}": v for key, v in sampled_result.items()})
    if diagnostics:
      result.update(retrieval.summarize(diagnostics, retrieval.TOP))
    return result


def _ranked(parts: list[np.ndarray]) -> np.ndarray:
  """The batches' top ids ``[n, >= 5]``: fewer than 5 labels leave the last places empty (-1, never relevant), so
  that P@5 is hits / 5 as everywhere else."""
  ids = np.concatenate(parts)
  return np.pad(ids, ((0, 0), (0, max(0, max(metrics.DEFAULT_KS) - ids.shape[1]))), constant_values=-1)


def padded_width(dataset: XCDataset, feature_limit: int | None) -> int:
  """Features per row that inference pads ``dataset``'s rows to.

  Every feature of every row, unless the run cut its rows to ``feature_limit`` (``--max_features``): the
  training set's widest row does not bound the rows a model is asked about, and cutting a longer one would
  silently drop features. Rounded up to a power of two, so that inputs of similar widths share a compilation.
  """
  widest = max(dataset.max_features_per_sample(), 1)
  width = 1 << (widest - 1).bit_length()
  return width if feature_limit is None else min(width, feature_limit)


def predict_in_batches(predict: Predict, state, dataset: XCDataset, num_samples: int, feature_limit: int | None,
                       batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """``predict`` over the first ``num_samples`` samples, in batches padded to one shape (one compilation);
  ``feature_limit`` as in :class:`Evaluator`.

  Returns:
    ``(scores, ids, sampled_ids or None)``, each ``[num_samples, top]``.
  """
  parts, max_features = [], padded_width(dataset, feature_limit)
  for start in range(0, num_samples, batch_size):
    rows = np.arange(start, min(start + batch_size, num_samples))
    fi, fv, _ = dataset.to_padded(rows, max_features, 0)
    pad = batch_size - len(rows)
    out = predict(state, np.pad(fi, ((0, pad), (0, 0)), constant_values=PAD_ID), np.pad(fv, ((0, pad), (0, 0))))
    parts.append([None if x is None else x[:len(rows)] for x in out])
  if not parts:
    return None, None, None
  return tuple(None if p[0] is None else np.concatenate(p) for p in zip(*parts))
