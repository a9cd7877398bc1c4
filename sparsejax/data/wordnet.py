"""Built-in real multi-label dataset: WordNet synsets -> their hypernym ancestors.

Reads the WordNet 3.0 database of Debian's ``wordnet-base`` package (``apt-get install wordnet-base``; the files
``data.noun``, ``data.verb``, ``index.noun`` and ``index.verb`` in ``/usr/share/wordnet``, or in the directory that
the environment variable ``SPARSEJAX_WORDNET_DIR`` names). The files are parsed here (format: the ``wndb(5WN)``
manual page); no NLTK.

Each *sample* is one noun or verb synset. Its text is the synset's words (``"dog, domestic dog, Canis
familiaris"``) and its gloss (definition and examples); its *labels* are all its ancestors through hypernym
(``@``) and instance-hypernym (``@i``) pointers, transitively (with multiple inheritance, the union of the
paths), not the synset itself. Labels on more than 5% of the synsets (``entity``, ``physical_entity``,
``object``, ...) are dropped, so that always predicting the root is no answer; so are labels with fewer than 2
samples (so that each can have a training sample); synsets left with no label are dropped.
Labels are named as NLTK names synsets, by first word, part of speech and sense number: ``dog.n.01``.

On WordNet 3.0 with the defaults: 94,425 samples (81,296 nouns, 13,129 verbs) of the 95,882 synsets, 13,708
labels, 4.17 labels per sample on average (median 4) and 23 at most (``scat.n.01``, under two parents). The 20
labels over 5% (``entity.n.01`` on 82,114 synsets, ``person.n.01`` on 10,296, down to ``relation.n.01`` on 5,145)
are dropped, as are the 6,744 synsets with a single descendant. The 1,457 synsets left with no label are the 560
roots (559 verbs, and ``entity.n.01``) and 897 whose every ancestor was dropped. The most frequent label kept
(``communication.n.02``) is on 4.9% of the samples, the median label on 5: a sample's labels are a chain from
its direct hypernym (often rare) up to broad classes shared by thousands (``plant.n.02``).

Parsing takes about 1.5 s and TF-IDF about 5 s more (2 busy cores): nothing is cached on disk (nor are the GCIDE
sets). Needs ``scikit-learn``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .dataset import XCDataset
from .gcide import MissingPackage
from .text import stratified_split, tfidf_datasets

# Where Debian's wordnet-base puts the database, and the variable that overrides it.
DEFAULT_DIR = "/usr/share/wordnet"
DIR_VARIABLE = "SPARSEJAX_WORDNET_DIR"
# The parts of speech that have a hypernym hierarchy (adjectives and adverbs have none).
_PARTS_OF_SPEECH = {"n": "noun", "v": "verb"}
_HYPERNYM_POINTERS = frozenset(("@", "@i"))
_VERSION = re.compile(r"WordNet (\S+) Copyright")


class Synset(NamedTuple):
  """One synset of a WordNet data file.

  Attributes:
    pos: part of speech, ``"n"`` or ``"v"``.
    offset: its byte offset in the data file, its id within that part of speech.
    words: its lemmas as the file writes them (``"Canis_familiaris"``), in order.
    hypernyms: ``(pos, offset)`` of the synsets its hypernym and instance-hypernym pointers name, in order.
    gloss: definition and examples, as written after the ``|``.
  """
  pos: str
  offset: int
  words: tuple[str, ...]
  hypernyms: tuple[tuple[str, int], ...]
  gloss: str


@dataclasses.dataclass(frozen=True, eq=False)
class WordNetInfo:
  """Names and provenance for :func:`load_wordnet` outputs.

  Attributes:
    label_names: ``[L]`` the label synsets' names (``"dog.n.01"``), in sorted order (the label ids).
    label_glosses: ``[L]`` the label synsets' glosses.
    train_texts, test_texts: the sample texts (words and gloss), aligned with the datasets.
    train_synsets, test_synsets: the sample synsets' names, aligned with the datasets.
    vectorizer: the fitted ``sklearn`` ``TfidfVectorizer``.
    wordnet_version: the version the database's license header names (``"3.0"``).
    directory: the directory the database was read from.
  """
  label_names: tuple[str, ...]
  label_glosses: tuple[str, ...]
  train_texts: tuple[str, ...]
  test_texts: tuple[str, ...]
  train_synsets: tuple[str, ...]
  test_synsets: tuple[str, ...]
  vectorizer: Any
  wordnet_version: str
  directory: str


def wordnet_dir() -> pathlib.Path:
  """The directory of the WordNet database: ``$SPARSEJAX_WORDNET_DIR``, else ``/usr/share/wordnet``.

  Raises:
    MissingPackage: the directory lacks one of the files the dataset reads (an ``ImportError``).
  """
  override = os.environ.get(DIR_VARIABLE)
  directory = pathlib.Path(override or DEFAULT_DIR)
  missing = [f"{kind}.{name}" for kind in ("data", "index") for name in _PARTS_OF_SPEECH.values()
             if not (directory / f"{kind}.{name}").is_file()]
  if missing:
    where = f"{DIR_VARIABLE}={override}" if override else str(directory)
    raise MissingPackage(f"the wordnet dataset needs the WordNet 3.0 database of Debian's wordnet-base package "
                         f"({where} has no {', '.join(missing)}): apt-get install wordnet-base, or set "
                         f"{DIR_VARIABLE} to a directory that holds data.noun, data.verb, index.noun and index.verb")
  return directory


def _lines(path: pathlib.Path):
  """``(line number, line)`` of a database file, past its license header (lines that start with two spaces)."""
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.startswith("  "):
        yield number, line


def read_version(path: str | os.PathLike) -> str:
  """The WordNet version a database file's license header names (``"3.0"``), or ``"unknown"``."""
  with open(path, encoding="utf-8") as f:
    for line in f:
      if not line.startswith("  "):
        break
      if match := _VERSION.search(line):
        return match.group(1)
  return "unknown"


def read_synsets(path: str | os.PathLike) -> list[Synset]:
  """Parses a WordNet data file (``data.noun``, ``data.verb``).

  A line is ``offset lex_filenum ss_type w_cnt word lex_id [word lex_id...] p_cnt [ptr...] [frames...] | gloss``,
  with ``w_cnt`` in hex and each pointer four fields, ``symbol offset pos source/target``.

  Returns:
    The synsets in file order.

  Raises:
    ValueError: a malformed line (naming the file and line).
  """
  path = pathlib.Path(path)
  synsets = []
  for number, line in _lines(path):
    fields, _, gloss = line.partition(" | ")
    try:
      fields = fields.split()
      num_words = int(fields[3], 16)
      pointers_at = 4 + 2 * num_words
      num_pointers = int(fields[pointers_at])
      pointers = fields[pointers_at + 1:pointers_at + 1 + 4 * num_pointers]
      if len(pointers) != 4 * num_pointers:
        raise ValueError(f"{num_pointers} pointers announced, {len(pointers) // 4} given")
      hypernyms = tuple((pointers[i + 2], int(pointers[i + 1])) for i in range(0, len(pointers), 4)
                        if pointers[i] in _HYPERNYM_POINTERS)
      synsets.append(Synset(fields[2], int(fields[0]), tuple(fields[4:pointers_at:2]), hypernyms, gloss.strip()))
    except (IndexError, ValueError) as e:
      raise ValueError(f"{path}:{number}: not a WordNet data line ({e}): {line.strip()[:80]!r}") from None
  return synsets


def read_sense_numbers(path: str | os.PathLike, pos: str) -> dict[tuple[str, int], int]:
  """Parses a WordNet index file (``index.noun``, ``index.verb``): each lemma's senses, in order.

  A line is ``lemma pos synset_cnt p_cnt [ptr_symbol...] sense_cnt tagsense_cnt synset_offset...``, with
  ``p_cnt`` symbols and ``synset_cnt`` offsets, the lemma's most frequent sense first.

  Returns:
    ``{(lemma, offset): sense number}``, from 1, lemmas lower-case as the file writes them.

  Raises:
    ValueError: a malformed line (naming the file and line).
  """
  path = pathlib.Path(path)
  senses = {}
  for number, line in _lines(path):
    fields = line.split()
    try:
      if fields[1] != pos:
        raise ValueError(f"part of speech {fields[1]!r}, not {pos!r}")
      num_synsets, num_pointers = int(fields[2]), int(fields[3])
      if num_synsets < 1 or len(fields) != 6 + num_pointers + num_synsets:
        raise ValueError(f"{num_synsets} synsets and {num_pointers} pointer symbols announced, {len(fields)} fields")
      for sense, offset in enumerate(fields[-num_synsets:], 1):
        senses[fields[0], int(offset)] = sense
    except (IndexError, ValueError) as e:
      raise ValueError(f"{path}:{number}: not a WordNet index line ({e}): {line.strip()[:80]!r}") from None
  return senses


def ancestors(synsets: Sequence[Synset]) -> list[frozenset[tuple[str, int]]]:
  """``[n]`` each synset's ancestors through hypernym and instance-hypernym pointers, transitively.

  Every path up is followed (multiple inheritance: the union); the synset itself is not its own ancestor.

  Raises:
    ValueError: a pointer to a synset that is not in ``synsets``, or a cycle of hypernyms.
  """
  parents = {(s.pos, s.offset): s.hypernyms for s in synsets}
  memo: dict[tuple[str, int], frozenset[tuple[str, int]]] = {}
  on_path: set[tuple[str, int]] = set()

  def up(key: tuple[str, int]) -> frozenset[tuple[str, int]]:
    if key in memo:
      return memo[key]
    if key in on_path:
      raise ValueError(f"the hypernyms of {key[1]:08d} ({key[0]}) lead back to it")
    on_path.add(key)
    found = set()
    for parent in parents[key]:
      if parent not in parents:
        raise ValueError(f"synset {key[1]:08d} ({key[0]}) has hypernym {parent[1]:08d} ({parent[0]}), "
                         "which is not in the data files")
      found.add(parent)
      found |= up(parent)
    on_path.discard(key)
    memo[key] = frozenset(found)
    return memo[key]

  # The noun hierarchy is under 20 levels deep: recursion is safe.
  return [up((s.pos, s.offset)) for s in synsets]


def select_labels(label_sets: Sequence[frozenset], *, max_label_fraction: float,
                  min_label_samples: int) -> tuple[list, list[int], list[list[int]]]:
  """The labels kept by the frequency filter, and each sample's ids among them.

  Args:
    label_sets: ``[n]`` each sample's labels (any sortable keys).
    max_label_fraction: drop labels on more than this fraction of the ``n`` samples.
    min_label_samples: drop labels on fewer samples than this.

  Returns:
    ``(labels, samples, sample_labels)``: the kept labels ``[L]`` in sorted order, the ids of the samples left
    with at least one of them ``[n']`` (in order), and those samples' label ids ``[n'][*]`` (ascending).
  """
  counts = collections.Counter(label for labels in label_sets for label in labels)
  most = max_label_fraction * len(label_sets)
  kept = sorted(label for label, count in counts.items() if min_label_samples <= count <= most)
  label_id = {label: i for i, label in enumerate(kept)}
  samples, sample_labels = [], []
  for i, labels in enumerate(label_sets):
    ids = sorted(label_id[label] for label in labels if label in label_id)
    if ids:
      samples.append(i)
      sample_labels.append(ids)
  return kept, samples, sample_labels


def synset_name(words: Sequence[str], pos: str, offset: int, senses: dict[tuple[str, int], int]) -> str:
  """The synset's name as NLTK writes it: its first word (lower case), part of speech, sense number.

  ``dog.n.01`` is the first sense of noun ``dog``; the sense number is the synset's place among the senses
  that the index file lists for that word.
  """
  lemma = words[0].lower()
  try:
    return f"{lemma}.{pos}.{senses[lemma, offset]:02d}"
  except KeyError:
    raise ValueError(f"the index file has no sense {offset:08d} of {lemma!r} ({pos})") from None


def _text(synset: Synset) -> str:
  """The sample text: its words, underscores as spaces, then its gloss."""
  return ", ".join(w.replace("_", " ") for w in synset.words) + "; " + synset.gloss


def load_wordnet(
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    max_label_fraction: float = 0.05,
    min_label_samples: int = 2,
    max_features: int = 100_000,
    min_df: int = 1,
) -> tuple[XCDataset, XCDataset, WordNetInfo]:
  """Load the WordNet hypernym dataset: a noun or verb synset's words and gloss -> its ancestors.

  The split is stratified by each sample's rarest label (fewest samples; ties to the lower id): a label
  with ``c`` samples that are rarest there puts about ``test_fraction * c`` of them in test and keeps one in
  train. Almost every label of WordNet 3.0 (all but about 10) is some sample's rarest; should a label still be on
  test samples alone, one of them is moved to train (none was, at test fractions 0.1 to 0.5 with seeds 0 to 2).

  Args:
    seed: seed of the train/test split.
    test_fraction: approximate fraction of samples in the test split.
    max_label_fraction: drop labels on more than this fraction of all noun and verb synsets.
    min_label_samples: drop labels on fewer synsets than this (>= 2, so that each can have training samples).
    max_features: vocabulary cap (most frequent training terms kept).
    min_df: minimum number of training texts a term must occur in.

  Returns:
    ``(train, test, info)``: datasets with L2-normalised TF-IDF rows over the same label space (label ids in
    the sorted order of their names), and :class:`WordNetInfo`.

  Raises:
    MissingPackage: the WordNet database is not there (an ``ImportError`` that says how to install it).
    ValueError: a malformed database file, or bad arguments.
  """
  if min_label_samples < 2:
    raise ValueError(f"min_label_samples must be >= 2 (test labels need training samples), got {min_label_samples}")
  if not 0.0 < max_label_fraction <= 1.0:
    raise ValueError(f"max_label_fraction must be in (0, 1], got {max_label_fraction}")
  if not 0.0 <= test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")

  directory = wordnet_dir()
  synsets: list[Synset] = []
  names: dict[tuple[str, int], str] = {}
  for pos, name in _PARTS_OF_SPEECH.items():
    part = read_synsets(directory / f"data.{name}")
    wrong = next((s for s in part if s.pos != pos), None)
    if wrong is not None:
      raise ValueError(f"{directory / f'data.{name}'}: synset {wrong.offset:08d} is a {wrong.pos!r}, not {pos!r}")
    senses = read_sense_numbers(directory / f"index.{name}", pos)
    names.update(((pos, s.offset), synset_name(s.words, pos, s.offset, senses)) for s in part)
    synsets.extend(part)
  labels, samples, sample_labels = select_labels(ancestors(synsets), max_label_fraction=max_label_fraction,
                                                 min_label_samples=min_label_samples)
  if not labels:
    raise ValueError(f"no label has {min_label_samples} to {max_label_fraction:.0%} of the {len(synsets)} synsets")
  gloss_of = {(s.pos, s.offset): s.gloss for s in synsets}
  # Label ids in the sorted order of the names (select_labels sorted the (pos, offset) keys).
  order = sorted(range(len(labels)), key=lambda i: names[labels[i]])
  new_id = np.empty(len(labels), np.int64)
  new_id[order] = np.arange(len(labels))
  labels = [labels[i] for i in order]
  sample_labels = [sorted(new_id[ids].tolist()) for ids in sample_labels]

  texts = [_text(synsets[i]) for i in samples]
  is_test = _split(sample_labels, len(labels), test_fraction, seed)
  train, test, vectorizer = tfidf_datasets(texts, sample_labels, is_test, len(labels), max_features=max_features,
                                           min_df=min_df)
  train_idx, test_idx = np.flatnonzero(~is_test), np.flatnonzero(is_test)
  sample_names = [names[synsets[i].pos, synsets[i].offset] for i in samples]
  info = WordNetInfo(
      label_names=tuple(names[key] for key in labels),
      label_glosses=tuple(gloss_of[key] for key in labels),
      train_texts=tuple(texts[i] for i in train_idx),
      test_texts=tuple(texts[i] for i in test_idx),
      train_synsets=tuple(sample_names[i] for i in train_idx),
      test_synsets=tuple(sample_names[i] for i in test_idx),
      vectorizer=vectorizer,
      wordnet_version=read_version(directory / "data.noun"),
      directory=str(directory),
  )
  return train, test, info


def _split(sample_labels: Sequence[Sequence[int]], num_labels: int, test_fraction: float, seed: int) -> np.ndarray:
  """Boolean ``[n]`` test mask, stratified by each sample's rarest label; every label keeps a training sample."""
  counts = np.bincount(np.concatenate([np.asarray(ids) for ids in sample_labels]), minlength=num_labels)
  rarest = np.array([min(ids, key=lambda label: (counts[label], label)) for ids in sample_labels])
  is_test = stratified_split(rarest, test_fraction, seed)
  # A label whose samples all went to test (each was rarest elsewhere): its first one goes back to train.
  in_train = np.zeros(num_labels, bool)
  for ids, test in zip(sample_labels, is_test):
    if not test:
      in_train[ids] = True
  for i, ids in enumerate(sample_labels):
    if is_test[i] and not in_train[ids].all():
      is_test[i] = False
      in_train[ids] = True
  return is_test
