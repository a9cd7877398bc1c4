"""Ranking metrics of a run's predictions on a test set and retrieval diagnostics.

Exact and sampled P@k, nDCG@k and PSP@k; label and top-k recall of the candidate sets.
"""

from collections.abc import Callable

import numpy as np
from absl import logging

from sparsejax import fusion as fusion_lib
from sparsejax import head_rankers, metrics, retrieval
from sparsejax.data import PAD_ID, XCDataset

Predict = Callable[[object, np.ndarray, np.ndarray], tuple]


class Evaluator:
  """Scores ``predict`` on a test set, in fixed-shape batches (a compilation per width group, see
  :func:`batch_groups`: one where no row is wider than ``PADDED_ELEMENTS / batch_size`` features).

  Args:
    test: the test set.
    propensity: ``[L]`` label propensities (:func:`sparsejax.metrics.propensity_scores` of the training set).
    feature_limit: features kept per sample, those of largest |value| (the run's ``--max_features``); None: all
      of them (see :func:`padded_width`).
    batch_size: samples per predict call (rows wider than ``PADDED_ELEMENTS / batch_size`` go in fewer).
    sampled_batch_size: ``() -> samples per call`` of the calls with ``diagnose`` (sampled inference, whose
      temporaries grow with its candidates: :func:`sparsejax.inference.rows_within`), asked once, at the first
      such call; None: ``batch_size``.
  """

  def __init__(self, test: XCDataset, propensity: np.ndarray, feature_limit: int | None, batch_size: int = 1024,
               sampled_batch_size: Callable[[], int] | None = None):
    self.test, self.propensity, self.batch_size = test, propensity, batch_size
    self.feature_limit, self._sampled_batch_size, self._sampled_groups = feature_limit, sampled_batch_size, None
    # Planned over the whole set, whatever num_samples a call asks for: the same shapes, no recompilation.
    self.groups = batch_groups(test.feature_counts(), feature_limit, batch_size)
    # The width of the labels that diagnose takes (one compiled shape); the metrics need far fewer (scoring_labels).
    self.max_labels = max(test.max_labels_per_sample(), 1)

  @classmethod
  def for_run(cls, test: XCDataset, train: XCDataset, feature_limit: int | None, a: float, b: float,
              sampled_batch_size: Callable[[], int] | None = None) -> "Evaluator":
    """An evaluator with the training set's propensities (Jain et al. parameters ``a``, ``b``)."""
    propensity = metrics.propensity_scores(train.label_frequencies(), len(train), a, b)
    return cls(test, propensity, feature_limit, sampled_batch_size=sampled_batch_size)

  def __call__(self, predict: Predict, state, num_samples: int | None = None, diagnose=None,
               fusion: "fusion_lib.Fusion | None" = None) -> dict[str, float]:
    """Metrics of ``predict(state, feat_ids, feat_vals) -> (scores, ids, sampled_ids | None)``.

    Args:
      predict: e.g. :attr:`sparsejax.distributed.sharding.Run.predict`.
      state: the model state.
      num_samples: the first this many test samples; None: all.
      diagnose: optional :attr:`sparsejax.distributed.sharding.Run.diagnose`, used instead of ``predict``: it also
        gives sampled inference at other active set sizes and retrieval diagnostics.
      fusion: the exact predictions are re-ranked by :func:`sparsejax.fusion.fused_top`
        (``p@k`` and the rest are the fused ranking's, ``network_p@k`` the network's own); None: none.

    Returns:
      ``p@k``, ``ndcg@k``, ``psp@k`` (k = 1, 3, 5), ``sampled_*`` (and ``sampled_k{K}_*``) where the prediction
      has them, and with ``diagnose`` the retrieval diagnostics (:func:`sparsejax.retrieval.summarize`).
    """
    k = max(metrics.DEFAULT_KS)
    rows_of, batches = [], []
    for rows, fi, fv in self._batches(num_samples, sampled=diagnose is not None):
      n, extra = len(rows), {"sampled": {}}
      if diagnose is None:
        scores, ids, sampled = predict(state, fi, fv)
      else:
        _, _, lab = self.test.to_padded(rows, 0, self.max_labels)
        scores, ids, sampled, extra = diagnose(state, fi, fv, np.pad(lab, ((0, len(fi) - n), (0, 0)),
                                                                   constant_values=PAD_ID))
      scores, ids = np.asarray(scores)[:n], np.asarray(ids)[:n]
      approx = ({"sampled": sampled} if sampled is not None else {}) | extra["sampled"]
      batch = {"exact": ids[:, :k], "sampled": {name: np.asarray(top)[:n, :k] for name, top in approx.items()}}
      if fusion is not None:
        batch["fused"] = fusion_lib.fused_top(fusion, scores, ids, fi[:n], fv[:n], min(k, ids.shape[1]))[1]
      if diagnose is not None:
        batch["retrieval"] = {key: v[:n] for key, v in extra["retrieval"].items()}
      rows_of.append(rows)
      batches.append(batch)
    # Metrics summed in the samples' order, as ever.
    out = _in_samples_order(rows_of, batches)
    rankings = [out["exact"], *([out["fused"]] if fusion is not None else []), *out["sampled"].values()]
    labels = scoring_labels(self.test, len(out["exact"]), np.concatenate(rankings, axis=1), self.propensity)
    result = metrics.evaluate_topk(metrics.pad_ranking(out["exact"]), labels, self.propensity)
    if fusion is not None:
      result = {f"network_{key}": v for key, v in result.items()} | metrics.evaluate_topk(
          metrics.pad_ranking(out["fused"]), labels, self.propensity)
    for name, top in out["sampled"].items():
      sampled_result = metrics.evaluate_topk(metrics.pad_ranking(top), labels, self.propensity)
      result.update({f"{name}_{key}": v for key, v in sampled_result.items()})
    if "retrieval" in out:
      result.update(retrieval.summarize([out["retrieval"]], retrieval.TOP))
    return result

  def fusion_weights(self, predict: Predict, state, centroids: "fusion_lib.LabelCentroids",
                     rankers: "head_rankers.HeadRankers | None" = None, metric: str = "p@1",
                     num_samples: int | None = None) -> tuple[float, float, dict[float, float], dict[float, float]]:
    """The centroids' and the head rankers' weights that score best on the first ``num_samples`` samples of this
    evaluator's set (None: all) (:func:`sparsejax.fusion.choose_weights` over the exact predictions of ``predict``,
    which must return
    enough candidates: its ``top``). A run passes ``--eval_samples``, the samples its checkpoints were selected
    on: scoring every label for a whole validation split of 50,000 samples and 8·10^6 labels took over 20 minutes
    on 2 cores."""
    rows_of, batches = [], []
    for rows, fi, fv in self._batches(num_samples):
      scores, ids, _ = predict(state, fi, fv)
      scores, ids = np.asarray(scores)[:len(rows)], np.asarray(ids)[:len(rows)]
      rows_of.append(rows)
      fi, fv = fi[:len(rows)], fv[:len(rows)]
      batches.append((scores, ids, fusion_lib.centroid_scores(centroids, fi, fv, ids),
                      None if rankers is None else head_rankers.ranker_scores(rankers, fi, fv, ids)))
    scores, ids, centroid_score, ranker_score = _in_samples_order(rows_of, batches)
    labels = scoring_labels(self.test, len(ids), ids, self.propensity)  # re-rankings keep to these ids
    return fusion_lib.choose_weights(scores, ids, centroid_score, labels, metric=metric, propensity=self.propensity,
                                     ranker_score=ranker_score)

  def choose_fusion(self, predict: Predict, state, centroids: "fusion_lib.LabelCentroids",
                    rankers: "head_rankers.HeadRankers | None", metric: str, num_samples: int | None,
                    who: str = "") -> "tuple[fusion_lib.Fusion, dict]":
    """``(fusion, record)``: the weights :meth:`fusion_weights` chooses, logged (``who``: the line's prefix), and the
    final record's fields that say so (``fusion_weight``, ``fusion_validation``, and with rankers
    ``ranker_weight``, ``ranker_validation``, ``ranker_labels``; none where no label had a ranker)."""
    rankers = rankers if rankers is not None and len(rankers.labels) else None
    weight, ranker_weight, table, ranker_table = self.fusion_weights(predict, state, centroids, rankers, metric,
                                                                     num_samples)
    logging.info("%scentroid fusion: weight %g (validation %s by weight: %s)", who, weight, metric,
                 ", ".join(f"{w:g} {v:.4f}" for w, v in table.items()))
    record = {"fusion_weight": weight, "fusion_validation": {f"{w:g}": v for w, v in table.items()}}
    if rankers is not None:
      logging.info("%shead rankers (%d labels): weight %g (validation %s by weight: %s)", who, len(rankers.labels),
                   ranker_weight, metric, ", ".join(f"{w:g} {v:.4f}" for w, v in ranker_table.items()))
      record.update({"ranker_weight": ranker_weight, "ranker_labels": len(rankers.labels),
                     "ranker_validation": {f"{w:g}": v for w, v in ranker_table.items()}})
    return fusion_lib.Fusion(centroids, weight, rankers, ranker_weight), record

  def _batches(self, num_samples: int | None, sampled: bool = False):
    """``(rows, feat_ids, feat_vals)`` per predict call: the padded batches of the first ``num_samples`` samples
    (rows: which ones; the features padded to the call's shape); ``sampled``: in the calls' size for ``diagnose``."""
    n = len(self.test) if num_samples is None else min(num_samples, len(self.test))
    groups = self.groups
    if sampled and self._sampled_batch_size is not None:
      if self._sampled_groups is None:
        size = min(self._sampled_batch_size(), self.batch_size)
        self._sampled_groups = batch_groups(self.test.feature_counts(), self.feature_limit, size)
      groups = self._sampled_groups
    for group_rows, width, rows_per_call in groups:
      group_rows = group_rows[group_rows < n]
      for start in range(0, len(group_rows), rows_per_call):
        rows = group_rows[start:start + rows_per_call]
        fi, fv, _ = self.test.to_padded(rows, width, 0)
        pad = rows_per_call - len(rows)  # one compiled shape per group
        yield rows, np.pad(fi, ((0, pad), (0, 0)), constant_values=PAD_ID), np.pad(fv, ((0, pad), (0, 0)))


def scoring_labels(dataset: XCDataset, num_samples: int, candidates: np.ndarray,
                   propensity: np.ndarray | None) -> np.ndarray:
  """The labels of the first ``num_samples`` samples, ``[num_samples, W]`` (``PAD_ID`` padded), as few as give every
  ranking of ``candidates`` the P@k, nDCG@k and PSP@k (k <= 5) that all of a sample's labels give.

  ``W`` is at most the candidates' width plus 5: a sample with more labels keeps those among its candidates
  (its hits) and its 5 of largest weight ``1/propensity`` (its first 5 distinct ones without propensities), which
  fix its ideal nDCG and PSP. Padding every sample to the widest one's labels made ``[n, 2M]`` of one sample with
  2M labels (issue 35), as the features once did.

  Args:
    dataset: the samples.
    num_samples: the first this many.
    candidates: ``[num_samples, c]`` every label id that a ranking to be scored may hold (-1: none).
    propensity: ``[N]`` label propensities (PSP's weights are their inverses), or None.
  """
  kmax = max(metrics.DEFAULT_KS)
  counts = dataset.label_counts()[:num_samples]
  width = max(1, min(int(counts.max(initial=0)), candidates.shape[1] + kmax))
  _, _, labels = dataset.to_padded(np.arange(num_samples), 0, width)
  inverse = None if propensity is None else 1.0 / np.asarray(propensity, np.float64)
  for row in np.flatnonzero(counts > width):  # the wide rows: few (each was its own width before)
    own = np.unique(dataset.label_indices[dataset.label_indptr[row]:dataset.label_indptr[row + 1]])
    heaviest = own[:kmax] if inverse is None else own[np.argsort(-inverse[own], kind="stable")[:kmax]]
    kept = np.union1d(own[np.isin(own, candidates[row])], heaviest)
    labels[row] = PAD_ID
    labels[row, :len(kept)] = kept
  return labels


def _in_samples_order(rows: list[np.ndarray], batches: list):
  """Per-batch results concatenated and put back in the samples' order (batch groups take rows out of it).

  Args:
    rows: ``[b_i]`` the samples of each batch.
    batches: per batch, arrays ``[b_i, ...]`` in (nested) dicts or tuples, the same structure for every batch.

  Returns:
    That structure with each array ``[sum b_i, ...]``, sorted by sample.
  """
  in_order = np.argsort(np.concatenate(rows), kind="stable")

  def join(parts):
    if parts[0] is None:  # a term not computed
      return None
    if isinstance(parts[0], dict):
      return {key: join([part[key] for part in parts]) for key in parts[0]}
    if isinstance(parts[0], tuple):
      return tuple(join(list(column)) for column in zip(*parts))
    return np.concatenate(parts)[in_order]

  return join(batches)


def padded_width(dataset: XCDataset, feature_limit: int | None) -> int:
  """Features per row that inference pads ``dataset``'s rows to.

  Every feature of every row, unless the run cut its rows to ``feature_limit`` (``--max_features``): the
  training set's widest row does not bound the rows a model is asked about, and cutting a longer one would
  silently drop features. Rounded up to a power of two, so that inputs of similar widths share a compilation.
  """
  return _row_width(dataset.max_features_per_sample(), feature_limit)


# Padded feature ids (and as many values) per predict call beyond which wider rows get batches of their own:
# 2^22, 32 MiB of ids and values.
PADDED_ELEMENTS = 1 << 22


def batch_groups(feature_counts: np.ndarray, feature_limit: int | None,
                 batch_size: int) -> list[tuple[np.ndarray, int, int]]:
  """How rows of ``feature_counts`` features are padded and batched: ``(rows, width, rows_per_call)`` per group.

  Rows of up to ``PADDED_ELEMENTS / batch_size`` features (after ``feature_limit``) form one group: ``batch_size``
  rows per call padded to the widest of them (:func:`padded_width`). Each wider power-of-two width is a group of
  its own, with as many rows per call as fit in :data:`PADDED_ELEMENTS` (at least one). Rows are in increasing
  order within a group.
  """
  distinct, which = np.unique(feature_counts, return_inverse=True)
  widths = np.array([_row_width(int(c), feature_limit) for c in distinct], np.int64)[which.reshape(-1)]
  narrow_limit = max(1, PADDED_ELEMENTS // batch_size)
  narrow = np.flatnonzero(widths <= narrow_limit)
  groups = [(narrow, int(widths[narrow].max()), batch_size)] if len(narrow) else []
  for width in np.unique(widths[widths > narrow_limit]):
    groups.append((np.flatnonzero(widths == width), int(width), min(batch_size, max(1, PADDED_ELEMENTS // width))))
  return groups


def predict_in_batches(predict: Predict, state, dataset: XCDataset, num_samples: int, feature_limit: int | None,
                       batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """``predict`` over the first ``num_samples`` samples, in batches of padded rows; ``feature_limit`` as in
  :class:`Evaluator`.

  Batched as :func:`batch_groups` says: one long row pads a few rows to its width, not ``batch_size`` of them, so
  the padded arrays follow the input's features, not its rows times its longest row (one line of 2M features once
  took 23.7 GB).

  Returns:
    ``(scores, ids, sampled_ids or None)``, each ``[num_samples, top]``, in the samples' order.
  """
  out = None
  for rows, width, rows_per_call in batch_groups(dataset.feature_counts()[:num_samples], feature_limit, batch_size):
    for start in range(0, len(rows), rows_per_call):
      batch = rows[start:start + rows_per_call]
      fi, fv, _ = dataset.to_padded(batch, width, 0)
      pad = rows_per_call - len(batch)  # one compiled shape per group
      result = predict(state, np.pad(fi, ((0, pad), (0, 0)), constant_values=PAD_ID), np.pad(fv, ((0, pad), (0, 0))))
      if out is None:
        out = [None if x is None else np.empty((num_samples, *x.shape[1:]), x.dtype) for x in result]
      for whole, part in zip(out, result):
        if whole is not None:
          whole[batch] = part[:len(batch)]
  if out is None:
    return None, None, None
  return tuple(out)


def _row_width(num_features: int, feature_limit: int | None) -> int:
  """The padded width of a row of ``num_features``: the next power of two, at most ``feature_limit``."""
  width = 1 << (max(num_features, 1) - 1).bit_length()
  return width if feature_limit is None else min(width, feature_limit)


def evaluate_state(evaluator: Evaluator, run, state, num_samples: int | None,
                   fused: "fusion_lib.Fusion | None" = None, sampled: bool = True):
  """``(test-set metrics, the state evaluated)`` of a run's ``state`` (a :class:`sparsejax.distributed.sharding.Run`):
  the metrics with retrieval diagnostics and the index's fill where the run has them; the state with the index that
  sampled inference queried.

  Sampled inference is evaluated with a freshly refreshed index (a copy: training goes on with its own), as a
  model saved for serving would have it; between refreshes the training index lags the moving rows. Not
  ``sampled``: exact scores only (no index rebuilt, no diagnostics), what model selection reads.
  """
  if not sampled:
    return evaluator(run.exact_predictor(), state, num_samples, fusion=fused), state
  if run.refresh_index is not None:
    state = run.refresh_index(state)
  result = evaluator(run.predict, state, num_samples, diagnose=run.diagnose, fusion=fused)
  if run.index_fill is not None:
    result.update(run.index_fill(state))
  return result, state


def retrieval_line(record: dict) -> str:
  """The retrieval diagnostics of an evaluation, for the log (empty if it has none)."""
  if "label_recall" not in record:
    return ""
  return (f"  | label_recall {record['label_recall']:.3f}  topk_recall@{retrieval.TOP} "
          f"{record[f'topk_recall@{retrieval.TOP}']:.3f}  candidates {record['mean_candidates']:.0f}  "
          f"cos(h, label) {record['label_cosine']:.3f}")
