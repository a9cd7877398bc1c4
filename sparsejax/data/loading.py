"""The train and test sets a run's data settings name (:class:`sparsejax.config.DataConfig`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..config import ConfigError
from .dataset import XCDataset, train_test_split
from .gcide import MissingPackage, load_gcide, load_gcide_cloze
from .icd10 import load_icd10
from .synthetic import make_synthetic
from .wordnet import load_wordnet
from .xc_format import XCFormatError, load_xc_file


class LoadedData(NamedTuple):
  """A dataset ready for training.

  Attributes:
    train, test: the splits, over the same features and labels.
    label_names: ``[L]`` a name per label, where the dataset has them (ICD-10 codes and titles, GCIDE words,
      WordNet synsets); else None.
    vectorizer: what turns raw text into feature rows (the real datasets' fitted TF-IDF, with a sklearn
      ``transform``), where the dataset has one; else None.
  """
  train: XCDataset
  test: XCDataset
  label_names: tuple[str, ...] | None = None
  vectorizer: Any = None


def load_dataset(config, *, seed: int = 0) -> LoadedData:
  """Loads (or generates) the dataset of ``config``.

  Args:
    config: a :class:`sparsejax.config.DataConfig` (validated).
    seed: seed of the synthetic data and of the train/test split.

  Raises:
    ConfigError: a built-in dataset whose optional package is not installed, or whose training set has no
      labelled sample.
    XCFormatError: a malformed or empty file, a file without a labelled line (nothing to train on, or nothing to
      score predictions against), or train and test files of different shapes (naming file and line).
  """
  loaded = _load(config, seed)
  if not len(loaded.train.label_indices):  # trained on nothing: loss 0 and an untrained model's metrics
    raise ConfigError("dataset", config.dataset, "the training set has no labelled sample: nothing to train on")
  return loaded


def _load(config, seed: int) -> LoadedData:
  """:func:`load_dataset` before the check that there is something to train on."""
  if config.dataset == "icd10":
    train, test, info = load_icd10(label_level=config.icd10_labels, seed=seed, test_fraction=config.test_fraction)
    return LoadedData(train, test, info.titled_label_names, info.vectorizer)  # "E11 Type 2 diabetes mellitus"
  if config.dataset in ("gcide", "gcide_cloze", "wordnet"):
    load = {"gcide": load_gcide, "gcide_cloze": load_gcide_cloze, "wordnet": load_wordnet}[config.dataset]
    try:
      train, test, info = load(seed=seed, test_fraction=config.test_fraction)
    except MissingPackage as e:
      raise ConfigError("dataset", config.dataset, str(e)) from None
    return LoadedData(train, test, info.label_names, info.vectorizer)
  if config.dataset == "synthetic":
    full = make_synthetic(config.synthetic_samples, config.synthetic_features, config.synthetic_labels,
                          labels_per_sample=config.synthetic_labels_per_sample, seed=seed)
    return LoadedData(*train_test_split(full, config.test_fraction, seed=seed))
  if config.dataset == "files":
    train, test = load_xc_file(config.train_file), load_xc_file(config.test_file)
    if (train.num_features, train.num_labels) != (test.num_features, test.num_labels):
      raise XCFormatError(config.test_file, 1, f"header has {test.num_features} features / {test.num_labels} "
                          f"labels, but {config.train_file} has {train.num_features} / {train.num_labels}")
    for path, split, what in ((config.train_file, train, "nothing to train on"),
                              (config.test_file, test, "nothing to score predictions against")):
      if len(split) == 0:
        raise XCFormatError(path, 1, "the file holds no samples")
      if not len(split.label_indices):  # trained: loss 0.0000; tested: every metric 0, reported as a result
        raise XCFormatError(path, 1, f"no sample has a label: {what}")
    return LoadedData(train, test)
  if config.dataset == "arrays":  # a run of sparsejax.fit, continued or restarted without its matrices
    raise ConfigError("dataset", config.dataset, "the matrices given to sparsejax.fit(X, Y) in Python, which only fit "
                      "can train on (give them to it again, with workdir= to continue its run); for files, "
                      "--dataset=files")
  raise ValueError(f"unknown dataset {config.dataset!r}: use 'icd10', 'gcide', 'gcide_cloze', 'wordnet', "
                   "'synthetic' or 'files'")
