"""The work of ``sparsejax-predict`` once :mod:`.predict` has parsed its flags and set ``JAX_PLATFORMS``: the flags
checked against the files and the model, the inputs read (text, XC or svmlight, sniffed where not given; their faults
named by file and line), the top labels written.

Imported by :func:`sparsejax.cli.predict.predict` only then: this module imports JAX and the model's code (through
:mod:`sparsejax.serving.model`), which must not start before the flags say where the network runs, and which
``--help`` and a flag's error need not wait for.
"""

import bz2
import gzip
import math
import os
import shutil
import sys
import tempfile
import typing
import warnings

import numpy as np

from sparsejax import model_kinds, rundirs
from sparsejax.cli.flags import fail, usage_error, use_compilation_cache, warn
from sparsejax.data import load_xc_file
from sparsejax.data.xc_format import FLOAT32_MAX, FLOAT32_OVERFLOW, UTF8_BOM, open_bytes
from sparsejax.platforms import PlatformError, PlatformUnavailable
from sparsejax.serving.inputs import UnknownWordsWarning
from sparsejax.serving.model import load
from sparsejax.workdir.orbax_logs import quiet_orbax_logs


def read_inputs(path: str, input_format: str, model):
  """The samples of ``path`` (``-``: stdin) as ``model.predict`` takes them."""
  if input_format == "auto" and model.text_input:
    input_format = "text"
  if path == "-" and input_format != "text":
    return _read_stdin_as_file(input_format, model)
  if input_format == "auto":
    input_format = _sniff(path)
  if input_format == "text":
    with (sys.stdin if path == "-" else open(path)) as f:
      return [line.rstrip("\n") for line in f]
  if input_format == "xc":
    data = load_xc_file(path)
    if data.num_features != model.num_features:
      raise ValueError(f"{path}: header has {data.num_features} features; the model reads {model.num_features}")
    return data
  from sklearn.datasets import load_svmlight_file  # deferred: scikit-learn (about 1.5 s) only for svmlight inputs

  try:
    x, _ = load_svmlight_file(path, n_features=model.num_features, multilabel=True, zero_based=True)
  except ValueError as e:
    where = _svmlight_id_out_of_range(path, model.num_features) or _not_an_xc_header(path)
    raise ValueError(where or f"{path}: not a svmlight file with feature ids in [0, {model.num_features}): {e}") \
        from None
  if not (np.abs(x.data) < FLOAT32_OVERFLOW).all():  # scikit-learn reads nan, inf and 1e39; a row of them scored NaN
    raise ValueError(_svmlight_value_not_finite(path) or f"{path}: a feature value is not finite in float32")
  return x


def _open_svmlight(path: str) -> typing.TextIO:
  """``path`` as text, decompressed as scikit-learn's svmlight reader decompresses it (by the name's ending)."""
  if path.endswith((".gz", ".bz2")):
    return (gzip if path.endswith(".gz") else bz2).open(path, "rt", errors="replace")
  return open(path, errors="replace")


def _not_an_xc_header(path: str) -> str | None:
  """``FILE:1: ...`` where the first line looks like a malformed XC header (numbers, no ``id:value`` pair), which the
  format sniffer then took for svmlight (scikit-learn's error said "need more than 1 value to unpack")."""
  with _open_svmlight(path) as f:
    tokens = f.readline().removeprefix("\ufeff").split("#", 1)[0].split()
  if len(tokens) < 2 or any(":" in t for t in tokens) or not tokens[0].isdigit():
    return None
  return (f"{path}:1: {' '.join(tokens)[:80]!r} is neither an XC header (three integers: samples, features, labels) "
          "nor a svmlight row (labels, then id:value pairs)")


def _svmlight_value_not_finite(path: str) -> str | None:
  """``FILE:LINE: ...`` of the first feature value that is not finite in float32 (NaN, inf, 1e39), as the XC reader
  words it."""
  with _open_svmlight(path) as f:
    for number, line in enumerate(f, 1):
      for item in line.split("#", 1)[0].split():
        name, sep, text = item.partition(":")
        if not sep or name == "qid":
          continue
        try:
          value = float(text)
        except ValueError:  # a form scikit-learn reads and float() does not (hex): named without its line
          continue
        if not math.isfinite(value):
          return f"{path}:{number}: non-finite feature value in {item!r}"
        if abs(value) >= FLOAT32_OVERFLOW:
          largest = np.float32(FLOAT32_MAX)
          return f"{path}:{number}: feature value in {item!r} overflows float32 (its largest is {largest!s})"
  return None


def _svmlight_id_out_of_range(path: str, num_features: int) -> str | None:
  """``FILE:LINE: ...`` of the first feature id outside ``[0, num_features)`` (scikit-learn names no line)."""
  with _open_svmlight(path) as f:
    for number, line in enumerate(f, 1):
      for item in line.split("#", 1)[0].split()[1:]:
        name, sep, _ = item.partition(":")
        if sep and name.lstrip("-").isdigit() and not 0 <= int(name) < num_features:
          return f"{path}:{number}: feature id {name} out of range: the model reads ids in [0, {num_features})"
  return None


def _read_stdin_as_file(input_format: str, model):
  """Feature rows (xc, svmlight) from stdin: their readers take files, so stdin is copied to one first."""
  with tempfile.NamedTemporaryFile(prefix="sparsejax-stdin-") as f:
    shutil.copyfileobj(sys.stdin.buffer, f)
    f.flush()
    try:
      return read_inputs(f.name, input_format, model)
    except ValueError as e:  # name what the user gave, not the copy
      raise ValueError(str(e).replace(f.name, "<stdin>")) from None


def _sniff(path: str) -> str:
  """``xc`` if the file starts with an XC header line (three integers), else ``svmlight``."""
  with open_bytes(path) as f:  # gzipped or not, with or without a byte-order mark, as the XC reader takes it
    first = f.readline().removeprefix(UTF8_BOM).split()
  return "xc" if len(first) == 3 and all(t.isdigit() for t in first) else "svmlight"


def run(flags) -> None:
  """Checks ``flags`` (sparsejax-predict's flag values), loads the model and writes its predictions
  (:func:`sparsejax.cli.predict.predict`, after ``JAX_PLATFORMS``)."""
  quiet_orbax_logs()  # stdout is the predictions; stderr only says what went wrong

  if not flags.workdir:
    usage_error("give --workdir: the work directory of a trained run" + rundirs.newest_run_hint())
  if not flags.input:
    usage_error("give --input: a file of input samples, or - for stdin")
  if flags.input_format not in ("auto", "xc", "svmlight", "text"):
    usage_error(f"--input_format={flags.input_format}: must be one of auto, xc, svmlight, text")
  if flags.top < 1:  # before the model loads (its upper bound, the model's labels, after)
    usage_error(f"--top={flags.top}: must be >= 1")
  if flags.k < 0 or 0 < flags.k < flags.top:
    usage_error(f"--k={flags.k}: must be 0 (exact) or at least --top={flags.top}")
  # Files first: a missing input or an unwritable output is named before the model loads and predicts.
  if flags.input != "-" and not os.path.isfile(flags.input):
    usage_error(f"--input={flags.input}: {'is a directory' if os.path.isdir(flags.input) else 'no such file'}")
  if flags.output != "-":
    parent = os.path.dirname(os.path.abspath(flags.output))
    if os.path.isdir(flags.output) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
      usage_error(f"--output={flags.output}: " + ("is a directory" if os.path.isdir(flags.output) else
                                                  f"cannot write a file in {parent}"))
  use_compilation_cache(flags.compilation_cache)  # before anything compiles
  try:
    model = load(flags.workdir, flags.step, flags.platform)
    if not 1 <= flags.top <= model.num_labels:
      usage_error(f"--top={flags.top}: must be in [1, {model.num_labels}] (the model's labels)")
    if flags.k > model.num_labels:
      usage_error(f"--k={flags.k}: must be at most {model.num_labels} (the model's labels)")
    if flags.k and not model_kinds.of(model.config).sampled:
      usage_error(f"--k={flags.k}: sampled prediction needs a SLIDE model; this one was trained with "
                  f"--model={model.config.network.model}")
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", UnknownWordsWarning)
      scores, ids = model.predict(read_inputs(flags.input, flags.input_format, model), top=flags.top,
                                  k=flags.k or None)
  except (PlatformError, PlatformUnavailable) as e:  # a dense model only off the CPU; a device of it
    usage_error(f"--platform={e.platform}: {e.problem}")
  except (OSError, ValueError) as e:
    fail(str(e))
  for warning in caught:  # one line per input line whose words the model does not know
    if issubclass(warning.category, UnknownWordsWarning):
      warn(f"{flags.input if flags.input != '-' else '<stdin>'}:{warning.message.row + 1}: {warning.message}")
    else:
      warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
  names = model.names(ids)
  # Tabs between the pairs: a label's name may hold spaces (ICD-10: its code and title); splitting on whitespace
  # still works for names without them.
  lines = ("\t".join(f"{n}:{s:.5g}" for n, s in zip(row_names, row_scores)) + "\n"
           for row_names, row_scores in zip(names, scores))
  if flags.output == "-":
    sys.stdout.writelines(lines)
    return
  try:
    with open(flags.output, "w") as f:
      f.writelines(lines)
  except OSError as e:
    fail(f"--output={flags.output}: {e.strerror or e}")


