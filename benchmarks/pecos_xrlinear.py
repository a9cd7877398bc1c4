"""PECOS XR-Linear on CSR matrices, in PECOS's own Python environment (``benchmarks/accuracy.py --system pecos``).

``libpecos`` pins numpy < 2 and brings torch, so it cannot share sparsejax's environment: ``accuracy.py`` writes
the training and test matrices as ``.npz`` files and runs this script with ``--pecos_python`` (a venv with
``pip install libpecos``). It trains PECOS's documented default pipeline (PIFA label embeddings, hierarchical
k-means indexer, XR-Linear with its default solver) and writes the test set's top-5 label ids and the training
seconds::

  python pecos_xrlinear.py TRAIN_X.npz TRAIN_Y.npz TEST_X.npz OUT.npz
"""

import argparse
import time

import numpy as np
import scipy.sparse as sp


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  for name in ("train_x", "train_y", "test_x", "out"):
    parser.add_argument(name)
  parser.add_argument("--top", type=int, default=5)
  args = parser.parse_args()
  from pecos.xmc import Indexer, LabelEmbeddingFactory
  from pecos.xmc.xlinear.model import XLinearModel

  x = sp.load_npz(args.train_x).tocsr().astype(np.float32)
  y = sp.load_npz(args.train_y).tocsr().astype(np.float32)
  x_test = sp.load_npz(args.test_x).tocsr().astype(np.float32)
  t = time.time()
  label_features = LabelEmbeddingFactory.create(y, x, method="pifa")
  clusters = Indexer.gen(label_features)
  model = XLinearModel.train(x, y, C=clusters)
  seconds = time.time() - t
  scores = model.predict(x_test, only_topk=args.top).tocsr()
  ids = np.full((x_test.shape[0], args.top), -1, np.int64)
  for i in range(x_test.shape[0]):
    row = slice(scores.indptr[i], scores.indptr[i + 1])
    order = np.argsort(-scores.data[row], kind="stable")
    ids[i, :len(order)] = scores.indices[row][order]
  np.savez(args.out, ids=ids, train_seconds=seconds)


if __name__ == "__main__":
  main()
