"""Head rankers: a logistic regression per frequent label on the raw sparse features, a term of the score fusion.

The network scores every label through one hidden layer (128-1,024 wide): a rank bound that a frequent label,
present in a large share of the samples, pays for most. On the suite's ``debian_depends`` (one label in 39% of the
training samples) PECOS's per-label linear models ranked that label first on more samples and more precisely,
worth 5.7 points of test P@1 (benchmarks/RESULTS.md, issue 48). A convex one-vs-all model per head label, solved on
the training split, adds what the shared layer loses: its log-odds ``z_l(x) = x . w_l + b_l`` is a third term of
:mod:`sparsejax.fusion`'s re-ranking, ``logit + w_c cos(x, c_l) + w_r z_l(x)`` (0 for the other labels), with
``w_r`` chosen on the validation split (0 included: where they do not help, the network's ranking stays).

Only the labels in at least :data:`MIN_SHARE` of the training samples (at most ``--head_rankers`` of them) get one,
and the ``logistic_regression`` kernel solves them by dual coordinate descent (``O(epochs x nnz)`` each, the labels
in parallel): 1-8 s on the suite's shapes on 2 cores, charged to the run's budget (scipy's L-BFGS-B on the primal
took 32-56 s for as many labels, less well solved). Scoring a sample's candidates costs ``O(nnz(x) x K)``::

  rankers = head_rankers.fit(train, head_rankers.head_labels(train, 20))
  z = head_rankers.ranker_scores(rankers, feat_ids, feat_vals, candidate_ids)   # [B, R], 0 off the head
"""

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from absl import logging

from sparsejax import _ffi
from sparsejax.data import XCDataset

# A label gets a ranker where it is in at least this share of the training samples: the labels a shared low-rank
# layer serves worst. On debian_depends 17 labels (the 20 most frequent: +1.5 points of test P@1 over the network,
# 5: +1.3, 60: no more); on the suite's single-label Zipf shapes 3-4.
MIN_SHARE = 0.02
# The inverse L2 penalty (liblinear's C: 0.5 |w|^2 + C sum log-loss): 3 beat 1, 0.3 and 10 on debian_depends (solved
# to the tolerance below: 1 lower at every fusion weight, 10 within 0.002 of 3).
C = 3.0
# The dual solve stops where the largest gradient of an epoch's one-variable problems is below TOLERANCE (liblinear's
# default is 0.1; 0.01 ranked alike on debian_depends at 20% more seconds), after MAX_EPOCHS at most (debian's 17
# labels: 9-18).
TOLERANCE = 0.01
MAX_EPOCHS = 100


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


def fit(train: XCDataset, labels: np.ndarray, c: float = C, tolerance: float = TOLERANCE,
        max_epochs: int = MAX_EPOCHS, seed: int = 0) -> HeadRankers:
  """Fits a ranker per label of ``labels``: ``min_{w,b} 0.5 (|w|^2 + b^2) + c sum_i log(1 + exp(-y_i (x_i . w + b)))``
  over the rows of ``train`` (``y_i = +1`` where the row has the label, else -1; the bias is penalised as a feature
  of value 1, as liblinear's), by the ``logistic_regression`` kernel's dual coordinate descent: each label until the
  largest gradient of an epoch's one-variable problems is below ``tolerance`` (liblinear's rule), at most
  ``max_epochs`` epochs, the labels in parallel.

  Deterministic: the same data and ``seed`` give the same bits, for any thread count. Needs JAX's CPU backend (the
  kernel is CPU code; :func:`cpu_available`).

  Raises:
    ValueError: ``labels`` repeats a label or names one outside ``[0, num_labels)``; ``c``, ``tolerance`` or
      ``max_epochs`` is not positive; or ``train`` has 2^31 non-zero features (or rows, or head labels' rows) or
      more (the kernel's int32 offsets).
  """
  labels = np.asarray(labels, np.int32)
  F, K, n = train.num_features, len(labels), len(train)
  if len(np.unique(labels)) != K or (K and (labels.min() < 0 or labels.max() >= train.num_labels)):
    raise ValueError(f"head rankers: labels must be distinct ids in [0, {train.num_labels}), got {labels.tolist()}")
  if not (c > 0 and tolerance > 0 and int(max_epochs) >= 1):
    raise ValueError(f"head rankers: c, tolerance and max_epochs must be positive, got {c}, {tolerance}, {max_epochs}")
  if K == 0 or n == 0 or F == 0:
    return HeadRankers(labels, np.zeros((F, K), np.float32), np.zeros(K, np.float32))
  t_start = time.time()
  X = train.feature_matrix().tocsr()
  if not X.has_canonical_format:  # a feature repeated in a row: the kernel's |x_i|^2 needs it summed (on a copy)
    X = X.copy()
    X.sum_duplicates()
  column = np.full(train.num_labels, -1, np.int64)
  column[labels] = np.arange(K)
  sample_of = np.repeat(np.arange(n), np.diff(train.label_indptr))
  of_head = column[train.label_indices] >= 0
  head_column, head_row = column[train.label_indices[of_head]], sample_of[of_head]
  by_column = np.lexsort((head_row, head_column))
  positive_offsets = np.concatenate([[0], np.cumsum(np.bincount(head_column, minlength=K))])
  if max(X.nnz, n, len(head_row)) >= 2**31:
    raise ValueError(f"head rankers: the training split has {X.nnz} non-zero features, {n} rows and {len(head_row)} "
                     "head labels' rows: the kernel takes fewer than 2^31 of each")
  cpu = jax.local_devices(backend="cpu")[0]
  inputs = [jax.device_put(np.ascontiguousarray(a, dtype), cpu) for a, dtype in (
      (X.indptr, np.int32), (X.indices, np.int32), (X.data, np.float32), (positive_offsets, np.int32),
      (head_row[by_column], np.int32))]
  call = _ffi.ffi_call("logistic_regression", (jax.ShapeDtypeStruct((K, F), jnp.float32),
                                               jax.ShapeDtypeStruct((K,), jnp.float32),
                                               jax.ShapeDtypeStruct((K,), jnp.int32)))
  weights, bias, epochs = jax.device_get(call(*inputs, num_features=np.int64(F), c=np.float32(c),
                                              tolerance=np.float32(tolerance), max_epochs=np.int64(max_epochs),
                                              seed=np.int64(seed)))
  logging.info("head rankers: %d labels (each in at least %.1f%% of the %d training samples), %d-%d epochs of dual "
               "coordinate descent in %.1f s", K, 100 * np.diff(positive_offsets).min() / n, n, epochs.min(),
               epochs.max(), time.time() - t_start)
  return HeadRankers(labels, np.ascontiguousarray(weights.T), np.array(bias))


def cpu_available() -> bool:
  """Whether this process's JAX has a CPU backend, where :func:`fit` runs (``JAX_PLATFORMS=cuda`` starts none)."""
  try:
    return bool(jax.local_devices(backend="cpu"))
  except RuntimeError:
    return False


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
