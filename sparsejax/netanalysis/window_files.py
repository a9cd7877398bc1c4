"""A profiled window's files, read and analysed without JAX: the profiler's trace placed on the wall clock, the
ranks' windows analysed (:mod:`sparsejax.netanalysis.breakdown`) and written as ``rank{r}.json`` and the job's
``profile.json``. :class:`sparsejax.netanalysis.collect.StepProfiler` writes them at the end of a window; ``netanalysis
report`` reads them back.
"""

import glob
import gzip
import json
import os
from collections.abc import Mapping

import numpy as np

from sparsejax.distributed.collectives import Collective
from sparsejax.netanalysis import breakdown, file_io, profiles

RANK_SCHEMA = "sparsejax.netanalysis.rank/1"
STEP_ANNOTATION = "train"  # the trace's name of a profiled step (jax.profiler.StepTraceAnnotation)


def read_trace(log_dir: str) -> list[dict]:
  """The events of the newest ``log_dir/plugins/profile/<run>/<host>.trace.json.gz``.

  Raises:
    FileNotFoundError: the profiler wrote no trace there.
  """
  files = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f"no profiler trace (*.trace.json.gz) under {log_dir}/plugins/profile")
  with gzip.open(files[-1], "rt") as f:
    return json.load(f).get("traceEvents", [])


def window_from_trace(events: list[dict], rank: int, steps: list[tuple[int, float, float]],
                      maintenance: list[tuple[str, int, float, float]]) -> breakdown.RankWindow:
  """The rank's window: XLA instruction events of a trace, on the wall clock of ``steps``.

  The trace's clock (microseconds from the start of the profile) is mapped onto ``time.time()``
  by the step annotations: ``steps`` holds each step's wall-clock begin, taken just before its
  annotation opened. The window's times count from its first step's begin (``origin``).

  Args:
    events: Chrome trace events (:func:`read_trace`).
    rank: this process's index.
    steps: ``(step, wall begin, wall end)`` as recorded by the loop.
    maintenance: ``(label, step, wall begin, wall end)``.
  """
  origin = min(a for _, a, _ in steps)
  steps = [(s, a - origin, b - origin) for s, a, b in steps]
  maintenance = [(label, s, a - origin, b - origin) for label, s, a, b in maintenance]
  begins = {s: a for s, a, _ in steps}
  shifts = [begins[int(e["args"]["step_num"])] - e["ts"] * 1e-6 for e in events
            if e.get("ph") == "X" and e.get("name") == STEP_ANNOTATION and "step_num" in e.get("args", {})
            and int(e["args"]["step_num"]) in begins]
  if not shifts:
    raise ValueError("the profiler trace holds no step annotations: cannot place its events in time")
  shift = float(np.median(shifts))
  ops = [(e["args"]["hlo_op"], e["args"].get("hlo_module", ""), e["ts"] * 1e-6 + shift,
          (e["ts"] + e.get("dur", 0.0)) * 1e-6 + shift)
         for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
  last = max([b for _, _, b in steps] + [b for *_, b in maintenance])
  ops = sorted(op for op in ops if op[3] >= 0 and op[2] <= last)
  return breakdown.RankWindow(rank=rank, steps=steps, ops=ops, maintenance=maintenance, origin=origin)


def analyze_run(windows, run: Mapping, capacity_bps: float | None = None) -> dict:
  """:func:`breakdown.analyze` of a run's windows with its recorded settings (``capacity_bps`` overrides)."""
  return breakdown.analyze(
      windows, run["module"], tuple(Collective.from_json(c) for c in run["collectives"]), processes=run["processes"],
      scopes=run["scopes"], scope_scaling=run["scope_scaling"],
      capacity_bps=capacity_bps if capacity_bps is not None else run["link_capacity_bps"])


def run_profile(analysis: Mapping, run: Mapping, workdir: str) -> profiles.Profile:
  """The job's ``profile/1`` from an analysis: one chain per profiled step, the median job step."""
  name = os.path.basename(os.path.normpath(os.path.abspath(workdir)))
  return profiles.profile_from_dict({
      "schema": profiles.PROFILE_SCHEMA, "name": name, "source": "run", "path": os.path.abspath(workdir),
      "job": run["job"], "workers": run["processes"], "per_process_batch": run["per_process_batch"],
      "step_seconds": analysis["summary"]["step_seconds_median"], "steps": analysis["chains"]},
      file=os.path.join(workdir, "netanalysis", "profile.json"))


def write_run(directory: str, windows, run: Mapping) -> dict:
  """Analyses the gathered windows and writes ``rank{r}.json`` and ``profile.json`` (atomically)."""
  analysis = analyze_run(windows, run)
  workdir = os.path.dirname(os.path.abspath(directory))
  for window, rank_info in zip(windows, analysis["ranks"]):
    scopes = {n: run["scopes"][n] for n in {op[0] for op in window.ops} if n in run["scopes"]}
    file_io.write_json_atomic(os.path.join(directory, f"rank{window.rank}.json"), {
        "schema": RANK_SCHEMA, "rank": window.rank, "run": dict(run, scopes=scopes), "window": window.to_json(),
        "breakdown": rank_info})
  profiles.write_profile(os.path.join(directory, "profile.json"), run_profile(analysis, run, workdir))
  return analysis
