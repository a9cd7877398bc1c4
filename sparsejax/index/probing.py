"""Multi-probe queries of LSH tables and the exact re-ranking of their candidates (issue 32), in ``jnp``.

A query's own bucket in each table holds only the rows that agree with it on every bin (DWTA) or bit (SimHash) of
the code. At the cosines of a trained layer (0.2-0.33 between a query and its best row, after centring and the
MIPS reduction) one disagreement is the common case, so each table is also probed at the query's nearest other
codes (multi-probe LSH, Lv et al. 2007): for DWTA the code with one bin's winner replaced by that bin's runner-up,
for the bins whose two largest values are closest; for SimHash the code with one bit flipped, for the bits whose
projections are closest to zero. The ids of all probed buckets are ranked by how many probes returned them (over
tables and probes together), and optionally the best of them re-ranked by their exact logits
(``O(candidates d)`` per query: a gather, never ``O(N d)``).

:func:`probed_candidates` counts with a sort of the ``L P S`` probed slots per query in XLA (the reference, lower
ids first among equals); :func:`counted_by_kernel` gives the same counts from the one-probe query kernel over the
tables repeated ``P`` times (ties in the kernel's seeded order): what the index's queries use. Either reads all
``L P S`` slots per query, which is the query's cost (benchmarks/results/HISTORY.md, "Hyperplanes drawn from the
rows").
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import ops, selection
from sparsejax.index import lsh
from sparsejax.index.tables import HashTables, query_codes

_NO_ID = np.iinfo(np.int32).max  # an empty probed slot: sorts after every id


def probe_codes(params: lsh.LSHParams, x: jax.Array, codes: jax.Array, num_probes: int) -> jax.Array:
  """Each table's own code and its ``num_probes - 1`` nearest other codes.

  Args:
    params: the hash functions (:mod:`sparsejax.index.lsh`).
    x: ``[B, d]`` float32 the queries as hashed.
    codes: ``[B, L]`` int32 their codes, ``lsh.lsh_hash(params, x)`` (the kernel's, so that the first probe is
      exactly the bucket a one-probe query reads).
    num_probes: ``P >= 1`` codes per table.

  Returns:
    ``[B, L, P]`` int32: ``codes``, then codes that differ in one bin (DWTA: the bin's runner-up; bins with the
    smallest gap between their two largest values first) or one bit (SimHash: smallest ``|projection|``
    first); -1 where a table has fewer (a DWTA code has ``K / 3`` bins; a bin with fewer than two nonzero
    values has no runner-up: the kernel skips zeros).
  """
  if num_probes < 1:
    raise ValueError(f"probe_codes: num_probes must be >= 1, got {num_probes}")
  if isinstance(params, lsh.DWTAParams):
    values = x[:, params.bin_idx]  # [B, L, bins, size]
    # The kernel's winner: the first largest nonzero value (zeros and NaN never win).
    values = jnp.where((values != 0) & ~jnp.isnan(values), values, -jnp.inf)
    best, pos = jax.lax.top_k(values, 2)
    gap = jnp.where(jnp.isfinite(best[..., 1]), best[..., 0] - best[..., 1], jnp.inf)
    shift = int(math.log2(params.bin_idx.shape[2])) * jnp.arange(params.bin_idx.shape[1])
    neighbours = codes[..., None] ^ ((pos[..., 0] ^ pos[..., 1]) << shift)  # [B, L, bins]
  else:
    projections = jnp.einsum("bd,lkd->blk", x, params.projections)
    gap = jnp.abs(projections)
    neighbours = codes[..., None] ^ (1 << jnp.arange(params.projections.shape[1]))
  extra = min(num_probes - 1, gap.shape[-1])
  if extra == 0:
    probes = codes[..., None]
  else:
    _, nearest = selection.row_topk(-gap.reshape(-1, gap.shape[-1]), extra)  # smallest gaps, lower one on ties
    nearest = nearest.reshape(gap.shape[:-1] + (extra,))
    usable = jnp.isfinite(jnp.take_along_axis(gap, nearest, axis=-1))
    probes = jnp.concatenate(
        [codes[..., None], jnp.where(usable, jnp.take_along_axis(neighbours, nearest, axis=-1), -1)], axis=-1)
  missing = num_probes - probes.shape[-1]
  return jnp.pad(probes, ((0, 0), (0, 0), (0, missing)), constant_values=-1).astype(jnp.int32)


def probed_candidates(tables: HashTables, probes: jax.Array, count: int) -> jax.Array:
  """The ids in the probed buckets, most often found first.

  Args:
    tables: the tables (``buckets [L, 2^K, S]``).
    probes: ``[B, L, P]`` int32 codes per table (:func:`probe_codes`), -1 to skip.
    count: ids kept per query, ``1 <= count``.

  Returns:
    ``[B, count]`` int32 distinct ids by decreasing number of probed buckets that hold them, the lower id first
    among equals; -1 after the last.
  """
  L, _, S = tables.buckets.shape
  table = jnp.arange(L)[None, :, None]
  code = jnp.maximum(probes, 0)
  slots = tables.buckets[table, code]  # [B, L, P, S]
  filled = jnp.minimum(tables.counts[table, code], S)  # (slots past a bucket's count are not read, as the kernel)
  held = (probes >= 0)[..., None] & (jnp.arange(S) < filled[..., None]) & (slots >= 0)
  ids = jnp.sort(jnp.where(held, slots, _NO_ID).reshape(probes.shape[0], -1), axis=1)
  m = ids.shape[1]
  starts = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  # Each run of equal ids (the empty slots' last): its length is the distance from its start to the next start.
  position = jnp.arange(m)
  next_start = jax.lax.cummin(jnp.where(starts, position, m)[:, ::-1], axis=1)[:, ::-1]
  run_end = jnp.concatenate([next_start[:, 1:], jnp.full_like(ids[:, :1], m)], axis=1)
  found = jnp.where(starts & (ids != _NO_ID), run_end - position, -1).astype(jnp.float32)
  if count > m:
    found = jnp.pad(found, ((0, 0), (0, count - m)), constant_values=-1.0)
    ids = jnp.pad(ids, ((0, 0), (0, count - m)), constant_values=_NO_ID)
  times, column = selection.row_topk(found, count)  # ties to the lower column: the lower id
  return jnp.where(times > 0, jnp.take_along_axis(ids, column, axis=1), -1)


def counted_by_kernel(tables: HashTables, probes: jax.Array, count: int, num_rows, seed=0) -> jax.Array:
  """:func:`probed_candidates` by the table query kernel: the ``L`` tables repeated ``P`` times (a copy of the
  buckets per call, ``P`` times their bytes), each repetition read at one probe.

  Args:
    tables: the tables (``buckets [L, 2^K, S]``).
    probes: ``[B, L, P]`` int32 codes per table (:func:`probe_codes`); -1 (no such probe) reads the table's own
      bucket again.
    count: ids kept per query, ``1 <= count <= num_rows``.
    num_rows: the rows' count (the kernel's bound on ids).
    seed: the kernel's seed (the order of ids found equally often).

  Returns:
    ``[B, count]`` int32 distinct ids by decreasing number of probed buckets that hold them; -1 after the last.
  """
  num_probes = probes.shape[2]
  probes = jnp.where(probes >= 0, probes, probes[..., :1])
  repeated = HashTables(jnp.tile(tables.buckets, (num_probes, 1, 1)), jnp.tile(tables.counts, (num_probes, 1)),
                        tables.seed, policy=tables.policy)
  codes = jnp.swapaxes(probes, 1, 2).reshape(probes.shape[0], -1)  # [B, P L]: repetition p reads probe p
  ids, found = query_codes(repeated, codes, k=count, num_rows=num_rows, seed=seed)
  return jnp.where(jnp.arange(count) < found[:, None], ids, -1)


def rerank(candidates: jax.Array, h: jax.Array, w: jax.Array, b: jax.Array, count: int) -> jax.Array:
  """The ``count`` candidates with the largest exact logits ``<h, w_i> + b_i``, largest first.

  Args:
    candidates: ``[B, C]`` int32 ids, -1 to skip.
    h: ``[B, d]`` float32 queries.
    w: ``[N, d]`` rows (float32 or bfloat16).
    b: ``[N]`` float32 biases.
    count: ``1 <= count <= C``.

  Returns:
    ``[B, count]`` int32 ids, -1 after the last candidate.
  """
  logits = jnp.where(candidates >= 0, ops.gather_dot(h, w, candidates, b.astype(jnp.float32)), -jnp.inf)
  best, column = selection.row_topk(logits, count)
  return jnp.where(best > -jnp.inf, jnp.take_along_axis(candidates, column, axis=1), -1)
