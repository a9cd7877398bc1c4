"""The what-if engine against hand-computed closed forms, an independent paper simulator and properties."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsejax.distributed.collectives import KINDS
from sparsejax.netanalysis import cost_tables, probe_results, profiles, report, whatif
from sparsejax.netanalysis.profiles import END, Chain, Collective, Profile, Segment

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "training_bottleneck")
ITERATION_SECONDS = {"resnet50": 0.1281, "resnet101": 0.192, "vgg16": 0.1945}  # the paper repository's
PAPER_WORKERS = (16, 64)
PAPER_BANDWIDTHS = (100e9, 40e9, 25e9, 10e9, 1e9)
PAPER_COMPRESSIONS = (1, 2, 5, 10, 100)


def _profile(segments, collectives, workers=1, name="p") -> Profile:
  chain = Chain(tuple(Segment(*s) if isinstance(s, tuple) else Segment(s) for s in segments), tuple(collectives))
  return Profile(name, "run", "", "dense", workers, None, chain.compute_seconds or 1.0, (chain,))


def _linear_table(intercept=2e-6, slope=1e-11):
  """gamma(s) = intercept + slope * s on [0, 1e9] (clamped beyond)."""
  return cost_tables.CostTable((0.0, 1e9), (intercept, intercept + slope * 1e9))


# ---------------------------------------------------------------------------------------------------
# Closed forms.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("workers", [2, 3, 16])
@pytest.mark.parametrize("compressible", [True, False])
def test_one_message_matches_closed_form(kind, workers, compressible):
  S, B, c, alpha = 12_345_678, 3.5e9, 7.0, 4.2e-5
  model = whatif.CostModel("test", alpha_s={kind: alpha}, reduce_cost=_linear_table())
  gamma = lambda s: 2e-6 + 1e-11 * s  # noqa: E731
  P, cc = workers, (c if compressible else 1.0)
  expected = {
      "all-reduce": 2 * (P - 1) * alpha + 2 * (P - 1) / P * S * 8 / (B * cc) + (P - 1) * gamma(S / P),
      "all-gather": (P - 1) * alpha + (P - 1) / P * S * 8 / (B * cc),
      "reduce-scatter": (P - 1) * alpha + (P - 1) / P * S * 8 / (B * cc) + (P - 1) * gamma(S / P),
      "all-to-all": (P - 1) * alpha + (P - 1) / P * S * 8 / (B * cc),
      "collective-permute": alpha + S * 8 / (B * cc),
  }[kind]
  profile = _profile([0.25], [Collective("x", kind, S, compressible, ready_after=0)])
  p = whatif.predict(profile, model, workers, B, c)
  assert p.comm_seconds == pytest.approx(expected, rel=1e-12)
  assert p.step_seconds == pytest.approx(0.25 + expected, rel=1e-12)
  assert p.exposed_comm_seconds == pytest.approx(expected, rel=1e-9)
  assert p.scaling_factor == pytest.approx(0.25 / (0.25 + expected), rel=1e-12)


def test_overlapped_collective_is_hidden_and_trailing_segment_counts():
  model = whatif.ideal_model()
  # 1 s backward, an all-reduce of 1 s at 8 Gbit/s x 2 (P=2: wire = S) ready after it, needed by a 0.5 s optimizer
  # segment; a second, small one ready at the start and needed at the end is fully hidden.
  profile = _profile([1.0, 0.5], [Collective("g", "all-reduce", 10**9, True, 0, needed_before=1),
                                  Collective("h", "all-reduce", 10**6, True, -1, END)])
  p = whatif.predict(profile, model, 2, 8e9)
  assert p.step_seconds == pytest.approx(1.0 + 1.0 + 0.5 + 0.0, rel=1e-12)
  assert p.exposed_comm_seconds == pytest.approx(1.0, rel=1e-9)
  assert p.bottleneck == "compute" and p.critical["bandwidth"] == pytest.approx(1.0)


def test_blocking_chain_sums_segments_and_collective_costs():
  model = whatif.CostModel("test", alpha_s={"all-reduce": 1e-4, "all-gather": 2e-4}, reduce_cost=_linear_table())
  segments = [0.010, 0.004, 0.002, 0.007]
  collectives = [Collective("a", "all-reduce", 4_000, False, 0, needed_before=1),
                 Collective("b", "all-gather", 80_000, False, 1, needed_before=2),
                 Collective("c", "all-reduce", 4_000, False, 2, needed_before=3)]
  P, B = 4, 1e9
  costs = [model.cost(c.kind, c.bytes, P, B).total for c in collectives]
  p = whatif.predict(_profile(segments, collectives), model, P, B, compression=10)
  assert p.step_seconds == pytest.approx(sum(segments) + sum(costs), rel=1e-12)
  assert p.comm_seconds == pytest.approx(sum(costs), rel=1e-12)
  sim = whatif.simulate(_profile(segments, collectives).steps[0],
                        lambda kind, nbytes, _: model.cost(kind, nbytes, P, B))
  assert [m.start for m in sim.messages] == pytest.approx([0.010, 0.010 + costs[0] + 0.004,
                                                           0.016 + costs[0] + costs[1]], rel=1e-12)
  assert sum(sim.critical.values()) == pytest.approx(sim.step_seconds, rel=1e-12)
  assert p.critical["latency"] == pytest.approx(2 * (2 * 3 * 1e-4) + 3 * 2e-4, rel=1e-12)  # 2 all-reduces, 1 gather


def test_channel_serves_collectives_one_at_a_time_in_ready_order():
  model = whatif.ideal_model()
  # Two 1 s all-reduces ready at 0.1 s and 0.2 s: the second waits for the first.
  profile = _profile([0.1, 0.1, 0.1], [Collective("a", "all-reduce", 10**9, True, 0),
                                       Collective("b", "all-reduce", 10**9, True, 1)])
  sim = whatif.simulate(profile.steps[0], lambda k, s, _: model.cost(k, s, 2, 8e9))
  assert [t for m in sim.messages for t in (m.start, m.finish)] == pytest.approx([0.1, 1.1, 1.1, 2.1])
  assert sim.step_seconds == pytest.approx(2.1)


# ---------------------------------------------------------------------------------------------------
# Fusion boundaries (5 ms, 64 MiB).


def _fused_members(waits, sizes, fusion=whatif.PAPER_FUSION):
  """Messages (as member lists) of a backward pass with one all-reduce per layer."""
  profile = _profile(waits, [Collective(f"l{i}", "all-reduce", s, True, i) for i, s in enumerate(sizes)])
  sim = whatif.simulate(profile.steps[0], lambda k, s, _: whatif.Cost(0.0, s * 1e-12, 0.0), fusion)
  return [list(m.members) for m in sim.messages]


def test_fusion_flushes_at_exactly_5ms():
  below = np.nextafter(0.005, 0.0)
  assert _fused_members([0.005, 0.001], [100, 100]) == [[0], [1]]
  assert _fused_members([below, 0.001], [100, 100]) == [[0, 1]]
  # accumulated over layers: 3 ms + 2 ms reaches 5 ms (3e-3 + 2e-3 == 5e-3 in binary64)
  assert 0.003 + 0.002 == 0.005
  assert _fused_members([0.003, 0.002, 0.001], [1, 1, 1]) == [[0, 1], [2]]
  assert _fused_members([0.003, np.nextafter(0.002, 0.0), 0.001], [1, 1, 1]) == [[0, 1, 2]]


def test_fusion_flushes_at_exactly_64_mib():
  mib64 = 64 * 1024 * 1024
  assert _fused_members([1e-4, 1e-4], [mib64, 10]) == [[0], [1]]
  assert _fused_members([1e-4, 1e-4], [mib64 - 1, 10]) == [[0, 1]]
  assert _fused_members([1e-4, 1e-4, 1e-4], [mib64 - 10, 10, 10]) == [[0, 1], [2]]


def test_fusion_only_merges_compressible_all_reduces_and_flushes_before_a_consumer():
  profile = _profile([1e-4, 1e-4, 1e-4], [Collective("a", "all-reduce", 10, True, 0, needed_before=1),
                                          Collective("b", "all-gather", 10, True, 0),
                                          Collective("c", "all-reduce", 10, False, 1),
                                          Collective("d", "all-reduce", 10, True, 1)])
  sim = whatif.simulate(profile.steps[0], lambda k, s, _: whatif.Cost(0.0, 1e-3, 0.0), whatif.PAPER_FUSION)
  assert [list(m.members) for m in sim.messages] == [[1], [0], [2], [3]]
  assert sim.messages[1].ready == pytest.approx(1e-4)  # flushed before segment 1, which needs it


# ---------------------------------------------------------------------------------------------------
# Independent reference of the paper's simulator (written from the description of netx-repo/
# training-bottleneck's simulation/, as a plain per-layer loop; shares no code with the engine).


def _reference_paper_sf(bk_path, cost_path, t_iter, n, bw, c):
  with open(bk_path) as f:
    lines = [line.strip() for line in f.read().strip().split("\n")]
  batch_n, layer_n = int(lines[1]), int(lines[2])
  rows = [line.split(",") for line in lines[3:3 + batch_n * layer_n]]
  with open(cost_path) as f:
    table = [tuple(float(x) for x in line.split(",")) for line in f.read().split() if line]
  xp, fp = [r[0] for r in table], [r[1] for r in table]
  overheads = []
  for b in range(batch_n):
    messages, now, acc_time, acc_buff = [], 0.0, 0.0, 0
    for wait_us, size in rows[b * layer_n:(b + 1) * layer_n]:
      now += float(wait_us) / 1e6
      acc_time += float(wait_us) / 1e6
      acc_buff += int(size)
      if acc_time >= 0.005 or acc_buff >= 64 * 1024 * 1024:
        messages.append((now, acc_buff))
        acc_time, acc_buff = 0.0, 0
    if acc_buff > 0:
      messages.append((now, acc_buff))
    done = 0.0
    for ready, size in messages:
      stage = (size * 8 * (n - 1) / n) / bw / c
      done = max(done, ready) + stage + (n - 1) * float(np.interp(size / n, xp, fp)) + stage
    overheads.append(max(0.0, done - now))
  return t_iter / (t_iter + sum(overheads) / len(overheads))


@pytest.fixture(scope="module")
def paper():
  table = cost_tables.read_cost_table(os.path.join(DATA, "cuda_vec_add.log"))
  bk = {name: profiles.read_bk_log(os.path.join(DATA, f"{name}.bk.log"), t) for name, t in ITERATION_SECONDS.items()}
  return whatif.paper_model(table), bk


def test_paper_mode_agrees_with_independent_reference_on_the_whole_grid(paper):
  model, bk = paper
  grid = whatif.grid(list(bk.values()), model, PAPER_WORKERS, PAPER_BANDWIDTHS, PAPER_COMPRESSIONS)
  assert len(grid) == 3 * 2 * 5 * 5
  for p in grid:
    expected = _reference_paper_sf(os.path.join(DATA, f"{p.profile}.bk.log"), os.path.join(DATA, "cuda_vec_add.log"),
                                   ITERATION_SECONDS[p.profile], p.workers, p.bandwidth_bps, p.compression)
    assert p.scaling_factor == pytest.approx(expected, abs=1e-9), p


def test_reference_handles_several_batches_like_the_engine(tmp_path, paper):
  model, _ = paper
  path = tmp_path / "two.bk.log"
  rows = ["700,4000", "3000,8192000", "2500,9437184", "900,70000000", "4000,4000", "10,65000000"]
  path.write_text("two batches\n2\n3\n" + "\n".join(rows) + "\n")
  profile = profiles.read_bk_log(str(path), 0.05)
  for n, bw, c in [(4, 1e9, 1), (16, 1e10, 3), (64, 25e9, 1)]:
    expected = _reference_paper_sf(str(path), os.path.join(DATA, "cuda_vec_add.log"), 0.05, n, bw, c)
    assert whatif.predict(profile, model, n, bw, c).scaling_factor == pytest.approx(expected, abs=1e-9)


def test_whatif_time_grows_linearly_with_the_layers_fusion_holds_back(tmp_path):
  # 10^5 layers of 0.1 us and 400 bytes: the paper's 5 ms window holds 50,000 gradients back at a time, and every
  # segment scanned them (minutes here); the subprocess' timeout ends that.
  layers, cost = 100_000, os.path.join(DATA, "cuda_vec_add.log")
  path = tmp_path / "deep.bk.log"
  path.write_text(f"deep\n1\n{layers}\n" + "0.1,400\n" * layers)
  result = subprocess.run([sys.executable, "-m", "sparsejax.netanalysis", "whatif", f"--profile={path}",
                           "--iteration_time_ms=20", "--model=paper", f"--reduce_cost={cost}", "--workers=8",
                           "--bandwidths=1gbit", f"--json={tmp_path}/w.json"], capture_output=True, text=True,
                          timeout=20)
  assert result.returncode == 0, result.stderr
  (prediction,) = report.read_whatif(f"{tmp_path}/w.json")["grid"]
  assert prediction["scaling_factor"] == pytest.approx(_reference_paper_sf(str(path), cost, 0.02, 8, 1e9, 1),
                                                       abs=1e-9)


def test_paper_reproduction(paper):
  model, bk = paper
  for name, profile in bk.items():
    for n in PAPER_WORKERS:
      assert whatif.predict(profile, model, n, 100e9).scaling_factor >= 0.95, (name, n)
  for name in ("resnet50", "resnet101"):
    for n in PAPER_WORKERS:
      assert whatif.predict(bk[name], model, n, 10e9).scaling_factor < 0.95, (name, n)
      needed = whatif.needed_compression(bk[name], model, n, 10e9, 0.95)
      assert needed.status == "needed" and 2 <= needed.compression <= 5, (name, n, needed)
  for n in PAPER_WORKERS:
    for bw in PAPER_BANDWIDTHS:
      vgg = whatif.needed_compression(bk["vgg16"], model, n, bw, 0.95).compression
      resnet = whatif.needed_compression(bk["resnet50"], model, n, bw, 0.95).compression
      assert vgg >= resnet, (n, bw)


def test_needed_compression_reaches_the_target_and_99_percent_of_it_does_not(paper):
  model, bk = paper
  for name, n, bw in [("resnet50", 16, 10e9), ("resnet101", 64, 25e9), ("vgg16", 64, 1e9), ("vgg16", 16, 40e9)]:
    needed = whatif.needed_compression(bk[name], model, n, bw, 0.95)
    assert needed.status == "needed"
    c = needed.compression
    assert whatif.predict(bk[name], model, n, bw, c).scaling_factor >= 0.95
    assert whatif.predict(bk[name], model, n, bw, 0.99 * c).scaling_factor < 0.95


def test_inversions_report_none_needed_and_unreachable_with_the_cause():
  profile = _profile([0.01], [Collective("g", "all-reduce", 10**8, True, 0)])
  assert whatif.needed_compression(profile, whatif.ideal_model(), 4, 1e15, 0.95).status == "none needed"
  slow = whatif.CostModel("test", alpha_s={"all-reduce": 1e-3})  # 6 ms of latency at P=4: SF <= 0.63
  needed = whatif.needed_compression(profile, slow, 4, 1e9, 0.95)
  assert needed.status == "unreachable" and needed.compression is None and needed.cause == "latency"
  assert needed.limit_scaling == pytest.approx(0.01 / (0.01 + 6e-3 + 8e8 * 1.5 / 1e9 / 1e4), rel=1e-9)
  costly = whatif.ideal_model(reduce_cost=cost_tables.CostTable((0.0, 1.0), (0.01, 0.01)))
  assert whatif.needed_compression(profile, costly, 4, 1e9, 0.95).cause == "reduction"
  assert whatif.needed_bandwidth(profile, slow, 4, 0.95).status == "unreachable"
  bw = whatif.needed_bandwidth(profile, whatif.ideal_model(), 4, 0.95)
  assert bw.status == "found"
  assert whatif.predict(profile, whatif.ideal_model(), 4, bw.bandwidth_bps).scaling_factor >= 0.95
  assert whatif.predict(profile, whatif.ideal_model(), 4, bw.bandwidth_bps / 1.02).scaling_factor < 0.95


def test_network_bound_rate_and_effective_compression():
  # exposed = 1.5 * 8e8 / B >= compute 0.01 s  <=>  B <= 1.2e11
  profile = _profile([0.01], [Collective("g", "all-reduce", 10**8, True, 0)])
  bound = whatif.network_bound_below(profile, whatif.ideal_model(), 4)
  assert bound.status == "found" and bound.bandwidth_bps == pytest.approx(1.2e11, rel=0.011)
  sparse = _profile([0.01], [Collective("s", "all-gather", 4 * 10**5, False, 0), Collective("t", "all-reduce", 10**5,
                                                                                            False, 0)])
  # P=4: dense 1.5e8 wire bytes; sparse 0.75 * 4e5 + 1.5 * 1e5 = 4.5e5
  assert whatif.effective_compression(sparse, profile, 4) == pytest.approx(1.5e8 / 4.5e5, rel=1e-12)


def test_a_profile_without_compressible_collectives_is_named_where_compression_is_asked_for(tmp_path):
  """A fresh-user review: --compression on a SLIDE profile changed nothing without saying so, and the compression
  plot came out with empty axes."""
  sparse = _profile([0.01], [Collective("s", "all-gather", 4 * 10**9, False, 0)], name="slide")
  dense = _profile([0.01], [Collective("g", "all-reduce", 10**8, True, 0)], name="dense")
  note = ("slide: no compressible collective (it exchanges activations and softmax sums, not gradients): "
          "compression changes nothing")
  result = whatif.analyse([sparse, dense], whatif.ideal_model(), [4], [1e9], [1.0, 100.0], 0.95)
  assert result.notes == [note]
  same = [p.scaling_factor for p in result.grid if p.profile == "slide"]
  assert len(same) == 2 and same[0] == same[1] < 0.95
  assert whatif.analyse([sparse, dense], whatif.ideal_model(), [4], [1e9]).notes == []  # not asked for
  pytest.importorskip("matplotlib")
  from sparsejax.netanalysis import report

  alone = whatif.analyse([sparse], whatif.ideal_model(), [4], [1e9], [1.0, 100.0], 0.95)
  assert [os.path.basename(p) for p in report.plot_whatif(alone, f"{tmp_path}/")] == ["whatif.png"]
  assert [os.path.basename(p) for p in report.plot_whatif(result, f"{tmp_path}/")] == ["whatif.png",
                                                                                        "compression.png"]


def test_other_worker_counts_scale_segments():
  profile = _profile([(0.02, "fwd", "batch"), (0.04, "shard", "sharded"), (0.01, "opt", "replicated")], [], workers=4)
  model = whatif.ideal_model()
  assert whatif.predict(profile, model, 8, 1e9, scaling="weak").compute_seconds == pytest.approx(0.02 + 0.02 + 0.01)
  assert whatif.predict(profile, model, 8, 1e9, scaling="strong").compute_seconds == pytest.approx(0.01 + 0.02 + 0.01)
  assert whatif.predict(profile, model, 2, 1e9, scaling="strong").compute_seconds == pytest.approx(0.04 + 0.08 + 0.01)


def test_measured_model_uses_probe_latency_bandwidth_and_reduction_cost():
  fit = lambda alpha, bw: probe_results.ProbeFit(alpha, bw, 0.999)  # noqa: E731
  table = cost_tables.CostTable((0.0, 1e6), (1e-6, 1e-3))
  probe = probe_results.Probe(4, "float32", 1e9, {"all-reduce": fit(5e-5, 8e8), "all-gather": fit(7e-5, 9e8)}, table)
  model, reference = whatif.measured_model(probe)
  assert reference == 1e9
  S, P = 10**6, 3
  expected = 2 * (P - 1) * 5e-5 + 2 * (P - 1) / P * S * 8 / 8e8 + (P - 1) * table(S / P)
  assert model.cost("all-reduce", S, P, 1e9).total == pytest.approx(expected, rel=1e-12)
  # predicting at 10x the nominal rate keeps the measured utilisation (80%)
  assert model.cost("all-reduce", S, P, 1e10).bandwidth == pytest.approx(2 * 2 / 3 * S * 8 / 8e9, rel=1e-12)
  # kinds the probe did not measure borrow a measured one
  assert model.cost("all-to-all", S, P, 1e9).latency == pytest.approx(2 * 7e-5)
  assert model.cost("reduce-scatter", S, P, 1e9).latency == pytest.approx(2 * 5e-5)
  no_capacity = probe_results.Probe(4, "float32", None, {"all-reduce": fit(5e-5, 8e8)})
  model, reference = whatif.measured_model(no_capacity, reduce_cost=table)
  assert reference == 8e8 and model.cost("all-reduce", S, P, 8e8).bandwidth == pytest.approx(4 / 3 * S * 8 / 8e8)
  assert model.reduce_cost is table


# ---------------------------------------------------------------------------------------------------
# Properties on random profiles.


@st.composite
def random_profiles(draw):
  n = draw(st.integers(1, 6))
  segments = [Segment(draw(st.floats(0.0, 0.02)), f"s{i}", draw(st.sampled_from(profiles.SCALES))) for i in range(n)]
  collectives = []
  for k in range(draw(st.integers(0, 6))):
    ready = draw(st.integers(-1, n - 1))
    needed = draw(st.one_of(st.just(END), st.integers(ready + 1, n))) if ready + 1 <= n else END
    collectives.append(Collective(f"c{k}", draw(st.sampled_from(KINDS)), draw(st.integers(0, 10**8)),
                                  draw(st.booleans()), ready, END if needed == n else needed))
  chain = Chain(tuple(segments), tuple(collectives))
  return Profile("random", "run", "", "dense", draw(st.integers(1, 8)), None, chain.compute_seconds or 1.0, (chain,))


@st.composite
def random_models(draw, concave_table=False):
  alpha = {k: draw(st.floats(0.0, 1e-4)) for k in KINDS}
  efficiency = {k: draw(st.floats(0.1, 1.0)) for k in KINDS}
  # A concave, non-decreasing reduction cost through gamma(0) >= 0: sampled a + b s^e, e <= 1.
  a, b, e = draw(st.floats(0.0, 1e-4)), draw(st.floats(0.0, 1e-9)), draw(st.floats(0.3, 1.0))
  sizes = (0.0, 1e3, 1e5, 1e7, 1e9)
  table = cost_tables.CostTable(sizes, tuple(a + b * s**e for s in sizes))
  fusion = draw(st.sampled_from([None, whatif.PAPER_FUSION, whatif.Fusion(seconds=0.001)]))
  return whatif.CostModel("random", alpha, efficiency, table, fusion)


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _not_above(a, b):
  return a <= b * (1 + 1e-12)


@PROPERTY_SETTINGS
@given(random_profiles(), random_models(), st.integers(2, 64), st.floats(1e6, 1e11), st.floats(1.0, 100.0),
       st.floats(1.0, 10.0), st.floats(1.0, 10.0))
def test_sf_never_decreases_with_bandwidth_or_compression(profile, model, workers, bw, c, more_bw, more_c):
  base = whatif.predict(profile, model, workers, bw, c).scaling_factor
  assert _not_above(base, whatif.predict(profile, model, workers, bw * more_bw, c).scaling_factor)
  assert _not_above(base, whatif.predict(profile, model, workers, bw, c * more_c).scaling_factor)


@PROPERTY_SETTINGS
@given(random_profiles(), random_models(), st.integers(2, 64), st.integers(1, 64), st.floats(1e6, 1e11))
def test_sf_never_increases_with_workers(profile, model, workers, more, bw):
  assert _not_above(whatif.predict(profile, model, workers + more, bw).scaling_factor,
                    whatif.predict(profile, model, workers, bw).scaling_factor)


def test_sf_can_increase_with_workers_for_a_step_shaped_reduction_cost():
  # Why the property above uses concave tables: (P-1) gamma(S/P) is not monotone in P for every
  # non-decreasing gamma. A cost that jumps between 10 and 11 bytes: P=2 adds 11-byte halves, P=3 ~7.3 bytes.
  step = cost_tables.CostTable((10.0, 11.0), (0.0, 1.0))
  profile = _profile([1.0], [Collective("g", "all-reduce", 22, True, 0)])
  model = whatif.ideal_model(reduce_cost=step)
  assert whatif.predict(profile, model, 3, 1e12).scaling_factor > whatif.predict(profile, model, 2, 1e12).scaling_factor


@settings(max_examples=40, deadline=None)
@given(random_profiles(), random_models(), st.integers(2, 64), st.floats(1e6, 1e11), st.floats(0.3, 0.99))
def test_needed_compression_is_tight_on_random_profiles(profile, model, workers, bw, target):
  needed = whatif.needed_compression(profile, model, workers, bw, target)
  sf = lambda c: whatif.predict(profile, model, workers, bw, c).scaling_factor  # noqa: E731
  if needed.status == "none needed":
    assert sf(1.0) >= target
  elif needed.status == "unreachable":
    assert sf(1e4) < target and needed.cause in whatif.TERMS[1:]
  else:
    assert sf(needed.compression) >= target > sf(0.99 * needed.compression)


@settings(max_examples=60, deadline=None)
@given(random_profiles(), random_models(), st.integers(2, 16), st.floats(1e6, 1e11))
def test_critical_path_adds_up_to_the_step(profile, model, workers, bw):
  p = whatif.predict(profile, model, workers, bw)
  assert math.fsum(p.critical.values()) == pytest.approx(p.step_seconds, rel=1e-9, abs=1e-15)
  assert p.step_seconds >= p.compute_seconds * (1 - 1e-12)
