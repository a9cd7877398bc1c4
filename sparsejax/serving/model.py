"""A trained model, loaded from its work directory: ``sparsejax.load(workdir)``.

::

  model = sparsejax.load("/tmp/synth")
  scores, ids = model.predict(test_set, top=5)          # an XCDataset, a scipy CSR matrix, or texts
  scores, ids = model.predict(test_set, top=5, k=1024)  # sampled: 1,024 index candidates scored per input
  model.evaluate(test_set)["p@1"]                       # the run's final P@1 on its test set, exactly
  model.label_names[ids[0, 0]]                          # where the dataset names its labels

Training writes what this needs next to the checkpoints, in ``WORKDIR/assets`` (:mod:`sparsejax.serving.assets`):
the label names (``labels.txt``, one per line), the fitted text vectorizer
(``vectorizer.json``, ICD-10), the training set's label frequencies (for
PSP@k) and the serving index that the final evaluation built for the selected
state (``serving_index.npz``; runs with a clustered index, a sharded run's
shards' indexes merged into one over all labels).
Predictions are exact (the top outputs over all N labels) or, with ``k``,
sampled from the serving index as the run's ``sampled_p@k`` measured them:
the same computations as the run's evaluations.
"""

import functools
import os
import warnings
from collections.abc import Sequence

import jax
import numpy as np

from sparsejax import (
  ensemble,
  fusion,
  index,
  inference,
  memory,
  metrics,
  model,
  model_kinds,
  platforms,
)
from sparsejax.config import Config
from sparsejax.data import XCDataset
from sparsejax.data.text import vectorizer_from_saved
from sparsejax.evaluation import Evaluator, predict_in_batches
from sparsejax.index import saved
from sparsejax.model_config import ModelConfig
from sparsejax.serving import assets, model_copy, restore
from sparsejax.serving import inputs as inputs_lib
from sparsejax.serving.assets import ASSETS
from sparsejax.workdir import checkpoint, seals


class TrainedModel:
  """A trained network (SLIDE's or the dense baseline's) with what its work directory knows about its data.

  Attributes:
    config: the run's settings.
    step: the training step of the checkpoint loaded.
    selected_by: why that checkpoint: ``"validation p@1"`` (the run's selected state, the one its final
      evaluation reported), ``"newest"`` (the run kept no best state: no validation split) or ``"step"``
      (asked for).
    num_features, num_labels: F and N.
    max_features: the run's padding width of training samples (its ``--max_features``, or its widest training
      sample); predictions and evaluations keep every feature of their inputs unless the run set
      ``--max_features``.
    label_names: ``[N]`` names of the labels, or None.
    vectorizer: the fitted text vectorizer, or None.
    members: the run's other ensemble members (``--ensemble_members``), each a :class:`TrainedModel` of
      ``WORKDIR/members/M``: predictions and evaluations merge their rankings (:mod:`sparsejax.ensemble`). Empty for
      one network, and where a checkpoint other than the selected state is loaded (the network alone).

  Args:
    workdir: the run's work directory (or a :meth:`save`'d model's).
    step: a checkpoint's step, or None: the run's selected state.
    platform: where the network runs, as ``sparsejax-train --platform``: ``"cpu"`` (SLIDE's kernels are CPU code),
      or ``"cuda"``/``"rocm"`` for a dense model. JAX is pinned to it (:func:`sparsejax.platforms.pin`): a machine
      whose JAX defaults to a GPU serves on its CPUs; where JAX already runs elsewhere, loading is refused, saying so.
  """

  def __init__(self, workdir: str, step: int | None = None, platform: str = "cpu"):

    self._workdir = workdir
    # JAX is pinned before anything starts it (orbax does, listing the checkpoints), by the network that config.json
    # names; the checkpoint's own settings are checked once read.
    platforms.pin(platform, restore.recorded_model(workdir), "load")
    checkpoints = checkpoint.Checkpoints(workdir, writable=False)
    newest = checkpoints.latest_step()
    if newest is None:
      raise FileNotFoundError(f"{checkpoints.directory}: no checkpoint (train with --workdir={workdir} first)")
    meta = checkpoints.meta(newest)
    if meta is None:
      raise ValueError(f"{checkpoints.directory}/{newest} records no settings (written by an older sparsejax)")
    self.config = Config.from_dict(meta["config"])
    platforms.check(platform, self.config.network.model)
    # The run's identity: what the seals of its best state and assets must name (None: an older sparsejax's run,
    # whose files have no seals).
    self._run_id = meta.get("run_id")
    if self._run_id is None:
      warnings.warn(seals.UnverifiedWarning(
          f"{workdir} was written by a sparsejax that did not seal its best state and assets: they are loaded "
          "without checking them"), stacklevel=3)
    assets.check_assets(os.path.join(workdir, ASSETS), self._run_id)  # before anything of them is read
    # A stage run once: what the restore and the padding rows' slicing free goes back to the system (tcmalloc keeps
    # it otherwise: at 10^9 parameters sparsejax-predict peaked 3.2 GB above the same prediction under glibc).
    with memory.freed_memory_returned():
      # (unpacked at once: a tuple kept of them would hold the restored arrays past the block)
      tree, self.step, self.selected_by, from_best = restore.served_state(workdir, checkpoints, self.config,
                                                                          self._run_id, newest, step)
      self._set_network(tree, meta)
      del tree
    self._read_assets(os.path.join(workdir, ASSETS))
    # The run's other ensemble members (sparsejax.ensemble): each its own run directory, checked as this one is.
    self.members: tuple[TrainedModel, ...] = ()
    if from_best and os.path.exists(os.path.join(workdir, ASSETS, assets.ENSEMBLE)):
      self.members = self._load_members(os.path.join(workdir, ASSETS, assets.ENSEMBLE), platform)

  def _set_network(self, tree: dict, meta: dict) -> None:
    """The network's parameters (as the run evaluated them) and sizes, from a restored state's arrays."""
    sizes = meta["data"]
    self.num_features, self.num_labels = sizes["num_features"], sizes["num_labels"]
    self.max_features, self._num_train = sizes["max_features"], sizes["num_train"]
    # A single-process run's training index: an LSH run's hash functions and table sizes serve sampled prediction
    # (a sharded run's are per process: not used). Checkpoints of both layouts (sparsejax.index.saved).
    self._training_index = saved.index_tree(tree) if meta.get("num_shards", 1) == 1 else None
    self.params = restore.network_params(tree, self.num_labels, self.config.optim.average_steps)

  def _read_assets(self, directory: str) -> None:
    """The run's label names, vectorizer, centroid fusion and label frequencies, checked against the model."""
    self.label_names = assets.read_label_names(directory, self.num_labels)
    # Checked now (a fixed schema: see load_vectorizer), built at the first text: scikit-learn's import is most of
    # sparsejax-predict's start-up, and feature-row inputs never need it.
    self._saved_vectorizer, self._vectorizer = assets.read_saved_vectorizer(directory, self.num_features), None
    # The run's centroid fusion (sparsejax.fusion): applied to every prediction, as its final evaluation did.
    self._fusion = assets.read_fusion(directory, self.num_labels, self.num_features)
    self._frequencies = assets.read_frequencies(directory, self.num_labels)

  def _load_members(self, recorded: str, platform: str) -> tuple["TrainedModel", ...]:
    """The ensemble's other members that ``recorded`` (the assets' ensemble file) names, each checked to be the
    one trained with this run."""
    entries = assets.read_ensemble(recorded)
    members = tuple(TrainedModel(assets.member_directory(self._workdir, m["directory"], recorded), platform=platform)
                    for m in entries)
    restore.check_members(entries, members, recorded, self.num_features, self.num_labels)
    return members

  def __repr__(self) -> str:
    """What the model is and where it came from: its sizes, its checkpoint and its work directory."""
    # The layers' widths as loaded (the input layer's, then each hidden layer's), not as configured.
    hidden = (int(self.params.embed.w.shape[1]), *(int(w.shape[1]) for w, _ in self.params.hidden))
    return (f"TrainedModel(workdir={self._workdir!r}, step={self.step}, selected_by={self.selected_by!r}, "
            f"model={self.config.network.model!r}, features={self.num_features}, hidden_dims={hidden}, "
            f"labels={self.num_labels}, named_labels={self.label_names is not None}, "
            f"text_input={self.text_input}" + (f", ensemble_members={1 + len(self.members)}" if self.members else "")
            + ")")

  @property
  def text_input(self) -> bool:
    """Whether the model reads texts (its dataset's vectorizer came with it), without building the vectorizer."""
    return self._saved_vectorizer is not None

  @property
  def vectorizer(self):
    """The fitted text vectorizer (a scikit-learn ``TfidfVectorizer``, built at the first use), or None."""
    if self._vectorizer is None and self._saved_vectorizer is not None:
      self._vectorizer = vectorizer_from_saved(self._saved_vectorizer)
    return self._vectorizer

  @property
  def run_id(self) -> str | None:
    """The run's identity, which its seals name (None: a run of an older sparsejax, unsealed)."""
    return self._run_id

  @property
  def workdir(self) -> str:
    """The work directory the model was loaded from."""
    return self._workdir

  def save(self, directory: str) -> str:
    """Copies what serving this model needs into a new directory, which :func:`load` opens as it opens a run's
    (:func:`sparsejax.serving.model_copy.save`: the newest checkpoint, the state loaded, the assets, the ensemble's
    members, ``config.json``; written whole or not at all). Loaded by its step, the model is opened again with
    ``load(directory, step=model.step)``.

    Args:
      directory: a path that does not exist yet, or an empty directory.

    Returns:
      The directory's absolute path.
    """
    return model_copy.save(self._workdir, self.step if self.selected_by == "step" else None, directory,
                           lambda member, target: TrainedModel(member).save(target))

  def features(self, inputs) -> XCDataset:
    """``inputs`` as feature rows: an XCDataset (as is), a scipy sparse ``[n, F]`` matrix, or texts (one string:
    one text, one row; :func:`sparsejax.serving.inputs.feature_rows`)."""
    return inputs_lib.feature_rows(inputs, self.num_features, self.num_labels,
                                   (lambda: self.vectorizer) if self.text_input else None)

  @functools.cached_property
  def _model_config(self):

    return ModelConfig.from_config(self.config, self.num_features, self.num_labels)

  @functools.cached_property
  def _inference_state(self):
    """The state that sampled prediction queries: the serving index of the output rows (kept by the run, else
    built on first use)."""

    if not model_kinds.of(self.config).sampled:
      raise ValueError("sampled prediction (k) needs a SLIDE model; this one was trained with "
                       f"--model={self.config.network.model} (full softmax): predict over all labels (k=None)")

    saved_index = None
    if self._training_index is not None:  # the run's own (LSH: hash functions), for the index its evaluations queried
      saved_index = index.from_config(self._model_config).from_arrays(self._training_index)
    return jax.jit(model.inference_state, static_argnames="config")(
        self.params, config=self._model_config, kept_index=self._kept_serving_index, saved_index=saved_index)

  @property
  def serving_index_kept(self) -> bool:
    """Whether the run kept the serving index of this model's step: sampled prediction need not build it."""
    return self._kept_serving_index is not None

  @functools.cached_property
  def _kept_serving_index(self):
    """The serving index the run kept for this model's step (see :func:`sparsejax.serving.assets.save_serving_index`),
    or None."""
    return assets.read_serving_index(os.path.join(self._workdir, ASSETS), self.step, self.num_labels,
                                     self.params.out.w.shape[1])

  def network_predictor(self, top: int, k: int | None = None, with_sampled: bool = False):
    """The network's ranking without the centroid fusion, for :class:`sparsejax.evaluation.Evaluator`:
    ``predict(params, fi, fv) -> (scores, ids, sampled_ids or None)``: exact top ``top`` (sampled among ``k``
    index candidates if ``k``), and with ``with_sampled`` also the sampled ids at the serving k; an ensemble's
    rankings merged (:func:`sparsejax.ensemble.merge_top`: each member's best ``max(top,
    sparsejax.fusion.CANDIDATES)``, the labels the fused re-ranking takes, mean logits)."""
    if not self.members:
      return self._network_fn(top, k, with_sampled)

    models = (self, *self.members)
    listed = max(top, min(fusion.CANDIDATES, k or self.num_labels, self.num_labels))
    exact = [m._network_fn(listed, k) for m in models]
    # The sampled ranking with its logits: each member's own index candidates, at its serving k.
    sampled = [m._network_fn(min(listed, m._model_config.serving_k), m._model_config.serving_k)
               for m in models] if with_sampled else None

    def merged(fns, params, fi, fv, width):
      outs = [fn(p, fi, fv) for fn, p in zip(fns, (params, *(m.params for m in self.members)))]
      return ensemble.merge_top([o[0] for o in outs], [o[1] for o in outs], width)

    def predict(params, fi, fv):
      scores, ids = merged(exact, params, fi, fv, top)
      return scores, ids, None if sampled is None else merged(sampled, params, fi, fv, top)[1]
    return predict

  def _network_fn(self, top: int, k: int | None = None, with_sampled: bool = False):
    """:meth:`network_predictor` of this network alone, compiled once per (top, k, with_sampled)."""
    # The cache is the model's own: one shared by all models (functools.lru_cache on the method) had an ensemble's
    # members evict each other's compiled functions, and kept every model it had served alive.
    if "_network_fns" not in self.__dict__:
      self._network_fns = functools.lru_cache(maxsize=8)(self._compile_network_fn)
    return self._network_fns(top, k, with_sampled)

  def _compile_network_fn(self, top: int, k: int | None, with_sampled: bool):


    exact = jax.jit(functools.partial(inference.predict_exact, top=top))
    if k is None and not with_sampled:
      return lambda params, fi, fv: (*map(np.asarray, exact(params, fi, fv)), None)
    state = self._inference_state
    sampled = jax.jit(functools.partial(inference.predict_sampled, config=self._model_config, top=top, k=k))
    if k is not None:
      return lambda params, fi, fv: (*map(np.asarray, sampled(state, fi, fv)), None)
    return lambda params, fi, fv: (*map(np.asarray, exact(params, fi, fv)), np.asarray(sampled(state, fi, fv)[1]))

  def predict(self, inputs, top: int = 5, batch_size: int | None = None,
              k: int | None = None, fusion: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The ``top`` best labels of each input: over all N outputs, or over ``k`` candidates from the index.

    Args:
      inputs: an XCDataset, a scipy sparse ``[n, F]`` matrix, or texts (when the model has a vectorizer; one
        string is one text).
      top: labels per input (at most N, and at most ``k``).
      batch_size: inputs per call (one compiled shape); an input too wide for ``batch_size`` of it to stay
        within :data:`sparsejax.evaluation.PADDED_ELEMENTS` padded features goes in a smaller call of its own.
        None: as many as keep a call's temporaries within the run's ``--eval_memory_mb`` (at most 1,024;
        :func:`sparsejax.inference.rows_within`: sampled inference over many candidates takes fewer).
      k: None: exact (every output scored). An int: sampled inference, as the run's ``sampled_p@k`` measured it:
        each input's ``k`` best candidates from the serving index (kept by the run, else built from the output
        rows on the first such call) are scored, and the top ``top`` of them returned. Faster than exact where
        ``k`` is a small share of N; a SLIDE model's only (not ``--model=dense``'s).
      fusion: the run's centroid fusion (:attr:`fusion_weight`, :mod:`sparsejax.fusion`), as its final evaluation
        ranked; False: the network's own ranking and logits.

    Returns:
      ``(scores [n, top] float32, ids [n, top] int32)``, best first; scores are the output layer's logits, plus
      ``fusion_weight`` times the centroid score for the fused candidates.
    """
    inputs_lib.check_prediction(top, k, batch_size, self.num_labels)
    if isinstance(inputs, Sequence) and not isinstance(inputs, str) and len(inputs) == 0:
      return np.zeros((0, top), np.float32), np.zeros((0, top), np.int32)  # no texts (a vectorizer refuses none)
    data = self.features(inputs)
    if len(data) == 0:
      return np.zeros((0, top), np.float32), np.zeros((0, top), np.int32)
    batch_size = batch_size or self._rows_per_call(() if k is None else (k,))
    scores, ids, _ = predict_in_batches(self._fused(top, k) if fusion else self.network_predictor(top, k), self.params,
                                        data, len(data), self.config.data.max_features, batch_size)
    return scores, ids

  @functools.cache  # noqa: B019 (a model is loaded once and kept: the count compiles programs)
  def _rows_per_call(self, ks: tuple[int, ...]) -> int:
    """Inputs per call of a prediction that scores ``ks`` candidates from the index (none: exact only) within the
    run's ``--eval_memory_mb`` (:func:`sparsejax.inference.rows_within`)."""
    return inference.rows_within(self._model_config, self.config.run.eval_memory_mb << 20, ks)

  @property
  def fusion_weight(self) -> float:
    """The weight of the labels' centroids in the ranking (:mod:`sparsejax.fusion`): 0 where the run chose none
    or fused nothing (no validation split, ``--nocentroid_fusion``, or a run of an older sparsejax)."""
    return 0.0 if self._fusion is None else self._fusion.weight

  @property
  def ranker_weight(self) -> float:
    """The weight of the head rankers' log-odds in the ranking (:mod:`sparsejax.head_rankers`): 0 where the run
    chose none or fitted none."""
    return 0.0 if self._fusion is None or self._fusion.rankers is None else self._fusion.ranker_weight

  def use_fusion(self, fused: "fusion.Fusion") -> None:
    """Ranks with this fusion from now on (:mod:`sparsejax.fusion`): what a run that just chose and saved it
    (:func:`sparsejax.serving.assets.save_fusion`) would load back."""
    self._fusion = fused

  def _fused(self, top: int, k: int | None = None, with_sampled: bool = False):
    """:meth:`network_predictor`'s ``predict`` with the run's centroid fusion: the network's best
    :data:`sparsejax.fusion.CANDIDATES` (at most ``k``) re-ranked by their fused scores, then (``top`` larger) the
    network's next ones in its order, with their logits."""
    if self._fusion is None or not self._fusion.active:
      return self.network_predictor(top, k, with_sampled)

    wide = self.network_predictor(max(top, min(fusion.CANDIDATES, k or self.num_labels, self.num_labels)), k,
                            with_sampled)

    def predict(params, fi, fv):
      scores, ids, sampled = wide(params, fi, fv)
      return (*fusion.fused_top(self._fusion, scores, ids, fi, fv, top),
              None if sampled is None else sampled[:, :top])
    return predict

  def evaluate(self, dataset, num_samples: int | None = None, *, sampled: bool = True,
               labels=None) -> dict[str, float]:
    """P@k, nDCG@k and PSP@k on ``dataset``, as the training run computes them.

    On the run's test set this reproduces its final evaluation (of the state :func:`load` selects): the exact
    metrics, and for a SLIDE model with ``sampled`` the ``sampled_*`` ones at the training k, from the serving
    index the run kept (a sharded run's: its shards' indexes merged, probed as the shards probed theirs).

    Args:
      dataset: labelled samples, an XCDataset; or a sparse ``[n, F]`` feature matrix with ``labels``.
      num_samples: the first samples evaluated (None: all).
      sampled: also the ``sampled_*`` metrics (a SLIDE model's).
      labels: the labels of a feature matrix ``dataset``, as :func:`sparsejax.fit` takes them: a sparse indicator
        matrix ``[n, N]``, label-id lists or one id per sample (:func:`sparsejax.data.from_arrays`).
    """
    dataset = inputs_lib.labelled_samples(dataset, labels, self.num_features, self.num_labels)
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer))
                                    or num_samples < 1):
      raise ValueError(f"num_samples must be an integer >= 1 or None (all), got {num_samples!r}")
    propensity = metrics.propensity_scores(self._frequencies, self._num_train, self.config.run.propensity_a,
                                           self.config.run.propensity_b)
    with_sampled = sampled and model_kinds.of(self.config).sampled
    evaluator = Evaluator(self.features(dataset), propensity, self.config.data.max_features,
                          self._rows_per_call((self._model_config.serving_k,) if with_sampled else ()))  # one shape
    return evaluator(self._fused(min(5, self.num_labels), with_sampled=with_sampled), self.params, num_samples)

  def names(self, ids: np.ndarray) -> np.ndarray:
    """Label names of ``ids`` (the ids as strings where the dataset has no names)."""
    ids = np.asarray(ids)
    outside = (ids < 0) | (ids >= self.num_labels)
    if outside.any():  # -1 named the last label (numpy's negative index), N + 5 was "N + 5" or an IndexError
      raise ValueError(f"names: label ids must be in [0, {self.num_labels}), got {ids[outside].flat[0]}")
    if self.label_names is None:
      return ids.astype(str)
    return np.asarray(self.label_names, dtype=object)[ids]


def load(workdir: str, step: int | None = None, platform: str = "cpu") -> TrainedModel:
  """The model trained in ``workdir``: the state its run selected on the validation split (the one its final
  evaluation reports), else its newest checkpoint; or checkpoint ``step``. Its network runs on ``platform``
  (JAX pinned to it, as :func:`sparsejax.fit` pins it: see :class:`TrainedModel`)."""
  return TrainedModel(workdir, step, platform)
