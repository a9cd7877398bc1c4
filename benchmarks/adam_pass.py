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

import argparse
import functools
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import optim
from sparsejax.optim import RowSparseAdamState, RowSparseGrad


def draw_ids(rng: np.random.Generator, num_labels: int, batch_size: int, active_k: int, zipf: float) -> np.ndarray:
  """``[batch_size, active_k]`` int32 ids, distinct within a sample, drawn with probability ~ 1 / rank^zipf
  (the rows of frequent labels repeat across samples), or uniformly for ``zipf`` = 0."""
  p = None
  if zipf > 0:
    p = 1.0 / np.arange(1, num_labels + 1) ** zipf
    p /= p.sum()
  return np.stack([rng.choice(num_labels, active_k, replace=False, p=p) for _ in range(batch_size)]).astype(np.int32)


def time_calls(call, iters: int, repeats: int, warmup: int = 1) -> list[float]:
  """Milliseconds per ``call()`` (which returns what to wait for), one figure per repeat of ``iters`` calls,
  after ``warmup`` calls."""
  for _ in range(warmup):
    out = call()
  jax.block_until_ready(out)
  ms = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = call()
    jax.block_until_ready(out)
    ms.append((time.perf_counter() - start) / iters * 1e3)
  return ms


def timing_summary(ms: list[float]) -> dict:
  """``min_ms``, ``median_ms`` and every figure ``ms`` of :func:`time_calls`, as the benchmarks' JSON holds them."""
  return dict(min_ms=min(ms), median_ms=float(np.median(ms)), ms=ms)


def checksum(*arrays) -> str:
  """16 hex digits of the SHA-256 of the arrays' bytes, in turn: equal outputs of two builds, equal checksums."""
  digest = hashlib.sha256()
  for a in arrays:
    digest.update(np.asarray(a).tobytes())
  return digest.hexdigest()[:16]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--num_labels", type=int, default=20_912)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--active_k", type=int, default=1024)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--zipf", type=float, default=0.6, help="id frequency ~ 1 / rank^zipf; 0: uniform")
  parser.add_argument("--iters", type=int, default=100, help="updates per timing")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  n, d, b, k = args.num_labels, args.dim, args.batch_size, args.active_k
  rng = np.random.default_rng(0)
  ids = draw_ids(rng, n, b, k, args.zipf)
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

  ms = time_calls(call, args.iters, args.repeats, warmup=5)
  result = dict(num_labels=n, batch_size=b, active_k=k, dim=d, zipf=args.zipf, slots_per_touched_row=slots_per_row,
                **timing_summary(ms))
  print(f"N={n} B={b} k={k} d={d} ({slots_per_row:.1f} slots per touched row): Adam pass with dh "
        f"min {result['min_ms']:.2f} ms, median {result['median_ms']:.2f} ms")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
