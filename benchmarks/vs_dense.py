"""sparsejax vs dense full-softmax training: same network, same data, same budget.

Trains the same network (sparse input layer -> 128 ReLU -> N outputs) twice:
with sparsejax (LSH-sampled output layer, row-sparse Adam) and densely (all N
logits, jnp + optax.adam on every parameter), then evaluates both exactly
over all N outputs on the same test set. The budget is either wall-clock
seconds (--budget, default) or epochs (--epochs).

  python benchmarks/vs_dense.py --budget 600 --json PATH        # synthetic, N = 200,000
  python benchmarks/vs_dense.py --dataset icd10 --epochs 5      # ICD-10-CM, same epochs
"""

import os
import tempfile

from sparsejax.config import Config
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate

import harness


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--dataset", default="synthetic", choices=("synthetic", "icd10"))
  parser.add_argument("--budget", type=float, default=600.0, help="training seconds per run")
  parser.add_argument("--epochs", type=float, default=None, help="train this many epochs instead of --budget")
  parser.add_argument("--labels", type=int, default=200_000)
  parser.add_argument("--features", type=int, default=100_000)
  parser.add_argument("--samples", type=int, default=500_000)
  parser.add_argument("--active_k", type=int, default=512)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--workdir", default=None)
  harness.add_json_flag(parser)
  args = parser.parse_args()
  base = override(
      Config(), dataset=args.dataset, synthetic_samples=args.samples, synthetic_features=args.features,
      synthetic_labels=args.labels, test_fraction=0.02 if args.dataset == "synthetic" else 0.1,
      batch_size=args.batch_size, active_k=args.active_k, num_epochs=args.epochs, max_steps=None,
      max_seconds=None if args.epochs else args.budget, eval_every=10**9, checkpoint_every=10**9,
      progress=False)
  workdir = args.workdir or tempfile.mkdtemp(prefix="vs_dense_")
  results = {}
  for name in ("sparse", "dense"):
    config = override(base, model="slide" if name == "sparse" else "dense")
    final = train_and_evaluate(config, os.path.join(workdir, name))
    results[name] = final
    print(f"{name:>6}: {final['step']:,} steps, {final['samples_per_sec']:,.0f} samples/s, "
          f"P@1 {final['p@1']:.4f}  P@5 {final['p@5']:.4f}  nDCG@5 {final['ndcg@5']:.4f}  PSP@5 {final['psp@5']:.4f}",
          flush=True)
  summary = {
      "samples_per_sec_ratio": results["sparse"]["samples_per_sec"] / results["dense"]["samples_per_sec"],
      "p@1_sparse": results["sparse"]["p@1"],
      "p@1_dense": results["dense"]["p@1"],
      "p@1_gap_points": 100 * (results["dense"]["p@1"] - results["sparse"]["p@1"]),
      "args": vars(args),
      "runs": results,
  }
  print(f"samples/s ratio {summary['samples_per_sec_ratio']:.1f}x; P@1 sparse {summary['p@1_sparse']:.4f} "
        f"vs dense {summary['p@1_dense']:.4f}")
  harness.write_json(args.json, summary, indent=2)


if __name__ == "__main__":
  main()
