"""SLIDE's hash tables as an :class:`~sparsejax.index.base.Index`: SimHash or DWTA functions, optionally over
centred, MIPS-reduced rows (:mod:`sparsejax.index.mips`), and the tables of :mod:`sparsejax.index.tables`."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.index import clusters, kinds, lsh, mips, probing, tables
from sparsejax.index.base import Index
from sparsejax.shard import shard_rows


class HashedIndex(NamedTuple):
  """The state of :func:`lsh_index`.

  Attributes:
    hash_functions: :class:`~sparsejax.index.lsh.SimHashParams` or :class:`~sparsejax.index.lsh.DWTAParams`
      (random ones are shared by every shard of a sharded run; hyperplanes drawn from the rows are each shard's).
    tables: the :class:`~sparsejax.index.tables.HashTables` of the rows (a shard's rows: its own tables).
  """
  hash_functions: lsh.LSHParams
  tables: tables.HashTables


def serving_sizes(t_config, params: lsh.LSHConfig, bucket_size: int) -> tuple[lsh.LSHConfig, int]:
  """The sizes of the tables that sampled inference and the evaluations build: ``(LSH config, slots per bucket)``
  (:func:`sparsejax.index.kinds.serving_table_sizes`, which the memory check reads too), from the settings
  ``t_config`` and the training tables' sizes.

  4x as many tables as training's (which need only some hard negatives per sample: 16 of them train as well per
  step as 64 did, at a third of the step's time). ``--lsh_serving=angular`` (SimHash): random hyperplanes over the
  rows' directions, about 100 rows per bucket in 2x the slots (synthetic 200K labels: 11 bits, 128 slots, 65 MiB;
  the same in 256 slots found as many). ``training``: the training tables' functions in buckets of about 4x
  their rows, in 4x the slots (with 64 tables, 3 probes and re-ranking, 0.91x of exact P@1 on the clustered
  runs' layers, 0.34x on the LSH run's: benchmarks/results/HISTORY.md, "Hyperplanes drawn from the rows").
  """
  num_tables, bits, slots = kinds.serving_table_sizes(t_config, params.num_bits, bucket_size)
  projections = "random" if t_config.lsh_serving == "angular" else params.projections
  return params._replace(num_tables=num_tables, num_bits=bits, projections=projections), slots


def lsh_index(config) -> Index:
  """Hash tables over the output rows, as ``config`` (a :class:`sparsejax.model_config.ModelConfig`) sizes them.

  ``config.lsh_config`` (family, L, K, where SimHash's hyperplanes come from), ``config.table_bucket_size`` and
  ``tables.table_policy`` size the tables;
  with ``tables.lsh_mips`` the rows are centred and norm-augmented before hashing and the queries augmented to
  match; ``tables.reinsert`` says which rows a step re-inserts. The serving index is built afresh with sizes of its
  own (:func:`serving_sizes`), by default (``tables.lsh_serving="angular"``) over the directions of the centred
  rows, each reduced by its own norm, with random hyperplanes. A query without labels (sampled inference) reads
  ``tables.lsh_probes`` buckets per table (:mod:`sparsejax.index.probing`) and, where it is given the rows,
  re-ranks ``tables.lsh_rerank`` x k of the most often found ids by their exact logits; a training query, with its
  labels, reads one bucket per table.
  """
  t_config = config.tables
  params = config.lsh_config
  bucket_size = config.table_bucket_size
  reduced = t_config.lsh_mips
  probes, rerank = t_config.lsh_probes, t_config.lsh_rerank
  angular = t_config.lsh_serving == "angular"
  serving_params, serving_slots = serving_sizes(t_config, params, bucket_size)
  # Queries are reduced as the rows are (mips.augment_queries): [h, 1] scaled to unit length, one 0 more.
  width = config.hidden_dims[-1] + 2 if reduced else config.hidden_dims[-1]

  def serves(num_tables: int) -> bool:
    """Whether tables of this count are a serving index's (:func:`serving_sizes`: 4x training's)."""
    return num_tables == serving_params.num_tables

  def hashed_rows(w, b, num_valid, unit=False):
    """The vectors the tables hold and how likely each is to give a hyperplane (``projections="rows"``); ``unit``:
    the centred rows' directions (``--lsh_serving=angular``)."""
    w = w.astype(jnp.float32)  # (bfloat16 rows widened: an O(N d) copy, for builds only)
    valid = jnp.arange(w.shape[0]) < (w.shape[0] if num_valid is None else num_valid)
    # Scaled by a power of two (exact) to a largest |value| below 1: the hashes' signs and the draw's relative
    # weights are the same, but finite rows near float32's largest no longer overflow the squared norms (an inf
    # weight is never drawn), the centring or the spread of the hyperplanes drawn from them.
    exponent = mips.largest_exponent(jnp.where(valid[:, None], w, 0.0), jnp.where(valid, b, 0.0))
    w, b = jnp.ldexp(w, -exponent), jnp.ldexp(b, -exponent)
    if reduced or unit:  # centred as the clustered index's rows are (mips.py)
      centred_w, centred_b = mips.centre_rows(w, b, num_valid)
      squared = jnp.sum(centred_w**2, axis=1) + centred_b**2
      # Angular: each row reduced by its own norm (unit rows, completion 0). A query's best rows point its way (the
      # synthetic set's trained LSH layer: median cosine 0.71, against -0.11 +- 0.21 for all rows), but reduced by
      # the longest row of all the cosines shrink with the rows' norms (to 0.42, most rows' to near 0): the
      # exact re-ranking restores the logits' order among the rows found.
      return mips.augment_rows(centred_w, centred_b, max_norm=jnp.sqrt(squared) if unit else None), squared
    return w, jnp.where(valid, jnp.sum(w**2, axis=1), 0.0)

  def draw(sizes: lsh.LSHConfig, key, x, weights) -> lsh.LSHParams:
    if sizes.projections == "rows":
      return lsh.simhash_from_rows(key, sizes, x, weights, completion=reduced)
    return lsh.init_lsh(key, sizes, x.shape[1])

  def new_index(sizes: lsh.LSHConfig, slots: int, function_key, build_key, w, b, num_valid,
                unit=False) -> HashedIndex:
    x, weights = hashed_rows(w, b, num_valid, unit)
    functions = draw(sizes, function_key, x, weights)
    empty = tables.init_tables(sizes, slots, policy=t_config.table_policy,
                               seed=jax.random.bits(build_key, (), jnp.uint32))
    return HashedIndex(functions, tables.build_tables(empty, functions, x, num_valid))

  def init(function_key, build_key, w, b, num_valid=None) -> HashedIndex:
    return new_index(params, bucket_size, function_key, build_key, w, b, num_valid)

  def refresh(state: HashedIndex, w, b, num_valid=None) -> HashedIndex:
    x, weights = hashed_rows(w, b, num_valid)
    functions = state.hash_functions
    if params.projections == "rows":
      # Hyperplanes drawn from the rows follow them: each rebuild draws new ones from the rows it hashes (a
      # pass over L K rows, beside the build's over all N), from a key the state and the rows determine.
      key = jax.random.fold_in(jax.random.key(state.tables.seed.reshape(-1)[0]),
                               jax.lax.bitcast_convert_type(jnp.sum(weights), jnp.int32))
      functions = draw(params, key, x, weights)
    return HashedIndex(functions, tables.build_tables(state.tables, functions, x, num_valid))

  def renew(state: HashedIndex, key, w, b, num_valid=None) -> HashedIndex:
    x, weights = hashed_rows(w, b, num_valid)
    functions = draw(params, key, x, weights)
    return HashedIndex(functions, tables.build_tables(state.tables, functions, x, num_valid))

  def query(state: HashedIndex, h, *, k, num_rows, labels=None, seed=0, max_from_index=None, rows=None):
    x = mips.augment_queries(h) if reduced or (angular and serves(lsh.num_tables(state.hash_functions))) else h
    if labels is not None:
      # A training query reads one bucket per table, in the kernel (the step cannot afford more); at most
      # max_from_index of its candidates are kept, the rest of the k slots after the labels random
      # (--random_negatives), as the clustered index's. Hard negatives alone bias the sampled softmax against the
      # rows they keep returning (synthetic 200K, tables full of them: validation P@1 0.39 at step 1,000 against
      # 0.63 with the clustered index's mix).
      cap = k if max_from_index is None else min(max_from_index, k)
      found, num_found = tables.lsh_query(state.tables, state.hash_functions, x, k=max(cap, 1), num_rows=num_rows,
                                          seed=seed)
      candidates = jnp.where(jnp.arange(found.shape[1]) < num_found[:, None], found, -1)
      return clusters.merge_candidates(candidates, k=k, num_rows=num_rows, labels=labels, seed=seed,
                                       max_from_candidates=cap)
    # Queries without labels (sampled inference, the evaluations' diagnostics) read lsh_probes buckets per table
    # and re-rank.
    if probes == 1 and not (rerank and rows is not None):
      return tables.lsh_query(state.tables, state.hash_functions, x, k=k, num_rows=num_rows, seed=seed)
    codes = probing.probe_codes(state.hash_functions, x, lsh.lsh_hash(state.hash_functions, x), probes)
    if rows is None or not rerank:
      candidates = probing.counted_by_kernel(state.tables, codes, k, num_rows, seed)
    else:  # the most often found rerank x k, then the best k of them by their exact logits
      # The kernel's id bound is the rows' length, not num_rows (a shard's valid rows, possibly traced and fewer
      # than rerank x k): the tables hold only valid ids, and its random fill past those found is masked.
      length = rows[0].shape[0]
      found = probing.counted_by_kernel(state.tables, codes, min(rerank * k, length), length, seed)
      candidates = probing.rerank(found, h, *rows, k)
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
    # Serving tables of their own sizes (serving_sizes), built afresh from the final rows, read with probes and
    # re-ranked; angular: over the rows' directions. Fixed keys: the same rows give the same index (and every
    # shard the same random hyperplanes).
    del state
    return new_index(serving_params, serving_slots, *jax.random.split(jax.random.key(0)), w, b, num_valid, angular)

  def partition(state: HashedIndex, split, replicated) -> HashedIndex:
    # Hyperplanes drawn from the rows are each shard's own, as its tables are.
    functions = split if params.projections == "rows" else replicated
    return HashedIndex(jax.tree.map(lambda _: functions, state.hash_functions),
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
      # The serving tables' buckets have slots of their own (occupancy [..., L, 2^K]: a sharded run's gathered too).
      fill=lambda counts: tables.table_fill(np.asarray(counts),
                                            serving_slots if serves(np.shape(counts)[-2]) else bucket_size),
      partition=partition, to_shard=lambda state: reshape_seed(state, ()),
      from_shard=lambda state: reshape_seed(state, (1,)), query_shards=query_shards, merge_shards=None,
      from_arrays=from_arrays,
      # K L projections of every row, and about 4 d products' worth for centring, norms and bucketing (N = 2e5,
      # d = 128: a refresh of 16 tables took 0.50 s, of 64 0.73 s; benchmarks/train_profile.py).
      refresh_products=shard_rows(config.num_labels, config.num_shards) * (params.num_bits * params.num_tables
                                                                            + 4 * width))
