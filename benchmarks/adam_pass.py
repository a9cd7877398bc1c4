"""Times one row-sparse Adam pass of an output layer with its input gradient (``combine=True``), alone.

The pass that dominates a sampled step where a batch's slots repeat rows (GCIDE cloze: N = 20,912, B = 128,
k = 1024, 6.4 slots per touched row). Ids are drawn per sample without repeats, from a Zipf-like distribution
(``--zipf`` > 0, the rows of frequent labels repeat across samples) or uniformly (``--zipf 0``). Prints the
minimum and median milliseconds of ``--repeats`` timings of ``--iters`` jitted, donated updates each.

To compare two builds on a noisy VM, run it in turn against each, several times:

  python benchmarks/adam_pass.py                                  # the cloze shape
  python benchmarks/adam_pass.py --num_labels 1000000 --zipf 0    # ~1 slot per touched row
  PYTHONPATH=/path/to/other/site-packages python benchmarks/adam_pass.py   # another build of sparsejax
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import optim
from sparsejax.optim import RowSparseAdamState, RowSparseGrad

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_shape_flags(parser, "num_labels", "batch_size", "active_k", "dim", "zipf")
  parser.add_argument("--iters", type=int, default=100, help="updates per timing")
  parser.add_argument("--repeats", type=int, default=7)
  harness.add_json_flag(parser)
  args = parser.parse_args()

  n, d, b, k = args.num_labels, args.dim, args.batch_size, args.active_k
  rng = np.random.default_rng(0)
  ids = harness.draw_ids(rng, n, b, k, args.zipf)
  slots_per_row = ids.size / len(np.unique(ids))
  params = (jnp.asarray(rng.normal(size=(n, d)), jnp.float32), jnp.zeros(n, jnp.float32))
  state = (RowSparseAdamState(jnp.zeros([], jnp.int32), jnp.zeros((n, d)), jnp.zeros((n, d))),
           RowSparseAdamState(jnp.zeros([], jnp.int32), jnp.zeros(n), jnp.zeros(n)))
  grad = RowSparseGrad(jnp.asarray(ids), jnp.asarray(rng.normal(size=(b, k)), jnp.float32),
                       jnp.asarray(rng.normal(size=(b, d)), jnp.float32))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state):
    new_params, new_state, _, dh = optim.apply_row_sparse_adam(params, state, grad, 1e-3, combine=True)
    return new_params, new_state, dh

  carry = [params, state]  # donated each call: the next call takes the new ones

  def call():
    carry[0], carry[1], dh = step(*carry)
    return dh

  ms = harness.time_calls(call, args.iters, args.repeats, warmup=5)
  result = dict(num_labels=n, batch_size=b, active_k=k, dim=d, zipf=args.zipf, slots_per_touched_row=slots_per_row,
                **harness.timing_summary(ms))
  print(f"N={n} B={b} k={k} d={d} ({slots_per_row:.1f} slots per touched row): Adam pass with dh "
        f"min {result['min_ms']:.2f} ms, median {result['median_ms']:.2f} ms")
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
