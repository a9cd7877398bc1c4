"""In-run measurement: a profiled window of training steps, the training loop's step observer.

The training loop (:class:`sparsejax.train.loop.Loop`) drives a :class:`StepProfiler` through the hooks of
:class:`sparsejax.train.step_observer.StepObserver`; ``sparsejax-train`` and :func:`sparsejax.fit` pass
:meth:`StepProfiler.from_config` to :func:`sparsejax.train.train_and_evaluate`, and a benchmark may drive one
itself::

  profiler = StepProfiler(workdir, steps=10, start=50, link_capacity="1gbit", ...)
  compiled = collectives.compile_step(jitted, state, batch, known_scopes=scopes)   # once
  while training:
    profiler.begin_step(step, compiled)
    state, metrics = train_step(state, batch)
    profiler.end_step(step + 1, (state, metrics))  # waits for the step (a window is requested)
    state = profiler.maintenance("tables", rebuild, state)   # timed as its own row in the window
    if step % log_every == 0: record.update(profiler.log_record())   # median and p90 step times
  profiler.finish()                               # every process; writes the files

The loop's always-on step fields (mean step time, collective bytes) are its own
(:class:`sparsejax.train.step_clock.StepMeans`). With a profiled window requested (``steps > 0``), every step of
the run is waited for, so that each step's own wall time is known (median and p90 per ``log_every`` window) and the
steps inside and outside the window are timed alike; the loop then keeps at most one step in flight (its host work
is no longer hidden behind the previous step).

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
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from sparsejax.distributed.collectives import CompiledStep
from sparsejax.netanalysis import breakdown, netif
from sparsejax.netanalysis.window_files import STEP_ANNOTATION, read_trace, window_from_trace, write_run
from sparsejax.rates import parse_rate

WARMUP_STEPS = 2  # steps of a process that are never profiled (compilation, first runs)
MAINTENANCE_PREFIX = "maintenance:"


def broadcast_int(value: int) -> int:
  """Process 0's ``value`` on every process."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def gather_json(obj) -> list | None:
  """Every process's JSON-able ``obj``, in rank order, on process 0 (None elsewhere).

  Uses ``multihost_utils.process_allgather`` of the encoded bytes (lengths first, then padded
  buffers), so it needs no shared file system.
  """
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32))).reshape(-1)
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:data.size] = data
  everything = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
  if jax.process_index() != 0:
    return None
  return [json.loads(bytes(everything[r, :int(n)])) for r, n in enumerate(sizes)]


class StepProfiler:
  """The profiled window of a training loop's steps, and their median and p90 times (see the module docstring).

  Args:
    workdir: the run's directory (files go to ``workdir/netanalysis``).
    steps: steps in the profiled window; 0: no window (the profiler then does nothing).
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

  def begin_step(self, step: int, compiled: CompiledStep) -> None:
    """Before step ``step`` (steps taken so far) is dispatched.

    Args:
      step: steps taken before this one.
      compiled: the step's compiled program (:func:`~sparsejax.distributed.collectives.compile_step`), whose
        collectives the window's files describe.
    """
    if self.compiled is None:
      self.compiled = compiled
      if self.steps:
        self.window_start = broadcast_int(max(self.start, step + WARMUP_STEPS))
    if self.steps and not self._done and not self._active and step == self.window_start:
      self._start_window()
    if self._active:
      self._io0 = netif.read_counters(self.iface_name) if self.iface_name else None
      self._annotation = jax.profiler.StepTraceAnnotation(STEP_ANNOTATION, step_num=step)
      self._steps.append((step, time.time(), math.nan))
      self._annotation.__enter__()
    self._t0 = time.perf_counter()

  def end_step(self, step: int, outputs) -> None:
    """After the step's dispatch; with a window requested, waits for ``outputs`` and records the step's time.

    Args:
      step: steps taken, this one included.
      outputs: the step's results (e.g. ``(state, metrics)``), waited for only if ``steps > 0``.
    """
    self._step = step
    if not self.steps:
      return
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
    begin = time.time()
    with jax.profiler.TraceAnnotation(MAINTENANCE_PREFIX + label):
      result = jax.block_until_ready(fn(*args, **kwargs))
    self._maintenance.append((label, self._step, begin, time.time()))
    return result

  def log_record(self) -> dict:
    """``step_seconds_median`` and ``step_seconds_p90`` of the single steps since the last record (a window
    requested; else empty); call right after the loop waited for its last step."""
    times, self._times = self._times, []
    if not times:
      return {}
    return {"step_seconds_median": float(np.median(times)), "step_seconds_p90": float(np.percentile(times, 90))}

  def finish(self) -> None:
    """After the loop, on every process: completes a window the loop ended early."""
    if self._active:
      self._finish_window()

  def close(self) -> None:
    """On any exit (also after an error): stops tracing and sampling; no collectives."""
    if self._active:
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
