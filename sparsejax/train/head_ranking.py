"""A run's head rankers (:mod:`sparsejax.head_rankers`): fitted once, at the start, on the training split, their
seconds charged to ``--max_seconds`` as a search's are; kept in ``workdir/head_rankers.npz`` so that a continued run
fuses the same ones (and charges nothing again)."""

import os
import tempfile
import time

import numpy as np
from absl import logging

from sparsejax import head_rankers
from sparsejax.config import Config
from sparsejax.data import LoadedData
from sparsejax.serving.assets import DAMAGED_ARRAYS
from sparsejax.train import plan, resume

FILE = "head_rankers.npz"


def wanted(config: Config) -> bool:
  """Whether a run of ``config`` fuses head rankers (a validation split chooses their weight)."""
  return config.run.centroid_fusion and config.run.head_rankers > 0 and config.data.validation_fraction > 0


def prepare(config: Config, workdir: str, data: LoadedData | None,
            searched: bool) -> tuple[LoadedData | None, head_rankers.HeadRankers | None, float]:
  """``(data, rankers, seconds)``: the run's head rankers, fitted where a new run wants them (None: none fitted), the
  data (loaded here if it was needed and None) and the fit's wall seconds (0 where nothing was fitted; loading is
  not counted). A continued run fits none: it fuses those its first invocation kept, if any (none where it kept none,
  or kept them for another ``--head_rankers``), and a finished run or one its checkpoints refuse costs nothing here.
  A run that just adopted its recipe search's winner (``searched``) is new. The run keeps them once it has started
  (:func:`save`): a run refused at its start leaves its work directory as it was."""
  if not wanted(config) or (resume.holds_checkpoints(workdir) and not searched):
    return data, None, 0.0
  if not head_rankers.cpu_available():  # e.g. JAX_PLATFORMS=cuda for a dense network on a GPU: fused without them
    logging.warning("head rankers: none fitted: their kernel is CPU code and this process's JAX has no CPU backend "
                    "(JAX_PLATFORMS=%s)", os.environ.get("JAX_PLATFORMS", ""))
    return data, None, 0.0
  data = data if data is not None else plan.load_data(config)
  t_start = time.time()
  train = training_split(config, data)
  rankers = head_rankers.fit(train, head_rankers.head_labels(train, config.run.head_rankers))
  return data, rankers, time.time() - t_start


def training_split(config: Config, data: LoadedData):
  """The samples the run trains on (its validation split held out, drawn as :func:`plan.split_data` draws it)."""
  return plan.validation_split(config, data.train, plan.validation_seed(config))[0]


def read(config: Config, workdir: str, train) -> head_rankers.HeadRankers | None:
  """The head rankers kept in ``workdir`` for a run of ``config`` trained on ``train`` (its training split), or None
  where the run wants none or none such are kept."""
  path = os.path.join(workdir, FILE)
  if not wanted(config) or not os.path.exists(path):
    return None
  try:
    with np.load(path, allow_pickle=False) as f:
      kept = {key: int(f[key]) for key in ("num_train", "num_features", "num_labels", "most")}
      rankers = head_rankers.HeadRankers(f["labels"].astype(np.int32), f["weights"].astype(np.float32),
                                         f["bias"].astype(np.float32))
  except DAMAGED_ARRAYS as e:  # the final evaluation fuses without them
    logging.warning("head rankers: %s is unreadable (%s: %s): not used", path, type(e).__name__, e)
    return None
  shape = _shape(train, config)
  K = len(rankers.labels)
  if (any(kept[key] != value for key, value in shape.items()) or rankers.labels.ndim != 1
      or rankers.weights.shape != (kept["num_features"], K) or rankers.bias.shape != (K,)
      or (K and (rankers.labels.min() < 0 or rankers.labels.max() >= kept["num_labels"]))):
    logging.warning("head rankers: %s was fitted for %s, not this run's %s: not used", path, kept, shape)
    return None
  return rankers


def remove(workdir: str) -> None:
  """Removes the head rankers kept in ``workdir`` (a new run's, where it fits none: another run's are not its)."""
  path = os.path.join(workdir, FILE)
  if os.path.exists(path):
    os.remove(path)


def _shape(train, config: Config) -> dict:
  """What the kept rankers must match: the training split's sizes and ``--head_rankers``."""
  return {"num_train": len(train), "num_features": train.num_features, "num_labels": train.num_labels,
          "most": config.run.head_rankers}


def save(config: Config, workdir: str, rankers: head_rankers.HeadRankers, train) -> None:
  """Keeps the rankers fitted on ``train`` (the run's training split) in ``workdir``, written atomically (a reader
  never sees half a file)."""
  fd, tmp = tempfile.mkstemp(dir=workdir, suffix=".npz.tmp")
  with os.fdopen(fd, "wb") as f:  # compressed: the weights of features no training row has are 0
    np.savez_compressed(f, labels=rankers.labels, weights=rankers.weights, bias=rankers.bias,
             **{key: np.int64(v) for key, v in _shape(train, config).items()})
  os.replace(tmp, os.path.join(workdir, FILE))
