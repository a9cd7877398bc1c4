"""Text datasets: label-stratified splits, TF-IDF features, and the fitted vectorizer saved as JSON.

Used by the built-in real datasets (:mod:`.icd10`, :mod:`.gcide`) and by prediction from text. The vectorizer
is saved as JSON rather than pickle: a work directory's files are safe to open, and they outlive
scikit-learn's pickle format. Needs ``scikit-learn`` (imported lazily).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .dataset import XCDataset


def save_vectorizer(vectorizer: Any, path: str | os.PathLike) -> None:
  """Writes a fitted ``TfidfVectorizer``'s parameters, vocabulary and idf weights to ``path``.

  Raises:
    TypeError: a vectorizer with parameters JSON cannot hold (a custom tokenizer, ...).
  """
  params = vectorizer.get_params()
  params.pop("dtype", None)
  params = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
  try:
    text = json.dumps({"params": params, "vocabulary": {t: int(i) for t, i in vectorizer.vocabulary_.items()},
                       "idf": vectorizer.idf_.tolist()})
  except TypeError as e:
    raise TypeError(f"cannot save this vectorizer as JSON: {e}") from None
  with open(path, "w") as f:
    f.write(text)


def load_vectorizer(path: str | os.PathLike) -> Any:
  """The ``TfidfVectorizer`` that :func:`save_vectorizer` wrote (``transform`` gives the same rows)."""
  from sklearn.feature_extraction.text import TfidfVectorizer

  with open(path) as f:
    saved = json.load(f)
  params = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["params"].items()}
  vectorizer = TfidfVectorizer(**params, dtype=np.float32)
  vectorizer.vocabulary_ = saved["vocabulary"]
  vectorizer.idf_ = np.asarray(saved["idf"], np.float64)
  return vectorizer


# Keep 1-character tokens: they matter in codes and terms ("type 1" vs "type 2", "C1").
TOKEN_PATTERN = r"(?u)\b\w+\b"


def stratified_split(groups: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
  """Boolean ``[n]`` test mask; every group keeps at least one train sample.

  Per group of size ``c`` the test count is ``floor(test_fraction * c + u)``
  (``u ~ U[0, 1)``, unbiased rounding) capped at ``c - 1``.
  """
  rng = np.random.default_rng(seed)
  n = len(groups)
  _, group_id, sizes = np.unique(groups, return_inverse=True, return_counts=True)
  num_test = np.floor(test_fraction * sizes + rng.random(len(sizes))).astype(np.int64)
  num_test = np.minimum(num_test, sizes - 1)
  # Random order within each group, then rank of each sample in its group.
  order = np.lexsort((rng.random(n), group_id))
  group_start = np.concatenate(([0], np.cumsum(sizes)[:-1]))
  rank = np.empty(n, dtype=np.int64)
  rank[order] = np.arange(n) - group_start[group_id[order]]
  return rank < num_test[group_id]


def tfidf_datasets(texts: Sequence[str], labels: Sequence[Sequence[int]], is_test: np.ndarray, num_labels: int, *,
                   max_features: int, min_df: int = 1) -> tuple[XCDataset, XCDataset, Any]:
  """Train and test datasets of L2-normalised TF-IDF rows (word unigrams and bigrams).

  The vocabulary and IDF weights are fitted on the training texts only.

  Args:
    texts: ``[n]`` sample texts.
    labels: ``[n]`` label id lists.
    is_test: ``[n]`` bool, which samples go to the test set.
    num_labels: L.
    max_features: vocabulary cap (most frequent training terms kept).
    min_df: minimum number of training texts a term must occur in.

  Returns:
    ``(train, test, vectorizer)`` with the fitted ``TfidfVectorizer``.
  """
  from sklearn.feature_extraction.text import TfidfVectorizer

  vectorizer = TfidfVectorizer(ngram_range=(1, 2), token_pattern=TOKEN_PATTERN, max_features=max_features,
                               min_df=min_df, sublinear_tf=True, dtype=np.float32)
  train_idx, test_idx = np.flatnonzero(~is_test), np.flatnonzero(is_test)
  x_train = vectorizer.fit_transform([texts[i] for i in train_idx])
  x_test = vectorizer.transform([texts[i] for i in test_idx])
  num_features = len(vectorizer.vocabulary_)

  def to_dataset(x, rows) -> XCDataset:
    x = x.tocsr()
    x.sort_indices()
    counts = np.array([len(labels[i]) for i in rows], dtype=np.int64)
    flat = [y for i in rows for y in labels[i]]
    return XCDataset(x.indptr, x.indices, x.data, np.concatenate([[0], np.cumsum(counts)]),
                     np.asarray(flat, np.int32), num_features, num_labels)

  return to_dataset(x_train, train_idx), to_dataset(x_test, test_idx), vectorizer
