"""``python -m sparsejax.netanalysis whatif``: flags, outputs (tables, JSON keys, PNGs) and its errors."""

import json
import os
import subprocess
import sys

import pytest

from sparsejax.netanalysis import cost_tables, probe_results, profiles, report
from sparsejax.netanalysis.__main__ import main as cli

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "training_bottleneck")
BK = {name: os.path.join(DATA, f"{name}.bk.log") for name in ("resnet50", "resnet101", "vgg16")}
COST = os.path.join(DATA, "cuda_vec_add.log")
PAPER_ARGS = ["--model=paper", f"--reduce_cost={COST}", "--workers=16,64", "--bandwidths=100gbit,10gbit",
              "--compression=1,2"]


def _run(capsys, *args):
  status = cli(["netanalysis", "whatif", *args])
  out, err = capsys.readouterr()
  return status, out, err


def test_help_lists_the_flags(capsys):
  status, out, _ = _run(capsys, "--help")
  assert status == 0
  for flag in ("--profile", "--iteration_time_ms", "--reduce_cost", "--probe", "--model", "--bandwidths", "--workers",
               "--compression", "--target_scaling", "--fusion_ms", "--fusion_mb", "--scaling", "--[no]details",
               "--json", "--png"):
    assert flag in out, flag


def test_module_entry_point_exits_2_without_traceback(tmp_path):
  result = subprocess.run([sys.executable, "-m", "sparsejax.netanalysis", "whatif", f"--profile={tmp_path}/x.bk.log",
                           "--iteration_time_ms=1"], capture_output=True, text=True, timeout=60)
  assert result.returncode == 2
  assert result.stderr.startswith(f"error: {tmp_path}/x.bk.log: cannot read") and "Traceback" not in result.stderr


def test_paper_run_writes_tables_json_and_pngs(capsys, tmp_path):
  profile_list = ",".join(BK.values())
  status, out, err = _run(capsys, f"--profile={profile_list}", "--iteration_time_ms=resnet50=128.1,resnet101=192,"
                          "vgg16=194.5", *PAPER_ARGS, "--target_scaling=0.95", f"--json={tmp_path}/w.json",
                          f"--png={tmp_path}/net")
  assert status == 0, err
  assert "== resnet101: scaling factor, bottleneck and step (ms) at compression 2x ==" in out
  assert "bandwidth (bit/s)" in out and "1e+11 (100gbit)" in out and "none needed" in out
  doc = report.read_whatif(f"{tmp_path}/w.json")
  assert doc["schema"] == "sparsejax.netanalysis.whatif/1" and doc["model"] == "paper"
  assert len(doc["grid"]) == 3 * 2 * 2 * 2
  assert {tuple(sorted(e)) for e in doc["grid"]} == {tuple(sorted([
      "profile", "workers", "bandwidth_bps", "compression", "scaling_factor", "step_seconds", "exposed_comm_seconds"]))}
  assert {tuple(sorted(e)) for e in doc["needed_compression"]} == {tuple(sorted(
      ["profile", "workers", "bandwidth_bps", "target_scaling", "compression"]))}
  resnet = {(e["workers"], e["bandwidth_bps"]): e["compression"] for e in doc["needed_compression"]
            if e["profile"] == "resnet50"}
  assert resnet[(16, 1e11)] == 1.0 and 2 <= resnet[(16, 1e10)] <= 5
  for name in ("whatif", "compression"):
    with open(f"{tmp_path}/net-{name}.png", "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_png_into_a_directory_and_without_matplotlib(capsys, tmp_path, monkeypatch):
  status, _, err = _run(capsys, f"--profile={BK['resnet50']}", "--iteration_time_ms=128.1", f"--png={tmp_path}/")
  assert status == 0, err
  assert os.path.exists(f"{tmp_path}/whatif.png") and not os.path.exists(f"{tmp_path}/compression.png")
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  status, _, err = _run(capsys, f"--profile={BK['resnet50']}", "--iteration_time_ms=128.1", f"--png={tmp_path}/")
  assert status == 2 and err == "error: PNG output needs matplotlib: pip install 'sparsejax[plot]' (or pip install " \
      "matplotlib)\n"


def test_png_named_after_the_plot_is_not_named_twice(capsys, tmp_path):
  """Issue 33: the README's --png=runs/whatif wrote runs/whatif-whatif.png."""
  pytest.importorskip("matplotlib")
  status, out, err = _run(capsys, f"--profile={BK['resnet50']}", "--iteration_time_ms=128.1", *PAPER_ARGS,
                          "--target_scaling=0.95", f"--png={tmp_path}/whatif")
  assert status == 0, err
  assert sorted(os.listdir(tmp_path)) == ["whatif-compression.png", "whatif.png"]
  assert f"wrote {tmp_path}/whatif.png" in out


@pytest.mark.parametrize("prefix, name, main, path", [
    ("runs/whatif", "whatif", True, "runs/whatif.png"),
    ("runs/whatif", "compression", False, "runs/whatif-compression.png"),
    ("runs/resnet-whatif", "whatif", True, "runs/resnet-whatif.png"),
    ("runs/net", "whatif", True, "runs/net-whatif.png"),  # a prefix, as before
    ("runs/net", "compression", False, "runs/net-compression.png"),
    ("runs/sf.png", "whatif", True, "runs/sf.png"),  # a file name: the main plot's
    ("runs/sf.png", "compression", False, "runs/sf-compression.png"),
    ("runs/breakdown", "breakdown", True, "runs/breakdown.png"),
])
def test_png_paths(tmp_path, monkeypatch, prefix, name, main, path):
  from sparsejax.netanalysis.report import png_path

  monkeypatch.chdir(tmp_path)
  assert png_path(prefix, name, main) == path
  assert png_path(f"{tmp_path}/runs/", name, main) == f"{tmp_path}/runs/{name}.png"


@pytest.mark.parametrize("times, message", [
    (None, "{resnet50}: a .bk.log profile needs its one-worker iteration time"),
    ("vgg16=194.5", "{resnet50}: a .bk.log profile needs its one-worker iteration time"),
    ("128.1", "--iteration_time_ms: '128.1' is one value for 2 profiles; give name=MS for each .bk.log"),
    ("resnet50=128.1,alexnet=1", "--iteration_time_ms: 'alexnet' names no profile"),
    ("resnet50=fast", "--iteration_time_ms: 'fast' is not a number"),
])
def test_iteration_times(capsys, times, message):
  args = [f"--profile={BK['resnet50']},{BK['vgg16']}"] + ([f"--iteration_time_ms={times}"] if times else [])
  status, _, err = _run(capsys, *args)
  assert status == 2 and err.startswith("error: " + message.format(**BK)), err


def test_measured_model_through_the_cli(capsys, tmp_path):
  profile = profiles.Profile("dense", "run", str(tmp_path), "dense", 4, 32, 0.2, (profiles.Chain(
      (profiles.Segment(0.1, "forward"), profiles.Segment(0.05, "backward"), profiles.Segment(0.01, "adam")),
      (profiles.Collective("all-reduce.1", "all-reduce", 10**7, True, 1, 2),)),))
  profiles.write_profile(f"{tmp_path}/profile.json", profile)
  status, _, err = _run(capsys, f"--profile={tmp_path}/profile.json", "--model=measured")
  assert status == 2 and err.startswith("error: --model=measured needs --probe=PATH")
  probe = probe_results.Probe(4, "float32", 1e8, {"all-reduce": probe_results.ProbeFit(1e-4, 9e7, 0.999)},
                              cost_tables.CostTable((0.0, 1e7), (0.0, 1e-3)))
  probe_results.write_probe(f"{tmp_path}/probe.json", probe)
  status, out, err = _run(capsys, f"--profile={tmp_path}/profile.json", "--model=measured",
                          f"--probe={tmp_path}/probe.json", "--workers=2,4", f"--json={tmp_path}/w.json",
                          "--target_scaling=0.9", "--details")
  assert status == 0, err
  assert "1e+08 (100mbit)" in out and "exposed ms" in out
  grid = {e["workers"]: e for e in json.load(open(f"{tmp_path}/w.json"))["grid"]}
  P, S = 2, 10**7
  comm = 2 * (P - 1) * 1e-4 + 2 * (P - 1) / P * S * 8 / 9e7 + (P - 1) * 1e-3 * (S / P) / 1e7
  assert grid[2]["bandwidth_bps"] == 1e8
  assert grid[2]["step_seconds"] == pytest.approx(0.16 + comm, rel=1e-12)
  assert grid[2]["exposed_comm_seconds"] == pytest.approx(comm, rel=1e-9)
  detail = {e["workers"]: e for e in json.load(open(f"{tmp_path}/w.json"))["predictions"]}
  assert detail[2]["comm_seconds"] == pytest.approx(comm, rel=1e-12) and detail[2]["bottleneck"] == "bandwidth"
  assert detail[2]["critical_path_seconds"]["latency"] == pytest.approx(2e-4, rel=1e-12)
  status, _, err = _run(capsys, f"--profile={tmp_path}/profile.json", f"--probe={tmp_path}/probe.json")
  assert status == 2 and err.startswith("error: --probe is only used by --model=measured")


def test_sparse_and_dense_profiles_get_the_effective_compression(capsys, tmp_path):
  def write(name, job, collectives):
    chain = profiles.Chain((profiles.Segment(0.05, "compute"), profiles.Segment(0.01, "update")), tuple(collectives))
    profiles.write_profile(f"{tmp_path}/{name}.json", profiles.Profile(name, "run", "", job, 4, 32, 0.06, (chain,)))

  write("dense", "dense", [profiles.Collective("g", "all-reduce", 4 * 10**8, True, 0, 1)])
  write("sparse", "sparse", [profiles.Collective("d", "all-reduce", 10**5, False, 0, 1)])
  status, out, err = _run(capsys, f"--profile={tmp_path}/dense.json,{tmp_path}/sparse.json", "--workers=4",
                          "--bandwidths=1gbit", "--target_scaling=0.9", f"--json={tmp_path}/w.json")
  assert status == 0, err
  assert "effective compression of the sparse job" in out and "4000x" in out
  doc = json.load(open(f"{tmp_path}/w.json"))
  assert doc["effective_compression"] == [{"sparse": "sparse", "dense": "dense", "workers": 4, "compression": 4000.0}]
  bound = {e["profile"]: e for e in doc["network_bound_below"]}
  # dense: exposed = 1.5 * 3.2e9 / B >= 0.06 s below B = 8e10; sparse: 1.5 * 8e5 / B >= 0.06 below 2e7
  assert bound["dense"]["bandwidth_bps"] == pytest.approx(8e10, rel=0.011)
  assert bound["sparse"]["bandwidth_bps"] == pytest.approx(2e7, rel=0.011)


@pytest.mark.parametrize("target, message", [
    ("dir", "is a directory (give a file name)"),
    ("file/w.json", "{tmp_path}/file is not a directory"),
])
def test_an_output_that_cannot_be_a_file_is_named_before_the_work(capsys, tmp_path, target, message):
  """Issue 35: --json on a directory (or under a file) ended in a traceback after the analysis, from the final
  rename; now one line, exit 2, before anything is computed, and no temporary file is left."""
  (tmp_path / "dir").mkdir()
  (tmp_path / "file").write_text("")
  path = tmp_path / target
  status, out, err = _run(capsys, f"--profile={BK['resnet50']}", "--iteration_time_ms=128", *PAPER_ARGS,
                          f"--json={path}")
  assert (status, out) == (2, "")
  assert err == f"error: --json={path}: {message.format(tmp_path=tmp_path)}\n"
  assert sorted(os.listdir(tmp_path)) == ["dir", "file"]


def test_a_failed_trace_write_leaves_no_temporary_file(tmp_path):
  """--trace's writer left its .NAME.tmp in the parent directory when the final rename failed."""
  from sparsejax.netanalysis import timeline

  (tmp_path / "trace.json").mkdir()
  with pytest.raises(OSError):
    timeline.write_chrome_trace(str(tmp_path / "trace.json"), {"traceEvents": []})
  assert os.listdir(tmp_path) == ["trace.json"]
