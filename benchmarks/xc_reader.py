"""Times the extreme-classification file reader on an Amazon-670K-sized file.

Writes a synthetic file with the shape of Amazon-670K's train split (490,449
lines, 135,909 features, 670,091 labels, ~100 features and ~5 labels per
line), then times `load_xc_file` on it.

  python benchmarks/xc_reader.py [--lines 490449] [--json PATH]
"""

import os
import tempfile
import time

from sparsejax import data

import harness


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--lines", type=int, default=490_449)
  parser.add_argument("--features", type=int, default=135_909)
  parser.add_argument("--labels", type=int, default=670_091)
  harness.add_json_flag(parser)
  args = parser.parse_args()
  ds = data.make_synthetic(args.lines, args.features, args.labels, labels_per_sample=5.45,
                           features_per_sample=100, seed=0)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "train.txt")
    t0 = time.perf_counter()
    data.save_xc_file(ds, path)
    write_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    loaded = data.load_xc_file(path)
    read_s = time.perf_counter() - t0
  assert len(loaded) == args.lines and loaded.indices.size == ds.indices.size
  result = {"lines": args.lines, "file_bytes": size, "read_s": read_s, "write_s": write_s}
  print(f"{args.lines:,} lines ({size / 2**20:,.0f} MiB): read in {read_s:.1f} s, written in {write_s:.1f} s")
  harness.write_json(args.json, result, indent=2)


if __name__ == "__main__":
  main()
