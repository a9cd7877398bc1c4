"""Speed of the clustered index's probe: the ``cluster_probe`` kernel against the ``top_k`` form it replaced.

``clusters.probe`` ranks each query's clusters and copies the members of the best ones. It used to take
``jax.lax.top_k`` of the ``[B, C]`` cluster scores with ``probes = min(C, k)``, which XLA:CPU compiles to a
full sort of every row, and locate the members by a search over cumulative sizes. The kernel sorts only as
many clusters as the members need. This times both, jitted, on the shapes that training and evaluation use
(random rows, clusters from one k-means iteration), and checks that they return the same ids:

  python benchmarks/index_probe.py --json benchmarks/results/index_probe.json

Reported per shape: the median of ``--calls`` timed calls after a warm-up, alternating the two forms
``--rounds`` times (median over rounds).
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.index import clusters

import harness

# (what, N rows, C clusters, B queries, count candidates): training's index at 2e5 and 1e6 rows with the default
# sqrt(N) clusters and k = 1024, evaluation's serving index as it was (2048 clusters) and as it is (4096 clusters,
# k = 1024 and 4000 = 2% of N) on 1,024 queries.
SHAPES = (("training step, N = 2e5", 200_000, 447, 128, 1024),
          ("training step, N = 1e6", 1_000_000, 1000, 128, 1024),
          ("evaluation, N = 2e5", 200_000, 2048, 1024, 1024),
          ("evaluation, N = 2.5e4", 25_000, 2048, 1024, 1024),
          ("serving index, N = 2e5", 200_000, 4096, 1024, 1024),
          ("serving index, N = 2e5, k = 4000", 200_000, 4096, 1024, 4000))


def top_k_probe(index: clusters.ClusterIndex, queries: jax.Array, probes: int, count: int) -> jax.Array:
  """The probe before the kernel (sparsejax <= 944e9a2): top_k over all clusters, members by searchsorted."""
  c = index.centroids
  probes = min(probes, c.shape[0])
  scores = jnp.dot(queries, c[:, :-2].T, precision="highest") + c[:, -2]
  scores = jnp.where(index.sizes > 0, scores, -jnp.inf)
  _, best = jax.lax.top_k(scores, probes)
  start, size = index.offsets[best], index.sizes[best]
  ends = jnp.cumsum(size, axis=1)
  j = jnp.arange(count, dtype=jnp.int32)
  which = jax.vmap(lambda e: jnp.searchsorted(e, j, side="right"))(ends)
  safe = jnp.minimum(which, probes - 1)
  pos = jnp.take_along_axis(start, safe, axis=1) + j - jnp.take_along_axis(ends - size, safe, axis=1)
  ids = index.rows[jnp.clip(pos, 0, index.rows.shape[0] - 1)]
  return jnp.where(which < probes, ids, -1)


def _median_ms(fn, args, calls: int) -> float:
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--calls", type=int, default=20, help="timed calls per form and round")
  parser.add_argument("--rounds", type=int, default=3, help="alternations of the two forms")
  parser.add_argument("--hidden", type=int, default=128, help="row width d")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  results = []
  for what, n, c, b, count in SHAPES:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(n, args.hidden)), jnp.float32)
    index = clusters.build_index(clusters.init_index(c, n, args.hidden), w, jnp.zeros((n,), jnp.float32),
                                 iterations=1, sample_per_cluster=16)
    h = jnp.asarray(np.maximum(rng.normal(size=(b, args.hidden)), 0), jnp.float32)
    probes = min(c, count)
    forms = {"kernel": jax.jit(clusters.probe, static_argnums=(2, 3)),
             "top_k": jax.jit(top_k_probe, static_argnums=(2, 3))}
    call_args = (index, h, probes, count)
    outs = {name: np.asarray(f(*call_args)) for name, f in forms.items()}  # compiles too
    same = bool(np.array_equal(outs["kernel"], outs["top_k"]))
    rounds = {name: [] for name in forms}
    for _ in range(args.rounds):
      for name, f in forms.items():
        rounds[name].append(_median_ms(f, call_args, args.calls))
    row = dict(what=what, rows=n, clusters=c, queries=b, count=count, probes=probes, same_ids=same,
               **{f"{name}_ms": statistics.median(v) for name, v in rounds.items()})
    row["speedup"] = row["top_k_ms"] / row["kernel_ms"]
    results.append(row)
    print(f"{what}: C = {c}, B = {b}, count = {count}: top_k {row['top_k_ms']:.2f} ms, kernel "
          f"{row['kernel_ms']:.2f} ms ({row['speedup']:.1f}x), same ids: {same}", flush=True)
  harness.write_json(args.json, dict(args=vars(args), results=results))


if __name__ == "__main__":
  main()
