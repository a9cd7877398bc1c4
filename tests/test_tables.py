"""Hash tables: insertion against a brute-force reference, queries' contract."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.index import lsh, tables


def _setup(N=300, d=16, L=6, bits=4, S=8, policy="fifo", seed=0):
  rng = np.random.default_rng(seed)
  W = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
  cfg = lsh.LSHConfig("simhash", L, bits)
  params = lsh.init_lsh(jax.random.key(seed), cfg, d)
  t = tables.build_tables(tables.init_tables(cfg, S, policy=policy), params, W)
  return W, params, t


def _fifo_reference(codes, ids, L, NB, S, buckets=None, counts=None):
  buckets = np.full((L, NB, S), -1) if buckets is None else buckets.copy()
  counts = np.zeros((L, NB), int) if counts is None else counts.copy()
  for code_row, i in zip(codes, ids):
    for l in range(L):
      c = code_row[l]
      if i in buckets[l, c, :min(counts[l, c], S)]:
        continue
      buckets[l, c, counts[l, c] % S] = i
      counts[l, c] += 1
  return buckets, counts


def test_fifo_build_and_insert_match_reference():
  W, params, t = _setup(S=4)  # 300 rows into 16 buckets of 4: rings wrap
  codes = np.asarray(lsh.lsh_hash(params, W))
  ref_b, ref_c = _fifo_reference(codes, range(300), 6, 16, 4)
  np.testing.assert_array_equal(t.buckets, ref_b)
  np.testing.assert_array_equal(t.counts, ref_c)
  # Re-insert changed rows 5 and 7 (and 9 unchanged: no duplicate), skip a -1.
  new_rows = W[jnp.array([5, 7, 9, 0])].at[:2].multiply(-1.0)
  ids = jnp.array([5, 7, 9, -1], jnp.int32)
  t2 = tables.insert_rows(t, params, new_rows, ids, 300)
  new_codes = np.asarray(lsh.lsh_hash(params, new_rows))
  ref_b, ref_c = _fifo_reference(new_codes[:3], [5, 7, 9], 6, 16, 4, ref_b, ref_c)
  np.testing.assert_array_equal(t2.buckets, ref_b)
  np.testing.assert_array_equal(t2.counts, ref_c)


def test_insert_skips_row_already_in_bucket():
  W, params, t = _setup(S=64)  # buckets never fill
  t2 = tables.insert_rows(t, params, W[:10], jnp.arange(10, dtype=jnp.int32), 300)
  np.testing.assert_array_equal(t2.buckets, t.buckets)
  np.testing.assert_array_equal(t2.counts, t.counts)


def test_reservoir_keeps_a_uniform_sample():
  """One bucket offered rows 0..n-1: reservoir keeps early and late rows alike, FIFO only the last."""
  n, S, L = 400, 8, 300
  codes = jnp.zeros((n, L), jnp.int32)
  ids = jnp.arange(n, dtype=jnp.int32)
  cfg = lsh.LSHConfig("simhash", L, 1)
  kept = {}
  for policy in ("reservoir", "fifo"):
    t = tables.init_tables(cfg, S, policy=policy, seed=3)
    t = tables._insert(t, codes, ids, n, reset=True)
    assert np.all(np.asarray(t.counts[:, 0]) == n)
    kept[policy] = np.asarray(t.buckets[:, 0, :])
  assert set(kept["fifo"].ravel()) == set(range(n - S, n))
  res = kept["reservoir"]
  assert all(len(set(row)) == S for row in res)
  early = np.isin(res, np.arange(n // 2)).mean()
  assert 0.4 < early < 0.6, early  # half the rows are "early": kept half the time


def test_query_contract():
  N, k = 300, 40
  W, params, t = _setup()
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(20, 16)), jnp.float32)
  labels = rng.integers(0, N, size=(20, 3)).astype(np.int32)
  labels[0, 1] = labels[0, 0]  # duplicate label
  labels[1, 2] = -1  # padding
  active, n_tab = tables.lsh_query(t, params, q, k=k, num_rows=N, labels=jnp.asarray(labels), seed=7)
  active, n_tab = np.asarray(active), np.asarray(n_tab)
  codes = np.asarray(lsh.lsh_hash(params, q))
  buckets, counts = np.asarray(t.buckets), np.asarray(t.counts)
  for b in range(20):
    row = active[b]
    assert len(set(row)) == k and row.min() >= 0 and row.max() < N
    want_labels = list(dict.fromkeys(y for y in labels[b] if y >= 0))
    assert list(row[:len(want_labels)]) == want_labels
    # Candidate frequencies, brute force.
    freq = Counter()
    for l in range(6):
      c = codes[b, l]
      freq.update(int(i) for i in buckets[l, c, :min(counts[l, c], 8)] if i >= 0)
    nl = len(want_labels)
    from_tables = row[nl:nl + n_tab[b]]
    assert n_tab[b] == min(k - nl, len(set(freq) - set(want_labels)))
    f = [freq[int(i)] for i in from_tables]
    assert all(x > 0 for x in f)
    assert f == sorted(f, reverse=True)  # ranked by table count
    if len(f):  # nothing left out that was returned by more tables
      left_out = set(freq) - set(from_tables) - set(want_labels)
      assert all(freq[i] <= f[-1] for i in left_out)
    assert not set(row[nl + n_tab[b]:]) & set(freq)  # fill is not from the tables


def test_query_deterministic_by_seed_and_k_equal_n():
  N = 300
  W, params, t = _setup()
  q = jnp.asarray(np.random.default_rng(2).normal(size=(8, 16)), jnp.float32)
  a1, _ = tables.lsh_query(t, params, q, k=200, num_rows=N, seed=1)
  a2, _ = tables.lsh_query(t, params, q, k=200, num_rows=N, seed=1)
  a3, _ = tables.lsh_query(t, params, q, k=200, num_rows=N, seed=2)
  np.testing.assert_array_equal(a1, a2)
  assert not np.array_equal(a1, a3)
  full, _ = jax.jit(lambda t, q: tables.lsh_query(t, params, q, k=N, num_rows=N, seed=3))(t, q)
  assert all(sorted(r) == list(range(N)) for r in np.asarray(full))


def test_query_errors():
  N = 300
  W, params, t = _setup()
  q = jnp.zeros((2, 16))
  with pytest.raises(ValueError, match=r"k = 301 must be in \[1, num_rows = 300\]"):
    tables.lsh_query(t, params, q, k=301, num_rows=N)
  with pytest.raises(Exception, match="row 1 of 'labels' has more distinct labels than k = 2"):
    jax.block_until_ready(tables.lsh_query(t, params, q, k=2, num_rows=N,
                                           labels=jnp.array([[1, -1, -1], [1, 2, 3]], jnp.int32)))
  with pytest.raises(Exception, match=r"'labels' has id 300 .*N = 300"):
    jax.block_until_ready(tables.lsh_query(t, params, q, k=5, num_rows=N, labels=jnp.array([[300], [0]], jnp.int32)))
  with pytest.raises(Exception, match="built for a layer of another size"):
    jax.block_until_ready(tables.lsh_query(t, params, q, k=5, num_rows=100))
  other = lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("simhash", 6, 5), 16)
  with pytest.raises(ValueError, match="hash functions give L = 6 codes of 5 bits"):
    tables.lsh_query(t, other, q, k=5, num_rows=N)
  with pytest.raises(Exception, match=r"'codes' has id 16 .*num_buckets = 16"):
    jax.block_until_ready(tables.query_codes(t, jnp.full((2, 6), 16, jnp.int32), k=5, num_rows=N))
  with pytest.raises(Exception, match=r"'ids' has id 300"):
    jax.block_until_ready(tables.insert_rows(t, params, W[:1], jnp.array([300], jnp.int32), N))
  empty, n = tables.lsh_query(t, params, jnp.zeros((0, 16)), k=5, num_rows=N)
  assert empty.shape == (0, 5) and n.shape == (0,)


def test_insert_in_place_when_donated():
  W, params, t = _setup()
  ptr = t.buckets.unsafe_buffer_pointer()
  insert = jax.jit(lambda t, rows, ids: tables.insert_rows(t, params, rows, ids, 300), donate_argnums=0)
  t2 = insert(t, W[:4], jnp.arange(4, dtype=jnp.int32))
  assert t2.buckets.unsafe_buffer_pointer() == ptr


def test_default_table_memory_proportional_to_n():
  S = tables.default_bucket_size()
  sizes = {}
  for N in (10**5, 10**6, 8 * 10**6):
    cfg = tables.default_lsh_config(N)
    sizes[N] = cfg.num_tables * 2**cfg.num_bits * S * 4
  assert 0.5 < (sizes[10**6] / sizes[10**5]) / 10 < 2
  assert 0.5 < (sizes[8 * 10**6] / sizes[10**6]) / 8 < 2
  t = tables.init_tables(tables.default_lsh_config(10**5), S)
  assert t.nbytes == t.buckets.nbytes + t.counts.nbytes + 4
