"""Head rankers: a logistic regression per frequent label on the raw sparse features, a term of the score fusion.

The network scores every label through one hidden layer (128-1,024 wide): a rank bound that a frequent label,
present in a large share of the samples, pays for most. On the suite's ``debian_depends`` (one label in 39% of the
training samples) PECOS's per-label linear models ranked that label first on more samples and more precisely,
worth 5.7 points of test P@1 (benchmarks/RESULTS.md, issue 48). A convex one-vs-all model per head label, solved on
the training split, adds what the shared layer loses: its log-odds ``z_l(x) = x . w_l + b_l`` is a third term of
:mod:`sparsejax.fusion`'s re-ranking, ``logit + w_c cos(x, c_l) + w_r z_l(x)`` (0 for the other labels), with
``w_r`` chosen on the validation split (0 included: where they do not help, the network's ranking stays).

Only the labels in at least :data:`MIN_SHARE` of the training samples (at most ``--head_rankers`` of them) get one,
so the solve costs ``O(iterations x nnz x K)``, a few seconds to a few tens, charged to the run's budget; scoring a
sample's candidates costs ``O(nnz(x) x K)``::

  rankers = head_rankers.fit(train, head_rankers.head_labels(train, 20))
  z = head_rankers.ranker_scores(rankers, feat_ids, feat_vals, candidate_ids)   # [B, R], 0 off the head
"""

import time
from typing import NamedTuple

import numpy as np
import scipy.optimize
import scipy.sparse as sp
from absl import logging

from sparsejax.data import XCDataset

# A label gets a ranker where it is in at least this share of the training samples: the labels a shared low-rank
# layer serves worst. On debian_depends 17 labels (the 20 most frequent: +1.5 points of test P@1 over the network,
# 5: +1.3, 60: no more); on the suite's single-label Zipf shapes 3-4.
MIN_SHARE = 0.02
# The inverse L2 penalty (liblinear's C: 0.5 |w|^2 + C sum log-loss): 3 beat 1, 0.3 and 10 on debian_depends.
C = 3.0
# L-BFGS iterations: the ranking gain is there after 50-100 (a 20-label solve converged in 248, no better).
ITERATIONS = 60


class HeadRankers(NamedTuple):
  """One logistic regression per head label.

  Attributes:
    labels: ``[K]`` int32 label ids, most frequent first.
    weights: ``[F, K]`` float32: column ``j`` is label ``labels[j]``'s weights over the features (0 for a feature
      no training sample has).
    bias: ``[K]`` float32.
  """
  labels: np.ndarray
  weights: np.ndarray
  bias: np.ndarray

  @property
  def num_features(self) -> int:
    return self.weights.shape[0]


def head_labels(train: XCDataset, most: int, min_share: float = MIN_SHARE) -> np.ndarray:
  """``[K]`` int32: the labels in at least ``min_share`` of ``train``'s samples, most frequent first (ties: the
  smaller id), at most ``most`` of them (0: none)."""
  counts = np.bincount(train.label_indices, minlength=train.num_labels)
  order = np.argsort(-counts, kind="stable")[:max(int(most), 0)]
  return order[counts[order] >= max(min_share * len(train), 1)].astype(np.int32)


def fit(train: XCDataset, labels: np.ndarray, c: float = C, iterations: int = ITERATIONS) -> HeadRankers:
  """Fits a ranker per label of ``labels``: ``min_w 0.5 |w|^2 + c sum_i log(1 + exp(-y_i (x_i . w + b)))`` over the
  rows of ``train`` (``y_i = +1`` where the row has the label, else -1; the bias unpenalised), by L-BFGS from 0 for
  ``iterations`` iterations, all labels in one solve (their objectives are separate: the sum's gradient is theirs).

  Deterministic: the same data give the same bits.
  """
  labels = np.asarray(labels, np.int32)
  F, K, n = train.num_features, len(labels), len(train)
  if K == 0 or n == 0:
    return HeadRankers(labels, np.zeros((F, K), np.float32), np.zeros(K, np.float32))
  t_start = time.time()
  X = train.feature_matrix().astype(np.float64).tocsr()
  X_t = X.T.tocsr()
  column = np.full(train.num_labels, -1, np.int64)
  column[labels] = np.arange(K)
  sample_of = np.repeat(np.arange(n), np.diff(train.label_indptr))
  of_head = column[train.label_indices] >= 0
  sign = -np.ones((n, K))
  sign[sample_of[of_head], column[train.label_indices[of_head]]] = 1.0

  def loss_and_gradient(theta):
    W, b = theta[:F * K].reshape(F, K), theta[F * K:]
    margin = -sign * (X @ W + b)  # the log-loss's argument: log(1 + exp(margin))
    d_z = -sign * _sigmoid(margin)  # d loss / d z
    loss = 0.5 * np.vdot(W, W) + c * np.logaddexp(0.0, margin).sum()
    return loss, np.concatenate([(W + c * (X_t @ d_z)).ravel(), c * d_z.sum(axis=0)])

  solved = scipy.optimize.minimize(loss_and_gradient, np.zeros(F * K + K), jac=True, method="L-BFGS-B",
                                   options={"maxiter": int(iterations)})
  least = np.bincount(column[train.label_indices[of_head]], minlength=K).min()
  logging.info("head rankers: %d labels (each in at least %.1f%% of the %d training samples), %d L-BFGS iterations "
               "in %.1f s", K, 100 * least / n, n, solved.nit, time.time() - t_start)
  theta = solved.x
  return HeadRankers(labels, theta[:F * K].reshape(F, K).astype(np.float32), theta[F * K:].astype(np.float32))


def _sigmoid(x: np.ndarray) -> np.ndarray:
  """``1 / (1 + exp(-x))`` without overflow."""
  e = np.exp(-np.abs(x))
  return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def ranker_scores(rankers: HeadRankers, feat_ids: np.ndarray, feat_vals: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """``x_b . w_l + b_l`` for each sample's candidates ``l = ids[b, r]`` that have a ranker, 0 for the others.

  Args:
    rankers: the head labels' rankers.
    feat_ids: ``[B, F]`` int feature ids, padded with ids outside ``[0, num_features)``.
    feat_vals: ``[B, F]`` their values.
    ids: ``[B, R]`` candidate label ids (padding, any id without a ranker: 0).

  Returns:
    ``[B, R]`` float32.
  """
  feat_ids, ids = np.asarray(feat_ids), np.asarray(ids)
  B = ids.shape[0]
  out = np.zeros(ids.shape, np.float32)
  K = len(rankers.labels)
  if K == 0 or B == 0 or ids.shape[1] == 0:
    return out
  real = (feat_ids >= 0) & (feat_ids < rankers.num_features)
  rows = np.nonzero(real)[0]
  X = sp.csr_matrix((np.asarray(feat_vals, np.float32)[real], (rows, feat_ids[real])),
                    shape=(B, rankers.num_features))
  z = X @ rankers.weights + rankers.bias  # [B, K]
  order = np.argsort(rankers.labels, kind="stable")
  sorted_labels = rankers.labels[order]
  pos = np.minimum(np.searchsorted(sorted_labels, ids), K - 1)
  has = sorted_labels[pos] == ids
  np.copyto(out, np.take_along_axis(z, order[pos], axis=1), where=has)
  return out
