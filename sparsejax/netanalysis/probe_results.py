"""The results of ``netanalysis probe`` (``sparsejax.netanalysis.probe/1`` JSON): fitted latency and bandwidth per
collective kind, the raw probe rows and the local reduction cost; :func:`write_probe` / :func:`read_probe`."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from sparsejax.distributed.collectives import KINDS
from sparsejax.netanalysis.cost_tables import CostTable, cost_table
from sparsejax.netanalysis.file_io import JsonValue, check_schema, load_json, write_checked

PROBE_SCHEMA = "sparsejax.netanalysis.probe/1"


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
  doc = JsonValue(file, obj)
  check_schema(doc, PROBE_SCHEMA)
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
  write_checked(path, probe_to_dict(probe), probe_from_dict)


def read_probe(path: str) -> Probe:
  """Read a ``probe/1`` JSON file. Raises :class:`ProfileError`."""
  return probe_from_dict(load_json(path), file=path)
