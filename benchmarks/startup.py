"""Wall time of short runs of ``sparsejax-train``, where start-up (imports, data, compilation) is most of it.

Each configuration runs ``--repeats`` times in a fresh work directory, without and with JAX's persistent
compilation cache (a new cache directory, filled by the first run with it: the remaining runs read it). Prints and
writes (``--json``) every wall time, in seconds.

  python benchmarks/startup.py                      # a 20-step synthetic run and the README's quick start
  python benchmarks/startup.py --runs tiny --repeats 5
  python benchmarks/startup.py --runs tiny --init_labels 2000000   # the initial state's time and peak memory
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")

RUNS = {
    # The shape most of the test suite trains: start-up is nearly all of it.
    "tiny": ["--dataset=synthetic", "--synthetic_samples=2000", "--synthetic_features=500", "--synthetic_labels=60",
             "--hidden_dims=16", "--active_k=60", "--num_tables=4", "--batch_size=32", "--max_steps=20",
             "--eval_every=1", "--eval_samples=64", "--log_every=1", "--checkpoint_every=1000", "--noprogress",
             "--learning_rate=0.01"],
    # The README's quick start (ICD-10-CM, the defaults).
    "quick_start": ["--noprogress"],
}


def time_run(args: list[str], env: dict) -> tuple[float, str]:
  """Seconds one run takes in a new work directory, and its final line."""
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, TRAIN, *args, f"--workdir={workdir}"], env=env, capture_output=True,
                         text=True, check=False)
    seconds = time.perf_counter() - start
  if out.returncode != 0:
    raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
  return seconds, out.stdout.strip().splitlines()[-1]


INIT = """
import resource, sys, time, jax
from sparsejax import dense, model
from sparsejax.config import override
cfg = override(model.ModelConfig(100_000, int(sys.argv[2])), hidden_dims=(128,), active_k=1024)
start = time.perf_counter()
jax.block_until_ready((model.init if sys.argv[1] == "slide" else dense.init)(jax.random.key(0), cfg))
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)
"""


def time_init(which: str, num_labels: int) -> dict:
  """Seconds and peak RSS (GB) of building the initial state of ``which`` (slide or dense), in a new process: 10^5
  features, d = 128, ``num_labels`` outputs."""
  out = subprocess.run([sys.executable, "-c", INIT, which, str(num_labels)], capture_output=True, text=True,
                       check=True)
  seconds, rss = map(float, out.stdout.split())
  return {"seconds": round(seconds, 2), "peak_rss_gb": round(rss, 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--runs", default="tiny,quick_start", help=f"comma-separated, of {sorted(RUNS)}")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", default=None, help="write the results here")
  parser.add_argument("--init_labels", type=int, default=0,
                      help="also time the initial state's build at this many outputs (and its peak RSS)")
  args = parser.parse_args()
  base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(), "cpus": os.cpu_count(),
             "runs": {}}
  for name in filter(None, args.runs.split(",")):  # --runs= : none (the init figures alone)
    with tempfile.TemporaryDirectory() as cache:
      cached = dict(base, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
      entry = {}
      for label, env in (("no_cache", base), ("cache", cached)):
        timings = [time_run(RUNS[name], env) for _ in range(args.repeats)]
        entry[label] = [round(s, 2) for s, _ in timings]
        entry["final_line"] = timings[-1][1]
        print(f"{name:12s} {label:9s} " + " ".join(f"{s:.2f}" for s, _ in timings) + " s", flush=True)
      results["runs"][name] = entry
  if args.init_labels:
    results["init"] = {which: time_init(which, args.init_labels) for which in ("slide", "dense")}
    results["init"]["num_labels"] = args.init_labels
    print("init:", results["init"], flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
