"""Profile schemas and file readers of netanalysis: one typed model of a step, many ways to get it.

* ``sparsejax.netanalysis.profile/1`` (JSON): a step as a chain of compute segments and collectives.
  sparsejax runs write it (``workdir/netanalysis/profile.json``); :func:`read_profile` reads it.
* ``.bk.log`` (the paper's backward-pass profiles): :func:`read_bk_log` maps one onto the same schema.
* ``bytes,seconds`` reduction-cost tables (``cuda_vec_add.log``, or the probe's): :func:`read_cost_table`.
* ``sparsejax.netanalysis.probe/1`` (JSON): fitted latency/bandwidth per collective kind, the raw
  probe rows and the local reduction cost: :func:`write_probe` / :func:`read_probe`.

Every reader raises :class:`ProfileError` whose message starts with where the problem is:
``PATH:LINE:`` for text files, ``PATH:LINE:COL:`` for invalid JSON and ``PATH: $.json.path:`` for a
bad value in valid JSON. Writers write a temporary file and rename it, so an interrupted writer never
leaves a broken file. Units: seconds, bytes, bits per second.
"""

import bisect
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from sparsejax.netanalysis.units import ProfileError

PROFILE_SCHEMA = "sparsejax.netanalysis.profile/1"
PROBE_SCHEMA = "sparsejax.netanalysis.probe/1"
WHATIF_SCHEMA = "sparsejax.netanalysis.whatif/1"

# How a compute segment's time changes with the number of processes P (see whatif.scale_chain).
SCALES = ("replicated", "sharded", "batch")
# Collective kinds, spelled as in XLA's HLO.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
END = "end"  # Collective.needed_before value: needed only when the step ends.
MAX_BYTES = 2**62  # larger byte counts are corrupt input, not messages


# ---------------------------------------------------------------------------------------------------
# The profile schema as typed objects.


@dataclasses.dataclass(frozen=True)
class Segment:
  """Compute on the one compute stream, between collectives.

  Attributes:
    seconds: duration at the profile's ``workers``, seconds >= 0.
    scope: what it is (a named scope such as ``hidden_fwd``, or ``layer 12``).
    scales: ``replicated`` (same work at any P), ``sharded`` (work ~ 1/P) or ``batch`` (work ~ the
      per-process batch: constant under weak scaling, ~ 1/P under strong scaling).
  """
  seconds: float
  scope: str = ""
  scales: str = "batch"


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the step.

  Attributes:
    name: HLO instruction name (``all-reduce.7``) or any label.
    kind: one of :data:`KINDS`.
    bytes: ``S`` of the cost model: the operand bytes of one process; for all-gather the gathered
      total (P x each process's piece), as in the formulas of :mod:`sparsejax.netanalysis.whatif`.
    compressible: a compression ratio applies to it (gradients), or not (e.g. softmax reductions).
    ready_after: index of the segment whose end makes it ready; -1: ready when the step starts.
    needed_before: index of the first segment that needs its result, or ``"end"`` (only the end of
      the step waits for it). Always greater than ``ready_after``.
    transfer_seconds: measured transfer time (min over ranks of its duration), or None.
    wait_seconds: measured time spent waiting for peers (slowest rank), or None.
    scope: named scope it came from (``dh_reduce``), may be empty.
    dtype: element type (``float32``), may be empty.
    shape: result shape, may be empty.
  """
  name: str
  kind: str
  bytes: int
  compressible: bool
  ready_after: int
  needed_before: int | str = END
  transfer_seconds: float | None = None
  wait_seconds: float | None = None
  scope: str = ""
  dtype: str = ""
  shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Chain:
  """One step: segments run in order; collectives in the order they become ready."""
  segments: tuple[Segment, ...]
  collectives: tuple[Collective, ...]

  @property
  def compute_seconds(self) -> float:
    return math.fsum(s.seconds for s in self.segments)

  @property
  def collective_bytes(self) -> int:
    return sum(c.bytes for c in self.collectives)


@dataclasses.dataclass(frozen=True)
class Profile:
  """A job's step, measured (``source="run"``) or read from a file (``source="file"``).

  Attributes:
    name: what reports call it (run name or file stem).
    source: ``run`` or ``file``.
    path: the run directory or file it came from.
    job: ``sparse`` (model-parallel sparsejax), ``dense`` (data-parallel), ``backward`` (a .bk.log), ...
    workers: number of processes P the profile was measured with (>= 1).
    per_process_batch: examples per process per step, or None when unknown.
    step_seconds: measured step (for a .bk.log: the one-worker iteration time), seconds > 0.
    steps: one chain per profiled step; predictions average over them (the paper averages batches).
  """
  name: str
  source: str
  path: str
  job: str
  workers: int
  per_process_batch: int | None
  step_seconds: float
  steps: tuple[Chain, ...]


# ---------------------------------------------------------------------------------------------------
# JSON: atomic writer and a reader that says where a bad value is.


def write_text_atomic(path: str, text: str) -> None:
  """Write ``text`` to ``path`` through a temporary file in the same directory and a rename.

  An interrupted writer leaves the previous file (or none), never a partial one. The file gets the
  usual permissions (0666 less the umask), not the temporary file's 0600.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def check_output_file(flag: str, path: str) -> None:
  """Raises ValueError where ``--flag=path`` cannot be written as a file (a directory, under a file, or in a
  directory this user cannot write), before anything is computed: the write failed at the end with a traceback."""
  if os.path.isdir(path):
    raise ValueError(f"--{flag}={path}: is a directory (give a file name)")
  existing = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(existing):  # missing directories are created
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f"--{flag}={path}: {existing} is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"--{flag}={path}: cannot write in {existing}")


def write_json_atomic(path: str, obj: Any) -> None:
  """Write ``obj`` as JSON to ``path`` atomically (see :func:`write_text_atomic`); NaN and inf are refused."""
  write_text_atomic(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def load_json(path: str) -> Any:
  """Parse a JSON file. Raises :class:`ProfileError` (``PATH:LINE:COL:`` for invalid JSON)."""
  text = _read_text(path)
  try:
    return json.loads(text, parse_constant=_refuse_constant)
  except json.JSONDecodeError as e:
    raise ProfileError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
  except ValueError as e:
    raise ProfileError(f"{path}:1:1: invalid JSON: {e}") from None


def _refuse_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


class _Json:
  """A JSON value and its path (``$.steps[0].bytes``), with typed getters that raise ProfileError."""

  def __init__(self, file: str, value: Any, path: str = "$"):
    self.file, self.value, self.path = file, value, path

  def error(self, message: str) -> ProfileError:
    return ProfileError(f"{self.file}: {self.path}: {message}")

  def _child(self, key: str | int, value: Any) -> "_Json":
    path = f"{self.path}[{key}]" if isinstance(key, int) else f"{self.path}.{key}"
    return _Json(self.file, value, path)

  def obj(self, keys: Sequence[str], optional: Sequence[str] = ()) -> dict[str, "_Json"]:
    """The members of an object that must have ``keys`` and may have ``optional`` (nothing else)."""
    if not isinstance(self.value, dict):
      raise self.error(f"expected an object, got {_type_name(self.value)}")
    for key in keys:
      if key not in self.value:
        raise self.error(f"missing key {key!r}")
    for key in self.value:
      if key not in keys and key not in optional:
        raise self.error(f"unknown key {key!r} (expected {', '.join(list(keys) + list(optional))})")
    return {k: self._child(k, v) for k, v in self.value.items()}

  def items(self, min_len: int = 0) -> list["_Json"]:
    if not isinstance(self.value, list):
      raise self.error(f"expected a list, got {_type_name(self.value)}")
    if len(self.value) < min_len:
      raise self.error(f"expected at least {min_len} item(s), got {len(self.value)}")
    return [self._child(i, v) for i, v in enumerate(self.value)]

  def string(self, choices: Sequence[str] | None = None) -> str:
    if not isinstance(self.value, str):
      raise self.error(f"expected a string, got {_type_name(self.value)}")
    if choices is not None and self.value not in choices:
      raise self.error(f"expected one of {', '.join(choices)}, got {self.value!r}")
    return self.value

  def boolean(self) -> bool:
    if not isinstance(self.value, bool):
      raise self.error(f"expected true or false, got {_type_name(self.value)}")
    return self.value

  def integer(self, minimum: int | None = None, maximum: int | None = None) -> int:
    v = self.value
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
      raise self.error(f"expected a whole number, got {_type_name(v)} {v!r}")
    v = int(v)
    if minimum is not None and v < minimum:
      raise self.error(f"must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
      raise self.error(f"must be <= {maximum}, got {v}")
    return v

  def number(self, minimum: float | None = None, positive: bool = False) -> float:
    v = self.value
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      raise self.error(f"expected a finite number, got {_type_name(v)} {v!r}")
    if positive and v <= 0:
      raise self.error(f"must be > 0, got {v!r}")
    if minimum is not None and v < minimum:
      raise self.error(f"must be >= {minimum}, got {v!r}")
    return float(v)

  def optional(self, getter: str, **kwargs) -> Any:
    return None if self.value is None else getattr(self, getter)(**kwargs)


def _type_name(value: Any) -> str:
  return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
          int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _schema(doc: _Json, expected: str) -> None:
  if not isinstance(doc.value, dict):
    raise doc.error(f"expected an object with \"schema\": \"{expected}\", got {_type_name(doc.value)}")
  if "schema" not in doc.value:
    raise doc.error(f"missing key 'schema' (expected \"{expected}\")")
  version = doc.value["schema"]
  if version != expected:
    raise _Json(doc.file, version, "$.schema").error(
        f"unsupported schema {version!r} (this version reads {expected!r})")


# ---------------------------------------------------------------------------------------------------
# profile/1


def profile_to_dict(profile: Profile) -> dict:
  """The ``sparsejax.netanalysis.profile/1`` JSON object of a :class:`Profile`."""

  def collective(c: Collective) -> dict:
    d = dataclasses.asdict(c)
    d["shape"] = list(c.shape)
    return d

  return {
      "schema": PROFILE_SCHEMA,
      "name": profile.name,
      "source": profile.source,
      "path": profile.path,
      "job": profile.job,
      "workers": profile.workers,
      "per_process_batch": profile.per_process_batch,
      "step_seconds": profile.step_seconds,
      "steps": [{"segments": [dataclasses.asdict(s) for s in chain.segments],
                 "collectives": [collective(c) for c in chain.collectives]} for chain in profile.steps],
  }


def profile_from_dict(obj: Any, file: str = "<profile>") -> Profile:
  """Validate a ``profile/1`` JSON object and build the :class:`Profile`; errors name ``file`` and the JSON path."""
  doc = _Json(file, obj)
  _schema(doc, PROFILE_SCHEMA)
  keys = doc.obj(["schema", "name", "source", "path", "job", "workers", "per_process_batch", "step_seconds", "steps"])
  return Profile(
      name=keys["name"].string(),
      source=keys["source"].string(("run", "file")),
      path=keys["path"].string(),
      job=keys["job"].string(),
      workers=keys["workers"].integer(minimum=1),
      per_process_batch=keys["per_process_batch"].optional("integer", minimum=1),
      step_seconds=keys["step_seconds"].number(positive=True),
      steps=tuple(_chain_from_json(step) for step in keys["steps"].items(min_len=1)),
  )


def _chain_from_json(step: _Json) -> Chain:
  keys = step.obj(["segments", "collectives"])
  segments = []
  for item in keys["segments"].items(min_len=1):
    s = item.obj(["seconds"], optional=["scope", "scales"])
    segments.append(Segment(seconds=s["seconds"].number(minimum=0.0),
                            scope=s["scope"].string() if "scope" in s else "",
                            scales=s["scales"].string(SCALES) if "scales" in s else "batch"))
  last = len(segments) - 1
  collectives = []
  for item in keys["collectives"].items():
    c = item.obj(["name", "kind", "bytes", "compressible", "ready_after", "needed_before"],
                 optional=["transfer_seconds", "wait_seconds", "scope", "dtype", "shape"])
    ready_after = c["ready_after"].integer(minimum=-1, maximum=last)
    needed = c["needed_before"]
    if needed.value == END:
      needed_before: int | str = END
    elif isinstance(needed.value, str):
      raise needed.error(f"expected a segment index or \"end\", got {needed.value!r}")
    else:
      needed_before = needed.integer(minimum=ready_after + 1, maximum=last)
    collectives.append(Collective(
        name=c["name"].string(),
        kind=c["kind"].string(KINDS),
        bytes=c["bytes"].integer(minimum=0, maximum=MAX_BYTES),
        compressible=c["compressible"].boolean(),
        ready_after=ready_after,
        needed_before=needed_before,
        transfer_seconds=c["transfer_seconds"].optional("number", minimum=0.0) if "transfer_seconds" in c else None,
        wait_seconds=c["wait_seconds"].optional("number", minimum=0.0) if "wait_seconds" in c else None,
        scope=c["scope"].string() if "scope" in c else "",
        dtype=c["dtype"].string() if "dtype" in c else "",
        shape=tuple(d.integer(minimum=0) for d in c["shape"].items()) if "shape" in c else (),
    ))
  return Chain(tuple(segments), tuple(collectives))


def _write_checked(path: str, obj: dict, from_dict) -> None:
  """Write a schema document atomically, after checking that its reader accepts it."""
  from_dict(obj, file=f"{path} (being written)")
  write_json_atomic(path, obj)


def write_profile(path: str, profile: Profile) -> None:
  """Write ``profile`` as ``profile/1`` JSON (atomically). Raises ProfileError if it would not read back."""
  _write_checked(path, profile_to_dict(profile), profile_from_dict)


def read_profile(path: str) -> Profile:
  """Read a ``profile/1`` JSON file. Raises :class:`ProfileError`."""
  return profile_from_dict(load_json(path), file=path)


# ---------------------------------------------------------------------------------------------------
# Text files: .bk.log and bytes,seconds tables.


def _read_text(path: str) -> str:
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ProfileError(f"{path}: cannot read: {e.strerror or e}") from None
  # Undecodable bytes become U+FFFD, so they fail as a bad field on their own line.
  return data.decode("utf-8", errors="replace")


def _lines(path: str) -> list[str]:
  """The file's lines (CRLF accepted) without trailing blank lines. Raises ProfileError when empty."""
  lines = _read_text(path).replace("\r\n", "\n").replace("\r", "\n").split("\n")
  while lines and not lines[-1].strip():
    lines.pop()
  if not lines:
    raise ProfileError(f"{path}:1: empty file")
  return lines


def _two_fields(path: str, lineno: int, line: str, what: str) -> tuple[str, str]:
  fields = line.split(",")
  if len(fields) != 2:
    got = "an empty line" if not line.strip() else f"{len(fields)} field(s): {line.strip()[:60]!r}"
    raise ProfileError(f"{path}:{lineno}: expected a row '{what}' (2 comma-separated fields), got {got}")
  return fields[0].strip(), fields[1].strip()


def _number(path: str, lineno: int, text: str, name: str) -> float:
  """A finite number >= 0."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or value < 0:
    raise ProfileError(f"{path}:{lineno}: {name} must be a finite number >= 0, got {text!r}")
  return value


def _whole(path: str, lineno: int, text: str, name: str) -> int:
  """A whole number >= 0 (``4000.0`` is fine, ``4000.5`` is not)."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or value < 0 or not value.is_integer() or value > MAX_BYTES:
    raise ProfileError(f"{path}:{lineno}: {name} must be a whole number in [0, 2^62], got {text!r}")
  return int(value)


def _positive_int(path: str, lineno: int, text: str, name: str) -> int:
  text = text.strip()
  if not (text.isascii() and text.isdigit()) or int(text) <= 0:
    raise ProfileError(f"{path}:{lineno}: line {lineno} must be the {name}, a positive integer, got {text[:60]!r}")
  return int(text)


def profile_stem(path: str) -> str:
  """What reports call a profile file: its name without ``.bk.log``, ``.json`` or ``.log``."""
  name = os.path.basename(path)
  for suffix in (".bk.log", ".json", ".log"):
    if name.endswith(suffix) and len(name) > len(suffix):
      return name[:-len(suffix)]
  return name


def read_bk_log(path: str, iteration_seconds: float, name: str | None = None) -> Profile:
  """Read a paper-style backward profile (``*.bk.log``) as a :class:`Profile`.

  Format: line 1 free text; line 2 the number of batches; line 3 the number of layers; then
  batches x layers rows ``wait_us,bytes`` in the order gradients become ready (``wait_us``: time since
  the previous layer's gradient was ready, the first row since backward start). Blank trailing lines,
  CRLF and spaces around fields are accepted.

  Mapping (one chain per batch): a ``forward`` segment of ``iteration_seconds - backward`` (the rest of
  the one-worker iteration, so that the chain's compute is the iteration time), then one segment per
  layer wait; one compressible all-reduce of each layer's bytes, ready after that layer's segment and
  needed at the end. Layers with 0 bytes get no collective. All segments scale as ``batch``.

  Args:
    path: the file.
    iteration_seconds: measured one-worker iteration time (forward + backward), seconds.
    name: profile name (default: the file name without ``.bk.log``).

  Returns:
    a Profile with ``workers=1``, ``job="backward"``, ``step_seconds=iteration_seconds``.

  Raises:
    ProfileError: ``PATH:LINE: ...`` for any malformed content, or an iteration time shorter than a
      batch's backward pass.
  """
  lines = _lines(path)
  if len(lines) < 3:
    raise ProfileError(f"{path}:{len(lines)}: file ends after line {len(lines)}: expected 3 header lines "
                       "(free text, number of batches, number of layers) before the rows")
  batches = _positive_int(path, 2, lines[1], "number of batches")
  layers = _positive_int(path, 3, lines[2], "number of layers")
  expected = batches * layers
  rows = lines[3:]
  if len(rows) < expected:
    raise ProfileError(f"{path}:{len(lines)}: file ends after {len(rows)} of {expected} rows "
                       f"({batches} batch(es) x {layers} layers)")
  if len(rows) > expected:
    raise ProfileError(f"{path}:{3 + expected + 1}: row beyond the declared {batches} batch(es) x {layers} layers")
  parsed = []
  for i, line in enumerate(rows):
    lineno = i + 4
    wait_text, bytes_text = _two_fields(path, lineno, line, "wait_us,bytes")
    parsed.append((_number(path, lineno, wait_text, "wait_us") * 1e-6, _whole(path, lineno, bytes_text, "bytes")))
  if not any(nbytes for _, nbytes in parsed):
    raise ProfileError(f"{path}:4: the profile has no gradient bytes (all {expected} rows have bytes 0)")
  if not (math.isfinite(iteration_seconds) and iteration_seconds > 0):
    raise ProfileError(f"{path}: the iteration time must be a positive number of seconds, got {iteration_seconds!r}")
  chains = []
  for b in range(batches):
    batch = parsed[b * layers:(b + 1) * layers]
    backward = math.fsum(wait for wait, _ in batch)
    if iteration_seconds < backward:
      raise ProfileError(f"{path}:{4 + b * layers}: the iteration time {iteration_seconds * 1e3:g} ms is shorter "
                         f"than batch {b + 1}'s backward pass ({backward * 1e3:.3f} ms)")
    segments = [Segment(iteration_seconds - backward, "forward", "batch")]
    collectives = []
    for layer, (wait, nbytes) in enumerate(batch):
      segments.append(Segment(wait, f"layer {layer}", "batch"))
      if nbytes:
        collectives.append(Collective(f"layer {layer}", "all-reduce", nbytes, True, ready_after=layer + 1))
    chains.append(Chain(tuple(segments), tuple(collectives)))
  return Profile(name=profile_stem(path) if name is None else name, source="file", path=path, job="backward",
                 workers=1, per_process_batch=None,
                 step_seconds=iteration_seconds, steps=tuple(chains))


@dataclasses.dataclass(frozen=True)
class CostTable:
  """A measured cost of a local operation by size (``bytes,seconds``), linearly interpolated.

  Attributes:
    sizes: bytes, strictly increasing (at least 2).
    seconds: seconds >= 0, one per size.
    path: where it came from (for messages; not part of equality).
  """
  sizes: tuple[float, ...]
  seconds: tuple[float, ...]
  path: str = dataclasses.field(default="", compare=False)

  def __call__(self, nbytes: float) -> float:
    """Seconds for ``nbytes``: linear between rows, the first/last row's time outside the table."""
    if nbytes <= self.sizes[0]:
      return self.seconds[0]
    if nbytes >= self.sizes[-1]:
      return self.seconds[-1]
    i = bisect.bisect_right(self.sizes, nbytes)
    x0, x1, y0, y1 = self.sizes[i - 1], self.sizes[i], self.seconds[i - 1], self.seconds[i]
    return y0 + (y1 - y0) * ((nbytes - x0) / (x1 - x0))

  def rows(self) -> list[list[float]]:
    return [[s, t] for s, t in zip(self.sizes, self.seconds)]


def cost_table(rows: Sequence[tuple[float, float]], where: Sequence[str] | None = None, path: str = "") -> CostTable:
  """Build a :class:`CostTable` from ``(bytes, seconds)`` rows, checking it.

  Args:
    rows: ``(bytes, seconds)`` pairs.
    where: one location prefix per row for messages (``PATH:LINE``); default ``PATH: $.reduce_cost[i]``.
    path: file the rows came from.

  Raises:
    ProfileError: fewer than 2 rows, sizes that do not increase, negative or non-finite values.
  """
  where = list(where) if where is not None else [f"{path}: $.reduce_cost[{i}]" for i in range(len(rows))]
  if len(rows) < 2:
    at = where[-1] if where else f"{path}:1"
    raise ProfileError(f"{at}: a bytes,seconds table needs at least 2 rows to interpolate, found {len(rows)}")
  for i, (size, seconds) in enumerate(rows):
    if not (math.isfinite(size) and size >= 0):
      raise ProfileError(f"{where[i]}: bytes must be a finite number >= 0, got {size!r}")
    if not (math.isfinite(seconds) and seconds >= 0):
      raise ProfileError(f"{where[i]}: seconds must be a finite number >= 0, got {seconds!r}")
    if i and size <= rows[i - 1][0]:
      raise ProfileError(f"{where[i]}: sizes must increase, got {size:g} bytes after {rows[i - 1][0]:g}")
  return CostTable(tuple(float(s) for s, _ in rows), tuple(float(t) for _, t in rows), path)


def read_cost_table(path: str) -> CostTable:
  """Read a ``bytes,seconds`` table such as ``cuda_vec_add.log`` (lines starting with ``#`` are comments).

  Raises:
    ProfileError: ``PATH:LINE: ...`` for a malformed row, fewer than 2 rows, sizes that do not
      increase or negative times.
  """
  rows, where = [], []
  for lineno, line in enumerate(_lines(path), start=1):
    if line.lstrip().startswith("#"):
      continue
    size_text, seconds_text = _two_fields(path, lineno, line, "bytes,seconds")
    rows.append((_number(path, lineno, size_text, "bytes"), _number(path, lineno, seconds_text, "seconds")))
    where.append(f"{path}:{lineno}")
  return cost_table(rows, where, path)


def write_cost_table(path: str, table: CostTable, comment: str = "") -> None:
  """Write ``table`` as ``bytes,seconds`` rows (the format of ``cuda_vec_add.log``), atomically."""
  lines = [f"# {line}" for line in comment.splitlines()]
  lines += [f"{s:.17g},{t:.17g}" for s, t in zip(table.sizes, table.seconds)]
  write_text_atomic(path, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------
# probe/1


@dataclasses.dataclass(frozen=True)
class ProbeRow:
  """One message size of a probe (the NCCL tests' columns). Times in seconds, rates in bit/s."""
  bytes: int
  elements: int
  seconds_median: float
  seconds_p10: float
  seconds_p90: float
  algbw_bps: float
  busbw_bps: float


@dataclasses.dataclass(frozen=True)
class ProbeFit:
  """``t = hops * alpha_s + wire_bytes * 8 / bw_bps`` fitted for one collective kind.

  Attributes:
    alpha_s: latency per hop, seconds.
    bw_bps: bandwidth of the wire bytes (bus bandwidth), bit/s.
    r2: coefficient of determination of the bandwidth fit, or None.
    rows: the measurements.
  """
  alpha_s: float
  bw_bps: float
  r2: float | None
  rows: tuple[ProbeRow, ...] = ()


@dataclasses.dataclass(frozen=True)
class Probe:
  """Result of ``netanalysis probe``.

  Attributes:
    workers: processes that took part.
    dtype: element type of the probe buffers.
    link_capacity_bps: nominal capacity of the link (``--link_capacity`` or the tbf rate), or None.
    collectives: fit per collective kind (keys from :data:`KINDS`).
    reduce_cost: local reduction cost (a jitted add of two buffers) by size, or None.
  """
  workers: int
  dtype: str
  link_capacity_bps: float | None
  collectives: Mapping[str, ProbeFit]
  reduce_cost: CostTable | None = None


def probe_to_dict(probe: Probe) -> dict:
  """The ``sparsejax.netanalysis.probe/1`` JSON object of a :class:`Probe`."""
  return {
      "schema": PROBE_SCHEMA,
      "workers": probe.workers,
      "dtype": probe.dtype,
      "link_capacity_bps": probe.link_capacity_bps,
      "collectives": {kind: {"alpha_s": fit.alpha_s, "bw_bps": fit.bw_bps, "r2": fit.r2,
                             "rows": [dataclasses.asdict(r) for r in fit.rows]}
                      for kind, fit in probe.collectives.items()},
      "reduce_cost": probe.reduce_cost.rows() if probe.reduce_cost is not None else None,
  }


def probe_from_dict(obj: Any, file: str = "<probe>") -> Probe:
  """Validate a ``probe/1`` JSON object and build the :class:`Probe`."""
  doc = _Json(file, obj)
  _schema(doc, PROBE_SCHEMA)
  keys = doc.obj(["schema", "workers", "dtype", "link_capacity_bps", "collectives", "reduce_cost"])
  fits = {}
  kinds = keys["collectives"].obj([], optional=KINDS)
  for kind, entry in kinds.items():
    f = entry.obj(["alpha_s", "bw_bps", "r2", "rows"])
    rows = []
    for item in f["rows"].items():
      r = item.obj([field.name for field in dataclasses.fields(ProbeRow)])
      rows.append(ProbeRow(bytes=r["bytes"].integer(minimum=0), elements=r["elements"].integer(minimum=0),
                           **{k: r[k].number(minimum=0.0) for k in ("seconds_median", "seconds_p10", "seconds_p90",
                                                                    "algbw_bps", "busbw_bps")}))
    fits[kind] = ProbeFit(alpha_s=f["alpha_s"].number(minimum=0.0), bw_bps=f["bw_bps"].number(positive=True),
                          r2=f["r2"].optional("number"), rows=tuple(rows))
  reduce_cost = None
  if keys["reduce_cost"].value is not None:
    rows = []
    for item in keys["reduce_cost"].items():
      pair = item.items()
      if len(pair) != 2:
        raise item.error(f"expected [bytes, seconds], got {len(pair)} item(s)")
      rows.append((pair[0].number(), pair[1].number()))
    reduce_cost = cost_table(rows, [f"{file}: $.reduce_cost[{i}]" for i in range(len(rows))], file)
  return Probe(workers=keys["workers"].integer(minimum=1), dtype=keys["dtype"].string(),
               link_capacity_bps=keys["link_capacity_bps"].optional("number", positive=True),
               collectives=fits, reduce_cost=reduce_cost)


def write_probe(path: str, probe: Probe) -> None:
  """Write ``probe`` as ``probe/1`` JSON (atomically). Raises ProfileError if it would not read back."""
  _write_checked(path, probe_to_dict(probe), probe_from_dict)


def read_probe(path: str) -> Probe:
  """Read a ``probe/1`` JSON file. Raises :class:`ProfileError`."""
  return probe_from_dict(load_json(path), file=path)


# ---------------------------------------------------------------------------------------------------
# whatif/1 (the output of `netanalysis whatif --json`)

_WHATIF_ENTRIES = {
    "grid": ("profile", "workers", "bandwidth_bps", "compression", "scaling_factor", "step_seconds",
             "exposed_comm_seconds"),
    "needed_compression": ("profile", "workers", "bandwidth_bps", "target_scaling", "compression"),
}


def read_whatif(path: str) -> dict:
  """Read the JSON written by ``netanalysis whatif --json``, checking its schema and the entries of its
  ``grid`` and ``needed_compression`` lists (``compression`` may be null: unreachable).

  Raises:
    ProfileError: invalid JSON, another schema, a missing or unknown key, a wrong type.
  """
  doc = _Json(path, load_json(path))
  _schema(doc, WHATIF_SCHEMA)
  keys = doc.obj(["schema", "model", "scaling", "fusion", "notes", "grid", "effective_compression"],
                 optional=["target_scaling", "needed_compression", "needed_bandwidth", "network_bound_below",
                           "predictions"])
  for name, fields in _WHATIF_ENTRIES.items():
    for entry in keys[name].items() if name in keys else ():
      values = entry.obj(fields)
      values["profile"].string()
      values["workers"].integer(minimum=1)
      for field in fields[2:]:
        if field != "compression" or name == "grid" or values[field].value is not None:
          values[field].number()
  return doc.value


# ---------------------------------------------------------------------------------------------------
# Dispatch on the file type.


def read_any_profile(path: str, iteration_seconds: float | None = None) -> Profile:
  """A ``profile/1`` JSON file (``*.json``, or content that starts like JSON), else a ``.bk.log``.

  Raises:
    ProfileError: unreadable or malformed file, or a ``.bk.log`` without an iteration time.
  """
  if path.endswith(".json") or _read_text(path).lstrip()[:1] in ("{", "["):
    return read_profile(path)
  if iteration_seconds is None:
    raise ProfileError(f"{path}: a .bk.log profile needs its one-worker iteration time: pass "
                       f"--iteration_time_ms=MS (several profiles: --iteration_time_ms=name=MS,...)")
  return read_bk_log(path, iteration_seconds)
