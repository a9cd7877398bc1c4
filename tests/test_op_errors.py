"""Op-level edge cases (issue 12, defect 14): each gives the right result or an error naming the op and argument."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import inference, ops, optim
from sparsejax.index import lsh, tables


def _grad(rng, B=4, k=5, N=30, d=3):
  ids = rng.integers(-1, N, size=(B, k)).astype(np.int32)
  return ops.RowSparseGrad(jnp.asarray(ids), jnp.asarray(rng.normal(size=(B, k)), jnp.float32),
                           jnp.asarray(rng.normal(size=(B, d)), jnp.float32))


@pytest.mark.parametrize("moment_dtype", [jnp.float32, jnp.bfloat16])
def test_vmap_of_the_optimizer_equals_a_loop(moment_dtype):
  """vmap raised NotImplementedError ("vmap_method=None"); it now runs the kernel once per element."""
  rng = np.random.default_rng(0)
  W = jnp.asarray(rng.normal(size=(3, 30, 3)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(3, 30)), jnp.float32)
  grad = _grad(rng)
  opt = optim.row_sparse_adam(0.1, weight_decay=0.01, moment_dtype=moment_dtype)
  step = lambda W, b: opt.update(grad, opt.init((W, b)), (W, b))
  got = jax.jit(jax.vmap(step))(W, b)
  for i in range(3):
    want = step(W[i], b[i])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(g[i], w)


def test_vmap_of_table_build_and_insert_equals_a_loop():
  rng = np.random.default_rng(1)
  cfg = lsh.LSHConfig("simhash", 4, 3)
  params = lsh.init_lsh(jax.random.key(0), cfg, 5)
  W = jnp.asarray(rng.normal(size=(2, 40, 5)), jnp.float32)
  rows = jnp.asarray(rng.normal(size=(2, 3, 5)), jnp.float32)
  ids = jnp.array([3, -1, 7], jnp.int32)

  def build_and_insert(W, rows):
    t = tables.build_tables(tables.init_tables(cfg, 4, policy="reservoir"), params, W)
    return tables.insert_rows(t, params, rows, ids, 40)

  got = jax.vmap(build_and_insert)(W, rows)
  for i in range(2):
    want = build_and_insert(W[i], rows[i])
    np.testing.assert_array_equal(got.buckets[i], want.buckets)
    np.testing.assert_array_equal(got.counts[i], want.counts)


def test_dwta_needs_an_input_dim():
  with pytest.raises(ValueError, match=r"init_lsh: argument 'dim' must be in \[1, "):  # was ZeroDivisionError
    lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("dwta", 2, 3), 0)
  with pytest.raises(TypeError, match="LSHConfig: argument 'num_tables' must be an integer"):
    lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("simhash", 2.0, 3), 4)
  for bad in (float("nan"), 0.0, 1.5):  # NaN was "cannot convert float NaN to integer"
    with pytest.raises(ValueError, match=rf"LSHConfig.projection_fraction must be in \(0, 1\], got {bad}"):
      lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("simhash", 2, 3, projection_fraction=bad), 4)
  # SimHash of zero-dimensional inputs is defined: every projection is 0, every code 0.
  params = lsh.init_lsh(jax.random.key(0), lsh.LSHConfig("simhash", 2, 3), 0)
  np.testing.assert_array_equal(lsh.lsh_hash(params, jnp.zeros((4, 0))), np.zeros((4, 2)))


def test_cluster_index_sizes_are_named():
  """A user audit: negative or float sizes gave raw JAX shape errors."""
  from sparsejax.index import clusters

  with pytest.raises(ValueError, match=r"init_index: argument 'dim' must be in \[0, inf\], got -5"):
    clusters.init_index(2, 10, -5)
  with pytest.raises(TypeError, match=r"init_index: argument 'num_clusters' must be an integer, got float 2.5"):
    clusters.init_index(2.5, 10, 4)


def _query_setup():
  cfg = lsh.LSHConfig("simhash", 2, 3)
  params = lsh.init_lsh(jax.random.key(0), cfg, 4)
  W = jnp.asarray(np.random.default_rng(2).normal(size=(20, 4)), jnp.float32)
  return params, tables.build_tables(tables.init_tables(cfg, 4), params, W)


@pytest.mark.parametrize("k", [2.0, 2.5, "2", True, None])
def test_k_must_be_an_integer(k):
  params, t = _query_setup()
  with pytest.raises(TypeError, match="lsh_query: argument 'k' must be an integer"):  # was a TypeError about shapes
    tables.lsh_query(t, params, jnp.ones((3, 4)), k=k, num_rows=20)
  with pytest.raises(TypeError, match="exact_topk: argument 'k' must be an integer"):  # 2.5 was truncated to 2
    inference.exact_topk(jnp.ones((3, 4)), jnp.ones((20, 4)), None, k)


def test_num_rows_beyond_int32_is_named():
  params, t = _query_setup()
  with pytest.raises(ValueError, match=r"lsh_query: argument 'num_rows' must be in \[1, 2147483647\], got 2147483648"):
    tables.lsh_query(t, params, jnp.ones((3, 4)), k=2, num_rows=2**31)  # was an OverflowError naming nothing
  with pytest.raises(ValueError, match=r"insert_rows: argument 'num_rows' must be in \[0, 2147483647\]"):
    tables.insert_rows(t, params, jnp.ones((1, 4)), jnp.zeros((1,), jnp.int32), 2**63)
  with pytest.raises(TypeError, match=r"lsh_query: argument 'num_rows' must be an integer scalar"):
    tables.lsh_query(t, params, jnp.ones((3, 4)), k=2, num_rows=jnp.float32(20))


def test_seeds_beyond_int32_use_their_low_32_bits():
  params, t = _query_setup()
  q = jnp.asarray(np.random.default_rng(3).normal(size=(3, 4)), jnp.float32)
  big, _ = tables.lsh_query(t, params, q, k=12, num_rows=20, seed=2**40 + 5)  # was an OverflowError
  small, _ = tables.lsh_query(t, params, q, k=12, num_rows=20, seed=5)
  np.testing.assert_array_equal(big, small)


def test_table_arguments_are_named():
  cfg = lsh.LSHConfig("simhash", 2, 3)
  with pytest.raises(ValueError, match=r"init_tables: argument 'bucket_size' must be in \[1, inf\], got 0"):
    tables.init_tables(cfg, 0)
  with pytest.raises(TypeError, match="init_tables: argument 'bucket_size' must be an integer"):
    tables.init_tables(cfg, 2.5)
  with pytest.raises(ValueError, match="init_tables: argument 'policy' must be one of"):
    tables.init_tables(cfg, 4, policy="lifo")
  with pytest.raises(ValueError, match=r"init_tables: argument 'seed' must be in \[0, 4294967295\]"):
    tables.init_tables(cfg, 4, seed=-1)
  params, t = _query_setup()
  with pytest.raises(ValueError, match="insert_rows: argument 'policy' must be one of"):  # was a KeyError
    tables.insert_rows(dataclasses.replace(t, policy="lifo"), params, jnp.ones((1, 4)), jnp.zeros((1,), jnp.int32),
                       20)
  with pytest.raises(TypeError, match="lsh_query: argument 'tables.seed' must have dtype uint32, got int32"):
    tables.lsh_query(dataclasses.replace(t, seed=jnp.int32(0)), params, jnp.ones((3, 4)), k=2, num_rows=20)
  with pytest.raises(ValueError, match=r"build_tables: argument 'num_valid' must be in \[0, 20\], got 21"):
    tables.build_tables(t, params, jnp.ones((20, 4)), num_valid=21)
  # Rows of the wrong width are named as the caller's argument, not as the hash functions' (a fresh-user review).
  for op, call in (("build_tables", lambda: tables.build_tables(t, params, jnp.ones((20, 5)))),
                   ("insert_rows", lambda: tables.insert_rows(t, params, jnp.ones((1, 5)), jnp.zeros((1,), jnp.int32),
                                                              20)),
                   ("lsh_query", lambda: tables.lsh_query(t, params, jnp.ones((3, 5)), k=2, num_rows=20))):
    argument = {"build_tables": "weight", "insert_rows": "rows", "lsh_query": "queries"}[op]
    with pytest.raises(ValueError, match=rf"{op}: argument '{argument}' must have shape \[.+, 4\]"):
      call()


def test_corrupt_table_counts_are_an_error_not_a_write():
  """A negative count used to index a bucket's slots at a negative offset: a silent out-of-bounds write."""
  params, t = _query_setup()
  code = int(lsh.lsh_hash(params, jnp.ones((1, 4)))[0, 1])
  bad = dataclasses.replace(t, counts=t.counts.at[1, code].set(-5))
  with pytest.raises(Exception, match=r"lsh_tables_insert: argument 'counts' holds -5 in table 1"):
    jax.block_until_ready(tables.insert_rows(bad, params, jnp.ones((1, 4)), jnp.zeros((1,), jnp.int32), 20))


def test_optimizer_arguments_are_named():
  rng = np.random.default_rng(4)
  W = jnp.asarray(rng.normal(size=(30, 3)), jnp.float32)
  b = jnp.zeros((30,), jnp.float32)
  for kwargs, name in ((dict(b1=1.0), "b1"), (dict(b2=float("nan")), "b2"), (dict(eps=-1e-8), "eps"),
                       (dict(weight_decay=float("inf")), "weight_decay")):
    with pytest.raises(ValueError, match=f"row_sparse_adam: argument '{name}' must be finite and in"):
      optim.row_sparse_adam(0.1, **kwargs)
  with pytest.raises(ValueError, match="row_sparse_adam: argument 'learning_rate' must be finite"):
    optim.row_sparse_adam(float("nan"))
  opt = optim.row_sparse_adam(0.1)
  # An optax-style dict of parameters is named (a fresh-user review: AttributeError: 'dict' object has no 'shape').
  with pytest.raises(TypeError, match=r"row_sparse_adam.init: params must be an \[N, d\] weight, an \[N\] bias or a "
                     r"\(weight, bias\) pair of arrays, got dict"):
    opt.init({"w": W, "b": b})
  with pytest.raises(TypeError, match=r"row_sparse_adam: argument 'params' must be an \[N, d\] weight.*got dict"):
    opt.update(_grad(rng), opt.init(W), {"w": W})
  with pytest.raises(TypeError, match=r"row_sparse_adam: a \(weight, bias\) pair of params needs a pair of states"):
    opt.update(_grad(rng), opt.init(W), (W, b))
  with pytest.raises(TypeError, match="row_sparse_adam: argument 'grad' must be a RowSparseGrad"):
    opt.update((1, 2, 3), opt.init(W), W)
  with pytest.raises(ValueError, match="row_sparse_adam: argument 'state.mu' must be float32 or bfloat16, got float16"):
    opt.update(_grad(rng), opt.init(W)._replace(mu=jnp.zeros((30, 3), jnp.float16)), W)
  with pytest.raises(Exception, match=r"row_sparse_adam: argument 'count' \(the step number after this update\)"):
    jax.block_until_ready(opt.update(_grad(rng), opt.init(W)._replace(count=jnp.int32(-1)), W))


def test_exact_topk_arguments_are_named():
  h, W = jnp.ones((3, 4)), jnp.ones((20, 4))
  with pytest.raises(ValueError, match=r"exact_topk: argument 'k' = 21 must lie in \[1, N = 20\]"):
    inference.exact_topk(h, W, None, 21)
  with pytest.raises(ValueError, match=r"exact_topk: argument 'row_chunk' must be in \[1, inf\]"):
    inference.exact_topk(h, W, None, 2, row_chunk=0)
  with pytest.raises(ValueError, match=r"exact_topk: argument 'h' must have shape \[n, d\] with d = 4"):
    inference.exact_topk(jnp.ones((3, 5)), W, None, 2)
  with pytest.raises(ValueError, match="exact_topk: argument 'weight' must be a float array"):
    inference.exact_topk(h, W.astype(jnp.int32), None, 2)


def test_exact_topk_ranks_nan_logits_last_without_repeating_ids():
  """inf - inf logits are -NaN on x86, which top_k ranked below the -inf of rows masked out of the last, shifted
  chunk: row 2 came back twice ([2, 2, 0])."""
  h = jnp.array([[np.inf, np.inf]], jnp.float32)
  W = jnp.array([[1, -1], [1, -1], [1, 1], [1, -1], [1, -1]], jnp.float32)
  scores, ids = inference.exact_topk(h, W, None, 3, row_chunk=3)
  np.testing.assert_array_equal(ids, [[2, 0, 1]])
  assert scores[0, 0] == np.inf and np.isnan(scores[0, 1:]).all()
