"""Retrieval diagnostics: does the candidate index find the neurons that matter?

Pure functions of arrays, computed at the final evaluation (every one with ``--sampled_evaluations=all``). Per
query they say
how much of what the exact model ranks first the index returns:

* :func:`label_recall` - fraction of the true labels among the candidates
  (before any label forcing: the index is queried without labels).
* :func:`topk_recall` - fraction of the exact top-``t`` outputs among them.
* :func:`label_cosine` - cosine between ``h`` and its label rows (low cosine
  is where sign-random-projection hashing of raw inner products fails).
* :func:`candidate_mask` - which entries of an active set came from the index.
* the fill of the index itself is its own (:attr:`sparsejax.index.Index.fill`).

:func:`summarize` turns per-query sums into the scalars written to
``metrics.jsonl``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.shard import Shard

TOP = 10  # topk_recall@TOP: how many of the exact top outputs the evaluation looks for among the candidates


def candidate_mask(active: jax.Array, num_from_index: jax.Array) -> jax.Array:
  """``[B, k]`` bool: the first ``num_from_index[b]`` ids of row b (an active set queried without labels)."""
  return jnp.arange(active.shape[1])[None, :] < num_from_index[:, None]


def _found(ids: jax.Array, among: jax.Array, among_mask: jax.Array, shard: Shard = Shard()) -> jax.Array:
  """``[B, m]`` bool: whether ``ids[b, j] >= 0`` is one of the masked ``among[b, :]`` (sharded: of any shard's:
  each shard looks in its own and they add up what they found, ``O(B m)`` numbers, not the candidates
  all-gathered, ``O(B P k)``: a 4-process final evaluation at 4·10^5 labels took 3x as long)."""
  hit = (ids[:, :, None] == among[:, None, :]) & among_mask[:, None, :]
  found = jnp.any(hit, axis=2) & (ids >= 0)
  return found if shard.axis is None else shard.psum(found.astype(jnp.int32)) > 0


def _distinct(ids: jax.Array) -> jax.Array:
  """``[B, m]`` bool: non-padding entries that do not repeat an earlier entry of their row."""
  m = ids.shape[1]
  earlier = jnp.tril(jnp.ones((m, m), bool), k=-1)
  repeat = jnp.any((ids[:, :, None] == ids[:, None, :]) & earlier, axis=2)
  return (ids >= 0) & ~repeat


def label_recall(candidates: jax.Array, mask: jax.Array, labels: jax.Array,
                 shard: Shard = Shard()) -> tuple[jax.Array, jax.Array]:
  """Per query, the fraction of its distinct true labels among its candidates.

  Args:
    candidates: ``[B, k]`` int32 ids (sharded: this shard's, as global ids).
    mask: ``[B, k]`` bool, which ids are candidates (see :func:`candidate_mask`).
    labels: ``[B, M]`` int32 true labels, -1 padded.
    shard: the split of the output layer: a label counts as found among any shard's candidates.

  Returns:
    ``(recall [B] float32, has_labels [B] bool)``; recall is 0 where a query has no labels.
  """
  distinct = _distinct(labels)
  count = jnp.sum(distinct, axis=1)
  found = jnp.sum(_found(labels, candidates, mask, shard) & distinct, axis=1)
  return jnp.where(count > 0, found / jnp.maximum(count, 1), 0.0).astype(jnp.float32), count > 0


def topk_recall(candidates: jax.Array, mask: jax.Array, top_ids: jax.Array, shard: Shard = Shard()) -> jax.Array:
  """``[B]`` fraction of the exact top outputs ``top_ids [B, t]`` (distinct ids) among the candidates (sharded:
  any shard's, as :func:`label_recall`)."""
  valid = top_ids >= 0
  found = jnp.sum(_found(top_ids, candidates, mask, shard), axis=1)
  return (found / jnp.maximum(jnp.sum(valid, axis=1), 1)).astype(jnp.float32)


def label_cosine_sum(h: jax.Array, weight: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per query, the sum of the cosines between ``h [B, d]`` and the rows of its distinct labels ``>= 0``.

  Returns:
    ``(sum [B] float32, count [B] int32)``: the sum and how many labels it is over. A sharded run gives each
    shard its own labels (the others -1) and adds up the shards' sums.
  """
  distinct = _distinct(labels)
  rows = weight[jnp.maximum(labels, 0)]  # [B, M, d]
  dots = jnp.einsum("bd,bmd->bm", h, rows, precision="highest")
  norms = jnp.linalg.norm(h, axis=1)[:, None] * jnp.linalg.norm(rows, axis=2)
  cos = jnp.where(distinct & (norms > 0), dots / jnp.maximum(norms, 1e-30), 0.0)
  return jnp.sum(cos, axis=1).astype(jnp.float32), jnp.sum(distinct, axis=1).astype(jnp.int32)


def label_cosine(h: jax.Array, weight: jax.Array, labels: jax.Array,
                 shard: Shard = Shard()) -> tuple[jax.Array, jax.Array]:
  """Per query, the mean cosine between ``h [B, d]`` and the rows of its labels.

  Args:
    h: ``[B, d]`` queries.
    weight: ``[N, d]`` output rows (this shard's ``[R, d]``: global rows ``[p R, (p + 1) R)``).
    labels: ``[B, M]`` true labels (global ids in ``[0, N)``), -1 padded.
    shard: the split of the output layer: each shard sums the cosines of the labels it holds, and the sums
      are added up.

  Returns:
    ``(cosine [B] float32, has_labels [B] bool)``; 0 where a query has no labels.
  """
  rows = weight.shape[0]
  offset = shard.index() * rows
  mine = (labels >= offset) & (labels < offset + rows)
  total, count = shard.psum(label_cosine_sum(h, weight, jnp.where(mine, labels - offset, -1)))
  return (total / jnp.maximum(count, 1)).astype(jnp.float32), count > 0


def per_query(active: jax.Array, num_from_index: jax.Array, labels: jax.Array, top_ids: jax.Array, h: jax.Array,
              weight: jax.Array, shard: Shard = Shard()) -> dict[str, jax.Array]:
  """All per-query diagnostics of one batch, as ``[B]`` arrays (jittable).

  Sharded (inside ``shard_map``), of the union of the shards' candidates: ``label_recall`` and ``topk_recall``
  find ids among every shard's candidates (each shard looks in its own; what they found is added up, ``O(B M)``
  and ``O(B t)`` numbers), ``num_candidates``
  adds up the shards' counts and ``label_cosine`` averages over the labels' rows wherever they live
  (:func:`label_cosine`). One process: its own.

  Args:
    active: ``[B, k]`` active sets from the index queried without labels (this shard's row ids, -1 none).
    num_from_index: ``[B]`` how many of them came from the index.
    labels: ``[B, M]`` true labels (global ids in ``[0, N)``), -1 padded.
    top_ids: ``[B, t]`` exact top-t output ids (global).
    h: ``[B, d]`` queries.
    weight: ``[N, d]`` output rows (this shard's ``[R, d]``: global rows ``[p R, (p + 1) R)``).
    shard: the split of the output layer.

  Returns:
    ``label_recall``, ``topk_recall``, ``label_cosine``, ``num_candidates``
    (float32) and ``has_labels`` (bool), the same on every shard.
  """
  rows = weight.shape[0]
  offset = shard.index() * rows
  candidates = jnp.where(active >= 0, active + offset, -1)  # global ids
  mask = candidate_mask(active, num_from_index)
  recall, has_labels = label_recall(candidates, mask, labels, shard)
  return {"label_recall": recall, "topk_recall": topk_recall(candidates, mask, top_ids, shard),
          "label_cosine": label_cosine(h, weight, labels, shard)[0],
          "num_candidates": shard.psum(num_from_index).astype(jnp.float32), "has_labels": has_labels}


def summarize(batches: list[dict], top: int) -> dict[str, float]:
  """Dataset means of :func:`per_query` outputs (label metrics over labelled queries only).

  Args:
    batches: per-batch dicts of ``[b]`` arrays (already trimmed of padding rows).
    top: the ``t`` of ``topk_recall@t`` (names the key).
  """
  cat = {key: np.concatenate([np.asarray(b[key]) for b in batches]) for key in batches[0]}
  labelled = cat["has_labels"]
  denom = max(int(labelled.sum()), 1)
  return {"label_recall": float(cat["label_recall"][labelled].sum() / denom),
          f"topk_recall@{top}": float(cat["topk_recall"].mean()),
          "mean_candidates": float(cat["num_candidates"].mean()),
          "label_cosine": float(cat["label_cosine"][labelled].sum() / denom)}
