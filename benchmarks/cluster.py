"""Distributed SLIDE vs dense data-parallel training on an emulated low-bandwidth cluster.

Makes P network namespaces on this machine, each with its own address on a
bridge, limits every host's link with `tc tbf` (e.g. 1 Gbit/s; `netem` delay
is not available on these kernels), and runs in them, as P jax.distributed
processes over gloo:

* the sparse job: the N-wide output layer split over the P processes
  (sparsejax.distributed), LSH-sampled active sets;
* the dense data-parallel baseline: every process holds the whole model and
  all-reduces all gradients every step (what Horovod does).

Both use the same network, synthetic data and batch. Reported per job: step
time (median), samples/s, and bytes each host sent per step, measured on its
interface. Needs root (ip netns, tc); otherwise it says so and exits 0.
Namespaces are removed even when a run fails.

  sudo python benchmarks/cluster.py --processes 4 --labels 1000000 --rates 1gbit,100mbit --json out.json

With --local the processes run on the host's loopback instead (no root, no
rate limit); with --memory it also reports each process's peak RSS:

  python benchmarks/cluster.py --local --labels 8000000 --steps 100 --skip_dense --memory
"""

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

NS_PREFIX = "sjns"
BRIDGE = "sjbr0"
SUBNET = "10.77.0"


# --- Worker (one rank) ---------------------------------------------------------

def _iface_tx_bytes() -> int:
  total = 0
  for iface in os.listdir("/sys/class/net"):
    if iface != "lo" or len(os.listdir("/sys/class/net")) == 1:
      with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        total += int(f.read())
  return total


def _peak_rss_bytes() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return 0


def worker(args) -> None:
  """One rank: build the job's model, time `steps` steps, write a JSON line."""
  from sparsejax import distributed
  distributed.initialize(args.coordinator, args.processes, args.rank, heartbeat_timeout_seconds=60,
                         initialization_timeout=300)
  import jax
  import numpy as np

  from sparsejax import dense, model
  from sparsejax.config import override

  P = jax.process_count()
  mesh = distributed.make_mesh()
  cfg = override(model.ModelConfig(args.features, args.labels), hidden_dims=(args.hidden,),
                          active_k=args.active_k, num_shards=P if args.job == "sparse" else 1)
  rng = np.random.default_rng(0)  # the same batches on every rank
  batches = [{"feat_ids": rng.integers(0, args.features, (args.batch, 32)).astype(np.int32),
              "feat_vals": rng.random((args.batch, 32), np.float32),
              "labels": rng.integers(0, args.labels, (args.batch, 1)).astype(np.int32)} for _ in range(4)]
  t0 = time.time()
  if args.job == "sparse":
    state = distributed.init(jax.random.key(0), cfg, mesh)
    step = distributed.make_train_step(cfg, mesh)
    put = lambda b: distributed.to_global(b, mesh)
  else:
    replicated = jax.sharding.NamedSharding(mesh, distributed.P())
    state = jax.jit(lambda: dense.init(jax.random.key(0), cfg), out_shardings=replicated)()
    step = distributed.make_dp_train_step(cfg, mesh)
    put = lambda b: distributed.to_global(b, mesh, distributed.P(distributed.AXIS))
  jax.block_until_ready(state)
  init_s = time.time() - t0
  global_batches = [put(b) for b in batches]
  analytic = distributed.collective_bytes(step, state, global_batches[0])
  for i in range(args.warmup):
    state, m = step(state, global_batches[i % 4])
  jax.block_until_ready(state)
  times, tx = [], []
  for i in range(args.steps):
    tx0, t = _iface_tx_bytes(), time.perf_counter()
    state, m = step(state, global_batches[i % 4])
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t)
    tx.append(_iface_tx_bytes() - tx0)
  loss = float(np.asarray(m["loss"].addressable_data(0)))
  result = dict(rank=args.rank, job=args.job, processes=P, init_s=init_s, step_s=float(np.median(times)),
                step_s_all=times, tx_bytes_per_step=float(np.median(tx)), collective_payload_bytes=analytic,
                loss=loss, peak_rss_bytes=_peak_rss_bytes(), num_params=model.num_params(state))
  with open(os.path.join(args.out, f"{args.job}_rank{args.rank}.json"), "w") as f:
    json.dump(result, f)


# --- Orchestration -----------------------------------------------------------------

def _sh(*cmd, check=True):
  return subprocess.run(cmd, check=check, capture_output=True, text=True)


def setup_namespaces(n: int, rate: str | None) -> list[str]:
  """P namespaces on a bridge, each link rate-limited; returns their addresses."""
  hostname = socket.gethostname()
  _sh("ip", "link", "add", BRIDGE, "type", "bridge")
  _sh("ip", "link", "set", BRIDGE, "up")
  addrs = []
  for i in range(n):
    ns, addr = f"{NS_PREFIX}{i}", f"{SUBNET}.{i + 1}"
    _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", f"sjv{i}", "type", "veth", "peer", "name", f"sjp{i}")
    _sh("ip", "link", "set", f"sjv{i}", "netns", ns)
    _sh("ip", "link", "set", f"sjp{i}", "master", BRIDGE)
    _sh("ip", "link", "set", f"sjp{i}", "up")
    _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", f"sjv{i}")
    _sh("ip", "netns", "exec", ns, "ip", "link", "set", f"sjv{i}", "up")
    _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    if rate:
      _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"sjv{i}", "root", "tbf", "rate", rate,
          "burst", "1mb", "latency", "100ms")
    # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: gloo, which
    # advertises the address its hostname resolves to, then advertises this one.
    os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
    with open(f"/etc/netns/{ns}/hosts", "w") as f:
      f.write(f"127.0.0.1 localhost\n{addr} {hostname}\n")
    addrs.append(addr)
  return addrs


def teardown_namespaces(n: int) -> None:
  for i in range(n):
    _sh("ip", "netns", "del", f"{NS_PREFIX}{i}", check=False)
    _sh("ip", "link", "del", f"sjp{i}", check=False)
    shutil.rmtree(f"/etc/netns/{NS_PREFIX}{i}", ignore_errors=True)
  _sh("ip", "link", "del", BRIDGE, check=False)


def can_use_namespaces() -> str | None:
  """None if namespaces can be made here, else why not."""
  if not sys.platform.startswith("linux"):
    return "network namespaces need Linux"
  if os.geteuid() != 0:
    return "needs root (ip netns, tc)"
  if shutil.which("ip") is None or shutil.which("tc") is None:
    return "needs iproute2 (ip, tc)"
  probe = _sh("ip", "netns", "add", f"{NS_PREFIX}probe", check=False)
  if probe.returncode != 0:
    return f"ip netns add failed: {probe.stderr.strip()}"
  _sh("ip", "netns", "del", f"{NS_PREFIX}probe", check=False)
  return None


def run_job(job: str, args, addrs: list[str] | None, out: str, timeout: float) -> list[dict]:
  """Runs one job's P ranks (in namespaces if addrs) and collects their results."""
  port = 29400 + (os.getpid() % 500)
  coord = f"{addrs[0] if addrs else '127.0.0.1'}:{port}"
  procs = []
  for rank in range(args.processes):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--job={job}", f"--rank={rank}",
           f"--coordinator={coord}", f"--processes={args.processes}", f"--labels={args.labels}",
           f"--features={args.features}", f"--hidden={args.hidden}", f"--active_k={args.active_k}",
           f"--batch={args.batch}", f"--steps={args.steps if job == 'sparse' else args.dense_steps}",
           f"--warmup={args.warmup}", f"--out={out}"]
    if args.pin and shutil.which("taskset"):
      # Each emulated host gets its own share of the cores (with more ranks
      # than cores, ranks share one): no process runs threads on every core.
      cmd = ["taskset", "-c", _cores_of(rank, args.processes)] + cmd
    if addrs:
      cmd = ["ip", "netns", "exec", f"{NS_PREFIX}{rank}"] + cmd
    log = open(os.path.join(out, f"{job}_rank{rank}.log"), "w")
    procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
  deadline = time.time() + timeout
  try:
    while any(p.poll() is None for p, _ in procs):
      failed = [r for r, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
      if failed or time.time() > deadline:
        raise RuntimeError(f"{job} job: rank(s) {failed or 'all'} failed or timed out; see {out}/{job}_rank*.log")
      time.sleep(0.2)
  finally:
    for p, log in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
      log.close()
  return [json.load(open(os.path.join(out, f"{job}_rank{r}.json"))) for r in range(args.processes)]


def _cores_of(rank: int, processes: int) -> str:
  cpus = os.cpu_count() or 1
  if processes >= cpus:
    return str(rank % cpus)
  per = cpus // processes
  return f"{rank * per}-{rank * per + per - 1}"


def summarize(results: list[dict], batch: int) -> dict:
  step = max(r["step_s"] for r in results)
  return dict(step_s=step, samples_per_sec=batch / step, tx_bytes_per_step=max(r["tx_bytes_per_step"] for r in results),
              collective_payload_bytes=results[0]["collective_payload_bytes"],
              peak_rss_bytes_total=sum(r["peak_rss_bytes"] for r in results),
              peak_rss_bytes_max=max(r["peak_rss_bytes"] for r in results),
              init_s=max(r["init_s"] for r in results), num_params=results[0]["num_params"], loss=results[0]["loss"])


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--labels", type=int, default=1_000_000)
  parser.add_argument("--features", type=int, default=10_000)
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--active_k", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=30, help="timed sparse steps")
  parser.add_argument("--dense_steps", type=int, default=3, help="timed dense data-parallel steps")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--rates", default="1gbit", help="comma-separated tc tbf rates, one run each")
  parser.add_argument("--local", action="store_true", help="loopback processes, no namespaces or rate limit")
  parser.add_argument("--skip_dense", action="store_true")
  parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                      help="pin each rank to its share of the cores (taskset)")
  parser.add_argument("--memory", action="store_true", help="report peak RSS per process and in total")
  parser.add_argument("--timeout", type=float, default=1800)
  parser.add_argument("--json", default=None)
  # Worker mode (internal).
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--job", default="sparse", help=argparse.SUPPRESS)
  parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    return worker(args)

  summary = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "args": vars(args), "runs": {}}
  rates = [None] if args.local else args.rates.split(",")
  if not args.local:
    why = can_use_namespaces()
    if why:
      print(f"benchmarks/cluster.py: skipped: {why}. (--local runs on loopback without namespaces.)")
      return 0
  for rate in rates:
    label = rate or "loopback"
    out = tempfile.mkdtemp(prefix=f"sjcluster_{label}_")
    addrs = None
    try:
      if not args.local:
        teardown_namespaces(args.processes)  # leftovers of an interrupted run
        addrs = setup_namespaces(args.processes, rate)
      run = {"sparse": summarize(run_job("sparse", args, addrs, out, args.timeout), args.batch)}
      if not args.skip_dense:
        run["dense_dp"] = summarize(run_job("dense", args, addrs, out, args.timeout), args.batch)
    finally:
      if not args.local:
        teardown_namespaces(args.processes)
    if "dense_dp" in run:
      run["step_speedup_vs_dense_dp"] = run["dense_dp"]["step_s"] / run["sparse"]["step_s"]
      run["bytes_per_step_ratio"] = run["sparse"]["tx_bytes_per_step"] / max(run["dense_dp"]["tx_bytes_per_step"], 1)
    summary["runs"][label] = run
    s = run["sparse"]
    print(f"[{label}] sparse: step {s['step_s'] * 1e3:.1f} ms, {s['samples_per_sec']:,.0f} samples/s, "
          f"{s['tx_bytes_per_step'] / 1e3:,.1f} kB sent/step/host, {s['num_params']:,} params, "
          f"peak RSS {s['peak_rss_bytes_total'] / 2**30:.2f} GiB total", flush=True)
    if "dense_dp" in run:
      d = run["dense_dp"]
      print(f"[{label}] dense data-parallel: step {d['step_s'] * 1e3:.1f} ms, {d['samples_per_sec']:,.1f} samples/s, "
            f"{d['tx_bytes_per_step'] / 1e6:,.1f} MB sent/step/host; sparse is "
            f"{run['step_speedup_vs_dense_dp']:.0f}x faster per step "
            f"with {run['bytes_per_step_ratio']:.2e} of the bytes",
            flush=True)
  first = summary["runs"][("1gbit" if "1gbit" in summary["runs"] else next(iter(summary["runs"])))]
  for key in ("step_speedup_vs_dense_dp", "bytes_per_step_ratio"):
    if key in first:
      summary[key] = first[key]
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
