"""What a loaded model reads: feature rows from an XCDataset, a sparse matrix or texts, and the warning for a text
none of whose words the model knows."""

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import scipy.sparse

from sparsejax.data import XCDataset, from_arrays

# Texts without a known word named one by one, then the rest in one warning.
_UNKNOWN_WORDS_NAMED = 10


class UnknownWordsWarning(UserWarning):
  """A text none of whose words (or word pairs) is in the model's vocabulary.

  Its feature row is empty, so the network sees no input: its predictions are the same for every such text (the
  labels the model favours when told nothing), not about the text.

  Attributes:
    row: the text's index among the inputs (0-based).
    more: how many further texts after it have no known word either (named in this one warning, not one each).
  """

  def __init__(self, row: int, text: str, more: int = 0):
    self.row, self.text, self.more = row, text, more
    shown = text if len(text) <= 60 else text[:57] + "..."
    if more:
      message = f"this text and {more} more after it have no word the model knows: their labels are a guess"
    else:
      message = f"no word of {shown!r} is in the model's vocabulary: its labels are a guess, the same for any such text"
    super().__init__(message)


def feature_rows(inputs, num_features: int, num_labels: int, vectorizer: Callable[[], object] | None) -> XCDataset:
  """``inputs`` as feature rows of a model of ``num_features`` features and ``num_labels`` labels: an XCDataset (as
  is), a scipy sparse ``[n, F]`` matrix, or texts (one string: one text, one row), which ``vectorizer()`` (None: the
  model reads no texts) turns into rows; each text without a known word is named in an :class:`UnknownWordsWarning`
  (the caller's caller's)."""
  if isinstance(inputs, str):  # a str is a sequence of one-character strs: not n texts
    inputs = [inputs]
  if isinstance(inputs, XCDataset):
    if inputs.num_features != num_features:
      raise ValueError(f"the inputs have {inputs.num_features} features; the model reads {num_features}")
    return inputs
  if isinstance(inputs, Sequence) and all(isinstance(t, str) for t in inputs):
    if vectorizer is None:
      raise ValueError("this model's dataset has no text vectorizer: give feature rows, not texts")
    texts = list(inputs)
    inputs = vectorizer().transform(texts)
    _warn_of_unknown_words(texts, np.flatnonzero(np.diff(inputs.indptr) == 0))

  if not scipy.sparse.issparse(inputs) or inputs.ndim != 2 or inputs.shape[1] != num_features:
    raise ValueError(f"inputs must be an XCDataset, texts, or a sparse [n, {num_features}] matrix; got "
                     f"{type(inputs).__name__} of shape {getattr(inputs, 'shape', None)}")
  x = scipy.sparse.csr_matrix(inputs)
  x.sort_indices()
  return XCDataset(x.indptr, x.indices, x.data, np.zeros(x.shape[0] + 1, np.int64), np.zeros(0, np.int32),
                   num_features, num_labels)


def check_prediction(top: int, k: int | None, batch_size: int | None, num_labels: int) -> None:
  """Raises a TypeError or ValueError naming the argument where a prediction's ``top``, ``k`` or ``batch_size`` is
  not one of a model of ``num_labels`` labels (:meth:`sparsejax.serving.model.TrainedModel.predict`)."""
  for name, value in (("top", top), ("batch_size", batch_size), ("k", k)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
      raise TypeError(f"{name} must be an integer, got {value!r}")
  if not 1 <= top <= num_labels:
    raise ValueError(f"top must be in [1, {num_labels}], got {top}")
  if k is not None and not top <= k <= num_labels:
    raise ValueError(f"k must be in [top = {top}, {num_labels}] (the candidates scored per input), got {k}")
  if batch_size is not None and batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def labelled_samples(dataset, labels, num_features: int, num_labels: int) -> XCDataset:
  """What :meth:`sparsejax.serving.model.TrainedModel.evaluate` scores: ``dataset`` (an XCDataset), or a sparse
  feature matrix with its ``labels`` (as :func:`sparsejax.data.from_arrays` takes them), checked to name the model's
  ``num_labels`` labels."""
  if labels is not None:
    if isinstance(dataset, XCDataset):
      raise TypeError("evaluate: an XCDataset holds its labels: give labels= with a feature matrix only")

    dataset = from_arrays(dataset, labels, num_labels=num_labels, num_features=num_features,
                          names=("dataset", "labels"))
  if not isinstance(dataset, XCDataset):  # a sparse matrix or texts would score 0 against no labels
    raise TypeError(f"evaluate needs labelled samples, an XCDataset; got {type(dataset).__name__} (give a feature "
                    "matrix's labels as labels=; predict takes unlabelled inputs)")
  if dataset.num_labels != num_labels:
    raise ValueError(f"the dataset has {dataset.num_labels} labels; the model predicts {num_labels}: its "
                     "label ids would not name the same labels")
  return dataset


def _warn_of_unknown_words(texts: list[str], rows: np.ndarray) -> None:
  """An :class:`UnknownWordsWarning` for each of the first texts at ``rows`` (no known word), one for the rest."""
  for row in rows[:_UNKNOWN_WORDS_NAMED]:
    warnings.warn(UnknownWordsWarning(int(row), texts[row]), stacklevel=5)
  if len(rows) > _UNKNOWN_WORDS_NAMED:
    rest = int(rows[_UNKNOWN_WORDS_NAMED])
    warnings.warn(UnknownWordsWarning(rest, texts[rest], more=len(rows) - _UNKNOWN_WORDS_NAMED - 1), stacklevel=5)
