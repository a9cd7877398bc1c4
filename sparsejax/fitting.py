"""``sparsejax.fit(X, Y)``: training on in-memory matrices, from a notebook or a script (the module is not named
fit: ``sparsejax.fit`` is the function).

::

  import sparsejax
  model = sparsejax.fit(X_train, Y_train, max_seconds=60)   # scipy CSR features; labels: indicator or id lists
  scores, ids = model.predict(X_test, top=5)
  model.evaluate(X_test, labels=Y_test)["p@1"]

It is ``sparsejax-train`` on matrices: the settings by the same names (``hidden_dims=(512,)``, ``max_seconds=60``,
``recipe="wide"``), checked the same way before anything is trained, the same training
(:func:`sparsejax.train.train_and_evaluate`, a recipe search included), the same log lines on stderr, the same work
directory (checkpoints, ``metrics.jsonl``, ``config.json``, ``assets/``), and the model that :func:`sparsejax.load`
returns for that directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from sparsejax import platforms, rundirs
from sparsejax.config import Config
from sparsejax.data import LoadedData, XCDataset, train_test_split
from sparsejax.data.arrays import features, label_count, label_rows
from sparsejax.netanalysis.collect import StepProfiler
from sparsejax.serving.model import TrainedModel
from sparsejax.settings import ConfigError, did_you_mean, field_type, iter_fields, override
from sparsejax.train import compilation_cache, driver, recipes
from sparsejax.train.console import log_to_console
from sparsejax.train.stopping import Interrupted

# fit's own arguments (named in the suggestions for a misspelt setting), and the settings it sets itself.
_ARGUMENTS = ("X", "Y", "X_val", "Y_val", "workdir", "num_labels", "label_names", "verbose", "platform",
              "compilation_cache")
_DATA_SETTINGS = ("dataset", "train_file", "test_file")
RUN_NAME = "fit"  # new work directories: RUNS/<UTC start>-fit


def fit(X: Any, Y: Any, *, X_val: Any = None, Y_val: Any = None, workdir: str | os.PathLike | None = None,
        num_labels: int | None = None, label_names: Sequence[str] | None = None, verbose: bool = True,
        platform: str = "cpu", compilation_cache: str | os.PathLike | None = "auto", **settings: Any) -> TrainedModel:
  """Trains a network on ``X`` and ``Y`` and returns it, as ``sparsejax.load`` would load it.

  The run is the one ``sparsejax-train`` makes of the same data and settings (its records say
  ``--dataset=arrays``): ``validation_fraction`` of the training rows are held out to select the state reported
  and returned (and for early stopping); the final evaluation scores ``X_val`` (else ``test_fraction`` of the rows,
  held out by a split seeded by ``seed``, as for the built-in datasets). Called again with the same ``workdir``, data
  and settings, it continues that run from its newest checkpoint (or, finished, returns it as it is).

  Args:
    X: features, a scipy sparse ``[n, F]`` matrix (CSR, or anything ``scipy.sparse.csr_matrix`` takes); finite
      values, negative ones allowed.
    Y: labels of the ``n`` samples: a sparse indicator matrix ``[n, L]`` (1 where a sample has a label), ``n``
      lists of label ids (``[[3, 17], [5], ...]``) or ``[n]`` label ids (one per sample). Every sample needs a label.
    X_val: ``[m, F]`` held-out samples for the final evaluation (the run's test set); with ``Y_val``.
    Y_val: their labels, in any form ``Y`` takes.
    workdir: the run's directory; default: a new one, ``~/sparsejax/runs/<UTC start>-fit`` (``$SPARSEJAX_RUNS``
      where set), named in the first log line and on the model (``model.workdir``).
    num_labels: ``L`` for label ids (default: the largest id in ``Y`` and ``Y_val`` + 1; an indicator matrix's
      width otherwise).
    label_names: ``[L]`` names of the labels, for ``model.names(ids)``.
    verbose: show the log lines ``sparsejax-train`` shows on stderr (work directory, settings, progress every
      ``log_every`` steps, evaluations, the final evaluation); False leaves absl's logging as the caller set it up.
    platform: where the network runs, as ``sparsejax-train --platform``: ``"cpu"`` (SLIDE's kernels are CPU code),
      or ``"cuda"`` / ``"rocm"`` for ``model="dense"``. Where JAX has not started yet in this process, it starts on
      this platform only (as the command sets ``JAX_PLATFORMS``), so a machine whose JAX defaults to a GPU trains
      on its CPUs; where JAX already runs on another platform, fit refuses to start, saying so.
    compilation_cache: JAX's persistent compilation cache, as ``sparsejax-train --compilation_cache``: ``"auto"``
      (``$JAX_COMPILATION_CACHE_DIR``, else a private per-user directory), a directory, or ``"none"`` (or None): off.
      A second fit of the same shapes, in this process or another, then starts without compiling. It stays so for
      the rest of the process.
    **settings: :class:`sparsejax.config.Config` settings by their flag names (``sparsejax-train --help`` lists
      them): ``max_seconds=60``, ``max_steps=500``, ``hidden_dims=(512,)``, ``recipe="wide"``, ``seed=1`` ...

  Returns:
    The trained model: ``predict(X, top=k)`` (scores and label ids ``[n, k]``), ``evaluate(X, labels=Y)`` (P@k,
    nDCG@k, PSP@k), ``names(ids)``, ``workdir``. The state selected on the validation split, else the last.

  Raises:
    TypeError: a setting that does not exist (with the names meant, as the command line suggests them), or
      arguments of the wrong kind (named).
    ValueError: data that cannot be trained on, naming the argument (and the row): mismatched shapes, a value
      that is not finite, an unlabelled sample, a label id out of range ...; a
      :class:`sparsejax.settings.ConfigError` (a ValueError) for a setting's value, worded as the command line words
      it (``--hidden_dims=0: must be >= 1``).
    ResumeError: ``workdir`` holds a run of other settings or data (``resume="force"`` continues it anyway where the
      shapes allow).

  Example::

    import scipy.sparse, sparsejax
    from sparsejax.data import make_synthetic

    data = make_synthetic(2000, 500, 100, seed=0)     # or your own CSR matrices
    X = scipy.sparse.csr_matrix((data.values, data.indices, data.indptr), shape=(len(data), 500))
    Y = [data.label_indices[a:b].tolist() for a, b in zip(data.label_indptr[:-1], data.label_indptr[1:])]
    model = sparsejax.fit(X[:1800], Y[:1800], X_val=X[1800:], Y_val=Y[1800:], max_steps=200)
    scores, ids = model.predict(X[1800:], top=5)     # [200, 5] each, best first
  """
  config = _config(settings)
  platforms.pin(platform, config.network.model, "fit")
  data = _data(X, Y, X_val, Y_val, num_labels, label_names, config)
  cache_problem = _use_compilation_cache(compilation_cache)


  new_run = workdir is None
  workdir = rundirs.new_run_directory(RUN_NAME) if new_run else os.path.expanduser(os.fspath(workdir))
  try:
    with log_to_console() if verbose else contextlib.nullcontext():
      if cache_problem:
        logging.warning("%s", cache_problem)
      if X_val is not None and "test_fraction" in settings:
        logging.warning("--test_fraction=%s has no effect: X_val is the test set", settings["test_fraction"])
      driver.train_and_evaluate(config, workdir, data=data, verbose=verbose, step_observer=StepProfiler.from_config)
  except Interrupted as e:  # Ctrl-C (a notebook's interrupt): say how to continue in Python, not on a command line
    e.args = (e.describe(how_to_continue=f"fit(...) with workdir={workdir!r} and the same data and settings "
                         "continues the run"),)
    raise
  except BaseException:
    if new_run:  # refused or stopped before writing anything: no empty directory left behind
      with contextlib.suppress(OSError):
        os.rmdir(workdir)
    raise
  return TrainedModel(workdir, platform=platform)


def _use_compilation_cache(setting: str | os.PathLike | None) -> str | None:
  """JAX's persistent compilation cache as ``--compilation_cache=setting`` sets it; why a directory named cannot be
  used, or None."""

  _, problem = compilation_cache.configure(compilation_cache.NONE if setting is None else os.fspath(setting))
  jax_cache.reset_cache()  # JAX decides on its cache once, at its first compilation: from now on, these settings
  return problem


def _config(settings: dict[str, Any]) -> Config:
  """The run's config: ``settings`` over the defaults, as ``sparsejax-train`` reads its flags; checked."""
  fields = {field.name: field for _, field in iter_fields(Config)}
  for name, value in settings.items():
    if name in _DATA_SETTINGS:
      raise ConfigError(name, value, "fit trains on the matrices it is given (X, Y, X_val, Y_val)")
    if name not in fields:
      raise TypeError(f"fit() got an unknown setting {name!r}{did_you_mean(name, [*fields, *_ARGUMENTS])}")
  values = {name: _as_setting(fields[name], value) for name, value in settings.items()}
  config = override(Config(), dataset="arrays", **values)
  # A recipe setting given counts as given, at its default value too (--hidden_dims=128 skips the search).
  return recipes.with_given_settings(config, set(settings)).validate()


def _as_setting(field: dataclasses.Field, value: Any) -> Any:
  """``value`` as the command line would have parsed it: numpy scalars as Python numbers, one integer as a list
  setting's one element (``hidden_dims=512`` as ``--hidden_dims=512``)."""
  if isinstance(value, np.generic):
    value = value.item()
  elif isinstance(value, np.ndarray):
    value = tuple(value.tolist())
  if typing.get_origin(field_type(field)[0]) is tuple and isinstance(value, int) and not isinstance(value, bool):
    return (value,)
  return value


def _data(X, Y, X_val, Y_val, num_labels, label_names, config: Config):
  """The run's train and test sets (``X_val``, else ``test_fraction`` of ``X``'s rows), checked."""
  if (X_val is None) != (Y_val is None):
    given, missing = ("X_val", "Y_val") if Y_val is None else ("Y_val", "X_val")
    raise TypeError(f"{given} is given without {missing}: the held-out samples need both")
  x = features(X, "X")
  labels = [("Y", label_rows(Y, x.shape[0], "Y"))]
  if X_val is not None:
    x_val = features(X_val, "X_val")
    if x_val.shape[1] != x.shape[1]:
      raise ValueError(f"X_val: has {x_val.shape[1]} columns (features); X has {x.shape[1]}")
    labels.append(("Y_val", label_rows(Y_val, x_val.shape[0], "Y_val")))
  count = label_count(labels, num_labels)
  if label_names is not None:
    label_names = tuple(label_names) if not isinstance(label_names, str) else label_names
    if isinstance(label_names, str) or not all(isinstance(n, str) for n in label_names):
      raise TypeError("label_names: give one string per label")
    if len(label_names) != count:
      raise ValueError(f"label_names: has {len(label_names)} names for {count} labels")
    if any("\n" in n for n in label_names):
      raise ValueError("label_names: a name holds a line break (the model keeps them one per line)")

  def dataset(features_, rows) -> XCDataset:
    return XCDataset(features_.indptr, features_.indices, features_.data, rows.indptr, rows.indices,
                     features_.shape[1], count)

  train = dataset(x, labels[0][1])
  if X_val is None:
    train, test = train_test_split(train, config.data.test_fraction, seed=config.run.seed)
  else:
    test = dataset(x_val, labels[1][1])
  return LoadedData(train, test, label_names)
