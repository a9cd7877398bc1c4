"""Sparse multi-label dataset container (CSR features + CSR labels).

Everything here is plain numpy so it can run in data-loading threads without
touching JAX. Padding convention shared with the kernels: id ``-1`` marks an
empty slot (feature or label), its value is ``0``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np
import scipy.sparse

from sparsejax.padding import PAD_ID


def _gather_csr(indptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Positions of the entries of ``rows`` in a CSR structure.

  Args:
    indptr: ``[n + 1]`` int64 row pointers.
    rows: ``[b]`` int row ids (any order, repeats allowed).

  Returns:
    ``(new_indptr [b + 1] int64, take [nnz_b] int64)`` where ``take`` indexes
    the CSR entry arrays, rows concatenated in the order of ``rows``.
  """
  starts = indptr[rows]
  lengths = indptr[rows + 1] - starts
  new_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
  np.cumsum(lengths, out=new_indptr[1:])
  # Entry j of output row r lives at starts[r] + j; build all at once.
  take = np.arange(new_indptr[-1], dtype=np.int64)
  take += np.repeat(starts - new_indptr[:-1], lengths)
  return new_indptr, take


def _row_ids(indptr: np.ndarray) -> np.ndarray:
  """``[nnz]`` int64 row id of every CSR entry."""
  return np.repeat(np.arange(len(indptr) - 1, dtype=np.int64), np.diff(indptr))


def _size(name: str, value) -> int:
  """A size given as an integer (``2.9`` or ``-3`` features are refused, not truncated)."""
  number = isinstance(value, (int, np.integer, float, np.floating)) and not isinstance(value, bool)
  if not number or not math.isfinite(value) or value != int(value) or value < 0:  # NaN and inf: int() would raise
    raise ValueError(f"XCDataset.{name} must be an integer >= 0, got {value!r}")
  return int(value)


def _integers(name: str, arr: np.ndarray, limits: np.iinfo) -> np.ndarray:
  """``arr`` as int64 if it holds integers within ``limits``, else a ValueError naming ``name``."""
  if arr.size == 0:
    return arr.astype(np.int64)
  if arr.dtype.kind == "f":
    whole = np.isfinite(arr) & (arr == np.trunc(arr))
    if not whole.all():
      raise ValueError(f"XCDataset.{name} must hold integers, got {arr[~whole][0].item()!r} at position "
                       f"{int(np.argmin(whole))}")
  elif arr.dtype.kind not in "iu":
    raise ValueError(f"XCDataset.{name} must hold integers, got an array of {arr.dtype}")
  low, high = arr.min(), arr.max()
  if low < limits.min or high > limits.max:
    raise ValueError(f"XCDataset.{name} holds {low if low < limits.min else high}, outside {limits.dtype}'s range")
  return arr.astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class XCDataset:
  """An extreme-classification dataset: sparse features, sparse label sets.

  Both features and labels are stored in CSR form over ``n`` samples. Arrays
  are coerced to the canonical dtypes on construction and validated cheaply
  (shapes, pointer monotonicity, id ranges).

  Attributes:
    indptr: ``[n + 1]`` int64 feature row pointers.
    indices: ``[nnz]`` int32 feature ids in ``[0, num_features)``.
    values: ``[nnz]`` float32 feature values.
    label_indptr: ``[n + 1]`` int64 label row pointers.
    label_indices: ``[nnz_labels]`` int32 label ids in ``[0, num_labels)``.
    num_features: ``F``, size of the feature space.
    num_labels: ``L``, size of the label space.
  """

  indptr: np.ndarray
  indices: np.ndarray
  values: np.ndarray
  label_indptr: np.ndarray
  label_indices: np.ndarray
  num_features: int
  num_labels: int

  def __post_init__(self) -> None:
    coerce = {
        "indptr": np.int64,
        "indices": np.int32,
        "values": np.float32,
        "label_indptr": np.int64,
        "label_indices": np.int32,
    }
    for name in ("num_features", "num_labels"):
      object.__setattr__(self, name, _size(name, getattr(self, name)))
    for name, dtype in coerce.items():
      arr = np.asarray(getattr(self, name))
      if arr.ndim != 1:
        raise ValueError(f"XCDataset.{name} must be 1-D, got shape {arr.shape}")
      if dtype is not np.float32:  # checked before the cast, which would wrap or truncate silently
        arr = _integers(name, arr, np.iinfo(dtype))
      object.__setattr__(self, name, np.ascontiguousarray(arr, dtype=dtype))
    self._validate()

  def _validate(self) -> None:
    n = len(self.indptr) - 1
    if n < 0 or len(self.label_indptr) != n + 1:
      raise ValueError(
          f"indptr and label_indptr must both have n+1 entries, got "
          f"{len(self.indptr)} and {len(self.label_indptr)}"
      )
    for ptr_name, ptr, entries in (
        ("indptr", self.indptr, ("indices", "values")),
        ("label_indptr", self.label_indptr, ("label_indices",)),
    ):
      if ptr[0] != 0 or np.any(np.diff(ptr) < 0):
        raise ValueError(f"{ptr_name} must start at 0 and be non-decreasing")
      for e in entries:
        if len(getattr(self, e)) != ptr[-1]:
          raise ValueError(f"len({e})={len(getattr(self, e))} != {ptr_name}[-1]={ptr[-1]}")
    for name, ids, bound in (
        ("indices", self.indices, self.num_features),
        ("label_indices", self.label_indices, self.num_labels),
    ):
      if ids.size and (ids.min() < 0 or ids.max() >= bound):
        raise ValueError(f"{name} out of range [0, {bound})")

  # ------------------------------------------------------------------ sizes
  def __len__(self) -> int:
    return len(self.indptr) - 1

  @property
  def num_samples(self) -> int:
    """``n``, the number of samples."""
    return len(self)

  def feature_counts(self) -> np.ndarray:
    """``[n]`` int64 number of stored features per sample."""
    return np.diff(self.indptr)

  def label_counts(self) -> np.ndarray:
    """``[n]`` int64 number of labels per sample."""
    return np.diff(self.label_indptr)

  def label_frequencies(self) -> np.ndarray:
    """``[L]`` int64 number of samples carrying each label (a label repeated within a sample counts once)."""
    sample = np.repeat(np.arange(len(self.label_indptr) - 1, dtype=np.int64), np.diff(self.label_indptr))
    keys = np.unique(sample * self.num_labels + self.label_indices)  # distinct (sample, label) pairs
    return np.bincount(keys % self.num_labels, minlength=self.num_labels).astype(np.int64)

  def feature_matrix(self):
    """The features as a scipy sparse matrix (the arrays shared, not copied).

    Returns:
      ``scipy.sparse.csr_matrix [n, F]`` float32; a sample without features is an empty row.
    """
    return scipy.sparse.csr_matrix((self.values, self.indices, self.indptr), shape=(len(self), self.num_features))

  # ------------------------------------------------------------ selection
  def subset(self, rows: Iterable[int] | np.ndarray) -> XCDataset:
    """Samples ``rows`` (in that order, repeats allowed) as a new dataset.

    Args:
      rows: ``[b]`` sample ids; negative ids count from the end.

    Returns:
      XCDataset with ``b`` samples and the same ``F`` and ``L``.
    """
    rows = self._check_rows(rows)
    f_ptr, f_take = _gather_csr(self.indptr, rows)
    l_ptr, l_take = _gather_csr(self.label_indptr, rows)
    return XCDataset(
        f_ptr,
        self.indices[f_take],
        self.values[f_take],
        l_ptr,
        self.label_indices[l_take],
        self.num_features,
        self.num_labels,
    )

  def _check_rows(self, rows) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.ndim != 1:
      raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
    if rows.size == 0:
      return rows.astype(np.int64)
    if not np.issubdtype(rows.dtype, np.integer):
      raise TypeError(f"rows must be integers, got dtype {rows.dtype}")
    n = len(self)
    rows = rows.astype(np.int64)
    if rows.min() < -n or rows.max() >= n:
      raise IndexError(f"row id out of range for dataset of {n} samples")
    return np.where(rows < 0, rows + n, rows)

  def max_features_per_sample(self) -> int:
    """Largest number of features in any sample (0 if empty)."""
    return int(self.feature_counts().max(initial=0))

  def max_labels_per_sample(self) -> int:
    """Largest number of labels in any sample (0 if empty)."""
    return int(self.label_counts().max(initial=0))

  def to_padded(
      self,
      rows: Iterable[int] | np.ndarray | None = None,
      max_features: int | None = None,
      max_labels: int | None = None,
  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dense, fixed-width, padded view of some samples (kernel input format).

    Rows with more than ``max_features`` features keep the ``max_features``
    entries of largest ``|value|`` (ties: earlier entry wins), because for
    L2-normalised TF-IDF-like rows those carry most of the mass. Kept
    entries stay in their stored order. Rows with more than ``max_labels``
    labels keep the first ``max_labels`` in stored order.

    Args:
      rows: ``[b]`` sample ids (default: all samples, in order).
      max_features: width ``M_f`` of the feature block (default: dataset-wide
        maximum, so shapes are identical across calls).
      max_labels: width ``M_l`` of the label block (default: dataset-wide max).

    Returns:
      ``feat_ids [b, M_f]`` int32 (padding ``-1``),
      ``feat_vals [b, M_f]`` float32 (padding ``0``),
      ``labels [b, M_l]`` int32 (padding ``-1``).
    """
    rows = np.arange(len(self)) if rows is None else self._check_rows(rows)
    if max_features is None:
      max_features = self.max_features_per_sample()
    if max_labels is None:
      max_labels = self.max_labels_per_sample()
    if max_features < 0 or max_labels < 0:
      raise ValueError("max_features and max_labels must be >= 0")
    b = len(rows)

    feat_ids = np.full((b, max_features), PAD_ID, dtype=np.int32)
    feat_vals = np.zeros((b, max_features), dtype=np.float32)
    f_ptr, f_take = _gather_csr(self.indptr, rows)
    row_of = _row_ids(f_ptr)
    slot = np.arange(len(f_take), dtype=np.int64) - f_ptr[row_of]
    if np.diff(f_ptr).max(initial=0) > max_features:
      # Rank entries within each row by decreasing |value| (stable, so
      # ties keep the earlier entry) and keep the top max_features.
      order = np.lexsort((-np.abs(self.values[f_take]), row_of))
      rank = np.empty_like(slot)
      rank[order] = slot  # sorted order is row-major, so slot == rank
      keep = rank < max_features
      f_take, row_of = f_take[keep], row_of[keep]
      kept_ptr = np.zeros(b + 1, dtype=np.int64)
      np.cumsum(np.bincount(row_of, minlength=b), out=kept_ptr[1:])
      slot = np.arange(len(f_take), dtype=np.int64) - kept_ptr[row_of]
    feat_ids[row_of, slot] = self.indices[f_take]
    feat_vals[row_of, slot] = self.values[f_take]

    labels = np.full((b, max_labels), PAD_ID, dtype=np.int32)
    l_ptr, l_take = _gather_csr(self.label_indptr, rows)
    l_row = _row_ids(l_ptr)
    l_slot = np.arange(len(l_take), dtype=np.int64) - l_ptr[l_row]
    keep = l_slot < max_labels
    labels[l_row[keep], l_slot[keep]] = self.label_indices[l_take[keep]]
    return feat_ids, feat_vals, labels

  def __repr__(self) -> str:
    return (
        f"XCDataset(n={len(self)}, num_features={self.num_features}, "
        f"num_labels={self.num_labels}, nnz={len(self.indices)}, "
        f"label_nnz={len(self.label_indices)})"
    )


def train_test_split(dataset: XCDataset, test_fraction: float, seed: int = 0) -> tuple[XCDataset, XCDataset]:
  """Random sample-level split, deterministic by ``seed``.

  Args:
    dataset: dataset with ``n`` samples.
    test_fraction: fraction in ``[0, 1]`` of samples put in the test split
      (rounded to the nearest integer count).
    seed: RNG seed.

  Returns:
    ``(train, test)``; each keeps its samples in original relative order.
  """
  if not 0.0 <= test_fraction <= 1.0:
    raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
  n = len(dataset)
  num_test = int(round(n * test_fraction))
  perm = np.random.default_rng(seed).permutation(n)
  test_rows = np.sort(perm[:num_test])
  train_rows = np.sort(perm[num_test:])
  return dataset.subset(train_rows), dataset.subset(test_rows)
