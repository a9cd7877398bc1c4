"""In-memory matrices as an :class:`XCDataset`, checked: what :func:`sparsejax.fit` trains on.

Features are a scipy sparse ``[n, F]`` matrix (or anything ``scipy.sparse.csr_matrix`` takes: a dense array, lists
of rows). Labels come in any of three forms:

* an indicator matrix, scipy sparse ``[n, L]``: 1 where a sample has a label (0 or nothing elsewhere);
* label-id lists, one per sample (``[[3, 17], [5], ...]``), each sample's order kept (``--max_labels`` keeps the
  first ones; an indicator matrix gives them in column order);
* one label id per sample, a 1-D integer array or a list of ints.

Every problem is a ``ValueError`` (a ``TypeError`` for a wrong kind of object) naming the argument and, where there
is one, the row and column: ``Y: row 3 has no label (an unlabelled sample): ...``. Plain numpy and scipy, no JAX.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import scipy.sparse

from .dataset import XCDataset
from .xc_format import FLOAT32_OVERFLOW


class LabelRows(NamedTuple):
  """Labels in CSR form: ``indices[indptr[i]:indptr[i + 1]]`` are sample i's label ids (int64).

  Attributes:
    width: an indicator matrix's columns (the labels it has room for), or None for label ids.
  """
  indptr: np.ndarray
  indices: np.ndarray
  width: int | None


def features(X: Any, name: str = "X") -> Any:
  """``X`` as a canonical float32 CSR matrix ``[n, F]`` (duplicate entries summed, column ids sorted; a copy).

  Raises:
    TypeError: ``X`` is not a 2-D numeric matrix.
    ValueError: ``X`` has no rows or a value that is not finite in float32 (NaN, inf, 1e39).
  """
  if X is None or isinstance(X, (str, bytes)):
    raise TypeError(f"{name}: give a sparse [n, num_features] matrix (scipy.sparse.csr_matrix), got {X!r}")
  try:
    ndim = X.ndim if scipy.sparse.issparse(X) else np.ndim(X)
  except ValueError as e:  # rows of different lengths
    raise TypeError(f"{name}: not a matrix ({e})") from None
  if ndim != 2:  # csr_matrix takes a 1-D array as one row: n samples of one feature were one sample
    raise TypeError(f"{name}: must be a 2-D [n, num_features] matrix, got {ndim} dimension(s) (shape "
                    f"{np.shape(X) if not scipy.sparse.issparse(X) else X.shape})")
  try:
    x = scipy.sparse.csr_matrix(X, copy=True)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name}: not a matrix that scipy.sparse.csr_matrix takes ({type(X).__name__}: {e})") from None
  if x.dtype.kind not in "biuf":
    raise TypeError(f"{name}: feature values must be numbers, got dtype {x.dtype}")
  if x.shape[0] == 0:
    raise ValueError(f"{name}: has no rows (samples)")
  if x.shape[1] == 0:
    raise ValueError(f"{name}: has no columns (features)")
  x.sum_duplicates()  # sorted column ids, one entry each (CSR allows repeats, which mean their sum)
  values = x.data.astype(np.float64)
  bad = np.flatnonzero(~(np.abs(values) < FLOAT32_OVERFLOW))  # NaN compares false: caught too
  if len(bad):
    row, column = _position(x.indptr, x.indices, bad[0])
    raise ValueError(f"{name}: row {row}, column {column} holds {values[bad[0]].item()!r}: feature values must be "
                     "finite in float32")
  return x.astype(np.float32)


def label_rows(Y: Any, num_samples: int, name: str = "Y") -> LabelRows:
  """The labels of ``num_samples`` samples, given in any of the module's three forms.

  Raises:
    TypeError: ``Y`` is none of the three forms (a dense 2-D array is refused: an indicator matrix goes through
      ``scipy.sparse.csr_matrix``, so that it is not mistaken for label-id lists of equal lengths).
    ValueError: another number of rows than ``num_samples``, an unlabelled sample, an indicator entry other than
      0 or 1, a label id that is negative, not an integer or repeated within its sample.
  """
  if scipy.sparse.issparse(Y):
    rows = _indicator(Y, name)
  elif isinstance(Y, np.ndarray) and Y.ndim == 2:
    raise TypeError(f"{name}: a dense 2-D array could be an indicator matrix or label-id lists: give an indicator "
                    f"matrix as scipy.sparse.csr_matrix({name}), label-id lists as a list of lists")
  elif isinstance(Y, np.ndarray) and Y.ndim == 1 and Y.dtype != object:
    rows = _one_per_sample(Y, name)
  elif isinstance(Y, (Sequence, np.ndarray)) and not isinstance(Y, (str, bytes)):
    rows = _id_lists(Y, name)
  else:
    raise TypeError(f"{name}: give labels as a sparse [n, num_labels] indicator matrix, label-id lists or one label "
                    f"id per sample, got {type(Y).__name__}")
  if len(rows.indptr) - 1 != num_samples:
    raise ValueError(f"{name}: has labels for {len(rows.indptr) - 1} samples; the features have {num_samples} rows")
  empty = np.flatnonzero(np.diff(rows.indptr) == 0)
  if len(empty):
    more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
    raise ValueError(f"{name}: row {empty[0]}{more} has no label (an unlabelled sample: nothing to train on or score "
                     "against): drop it, or give it its labels")
  return rows


def _indicator(Y: Any, name: str) -> LabelRows:
  if Y.ndim != 2:
    raise TypeError(f"{name}: a sparse indicator matrix must be 2-D [n, num_labels], got shape {Y.shape}")
  y = scipy.sparse.csr_matrix(Y, copy=True)
  y.sum_duplicates()  # a label entered twice (COO input) adds up to 2: refused below
  if y.dtype.kind not in "biuf":
    raise TypeError(f"{name}: an indicator matrix must hold numbers, got dtype {y.dtype}")
  bad = np.flatnonzero((y.data != 0) & (y.data != 1))  # NaN: both true
  if len(bad):
    row, column = _position(y.indptr, y.indices, bad[0])
    raise ValueError(f"{name}: row {row}, column {column} holds {y.data[bad[0]].item()!r}: an indicator matrix holds "
                     "1 where a sample has a label, 0 (or nothing) elsewhere")
  y.eliminate_zeros()
  return LabelRows(y.indptr.astype(np.int64), y.indices.astype(np.int64), y.shape[1])


def _one_per_sample(Y: np.ndarray, name: str) -> LabelRows:
  ids = _label_ids(Y, name, lambda i: i)
  return LabelRows(np.arange(len(ids) + 1, dtype=np.int64), ids, None)


def _id_lists(Y: Any, name: str) -> LabelRows:
  """Label-id lists (an int alone is a list of one): all at once where every row is a list of distinct ids >= 0, or
  every row an int (16 us a row one by one: a minute for millions), else row by row, which names the row at fault."""
  rows = list(Y)
  # One id per sample as a list of ints: the ints of a 1-D integer array (bools are not ids: row by row refuses them).
  types = set(map(type, rows))
  if rows and all(issubclass(t, numbers.Integral) and not issubclass(t, (bool, np.bool_)) for t in types):
    ids = np.array(rows)
    if ids.dtype.kind in "iu":  # not ints beyond int64's range (dtype object, or float64 beside negative ones)
      return _one_per_sample(ids, name)
  if rows and all(type(item) in (list, tuple) or isinstance(item, np.ndarray) for item in rows):
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    try:
      ids = np.array(list(itertools.chain.from_iterable(rows)))
    except (TypeError, ValueError):  # nested lists of other lengths
      ids = np.zeros(0, object)
    if ids.ndim == 1 and ids.dtype.kind in "iu" and len(ids) and ids.min() >= 0:
      row_ids = np.repeat(np.arange(len(rows)), lengths)
      order = np.lexsort((ids, row_ids))
      same = (row_ids[order][1:] == row_ids[order][:-1]) & (ids[order][1:] == ids[order][:-1])
      if not same.any():
        indptr = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=indptr[1:])
        return LabelRows(indptr, ids.astype(np.int64), None)
  return _id_lists_row_by_row(rows, name)


def _id_lists_row_by_row(Y: list, name: str) -> LabelRows:
  lengths, parts = np.zeros(len(Y), np.int64), []
  for row, item in enumerate(Y):
    if isinstance(item, numbers.Integral) and not isinstance(item, bool):
      ids = np.asarray([item])
    elif isinstance(item, (Sequence, np.ndarray, set, frozenset)) and not isinstance(item, (str, bytes)):
      ids = np.asarray(sorted(item) if isinstance(item, (set, frozenset)) else item)
      if ids.ndim != 1 or (ids.dtype == object and len(ids)):
        raise TypeError(f"{name}: row {row} is not a flat list of label ids: {_shown(item)}")
    else:
      raise TypeError(f"{name}: row {row} is {_shown(item)}: give each sample's label ids as a list of ints")
    ids = _label_ids(ids, name, lambda i, row=row: row)
    distinct, counts = np.unique(ids, return_counts=True)
    if len(distinct) != len(ids):
      raise ValueError(f"{name}: row {row} lists label {distinct[counts > 1][0]} more than once")
    lengths[row] = len(ids)
    parts.append(ids)
  indptr = np.zeros(len(Y) + 1, np.int64)
  np.cumsum(lengths, out=indptr[1:])
  return LabelRows(indptr, np.concatenate(parts) if parts else np.zeros(0, np.int64), None)


def _label_ids(ids: np.ndarray, name: str, row_of) -> np.ndarray:
  """``ids`` as int64 label ids; ``row_of(i)``: the sample whose id is ``ids[i]``, for the error."""
  if ids.size == 0:
    return ids.astype(np.int64)
  if ids.dtype.kind == "b" or ids.dtype.kind not in "iuf":
    raise TypeError(f"{name}: row {row_of(0)}: label ids must be integers, got dtype {ids.dtype}")
  if ids.dtype.kind == "f":
    whole = np.isfinite(ids) & (ids == np.trunc(ids))
    if not whole.all():
      i = int(np.argmin(whole))
      raise ValueError(f"{name}: row {row_of(i)} holds {ids[i].item()!r}: label ids must be integers")
  negative = np.flatnonzero(ids < 0)
  if len(negative):
    i = negative[0]
    raise ValueError(f"{name}: row {row_of(i)} holds label {ids[i].item()!r}: label ids are >= 0")
  return ids.astype(np.int64)


def label_count(labels: Sequence[tuple[str, LabelRows]], num_labels: int | None = None) -> int:
  """The number of labels that ``labels`` (``(argument name, rows)`` pairs) share: an indicator matrix's width, the
  given ``num_labels``, else the largest label id + 1; a ValueError naming the argument that does not fit."""
  widths = [(name, rows.width) for name, rows in labels if rows.width is not None]
  for (first, width), (other, other_width) in zip(widths, widths[1:]):
    if other_width != width:
      raise ValueError(f"{other}: has {other_width} label columns; {first} has {width}")
  if num_labels is not None:
    if isinstance(num_labels, bool) or not isinstance(num_labels, numbers.Integral) or num_labels < 1:
      raise ValueError(f"num_labels: must be an integer >= 1, got {num_labels!r}")
    if widths and widths[0][1] != num_labels:
      raise ValueError(f"num_labels: is {num_labels}; {widths[0][0]} has {widths[0][1]} label columns")
    count = int(num_labels)
  elif widths:
    count = widths[0][1]
  else:
    count = 1 + max(int(rows.indices.max(initial=-1)) for _, rows in labels)
  for name, rows in labels:
    outside = np.flatnonzero(rows.indices >= count)
    if len(outside):
      row = int(np.searchsorted(rows.indptr, outside[0], side="right")) - 1
      why = f"num_labels={count}" if num_labels is not None else f"{widths[0][0]} has {count} label columns"
      raise ValueError(f"{name}: row {row} holds label {rows.indices[outside[0]]}, outside [0, {count}) ({why})")
  return count


def from_arrays(X: Any, Y: Any, *, num_labels: int | None = None, num_features: int | None = None,
                names: tuple[str, str] = ("X", "Y")) -> XCDataset:
  """``X`` (features ``[n, F]``) and ``Y`` (labels, in any of the module's three forms) as an :class:`XCDataset`.

  Args:
    X: a scipy sparse ``[n, F]`` matrix, or anything ``scipy.sparse.csr_matrix`` takes.
    Y: an indicator matrix ``[n, L]``, ``n`` label-id lists or ``[n]`` label ids.
    num_labels: ``L`` (default: the indicator's width, else the largest label id + 1).
    num_features: ``F`` that ``X`` must have (a model's), or None.
    names: what the errors call ``X`` and ``Y``.

  Raises:
    TypeError, ValueError: naming the argument (see :func:`features` and :func:`label_rows`).
  """
  x = features(X, names[0])
  if num_features is not None and x.shape[1] != num_features:
    raise ValueError(f"{names[0]}: has {x.shape[1]} columns (features); the model reads {num_features}")
  rows = label_rows(Y, x.shape[0], names[1])
  count = label_count([(names[1], rows)], num_labels)
  return XCDataset(x.indptr, x.indices, x.data, rows.indptr, rows.indices, x.shape[1], count)


def _position(indptr: np.ndarray, indices: np.ndarray, entry: int) -> tuple[int, int]:
  """``(row, column)`` of CSR entry ``entry``."""
  return int(np.searchsorted(indptr, entry, side="right")) - 1, int(indices[entry])


def _shown(item: Any) -> str:
  text = repr(item)
  return text if len(text) <= 40 else text[:37] + "..."
