"""Time of ``netanalysis whatif`` against the number of layers of a ``.bk.log`` (issue 35: 10^4 layers took 6.4 s,
3·10^4 24.5 s, 10^6 no answer after 90 s: worse than linear).

For each size, a ``.bk.log`` of that many layers of 0.1 us and 400 bytes (the paper's 5 ms fusion window then holds
50,000 gradients back at a time: the case that was quadratic) is read and predicted at one grid point (the paper's
cost model with ``cuda_vec_add.log``, 8 workers, 1 Gbit/s, an iteration twice the backward pass), in one process as
the command runs them (the cyclic garbage collector off). Prints seconds and microseconds per layer for reading and
for the prediction; a linear scaling keeps the per-layer figures flat. The command's default grid (6 worker counts x
5 link rates) is 30 such predictions: ``--grid=default``.

  python benchmarks/whatif_scaling.py                                  # 10^4, 10^5, 10^6 layers, one point
  python benchmarks/whatif_scaling.py --layers 10000,30000,100000 --grid=default --json /tmp/w.json
"""

import gc
import os
import tempfile
import time

from sparsejax.netanalysis import cost_tables, profiles, whatif

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COST = os.path.join(ROOT, "tests", "data", "training_bottleneck", "cuda_vec_add.log")
LAYER_SECONDS = 1e-7  # each layer's backward time; the iteration is twice the backward pass
GRIDS = {"one": ([8], [1e9]), "default": ([2, 4, 8, 16, 32, 64], [1e7, 1e8, 1e9, 1e10, 1e11])}


def time_whatif(layers: int, grid: str, directory: str) -> dict:
  """Seconds to read a ``.bk.log`` of ``layers`` layers and to predict its ``grid``, and the scaling factors."""
  path = os.path.join(directory, f"deep{layers}.bk.log")
  with open(path, "w") as f:
    f.write(f"deep\n1\n{layers}\n" + f"{LAYER_SECONDS * 1e6:g},400\n" * layers)
  model = whatif.paper_model(cost_tables.read_cost_table(COST))
  workers, bandwidths = GRIDS[grid]
  gc.disable()  # as the command runs them
  try:
    start = time.perf_counter()
    profile = profiles.read_any_profile(path, 2 * layers * LAYER_SECONDS)
    read = time.perf_counter() - start
    start = time.perf_counter()
    predictions = whatif.grid([profile], model, workers, bandwidths)
    predict = time.perf_counter() - start
  finally:
    gc.enable()
  os.remove(path)
  return {"layers": layers, "grid_points": len(predictions), "read_seconds": read, "predict_seconds": predict,
          "read_us_per_layer": read / layers * 1e6,
          "predict_us_per_layer_and_point": predict / layers / len(predictions) * 1e6,
          "scaling_factors": [p.scaling_factor for p in predictions]}


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--layers", default="10000,100000,1000000", help="comma list of layer counts")
  parser.add_argument("--grid", choices=sorted(GRIDS), default="one", help="one point, or the command's default grid")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as directory:
    for layers in (int(n) for n in args.layers.split(",")):
      row = time_whatif(layers, args.grid, directory)
      rows.append(row)
      print(f"{layers:>9,} layers  read {row['read_seconds']:7.2f} s ({row['read_us_per_layer']:.2f} us/layer)  "
            f"predict {row['predict_seconds']:7.2f} s for {row['grid_points']} point(s) "
            f"({row['predict_us_per_layer_and_point']:.2f} us/layer/point)", flush=True)
  harness.write_json(args.json, {"benchmark": "whatif_scaling", "grid": args.grid, "rows": rows})


if __name__ == "__main__":
  main()
