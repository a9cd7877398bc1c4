"""Dense full-softmax baseline of the same network (what a plain JAX user writes).

Same layers, initialization, targets, loss and optimizer as
:mod:`sparsejax.model`, but every step computes all N logits and AdamW
(:func:`sparsejax.network.dense_optimizer`) updates every parameter: the cost
sparsejax is measured against.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sparsejax import averaging, model, network
from sparsejax.loss import all_rows_label_targets, loss_denominator, softmax_cross_entropy
from sparsejax.model_config import ModelConfig


class DenseState(NamedTuple):
  """Parameters and optax state of the dense baseline (see :class:`model.SlideState`; ``average``: the same
  parameter averaging, so that the baseline is evaluated as the sparse model is)."""
  step: jax.Array
  rng: jax.Array
  embed: network.SparseLayer
  hidden: tuple
  out: network.SparseLayer
  opt: Any
  average: Any = None


def init(rng: jax.Array, config: ModelConfig) -> DenseState:
  """The same initial parameters as :func:`sparsejax.model.init` with the same key."""
  p = network.jitted_init_params(rng, config)  # one program, not ~20 compiled op by op
  # The sparse model's run key (model.init_from_params): the same dropout masks at the same step.
  rng_data = jax.random.key_data(jax.random.split(jax.random.fold_in(rng, 1), 3)[2])
  return DenseState(jnp.zeros((), jnp.int32), rng_data, p.embed, p.hidden, p.out,
                    network.dense_optimizer(config).init((p.embed, p.hidden, p.out)),
                    averaging.init(p) if config.optim.average_steps else None)


def full_logits(params, feat_ids, feat_vals, keep: jax.Array | None = None) -> jax.Array:
  """``[B, N]`` logits; ``keep``: the training step's hidden dropout factor (:func:`sparsejax.network.dropout`)."""
  embed, hidden, out = params
  h = network.hidden_forward(embed.w, (embed.b, hidden), feat_ids, feat_vals)
  if keep is not None:
    h = h * keep
  return h @ out.w.T + out.b


def _dropout(config: ModelConfig, state: DenseState, feat_ids: jax.Array, feat_vals: jax.Array,
             axis: str | None):
  """:func:`sparsejax.network.dropout` of this process's samples: with ``axis`` (data parallelism) its rows of the
  masks drawn for the whole batch, as one process drawing them would (and the sparse model does), not the first
  slice's masks again on every slice (each process drawing its own ``[B / P, ...]`` masks from the same key)."""
  if axis is None or (config.network.dropout == 0 and config.network.input_dropout == 0):
    return network.dropout(config, state.rng, state.step, feat_ids, feat_vals)
  rows, start = feat_ids.shape[0], jax.lax.axis_index(axis) * feat_ids.shape[0]
  whole = (jax.lax.axis_size(axis) * rows, feat_ids.shape[1])  # the masks depend on the shape, not the contents
  ids, vals, keep = network.dropout(
      config, state.rng, state.step,
      jax.lax.dynamic_update_slice(jnp.zeros(whole, feat_ids.dtype), feat_ids, (start, 0)),
      jax.lax.dynamic_update_slice(jnp.zeros(whole, feat_vals.dtype), feat_vals, (start, 0)))
  mine = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, start, rows)  # noqa: E731
  return mine(ids), mine(vals), mine(keep)


# The named scopes of :func:`train_step` and how their work per process scales with P processes:
# "batch" (proportional to this process's share of the batch) or "replicated" (the same on every process).
STEP_SCOPES = {"forward": "batch", "backward": "batch", "grad_reduce": "replicated", "adam": "replicated"}


def train_step(state: DenseState, batch: dict, *, config: ModelConfig,
               axis: str | None = None) -> tuple[DenseState, dict]:
  """One dense step: full softmax over all N outputs, Adam on every parameter.

  With ``axis`` set this is data-parallel (what Horovod does): it runs inside
  ``shard_map`` on this process's slice of the batch, and the gradients of
  all parameters are all-reduced (psum) every step, so every replica applies
  the same update.
  """
  labels = batch["labels"]
  psum = (lambda x: x) if axis is None else (lambda x: jax.lax.psum(x, axis))
  with jax.named_scope("forward"):
    # The sparse model's target, 1/|y| on each label (1 with --label_weights=per_label), built by a scatter: O(B·M),
    # not the O(B·N·M) comparison.
    targets = all_rows_label_targets(labels, config.num_labels, per_label=config.per_label_targets)
    num_labeled = psum(loss_denominator(targets, config.per_label_targets))

    # The sparse model's dropout, the same masks for the same (rng, step).
    feat_ids, feat_vals, keep = _dropout(config, state, batch["feat_ids"], batch["feat_vals"], axis)

    def loss_fn(params):  # this slice's share of the mean over all labeled samples
      logits = full_logits(params, feat_ids, feat_vals, keep)
      return softmax_cross_entropy(logits, targets, num_labeled)

    params = (state.embed, state.hidden, state.out)
    loss, loss_vjp = jax.vjp(loss_fn, params)
  with jax.named_scope("backward"):
    (grads,) = loss_vjp(jnp.ones_like(loss))
  with jax.named_scope("grad_reduce"):
    loss, grads = psum((loss, grads))
  with jax.named_scope("adam"):
    updates, opt = network.dense_optimizer(config).update(grads, state.opt, params)
    # A non-finite step is not applied (see model.train_step); loss and gradients are psums: every replica agrees.
    finite = model.all_finite((loss, grads))
    (embed, hidden, out), opt = model.keep_if(finite, (optax.apply_updates(params, updates), opt),
                                              (params, state.opt))
  lr = config.schedule()(state.step)
  return state._replace(step=state.step + 1, embed=embed, hidden=hidden, out=out, opt=opt), {
      "loss": loss, "learning_rate": lr, "finite": finite}
