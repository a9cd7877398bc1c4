"""``python -m sparsejax.netanalysis whatif``: predict steps at other link rates, worker counts and compression.

Examples::

  # The paper's analysis of its own profiles:
  python -m sparsejax.netanalysis whatif --model=paper --profile=resnet50.bk.log --iteration_time_ms=128.1 \\
      --reduce_cost=cuda_vec_add.log --workers=16,64 --bandwidths=100gbit,10gbit --compression=1,2,5 \\
      --target_scaling=0.95
  # A sparsejax run, with the latency and bandwidth measured by `netanalysis probe`:
  python -m sparsejax.netanalysis whatif --profile=runs/dist/netanalysis/profile.json --model=measured \\
      --probe=runs/probe.json --bandwidths=10mbit,100mbit,1gbit --workers=2,4,8 --json=runs/whatif.json
"""

import gc
import math
import os

from absl import flags

from sparsejax.netanalysis import cost_tables, file_io, probe_results, profiles, report, whatif
from sparsejax.netanalysis.flagdefs import define_flag
from sparsejax.rates import parse_rate

DEFAULT_BANDWIDTHS = "10mbit,100mbit,1gbit,10gbit,100gbit"
FLAGS = flags.FLAGS


def define_flags(command: str) -> None:
  """Define the flags of the ``whatif`` command."""
  del command
  define_flag("list", "profile", None, "Profiles to analyse: .bk.log or profile.json files (comma list).")
  define_flag("string", "iteration_time_ms", None,
              "One-worker iteration time of each .bk.log, milliseconds: MS for a single .bk.log, or "
              "name=MS,... (name: the file name without .bk.log, e.g. resnet50=128.1,vgg16=194.5).")
  define_flag("enum", "model", "ideal", ["paper", "ideal", "measured"],
              "paper: the paper's simulator (no latency, fusion every 5 ms / 64 MiB); ideal: the link fully "
              "used at its nominal rate; measured: latency, bandwidth and reduction cost from --probe.")
  define_flag("string", "reduce_cost", None,
              "bytes,seconds table of the local reduction cost (cuda_vec_add.log or the probe's); "
              "default: the probe's (measured model) or free.")
  define_flag("string", "probe", None, "Probe file (netanalysis probe --out) for --model=measured.")
  define_flag("list", "bandwidths", None,
              f"Link rates (tc units: bit, kbit, mbit, gbit, tbit). Default: {DEFAULT_BANDWIDTHS}, or the "
              "probed link for --model=measured.")
  define_flag("list", "workers", "2,4,8,16,32,64", "Numbers of processes P (each >= 2).")
  define_flag("list", "compression", "1", "Compression ratios c (each >= 1) of compressible (gradient) collectives.")
  define_flag("float", "target_scaling", None,
              "Target scaling factor in (0, 1]: also report the compression and the bandwidth needed.")
  define_flag("float", "fusion_ms", None, "Fuse ready gradients until this much compute time passed (paper: 5).")
  define_flag("float", "fusion_mb", None, "... or this many MiB are pending (paper: 64).")
  define_flag("enum", "scaling", "weak", ["weak", "strong"],
              "weak: per-process batch fixed (the paper); strong: global batch fixed (batch segments ~ 1/P).")
  define_flag("bool", "details", False, "Also print one row per prediction (step, compute, comm, exposed comm).")
  define_flag("string", "json", None, "Write the results as JSON (schema sparsejax.netanalysis.whatif/1) here.")
  define_flag("string", "png", None,
              "Write PREFIX-whatif.png and PREFIX-compression.png (PREFIX.png and PREFIX-compression.png where "
              "PREFIX ends in whatif or .png; a directory: DIR/whatif.png and DIR/compression.png).")


def _numbers(flag: str, values: list[str], cast, minimum: float, exclusive: bool = False) -> list:
  out = []
  for text in values:
    try:
      value = cast(text)
    except ValueError:
      raise ValueError(f"--{flag}: {text!r} is not a {'whole ' if cast is int else ''}number") from None
    if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
      raise ValueError(f"--{flag}: {text} must be {'>' if exclusive else '>='} {minimum:g}")
    out.append(value)
  if not out:
    raise ValueError(f"--{flag}: give at least one value")
  return out


def iteration_times(paths: list[str], text: str | None) -> dict[str, float]:
  """Map each profile path to its iteration time in seconds, from ``--iteration_time_ms``.

  Raises:
    ValueError: a malformed value, a name that matches no profile, or one bare value for several .bk.log.
  """
  if not text:
    return {}
  entries = [e.strip() for e in text.split(",") if e.strip()]
  stems = {path: profiles.profile_stem(path) for path in paths}
  times = {}
  for entry in entries:
    name, _, value = entry.rpartition("=")
    ms = _numbers("iteration_time_ms", [value], float, 0.0, exclusive=True)[0]
    if not name:
      if len(entries) > 1 or len(paths) > 1:
        raise ValueError(f"--iteration_time_ms: {entry!r} is one value for {len(paths)} profiles; give name=MS for "
              f"each .bk.log ({', '.join(stems.values())})")
      return {paths[0]: ms / 1e3}
    matches = [p for p, stem in stems.items() if name in (stem, p, os.path.basename(p))]
    if not matches:
      raise ValueError(f"--iteration_time_ms: {name!r} names no profile (profiles: {', '.join(stems.values())})")
    for path in matches:
      times[path] = ms / 1e3
  return times


def load_profiles(paths: list[str], times_ms: str | None) -> list[profiles.Profile]:
  """Read every ``--profile``; a .bk.log without an iteration time is an error naming the file."""
  times = iteration_times(paths, times_ms)
  return [profiles.read_any_profile(path, times.get(path)) for path in paths]


def _fusion() -> whatif.Fusion | None:
  if FLAGS.fusion_ms is None and FLAGS.fusion_mb is None:
    return whatif.PAPER_FUSION if FLAGS.model == "paper" else None
  for name in ("fusion_ms", "fusion_mb"):
    value = getattr(FLAGS, name)
    if value is not None and not value > 0:
      raise ValueError(f"--{name}: {value} must be > 0")
  return whatif.Fusion(seconds=FLAGS.fusion_ms / 1e3 if FLAGS.fusion_ms else math.inf,
                       bytes=FLAGS.fusion_mb * whatif.MIB if FLAGS.fusion_mb else math.inf)


def build_model() -> tuple[whatif.CostModel, list[float], list[str]]:
  """The cost model, the link rates to predict at and notes for the reader, from the flags."""
  notes = []
  table = cost_tables.read_cost_table(FLAGS.reduce_cost) if FLAGS.reduce_cost else None
  try:
    bandwidths = [parse_rate(b) for b in FLAGS.bandwidths] if FLAGS.bandwidths else None
  except ValueError as e:
    raise ValueError(f"--bandwidths: {e}") from None
  if FLAGS.model == "measured":
    if not FLAGS.probe:
      raise ValueError("--model=measured needs --probe=PATH (from `python -m sparsejax.netanalysis probe`)")
    probe = probe_results.read_probe(FLAGS.probe)
    model, reference = whatif.measured_model(probe, table, _fusion())
    if probe.link_capacity_bps is None and bandwidths:
      notes.append("the probe recorded no link capacity: the all-reduce is assumed to reach each nominal rate")
    return model, bandwidths or [reference], notes
  if FLAGS.probe:
    raise ValueError(f"--probe is only used by --model=measured (got --model={FLAGS.model})")
  if table is None:
    notes.append("no --reduce_cost: reductions are free")
  make = whatif.paper_model if FLAGS.model == "paper" else whatif.ideal_model
  return make(table, _fusion()), bandwidths or [parse_rate(b) for b in DEFAULT_BANDWIDTHS.split(",")], notes


def main(command: str, argv: list[str]) -> int:
  """Run ``whatif`` with the parsed flags; print the tables, write JSON/PNG. Returns the exit status."""
  del command
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.profile:
    raise ValueError("--profile is required: a .bk.log or profile.json file, or a comma list of them")
  workers = _numbers("workers", FLAGS.workers, int, 2)
  compressions = _numbers("compression", FLAGS.compression, float, 1.0)
  target = FLAGS.target_scaling
  if target is not None and not 0 < target <= 1:
    raise ValueError(f"--target_scaling: {target} must be in (0, 1]")
  if FLAGS.png:
    report.require_matplotlib()
  model, bandwidths, notes = build_model()
  # Reading and simulating allocate a few acyclic objects per layer and prediction, all freed by reference counting;
  # the cyclic collector traversed them and the profile again and again (half the time at 10^5 layers, growing
  # faster than the layers).
  collecting = gc.isenabled()
  gc.disable()
  try:
    profile_list = load_profiles(FLAGS.profile, FLAGS.iteration_time_ms)
    result = whatif.analyse(profile_list, model, workers, bandwidths, compressions, target, FLAGS.scaling, notes)
  finally:
    if collecting:
      gc.enable()
  print(report.format_whatif(result))
  if FLAGS.details:
    print("\n" + report.format_predictions(result))
  if FLAGS.json:
    file_io.write_json_atomic(FLAGS.json, report.whatif_json(result))
    print(f"wrote {FLAGS.json}")
  if FLAGS.png:
    for path in report.plot_whatif(result, FLAGS.png):
      print(f"wrote {path}")
  return 0
