"""``probe``: measure collective latency and bandwidth between the processes of a job.

  python -m sparsejax.distributed.launch -n 4 python -m sparsejax.netanalysis probe --out=runs/probe.json
  # multi-host: on each host, with the usual flags
  python -m sparsejax.netanalysis probe --coordinator_address=host0:1234 --num_processes=4 --process_id=$RANK ...

Jitted ``shard_map`` collectives over the same gloo path as training: an all-reduce (psum), an
all-gather and a ring collective-permute (ppermute), float32, message sizes from 4 bytes doubling
up to ``--max_bytes`` or until one call takes longer than ``--max_call_seconds``, 2 warm-up calls
and at least 5 timed calls per size (more while they are cheap), within ``--budget_seconds``
(shared equally by the kinds; a size whose calls would end past the deadline, judged by its
first call, is not timed).
A call's time is the slowest rank's (every rank times its own calls; they are gathered at the end).

Process 0 prints a table like the NCCL tests' (size, elements, time median / p10 / p90, algbw and
busbw in bit/s) and writes ``--out`` (``sparsejax.netanalysis.probe/1``) with, per kind, the least-
squares fit ``t = hops * alpha + wire_bytes * 8 / bw`` (``bw`` from sizes >= 64 KiB, with its R^2;
``alpha`` from the smallest sizes). It also times a local jitted add of two float32 buffers per
size and writes that reduction cost as ``bytes,seconds`` rows (the format of the paper's
``cuda_vec_add.log``) next to ``--out``.

Sizes: ``bytes`` is ``S`` of the cost model, what each process contributes, except for all-gather,
where it is the gathered total (P pieces of ``S / P``). ``algbw = S * 8 / t``; ``busbw = wire * 8 / t``
with the ring's wire bytes (all-reduce ``2 (P-1)/P S``, all-gather ``(P-1)/P S``, permute ``S``),
the NCCL tests' definition.
"""

import numpy as np
from absl import flags

from sparsejax.distributed.collectives import ring_wire_bytes
from sparsejax.netanalysis import probe_results
from sparsejax.netanalysis.flagdefs import define_flag
from sparsejax.rates import parse_rate

FLAGS = flags.FLAGS
KINDS = ("all-reduce", "all-gather", "collective-permute")
HOPS = {"all-reduce": lambda p: 2 * (p - 1), "all-gather": lambda p: p - 1, "collective-permute": lambda p: 1}
FIT_MIN_BYTES = 64 * 1024  # sizes used for the bandwidth fit
ALPHA_MAX_BYTES = 1024  # sizes used for the latency
ELEMENT_BYTES = 4  # float32


def define_flags(command: str) -> None:
  """Define the flags of ``probe`` (including the launcher's)."""
  del command
  define_flag("string", "out", None, "Write the probe (schema sparsejax.netanalysis.probe/1) here.")
  define_flag("integer", "max_bytes", 256 * 1024 * 1024, "Largest message S, bytes.")
  define_flag("float", "max_call_seconds", 2.0, "Stop growing a kind's messages once one call takes longer.")
  define_flag("integer", "iters", 5, "Timed calls per size (at least; more while a size costs < 0.2 s).")
  define_flag("integer", "warmup", 2, "Untimed calls per size.")
  define_flag("float", "budget_seconds", 60.0, "Time for the collectives, shared equally by the kinds: a kind stops "
              "growing its messages before a size whose calls would run past its share (plus what earlier kinds left).")
  define_flag("list", "kinds", ",".join(KINDS), "Collectives to probe.")
  define_flag("string", "link_capacity", None, "The link's nominal rate (tc units), recorded with the probe.")
  define_flag("string", "reduce_cost_out", None, "Where to write the bytes,seconds reduction cost (default: OUT's "
              "name with .reduce_cost.log).")
  define_flag("string", "coordinator_address", None, "host:port of process 0 (multi-process).")
  define_flag("integer", "num_processes", None, "Processes in the job.")
  define_flag("integer", "process_id", None, "This process's rank.")


def sizes(max_bytes: int, processes: int, kind: str) -> list[int]:
  """Message sizes ``S`` (bytes), doubling from the smallest float32 message of ``kind``."""
  step = ELEMENT_BYTES * (processes if kind == "all-gather" else 1)
  out, s = [], step
  while s <= max_bytes:
    out.append(s)
    s *= 2
  return out


def fit(kind: str, processes: int, rows: list[probe_results.ProbeRow]) -> probe_results.ProbeFit:
  """Least-squares ``t = hops * alpha + wire * 8 / bw`` of one kind's rows.

  ``bw`` is the slope of ``t`` against wire bytes over sizes >= 64 KiB (R^2 of that line); ``alpha``
  is the median over sizes <= 1 KiB (or the smallest size) of ``(t - wire * 8 / bw) / hops``, >= 0.
  With fewer than two large sizes, the largest two sizes give the slope (R^2 None).
  """
  wire = np.array([ring_wire_bytes(kind, r.bytes, processes) for r in rows])
  t = np.array([r.seconds_median for r in rows])
  big = wire >= ring_wire_bytes(kind, FIT_MIN_BYTES, processes)
  if big.sum() < 2:
    big = np.zeros(len(rows), bool)
    big[-2:] = True
  slope, intercept = np.polyfit(wire[big], t[big], 1)
  r2 = None
  if big.sum() >= 3:
    predicted = slope * wire[big] + intercept
    ss_tot = float(np.sum((t[big] - t[big].mean()) ** 2))
    r2 = 1.0 - float(np.sum((t[big] - predicted) ** 2)) / ss_tot if ss_tot > 0 else None
  slope = max(slope, 1e-30)
  bw = 8.0 / slope
  small = np.array([r.bytes <= ALPHA_MAX_BYTES for r in rows]) | (np.arange(len(rows)) == 0)
  alpha = max(0.0, float(np.median((t[small] - wire[small] * slope) / HOPS[kind](processes))))
  return probe_results.ProbeFit(alpha_s=alpha, bw_bps=bw, r2=r2, rows=tuple(rows))


def probe_row(kind: str, processes: int, nbytes: int, times: list[float]) -> probe_results.ProbeRow:
  """One table row from the call times (seconds) of one size."""
  t = np.asarray(times)
  median = float(np.median(t))
  return probe_results.ProbeRow(bytes=nbytes, elements=nbytes // ELEMENT_BYTES, seconds_median=median,
                           seconds_p10=float(np.percentile(t, 10)), seconds_p90=float(np.percentile(t, 90)),
                           algbw_bps=nbytes * 8 / median,
                           busbw_bps=ring_wire_bytes(kind, nbytes, processes) * 8 / median)


def format_table(probe: probe_results.Probe) -> str:
  """The NCCL-tests-style table of every row."""
  cap = f", link capacity {probe.link_capacity_bps:.4g} bit/s" if probe.link_capacity_bps else ""
  lines = [f"# sparsejax.netanalysis probe: {probe.workers} processes, {probe.dtype}{cap}",
           f"# {'size':>12} {'count':>11} {'type':>7} {'op':>18} {'time-med':>10} {'time-p10':>10} {'time-p90':>10} "
           f"{'algbw':>10} {'busbw':>10}",
           f"# {'(B)':>12} {'(elements)':>11} {'':>7} {'':>18} {'(us)':>10} {'(us)':>10} {'(us)':>10} "
           f"{'(bit/s)':>10} {'(bit/s)':>10}"]
  for kind, f in probe.collectives.items():
    for r in f.rows:
      lines.append(f"  {r.bytes:>12} {r.elements:>11} {'float':>7} {kind:>18} {r.seconds_median * 1e6:>10.1f} "
                   f"{r.seconds_p10 * 1e6:>10.1f} {r.seconds_p90 * 1e6:>10.1f} "
                   f"{r.algbw_bps:>10.4g} {r.busbw_bps:>10.4g}")
  lines.append("#")
  for kind, f in probe.collectives.items():
    r2 = "-" if f.r2 is None else f"{f.r2:.4f}"
    util = f" ({f.bw_bps / probe.link_capacity_bps:.1%} of the link)" if probe.link_capacity_bps else ""
    lines.append(f"# fit {kind:>18}: alpha {f.alpha_s * 1e6:.1f} us/hop, bw {f.bw_bps:.4g} bit/s{util}, R^2 {r2}")
  return "\n".join(lines)


def main(command: str, argv) -> int:
  """Run the probe on every process; process 0 prints the table and writes the files."""
  del command
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
  kinds = [k.strip() for k in FLAGS.kinds if k.strip()]
  for kind in kinds:
    if kind not in KINDS:
      raise ValueError(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
  if FLAGS.max_bytes < ELEMENT_BYTES:
    raise ValueError(f"--max_bytes must be >= {ELEMENT_BYTES}, got {FLAGS.max_bytes}")
  if not FLAGS.max_call_seconds > 0:
    raise ValueError(f"--max_call_seconds must be > 0, got {FLAGS.max_call_seconds}")
  if FLAGS.iters < 5:
    raise ValueError(f"--iters must be >= 5 (timed calls per size), got {FLAGS.iters}")
  if FLAGS.warmup < 0:
    raise ValueError(f"--warmup must be >= 0, got {FLAGS.warmup}")
  capacity = parse_rate(FLAGS.link_capacity) if FLAGS.link_capacity else None
  # deferred: JAX and the collectives load only for a probe, not for --help, a flag's error or the fits
  from sparsejax.netanalysis import probe_run

  return probe_run.run(kinds, capacity)
