"""The "Network analysis" tables of benchmarks/RESULTS.md (the first run's: benchmarks/results/HISTORY.md) from an
emulated-cluster validation (issue 8).

  sudo python benchmarks/cluster.py --validate_whatif --netanalysis_dir=/tmp/netval
  python benchmarks/netanalysis_cluster.py   # reads benchmarks/results/netanalysis_validation.json
  # one core per rank on 2 cores (P = 2):
  sudo python benchmarks/cluster.py --validate_whatif --processes 2 --netanalysis_dir=/tmp/netval_p2 \
      --json benchmarks/results/netanalysis_validation_p2.json
  python benchmarks/netanalysis_cluster.py --validation benchmarks/results/netanalysis_validation_p2.json \
      --prefix benchmarks/results/netanalysis_cluster_p2

Reads the validation JSON and the run directories it names (``--netanalysis_dir``), then

* what-if with ``--model=measured`` on the two 1 Gbit/s profiles and the 1 Gbit/s probe: the
  compression the dense job needs for SF 0.9 at 1 Gbit/s, next to the sparse job's effective
  compression ratio (dense over sparse wire bytes per step); JSON and PNGs;
* the dense-with-overlap what-if: ``netanalysis export-bk`` of the dense 1 Gbit/s run, replayed by the
  paper model (gradients fused every 5 ms / 64 MiB and all-reduced while backward runs), against the
  dense job as it is compiled (one all-reduce after the whole backward pass), both at full link rate;
* breakdown PNGs of both jobs at every rate;

and writes the Markdown tables to ``benchmarks/results/netanalysis_cluster.md`` (and stdout), with the
summary in ``benchmarks/results/netanalysis_cluster.json``.
"""

import argparse
import json
import os
import sys

import harness

BASE = "1gbit"
RATES = ("10mbit", "100mbit", "1gbit", "10gbit")


def _ms(x) -> str:
  return "-" if x is None else f"{x * 1e3:,.1f}"


def _pct(x) -> str:
  return "-" if x is None else f"{x:.1%}"


def _table(header, rows) -> list[str]:
  cells = lambda row: "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"  # noqa: E731
  return [cells(header), "|" + "---|" * len(header)] + [cells(r) for r in rows]


def _order(key: str) -> tuple:
  job, rate, p = key.split("/")
  from sparsejax.rates import parse_rate
  return (job != "sparse", -parse_rate(rate), -int(p[1:]))


def breakdown_rows(runs: dict) -> list[list[str]]:
  rows = []
  for key in sorted(runs, key=_order):
    run = runs[key]
    n = run.get("netanalysis")
    if not n:
      continue
    job, rate, p = key.split("/")
    s, u, i = n["summary"], n["utilisation"], n.get("interface") or {}
    step = s["step_seconds_mean"]
    busy = [r["cpu_busy"] for r in n["ranks"] if r["cpu_busy"] is not None]
    rows.append([job, rate, p[1:], _ms(run["step_s"]), _ms(step), _pct(s["compute_seconds_mean"] / step),
                 _pct(s["exposed_comm_seconds_mean"] / step), _pct(s["wait_seconds_mean"] / step),
                 _pct(s["transfer_seconds_mean"] / step), _pct(s["other_seconds_mean"] / step),
                 f"{n['scaling_factor']:.3f}", _pct(u.get("during_comm")), _pct(u.get("step_average")),
                 f"{u['wire_bytes_per_step']:,.0f}",
                 "-" if i.get("tx_over_analytic") is None else f"{i['tx_over_analytic']:.2f}",
                 "-" if not busy else f"{sum(busy) / len(busy):.2f}", f"{n['profiling_overhead'] - 1:+.1%}"])
  return rows


def whatif_workers(processes: int) -> list[int]:
  """The worker counts of the what-if tables: 2, the validation's P, 8 and 16, each once (P = 2 is one of them)."""
  return sorted({2, processes, 8, 16})


def acceptance_rows(checks: list[dict]) -> list[list[str]]:
  """The acceptance table's rows: a check not judged shows its reason where the value and verdict would be."""
  return [[c["check"], "-" if c["passed"] is None else f"{c['value']:.4g}", c["want"],
           f"NOT JUDGED: {c['not_judged']}" if c["passed"] is None else "PASS" if c["passed"] else "FAIL"]
          for c in checks]


def main() -> int:
  parser = harness.parser(__doc__)
  parser.add_argument("--validation", default=os.path.join(harness.RESULTS_DIR, "netanalysis_validation.json"))
  parser.add_argument("--prefix", default=os.path.join(harness.RESULTS_DIR, "netanalysis_cluster"),
                      help="output files: PREFIX.md, PREFIX.json, PREFIX-*.png, PREFIX-dense.bk.log")
  parser.add_argument("--target", type=float, default=0.9, help="target scaling factor of the compression question")
  parser.add_argument("--png", action=argparse.BooleanOptionalAction, default=True)
  args = parser.parse_args()

  from sparsejax.netanalysis import __main__ as cli
  from sparsejax.netanalysis import file_io, probe_results, profiles, report, report_cli, whatif
  from sparsejax.rates import parse_rate

  val = harness.local_paths(json.load(open(args.validation)))  # its run directories, as this machine names them
  runs, directory = val["runs"], val["directory"]
  P = val["args"]["processes"]
  probe_path = lambda rate: os.path.join(directory, rate, f"probe_{rate}_p{P}.json")  # noqa: E731
  profile_path = lambda job, rate: runs[f"{job}/{rate}/p{P}"]["netanalysis"]["profile"]  # noqa: E731
  out = {"validation": os.path.relpath(args.validation), "target_scaling": args.target}
  md = []

  # What-if at the measured link: the dense job's needed compression vs the sparse job's effective ratio.
  sparse, dense = (profiles.read_profile(profile_path(job, BASE)) for job in ("sparse", "dense"))
  model, _ = whatif.measured_model(probe_results.read_probe(probe_path(BASE)))
  bandwidths = [parse_rate(r) for r in RATES]
  workers = whatif_workers(P)
  analysis = whatif.analyse([sparse, dense], model, workers, bandwidths, [1, 2, 5, 10, 100], args.target)
  file_io.write_json_atomic(args.prefix + "-whatif.json", report.whatif_json(analysis))
  if args.png:
    report.plot_whatif(analysis, args.prefix)
  need = {(n.profile, n.workers, n.bandwidth_bps): n for n in analysis.needed_compression}
  effective = {e.workers: e.compression for e in analysis.effective_compression}
  compression_rows = []
  for w in workers:
    cells = []
    for b in bandwidths:
      n = need[(dense.name, w, b)]
      cells.append("none" if n.status == "none needed" else "unreachable" if n.compression is None
                   else f"{n.compression:,.1f}x")
    compression_rows.append([str(w)] + cells + [f"{effective[w]:,.0f}x"])
  headline = need[(dense.name, P, parse_rate(BASE))]
  out["dense_needed_compression_at_1gbit"] = headline.compression
  out["sparse_effective_compression"] = effective[P]
  sparse_need = need[(sparse.name, P, parse_rate(BASE))]
  out["sparse_needed_compression_at_1gbit"] = sparse_need.compression
  grid = {(p.profile, p.workers, p.bandwidth_bps, p.compression): p for p in analysis.grid}
  sf_rows = [[job, r] + [f"{grid[(prof.name, w, parse_rate(r), 1.0)].scaling_factor:.3f}" for w in workers]
             for job, prof in (("sparse", sparse), ("dense", dense)) for r in RATES]

  # Dense with overlap: the dense run's backward pass as a .bk.log, replayed by the paper model.
  bk = args.prefix + "-dense.bk.log"
  dense_dir = runs[f"dense/{BASE}/p{P}"]["workdir"]
  windows, run_info, _ = report_cli.load_run(dense_dir)
  _, iteration = report_cli.backward_rows(windows[0], run_info)
  if cli.main(["netanalysis", "export-bk", f"--run={dense_dir}", f"--out={bk}"]) != 0:
    raise SystemExit("export-bk failed")
  overlap = profiles.read_any_profile(bk, iteration)
  table = probe_results.read_probe(probe_path(BASE)).reduce_cost
  as_compiled_model, paper = whatif.ideal_model(table), whatif.paper_model(table)
  overlap_rows, out["dense_with_overlap"] = [], []
  for rate, b in zip(RATES, bandwidths):
    a = whatif.predict(dense, as_compiled_model, P, b)
    o = whatif.predict(overlap, paper, P, b)
    out["dense_with_overlap"].append({"bandwidth_bps": b, "as_compiled_step_seconds": a.step_seconds,
                                      "as_compiled_exposed_comm_seconds": a.exposed_comm_seconds,
                                      "as_compiled_scaling_factor": a.scaling_factor,
                                      "overlap_exposed_comm_seconds": o.exposed_comm_seconds,
                                      "overlap_scaling_factor": o.scaling_factor})
    overlap_rows.append([rate, _ms(a.step_seconds), _ms(a.exposed_comm_seconds), f"{a.scaling_factor:.3f}",
                         _ms(o.exposed_comm_seconds), f"{o.scaling_factor:.3f}"])
  out["dense_iteration_seconds"] = iteration
  out["dense_gradients"] = len(overlap.steps[0].collectives)

  if args.png:
    for key, run in runs.items():
      if run.get("netanalysis"):
        job, rate, p = key.split("/")
        a, *_ = report_cli.run_report(run["workdir"])
        report_cli.plot_breakdown(a, f"{args.prefix}-{job}-{rate}-{p}")

  load = (val.get("load_average_at_start"), val.get("load_average_at_end"))
  md += ["Breakdown of the profiled window (means over the window's steps, the slowest rank's step; "
         "`step` is the median step outside the window):", ""]
  md += _table(["job", "link", "P", "step ms", "window step ms", "compute", "exposed comm", "wait", "transfer", "other",
                "SF", "link use (comm)", "link use (step)", "wire B/step", "tx / analytic", "CPU busy",
                "window overhead"], breakdown_rows(runs))
  md += ["", f"Predictions (`--model=measured`, from the {BASE} profiles and the probe at each rate) against "
         "measurements; `ideal` = full link rate, no latency:", ""]
  rows = []
  for r in val["validation"]:
    rows.append([r["job"], r["rate"], str(r["workers"]), _ms(r["measured_step_seconds"]),
                 _ms(r.get("predicted_step_seconds")), _pct(r.get("error")) if "error" in r else "-",
                 _ms(r["ideal_step_seconds"]), f"{r['measured_over_ideal']:.2f}"])
  md += _table(["job", "link", "P", "measured ms", "predicted ms", "error", "ideal ms", "measured / ideal"], rows)
  md += ["", f"Gradient all-reduce transfer at other P, predicted from the P = {P} probe:", ""]
  md += _table(["P", "link", "bytes", "predicted ms", "measured ms", "error"],
               [[str(t["workers"]), t["rate"], f"{t['bytes']:,}", _ms(t["predicted_transfer_seconds"]),
                 _ms(t["measured_transfer_seconds"]), _pct(t["error"])] for t in val["transfer"]])
  md += ["", "Probe fits (`t = hops * alpha + wire_bytes * 8 / bw`, sizes >= 64 KiB for bw):", ""]
  rows = []
  for rate, fits in val["probes"].items():
    for kind, f in fits.items():
      if kind != "seconds":
        rows.append([rate, kind, f"{f['alpha_s'] * 1e6:,.0f}", f"{f['bw_bps']:.3g}", _pct(f["bw_over_rate"]),
                     "-" if f["r2"] is None else f"{f['r2']:.4f}", f"{fits['seconds']:.0f}"])
  md += _table(["link", "kind", "alpha us/hop", "bw bit/s", "bw / tbf rate", "R^2", "probe s"], rows)
  md += ["", f"Dense job: compression needed for SF {args.target} (`--model=measured`, the {BASE} profile and "
         "probe), and the sparse job's effective compression ratio (dense / sparse wire bytes per step):", ""]
  md += _table(["P"] + list(RATES) + ["sparse job's effective ratio"], compression_rows)
  md += ["", f"Scaling factor at c = 1 (`--model=measured`, {BASE} profiles):", ""]
  md += _table(["job", "link"] + [f"P = {w}" for w in workers], sf_rows)
  md += ["", f"Dense with overlap (P = {P}, full link rate, reduction cost from the probe): the dense "
         f"{BASE} run exported with `export-bk` ({out['dense_gradients']} gradients, forward + backward "
         f"{iteration * 1e3:,.0f} ms) and replayed by the paper model, against the dense job as compiled:", ""]
  md += _table(["link", "as compiled: step ms", "exposed comm ms", "SF", "overlap + fusion: exposed comm ms", "SF"],
               overlap_rows)
  md += ["", "Acceptance checks of the validation:", ""]
  md += _table(["check", "value", "want", ""], acceptance_rows(val["acceptance"]))
  judged = [c for c in val["acceptance"] if c["passed"] is not None]
  md += ["", f"{len(val['acceptance'])} checks: {len(judged)} judged ({sum(c['passed'] for c in judged)} passed), "
         f"{len(val['acceptance']) - len(judged)} not judged."]
  md += ["", f"Load average (1, 5, 15 min) at start {load[0]}, at end {load[1]}."]
  text = "\n".join(md) + "\n"
  with open(args.prefix + ".md", "w") as f:
    f.write(text)
  file_io.write_json_atomic(args.prefix + ".json", out)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
