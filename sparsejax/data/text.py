"""Text datasets: label-stratified splits, TF-IDF features, and the fitted vectorizer saved as JSON.

Used by the built-in real datasets (:mod:`.icd10`, :mod:`.gcide`) and by prediction from text. The vectorizer
is saved as JSON rather than pickle: a work directory's files are safe to open, and they outlive
scikit-learn's pickle format. Loading checks that JSON against a fixed schema of data (:func:`load_vectorizer`):
a vectorizer received from someone else never reads files nor runs a regular expression of theirs. Needs
``scikit-learn`` (imported lazily).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .dataset import XCDataset

# Keep 1-character tokens: they matter in codes and terms ("type 1" vs "type 2", "C1").
TOKEN_PATTERN = r"(?u)\b\w+\b"


def sklearn_text():
  """scikit-learn's text module (``TfidfVectorizer``, ``ENGLISH_STOP_WORDS``), imported on first use."""
  # deferred: scikit-learn takes about 1.5 s to import, and models given feature rows never need it
  from sklearn.feature_extraction import text as sklearn_text_module

  return sklearn_text_module


class VectorizerFormatError(ValueError):
  """A ``vectorizer.json`` that is not what :func:`save_vectorizer` writes; ``str()`` names the file and the key.

  Attributes:
    path: the file.
    key: what in it is wrong (``params.token_pattern``, ``vocabulary``, ``idf[3]``, ...), or None: the whole file.
    reason: what is wrong with it.
  """

  def __init__(self, path: str | os.PathLike, key: str | None, reason: str):
    self.path, self.key, self.reason = os.fspath(path), key, reason
    super().__init__(f"{self.path}: {key}: {reason}" if key else f"{self.path}: {reason}")

  def __reduce__(self):  # keep picklable despite the custom signature
    return type(self), (self.path, self.key, self.reason)


def save_vectorizer(vectorizer: Any, path: str | os.PathLike) -> None:
  """Writes a fitted ``TfidfVectorizer``'s parameters, vocabulary and idf weights to ``path``.

  Raises:
    VectorizerFormatError: a vectorizer that :func:`load_vectorizer` would refuse (a custom tokenizer, another
      token pattern, ...): the run would leave a work directory that cannot predict from text.
  """
  params = vectorizer.get_params()
  params = {k: list(params[k]) if isinstance(params[k], tuple) else params[k] for k in _PARAMS}
  saved = {"params": params, "vocabulary": {t: int(i) for t, i in vectorizer.vocabulary_.items()},
           "idf": vectorizer.idf_.tolist()}
  _check_saved(saved, path)
  text = json.dumps(saved)
  with open(path, "w") as f:
    f.write(text)


def load_vectorizer(path: str | os.PathLike) -> Any:
  """The ``TfidfVectorizer`` that :func:`save_vectorizer` wrote (``transform`` gives the same rows).

  The file is data, checked against a fixed schema before anything is built from it: every parameter
  :func:`save_vectorizer` writes, each with the values it may hold (the texts are never file names to open, the
  tokens are found by sparsejax's own pattern, never one from the file), a vocabulary of terms numbering the
  columns ``0 .. V-1`` once each, and ``V`` idf weights.

  Raises:
    OSError: the file cannot be read.
    VectorizerFormatError: anything else about it, naming the file and the key.
  """
  return vectorizer_from_saved(read_vectorizer(path))


def read_vectorizer(path: str | os.PathLike) -> dict:
  """``vectorizer.json`` as checked data (:func:`load_vectorizer`'s checks), without importing scikit-learn (about
  1.5 s of a command's start-up): what a model that may never see a text keeps until one comes.

  Raises:
    OSError: the file cannot be read.
    VectorizerFormatError: anything else about it, naming the file and the key.
  """
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: deeply nested
    raise VectorizerFormatError(path, None, f"not a vectorizer's JSON: {type(e).__name__}: {e}") from None
  _check_saved(saved, path)
  return saved


def vectorizer_from_saved(saved: dict) -> Any:
  """The ``TfidfVectorizer`` of :func:`read_vectorizer`'s checked data."""
  params = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["params"].items()}
  vectorizer = sklearn_text().TfidfVectorizer(**params, dtype=np.float32)
  vectorizer.vocabulary_ = saved["vocabulary"]
  vectorizer.idf_ = np.asarray(saved["idf"], np.float64)
  return vectorizer


def _is_bool(value) -> bool:
  return isinstance(value, bool)


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_MAX_NGRAM = 3  # sparsejax writes (1, 2); each n adds a string per token to every text transform reads
_MAX_IDF = 1e6  # idf = ln(n / df) + 1 >= 1 (smoothed or not): ~22 at 10^9 texts

# Every parameter save_vectorizer writes (TfidfVectorizer's, but dtype) and the values each may hold, as JSON gives
# them. Only data: texts as they are given (never file names to open), no callables, and no regular expression but
# sparsejax's own (one from the file could backtrack for ever on an input line).
_PARAMS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "analyzer": (lambda v: v == "word", "'word'"),
    "binary": (_is_bool, "true or false"),
    "decode_error": (lambda v: v in ("strict", "ignore", "replace"), "'strict', 'ignore' or 'replace'"),
    "encoding": (lambda v: v == "utf-8", "'utf-8'"),
    "input": (lambda v: v == "content", "'content' (the texts themselves, never names of files to read)"),
    "lowercase": (_is_bool, "true or false"),
    "max_df": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "max_features": (lambda v: v is None or _is_int(v) and v >= 1, "null or an integer >= 1"),
    "min_df": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "ngram_range": (lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_int, v))
                    and 1 <= v[0] <= v[1] <= _MAX_NGRAM, f"[min_n, max_n], 1 <= min_n <= max_n <= {_MAX_NGRAM}"),
    "norm": (lambda v: v in ("l1", "l2", None), "'l1', 'l2' or null"),
    "preprocessor": (lambda v: v is None, "null"),
    "smooth_idf": (_is_bool, "true or false"),
    "stop_words": (lambda v: v is None, "null"),
    "strip_accents": (lambda v: v in ("ascii", "unicode", None), "'ascii', 'unicode' or null"),
    "sublinear_tf": (_is_bool, "true or false"),
    "token_pattern": (lambda v: v == TOKEN_PATTERN, f"sparsejax's own {TOKEN_PATTERN!r}"),
    "tokenizer": (lambda v: v is None, "null"),
    "use_idf": (lambda v: v is True, "true (the file holds idf weights)"),
    "vocabulary": (lambda v: v is None, "null (the fitted vocabulary is the file's own key)"),
}


def _check_saved(saved: Any, path: str | os.PathLike) -> None:
  """Raises :class:`VectorizerFormatError` unless ``saved`` (a parsed ``vectorizer.json``) fits the schema."""

  def refuse(key, reason):
    return VectorizerFormatError(path, key, reason)

  if not isinstance(saved, dict) or set(saved) != {"params", "vocabulary", "idf"}:
    raise refuse(None, "must be a JSON object of exactly params, vocabulary and idf, as sparsejax writes it")
  params = saved["params"]
  if not isinstance(params, dict):
    raise refuse("params", "must be an object of TfidfVectorizer parameters")
  for key, value in params.items():
    if key not in _PARAMS:
      raise refuse(f"params.{key}", f"not a parameter sparsejax writes (it writes {', '.join(_PARAMS)})")
    allowed, what = _PARAMS[key]
    if not allowed(value):
      raise refuse(f"params.{key}", f"must be {what}, got {json.dumps(value)[:200]}")
  missing = [key for key in _PARAMS if key not in params]
  if missing:
    raise refuse(f"params.{missing[0]}", "missing (sparsejax writes every parameter: the defaults may differ)")
  vocabulary = saved["vocabulary"]
  if not isinstance(vocabulary, dict) or not vocabulary:
    raise refuse("vocabulary", "must be a non-empty object of term: column")
  size, owner = len(vocabulary), {}
  for term, column in vocabulary.items():  # JSON keys are strings: the terms need no check
    if not _is_int(column) or not 0 <= column < size:
      raise refuse(f"vocabulary[{term!r}]", f"must be a column in [0, {size}) (one per term), got "
                   f"{json.dumps(column)[:200]}")
    if column in owner:
      raise refuse(f"vocabulary[{term!r}]", f"column {column} is also {owner[column]!r}'s")
    owner[column] = term
  idf = saved["idf"]
  if not isinstance(idf, list) or len(idf) != size:
    raise refuse("idf", f"must be a list of {size} weights (one per vocabulary term), got "
                 f"{len(idf) if isinstance(idf, list) else type(idf).__name__}")
  for i, weight in enumerate(idf):
    if not (_is_number(weight) and 1 <= weight <= _MAX_IDF):
      raise refuse(f"idf[{i}]", f"must be a number in [1, {_MAX_IDF:g}] (ln(n / df) + 1), got "
                   f"{json.dumps(weight)[:200]}")


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
  vectorizer = sklearn_text().TfidfVectorizer(ngram_range=(1, 2), token_pattern=TOKEN_PATTERN,
                                              max_features=max_features, min_df=min_df, sublinear_tf=True,
                                              dtype=np.float32)
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
