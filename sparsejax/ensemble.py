"""Ensembles of networks: their rankings merged by mean logit.

A network that peaks early (GCIDE cloze, WordNet: its best validation state within the first fifth of a 300 s run)
leaves most of a time budget unused; another network of the same recipe from another seed, averaged with it,
is the measured use of that time (GCIDE cloze: test P@1 0.1054 and 0.1038 alone, 0.1103 together; WordNet 0.7156
and 0.7128, 0.7198; benchmarks/RESULTS.md, "Early stopping and ensembles"). Each member ranks its own best ``T``
labels (exactly, or among its index's candidates); :func:`merge_top` scores the union of the members' lists by the
mean of the members' logits, a member's lowest listed logit standing in for a label it did not rank (for an exact
ranking, an upper bound: the label scored at most that). O(members x T) per sample, never O(N)::

  scores, ids = merge_top([scores_a, scores_b], [ids_a, ids_b], top=5)

The training side (which members a run trains, and when) is :mod:`sparsejax.train.members`; serving,
:class:`sparsejax.serving.model.TrainedModel`.
"""

import numpy as np


def merge_top(scores: list[np.ndarray], ids: list[np.ndarray], top: int) -> tuple[np.ndarray, np.ndarray]:
  """The best ``top`` labels of each sample by the members' mean logit.

  Args:
    scores: one ``[n, T]`` float array per member, each row best first (``-inf`` or NaN: no label).
    ids: one ``[n, T]`` int array per member: the labels of ``scores`` (negative: no label).
    top: labels per sample returned (at most the union's size, ``members x T``).

  Returns:
    ``(scores [n, top] float32, ids [n, top] int32)``, best first: a label's score is the mean, over the members
    that list any label for the sample, of its logit where the member ranked it, else the member's lowest listed
    logit. Ties keep the first member's
    order, then the next member's; slots past the labels found hold ``-inf`` and ``-1``.
  """
  if not scores or len(scores) != len(ids):
    raise ValueError(f"merge_top: one scores and one ids array per member, got {len(scores)} and {len(ids)}")
  # A sampled ranking pads the slots past its candidates with NaN or -inf: no label there.
  scores = [np.nan_to_num(np.asarray(s, np.float32), nan=-np.inf, posinf=np.inf, neginf=-np.inf) for s in scores]
  ids = [np.asarray(i) for i in ids]
  n, t = ids[0].shape
  for s, i in zip(scores, ids):
    if s.shape != (n, t) or i.shape != (n, t):
      raise ValueError(f"merge_top: every member's scores and ids must be [{n}, {t}], got {s.shape} and {i.shape}")
  members = len(ids)
  if not 1 <= top <= members * t:
    raise ValueError(f"merge_top: top must be in [1, {members * t}] (the members' labels), got {top}")
  union = np.concatenate(ids, axis=1)  # [n, M T]
  # Rows' labels as one sorted key space (row * span + id + 1): one searchsorted finds every (row, label) pair,
  # O(n M T log(n T)), instead of comparing each union label with each listed one.
  span = int(max(union.max(initial=-1), -1)) + 2
  rows = np.arange(n, dtype=np.int64)[:, None] * span
  union_key = (rows + union + 1).ravel()
  # A label listed by an earlier member is scored once, in its first slot (a stable sort keeps that one first).
  order = np.argsort(union_key, kind="stable")
  first = np.ones(union_key.size, bool)
  first[1:] = union_key[order][1:] != union_key[order][:-1]
  valid = np.empty(union_key.size, bool)
  valid[order] = first
  valid = valid.reshape(union.shape) & (union >= 0)
  total = np.zeros(union.shape, np.float32)
  listing = np.zeros((n, 1), np.float32)  # members that list a label for the sample: the mean is over them
  for s, i in zip(scores, ids):
    key = (rows + np.where(i >= 0, i + 1, 0)).ravel()  # no label: id 0 of the row, which no union label is
    by_key = np.argsort(key, kind="stable")
    sorted_key = key[by_key]
    at = np.minimum(np.searchsorted(sorted_key, union_key), sorted_key.size - 1)
    found = (sorted_key[at] == union_key).reshape(union.shape) & (union >= 0)
    logit = s.ravel()[by_key][at].reshape(union.shape)
    # The member's lowest logit listed (a sampled ranking may list fewer than T labels, the rest -inf).
    floor = np.min(np.where(np.isfinite(s), s, np.inf), axis=1, keepdims=True)
    lists = np.isfinite(floor)
    total += np.where(lists, np.where(found, logit, floor), 0.0)
    listing += lists
  merged = np.where(valid & (listing > 0), total / np.maximum(listing, 1), -np.inf).astype(np.float32)
  order = np.argsort(-merged, axis=1, kind="stable")[:, :top]
  best = np.take_along_axis(merged, order, axis=1)
  return best, np.where(np.isfinite(best), np.take_along_axis(union, order, axis=1), -1).astype(np.int32)
