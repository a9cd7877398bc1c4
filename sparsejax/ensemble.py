"""Ensembles of networks: their rankings merged by mean logit.

A network that peaks early (GCIDE cloze, WordNet: its best validation state within the first fifth of a 300 s run)
leaves most of a time budget unused; another network of the same recipe from another seed, averaged with it,
is the measured use of that time (GCIDE cloze: test P@1 0.1054 and 0.1038 alone, 0.1103 together; WordNet 0.7156
and 0.7128, 0.7198; benchmarks/RESULTS.md, "Ensembles"). Each member ranks its own best ``T`` labels (exactly, or
among its index's candidates); :func:`merge_top` scores the union of the members' lists by the mean of the members'
logits, a member's ``T``-th logit standing in for a label it did not rank (an upper bound: the label scored at most
that). O(members x T) per sample, never O(N)::

  scores, ids = merge_top([scores_a, scores_b], [ids_a, ids_b], top=5)

The training side (which members a run trains, and when) is :mod:`sparsejax.train.members`; serving,
:class:`sparsejax.train.trained.TrainedModel`.
"""

import numpy as np


def merge_top(scores: list[np.ndarray], ids: list[np.ndarray], top: int) -> tuple[np.ndarray, np.ndarray]:
  """The best ``top`` labels of each sample by the members' mean logit.

  Args:
    scores: one ``[n, T]`` float array per member, each row best first (``-inf``: no label).
    ids: one ``[n, T]`` int array per member: the labels of ``scores`` (negative: no label).
    top: labels per sample returned (at most the union's size, ``members x T``).

  Returns:
    ``(scores [n, top] float32, ids [n, top] int32)``, best first: a label's score is the mean over members of
    its logit where the member ranked it, else the member's lowest listed logit. Ties keep the first member's
    order, then the next member's; slots past the labels found hold ``-inf`` and ``-1``.
  """
  if not scores or len(scores) != len(ids):
    raise ValueError(f"merge_top: one scores and one ids array per member, got {len(scores)} and {len(ids)}")
  scores = [np.asarray(s, np.float32) for s in scores]
  ids = [np.asarray(i) for i in ids]
  n, t = ids[0].shape
  for s, i in zip(scores, ids):
    if s.shape != (n, t) or i.shape != (n, t):
      raise ValueError(f"merge_top: every member's scores and ids must be [{n}, {t}], got {s.shape} and {i.shape}")
  members = len(ids)
  if not 1 <= top <= members * t:
    raise ValueError(f"merge_top: top must be in [1, {members * t}] (the members' labels), got {top}")
  union = np.concatenate(ids, axis=1)  # [n, M T]
  valid = union >= 0
  # A label listed by an earlier member is scored once, in that member's slot.
  for m in range(1, members):
    block = slice(m * t, (m + 1) * t)
    seen = (union[:, block, None] == union[:, None, :m * t]).any(axis=2)
    valid[:, block] &= ~seen
  total = np.zeros(union.shape, np.float32)
  for s, i in zip(scores, ids):
    match = (union[:, :, None] == i[:, None, :]) & (i[:, None, :] >= 0)  # [n, M T, T]
    found = match.any(axis=2)
    logit = np.take_along_axis(s, match.argmax(axis=2), axis=1)
    # The member's lowest logit listed (a sampled ranking may list fewer than T labels, the rest -inf).
    floor = np.min(np.where(np.isfinite(s), s, np.inf), axis=1, keepdims=True)
    total += np.where(found, logit, np.where(np.isfinite(floor), floor, -np.inf))
  merged = np.where(valid, total / members, -np.inf).astype(np.float32)
  order = np.argsort(-merged, axis=1, kind="stable")[:, :top]
  best = np.take_along_axis(merged, order, axis=1)
  return best, np.where(np.isfinite(best), np.take_along_axis(union, order, axis=1), -1).astype(np.int32)
