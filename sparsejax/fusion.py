"""Score fusion with label centroids: the network's top candidates re-ranked by ``logit + w · cos(x, c_l)``.

A label's centroid ``c_l`` is the L2-normalised sum of the feature rows of its training samples (PECOS calls it
PIFA, *positive instance feature aggregation*). Its score ``x · c_l`` is a nearest-class-mean classifier over the
raw sparse features: it needs no training, and on sets with few samples per label it knows what a low-rank network
cannot hold (GCIDE, 25K labels from 70K definitions: the centroids alone reach test P@1 0.055, the network 0.048,
PECOS 0.054; benchmarks/RESULTS.md, "Score fusion"). Fusing the two re-ranks the network's ``CANDIDATES`` best labels
of a sample, so the cost is ``O(CANDIDATES · nnz)`` per sample, never ``O(N)``, and training is untouched.

A second term re-ranks the head labels, those in a large share of the samples, by per-label logistic regressions
on the same raw features (:mod:`sparsejax.head_rankers`): ``logit + w cos(x, c_l) + w_r z_l(x)``, ``z_l`` their
log-odds (0 for the other labels).

The weights are chosen on the validation split at the end of a run (:func:`choose_weights`, from :data:`WEIGHTS` and
:data:`RANKER_WEIGHTS`, 0 included: a set where a term does not help keeps the network's ranking), recorded in
``metrics.jsonl`` and the run's assets, and :func:`sparsejax.load`'s model applies them (a :class:`Fusion`)::

  centroids = fusion.label_centroids(train)                    # once, O(nnz)
  scores, ids = fusion.fused_top(fusion.Fusion(centroids, w), scores, ids, feat_ids, feat_vals, top=5)
"""

import concurrent.futures
import os
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from sparsejax import _ffi, metrics
from sparsejax.data import XCDataset
from sparsejax.head_rankers import HeadRankers, ranker_scores

# The network's best labels per sample that fusion re-ranks. GCIDE's network has 24% of its test labels in its
# top 100 (and the centroids' own P@1 is 0.055): re-ranking reaches them without scoring all N labels.
CANDIDATES = 100
# The weights compared on the validation split: logits span about 10-30 units where cosines span 0-1.
WEIGHTS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
# The head rankers' weights compared: their log-odds span about as much as the logits (debian_depends: 1-2 best).
RANKER_WEIGHTS = (0.0, 0.5, 1.0, 2.0)
# (feature, candidate) lookups of centroid_scores at once, over its threads: bounds its temporaries (about 40 bytes
# each), whatever the cores.
_CHUNK_ENTRIES = 1 << 20


class LabelCentroids(NamedTuple):
  """The labels' centroids, CSR over labels.

  Attributes:
    indptr: ``[N + 1]`` int64 row pointers.
    indices: ``[nnz]`` int32 feature ids, increasing within a row.
    values: ``[nnz]`` float32; each non-empty row has unit L2 norm (a label with no training sample: empty).
    num_features: F.
    lookup: the entries by feature, for :func:`centroid_scores` (derived, never saved; :meth:`of` makes it once,
      None: made on each call): ``(keys [nnz] int64 feature · N + label, increasing; values [nnz] float32)``.
  """
  indptr: np.ndarray
  indices: np.ndarray
  values: np.ndarray
  num_features: int
  lookup: tuple[np.ndarray, np.ndarray] | None = None

  @classmethod
  def of(cls, indptr, indices, values, num_features: int) -> "LabelCentroids":
    """The centroids of these CSR arrays, with their :attr:`lookup`."""
    indptr, indices = np.asarray(indptr, np.int64), np.asarray(indices, np.int32)
    centroids = cls(indptr, indices, np.asarray(values, np.float32), int(num_features))
    return centroids._replace(lookup=_by_feature(centroids))

  @property
  def num_labels(self) -> int:
    return len(self.indptr) - 1

  def matrix(self) -> sp.csr_matrix:
    return sp.csr_matrix((self.values, self.indices, self.indptr), shape=(self.num_labels, self.num_features))


class Fusion(NamedTuple):
  """What re-ranks the network's best labels, with the weights a run chose.

  Attributes:
    centroids: the labels' centroids.
    weight: theirs, ``w`` (0: unused).
    rankers: the head labels' rankers (None: none).
    ranker_weight: theirs, ``w_r`` (0: unused).
  """
  centroids: LabelCentroids
  weight: float
  rankers: HeadRankers | None = None
  ranker_weight: float = 0.0

  @property
  def active(self) -> bool:
    """Whether it changes the network's ranking at all."""
    return bool(self.weight) or (self.rankers is not None and bool(self.ranker_weight))


def label_centroids(train: XCDataset) -> LabelCentroids:
  """The centroids of ``train``'s labels: ``c_l = s_l / |s_l|``, ``s_l`` the sum of the rows labelled ``l``.

  O(nnz) work and memory: at most the training set's non-zeros.
  """
  n = len(train)
  sample_of = np.repeat(np.arange(n), np.diff(train.label_indptr))
  membership = sp.csr_matrix((np.ones(len(sample_of), np.float32), (train.label_indices, sample_of)),
                             shape=(train.num_labels, n))
  sums = (membership @ train.feature_matrix()).tocsr()
  sums.sort_indices()
  norms = np.sqrt(np.asarray(sums.multiply(sums).sum(axis=1), np.float64).ravel())
  sums.data *= np.repeat(np.where(norms > 0, 1.0 / np.maximum(norms, 1e-30), 0.0), np.diff(sums.indptr))
  return LabelCentroids.of(sums.indptr, sums.indices, sums.data, train.num_features)


def _host_threads() -> int:
  """The cores this process may run on (taskset's mask), at most ``SPARSEJAX_NUM_THREADS`` as the kernels."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
  return min(cores, _ffi.thread_cap() or cores)


def _by_feature(centroids: LabelCentroids) -> tuple[np.ndarray, np.ndarray]:
  """:attr:`LabelCentroids.lookup`: the entries ordered by (feature, label), keyed ``feature · N + label``."""
  by_feature = centroids.matrix().tocsc()
  by_feature.sum_duplicates()  # (sorted, one entry per label and feature: a search finds one)
  keys = np.repeat(np.arange(centroids.num_features, dtype=np.int64), np.diff(by_feature.indptr))
  return keys * centroids.num_labels + by_feature.indices, by_feature.data.astype(np.float32)


def centroid_scores(centroids: LabelCentroids, feat_ids: np.ndarray, feat_vals: np.ndarray,
                    ids: np.ndarray) -> np.ndarray:
  """``x_b · c_{ids[b, r]}`` for each sample's candidates.

  Each of a sample's features is looked up, for each candidate, among the labels whose centroids hold it (a binary
  search over ``feature · N + label`` keys, a sample's candidates in increasing order, so that its searches stay
  within the few cache lines of that feature's labels): ``O(B R nnz(x) log nnz(C))``, whatever the centroids' rows'
  lengths. Gathering the candidates' rows instead costs their lengths, and a frequent label's centroid holds
  thousands of features: on the suite's ``labels_5`` 5,000 samples' 100 candidates took 35 s that way; on
  ``labels_heavy`` (104M centroid entries) a sample's label-major lookups took 5 ms, feature-major ones 0.9 ms.

  Args:
    centroids: the labels' centroids.
    feat_ids: ``[B, F]`` int feature ids, ``PAD_ID`` (or any id outside ``[0, num_features)``) padded.
    feat_vals: ``[B, F]`` their values.
    ids: ``[B, R]`` candidate label ids; ids outside ``[0, N)`` (padding) score 0.

  Returns:
    ``[B, R]`` float32.
  """
  feat_ids, feat_vals, ids = np.asarray(feat_ids), np.asarray(feat_vals, np.float32), np.asarray(ids)
  B, R = ids.shape
  out = np.zeros((B, R), np.float32)
  F, N = centroids.num_features, centroids.num_labels
  real = (feat_ids >= 0) & (feat_ids < F)
  if B == 0 or R == 0 or len(centroids.values) == 0 or not real.any():
    return out
  keys, values = centroids.lookup if centroids.lookup is not None else _by_feature(centroids)
  # The samples' real features only (a padded row can be far wider than most), sample by sample.
  sample, feature, value = np.nonzero(real)[0], feat_ids[real].astype(np.int64), feat_vals[real]
  candidates = np.where((ids >= 0) & (ids < N), ids, -1).astype(np.int64)  # padding -1
  order = np.argsort(candidates, axis=1, kind="stable")
  candidates = np.take_along_axis(candidates, order, axis=1)
  starts = np.searchsorted(sample, np.arange(B + 1))  # each sample's run of features
  threads = _host_threads()
  entries_per_chunk = max(1, _CHUNK_ENTRIES // (R * threads))  # bounds the [features, R] temporaries of all threads
  scores = np.zeros((B, R), np.float32)  # in each row's increasing candidate order
  chunks, first = [], 0
  while first < B:  # whole samples per chunk (at least one)
    last = min(B, max(first + 1, int(np.searchsorted(starts, starts[first] + entries_per_chunk, side="right")) - 1))
    chunks.append((first, last))
    first = last

  def score(chunk: tuple[int, int]) -> None:  # rows first:last of scores, and nothing else
    first, last = chunk
    e = slice(starts[first], starts[last])
    label = candidates[sample[e]]  # [E, R]
    query = feature[e, None] * N + np.maximum(label, 0)
    pos = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    contribution = np.where((label >= 0) & (keys[pos] == query), values[pos] * value[e, None], np.float32(0))
    runs = starts[first:last] - starts[first]
    present = np.diff(starts[first:last + 1]) > 0  # reduceat reads an empty run as its next element
    if present.any():
      scores[first:last][present] = np.add.reduceat(contribution, runs[present], axis=0, dtype=np.float32)

  # The chunks on every core (numpy's searches and ufuncs release the GIL): each writes its own rows, so the scores
  # are the same floats whatever the threads. labels_heavy's 10,000 test samples: 19 s single-threaded.
  workers = min(len(chunks), threads)
  if workers > 1:
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      list(pool.map(score, chunks))
  else:
    for chunk in chunks:
      score(chunk)
  np.put_along_axis(out, order, scores, axis=1)
  return out


def rerank(scores: np.ndarray, ids: np.ndarray, centroid_score: np.ndarray, weight: float, top: int,
           ranker_score: np.ndarray | None = None, ranker_weight: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
  """The ``top`` best of each row by ``scores + weight · centroid_score + ranker_weight · ranker_score`` (ties: the
  network's order).

  Args:
    scores: ``[B, R]`` the network's logits of ``ids``, best first (``-inf`` for padding).
    ids: ``[B, R]`` candidate ids.
    centroid_score: ``[B, R]`` :func:`centroid_scores` of ``ids``.
    weight: the centroids' weight ``w`` (0: the network's ranking).
    top: kept per row (``<= R``).
    ranker_score: ``[B, R]`` :func:`sparsejax.head_rankers.ranker_scores` of ``ids`` (None: no such term).
    ranker_weight: its weight ``w_r``.

  Returns:
    ``(fused scores [B, top] float32, ids [B, top])``.
  """
  fused = np.asarray(scores, np.float32) + np.float32(weight) * np.asarray(centroid_score, np.float32)
  if ranker_score is not None and ranker_weight:
    fused = fused + np.float32(ranker_weight) * np.asarray(ranker_score, np.float32)
  order = np.argsort(-fused, axis=1, kind="stable")[:, :top]
  return np.take_along_axis(fused, order, axis=1), np.take_along_axis(np.asarray(ids), order, axis=1)


def term_scores(fusion: Fusion, feat_ids: np.ndarray, feat_vals: np.ndarray,
                ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
  """``(centroid scores, ranker scores or None)`` of candidates ``ids`` ``[B, R]``: the terms of ``fusion`` whose
  weight is not 0 (the centroids' are 0 where their weight is)."""
  centroid_score = (centroid_scores(fusion.centroids, feat_ids, feat_vals, ids) if fusion.weight
                    else np.zeros(np.shape(ids), np.float32))
  ranker_score = (ranker_scores(fusion.rankers, feat_ids, feat_vals, ids)
                  if fusion.rankers is not None and fusion.ranker_weight else None)
  return centroid_score, ranker_score


def fused_top(fusion: Fusion, scores: np.ndarray, ids: np.ndarray, feat_ids: np.ndarray, feat_vals: np.ndarray,
              top: int) -> tuple[np.ndarray, np.ndarray]:
  """The fused ranking's ``top`` best: the network's first :data:`CANDIDATES` re-ranked (:func:`rerank`), then,
  past them, the network's next ones in its order with their logits (a longer ranking extends a shorter one).

  Args:
    fusion: the terms and their weights.
    scores, ids: ``[B, R]`` the network's best, logits descending.
    feat_ids, feat_vals: ``[B, F]`` the samples' features, as :func:`centroid_scores` takes them.
    top: kept per row (``<= R``).
  """
  head = min(CANDIDATES, ids.shape[1])
  centroid_score, ranker_score = term_scores(fusion, feat_ids, feat_vals, ids[:, :head])
  fused = rerank(scores[:, :head], ids[:, :head], centroid_score, fusion.weight, min(top, head), ranker_score,
                 fusion.ranker_weight)
  return (np.concatenate([fused[0], np.asarray(scores, np.float32)[:, head:top]], axis=1),
          np.concatenate([fused[1], np.asarray(ids)[:, head:top]], axis=1))


def choose_weights(scores: np.ndarray, ids: np.ndarray, centroid_score: np.ndarray, labels: np.ndarray,
                   metric: str = "p@1", propensity: np.ndarray | None = None, weights=WEIGHTS,
                   ranker_score: np.ndarray | None = None,
                   ranker_weights=RANKER_WEIGHTS) -> tuple[float, float, dict[float, float], dict[float, float]]:
  """The pair of ``weights`` x ``ranker_weights`` whose re-ranking scores best by ``metric`` (ties: the smaller
  ranker weight, then the smaller weight).

  Args:
    scores, ids, centroid_score: as :func:`rerank`'s, for the validation samples.
    labels: ``[n, M]`` their labels, ``PAD_ID`` padded.
    metric: a :func:`sparsejax.metrics.evaluate_topk` key (``p@1``, ``ndcg@5``, ``psp@k`` with ``propensity``).
    propensity: ``[N]`` label propensities, for ``psp@k``.
    weights: the centroids' candidates, increasing.
    ranker_score: as :func:`rerank`'s (None: no head rankers; their weight 0).
    ranker_weights: their candidates, increasing.

  Returns:
    ``(weight, ranker weight, {weight: metric at the chosen ranker weight}, {ranker weight: metric at the chosen
    weight})``.
  """
  top = min(max(metrics.DEFAULT_KS), ids.shape[1])
  results = {}
  for wr in (ranker_weights if ranker_score is not None else (0.0,)):
    for w in weights:
      _, ranked = rerank(scores, ids, centroid_score, w, top, ranker_score, wr)
      results[float(w), float(wr)] = float(metrics.evaluate_topk(metrics.pad_ranking(ranked), labels,
                                                                 propensity)[metric])
  best = max(results.values())
  weight, ranker_weight = next(pair for pair in results if results[pair] == best)
  return (weight, ranker_weight, {w: v for (w, wr), v in results.items() if wr == ranker_weight},
          {wr: v for (w, wr), v in results.items() if w == weight})
