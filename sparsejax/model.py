"""SLIDE's training step: sparse features -> dense ReLU layers -> sampled output layer.

Functional API::

  state = init(rng, config)
  state, metrics = train_step(state, batch, config=config)   # jit, state donated
  state = rebuild_tables(state, config)                       # on a schedule (sparsejax.schedule)

Per step, only the sampled output rows and the input rows of the batch's
features are read and updated (row-sparse Adam); the dense hidden layers use
optax. Nothing in a step is O(N d) for the N-wide output layer. Batches are
dicts of ``feat_ids [B, F] int32`` (-1 padded), ``feat_vals [B, F] float32``
and ``labels [B, M] int32`` (-1 padded).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax import averaging, index, network, ops, optim
from sparsejax.loss import (
  all_rows_label_targets,
  label_ids_in_layer,
  leading_label_targets,
  num_distinct_labels,
  sharded_softmax_cross_entropy,
  tail_log_weights,
)
from sparsejax.model_config import ModelConfig, local_active_k, uses_exact_path
from sparsejax.network import NetworkParams, SparseLayer, dense_optimizer, dropout, hidden_forward
from sparsejax.padding import PAD_ID
from sparsejax.shard import Shard


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
    average: the moving average of ``(embed, hidden, out)`` that is evaluated and served
      (:class:`sparsejax.averaging.ParamAverage`), or None (``--average_steps=0``).
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
  average: Any = None


def init(rng: jax.Array, config: ModelConfig) -> SlideState:
  """A fresh network, optimizer states and the built candidate index.

  Args:
    rng: a PRNG key.
    config: the model.

  Returns:
    The initial :class:`SlideState`.
  """
  return init_from_params(rng, config, network.jitted_init_params(rng, config))


def init_index(rng: jax.Array, config: ModelConfig, out: SparseLayer,
               num_valid: int | jax.Array | None = None) -> Any:
  """The candidate index built over the initial output layer ``out`` (:func:`init_from_params`'s).

  A sharded run builds it by a program of its own before the rest of the state: in one program with the optimizer
  states, XLA held the build's temporaries beside them (7.5 GB and more per process at 2·10^6 rows per shard, d =
  128: 4 processes of a 10^9-parameter model were killed for memory on a 24 GB machine).
  """
  k_lsh, k_tables, _ = jax.random.split(jax.random.fold_in(rng, 1), 3)
  return _init_index(k_lsh, k_tables, config, out._replace(w=out.w.astype(config.optim.weight_dtype)), num_valid)


def init_from_params(rng: jax.Array, config: ModelConfig, params: NetworkParams,
                     num_valid: int | jax.Array | None = None, index_state: Any = None) -> SlideState:
  """The state around given parameters: optimizer states, the built candidate index.

  Args:
    rng: the key given to :func:`init_params`.
    config: the model.
    params: the parameters (``params.out`` may be one shard of the layer).
    num_valid: rows of ``params.out`` that are real (the rest padding).
    index_state: :func:`init_index`'s index of the same arguments, if built already (else built here).
  """
  _, _, k_state = jax.random.split(jax.random.fold_in(rng, 1), 3)
  sparse_opt = optim.row_sparse_adam(config.schedule(), **config.adam_args(),
                                     moment_dtype=jnp.dtype(config.optim.moment_dtype),
                                     second_moment=config.optim.second_moment)
  # The output layer's weights in their training dtype (the index is built from their float32 values).
  params = params._replace(out=params.out._replace(w=params.out.w.astype(config.optim.weight_dtype)))
  if index_state is None:
    index_state = init_index(rng, config, params.out, num_valid)
  return SlideState(
      step=jnp.zeros((), jnp.int32),
      rng=jax.random.key_data(k_state),
      embed=params.embed, hidden=params.hidden, out=params.out,
      embed_opt=sparse_opt.init(params.embed.w), out_w_opt=sparse_opt.init(params.out.w),
      out_b_opt=sparse_opt.init(params.out.b),
      dense_opt=dense_optimizer(config).init((params.embed.b, params.hidden)),
      index=index_state,
      average=averaging.init(params) if config.optim.average_steps else None)


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
                                         max_from_index=max_from_index, rows=(state.out.w, state.out.b))


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


class OutputUpdate(NamedTuple):
  """The output layer's part of a step (:func:`exact_output` or :func:`sampled_output`).

  Attributes:
    loss: ``[]`` the batch's loss (merged over the shards).
    out, out_w_opt, out_b_opt: the output layer and its Adam states after the step (as before where not applied).
    touched: ``[n]`` ids of the rows the step updated (-1: none), or None (every row: the exact step).
    from_index: ``[]`` mean active ids per sample that came from the index, summed over the shards.
    grads: ``(d_dense, d_embed)``, the gradients of the hidden layers and of the input layer's pre-activation.
    finite: ``[]`` bool, whether the step is applied (every shard decides the same).
  """
  loss: jax.Array
  out: SparseLayer
  out_w_opt: optim.RowSparseAdamState
  out_b_opt: optim.RowSparseAdamState
  touched: jax.Array | None
  from_index: jax.Array
  grads: tuple
  finite: jax.Array


def exact_output(state: SlideState, h: jax.Array, labels: jax.Array, local_labels: jax.Array, n_valid: jax.Array, *,
                 backward, inputs_finite, lr: jax.Array, config: ModelConfig, shard: Shard) -> OutputUpdate:
  """Every (real) row of the shard is active: dense matmuls, Adam on every row.

  Args:
    state: the step's state; h: ``[B, d]`` the last hidden layer's activations.
    labels: ``[B, M]`` the batch's labels in ``[0, N)``; local_labels: this shard's of them, as local ids (-1 else).
    n_valid: this shard's real rows.
    backward: ``dh -> (d_dense, d_embed)``, back-propagation through the hidden layers.
    inputs_finite: ``d_embed -> []`` bool, whether the input layer's row gradients stay finite.
    lr: the learning rate; config, shard: as :func:`train_step`'s.
  """
  B, rows = h.shape[0], state.out.w.shape[0]
  from_tables = jnp.zeros((B,), jnp.int32)
  with jax.named_scope("out_logits"):
    row_ids = jnp.arange(rows, dtype=jnp.int32)
    valid = row_ids < n_valid
    w = state.out.w.astype(jnp.float32)  # (bfloat16 weights: widened for the matmuls)
    logits = jnp.where(valid, h @ w.T + state.out.b, -jnp.inf)
    targets = all_rows_label_targets(local_labels, rows, num_distinct_labels(labels),
                                     per_label=config.per_label_targets)
  with jax.named_scope("softmax_reduce"):
    loss, g_out = sharded_softmax_cross_entropy(logits, targets, shard, per_label=config.per_label_targets)
  with jax.named_scope("dh_reduce"):  # the step's metric rides along in the same all-reduce
    # A shard whose row gradients could overflow poisons dh, so that every shard skips the step (no extra
    # collective).
    dh, tables_fraction = shard.psum_packed(g_out @ w + jnp.where(_sums_stay_finite(B, g_out, h), 0.0, jnp.nan),
                                            jnp.mean(from_tables.astype(jnp.float32)))
  d_dense, d_embed = backward(dh)
  finite = all_finite((loss, dh, d_dense, d_embed)) & inputs_finite(d_embed)
  with jax.named_scope("out_adam"):
    old_out = ((state.out.w, state.out.b), (state.out_w_opt, state.out_b_opt))
    new_out = optim.adam_all_rows(
        *old_out, (g_out.T @ h, jnp.sum(g_out, axis=0)), lr,
        jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step), 0xADA),
        **config.adam_args())
    (out_w, out_b), (out_w_opt, out_b_opt) = keep_if(finite, new_out, old_out)  # O(N d), as the step itself
  return OutputUpdate(loss, SparseLayer(out_w, out_b), out_w_opt, out_b_opt, None, tables_fraction,
                      (d_dense, d_embed), finite)


def sampled_output(state: SlideState, h: jax.Array, labels: jax.Array, local_labels: jax.Array, n_valid: jax.Array, *,
                   backward, inputs_finite, lr: jax.Array, config: ModelConfig, shard: Shard) -> OutputUpdate:
  """SLIDE's step: each sample's active rows from the index, their logits, and row-sparse Adam on them (arguments
  as :func:`exact_output`'s)."""
  with jax.named_scope("lsh_query"):
    seed = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    if shard.axis is not None:
      seed = jax.random.fold_in(seed, shard.index())
    active, from_tables = query_active(
        state, h, config=config, k=local_active_k(config, config.num_shards), num_rows=n_valid,
        labels=local_labels, seed=jax.random.bits(seed, (), jnp.uint32), max_from_index=config.max_from_index)
  with jax.named_scope("out_logits"):
    # The query put the labels first: O(B k), not the O(B k M) comparison of label_targets.
    targets = leading_label_targets(active, local_labels, num_distinct_labels(labels),
                                    per_label=config.per_label_targets)
    logits = jnp.where(active >= 0, ops.sparse_logits(h, state.out.w, state.out.b, active), -jnp.inf)
    if config.network.tail_correction:
      logits = logits + tail_log_weights(jnp.sum(targets > 0, axis=1) + from_tables, active.shape[1], n_valid)
  with jax.named_scope("softmax_reduce"):
    loss, g_out = sharded_softmax_cross_entropy(logits, targets, shard, per_label=config.per_label_targets)
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
        ops.RowSparseGrad(active, jnp.where(applied, g_out, 0.0), h), lr, combine=True, **config.adam_args())
    out_w_opt, out_b_opt = (new._replace(count=jnp.where(applied, new.count, old.count)) for new, old in (
        (out_w_opt, state.out_w_opt), (out_b_opt, state.out_b_opt)))
  with jax.named_scope("dh_reduce"):  # the step's metric rides along in the same all-reduce
    dh, tables_fraction = shard.psum_packed(dh, jnp.mean(from_tables.astype(jnp.float32)))
  d_dense, d_embed = backward(dh)
  # The rest of the step is decided with dh too. (A non-finite dh from finite rows, loss and h, which the
  # output layer's update could no longer wait for, would need rows near the float32 limit.)
  finite = applied & all_finite((dh, d_dense, d_embed)) & inputs_finite(d_embed)
  return OutputUpdate(loss, SparseLayer(out_w, out_b), out_w_opt, out_b_opt, touched, tables_fraction,
                      (d_dense, d_embed), finite)


def train_step(state: SlideState, batch: dict, *, config: ModelConfig,
               shard: Shard = Shard()) -> tuple[SlideState, dict]:
  """One SGD step on a batch. Jit with ``config`` static and the state donated.

  With ``shard.axis`` set this runs inside ``shard_map`` on one slice of the
  output layer (see :mod:`sparsejax.distributed.sharding`): the batch, the hidden
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

  def backward(dh):
    with jax.named_scope("hidden_bwd"):
      return hidden_vjp(dh)

  # A non-finite step is not applied (the loop stops or skips it: --on_nonfinite): the verdict comes from values
  # every shard agrees on (the loss and dh are psums, h is replicated), and a skipped step changes nothing but
  # the step counter.
  exact = uses_exact_path(config)
  output = (exact_output if exact else sampled_output)(
      state, h, labels, local_labels, n_valid, backward=backward, lr=lr, config=config, shard=shard,
      inputs_finite=lambda d_embed: _sums_stay_finite(fids.size, fvals, d_embed))
  finite, (d_dense, d_embed) = output.finite, output.grads

  with jax.named_scope("embed_adam"):
    embed_w, embed_opt, _ = optim.apply_row_sparse_adam(
        state.embed.w, state.embed_opt, ops.RowSparseGrad(jnp.where(finite, fids, PAD_ID), fvals, d_embed), lr,
        **config.adam_args())
    embed_opt = embed_opt._replace(count=jnp.where(finite, embed_opt.count, state.embed_opt.count))
  with jax.named_scope("dense_adam"):
    updates, dense_opt = dense_optimizer(config).update(d_dense, state.dense_opt, dense_params)
    embed_b, hidden = keep_if(finite, optax.apply_updates(dense_params, updates), dense_params)
    dense_opt = keep_if(finite, dense_opt, state.dense_opt)

  index_state = state.index
  if not exact:  # the exact step does not query the index
    with jax.named_scope("out_adam"):  # re-inserting updated rows is part of updating this shard's rows
      index_state = index.from_config(config).update(
          index_state, output.out.w, labels=jnp.where(finite, local_labels, PAD_ID), touched=output.touched,
          num_rows=rows)

  new_state = state._replace(
      step=state.step + 1, embed=SparseLayer(embed_w, embed_b), hidden=hidden, out=output.out,
      embed_opt=embed_opt, out_w_opt=output.out_w_opt, out_b_opt=output.out_b_opt, dense_opt=dense_opt,
      index=index_state)
  metrics = {"loss": output.loss, "learning_rate": lr, "finite": finite,
             "active_from_tables": output.from_index / config.num_shards}
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


def hidden(state: SlideState, feat_ids: jax.Array, feat_vals: jax.Array) -> jax.Array:
  """Last hidden layer activations ``[B, d]`` for a batch (any state with ``embed`` and ``hidden``)."""
  return hidden_forward(state.embed.w, (state.embed.b, state.hidden), feat_ids, feat_vals)


def num_params(state: SlideState) -> int:
  """Trainable parameters."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves((state.embed, state.hidden, state.out)))
