"""Wall time of short runs of ``sparsejax-train`` and of ``sparsejax-predict`` calls, where start-up (imports, data,
compilation) is most of it.

Each configuration runs ``--repeats`` times in a fresh work directory, without JAX's persistent compilation cache
(``--compilation_cache=none``: the commands use a per-user one by default) and with it (a new cache directory,
filled by the first run with it: the remaining runs read it). Prints and writes (``--json``) every wall time, in
seconds.

  python benchmarks/startup.py                      # a 20-step synthetic run, predict with it, the quick start
  python benchmarks/startup.py --runs tiny,predict --repeats 5
  python benchmarks/startup.py --runs tiny,tiny_2processes   # the tiny run alone and over 2 local processes
  python benchmarks/startup.py --runs tiny --init_labels 2000000   # the initial state's time and peak memory
"""

import functools
import os
import subprocess
import sys
import tempfile
import time

import harness

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
    # sparsejax-predict with the tiny run's model, on PREDICT_ROWS synthetic rows (its arguments: predict_timer's).
    "predict": [],
}
# The tiny run over 2 processes (sparsejax-launch -n 2): every rank compiles, and reads the cache, its own programs.
RUNS["tiny_2processes"] = RUNS["tiny"]
PROCESSES = {"tiny_2processes": 2}


PREDICT = os.path.join(os.path.dirname(sys.executable), "sparsejax-predict")
PREDICT_ROWS = 1000  # input rows of each timed sparsejax-predict call (one batch): start-up is nearly all of it


def time_run(args: list[str], env: dict, cache: str, processes: int = 1) -> tuple[float, str]:
  """Seconds one run takes in a new work directory with ``--compilation_cache=cache``, and its final line;
  ``processes`` > 1: launched over that many local processes."""
  command = ([sys.executable, "-m", "sparsejax.distributed.launch", "-n", str(processes), TRAIN] if processes > 1
             else [sys.executable, TRAIN])
  with tempfile.TemporaryDirectory() as workdir:
    start = time.perf_counter()
    out = subprocess.run([*command, *args, f"--workdir={workdir}", f"--compilation_cache={cache}"],
                         env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
  if out.returncode != 0:
    raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
  return seconds, out.stdout.strip().splitlines()[-1]


def predict_timer(env: dict, directory: str):
  """A function timing one ``sparsejax-predict`` call on ``PREDICT_ROWS`` rows with a given cache, as
  :func:`time_run` times a run; the model is the tiny run's, trained first in ``directory`` (without a cache)."""
  from sparsejax import data

  workdir, inputs = os.path.join(directory, "model"), os.path.join(directory, "inputs.txt")
  out = subprocess.run([sys.executable, TRAIN, *RUNS["tiny"], f"--workdir={workdir}", "--compilation_cache=none"],
                       env=env, capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise SystemExit(f"training the model to predict with failed:\n{out.stderr[-3000:]}")
  data.save_xc_file(data.make_synthetic(PREDICT_ROWS, 500, 60, seed=1), inputs)

  def time_predict(_, env: dict, cache: str) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run([PREDICT, f"--workdir={workdir}", f"--input={inputs}", f"--compilation_cache={cache}"],
                         env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
      raise SystemExit(f"sparsejax-predict failed:\n{out.stderr[-3000:]}")
    return seconds, f"{len(out.stdout.splitlines())} lines of predictions"

  return time_predict


INIT = """
import resource, sys, time, jax
from sparsejax import dense, model
from sparsejax.settings import override
from sparsejax.model_config import ModelConfig
cfg = override(ModelConfig(100_000, int(sys.argv[2])), hidden_dims=(128,), active_k=1024)
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
  parser = harness.parser(__doc__)
  parser.add_argument("--runs", default="tiny,predict,quick_start", help=f"comma-separated, of {sorted(RUNS)}")
  parser.add_argument("--repeats", type=int, default=3)
  harness.add_json_flag(parser)
  parser.add_argument("--init_labels", type=int, default=0,
                      help="also time the initial state's build at this many outputs (and its peak RSS)")
  args = parser.parse_args()
  base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  results = {"load_average": os.getloadavg(), "runs": {}}
  for name in filter(None, args.runs.split(",")):  # --runs= : none (the init figures alone)
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as scratch:
      timer = (predict_timer(base, scratch) if name == "predict"
               else functools.partial(time_run, processes=PROCESSES.get(name, 1)))
      entry = {}
      for label, setting in (("no_cache", "none"), ("cache", cache)):
        timings = [timer(RUNS[name], base, setting) for _ in range(args.repeats)]
        entry[label] = [round(s, 2) for s, _ in timings]
        entry["final_line"] = timings[-1][1]
        print(f"{name:12s} {label:9s} " + " ".join(f"{s:.2f}" for s, _ in timings) + " s", flush=True)
      results["runs"][name] = entry
  results["load_average_after"] = os.getloadavg()
  if args.init_labels:
    results["init"] = {which: time_init(which, args.init_labels) for which in ("slide", "dense")}
    results["init"]["num_labels"] = args.init_labels
    print("init:", results["init"], flush=True)
  harness.write_json(args.json, results)


if __name__ == "__main__":
  main()
