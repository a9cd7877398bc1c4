"""Accuracy against wall-clock time: sparsejax, all-active, dense full softmax and napkinXC, side by side.

Every model trains on the same files (written once, Extreme Classification
Repository format) and the same cores, for the same training-time budget,
and is evaluated exactly on the same test set:

* ``sparsejax``: the default configuration (sampled output layer).
* ``all_active``: the same network with every output neuron active
  (``active_k >= N``: the exact softmax through the sparse kernels).
* ``dense``: the same network trained densely (jnp + optax, full softmax).
* ``napkinxc``: napkinXC's probabilistic label tree (``PLT``, liblinear
  nodes; benchmark-only: ``pip install napkinxc``), one point per run.

The sparsejax runs are evaluated every ``--eval_every`` steps, giving P@1
and P@5 against training seconds (evaluation time excluded). Writes a JSON
file and a PNG of P@1 against seconds.

  python benchmarks/accuracy.py --dataset synthetic --budget 300 --out benchmarks/results/accuracy_synthetic
  python benchmarks/accuracy.py --dataset gcide --budget 300 --out benchmarks/results/accuracy_gcide

Wall-clock comparisons need a quiet machine: nothing else should run.
"""

import argparse
import datetime
import json
import os
import platform
import time

import numpy as np

from sparsejax import data as xcdata

MODELS = ("sparsejax", "all_active", "dense", "napkinxc")


def write_files(dataset: str, workdir: str, seed: int) -> tuple[str, str]:
  """The benchmark's train and test files (written once per workdir)."""
  train_path, test_path = os.path.join(workdir, "train.txt"), os.path.join(workdir, "test.txt")
  if os.path.exists(train_path) and os.path.exists(test_path):
    return train_path, test_path
  if dataset == "synthetic":
    # The acceptance set of issue 9: make_synthetic(100_000, 100_000, 200_000) plus 10K test samples.
    full = xcdata.make_synthetic(110_000, 100_000, 200_000, seed=seed)
    train, test = full.subset(np.arange(100_000)), full.subset(np.arange(100_000, 110_000))
  elif dataset == "gcide":
    train, test, _ = xcdata.load_gcide(seed=seed)
  elif dataset == "icd10":
    train, test, _ = xcdata.load_icd10(seed=seed)
  else:
    raise ValueError(f"unknown dataset {dataset!r}")
  os.makedirs(workdir, exist_ok=True)
  xcdata.save_xc_file(train_path + ".tmp", train)
  xcdata.save_xc_file(test_path + ".tmp", test)
  os.replace(train_path + ".tmp", train_path)
  os.replace(test_path + ".tmp", test_path)
  return train_path, test_path


def run_sparsejax(name: str, train_path: str, test_path: str, workdir: str, args) -> dict:
  """One sparsejax run; returns its curve (P@1 / P@5 against training seconds) and final metrics."""
  from sparsejax.config import Config, override
  from sparsejax.train import train_and_evaluate

  config = override(Config(), dataset="files", train_file=train_path, test_file=test_path, max_seconds=args.budget,
                    eval_every=args.eval_every, eval_samples=args.eval_samples, checkpoint_every=10**9,
                    progress=False, seed=args.seed)
  if name == "all_active":
    config = override(config, active_k=2**31 - 1)
  elif name == "dense":
    config = override(config, model="dense")
  run_dir = os.path.join(workdir, name)
  final = train_and_evaluate(config, run_dir)
  curve = []
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      if not record.get("final"):
        curve.append({key: record[key] for key in ("step", "train_seconds", "p@1", "p@5")})
  curve.append({"step": final["step"], "train_seconds": final["train_seconds"], "p@1": final["p@1"],
                "p@5": final["p@5"]})
  return {"curve": curve, "final": final}


def run_napkinxc(train_path: str, test_path: str, args) -> dict:
  """napkinXC PLT with its defaults (liblinear nodes): one (seconds, P@1, P@5) point."""
  import scipy.sparse
  from napkinxc.models import PLT

  def to_xy(ds):
    x = scipy.sparse.csr_matrix((ds.values, ds.indices, ds.indptr), shape=(len(ds), ds.num_features))
    y = [ds.label_indices[ds.label_indptr[i]:ds.label_indptr[i + 1]].tolist() for i in range(len(ds))]
    return x, y

  train, test = xcdata.load_xc_file(train_path), xcdata.load_xc_file(test_path)
  x_train, y_train = to_xy(train)
  x_test, _ = to_xy(test)
  model = PLT(os.path.join(args.workdir, "napkinxc"), seed=args.seed, threads=0)
  t = time.time()
  model.fit(x_train, y_train)
  seconds = time.time() - t
  top = model.predict(x_test, top_k=5)
  ids = np.full((len(test), 5), -1, np.int64)
  for i, row in enumerate(top):
    ids[i, :len(row)] = row[:5]
  _, _, labels = test.to_padded(None)
  from sparsejax import metrics

  result = metrics.evaluate_topk(ids, labels)
  point = {"step": 1, "train_seconds": seconds, "p@1": result["p@1"], "p@5": result["p@5"]}
  return {"curve": [point], "final": {**result, "train_seconds": seconds, "within_budget": seconds <= args.budget}}


def plot(results: dict, path: str, title: str):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, run in results.items():
    xs = [p["train_seconds"] for p in run["curve"]]
    ys = [p["p@1"] for p in run["curve"]]
    ax.plot(xs, ys, "o" if len(xs) == 1 else "-o", markersize=4, label=name)
  ax.set_xlabel("training seconds (evaluation excluded)")
  ax.set_ylabel("P@1 (exact, test set)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dataset", default="synthetic", choices=("synthetic", "gcide", "icd10"))
  parser.add_argument("--budget", type=float, default=300.0, help="training seconds per model")
  parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
  parser.add_argument("--eval_every", type=int, default=200, help="steps between evaluations (sparsejax runs)")
  parser.add_argument("--eval_samples", type=int, default=5000, help="test samples of periodic evaluations")
  parser.add_argument("--workdir", default="/tmp/sparsejax_accuracy")
  parser.add_argument("--out", default=None, help="output prefix: writes PREFIX.json and PREFIX.png")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  models = [m for m in args.models.split(",") if m]
  unknown = set(models) - set(MODELS)
  if unknown:
    parser.error(f"unknown models {sorted(unknown)}; choose from {MODELS}")
  workdir = os.path.join(args.workdir, args.dataset)
  train_path, test_path = write_files(args.dataset, workdir, args.seed)
  results = {}
  for name in models:
    results[name] = run_napkinxc(train_path, test_path, args) if name == "napkinxc" else run_sparsejax(
        name, train_path, test_path, workdir, args)
    best = max(results[name]["curve"], key=lambda p: p["p@1"])
    print(f"{name:>11}: best P@1 {best['p@1']:.4f} at {best['train_seconds']:.0f} s, final P@1 "
          f"{results[name]['final']['p@1']:.4f}", flush=True)
  report = {
      "dataset": args.dataset, "budget_seconds": args.budget, "date": datetime.datetime.now().isoformat(),
      "load_average_at_end": os.getloadavg(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
      "best_p@1": {name: max(p["p@1"] for p in run["curve"]) for name, run in results.items()},
      "runs": results,
  }
  prefix = args.out or os.path.join(workdir, "accuracy")
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  with open(prefix + ".json", "w") as f:
    json.dump(report, f, indent=1, default=float)
  plot(results, prefix + ".png", f"{args.dataset}: P@1 against training time ({os.cpu_count()} cores)")
  print(f"wrote {prefix}.json and {prefix}.png")


if __name__ == "__main__":
  main()
