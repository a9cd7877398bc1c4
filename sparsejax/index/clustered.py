"""The clustered (IVF) index of :mod:`sparsejax.index.clusters` as an :class:`~sparsejax.index.base.Index`."""

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import selection
from sparsejax.index import clusters
from sparsejax.index.base import Index


def cluster_index(config) -> Index:
  """Spherical k-means clusters of the output rows, as ``config`` (a :class:`sparsejax.model_config.ModelConfig`) sizes
  them.

  Training: ``config.index_sizes`` clusters, ``tables.kmeans_iterations`` Lloyd iterations on ``kmeans_sample``
  rows per cluster; queries probe ``tables.cluster_probes`` clusters (default all) ranked with
  ``tables.cluster_spread_weight``. Serving: a finer index, ``config.eval_index_sizes``, built afresh. A refresh
  re-clusters from fresh seeds; the state is the :class:`~sparsejax.index.clusters.ClusterIndex` itself.
  """
  t_config = config.tables
  num_clusters, num_rows, _ = config.index_sizes
  dim = config.hidden_dims[-1]
  iterations, sample = t_config.kmeans_iterations, config.kmeans_sample

  def build(index: clusters.ClusterIndex, w, b, num_valid, key=None, iters=iterations) -> clusters.ClusterIndex:
    # (bfloat16 rows widened: an O(N d) copy, for builds only)
    return clusters.build_index(index, w.astype(jnp.float32), b, iterations=iters, num_valid=num_valid, key=key,
                                sample_per_cluster=sample)

  def init(function_key, build_key, w, b, num_valid=None) -> clusters.ClusterIndex:
    del function_key  # no hash functions: the seeds' offset is drawn from build_key
    return build(clusters.init_index(num_clusters, num_rows, dim), w, b, num_valid, build_key)

  def query(state: clusters.ClusterIndex, h, *, k, num_rows, labels=None, seed=0, max_from_index=None, rows=None):
    del rows  # the clusters are ranked by their mean logit: no row is read at query time
    # Default: all of this index's clusters, ranked; at most k of them can contribute (none is empty).
    probes = min(t_config.cluster_probes or state.centroids.shape[0], k)
    return clusters.index_query(state, h, k=k, num_rows=num_rows, probes=probes, labels=labels, seed=seed,
                                max_from_index=max_from_index, spread_weight=t_config.cluster_spread_weight)

  def serving(state, w, b, num_valid=None) -> clusters.ClusterIndex:
    del state  # built afresh, finer than the training index (once per evaluation, not per step)
    c, iters = config.eval_index_sizes
    return build(clusters.init_index(c, w.shape[0], w.shape[1]), w, b, num_valid, iters=iters)

  def query_shards(state: clusters.ClusterIndex, h, *, k, local_k, num_rows, shard, seed=0, rows=None):
    """One process: :func:`query`. Sharded, the clusters of every shard are ranked together, as one process ranks
    its single index's: each shard all-gathers the scores and sizes of its best ``min(probes, C)`` clusters
    (``O(n k)``) and members are taken from the best clusters on, wherever they live, until there are ``k`` of
    them; each shard then takes its share from its own probe list (ranked the same way). No shard is held to a
    fixed quota of ``k / P``, which would cut off a shard that holds the best clusters. (A shard's probed
    clusters may hold fewer rows than its share: one process would fill such an active set with random rows,
    the shards do not.)"""
    if shard.axis is None:
      return query(state, h, k=local_k, num_rows=num_rows, seed=seed)
    probes = min(t_config.cluster_probes or k, k)  # one process: min(cluster_probes or C, k) clusters
    m = min(probes, state.centroids.shape[0])
    sizes = state.sizes
    scores = clusters.probe_scores(state, h, t_config.cluster_spread_weight)
    # This shard's best m clusters in the probe's order (empty ones never take a probe: NaN, last).
    best, which = selection.row_topk(jnp.where(sizes[None, :] > 0, scores, jnp.nan), m)
    counts = jnp.where(jnp.isnan(best), 0, sizes[which])
    best, counts = shard.concatenate(best), shard.concatenate(counts)  # [n, P m], shard by shard
    _, order = selection.row_topk(best, best.shape[1])  # every shard's clusters ranked together
    counts = jnp.where(jnp.arange(best.shape[1]) < probes, jnp.take_along_axis(counts, order, axis=1), 0)
    taken = jnp.clip(k - (jnp.cumsum(counts, axis=1) - counts), 0, counts)  # members taken from each cluster
    mine = (order // m) == shard.index()
    share = jnp.sum(jnp.where(mine, taken, 0), axis=1).astype(jnp.int32)
    width = min(k, state.rows.shape[0])
    active = clusters.probe_ranked(state, scores, m, width)
    return jnp.where(jnp.arange(width)[None, :] < share[:, None], active, -1), share

  lloyd_rows = num_rows if sample is None else min(num_rows, sample * num_clusters)
  identity = lambda state: state
  return Index(
      init=init, refresh=lambda state, w, b, num_valid=None: build(state, w, b, num_valid),
      renew=lambda state, key, w, b, num_valid=None: build(state, w, b, num_valid, key),
      query=query, update=lambda state, w, *, labels, touched, num_rows: state, serving=serving,
      occupancy=lambda state: state.sizes, fill=lambda sizes: clusters.cluster_fill(np.asarray(sizes)),
      partition=lambda state, split, replicated: jax.tree.map(lambda _: split, state),
      to_shard=identity, from_shard=identity, query_shards=query_shards, merge_shards=clusters.merge_shards,
      from_arrays=lambda tree: clusters.ClusterIndex(tree["centroids"], tree["offsets"], tree["rows"]),
      # the final assignment of every row plus the Lloyd iterations on their sample, each against every centroid
      refresh_products=num_clusters * (num_rows + iterations * lloyd_rows))
