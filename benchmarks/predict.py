"""A trained model as a user serves it: ``sparsejax.load`` and ``predict`` over a test file, exact and sampled.

Times, for one work directory and one test file (Extreme Classification Repository format), what a user of
``sparsejax.load(workdir)`` waits for: loading the selected checkpoint, the first sampled call (which builds the
serving index, unless the run kept it in ``WORKDIR/assets``), and ``predict`` over every test sample, exactly
(all N labels scored) and sampled (``--k`` candidates per sample from the serving index), each the minimum of
``--repeats`` calls after the first. It
also scores the predictions (P@1 and P@5 against the file's labels) and says how often the sampled top label is
the exact one:

  python benchmarks/accuracy.py --dataset synthetic --system sparsejax --budget 300   # the model
  python benchmarks/predict.py --workdir /tmp/sparsejax_accuracy/synthetic/sparsejax-300s \\
    --test /tmp/sparsejax_accuracy/synthetic/test.txt --k 1024 4000 --json benchmarks/results/predict_synthetic.json
"""

import time

import numpy as np

import sparsejax
from sparsejax import metrics
from sparsejax.data.xc_format import load_xc_file

import harness


def timed(fn, repeats: int) -> tuple[float, float, object]:
  """``(first call's seconds, minimum of the next repeats, the last result)``."""
  start = time.perf_counter()
  out = fn()
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return first, min(times), out


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--workdir", required=True, help="a trained run's work directory")
  parser.add_argument("--test", required=True, help="test samples with their labels (XC repository format)")
  parser.add_argument("--k", type=int, nargs="+", default=[1024], help="candidates per sample of sampled predict")
  parser.add_argument("--top", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=3)
  harness.add_json_flag(parser)
  args = parser.parse_args()

  test = load_xc_file(args.test)
  labels = test.to_padded(None, None)[2]
  start = time.perf_counter()
  model = sparsejax.load(args.workdir)
  load_s = time.perf_counter() - start
  n = len(test)
  result = dict(workdir=args.workdir, test=args.test, samples=n, num_labels=model.num_labels, step=model.step,
                selected_by=model.selected_by, serving_index_kept=model.serving_index_kept, load_s=load_s,
                runs=[])
  print(f"loaded step {model.step} ({model.selected_by}) in {load_s:.2f} s; {n} test samples, N = "
        f"{model.num_labels}")
  exact_ids = None
  for k in [None, *args.k]:
    first, best, (_, ids) = timed(lambda k=k: model.predict(test, top=args.top, k=k), args.repeats)
    scores = metrics.evaluate_topk(ids, labels, ks=(1, 5))
    run = dict(k=k, first_s=first, min_s=best, samples_per_s=n / best, **scores)
    if k is None:
      exact_ids = ids
    else:
      run["top1_equals_exact"] = float(np.mean(ids[:, 0] == exact_ids[:, 0]))
    result["runs"].append(run)
    index = (", the serving index kept by the run" if result["serving_index_kept"] else
             ", building the serving index") if k == args.k[0] else ""
    print(f"{'exact' if k is None else f'sampled k={k}'}: first call {first:.2f} s (with compilation{index}), "
          f"then {best:.3f} s: {n / best:,.0f} samples/s; "
          f"P@1 {scores['p@1']:.4f} P@5 {scores['p@5']:.4f}"
          + (f"; top label = exact's for {run['top1_equals_exact']:.3f}" if k is not None else ""))
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
