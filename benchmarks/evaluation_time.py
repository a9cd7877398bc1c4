"""Time of one periodic evaluation of a finished accuracy run, by part.

A training run evaluates its validation split every ``--evals_per_epoch``-th of an epoch. With
``--sampled_evaluations=all`` (the final test evaluation always) it builds the serving index on the current rows,
then runs exact and sampled inference with the retrieval diagnostics (``Run.diagnose``); by default a periodic
one runs the exact part only. This restores a ``benchmarks/accuracy.py`` sparsejax run's selected state and times those
parts on ``--samples`` test samples (the second of two rounds, after compilation):

  python benchmarks/accuracy.py --dataset gcide --system sparsejax --budget 300   # the run
  python benchmarks/evaluation_time.py --dataset gcide --tag 300s --json benchmarks/results/evaluation_time_gcide.json
"""

import time

import harness
from harness import finished_runs


def main() -> None:
  parser = harness.parser(__doc__)
  finished_runs.add_finished_run_flags(parser, "gcide")
  parser.add_argument("--samples", type=int, default=5000, help="test samples evaluated (accuracy.py's default "
                      "--eval_samples)")
  harness.add_json_flag(parser)
  args = parser.parse_args()

  import jax

  _, test, run, state, evaluator = finished_runs.finished_run(args)
  samples = min(args.samples, len(test))
  for _ in range(2):  # the first round compiles
    start = time.perf_counter()
    served = jax.block_until_ready(run.refresh_index(state))
    build = time.perf_counter() - start
    start = time.perf_counter()
    evaluator(run.predict, served, samples)
    predict = time.perf_counter() - start
    start = time.perf_counter()
    evaluator(run.predict, served, samples, diagnose=run.diagnose)
    diagnose = time.perf_counter() - start
  result = dict(dataset=args.dataset, run=finished_runs.finished_run_dir(args),
                samples=samples, num_labels=test.num_labels,
                serving_index_seconds=build, predict_seconds=predict, diagnose_seconds=diagnose,
                evaluation_seconds=build + diagnose)
  print(f"{args.dataset}: {samples} samples, N = {test.num_labels}: serving index {build:.2f} s, exact + sampled "
        f"inference {predict:.2f} s, with the diagnostics {diagnose:.2f} s (an evaluation: index + diagnostics "
        f"{build + diagnose:.2f} s)")
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
