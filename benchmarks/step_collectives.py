"""Latency of the sparse step's collectives: the exchange as it is against the earlier three-collective form.

The sparse model-parallel step exchanges O(B d) numbers, so over gloo its collectives cost their latency, not
their bytes. This times, in one jitted ``shard_map`` per variant, the two rounds of one step with the step's
shapes (``B`` samples, hidden width ``d``):

* ``one_gather_one_psum`` (the step now): one all-gather of ``[4, B]`` softmax partials, then one psum of
  ``dh [B, d]`` with the step's metric packed into the same array.
* ``pmax_then_tuple_psums`` (the step before): a pmax of ``[B]``, a psum of a tuple of three ``[B]`` arrays, then
  a psum of the tuple ``(dh, metric)``. XLA's CPU all-reduce runs one gloo call per tuple element, each paying the
  round trip.

Run under the launcher, P local processes (loopback)::

  python -m sparsejax.distributed.launch -n 4 benchmarks/step_collectives.py --json=/tmp/coll_p4.json

Each variant: ``--calls`` timed calls after a warm-up, alternating the variants ``--rounds`` times; reported per
variant: the median over rounds of each round's median call, and the p10.
"""

import json
import time

import numpy as np

from sparsejax.shard import Shard

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_launcher_flags(parser)
  parser.add_argument("--batch", type=int, default=128, help="samples per step (B)")
  parser.add_argument("--hidden", type=int, default=128, help="hidden width (d)")
  parser.add_argument("--calls", type=int, default=200, help="timed calls per variant and round")
  parser.add_argument("--rounds", type=int, default=3, help="alternations of the variants")
  harness.add_json_flag(parser, help="write the results here (process 0, with the machine)")
  args = parser.parse_args()
  from sparsejax.distributed import process_group
  process_group.initialize(args.coordinator_address, args.num_processes, args.process_id)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from sparsejax.distributed import sharding
  from sparsejax.distributed.sharding import AXIS

  mesh = sharding.make_mesh()
  B, d = args.batch, args.hidden
  shard = Shard(AXIS)

  def now(logits, dh):
    partials = shard.all_gather(jnp.stack([jnp.max(logits, 1), jnp.sum(logits, 1), logits[:, 0], logits[:, 1]]))
    dh, metric = shard.psum_packed(dh * jnp.sum(partials[:, 1], axis=0)[:, None], jnp.mean(dh))
    return dh + metric

  def before(logits, dh):
    m = jax.lax.pmax(jnp.max(logits, 1), AXIS)
    a, b, c = jax.lax.psum((jnp.sum(logits - m[:, None], 1), logits[:, 0], logits[:, 1]), AXIS)
    dh, metric = jax.lax.psum((dh * (a + b + c)[:, None], jnp.mean(dh)), AXIS)
    return dh + metric

  sharding = NamedSharding(mesh, P(AXIS))
  logits = jax.make_array_from_callback((B * mesh.size, 64), sharding, lambda i: np.ones((B, 64), np.float32))
  dh = jax.make_array_from_callback((B * mesh.size, d), sharding, lambda i: np.ones((B, d), np.float32))
  variants = {name: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS),
                                          check_vma=False))
              for name, fn in (("one_gather_one_psum", now), ("pmax_then_tuple_psums", before))}
  times = {name: [] for name in variants}
  for _ in range(args.rounds):
    for name, fn in variants.items():
      for _ in range(20):
        fn(logits, dh).block_until_ready()
      calls = []
      for _ in range(args.calls):
        t = time.perf_counter()
        fn(logits, dh).block_until_ready()
        calls.append(time.perf_counter() - t)
      times[name].append(calls)
  result = {"processes": mesh.size, "batch": B, "hidden": d, "calls": args.calls, "rounds": args.rounds,
            "variants": {}}
  for name, rounds in times.items():
    result["variants"][name] = {"median_ms": float(np.median([np.median(r) for r in rounds]) * 1e3),
                                "p10_ms": float(np.percentile(np.concatenate(rounds), 10) * 1e3)}
  result["before_over_now"] = (result["variants"]["pmax_then_tuple_psums"]["median_ms"]
                               / result["variants"]["one_gather_one_psum"]["median_ms"])
  if jax.process_index() == 0:
    print(json.dumps(result), flush=True)
    harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
