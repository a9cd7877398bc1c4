"""The peers that benchmarks set beside sparsejax: PECOS XR-Linear and napkinXC's PLT, trained on the same files.

Shared by ``accuracy.py`` and ``suite.py``. Each peer trains on the training file minus the validation split that
sparsejax's default run holds out (``sparsejax.train``: seed + 1), so every system learns from the same samples,
and is scored exactly on the whole test file (top 5).
"""

import os
import subprocess
import sys
import time

import numpy as np

from sparsejax import data as xcdata

PECOS_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pecos_xrlinear.py")


def peer_data(train_path: str, test_path: str, seed: int):
  """``(train, test)``: the training samples minus sparsejax's validation split (drawn as its defaults draw it:
  grouped where the test set looks split by groups, ``--validation_split=auto``), and the test samples."""
  from sparsejax.config import Config

  train, test = xcdata.load_xc_file(train_path), xcdata.load_xc_file(test_path)
  fraction = Config().data.validation_fraction
  if fraction > 0:
    grouped = xcdata.grouped_split.looks_grouped(train, test).grouped
    train, _ = xcdata.grouped_split.split(train, fraction, seed + 1, grouped)
  return train, test


def label_matrix(ds):
  """``ds``'s labels as a ``[n, L]`` indicator matrix (PECOS's Y)."""
  import scipy.sparse

  return scipy.sparse.csr_matrix((np.ones(len(ds.label_indices), np.float32), ds.label_indices, ds.label_indptr),
                                 shape=(len(ds), ds.num_labels))


def peer_result(ids: np.ndarray, test, seconds: float, budget: float | None, wall: float | None = None) -> dict:
  """A peer's result as accuracy.py's JSON holds it: one test point at its training seconds, the test metrics."""
  from sparsejax import metrics

  _, _, labels = test.to_padded(None)
  result = metrics.evaluate_topk(ids, labels)
  point = {"step": None, "epoch": None, "seconds": seconds, "p@1": result["p@1"], "p@5": result["p@5"],
           "split": "test"}
  return {"curve": [point], "final": {**result, "train_seconds": seconds, "seconds": seconds,
                                      "within_budget": budget is None or seconds <= budget},
          "wall_seconds": seconds if wall is None else wall}


def run_pecos(train_path: str, test_path: str, run_dir: str, *, seed: int, budget: float | None = None,
              pecos_python: str = sys.executable, nice: int = 0) -> dict:
  """PECOS XR-Linear (PIFA + hierarchical k-means + its default solver) in its own environment (``pecos_python``:
  libpecos pins numpy < 2; see pecos_xrlinear.py). ``wall_seconds``: the whole subprocess (load, train, predict)."""
  import scipy.sparse

  train, test = peer_data(train_path, test_path, seed)
  os.makedirs(run_dir, exist_ok=True)
  paths = [os.path.join(run_dir, f"{name}.npz") for name in ("train_x", "train_y", "test_x", "out")]
  for path, matrix in zip(paths, (train.feature_matrix(), label_matrix(train), test.feature_matrix())):
    scipy.sparse.save_npz(path, matrix)
  t = time.time()
  subprocess.run([*(["nice", "-n", str(nice)] if nice else []), pecos_python, PECOS_SCRIPT, *paths], check=True)
  wall = time.time() - t
  out = np.load(paths[-1])
  return peer_result(out["ids"], test, float(out["train_seconds"]), budget, wall)


def run_napkinxc(train_path: str, test_path: str, run_dir: str, *, seed: int, budget: float | None = None) -> dict:
  """napkinXC PLT with its defaults (liblinear nodes; benchmark-only: ``pip install napkinxc``).
  ``wall_seconds``: training and predicting the test set."""
  from napkinxc.models import PLT

  train, test = peer_data(train_path, test_path, seed)
  x_train = train.feature_matrix()
  y_train = [train.label_indices[train.label_indptr[i]:train.label_indptr[i + 1]].tolist() for i in range(len(train))]
  x_test = test.feature_matrix()
  model = PLT(run_dir, seed=seed, threads=0)
  t = time.time()
  model.fit(x_train, y_train)
  seconds = time.time() - t
  top = model.predict(x_test, top_k=5)
  wall = time.time() - t
  ids = np.full((len(test), 5), -1, np.int64)
  for i, row in enumerate(top):
    ids[i, :len(row)] = row[:5]
  return peer_result(ids, test, seconds, budget, wall)
