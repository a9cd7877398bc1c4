"""benchmarks/cluster.py's pure parts (no root): the tbf bucket and issue 8's acceptance checks."""


import pytest


@pytest.fixture(scope="module")
def cluster(benchmark_module):
  return benchmark_module("cluster")


@pytest.mark.parametrize("rate,burst", [("1gbit", 250_000), ("100mbit", 25_000), ("10mbit", 4096), ("1mbit", 4096),
                                        ("16.384mbit", 4096), ("20mbit", 5000)])
def test_default_burst_is_2ms_of_the_rate_at_least_4kib(cluster, rate, burst):
  assert cluster.default_burst(rate) == burst


@pytest.mark.parametrize("rate,queue", [("1gbit", 12_500_000), ("100mbit", 1_250_000), ("10mbit", 1 << 20)])
def test_default_queue_is_100ms_of_the_rate_at_least_1mib(cluster, rate, queue):
  assert cluster.default_queue(rate) == queue


def _checks(cluster, *, bw=0.9e9, r2=0.995, probe_s=60.0, overhead=1.05, dense_exposed=0.9, sparse_transfer=0.05,
            tx=1.0, sparse_100_error=0.1, sparse_100_step=0.01, transfer_error=0.1):
  probes = {"1gbit": {"all-reduce": {"bw_over_rate": bw / 1e9, "r2": r2}, "seconds": probe_s}}

  def run(exposed=0.0, transfer=0.0, tx_over=None):
    summary = {"step_seconds_mean": 1.0, "exposed_comm_seconds_mean": exposed, "transfer_seconds_mean": transfer}
    return {"netanalysis": {"summary": summary, "profiling_overhead": overhead,
                            "interface": {"tx_over_analytic": tx_over} if tx_over else None}}

  runs = {("sparse", "1gbit", 4): run(transfer=sparse_transfer), ("dense", "100mbit", 4): run(dense_exposed, 0, tx)}
  table = [{"job": "sparse", "rate": "100mbit", "measured_step_seconds": sparse_100_step, "error": sparse_100_error},
           {"job": "dense", "rate": "10mbit", "measured_step_seconds": 60.0, "error": -0.05},
           {"job": "dense", "rate": "1gbit", "measured_step_seconds": 1.0}]  # the profiled rate: no prediction
  transfers = [{"workers": 2, "rate": "100mbit", "error": transfer_error}]
  return {c["check"]: c["passed"] for c in cluster.acceptance_checks(table, transfers, probes, runs)}


def test_acceptance_checks_pass_and_name_every_item(cluster):
  checks = _checks(cluster)
  assert all(checks.values()) and len(checks) == 10
  assert "dense 10mbit: |predicted / measured - 1|" in checks
  assert not any("dense 1gbit: |predicted" in c for c in checks)


@pytest.mark.parametrize("change,failing", [
    (dict(bw=0.79e9), "probe 1gbit: all-reduce bw / tbf rate"),
    (dict(bw=1.01e9), "probe 1gbit: all-reduce bw / tbf rate"),
    (dict(r2=0.98), "probe 1gbit: all-reduce fit R^2 (sizes >= 64 KiB)"),
    (dict(probe_s=91.0), "probe 1gbit: seconds"),
    (dict(overhead=0.89), "sparse 1gbit: |window median step / outside median - 1| (profiling overhead)"),
    (dict(dense_exposed=0.84), "dense 100mbit: exposed comm / step"),
    (dict(sparse_transfer=0.11), "sparse 1gbit: transfer / step"),
    (dict(tx=1.16), "dense 100mbit: measured tx / analytic ring wire bytes"),
    (dict(tx=0.94), "dense 100mbit: measured tx / analytic ring wire bytes"),
    # 15% or 3 ms, whichever is larger: 25% of a 10 ms step is 2.5 ms (passes); 40% is 4 ms (fails).
    (dict(sparse_100_error=0.4), "sparse 100mbit: |predicted / measured - 1| (bound: 15% or 3 ms)"),
    (dict(transfer_error=-0.21), "dense P=2 100mbit: |predicted / measured transfer - 1|"),
])
def test_acceptance_checks_fail_outside_each_bound(cluster, change, failing):
  checks = _checks(cluster, **change)
  assert [c for c, ok in checks.items() if not ok] == [failing]


def test_sparse_100mbit_bound_is_3ms_for_short_steps(cluster):
  assert _checks(cluster, sparse_100_error=0.25)["sparse 100mbit: |predicted / measured - 1| (bound: 15% or 3 ms)"]
  assert not _checks(cluster, sparse_100_error=0.25, sparse_100_step=0.1)[
      "sparse 100mbit: |predicted / measured - 1| (bound: 15% or 3 ms)"]
