"""The profile schema of netanalysis: one typed model of a step, read from a run's JSON or the paper's profiles.

* ``sparsejax.netanalysis.profile/1`` (JSON): a step as a chain of compute segments and collectives.
  sparsejax runs write it (``workdir/netanalysis/profile.json``); :func:`read_profile` reads it.
* ``.bk.log`` (the paper's backward-pass profiles): :func:`read_bk_log` maps one onto the same schema.

The other files of netanalysis: ``bytes,seconds`` reduction-cost tables (:mod:`.cost_tables`), the probe's fitted
latency/bandwidth per collective kind (``sparsejax.netanalysis.probe/1``: :mod:`.probe_results`) and the what-if
document (:func:`sparsejax.netanalysis.report.read_whatif`). Every reader raises :class:`ProfileError` whose message
starts with where the problem is, and writers never leave a broken file (:mod:`.file_io`). Units: seconds, bytes,
bits per second.
"""

import dataclasses
import math
import os
from typing import Any

from sparsejax.distributed.collectives import KINDS  # collective kinds, spelled as in XLA's HLO
from sparsejax.netanalysis.file_io import (
  JsonValue,
  check_schema,
  load_json,
  number_field,
  read_lines,
  read_text,
  two_fields,
  write_checked,
)
from sparsejax.netanalysis.units import ProfileError

PROFILE_SCHEMA = "sparsejax.netanalysis.profile/1"

# How a compute segment's time changes with the number of processes P (see whatif.scale_chain).
SCALES = ("replicated", "sharded", "batch")
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
  doc = JsonValue(file, obj)
  check_schema(doc, PROFILE_SCHEMA)
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


def _chain_from_json(step: JsonValue) -> Chain:
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


def write_profile(path: str, profile: Profile) -> None:
  """Write ``profile`` as ``profile/1`` JSON (atomically). Raises ProfileError if it would not read back."""
  write_checked(path, profile_to_dict(profile), profile_from_dict)


def read_profile(path: str) -> Profile:
  """Read a ``profile/1`` JSON file. Raises :class:`ProfileError`."""
  return profile_from_dict(load_json(path), file=path)


# ---------------------------------------------------------------------------------------------------
# The paper's .bk.log.


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
  lines = read_lines(path)
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
    wait_text, bytes_text = two_fields(path, lineno, line, "wait_us,bytes")
    parsed.append((number_field(path, lineno, wait_text, "wait_us") * 1e-6, _whole(path, lineno, bytes_text, "bytes")))
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


# ---------------------------------------------------------------------------------------------------
# Dispatch on the file type.


def read_any_profile(path: str, iteration_seconds: float | None = None) -> Profile:
  """A ``profile/1`` JSON file (``*.json``, or content that starts like JSON), else a ``.bk.log``.

  Raises:
    ProfileError: unreadable or malformed file, or a ``.bk.log`` without an iteration time.
  """
  if path.endswith(".json") or read_text(path).lstrip()[:1] in ("{", "["):
    return read_profile(path)
  if iteration_seconds is None:
    raise ProfileError(f"{path}: a .bk.log profile needs its one-worker iteration time: pass "
                       f"--iteration_time_ms=MS (several profiles: --iteration_time_ms=name=MS,...)")
  return read_bk_log(path, iteration_seconds)
