"""Tests for sparsejax.data.wordnet: the WordNet parser, ancestors, label filter, split and --dataset=wordnet.

The fixture in tests/data/wordnet holds 16 noun and 3 verb lines of WordNet 3.0 (real offsets, words, glosses
and license header), with pointers cut to a few per line: a hypernym chain entity -> physical_entity -> object
-> whole -> living_thing -> organism, person under both organism and causal_agent, dog under domestic_animal
under animal, Einstein an instance (``@i``) of physicist under scientist under person, acme (10 words, ``0a``)
under degree (a root here), and the verbs respire and choke under breathe (whose offset, 00001740, is also
entity's). The index files hold the real lines of those lemmas.
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np
import pytest

from sparsejax.data import WordNetInfo, load_dataset, load_wordnet, wordnet
from sparsejax.data import loading as loading_module
from sparsejax.data.text import stratified_split

FIXTURE = pathlib.Path(__file__).resolve().parent / "data" / "wordnet"

# Each fixture synset's ancestors, worked out by hand from the fixture's @ and @i pointers.
_LIVING = {"living_thing.n.01", "whole.n.02", "object.n.01", "physical_entity.n.01", "entity.n.01"}
_PERSON = {"organism.n.01", "causal_agent.n.01"} | _LIVING
EXPECTED_ANCESTORS = {
    "entity.n.01": set(),
    "physical_entity.n.01": {"entity.n.01"},
    "object.n.01": {"physical_entity.n.01", "entity.n.01"},
    "whole.n.02": {"object.n.01", "physical_entity.n.01", "entity.n.01"},
    "living_thing.n.01": _LIVING - {"living_thing.n.01"},
    "organism.n.01": _LIVING,
    "causal_agent.n.01": {"physical_entity.n.01", "entity.n.01"},
    "person.n.01": _PERSON,
    "animal.n.01": {"organism.n.01"} | _LIVING,
    "domestic_animal.n.01": {"animal.n.01", "organism.n.01"} | _LIVING,
    "dog.n.01": {"domestic_animal.n.01", "animal.n.01", "organism.n.01"} | _LIVING,
    "scientist.n.01": {"person.n.01"} | _PERSON,
    "physicist.n.01": {"scientist.n.01", "person.n.01"} | _PERSON,
    "einstein.n.01": {"physicist.n.01", "scientist.n.01", "person.n.01"} | _PERSON,
    "degree.n.02": set(),
    "acme.n.01": {"degree.n.02"},
    "breathe.v.01": set(),
    "respire.v.01": {"breathe.v.01"},
    "choke.v.01": {"breathe.v.01"},
}
# With max_label_fraction=0.25 (at most 4 of the 19 synsets) and min_label_samples=2, the labels kept: entity
# (13 descendants) down to organism (7) are too frequent; domestic_animal, physicist and degree have one each.
FIXTURE_LABELS = ("animal.n.01", "breathe.v.01", "causal_agent.n.01", "person.n.01", "scientist.n.01")
FIXTURE_SAMPLE_LABELS = {
    "person.n.01": {"causal_agent.n.01"},
    "domestic_animal.n.01": {"animal.n.01"},
    "dog.n.01": {"animal.n.01"},
    "scientist.n.01": {"person.n.01", "causal_agent.n.01"},
    "physicist.n.01": {"scientist.n.01", "person.n.01", "causal_agent.n.01"},
    "einstein.n.01": {"scientist.n.01", "person.n.01", "causal_agent.n.01"},
    "respire.v.01": {"breathe.v.01"},
    "choke.v.01": {"breathe.v.01"},
}


@pytest.fixture
def fixture_dir(monkeypatch) -> pathlib.Path:
  monkeypatch.setenv(wordnet.DIR_VARIABLE, str(FIXTURE))
  return FIXTURE


def _fixture_synsets():
  return wordnet.read_synsets(FIXTURE / "data.noun") + wordnet.read_synsets(FIXTURE / "data.verb")


def _names(synsets):
  senses = {pos: wordnet.read_sense_numbers(FIXTURE / f"index.{name}", pos) for pos, name in (("n", "noun"),
                                                                                             ("v", "verb"))}
  return {(s.pos, s.offset): wordnet.synset_name(s.words, s.pos, s.offset, senses[s.pos]) for s in synsets}


def _labels_by_sample(dataset, synset_names, label_names):
  return {name: {label_names[j] for j in dataset.label_indices[dataset.label_indptr[i]:dataset.label_indptr[i + 1]]}
          for i, name in enumerate(synset_names)}


def test_parser_reads_words_pointers_and_gloss():
  nouns, verbs = wordnet.read_synsets(FIXTURE / "data.noun"), wordnet.read_synsets(FIXTURE / "data.verb")
  assert [s.offset for s in nouns] == [1740, 1930, 2684, 3553, 4258, 4475, 7347, 7846, 15388, 1317541, 2084071,
                                       10428004, 10560637, 10954498, 13939892, 13940456]
  by_offset = {s.offset: s for s in nouns}
  # Two hypernyms; the other pointers (#m member holonym, + derivation) are not hypernyms.
  assert by_offset[7846] == wordnet.Synset(
      "n", 7846, ("person", "individual", "someone", "somebody", "mortal", "soul"), (("n", 4475), ("n", 7347)),
      'a human being; "there was too much for one person to do"')
  assert by_offset[10954498] == wordnet.Synset(  # an instance hypernym
      "n", 10954498, ("Einstein", "Albert_Einstein"), (("n", 10428004),),
      "physicist born in Germany who formulated the special theory of relativity and the general theory of "
      "relativity; Einstein also proposed that light consists of discrete quantized bundles of energy (later "
      "called photons) (1879-1955)")
  # w_cnt is hex: 0a is 10 words.
  assert by_offset[13940456].words == ("acme", "height", "elevation", "peak", "pinnacle", "summit", "superlative",
                                       "meridian", "tiptop", "top")
  assert by_offset[13940456].hypernyms == (("n", 13939892),)
  assert by_offset[2084071].words == ("dog", "domestic_dog", "Canis_familiaris")
  assert by_offset[2084071].hypernyms == (("n", 1317541),)
  assert by_offset[1740].hypernyms == ()
  # Verb lines end their pointers with frames (f_cnt + f_num w_num ...); verb groups ($) are not hypernyms.
  assert verbs == [
      wordnet.Synset("v", 1740, ("breathe", "take_a_breath", "respire", "suspire"), (),
                     'draw air into, and expel out of, the lungs; "I can breathe better when the air is clean"; '
                     '"The patient is respiring"'),
      wordnet.Synset("v", 2573, ("respire",), (("v", 1740),), "breathe easily again, as after exertion or anxiety"),
      wordnet.Synset("v", 2724, ("choke",), (("v", 1740),),
                     'breathe with great difficulty, as when experiencing a strong emotion; "She choked with '
                     'emotion when she spoke about her deceased husband"'),
  ]
  assert wordnet.read_version(FIXTURE / "data.noun") == "3.0"


def test_names_are_nltks_sense_numbers():
  names = _names(_fixture_synsets())
  assert sorted(names.values()) == sorted(EXPECTED_ANCESTORS)
  # whole and degree are listed second in index.noun; Einstein is lower-cased as in the index.
  assert names["n", 3553] == "whole.n.02"
  assert names["n", 13939892] == "degree.n.02"
  assert names["n", 10954498] == "einstein.n.01"
  assert names["n", 1740] == "entity.n.01" and names["v", 1740] == "breathe.v.01"
  with pytest.raises(ValueError, match=r"no sense 00000001 of 'dog' \(n\)"):
    wordnet.synset_name(("dog",), "n", 1, {})


def test_ancestors_follow_every_hypernym_and_instance_path():
  synsets = _fixture_synsets()
  names = _names(synsets)
  found = {names[s.pos, s.offset]: {names[a] for a in ancestors} for s, ancestors in
           zip(synsets, wordnet.ancestors(synsets))}
  assert found == EXPECTED_ANCESTORS


def test_ancestors_reject_a_missing_hypernym_and_a_cycle():
  orphan = wordnet.Synset("n", 5, ("x",), (("n", 6),), "")
  with pytest.raises(ValueError, match=r"synset 00000005 \(n\) has hypernym 00000006 \(n\), which is not in"):
    wordnet.ancestors([orphan])
  cycle = [wordnet.Synset("n", 5, ("x",), (("n", 6),), ""), wordnet.Synset("n", 6, ("y",), (("n", 5),), "")]
  with pytest.raises(ValueError, match=r"the hypernyms of 0000000[56] \(n\) lead back to it"):
    wordnet.ancestors(cycle)


def test_malformed_lines_name_file_and_line(tmp_path):
  path = tmp_path / "data.noun"
  path.write_text("  1 license\n00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | too few pointers  \n")
  with pytest.raises(ValueError, match=r"data\.noun:2: not a WordNet data line \(3 pointers announced, 1 given\)"):
    wordnet.read_synsets(path)
  path.write_text("00001740 03 n zz entity 0 000 | bad word count  \n")
  with pytest.raises(ValueError, match=r"data\.noun:1: not a WordNet data line"):
    wordnet.read_synsets(path)
  index = tmp_path / "index.noun"
  index.write_text("dog n 2 1 @ 2 1 02084071  \n")
  with pytest.raises(ValueError, match=r"index\.noun:1: not a WordNet index line \(2 synsets and 1 pointer "
                     r"symbols announced, 8 fields\)"):
    wordnet.read_sense_numbers(index, "n")
  with pytest.raises(ValueError, match=r"index\.noun:1: .*part of speech 'n', not 'v'"):
    wordnet.read_sense_numbers(index, "v")


def test_label_filter_drops_frequent_and_single_labels_then_empty_samples():
  label_sets = [frozenset("ab"), frozenset("a"), frozenset("ac"), frozenset("c"), frozenset(), frozenset("d")]
  # a is on 3 of 6 samples: kept at a 50% cap (3 <= 3), dropped at 40%; b and d are on one sample each.
  assert wordnet.select_labels(label_sets, max_label_fraction=0.5, min_label_samples=2) == (
      ["a", "c"], [0, 1, 2, 3], [[0], [0], [0, 1], [1]])
  assert wordnet.select_labels(label_sets, max_label_fraction=0.4, min_label_samples=2) == (["c"], [2, 3], [[0], [0]])
  assert wordnet.select_labels(label_sets, max_label_fraction=1.0, min_label_samples=1) == (
      ["a", "b", "c", "d"], [0, 1, 2, 3, 5], [[0, 1], [0], [0, 2], [2], [3]])


def test_split_gives_back_a_label_whose_samples_all_went_to_test():
  # Labels 0, 1 and 2 are each sample pair's rarest; label 3 is on samples 0, 2 and 4, one of each pair.
  sample_labels = [[0, 3], [0], [1, 3], [1], [2, 3], [2]]
  rarest = np.array([0, 0, 1, 1, 2, 2])
  seed = next(s for s in range(100) if stratified_split(rarest, 0.5, s).tolist() == [True, False] * 3)
  # Sample 0 is the first test sample of label 3: it goes to train, the others stay.
  assert wordnet._split(sample_labels, 4, 0.5, seed).tolist() == [False, False, True, False, True, False]


def test_load_wordnet_on_the_fixture(fixture_dir):
  train, test, info = load_wordnet(seed=3, test_fraction=0.5, max_label_fraction=0.25)
  assert isinstance(info, WordNetInfo)
  assert info.label_names == FIXTURE_LABELS
  assert info.label_glosses[0] == "a living organism characterized by voluntary movement"
  assert (info.wordnet_version, info.directory) == ("3.0", str(FIXTURE))
  assert (train.num_labels, test.num_labels) == (5, 5)
  # Rarest-label groups: {domestic_animal, dog}, {respire, choke}, {physicist, einstein} put one each in test;
  # person and scientist are alone in theirs.
  assert (len(train), len(test)) == (5, 3)
  found = _labels_by_sample(train, info.train_synsets, info.label_names)
  found.update(_labels_by_sample(test, info.test_synsets, info.label_names))
  assert found == FIXTURE_SAMPLE_LABELS
  assert {"person.n.01", "scientist.n.01"} <= set(info.train_synsets)
  for pair in ({"domestic_animal.n.01", "dog.n.01"}, {"respire.v.01", "choke.v.01"},
               {"physicist.n.01", "einstein.n.01"}):
    assert len(pair & set(info.test_synsets)) == 1
  text_of = dict(zip(info.train_synsets + info.test_synsets, info.train_texts + info.test_texts))
  assert text_of["dog.n.01"] == (
      "dog, domestic dog, Canis familiaris; a member of the genus Canis (probably descended from the common wolf) "
      'that has been domesticated by man since prehistoric times; occurs in many breeds; "the dog barked all night"')
  # Features: the vectorizer fitted on the training texts, rows as it gives them.
  assert train.num_features == len(info.vectorizer.vocabulary_)
  row = info.vectorizer.transform([info.test_texts[0]])
  assert row.indices.size == test.indptr[1] > 0
  assert np.allclose(row.toarray()[0, test.indices[:test.indptr[1]]], test.values[:test.indptr[1]])


def test_load_wordnet_defaults_leave_the_tiny_fixture_no_label(fixture_dir):
  # 5% of 19 synsets is under one: every label is too frequent.
  with pytest.raises(ValueError, match=r"no label has 2 to 5% of the 19 synsets"):
    load_wordnet()


def test_dataset_wordnet_loads_through_the_config(fixture_dir, monkeypatch):
  from sparsejax.config import DataConfig

  monkeypatch.setattr(loading_module, "load_wordnet", functools.partial(load_wordnet, max_label_fraction=0.25))
  data = load_dataset(DataConfig(dataset="wordnet", test_fraction=0.5), seed=3)
  assert data.label_names == FIXTURE_LABELS
  assert (len(data.train), len(data.test)) == (5, 3)
  assert data.vectorizer.transform(["a person"]).shape == (1, data.train.num_features)


def test_dataset_wordnet_without_the_database_is_a_config_error(tmp_path, monkeypatch):
  from sparsejax.config import DataConfig
  from sparsejax.settings import ConfigError

  monkeypatch.setenv(wordnet.DIR_VARIABLE, str(tmp_path))
  (tmp_path / "data.noun").write_text("")
  with pytest.raises(ConfigError, match=r"--dataset=wordnet: .*wordnet-base.*has no data\.verb, index\.noun, "
                     r"index\.verb\): apt-get install wordnet-base, or set SPARSEJAX_WORDNET_DIR"):
    load_dataset(DataConfig(dataset="wordnet"))
  monkeypatch.delenv(wordnet.DIR_VARIABLE)
  monkeypatch.setattr(wordnet, "DEFAULT_DIR", str(tmp_path / "absent"))
  with pytest.raises(wordnet.MissingPackage, match=r"\(.*absent has no data\.noun, .*\): apt-get install wordnet-base"):
    load_wordnet()


_HAVE_WORDNET = all((pathlib.Path(wordnet.DEFAULT_DIR) / f).is_file() for f in ("data.noun", "data.verb",
                                                                                 "index.noun", "index.verb"))


@pytest.mark.skipif(not _HAVE_WORDNET, reason="needs Debian's wordnet-base (apt-get install wordnet-base)")
def test_real_wordnet_counts(monkeypatch):
  monkeypatch.delenv(wordnet.DIR_VARIABLE, raising=False)
  train, test, info = load_wordnet(seed=0, test_fraction=0.2)
  labels_per_sample = np.concatenate([np.diff(train.label_indptr), np.diff(test.label_indptr)])
  assert (len(train) + len(test), train.num_labels) == (94_425, 13_708)
  assert labels_per_sample.sum() == 393_333 and labels_per_sample.max() == 23
  assert info.wordnet_version == "3.0"
  i = info.train_synsets.index("dog.n.01")
  assert {info.label_names[j] for j in train.label_indices[train.label_indptr[i]:train.label_indptr[i + 1]]} == {
      "animal.n.01", "canine.n.02", "carnivore.n.01", "chordate.n.01", "domestic_animal.n.01", "mammal.n.01",
      "placental.n.01", "vertebrate.n.01"}
  # Every label has training samples.
  assert np.bincount(train.label_indices, minlength=train.num_labels).min() >= 1
