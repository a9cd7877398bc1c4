"""The candidate index as a protocol: a NamedTuple of pure functions over the index's own pytree state.

An index answers, for each hidden vector ``h``, which output rows are worth computing. The step, the table
schedule, evaluation and the sharded runtime see only :class:`Index`; which index it is (hash tables or clusters)
is decided once, by :func:`sparsejax.index.from_config`, and is known only inside this package.

Every function is pure (jit it; donate the state to update its arrays in place). ``w [N, d]`` and ``b [N]`` are
the output layer's rows (any float dtype: an index is built from their float32 values), ``num_valid`` the rows
below which they are real (a sharded layer's last shard is padded; default all, may be traced).
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Index(NamedTuple):
  """How one kind of candidate index is built, queried, refreshed and served (see
  :func:`sparsejax.index.from_config`).

  Attributes:
    init: ``(function_key, build_key, w, b, num_valid=None) -> state``: new hash functions (cluster seeds) drawn
      from ``function_key`` (``build_key``) and the index built over the rows.
    refresh: ``(state, w, b, num_valid=None) -> state``: rebuilt from the current rows (scheduled, ``O(N d)``
      work or more, off the step), with the same hash functions.
    renew: ``(state, key, w, b, num_valid=None) -> state``: new hash functions (clusters: new seeds) from
      ``key``, then rebuilt.
    query: ``(state, h [B, d], *, k, num_rows, labels=None, seed=0, max_from_index=None, rows=None) -> (active
      [B, k], num_from_index [B])``: each sample's ``k`` active ids: its labels (if given), then index
      candidates (at most ``max_from_index``), then distinct random ids below ``num_rows``. ``rows``: the layer's
      ``(w, b)``, for an index that re-ranks its candidates by their exact logits (hash tables with
      ``--lsh_rerank``); the others ignore it.
    update: ``(state, w, *, labels [B, M], touched [B, k] or None, num_rows) -> state``: what a training step
      changes in the index after updating the rows ``touched`` (padding ids -1 skipped; ``labels`` are the
      batch's label rows, -1 where the step was not applied): hash tables may re-insert them (``--reinsert``).
    serving: ``(state or None, w, b, num_valid=None) -> state``: the index that evaluation and sampled inference
      query, built afresh from the rows (clusters: finer than the training index); ``state`` gives the run's hash
      functions and table sizes (None: fresh ones from a fixed key). The given state is left alone.
    occupancy: ``state -> array``: what :attr:`fill` summarizes (bucket counts or cluster sizes), so that a
      sharded run all-gathers only it.
    fill: ``occupancy (any shape: every shard's together) -> dict``: fill statistics written to the metrics.
    partition: ``(state, split, replicated) -> specs``: the state's tree with each leaf's partition spec in a
      sharded run (each shard indexes its own rows; hash functions are shared).
    to_shard: ``state -> state``: a sharded run's stacked state (inside ``shard_map``) as one shard's.
    from_shard: the inverse of :attr:`to_shard`.
    query_shards: ``(state, h, *, k, local_k, num_rows, shard, seed=0, rows=None) -> (active [B, w] local ids,
      -1 past the shard's share, num_from_index [B])``: this shard's share of each query's ``k`` candidates,
      queried without labels (a :class:`sparsejax.shard.Shard`; one process: :attr:`query` with ``local_k``,
      random fill included): a sharded clustered index ranks the shards' clusters together, hash tables give
      their own ``local_k``.
    merge_shards: ``(shards, rows_per_shard, num_rows) -> state`` of host arrays: one index over a sharded
      layer's global rows from its shards' serving indexes, kept with the model (``sparsejax.load`` probes it);
      None for an index that is not kept (rebuilt from the rows when needed).
    from_arrays: ``tree -> state``: the state from a plain tree of arrays (a checkpoint's, read back as dicts).
    refresh_products: row-by-vector products of one refresh of this index (its cost model's unit).
  """
  init: Callable[..., Any]
  refresh: Callable[..., Any]
  renew: Callable[..., Any]
  query: Callable[..., tuple[Any, Any]]
  update: Callable[..., Any]
  serving: Callable[..., Any]
  occupancy: Callable[[Any], Any]
  fill: Callable[[Any], dict[str, float]]
  partition: Callable[[Any, Any, Any], Any]
  to_shard: Callable[[Any], Any]
  from_shard: Callable[[Any], Any]
  query_shards: Callable[..., tuple[Any, Any]]
  merge_shards: Callable[[Sequence[Any], int, int], Any] | None
  from_arrays: Callable[[Any], Any]
  refresh_products: float
