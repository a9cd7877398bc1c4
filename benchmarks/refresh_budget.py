"""Accuracy per wall-clock second against ``--refresh_budget`` (how often the clustered index is refreshed).

Trains the default network on the synthetic set for the same wall-clock budget with each refresh budget and
reports steps, samples/s, test P@1 and sampled-inference P@1 of the final step (JSON lines, and ``--json``):

  python benchmarks/refresh_budget.py --labels 1000000 --seconds 120 --budgets 0,0.05,0.25

Budget 0 keeps ``--rebuild_period`` as given (50 steps, growing 1.05x); a budget b lengthens the periods to at
least ``refresh_cost_in_steps / b`` steps. Timings want a quiet machine; run the budgets back to back.
"""

import json
import tempfile

from sparsejax.config import Config
from sparsejax.model_config import ModelConfig
from sparsejax.schedule import TableSchedule
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate

import harness


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--labels", type=int, default=1_000_000)
  parser.add_argument("--samples", type=int, default=100_000, help="synthetic samples (5%% are the test set)")
  parser.add_argument("--features", type=int, default=20_000)
  parser.add_argument("--seconds", type=float, default=120.0, help="training seconds per run")
  parser.add_argument("--budgets", default="0,0.05,0.25", help="comma-separated --refresh_budget values")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  runs = []
  for budget in (float(b) for b in args.budgets.split(",")):
    config = override(Config(), dataset="synthetic", synthetic_labels=args.labels, synthetic_samples=args.samples,
                      synthetic_features=args.features, validation_fraction=0.0, max_seconds=args.seconds,
                      eval_every=10**9, checkpoint_every=10**9, progress=False, log_every=25, refresh_budget=budget)
    with tempfile.TemporaryDirectory() as workdir:
      final = train_and_evaluate(config, workdir)
    schedule = TableSchedule.for_model(ModelConfig.from_config(config, args.features, args.labels))
    run = {"refresh_budget": budget, "first_refresh_period": schedule.period,
           **{k: final.get(k) for k in ("step", "samples_per_sec", "train_seconds", "p@1", "p@5", "sampled_p@1")}}
    print(json.dumps(run), flush=True)
    runs.append(run)
  harness.write_json(args.json, {"labels": args.labels, "samples": args.samples, "seconds": args.seconds,
                                 "runs": runs})


if __name__ == "__main__":
  main()
