"""Synthetic extreme-classification data with planted, learnable structure.

Generative model (all vectorised, no per-sample Python loop):

* Label popularity is Zipf: ``P(label = r) ∝ (r + 1) ** -power_law_exponent``;
 label id ``r`` is its popularity rank (label 0 is the most frequent).
* Each label owns a sparse *prototype*: ``prototype_size`` feature ids drawn
 uniformly from ``[0, F)`` with positive log-normal weights.
* Features themselves have a Zipf popularity (over a random permutation of
 ids) that drives the *noise* features, and an IDF-like weight
 ``1 + log(1 + popularity_rank)`` (common features weigh less).
* A sample draws its labels, keeps each prototype feature of each label with
 probability ``1 - dropout``, adds ``~Poisson(noise * features_per_sample)``
 popularity-distributed noise features, gives every feature a TF-IDF-like
 value ``tf * idf * weight`` (``tf = 1 + Poisson(0.5)``), merges duplicate
 ids by summing and L2-normalises the row.

So a label's prototype is recoverable from its samples (e.g. the class
centroid), and a nearest-centroid classifier beats chance (~1/L) by far.
"""

from __future__ import annotations

import numpy as np

from .dataset import XCDataset

_BLOCK = 1 << 16  # samples generated per vectorised step


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
  """``[n]`` float64 cumulative distribution of Zipf ranks ``0..n-1``."""
  cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -float(exponent))
  cdf /= cdf[-1]
  return cdf


def _draw(rng: np.random.Generator, cdf: np.ndarray, size: int) -> np.ndarray:
  """``[size]`` int64 draws from the distribution with CDF ``cdf``."""
  idx = np.searchsorted(cdf, rng.random(size), side="right")
  return np.minimum(idx, len(cdf) - 1)


def _draw_label_sets(
    rng: np.random.Generator, cdf: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """``(rows, labels)``: ``counts[i]`` distinct labels per sample, sorted.

  Duplicates inside a sample are redrawn (a few vectorised rounds; what
  is left after that is dropped, which only happens when a sample asks for
  almost all labels).
  """
  n = len(counts)
  rows = np.repeat(np.arange(n, dtype=np.int64), counts)
  labels = _draw(rng, cdf, len(rows))
  num_labels = len(cdf)
  for _ in range(64):
    key = rows * num_labels + labels
    order = np.argsort(key, kind="stable")
    dup = np.zeros(len(key), dtype=bool)
    dup[order[1:]] = key[order[1:]] == key[order[:-1]]
    if not dup.any():
      break
    labels[dup] = _draw(rng, cdf, int(dup.sum()))
  rows, labels = rows[~dup], labels[~dup]
  order = np.lexsort((labels, rows))
  return rows[order], labels[order]


def make_synthetic(
    num_samples: int,
    num_features: int,
    num_labels: int,
    *,
    labels_per_sample: float = 1,
    features_per_sample: float = 30,
    power_law_exponent: float = 1.0,
    noise: float = 0.2,
    dropout: float = 0.3,
    prototype_size: int | None = None,
    seed: int = 0,
) -> XCDataset:
  """Generate a synthetic multi-label dataset (see module docstring).

  Args:
    num_samples: ``n``.
    num_features: ``F``.
    num_labels: ``L``.
    labels_per_sample: an ``int`` gives exactly that many distinct labels
      per sample; a non-integral ``float`` ``m >= 1`` gives
      ``1 + Poisson(m - 1)`` labels (mean ``m``).
    features_per_sample: target mean number of non-zeros per row (before
      merging duplicate ids, so the realised mean is slightly lower).
    power_law_exponent: Zipf exponent of label (and feature) popularity.
    noise: fraction of a row's features that are label-independent noise.
    dropout: probability of dropping each prototype feature from a sample.
    prototype_size: features per label prototype; default chosen so the
      mean row size matches ``features_per_sample``.
    seed: RNG seed; output is a deterministic function of all arguments.

  Returns:
    XCDataset with ``n`` samples, L2-normalised float32 rows, sorted
    feature ids and sorted label ids within each sample.
  """
  if num_samples < 0 or num_features <= 0 or num_labels <= 0:
    raise ValueError("need num_samples >= 0 and num_features, num_labels > 0")
  if not (0 <= noise < 1 and 0 <= dropout < 1):
    raise ValueError("noise and dropout must be in [0, 1)")
  if labels_per_sample < 1 or labels_per_sample > num_labels:
    raise ValueError(f"labels_per_sample must be in [1, num_labels], got {labels_per_sample}")
  # One stream for the global structure, one per block of samples, so memory
  # stays bounded and the output does not depend on anything but the args.
  num_blocks = -(-num_samples // _BLOCK)
  seeds = np.random.SeedSequence(seed).spawn(1 + num_blocks)
  rng = np.random.default_rng(seeds[0])

  # Label prototypes: [L, P] feature ids and positive weights.
  if prototype_size is None:
    signal = features_per_sample * (1 - noise)
    prototype_size = max(1, round(signal / ((1 - dropout) * float(labels_per_sample))))
  proto_ids = rng.integers(0, num_features, (num_labels, prototype_size), dtype=np.int32)
  proto_w = rng.lognormal(0.0, 0.5, (num_labels, prototype_size)).astype(np.float32)
  # Feature popularity (drives noise) and IDF-like weights.
  feature_rank = rng.permutation(num_features)  # feature id -> popularity rank
  idf = (1.0 + np.log1p(feature_rank)).astype(np.float32)
  by_rank = np.argsort(feature_rank).astype(np.int32)  # popularity rank -> feature id
  label_cdf = _zipf_cdf(num_labels, power_law_exponent)
  feature_cdf = _zipf_cdf(num_features, power_law_exponent)

  feat_counts, feat_ids, feat_vals, label_counts, label_ids = [], [], [], [], []
  for block in range(num_blocks):
    n = min(_BLOCK, num_samples - block * _BLOCK)
    brng = np.random.default_rng(seeds[1 + block])
    if float(labels_per_sample).is_integer():
      counts = np.full(n, int(labels_per_sample), dtype=np.int64)
    else:
      counts = np.minimum(1 + brng.poisson(labels_per_sample - 1, n), num_labels)
    label_rows, labels = _draw_label_sets(brng, label_cdf, counts)

    # Signal: every (sample, label, prototype slot) kept w.p. 1 - dropout.
    slot = labels.repeat(prototype_size) * prototype_size + np.tile(np.arange(prototype_size), len(labels))
    keep = brng.random(len(slot)) >= dropout
    sig_rows = label_rows.repeat(prototype_size)[keep]
    slot = slot[keep]
    # Noise: popularity-distributed features with unit weight.
    noise_counts = brng.poisson(noise * features_per_sample, n)
    noise_rows = np.repeat(np.arange(n, dtype=np.int64), noise_counts)
    noise_ids = by_rank[_draw(brng, feature_cdf, len(noise_rows))]

    rows = np.concatenate([sig_rows, noise_rows])
    ids = np.concatenate([proto_ids.reshape(-1)[slot], noise_ids])
    weight = np.concatenate([proto_w.reshape(-1)[slot], np.ones(len(noise_rows), np.float32)])
    tf = (1 + brng.poisson(0.5, len(rows))).astype(np.float32)
    vals = tf * idf[ids] * weight

    # Sort by (row, feature id), sum duplicate ids, L2-normalise rows.
    key = rows * num_features + ids
    order = np.argsort(key)
    key = key[order]
    first = np.ones(len(key), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    starts = np.flatnonzero(first)
    vals = np.add.reduceat(vals[order], starts) if len(starts) else vals[:0]
    key = key[starts]
    rows = key // num_features
    sq_norms = np.bincount(rows, weights=np.square(vals, dtype=np.float64), minlength=n)
    vals /= np.maximum(np.sqrt(sq_norms), 1e-12).astype(np.float32)[rows]

    feat_counts.append(np.bincount(rows, minlength=n))
    feat_ids.append((key % num_features).astype(np.int32))
    feat_vals.append(vals)
    label_counts.append(np.bincount(label_rows, minlength=n))
    label_ids.append(labels.astype(np.int32))

  def ptr(counts):
    out = np.zeros(num_samples + 1, dtype=np.int64)
    if counts:
      np.cumsum(np.concatenate(counts), out=out[1:])
    return out

  def cat(parts, dtype):
    return np.concatenate(parts) if parts else np.zeros(0, dtype)

  return XCDataset(
      ptr(feat_counts),
      cat(feat_ids, np.int32),
      cat(feat_vals, np.float32),
      ptr(label_counts),
      cat(label_ids, np.int32),
      num_features,
      num_labels,
  )
