"""Times exact inference alone: ``inference.exact_topk``, the top outputs of a batch of queries over all N rows.

Exact inference scores every output row (a ``[n, d] x [d, N]`` matmul, ``--row_chunk`` rows at a time) and keeps
each query's best ``--top``: evaluation (exact P@k, the retrieval diagnostics' exact top 10), ``sparsejax-predict``
and the dense baseline all go through it. Random normal rows and queries; prints the minimum and median
milliseconds of ``--repeats`` calls per (queries, row chunk) and a checksum of the ids, so that two builds can be
compared in turn on this noisy VM (same checksum: the same top ids):

  python benchmarks/exact_topk.py                                   # N = 2e5, 1,024 and 128 queries
  python benchmarks/exact_topk.py --row_chunk 65536 16384 4096      # the chunk size
  PYTHONPATH=/path/to/other/site-packages python benchmarks/exact_topk.py   # another build
"""

import functools

import jax.numpy as jnp
import numpy as np

from sparsejax import inference

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_shape_flags(parser, "num_labels", "dim", num_labels=200_000)
  parser.add_argument("--queries", type=int, nargs="+", default=[1024, 128])
  parser.add_argument("--row_chunk", type=int, nargs="+", default=[None],
                      help="output rows per step (default: exact_topk's own default)")
  parser.add_argument("--top", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  harness.add_json_flag(parser)
  args = parser.parse_args()

  n, d = args.num_labels, args.dim
  rng = np.random.default_rng(0)
  weight = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=n), jnp.float32)
  result = dict(num_labels=n, dim=d, top=args.top, runs=[])
  for b in args.queries:
    h = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
    for chunk in args.row_chunk:
      kwargs = {} if chunk is None else {"row_chunk": chunk}
      call = functools.partial(inference.exact_topk, h, weight, bias, args.top, **kwargs)
      ids = harness.checksum(call()[1])
      ms = harness.time_calls(call, 1, args.repeats)
      result["runs"].append(dict(queries=b, row_chunk=chunk, **harness.timing_summary(ms), checksum=ids))
      print(f"N={n} d={d} top {args.top}: {b} queries, row_chunk {chunk or 'default'}: min {min(ms):.1f} ms, "
            f"median {np.median(ms):.1f} ms (ids {ids})")
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
