"""Times a build of the clustered index alone: the training index's refresh and the serving index of evaluations.

A build is spherical k-means of the N output rows (``clusters.build_index``): Lloyd iterations, a final
assignment of every row to its best centroid, then the inverted file. With the default settings
(``--kmeans_iterations=2``, ``--kmeans_sample=64``) the training index has about sqrt(N) clusters and the serving
index the larger of 4 times that and 4,096 (``ModelConfig.index_sizes`` and ``eval_index_sizes``).

The rows are random normal with a shared component (as trained rows have). Prints the minimum and median
milliseconds of ``--repeats`` builds and a checksum of the index, so that two builds can be compared in turn on
this noisy VM (same checksum: the same index), and XLA's count of the build's temporaries (``--repeats 0``: that
count alone, nothing built):

  python benchmarks/index_build.py                              # GCIDE cloze's N
  python benchmarks/index_build.py --num_labels 200000 --repeats 3
  python benchmarks/index_build.py --num_labels 2000000 --dim 128 --repeats 0   # a 10^9-parameter run's shard
  PYTHONPATH=/path/to/other/site-packages python benchmarks/index_build.py   # another build
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.index import clusters

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_shape_flags(parser, "num_labels", "dim")
  parser.add_argument("--kmeans_iterations", type=int, default=2)
  parser.add_argument("--kmeans_sample", type=int, default=64, help="rows per cluster of the Lloyd iterations")
  parser.add_argument("--repeats", type=int, default=7, help="timed builds (0: XLA's count of temporaries only)")
  harness.add_json_flag(parser)
  args = parser.parse_args()

  n, d = args.num_labels, args.dim
  if args.repeats:
    rng = np.random.default_rng(0)
    shared = rng.normal(size=d)
    weight = jnp.asarray(0.1 * (rng.normal(size=(n, d)) + 2.0 * shared), jnp.float32)
    bias = jnp.asarray(rng.normal(size=n), jnp.float32)
  else:
    weight, bias = jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32)
  train_c = clusters.default_num_clusters(n)
  result = dict(num_labels=n, dim=d, kmeans_iterations=args.kmeans_iterations, kmeans_sample=args.kmeans_sample,
                builds={})
  for name, c in (("training", train_c), ("serving", min(max(4 * train_c, 4096), n))):
    index = clusters.init_index(c, n, d)
    build = jax.jit(functools.partial(clusters.build_index, iterations=args.kmeans_iterations,
                                      sample_per_cluster=args.kmeans_sample))
    temp_mb = build.lower(index, weight, bias).compile().memory_analysis().temp_size_in_bytes / 2**20
    result["builds"][name] = dict(clusters=c, temp_mb=temp_mb)
    if not args.repeats:
      print(f"N={n} d={d}: {name} index ({c} clusters) XLA temporaries {temp_mb:.0f} MB")
      continue
    built = build(index, weight, bias)
    index_sum = harness.checksum(built.offsets, built.rows, built.centroids)
    ms = harness.time_calls(functools.partial(build, index, weight, bias), 1, args.repeats)
    result["builds"][name].update(**harness.timing_summary(ms), checksum=index_sum)
    print(f"N={n} d={d}: {name} index ({c} clusters) min {min(ms):.1f} ms, median {np.median(ms):.1f} ms "
          f"(index {index_sum}), XLA temporaries {temp_mb:.0f} MB")
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
