"""The training loss of a (possibly sharded) output layer: SLIDE's multi-label targets and the softmax
cross-entropy over the active outputs, merged across the shards of the layer (:class:`Shard`).

Used by the sparse step (:func:`sparsejax.model.train_step`) and the dense baseline (:mod:`sparsejax.dense`).
"""


import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.shard import Shard


def _label_weight(count: jax.Array, per_label: bool) -> jax.Array:
  """``[B, 1]`` each label's target: ``1/|y|`` (SLIDE's, per sample) or 1 (per label)."""
  return jnp.ones((count.shape[0], 1), jnp.float32) if per_label else 1.0 / jnp.maximum(count, 1)[:, None]


def label_targets(active: jax.Array, labels: jax.Array, num_labels: jax.Array | None = None, *,
                  per_label: bool = False) -> jax.Array:
  """SLIDE's multi-label target: ``1/|y|`` on each active id that is a label (1 with ``per_label``).

  Args:
    active: ``[B, k]`` int32 active ids.
    labels: ``[B, M]`` int32 labels, -1 padded.
    num_labels: ``[B]`` |y| per sample, when ``labels`` hold only some of them
      (a shard's); default: the labels found in ``active``.
    per_label: each label's target 1 (the sum of the labels' log-losses, ``--label_weights=per_label``).

  Returns:
    ``[B, k]`` float32 targets (a distribution per labeled row unless ``per_label``; unlabeled rows are 0).
  """
  is_label = jnp.any((active[:, :, None] == labels[:, None, :]) & (labels[:, None, :] >= 0), axis=-1)
  count = jnp.sum(is_label, axis=1) if num_labels is None else num_labels
  return jnp.where(is_label, _label_weight(count, per_label), 0.0).astype(jnp.float32)


def leading_label_targets(active: jax.Array, labels: jax.Array, num_labels: jax.Array | None = None, *,
                          per_label: bool = False) -> jax.Array:
  """:func:`label_targets` of an active set that holds each sample's distinct labels first, in O(B (k + M log M)).

  The index's queries put a sample's distinct labels in its first slots and never again
  (:attr:`sparsejax.index.Index.query`), so the labels among the active ids are the first ``min(|labels|, k)``:
  no ``[B, k, M]`` comparison, whose cost followed the batch's longest label row (310 labels: 38 ms of a 15 ms
  step at B 128, k 1,024). The same floats as :func:`label_targets` for such an active set.

  Args:
    active: ``[B, k]`` int32 active ids, each row starting with the distinct non-padding ids of its ``labels`` row.
    labels: ``[B, M]`` int32 the labels given to the query, -1 padded.
    num_labels: ``[B]`` |y| per sample, as in :func:`label_targets`; default: the labels found in ``active``.
    per_label: as in :func:`label_targets`.

  Returns:
    ``[B, k]`` float32 targets, as :func:`label_targets`'.
  """
  k = active.shape[1]
  leading = jnp.minimum(num_distinct_labels(labels), k)
  is_label = jnp.arange(k)[None, :] < leading[:, None]
  count = leading if num_labels is None else num_labels
  return jnp.where(is_label, _label_weight(count, per_label), 0.0).astype(jnp.float32)


def all_rows_label_targets(labels: jax.Array, num_rows: int, num_labels: jax.Array | None = None, *,
                           per_label: bool = False) -> jax.Array:
  """:func:`label_targets` where every row is active (``active = arange(num_rows)``), in O(B·M), not O(B·N·M).

  Args:
    labels: ``[B, M]`` int32 row ids, -1 (or any id outside ``[0, num_rows)``) padded.
    num_rows: N, the number of rows (all active).
    num_labels: ``[B]`` |y| per sample, as in :func:`label_targets`; default: the distinct ids in ``labels``.
    per_label: as in :func:`label_targets`.

  Returns:
    ``[B, N]`` float32: ``1/|y|`` (``per_label``: 1) on each label's row.
  """
  B = labels.shape[0]
  count = num_distinct_labels(jnp.where((labels >= 0) & (labels < num_rows), labels, -1)) \
      if num_labels is None else num_labels
  sample = jnp.broadcast_to(jnp.arange(B)[:, None], labels.shape)
  # Padding goes to row N, which mode="drop" drops (-1 would wrap to the last row); a repeated id is set once.
  rows = jnp.where((labels >= 0) & (labels < num_rows), labels, num_rows)
  return jnp.zeros((B, num_rows), jnp.float32).at[sample, rows].set(
      jnp.broadcast_to(_label_weight(count, per_label), labels.shape).astype(jnp.float32), mode="drop")


def softmax_cross_entropy(logits: jax.Array, targets: jax.Array, num_labeled: jax.Array | None = None) -> jax.Array:
  """Mean over labeled samples of ``-sum_j t_j log softmax(logits)_j``.

  Args:
    logits: ``[B, k]``.
    targets: ``[B, k]`` target distributions (all-zero rows: unlabeled samples).
    num_labeled: the mean's denominator when the batch is split over
      processes (data parallelism): the labeled samples of the whole batch
      (per-label targets: the sum of the batch's targets, :func:`loss_denominator`).
      Default: those of this one.
  """
  per_sample = -jnp.sum(targets * jax.nn.log_softmax(logits, axis=-1), axis=-1)
  labeled = jnp.sum(targets, axis=-1) > 0
  count = jnp.sum(labeled) if num_labeled is None else num_labeled
  return jnp.sum(jnp.where(labeled, per_sample, 0.0)) / jnp.maximum(count, 1)


def label_ids_in_layer(labels, num_labels: int) -> jax.Array:
  """``labels`` with every id outside ``[0, num_labels)`` as padding (-1), so that the loss's targets and its count
  of labels agree; concrete ids outside ``[-1, num_labels)`` are refused (1-based ids, or another N)."""
  if not isinstance(labels, jax.core.Tracer):
    ids = np.asarray(labels)
    wrong = (ids < -1) | (ids >= num_labels)
    if wrong.any():
      at = tuple(int(i) for i in np.argwhere(wrong)[0])
      raise ValueError(f"train_step: argument 'labels' must hold ids in [0, {num_labels}) or -1 (padding); got "
                       f"{int(ids[at])} at {at}")
  return jnp.where((labels >= 0) & (labels < num_labels), labels, -1)


def num_distinct_labels(labels: jax.Array) -> jax.Array:
  """``[B]`` number of distinct non-padding ids per row of ``labels [B, M]``."""
  s = jnp.sort(labels, axis=1)
  new = jnp.concatenate([jnp.ones_like(s[:, :1], bool), s[:, 1:] != s[:, :-1]], axis=1)
  return jnp.sum(new & (s >= 0), axis=1)


def tail_log_weights(num_before: jax.Array, k: int, num_rows: jax.Array | int) -> jax.Array:
  """``[B, k]`` log importance weights of an active set whose last entries are a uniform sample of the rest.

  Row b holds ``num_before[b]`` chosen ids (labels, index candidates) and
  then ``k - num_before[b]`` ids drawn uniformly from the other
  ``num_rows - num_before[b]`` rows. Each drawn id stands for
  ``(num_rows - num_before) / (k - num_before)`` rows: adding the log of that
  to its logit makes the active set's softmax normalizer an unbiased
  estimate of the full one (sampled softmax with a uniform proposal).
  """
  drawn = k - num_before
  weight = jnp.log(jnp.maximum(num_rows - num_before, 1) / jnp.maximum(drawn, 1))
  return jnp.where(jnp.arange(k)[None, :] >= num_before[:, None], weight[:, None], 0.0).astype(jnp.float32)


def loss_denominator(targets: jax.Array, per_label: bool) -> jax.Array:
  """The loss's mean is over this many (``[]``): the labeled rows of ``targets [B, k]``, or with per-label targets
  the (sample, label) pairs, the sum of the targets (the same on single-label data)."""
  return jnp.sum(targets) if per_label else jnp.sum(jnp.sum(targets, axis=1) > 0)


def sharded_softmax_cross_entropy(logits: jax.Array, targets: jax.Array, shard: Shard = Shard(), *,
                                  per_label: bool = False):
  """Softmax cross-entropy over the union of the shards' active sets, and its gradient.

  Each shard holds some columns of every sample's logits. The shards
  exchange their partial softmax normalizers in one all-gather of ``[4, B]``
  numbers per shard (local max, sum of exponentials relative to it, target
  logit, target mass) and each combines them in shard order, so every
  replica gets bit-identical results. One small collective rather than a
  pmax followed by a psum: at these sizes a collective costs its latency,
  not its bytes (``benchmarks/RESULTS.md``, "Two collectives per sparse
  step instead of six gloo calls").

  Args:
    logits: ``[B, k]`` this shard's logits (``-inf`` at padding).
    targets: ``[B, k]`` this shard's part of each sample's target
      distribution (rows of unlabeled samples are 0 on every shard).
    shard: the split of the output layer.
    per_label: the targets are 1 per label (:func:`label_targets`): a sample's
      loss is the sum of its labels' log-losses, ``|y| lse - sum_y logit``,
      and the mean is over (sample, label) pairs.

  Returns:
    ``(loss, g)``: the mean loss over labeled samples (same on all shards) and
    ``g = dloss/dlogits`` ``[B, k]``.
  """
  local_max = jnp.max(logits, axis=1)  # -inf where this shard has no active id for the sample
  shift = jnp.where(jnp.isfinite(local_max), local_max, 0.0)
  parts = shard.all_gather(jnp.stack([
      local_max,
      jnp.sum(jnp.exp(logits - shift[:, None]), axis=1),
      jnp.sum(jnp.where(targets > 0, targets * logits, 0.0), axis=1),
      jnp.sum(targets, axis=1)]))  # [P, 4, B]
  maxes, sums = parts[:, 0], parts[:, 1]
  m = jnp.max(maxes, axis=0)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  # Only shards without any active id (max -inf, sum 0) drop out: an overflowed (+inf) or NaN logit still makes
  # the loss non-finite, so that the step is skipped.
  sum_exp = jnp.sum(jnp.where(maxes == -jnp.inf, 0.0, sums * jnp.exp(maxes - m)), axis=0)
  target_logit, mass = jnp.sum(parts[:, 2], axis=0), jnp.sum(parts[:, 3], axis=0)
  lse = m + jnp.log(sum_exp)
  labeled = mass > 0
  if per_label:  # each label's -log p: |y| lse - sum_y logit, its gradient |y| p - t; the mean over the pairs
    count = jnp.maximum(jnp.sum(mass), 1)
    loss = jnp.sum(jnp.where(labeled, mass * lse - target_logit, 0.0)) / count
    g = (mass[:, None] * jnp.exp(logits - lse[:, None]) - targets) * (labeled / count)[:, None]
    return loss, g
  count = jnp.maximum(jnp.sum(labeled), 1)
  loss = jnp.sum(jnp.where(labeled, lse - target_logit, 0.0)) / count
  g = (jnp.exp(logits - lse[:, None]) - targets) * (labeled / count)[:, None]
  return loss, g
