"""A SLIDE network: sparse features -> dense ReLU layers -> sampled output layer.

Functional API::

  state = init(rng, config)
  state, metrics = train_step(state, batch, config=config)   # jit, state donated
  state = rebuild_tables(state)                               # on a schedule

Per step, only the sampled output rows and the input rows of the batch's
features are read and updated (row-sparse Adam); the dense hidden layers use
optax. Nothing in a step is O(N d) for the N-wide output layer. Batches are
dicts of ``feat_ids [B, F] int32`` (-1 padded), ``feat_vals [B, F] float32``
and ``labels [B, M] int32`` (-1 padded).
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax import index, ops, optim
from sparsejax.config import ConfigError, NetworkConfig, OptimizerConfig, TablesConfig
from sparsejax.index import clusters, lsh, tables
from sparsejax.loss import (  # noqa: F401 (re-exported: the loss's home was this module)
  Shard,
  all_rows_label_targets,
  label_ids_in_layer,
  label_targets,
  num_distinct_labels,
  shard_rows,
  sharded_softmax_cross_entropy,
  softmax_cross_entropy,
  tail_log_weights,
)
from sparsejax.padding import PAD_ID

# Default clusters of the evaluation index: at least this many (and 4 x the training index's). Measured on a
# synthetic 20K-label network after 2 epochs (5 Lloyd iterations), sampled over exact P@1 at k = 1024 and at
# k = 400 (2% of N): 141 clusters (2 iterations, the training index) 0.84 / 0.78, 2048: 0.96 / 0.85, 3003:
# 0.96 / 0.88. On the 200K-label set after 12 epochs (the 300 s run of benchmarks/accuracy.py; 10,000 test
# queries, k = 1024, clusters ranked by mean logit + spread): 512 clusters 0.61, 2048 (3 iterations) 0.926, 4096
# (1 iteration) 0.954, (2) 0.970, (3) 0.971. Finer clusters cost more to rank (B x C x d) and to build
# (N x C x d per Lloyd iteration, once per evaluation): at N = 2*10^5 and d = 128, 2048 clusters and 3 iterations
# take 4.9 s, 4096 and 2 iterations 9.6 s on 2 cores (benchmarks/serving_index.py).
EVAL_MIN_CLUSTERS = 4096


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and hyper-parameters of a SLIDE network (hashable: a static jit argument).

  The settings are those of the run's ``network``, ``tables`` and ``optim``
  sections (documented in :mod:`sparsejax.config`); a training run builds this
  with :meth:`sparsejax.config.Config.model_config`. For scripts::

    config = ModelConfig(num_features=F, num_labels=N, network=NetworkConfig(hidden_dims=(64,)))
    config = override(ModelConfig(F, N), hidden_dims=(64,), learning_rate=1e-2)   # the same, by name

  Attributes:
    num_features: F, input feature space.
    num_labels: N, output layer width.
    network: layer widths, active neurons per sample, output init scale.
    tables: the candidate index (clustered or LSH) and its sizes (the
      refresh schedule is read by the training loop, see :class:`TableSchedule`).
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
    default = tables.default_lsh_config(rows, self.tables.lsh_family, self.tables.num_tables)
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

  def adam_args(self) -> dict[str, float]:
    """Adam's constants as keyword arguments (shared by every optimizer of the model)."""
    return dict(b1=self.optim.b1, b2=self.optim.b2, eps=self.optim.eps, weight_decay=self.optim.weight_decay)

  def validate(self) -> None:
    """Raises :class:`sparsejax.config.ConfigError` (a ``ValueError``) naming a bad setting."""
    for name in ("num_features", "num_labels", "num_shards"):
      if getattr(self, name) < 1:
        raise ConfigError(name, getattr(self, name), "must be >= 1")
    for section in (self.network, self.tables, self.optim):
      section.validate()
    self.lsh_config.validate()


class SparseLayer(NamedTuple):
  """A layer whose rows are read and updated sparsely: ``w [rows, d]``, ``b``."""
  w: jax.Array
  b: jax.Array


class SlideState(NamedTuple):
  """Everything a training run holds, as arrays (checkpointable, donatable).

  Attributes:
    step: ``[]`` int32 steps taken.
    rng: ``[2]`` uint32 raw PRNG key data.
    embed: input layer, ``w [F, d0]`` (row-sparse Adam) and ``b [d0]`` (optax).
    hidden: dense layers ``[(w [d_i, d_i+1], b [d_i+1]), ...]`` (optax).
    out: output layer, ``w [N, d]`` and ``b [N]`` (row-sparse Adam).
    embed_opt: row-sparse Adam state of ``embed.w``.
    out_w_opt, out_b_opt: row-sparse Adam states of ``out.w`` and ``out.b``.
    dense_opt: optax state of ``(embed.b, hidden)``.
    index: the state of the output layer's candidate index (:func:`sparsejax.index.from_config`: hash functions
      and tables, or a clustered index).
  """
  step: jax.Array
  rng: jax.Array
  embed: SparseLayer
  hidden: tuple
  out: SparseLayer
  embed_opt: optim.RowSparseAdamState
  out_w_opt: optim.RowSparseAdamState
  out_b_opt: optim.RowSparseAdamState
  dense_opt: Any
  index: Any


def dense_optimizer(config: ModelConfig) -> optax.GradientTransformation:
  """optax AdamW with the model's schedule and constants (the dense layers; every layer of the dense baseline)."""
  return optax.adamw(config.schedule(), **config.adam_args())


class NetworkParams(NamedTuple):
  """The trainable parameters: ``embed``, ``hidden`` and ``out`` as in :class:`SlideState`."""
  embed: SparseLayer
  hidden: tuple
  out: SparseLayer


def init_params(rng: jax.Array, config: ModelConfig) -> NetworkParams:
  """Initial parameters (shared by the dense baseline, for like-for-like runs)."""
  config.validate()
  dims = config.hidden_dims
  k_embed, k_out, k_hidden = jax.random.split(jax.random.fold_in(rng, 0), 3)
  glorot = jax.nn.initializers.glorot_uniform()
  # A feature vector sums ~tens of input rows: rows of std 1/sqrt(d0) keep
  # the first layer's activations O(1) for L2-normalised inputs.
  embed = SparseLayer(
      jax.random.normal(k_embed, (config.num_features, dims[0]), jnp.float32) * (1.0 / math.sqrt(dims[0])),
      jnp.zeros((dims[0],), jnp.float32))
  hidden = tuple(
      (glorot(k, (dims[i], dims[i + 1]), jnp.float32), jnp.zeros((dims[i + 1],), jnp.float32))
      for i, k in enumerate(jax.random.split(k_hidden, len(dims) - 1)))
  # Random (not zero) output rows: the LSH tables need rows that hash apart.
  out = SparseLayer(
      jax.random.normal(k_out, (config.num_labels, dims[-1]), jnp.float32)
      * (config.network.init_scale / math.sqrt(dims[-1])),
      jnp.zeros((config.num_labels,), jnp.float32))
  return NetworkParams(embed, hidden, out)


def init(rng: jax.Array, config: ModelConfig) -> SlideState:
  """A fresh network, optimizer states and built LSH tables.

  Args:
    rng: a PRNG key.
    config: the model.

  Returns:
    The initial :class:`SlideState`.
  """
  return init_from_params(rng, config, jitted_init_params(rng, config))


# The parameters and the index are each built by one jitted program (also when init, or dense.init, runs outside
# jit). Op by op, init compiled ~100 small ops one at a time (4.5 s of a small run's start). As one program with
# the rest of the state, XLA held every temporary of the index build at once: 9.7 GB peak at N = 2·10^6, d = 128,
# against 5.6 GB op by op and 4.6 GB as these two programs.
jitted_init_params = jax.jit(init_params, static_argnums=1)


def init_from_params(rng: jax.Array, config: ModelConfig, params: NetworkParams,
                     num_valid: int | jax.Array | None = None) -> SlideState:
  """The state around given parameters: optimizer states, the built candidate index.

  Args:
    rng: the key given to :func:`init_params`.
    config: the model.
    params: the parameters (``params.out`` may be one shard of the layer).
    num_valid: rows of ``params.out`` that are real (the rest padding).
  """
  k_lsh, k_tables, k_state = jax.random.split(jax.random.fold_in(rng, 1), 3)
  sparse_opt = optim.row_sparse_adam(config.schedule(), **config.adam_args(),
                                     moment_dtype=jnp.dtype(config.optim.moment_dtype),
                                     second_moment=config.optim.second_moment)
  # The output layer's weights in their training dtype (the index is built from their float32 values).
  params = params._replace(out=params.out._replace(w=params.out.w.astype(config.optim.weight_dtype)))
  index_state = _init_index(k_lsh, k_tables, config, params.out, num_valid)
  return SlideState(
      step=jnp.zeros((), jnp.int32),
      rng=jax.random.key_data(k_state),
      embed=params.embed, hidden=params.hidden, out=params.out,
      embed_opt=sparse_opt.init(params.embed.w), out_w_opt=sparse_opt.init(params.out.w),
      out_b_opt=sparse_opt.init(params.out.b),
      dense_opt=dense_optimizer(config).init((params.embed.b, params.hidden)),
      index=index_state)


# Built by one jitted program of its own, as the parameters are (see jitted_init_params).
_init_index = jax.jit(lambda k_functions, k_build, config, out, num_valid: index.from_config(config).init(
    k_functions, k_build, out.w, out.b, num_valid), static_argnums=2)


def query_active(state: SlideState, h: jax.Array, *, config: ModelConfig, k: int, num_rows: int | jax.Array,
                 labels: jax.Array | None = None, seed: jax.Array | int = 0,
                 max_from_index: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Each query's ``k`` active ids from the state's index: ``(active [B, k], num_from_index [B])``.

  Labels (if given) come first, then index candidates (at most
  ``max_from_index``, default ``k``; LSH tables take as many as they have),
  then distinct random ids.
  """
  return index.from_config(config).query(state.index, h, k=k, num_rows=num_rows, labels=labels, seed=seed,
                                         max_from_index=max_from_index)


def hidden_forward(embed_w: jax.Array, dense_params, feat_ids: jax.Array, feat_vals: jax.Array,
                   embed_tap: jax.Array | None = None) -> jax.Array:
  """Sparse features to the last hidden layer's activations ``[B, d]``.

  ``embed_tap`` (zeros) is added to the input layer's pre-activation; its
  gradient is the cotangent that the input layer's row-sparse gradient needs.
  """
  embed_b, hidden = dense_params
  z = ops.embedding_bag(feat_ids, feat_vals, embed_w, embed_b)
  if embed_tap is not None:
    z = z + embed_tap
  h = jax.nn.relu(z)
  for w, b in hidden:
    h = jax.nn.relu(h @ w + b)
  return h


def input_dropout(feat_ids: jax.Array, feat_vals: jax.Array, rate: float,
                  key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inverted dropout on the input features: ``(feat_ids, feat_vals)`` ``[B, F]`` with each feature dropped with
  probability ``rate`` (its id made padding, its value 0) and the others' values divided by ``1 - rate``, so that
  the embedding bag's expectation is unchanged. A dropped feature's input row is neither read nor updated (lazy
  Adam leaves it alone, as for a feature the sample does not have): the step stays O(B F)."""
  keep = jax.random.bernoulli(key, 1.0 - rate, feat_vals.shape) & (feat_ids >= 0)
  return (jnp.where(keep, feat_ids, PAD_ID),
          jnp.where(keep, feat_vals / (1.0 - rate), 0.0).astype(feat_vals.dtype))


def dropout(config: ModelConfig, rng: jax.Array, step: jax.Array, feat_ids: jax.Array, feat_vals: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """A training step's dropout, its masks drawn from ``(rng, step)`` (the sparse and dense models share it).

  Args:
    config: ``config.network.input_dropout`` and ``.dropout`` are the rates (0: none).
    rng: ``[2]`` uint32 key data of the run (``SlideState.rng``).
    step: the step number.
    feat_ids, feat_vals: ``[B, F]`` the batch's features.

  Returns:
    ``(feat_ids, feat_vals, keep)``: the features after :func:`input_dropout`, and the ``[B, d]`` inverted-dropout
    factor (0 or ``1/(1-rate)``) to multiply the last hidden layer's activations by, or None without dropout.
  """
  key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
  if config.network.input_dropout > 0:
    feat_ids, feat_vals = input_dropout(feat_ids, feat_vals, config.network.input_dropout,
                                        jax.random.fold_in(key, 0x1d))
  keep = None
  if config.network.dropout > 0:
    keep = jax.random.bernoulli(jax.random.fold_in(key, 0x0d), 1.0 - config.network.dropout,
                                (feat_ids.shape[0], config.hidden_dims[-1]))
    keep = keep.astype(jnp.float32) / (1.0 - config.network.dropout)
  return feat_ids, feat_vals, keep


def all_finite(tree) -> jax.Array:
  """Whether every floating-point value in ``tree`` is finite: a ``[]`` bool."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return functools.reduce(jnp.logical_and, flags, jnp.bool_(True))


def _sums_stay_finite(count: int, g: jax.Array, x: jax.Array) -> jax.Array:
  """Whether row-sparse gradients ``sum of up to count terms g[b, j] x[b]`` and their squares (Adam's second
  moment) surely stay finite: a bound from the largest factors, O(B k + B d)."""
  bound = count * jnp.max(jnp.abs(g), initial=0.0) * jnp.max(jnp.abs(x), initial=0.0)
  return jnp.isfinite(bound * bound)


def keep_if(ok: jax.Array, new, old):
  """``new`` if ``ok`` else ``old``, leaf by leaf (reads both: for small trees, or a model that is dense anyway)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def local_active_k(config: ModelConfig, count: int) -> int:
  """Active ids per shard: ``k / count``, within the smallest shard's real rows."""
  rows = shard_rows(config.num_labels, count)
  smallest = config.num_labels - (count - 1) * rows
  return max(1, min(-(-config.k // count), smallest))


# A gathered dot product (sampled step: B x k of them, plus sorting the ids and the query) costs about as much
# as about ten dense ones (exact step: B x N in BLAS matmuls) on CPU: with k >= N / EXACT_PATH_RATIO the exact
# step is the faster one.
EXACT_PATH_RATIO = 8


def uses_exact_path(config: ModelConfig) -> bool:
  """Whether the SLIDE step computes the exact softmax over all of a shard's rows.

  ``network.softmax`` forces it (``exact``) or the sampled one (``sampled``; still exact when ``active_k`` covers
  every label); ``auto`` takes the exact step where the active set is a large fraction of the rows
  (``active_k * EXACT_PATH_RATIO >= rows``), where it is cheaper than sampling.
  """
  rows = shard_rows(config.num_labels, config.num_shards)
  k = local_active_k(config, config.num_shards)
  if k >= rows or config.network.softmax == "exact":
    return True
  return config.network.softmax == "auto" and k * EXACT_PATH_RATIO >= rows


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


# The named scopes of :func:`train_step` (``jax.named_scope``: they reach the compiled HLO's metadata and
# so every netanalysis report), each with how its work per process scales with the number of shards P:
# "replicated" (every shard does all of it) or "sharded" (each shard does 1/P of it).
STEP_SCOPES = {
    "hidden_fwd": "replicated",  # input and hidden layers, forward
    "lsh_query": "sharded",  # each shard samples k/P ids from its own tables
    "out_logits": "sharded",  # logits of this shard's active ids
    "softmax_reduce": "sharded",  # local softmax partials, then one all-gather of [4, B] numbers
    "dh_reduce": "sharded",  # the psum of dh (this shard's part of dh = g W comes from out_adam's pass)
    "hidden_bwd": "replicated",
    "out_adam": "sharded",  # row-sparse Adam on this shard's active rows (and table re-insertion)
    "embed_adam": "replicated",
    "dense_adam": "replicated",
}


def train_step(state: SlideState, batch: dict, *, config: ModelConfig,
               shard: Shard = Shard()) -> tuple[SlideState, dict]:
  """One SGD step on a batch. Jit with ``config`` static and the state donated.

  With ``shard.axis`` set this runs inside ``shard_map`` on one slice of the
  output layer (see :mod:`sparsejax.distributed`): the batch, the hidden
  layers and their updates are replicated, and per step the shards exchange
  only ``O(B d)`` numbers (softmax normalizers and the hidden gradient).

  Args:
    state: the current state (this shard's slice of the output layer).
    batch: ``feat_ids [B, F]``, ``feat_vals [B, F]``, ``labels [B, M]`` int32 ids in ``[0, N)``, -1 padded.
      Other ids are padding too; labels given as concrete arrays (not traced) are checked and refused
      (:class:`sparsejax.data.XCDataset` refuses them at load).
    config: the model's config.
    shard: the split of the output layer.

  Returns:
    ``(new_state, metrics)``; metrics hold scalar ``loss``, the mean number
    of active ids that came from the tables (per shard), and the learning rate.
  """
  fids, fvals = batch["feat_ids"], batch["feat_vals"]
  labels = label_ids_in_layer(batch["labels"], config.num_labels)
  B = fids.shape[0]
  rows = state.out.w.shape[0]
  offset = shard.index() * rows
  n_valid = jnp.clip(config.num_labels - offset, 0, rows).astype(jnp.int32)
  local_labels = jnp.where((labels >= offset) & (labels < offset + n_valid), labels - offset, PAD_ID)
  dense_params = (state.embed.b, state.hidden)
  fids, fvals, keep = dropout(config, state.rng, state.step, fids, fvals)
  with jax.named_scope("hidden_fwd"):
    h, hidden_vjp = jax.vjp(
        lambda dp, tap: hidden_forward(state.embed.w, dp, fids, fvals, tap) * (1.0 if keep is None else keep),
        dense_params, jnp.zeros((B, config.hidden_dims[0]), jnp.float32))
  lr = config.schedule()(state.step)
  adam = config.adam_args()
  exact = uses_exact_path(config)
  # A non-finite step is not applied (the loop stops or skips it: --on_nonfinite): the verdict comes from values
  # every shard agrees on (the loss and dh are psums, h is replicated), and a skipped step changes nothing but
  # the step counter.
  if exact:  # every (real) row is active: dense matmuls, Adam on every row
    from_tables = jnp.zeros((B,), jnp.int32)
    touched = None
    with jax.named_scope("out_logits"):
      row_ids = jnp.arange(rows, dtype=jnp.int32)
      valid = row_ids < n_valid
      w = state.out.w.astype(jnp.float32)  # (bfloat16 weights: widened for the matmuls)
      logits = jnp.where(valid, h @ w.T + state.out.b, -jnp.inf)
      targets = all_rows_label_targets(local_labels, rows, num_distinct_labels(labels))
    with jax.named_scope("softmax_reduce"):
      loss, g_out = sharded_softmax_cross_entropy(logits, targets, shard)
    with jax.named_scope("dh_reduce"):  # the step's metric rides along in the same all-reduce
      # A shard whose row gradients could overflow poisons dh, so that every shard skips the step (no extra
      # collective).
      dh, tables_fraction = shard.psum_packed(g_out @ w + jnp.where(_sums_stay_finite(B, g_out, h), 0.0, jnp.nan),
                                              jnp.mean(from_tables.astype(jnp.float32)))
    with jax.named_scope("hidden_bwd"):
      d_dense, d_embed = hidden_vjp(dh)
    finite = all_finite((loss, dh, d_dense, d_embed)) & _sums_stay_finite(fids.size, fvals, d_embed)
    with jax.named_scope("out_adam"):
      old_out = ((state.out.w, state.out.b), (state.out_w_opt, state.out_b_opt))
      new_out = optim.adam_all_rows(
          *old_out, (g_out.T @ h, jnp.sum(g_out, axis=0)), lr,
          jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step), 0xADA), **adam)
      (out_w, out_b), (out_w_opt, out_b_opt) = keep_if(finite, new_out, old_out)  # O(N d), as the step itself
  else:
    with jax.named_scope("lsh_query"):
      seed = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
      if shard.axis is not None:
        seed = jax.random.fold_in(seed, shard.index())
      active, from_tables = query_active(
          state, h, config=config, k=local_active_k(config, config.num_shards), num_rows=n_valid,
          labels=local_labels, seed=jax.random.bits(seed, (), jnp.uint32), max_from_index=config.max_from_index)
    with jax.named_scope("out_logits"):
      targets = label_targets(active, local_labels, num_distinct_labels(labels))
      logits = jnp.where(active >= 0, ops.sparse_logits(h, state.out.w, state.out.b, active), -jnp.inf)
      if config.network.tail_correction:
        logits = logits + tail_log_weights(jnp.sum(targets > 0, axis=1) + from_tables, active.shape[1], n_valid)
    with jax.named_scope("softmax_reduce"):
      loss, g_out = sharded_softmax_cross_entropy(logits, targets, shard)
    with jax.named_scope("out_adam"):
      # The output rows are written in place in the same pass that computes dh (below), so their verdict comes
      # first, from the loss and h: with a finite loss every |g_out| <= 1, so the row gradients (sums of at most
      # active.size terms g_out[b, j] h[b]) and their squares stay finite if this bound does. A skipped step
      # updates no row (padding ids).
      applied = all_finite((loss, h)) & _sums_stay_finite(active.size, jnp.ones(()), h)
      active = jnp.where(applied, active, PAD_ID)
      # The output layer's weight and bias share their rows: one pass updates both, and computes the hidden
      # layer's gradient dh = sum_j g_out[b, j] W[active[b, j]] from the rows it reads anyway (W before the
      # update).
      (out_w, out_b), (out_w_opt, out_b_opt), touched, dh = optim.apply_row_sparse_adam(
          (state.out.w, state.out.b), (state.out_w_opt, state.out_b_opt),
          ops.RowSparseGrad(active, jnp.where(applied, g_out, 0.0), h), lr, combine=True, **adam)
      out_w_opt, out_b_opt = (new._replace(count=jnp.where(applied, new.count, old.count)) for new, old in (
          (out_w_opt, state.out_w_opt), (out_b_opt, state.out_b_opt)))
    with jax.named_scope("dh_reduce"):  # the step's metric rides along in the same all-reduce
      dh, tables_fraction = shard.psum_packed(dh, jnp.mean(from_tables.astype(jnp.float32)))
    with jax.named_scope("hidden_bwd"):
      d_dense, d_embed = hidden_vjp(dh)
    # The rest of the step is decided with dh too. (A non-finite dh from finite rows, loss and h, which the
    # output layer's update could no longer wait for, would need rows near the float32 limit.)
    finite = applied & all_finite((dh, d_dense, d_embed)) & _sums_stay_finite(fids.size, fvals, d_embed)

  with jax.named_scope("embed_adam"):
    embed_w, embed_opt, _ = optim.apply_row_sparse_adam(
        state.embed.w, state.embed_opt, ops.RowSparseGrad(jnp.where(finite, fids, PAD_ID), fvals, d_embed), lr,
        **adam)
    embed_opt = embed_opt._replace(count=jnp.where(finite, embed_opt.count, state.embed_opt.count))
  with jax.named_scope("dense_adam"):
    updates, dense_opt = dense_optimizer(config).update(d_dense, state.dense_opt, dense_params)
    embed_b, hidden = keep_if(finite, optax.apply_updates(dense_params, updates), dense_params)
    dense_opt = keep_if(finite, dense_opt, state.dense_opt)

  index_state = state.index
  if not exact:  # the exact step does not query the index
    with jax.named_scope("out_adam"):  # re-inserting updated rows is part of updating this shard's rows
      index_state = index.from_config(config).update(index_state, out_w, labels=jnp.where(finite, local_labels, PAD_ID),
                                                     touched=touched, num_rows=rows)

  new_state = state._replace(
      step=state.step + 1, embed=SparseLayer(embed_w, embed_b), hidden=hidden, out=SparseLayer(out_w, out_b),
      embed_opt=embed_opt, out_w_opt=out_w_opt, out_b_opt=out_b_opt, dense_opt=dense_opt, index=index_state)
  metrics = {"loss": loss, "learning_rate": lr, "finite": finite,
             "active_from_tables": tables_fraction / config.num_shards}
  return new_state, metrics


def rebuild_tables(state: SlideState, config: ModelConfig, num_valid: int | jax.Array | None = None) -> SlideState:
  """Refreshes the index from the current rows (amortized work, off the step): :attr:`sparsejax.index.Index.refresh`.

  Args:
    state: the state whose ``index`` is refreshed.
    config: the model.
    num_valid: only rows below it are real (a padded shard); default all.
  """
  return state._replace(index=index.from_config(config).refresh(state.index, state.out.w, state.out.b, num_valid))


def serving_index(state: SlideState, config: ModelConfig, num_valid: int | jax.Array | None = None) -> SlideState:
  """The state with the index that evaluation and sampled inference use, built afresh from its rows
  (:attr:`sparsejax.index.Index.serving`: a clustered index of ``config.eval_index_sizes``, finer than the training
  index; LSH tables rebuilt as in training). The state's own index is left alone (the result holds a new one,
  possibly of another size). In a sharded run ``state`` is one shard's (its rows below ``num_valid`` real, the rest
  padding).
  """
  return state._replace(index=index.from_config(config).serving(state.index, state.out.w, state.out.b, num_valid))


def inference_state(params: NetworkParams, config: ModelConfig, kept_index=None, saved_index=None) -> SlideState:
  """A state for sampled inference around trained ``params``, with no optimizer state.

  Its index is the one the run's evaluations queried (:func:`serving_index`, deterministic: for one process the
  same as the run's final evaluation built): ``kept_index`` where the run kept it, else built from the rows and
  the run's training index ``saved_index`` (its hash functions and table sizes; None: fresh ones of the run's
  sizes). ``params.out`` holds the N real rows (a sharded run's padding taken off).
  """
  state = SlideState(step=None, rng=None, embed=params.embed, hidden=params.hidden, out=params.out, embed_opt=None,
                     out_w_opt=None, out_b_opt=None, dense_opt=None, index=kept_index)
  if kept_index is not None:
    return state
  return state._replace(index=index.from_config(config).serving(saved_index, params.out.w, params.out.b))


def new_hash_functions(state: SlideState, config: ModelConfig,
                       num_valid: int | jax.Array | None = None) -> SlideState:
  """Draws new hash functions (a clustered index: new seeds) and rebuilds."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), -state.step - 1)
  return state._replace(index=index.from_config(config).renew(state.index, key, state.out.w, state.out.b, num_valid))


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


def hidden(state: SlideState, feat_ids: jax.Array, feat_vals: jax.Array) -> jax.Array:
  """Last hidden layer activations ``[B, d]`` for a batch (any state with ``embed`` and ``hidden``)."""
  return hidden_forward(state.embed.w, (state.embed.b, state.hidden), feat_ids, feat_vals)


def num_params(state: SlideState) -> int:
  """Trainable parameters."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves((state.embed, state.hidden, state.out)))
