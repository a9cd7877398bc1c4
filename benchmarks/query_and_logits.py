"""Times the two per-sample kernels of a sampled step's forward, alone: building the active sets and their logits.

- ``merge_candidates``: each sample's active set of ``k`` distinct ids from its labels, ``--candidates`` ranked
  candidates (as the clustered index's probe returns them) and a random fill; the set of ids already taken is
  the kernel's inner loop.
- ``gather_dot``: the logits ``<h[b], W[ids[b, j]]> + bias`` of those sets (``sparse_logits``' forward).

At the GCIDE cloze shape by default (N = 20,912, B = 128, k = 1024, d = 128, half of each set from the
index). Ids are drawn per sample without repeats, Zipf-like, by ``harness.draw_ids``. Prints the minimum and
median milliseconds of ``--repeats`` timings of ``--iters`` calls each, and a checksum of the outputs, so that
two builds can be compared in turn on this noisy VM (same checksum: same outputs):

  python benchmarks/query_and_logits.py
  python benchmarks/query_and_logits.py --num_labels 1000000 --zipf 0
  PYTHONPATH=/path/to/other/site-packages python benchmarks/query_and_logits.py   # another build
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import ops
from sparsejax.index import clusters

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_shape_flags(parser, "num_labels", "batch_size", "active_k", "dim", "zipf")
  parser.add_argument("--candidates", type=int, default=512, help="ranked candidates per sample (from the index)")
  parser.add_argument("--iters", type=int, default=100, help="calls per timing")
  parser.add_argument("--repeats", type=int, default=7)
  harness.add_json_flag(parser)
  args = parser.parse_args()

  n, d, b, k, c = args.num_labels, args.dim, args.batch_size, args.active_k, args.candidates
  rng = np.random.default_rng(0)
  ids = harness.draw_ids(rng, n, b, k, args.zipf)
  candidates = jnp.asarray(ids[:, :c])
  labels = jnp.asarray(ids[:, -1:])
  weight = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=n), jnp.float32)
  h = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)

  merge = jax.jit(lambda cand, lab: clusters.merge_candidates(cand, k=k, num_rows=n, labels=lab, seed=3,
                                                              max_from_candidates=c))
  active = merge(candidates, labels)[0]
  logits = jax.jit(ops.gather_dot)
  outputs = {"merge_candidates": active, "gather_dot": logits(h, weight, active, bias)}
  result = dict(num_labels=n, batch_size=b, active_k=k, candidates=c, dim=d, zipf=args.zipf, kernels={})
  for name, fn, fn_args in (("merge_candidates", merge, (candidates, labels)),
                            ("gather_dot", logits, (h, weight, active, bias))):
    ms = harness.time_calls(functools.partial(fn, *fn_args), args.iters, args.repeats)
    output_sum = harness.checksum(outputs[name])
    result["kernels"][name] = dict(**harness.timing_summary(ms), checksum=output_sum)
    print(f"N={n} B={b} k={k} d={d}: {name} min {min(ms):.3f} ms, median {np.median(ms):.3f} ms "
          f"(outputs {output_sum})")
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
