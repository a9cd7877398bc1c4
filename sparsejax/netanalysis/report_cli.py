"""``report`` and ``export-bk``: read a profiled run (``workdir/netanalysis/rank*.json``).

Examples::

  # Step breakdown, per-collective timing and link utilisation; a PNG and a Perfetto timeline:
  python -m sparsejax.netanalysis report --run=runs/dist --png=runs/dist/net --trace=runs/dist/timeline.json
  # With the link's capacity from a probe, and the scaling factor against a one-process run:
  python -m sparsejax.netanalysis report --run=runs/dist --probe=runs/probe.json --baseline_run=runs/one
  # The backward pass of a dense data-parallel run as a .bk.log, for the paper-mode what-if:
  python -m sparsejax.netanalysis export-bk --run=runs/dense --out=runs/dense.bk.log
"""

import glob
import json
import math
import os
import re

import numpy as np
from absl import flags

from sparsejax.distributed.collectives import Collective
from sparsejax.netanalysis import breakdown, file_io, probe_results, report, timeline, window_files
from sparsejax.netanalysis.flagdefs import define_flag
from sparsejax.netanalysis.units import ProfileError
from sparsejax.rates import parse_rate

FLAGS = flags.FLAGS
REPORT_SCHEMA = "sparsejax.netanalysis.run_report/1"
_RANK_KEYS = ("schema", "rank", "run", "window", "breakdown")
_RUN_KEYS = ("job", "processes", "per_process_batch", "link_capacity_bps", "module", "collectives", "scope_scaling",
             "scopes")


def define_flags(command: str) -> None:
  """Define the flags of ``report`` or ``export-bk``."""
  define_flag("string", "run", None,
              "The run's workdir (or its netanalysis/ directory), written with --netanalysis_steps.")
  if command == "export-bk":
    define_flag("string", "out", None, "The .bk.log to write (default: RUN/netanalysis/backward.bk.log).")
    define_flag("integer", "rank", 0, "The rank whose timeline to export.")
    return
  define_flag("string", "link_capacity", None,
              "The link's capacity (tc units, e.g. 1gbit); overrides --probe and the run's.")
  define_flag("string", "probe", None,
              "A probe file (netanalysis probe --out): capacity = its fitted all-reduce bandwidth.")
  define_flag("string", "baseline_run", None, "A one-process run of the same per-process work: report T_n / (n T_1).")
  define_flag("string", "json", None, f"Write the report as JSON (schema {REPORT_SCHEMA}) here.")
  define_flag("string", "png", None, "Write PREFIX-breakdown.png (PREFIX.png where PREFIX ends in breakdown or "
              ".png; a directory: DIR/breakdown.png).")
  define_flag("string", "trace", None, "Write a Chrome trace (ui.perfetto.dev, chrome://tracing) of the window here.")


# --- Reading a run ---------------------------------------------------------------------------------


def _netanalysis_dir(run: str) -> str:
  if not run:
    raise ValueError("--run: give the run's workdir (the one with netanalysis/rank0.json)")
  for directory in (os.path.join(run, "netanalysis"), run):
    if os.path.isfile(os.path.join(directory, "rank0.json")):
      return directory
  if not os.path.isdir(run):
    raise ProfileError(f"{run}: no such directory")
  raise ProfileError(f"{os.path.join(run, 'netanalysis', 'rank0.json')}: missing: the run was not profiled "
                     "(train with --netanalysis_steps=N) or its window never completed")


def _check_keys(path: str, obj, keys, where: str = "$") -> None:
  if not isinstance(obj, dict):
    raise ProfileError(f"{path}: {where}: expected an object")
  for key in keys:
    if key not in obj:
      raise ProfileError(f"{path}: {where}: missing key {key!r}")


# A profiled window lasts a few steps: its times (seconds from its first step) lie well within this.
_WINDOW_SECONDS = 1e6


def _check_window_values(path: str, window: dict) -> None:
  """Refuses a rank's window whose numbers cannot be a profile's (negative or 1e308 values gave a clock offset of
  -1.8e18 ms or a step of inf): times finite and within ``_WINDOW_SECONDS`` of the first step (a step's from 0
  on; an instruction, a rebuild or a counter sample may start before it), each end after its start; ``origin``
  (an epoch time), CPU and wall seconds and byte counts finite and >= 0."""

  def check(where: str, value, low: float, high: float = math.inf) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and low <= value <= high):
      shown = f"{value:g}" if number else repr(value)
      raise ProfileError(f"{path}: $.window.{where}: {shown} must be a finite number in [{low:g}, {high:g}]")

  def check_times(where: str, rows, first: int, low: float) -> None:
    for i, row in enumerate(rows if isinstance(rows, list) else []):
      if not isinstance(row, list) or len(row) != first + 2:
        raise ProfileError(f"{path}: $.window.{where}[{i}]: expected a list of {first + 2} values")
      for j in (first, first + 1):
        check(f"{where}[{i}][{j}]", row[j], low, _WINDOW_SECONDS)
      check(f"{where}[{i}][{first + 1}]", row[first + 1], row[first], _WINDOW_SECONDS)  # the end after the start

  for name in ("origin", "cpu_seconds", "wall_seconds"):
    if name in window:
      check(name, window[name], 0.0, 1e12)
  check_times("steps", window.get("steps"), 1, 0.0)
  check_times("maintenance", window.get("maintenance"), 2, -_WINDOW_SECONDS)
  check_times("ops", window.get("ops"), 2, -_WINDOW_SECONDS)
  for i, (t, *counts) in enumerate(window.get("counters") or []):
    check(f"counters[{i}][0]", t, -_WINDOW_SECONDS, _WINDOW_SECONDS)
    for j, count in enumerate(counts, 1):
      check(f"counters[{i}][{j}]", count, 0.0, 2.0**64)
  for i, counts in enumerate(window.get("step_io") or []):
    for j, count in enumerate(counts):
      check(f"step_io[{i}][{j}]", count, 0.0, 2.0**64)


def load_run(run: str) -> tuple[list[breakdown.RankWindow], dict, str]:
  """The windows of every rank, the run's settings (scopes merged over ranks) and the directory read.

  Raises:
    ProfileError: a missing directory or rank file, invalid JSON, a wrong schema, a missing key or
      ranks that disagree.
  """
  directory = _netanalysis_dir(run)
  paths = sorted(glob.glob(os.path.join(directory, "rank*.json")),
                 key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0))
  windows, runs = [], []
  for path in paths:
    doc = file_io.load_json(path)
    _check_keys(path, doc, _RANK_KEYS)
    if doc["schema"] != window_files.RANK_SCHEMA:
      raise ProfileError(f"{path}: $.schema: unsupported schema {doc['schema']!r} (this version reads "
                         f"{window_files.RANK_SCHEMA!r})")
    _check_keys(path, doc["run"], _RUN_KEYS, "$.run")
    _check_keys(path, doc["window"], ("rank", "steps", "ops"), "$.window")
    _check_window_values(path, doc["window"])
    try:
      windows.append(breakdown.RankWindow.from_json(doc["window"]))
    except TypeError as e:
      raise ProfileError(f"{path}: $.window: {e}") from None
    runs.append(doc["run"])
  processes = runs[0]["processes"]
  ranks = [w.rank for w in windows]
  if ranks != list(range(processes)):
    raise ProfileError(f"{directory}: the run had {processes} processes but rank files for {ranks} were found")
  run_info = dict(runs[0], scopes={k: v for r in runs for k, v in r["scopes"].items()})
  return windows, run_info, directory


def link_capacity(flag: str | None, probe_path: str | None, recorded: float | None) -> tuple[float | None, str]:
  """The capacity and where it came from: ``--link_capacity``, else a probe's fitted all-reduce bandwidth,
  else the run's own setting; ``(None, why)`` when none is known (never guessed)."""
  if flag:
    return parse_rate(flag), f"--link_capacity={flag}"
  if probe_path:
    probe = probe_results.read_probe(probe_path)
    fit = probe.collectives.get("all-reduce")
    if fit is None:
      raise ProfileError(f"{probe_path}: $.collectives: no all-reduce fit to take the link's capacity from")
    return fit.bw_bps, f"fitted all-reduce bandwidth in {probe_path}"
  if recorded:
    return recorded, "the run's link_capacity"
  return None, "unknown: pass --link_capacity or --probe for utilisations"


def _check_one_process(run: str, processes: int) -> None:
  if processes != 1:  # T_1 must be one process's: a run compared with itself gave a scaling factor of 1
    raise ProfileError(f"--baseline_run={run} ran {processes} processes: give a one-process run of the same "
                       "per-process work")


def baseline_step(run: str) -> float:
  """Median step of a one-process run: its profiled window, else its metrics.jsonl step times."""
  try:
    windows, _, _ = load_run(run)
  except ProfileError:
    windows = None
  if windows is not None:
    _check_one_process(run, len(windows))
    return float(np.median([b - a for _, a, b in windows[0].steps]))
  path = os.path.join(run, "metrics.jsonl")
  try:
    with open(path) as f:
      records = list(map(json.loads, f))
  except (OSError, ValueError) as e:
    raise ProfileError(f"{path}: cannot read the baseline's step times: {e}") from None
  _check_one_process(run, max((r.get("num_processes", 1) for r in records), default=1))
  medians = [r["step_seconds_median"] for r in records if "step_seconds_median" in r]
  if not medians:
    raise ProfileError(f"{path}: no step_seconds_median records (and no netanalysis window) in the baseline run")
  return float(np.median(medians))


# --- report -------------------------------------------------------------------------------------------


def _ms(seconds) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _pct(x) -> str:
  return "-" if x is None else f"{x:.1%}"


def _bps(x) -> str:
  return "-" if x is None else f"{x:.4g}"


def format_run_report(analysis: dict, run: dict, directory: str, capacity_source: str) -> str:
  """The ``report`` text: breakdown (median and p90), per rank, per collective, utilisation, SF, bottleneck."""
  s = analysis["summary"]
  steps = [x["step"] for x in analysis["steps"]]
  capacity = report.rate_label(analysis["capacity_bps"]) + " bit/s" if analysis["capacity_bps"] else "-"
  lines = [f"Run {os.path.dirname(os.path.abspath(directory))}: {run['job']} job, P = {run['processes']}, "
           f"{len(steps)} profiled steps ({steps[0]}-{steps[-1]}), per-process batch {run['per_process_batch']}",
           f"Link capacity: {capacity}"
           f" ({capacity_source})", "",
           "Step breakdown (the job's step is its slowest rank's), ms:"]
  rows = []
  for key, label in (("step", "step"), ("compute", "compute"), ("comm", "communication"),
                     ("overlap", "  overlapped"), ("exposed_comm", "  exposed"), ("wait", "    waiting for peers"),
                     ("transfer", "    transfer"), ("other", "other (host, dispatch)")):
    rows.append([label, _ms(s[f"{key}_seconds_median"]), _ms(s[f"{key}_seconds_p90"]), _ms(s[f"{key}_seconds_mean"]),
                 _pct(s[f"{key}_seconds_mean"] / s["step_seconds_mean"])])
  lines += [report.format_table(["", "median", "p90", "mean", "of step (means)"], rows), ""]
  rows = []
  for r in analysis["ranks"]:
    med = {k: np.median([x[f"{k}_seconds"] for x in r["steps"]]) for k in breakdown.FIELDS}
    rows.append([str(r["rank"]), _ms(med["step"]), _ms(med["compute"]), _ms(med["exposed_comm"]), _ms(med["wait"]),
                 _ms(med["transfer"]), _ms(med["other"]), "-" if r["cpu_busy"] is None else f"{r['cpu_busy']:.2f}",
                 f"{r['clock_offset_seconds'] * 1e3:+.3f}"])
  lines += ["Per rank (medians, ms; CPU busy = process CPU seconds / wall seconds):",
            report.format_table(["rank", "step", "compute", "exposed comm", "wait", "transfer", "other", "CPU busy",
                                 "clock offset"], rows), ""]
  rows = []
  for c in analysis["collectives"]:
    rows.append([c["name"], c["kind"], c["scope"] or "-", f"{c['bytes']:,}", f"{c['wire_bytes']:,.0f}",
                 f"{c['calls_per_step']:g}", _ms(c["transfer_seconds_median"]), _ms(c["wait_seconds_median"]),
                 _bps(c["busbw_bps"]), _pct(c.get("utilisation"))])
  lines += ["Collectives (per call; wire bytes: one process's ring traffic; transfer: the fastest rank's duration; "
            "wait: the slowest rank's):",
            report.format_table(["name", "kind", "scope", "bytes", "wire bytes", "calls/step", "transfer ms", "wait ms",
                                 "busbw bit/s", "utilisation"], rows, left=3), ""]
  u = analysis["utilisation"]
  lines.append(f"Wire bytes per step per process: {u['wire_bytes_per_step']:,.0f}")
  if analysis["capacity_bps"]:
    lines.append(f"Link utilisation: during communication {_bps(u['during_comm_bps'])} bit/s "
                 f"({_pct(u.get('during_comm'))}); step average {_bps(u['step_average_bps'])} bit/s "
                 f"({_pct(u.get('step_average'))})")
  else:
    lines.append(f"Link utilisation: omitted, capacity {capacity_source}")
  if analysis["interface"]:
    i = analysis["interface"]
    ratio = "-" if i["tx_over_analytic"] is None else f"{i['tx_over_analytic']:.2f}"
    lines.append(f"Interface {','.join(i['names'])}: tx {i['tx_bytes_per_step_median']:,.0f} B/step, rx "
                 f"{i['rx_bytes_per_step_median']:,.0f} B/step; measured tx / analytic wire bytes = {ratio} "
                 "(counters include all traffic on the interface)")
  a = analysis["alignment"]["residual"]
  lines.append(f"Clock alignment residual: median {a['median_seconds'] * 1e3:.3f} ms, "
               f"max {a['max_seconds'] * 1e3:.3f} ms "
               f"over {a['instances']} collective completions")
  if analysis["missing_collective_events"]:
    lines.append(f"Warning: {analysis['missing_collective_events']} (rank, step, collective) without trace events")
  if analysis["maintenance"]:
    rows = [[m["label"], str(m["rank"]), str(m["step"]), _ms(m["seconds"]), ",".join(m["modules"])]
            for m in analysis["maintenance"]]
    lines += ["", "Maintenance in the window (not part of any step):",
              report.format_table(["what", "rank", "after step", "ms", "modules"], rows, left=1)]
  lines += ["", f"Scaling factor SF = (step - exposed comm) / step = {analysis['scaling_factor']:.3f}"]
  if analysis.get("measured_scaling") is not None:
    lines.append(f"Measured scaling factor T_n / (n T_1) (T: throughput; here the one-process step over this "
                 f"one's) = {analysis['measured_scaling']:.3f} "
                 f"(one-process step {_ms(analysis['baseline_step_seconds'])} ms)")
  lines += [f"Bottleneck: {analysis['bottleneck']}"]
  return "\n".join(lines)


def plot_breakdown(analysis: dict, prefix: str) -> str:
  """``breakdown.png``: stacked bars per rank of compute, overlapped comm, wait, transfer and other (medians)."""
  plt = report.require_matplotlib()
  parts = [("compute (not overlapped)", "C0"), ("overlapped comm", "C2"), ("waiting for peers", "C1"),
           ("transfer", "C3"), ("other", "C7")]
  labels, values = [], []
  for r in analysis["ranks"]:
    med = {k: float(np.median([x[f"{k}_seconds"] for x in r["steps"]])) for k in breakdown.FIELDS}
    labels.append(f"rank {r['rank']}")
    values.append([med["compute"] - med["overlap"], med["overlap"], med["wait"], med["transfer"], med["other"]])
  values = np.array(values) * 1e3
  fig, ax = plt.subplots(figsize=(4.5 + 0.9 * len(labels), 4))
  bottom = np.zeros(len(labels))
  for (name, color), column in zip(parts, values.T):
    ax.bar(labels, column, bottom=bottom, label=name, color=color)
    bottom += column
  ax.set_ylabel("ms per step (median)")
  ax.set_title(f"{analysis.get('job', '')} step breakdown, P = {analysis['processes']}".strip())
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  path = report.png_path(prefix, "breakdown")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def run_report(run: str, capacity_flag: str | None = None, probe: str | None = None,
               baseline: str | None = None) -> tuple[dict, dict, list, str, str]:
  """Loads and analyses a run: ``(analysis, run settings, windows, directory, capacity source)``."""
  windows, run_info, directory = load_run(run)
  capacity, source = link_capacity(capacity_flag, probe, run_info["link_capacity_bps"])
  try:
    analysis = window_files.analyze_run(windows, run_info, capacity)
  except ValueError as e:
    raise ProfileError(f"{directory}: {e}") from None
  analysis.update(job=run_info["job"], bottleneck=breakdown.bottleneck(analysis), capacity_source=source)
  if baseline:
    t1 = baseline_step(baseline)
    analysis.update(baseline_step_seconds=t1, measured_scaling=t1 / analysis["summary"]["step_seconds_median"])
  return analysis, run_info, windows, directory, source


def _report(argv) -> int:
  analysis, run_info, windows, directory, source = run_report(FLAGS.run, FLAGS.link_capacity, FLAGS.probe,
                                                              FLAGS.baseline_run)
  print(format_run_report(analysis, run_info, directory, source))
  if FLAGS.json:
    doc = {"schema": REPORT_SCHEMA, "run": os.path.abspath(FLAGS.run),
           **{k: v for k, v in analysis.items() if k != "chains"}}
    file_io.write_json_atomic(FLAGS.json, _finite(doc))
    print(f"wrote {FLAGS.json}")
  if FLAGS.png:
    print(f"wrote {plot_breakdown(analysis, FLAGS.png)}")
  if FLAGS.trace:
    size = timeline.write_chrome_trace(FLAGS.trace, timeline.chrome_trace(windows, analysis, run_info))
    print(f"wrote {FLAGS.trace} ({size / 1e6:.1f} MB; open in ui.perfetto.dev)")
  return 0


def _finite(obj):
  """NaN and infinities (not JSON) as null."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  if isinstance(obj, dict):
    return {k: _finite(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_finite(v) for v in obj]
  return obj


# --- export-bk ------------------------------------------------------------------------------------------


def backward_rows(window: breakdown.RankWindow, run: dict) -> tuple[list[list[tuple[float, int]]], float]:
  """Per profiled step, ``(wait_us, bytes)`` of each gradient in the order it became ready, and the
  longest forward + backward time of those steps (seconds: an ``--iteration_time_ms`` every batch's
  backward pass fits in).

  A gradient is an operand of the gradient all-reduce (scope ``grad_reduce``) computed in the
  ``backward`` scope; it is ready when the instruction producing it ends. The first row's wait is
  from the end of the forward pass (the last ``forward`` instruction to end before that).
  """
  reduce = [Collective.from_json(c) for c in run["collectives"]
            if c["kind"] == "all-reduce" and "grad_reduce" in c["scope"].split("+")]
  if not reduce:
    raise ProfileError("the run has no gradient all-reduce (scope grad_reduce): export-bk needs a dense "
                       "data-parallel run (--model=dense over several processes)")
  scopes = run["scopes"]
  grads = [(p, b) for c in reduce for p, b in zip(c.producers, c.operand_sizes()) if scopes.get(p) == "backward"]
  out, iteration = [], []
  for _step, start, end in window.steps:
    ops = [(n, a, b) for n, m, a, b in window.ops if m == run["module"] and start <= a <= end]
    ends = {}
    for n, _, b in ops:
      ends[n] = max(ends.get(n, b), b)
    if any(p not in ends for p, _ in grads):
      continue
    ready = sorted((ends[p], nbytes) for p, nbytes in grads)
    # Backward starts when the forward pass is done: the last forward instruction that ended before the
    # first gradient was ready (XLA may schedule forward-scoped leftovers, e.g. the loss, later).
    forward = [b for n, a, b in ops if scopes.get(n) == "forward" and b <= ready[0][0]]
    if not forward:
      continue
    rows, previous = [], max(forward)
    for t, nbytes in ready:
      rows.append((max(t - previous, 0.0) * 1e6, nbytes))
      previous = t
    out.append(rows)
    fwd_bwd = [(a, b) for n, a, b in ops if scopes.get(n) in ("forward", "backward")]
    iteration.append(ready[-1][0] - min(a for a, _ in fwd_bwd))
  if not out:
    raise ProfileError("no profiled step has trace events for every gradient of the all-reduce")
  return out, float(np.max(iteration))


def _export_bk(argv) -> int:
  windows, run_info, directory = load_run(FLAGS.run)
  if not 0 <= FLAGS.rank < len(windows):
    raise ValueError(f"--rank={FLAGS.rank}: the run has ranks 0-{len(windows) - 1}")
  batches, iteration = backward_rows(windows[FLAGS.rank], run_info)
  layers = min(len(b) for b in batches)
  out = FLAGS.out or os.path.join(directory, "backward.bk.log")
  lines = [f"sparsejax dense run {os.path.abspath(FLAGS.run)} rank {FLAGS.rank}: wait_us since the previous gradient "
           f"was ready (first: since backward start), bytes of the gradient (netanalysis export-bk)",
           str(len(batches)), str(layers)]
  lines += [f"{wait:.3f},{nbytes}" for rows in batches for wait, nbytes in rows[:layers]]
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".tmp", "w") as f:
    f.write("\n".join(lines) + "\n")
  os.replace(out + ".tmp", out)
  print(f"wrote {out}: {len(batches)} batch(es) x {layers} gradients; forward + backward took up to "
        f"{iteration * 1e3:.3f} ms: use --iteration_time_ms={iteration * 1e3:.3f}")
  return 0


def main(command: str, argv) -> int:
  """Run ``report`` or ``export-bk``."""
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
  return _export_bk(argv) if command == "export-bk" else _report(argv)
