"""Accuracy of the sparse layers' optimizer options against lazy Adam, on the same runs.

Every variant trains the same network on the same synthetic data, from the
same seed, for the same number of epochs, and is evaluated exactly on the same
test set. Variants (each one option changed from the default, lazy Adam with
float32 moments):

* ``lazy_adam``: the default.
* ``rowwise_adam``: ``--second_moment=row`` (one second moment per row).
* ``bf16_moments``: ``--moment_dtype=bfloat16`` (stochastically rounded).
* ``bf16_weights``: ``--weight_dtype=bfloat16`` (the output layer's weights, stochastically rounded).
* ``bf16_all``: both (6 bytes per weight element instead of Adam's 12).

  python benchmarks/optimizers.py --json benchmarks/results/optimizers.json

Accuracy at fixed epochs does not depend on the machine's speed (samples/s
here is only indicative).
"""

import json
import tempfile

from sparsejax.config import Config
from sparsejax.settings import override
from sparsejax.train import driver

import harness

VARIANTS = {
    "lazy_adam": {},
    "rowwise_adam": {"second_moment": "row"},
    "bf16_moments": {"moment_dtype": "bfloat16"},
    "bf16_weights": {"weight_dtype": "bfloat16"},
    "bf16_all": {"weight_dtype": "bfloat16", "moment_dtype": "bfloat16"},
}


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
  parser.add_argument("--epochs", type=float, default=3.0)
  parser.add_argument("--samples", type=int, default=100_000, help="synthetic samples (train and test)")
  parser.add_argument("--labels", type=int, default=10_000, help="synthetic labels N")
  parser.add_argument("--seeds", default="0", help="comma-separated seeds: every variant runs each")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  runs = []
  for seed in (int(s) for s in args.seeds.split(",")):
    for name in args.variants.split(","):
      config = override(Config(), dataset="synthetic", synthetic_samples=args.samples, synthetic_labels=args.labels,
                        num_epochs=args.epochs, seed=seed, progress=False, eval_every=10**9, **VARIANTS[name])
      with tempfile.TemporaryDirectory() as workdir:
        final = driver.train_and_evaluate(config, workdir)
      run = {"variant": name, "seed": seed, **{k: final[k] for k in ("p@1", "p@3", "p@5", "samples_per_sec", "step")}}
      runs.append(run)
      print(f"{name:>14} seed {seed}: P@1 {run['p@1']:.4f}  P@5 {run['p@5']:.4f}  "
            f"({run['step']} steps, {run['samples_per_sec']:.0f} samples/s)", flush=True)
  means = {}
  for name in dict.fromkeys(r["variant"] for r in runs):
    mine = [r for r in runs if r["variant"] == name]
    means[name] = {k: sum(r[k] for r in mine) / len(mine) for k in ("p@1", "p@3", "p@5")}
  if "lazy_adam" in means:
    for m in means.values():
      m["p@1_minus_lazy_adam"] = m["p@1"] - means["lazy_adam"]["p@1"]
  summary = {"config": vars(args), "runs": runs, "means": means}
  print(json.dumps(means, indent=2))
  harness.write_json(args.json, summary, indent=2)


if __name__ == "__main__":
  main()
