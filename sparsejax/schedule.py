"""When the candidate index is refreshed: :class:`TableSchedule`, and the refresh's cost in training steps."""

import dataclasses
import math

from sparsejax import index
from sparsejax.config import TablesConfig
from sparsejax.model_config import ModelConfig, local_active_k, uses_exact_path


def min_rebuild_period(config: TablesConfig, refresh_steps: float) -> int:
  """Shortest period, in steps, that keeps refreshes of ``refresh_steps`` steps within ``config.refresh_budget``
  of the training time (0: no budget)."""
  if config.refresh_budget <= 0 or refresh_steps <= 0:
    return 0
  return math.ceil(refresh_steps / config.refresh_budget)


@dataclasses.dataclass(frozen=True)
class TableSchedule:
  """When to rebuild the tables and when to draw new hash functions.

  Rebuilds happen after ``period`` steps, then each period is ``growth``
  times the previous one (capped at ``max_period``), as SLIDE does. New hash
  functions are drawn every ``rehash_period`` steps (0: never). A pure
  function of the step, so a resumed run keeps the same schedule. Any values
  give an answer (periods are at least one step); :class:`TablesConfig`
  rejects the meaningless ones (``growth < 1``, ``max_period < period``).
  """
  period: int
  growth: float
  max_period: int
  rehash_period: int = 0

  @classmethod
  def from_config(cls, config: TablesConfig, refresh_steps: float = 0.0) -> "TableSchedule":
    """The schedule of ``config``, its periods lengthened so that refreshes of ``refresh_steps`` steps each
    (:func:`refresh_cost_in_steps`) take at most ``config.refresh_budget`` of the training time."""
    period, max_period = config.rebuild_period, config.rebuild_max_period
    floor = min_rebuild_period(config, refresh_steps)
    if period and floor > period:
      period, max_period = floor, max(max_period, floor)
    return cls(period, config.rebuild_growth, max_period, config.rehash_period)

  @classmethod
  def for_model(cls, config: ModelConfig) -> "TableSchedule":
    """The schedule of a sampled SLIDE run of ``config`` (one shard's sizes): :meth:`from_config` with the
    refresh's estimated cost, :func:`refresh_cost_in_steps`."""
    return cls.from_config(config.tables, refresh_cost_in_steps(config))

  def rebuild_due(self, step: int) -> bool:
    """Whether the tables are rebuilt after step ``step`` (1-based count)."""
    if self.period <= 0 or step <= 0:
      return False
    cap = max(float(self.max_period), 1.0)
    at, p = 0, min(float(self.period), cap)
    while True:
      length = max(1, round(p))
      following = min(max(p * self.growth, 1.0), cap)
      if following == p:  # fixed from here on: no need to walk the remaining periods
        return step > at and (step - at) % length == 0
      at += length
      if at >= step:  # every loop advances: at most `step` rounds, ~log(cap/period)/log(growth) in practice
        return at == step
      p = following

  def rehash_due(self, step: int) -> bool:
    return self.rehash_period > 0 and step > 0 and step % self.rehash_period == 0


# A refresh scores every row against every cluster (or hash projection): dot products of a row with a d-vector in
# blocked matmuls. A training step reads and writes B x k rows at random (gathers, Adam, scatter). One touched row
# of a step costs about as much as this many of a refresh's products: on the 2-vCPU VM (train_profile.py, default
# network, batch 128) a refresh at N = 2e5 took 16.0 steps (estimate 17.5); at 10^6, 53 steps (estimate 172: the
# larger matmuls run faster and the step's rows miss the cache more, so the estimate errs on the rare side there).
REFRESH_PRODUCTS_PER_TOUCHED_ROW = 50.0


def refresh_cost_in_steps(config: ModelConfig) -> float:
  """Estimated wall time of one refresh of a shard's training index, in training steps of ``config``.

  From the sizes alone (so every process and every resumed run agrees): the refresh's row-by-vector products
  (clusters: the final assignment of every row plus the Lloyd iterations on their sample, each against ``C``
  centroids; LSH: ``K x L`` projections of every row) over the rows a step touches (``batch_size x k``), scaled
  by :data:`REFRESH_PRODUCTS_PER_TOUCHED_ROW`. 0 where the step is exact (no training index).
  """
  if uses_exact_path(config):
    return 0.0
  products = index.from_config(config).refresh_products
  touched = config.optim.batch_size * local_active_k(config, config.num_shards)
  return products / (touched * REFRESH_PRODUCTS_PER_TOUCHED_ROW)
