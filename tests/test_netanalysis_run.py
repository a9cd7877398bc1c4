"""netanalysis in real multi-process jobs (launcher, loopback): a profiled training run and the probe."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sparsejax.netanalysis import breakdown, cost_tables, probe_results, profiles, report_cli, window_files
from sparsejax.netanalysis.__main__ import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
WINDOW = (6, 8)  # start, steps


def _launch(n: int, args: list[str], timeout: int = 400) -> str:
  out = subprocess.run([sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", str(n), *args],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  return out.stdout


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("profiled")
  _launch(2, [TRAIN, "--dataset=synthetic", "--synthetic_samples=1500", "--synthetic_features=400",
              "--synthetic_labels=300", "--hidden_dims=16", "--active_k=32", "--num_tables=4", "--batch_size=32",
              "--max_steps=16", "--eval_every=10", "--eval_samples=64", "--log_every=8", "--progress=false",
              "--checkpoint_every=1000", f"--netanalysis_start={WINDOW[0]}", f"--netanalysis_steps={WINDOW[1]}",
              "--link_capacity=1gbit", "--rebuild_period=9", "--candidates=lsh", "--validation_fraction=0",
              f"--workdir={workdir}"])
  return str(workdir)


def _covered(spans, start, end, grid=1e-7) -> float:
  """|union of spans within [start, end]| by counting grid points: an independent reference."""
  t = np.arange(start, end, grid) + grid / 2
  covered = np.zeros(len(t), bool)
  for a, b in spans:
    if b > start and a < end:
      covered[np.searchsorted(t, a):np.searchsorted(t, b)] = True
  return covered.sum() * grid


def test_profiled_run_breakdown(profiled_run):
  windows, run, _ = report_cli.load_run(profiled_run)
  assert run["processes"] == 2 and run["job"] == "sparse" and len(windows) == 2
  analysis = window_files.analyze_run(windows, run)
  windows = breakdown.common_clock(windows)
  names = {c["name"] for c in run["collectives"]}
  assert names and analysis["missing_collective_events"] == 0
  for w, rank in zip(windows, analysis["ranks"]):
    assert [s["step"] for s in rank["steps"]] == list(range(WINDOW[0], sum(WINDOW)))
    for s in rank["steps"]:
      step = s["step_seconds"]
      # compute + exposed comm + other = step within 2%, and compute + exposed comm is the time some
      # instruction ran, counted independently on a 0.1 us grid.
      assert abs(s["compute_seconds"] + s["exposed_comm_seconds"] + s["other_seconds"] - step) <= 0.02 * step
      busy = _covered([(a - rank["clock_offset_seconds"], b - rank["clock_offset_seconds"]) for _, _, a, b in w.ops],
                      s["start"], s["end"])
      assert abs(s["compute_seconds"] + s["exposed_comm_seconds"] - busy) <= 0.02 * step + 1e-5
      # Every collective of the compiled step ran in every profiled step on this rank.
      found = {n for n, m, a, b in w.ops if m == run["module"] and s["start"] + rank["clock_offset_seconds"] <= a
               <= s["end"] + rank["clock_offset_seconds"]}
      assert names <= found
  # Collectives end together once the clocks are aligned: within a few ms (1.85 ms measured once with the suite's
  # other worker busy on the second of 2 cores: the limit was 1 ms).
  assert analysis["alignment"]["residual"]["median_seconds"] <= 5e-3
  assert analysis["alignment"]["residual"]["instances"] == len(names) * WINDOW[1]
  # The maintenance in the window (a table rebuild after step 9, an evaluation after step 10) is reported
  # on its own and kept out of the steps.
  labels = {(m["label"], m["step"]) for m in analysis["maintenance"]}
  assert {("tables", 9), ("eval", 10)} <= labels
  profile = profiles.read_profile(os.path.join(profiled_run, "netanalysis", "profile.json"))
  assert profile.workers == 2 and profile.job == "sparse" and len(profile.steps) == WINDOW[1]
  assert {c.name for c in profile.steps[0].collectives} == names


def test_profiled_run_step_times_in_metrics(profiled_run):
  records = [json.loads(l) for l in open(os.path.join(profiled_run, "metrics.jsonl"))]
  timed = [r for r in records if "step_seconds_median" in r]
  assert [r["step"] for r in timed] == [8, 16]
  windows, run, _ = report_cli.load_run(profiled_run)
  assert timed[0]["collective_bytes_per_step"] == sum(c["operand_bytes"] for c in run["collectives"])
  assert timed[0]["wire_bytes_per_step"] == pytest.approx(sum(c["wire_bytes"] for c in run["collectives"]))


def test_profiled_run_report_and_timeline(profiled_run, capsys):
  trace = os.path.join(profiled_run, "timeline.json")
  assert cli(["x", "report", f"--run={profiled_run}", f"--trace={trace}", f"--json={profiled_run}/r.json"]) == 0
  text = capsys.readouterr().out
  assert "softmax_reduce" in text and "dh_reduce" in text and "Scaling factor" in text
  with open(trace) as f:
    events = json.load(f)["traceEvents"]
  assert events and all({"ph", "ts", "pid", "tid"} <= set(e) for e in events)
  assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
  assert {e["pid"] for e in events} == {0, 1}
  assert sum(e.get("cat") == "collective" for e in events) >= 2 * WINDOW[1]
  assert os.path.getsize(trace) < 20e6


def test_probe_two_processes(tmp_path):
  out = tmp_path / "probe.json"
  text = _launch(2, [sys.executable, "-P", "-m", "sparsejax.netanalysis", "probe", f"--out={out}",
                     "--max_bytes=262144", "--kinds=all-reduce,collective-permute", "--link_capacity=10gbit"])
  assert "busbw" in text and "fit         all-reduce" in text
  probe = probe_results.read_probe(str(out))
  assert probe.workers == 2 and probe.link_capacity_bps == 1e10 and set(probe.collectives) == {
      "all-reduce", "collective-permute"}
  ar = probe.collectives["all-reduce"]
  assert [r.bytes for r in ar.rows] == [4 * 2**i for i in range(17)]
  for r in ar.rows:
    assert r.seconds_p10 <= r.seconds_median <= r.seconds_p90
    assert r.busbw_bps == pytest.approx(r.algbw_bps)  # P = 2: 2 (P-1)/P = 1
  assert ar.bw_bps > 0 and ar.alpha_s >= 0 and ar.r2 is not None
  cost = cost_tables.read_cost_table(str(tmp_path / "probe.reduce_cost.log"))
  assert cost.sizes[0] == 4 and len(cost.sizes) >= 10


@pytest.mark.parametrize("flag,message", [
    ("--kinds=all-reduce,broadcast", "--kinds: 'broadcast' is not one of"),
    ("--max_bytes=2", "--max_bytes must be >= 4"),
    ("--iters=3", "--iters must be >= 5"),
    ("--max_call_seconds=0", "--max_call_seconds must be > 0"),
    ("--link_capacity=1gbps", "rate '1gbps'"),
])
def test_probe_bad_flags(flag, message, capsys):
  assert cli(["x", "probe", flag]) == 2
  assert capsys.readouterr().err.startswith("error: " + message)


def test_probe_needs_two_processes(capsys):
  assert cli(["x", "probe", "--max_bytes=64"]) == 2
  assert "probe needs at least 2 processes" in capsys.readouterr().err


def test_probe_fit_recovers_alpha_and_bandwidth():
  from sparsejax.netanalysis import probe
  P, alpha, bw = 4, 50e-6, 1e9
  rows = [probe.probe_row("all-reduce", P, s, [2 * (P - 1) * alpha + 1.5 * s * 8 / bw] * 5)
          for s in probe.sizes(2**22, P, "all-reduce")]
  f = probe.fit("all-reduce", P, rows)
  assert f.bw_bps == pytest.approx(bw, rel=1e-6) and f.alpha_s == pytest.approx(alpha, rel=1e-6)
  assert f.r2 == pytest.approx(1.0)
