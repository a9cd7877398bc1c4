"""SLIDE's hash tables as an :class:`~sparsejax.index.base.Index`: SimHash or DWTA functions, optionally over
centred, MIPS-reduced rows (:mod:`sparsejax.index.mips`), and the tables of :mod:`sparsejax.index.tables`."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.index import clusters, lsh, mips, probing, tables
from sparsejax.index.base import Index
from sparsejax.loss import shard_rows


class HashedIndex(NamedTuple):
  """The state of :func:`lsh_index`.

  Attributes:
    hash_functions: :class:`~sparsejax.index.lsh.SimHashParams` or :class:`~sparsejax.index.lsh.DWTAParams`
      (shared by every shard of a sharded run).
    tables: the :class:`~sparsejax.index.tables.HashTables` of the rows (a shard's rows: its own tables).
  """
  hash_functions: lsh.LSHParams
  tables: tables.HashTables


def lsh_index(config) -> Index:
  """Hash tables over the output rows, as ``config`` (a :class:`sparsejax.model_config.ModelConfig`) sizes them.

  ``config.lsh_config`` (family, L, K), ``config.table_bucket_size`` and ``tables.table_policy`` size the tables;
  with ``tables.lsh_mips`` the rows are centred and norm-augmented before hashing and the queries augmented to
  match; ``tables.reinsert`` says which rows a step re-inserts. The serving index is the training one rebuilt.
  ``tables.lsh_probes`` buckets are read per table (more than one: :mod:`sparsejax.index.probing`, in ``jnp``) and,
  where the query is given the rows, ``tables.lsh_rerank`` x k of the most often found ids are re-ranked by their
  exact logits.
  """
  t_config = config.tables
  params = config.lsh_config
  bucket_size = config.table_bucket_size
  reduced = t_config.lsh_mips
  probes, rerank = t_config.lsh_probes, t_config.lsh_rerank
  width = config.hidden_dims[-1] + 2 if reduced else config.hidden_dims[-1]

  def build(empty: tables.HashTables, functions, w, b, num_valid) -> tables.HashTables:
    w = w.astype(jnp.float32)  # (bfloat16 rows widened: an O(N d) copy, for builds only)
    if reduced:  # centred as the clustered index's rows are (mips.py)
      return tables.build_tables(empty, functions, mips.augment_rows(*mips.centre_rows(w, b, num_valid)), num_valid)
    return tables.build_tables(empty, functions, w, num_valid)

  def init(function_key, build_key, w, b, num_valid=None) -> HashedIndex:
    functions = lsh.init_lsh(function_key, params, width)
    empty = tables.init_tables(params, bucket_size, policy=t_config.table_policy,
                               seed=jax.random.bits(build_key, (), jnp.uint32))
    return HashedIndex(functions, build(empty, functions, w, b, num_valid))

  def refresh(state: HashedIndex, w, b, num_valid=None) -> HashedIndex:
    return state._replace(tables=build(state.tables, state.hash_functions, w, b, num_valid))

  def renew(state: HashedIndex, key, w, b, num_valid=None) -> HashedIndex:
    return refresh(state._replace(hash_functions=lsh.init_lsh(key, params, width)), w, b, num_valid)

  def query(state: HashedIndex, h, *, k, num_rows, labels=None, seed=0, max_from_index=None, rows=None):
    del max_from_index  # the tables give as many candidates as their buckets hold
    x = mips.augment_queries(h) if reduced else h
    if probes == 1 and not (rerank and rows is not None):  # one bucket per table: the kernel alone
      return tables.lsh_query(state.tables, state.hash_functions, x, k=k, num_rows=num_rows, labels=labels,
                              seed=seed)
    codes = probing.probe_codes(state.hash_functions, x, lsh.lsh_hash(state.hash_functions, x), probes)
    if rows is None or not rerank:
      candidates = probing.probed_candidates(state.tables, codes, k)
    else:  # the most often found rerank x k, then the best k of them by their exact logits
      candidates = probing.rerank(probing.probed_candidates(state.tables, codes, rerank * k), h, *rows, k)
    return clusters.merge_candidates(candidates, k=k, num_rows=num_rows, labels=labels, seed=seed)

  def update(state: HashedIndex, w, *, labels, touched, num_rows) -> HashedIndex:
    if t_config.reinsert == "labels":
      ids = labels.reshape(-1)
    elif t_config.reinsert == "all":
      ids = touched
    else:
      return state
    rows = jnp.take(w, jnp.maximum(ids, 0), axis=0).astype(jnp.float32)
    return state._replace(tables=tables.insert_rows(state.tables, state.hash_functions, rows, ids, num_rows))

  def serving(state: HashedIndex | None, w, b, num_valid=None) -> HashedIndex:
    if state is None:  # no hash functions kept (a sharded run's are per process): fresh ones of the run's sizes
      return init(*jax.random.split(jax.random.key(0)), w, b, num_valid)
    return refresh(state, w, b, num_valid)

  def partition(state: HashedIndex, split, replicated) -> HashedIndex:
    return HashedIndex(jax.tree.map(lambda _: replicated, state.hash_functions),
                       jax.tree.map(lambda _: split, state.tables))

  def reshape_seed(state: HashedIndex, shape) -> HashedIndex:  # the tables' seed: [P] stacked, [] per shard
    return state._replace(tables=dataclasses.replace(state.tables, seed=state.tables.seed.reshape(shape)))

  def query_shards(state: HashedIndex, h, *, k, local_k, num_rows, shard, seed=0, rows=None):
    del k, shard  # buckets have no scores to rank across shards: each shard's own local_k, as in training
    return query(state, h, k=local_k, num_rows=num_rows, seed=seed, rows=rows)

  def from_arrays(tree) -> HashedIndex:
    family = lsh.SimHashParams if params.family == "simhash" else lsh.DWTAParams
    t = tree["tables"]
    return HashedIndex(family(**tree["hash_functions"]),
                       tables.HashTables(t["buckets"], t["counts"], t["seed"], policy=t_config.table_policy))

  return Index(
      init=init, refresh=refresh, renew=renew, query=query, update=update, serving=serving,
      occupancy=lambda state: state.tables.counts,
      fill=lambda counts: tables.table_fill(np.asarray(counts), bucket_size),
      partition=partition, to_shard=lambda state: reshape_seed(state, ()),
      from_shard=lambda state: reshape_seed(state, (1,)), query_shards=query_shards, merge_shards=None,
      from_arrays=from_arrays,
      refresh_products=shard_rows(config.num_labels, config.num_shards) * params.num_bits * params.num_tables)
