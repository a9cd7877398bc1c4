"""A fitted TF-IDF vectorizer (scikit-learn's ``TfidfVectorizer``) saved as JSON, so text can be featurized later.

JSON rather than pickle: a work directory's files are safe to open, and they
outlive scikit-learn's pickle format.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


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
