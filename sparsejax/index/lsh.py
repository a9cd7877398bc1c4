"""Locality-sensitive hash functions, stored as arrays and made from a seed.

Two families (as in SLIDE):

* ``"simhash"``: signed random projections; each of the ``K`` bits of a
  table's code is the sign of a sparse +-1 projection over a random third of
  the input dims (stored as a dense matrix with zeros, which vectorizes).
  With ``projections="rows"`` (:func:`simhash_from_rows`) the hyperplanes are
  drawn from the data instead: each is normal to a row sampled in proportion to
  its squared norm, jittered, so the bits split the rows where they (and the
  largest logits) lie.
* ``"dwta"``: densified winner-take-all; each hash is the argmax position in a
  bin of ``bin_size`` (8) random dims, i.e. 3 bits, packed with shifts of
  exactly 3 bits so that all ``2^K`` codes are reachable; empty (all-zero)
  bins borrow another bin's value (densification).

``lsh_hash(params, x)`` maps ``x [B, d]`` to codes ``[B, L]`` int32 in
``[0, 2^K)``, one per table.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsejax import _ffi
from sparsejax._checks import INT32_MAX, Dims, check_array, check_int


class LSHConfig(NamedTuple):
  """Hash family and sizes (hashable: usable as a static jit argument).

  Attributes:
    family: ``"simhash"`` or ``"dwta"``.
    num_tables: L, the number of tables (codes per vector).
    num_bits: K, bits per code; for DWTA a multiple of ``log2(bin_size)``.
    bin_size: DWTA bin width (a power of two).
    projection_fraction: SimHash: fraction of dims in each projection.
    projections: SimHash: ``"random"`` (sparse +-1 projections drawn at
      random) or ``"rows"`` (normals of rows drawn from the data:
      :func:`simhash_from_rows`).
  """
  family: str = "simhash"
  num_tables: int = 32
  num_bits: int = 12
  bin_size: int = 8
  projection_fraction: float = 1.0 / 3.0
  projections: str = "random"

  def validate(self) -> None:
    if self.family not in ("simhash", "dwta"):
      raise ValueError(f"LSHConfig.family must be 'simhash' or 'dwta', got {self.family!r}")
    for field in ("num_tables", "num_bits", "bin_size"):
      check_int("LSHConfig", field, getattr(self, field))
    if self.num_tables < 1:
      raise ValueError(f"LSHConfig.num_tables must be >= 1, got {self.num_tables}")
    if not 1 <= self.num_bits <= 30:
      raise ValueError(f"LSHConfig.num_bits must be in [1, 30], got {self.num_bits}")
    if self.projections not in ("random", "rows"):
      raise ValueError(f"LSHConfig.projections must be 'random' or 'rows', got {self.projections!r}")
    if self.projections == "rows" and self.family != "simhash":
      raise ValueError(f"LSHConfig.projections='rows' needs family 'simhash', got {self.family!r}")
    if not (isinstance(self.projection_fraction, (int, float)) and 0 < self.projection_fraction <= 1):
      raise ValueError(f"LSHConfig.projection_fraction must be in (0, 1], got {self.projection_fraction!r}")
    if self.family == "dwta":
      bits = int(math.log2(max(self.bin_size, 1)))
      if self.bin_size < 2 or 2**bits != self.bin_size:
        raise ValueError(f"LSHConfig.bin_size must be a power of two >= 2, got {self.bin_size}")
      if self.num_bits % bits:
        raise ValueError(f"DWTA codes pack {bits}-bit bins: num_bits must be a multiple of {bits}, got {self.num_bits}")


class SimHashParams(NamedTuple):
  """Sparse signed projections, stored dense (zeros off their support).

  Attributes:
    projections: ``[L, K, d]`` float32, each row +-1 on a random
      ``projection_fraction`` of the dims and 0 elsewhere.
  """
  projections: jax.Array


class DWTAParams(NamedTuple):
  """Winner-take-all bins.

  Attributes:
    bin_idx: ``[L, K / log2(bin_size), bin_size]`` int32 input dims per bin.
    seed: ``[]`` uint32 seed of the densification probes.
  """
  bin_idx: jax.Array
  seed: jax.Array


LSHParams = SimHashParams | DWTAParams


def init_lsh(key: jax.Array, config: LSHConfig, dim: int) -> LSHParams:
  """Draws hash functions for ``dim``-dimensional inputs.

  Args:
    key: a PRNG key (new functions: a new key).
    config: the family and sizes.
    dim: input dimension d.

  Returns:
    :class:`SimHashParams` or :class:`DWTAParams`.
  """
  config.validate()
  # DWTA bins draw input dims: it needs at least one.
  dim = check_int("init_lsh", "dim", dim, 1 if config.family == "dwta" else 0, INT32_MAX)
  L, K = config.num_tables, config.num_bits
  if config.family == "simhash":
    m = max(1, min(dim, round(dim * config.projection_fraction)))
    k_idx, k_sign = jax.random.split(key)
    keys = jax.random.split(k_idx, L * K)
    # Rank of each dim in a random permutation: the first m ranks are the support.
    support = jax.vmap(lambda k: jnp.argsort(jax.random.permutation(k, dim)) < m)(keys)
    sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, (L * K, dim)), 1.0, -1.0)
    return SimHashParams(jnp.where(support, sign, 0.0).astype(jnp.float32).reshape(L, K, dim))
  bins = K // int(math.log2(config.bin_size))
  total = L * bins * config.bin_size
  # Concatenated permutations: every dim is used about equally often.
  n_perm = -(-total // dim)
  k_perm, k_seed = jax.random.split(key)
  perms = jax.vmap(lambda k: jax.random.permutation(k, dim))(jax.random.split(k_perm, n_perm))
  idx = perms.reshape(-1)[:total].astype(jnp.int32).reshape(L, bins, config.bin_size)
  seed = jax.random.bits(k_seed, (), jnp.uint32)
  return DWTAParams(idx, seed)


# Jitter of the drawn rows, relative to their entries' standard deviation: 0.3 measured best of 0, 0.15, 0.3, 0.6
# and 1.0 (exact rows repeat the few largest ones; 1.0 is close to random hyperplanes) on the trained layers of the
# synthetic 200K-label set and GCIDE cloze (benchmarks/results/HISTORY.md, "Hyperplanes drawn from the rows").
ROW_JITTER = 0.3


def draw_weighted(key: jax.Array, weights: jax.Array, count: int) -> jax.Array:
  """``count`` ids in ``[0, N)`` drawn with replacement in proportion to ``weights`` ``[N]`` (negative or non-finite
  ones count as 0; all 0: uniformly), as ``[count]`` int32.

  By the inverse of the weights' cumulative sum: O(N + count log N). (``jax.random.categorical`` draws a Gumbel
  per row and draw, O(N count): 455 of a 790 ms refresh of 16 tables at N = 2e5.)
  """
  weights = jnp.where(jnp.isfinite(weights), jnp.maximum(weights, 0.0), 0.0).astype(jnp.float32)
  weights = jnp.where(jnp.sum(weights) > 0, weights, jnp.ones_like(weights))
  # Scaled below 1 by a power of two first (exact; a division by the largest weight flushed weights near float32's
  # largest to 0): their cumulative sum stays finite.
  cumulative = jnp.cumsum(jnp.ldexp(weights, -jnp.frexp(jnp.max(weights))[1]), dtype=jnp.float32)
  # Targets below the total (a product rounded up to it would pass the last row of weight > 0).
  targets = jnp.minimum(jax.random.uniform(key, (count,), jnp.float32) * cumulative[-1],
                        jnp.nextafter(cumulative[-1], jnp.float32(0)))
  # The first id whose cumulative sum exceeds its target: ids of weight 0 never are.
  return jnp.searchsorted(cumulative, targets, side="right", method="scan_unrolled").astype(jnp.int32)


def simhash_from_rows(key: jax.Array, config: LSHConfig, rows: jax.Array, weights: jax.Array, *,
                      completion: bool) -> SimHashParams:
  """SimHash hyperplanes drawn from the data: the normals of ``L K`` sampled rows, jittered.

  Random hyperplanes spend most bits on directions in which neither the rows nor the queries differ; the largest
  logits of a trained layer come from its largest rows (synthetic 200K labels: the top row's norm is 5-8x the
  median row's), so rows are drawn in proportion to ``weights`` (their squared norms). A query and a row then
  share a bit when they lie on the same side of a row like the ones it is likely to score high against.

  Args:
    key: a PRNG key.
    config: the sizes (``family="simhash"``).
    rows: ``[N, D]`` float32, the vectors the tables hash.
    weights: ``[N]`` non-negative sampling weights (0: never drawn, e.g. padding rows).
    completion: whether ``rows``' last coordinate is MIPS's norm completion (:mod:`sparsejax.index.mips`),
      which queries do not have: the drawn rows' is zeroed before the jitter.

  Returns:
    :class:`SimHashParams` with ``[L, K, D]`` projections.
  """
  L, K = config.num_tables, config.num_bits
  n, dim = rows.shape
  k_pick, k_jitter = jax.random.split(key)
  picked = jnp.take(rows, draw_weighted(k_pick, weights, L * K), axis=0).astype(jnp.float32)
  if completion:
    picked = picked.at[:, dim - 1].set(0.0)
  scale = jnp.maximum(jnp.std(picked), 1e-30)
  # The completion coordinate keeps its jitter: a row's bits then depend a little on its norm too (rows much
  # shorter than the longest, whose completion is near 1, share the jitter's side), which the largest logits, the
  # long rows', are not on. Measured on the serving tables (ids found equally often ranked lower id first, as then):
  # 0.955x of exact P@1 (synthetic 200K) and 0.933x (GCIDE cloze) with it, 0.868x and 0.973x with the coordinate
  # zeroed after the jitter.
  picked = picked + ROW_JITTER * scale * jax.random.normal(k_jitter, picked.shape, jnp.float32)
  return SimHashParams(picked.reshape(L, K, dim))


def lsh_hash(params: LSHParams, x: jax.Array) -> jax.Array:
  """Hashes each row of ``x`` into one code per table.

  Args:
    params: from :func:`init_lsh`.
    x: ``[B, d]`` float32.

  Returns:
    ``[B, L]`` int32 codes in ``[0, 2^K)``.
  """
  dims = Dims("lsh_hash")
  check_array(dims, "x", x, jnp.float32, ("B", "d"))
  if isinstance(params, SimHashParams):
    check_array(dims, "projections", params.projections, jnp.float32, ("L", "K", "d"))
    L, K, d = params.projections.shape
    out = jax.ShapeDtypeStruct((dims["B"], L), jnp.int32)
    return _ffi.ffi_call("simhash", out, vmap_method="sequential")(x, params.projections.reshape(L * K, d).T)
  if isinstance(params, DWTAParams):
    check_array(dims, "bin_idx", params.bin_idx, jnp.int32, ("L", "bins", "bin_size"))
    check_array(dims, "seed", params.seed, jnp.uint32, ())
    L, bins, size = params.bin_idx.shape
    out = jax.ShapeDtypeStruct((dims["B"], L), jnp.int32)
    return _ffi.ffi_call("dwta", out, vmap_method="sequential")(
        x, params.bin_idx.reshape(L * bins, size), params.seed)
  raise TypeError(f"lsh_hash: params must be SimHashParams or DWTAParams, got {type(params).__name__}")


def num_bits(params: LSHParams) -> int:
  """K, the bits per code of these hash functions."""
  if isinstance(params, SimHashParams):
    return params.projections.shape[1]
  return params.bin_idx.shape[1] * int(math.log2(params.bin_idx.shape[2]))


def num_tables(params: LSHParams) -> int:
  """L, the number of codes per vector."""
  return (params.projections if isinstance(params, SimHashParams) else params.bin_idx).shape[0]


def input_dim(params: LSHParams) -> int | None:
  """The input width the hash functions were drawn for (None for DWTA, whose bins only bound it)."""
  if isinstance(params, SimHashParams):
    return params.projections.shape[2]
  return None
