"""The centroid fusion's scoring time (sparsejax.fusion.centroid_scores) against gathering each candidate's centroid
row (the implementation before 4248b53, kept here as the baseline), on a data set's files.

Each of ``--samples`` test samples (padded to the widest of them, as an evaluation batch is) scores ``--candidates``
labels drawn by their training frequency, as a network's shortlist favours frequent labels (seed 0). Both ways must
give the same scores (checked to 1e-5). Heavy multi-label sets make large centroids: a training row with 500 labels
and 2,000 features adds a million entries::

  python benchmarks/suite.py --build --shapes labels_heavy labels_5        # the data, in ~/.cache/sparsejax-suite
  python benchmarks/centroid_scores.py --data ~/.cache/sparsejax-suite/labels_heavy --samples 1000
  python benchmarks/centroid_scores.py --data ~/.cache/sparsejax-suite/labels_5 --samples 2000

``--data`` holds ``train.txt`` and ``test.txt`` (Extreme Classification Repository format).
"""

import os
import time

import numpy as np

from sparsejax import fusion
from sparsejax.data import load_xc_file

import harness


def row_gather_scores(centroids: fusion.LabelCentroids, feat_ids: np.ndarray, feat_vals: np.ndarray,
                      ids: np.ndarray) -> np.ndarray:
  """The former scoring: each (sample, candidate) pair's centroid row gathered whole and multiplied by the sample."""
  import scipy.sparse as sp

  B, R = ids.shape
  real = (feat_ids >= 0) & (feat_ids < centroids.num_features)
  rows = np.broadcast_to(np.arange(B)[:, None], feat_ids.shape)[real]
  x = sp.csr_matrix((feat_vals[real], (rows, feat_ids[real])), shape=(B, centroids.num_features))
  valid = (ids >= 0) & (ids < centroids.num_labels)
  flat = np.where(valid, ids, 0).ravel()
  lengths = np.diff(centroids.indptr)[flat]
  c = centroids.matrix()
  out = np.empty(B * R, np.float32)
  start = 0
  while start < B * R:  # chunks of about 2^24 gathered entries (at least one pair)
    stop = start + max(1, int(np.searchsorted(np.cumsum(lengths[start:]), 1 << 24)))
    pairs = slice(start, stop)
    out[pairs] = np.asarray(c[flat[pairs]].multiply(x[np.arange(start, stop) // R]).sum(axis=1)).ravel()
    start = stop
  return np.where(valid.ravel(), out, 0.0).reshape(B, R).astype(np.float32)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--data", required=True, help="the directory with train.txt and test.txt")
  parser.add_argument("--samples", type=int, default=1000, help="test samples scored")
  parser.add_argument("--candidates", type=int, default=fusion.CANDIDATES, help="candidates per sample")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls of the current scoring (median)")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  data = os.path.expanduser(args.data)
  train, test = load_xc_file(os.path.join(data, "train.txt")), load_xc_file(os.path.join(data, "test.txt"))
  t = time.perf_counter()
  centroids = fusion.label_centroids(train)
  build = time.perf_counter() - t
  rows = np.arange(min(args.samples, len(test)))
  fi, fv, _ = test.to_padded(rows, max(int(test.feature_counts()[rows].max()), 1), 1)
  counts = np.bincount(train.label_indices, minlength=train.num_labels).astype(np.float64)
  ids = np.random.default_rng(0).choice(train.num_labels, size=(len(rows), args.candidates), p=counts / counts.sum())
  current = harness.median_seconds(fusion.centroid_scores, centroids, fi, fv, ids, repeats=args.repeats, warmup=1)
  t = time.perf_counter()
  baseline_scores = row_gather_scores(centroids, fi, fv, ids)
  baseline = time.perf_counter() - t
  np.testing.assert_allclose(fusion.centroid_scores(centroids, fi, fv, ids), baseline_scores, rtol=1e-5, atol=1e-6)
  result = {"data": args.data, "samples": len(rows), "candidates": args.candidates, "padded_width": fi.shape[1],
            "centroid_entries": len(centroids.values), "centroids_seconds": build,
            "centroid_scores_seconds": current, "row_gather_seconds": baseline, "speedup": baseline / current}
  print(f"{len(rows)} samples (padded to {fi.shape[1]}) x {args.candidates} candidates, "
        f"{len(centroids.values):,} centroid entries (built in {build:.1f} s with their lookup): "
        f"centroid_scores {current:.2f} s, row gather {baseline:.2f} s ({baseline / current:.1f}x)")
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
