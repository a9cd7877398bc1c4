"""Evaluation metrics for extreme multi-label classification (XMC).

This module provides:

* :func:`propensity_scores` / :func:`inverse_propensity` -- the label
 propensity model of Jain et al. (2016), as used by the Extreme
 Classification Repository.
* :func:`ranking_metrics` -- per-sample P@k, nDCG@k and propensity-scored
 precision from top-k predictions (vectorised NumPy).
* :func:`evaluate_topk` -- dataset-level means as a flat ``dict`` of floats.
* :func:`pad_ranking` -- a ranking shorter than the largest cut-off widened
 with "no prediction", so that P@k still divides by ``k``.
* :func:`ranking_metrics_jax` -- a jittable variant for on-device evaluation.

The predictions they score come from :mod:`sparsejax.inference` (exact
chunked top-k over all ``N`` outputs, or LSH-sampled).

Conventions (shared by every function here):

* Label sets are padded ``int`` arrays ``labels [n, max_labels]`` where ``-1``
 (any negative value) is padding. Duplicate ids within a row are counted
 once, i.e. a row is treated as a *set* of labels.
* ``topk_ids [n, k]`` holds predictions sorted by descending score; negative
 ids are "no prediction" and are never relevant. Ids within a row are
 assumed to be distinct (as produced by any top-k routine).
* Samples with no labels score 0 on every metric and still count in the
 denominator of every mean (the convention of the XC repository tools,
 e.g. ``pyxclib.evaluation.xc_metrics``).
* ``P@k = (1/k) * sum_{i<=k} rel_i`` (always divided by ``k``, not by
 ``min(k, |y|)``).
* ``nDCG@k = DCG@k / IDCG@k`` with ``DCG@k = sum_{i<=k} rel_i / log2(i + 1)``
 and ``IDCG@k = sum_{i<=min(k, |y|)} 1 / log2(i + 1)``.
* ``PSP@k``: with inverse propensities ``w_l = 1 / p_l``, the raw score of a
 sample is ``(1/k) * sum_{i<=k} rel_i * w_{id_i}`` and its ideal score is
 ``(1/k) * sum`` of its ``min(k, |y|)`` largest ``w_l`` over its true labels.
 The reported ``psp@k`` is normalised; see :func:`evaluate_topk` for the
 ``"dataset"`` (XC repository default) and ``"sample"`` normalisations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax._checks import check_int

__all__ = [
    "propensity_scores",
    "inverse_propensity",
    "label_frequencies",
    "ranking_metrics",
    "evaluate_topk",
    "pad_ranking",
    "ranking_metrics_jax",
]

DEFAULT_KS: tuple[int, ...] = (1, 3, 5)


# ---------------------------------------------------------------------------
# Propensity model (Jain, Prabhu & Varma, KDD 2016)
# ---------------------------------------------------------------------------


def propensity_scores(label_frequencies: np.ndarray | Sequence[float], num_samples: int, A: float = 0.55,
                      B: float = 1.5) -> np.ndarray:
  """Label propensities ``p_l`` of Jain et al. (2016).

  ``p_l = 1 / (1 + C * exp(-A * log(N_l + B)))`` with
  ``C = (log N - 1) * (B + 1) ** A``, where ``N`` is the number of training
  samples and ``N_l`` the number of training samples tagged with label
  ``l``. The XC repository uses ``A=0.55, B=1.5`` for most data sets
  (``A=0.6, B=2.6`` for Amazon-* and ``A=0.5, B=0.4`` for Wikipedia-*).

  Takes the arguments of :func:`inverse_propensity`.

  Returns:
    ``[L]`` float64 propensities in ``(0, 1]``; the inverse propensity
    (the PSP weight) is ``1 / p_l``, see :func:`inverse_propensity`.
  """
  return 1.0 / inverse_propensity(label_frequencies, num_samples, A, B)


def inverse_propensity(label_frequencies: np.ndarray | Sequence[float], num_samples: int, A: float = 0.55,
                       B: float = 1.5) -> np.ndarray:
  """Inverse propensities ``1 / p_l = 1 + C * (N_l + B) ** -A`` (``C`` as in :func:`propensity_scores`, 0 for
  ``N < e``).

  Args:
    label_frequencies: ``[L]`` training frequency ``N_l`` of every label.
    num_samples: ``N``, the number of training samples.
    A: Propensity model parameter.
    B: Propensity model parameter.

  Returns:
    ``[L]`` float64 inverse propensities (PSP weights).
  """
  freqs = np.asarray(label_frequencies, dtype=np.float64)
  if freqs.ndim != 1:
    raise ValueError(f"label_frequencies must be 1-D, got shape {freqs.shape}")
  if num_samples <= 0:
    raise ValueError(f"num_samples must be positive, got {num_samples}")
  if A <= 0 or B <= 0:
    raise ValueError(f"the propensity model needs A > 0 and B > 0, got A = {A}, B = {B}")
  # log N - 1 < 0 below N = e (1 or 2 samples): no correction there, not propensities outside (0, 1].
  c = max(math.log(num_samples) - 1.0, 0.0) * (B + 1.0) ** A
  return 1.0 + c * np.exp(-A * np.log(freqs + B))


def label_frequencies(labels: np.ndarray, num_labels: int) -> np.ndarray:
  """Per-label sample counts ``N_l`` from padded training labels.

  Args:
    labels: ``[n, max_labels]`` int label ids, ``-1`` padded. Duplicate
      ids within a row count once.
    num_labels: ``L``, the size of the label space.

  Returns:
    ``[L]`` int64 counts.
  """
  labels = np.asarray(labels)
  if labels.ndim != 2:
    raise ValueError(f"labels must be 2-D, got shape {labels.shape}")
  srt, unique = _row_unique(labels, num_labels)
  return np.bincount(srt[unique], minlength=num_labels).astype(np.int64)


# ---------------------------------------------------------------------------
# NumPy ranking metrics
# ---------------------------------------------------------------------------


def _row_unique(labels: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
  """Row-sorted labels and a mask of their first occurrences (padding excluded).

  Returns ``(sorted_labels [n, m], unique [n, m] bool)``; raises if any label
  id is ``>= stride``.
  """
  srt = np.sort(labels, axis=1)
  if srt.size and srt[:, -1].max() >= stride:
    raise ValueError(f"label id {srt[:, -1].max()} out of range (< {stride} required)")
  unique = srt >= 0
  unique[:, 1:] &= srt[:, 1:] != srt[:, :-1]
  return srt, unique


def _check_inputs(topk_ids, labels, ks):
  topk_ids = np.asarray(topk_ids)
  labels = np.asarray(labels)
  if topk_ids.ndim != 2 or labels.ndim != 2:
    raise ValueError(f"topk_ids and labels must be 2-D, got {topk_ids.shape} and {labels.shape}")
  if topk_ids.shape[0] != labels.shape[0]:
    raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows but labels has {labels.shape[0]}")
  if not np.issubdtype(topk_ids.dtype, np.integer) or not np.issubdtype(labels.dtype, np.integer):
    raise TypeError("topk_ids and labels must be integer arrays")
  ks = tuple(int(k) for k in ks)
  if not ks or min(ks) < 1 or max(ks) > topk_ids.shape[1]:
    raise ValueError(f"ks={ks} must lie in [1, {topk_ids.shape[1]}] (topk_ids width)")
  return topk_ids, labels, ks


def ranking_metrics(
    topk_ids: np.ndarray,
    labels: np.ndarray,
    inv_propensity: np.ndarray | None = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, np.ndarray]:
  """Per-sample ranking metrics from top-k predictions (vectorised NumPy).

  Args:
    topk_ids: ``[n, k]`` int predicted label ids sorted by descending
      score (``k >= max(ks)``); negative ids are never relevant.
    labels: ``[n, max_labels]`` int true label ids, ``-1`` padded.
    inv_propensity: optional ``[L]`` inverse propensities ``1 / p_l``
      (:func:`inverse_propensity`); every label id must be ``< L``.
    ks: cut-offs to evaluate.

  Returns:
    Dict of ``[n]`` float64 arrays with keys ``"p@k"`` and ``"ndcg@k"``
    for every ``k`` in ``ks``, plus, when ``inv_propensity`` is given,
    ``"psp_raw@k"`` (un-normalised propensity-scored precision) and
    ``"psp_ideal@k"`` (its best achievable value for that sample's label
    set). Samples without labels get 0 everywhere.
  """
  topk_ids, labels, ks = _check_inputs(topk_ids, labels, ks)
  n = topk_ids.shape[0]
  kmax = max(ks)
  preds = topk_ids[:, :kmax].astype(np.int64)

  if inv_propensity is not None:
    weights = np.asarray(inv_propensity, dtype=np.float64)
    if weights.ndim != 1:
      raise ValueError("inv_propensity must be 1-D")
    stride = weights.shape[0]
  else:
    weights = None
    stride = int(max(labels.max(initial=-1), preds.max(initial=-1))) + 1
  stride = max(stride, 1)

  # Relevance via one globally sorted key array, key = row * stride + label:
  # rows ascend and labels ascend within a row, so no global sort is needed.
  srt, unique = _row_unique(labels, stride)
  num_true = unique.sum(axis=1)
  keys = (np.arange(n, dtype=np.int64)[:, None] * stride + srt)[unique]
  pred_ok = (preds >= 0) & (preds < stride)
  pred_keys = np.arange(n, dtype=np.int64)[:, None] * stride + np.where(pred_ok, preds, 0)
  if keys.size:
    pos = np.minimum(np.searchsorted(keys, pred_keys), keys.size - 1)
    rel = pred_ok & (keys[pos] == pred_keys)
  else:
    rel = np.zeros_like(pred_ok)
  rel_f = rel.astype(np.float64)

  ranks = np.arange(1, kmax + 1, dtype=np.float64)
  discount = 1.0 / np.log2(ranks + 1.0)
  hits = np.cumsum(rel_f, axis=1)
  dcg = np.cumsum(rel_f * discount, axis=1)
  idcg_table = np.concatenate([[0.0], np.cumsum(discount)])  # idcg_table[j] for j relevant

  out: dict[str, np.ndarray] = {}
  for k in ks:
    out[f"p@{k}"] = hits[:, k - 1] / k
  for k in ks:
    idcg = idcg_table[np.minimum(num_true, k)]
    out[f"ndcg@{k}"] = np.divide(dcg[:, k - 1], idcg, out=np.zeros(n), where=idcg > 0)

  if weights is not None:
    gained = np.cumsum(rel_f * weights[np.where(pred_ok, preds, 0)], axis=1)
    # Best achievable: each sample's kmax largest weights among its labels.
    label_w = np.where(unique, weights[np.maximum(srt, 0)], 0.0)
    if label_w.shape[1] > kmax:
      label_w = -np.partition(-label_w, kmax - 1, axis=1)[:, :kmax]
    elif label_w.shape[1] < kmax:
      label_w = np.pad(label_w, ((0, 0), (0, kmax - label_w.shape[1])))
    ideal = np.cumsum(-np.sort(-label_w, axis=1), axis=1)
    for k in ks:
      out[f"psp_raw@{k}"] = gained[:, k - 1] / k
    for k in ks:
      out[f"psp_ideal@{k}"] = ideal[:, k - 1] / k
  return out


def evaluate_topk(
    topk_ids: np.ndarray,
    labels: np.ndarray,
    propensity: np.ndarray | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    psp_normalization: str = "dataset",
) -> dict[str, float]:
  """Dataset-level P@k, nDCG@k and (optionally) PSP@k.

  ``p@k`` and ``ndcg@k`` are means over all ``n`` samples (samples without
  labels count as 0).

  ``psp@k`` normalisation (``psp_normalization``):

  * ``"dataset"`` (default, the XC repository tools / ``pyxclib``
   convention): ``mean_i(psp_raw_i) / mean_i(psp_ideal_i)``, i.e. the
   propensity-scored precision divided by that of a perfect predictor.
  * ``"sample"``: ``mean_i(psp_raw_i / psp_ideal_i)``, each sample
   normalised by its own best achievable score (0 for samples without
   labels, which still count in the mean).
  * ``"none"``: ``mean_i(psp_raw_i)``, the un-normalised Jain et al. PSP.

  A perfect predictor scores 1.0 under ``"dataset"`` and ``"sample"``. The
  two differ when per-sample ideal scores vary: ``"dataset"`` weights each
  sample by its ideal score, ``"sample"`` weights samples equally.

  Args:
    topk_ids: ``[n, k]`` int predictions sorted by descending score.
    labels: ``[n, max_labels]`` int true labels, ``-1`` padded.
    propensity: optional ``[L]`` propensities ``p_l`` as returned by
      :func:`propensity_scores` (the weights used are ``1 / p_l``).
    ks: cut-offs to evaluate (each ``<= k``).
    psp_normalization: ``"dataset"``, ``"sample"`` or ``"none"``.

  Returns:
    ``{"p@1": ..., "p@3": ..., "p@5": ..., "ndcg@1": ..., ...}`` and, when
    ``propensity`` is given, ``"psp@1"``, ``"psp@3"``, ``"psp@5"``; values
    are Python floats.
  """
  if psp_normalization not in ("dataset", "sample", "none"):
    raise ValueError(f"unknown psp_normalization {psp_normalization!r}")
  inv = None
  if propensity is not None:
    p = np.asarray(propensity, dtype=np.float64)
    wrong = ~(np.isfinite(p) & (p > 0))  # NaN compares false: it reported PSP 0 silently
    if wrong.any():
      bad = int(np.flatnonzero(wrong)[0])
      raise ValueError(f"propensities must be positive and finite; label {bad} has {p[bad]}")
    inv = 1.0 / p
  per_sample = ranking_metrics(topk_ids, labels, inv, ks)
  if np.asarray(topk_ids).shape[0] == 0:
    raise ValueError("cannot evaluate an empty set of samples")
  ks = tuple(int(k) for k in ks)
  out = {f"p@{k}": float(per_sample[f"p@{k}"].mean()) for k in ks}
  out.update({f"ndcg@{k}": float(per_sample[f"ndcg@{k}"].mean()) for k in ks})
  if inv is not None:
    for k in ks:
      raw, ideal = per_sample[f"psp_raw@{k}"], per_sample[f"psp_ideal@{k}"]
      if psp_normalization == "dataset":
        denom = ideal.mean()
        value = raw.mean() / denom if denom > 0 else 0.0
      elif psp_normalization == "sample":
        value = np.divide(raw, ideal, out=np.zeros_like(raw), where=ideal > 0).mean()
      else:
        value = raw.mean()
      out[f"psp@{k}"] = float(value)
  return out


def pad_ranking(topk_ids: np.ndarray, k: int = max(DEFAULT_KS)) -> np.ndarray:
  """``topk_ids`` with at least ``k`` columns: a ranking of fewer labels (a model of fewer than ``k`` outputs, a
  prediction of fewer candidates) gets its last places empty (``-1``, never relevant), so that P@k is hits / k as
  everywhere else rather than a cut-off the ranking cannot reach.

  Args:
    topk_ids: ``[n, r]`` int predictions sorted by descending score.
    k: the width to reach.

  Returns:
    ``[n, max(r, k)]``, ``topk_ids`` itself where it is wide enough.
  """
  topk_ids = np.asarray(topk_ids)
  return np.pad(topk_ids, ((0, 0), (0, max(0, k - topk_ids.shape[1]))), constant_values=-1)


# ---------------------------------------------------------------------------
# JAX ranking metrics (jittable)
# ---------------------------------------------------------------------------


def ranking_metrics_jax(
    topk_ids: jax.Array,
    labels: jax.Array,
    inv_propensity: jax.Array | None = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, jax.Array]:
  """Jittable per-sample metrics; same definitions as :func:`ranking_metrics`.

  Uses an ``[n, k, max_labels]`` comparison, so it is meant for batches
  (e.g. inside an evaluation step), not for millions of rows at once.

  Args:
    topk_ids: ``[n, k]`` int predicted ids sorted by descending score.
    labels: ``[n, max_labels]`` int true labels, ``-1`` padded.
    inv_propensity: optional ``[L]`` inverse propensities. Out-of-range
      ids are clamped (JAX semantics), so ensure ids are ``< L``.
    ks: cut-offs (a list or tuple of ints, static), each in ``[1, k]``.

  Returns:
    Dict of ``[n]`` float32 arrays: ``"p@k"``, ``"ndcg@k"`` and, with
    ``inv_propensity``, ``"psp_raw@k"`` and ``"psp_ideal@k"``.
  """
  if not isinstance(ks, Sequence) or not ks:
    raise TypeError(f"ranking_metrics_jax: argument 'ks' must be a non-empty list or tuple of ints, got {ks!r}")
  ks = tuple(check_int("ranking_metrics_jax", "ks", k, 1) for k in ks)  # hashable: jit's static argument
  return _ranking_metrics_jax(topk_ids, labels, inv_propensity, ks)


@partial(jax.jit, static_argnames=("ks",))
def _ranking_metrics_jax(topk_ids, labels, inv_propensity, ks):
  """:func:`ranking_metrics_jax` with ``ks`` a tuple of positive ints."""
  kmax = max(ks)
  if kmax > topk_ids.shape[1]:
    raise ValueError(f"ranking_metrics_jax: max(ks) = {kmax} exceeds the width of 'topk_ids' {topk_ids.shape[1]}")
  preds = topk_ids[:, :kmax]
  m = labels.shape[1]
  valid = labels >= 0
  # A label is counted once: drop entries equal to an earlier entry in the row.
  earlier = jnp.tril(jnp.ones((m, m), dtype=bool), k=-1)  # [i, j]: j < i
  dup = jnp.any((labels[:, :, None] == labels[:, None, :]) & earlier & valid[:, None, :], axis=2)
  uniq = valid & ~dup
  num_true = uniq.sum(axis=1)
  rel = jnp.any((preds[:, :, None] == labels[:, None, :]) & uniq[:, None, :], axis=2)
  rel = (rel & (preds >= 0)).astype(jnp.float32)

  ranks = jnp.arange(1, kmax + 1, dtype=jnp.float32)
  discount = 1.0 / jnp.log2(ranks + 1.0)
  hits = jnp.cumsum(rel, axis=1)
  dcg = jnp.cumsum(rel * discount, axis=1)
  idcg_table = jnp.concatenate([jnp.zeros(1), jnp.cumsum(discount)])
  out = {}
  for k in ks:
    out[f"p@{k}"] = hits[:, k - 1] / k
  for k in ks:
    idcg = idcg_table[jnp.minimum(num_true, k)]
    out[f"ndcg@{k}"] = jnp.where(idcg > 0, dcg[:, k - 1] / jnp.where(idcg > 0, idcg, 1.0), 0.0)
  if inv_propensity is not None:
    w = inv_propensity.astype(jnp.float32)
    gained = jnp.cumsum(rel * w[jnp.maximum(preds, 0)], axis=1)
    label_w = jnp.where(uniq, w[jnp.maximum(labels, 0)], 0.0)
    if m < kmax:
      label_w = jnp.pad(label_w, ((0, 0), (0, kmax - m)))
    ideal = jnp.cumsum(jax.lax.top_k(label_w, kmax)[0], axis=1)
    for k in ks:
      out[f"psp_raw@{k}"] = gained[:, k - 1] / k
    for k in ks:
      out[f"psp_ideal@{k}"] = ideal[:, k - 1] / k
  return out
