"""Fuzzing the XC reader: byte-level mutations of valid files give a valid dataset or an XCFormatError with file:line.

Variants of a valid file (CRLF, a BOM, trailing spaces, blank lines, gzip) are
mutated byte by byte (flips, insertions of bytes and of tokens that matter to
the format, deletions, duplications). The reader's result must equal that of
its line-by-line reference parser alone (the fast path switched off), and be
either a dataset that passes XCDataset's checks with finite float32 values, or
an XCFormatError whose message starts with "path:line:" for a line of the file.
"""

import collections
import gzip
import re
from unittest import mock

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sparsejax.data import XCFormatError, load_xc_file, make_synthetic, save_xc_file, xc_format

# Bytes and tokens that matter to the format, inserted anywhere.
TOKENS = [b"\r\n", b"\n", b"\r", b" ", b"\t", b"\x0b", b"\x1c", b":", b",", b"-", b"+", b".", b"e", b"\x00", b"\xff",
          b"\xef\xbb\xbf", b"0:0", b"1,2", b" 0:1e39"]
# Replacements for a feature value, a feature id and a label field.
VALUES = [b"1e39", b"-3.5e38", b"3.4e38", b"1e-50", b"-0", b"1_5", b"nan", b"-inf", b"", b"+1", b".5", b"5.", b"1e",
          b"0x1", b"1,5", b"1:2"]
IDS = [b"-1", b"2147483648", b"99999999999999999999", b"", b"0x1", b"1.0", b"+1", b"29", b"30", b"\xd9\xa3"]
LABELS = [b"-1", b"8", b"9", b"1,,2", b"1,", b",1", b"0,0", b"1.5", b"2:1", b"4294967296"]
SPANS = {"value": (re.compile(rb":([^\s:]*)"), VALUES), "id": (re.compile(rb"(?:^|\s)(\d+):", re.M), IDS),
         "label": (re.compile(rb"^([^\s:]+)(?=\s)", re.M), LABELS)}

mutation = st.tuples(
    st.sampled_from(["flip", "insert", "token", "delete", "duplicate", "value", "id", "label", "line"]),
    st.integers(0, 1 << 16), st.integers(0, 255), st.integers(0, 63), st.integers(1, 12))
case = st.fixed_dictionaries({
    "seed": st.integers(0, 3), "crlf": st.booleans(), "bom": st.booleans(), "trailing_spaces": st.booleans(),
    "blank_lines": st.integers(0, 2), "gz": st.booleans(), "mutate_compressed": st.booleans(),
    "chunk_bytes": st.sampled_from([16, 100, 1 << 20]), "mutations": st.lists(mutation, max_size=4)})


def _mutate(data: bytes, mutations) -> bytes:
  b = bytearray(data)
  for kind, where, byte, pick, length in mutations:
    i = where % (len(b) + 1)
    if kind == "flip" and i < len(b):
      b[i] ^= 1 << (byte % 8)
    elif kind == "insert":
      b[i:i] = bytes([byte])
    elif kind == "token":
      b[i:i] = TOKENS[pick % len(TOKENS)]
    elif kind == "delete":
      del b[i:i + length]
    elif kind == "duplicate":
      b[i:i] = b[i:i + length]
    elif kind == "line":  # delete, duplicate or blank out a whole line
      lines = bytes(b).split(b"\n")
      j = where % len(lines)
      lines[j:j + 1] = [[], [lines[j]] * 2, [b""]][byte % 3]
      b = bytearray(b"\n".join(lines))
    elif kind in SPANS:
      pattern, replacements = SPANS[kind]
      spans = [m.span(1) for m in pattern.finditer(bytes(b))]
      if spans:
        start, stop = spans[where % len(spans)]
        b[start:stop] = replacements[pick % len(replacements)]
  return bytes(b)


def _file_bytes(c, base: bytes) -> tuple[bytes, bytes]:
  """The file's bytes, and its text (uncompressed; before mutation where the compressed bytes are mutated)."""
  text = base
  if c["trailing_spaces"]:
    text = text.replace(b"\n", b"  \n")
  if c["crlf"]:
    text = text.replace(b"\n", b"\r\n")
  text = (b"\xef\xbb\xbf" if c["bom"] else b"") + text + b"\n" * c["blank_lines"]
  if c["gz"] and c["mutate_compressed"]:
    return _mutate(gzip.compress(text, mtime=0), c["mutations"]), text
  text = _mutate(text, c["mutations"])
  return (gzip.compress(text, mtime=0) if c["gz"] else text), text


def _load(path, chunk_bytes, fast: bool):
  """The dataset's arrays, or the error message."""
  with mock.patch.object(xc_format, "_parse_chunk_fast", xc_format._parse_chunk_fast if fast else lambda *a: None):
    try:
      ds = load_xc_file(path, chunk_bytes=chunk_bytes)
    except XCFormatError as e:
      return e
  return ds


def test_mutated_files_give_a_dataset_or_an_error_naming_file_and_line(tmp_path, fuzz_settings, capsys,
                                                                       record_cases):
  bases = {}
  for seed in range(4):
    ds = make_synthetic(8 + 3 * seed, 30, 9, labels_per_sample=1.5, seed=seed)
    save_xc_file(ds, tmp_path / "base.txt")
    bases[seed] = (ds, (tmp_path / "base.txt").read_bytes())
  path = tmp_path / "case.txt"
  counts = collections.Counter()

  @fuzz_settings(300)
  @given(case)
  def check(c):
    original, base = bases[c["seed"]]
    data, text = _file_bytes(c, base)
    path.write_bytes(data)
    got, reference = _load(path, c["chunk_bytes"], True), _load(path, c["chunk_bytes"], False)
    counts["cases"] += 1
    if isinstance(got, XCFormatError):
      counts["errors"] += 1
      assert isinstance(reference, XCFormatError) and str(got) == str(reference), (got, reference)
      assert str(got).startswith(f"{path}:{got.line}: ") and 1 <= got.line <= text.count(b"\n") + 2, got
      return
    counts["datasets"] += 1
    assert not isinstance(reference, XCFormatError), reference
    for field in ("indptr", "indices", "values", "label_indptr", "label_indices"):
      np.testing.assert_array_equal(getattr(got, field), getattr(reference, field), err_msg=field)
    assert got.values.dtype == np.float32 and np.all(np.isfinite(got.values))
    assert (got.indices < got.num_features).all() and (got.label_indices < got.num_labels).all()
    if not c["mutations"]:
      for field in ("indptr", "indices", "values", "label_indptr", "label_indices"):
        np.testing.assert_array_equal(getattr(got, field), getattr(original, field), err_msg=field)

  check()
  with capsys.disabled():
    print(f"\nXC reader fuzz: {counts['cases']} cases: {counts['datasets']} datasets, {counts['errors']} "
          "XCFormatErrors with file:line, 0 crashes")
  record_cases("XC reader (mutated files)", {"dataset": counts["datasets"], "error": counts["errors"]})
  assert counts["cases"] >= 250 and counts["datasets"] > 10 and counts["errors"] > 50, counts
