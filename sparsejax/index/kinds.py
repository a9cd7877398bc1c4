"""The kinds of candidate index, by their ``--candidates`` name: what each reads of the settings, and how it is made
(:func:`from_config`, the one place that picks an implementation).

Free of JAX (the settings are validated before JAX is imported): the implementations are imported on first use.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

from sparsejax import memory
from sparsejax.settings import ConfigError


class Kind(NamedTuple):
  """One kind of index, as the settings see it.

  Attributes:
    make: ``model_config -> Index`` (imports its module on first use).
    settings: the ``tables`` settings that only this kind reads.
    reinserts: ``tables_config -> bool``: whether the index can take rows re-inserted after each step
      (``--reinsert``).
    table_bytes: ``(tables_config, num_bits, bucket_size) -> (bits, slots, bytes)`` of hash tables allocated
      whole when a run starts (``num_bits``/``bucket_size`` None: the settings', at least), or None without them.
  """
  make: Callable[[Any], Any]
  settings: tuple[str, ...]
  reinserts: Callable[[Any], bool]
  table_bytes: Callable[[Any, int | None, int | None], tuple[int, int, int] | None]


def implementation(name: str) -> Callable[[Any], Any]:
  """``cluster_index`` or ``lsh_index``, as :mod:`sparsejax.index` names them, imported on first use."""
  # deferred: the implementations import JAX (the settings are validated without it), and hashed imports this module.
  # Both at once: they share their imports (hashed's own take a few hundredths of a second).
  from sparsejax.index import clustered, hashed

  return {"cluster_index": clustered.cluster_index, "lsh_index": hashed.lsh_index}[name]


def _clusters(config):
  return implementation("cluster_index")(config)


def _lsh(config):
  return implementation("lsh_index")(config)


# Tables of sampled inference and the evaluations per table of training (serving_table_sizes).
SERVING_TABLES = 4


def serving_table_sizes(t, num_bits: int, slots: int) -> tuple[int, int, int]:
  """``(tables, bits, slots per bucket)`` of the LSH tables that sampled inference and the evaluations build, from
  the settings ``t`` (a :class:`sparsejax.config.TablesConfig`) and the training tables' bits and slots (see
  :func:`sparsejax.index.hashed.serving_sizes`). Here, free of JAX, for the memory check too.

  4x the tables. ``--lsh_serving=angular`` with SimHash: random hyperplanes over about 100 rows per bucket (one
  bit more than tables of hyperplanes drawn from the rows, at about 200 rows per bucket; 2 fewer than random
  ones, at 32), in 2x the slots. Otherwise (and DWTA) 2 fewer bits than the training tables (4x their rows per
  bucket; DWTA 3 fewer, 8x: its codes pack 3-bit bins), in 4x the slots. At least 6 bits.
  """
  if t.lsh_serving == "angular" and t.lsh_family == "simhash":
    bits, slots = num_bits + (1 if t.lsh_projections == "rows" else -2), 2 * slots
  else:
    bits, slots = num_bits - (3 if t.lsh_family == "dwta" else 2), 4 * slots
  return SERVING_TABLES * t.num_tables, min(max(bits, min(num_bits, 6)), 30), slots


def _lsh_table_bytes(t, num_bits: int | None, bucket_size: int | None) -> tuple[int, int, int]:
  bits = num_bits or t.num_bits or (3 if t.lsh_family == "dwta" else 1)
  slots = bucket_size or t.bucket_size or 64  # tables.default_bucket_size()
  table_bytes = lambda tables, bits, slots: tables * 2**bits * (slots + 1) * 4  # noqa: E731 -- ids and counts
  # The evaluations' serving tables are built beside the training ones.
  serving = table_bytes(*serving_table_sizes(t, bits, slots))
  return bits, slots, table_bytes(t.num_tables, bits, slots) + serving


KINDS = {
    "clusters": Kind(_clusters, ("num_clusters", "cluster_probes", "kmeans_iterations", "kmeans_sample"),
                     # its rows are centred and clustered together: refreshed as a whole
                     reinserts=lambda t: False, table_bytes=lambda t, bits, slots: None),
    "lsh": Kind(_lsh, ("lsh_family", "lsh_projections", "num_tables", "num_bits", "lsh_mips", "lsh_probes",
                       "lsh_rerank", "lsh_serving"),
                # MIPS-reduced rows are centred and scaled together: refreshed as a whole
                reinserts=lambda t: not t.lsh_mips, table_bytes=_lsh_table_bytes),
}


def unused_settings(tables_config) -> dict[str, str]:
  """The index settings that a run of ``tables_config`` (a :class:`sparsejax.config.TablesConfig`) does not read:
  those of the other kinds of index, and SimHash's hyperplanes under DWTA. Name -> why."""
  unused = {name: f"only read with --candidates={other}" for other, kind in KINDS.items()
            if other != tables_config.candidates for name in kind.settings}
  if tables_config.candidates == "lsh" and tables_config.lsh_family == "dwta":
    unused["lsh_projections"] = "only read with --lsh_family=simhash (dwta draws no hyperplanes)"
  return unused


def from_config(config):
  """The :class:`~sparsejax.index.base.Index` that ``config`` describes (a
  :class:`sparsejax.model_config.ModelConfig`: its ``tables`` section and one shard's sizes): the one place
  that maps ``--candidates`` to an implementation."""
  return KINDS[config.tables.candidates].make(config)


def check_table_memory(t, num_bits: int | None = None, bucket_size: int | None = None) -> None:
  """Raises a :class:`~sparsejax.settings.ConfigError` where the hash tables of the index that the settings ``t``
  (a :class:`sparsejax.config.TablesConfig`) describe cannot fit in this machine's memory (an index without them
  always fits).

  The tables are allocated whole (and filled) when a run starts: ``num_tables x 2^num_bits`` buckets of
  ``bucket_size`` int32 ids. One that cannot be allocated aborted the process inside jit (SIGABRT) instead of
  failing. Before the data is loaded ``--num_bits=none`` counts as its least value (a lower bound); the run
  checks again with the sizes the data gives (``num_bits``, ``bucket_size``).
  """
  sizes = KINDS[t.candidates].table_bytes(t, num_bits, bucket_size)  # None: an index without hash tables
  if sizes is None:
    return
  bits, slots, need = sizes
  have = memory.machine_memory_bytes()
  if have is None or need <= have:
    return
  if t.bucket_size is not None and (t.bucket_size > 64 or t.num_bits is None):
    name = "bucket_size"
  elif t.num_bits is not None:
    name = "num_bits"
  else:
    name = "num_tables"
  raise ConfigError(name, getattr(t, name), f"LSH tables of {t.num_tables} x 2^{bits} buckets x {slots} ids "
                    "and the evaluations' (4x as many) need "
                    f"{_gib(need)} of memory; this machine has {_gib(have)}. Lower --num_bits, --num_tables or "
                    "--bucket_size (or --lsh_serving=training: smaller evaluation tables)")


def _gib(num_bytes: int) -> str:
  return f"{num_bytes / 2**30:,.1f} GiB"
