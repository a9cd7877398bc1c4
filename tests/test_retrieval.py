"""Candidate retrieval: MIPS reduction, clustered index, merge kernel and diagnostics against brute force."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import _ffi, model, retrieval
from sparsejax.index import clusters, lsh, mips, tables
from sparsejax.model_config import ModelConfig
from sparsejax.network import SparseLayer


def test_mips_reduction_ranks_like_inner_products():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(300, 12)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(300, 1)).astype(np.float32)
  b = rng.normal(size=300).astype(np.float32)
  h = np.maximum(rng.normal(size=(20, 12)), 0).astype(np.float32)
  x = mips.augment_rows(jnp.asarray(w), jnp.asarray(b))
  q = mips.augment_queries(jnp.asarray(h))
  np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, rtol=1e-5)
  cosine = np.asarray(q, np.float64) @ np.asarray(x, np.float64).T
  logits = h.astype(np.float64) @ w.T.astype(np.float64) + b
  # <q, x_i> = logit_i / (M |[h, 1]|): the same ranking, up to float rounding.
  scale = np.max(np.linalg.norm(np.concatenate([w, b[:, None]], 1), axis=1)) * np.linalg.norm(
      np.concatenate([h, np.ones((20, 1))], 1), axis=1)
  np.testing.assert_allclose(cosine * scale[:, None], logits, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(np.argsort(-cosine, axis=1, kind="stable")[:, :50],
                                np.argsort(-logits, axis=1, kind="stable")[:, :50])


def _merge_reference(candidates, labels, k, max_from):
  """Labels, then distinct candidates (at most max_from); the random fill is checked separately."""
  out = []
  for y in labels:
    if y >= 0 and y not in out:
      out.append(int(y))
  taken = 0
  for c in candidates:
    if taken == max_from or len(out) == k:
      break
    if c >= 0 and c not in out:
      out.append(int(c))
      taken += 1
  return out, taken


# N = 20: the random fill lists the unused ids (2k > N); 5M: the kernel's id set is a hash set, not a bitmap.
@pytest.mark.parametrize("N", [20, 200, 5_000_000])
@pytest.mark.parametrize("max_from", [None, 5])
def test_merge_candidates_against_reference(max_from, N):
  rng = np.random.default_rng(1)
  B, C, k = 16, 30, 12
  cand = rng.integers(-1, min(40, N), size=(B, C)).astype(np.int32)  # repeats and padding
  labels = rng.integers(-1, min(60, N), size=(B, 3)).astype(np.int32)
  active, n = clusters.merge_candidates(jnp.asarray(cand), k=k, num_rows=N, labels=jnp.asarray(labels), seed=7,
                                        max_from_candidates=max_from)
  active, n = np.asarray(active), np.asarray(n)
  for b in range(B):
    want, taken = _merge_reference(cand[b], labels[b], k, k if max_from is None else max_from)
    assert active[b, :len(want)].tolist() == want
    assert n[b] == taken
    assert len(set(active[b].tolist())) == k and active[b].min() >= 0 and active[b].max() < N  # distinct fill
  again, _ = clusters.merge_candidates(jnp.asarray(cand), k=k, num_rows=N, labels=jnp.asarray(labels), seed=7,
                                       max_from_candidates=max_from)
  np.testing.assert_array_equal(again, active)


def test_merge_candidates_rejects_bad_ids_and_too_many_labels():
  with pytest.raises(Exception, match="candidates"):
    jax.block_until_ready(clusters.merge_candidates(jnp.array([[3, 250]], jnp.int32), k=2, num_rows=200))
  with pytest.raises(Exception, match="more distinct labels than k"):
    jax.block_until_ready(clusters.merge_candidates(jnp.array([[3]], jnp.int32), k=2, num_rows=200,
                                                    labels=jnp.array([[1, 2, 3]], jnp.int32)))
  with pytest.raises(TypeError, match="candidates"):
    clusters.merge_candidates(jnp.array([[3.0]]), k=1, num_rows=200)
  with pytest.raises(TypeError, match="merge_candidates: argument 'seed' must be an integer"):  # was truncated
    clusters.merge_candidates(jnp.array([[3]], jnp.int32), k=2, num_rows=200, seed=1.7)
  same = [clusters.merge_candidates(jnp.array([[3]], jnp.int32), k=5, num_rows=200, seed=s)[0] for s in
          (-1, 2**32 - 1, jnp.uint32(2**32 - 1))]  # any integer seed: its low 32 bits
  np.testing.assert_array_equal(same[0], same[1])
  np.testing.assert_array_equal(same[0], same[2])


def _index(n=500, d=8, c=20, num_valid=None, seed=0):
  rng = np.random.default_rng(seed)
  w = (rng.normal(size=(n, d)) * rng.uniform(0.2, 2.0, size=(n, 1))).astype(np.float32)
  b = rng.normal(size=n).astype(np.float32) * 0.3
  index = clusters.build_index(clusters.init_index(c, n, d), jnp.asarray(w), jnp.asarray(b), iterations=5,
                               num_valid=num_valid, key=jax.random.key(seed))
  return index, w, b


@pytest.mark.parametrize("largest", [3.4e38, 1e20, 1e-25])
def test_build_index_of_rows_near_float32s_limits(largest):
  """Finite rows near float32's maximum (their sums and squared norms overflow), large enough that squared norms
  do, or tiny (squares underflow): the same clusters as the same rows scaled by a power of two to about 1 (exact),
  the right ones (4 planted groups, one of small rows beside the huge ones), finite probe vectors: the members'
  mean rows (float64 reference) and spreads (the largest float32 where the true one is beyond float32)."""
  rng = np.random.default_rng(11)
  n, d, c = 96, 5, 4
  groups = np.repeat(np.arange(c), n // c)  # contiguous groups: the seeds, spread over the rows, hit each once
  directions = np.eye(c, d + 1) * 0.9 - 0.05
  wb = directions[groups] + rng.uniform(-0.05, 0.05, size=(n, d + 1))
  wb[groups == 3] *= 1e-6  # beside the others, about 0 after centring: one cluster of their own
  wb = (wb * (largest / np.abs(wb).max())).astype(np.float32)
  w, b = wb[:, :d], wb[:, d]
  power = int(np.frexp(np.abs(wb).max())[1])
  build = lambda w, b: clusters.build_index(clusters.init_index(c, n, d), jnp.asarray(w), jnp.asarray(b),
                                            iterations=3, key=jax.random.key(0))
  index = build(w, b)
  offsets, rows, cent = np.asarray(index.offsets), np.asarray(index.rows), np.asarray(index.centroids)
  scaled = build(np.ldexp(w, -power), np.ldexp(b, -power))
  np.testing.assert_array_equal(offsets, np.asarray(scaled.offsets))
  np.testing.assert_array_equal(rows, np.asarray(scaled.rows))
  assert sorted(sorted(groups[rows[offsets[k]:offsets[k + 1]]].tolist()) for k in range(c)) == [
      [g] * (n // c) for g in range(c)]  # each cluster is one planted group
  assert np.all(np.isfinite(cent))
  limit = float(np.finfo(np.float32).max)
  for k in range(c):
    members = wb[rows[offsets[k]:offsets[k + 1]]].astype(np.float64)
    mean = members.mean(axis=0)
    np.testing.assert_allclose(cent[k, :-1], mean, rtol=1e-5, atol=1e-6 * np.abs(members).max())
    spread = np.sqrt(np.mean(np.sum((members - mean) ** 2, axis=1)))
    np.testing.assert_allclose(cent[k, -1], min(spread, limit), rtol=1e-3)


def test_build_index_is_a_partition_with_the_clusters_mean_rows():
  index, w, b = _index(num_valid=470)
  offsets, rows, cent = np.asarray(index.offsets), np.asarray(index.rows), np.asarray(index.centroids)
  assert offsets[0] == 0 and offsets[-1] == 470 and np.all(np.diff(offsets) >= 0)
  assert sorted(rows[:470].tolist()) == list(range(470)) and np.all(rows[470:] == -1)  # padding rows left out
  wb = np.concatenate([w, b[:, None]], axis=1).astype(np.float64)
  for c in range(cent.shape[0]):
    members = rows[offsets[c]:offsets[c + 1]]
    want = wb[members].mean(axis=0) if len(members) else np.zeros(wb.shape[1])
    np.testing.assert_allclose(cent[c, :-1], want, rtol=1e-4, atol=1e-5)  # probe vector: the mean row
    spread = np.sqrt(np.mean(np.sum((wb[members] - want) ** 2, axis=1))) if len(members) else 0.0
    np.testing.assert_allclose(cent[c, -1], spread, rtol=1e-3, atol=1e-4)  # rms distance from it
  stats = clusters.cluster_fill(np.asarray(index.sizes))  # what the clustered Index.fill reports
  assert stats["cluster_mean"] == pytest.approx(470 / 20) and stats["cluster_max"] == np.diff(offsets).max()


def test_build_index_leaves_non_finite_rows_out_of_every_cluster():
  """A user audit: one NaN weight made the mean row NaN, so every centred row, and put all rows in cluster 0."""
  _, w, b = _index()
  w[3, 0], b[7] = np.nan, np.inf
  index = clusters.build_index(clusters.init_index(20, 500, 8), jnp.asarray(w), jnp.asarray(b), iterations=5)
  offsets, rows, cent = np.asarray(index.offsets), np.asarray(index.rows), np.asarray(index.centroids)
  assert offsets[-1] == 498 and sorted(rows[:498].tolist()) == sorted(set(range(500)) - {3, 7})
  assert np.all(rows[498:] == -1) and np.all(np.isfinite(cent))
  # The finite rows are clustered as they are without the others (seeds, means and assignments alike).
  kept = np.array(sorted(set(range(500)) - {3, 7}))
  alone = clusters.build_index(clusters.init_index(20, 498, 8), jnp.asarray(w[kept]), jnp.asarray(b[kept]),
                               iterations=5)
  np.testing.assert_array_equal(offsets, np.asarray(alone.offsets))
  np.testing.assert_array_equal(rows[:498], kept[np.asarray(alone.rows)])
  np.testing.assert_allclose(cent, np.asarray(alone.centroids), rtol=1e-5, atol=1e-6)


def test_merged_shard_indexes_probe_as_the_shards_do():
  """Two shards' indexes (the second with a padding row and a non-finite row left out) merged into one: its
  clusters are the shards' with global member ids, and probing it takes, from every shard's clusters ranked
  together, the members of the best ones on (brute force over the shards' own scores)."""
  rng = np.random.default_rng(5)
  N, R, d = 47, 24, 6
  w = (rng.normal(size=(2 * R, d)) * rng.uniform(0.2, 2.0, size=(2 * R, 1))).astype(np.float32)
  b = rng.normal(size=2 * R).astype(np.float32)
  w[30, 0] = np.nan  # left out of every cluster, as one process leaves it out
  shards = [clusters.build_index(clusters.init_index(5, R, d), jnp.asarray(w[p * R:(p + 1) * R]),
                                 jnp.asarray(b[p * R:(p + 1) * R]), iterations=3, num_valid=min(R, N - p * R))
            for p in range(2)]
  merged = clusters.merge_shards([jax.tree.map(np.asarray, s) for s in shards], R, N)
  assert merged.centroids.shape == (10, d + 2) and merged.offsets.shape == (11,) and merged.rows.shape == (N,)
  assert sorted(merged.rows[:-1].tolist()) == sorted(set(range(N)) - {30}) and merged.rows[-1] == -1
  members = [(np.asarray(s.rows)[np.asarray(s.offsets)[c]:np.asarray(s.offsets)[c + 1]] + p * R).tolist()
             for p, s in enumerate(shards) for c in range(5)]
  assert [merged.rows[merged.offsets[c]:merged.offsets[c + 1]].tolist() for c in range(10)] == members
  h = jnp.asarray(np.maximum(rng.normal(size=(8, d)), 0), jnp.float32)
  scores = np.concatenate([np.asarray(clusters.probe_scores(s, h)) for s in shards], axis=1)
  for count in (1, 7, 20, N - 1):
    got = np.asarray(clusters.probe(jax.tree.map(jnp.asarray, merged), h, 10, count))
    for q in range(8):
      ranked = sorted((c for c in range(10) if members[c]), key=lambda c, q=q: (-scores[q, c], c))
      want = [m for c in ranked for m in members[c]][:count]
      assert got[q].tolist() == want + [-1] * (count - len(want)), (count, q)
  with pytest.raises(ValueError, match="more than num_rows = 40"):
    clusters.merge_shards(shards, R, 40)


def test_index_arguments_are_named():
  """A user audit: num_valid outside [0, N] was accepted, and a query of the wrong width blamed the index."""
  index, w, b = _index()
  for bad in (-1, 510):
    with pytest.raises(ValueError, match=rf"build_index: argument 'num_valid' must be in \[0, 500\], got {bad}"):
      clusters.build_index(index, jnp.asarray(w), jnp.asarray(b), num_valid=bad)
  # A float count of iterations gave a raw fori_loop error.
  with pytest.raises(TypeError, match=r"build_index: argument 'iterations' must be an integer, got float 1.5"):
    clusters.build_index(index, jnp.asarray(w), jnp.asarray(b), iterations=1.5)
  with pytest.raises(ValueError, match=r"build_index: argument 'sample_per_cluster' must be in \[1, inf\], got 0"):
    clusters.build_index(index, jnp.asarray(w), jnp.asarray(b), sample_per_cluster=0)
  with pytest.raises(ValueError, match=r"index_probe: argument 'queries' must have shape \[B, 8\] with axis 1 = 8, "
                                       r"got \(2, 9\)"):
    clusters.probe(index, jnp.zeros((2, 9), jnp.float32), probes=2, count=4)


def test_build_index_ignores_the_component_all_rows_share():
  # A row shared by all rows shifts every logit of a query by one constant: the exact ranking, and so the
  # clusters and each query's candidates, must not change (raw rows would all point along the shared one).
  rng = np.random.default_rng(4)
  w = rng.normal(size=(600, 8)).astype(np.float32)
  b = (0.3 * rng.normal(size=600)).astype(np.float32)
  shared = (20.0 * rng.normal(size=8)).astype(np.float32)

  def build(w, b):
    return clusters.build_index(clusters.init_index(24, 600, 8), jnp.asarray(w), jnp.asarray(b), iterations=4,
                                key=jax.random.key(1))

  plain, shifted = build(w, b), build(w + shared, b + 5.0)
  np.testing.assert_array_equal(np.asarray(plain.offsets), np.asarray(shifted.offsets))
  np.testing.assert_array_equal(np.asarray(plain.rows), np.asarray(shifted.rows))
  h = np.maximum(rng.normal(size=(16, 8)), 0).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(clusters.probe(plain, jnp.asarray(h), 24, 100)),
                                np.asarray(clusters.probe(shifted, jnp.asarray(h), 24, 100)))


def test_build_index_on_a_sample_partitions_every_row_and_finds_planted_clusters():
  # 40 planted directions x 75 rows; Lloyd on 16 sampled rows per cluster must still place every valid row in
  # the cluster of its direction, like the full build (a sample as large as N is the full build, bit for bit).
  rng = np.random.default_rng(8)
  c, per, d, num_valid = 40, 75, 16, 2950
  directions = rng.normal(size=(c, d))
  truth = np.repeat(np.arange(c), per)
  w = (directions[truth] + 0.05 * rng.normal(size=(c * per, d))).astype(np.float32)
  b = np.zeros(c * per, np.float32)

  def build(sample):
    return clusters.build_index(clusters.init_index(c, c * per, d), jnp.asarray(w), jnp.asarray(b), iterations=4,
                                num_valid=num_valid, key=jax.random.key(2), sample_per_cluster=sample)

  full, sampled = build(None), build(16)
  for got, want in zip(jax.tree.leaves(build(per)), jax.tree.leaves(full)):  # 75 x 40 rows >= N: no sample
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for index in (full, sampled):
    offsets, rows = np.asarray(index.offsets), np.asarray(index.rows)
    assert offsets[-1] == num_valid and sorted(rows[:num_valid].tolist()) == list(range(num_valid))
    assert np.all(rows[num_valid:] == -1)
    # Purity: the share of rows whose cluster's majority direction is their own.
    members = [truth[rows[offsets[k]:offsets[k + 1]]] for k in range(c)]
    pure = sum(np.bincount(m).max() for m in members if len(m))
    assert pure / num_valid > 0.95, pure / num_valid
  with pytest.raises(ValueError, match="sample_per_cluster"):
    build(0)


def test_probe_takes_the_best_clusters_members_in_order():
  index, w, b = _index()
  h = np.maximum(np.random.default_rng(5).normal(size=(6, 8)), 0).astype(np.float32)
  got = np.asarray(clusters.probe(index, jnp.asarray(h), probes=4, count=60))
  cent, offsets, rows = (np.asarray(index.centroids, np.float64), np.asarray(index.offsets), np.asarray(index.rows))
  q = np.concatenate([h, np.ones((6, 1))], 1)
  for i in range(6):
    best = np.argsort(-(q @ cent[:, :-1].T)[i], kind="stable")[:4]  # the clusters' mean logits
    want = np.concatenate([rows[offsets[c]:offsets[c + 1]] for c in best])[:60]
    assert got[i, :len(want)].tolist() == want.tolist()
    assert np.all(got[i, len(want):] == -1)


def _probe_reference(scores, offsets, rows, probes, count):
  """Brute force: every non-empty cluster ranked by score (NaN last, ties to the lower id), members in order."""
  out = np.full((scores.shape[0], count), -1, np.int32)
  for i, s in enumerate(scores):
    ranked = sorted((k for k in range(len(s)) if offsets[k + 1] > offsets[k]),
                    key=lambda k: (np.isnan(s[k]), -np.nan_to_num(s[k], nan=0.0), k))[:probes]
    got = np.concatenate([rows[offsets[k]:offsets[k + 1]] for k in ranked] + [np.zeros(0, np.int32)])[:count]
    out[i, :len(got)] = got
  return out


@pytest.mark.parametrize("probes,count", [(1, 5), (3, 40), (50, 17), (50, 400), (7, 0)])
def test_probe_kernel_against_brute_force(probes, count):
  """Ties, NaN and -inf scores, empty clusters, a probe limit and counts beyond all members (the kernel's
  partial sort extends itself when the first batch of clusters falls short)."""
  rng = np.random.default_rng(probes * 100 + count)
  C, R, B = 50, 300, 16
  sizes = rng.integers(0, 13, size=C)
  sizes[rng.random(C) < 0.2] = 0  # empty clusters
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
  assert offsets[-1] <= R
  rows = rng.permutation(R).astype(np.int32)
  scores = rng.choice(np.float32([-1.0, 0.0, 0.5, 1.0, 2.0, np.nan, -np.inf]), size=(B, C))  # many ties
  index = clusters.ClusterIndex(jnp.zeros((C, 3), jnp.float32), jnp.asarray(offsets), jnp.asarray(rows))
  call = _ffi.ffi_call("cluster_probe", jax.ShapeDtypeStruct((B, count), jnp.int32))
  got = np.asarray(call(jnp.asarray(scores), index.offsets, index.rows, probes=np.int64(probes)))
  np.testing.assert_array_equal(got, _probe_reference(scores, offsets, rows, probes, count))


@pytest.mark.parametrize("empty,big,probes,count", [(0.0, 80, 4096, 10), (0.2, 80, 4096, 600),
                                                     (0.2, 400, 4096, 600), (0.2, 80, 4096, 20000),
                                                     (0.2, 80, 20, 200), (0.2, 80, 500, 600),
                                                     (0.9, 80, 4096, 50), (0.97, 80, 4096, 40)])
def test_probe_kernel_against_brute_force_with_many_clusters(empty, big, probes, count):
  """From 1,024 clusters on the kernel ranks only those below a threshold sampled from every 16th score, then the
  rest of those, then (if their members fall short) all clusters. Skewed cluster sizes (most members in a few
  clusters of up to `big`) and rows that rank the smallest clusters first, so that the first batch, or all the
  clusters below the threshold, fall short; empty clusters (most of them, in the last two cases, so that the
  sampled threshold can be an empty one); ties, NaN and -inf, a row of NaN; a probe limit."""
  rng = np.random.default_rng(int(empty * 100) + big + probes + count)
  C, B = 4096, 12
  sizes = np.where(rng.random(C) < 0.05, rng.integers(20, big, size=C), rng.integers(0, 3, size=C))
  sizes[rng.random(C) < empty] = 0
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
  rows = rng.permutation(offsets[-1]).astype(np.int32)
  values = np.concatenate([rng.standard_normal(40), [0.0, -0.0, np.nan, -np.inf, np.inf]]).astype(np.float32)
  scores = np.where(rng.random((B, C)) < 0.5, rng.standard_normal((B, C)), rng.choice(values, size=(B, C)))
  scores[3] = np.nan
  scores[4, rng.random(C) < 0.9] = -np.inf
  scores[5] = -sizes + 0.1 * rng.standard_normal(C)  # the smallest clusters first
  scores[6] = -sizes  # the same, in ties broken by cluster id
  scores = scores.astype(np.float32)
  call = _ffi.ffi_call("cluster_probe", jax.ShapeDtypeStruct((B, count), jnp.int32))
  got = np.asarray(call(jnp.asarray(scores), jnp.asarray(offsets), jnp.asarray(rows), probes=np.int64(probes)))
  np.testing.assert_array_equal(got, _probe_reference(scores, offsets, rows, probes, count))


def test_assign_matches_dense_argmax_over_chunks():
  """clusters._assign (chunked matmul + the kernel) against one dense argmax, with rows not a multiple of the
  chunk and the chunk shrunk so that several chunks run."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal((1000, 9)).astype(np.float32)
  c = rng.standard_normal((70, 9)).astype(np.float32)
  scores = np.asarray(jnp.dot(jnp.asarray(x), jnp.asarray(c).T, precision="highest"))
  best, score = clusters._assign(jnp.asarray(x), jnp.asarray(c))
  np.testing.assert_array_equal(np.asarray(best), np.argmax(scores, axis=1))
  np.testing.assert_allclose(np.asarray(score), scores.max(axis=1), rtol=1e-6)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(clusters, "_ASSIGN_CHUNK_BYTES", 4 * 70 * 64)  # 64 rows a chunk: 16 chunks, the last padded
    best2, _ = jax.jit(clusters._assign)(jnp.asarray(x), jnp.asarray(c))
  np.testing.assert_array_equal(np.asarray(best2), np.argmax(scores, axis=1))


def test_probe_rejects_a_corrupt_index():
  index, _, _ = _index(n=60, d=4, c=5, seed=2)
  h = jnp.ones((2, 4), jnp.float32)
  offsets = np.asarray(index.offsets).copy()
  offsets[2] = offsets[1] - 1  # decreasing: would read members of another cluster, or before 'rows'
  bad = clusters.ClusterIndex(index.centroids, jnp.asarray(offsets), index.rows)
  with pytest.raises(Exception, match=r"index_probe: argument 'index.offsets' must be non-decreasing in \[0, R = 60\]"
                                      r" .*offsets\[2\]"):
    jax.block_until_ready(clusters.probe(bad, h, probes=5, count=10))
  offsets[2], offsets[5] = offsets[1], 61  # past the end of 'rows'
  bad = clusters.ClusterIndex(index.centroids, jnp.asarray(offsets), index.rows)
  with pytest.raises(Exception, match=r"offsets\[5\] = 61"):
    jax.block_until_ready(jax.jit(clusters.probe, static_argnums=(2, 3))(bad, h, 5, 10))
  with pytest.raises(ValueError, match=r"index_probe: argument 'probes' must be in \[1, inf\], got 0"):
    clusters.probe(index, h, probes=0, count=10)


@pytest.mark.parametrize("num_clusters", [6, 2048])  # 2048: the kernel's narrowed ranking (from 1,024 clusters)
@pytest.mark.parametrize("bad_id", [40, 41, -1, -(2**31)])
def test_probe_rejects_member_ids_outside_the_rows(num_clusters, bad_id):
  """A hand-built (or loaded) index whose members lie outside [0, N) (N = len(rows)) is an error naming the id,
  its position in 'rows', its cluster and the query that probed it (the lowest such query), eager and jitted;
  never a returned id. A bad member that no query reaches changes nothing."""
  C, N = num_clusters, 40
  sizes = np.zeros(C, np.int64)
  sizes[:6] = [3, 0, 4, 2, 5, 1]  # 15 members; the rest empty
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
  rows = np.concatenate([np.arange(0, 30, 2), np.full(N - 15, -1)]).astype(np.int32)  # member ids 0, 2, ..., 28
  scores = np.full((3, C), -1.0, np.float32)
  scores[:, :6] = [[5, 0, 4, 3, 2, 1], [0, 0, 1, 2, 3, 4], [5, 0, 4, 3, 2, 1]]  # queries 0, 2: clusters 0, 2, 3
  index = clusters.ClusterIndex(jnp.zeros((C, 3), jnp.float32), jnp.asarray(offsets), jnp.asarray(rows))
  call = lambda index, scores: clusters.probe_ranked(index, scores, 3, 6)
  np.testing.assert_array_equal(np.asarray(call(index, jnp.asarray(scores))),
                                _probe_reference(scores, offsets, rows, 3, 6))
  rows[10] = bad_id  # cluster 4's second member: probed by query 1 only (scores 4, 3, 2 for clusters 5, 4, 3)
  bad = clusters.ClusterIndex(index.centroids, index.offsets, jnp.asarray(rows))
  pattern = (rf"index_probe: argument 'index.rows' has id {bad_id} at position 10 \(a member of cluster 4, probed "
             rf"for query 1\), outside \[0, N = 40\)")
  with pytest.raises(Exception, match=pattern):
    jax.block_until_ready(call(bad, jnp.asarray(scores)))
  with pytest.raises(Exception, match=pattern):
    jax.block_until_ready(jax.jit(call)(bad, jnp.asarray(scores)))
  # Only queries 0 and 2 (which stop within clusters 0, 2): the bad member is never copied out.
  np.testing.assert_array_equal(np.asarray(jax.jit(call)(bad, jnp.asarray(scores[::2]))),
                                _probe_reference(scores[::2], offsets, rows, 3, 6))


def test_probe_ranks_clusters_by_mean_logit_plus_spread():
  index, w, b = _index()
  h = np.maximum(np.random.default_rng(7).normal(size=(6, 8)), 0).astype(np.float32)
  cent, offsets, rows = (np.asarray(index.centroids, np.float64), np.asarray(index.offsets), np.asarray(index.rows))
  q = np.concatenate([h, np.ones((6, 1))], 1)
  for weight in (0.5, 3.0):
    got = np.asarray(clusters.probe(index, jnp.asarray(h), probes=5, count=70, spread_weight=weight))
    score = q @ cent[:, :-1].T + weight * np.linalg.norm(q, axis=1, keepdims=True) * cent[:, -1] / np.sqrt(9)
    for i in range(6):
      best = np.argsort(-score[i], kind="stable")[:5]
      want = np.concatenate([rows[offsets[c]:offsets[c + 1]] for c in best])[:70]
      assert got[i, :len(want)].tolist() == want.tolist()
  # A large weight changes the order: it is not ignored.
  plain = np.asarray(clusters.probe(index, jnp.asarray(h), probes=5, count=70))
  assert not np.array_equal(plain, np.asarray(clusters.probe(index, jnp.asarray(h), probes=5, count=70,
                                                             spread_weight=50.0)))


def test_index_query_finds_the_top_logits():
  index, w, b = _index(n=2000, d=16, c=45, seed=3)
  h = np.maximum(np.random.default_rng(6).normal(size=(32, 16)), 0).astype(np.float32)
  active, n = clusters.index_query(index, jnp.asarray(h), k=200, num_rows=2000, probes=20)
  top = np.argsort(-(h @ w.T + b), axis=1)[:, :10]
  found = np.mean([len(set(top[i]) & set(np.asarray(active)[i, :int(n[i])].tolist())) / 10 for i in range(32)])
  assert found > 0.5, found  # 10% of the rows (random ones would hold 10% of the top 10)


SHARDED_RECALL = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from sparsejax import retrieval
from sparsejax.distributed.sharding import make_mesh
from sparsejax.shard import Shard
rng = np.random.default_rng(5)
shards, B, k, R, d = 3, 8, 6, 20, 4  # each shard 20 rows: global ids [20 p, 20 p + 20)
active = np.stack([np.stack([rng.permutation(R)[:k] for _ in range(B)]) for _ in range(shards)]).astype(np.int32)
active[:, 0, 4:] = -1  # a shard's share ends early (a clustered query's padding)
n = rng.integers(0, k + 1, size=(shards, B)).astype(np.int32)
labels = rng.integers(-1, shards * R, size=(B, 3)).astype(np.int32)
top = np.stack([rng.permutation(shards * R)[:5] for _ in range(B)]).astype(np.int32)
h, w = rng.normal(size=(B, d)).astype(np.float32), rng.normal(size=(shards * R, d)).astype(np.float32)
def local(active, n, labels, top, h, w):
  out = retrieval.per_query(active[0], n[0], labels, top, h, w, Shard("shard"))
  return out["label_recall"], out["topk_recall"]
f = jax.shard_map(local, mesh=make_mesh(shards), in_specs=(P("shard"), P("shard"), P(), P(), P(), P("shard")),
                  out_specs=(P(), P()), check_vma=False)
recall, topk = f(*map(jnp.asarray, (active, n, labels, top, h, w)))
print(json.dumps(dict(active=active.tolist(), n=n.tolist(), labels=labels.tolist(), top=top.tolist(),
                      recall=np.asarray(recall).tolist(), topk=np.asarray(topk).tolist())))
"""


def test_sharded_recalls_are_of_the_union_of_the_shards_candidates(run_python):
  """Each shard looks for the labels and the exact top ids among its own candidates and the shards add up what they
  found: the recalls of the union of every shard's candidates (global ids), against a set-based count."""
  got = json.loads(run_python(code=SHARDED_RECALL, devices=3).stdout.splitlines()[-1])
  active, n = np.asarray(got["active"]), np.asarray(got["n"])
  for b, (ys, top) in enumerate(zip(got["labels"], got["top"])):
    union = {int(a) + 20 * p for p in range(3) for a in active[p, b, :n[p, b]] if a >= 0}
    ys = {y for y in ys if y >= 0}
    assert got["recall"][b] == pytest.approx(len(ys & union) / len(ys) if ys else 0.0)
    assert got["topk"][b] == pytest.approx(len(set(top) & union) / 5)


def test_diagnostics_against_brute_force():
  rng = np.random.default_rng(2)
  B, k, N, d = 9, 7, 40, 5
  active = np.stack([rng.permutation(N)[:k] for _ in range(B)]).astype(np.int32)
  n = rng.integers(0, k + 1, size=B).astype(np.int32)
  labels = rng.integers(-1, N, size=(B, 3)).astype(np.int32)
  labels[0] = [active[0, 0], active[0, 0], -1]  # a repeated label counts once
  labels[1] = -1  # no labels: excluded from the label metrics
  top = np.stack([rng.permutation(N)[:4] for _ in range(B)]).astype(np.int32)
  h = rng.normal(size=(B, d)).astype(np.float32)
  w = rng.normal(size=(N, d)).astype(np.float32)
  got = jax.tree.map(np.asarray, retrieval.per_query(*map(jnp.asarray, (active, n, labels, top, h, w))))
  for b in range(B):
    cands = set(active[b, :n[b]].tolist())
    ys = {int(y) for y in labels[b] if y >= 0}
    assert got["has_labels"][b] == bool(ys)
    if ys:
      assert got["label_recall"][b] == pytest.approx(len(ys & cands) / len(ys))
      cos = [h[b] @ w[y] / np.linalg.norm(h[b]) / np.linalg.norm(w[y]) for y in ys]
      assert got["label_cosine"][b] == pytest.approx(np.mean(cos), rel=1e-5)
    assert got["topk_recall"][b] == pytest.approx(len(set(top[b].tolist()) & cands) / 4)
    assert got["num_candidates"][b] == n[b]
  summary = retrieval.summarize([{key: v[:4] for key, v in got.items()}, {key: v[4:] for key, v in got.items()}], 4)
  labelled = got["has_labels"]
  assert summary["label_recall"] == pytest.approx(got["label_recall"][labelled].mean())
  assert summary["topk_recall@4"] == pytest.approx(got["topk_recall"].mean())
  assert summary["mean_candidates"] == pytest.approx(n.mean())


def test_table_fill_against_counts():
  cfg = lsh.LSHConfig("simhash", num_tables=3, num_bits=3)
  params = lsh.init_lsh(jax.random.key(0), cfg, 6)
  w = jax.random.normal(jax.random.key(1), (100, 6))
  t = tables.build_tables(tables.init_tables(cfg, 16), params, w)
  codes = np.asarray(lsh.lsh_hash(params, w))
  counts = np.stack([np.bincount(codes[:, l], minlength=8) for l in range(3)])
  stats = tables.table_fill(np.asarray(t.counts), t.buckets.shape[2])  # what the hashed Index.fill reports
  assert stats["bucket_mean"] == pytest.approx(np.minimum(counts, 16).mean())
  assert stats["buckets_empty"] == pytest.approx(np.mean(counts == 0))
  assert stats["buckets_overflowed"] == pytest.approx(np.mean(counts > 16))


def test_probe_skips_empty_clusters():
  index, w, b = _index(n=60, d=4, c=5, seed=2)
  sizes = np.asarray(index.sizes)
  # Empty the first cluster (its members move to the second) and give it the best score of every query.
  offsets = np.asarray(index.offsets).copy()
  offsets[1] = 0
  cent = np.asarray(index.centroids).copy()
  cent[0, :-1] = 100.0
  emptied = clusters.ClusterIndex(jnp.asarray(cent), jnp.asarray(offsets), index.rows)
  h = np.ones((3, 4), np.float32)
  got = np.asarray(clusters.probe(emptied, jnp.asarray(h), probes=1, count=8))
  assert sizes[0] > 0 and np.all(got >= 0)  # the one probe went to a non-empty cluster


def test_serving_index_is_built_finer_on_the_final_rows():
  from sparsejax.config import Config
  from sparsejax.settings import override

  config = ModelConfig.from_config(override(Config(), hidden_dims=(8,), num_clusters=5, eval_num_clusters=40,
                                            eval_kmeans_iterations=3, active_k=64), 50, 400)
  assert config.index_sizes[0] == 5 and config.eval_index_sizes == (40, 3)
  state = model.init(jax.random.key(0), config)
  rng = np.random.default_rng(0)
  out = SparseLayer(jnp.asarray(rng.normal(size=(400, 8)), jnp.float32),
                          jnp.asarray(0.1 * rng.normal(size=400), jnp.float32))
  state = state._replace(out=out)
  served = model.serving_index(state, config)
  assert served.index.centroids.shape == (40, 10) and state.index.centroids.shape == (5, 10)
  want = clusters.build_index(clusters.init_index(40, 400, 8), out.w, out.b, iterations=3)
  for got, expected in zip(jax.tree.leaves(served.index), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  h = np.maximum(rng.normal(size=(16, 8)), 0).astype(np.float32)
  active, n = model.query_active(served, jnp.asarray(h), config=config, k=64, num_rows=400)
  assert np.all(np.asarray(n) == 64)
  np.testing.assert_array_equal(np.asarray(active), np.asarray(clusters.probe(
      want, jnp.asarray(h), 40, 64, spread_weight=config.tables.cluster_spread_weight)))
  top = np.argsort(-(h @ np.asarray(out.w).T + np.asarray(out.b)), axis=1)[:, :5]
  found = np.mean([len(set(top[i]) & set(np.asarray(active)[i].tolist())) / 5 for i in range(16)])
  assert found > 0.5, found  # 16% of the rows hold most of the exact top 5


def test_serving_index_of_bfloat16_rows():
  from sparsejax.config import Config
  from sparsejax.settings import override

  config = override(Config(), hidden_dims=(8,), num_clusters=4, eval_num_clusters=12, active_k=32,
                    weight_dtype="bfloat16")
  config = ModelConfig.from_config(config, 50, 200)
  state = model.init(jax.random.key(1), config)
  assert state.out.w.dtype == jnp.bfloat16
  served = model.serving_index(state, config)
  want = clusters.build_index(clusters.init_index(12, 200, 8), state.out.w.astype(jnp.float32), state.out.b,
                              iterations=config.eval_index_sizes[1])
  np.testing.assert_array_equal(np.asarray(served.index.rows), np.asarray(want.rows))


def test_serving_k_is_a_fixed_share_of_the_labels_or_the_training_k():
  """(N / 4000)^2 candidates, at most N / 16, at least the training k: at 10^6 labels the training k (1,024) found
  the exact top label for 8% of the queries, a sixteenth of the rows for 99% (benchmarks/RESULTS.md, "Sampled
  inference at 10^6 labels")."""
  from sparsejax.config import Config
  from sparsejax.settings import override

  def serving_k(num_labels, **settings):
    return ModelConfig.from_config(override(Config(), **settings), 50, num_labels).serving_k

  assert serving_k(10**6) == 62_500 and serving_k(200_000) == 2_500 and serving_k(500_000) == 15_625  # (N / 4000)^2
  assert serving_k(10**7) == 625_000  # N / 16
  assert serving_k(100_000) == 1024 and serving_k(500) == 500  # the training k (625 < 1,024), at most N
  assert serving_k(10**6, active_k=100_000) == 100_000
  assert serving_k(10**6, serving_k=4096) == 4096 and serving_k(300, serving_k=4096) == 300


@pytest.mark.parametrize("setting, k", [(None, 8), (400, 400)])
def test_sampled_inference_scores_serving_k_candidates_exactly(setting, k):
  """Default at 400 rows: the training k, 8 (the square rule gives 0), each query's best 5 by their exact logits;
  all 400 rows as candidates: the brute-force top 5."""
  from sparsejax import inference
  from sparsejax.config import Config
  from sparsejax.settings import override

  config = ModelConfig.from_config(override(Config(), hidden_dims=(8,), num_clusters=5, eval_num_clusters=40,
                                            active_k=8, serving_k=setting), 50, 400)
  assert config.serving_k == k
  rng = np.random.default_rng(1)
  state = model.init(jax.random.key(0), config)
  w, b = rng.normal(size=(400, 8)).astype(np.float32), (0.1 * rng.normal(size=400)).astype(np.float32)
  state = model.serving_index(state._replace(out=SparseLayer(jnp.asarray(w), jnp.asarray(b))), config)
  h = np.maximum(rng.normal(size=(16, 8)), 0).astype(np.float32)
  scores, ids, active, n = map(np.asarray, inference.sampled_topk(state, jnp.asarray(h), config=config, top=5))
  assert active.shape == (16, k) and np.all(n == k)
  assert all(len(set(row)) == k for row in active.tolist())
  for i in range(16):  # the best 5 of the candidates' logits, from numpy
    logits = h[i] @ w[active[i]].T + b[active[i]]
    np.testing.assert_array_equal(ids[i], active[i][np.argsort(-logits, kind="stable")[:5]])
    np.testing.assert_allclose(scores[i], np.sort(logits)[::-1][:5], rtol=1e-5)
  if k == 400:
    np.testing.assert_array_equal(ids, np.argsort(-(h @ w.T + b), axis=1, kind="stable")[:, :5])
