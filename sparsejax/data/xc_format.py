"""Reader / writer for the Extreme Classification Repository text format.

Format (e.g. Amazon-670K ``train.txt``)::

  num_points num_features num_labels
  l1,l2,... f:v f:v ...
  f:v f:v ...            <- a sample with no labels starts with a space

Labels and feature ids are 0-based. As a convenience, a line whose first item
contains ``:`` is also read as a label-less sample. Trailing whitespace-only
lines at the end of the file are ignored; CR/LF line ends, a UTF-8 byte order
mark and gzip compression (``.gz`` or not: the magic bytes decide) are
accepted. Whitespace is ASCII's (space, tab, CR, VT, FF); values must be
finite in float32 (``1e39`` is an error, not ``inf``).

Speed: the file is processed in chunks of whole lines with a vectorised numpy
tokenizer (byte classes, token boundaries, structural checks) and a single
``np.fromstring`` call to convert every number of the chunk. Any chunk that
fails a check is re-parsed line by line with a careful Python parser, which
reports the first bad line (file name and 1-based line number, header = line
1) in an :class:`XCFormatError`.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import warnings
import zlib
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

import numpy as np

from .dataset import XCDataset

_CHUNK_BYTES = 32 << 20
UTF8_BOM = b"\xef\xbb\xbf"
_GZIP_MAGIC = b"\x1f\x8b"
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest magnitude that rounds to inf in float32 (half an ulp above the largest float32): a value below it,
# such as the shortest text of the largest float32 that save_xc_file writes, reads as a finite float32.
FLOAT32_OVERFLOW = 2.0**128 - 2.0**103

# Byte -> class tables, applied with ``bytes.translate`` (several times faster
# than numpy fancy indexing on uint8 arrays).
_TOK, _SPACE, _NL, _COMMA, _COLON = 0, 1, 2, 3, 4
_CLASS_TABLE = bytearray(256)
for _ch in b" \t\r\v\f":
  _CLASS_TABLE[_ch] = _SPACE
_CLASS_TABLE[ord("\n")] = _NL
_CLASS_TABLE[ord(",")] = _COMMA
_CLASS_TABLE[ord(":")] = _COLON
_CLASS_TABLE = bytes(_CLASS_TABLE)
# 1 for token bytes that are not digits (allowed only inside values).
_NONDIGIT_TABLE = bytes(int(_CLASS_TABLE[b] == _TOK and not 48 <= b <= 57) for b in range(256))
# Separators -> space so one ``np.fromstring(sep=" ")`` reads every number.
_NUMBERS_TABLE = bytes.maketrans(b",:\t\r\v\f", b"      ")


class XCFormatError(ValueError):
  """Malformed XC-format file; ``str()`` starts with ``"<path>:<line>: "``.

  Attributes:
    path: the file.
    line: 1-based line number (the header is line 1).
  """

  def __init__(self, path: str | os.PathLike, line: int, message: str):
    self.path = os.fspath(path)
    self.line = int(line)
    self.message = message
    super().__init__(f"{self.path}:{self.line}: {message}")

  def __reduce__(self):  # keep picklable despite the custom signature
    return type(self), (self.path, self.line, self.message)


class _Rows(NamedTuple):
  """Parsed CSR pieces for a run of consecutive lines."""

  feat_counts: np.ndarray  # [lines] int64
  feat_ids: np.ndarray  # [nnz] int32
  feat_vals: np.ndarray  # [nnz] float32
  label_counts: np.ndarray  # [lines] int64
  label_ids: np.ndarray  # [nnz_l] int32


def _shown(line: bytes) -> str:
  """The start of a line as text, for a message."""
  return line[:80].decode("utf-8", "replace").rstrip("\r\n")


def _parse_header(line: bytes, path) -> tuple[int, int, int]:
  fields = line.split()
  if len(fields) != 3:
    raise XCFormatError(path, 1, f"header must be 'num_points num_features num_labels', got {_shown(line)!r}")
  try:
    counts = tuple(int(f) for f in fields)
  except ValueError:
    raise XCFormatError(path, 1, f"header fields must be integers, got {_shown(line)!r}") from None
  if min(counts) < 0:
    raise XCFormatError(path, 1, f"header counts must be >= 0, got {_shown(line)!r}")
  if max(counts[1:]) > np.iinfo(np.int32).max:
    raise XCFormatError(path, 1, "num_features and num_labels must fit in int32")
  return counts  # type: ignore[return-value]


# --------------------------------------------------------------------------
# Fast path.
# --------------------------------------------------------------------------
def _parse_chunk_fast(chunk: bytes, num_features: int, num_labels: int) -> _Rows | None:
  """Vectorised parse of whole lines (``chunk`` ends with ``\\n``).

  Works on token boundaries (maximal runs of non-separator bytes) and their
  neighbouring separator classes, so most arrays are per token, not per byte.
  Returns None if anything is off; the caller then runs the line parser,
  which gives the precise error (or the parse, if this path was too strict).
  """
  cls = np.frombuffer(chunk.translate(_CLASS_TABLE), dtype=np.uint8)
  tok = cls == _TOK
  # Token starts and ends alternate (the chunk ends with '\n', a non-token).
  edges = np.flatnonzero(np.diff(tok.view(np.int8), prepend=np.int8(0)))
  starts, ends = edges[0::2], edges[1::2]
  num_tok = len(starts)
  nl = np.flatnonzero(cls == _NL)
  num_lines = len(nl)
  line_start = np.concatenate(([0], nl[:-1] + 1))
  first_tok = np.searchsorted(starts, line_start)  # [lines]
  tok_per_line = np.diff(first_tok, append=num_tok)
  num_commas = np.count_nonzero(cls == _COMMA)
  num_colons = np.count_nonzero(cls == _COLON)
  if num_tok == 0:
    return _empty_rows(num_lines) if num_commas + num_colons == 0 else None
  tok_line = np.repeat(np.arange(num_lines), tok_per_line)

  prev_cls = cls[starts - 1]  # starts[0] == 0 wraps to the final '\n': fine
  next_cls = cls[ends]
  prev_ws = (prev_cls == _SPACE) | (prev_cls == _NL)
  next_ws = (next_cls == _SPACE) | (next_cls == _NL)
  next_colon = next_cls == _COLON
  # glued[i]: token i+1 starts right after the single separator ending token i.
  glued = np.zeros(num_tok, dtype=bool)
  glued[:-1] = starts[1:] == ends[:-1] + 1

  # Label field = the line's first whitespace-delimited item, when the line
  # starts with a token and that item has no ':'. last_label = its last token.
  ws_tok = np.flatnonzero(next_ws)
  if ws_tok.size == 0:
    return None
  last_label = ws_tok[np.minimum(np.searchsorted(ws_tok, first_tok), len(ws_tok) - 1)]
  has_tok = tok_per_line > 0
  if np.any(has_tok & (last_label >= first_tok + tok_per_line)):
    return None  # a line's last token is not followed by whitespace ('3,', '1:')
  colon_cum = np.concatenate(([0], np.cumsum(next_colon)))
  labeled = has_tok & (cls[line_start] == _TOK) & (colon_cum[last_label] == colon_cum[first_tok])
  label_counts = np.where(labeled, last_label - first_tok + 1, 0)
  pos_in_line = np.arange(num_tok) - first_tok[tok_line]
  is_label = pos_in_line < label_counts[tok_line]

  # Labels are comma-glued ('1,,2' and '1, 2' fail); features are 'id:value'
  # items ('3:', ':4', '3:4:5', '3-1.0' fail). Separator counts must match so
  # that no stray ',' or ':' hides between whitespace.
  is_id = ~is_label & next_colon & glued & prev_ws
  is_val = ~is_label & (prev_cls == _COLON) & next_ws
  if (
      not np.all(is_label | is_id | is_val)
      or not np.all(glued[is_label & ~next_ws])
      or num_commas != np.count_nonzero(is_label) - np.count_nonzero(labeled)
      or num_colons != np.count_nonzero(is_id)
  ):
    return None
  # Ids and labels must be plain digit strings (no sign, no decimal point).
  nondigit = np.flatnonzero(np.frombuffer(chunk.translate(_NONDIGIT_TABLE), dtype=np.bool_))
  if nondigit.size and not np.all(is_val[np.searchsorted(starts, nondigit, "right") - 1]):
    return None

  # Convert every token at once: separators -> spaces, one C-level scan.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "could not be read to its end"
    try:
      numbers = np.fromstring(chunk.translate(_NUMBERS_TABLE), dtype=np.float64, sep=" ")
    except ValueError:
      return None
  if len(numbers) != num_tok:
    return None
  label_ids = numbers[is_label]
  feat_ids = numbers[is_id]
  feat_vals = numbers[is_val]
  if (
      (label_ids.size and label_ids.max() >= num_labels)
      or (feat_ids.size and feat_ids.max() >= num_features)
      or not np.all(np.abs(feat_vals) < FLOAT32_OVERFLOW)  # also false for NaN: finite in float32
  ):
    return None
  return _Rows(
      (tok_per_line - label_counts) // 2,
      feat_ids.astype(np.int32),
      feat_vals.astype(np.float32),
      label_counts.astype(np.int64),
      label_ids.astype(np.int32),
  )


def _empty_rows(num_lines: int) -> _Rows:
  zeros = np.zeros(num_lines, dtype=np.int64)
  empty = np.zeros(0, dtype=np.int32)
  return _Rows(zeros, empty, empty.astype(np.float32), zeros, empty)


# --------------------------------------------------------------------------
# Careful line-by-line path (error location, and fallback parse).
# --------------------------------------------------------------------------
def _parse_id(text: str, bound: int, what: str, err) -> int:
  if not text.isdigit() or not text.isascii():
    if text[:1] == "-" and text[1:].isdigit():
      raise err(f"negative {what} {text!r}")
    raise err(f"malformed {what} {text!r} (expected a non-negative integer)")
  value = int(text)
  if value >= bound:
    raise err(f"{what} {value} out of range (header says there are {bound})")
  return value


def _parse_chunk_slow(chunk: bytes, first_line: int, num_features: int, num_labels: int, path) -> _Rows:
  """Reference parser: one line at a time, raises :class:`XCFormatError`."""
  feat_counts, feat_ids, feat_vals, label_counts, label_ids = [], [], [], [], []
  for offset, raw in enumerate(chunk.split(b"\n")[:-1]):
    line_no = first_line + offset

    def err(msg, _line_no=line_no):
      return XCFormatError(path, _line_no, msg)

    if not raw.isascii():
      raise err("non-ASCII bytes in line")
    items = [t.decode("ascii") for t in raw.split()]  # bytes.split(): the fast path's whitespace
    if items and raw[:1].strip() and ":" not in items[0]:
      label_field, items = items[0], items[1:]
      labels = label_field.split(",")
      label_ids.extend(_parse_id(t, num_labels, "label id", err) for t in labels)
      label_counts.append(len(labels))
    else:
      label_counts.append(0)
    for item in items:
      id_text, sep, value_text = item.partition(":")
      if not sep:
        raise err(f"malformed feature {item!r} (expected 'id:value')")
      feat_ids.append(_parse_id(id_text, num_features, "feature id", err))
      if not value_text:
        raise err(f"missing feature value in {item!r}")
      try:
        if "_" in value_text:  # float() would read "1_0" as 10
          raise ValueError
        value = float(value_text)
      except ValueError:
        raise err(f"malformed feature value in {item!r}") from None
      if not np.isfinite(value):
        raise err(f"non-finite feature value in {item!r}")
      if abs(value) >= FLOAT32_OVERFLOW:
        raise err(f"feature value in {item!r} overflows float32 (its largest is {np.float32(FLOAT32_MAX)!s})")
      feat_vals.append(value)
    feat_counts.append(len(items))
  return _Rows(
      np.asarray(feat_counts, dtype=np.int64),
      np.asarray(feat_ids, dtype=np.int32),
      np.asarray(feat_vals, dtype=np.float64).astype(np.float32),
      np.asarray(label_counts, dtype=np.int64),
      np.asarray(label_ids, dtype=np.int32),
  )


def _iter_line_chunks(f, chunk_bytes: int):
  """Yield byte blocks of whole lines, each ending with ``\\n``."""
  carry = b""
  while True:
    block = f.read(chunk_bytes)
    if not block:
      break
    block = carry + block
    cut = block.rfind(b"\n") + 1
    if cut == 0:
      carry = block
      continue
    carry = block[cut:]
    yield block[:cut]
  if carry:
    yield carry + b"\n"


@contextlib.contextmanager
def open_bytes(path: str | os.PathLike) -> Iterator[BinaryIO]:
  """``path`` opened for reading bytes, gunzipped where its first bytes are gzip's magic (whatever its name)."""
  with open(path, "rb") as raw:
    compressed = raw.read(2) == _GZIP_MAGIC
    raw.seek(0)
    yield gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw


def load_xc_file(path: str | os.PathLike, *, chunk_bytes: int = _CHUNK_BYTES) -> XCDataset:
  """Read an XC-repository text file.

  Args:
    path: file in the format described in the module docstring.
    chunk_bytes: approximate bytes processed per vectorised step (bounds
      the temporary memory to a small multiple of this).

  Returns:
    XCDataset with ``num_points`` samples and the header's ``F`` and ``L``.

  Raises:
    XCFormatError: (a ``ValueError``) naming file and line on a malformed
      header, malformed ``id:value`` pair or label, negative or
      out-of-range id, a value that is not finite in float32, a number of
      data lines that differs from the header's ``num_points``, or corrupt
      gzip data (the line where it broke off).
  """
  parts: list[_Rows] = []
  lines_done = 0
  with open_bytes(path) as f:
    first_line = 1  # of what is being read
    try:
      header = f.readline()
      num_points, num_features, num_labels = _parse_header(header.removeprefix(UTF8_BOM), path)
      first_line = 2
      for chunk in _iter_line_chunks(f, chunk_bytes):
        rows = _parse_chunk_fast(chunk, num_features, num_labels)
        if rows is None:
          rows = _parse_chunk_slow(chunk, first_line, num_features, num_labels, path)
        parts.append(rows)
        lines_done += len(rows.feat_counts)
        first_line = 2 + lines_done
    except (EOFError, OSError, zlib.error) as e:
      if not isinstance(f, gzip.GzipFile):  # a plain file's I/O error is not corrupt gzip data
        raise
      raise XCFormatError(path, first_line, f"corrupt or truncated gzip data ({e})") from None

  feat_counts = np.concatenate([p.feat_counts for p in parts] or [np.zeros(0, np.int64)])
  label_counts = np.concatenate([p.label_counts for p in parts] or [np.zeros(0, np.int64)])
  if lines_done > num_points:
    # Tolerate blank lines at the very end (editor artefacts).
    extra = slice(num_points, None)
    if feat_counts[extra].any() or label_counts[extra].any():
      first_extra = num_points + np.flatnonzero((feat_counts[extra] > 0) | (label_counts[extra] > 0))[0]
      empty = np.flatnonzero((feat_counts[:num_points] == 0) & (label_counts[:num_points] == 0))
      raise XCFormatError(
          path,
          first_extra + 2,
          f"more data lines than the header's num_points={num_points}"
          + (f" (an empty line is a sample with no labels and no features: line {empty[0] + 2} is one)"
             if len(empty) else ""),
      )
    feat_counts, label_counts = feat_counts[:num_points], label_counts[:num_points]
  elif lines_done < num_points:
    raise XCFormatError(
        path,
        lines_done + 2,
        f"file ends after {lines_done} data lines but the header (line 1) " f"says num_points={num_points}",
    )

  def cat(field, dtype):
    return np.concatenate([getattr(p, field) for p in parts] or [np.zeros(0, dtype)])

  indptr = np.zeros(num_points + 1, dtype=np.int64)
  np.cumsum(feat_counts, out=indptr[1:])
  label_indptr = np.zeros(num_points + 1, dtype=np.int64)
  np.cumsum(label_counts, out=label_indptr[1:])
  return XCDataset(
      indptr,
      cat("feat_ids", np.int32),
      cat("feat_vals", np.float32),
      label_indptr,
      cat("label_ids", np.int32),
      num_features,
      num_labels,
  )


def save_xc_file(dataset: XCDataset, path: str | os.PathLike) -> None:
  """Write ``dataset`` in XC-repository format; ``load_xc_file`` reads it back exactly.

  Values are written with the shortest decimal form that round-trips
  float32. Samples without labels are written with a leading space.

  Args:
    dataset: the dataset to write.
    path: output file (overwritten).
  """
  n = len(dataset)
  bad = np.flatnonzero(~np.isfinite(dataset.values))
  if len(bad):  # load_xc_file refuses them: the file would not read back
    sample = int(np.searchsorted(dataset.indptr, bad[0], side="right")) - 1
    raise ValueError(f"save_xc_file: sample {sample} has the non-finite feature value {dataset.values[bad[0]]} "
                     f"(feature {dataset.indices[bad[0]]}); the XC format holds finite values only")
  ids_s = dataset.indices.astype("U")
  vals_s = dataset.values.astype("U")
  labels_s = dataset.label_indices.astype("U")
  fptr = dataset.indptr.tolist()
  lptr = dataset.label_indptr.tolist()
  with open(path, "w", encoding="ascii", newline="\n") as f:
    f.write(f"{n} {dataset.num_features} {dataset.num_labels}\n")
    lines = []
    for i in range(n):
      a, b = fptr[i], fptr[i + 1]
      feats = " ".join(map(":".join, zip(ids_s[a:b].tolist(), vals_s[a:b].tolist())))
      labels = ",".join(labels_s[lptr[i] : lptr[i + 1]].tolist())
      lines.append(f"{labels} {feats}" if feats else labels if labels else "")
      if len(lines) >= 4096:
        f.write("\n".join(lines) + "\n")
        lines.clear()
    if lines:
      f.write("\n".join(lines) + "\n")
