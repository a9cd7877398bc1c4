"""A trained model, loaded from its work directory: ``sparsejax.load(workdir)``.

::

  model = sparsejax.load("/tmp/synth")
  scores, ids = model.predict(test_set, top=5)          # an XCDataset, a scipy CSR matrix, or texts
  model.evaluate(test_set)["p@1"]                       # the run's final P@1 on its test set, exactly
  model.label_names[ids[0, 0]]                          # where the dataset names its labels

Training writes what this needs next to the checkpoints, in ``WORKDIR/assets``:
the label names (``labels.txt``, one per line), the fitted text vectorizer
(``vectorizer.json``, ICD-10) and the training set's label frequencies (for
PSP@k). Predictions are exact: the top outputs over all N labels, the same
computation as the run's evaluations.
"""

import functools
import os
from collections.abc import Sequence

import numpy as np

from sparsejax.config import Config
from sparsejax.data import LoadedData, XCDataset
from sparsejax.data.text import load_vectorizer, save_vectorizer
from sparsejax.evaluation import Evaluator, predict_in_batches

ASSETS = "assets"
_LABELS, _VECTORIZER, _FREQUENCIES = "labels.txt", "vectorizer.json", "label_frequencies.npy"


def save_assets(workdir: str, data: LoadedData) -> None:
  """Writes the label names, the vectorizer and the label frequencies of ``data`` to ``WORKDIR/assets``."""
  directory = os.path.join(workdir, ASSETS)
  os.makedirs(directory, exist_ok=True)
  np.save(os.path.join(directory, _FREQUENCIES), data.train.label_frequencies())
  if data.label_names is not None:
    if any("\n" in name for name in data.label_names):
      raise ValueError("label names must not contain line breaks")
    with open(os.path.join(directory, _LABELS), "w") as f:
      f.writelines(name + "\n" for name in data.label_names)
  if data.vectorizer is not None:
    save_vectorizer(data.vectorizer, os.path.join(directory, _VECTORIZER))


class TrainedModel:
  """A trained network (SLIDE's or the dense baseline's) with what its work directory knows about its data.

  Attributes:
    config: the run's settings.
    step: the training step of the checkpoint loaded.
    num_features, num_labels: F and N.
    max_features: features kept per sample (the run's padding width).
    label_names: ``[N]`` names of the labels, or None.
    vectorizer: the fitted text vectorizer, or None.
  """

  def __init__(self, workdir: str, step: int | None = None):
    from sparsejax import checkpoint, model

    checkpoints = checkpoint.Checkpoints(workdir, writable=False)
    self.step = checkpoints.latest_step() if step is None else step
    if self.step is None:
      raise FileNotFoundError(f"{checkpoints.directory}: no checkpoint (train with --workdir={workdir} first)")
    meta = checkpoints.meta(self.step)
    if meta is None:
      raise ValueError(f"{checkpoints.directory}/{self.step} records no settings (written by an older sparsejax)")
    self.config = Config.from_dict(meta["config"])
    sizes = meta["data"]
    self.num_features, self.num_labels = sizes["num_features"], sizes["num_labels"]
    self.max_features, self._num_train = sizes["max_features"], sizes["num_train"]
    tree = checkpoints.restore_arrays(self.step)
    n = self.num_labels  # a sharded run's layer has padding rows after the N real ones
    self.params = model.NetworkParams(
        embed=model.SparseLayer(tree["embed"]["w"], tree["embed"]["b"]),
        hidden=tuple((w, b) for w, b in tree["hidden"]),
        out=model.SparseLayer(tree["out"]["w"][:n], tree["out"]["b"][:n]))
    assets = os.path.join(workdir, ASSETS)
    self.label_names = None
    if os.path.exists(os.path.join(assets, _LABELS)):
      with open(os.path.join(assets, _LABELS)) as f:
        self.label_names = tuple(line.rstrip("\n") for line in f)
    self.vectorizer = None
    if os.path.exists(os.path.join(assets, _VECTORIZER)):
      self.vectorizer = load_vectorizer(os.path.join(assets, _VECTORIZER))
    self._frequencies = np.load(os.path.join(assets, _FREQUENCIES))

  def features(self, inputs) -> XCDataset:
    """``inputs`` as feature rows: an XCDataset (as is), a scipy sparse ``[n, F]`` matrix, or texts."""
    if isinstance(inputs, XCDataset):
      if inputs.num_features != self.num_features:
        raise ValueError(f"the inputs have {inputs.num_features} features; the model reads {self.num_features}")
      return inputs
    if isinstance(inputs, Sequence) and all(isinstance(t, str) for t in inputs):
      if self.vectorizer is None:
        raise ValueError("this model's dataset has no text vectorizer: give feature rows, not texts")
      inputs = self.vectorizer.transform(list(inputs))
    import scipy.sparse

    if not scipy.sparse.issparse(inputs) or inputs.ndim != 2 or inputs.shape[1] != self.num_features:
      raise ValueError(f"inputs must be an XCDataset, texts, or a sparse [n, {self.num_features}] matrix; got "
                       f"{type(inputs).__name__} of shape {getattr(inputs, 'shape', None)}")
    x = scipy.sparse.csr_matrix(inputs)
    x.sort_indices()
    return XCDataset(x.indptr, x.indices, x.data, np.zeros(x.shape[0] + 1, np.int64), np.zeros(0, np.int32),
                     self.num_features, self.num_labels)

  @functools.lru_cache(maxsize=8)  # noqa: B019 - one compiled predict per top; the model lives as long
  def _predict_fn(self, top: int):
    import jax

    from sparsejax import inference

    exact = jax.jit(functools.partial(inference.predict_exact, top=top))

    def predict(params, fi, fv):
      scores, ids = exact(params, fi, fv)
      return np.asarray(scores), np.asarray(ids), None

    return predict

  def predict(self, inputs, top: int = 5, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """The ``top`` best labels of each input over all N outputs.

    Args:
      inputs: an XCDataset, a scipy sparse ``[n, F]`` matrix, or texts (when the model has a vectorizer).
      top: labels per input (at most N).
      batch_size: inputs per call (one compiled shape).

    Returns:
      ``(scores [n, top] float32, ids [n, top] int32)``, best first; scores are the output layer's logits.
    """
    if not 1 <= top <= self.num_labels:
      raise ValueError(f"top must be in [1, {self.num_labels}], got {top}")
    data = self.features(inputs)
    if len(data) == 0:
      return np.zeros((0, top), np.float32), np.zeros((0, top), np.int32)
    scores, ids, _ = predict_in_batches(self._predict_fn(top), self.params, data, len(data), self.max_features,
                                        batch_size)
    return scores, ids

  def evaluate(self, dataset: XCDataset, num_samples: int | None = None) -> dict[str, float]:
    """Exact P@k, nDCG@k and PSP@k on ``dataset``, as the training run computes them.

    On the run's test set this reproduces its final evaluation's exact metrics.
    """
    from sparsejax import metrics

    propensity = metrics.propensity_scores(self._frequencies, self._num_train, self.config.run.propensity_a,
                                           self.config.run.propensity_b)
    evaluator = Evaluator(self.features(dataset), propensity, self.max_features)
    return evaluator(self._predict_fn(min(5, self.num_labels)), self.params, num_samples)

  def names(self, ids: np.ndarray) -> np.ndarray:
    """Label names of ``ids`` (the ids as strings where the dataset has no names)."""
    if self.label_names is None:
      return np.asarray(ids).astype(str)
    return np.asarray(self.label_names, dtype=object)[np.asarray(ids)]


def load(workdir: str, step: int | None = None) -> TrainedModel:
  """The model trained in ``workdir`` (its newest checkpoint, or ``step``'s)."""
  return TrainedModel(workdir, step)
