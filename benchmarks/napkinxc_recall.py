"""How often napkinXC's own top k holds a test query's label: a second model's ceiling for issue 9's label_recall.

Issue 9 asks for ``label_recall >= 0.8``: the share of a test query's labels among its k candidates. No index can
return more than the model behind it ranks in its exact top k. This measures the same share for napkinXC's PLT,
an unrelated model family, at the same k, to tell a limit of the data from one of sparsejax's network. It
loads the PLT that ``benchmarks/accuracy.py --system napkinxc`` trained and saved for the dataset:

  python benchmarks/accuracy.py --dataset gcide_cloze --system napkinxc --budget 300    # the run
  python benchmarks/napkinxc_recall.py --dataset gcide_cloze --k 1024 407 \\
      --json benchmarks/results/napkinxc_recall_gcide_cloze.json

``label_recall`` is averaged over queries as in ``sparsejax.retrieval`` (each query: the share of its labels
found; queries without labels are left out).
"""

import os
import time

import numpy as np

import harness
from harness import finished_runs


def label_recall(top: list, labels: list[np.ndarray], k: int) -> float:
  """Mean over labelled queries of the share of their distinct labels among their first ``k`` predictions."""
  shares = [np.isin(np.unique(y), np.asarray(row[:k], np.int64)).mean() for row, y in zip(top, labels) if len(y)]
  return float(np.mean(shares))


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--dataset", default="gcide_cloze", choices=("synthetic", "gcide", "gcide_cloze", "icd10"))
  parser.add_argument("--tag", default="300s", help="the napkinxc run's tag")
  parser.add_argument("--k", type=int, nargs="+", default=[1024])
  parser.add_argument("--queries", type=int, default=None, help="the first this many test queries (default: all)")
  parser.add_argument("--workdir", default=finished_runs.DEFAULT_WORKDIR, help="accuracy.py's --workdir")
  harness.add_json_flag(parser)
  args = parser.parse_args()

  from napkinxc.models import PLT

  from sparsejax import data as xcdata

  run_dir = os.path.join(args.workdir, args.dataset, f"napkinxc-{args.tag}")
  if not os.path.isdir(run_dir):
    raise SystemExit(f"no napkinXC run in {run_dir}: run benchmarks/accuracy.py --dataset {args.dataset} "
                     f"--system napkinxc first")
  test = xcdata.load_xc_file(os.path.join(args.workdir, args.dataset, "test.txt"))
  if args.queries is not None:
    test = test.subset(np.arange(min(args.queries, len(test))))
  x = test.feature_matrix()
  labels = [test.label_indices[test.label_indptr[i]:test.label_indptr[i + 1]] for i in range(len(test))]
  if not any(len(y) for y in labels):
    raise SystemExit(f"no test query of {args.dataset} has a label")
  model = PLT(run_dir)
  model.load()
  trained = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(max(
      os.path.getmtime(os.path.join(run_dir, name)) for name in os.listdir(run_dir))))
  start = time.perf_counter()
  top = model.predict(x, top_k=max(args.k))
  seconds = time.perf_counter() - start
  results = {str(k): label_recall(top, labels, k) for k in sorted(args.k)}
  for k, value in results.items():
    print(f"{args.dataset}: napkinXC's top {k} holds the label for {value:.3f} of {len(test)} test queries "
          f"(label_recall); predicting the top {max(args.k)} took {seconds:.1f} s")
  harness.write_json(args.json, dict(dataset=args.dataset, run=run_dir, model_written=trained, queries=len(test),
                                     label_recall=results, predict_seconds=seconds))


if __name__ == "__main__":
  main()
