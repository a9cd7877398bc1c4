"""Offline study of score fusion with label centroids (sparsejax.fusion) on a finished run's selected state.

For the run's network, the label centroids alone and their fusion, the test P@1, with the fusion weight chosen on one
half of the test set and scored on the other (both ways, then averaged), for several candidate counts. The network
is evaluated without the run's own fusion (``fusion=False``): this measures what fusion adds to any trained model::

  python benchmarks/fusion.py --run /tmp/sparsejax_accuracy/gcide/sparsejax-300s+avg \\
      --data /tmp/sparsejax_accuracy/gcide --json benchmarks/results/fusion/gcide.json

``--data`` holds the run's ``train.txt`` and ``test.txt`` (XC format; benchmarks/accuracy.py writes them). The
centroids are built from the whole of ``train.txt`` here (the run itself builds them from its training split, 95% of
it). Accuracy only: timings are not compared.
"""

import os

import numpy as np

import sparsejax
from sparsejax import fusion
from sparsejax.data import load_xc_file

import harness


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--run", required=True, help="a finished run's work directory")
  parser.add_argument("--data", required=True, help="the directory with its train.txt and test.txt")
  parser.add_argument("--candidates", default="50,100,400", help="comma-separated candidate counts")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  train, test = load_xc_file(os.path.join(args.data, "train.txt")), load_xc_file(os.path.join(args.data, "test.txt"))
  centroids = fusion.label_centroids(train)
  model = sparsejax.load(args.run)
  counts = sorted(int(c) for c in args.candidates.split(","))
  scores, ids = model.predict(test, top=max(counts), fusion=False)
  fi, fv, labels = test.to_padded(np.arange(len(test)), model.max_features, max(test.max_labels_per_sample(), 1))
  score = np.concatenate([fusion.centroid_scores(centroids, fi[s:s + 1000], fv[s:s + 1000], ids[s:s + 1000])
                          for s in range(0, len(test), 1000)])
  n = len(test)
  hit = lambda top: np.array([top[i] in set(labels[i][labels[i] >= 0].tolist()) for i in range(n)])
  x, c = test.feature_matrix(), centroids.matrix().T.tocsr()
  alone = np.concatenate([np.asarray((x[s:s + 2000] @ c).argmax(axis=1)).ravel()  # the centroids alone, all N
                          for s in range(0, n, 2000)])
  result = {"run": args.run, "data": args.data, "test_samples": n,
            "network_p@1": float(hit(ids[:, 0]).mean()),
            "centroids_p@1": float(hit(alone).mean()), "fused": {}}
  halves = np.arange(n) % 2 == 0
  for count in counts:
    table = {}
    for w in fusion.WEIGHTS:
      _, top = fusion.rerank(scores[:, :count], ids[:, :count], score[:, :count], w, 1)
      h = hit(top[:, 0])
      table[w] = (float(h[halves].mean()), float(h[~halves].mean()))
    on_a, on_b = max(table, key=lambda w: table[w][0]), max(table, key=lambda w: table[w][1])
    result["fused"][count] = {"weight_chosen_on_a": on_a, "weight_chosen_on_b": on_b,
                              "p@1_crossed": (table[on_a][1] + table[on_b][0]) / 2,
                              "p@1_by_weight": {f"{w:g}": (a + b) / 2 for w, (a, b) in table.items()}}
    print(f"{count} candidates: P@1 {result['fused'][count]['p@1_crossed']:.4f} (weights {on_a:g} / {on_b:g}); "
          f"network {result['network_p@1']:.4f}, centroids alone {result['centroids_p@1']:.4f}", flush=True)
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
