"""Candidate indexes: which output rows each sample computes.

One protocol, :class:`Index` (a NamedTuple of pure functions over the index's pytree state, optax-style), and its
two implementations:

* :func:`cluster_index` (``--candidates=clusters``, :mod:`.clustered` over :mod:`.clusters`): spherical k-means
  of the centred rows, probed by the clusters' mean logit.
* :func:`lsh_index` (``--candidates=lsh``, :mod:`.hashed` over :mod:`.lsh`, :mod:`.tables` and :mod:`.mips`):
  SLIDE's hash tables, SimHash or DWTA, of raw or centred MIPS-reduced rows.

:func:`from_config` (:mod:`.kinds`) is the one place that picks an implementation; :mod:`.kinds` also says
what each reads of the settings (without JAX, for the settings' validation); :mod:`.saved` restores
checkpoints of the earlier layout.
Importing this package does not import JAX; the implementations load on first use.
"""

from sparsejax.index import kinds
from sparsejax.index.base import Index
from sparsejax.index.kinds import from_config

__all__ = ["Index", "from_config", "cluster_index", "lsh_index"]


def __getattr__(name: str):
  """``cluster_index`` and ``lsh_index``, imported on first use (:func:`.kinds.implementation`): they import JAX."""
  if name in ("cluster_index", "lsh_index"):
    return kinds.implementation(name)
  raise AttributeError(f"module 'sparsejax.index' has no attribute {name!r}")
