"""The paper's what-if analysis on its own measured profiles (Zhang et al., NetAI 2020), the full grid.

ResNet50, ResNet101 and VGG16 (backward profiles from netx-repo/training-bottleneck, vendored in
tests/data/training_bottleneck/), n in {16, 64} workers, links of 100, 40, 25, 10 and 1 Gbit/s,
compression 1, 2, 5, 10 and 100, with the paper model (fusion every 5 ms / 64 MiB, ring all-reduce at
full link rate, reduction cost interpolated in cuda_vec_add.log), and the compression needed for a
scaling factor of 0.95.

  python benchmarks/netanalysis_paper.py
  # writes benchmarks/results/netanalysis_paper.json (schema sparsejax.netanalysis.whatif/1) and
  # benchmarks/results/netanalysis_paper-{whatif,compression}.png. The same analysis from the command line:
  python -m sparsejax.netanalysis whatif --model=paper --profile=tests/data/training_bottleneck/resnet50.bk.log,\
tests/data/training_bottleneck/resnet101.bk.log,tests/data/training_bottleneck/vgg16.bk.log \
      --iteration_time_ms=resnet50=128.1,resnet101=192.0,vgg16=194.5 \
      --reduce_cost=tests/data/training_bottleneck/cuda_vec_add.log --workers=16,64 \
      --bandwidths=100gbit,40gbit,25gbit,10gbit,1gbit --compression=1,2,5,10,100 --target_scaling=0.95
"""

import os
import time

from sparsejax.netanalysis import cost_tables, file_io, profiles, report, whatif

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATION_MS = {"resnet50": 128.1, "resnet101": 192.0, "vgg16": 194.5}  # one-GPU iteration, from the paper's repository


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--data", default=os.path.join(ROOT, "tests", "data", "training_bottleneck"))
  parser.add_argument("--out", default=os.path.join(harness.RESULTS_DIR, "netanalysis_paper"),
                      help="writes OUT.json and OUT-{whatif,compression}.png")
  parser.add_argument("--target_scaling", type=float, default=0.95)
  args = parser.parse_args()
  bk = [profiles.read_bk_log(os.path.join(args.data, f"{name}.bk.log"), ms / 1e3) for name, ms in ITERATION_MS.items()]
  model = whatif.paper_model(cost_tables.read_cost_table(os.path.join(args.data, "cuda_vec_add.log")))
  workers, bandwidths, compressions = (16, 64), (100e9, 40e9, 25e9, 10e9, 1e9), (1, 2, 5, 10, 100)
  start = time.perf_counter()
  grid = whatif.grid(bk, model, workers, bandwidths, compressions)
  grid_seconds = time.perf_counter() - start
  start = time.perf_counter()
  result = whatif.analyse(bk, model, workers, bandwidths, compressions, args.target_scaling)
  analysis_seconds = time.perf_counter() - start
  assert result.grid == grid
  print(report.format_whatif(result))
  file_io.write_json_atomic(f"{args.out}.json", report.whatif_json(result))
  paths = report.plot_whatif(result, args.out)
  print(f"\ngrid of {len(grid)} predictions: {grid_seconds:.3f} s; grid + every inversion: {analysis_seconds:.3f} s")
  print("wrote", ", ".join([f"{args.out}.json", *paths]))


if __name__ == "__main__":
  main()
