"""Step breakdown of a profiled window: where each rank's step went, and how well the link was used.

The definitions are those of Holistic Trace Analysis (PyTorch's trace analyser), applied to XLA's
thunks on CPU. Per rank and step, with ``C`` the union of non-collective instruction intervals and
``M`` the union of collective intervals inside the step:

* ``compute = |C|``, ``comm = |M|``, ``overlap = |C ∩ M|``, ``exposed_comm = comm - overlap``;
* ``other = step - |C ∪ M|`` (dispatch, host work, data), so ``compute + exposed_comm + other = step``;
* every collective instance's duration on rank r is split into ``wait_r`` (its first part: waiting for
  the slowest peer to arrive) and ``transfer`` (its last part), where ``transfer`` is the instance's
  shortest duration over ranks; exposed communication splits the same way.

Ranks' clocks are aligned on collective completions (all ranks leave a collective at nearly the
same moment): rank r's offset is the median over the window of ``end_r - end_0``; what is left
(the residual) is reported. The job's step is its slowest rank's.

Units: seconds, bytes, bits per second.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from sparsejax.distributed.collectives import Collective
from sparsejax.netanalysis import intervals as iv

FIELDS = ("step", "compute", "comm", "overlap", "exposed_comm", "wait", "transfer", "other")
# Collectives of these named scopes carry gradients, which a compression scheme could shrink.
GRADIENT_SCOPES = ("grad_reduce",)
DTYPE_NAMES = {"f32": "float32", "f64": "float64", "bf16": "bfloat16", "f16": "float16", "s32": "int32",
               "s64": "int64", "u32": "uint32", "u8": "uint8", "s8": "int8", "pred": "bool"}


@dataclasses.dataclass
class RankWindow:
  """What one rank recorded in the profiled window (times in seconds on the rank's own clock, from ``origin``).

  Attributes:
    rank: process index.
    steps: ``(step, start, end)`` of each profiled step (the step's annotation, which ends after
      ``block_until_ready``).
    ops: ``(name, module, start, end)`` of every XLA instruction (thunk) executed in the window.
    maintenance: ``(label, step, start, end)`` of table rebuilds, checksums, evaluations... in the window.
    step_io: ``(tx_bytes, rx_bytes)`` the interface counted during each step (None: no interface).
    counters: ``(time, tx_bytes, rx_bytes)`` samples of the interface's counters.
    iface: the interface's name, or None.
    cpu_seconds: CPU time of the process over the window.
    wall_seconds: wall time of the window.
    origin: the rank's wall-clock time (``time.time()``) of time 0, so that times keep sub-microsecond
      resolution (an epoch time in float64 resolves only ~0.2 us).
  """
  rank: int
  steps: list
  ops: list
  maintenance: list = dataclasses.field(default_factory=list)
  step_io: list | None = None
  counters: list = dataclasses.field(default_factory=list)
  iface: str | None = None
  cpu_seconds: float = 0.0
  wall_seconds: float = 0.0
  origin: float = 0.0

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, obj: Mapping) -> "RankWindow":
    return cls(**{f.name: obj[f.name] for f in dataclasses.fields(cls) if f.name in obj})


def _median(values) -> float | None:
  return float(np.median(values)) if len(values) else None


def _mean(values) -> float | None:
  return float(np.mean(values)) if len(values) else None


def _p90(values) -> float | None:
  return float(np.percentile(values, 90)) if len(values) else None


def collective_instances(window: RankWindow, module: str, names: set[str]) -> dict[tuple, tuple[float, float]]:
  """``(step, name, k) -> (start, end)``: the k-th execution of collective ``name`` in each step."""
  out, by_step = {}, {}
  for name, op_module, start, end in window.ops:
    if op_module == module and name in names:
      for step, s0, s1 in window.steps:
        if s0 <= start <= s1:
          by_step.setdefault(step, []).append((start, end, name))
          break
  for step, events in by_step.items():
    seen = {}
    for start, end, name in sorted(events):
      k = seen.get(name, 0)
      seen[name] = k + 1
      out[(step, name, k)] = (start, end)
  return out


def align(instances: Sequence[Mapping[tuple, tuple[float, float]]]) -> tuple[list[float], dict]:
  """Clock offsets of the ranks from collective completions.

  Args:
    instances: per rank, :func:`collective_instances`.

  Returns:
    ``(offsets, residual)``: subtract ``offsets[r]`` from rank r's times to put them on rank 0's
    clock (``offsets[0] = 0``); ``residual`` holds ``median_seconds`` and ``max_seconds`` of
    ``|end_r - offset_r - end_0|`` over every matched instance and rank, and ``instances``.
  """
  offsets, residuals = [0.0], []
  for inst in instances[1:]:
    deltas = [inst[key][1] - instances[0][key][1] for key in inst if key in instances[0]]
    offset = _median(deltas) if deltas else 0.0
    offsets.append(offset)
    residuals += [abs(d - offset) for d in deltas]
  return offsets, {"median_seconds": _median(residuals) if residuals else 0.0,
                   "max_seconds": max(residuals) if residuals else 0.0, "instances": len(residuals)}


def transfer_times(instances: Sequence[Mapping[tuple, tuple[float, float]]]) -> dict[tuple, float]:
  """``(step, name, k) -> transfer``: each collective instance's shortest duration over the ranks."""
  common = set.intersection(*(set(inst) for inst in instances)) if instances else set()
  return {key: min(inst[key][1] - inst[key][0] for inst in instances) for key in common}


def common_clock(windows: Sequence[RankWindow]) -> list[RankWindow]:
  """The windows with times from rank 0's ``origin`` (each rank's wall clock, not yet aligned)."""
  return [_shift(w, windows[0].origin - w.origin) for w in windows]


def _shift(window: RankWindow, offset: float) -> RankWindow:
  return dataclasses.replace(
      window, steps=[(s, a - offset, b - offset) for s, a, b in window.steps],
      ops=[(n, m, a - offset, b - offset) for n, m, a, b in window.ops],
      maintenance=[(label, s, a - offset, b - offset) for label, s, a, b in window.maintenance],
      counters=[(t - offset, tx, rx) for t, tx, rx in window.counters], origin=window.origin + offset)


def step_breakdown(ops: Sequence[tuple[float, float, bool]], start: float, end: float,
                   waits: Sequence[tuple[float, float, float]] = ()) -> dict[str, float]:
  """The breakdown of one step on one rank.

  Args:
    ops: ``(start, end, is_collective)`` of the instructions (clipped to the step).
    start, end: the step.
    waits: ``(start, end, wait_seconds)`` of each collective instance: its first ``wait_seconds``
      were spent waiting for peers, the rest transferring.

  Returns:
    seconds of each of :data:`FIELDS` (``wait + transfer = exposed_comm``; ``compute +
    exposed_comm + other = step``).
  """
  compute = iv.clip(iv.union((a, b) for a, b, coll in ops if not coll), start, end)
  comm = iv.clip(iv.union((a, b) for a, b, coll in ops if coll), start, end)
  overlap = iv.intersect(compute, comm)
  transfer = iv.clip(iv.union((min(a + w, b), b) for a, b, w in waits), start, end)
  waiting = iv.subtract(iv.clip(iv.union((a, min(a + w, b)) for a, b, w in waits), start, end), transfer)
  busy = iv.union(compute + comm)
  out = {"step": end - start, "compute": iv.length(compute), "comm": iv.length(comm), "overlap": iv.length(overlap),
         "transfer": iv.length(iv.subtract(transfer, compute)), "wait": iv.length(iv.subtract(waiting, compute)),
         "other": (end - start) - iv.length(busy)}
  out["exposed_comm"] = out["comm"] - out["overlap"]
  return out


def analyze(windows: Sequence[RankWindow], module: str, collectives: Sequence[Collective], *,
            processes: int, scopes: Mapping[str, str] | None = None,
            scope_scaling: Mapping[str, str] | None = None, capacity_bps: float | None = None) -> dict:
  """Breakdown, per-collective timing and link utilisation of a profiled window.

  Args:
    windows: one per rank.
    module: the step's HLO module name (its trace events' ``hlo_module``).
    collectives: the step's collectives (:func:`~sparsejax.distributed.collectives.compile_step`).
    processes: P.
    scopes: instruction name -> named scope, for the segments of the profile chain.
    scope_scaling: named scope -> ``replicated``, ``sharded`` or ``batch``.
    capacity_bps: the link's capacity, bit/s, or None (utilisations are then omitted).

  Returns:
    A JSON-ready dict: ``ranks`` (per rank: clock offset, per-step breakdown, collective
    instances, CPU busy), ``steps`` (the job's: per step the slowest rank's breakdown),
    ``summary`` (median and p90 of each field), ``collectives`` (per collective: kind, scope,
    bytes, wire bytes, median transfer and wait, busbw, utilisation), ``utilisation``,
    ``interface``, ``alignment``, ``maintenance``, ``missing_collective_events``,
    ``scaling_factor`` and ``chains`` (per step, the slowest rank's step as segments and
    collectives for the profile).
  """
  scopes, scope_scaling = scopes or {}, scope_scaling or {}
  names = {c.name for c in collectives}
  by_name = {c.name: c for c in collectives}
  windows = common_clock(windows)
  raw = [collective_instances(w, module, names) for w in windows]
  offsets, residual = align(raw)
  windows = [_shift(w, off) for w, off in zip(windows, offsets)]
  instances = [{key: (a - off, b - off) for key, (a, b) in inst.items()} for inst, off in zip(raw, offsets)]
  common_steps = sorted(set.intersection(*(set(s for s, _, _ in w.steps) for w in windows)))
  if not common_steps:
    raise ValueError("no step was profiled on every rank")
  transfer = transfer_times(instances)

  ranks, per_rank_steps = [], []
  missing = 0
  for w, inst in zip(windows, instances):
    steps = {}
    for step, start, end in w.steps:
      if step not in common_steps:
        continue
      ops = [(max(a, start), min(b, end), n in names and m == module) for n, m, a, b in w.ops if b > start and a < end]
      waits = [(a, b, (b - a) - transfer.get(key, b - a)) for key, (a, b) in inst.items() if key[0] == step]
      steps[step] = dict(step_breakdown(ops, start, end, waits), start=start, end=end)
      found = {key[1] for key in inst if key[0] == step}
      missing += len(names - found)
    if w.step_io:
      io = {s: tuple(x) for (s, _, _), x in zip(w.steps, w.step_io)}
      for step, b in steps.items():
        b["tx_bytes"], b["rx_bytes"] = io[step]
    per_rank_steps.append(steps)
    ranks.append({
        "rank": w.rank, "clock_offset_seconds": offsets[len(ranks)],
        "steps": [{"step": s, **{f"{k}_seconds" if k in FIELDS else k: v for k, v in b.items()}}
                  for s, b in sorted(steps.items())],
        "cpu_busy": w.cpu_seconds / w.wall_seconds if w.wall_seconds > 0 else None,
        "cpu_seconds": w.cpu_seconds, "wall_seconds": w.wall_seconds, "iface": w.iface,
    })

  job_steps, slowest = [], []
  for step in common_steps:
    r = max(range(len(windows)), key=lambda i: per_rank_steps[i][step]["step"])
    slowest.append(r)
    job_steps.append({"step": step, "rank": r, **{f"{k}_seconds": per_rank_steps[r][step][k] for k in FIELDS}})
  summary = {f"{k}_seconds_{stat}": fn([s[f"{k}_seconds"] for s in job_steps])
             for k in FIELDS for stat, fn in (("median", _median), ("p90", _p90), ("mean", _mean))}

  wire = {c.name: c.wire_bytes(processes) for c in collectives}
  wire_per_step = sum(wire.values())
  per_collective = []
  for c in collectives:
    keys = [key for key in transfer if key[1] == c.name]
    t = _median([transfer[key] for key in keys])
    waits = [(instances[r][key][1] - instances[r][key][0]) - transfer[key]
             for key, r in ((key, slowest[common_steps.index(key[0])]) for key in keys if key[0] in common_steps)]
    row = {"name": c.name, "kind": c.kind, "scope": c.scope, "dtypes": list(c.dtypes),
           "operand_bytes": c.operand_bytes, "bytes": c.model_bytes(processes), "wire_bytes": wire[c.name],
           "calls_per_step": len(keys) / max(len(common_steps), 1),
           "transfer_seconds_median": t, "wait_seconds_median": _median(waits)}
    row["busbw_bps"] = wire[c.name] * 8 / t if t and t > 0 else None
    if capacity_bps and row["busbw_bps"] is not None:
      row["utilisation"] = row["busbw_bps"] / capacity_bps
    per_collective.append(row)

  utilisation = {"capacity_bps": capacity_bps, "wire_bytes_per_step": wire_per_step}
  comm_util = []
  for inst in instances:
    spans = iv.union((b - transfer[key], b) for key, (a, b) in inst.items() if key in transfer)
    total_wire = sum(wire[key[1]] for key in inst if key in transfer)
    busy = iv.length(spans)
    if busy > 0:
      comm_util.append(total_wire * 8 / busy)
  utilisation["during_comm_bps"] = _median(comm_util) if comm_util else None
  step_median = summary["step_seconds_median"]
  utilisation["step_average_bps"] = wire_per_step * 8 / step_median if step_median > 0 else None
  if capacity_bps:
    for key in ("during_comm", "step_average"):
      value = utilisation[f"{key}_bps"]
      utilisation[key] = value / capacity_bps if value is not None else None

  interface = _interface(ranks, wire_per_step)
  maintenance = []
  for w in windows:
    for label, step, start, end in w.maintenance:
      modules = sorted({m for n, m, a, b in w.ops if start <= a <= end})
      if modules:
        maintenance.append({"rank": w.rank, "label": label, "step": step, "seconds": end - start, "modules": modules})

  exposed = summary["exposed_comm_seconds_median"]
  chains = [_chain(windows[r], instances[r], step, transfer, module, names, by_name, scopes, scope_scaling, processes)
            for step, r in zip(common_steps, slowest)]
  return {
      "processes": processes, "module": module, "capacity_bps": capacity_bps,
      "alignment": {"offsets_seconds": offsets, "residual": residual},
      "steps": job_steps, "summary": summary, "ranks": ranks, "collectives": per_collective,
      "utilisation": utilisation, "interface": interface, "maintenance": maintenance,
      "missing_collective_events": missing,
      "scaling_factor": (step_median - exposed) / step_median if step_median > 0 else None,
      "chains": chains,
  }


def _interface(ranks: list[dict], wire_per_step: float) -> dict | None:
  """Per-step tx/rx from the interface counters, and measured tx over the analytic wire bytes."""
  tx = [s["tx_bytes"] for r in ranks for s in r["steps"] if "tx_bytes" in s]
  rx = [s["rx_bytes"] for r in ranks for s in r["steps"] if "rx_bytes" in s]
  if not tx:
    return None
  out = {"names": sorted({r["iface"] for r in ranks if r["iface"]}), "tx_bytes_per_step_median": _median(tx),
         "rx_bytes_per_step_median": _median(rx)}
  out["tx_over_analytic"] = out["tx_bytes_per_step_median"] / wire_per_step if wire_per_step > 0 else None
  return out


def _scope_segments(compute_ops, r0: float, r1: float, scopes, scope_scaling) -> tuple[list[dict], float]:
  """Segments of the compute inside ``[r0, r1]``, one per scope in order of first appearance (their
  seconds share the compute union in proportion to each scope's own union), and that union's length."""
  inside = [(scopes.get(n, "") or "unscoped", max(a, r0), min(b, r1)) for n, a, b in compute_ops
            if min(b, r1) > max(a, r0)]
  busy = iv.length(iv.union((a, b) for _, a, b in inside))
  by_scope: dict[str, list] = {}
  for scope, a, b in sorted(inside, key=lambda x: x[1]):
    by_scope.setdefault(scope, []).append((a, b))
  lengths = {scope: iv.length(iv.union(spans)) for scope, spans in by_scope.items()}
  total = sum(lengths.values())
  return [{"seconds": busy * seconds / total, "scope": scope, "scales": scope_scaling.get(scope, "replicated")}
          for scope, seconds in lengths.items()], busy


def _chain(window: RankWindow, inst: Mapping, step: int, transfer: Mapping, module: str, names: set,
           by_name: Mapping[str, Collective], scopes: Mapping[str, str], scope_scaling: Mapping[str, str],
           processes: int) -> dict:
  """One step of one rank as the profile's chain: segments between collectives, split by scope.

  Regions are cut at collectives; in each region, compute time goes to the scopes that ran there
  (in order of first appearance, shares of the region's compute union) and the rest of the region
  (dispatch, host) to a ``host`` segment. Then the time the next collective waited for slower peers
  (load imbalance, which no link speed changes) becomes a ``waiting for peers`` segment, after
  which the collective is ready; compute that ran while it was in flight follows as segments it
  overlaps, and the next region needs its result. Segments plus transfers add up to the step.
  """
  start, end = next((a, b) for s, a, b in window.steps if s == step)
  colls = sorted((a, b, key) for key, (a, b) in inst.items() if key[0] == step)
  bounds = [start] + [x for a, b, _ in colls for x in (a, b)] + [end]
  regions = [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(0, len(bounds), 2)]
  compute_ops = [(n, a, b) for n, m, a, b in window.ops if not (n in names and m == module) and b > start and a < end]
  segments, ready_after, needed_before = [], [], []
  for i, (r0, r1) in enumerate(regions):
    if i:
      needed_before.append(len(segments))
    region, busy = _scope_segments(compute_ops, r0, r1, scopes, scope_scaling)
    segments += region
    if r1 - r0 > busy or not region:
      segments.append({"seconds": max(r1 - r0 - busy, 0.0), "scope": "host", "scales": "replicated"})
    if i < len(colls):
      a, b, key = colls[i]
      wait = (b - a) - transfer.get(key, b - a)
      if wait > 0:
        segments.append({"seconds": wait, "scope": "waiting for peers", "scales": "replicated"})
      ready_after.append(len(segments) - 1)
      segments += _scope_segments(compute_ops, a, b, scopes, scope_scaling)[0]  # overlapped with the collective
  out = []
  for i, (a, b, key) in enumerate(colls):
    c = by_name[key[1]]
    out.append({
        "name": c.name, "kind": c.kind, "bytes": c.model_bytes(processes),
        "compressible": bool(c.scope) and all(s in GRADIENT_SCOPES for s in c.scope.split("+")),
        "ready_after": ready_after[i], "needed_before": needed_before[i],
        "transfer_seconds": transfer.get(key, b - a), "wait_seconds": (b - a) - transfer.get(key, b - a),
        "scope": c.scope, "dtype": "+".join(dict.fromkeys(DTYPE_NAMES.get(t, t) for t in c.dtypes)),
        "shape": list(c.shapes[0]) if len(c.shapes) == 1 else [],
    })
  return {"segments": segments, "collectives": out}


def bottleneck(analysis: Mapping) -> str:
  """The run's bottleneck in one sentence, from :func:`analyze`'s result."""
  s = analysis["summary"]  # shares of the mean step: the means add up (compute + exposed comm + other = step)
  step = s["step_seconds_mean"]
  share = {k: s[f"{k}_seconds_mean"] / step for k in ("compute", "exposed_comm", "wait", "transfer", "other")}
  util = analysis["utilisation"].get("during_comm")
  link = f"; while communicating the link is {util:.0%} used" if util is not None else ""
  cpu = [r["cpu_busy"] for r in analysis["ranks"] if r["cpu_busy"] is not None]
  cpu_text = f"; the processes keep {sum(cpu):.1f} cores busy in all" if cpu else ""
  if share["exposed_comm"] >= max(share["compute"], share["other"]):
    if share["wait"] > share["transfer"]:
      return (f"Communication-bound, but mostly waiting for slower peers: exposed communication is "
              f"{share['exposed_comm']:.0%} of the step ({share['wait']:.0%} waiting, {share['transfer']:.0%} "
              f"transfer), so rank imbalance (compute or CPU contention), not the link, sets the pace{link}{cpu_text}.")
    if util is not None and util < 0.5:
      return (f"Communication-bound, but not by bandwidth: {share['exposed_comm']:.0%} of the step is exposed "
              f"communication ({share['transfer']:.0%} transfer, {share['wait']:.0%} waiting for peers), yet the link "
              f"is only {util:.0%} used while communicating: per-message latency and host overhead dominate.")
    return (f"Network-bound: {share['exposed_comm']:.0%} of the step is exposed communication "
            f"({share['transfer']:.0%} transfer, {share['wait']:.0%} waiting for peers){link}.")
  if share["compute"] >= share["other"]:
    return (f"Compute-bound: compute is {share['compute']:.0%} of the step; exposed communication "
            f"{share['exposed_comm']:.0%} ({share['transfer']:.0%} transfer, {share['wait']:.0%} waiting for peers)"
            f"{link}{cpu_text}.")
  return (f"Host-bound: {share['other']:.0%} of the step is neither XLA compute nor communication (dispatch, "
          f"Python, data); compute {share['compute']:.0%}, "
          f"exposed communication {share['exposed_comm']:.0%}{cpu_text}.")
