"""The ``k`` highest scores of each row, by the ``row_topk`` kernel.

k-means assignment and exact and sampled inference rank rows of scores with it, in the order in which the
clustered index's probe (its own kernel) ranks clusters: score descending, ``-0 == +0``, ties to the lower
column, NaN last.
"""

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import _ffi
from sparsejax._checks import Dims, check_array, check_int


def row_topk(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Each row's ``k`` highest scores and their columns, best first.

  ``jax.lax.top_k`` on XLA:CPU took about 3.6 ns per score (three times the matmul of exact inference that
  made them) and sorts NaN by sign; the kernel is one vectorized pass per row (``O(C)`` for any ``k``).

  Args:
    scores: ``[n, C]`` float32.
    k: ``1 <= k <= C``.

  Returns:
    ``(values [n, k] float32, columns [n, k] int32)``: score descending, ``-0 == +0``, ties to the lower
    column, NaN after every number.
  """
  dims = Dims("row_topk")
  check_array(dims, "scores", scores, jnp.float32, ("n", "C"))
  k = check_int("row_topk", "k", k, 1, dims["C"])
  n = dims["n"]

  def kernel(scores):
    call = _ffi.ffi_call("row_topk", (jax.ShapeDtypeStruct((n, k), jnp.float32),
                                      jax.ShapeDtypeStruct((n, k), jnp.int32)), vmap_method="sequential")
    return call(scores, k=np.int64(k))

  return _ffi.on_cpu(kernel, lambda scores: row_topk_jnp(scores, k), scores)


def row_topk_jnp(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """:func:`row_topk` in ``jnp`` (where there is no kernel: accelerators), in the same order.

  ``jax.lax.top_k`` keeps the lower column first among equals; it ranks an order-preserving int32 key of each
  score, in which ``-0`` and ``+0`` are one key and every NaN ranks below ``-inf``.
  """
  bits = jax.lax.bitcast_convert_type(jnp.where(scores == 0, 0.0, scores), jnp.int32)
  key = jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)  # negative floats: larger magnitude, lower key
  key = jnp.where(jnp.isnan(scores), np.iinfo(np.int32).min, key)
  _, columns = jax.lax.top_k(key, k)
  return jnp.take_along_axis(scores, columns, axis=1), columns
