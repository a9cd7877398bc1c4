"""netanalysis breakdown, report, timeline and export-bk on hand-built traces (exact, hand-computed values)."""

import json
import os
import random

import numpy as np
import pytest

from sparsejax.distributed.collectives import Collective
from sparsejax.netanalysis import breakdown, intervals, profiles, report_cli, timeline, window_files
from sparsejax.netanalysis.__main__ import main as cli

MS = 1e-3
OFFSET = 0.5  # rank 1's clock runs 0.5 s ahead of rank 0's
MODULE = "jit_step"
AR = Collective(name="ar", kind="all-reduce", dtypes=("f32", "f32", "f32"), shapes=((100, 2), (50,), ()),
                operand_bytes=1004, result_bytes=1004, group_size=2, scope="grad_reduce", op_name="x",
                producers=("g1", "g2", "loss"))


def _step_ops(t0: float, rank: int) -> list:
  """One step's thunks (ms from the step start) on rank 0 and rank 1 (see test_analyze_two_ranks)."""
  if rank == 0:
    ops = [("a", 0, 2), ("b", 1, 3), ("ar", 3, 7), ("c", 5, 6), ("d", 7, 9)]
  else:
    ops = [("f", 0, 5), ("ar", 5, 7), ("g", 7, 8)]
  shift = OFFSET if rank == 1 else 0.0
  return [(n, MODULE, t0 + a * MS + shift, t0 + b * MS + shift) for n, a, b in ops]


def _windows() -> list[breakdown.RankWindow]:
  windows = []
  for rank in (0, 1):
    shift = OFFSET if rank == 1 else 0.0
    length = 10 if rank == 0 else 10.5
    steps = [(s, 100 + 0.02 * i + shift, 100 + 0.02 * i + length * MS + shift) for i, s in enumerate((20, 21))]
    ops = [op for i in range(2) for op in _step_ops(100 + 0.02 * i, rank)]
    maintenance = []
    if rank == 0:  # a rebuild after step 21 (it ran XLA code) and an evaluation that did not
      ops.append(("rebuild", "jit_rebuild", 100.035, 100.037))
      maintenance = [("tables", 22, 100.034, 100.038), ("eval", 22, 100.039, 100.040)]
    windows.append(breakdown.RankWindow(rank=rank, steps=steps, ops=ops, maintenance=maintenance,
                                        step_io=[(1100, 1000), (1100, 1000)], counters=[(100 + shift, 0, 0),
                                        (100.01 + shift, 5000, 4000)], iface="lo", cpu_seconds=0.03, wall_seconds=0.06))
  return windows


SCOPES = {"a": "hidden_fwd", "b": "hidden_fwd", "c": "lsh_query", "d": "out_adam", "f": "hidden_fwd", "g": "out_adam",
          "ar": "grad_reduce"}
SCALING = {"hidden_fwd": "replicated", "lsh_query": "sharded", "out_adam": "sharded"}


def _analysis(capacity=1e7):
  return breakdown.analyze(_windows(), MODULE, [AR], processes=2, scopes=SCOPES, scope_scaling=SCALING,
                           capacity_bps=capacity)


def test_intervals_against_brute_force():
  rng = random.Random(0)
  for _ in range(200):
    x = intervals.union((a, a + rng.randint(1, 5)) for a in rng.sample(range(40), 6))
    y = intervals.union((a, a + rng.randint(1, 5)) for a in rng.sample(range(40), 6))
    grid = [t + 0.5 for t in range(50)]
    inside = lambda s, t: any(a <= t < b for a, b in s)
    assert intervals.length(intervals.intersect(x, y)) == sum(inside(x, t) and inside(y, t) for t in grid)
    assert intervals.length(intervals.subtract(x, y)) == sum(inside(x, t) and not inside(y, t) for t in grid)
    assert intervals.length(intervals.union(x + y)) == sum(inside(x, t) or inside(y, t) for t in grid)


def test_analyze_two_ranks():
  a = _analysis()
  # Clocks: rank 1 is found 0.5 s ahead, exactly (both ranks leave the all-reduce at 7 ms).
  assert a["alignment"]["offsets_seconds"] == [0.0, pytest.approx(OFFSET)]
  assert a["alignment"]["residual"]["max_seconds"] == pytest.approx(0, abs=1e-9)
  r0, r1 = a["ranks"]
  # Rank 0: compute [0,3] u [5,6] u [7,9] = 6; comm [3,7] = 4, overlap [5,6] = 1, exposed 3. The all-reduce
  # took 4 ms here and 2 ms on rank 1: transfer 2, so [3,5] waited (exposed 2) and [5,7] transferred
  # (exposed [6,7] = 1). Other: 10 - |[0,9]| = 1.
  expected0 = dict(step=10, compute=6, comm=4, overlap=1, exposed_comm=3, wait=2, transfer=1, other=1)
  expected1 = dict(step=10.5, compute=6, comm=2, overlap=0, exposed_comm=2, wait=0, transfer=2, other=2.5)
  for rank, expected in ((r0, expected0), (r1, expected1)):
    assert [s["step"] for s in rank["steps"]] == [20, 21]
    for s in rank["steps"]:
      for k, v in expected.items():
        assert s[f"{k}_seconds"] == pytest.approx(v * MS, abs=1e-9), (rank["rank"], k)
      assert s["compute_seconds"] + s["exposed_comm_seconds"] + s["other_seconds"] == pytest.approx(s["step_seconds"])
      assert (s["tx_bytes"], s["rx_bytes"]) == (1100, 1000)
  assert r0["cpu_busy"] == pytest.approx(0.5)
  # The job's step is the slowest rank's (rank 1).
  assert [s["rank"] for s in a["steps"]] == [1, 1]
  assert a["summary"]["step_seconds_median"] == a["summary"]["step_seconds_mean"] == pytest.approx(10.5 * MS)
  assert a["scaling_factor"] == pytest.approx((10.5 - 2) / 10.5)
  # Per collective: 1004 bytes, ring wire bytes 2 (P-1)/P S = 1004, transfer 2 ms, busbw 4.016 Mbit/s.
  (c,) = a["collectives"]
  assert (c["bytes"], c["wire_bytes"], c["calls_per_step"]) == (1004, 1004, 1)
  assert c["transfer_seconds_median"] == pytest.approx(2 * MS) and c["wait_seconds_median"] == pytest.approx(0)
  assert c["busbw_bps"] == pytest.approx(1004 * 8 / 0.002) and c["utilisation"] == pytest.approx(0.4016)
  u = a["utilisation"]
  assert u["during_comm"] == pytest.approx(0.4016)
  assert u["step_average_bps"] == pytest.approx(1004 * 8 / 0.0105)
  assert a["interface"]["tx_over_analytic"] == pytest.approx(1100 / 1004)
  assert a["missing_collective_events"] == 0
  assert [(m["label"], m["step"], m["modules"]) for m in a["maintenance"]] == [("tables", 22, ["jit_rebuild"])]


def test_chains_make_a_valid_profile():
  a = _analysis()
  chain = a["chains"][0]
  # Rank 1 (the slowest): [0,5] hidden_fwd, the all-reduce, then out_adam 1 ms and 2.5 ms of host time.
  assert [(s["scope"], s["scales"], round(s["seconds"] / MS, 6)) for s in chain["segments"]] == [
      ("hidden_fwd", "replicated", 5.0), ("out_adam", "sharded", 1.0), ("host", "replicated", 2.5)]
  (c,) = chain["collectives"]
  assert (c["ready_after"], c["needed_before"], c["compressible"], c["dtype"]) == (0, 1, True, "float32")
  assert c["transfer_seconds"] == pytest.approx(2 * MS)
  run = {"job": "dense", "processes": 2, "per_process_batch": 16}
  profile = window_files.run_profile(a, run, "/tmp/somerun")
  assert profile.workers == 2 and len(profile.steps) == 2 and profile.step_seconds == pytest.approx(10.5 * MS)
  assert profile.steps[0].compute_seconds == pytest.approx(8.5 * MS)


def test_chain_of_a_rank_that_waited_and_overlapped():
  windows = _windows()
  windows[0].steps = [(s, a, a + 12 * MS) for s, a, b in windows[0].steps]  # rank 0 is now the slowest
  a = breakdown.analyze(windows, MODULE, [AR], processes=2, scopes=SCOPES, scope_scaling=SCALING)
  chain = a["chains"][0]
  # [0,3] hidden_fwd; 2 ms waiting for rank 1; the all-reduce (ready there) overlaps lsh_query [5,6]; then
  # [7,12]: out_adam [7,9] and 3 ms of host time need its result.
  assert [(s["scope"], round(s["seconds"] / MS, 6)) for s in chain["segments"]] == [
      ("hidden_fwd", 3.0), ("waiting for peers", 2.0), ("lsh_query", 1.0), ("out_adam", 2.0), ("host", 3.0)]
  (c,) = chain["collectives"]
  assert (c["ready_after"], c["needed_before"]) == (1, 3)
  assert c["wait_seconds"] == pytest.approx(2 * MS) and c["transfer_seconds"] == pytest.approx(2 * MS)
  # Segments plus the transfer add up to the step, less the overlapped compute.
  total = sum(s["seconds"] for s in chain["segments"]) + c["transfer_seconds"] - 1 * MS
  assert total == pytest.approx(12 * MS)


def test_no_capacity_no_utilisation():
  a = _analysis(capacity=None)
  assert "utilisation" not in a["collectives"][0] and "during_comm" not in a["utilisation"]


@pytest.mark.parametrize("shares,start", [
    (dict(compute=0.8, exposed_comm=0.1, wait=0.05, transfer=0.05, other=0.1), "Compute-bound"),
    (dict(compute=0.1, exposed_comm=0.85, wait=0.05, transfer=0.8, other=0.05), "Network-bound"),
    (dict(compute=0.1, exposed_comm=0.85, wait=0.6, transfer=0.25, other=0.05),
     "Communication-bound, but mostly waiting"),
    (dict(compute=0.1, exposed_comm=0.2, wait=0.1, transfer=0.1, other=0.7), "Host-bound"),
])
def test_bottleneck_sentence(shares, start):
  summary = {"step_seconds_mean": 1.0, **{f"{k}_seconds_mean": v for k, v in shares.items()}}
  analysis = {"summary": summary, "utilisation": {"during_comm": 0.9}, "ranks": [{"cpu_busy": 1.0}]}
  assert breakdown.bottleneck(analysis).startswith(start)


def _run_info():
  return {"job": "dense", "processes": 2, "per_process_batch": 16, "link_capacity_bps": 1e7, "module": MODULE,
          "collectives": [AR.to_json(2)], "scope_scaling": SCALING,
          "scopes": {**SCOPES, "g1": "backward", "g2": "backward", "loss": "forward", "fwd": "forward",
                     "b0": "backward"}}


@pytest.fixture
def run_dir(tmp_path):
  window_files.write_run(str(tmp_path / "netanalysis"), _windows(), _run_info())
  return tmp_path


def test_written_run_reports(run_dir, capsys):
  assert sorted(os.listdir(run_dir / "netanalysis")) == ["profile.json", "rank0.json", "rank1.json"]
  profiles.read_profile(str(run_dir / "netanalysis" / "profile.json"))
  out_json, trace = run_dir / "report.json", run_dir / "timeline.json"
  one = run_dir / "one"  # a one-process baseline: rank 0's window alone
  window_files.write_run(str(one / "netanalysis"), _windows()[:1], {**_run_info(), "processes": 1})
  assert cli(["x", "report", f"--run={run_dir}", f"--json={out_json}", f"--trace={trace}", f"--png={run_dir}/",
              f"--baseline_run={one}"]) == 0
  text = capsys.readouterr().out
  assert "Step breakdown" in text and "Bottleneck:" in text and "grad_reduce" in text and "40.2%" in text
  assert "Measured scaling factor T_n / (n T_1) (T: throughput; here the one-process step over this one's) = 0.952" \
      in text
  doc = json.load(open(out_json))
  assert doc["schema"] == report_cli.REPORT_SCHEMA and doc["summary"]["step_seconds_median"] == pytest.approx(0.0105)
  assert doc["measured_scaling"] == pytest.approx(10 / 10.5)  # the baseline's step over this run's
  # A run of several processes is no baseline (a fresh-user review: the run itself was taken as its own).
  with pytest.raises(profiles.ProfileError, match=r"--baseline_run=.* ran 2 processes: give a one-process run"):
    report_cli.baseline_step(str(run_dir))
  assert (run_dir / "breakdown.png").stat().st_size > 1000
  # --link_capacity overrides the recorded capacity.
  assert cli(["x", "report", f"--run={run_dir}", "--link_capacity=100mbit"]) == 0
  assert "4.0%" in capsys.readouterr().out


def test_timeline_is_valid_chrome_trace(run_dir):
  windows, run, _ = report_cli.load_run(str(run_dir))
  analysis = window_files.analyze_run(windows, run)
  trace = json.loads(json.dumps(timeline.chrome_trace(windows, analysis, run)))
  events = trace["traceEvents"]
  assert all({"ph", "ts", "pid", "tid"} <= set(e) for e in events)
  assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
  names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
  assert {(0, "compute"), (0, "compute #2"), (0, "collectives"), (0, "host"), (1, "compute")} <= names
  # Ranks aligned: both leave the all-reduce of step 20 at 7 ms after rank 0's first step began.
  ends = [e["ts"] + e["dur"] for e in events if e["name"] == "ar" and e["args"]["step"] == 20]
  assert ends == pytest.approx([7000, 7000])
  ar = next(e for e in events if e["name"] == "ar")
  assert ar["args"]["busbw_bps"] == pytest.approx(1004 * 8 / 0.002)
  counters = [e for e in events if e["ph"] == "C"]
  assert counters and counters[0]["args"]["tx"] == pytest.approx(5000 * 8 / 0.01 / 1e6)


def test_export_bk(tmp_path, capsys):
  # Backward starts at 2 ms (b0); gradients g2 and g1 are ready at 4 and 6 ms; the loss is not a gradient.
  ops = [("fwd", MODULE, 0, 2), ("loss", MODULE, 1, 2), ("b0", MODULE, 2, 3), ("g2", MODULE, 3, 4),
         ("g1", MODULE, 4, 6), ("ar", MODULE, 6, 8)]
  windows = [breakdown.RankWindow(rank=r, steps=[(5, 0.0, 0.010)], ops=[(n, m, a * MS, b * MS) for n, m, a, b in ops])
             for r in (0, 1)]
  window_files.write_run(str(tmp_path / "netanalysis"), windows, _run_info())
  out = tmp_path / "dense.bk.log"
  assert cli(["x", "export-bk", f"--run={tmp_path}", f"--out={out}"]) == 0
  assert "--iteration_time_ms=6.000" in capsys.readouterr().out
  lines = out.read_text().splitlines()
  assert lines[1:] == ["1", "2", "2000.000,200", "2000.000,800"]
  profile = profiles.read_bk_log(str(out), iteration_seconds=0.006)
  assert profile.steps[0].collective_bytes == 1000


def _write(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  return path


@pytest.mark.parametrize("case,expected", [
    ("missing_dir", "{run}: no such directory"),
    ("empty_dir", "{run}/netanalysis/rank0.json: missing: the run was not profiled"),
    ("invalid_json", "{run}/netanalysis/rank0.json:1:2: invalid JSON"),
    ("wrong_schema", "{run}/netanalysis/rank0.json: $.schema: unsupported schema 'other/9'"),
    ("missing_key", "{run}/netanalysis/rank0.json: $.run: missing key 'module'"),
    ("missing_rank", "{run}/netanalysis: the run had 2 processes but rank files for [0] were found"),
    ("bad_capacity", "rate '10mbps'"),
    ("sparse_export", "the run has no gradient all-reduce"),
    # issue 35: a clock offset of -1.8e18 ms, a step of inf
    ("op_end_1e308", "{run}/netanalysis/rank1.json: $.window.ops[0][3]: 1e+308 must be a finite number in [-1e+06, "
                     "1e+06]"),
    ("negative_origin", "{run}/netanalysis/rank1.json: $.window.origin: -1.8e+15 must be a finite number in [0, "
                        "1e+12]"),
    ("step_ends_first", "{run}/netanalysis/rank0.json: $.window.steps[1][2]: 1 must be a finite number in "),
    ("negative_bytes", "{run}/netanalysis/rank0.json: $.window.step_io[0][1]: -1000 must be a finite number in [0, "),
])
def test_bad_input(run_dir, tmp_path, capsys, case, expected):
  run = run_dir
  args = ["report"]
  rank0 = run_dir / "netanalysis" / "rank0.json"
  doc = json.loads(rank0.read_text())
  if case == "missing_dir":
    run = tmp_path / "nope"
  elif case == "empty_dir":
    run = tmp_path / "empty"
    run.mkdir()
  elif case == "invalid_json":
    rank0.write_text("{oops")
  elif case == "wrong_schema":
    rank0.write_text(json.dumps(dict(doc, schema="other/9")))
  elif case == "missing_key":
    rank0.write_text(json.dumps(dict(doc, run={k: v for k, v in doc["run"].items() if k != "module"})))
  elif case == "missing_rank":
    (run_dir / "netanalysis" / "rank1.json").unlink()
  elif case == "bad_capacity":
    args.append("--link_capacity=10mbps")
  elif case in ("op_end_1e308", "negative_origin", "step_ends_first", "negative_bytes"):
    path = run_dir / "netanalysis" / ("rank1.json" if case in ("op_end_1e308", "negative_origin") else "rank0.json")
    d = json.loads(path.read_text())
    window = d["window"]
    if case == "op_end_1e308":
      window["ops"][0][3] = 1e308
    elif case == "negative_origin":
      window["origin"] = -1.8e15
    elif case == "step_ends_first":
      window["steps"][1][2] = 1.0
    else:
      window["step_io"][0][1] = -1000
    path.write_text(json.dumps(d))
  elif case == "sparse_export":
    args = ["export-bk"]
    for r in (0, 1):
      path = run_dir / "netanalysis" / f"rank{r}.json"
      d = json.loads(path.read_text())
      d["run"]["collectives"][0]["scope"] = "dh_reduce"
      path.write_text(json.dumps(d))
  assert cli(["x", *args, f"--run={run}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: " + expected.format(run=run)), err


def test_unexpected_arguments_and_missing_run(capsys):
  assert cli(["x", "report"]) == 2
  assert "--run" in capsys.readouterr().err
  assert cli(["x", "report", "--run=/x", "stray"]) == 2
  assert "unexpected arguments: stray" in capsys.readouterr().err


def test_window_from_trace_maps_the_clock():
  events = [{"ph": "X", "name": "train", "ts": 1000.0, "dur": 500.0, "args": {"step_num": "7"}},
            {"ph": "X", "name": "psum.1", "ts": 1100.0, "dur": 50.0, "args": {"hlo_op": "psum.1", "hlo_module": "m"}},
            {"ph": "X", "name": "late", "ts": 9000.0, "dur": 5.0, "args": {"hlo_op": "late", "hlo_module": "m"}}]
  w = window_files.window_from_trace(events, 0, [(7, 50.0, 50.0005)], [])
  assert w.origin == 50.0 and w.steps == [(7, 0.0, pytest.approx(0.0005))]
  assert w.ops == [("psum.1", "m", pytest.approx(1e-4, abs=1e-12), pytest.approx(1.5e-4, abs=1e-12))]  # "late" is out
  with pytest.raises(ValueError, match="no step annotations"):
    window_files.window_from_trace(events[1:], 0, [(7, 50.0, 50.0005)], [])


def test_step_breakdown_adds_up_on_random_steps():
  rng = np.random.default_rng(0)
  for _ in range(100):
    starts = rng.uniform(0, 10, 12)
    ops = [(a, a + rng.uniform(0.1, 2), bool(rng.random() < 0.3)) for a in starts]
    waits = [(a, b, rng.uniform(0, b - a)) for a, b, coll in ops if coll]
    b = breakdown.step_breakdown(ops, 0.0, 12.0, waits)
    assert b["compute"] + b["exposed_comm"] + b["other"] == pytest.approx(b["step"])
    assert b["wait"] + b["transfer"] == pytest.approx(b["exposed_comm"])
    assert min(b.values()) >= -1e-12
