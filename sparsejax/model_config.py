"""The static config of a SLIDE network (:class:`ModelConfig`) and the sizes derived from it.

The run's settings (:mod:`sparsejax.config`) map to it in one direction, :meth:`ModelConfig.from_config`: the
settings know nothing of the model.
"""

import dataclasses
import math
from typing import NamedTuple

import optax

from sparsejax import step_cost
from sparsejax.config import NetworkConfig, OptimizerConfig, TablesConfig
from sparsejax.index import clusters, lsh, tables
from sparsejax.settings import ConfigError
from sparsejax.shard import shard_rows

# Default clusters of the evaluation index: at least this many (and 4 x the training index's). Measured on a
# synthetic 20K-label network after 2 epochs (5 Lloyd iterations), sampled over exact P@1 at k = 1024 and at
# k = 400 (2% of N): 141 clusters (2 iterations, the training index) 0.84 / 0.78, 2048: 0.96 / 0.85, 3003:
# 0.96 / 0.88. On the 200K-label set after 12 epochs (the 300 s run of benchmarks/accuracy.py; 10,000 test
# queries, k = 1024, clusters ranked by mean logit + spread): 512 clusters 0.61, 2048 (3 iterations) 0.926, 4096
# (1 iteration) 0.954, (2) 0.970, (3) 0.971. Finer clusters cost more to rank (B x C x d) and to build
# (N x C x d per Lloyd iteration, once per evaluation): at N = 2*10^5 and d = 128, 2048 clusters and 3 iterations
# take 4.9 s, 4096 and 2 iterations 9.6 s on 2 cores (benchmarks/serving_index.py).
EVAL_MIN_CLUSTERS = 4096

# Default candidates of sampled inference (serving): (N / SERVING_SCALE)^2, at most N / SERVING_ROW_FRACTION (a
# sixteenth of the exact path's row products) and at least the training k. The share of the rows that a query
# needs grew with N: measured on the synthetic sets (benchmarks/RESULTS.md, "Sampled inference at 10^6 labels"),
# sampled / exact P@1 at 2*10^5 labels 0.964 at k = 1,024 (N / 195) and 0.991 at 4,000; at 10^6 (the 600 s run,
# 4,096 serving clusters) 0.08 at 1,024, 0.57 at 16,384, 0.67 at 32,768 and 0.986 at 62,500 (N / 16). The square
# gives 2,500 at 2*10^5 and 62,500 at 10^6. On a CPU the candidates' rows are gathered query by query (memory
# bound), so a query's time grows with k faster than its row products say: at 10^6 the 62,500 candidates took
# about as long as the exact top 5 on 2 cores.
SERVING_SCALE = 4000
SERVING_ROW_FRACTION = 16


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and hyper-parameters of a SLIDE network (hashable: a static jit argument).

  The settings are those of the run's ``network``, ``tables`` and ``optim``
  sections (documented in :mod:`sparsejax.config`); a training run builds this
  with :meth:`from_config`. For scripts::

    config = ModelConfig(num_features=F, num_labels=N, network=NetworkConfig(hidden_dims=(64,)))
    config = override(ModelConfig(F, N), hidden_dims=(64,), learning_rate=1e-2)   # the same, by name

  Attributes:
    num_features: F, input feature space.
    num_labels: N, output layer width.
    network: layer widths, active neurons per sample, output init scale.
    tables: the candidate index (clustered or LSH) and its sizes (the
      refresh schedule is read by the training loop, see :class:`sparsejax.schedule.TableSchedule`).
    optim: Adam and learning-rate schedule.
    num_shards: processes the output layer is split across (each holds
      ``ceil(N / num_shards)`` rows, its own tables and optimizer state).
  """
  num_features: int
  num_labels: int
  network: NetworkConfig = dataclasses.field(default_factory=NetworkConfig)
  tables: TablesConfig = dataclasses.field(default_factory=TablesConfig)
  optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  num_shards: int = 1

  @classmethod
  def from_config(cls, config, num_features: int, num_labels: int, num_shards: int = 1) -> "ModelConfig":
    """The model of a run's settings (a :class:`sparsejax.config.Config`) for data of ``num_features``
    features and ``num_labels`` labels."""
    return cls(num_features=num_features, num_labels=num_labels, network=config.network, tables=config.tables,
               optim=config.optim, num_shards=num_shards)

  @property
  def hidden_dims(self) -> tuple[int, ...]:
    return tuple(self.network.hidden_dims)

  @property
  def k(self) -> int:
    """Active output neurons per sample."""
    return min(self.network.active_k, self.num_labels)

  @property
  def lsh_config(self) -> lsh.LSHConfig:
    # Each shard's tables index its own rows: size them for those.
    rows = shard_rows(self.num_labels, self.num_shards)
    default = tables.default_lsh_config(rows, self.tables.lsh_family, self.tables.num_tables,
                                        projections=self.tables.lsh_projections)
    if self.tables.num_bits is None:
      return default
    return default._replace(num_bits=self.tables.num_bits)

  @property
  def table_bucket_size(self) -> int:
    return self.tables.bucket_size or tables.default_bucket_size()

  @property
  def index_sizes(self) -> tuple[int, int, int]:
    """``(clusters, rows, probes)`` of each shard's clustered index."""
    rows = shard_rows(self.num_labels, self.num_shards)
    c = min(self.tables.num_clusters or clusters.default_num_clusters(rows), rows)
    return c, rows, min(self.tables.cluster_probes or c, c)

  @property
  def kmeans_sample(self) -> int | None:
    """Rows per cluster of the Lloyd iterations of every clustered-index build (None: all rows)."""
    return self.tables.kmeans_sample or None

  @property
  def eval_index_sizes(self) -> tuple[int, int]:
    """``(clusters, Lloyd iterations)`` of each shard's clustered index built for evaluation and sampled inference.

    Per shard, as :attr:`index_sizes` (``num_clusters``) is: ``eval_num_clusters``, default the larger of 4 x
    the shard's training clusters and ``EVAL_MIN_CLUSTERS``, at most the shard's rows. A shard's index costs no
    more to build or rank than one process's (fewer rows, as many clusters at most). Splitting one process's
    clusters over the shards by their rows instead ranked candidates more coarsely where the rows that matter
    sit in one shard: synthetic 3,000 labels, 1,500 steps, k = 128, sampled P@1 (exact 0.945): one process,
    300 clusters 0.889; two shards of 300 each 0.848, of 150 each 0.743.
    """
    c, rows, _ = self.index_sizes
    default = max(4 * c, EVAL_MIN_CLUSTERS)
    return min(self.tables.eval_num_clusters or default, rows), self.tables.eval_kmeans_iterations

  @property
  def serving_k(self) -> int:
    """Candidates per query of sampled inference over all shards: ``tables.serving_k``, default
    ``(N / SERVING_SCALE)^2`` but at most ``N / SERVING_ROW_FRACTION``, at least :attr:`k`; at most N."""
    n = self.num_labels
    default = max(self.k, min((n // SERVING_SCALE) ** 2, n // SERVING_ROW_FRACTION))
    return min(self.tables.serving_k or default, self.num_labels)

  @property
  def max_from_index(self) -> int:
    """Active ids per shard that may come from the index (the rest of the non-label ones are random)."""
    k = local_active_k(self, self.num_shards)
    return k - int(round(self.network.random_negatives * k))

  @property
  def peak_learning_rate(self) -> float:
    """``learning_rate`` scaled from ``reference_batch_size`` to ``batch_size`` by ``lr_scaling``."""
    o = self.optim
    ratio = o.batch_size / o.reference_batch_size
    return o.learning_rate * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[o.lr_scaling]

  def schedule(self) -> optax.Schedule:
    """Learning rate as a function of the step."""
    o, peak = self.optim, self.peak_learning_rate
    if o.decay_steps > 0:
      return optax.warmup_cosine_decay_schedule(0.0 if o.warmup_steps else peak, peak, o.warmup_steps,
                                                o.warmup_steps + o.decay_steps, end_value=0.1 * peak)
    if o.warmup_steps > 0:
      return optax.linear_schedule(0.0, peak, o.warmup_steps)
    return optax.constant_schedule(peak)

  @property
  def exact_softmax(self) -> bool:
    """Whether the SLIDE step computes every output neuron (see :func:`uses_exact_path`)."""
    return uses_exact_path(self)

  @property
  def per_label_targets(self) -> bool:
    """Whether each label of a sample weighs 1 in the loss (``--label_weights=per_label``), not ``1/|y|``."""
    return self.network.label_weights == "per_label"

  def adam_args(self) -> dict[str, float]:
    """Adam's constants as keyword arguments (shared by every optimizer of the model)."""
    return dict(b1=self.optim.b1, b2=self.optim.b2, eps=self.optim.eps, weight_decay=self.optim.weight_decay)

  def validate(self) -> None:
    """Raises :class:`sparsejax.settings.ConfigError` (a ``ValueError``) naming a bad setting."""
    for name in ("num_features", "num_labels", "num_shards"):
      if getattr(self, name) < 1:
        raise ConfigError(name, getattr(self, name), "must be >= 1")
    for section in (self.network, self.tables, self.optim):
      section.validate()
    self.lsh_config.validate()


def local_active_k(config: ModelConfig, count: int) -> int:
  """Active ids per shard: ``k / count``, within the smallest shard's real rows."""
  rows = shard_rows(config.num_labels, count)
  smallest = config.num_labels - (count - 1) * rows
  return max(1, min(-(-config.k // count), smallest))


class SoftmaxCosts(NamedTuple):
  """Modelled seconds per step of one shard's output layer on either path (:func:`step_cost.output_layer_seconds`)."""
  exact: float
  sampled: float


def softmax_costs(config: ModelConfig) -> SoftmaxCosts:
  """The output layer's modelled cost per step on the exact and on the sampled path, on one shard (its rows and its
  share of the active set). The rest of the step is the same on both."""
  rows = shard_rows(config.num_labels, config.num_shards)
  sizes = (config.optim.batch_size, rows, local_active_k(config, config.num_shards), config.hidden_dims[-1])
  return SoftmaxCosts(step_cost.output_layer_seconds(*sizes, exact=True),
                      step_cost.output_layer_seconds(*sizes, exact=False))


def uses_exact_path(config: ModelConfig) -> bool:
  """Whether the SLIDE step computes the exact softmax over all of a shard's rows.

  ``network.softmax`` forces it (``exact``) or the sampled one (``sampled``; still exact when ``active_k`` covers
  every label); ``auto`` takes the path of the lower modelled cost (:func:`softmax_costs`): the exact one where the
  active set is a large fraction of the rows (with the default batch, about ``4 x active_k >= rows``).
  """
  rows = shard_rows(config.num_labels, config.num_shards)
  if local_active_k(config, config.num_shards) >= rows or config.network.softmax == "exact":
    return True
  if config.network.softmax != "auto":
    return False
  costs = softmax_costs(config)
  return costs.exact <= costs.sampled


def softmax_choice(config: ModelConfig) -> str:
  """The log line that says which softmax the step takes and why, with both paths' modelled costs."""
  rows = shard_rows(config.num_labels, config.num_shards)
  k = local_active_k(config, config.num_shards)
  exact, costs = uses_exact_path(config), softmax_costs(config)
  chosen, other = ("exact", "sampled") if exact else ("sampled", "exact")
  if k >= rows:
    why = "every row is active: nothing to sample"
  elif config.network.softmax != "auto":
    why = f"--softmax={config.network.softmax}"
  else:
    why = f"the cheaper path by the step-cost model; --softmax={other} forces the other"
  return (f"softmax: {chosen} ({k} active of {rows} rows per shard; the output layer modelled at "
          f"{1e3 * getattr(costs, chosen):.2f} ms per step against {1e3 * getattr(costs, other):.2f} ms {other}: "
          f"{why})")
