"""LSH that retrieves (issue 32): the centred MIPS reduction and the --candidates=lsh defaults, against brute force."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import index, model
from sparsejax.index import mips
from sparsejax.model_config import ModelConfig
from sparsejax.network import SparseLayer
from sparsejax.settings import override


def test_centred_mips_rows_rank_like_the_logits():
  """Centring moves every logit of a query by one constant: the cosines of the reduced rows keep the ranking."""
  rng = np.random.default_rng(0)
  n, d, valid = 300, 12, 280
  shared = rng.normal(size=d).astype(np.float32) * 4  # a direction every row has (as trained rows do)
  w = (shared + rng.normal(size=(n, d)) * rng.uniform(0.1, 3.0, size=(n, 1))).astype(np.float32)
  b = rng.normal(size=n).astype(np.float32)
  h = np.maximum(rng.normal(size=(20, d)), 0).astype(np.float32)
  cw, cb = mips.centre_rows(jnp.asarray(w), jnp.asarray(b), valid)
  cw, cb = np.asarray(cw, np.float64), np.asarray(cb, np.float64)
  np.testing.assert_allclose(cw[:valid], w[:valid] - w[:valid].mean(0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cb[:valid], b[:valid] - b[:valid].mean(), rtol=1e-5, atol=1e-5)
  assert not cw[valid:].any() and not cb[valid:].any()  # padding rows: zero, outside the mean
  x = np.asarray(mips.augment_rows(jnp.asarray(cw, jnp.float32), jnp.asarray(cb, jnp.float32)), np.float64)
  q = np.asarray(mips.augment_queries(jnp.asarray(h)), np.float64)
  cosine = (q @ x.T)[:, :valid]
  logits = h.astype(np.float64) @ w[:valid].T.astype(np.float64) + b[:valid]
  # <q, x_i> = (logit_i - c) / (M |[h, 1]|) with c = <h, w_mean> + b_mean, the same for every row of a query.
  scale = np.max(np.linalg.norm(np.concatenate([cw, cb[:, None]], 1), axis=1)) * np.linalg.norm(
      np.concatenate([h, np.ones((20, 1))], 1), axis=1)
  shift = h.astype(np.float64) @ w[:valid].mean(0) + b[:valid].mean()
  np.testing.assert_allclose(cosine * scale[:, None] + shift[:, None], logits, rtol=1e-4, atol=1e-3)
  np.testing.assert_array_equal(np.argsort(-cosine, axis=1, kind="stable")[:, :50],
                                np.argsort(-logits, axis=1, kind="stable")[:, :50])


def test_a_row_that_is_not_finite_is_left_out_of_the_centring():
  """One diverged row must not turn the mean row, so every centred row, into NaN (it is zeroed, as padding is)."""
  rng = np.random.default_rng(1)
  w = rng.normal(size=(50, 6)).astype(np.float32)
  b = rng.normal(size=50).astype(np.float32)
  w[7, 2], b[11] = np.nan, np.inf
  cw, cb = (np.asarray(x) for x in mips.centre_rows(jnp.asarray(w), jnp.asarray(b)))
  finite = np.ones(50, bool)
  finite[[7, 11]] = False
  np.testing.assert_allclose(cw[finite], w[finite] - w[finite].mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(cb[finite], b[finite] - b[finite].mean(), rtol=1e-5, atol=1e-6)
  assert not cw[~finite].any() and not cb[~finite].any()
  assert np.isfinite(np.asarray(mips.augment_rows(jnp.asarray(cw), jnp.asarray(cb)))).all()


def _planted_layer(num_rows: int, dim: int, num_queries: int, seed: int = 0):
  """Rows sharing one direction that the queries point away from (what training does to an output layer: the
  raw cos(h, label row) goes negative), and for each query one planted row with the largest logit, whose cosine
  with the query after centring is modest (about 0.4; 0.2-0.3 in the trained layers of benchmarks/lsh_retrieval.py).

  Returns ``(w, b, h, planted)`` for the queries whose largest logit is their planted row's (brute force).
  """
  rng = np.random.default_rng(seed)
  shared = np.zeros(dim, np.float32)
  shared[0] = 1.0
  w = -3.0 * shared + rng.normal(size=(num_rows, dim)).astype(np.float32) / np.sqrt(dim)
  g = rng.normal(size=(num_queries, dim)).astype(np.float32)
  g[:, 0] = 0.0
  g /= np.linalg.norm(g, axis=1, keepdims=True)
  h = (shared + g).astype(np.float32)
  planted = rng.choice(num_rows, num_queries, replace=False)
  w[planted] += g
  b = np.zeros(num_rows, np.float32)
  best = np.argmax(h.astype(np.float64) @ w.T.astype(np.float64), axis=1) == planted
  return w, b, h[best], planted[best]


def _recall_of_planted(settings: dict, w, b, h, planted, k: int, serving: bool = False) -> float:
  """How often the planted row is among a query's index candidates: the training tables' (``serving=False``) or
  those sampled inference reads (``serving=True``: :func:`sparsejax.index.hashed.serving_sizes`)."""
  n, d = w.shape
  cfg = override(ModelConfig(10, n), hidden_dims=(d,), active_k=k, candidates="lsh", **settings)
  out = SparseLayer(jnp.asarray(w), jnp.asarray(b))
  kind = index.from_config(cfg)
  built = kind.serving(None, out.w, out.b) if serving else kind.init(*jax.random.split(jax.random.key(0)), out.w, out.b)
  state = model.SlideState(*([None] * len(model.SlideState._fields)))._replace(out=out, index=built)
  active, from_index = model.query_active(state, jnp.asarray(h), config=cfg, k=k, num_rows=n, seed=1)
  active, from_index = np.asarray(active), np.asarray(from_index)
  found = [planted[i] in active[i, :from_index[i]] for i in range(len(h))]
  return float(np.mean(found))


def test_lsh_defaults_retrieve_the_planted_best_row_that_the_old_ones_miss():
  """k = 64 of 4,096 rows: how often the planted row (each query's largest logit) is among the candidates of the
  tables sampled inference reads.

  Measured at 392de11: the serving tables of then (centred MIPS rows, SimHash hyperplanes drawn from the rows, 64
  tables, 3 probes, re-ranked) 0.98; the 16 training tables read the same way 0.45; the tables before issue 32
  (raw rows, random SimHash, 32 tables, FIFO buckets, one bucket read) 0.17. Today's (angular) serving tables too
  (>= 0.9 asserted).
  """
  w, b, h, planted = _planted_layer(4096, 64, 400)
  assert len(h) > 300
  recall = _recall_of_planted(dict(), w, b, h, planted, k=64, serving=True)
  before = _recall_of_planted(dict(lsh_family="simhash", lsh_mips=False, lsh_projections="random", num_tables=32,
                                   table_policy="fifo", lsh_probes=1, lsh_rerank=0), w, b, h, planted, k=64)
  assert recall >= 0.9 and before <= 0.3, (recall, before)


def test_hyperplanes_drawn_from_rows_follow_the_heavy_rows():
  """simhash_from_rows: rows are drawn in proportion to their weights (zero: never), the MIPS completion coordinate
  zeroed, then jittered by ROW_JITTER of their entries' spread; the same key gives the same hyperplanes."""
  from sparsejax.index import lsh

  rng = np.random.default_rng(0)
  rows = rng.normal(size=(1000, 9)).astype(np.float32)
  heavy = np.array([3, 500, 917])
  weights = np.zeros(1000, np.float32)
  weights[heavy] = [1.0, 2.0, 1.0]
  cfg = lsh.LSHConfig(num_tables=40, num_bits=10, projections="rows")
  p = np.asarray(lsh.simhash_from_rows(jax.random.key(1), cfg, jnp.asarray(rows), jnp.asarray(weights),
                                       completion=True).projections).reshape(-1, 9)
  assert p.shape == (400, 9)
  spread = np.std(np.concatenate([rows[heavy, :-1], np.zeros((3, 1), np.float32)], axis=1))
  assert 0.15 * spread < np.std(p[:, -1]) < 0.45 * spread  # the completion's: the jitter alone
  target = rows[heavy, :-1]
  nearest = np.argmax(p[:, :-1] @ target.T / np.linalg.norm(target, axis=1), axis=1)
  cosine = np.max(p[:, :-1] @ (target / np.linalg.norm(target, axis=1, keepdims=True)).T, axis=1) / \
      np.linalg.norm(p[:, :-1], axis=1)
  assert np.mean(cosine) > 0.9 and np.all(cosine > 0.5)  # each a jittered heavy row
  share = np.bincount(nearest, minlength=3) / len(p)
  np.testing.assert_allclose(share, [0.25, 0.5, 0.25], atol=0.08)
  again = lsh.simhash_from_rows(jax.random.key(1), cfg, jnp.asarray(rows), jnp.asarray(weights), completion=True)
  np.testing.assert_array_equal(np.asarray(again.projections).reshape(-1, 9), p)
  with pytest.raises(ValueError, match="projections"):
    lsh.LSHConfig(family="dwta", num_bits=9, projections="rows").validate()


def test_weighted_draws_follow_the_weights():
  """draw_weighted: ids drawn in proportion to their weights (frequencies within sampling error of the weights'
  shares over 200,000 draws), never an id of weight 0 (negative and NaN weights count as 0, also at either end),
  uniform when every weight is 0, and finite for weights near float32's largest."""
  from sparsejax.index import lsh

  weights = np.zeros(1000, np.float32)
  weights[[1, 10, 500, 998]] = [1.0, 3.0, 0.5, 2.0]
  weights[[0, 999]] = [-1.0, np.nan]
  ids = np.asarray(lsh.draw_weighted(jax.random.key(0), jnp.asarray(weights), 200_000))
  assert ids.dtype == np.int32 and set(np.unique(ids)) == {1, 10, 500, 998}
  share = np.bincount(ids, minlength=1000)[[1, 10, 500, 998]] / len(ids)
  np.testing.assert_allclose(share, np.array([1.0, 3.0, 0.5, 2.0]) / 6.5, atol=0.005)
  uniform = np.asarray(lsh.draw_weighted(jax.random.key(1), jnp.zeros(50), 50_000))
  counts = np.bincount(uniform, minlength=50)
  assert counts.min() > 800 and counts.max() < 1200  # 1,000 expected each
  huge = np.full(10, np.finfo(np.float32).max, np.float32)
  huge[3] = 0.0
  drawn = np.asarray(lsh.draw_weighted(jax.random.key(2), jnp.asarray(huge), 10_000))
  assert 3 not in drawn and set(np.unique(drawn)) == set(range(10)) - {3}


def test_drawn_hyperplanes_find_the_largest_logits_where_random_ones_do_not():
  """Training tables (one bucket per table) over a layer whose largest logits come from its few large rows (as in
  a trained layer: the frequent labels' rows): SimHash hyperplanes drawn from the rows find each query's best row
  far more often than random ones, and the serving tables (fuller buckets, probes, re-ranking) more often still."""
  rng = np.random.default_rng(3)
  n, d, k = 8192, 32, 64
  w = (rng.normal(size=(n, d)) / np.sqrt(d)).astype(np.float32)
  large = rng.choice(n, 200, replace=False)
  w[large] *= 6.0
  h = rng.normal(size=(300, d)).astype(np.float32)
  b = np.zeros(n, np.float32)
  best = np.argmax(h.astype(np.float64) @ w.T.astype(np.float64), axis=1)
  random_planes = _recall_of_planted(dict(lsh_projections="random", lsh_probes=1, lsh_rerank=0), w, b, h, best, k)
  drawn = _recall_of_planted(dict(lsh_probes=1, lsh_rerank=0), w, b, h, best, k)
  assert drawn >= random_planes + 0.2, (drawn, random_planes)


@pytest.mark.parametrize("scale", [3e37, 1e20, 1e-25])
def test_rows_near_float32s_limits_are_centred_and_reduced_as_in_float64(scale):
  """Issue 35 (as build_index's cf63902): finite rows near float32's largest overflowed the mean row into inf (every
  centred row NaN) and the row norms into inf (every reduced row 0); tiny rows underflowed the squared norms to 0
  (reduced rows far shorter than 1). Against a float64 reference; a spread of values with entries up to 3.4e38."""
  rng = np.random.default_rng(2)
  n, d, valid = 40, 6, 36
  w = (rng.uniform(-1, 1, size=(n, d)) * scale).astype(np.float32)
  b = (rng.uniform(-1, 1, size=n) * scale).astype(np.float32)
  if scale > 1e37:
    w[3, 1] = np.float32(3.4e38)  # the centred value stays within float32's range
  cw, cb = (np.asarray(x, np.float64) for x in mips.centre_rows(jnp.asarray(w), jnp.asarray(b), valid))
  w64, b64 = w[:valid].astype(np.float64), b[:valid].astype(np.float64)
  ref_w, ref_b = w64 - w64.mean(0), b64 - b64.mean()
  np.testing.assert_allclose(cw[:valid], ref_w, rtol=1e-5, atol=1e-6 * scale)
  np.testing.assert_allclose(cb[:valid], ref_b, rtol=1e-5, atol=1e-6 * scale)
  assert not cw[valid:].any() and not cb[valid:].any()
  x = np.asarray(mips.augment_rows(jnp.asarray(cw, jnp.float32), jnp.asarray(cb, jnp.float32)), np.float64)
  rows = np.concatenate([ref_w, ref_b[:, None]], axis=1)
  rows /= np.max(np.linalg.norm(rows, axis=1))
  reference = np.concatenate([rows, np.sqrt(np.maximum(1 - np.sum(rows**2, axis=1, keepdims=True), 0))], axis=1)
  np.testing.assert_allclose(x[:valid, :-1], reference[:, :-1], atol=1e-6)
  np.testing.assert_allclose(x[:valid, -1]**2, reference[:, -1]**2, atol=1e-6)  # sqrt(1 - |x|^2): squared
  np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)  # padding rows: the completion alone


@pytest.mark.parametrize("settings", [dict(), dict(lsh_mips=False)])
def test_an_lsh_index_of_rows_scaled_near_float32s_largest_is_the_index_of_the_rows(settings):
  """Rows times 2^120 (about 1.3e36, exact) give the same hyperplanes' tables as the rows themselves: the weights
  of the draw (squared norms) overflowed into inf, never drawn, and the centring into NaN."""
  w, b, _, _ = _planted_layer(512, 16, 10)
  cfg = override(ModelConfig(10, 512), hidden_dims=(16,), active_k=32, candidates="lsh", **settings)
  kind = index.from_config(cfg)
  keys = jax.random.split(jax.random.key(0))
  built = kind.init(*keys, jnp.asarray(w), jnp.asarray(b + 0.5))
  huge = kind.init(*keys, jnp.asarray(np.ldexp(w, 120)), jnp.asarray(np.ldexp(b + 0.5, 120)))
  assert np.isfinite(np.ldexp(w, 120)).all()
  jax.tree.map(np.testing.assert_array_equal, huge.tables, built.tables)


def test_angular_serving_tables_find_the_short_rows_one_reduction_misses():
  """Long rows that no query points at, and for each query a planted short row (a sixth of their norm) with its
  largest logit: reduced by the longest row of all (``--lsh_serving=training``), the planted row's cosine with the
  query is below 0.2 (hash bits nearly coin flips); reduced by its own norm (``angular``, the default), near its
  direction's (about 0.9). k = 64 of 4,096 rows, the serving tables: measured 0.0 with the training tables'
  reduction (its hyperplanes, drawn from the long rows, split where no query is), 1.0 angular."""
  rng = np.random.default_rng(5)
  n, d, num_queries = 4096, 32, 300
  w = np.zeros((n, d), np.float32)
  w[: n // 2, : d // 2] = 10.0 * rng.normal(size=(n // 2, d // 2)) / np.sqrt(d // 2)  # long, off the queries
  w[n // 2:, d // 2:] = rng.normal(size=(n // 2, d // 2)) / np.sqrt(d // 2)  # short, where the queries are
  h = np.zeros((num_queries, d), np.float32)
  h[:, d // 2:] = rng.normal(size=(num_queries, d // 2))
  h /= np.linalg.norm(h, axis=1, keepdims=True)
  planted = n // 2 + rng.choice(n // 2, num_queries, replace=False)
  w[planted] = 1.5 * h + 0.5 * w[planted]
  b = np.zeros(n, np.float32)
  best = np.argmax(h @ w.T, axis=1) == planted
  h, planted = h[best], planted[best]
  assert len(h) > 250
  angular = _recall_of_planted(dict(), w, b, h, planted, k=64, serving=True)
  one_reduction = _recall_of_planted(dict(lsh_serving="training"), w, b, h, planted, k=64, serving=True)
  assert angular >= 0.9 and one_reduction <= 0.5, (angular, one_reduction)


def test_rows_reduced_each_by_its_own_norm_are_their_unit_directions():
  """``augment_rows`` with one ``M`` per row (what the angular serving tables hash): each row its own direction,
  the completion coordinate 0 (a row longer than its ``M`` too), against numpy."""
  rng = np.random.default_rng(6)
  w = rng.normal(size=(40, 7)).astype(np.float32) * rng.lognormal(0, 2, size=(40, 1)).astype(np.float32)
  b = rng.normal(size=40).astype(np.float32)
  x = np.concatenate([w, b[:, None]], axis=1).astype(np.float64)
  norms = np.linalg.norm(x, axis=1)
  reduced = np.asarray(mips.augment_rows(jnp.asarray(w), jnp.asarray(b), max_norm=jnp.asarray(norms, jnp.float32)))
  np.testing.assert_allclose(reduced[:, :8], x / norms[:, None], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(reduced[:, 8], 0.0, atol=2e-3)  # sqrt of a float32 rounding of 1 - 1
  halved = np.asarray(mips.augment_rows(jnp.asarray(w), jnp.asarray(b), max_norm=jnp.asarray(2 * norms, jnp.float32)))
  np.testing.assert_allclose(halved[:, 8], np.sqrt(0.75), rtol=1e-5)
  longer = np.asarray(mips.augment_rows(jnp.asarray(w), jnp.asarray(b), max_norm=jnp.asarray(norms / 2, jnp.float32)))
  np.testing.assert_allclose(longer[:, :8], 2 * x / norms[:, None], rtol=1e-5, atol=1e-6)
  assert not longer[:, 8].any()  # a row longer than its M: completion 0


@pytest.mark.parametrize("settings, bits, slots, projections", [
    (dict(), 11, 128, "random"),  # angular over drawn training hyperplanes (10 bits): one bit more, 2x the slots
    (dict(lsh_projections="random"), 11, 128, "random"),  # random training tables (13 bits): 2 fewer
    (dict(lsh_serving="training"), 8, 256, "rows"),
    (dict(lsh_family="dwta"), 9, 256, None),  # DWTA's bins: 3 fewer bits (12), 4x the slots
])
def test_serving_table_sizes(settings, bits, slots, projections):
  """The serving tables of 200K rows (64 slots per training bucket): 64 tables, the bits and slots of the rule in
  kinds.serving_table_sizes, as the index builds them."""
  from sparsejax.index import hashed

  cfg = override(ModelConfig(10, 200_000), candidates="lsh", **settings)
  sizes, got_slots = hashed.serving_sizes(cfg.tables, cfg.lsh_config, cfg.table_bucket_size)
  assert (sizes.num_tables, sizes.num_bits, got_slots) == (64, bits, slots)
  if projections is not None:
    assert sizes.projections == projections


def test_the_fill_of_serving_tables_counts_their_own_slots():
  """Bucket statistics of the serving tables (what the evaluations record) against their own slots per bucket
  (128 here, the training tables' 64): 300 rows of one direction fill one bucket per table."""
  n, d = 300, 8
  w = np.tile(np.arange(1, d + 1, dtype=np.float32), (n, 1)) * np.linspace(1, 2, n, dtype=np.float32)[:, None]
  w -= w.mean(axis=0)  # (centred, the rows point two ways: the longer half one, the shorter the other)
  b = np.zeros(n, np.float32)
  cfg = override(ModelConfig(10, n), hidden_dims=(d,), candidates="lsh")
  kind = index.from_config(cfg)
  serving = kind.serving(None, jnp.asarray(w), jnp.asarray(b))
  training = kind.init(*jax.random.split(jax.random.key(0)), jnp.asarray(w), jnp.asarray(b))
  assert kind.fill(kind.occupancy(serving))["bucket_max"] == 128
  assert kind.fill(kind.occupancy(training))["bucket_max"] == 64
  stacked = np.stack([np.asarray(kind.occupancy(serving))] * 2)  # a sharded run's, all-gathered
  assert kind.fill(stacked)["bucket_max"] == 128
