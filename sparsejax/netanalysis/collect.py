"""In-run measurement: per-step times always, and a profiled window of steps on request.

A training loop drives a :class:`StepProfiler` through four hooks::

  profiler = StepProfiler(workdir, steps=10, start=50, link_capacity="1gbit", ...)
  while training:
    profiler.begin_step(step, program)            # program() -> (jitted, args, scopes), compiled once
    state, metrics = train_step(state, batch)
    profiler.end_step(step + 1, (state, metrics))  # a timestamp (with a window: waits for the step)
    state = profiler.maintenance("tables", rebuild, state)   # timed as its own row in the window
    if step % log_every == 0: record.update(profiler.log_record())   # after the loop's own sync
  profiler.finish()                               # every process; writes the files

**Always (nearly free).** Two timestamps per step and nothing else: the loop is not synchronized.
:meth:`StepProfiler.log_record`, called right after the loop's own sync every ``log_every`` steps,
gives the mean step time over that window (wall time since the previous record over the steps
taken: exact, since the loop waits for the last step's loss) and the analytic collective bytes of
the compiled step, for ``metrics.jsonl``. With a profiled window requested (``steps > 0``), every
step of the run is waited for, so that each step's own wall time is known (median and p90 per
``log_every`` window too) and the steps inside and outside the window are timed alike; the loop
then keeps at most one step in flight (its host work is no longer hidden behind the previous step).

**The profiled window** (``steps > 0``): ``steps`` steps from step ``start`` (at least two steps
after this process started, so compilation is never profiled; process 0 decides, every process
follows). In it, each step runs inside ``jax.profiler.StepTraceAnnotation("train", step_num=s)``
under ``jax.profiler.trace``; maintenance (table rebuilds, checksums, evaluations) gets its own
annotation and is waited for, so it is never mixed into a step; the interface's tx/rx counters are
sampled every 10 ms. At the end every process parses its trace and sends a small summary to
process 0 (``multihost_utils``, no shared file system needed), which aligns the ranks' clocks,
computes the breakdown (:mod:`sparsejax.netanalysis.breakdown`) and writes, atomically:

* ``workdir/netanalysis/rank{r}.json``: rank r's events, counters and per-step breakdown, plus the
  compiled step's collectives (each file is self-contained: ``netanalysis report`` re-reads them);
* ``workdir/netanalysis/profile.json``: the job's profile (``sparsejax.netanalysis.profile/1``);
* with ``keep_raw``: the profiler's own output under ``workdir/netanalysis/raw/rank{r}``.
"""

import contextlib
import glob
import gzip
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping

import numpy as np
from absl import logging

from sparsejax.netanalysis import breakdown, collectives, netif, profiles
from sparsejax.netanalysis.collectives import Collective, CompiledStep
from sparsejax.rates import parse_rate

RANK_SCHEMA = "sparsejax.netanalysis.rank/1"
WARMUP_STEPS = 2  # steps of a process that are never profiled (compilation, first runs)
STEP_ANNOTATION = "train"
MAINTENANCE_PREFIX = "maintenance:"


def broadcast_int(value: int) -> int:
  """Process 0's ``value`` on every process."""
  import jax
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def gather_json(obj) -> list | None:
  """Every process's JSON-able ``obj``, in rank order, on process 0 (None elsewhere).

  Uses ``multihost_utils.process_allgather`` of the encoded bytes (lengths first, then padded
  buffers), so it needs no shared file system.
  """
  import jax
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:data.size] = data
  everything = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
  if jax.process_index() != 0:
    return None
  return [json.loads(bytes(everything[r, :int(n)])) for r, n in enumerate(sizes)]


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


class StepProfiler:
  """Per-step timing of a training loop, and an optional profiled window (see the module docstring).

  Args:
    workdir: the run's directory (files go to ``workdir/netanalysis``).
    steps: steps in the profiled window; 0: no window.
    start: the first step (0-based count of steps taken before it) of the window.
    link_capacity: the link's rate (``"1gbit"``, bit/s as a number) for utilisations, or None.
    iface: the interface whose counters to sample, ``"auto"``: the one this process advertises.
    keep_raw: keep the profiler's raw output.
    job: ``sparse`` or ``dense`` (the profile's job).
    per_process_batch: examples per process per step, for the profile.
    scope_scaling: named scope -> ``replicated`` / ``sharded`` / ``batch`` (``model.STEP_SCOPES``).
  """

  def __init__(self, workdir: str, *, steps: int = 0, start: int = 20, link_capacity: str | float | None = None,
               iface: str = "auto", keep_raw: bool = False, job: str = "sparse", per_process_batch: int | None = None,
               scope_scaling: Mapping[str, str] | None = None):
    if steps < 0 or start < 0:
      raise ValueError(f"netanalysis_steps and netanalysis_start must be >= 0, got {steps} and {start}")
    self.workdir, self.steps, self.start = workdir, steps, start
    self.capacity_bps = parse_rate(link_capacity) if link_capacity not in (None, "") else None
    self.iface_name = netif.resolve_interface(iface) if steps else None
    self.keep_raw, self.job, self.per_process_batch = keep_raw, job, per_process_batch
    self.scope_scaling = dict(scope_scaling or {})
    self.compiled: CompiledStep | None = None
    self.window_start: int | None = None
    self._times: list[float] = []  # each step's wall time (only when every step is waited for)
    self._t0 = 0.0
    self._record_t0: float | None = None  # first step's start since the last log_record
    self._record_steps = 0
    self._active = False
    self._done = False
    self._annotation = None
    self._raw_dir = None
    self._sampler = None
    self._step = 0  # steps taken (maintenance rows are labelled with it)
    self._steps: list[tuple[int, float, float]] = []
    self._step_io: list[tuple[int, int]] = []
    self._maintenance: list[tuple[str, int, float, float]] = []
    self._wall0 = self._cpu0 = 0.0
    self._io0 = None

  @classmethod
  def from_config(cls, config, workdir: str, *, job: str, per_process_batch: int | None,
                  scope_scaling: Mapping[str, str] | None) -> "StepProfiler":
    """A profiler from the ``netanalysis`` section (:class:`sparsejax.config.NetanalysisConfig`)."""
    return cls(workdir, steps=config.netanalysis_steps, start=config.netanalysis_start,
               link_capacity=config.link_capacity, iface=config.netanalysis_iface,
               keep_raw=config.netanalysis_keep_raw, job=job, per_process_batch=per_process_batch,
               scope_scaling=scope_scaling)

  # --- Hooks ---------------------------------------------------------------------------------

  @property
  def in_window(self) -> bool:
    return self._active

  def begin_step(self, step: int, program: Callable[[], tuple]) -> None:
    """Before step ``step`` (steps taken so far) is dispatched.

    Args:
      step: steps taken before this one.
      program: returns ``(jitted, args, scopes)``, the step's jitted function, its arguments and named scopes
        (:attr:`sparsejax.distributed.sharding.Run.step_program`), compiled here once, before the first step
        (:func:`~sparsejax.netanalysis.collectives.compile_step`; JAX reuses that compilation for the step).
    """
    if self.compiled is None:
      jitted, args, scopes = program()
      self.compiled = collectives.compile_step(jitted, *args, known_scopes=scopes)
      if self.steps:
        self.window_start = broadcast_int(max(self.start, step + WARMUP_STEPS))
    if self.steps and not self._done and not self._active and step == self.window_start:
      self._start_window()
    if self._active:
      import jax
      self._io0 = netif.read_counters(self.iface_name) if self.iface_name else None
      self._annotation = jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=step)
      self._steps.append((step, time.time(), math.nan))
      self._annotation.__enter__()
    self._t0 = time.perf_counter()
    if self._record_t0 is None:
      self._record_t0 = self._t0

  def end_step(self, step: int, outputs) -> None:
    """After the step's dispatch; with a window requested, waits for ``outputs`` and records the step's time.

    Args:
      step: steps taken, this one included.
      outputs: the step's results (e.g. ``(state, metrics)``), waited for only if ``steps > 0``.
    """
    self._step = step
    self._record_steps += 1
    if not self.steps:
      return
    import jax
    jax.block_until_ready(outputs)
    self._times.append(time.perf_counter() - self._t0)
    if not self._active:
      return
    self._annotation.__exit__(None, None, None)
    self._annotation = None
    s, begin, _ = self._steps[-1]
    self._steps[-1] = (s, begin, time.time())
    if self._io0 is not None:
      tx, rx = netif.read_counters(self.iface_name)
      self._step_io.append((tx - self._io0[0], rx - self._io0[1]))
    if step >= self.window_start + self.steps:
      self._finish_window()

  def maintenance(self, label: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; inside the window, annotated, waited for and recorded as a ``label`` row."""
    if not self._active:
      return fn(*args, **kwargs)
    import jax
    begin = time.time()
    with jax.profiler.TraceAnnotation(MAINTENANCE_PREFIX + label):
      result = jax.block_until_ready(fn(*args, **kwargs))
    self._maintenance.append((label, self._step, begin, time.time()))
    return result

  def log_record(self) -> dict:
    """The always-on fields for ``metrics.jsonl``; call right after the loop waited for its last step.

    ``step_seconds_mean`` (wall time since the previous record's first step over the steps taken since),
    ``steps_timed``; with a window requested also ``step_seconds_median`` and ``step_seconds_p90`` of the
    single steps; with a described step ``collective_bytes_per_step`` and ``wire_bytes_per_step``
    (ring bytes one process sends). Empty if no step was taken since the last record.
    """
    times, self._times = self._times, []
    steps, t0 = self._record_steps, self._record_t0
    self._record_steps, self._record_t0 = 0, None
    if not steps or t0 is None:
      return {}
    record = {"step_seconds_mean": (time.perf_counter() - t0) / steps, "steps_timed": steps}
    if times:
      record.update(step_seconds_median=float(np.median(times)), step_seconds_p90=float(np.percentile(times, 90)))
    if self.compiled is not None:
      import jax
      record["collective_bytes_per_step"] = sum(c.operand_bytes for c in self.compiled.collectives)
      record["wire_bytes_per_step"] = sum(c.wire_bytes(jax.process_count()) for c in self.compiled.collectives)
    return record

  def finish(self) -> None:
    """After the loop, on every process: completes a window the loop ended early."""
    if self._active:
      self._finish_window()

  def close(self) -> None:
    """On any exit (also after an error): stops tracing and sampling; no collectives."""
    if self._active:
      import jax
      self._active = False
      if self._sampler is not None:
        self._sampler.stop()
      with contextlib.suppress(Exception):
        jax.profiler.stop_trace()
      self._cleanup_raw()

  # --- The window --------------------------------------------------------------------------------

  @property
  def directory(self) -> str:
    return os.path.join(self.workdir, "netanalysis")

  def _start_window(self):
    import jax
    rank = jax.process_index()
    if self.keep_raw:
      self._raw_dir = os.path.join(self.directory, "raw", f"rank{rank}")
      os.makedirs(self._raw_dir, exist_ok=True)
    else:
      self._raw_dir = tempfile.mkdtemp(prefix=f"sparsejax_netanalysis_rank{rank}_")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python function events would cost more than the steps' thunks
    options.host_tracer_level = 1
    logging.info("netanalysis: profiling steps %d-%d", self.window_start, self.window_start + self.steps - 1)
    jax.profiler.start_trace(self._raw_dir, profiler_options=options)
    self._sampler = netif.CounterSampler(self.iface_name).start() if self.iface_name else None
    self._wall0, self._cpu0 = time.time(), time.process_time()
    self._active = True

  def _cleanup_raw(self):
    if self._raw_dir and not self.keep_raw:
      shutil.rmtree(self._raw_dir, ignore_errors=True)

  def _finish_window(self):
    import jax
    self._active, self._done = False, True
    wall, cpu = time.time() - self._wall0, time.process_time() - self._cpu0
    counters = self._sampler.stop() if self._sampler is not None else []
    jax.profiler.stop_trace()
    rank = jax.process_index()
    try:
      window = window_from_trace(read_trace(self._raw_dir), rank, self._steps, self._maintenance)
      window.counters = [(t - window.origin, tx, rx) for t, tx, rx in counters]
      window.iface = self.iface_name
      window.step_io = self._step_io if self.iface_name else None
      window.cpu_seconds, window.wall_seconds = cpu, wall
      summary = window.to_json()
    except (OSError, ValueError, KeyError) as e:  # a broken trace must not stop the run
      summary = {"error": f"rank {rank}: {e}"}
    finally:
      self._cleanup_raw()
    gathered = gather_json(summary)
    if gathered is None:
      return
    errors = [g["error"] for g in gathered if "error" in g]
    if errors:
      logging.warning("netanalysis: no profile written: %s", "; ".join(errors))
      return
    windows = [breakdown.RankWindow.from_json(g) for g in gathered]
    run = self._run_info(jax.process_count())
    write_run(self.directory, windows, run)
    logging.info("netanalysis: wrote %s (report: python -m sparsejax.netanalysis report --run=%s)",
                 self.directory, self.workdir)

  def _run_info(self, processes: int) -> dict:
    c = self.compiled
    return {"job": self.job, "processes": processes, "per_process_batch": self.per_process_batch,
            "link_capacity_bps": self.capacity_bps, "module": c.module,
            "collectives": [x.to_json(processes) for x in c.collectives],
            "scope_scaling": self.scope_scaling, "scopes": dict(c.scopes)}


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
    profiles.write_json_atomic(os.path.join(directory, f"rank{window.rank}.json"), {
        "schema": RANK_SCHEMA, "rank": window.rank, "run": dict(run, scopes=scopes), "window": window.to_json(),
        "breakdown": rank_info})
  profiles.write_profile(os.path.join(directory, "profile.json"), run_profile(analysis, run, workdir))
  return analysis
