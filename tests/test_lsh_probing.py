"""Multi-probe LSH queries and the exact re-ranking of their candidates (sparsejax.index.probing) against
brute-force numpy references."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lsh_retrieval import _planted_layer, _recall_of_planted

from sparsejax import model
from sparsejax.index import from_config, lsh, mips, probing, tables
from sparsejax.model_config import ModelConfig
from sparsejax.network import SparseLayer
from sparsejax.settings import override


def _dwta_probes_ref(params, x, num_probes):
  """Each table's code, then the codes with one bin's winner replaced by its runner-up, smallest gap first
  (ties: the lower bin), among bins with two nonzero values; -1 padded."""
  idx = np.asarray(params.bin_idx)
  codes = np.asarray(lsh.lsh_hash(params, jnp.asarray(x)))
  L, bins, size = idx.shape
  bits = int(np.log2(size))
  out = np.full((len(x), L, num_probes), -1, np.int64)
  for q in range(len(x)):
    for table in range(L):
      out[q, table, 0] = codes[q, table]
      options = []
      for j in range(bins):
        values = x[q, idx[table, j]]
        nonzero = [t for t in range(size) if values[t] != 0]
        if len(nonzero) < 2:
          continue
        order = sorted(nonzero, key=lambda t: (-values[t], t))  # the first largest wins, as in the kernel
        win, runner = order[0], order[1]
        assert (codes[q, table] >> (bits * j)) & (size - 1) == win
        options.append((values[win] - values[runner], j, codes[q, table] ^ ((win ^ runner) << (bits * j))))
      for p, (_, _, code) in enumerate(sorted(options)[:num_probes - 1]):
        out[q, table, p + 1] = code
  return out


def test_dwta_probes_are_the_runner_up_bins_closest_first():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(20, 40)).astype(np.float32)
  x[rng.random(x.shape) < 0.4] = 0.0  # zeros never win a bin: some bins have a single or no candidate
  params = lsh.init_lsh(jax.random.key(1), lsh.LSHConfig("dwta", num_tables=5, num_bits=9), 40)
  codes = lsh.lsh_hash(params, jnp.asarray(x))
  for num_probes in (1, 3, 5):  # 5 > 1 + 3 bins: the last column is -1
    got = np.asarray(probing.probe_codes(params, jnp.asarray(x), codes, num_probes))
    np.testing.assert_array_equal(got, _dwta_probes_ref(params, x, num_probes))
  assert (got[..., 4] == -1).all() and (got[..., 1] >= 0).mean() > 0.9


def test_simhash_probes_flip_the_least_certain_bits_first():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(16, 24)).astype(np.float32)
  params = lsh.init_lsh(jax.random.key(2), lsh.LSHConfig("simhash", num_tables=4, num_bits=6), 24)
  codes = np.asarray(lsh.lsh_hash(params, jnp.asarray(x)))
  got = np.asarray(probing.probe_codes(params, jnp.asarray(x), jnp.asarray(codes), 4))
  margin = np.abs(np.einsum("bd,lkd->blk", x.astype(np.float64), np.asarray(params.projections, np.float64)))
  order = np.argsort(margin, axis=-1, kind="stable")[..., :3]
  np.testing.assert_array_equal(got[..., 0], codes)
  np.testing.assert_array_equal(got[..., 1:], codes[..., None] ^ (1 << order))


def _tables_of(rows, family="dwta", L=6, K=6, S=8):
  config = lsh.LSHConfig(family, num_tables=L, num_bits=K)
  params = lsh.init_lsh(jax.random.key(3), config, rows.shape[1])
  built = tables.build_tables(tables.init_tables(config, S, policy="reservoir", seed=5), params, jnp.asarray(rows))
  return params, built


def test_probed_candidates_are_counted_over_tables_and_probes():
  """Against a Counter over the probed buckets' filled slots (overflowing buckets included: S = 8 for about
  300 / 64 rows per bucket, with skew)."""
  rng = np.random.default_rng(2)
  rows = rng.normal(size=(300, 16)).astype(np.float32)
  x = rng.normal(size=(12, 16)).astype(np.float32)
  params, built = _tables_of(rows)
  probes = np.asarray(probing.probe_codes(params, jnp.asarray(x), lsh.lsh_hash(params, jnp.asarray(x)), 3))
  buckets, counts = np.asarray(built.buckets), np.asarray(built.counts)
  assert (counts > buckets.shape[2]).any()
  for count in (5, 40, 400):  # 400: more than any query finds (-1 after)
    got = np.asarray(probing.probed_candidates(built, jnp.asarray(probes), count))
    for q in range(len(x)):
      found = collections.Counter()
      for table in range(probes.shape[1]):
        for code in probes[q, table]:
          if code >= 0:
            found.update(int(i) for i in buckets[table, code, :min(counts[table, code], buckets.shape[2])] if i >= 0)
      ranked = [i for i, _ in sorted(found.items(), key=lambda item: (-item[1], item[0]))][:count]
      np.testing.assert_array_equal(got[q], ranked + [-1] * (count - len(ranked)))


@pytest.mark.parametrize("family", ["dwta", "simhash"])
def test_the_kernels_count_of_probed_buckets_is_the_references(family):
  """counted_by_kernel (the query kernel over the tables repeated once per probe) against the Counter of the
  probed buckets: distinct ids, by non-increasing count, every id found more often than the last one kept
  included, -1 after the last found; the same multiset of counts as probed_candidates (ties may order
  differently)."""
  rng = np.random.default_rng(7)
  rows = rng.normal(size=(300, 16)).astype(np.float32)
  x = rng.normal(size=(12, 16)).astype(np.float32)
  params, built = _tables_of(rows, family)
  probes = np.asarray(probing.probe_codes(params, jnp.asarray(x), lsh.lsh_hash(params, jnp.asarray(x)), 3))
  buckets, counts = np.asarray(built.buckets), np.asarray(built.counts)
  for count in (5, 40, 300):
    got = np.asarray(probing.counted_by_kernel(built, jnp.asarray(probes), count, 300, seed=3))
    reference = np.asarray(probing.probed_candidates(built, jnp.asarray(probes), count))
    for q in range(len(x)):
      found = collections.Counter()
      for table in range(probes.shape[1]):
        for code in set(probes[q, table]) if family == "simhash" else probes[q, table]:
          code = code if code >= 0 else probes[q, table, 0]
          found.update(int(i) for i in buckets[table, code, :min(counts[table, code], buckets.shape[2])] if i >= 0)
      kept = got[q][got[q] >= 0]
      assert len(set(kept)) == len(kept) == min(count, len(found)) and np.all(got[q][len(kept):] == -1)
      times = [found[int(i)] for i in kept]
      assert times == sorted(times, reverse=True)
      if kept.size:
        assert {i for i, n in found.items() if n > times[-1]} <= set(kept.tolist())
      if family == "simhash":  # no missing probes: the reference counts the same buckets
        assert sorted(times) == sorted(found[int(i)] for i in reference[q] if i >= 0)


def test_rerank_keeps_the_largest_exact_logits():
  rng = np.random.default_rng(3)
  w = rng.normal(size=(50, 8)).astype(np.float32)
  b = rng.normal(size=50).astype(np.float32)
  h = rng.normal(size=(6, 8)).astype(np.float32)
  candidates = np.stack([rng.permutation(50)[:20] for _ in range(6)]).astype(np.int32)
  candidates[:, 15:] = -1
  got = np.asarray(probing.rerank(jnp.asarray(candidates), jnp.asarray(h), jnp.asarray(w), jnp.asarray(b), 17))
  for q in range(6):
    ids = candidates[q, :15]
    logits = h[q].astype(np.float64) @ w[ids].T.astype(np.float64) + b[ids]
    np.testing.assert_array_equal(got[q], list(ids[np.argsort(-logits)]) + [-1, -1])


def _index_query(settings, w, b, h, k, labels=None):
  n, d = w.shape
  cfg = override(ModelConfig(10, n), hidden_dims=(d,), active_k=k, candidates="lsh", **settings)
  out = SparseLayer(jnp.asarray(w), jnp.asarray(b))
  built = from_config(cfg).init(*jax.random.split(jax.random.key(0)), out.w, out.b)
  state = model.SlideState(*([None] * len(model.SlideState._fields)))._replace(out=out, index=built)
  active, from_index = jax.jit(lambda s, hh, lab: model.query_active(s, hh, config=cfg, k=k, num_rows=n,
                                                                     labels=lab, seed=1))(state, jnp.asarray(h), labels)
  return cfg, built, np.asarray(active), np.asarray(from_index)


def test_probed_and_reranked_query_against_brute_force():
  """The index's query without labels (sampled inference) with probes and re-ranking: the best k of the
  rerank x k ids found most often, by their exact logits (numpy), then distinct random ids."""
  rng = np.random.default_rng(4)
  w = rng.normal(size=(2000, 32)).astype(np.float32)
  b = rng.normal(size=2000).astype(np.float32)
  h = rng.normal(size=(16, 32)).astype(np.float32)
  k = 24
  cfg, built, active, from_index = _index_query(dict(lsh_probes=3, lsh_rerank=4), w, b, h, k)
  xq = mips.augment_queries(jnp.asarray(h))
  found = np.asarray(probing.counted_by_kernel(
      built.tables, probing.probe_codes(built.hash_functions, xq, lsh.lsh_hash(built.hash_functions, xq), 3), 4 * k,
      2000, seed=1))  # the query's seed: the same ids among those found equally often
  for q in range(16):
    assert len(set(active[q])) == k and active[q].max() < 2000
    ids = found[q][found[q] >= 0]
    logits = h[q].astype(np.float64) @ w[ids].T.astype(np.float64) + b[ids]
    best = list(ids[np.argsort(-logits)][:k])
    assert from_index[q] == len(best)
    np.testing.assert_array_equal(active[q, :len(best)], best)


def test_a_training_query_reads_one_bucket_per_table_whatever_the_probes():
  """A query with labels (a training step's) reads one bucket per table in the kernel, even where --lsh_probes and
  --lsh_rerank are set for sampled inference: labels first, then the kernel's candidates in its order (at most
  max_from_index of them: --random_negatives), then distinct random ids."""
  rng = np.random.default_rng(5)
  w = rng.normal(size=(2000, 32)).astype(np.float32)
  b = rng.normal(size=2000).astype(np.float32)
  h = rng.normal(size=(16, 32)).astype(np.float32)
  labels = np.full((16, 2), -1, np.int32)
  labels[:, 0] = rng.choice(2000, 16)
  k = 24
  n = 2000
  cfg = override(ModelConfig(10, n), hidden_dims=(32,), active_k=k, candidates="lsh", lsh_probes=3,
                 lsh_rerank=4)
  out = SparseLayer(jnp.asarray(w), jnp.asarray(b))
  built = from_config(cfg).init(*jax.random.split(jax.random.key(0)), out.w, out.b)
  state = model.SlideState(*([None] * len(model.SlideState._fields)))._replace(out=out, index=built)
  xq = mips.augment_queries(jnp.asarray(h))
  for cap in (None, 10):
    active, from_index = (np.asarray(a) for a in model.query_active(
        state, jnp.asarray(h), config=cfg, k=k, num_rows=n, labels=jnp.asarray(labels), seed=1,
        max_from_index=cap))
    found, num_found = (np.asarray(a) for a in tables.lsh_query(built.tables, built.hash_functions, xq,
                                                                k=cap or k, num_rows=n, seed=1))
    for q in range(16):
      assert active[q, 0] == labels[q, 0] and len(set(active[q])) == k and active[q].max() < n
      want = [i for i in found[q, :num_found[q]] if i != labels[q, 0]][:k - 1]
      assert from_index[q] == len(want) <= (cap or k)
      np.testing.assert_array_equal(active[q, 1:1 + len(want)], want)


def test_more_probes_find_a_superset_and_the_planted_rows():
  """Probing reads each table's own bucket first: a query's ids at 3 probes include those at 1 (when all are
  kept). On the planted layer of test_lsh_retrieval (k = 64 of 4,096 rows), re-ranked probes find the planted
  best row more often than one probe (DWTA, measured: 0.72 at 1 probe, 0.93 at 3, 0.98 at 3 with rerank 4)."""
  rng = np.random.default_rng(5)
  rows = rng.normal(size=(500, 16)).astype(np.float32)
  x = jnp.asarray(rng.normal(size=(10, 16)).astype(np.float32))
  params, built = _tables_of(rows)
  one, three = (np.asarray(probing.probed_candidates(
      built, probing.probe_codes(params, x, lsh.lsh_hash(params, x), p), 500)) for p in (1, 3))
  for q in range(10):
    assert set(one[q][one[q] >= 0]) < set(three[q][three[q] >= 0])
  w, b, h, planted = _planted_layer(4096, 64, 400)
  base = _recall_of_planted(dict(lsh_family="dwta", lsh_probes=1, lsh_rerank=0), w, b, h, planted, k=64)
  probed = _recall_of_planted(dict(lsh_family="dwta", lsh_probes=3, lsh_rerank=4), w, b, h, planted, k=64)
  assert probed >= base + 0.1, (probed, base)


@pytest.mark.parametrize("family", ["dwta", "simhash"])
def test_one_probe_is_the_kernel_query(family):
  """lsh_probes=1 without re-ranking is today's kernel query; with one probe, the jnp count finds the same ids
  (the kernel breaks ties in a seeded random order, the count by id: compared as sets of the ids found)."""
  rng = np.random.default_rng(6)
  rows = rng.normal(size=(400, 16)).astype(np.float32)
  x = jnp.asarray(rng.normal(size=(8, 16)).astype(np.float32))
  params, built = _tables_of(rows, family)
  active, from_tables = tables.lsh_query(built, params, x, k=400, num_rows=400)
  counted = np.asarray(probing.probed_candidates(built, probing.probe_codes(params, x, lsh.lsh_hash(params, x), 1),
                                                 400))
  for q in range(8):
    assert set(np.asarray(active[q, :from_tables[q]])) == set(counted[q][counted[q] >= 0])


def test_a_reranked_query_over_fewer_valid_rows_than_it_counts():
  """rerank x k may exceed the valid rows (a padded shard's, traced): the probed count is bounded by the rows'
  length, and every id found or drawn is a valid row (it had asked the kernel for more ids than num_rows)."""
  rng = np.random.default_rng(8)
  n, valid, k = 100, 60, 40
  w = rng.normal(size=(n, 16)).astype(np.float32)
  b = rng.normal(size=n).astype(np.float32)
  cfg = override(ModelConfig(10, n), hidden_dims=(16,), active_k=k, candidates="lsh", lsh_probes=3,
                 lsh_rerank=4)
  out = SparseLayer(jnp.asarray(w), jnp.asarray(b))
  built = from_config(cfg).init(*jax.random.split(jax.random.key(0)), out.w, out.b, valid)
  state = model.SlideState(*([None] * len(model.SlideState._fields)))._replace(out=out, index=built)
  h = jnp.asarray(rng.normal(size=(8, 16)).astype(np.float32))
  active, _ = jax.jit(lambda s, hh, m: model.query_active(s, hh, config=cfg, k=k, num_rows=m))(
      state, h, jnp.int32(valid))
  active = np.asarray(active)
  assert np.all((active >= 0) & (active < valid))
  assert all(len(set(row)) == k for row in active)
