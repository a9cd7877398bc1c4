"""The text vectorizer a work directory keeps (``assets/vectorizer.json``): data checked against a fixed schema."""

import builtins
import json
import re
import time

import numpy as np
import pytest

from sparsejax.data.text import TOKEN_PATTERN, VectorizerFormatError, load_vectorizer, save_vectorizer, tfidf_datasets

TEXTS = ["type 2 diabetes mellitus", "fracture of the neck of the femur", "diabetes with kidney complications",
         "open fracture of the right femur", "type 1 diabetes", "neck pain"]


@pytest.fixture(scope="module")
def fitted():
  """A vectorizer fitted as the real datasets fit theirs."""
  labels = [[i % 2] for i in range(len(TEXTS))]
  is_test = np.arange(len(TEXTS)) == len(TEXTS) - 1
  *_, vectorizer = tfidf_datasets(TEXTS, labels, is_test, 2, max_features=50)
  return vectorizer


@pytest.fixture
def saved(fitted, tmp_path):
  """``(path, document)`` of the fitted vectorizer as save_vectorizer writes it."""
  path = tmp_path / "vectorizer.json"
  save_vectorizer(fitted, path)
  return path, json.loads(path.read_text())


def test_a_saved_vectorizer_round_trips_exactly(fitted, saved, tmp_path):
  path, document = saved
  loaded = load_vectorizer(path)
  texts = ["diabetes of the femur", "Type 2 fracture, open", "nothing known here", ""]
  want, got = fitted.transform(texts), loaded.transform(texts)
  assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
  assert (got != want).nnz == 0
  assert loaded.vocabulary_ == fitted.vocabulary_
  assert document["params"]["token_pattern"] == TOKEN_PATTERN and document["params"]["input"] == "content"
  save_vectorizer(loaded, tmp_path / "again.json")  # and saved again, the same file
  assert (tmp_path / "again.json").read_text() == path.read_text()


def _hostile(path, document, key, value):
  """Writes ``document`` to ``path`` with ``key`` (``params.input``, ``idf``, ...) set to ``value`` (None: gone)."""
  *parents, last = key.split(".")
  changed = json.loads(json.dumps(document))
  target = changed
  for name in parents:
    target = target[name]
  if value is None:
    del target[last]
  else:
    target[last] = value
  path.write_text(json.dumps(changed))


def test_a_vectorizer_that_opens_its_texts_as_files_is_refused_before_any_read(saved, tmp_path, monkeypatch):
  path, document = saved
  # A file whose words the vocabulary knows: read as a text's content, it would give that text features.
  secret = tmp_path / "secret.txt"
  secret.write_text("diabetes fracture femur\n")
  _hostile(path, document, "params.input", "filename")
  opened = []
  real_open = builtins.open
  monkeypatch.setattr(builtins, "open", lambda file, *args, **kwargs: opened.append(str(file)) or
                      real_open(file, *args, **kwargs))
  refusal = None
  try:
    load_vectorizer(path).transform([str(secret)])  # the hostile file's promise: open each "text" as a path
  except VectorizerFormatError as e:
    refusal = str(e)
  assert str(secret) not in opened  # it was: the text got the secret's features
  assert opened == [str(path)]
  assert refusal.startswith(f"{path}: params.input: must be 'content' (the texts themselves, never names of files "
                            "to read), got \"filename\""), refusal


def test_a_vectorizer_with_its_own_regular_expression_is_refused_at_once(saved):
  path, document = saved
  _hostile(path, document, "params.token_pattern", "(a+)+b")  # backtracks exponentially on "aaaa...a"
  start = time.monotonic()
  with pytest.raises(VectorizerFormatError, match=re.escape(f"{path}: params.token_pattern: must be sparsejax's "
                                                            f"own {TOKEN_PATTERN!r}, got \"(a+)+b\"")):
    load_vectorizer(path).transform(["a" * 25])  # ~1.5 s; each further "a" doubles it
  assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("key, value, message", [
    ("params.analyzer", "char", "params.analyzer: must be 'word', got \"char\""),
    ("params.tokenizer", "os.system", "params.tokenizer: must be null"),
    ("params.preprocessor", "eval", "params.preprocessor: must be null"),
    ("params.stop_words", ["the"], "params.stop_words: must be null"),
    ("params.encoding", "rot13", "params.encoding: must be 'utf-8'"),
    ("params.lowercase", "yes", "params.lowercase: must be true or false, got \"yes\""),
    ("params.ngram_range", [1, 1000], "params.ngram_range: must be [min_n, max_n], 1 <= min_n <= max_n <= 3"),
    ("params.ngram_range", [2, 1], "params.ngram_range: must be [min_n, max_n]"),
    ("params.ngram_range", [True, 2], "params.ngram_range: must be [min_n, max_n]"),
    ("params.max_features", 0, "params.max_features: must be null or an integer >= 1, got 0"),
    ("params.dtype", "float64", "params.dtype: not a parameter sparsejax writes"),
    ("params.use_idf", None, "params.use_idf: missing"),
    ("params", [], "params: must be an object"),
    ("vocabulary", {}, "vocabulary: must be a non-empty object of term: column"),
    ("vocabulary", ["a", "b"], "vocabulary: must be a non-empty object"),
    ("vocabulary.zzz", 10**6, "vocabulary['zzz']: must be a column in ["),
    ("vocabulary.diabetes", 1.5, "vocabulary['diabetes']: must be a column in ["),
    ("vocabulary.diabetes", -1, "vocabulary['diabetes']: must be a column in ["),
    ("idf", [1.0], "idf: must be a list of "),
    ("idf", None, "must be a JSON object of exactly params, vocabulary and idf"),
    ("extra", 1, "must be a JSON object of exactly params, vocabulary and idf"),
])
def test_anything_but_the_schema_is_refused_naming_the_file_and_key(saved, key, value, message):
  path, document = saved
  _hostile(path, document, key, value)
  with pytest.raises(VectorizerFormatError) as caught:
    load_vectorizer(path)
  assert str(caught.value).startswith(f"{path}: {message}"), str(caught.value)


def test_vocabulary_columns_are_a_permutation_and_idf_weights_finite(saved):
  path, document = saved
  terms = sorted(document["vocabulary"], key=document["vocabulary"].get)
  _hostile(path, document, f"vocabulary.{terms[1]}", 0)  # two terms, one column
  with pytest.raises(VectorizerFormatError, match=re.escape(f"{path}: vocabulary[{terms[1]!r}]: column 0 is "
                                                            f"also {terms[0]!r}'s")):
    load_vectorizer(path)
  for weight, shown in ((float("nan"), "NaN"), (float("inf"), "Infinity"), (0.5, "0.5"), ("2", '"2"'),
                        (1e300, "1e+300")):
    _hostile(path, document, "idf", [weight] + document["idf"][1:])
    with pytest.raises(VectorizerFormatError, match=re.escape(f"{path}: idf[0]: must be a number in [1, 1e+06] "
                                                              f"(ln(n / df) + 1), got {shown}")):
      load_vectorizer(path)


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe not utf-8", "not a vectorizer's JSON: UnicodeDecodeError"),
    (b"{", "not a vectorizer's JSON: JSONDecodeError"),
    (b"[" * 100_000 + b"]" * 100_000, "not a vectorizer's JSON: RecursionError"),
    (b"[]", "must be a JSON object of exactly params, vocabulary and idf"),
])
def test_a_file_that_is_not_a_vectorizer_is_named(tmp_path, content, message):
  path = tmp_path / "vectorizer.json"
  path.write_bytes(content)
  with pytest.raises(VectorizerFormatError, match=re.escape(f"{path}: {message}")):
    load_vectorizer(path)


def test_a_vectorizer_load_would_refuse_is_not_saved(fitted, tmp_path):
  other = type(fitted)(token_pattern=r"\w+").fit(TEXTS)
  with pytest.raises(VectorizerFormatError, match=re.escape(f"{tmp_path / 'v.json'}: params.token_pattern: must be "
                                                            "sparsejax's own")):
    save_vectorizer(other, tmp_path / "v.json")
  assert not (tmp_path / "v.json").exists()
