"""A profiled window as a Chrome trace (JSON) that opens in ui.perfetto.dev and chrome://tracing.

One process per rank, with threads ``compute`` (XLA instructions; concurrent ones get extra lanes
``compute #2``...), ``collectives`` (slices carry the HLO name, scope, bytes, transfer, wait and
busbw of that call) and ``host`` (steps and maintenance), and a ``link Mbit/s`` counter track of the
interface's tx and rx. Ranks are aligned on collective completions (see
:mod:`sparsejax.netanalysis.breakdown`) and only the profiled window is written, so the file stays
small (a few MB for ten steps of the sparse job on four ranks).
"""

import json
import os
import tempfile
from collections.abc import Mapping, Sequence

from sparsejax.netanalysis import breakdown

_COMPUTE, _COLLECTIVES, _HOST = 1, 2, 3


def _us(seconds: float, origin: float) -> float:
  return round((seconds - origin) * 1e6, 3)


def _lanes(spans: Sequence[tuple[float, float]]) -> list[int]:
  """A lane per span so that spans in one lane never overlap (greedy, in start order)."""
  ends: list[float] = []
  out = [0] * len(spans)
  for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
    start, end = spans[i]
    lane = next((k for k, e in enumerate(ends) if e <= start), len(ends))
    if lane == len(ends):
      ends.append(end)
    else:
      ends[lane] = end
    out[i] = lane
  return out


def chrome_trace(windows: Sequence[breakdown.RankWindow], analysis: Mapping, run: Mapping) -> dict:
  """The Chrome trace object of a run.

  Args:
    windows: the ranks' windows, on their own clocks (as recorded).
    analysis: :func:`breakdown.analyze` of them (clock offsets, per-collective transfer and wire bytes).
    run: the run's settings (``module``, ``scopes``, ``collectives``).
  """
  windows = breakdown.common_clock(windows)
  offsets = analysis["alignment"]["offsets_seconds"]
  names = {c["name"] for c in run["collectives"]}
  wire = {c["name"]: c["wire_bytes"] for c in analysis["collectives"]}
  scopes = run.get("scopes", {})
  origin = min(w.steps[0][1] - off for w, off in zip(windows, offsets) if w.steps)
  per_rank = [breakdown.collective_instances(w, run["module"], names) for w in windows]
  transfer_of = breakdown.transfer_times(per_rank)
  events = []
  for w, off, instances in zip(windows, offsets, per_rank):
    pid = w.rank
    events.append({"ph": "M", "pid": pid, "tid": 0, "ts": 0, "name": "process_name",
                   "args": {"name": f"rank {w.rank}"}})
    events.append({"ph": "M", "pid": pid, "tid": 0, "ts": 0, "name": "process_sort_index",
                   "args": {"sort_index": w.rank}})
    threads = {_COLLECTIVES: "collectives", _HOST: "host"}
    for key, (a, b) in instances.items():
      t = transfer_of.get(key)
      args = {"hlo_op": key[1], "scope": scopes.get(key[1], ""), "step": key[0],
              "wire_bytes": wire.get(key[1])}
      if t is not None:
        args.update(transfer_ms=round(t * 1e3, 4), wait_ms=round((b - a - t) * 1e3, 4))
        if t > 0 and wire.get(key[1]) is not None:
          args["busbw_bps"] = wire[key[1]] * 8 / t
      events.append({"ph": "X", "pid": pid, "tid": _COLLECTIVES, "ts": _us(a - off, origin),
                     "dur": _us(b, a), "name": key[1], "cat": "collective", "args": args})
    compute = [(n, m, a, b) for n, m, a, b in w.ops if not (n in names and m == run["module"])]
    lanes = _lanes([(a, b) for _, _, a, b in compute])
    for (name, module, a, b), lane in zip(compute, lanes):
      tid = 10 + lane
      threads.setdefault(tid, "compute" if lane == 0 else f"compute #{lane + 1}")
      events.append({"ph": "X", "pid": pid, "tid": tid, "ts": _us(a - off, origin), "dur": _us(b, a), "name": name,
                     "cat": "compute", "args": {"hlo_op": name, "module": module, "scope": scopes.get(name, "")}})
    for step, a, b in w.steps:
      events.append({"ph": "X", "pid": pid, "tid": _HOST, "ts": _us(a - off, origin), "dur": _us(b, a),
                     "name": f"step {step}", "cat": "step", "args": {"step": step}})
    for label, step, a, b in w.maintenance:
      events.append({"ph": "X", "pid": pid, "tid": _HOST, "ts": _us(a - off, origin), "dur": _us(b, a),
                     "name": f"maintenance: {label}", "cat": "maintenance", "args": {"after_step": step}})
    for (t0, tx0, rx0), (t1, tx1, rx1) in zip(w.counters, w.counters[1:]):
      if t1 > t0:
        events.append({"ph": "C", "pid": pid, "tid": 0, "ts": _us(t0 - off, origin), "name": "link Mbit/s",
                       "args": {"tx": round((tx1 - tx0) * 8 / (t1 - t0) / 1e6, 3),
                                "rx": round((rx1 - rx0) * 8 / (t1 - t0) / 1e6, 3)}})
    for tid, name in threads.items():
      events.append({"ph": "M", "pid": pid, "tid": tid, "ts": 0, "name": "thread_name", "args": {"name": name}})
      events.append({"ph": "M", "pid": pid, "tid": tid, "ts": 0, "name": "thread_sort_index",
                     "args": {"sort_index": tid}})
  return {"displayTimeUnit": "ms", "traceEvents": events,
          "metadata": {"source": "sparsejax.netanalysis", "module": run["module"], "processes": run["processes"]}}


def write_chrome_trace(path: str, trace: Mapping) -> int:
  """Write ``trace`` as compact JSON (atomically); returns the file's size in bytes."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
  except BaseException:  # a failed write (a directory at path, a full disk) leaves no temporary file behind
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  return os.path.getsize(path)
