"""A clustered (IVF) index over the rows of an output layer, as a pytree of arrays.

The rows, centred on their mean row (which shifts each query's logits by
one constant, so leaves their ranking alone, but removes the direction that
all rows share after training), are grouped by spherical k-means in the
MIPS-augmented space of :mod:`sparsejax.index.mips` (so that a cluster holds rows
whose logits rise and fall together). A query scores the ``C`` clusters by
their members' mean logit (one ``[B, C]`` matmul with the clusters' mean
rows), probes its best clusters and takes their members, best cluster first,
as candidates: an inverted-file index. Refreshing it (a few Lloyd iterations)
is ``O(N C d)`` scheduled work, like rebuilding hash tables; a query is
``O(B C d)`` plus the probed members.

* :func:`init_index` - empty index of static sizes.
* :func:`build_index` - (re)clusters the rows and refills the member lists.
* :func:`probe` - the first ``T`` members of each query's best clusters.
* :func:`index_query` - active sets (labels, candidates, random fill), like
  :func:`sparsejax.index.tables.lsh_query`.
* :func:`merge_candidates` - the kernel that turns ranked candidates into
  duplicate-free active sets.
* :func:`merge_shards` - one index over a sharded layer's rows from its
  shards' indexes.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import _ffi, selection
from sparsejax._checks import Dims, check_array, check_index, check_int
from sparsejax.index import mips

_ASSIGN_CHUNK_BYTES = 4 << 20  # scores of a chunk of rows against all centroids, while clustering
_ASSIGN_MIN_CHUNK = 64
_ROW_BLOCK = 16384  # rows per block where the index is built without copying every row (8 MB of them at d = 128)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ClusterIndex:
  """C clusters of the N output rows, as an inverted file (no capacity limit).

  Attributes:
    centroids: ``[C, d + 2]`` float32 probe vectors: cluster c's mean row
      and spread ``[mean w, mean b, s]`` (a query's score of the cluster is
      its members' mean logit, plus, if asked, a multiple of ``s``, the root
      mean square distance of its members' ``[w, b]`` from the mean row); all
      zero before the first build and for empty clusters.
    offsets: ``[C + 1]`` int32: cluster c's members are
      ``rows[offsets[c]:offsets[c + 1]]``.
    rows: ``[N]`` int32 row ids grouped by cluster, each cluster's closest to
      its centroid first (padding rows of a shard last, outside every cluster).
  """
  centroids: jax.Array
  offsets: jax.Array
  rows: jax.Array

  @property
  def sizes(self) -> jax.Array:
    """``[C]`` rows per cluster."""
    return jnp.diff(self.offsets)

  @property
  def nbytes(self) -> int:
    return int(self.centroids.size * 4 + self.offsets.size * 4 + self.rows.size * 4)


def default_num_clusters(num_rows: int) -> int:
  """About ``sqrt(N)`` clusters: refresh cost ``O(N^1.5 d)``, ``sqrt(N)`` rows per cluster."""
  return max(1, round(math.sqrt(num_rows)))


def init_index(num_clusters: int, num_rows: int, dim: int) -> ClusterIndex:
  """An empty index of ``num_clusters`` clusters over ``num_rows`` rows of width ``dim``."""
  num_rows = check_int("init_index", "num_rows", num_rows, 1)
  num_clusters = check_int("init_index", "num_clusters", num_clusters, 1)
  dim = check_int("init_index", "dim", dim, 0)
  if not 1 <= num_clusters <= num_rows:
    raise ValueError(f"num_clusters must be in [1, num_rows = {num_rows}], got {num_clusters}")
  return ClusterIndex(centroids=jnp.zeros((num_clusters, dim + 2), jnp.float32),
                      offsets=jnp.zeros((num_clusters + 1,), jnp.int32),
                      rows=jnp.full((num_rows,), -1, jnp.int32))


def _blocks(n: int, block: int):
  """``(count, rows per block, start(i))``: blocks of ``block`` rows (at most ``n``) over ``[0, n)``, the last one
  ending at row ``n`` (it re-reads rows of the one before)."""
  block = min(block, n)
  return -(-n // block), block, lambda i: jnp.minimum(i * block, n - block)


def _map_rows(fn, n: int, block: int, *arrays) -> tuple[jax.Array, ...]:
  """``fn(*blocks) -> tuple of [block, ...]`` over blocks of rows of ``arrays`` (each ``[n, ...]``), joined into
  ``[n, ...]`` arrays: never more than a block of whatever ``fn`` makes at once."""
  count, block, start = _blocks(n, block)
  outs = jax.lax.map(lambda i: fn(*[jax.lax.dynamic_slice_in_dim(a, start(i), block) for a in arrays]),
                     jnp.arange(count))
  overlap = count * block - n  # rows at the last block's start that the one before gave
  return tuple(jnp.concatenate([o[:-1].reshape(-1, *o.shape[2:]), o[-1, overlap:]]) for o in outs)


def _sum_rows(fn, n: int, block: int, discarded: int, *arrays):
  """The sum over blocks of rows of ``fn(*blocks)``: the rows that a last block re-reads are given the segment id
  ``discarded`` in the last array (the segment ids, or a mask with ``discarded = False``)."""
  count, block, start = _blocks(n, block)

  def add(i, total):
    blocks = [jax.lax.dynamic_slice_in_dim(a, start(i), block) for a in arrays]
    fresh = jnp.arange(block) + start(i) >= i * block
    blocks[-1] = jnp.where(fresh, blocks[-1], discarded)
    return jax.tree.map(jnp.add, total, fn(*blocks))

  first = fn(*[jax.lax.dynamic_slice_in_dim(a, 0, block) for a in arrays])
  return jax.lax.fori_loop(1, count, add, first)


def _assign_chunk(num_centroids: int) -> int:
  """Rows per block of :func:`_assign`: their ``[chunk, C]`` scores stay about ``_ASSIGN_CHUNK_BYTES``, in cache for
  the kernel that reads them. (XLA:CPU's argmax over a row's C scores took longer than the matmul: 1.9 s of 3.2 s
  for 2e5 rows and 4096 centroids.)"""
  return max(_ASSIGN_CHUNK_BYTES // (4 * num_centroids), _ASSIGN_MIN_CHUNK)


def _best_centroid(rows: jax.Array, centroids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(best centroid [m], its score [m])`` of a block of rows ``[m, d + 2]``."""
  score, assign = selection.row_topk(jnp.dot(rows, centroids.T, precision="highest"), 1)
  return assign[:, 0], score[:, 0]


def _assign(x: jax.Array, centroids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Best centroid ``[N]`` and its score ``[N]`` of each row, in blocks of rows (never ``[N, C]``).

  Ties go to the lower centroid and NaN scores rank last (:func:`selection.row_topk`, as :func:`probe` ranks).
  """
  return _map_rows(lambda rows: _best_centroid(rows, centroids), x.shape[0], _assign_chunk(centroids.shape[0]), x)


def build_index(index: ClusterIndex, weight: jax.Array, bias: jax.Array, *, iterations: int = 2,
                num_valid: int | jax.Array | None = None, key: jax.Array | None = None,
                sample_per_cluster: int | None = None) -> ClusterIndex:
  """Spherical k-means of the centred, augmented rows, then the inverted file and the clusters' mean rows.

  Measured on a synthetic 20K-label layer after 2 epochs, whose rows share a large common component (the
  mean cosine between a query and its label's row is below 0), with sampled over exact P@1 at k = 1024 /
  k = 400: raw augmented rows (282 clusters, 5 iterations) 0.54 / 0.44 (43% of the exact top-10 found);
  centred rows 0.90 / 0.78 (80%); centred and probed by the clusters' mean logit instead of the centroid's
  cosine 0.93 / 0.86.

  Every build starts afresh from ``C`` rows spread over ``[0, num_valid)``
  (offset drawn from ``key``), runs ``iterations`` Lloyd iterations (assign
  every row to its best centroid, move each centroid to the normalised mean
  of its rows; a cluster left empty keeps its centroid) and a final
  assignment: ``iterations + 1`` passes of ``O(N C d)``. With
  ``sample_per_cluster`` the Lloyd iterations see only a strided sample of
  that many rows per cluster (FAISS trains its IVF centroids the same way),
  and only the final assignment covers every row: at N = 10^6 (C = 1000) and
  64 rows per cluster a build costs about one pass instead of three. Measured
  on a trained 200K-row layer (C = 447): 99.67% of the exact top-10 within
  1024 candidates with 64 rows per cluster, 99.62% with every row, 96.5%
  with 16. Fresh seeds, not the
  previous centroids: measured on a trained 200K-row layer, two iterations
  from fresh seeds find 99.6% of the exact top-10 within 1024 candidates,
  while centroids carried over from the random initialisation still find
  only 78% after two more (clusters formed around untrained rows persist).

  Args:
    index: the index to refill (its arrays are reused; its sizes are kept).
    weight: ``[N, d]`` float32 rows.
    bias: ``[N]`` float32 biases.
    iterations: Lloyd iterations.
    num_valid: rows ``[0, num_valid)`` are real, the rest padding, in ``[0, N]``; may be traced (a traced value
      outside is clipped into it).
    key: PRNG key of the seeds' offset (default: a fixed key).
    sample_per_cluster: Lloyd iterations on ``sample_per_cluster * C`` rows
      spread over the valid ones; None, or a sample as large as ``N``: all rows.

  Returns:
    The rebuilt index.
  """
  dims = Dims("build_index")
  check_array(dims, "weight", weight, jnp.float32, ("N", "d"))
  check_array(dims, "bias", bias, jnp.float32, ("N",))
  check_array(dims, "index.centroids", index.centroids, jnp.float32, ("C", dims["d"] + 2))
  check_array(dims, "index.rows", index.rows, jnp.int32, ("N",))
  iterations = check_int("build_index", "iterations", iterations, 0)
  if sample_per_cluster is not None:
    sample_per_cluster = check_int("build_index", "sample_per_cluster", sample_per_cluster, 1)
  n = weight.shape[0]
  num_clusters = index.centroids.shape[0]
  if num_valid is not None:
    num_valid = check_index("build_index", "num_valid", num_valid, 0, n)
  valid = jnp.arange(n) < (n if num_valid is None else num_valid)
  # A non-finite row (a diverged one) would turn the mean row, so every centred row and centroid, into NaN and
  # collapse the index into one cluster: it is left out of every cluster instead, as padding is.
  row_largest = jnp.maximum(jnp.max(jnp.abs(weight), axis=1), jnp.abs(bias))  # NaN where a value is (max keeps it)
  valid &= jnp.isfinite(row_largest)
  row_largest = jnp.where(valid, row_largest, 0.0)
  n_valid = jnp.sum(valid)
  # The [N, d] rows are never copied whole (at 2·10^6 rows a shard, three such copies were 3 GB of temporaries beside
  # a 4.7 GB state, and 4 processes did not fit 24 GB): the reductions below read them in place, and the centred,
  # augmented rows are made block by block where they are needed (the Lloyd iterations see a sample of them).
  # The clusters are those of the rows scaled by a power of two (exact) to a largest |value| in [1/2, 1): finite
  # rows near float32's maximum would overflow the mean row's sum and the squared norms into inf and NaN (tiny
  # ones would underflow), and spherical k-means of centred rows does not depend on their scale.
  _, exponent = jnp.frexp(jnp.max(row_largest))
  # Centred rows: subtracting the mean row changes every logit of a query by the same amount (its ranking is
  # unchanged) but removes the component all rows share, which otherwise dominates their directions. (Summed block
  # by block: XLA:CPU made the masked, scaled rows whole for one sum over them.)
  w_sum, b_sum = _sum_rows(lambda w, b, ok: (jnp.sum(jnp.where(ok[:, None], jnp.ldexp(w, -exponent), 0.0), axis=0),
                                                jnp.sum(jnp.where(ok, jnp.ldexp(b, -exponent), 0.0))),
                           n, _ROW_BLOCK, False, weight, bias, valid)
  w_mean, b_mean = w_sum / jnp.maximum(n_valid, 1), b_sum / jnp.maximum(n_valid, 1)

  def centred(w, b, ok):
    """A block's centred, scaled rows and biases (a row left out counts as zero before centring)."""
    w, b = jnp.where(ok[:, None], w, 0.0), jnp.where(ok, b, 0.0)
    return jnp.ldexp(w, -exponent) - w_mean, jnp.ldexp(b, -exponent) - b_mean

  # The unit sphere's radius M of the augmented rows: the longest centred row of all (a row left out too, as one
  # mips.augment_rows call over every row measured it).
  def norms(w, b, ok):
    cw, cb = centred(w, b, ok)
    return (jnp.linalg.norm(jnp.concatenate([cw, cb[:, None]], axis=1), axis=1),)

  max_norm = jnp.max(_map_rows(norms, n, _ROW_BLOCK, weight, bias, valid)[0])

  def augmented(w, b, ok):
    """A block's rows as the clusters see them: centred, augmented to unit norm; zero where left out."""
    return jnp.where(ok[:, None], mips.augment_rows(*centred(w, b, ok), max_norm), 0.0)

  offset = jax.random.uniform(jax.random.key(0) if key is None else key, ())

  def spread(count: int, among):
    """``count`` indices evenly spread over ``[0, among)`` (distinct when ``count <= among``)."""
    return jnp.clip(jnp.floor((jnp.arange(count) + offset) * among / count).astype(jnp.int32), 0, n - 1)

  valid_rows = jnp.nonzero(valid, size=n, fill_value=0)[0]  # [0, n_valid) but where a non-finite row is left out
  sample_size = n if sample_per_cluster is None else min(n, sample_per_cluster * num_clusters)
  if sample_size < n:  # every sampled row is a valid one
    sample = valid_rows[spread(sample_size, n_valid)]
    train, train_valid = augmented(weight[sample], bias[sample], valid[sample]), None
    centroids = train[spread(num_clusters, sample_size)]  # seeds spread over the sampled rows
  else:  # few rows: all of them, made once
    train = _map_rows(lambda w, b, ok: (augmented(w, b, ok),), n, _ROW_BLOCK, weight, bias, valid)[0]
    train_valid = valid
    centroids = train[valid_rows[spread(num_clusters, n_valid)]]  # seeds spread over the valid rows

  def lloyd(_, c):
    assign, _ = _assign(train, c)
    if train_valid is not None:
      assign = jnp.where(train_valid, assign, num_clusters)
    sums = jax.ops.segment_sum(train, assign, num_clusters + 1)[:num_clusters]
    norms = jnp.linalg.norm(sums, axis=1, keepdims=True)
    return jnp.where(norms > 0, sums / jnp.maximum(norms, 1e-30), c)

  centroids = jax.lax.fori_loop(0, iterations, lloyd, centroids)
  if train_valid is None:  # every row's best centroid, block by block
    assign, score = _map_rows(lambda w, b, ok: _best_centroid(augmented(w, b, ok), centroids), n,
                              _assign_chunk(centroids.shape[0]), weight, bias, valid)
  else:
    assign, score = _assign(train, centroids)
  assign = jnp.where(valid, assign, num_clusters)  # padding rows: a cluster past the end
  sizes = jnp.bincount(assign, length=num_clusters + 1)[:num_clusters]
  offsets = jnp.concatenate([jnp.zeros((1,), sizes.dtype), jnp.cumsum(sizes)]).astype(jnp.int32)
  # Rows cluster by cluster, closest to the centroid first.
  rows = jnp.lexsort((-score, assign)).astype(jnp.int32)
  # Probe vectors: each cluster's mean row [w, b], so that a query scores a cluster by its members' mean logit,
  # and the members' spread around it: rms distance^2 = mean |x|^2 - |mean x|^2 (no [N, d] gather of the means).
  # Both are summed over the members scaled by a power of two of their cluster's own (so that neither sum overflows
  # nor a cluster of small rows beside huge ones loses precision), then scaled back; a spread beyond float32's
  # range (members near its maximum, far apart) is the largest float32.
  largest = jax.ops.segment_max(row_largest, assign, num_clusters + 1)[:num_clusters]
  _, cluster_exponent = jnp.frexp(jnp.maximum(largest, 0.0))  # an empty cluster's -inf: 0
  scale = jnp.append(cluster_exponent, 0)

  def scaled_sums(w, b, ok, which):
    wb = jnp.where(ok[:, None], jnp.concatenate([w, b[:, None]], axis=1), 0.0)
    wb = jnp.ldexp(wb, -scale[which][:, None])
    return jax.ops.segment_sum(wb, which, num_clusters + 1), jax.ops.segment_sum(jnp.sum(wb * wb, axis=1), which,
                                                                                num_clusters + 1)
  sums, square = _sum_rows(scaled_sums, n, _ROW_BLOCK, num_clusters, weight, bias, valid, assign)
  count = jnp.maximum(sizes, 1)[:, None].astype(jnp.float32)
  means = sums[:num_clusters] / count
  square = square[:num_clusters] / count[:, 0]
  spreads = jnp.sqrt(jnp.maximum(square - jnp.sum(means * means, axis=1), 0.0))
  limit = np.finfo(np.float32).max
  means = jnp.clip(jnp.ldexp(means, cluster_exponent[:, None]), -limit, limit)
  spreads = jnp.minimum(jnp.ldexp(spreads, cluster_exponent), limit)
  probe_vectors = jnp.concatenate([means, spreads[:, None]], axis=1)  # an empty cluster: all zero
  return ClusterIndex(centroids=probe_vectors, offsets=offsets,
                      rows=jnp.where(jnp.arange(n) < offsets[-1], rows, -1))


def merge_shards(shards: Sequence[ClusterIndex], rows_per_shard: int, num_rows: int) -> ClusterIndex:
  """One index over the ``num_rows`` global rows of a sharded layer, from its shards' indexes (host arrays).

  Shard ``p`` holds global rows ``[p R, (p + 1) R)`` (``R = rows_per_shard``) as local ids ``[0, R)``; its
  members are its real, finite rows (padding rows are outside every cluster). The result has every shard's
  clusters, in shard order, with their members as global ids (``rows`` ends in -1 where rows were left out, as a
  one-process index does). Probing it ranks all of those clusters together and takes members from the best one
  on, which is how a sharded run probes its shards' indexes (:func:`sparsejax.inference.index_candidates`): one
  process serves the candidates that the shards served.
  """
  offsets, rows, base = [], [], 0
  for p, shard in enumerate(shards):
    o, r = np.asarray(shard.offsets, np.int64), np.asarray(shard.rows)
    offsets.append(o[:-1] + base)
    rows.append(r[:o[-1]].astype(np.int64) + p * rows_per_shard)
    base += int(o[-1])
  if base > num_rows:
    raise ValueError(f"merge_shards: the shards' clusters hold {base} rows, more than num_rows = {num_rows}")
  return ClusterIndex(np.concatenate([np.asarray(s.centroids, np.float32) for s in shards]),
                      np.concatenate([*offsets, [base]]).astype(np.int32),
                      np.concatenate([*rows, np.full(num_rows - base, -1)]).astype(np.int32))


def probe(index: ClusterIndex, queries: jax.Array, probes: int, count: int, spread_weight: float = 0.0) -> jax.Array:
  """The first ``count`` members of each query's ``probes`` best clusters, best cluster first.

  A cluster's score is ``[h, 1]`` times its mean row (its members' mean
  logit) plus ``spread_weight`` times ``|[h, 1]| s / sqrt(d + 1)``, the
  standard deviation its members' logits would have if their spread ``s``
  were the same in every direction: a cluster of scattered rows is more
  likely to hold the largest logit than its mean says. One ``[B, C]``
  matmul scores the clusters; the ``cluster_probe`` kernel then sorts, per
  query, only as many clusters as its ``count`` members need (``O(C log m)``
  for ``m`` clusters used; a ``top_k`` over all ``C`` compiled to a full
  sort of each row on XLA:CPU; from 1,024 clusters on, only those below a
  threshold sampled from the scores, unless they fall short) and copies
  their members. Ties go to the lower cluster id, NaN scores rank last and
  empty clusters never take a probe.

  Args:
    index: a built index.
    queries: ``[B, d]`` float32 hidden activations.
    probes: at most this many clusters per query (>= 1).
    count: candidates per query.
    spread_weight: weight of the clusters' spread in their score (0: the mean logit alone).

  Returns:
    ``[B, count]`` int32 row ids, -1 past the probed clusters' members.
  """
  dims = Dims("index_probe")
  check_array(dims, "index.centroids", index.centroids, jnp.float32, ("C", "d + 2"))
  check_array(dims, "queries", queries, jnp.float32, ("B", dims["d + 2"] - 2))  # the index's width names the query
  return probe_ranked(index, probe_scores(index, queries, spread_weight), probes, count)  # checks offsets, rows


def probe_ranked(index: ClusterIndex, scores: jax.Array, probes: int, count: int) -> jax.Array:
  """:func:`probe` with the clusters' scores ``[B, C]`` given (:func:`probe_scores`)."""
  dims = Dims("index_probe")
  check_array(dims, "scores", scores, jnp.float32, ("B", "C"))
  check_array(dims, "index.offsets", index.offsets, jnp.int32, (dims["C"] + 1,))
  check_array(dims, "index.rows", index.rows, jnp.int32, ("R",))
  probes = check_int("index_probe", "probes", probes, 1)
  count = check_int("index_probe", "count", count, 0)
  call = _ffi.ffi_call("cluster_probe", jax.ShapeDtypeStruct((dims["B"], count), jnp.int32),
                       vmap_method="sequential")
  return call(scores, index.offsets, index.rows, probes=np.int64(probes))  # the kernel takes at most C


def probe_scores(index: ClusterIndex, queries: jax.Array, spread_weight: float = 0.0) -> jax.Array:
  """``[B, C]`` the score of each cluster for each query, by which :func:`probe` ranks them (see there)."""
  c = index.centroids
  scores = jnp.dot(queries, c[:, :-2].T, precision="highest") + c[:, -2]  # [h, 1] . mean row
  if spread_weight:
    norms = jnp.sqrt(jnp.sum(queries * queries, axis=1, keepdims=True) + 1.0)  # |[h, 1]|
    scores = scores + (spread_weight / math.sqrt(queries.shape[1] + 1)) * norms * c[:, -1]
  return scores


def merge_candidates(candidates: jax.Array, *, k: int, num_rows: int | jax.Array, labels: jax.Array | None = None,
                     seed: jax.Array | int = 0, max_from_candidates: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Active sets from ranked candidates: labels, then candidates in order, then random ids.

  Args:
    candidates: ``[B, C]`` int32 candidate ids, best first, -1 to skip;
      repeats are taken once.
    k: active set size, ``1 <= k <= num_rows``.
    num_rows: N (may be traced).
    labels: optional ``[B, max_labels]`` int32 true labels, -1 padded.
    seed: scalar seed of the random fill.
    max_from_candidates: take at most this many candidates (the rest of the
      ``k`` slots get random ids); default ``k``.

  Returns:
    ``(active [B, k] int32, num_from_candidates [B] int32)``.
  """
  dims = Dims("merge_candidates")
  check_array(dims, "candidates", candidates, jnp.int32, ("B", "C"))
  B = dims["B"]
  if labels is None:
    labels = jnp.full((B, 0), -1, jnp.int32)
  check_array(dims, "labels", labels, jnp.int32, ("B", "max_labels"))
  k = check_int("merge_candidates", "k", k, 1)
  if isinstance(num_rows, int) and k > num_rows:
    raise ValueError(f"merge_candidates: argument 'k' = {k} must be in [1, num_rows = {num_rows}]")
  max_from = k if max_from_candidates is None else check_int("merge_candidates", "max_from_candidates",
                                                             max_from_candidates, 0)
  seed = check_index(dims.op, "seed", seed, -(2**63), 2**64 - 1)  # any integer: its low 32 bits are used
  seed = np.uint32(seed % 2**32) if isinstance(seed, (int, np.integer)) else seed.astype(jnp.uint32)
  call = _ffi.ffi_call(
      "merge_candidates",
      (jax.ShapeDtypeStruct((B, k), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)),
      vmap_method="sequential")
  return call(candidates, labels, seed, jnp.asarray(num_rows, jnp.int32),
              max_from_candidates=np.int64(max_from))


def index_query(index: ClusterIndex, queries: jax.Array, *, k: int, num_rows: int | jax.Array, probes: int,
                labels: jax.Array | None = None, seed: jax.Array | int = 0,
                max_from_index: int | None = None, spread_weight: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """The ``k`` neurons to compute for each query (the clustered-index analogue of ``lsh_query``).

  Args:
    index: a built index.
    queries: ``[B, d]`` float32 hidden activations.
    k: active set size.
    num_rows: N.
    probes: clusters probed per query.
    labels: optional ``[B, max_labels]`` true labels (first in each row).
    seed: random fill seed.
    max_from_index: at most this many ids from the index per row.
    spread_weight: see :func:`probe`.

  Returns:
    ``(active [B, k] int32, num_from_index [B] int32)``.
  """
  count = k if max_from_index is None else max_from_index
  return merge_candidates(probe(index, queries, probes, count, spread_weight), k=k, num_rows=num_rows,
                          labels=labels, seed=seed, max_from_candidates=count)


def cluster_fill(sizes: np.ndarray) -> dict[str, float]:
  """:attr:`sparsejax.index.Index.fill` of a clustered index from its cluster ``sizes`` (any shape: every shard's
  together)."""
  return {"cluster_mean": float(sizes.mean()), "cluster_max": float(sizes.max()),
          "clusters_empty": float(np.mean(sizes == 0))}
