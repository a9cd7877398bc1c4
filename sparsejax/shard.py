"""How the output layer is split over processes: :class:`Shard`, the mesh axis its rows are split over (the
collectives the loss, the index and inference call), and :func:`shard_rows`, the rows each shard holds."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Shard(NamedTuple):
  """The mesh axis the output layer is split over.

  The layer's N rows are split into ``config.num_shards`` contiguous ranges
  of ``shard_rows(N, num_shards)`` rows (the last ones padded when N does not
  divide evenly), one per position along ``axis`` inside ``shard_map``.
  ``axis=None``: one process holds the whole layer.
  """
  axis: str | None = None

  def index(self):
    return 0 if self.axis is None else jax.lax.axis_index(self.axis)

  def psum(self, x):
    return x if self.axis is None else jax.lax.psum(x, self.axis)

  def psum_packed(self, *arrays):
    """``psum`` of float32 arrays as one flat array: one collective call (a tuple all-reduce makes one per array,
    each paying the link's latency)."""
    if self.axis is None:
      return arrays
    flat = jax.lax.psum(jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in arrays]), self.axis)
    offsets = np.cumsum([0] + [a.size for a in arrays])
    return tuple(flat[i:j].reshape(a.shape) for a, i, j in zip(arrays, offsets[:-1], offsets[1:]))

  def all_gather(self, x):
    """``[P, ...]``: every shard's ``x``, in shard order (``[1, ...]`` for one process)."""
    return x[None] if self.axis is None else jax.lax.all_gather(x, self.axis)

  def concatenate(self, x, axis: int = 1):
    """Every shard's ``x`` joined along ``axis``, in shard order (``x`` itself for one process)."""
    return x if self.axis is None else jax.lax.all_gather(x, self.axis, axis=axis, tiled=True)

  def row_range(self, rows: int, num_labels: int):
    """``(offset, num_valid)``: the global id of this shard's first row and how many of its ``rows`` rows are real
    (the last shards' rest is padding) in a layer of ``num_labels`` rows; Python ints for one process."""
    if self.axis is None:
      return 0, min(rows, num_labels)
    offset = self.index() * rows
    return offset, jnp.clip(num_labels - offset, 0, rows).astype(jnp.int32)


def shard_rows(num_labels: int, count: int) -> int:
  """Rows per shard when ``num_labels`` rows are split ``count`` ways (ceil)."""
  return -(-num_labels // count)
