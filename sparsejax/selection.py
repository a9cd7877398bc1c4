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
  call = _ffi.ffi_call("row_topk", (jax.ShapeDtypeStruct((n, k), jnp.float32),
                                    jax.ShapeDtypeStruct((n, k), jnp.int32)), vmap_method="sequential")
  return call(scores, k=np.int64(k))
