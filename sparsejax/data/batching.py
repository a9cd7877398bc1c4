"""Shuffled, bucketed-shape, resumable mini-batches with background prefetching.

Order: epoch ``e`` visits the samples in the permutation drawn from
``np.random.default_rng((seed, e))``, in consecutive slices of ``batch_size``.
So the batch sequence is a pure function of ``(seed, epoch, index)``, which is
what makes :meth:`BatchIterator.state` a complete checkpoint.

Widths: by default each batch is padded to its own longest feature and label
rows, rounded up to a power of two (at least 32) and capped at
``max_features`` / ``max_labels`` (:func:`bucket_width`). A heavy-tailed
multi-label set (mean 5 labels, one row of 310) then steps at ``[B, 32..64]``
labels and pays the long row only in the batches that hold it, and the step
compiles at most ``1 + ceil(log2(max / 32))`` widths per array. The widths are
a pure function of the batch's rows, so resuming keeps them too.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .dataset import PAD_ID, XCDataset

Batch = dict[str, np.ndarray]


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
  """``[num_samples]`` int64 visiting order of ``epoch`` (pure function of its args)."""
  return np.random.default_rng((seed, epoch)).permutation(num_samples)


WIDTHS = ("bucketed", "fixed")

# The narrowest bucketed width: below it a batch's width costs the step next to nothing (B 128, k 1,024: the
# output layer's B k d work is 30x an embedding bag of 32 features, label rows of 32 cost a [B, 32] sort), and
# each narrower bucket would be one more compiled program.
MIN_WIDTH = 32


def bucket_width(longest: int, cap: int, floor: int = MIN_WIDTH) -> int:
  """The padded width of a batch whose longest row has ``longest`` entries: the next power of two, at least
  ``floor``, at most ``cap``.

  Args:
    longest: the batch's longest row (features or labels), >= 0.
    cap: the widest batch (``max_features`` / ``max_labels``); rows longer are cut to it as before.
    floor: the narrowest width below ``cap``.

  Returns:
    ``min(cap, max(floor, 2 ** ceil(log2(longest))))``: so at most ``1 + ceil(log2(cap / floor))`` distinct
    widths (each a compiled step; a longest row of 310: 32, 64, 128, 256 and 310), and the dataset-wide width
    only for batches that need more than half of it.
  """
  width = 1 << max(int(longest) - 1, 0).bit_length()
  return min(int(cap), max(int(floor), width))


def bucket_widths(cap: int, floor: int = MIN_WIDTH) -> list[int]:
  """Every width :func:`bucket_width` gives below ``cap``, ascending (a run compiles its step at most once per
  pair of feature and label widths)."""
  return sorted({bucket_width(1 << e, cap, floor) for e in range(max(int(cap), 1).bit_length() + 1)})


def batch_widths(dataset: XCDataset, rows: np.ndarray, max_features: int, max_labels: int) -> tuple[int, int]:
  """``(M_f, M_l)`` of the batch of ``rows``: :func:`bucket_width` of its longest feature and label rows."""
  longest_f = int(np.max(dataset.indptr[rows + 1] - dataset.indptr[rows], initial=0))
  longest_l = int(np.max(dataset.label_indptr[rows + 1] - dataset.label_indptr[rows], initial=0))
  return bucket_width(longest_f, max_features), bucket_width(longest_l, max_labels)


def _make_batch(
    dataset: XCDataset,
    rows: np.ndarray,
    batch_size: int,
    max_features: int,
    max_labels: int,
    widths: str = "fixed",
) -> Batch:
  if widths == "bucketed":
    max_features, max_labels = batch_widths(dataset, rows, max_features, max_labels)
  feat_ids, feat_vals, labels = dataset.to_padded(rows, max_features, max_labels)
  if len(rows) < batch_size:  # final partial batch: pad with empty rows
    pad = batch_size - len(rows)
    feat_ids = np.pad(feat_ids, ((0, pad), (0, 0)), constant_values=PAD_ID)
    feat_vals = np.pad(feat_vals, ((0, pad), (0, 0)))
    labels = np.pad(labels, ((0, pad), (0, 0)), constant_values=PAD_ID)
  return {"feat_ids": feat_ids, "feat_vals": feat_vals, "labels": labels}


def _produce(
    dataset: XCDataset,
    batch_size: int,
    seed: int,
    epoch: int,
    index: int,
    num_epochs: int | None,
    max_features: int,
    max_labels: int,
    drop_remainder: bool,
    transform: Callable[[Batch], Any] | None,
    widths: str = "fixed",
) -> Iterator[tuple[Any, dict[str, int]]]:
  """Yield ``(batch, state_after_batch)`` from position ``(epoch, index)``."""
  n = len(dataset)
  last_start = n - batch_size if drop_remainder else n - 1
  while num_epochs is None or epoch < num_epochs:
    if last_start < 0:
      if num_epochs is None:
        raise ValueError(f"dataset of {n} samples yields no batch of {batch_size}")
      return
    perm = epoch_permutation(n, seed, epoch)
    while index <= last_start:
      rows = perm[index : index + batch_size]
      batch = _make_batch(dataset, rows, batch_size, max_features, max_labels, widths)
      if transform is not None:
        batch = transform(batch)
      index += batch_size
      if index > last_start:
        next_state = {"epoch": epoch + 1, "index": 0}
      else:
        next_state = {"epoch": epoch, "index": index}
      yield batch, next_state
    epoch, index = epoch + 1, 0


_END = object()


class _Failure:

  def __init__(self, exc: BaseException):
    self.exc = exc


def _worker(producer: Iterator, out: queue.Queue, stop: threading.Event) -> None:
  """Thread body: move items from ``producer`` to ``out`` until done or stopped.

  Holds no reference to the BatchIterator, so an abandoned iterator can be
  garbage-collected (its finalizer then stops this thread).
  """

  def put(item) -> bool:
    while not stop.is_set():
      try:
        out.put(item, timeout=0.05)
        return True
      except queue.Full:
        continue
    return False

  try:
    for item in producer:
      if not put(item):
        return
    put(_END)
  except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
    put(_Failure(exc))


def _shutdown(thread: threading.Thread | None, out: queue.Queue, stop: threading.Event) -> None:
  stop.set()
  if thread is not None:
    while thread.is_alive():
      try:  # unblock a worker waiting on a full queue
        out.get_nowait()
      except queue.Empty:
        pass
      thread.join(timeout=0.05)


class BatchIterator:
  """Iterator over shuffled mini-batches of an :class:`XCDataset`, of a few bucketed shapes.

  Each item is ``{"feat_ids": [B, M_f] int32 (pad -1), "feat_vals": [B, M_f]
  float32 (pad 0), "labels": [B, M_l] int32 (pad -1)}`` (see
  :meth:`XCDataset.to_padded`), or ``transform`` of that dict. ``M_f`` and
  ``M_l`` are the batch's own (``widths="bucketed"``, :func:`bucket_width`) or
  always ``max_features`` / ``max_labels`` (``widths="fixed"``). With
  ``drop_remainder=False`` the last batch of an epoch is padded with empty
  rows (all ids -1) to keep ``B`` fixed.

  Batches are prepared by a daemon thread into a bounded queue of
  ``prefetch`` items (``prefetch=0``: prepared synchronously). Exceptions
  raised while preparing a batch are re-raised by ``next()``. Call
  :meth:`close` (or use ``with``) to stop the thread early.

  Checkpointing: :meth:`state` gives the position after the last batch
  *returned* (prefetched batches do not count); pass it back through
  ``BatchIterator(..., **state)`` or :meth:`from_state` with the same dataset,
  ``seed`` and ``batch_size`` to continue with exactly the same batches.

  Args:
    dataset: samples to batch.
    batch_size: ``B``.
    seed: shuffling seed.
    epoch: epoch to start in.
    index: offset into that epoch's permutation (a multiple of ``B`` when it
      comes from :meth:`state`).
    max_features: the widest ``M_f`` (longer rows keep their largest values); default: dataset-wide max features
      per sample.
    max_labels: the widest ``M_l`` (longer rows keep their first labels); default: dataset-wide max labels per
      sample.
    widths: ``"bucketed"``: each batch padded to its longest rows rounded up to a power of two (at least 32, at
      most the maximum: :func:`bucket_width`); ``"fixed"``: every batch padded to the maximum.
    drop_remainder: drop each epoch's final partial batch.
    num_epochs: stop when the epoch counter reaches this (absolute, so a
      resumed iterator stops at the same place); None: never stop.
    prefetch: queue size of the background thread (0 disables it).
    transform: optional function applied to each batch in the worker
      thread (e.g. ``jax.device_put``), to move more work off the
      training loop.
  """

  def __init__(
      self,
      dataset: XCDataset,
      batch_size: int,
      *,
      seed: int = 0,
      epoch: int = 0,
      index: int = 0,
      max_features: int | None = None,
      max_labels: int | None = None,
      drop_remainder: bool = True,
      num_epochs: int | None = None,
      prefetch: int = 2,
      transform: Callable[[Batch], Any] | None = None,
      widths: str = "bucketed",
  ):
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    if epoch < 0 or index < 0:
      raise ValueError("epoch and index must be >= 0")
    if prefetch < 0:
      raise ValueError("prefetch must be >= 0")
    if widths not in WIDTHS:
      raise ValueError(f"widths must be one of {WIDTHS}, got {widths!r}")
    self.dataset = dataset
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.max_features = dataset.max_features_per_sample() if max_features is None else int(max_features)
    self.max_labels = dataset.max_labels_per_sample() if max_labels is None else int(max_labels)
    self.drop_remainder = bool(drop_remainder)
    self.num_epochs = num_epochs
    self.prefetch = int(prefetch)
    self.widths = widths
    self._state = {"epoch": int(epoch), "index": int(index)}
    self._producer = _produce(
        dataset,
        self.batch_size,
        self.seed,
        int(epoch),
        int(index),
        num_epochs,
        self.max_features,
        self.max_labels,
        self.drop_remainder,
        transform,
        widths,
    )
    self._queue: queue.Queue = queue.Queue(maxsize=max(1, self.prefetch))
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._done = False
    self._finalizer = weakref.finalize(self, _shutdown, None, self._queue, self._stop)

  @classmethod
  def from_state(
      cls, dataset: XCDataset, batch_size: int, state: dict[str, int], **kwargs
  ) -> BatchIterator:
    """Resume at ``state`` (from :meth:`state`); ``kwargs`` as in ``__init__``."""
    return cls(dataset, batch_size, epoch=state["epoch"], index=state["index"], **kwargs)

  def state(self) -> dict[str, int]:
    """``{"epoch", "index"}`` of the next batch to be returned (JSON-friendly)."""
    return dict(self._state)

  @property
  def batches_per_epoch(self) -> int:
    """Number of batches in one epoch."""
    n = len(self.dataset)
    return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self) -> Any:
    if self._done:
      raise StopIteration
    if self.prefetch == 0:
      try:
        batch, self._state = next(self._producer)
      except StopIteration:
        self._done = True
        raise
      return batch
    if self._thread is None:
      self._start()
    item = self._queue.get()
    if item is _END:
      self._done = True
      raise StopIteration
    if isinstance(item, _Failure):
      self._done = True
      raise item.exc
    batch, self._state = item
    return batch

  def _start(self) -> None:
    self._thread = threading.Thread(
        target=_worker,
        args=(self._producer, self._queue, self._stop),
        name="sparsejax-batch-prefetch",
        daemon=True,
    )
    self._finalizer.detach()
    self._finalizer = weakref.finalize(self, _shutdown, self._thread, self._queue, self._stop)
    self._thread.start()

  def close(self) -> None:
    """Stop the prefetch thread (idempotent); further ``next()`` stops."""
    self._done = True
    self._finalizer()

  def __enter__(self) -> BatchIterator:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def batches(dataset: XCDataset, batch_size: int, **kwargs) -> BatchIterator:
  """Shorthand for :class:`BatchIterator` ``(dataset, batch_size, **kwargs)``."""
  return BatchIterator(dataset, batch_size, **kwargs)
