"""LSH hash functions against NumPy references, and the quality of the tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from references import dwta_ref, simhash_ref

from sparsejax.index import lsh, tables


def _simhash_ref(params, x):
  return simhash_ref(params.projections, x)


def _dwta_ref(params, x):
  return dwta_ref(np.asarray(params.bin_idx), int(params.seed), x)


def test_simhash_matches_numpy_reference():
  cfg = lsh.LSHConfig("simhash", num_tables=5, num_bits=7)
  params = lsh.init_lsh(jax.random.key(1), cfg, 30)
  P = np.asarray(params.projections).reshape(35, 30)
  assert np.all(np.count_nonzero(P, axis=1) == 10)  # a third of the dims
  assert set(np.unique(P)) == {-1.0, 0.0, 1.0}
  assert len({tuple(np.flatnonzero(r)) for r in P}) > 30  # supports differ
  x = jnp.asarray(np.random.default_rng(0).normal(size=(50, 30)), jnp.float32)
  np.testing.assert_array_equal(lsh.lsh_hash(params, x), _simhash_ref(params, x))


def test_dwta_matches_numpy_reference_with_densification():
  cfg = lsh.LSHConfig("dwta", num_tables=4, num_bits=9)
  params = lsh.init_lsh(jax.random.key(2), cfg, 40)
  assert params.bin_idx.shape == (4, 3, 8)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(30, 40)) * (rng.random((30, 40)) < 0.15)  # sparse: many empty bins
  x[0] = 0.0  # all bins empty
  x = jnp.asarray(x, jnp.float32)
  np.testing.assert_array_equal(lsh.lsh_hash(params, x), _dwta_ref(params, x))


@pytest.mark.parametrize("family,bits", [("dwta", 6), ("dwta", 9), ("simhash", 8)])
def test_codes_use_all_their_bits(family, bits):
  """Every one of the 2^K codes is reachable (SLIDE packs DWTA bins 2 bits apart)."""
  params = lsh.init_lsh(jax.random.key(3), lsh.LSHConfig(family, num_tables=4, num_bits=bits), 64)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(20000, 64)), jnp.float32)
  codes = np.asarray(lsh.lsh_hash(params, x))
  assert codes.min() >= 0 and codes.max() < 2**bits
  for l in range(4):
    assert len(np.unique(codes[:, l])) >= 0.95 * 2**bits


def test_hash_functions_deterministic_by_key():
  cfg = lsh.LSHConfig("dwta", 3, 6)
  a, b = lsh.init_lsh(jax.random.key(5), cfg, 20), lsh.init_lsh(jax.random.key(5), cfg, 20)
  c = lsh.init_lsh(jax.random.key(6), cfg, 20)
  np.testing.assert_array_equal(a.bin_idx, b.bin_idx)
  assert not np.array_equal(a.bin_idx, c.bin_idx)


def test_bad_configs_and_inputs_raise():
  with pytest.raises(ValueError, match="multiple of 3"):
    lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("dwta", 2, 7), 16)
  with pytest.raises(ValueError, match="family"):
    lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("minhash", 2, 6), 16)
  params = lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("simhash", 2, 6), 16)
  with pytest.raises(ValueError, match=r"'x' must have shape \[B, d\]"):
    lsh.lsh_hash(params, jnp.zeros((3, 16, 1)))
  with pytest.raises(TypeError, match="'x' must have dtype float32"):
    lsh.lsh_hash(params, jnp.zeros((3, 16), jnp.int32))
  with pytest.raises(ValueError, match=r"'projections' must have shape \[L, K, d\] with d = 17 \(from 'x'\)"):
    lsh.lsh_hash(params, jnp.zeros((3, 17)))
  assert lsh.lsh_hash(params, jnp.zeros((0, 16))).shape == (0, 2)


def _recall_at_10(family, num_tables, bits, N=4000, d=64, Q=200):
  rng = np.random.default_rng(0)
  W = rng.normal(size=(N, d)).astype(np.float32)
  W /= np.linalg.norm(W, axis=1, keepdims=True)
  q = rng.normal(size=(Q, d)).astype(np.float32)
  q /= np.linalg.norm(q, axis=1, keepdims=True)
  if family == "dwta":
    W, q = np.maximum(W, 0), np.maximum(q, 0)  # winner-take-all suits non-negative data
  truth = np.argsort(-(q @ W.T), axis=1)[:, :10]
  cfg = lsh.LSHConfig(family, num_tables=num_tables, num_bits=bits)
  params = lsh.init_lsh(jax.random.key(0), cfg, d)
  t = tables.build_tables(tables.init_tables(cfg, 64), params, jnp.asarray(W))
  active, n = tables.lsh_query(t, params, jnp.asarray(q), k=N // 2, num_rows=N)
  active, n = np.asarray(active), np.asarray(n)
  hits = [len(set(truth[i]) & set(active[i, :n[i]])) / 10 for i in range(Q)]
  return float(np.mean(hits)), float(np.mean(n)) / N


@pytest.mark.parametrize("family,bits", [("simhash", 8), ("dwta", 6)])
def test_recall_grows_with_tables_and_beats_random(family, bits):
  results = [_recall_at_10(family, L, bits) for L in (1, 4, 16)]
  recalls = [r for r, _ in results]
  assert recalls[0] < recalls[1] < recalls[2], results
  for recall, frac in results:
    # A random subset of the same size would have recall == frac.
    assert recall > 3 * frac, results
