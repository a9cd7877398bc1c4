"""LSH hash tables over the rows of a weight matrix, as a pytree of arrays.

``HashTables`` holds ``buckets [L, 2^K, S]`` (row ids, -1 = empty) and
``counts [L, 2^K]`` (rows ever offered to each bucket). All functions are pure
and return new tables; jit them with the tables donated and the kernels update
the buffers in place.

* :func:`build_tables` hashes every row and refills the tables (O(N d): a
  scheduled, amortized refresh, not per-step work).
* :func:`insert_rows` re-inserts a few rows (e.g. those a step just updated).
* :func:`lsh_query` returns each query's active set ``[B, k]``.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import _ffi
from sparsejax._checks import INT32_MAX, Dims, check_array, check_index, check_int
from sparsejax.index.lsh import LSHConfig, LSHParams, input_dim, lsh_hash, num_bits, num_tables
from sparsejax.padding import PAD_ID

POLICIES = {"fifo": 0, "reservoir": 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HashTables:
  """L hash tables of ``2^K`` buckets holding up to ``S`` row ids each.

  Attributes:
    buckets: ``[L, 2^K, S]`` int32 row ids, -1 where empty.
    counts: ``[L, 2^K]`` int32 number of rows offered to each bucket (the
      FIFO ring position / reservoir sampling counter; capped).
    seed: ``[]`` uint32 seed of reservoir sampling.
    policy: ``"fifo"`` or ``"reservoir"``: which rows a full bucket keeps.
  """
  buckets: jax.Array
  counts: jax.Array
  seed: jax.Array
  policy: str = dataclasses.field(default="fifo", metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes held by the tables."""
    return int(self.buckets.size * 4 + self.counts.size * 4 + 4)


# Rows per bucket of tables whose SimHash hyperplanes are drawn from the rows (see default_lsh_config).
ROWS_PER_BUCKET_DRAWN = 200.0


def default_lsh_config(num_rows: int, family: str = "simhash", num_tables: int = 32,
                       rows_per_bucket: float | None = None, projections: str = "random") -> LSHConfig:
  """Hash sizes that scale with the layer: about ``rows_per_bucket`` rows per bucket.

  With :func:`default_bucket_size` slots per bucket, table memory is then
  ``4 * L * S / rows_per_bucket`` bytes per row: proportional to N (SLIDE's
  fixed 2^18 x 128 x 50 tables take 6.7 GB whatever N is). The default load is
  32 rows per bucket, and 200 for hyperplanes drawn from the rows
  (``projections="rows"``), whose codes spread the rows unevenly: with 64
  slots per bucket, 10 bits found the largest logit of 0.50x of the queries
  that exact scoring does on the synthetic 200K-label set, 13 bits 0.36x
  (benchmarks/results/HISTORY.md, "Hyperplanes drawn from the rows"). DWTA draws
  no hyperplanes: ``projections`` is read for SimHash only.
  """
  if family != "simhash":
    projections = "random"
  if rows_per_bucket is None:
    rows_per_bucket = ROWS_PER_BUCKET_DRAWN if projections == "rows" else 32.0
  bits = max(1, round(math.log2(max(num_rows / rows_per_bucket, 2))))
  if family == "dwta":
    bits = max(3, 3 * round(bits / 3))
  return LSHConfig(family=family, num_tables=num_tables, num_bits=min(bits, 24), projections=projections)


def default_bucket_size(rows_per_bucket: float = 32.0) -> int:
  """Slots per bucket: twice the mean load, so skewed buckets keep most rows."""
  return max(4, 2 ** math.ceil(math.log2(2 * rows_per_bucket)))


def init_tables(config: LSHConfig, bucket_size: int, *, policy: str = "fifo", seed: int = 0) -> HashTables:
  """Empty tables for hash functions of ``config``.

  Args:
    config: gives L (``num_tables``) and K (``num_bits``).
    bucket_size: S, ids kept per bucket.
    policy: ``"fifo"`` (a full bucket drops its oldest id) or ``"reservoir"``
      (keeps a uniform sample of all rows offered).
    seed: seed of reservoir sampling.
  """
  _check_policy("init_tables", policy)
  bucket_size = check_int("init_tables", "bucket_size", bucket_size, 1)
  seed = check_index("init_tables", "seed", seed, 0, 2**32 - 1)  # an int, or a (traced) integer scalar
  config.validate()
  L, NB = config.num_tables, 2**config.num_bits
  return HashTables(
      buckets=jnp.full((L, NB, bucket_size), PAD_ID, jnp.int32),
      counts=jnp.zeros((L, NB), jnp.int32),
      seed=jnp.asarray(seed, jnp.uint32),
      policy=policy,
  )


def _check_policy(op: str, policy):
  if policy not in POLICIES:
    raise ValueError(f"{op}: argument 'policy' must be one of {sorted(POLICIES)}, got {policy!r}")


def _check_table_arrays(dims: Dims, tables: HashTables):
  if not isinstance(tables, HashTables):
    raise TypeError(f"{dims.op}: argument 'tables' must be HashTables, got {type(tables).__name__}")
  check_array(dims, "tables.buckets", tables.buckets, jnp.int32, ("L", "num_buckets", "bucket_size"))
  check_array(dims, "tables.counts", tables.counts, jnp.int32, ("L", "num_buckets"))
  check_array(dims, "tables.seed", tables.seed, jnp.uint32, ())
  _check_policy(dims.op, tables.policy)


def _check_tables(dims: Dims, tables: HashTables, params: LSHParams):
  _check_table_arrays(dims, tables)
  L, NB = num_tables(params), 2 ** num_bits(params)
  if (dims["L"], dims["num_buckets"]) != (L, NB):
    raise ValueError(
        f"{dims.op}: tables have L = {dims['L']} tables of {dims['num_buckets']} buckets but the hash "
        f"functions give L = {L} codes of {num_bits(params)} bits ({NB} buckets)")


def _insert(tables: HashTables, codes, ids, num_rows: int, reset: bool) -> HashTables:
  call = _ffi.ffi_call(
      "lsh_tables_insert",
      (jax.ShapeDtypeStruct(tables.buckets.shape, jnp.int32),
       jax.ShapeDtypeStruct(tables.counts.shape, jnp.int32)),
      input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
  buckets, counts = call(tables.buckets, tables.counts, codes, ids, tables.seed,
                         policy=np.int32(POLICIES[tables.policy]), reset=reset, num_rows=num_rows)
  return dataclasses.replace(tables, buckets=buckets, counts=counts)


def _width(params: LSHParams) -> int | str:
  """The input width that the arguments hashed must have: SimHash's own, so that a wrong one is named as the
  argument the caller gave rather than as the hash functions' (DWTA's bins only bound it: ``"d"``)."""
  width = input_dim(params)
  return "d" if width is None else width


def build_tables(tables: HashTables, params: LSHParams, weight: jax.Array,
                 num_valid: int | jax.Array | None = None) -> HashTables:
  """Clears the tables and inserts every row of ``weight`` (rows 0..N-1 in order).

  Args:
    tables: tables to refill (donate them to reuse their memory).
    params: hash functions.
    weight: ``[N, d]`` float32.
    num_valid: insert only rows ``[0, num_valid)`` (the rest are padding, e.g.
      of the last shard of a layer split unevenly), in ``[0, N]``; may be traced
      (a traced value outside is clipped into it).

  Returns:
    The rebuilt tables.
  """
  dims = Dims("build_tables")
  check_array(dims, "weight", weight, jnp.float32, ("N", _width(params)))
  check_int(dims.op, "weight.shape[0]", dims["N"], 0, INT32_MAX)
  _check_tables(dims, tables, params)
  codes = lsh_hash(params, weight)
  ids = jnp.arange(weight.shape[0], dtype=jnp.int32)
  if num_valid is not None:
    num_valid = check_index(dims.op, "num_valid", num_valid, 0, dims["N"])
    ids = jnp.where(ids < num_valid, ids, PAD_ID)
  return _insert(tables, codes, ids, weight.shape[0], reset=True)


def insert_rows(tables: HashTables, params: LSHParams, rows: jax.Array, ids: jax.Array,
                num_rows: int) -> HashTables:
  """Offers some rows (again) to their buckets.

  A row id already present in its bucket is not duplicated; its entry in an
  old bucket (from before the row changed) stays until overwritten or rebuilt.

  Args:
    tables: the tables.
    params: hash functions.
    rows: ``[n, d]`` float32 the rows' current values.
    ids: ``[n]`` int32 their ids in ``[0, num_rows)``, -1 to skip.
    num_rows: N, the layer width (bounds the ids).
  """
  dims = Dims("insert_rows")
  check_array(dims, "rows", rows, jnp.float32, ("n", _width(params)))
  check_array(dims, "ids", ids, jnp.int32, ("n",))
  num_rows = check_int(dims.op, "num_rows", num_rows, 0, INT32_MAX)
  _check_tables(dims, tables, params)
  return _insert(tables, lsh_hash(params, rows), ids, num_rows, reset=False)


def query_codes(tables: HashTables, codes: jax.Array, *, k: int, num_rows: int | jax.Array,
                labels: jax.Array | None = None, seed: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
  """Active sets from precomputed codes (see :func:`lsh_query`)."""
  dims = Dims("lsh_query")
  check_array(dims, "codes", codes, jnp.int32, ("B", "L"))
  _check_table_arrays(dims, tables)
  B = dims["B"]
  if labels is None:
    labels = jnp.full((B, 0), PAD_ID, jnp.int32)
  check_array(dims, "labels", labels, jnp.int32, ("B", "max_labels"))
  k = check_int(dims.op, "k", k, 1, INT32_MAX)
  num_rows = check_index(dims.op, "num_rows", num_rows, 1)
  if isinstance(num_rows, int) and k > num_rows:
    raise ValueError(f"lsh_query: k = {k} must be in [1, num_rows = {num_rows}]")
  # Any integer seed: only its low 32 bits are used.
  seed = check_index(dims.op, "seed", seed, -(2**63), 2**64 - 1)
  seed = np.uint32(seed % 2**32) if isinstance(seed, int) else seed.astype(jnp.uint32)
  call = _ffi.ffi_call(
      "lsh_query",
      (jax.ShapeDtypeStruct((B, k), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)),
      vmap_method="sequential")
  return call(tables.buckets, tables.counts, codes, labels, seed, jnp.asarray(num_rows, jnp.int32))


def lsh_query(tables: HashTables, params: LSHParams, queries: jax.Array, *, k: int, num_rows: int | jax.Array,
              labels: jax.Array | None = None, seed: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
  """The ``k`` neurons to compute for each query.

  Each row holds, without duplicates: the sample's labels (training), then
  table candidates by decreasing number of tables that returned them (ties
  in an order drawn from ``seed``), then distinct random ids up to ``k``.

  Args:
    tables: built tables.
    params: the hash functions the tables were built with.
    queries: ``[B, d]`` float32 query vectors (hidden activations).
    k: active set size, ``1 <= k <= num_rows``.
    num_rows: N, the layer width (ids are drawn from ``[0, N)``); may be a
      traced scalar (e.g. the size of this process's shard).
    labels: optional ``[B, max_labels]`` int32 true labels, -1 padded.
    seed: scalar seed for tie-breaking and random fill (vary it per step).

  Returns:
    ``(active [B, k] int32, num_from_tables [B] int32)``: the ids and how many
    of them (not counting labels) came from the tables.
  """
  dims = Dims("lsh_query")
  check_array(dims, "queries", queries, jnp.float32, ("B", _width(params)))
  _check_tables(dims, tables, params)
  return query_codes(tables, lsh_hash(params, queries), k=k, num_rows=num_rows, labels=labels, seed=seed)


def table_fill(counts: np.ndarray, slots: int) -> dict[str, float]:
  """:attr:`sparsejax.index.Index.fill` of hash tables from their bucket ``counts`` (any shape: every shard's
  tables together) and their ``slots`` per bucket."""
  held = np.minimum(counts, slots)
  return {"bucket_mean": float(held.mean()), "bucket_max": float(held.max()),
          "buckets_empty": float(np.mean(counts == 0)), "buckets_overflowed": float(np.mean(counts > slots))}
