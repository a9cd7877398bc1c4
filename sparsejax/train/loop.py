"""``train_and_evaluate(config, workdir)``: the training loop of a SLIDE network or its dense baseline.

It validates the config and the work directory, loads the data
(:func:`sparsejax.data.load_dataset`), builds the run
(:func:`sparsejax.distributed.sharding.make_run`: one process or several, SLIDE or
dense), resumes from the newest checkpoint when it continues the same run
(:mod:`sparsejax.train.checkpoint`), trains until the budget is spent or a signal
asks it to stop (:mod:`sparsejax.train.stopping`), evaluating
(:mod:`sparsejax.train.evaluation`) and writing metrics
(:mod:`sparsejax.train.metric_writer`) on the way, and returns the final
evaluation. A resumed run continues exactly as an uninterrupted one would.

Files in ``workdir``: ``metrics.jsonl``, ``checkpoints/``, ``search/`` (a recipe search's candidates), ``config.json``
(written once the run has started or resumed), ``assets/`` (label names,
vectorizer: what :func:`sparsejax.load` needs) and, if asked for,
``tensorboard/``.
"""

import dataclasses
import functools
import json
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from sparsejax import averaging, dense, fusion, memory, model, retrieval
from sparsejax.config import MIN_STALE_EVALUATIONS, NOISE_MARGIN, Config, ConfigError, DataConfig, override
from sparsejax.data import BatchIterator, LoadedData, load_dataset, train_test_split
from sparsejax.data.batching import bucket_widths
from sparsejax.distributed import sharding
from sparsejax.model_config import ModelConfig
from sparsejax.netanalysis.collect import StepProfiler
from sparsejax.shard import shard_rows
from sparsejax.train import checkpoint, compile_clock, members, recipes, seals, search, trained
from sparsejax.train.console import Progress, final_line, log_settings, log_to_console
from sparsejax.train.evaluation import Evaluator
from sparsejax.train.metric_writer import METRICS_FILE, MetricWriter, read_records
from sparsejax.train.nonfinite import NonFiniteError, NonFiniteWatch
from sparsejax.train.stopping import Interrupted, StopRequests

# Final-record fields that describe the run rather than a point of a curve.
_SUMMARY_FIELDS = ("step", "epoch", "last_loss", "samples_per_sec", "seconds", "train_seconds", "budget_seconds",
                   "num_params", "final",
                   "num_processes", "last_step", "selected_step", "selected_by", "stopped_by", "bad_evaluations",
                   "improved_step", "stale_evaluations", "recipe", "search_seconds", "search_wall_seconds",
                   "search_scores", "fusion_weight", "fusion_validation")


def train_and_evaluate(config: Config, workdir: str, *, data: LoadedData | None = None,
                       verbose: bool = False) -> dict[str, Any]:
  """Trains and evaluates; continues the run in ``workdir`` if it holds one.

  A fresh run with ``--recipe=auto`` first compares the network recipes on the validation split within part of
  the budget (:mod:`sparsejax.train.search`) and trains the winner on; a named recipe's settings apply where the config
  has the defaults (:mod:`sparsejax.train.recipes`); a continued run keeps the recipe its checkpoints record.

  Args:
    config: the run (validated here, before any data is loaded).
    workdir: output directory (created).
    data: the train and test sets (:func:`sparsejax.fit` gives its matrices so, with ``--dataset=arrays``); None:
      those that ``config.data`` names, loaded here.
    verbose: show the log lines ``sparsejax-train`` shows (the work directory, the settings, progress, evaluations,
      the final evaluation) on stderr, for a caller outside ``absl.app``
      (:func:`sparsejax.train.console.log_to_console`).
      False: logging as the caller set it up (absl's logger, which shows only warnings unless set up).

  Returns:
    The final evaluation on the test set (exact and sampled P@k, nDCG@k, PSP@k) of the selected state (the
    best on the validation split when there is one, else the last) with ``step`` (the selected one),
    ``last_step``, ``samples_per_sec``, ``train_seconds`` and ``num_params``. For a run that had already
    finished, its recorded final evaluation. An ensemble's (``--ensemble_members``) is the merged ranking's
    evaluation with ``ensemble_members``; ``num_params``, ``train_seconds`` and ``samples_per_sec`` are the members'
    together, and what only the first network measured (its test P@k, retrieval diagnostics, index fill, validation
    score, last loss) is named ``member0_*`` (:func:`sparsejax.train.members.evaluate`).

  Raises:
    ConfigError: an invalid setting or an unwritable work directory (before anything is loaded).
    NonFiniteError: a NaN or Inf loss or update (``--on_nonfinite``); the checkpoints on disk are finite.
    ResumeError: ``workdir`` holds checkpoints of another run.
    Interrupted: SIGINT or SIGTERM stopped the run (after saving a checkpoint).
  """
  if verbose:
    with log_to_console():
      logging.info("work directory: %s", workdir)
      log_settings(config)
      final = train_and_evaluate(config, workdir, data=data)
      logging.info("%s", final_line(final, workdir))
      return final
  config.validate()
  t_invocation, search_wall_seconds = time.time(), 0.0
  # A run stopped while it took over its search's winner finishes that first (the search runs in one process; a
  # refused --resume=never changes nothing); a run continued after its search reports it. --max_seconds counts
  # this invocation's training: the search's seconds were charged to the invocation that searched.
  search_summary = None
  if config.search.recipe == recipes.AUTO and config.checkpoint.resume != "never" and jax.process_count() == 1:
    search_summary = search.finish_adoption(workdir)
  if config.search.recipe in recipes.names():
    config = recipes.apply(config, recipes.get(config.search.recipe))
  # A run continued takes the recipe its checkpoints record (_train).
  elif config.search.recipe == recipes.AUTO and not _holds_checkpoints(workdir):
    why_not = search.reason_not_to_search(config, jax.process_count())
    interrupted_search = os.path.isdir(os.path.join(workdir, search.SEARCH_DIR))
    if why_not is None and config.checkpoint.resume == "never" and interrupted_search:
      raise checkpoint.ResumeError(f"{os.path.join(workdir, search.SEARCH_DIR)} holds an interrupted recipe search "
                                   "and --resume=never: use another --workdir for a new run (or --resume=auto to "
                                   "continue it)")
    if why_not is None:
      with checkpoint.new_directories_removed_on_failure(workdir):
        checkpoint.check_writable(workdir)
        read_records(workdir)
        data = data if data is not None else _load_data(config)
        chosen = search.run(config, workdir, _data_shape(config, data.train),
                            functools.partial(_train, data=data), functools.partial(_append_record, workdir))
      if chosen is not None:
        config, search_summary = chosen
        # The search's wall time, measuring, compiling and evaluating included, counts against --max_seconds (the
        # startup of its first training aside: a run without a search spends it as well).
        search_wall_seconds = search_summary["search_wall_seconds"]
        config = _charged_for_search(config, search_wall_seconds)
    else:
      logging.info("recipe: the defaults, no search (%s)", why_not)
  final = _train(config, workdir, data=data, search_summary=search_summary)
  final = _with_members(config, workdir, data, final)
  _log_budget(config, final, search_wall_seconds, time.time() - t_invocation)
  return final


def _log_budget(config: Config, final: dict[str, Any], search_wall_seconds: float, total: float) -> None:
  """Logs what this invocation's seconds went to: those that --max_seconds counts (the search, the training and its
  evaluations, the ensemble's members) and the rest (loading, compiling, the final evaluations)."""
  if final.get("budget_seconds") is None:  # a finished run's record, returned as it was
    return
  counted = search_wall_seconds + final["budget_seconds"]
  budget = config.budget.max_seconds
  logging.info("seconds: %.1f counted against the budget%s (search %.1f, training and evaluations %.1f), %.1f "
               "besides (loading, compiling, final evaluation); %.1f in all", counted,
               f" of {budget + search_wall_seconds:.0f}" if budget is not None else "", search_wall_seconds,
               final["budget_seconds"], total - counted, total)


def _with_members(config: Config, workdir: str, data: LoadedData | None, final: dict[str, Any]) -> dict[str, Any]:
  """``final``, or the ensemble's final record where the run trains more members (:mod:`sparsejax.train.members`)."""
  if "ensemble_members" in final:  # a finished run's recorded ensemble
    return final
  why_not = members.reason_not_to_train(config, final, jax.process_count())
  if why_not is not None:
    if config.search.ensemble_members > 1:
      logging.info("ensemble: one network (%s)", why_not)
    return final
  # The first member's settings as it trained them (the recipe its search or checkpoints chose), with this
  # invocation's budget.
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    trained_config = override(Config.from_dict(json.load(f)), max_seconds=config.budget.max_seconds,
                              ensemble_members=config.search.ensemble_members)
  data = data if data is not None else _load_data(trained_config)
  validation_seed = _validation_seed(trained_config)
  done = members.train(trained_config, final, workdir, functools.partial(_train, data=data), validation_seed)
  if not done:
    # Recorded as a run of one network, as a formed ensemble is recorded: a rerun neither loads the data nor tries
    # the members again (with its budget counted afresh: a member the clock stopped would train on).
    final = {**final, "ensemble_members": 1}
    _append_record(workdir, final)
    return final
  train, validation = train_test_split(data.train, trained_config.data.validation_fraction, seed=validation_seed)
  record = members.evaluate(trained_config, final, workdir, done, (train, validation, data.test))
  _append_record(workdir, record)
  logging.info("final (ensemble of %d, test set): P@1 %.4f  P@3 %.4f  P@5 %.4f", record["ensemble_members"],
               record["p@1"], record["p@3"], record["p@5"])
  return record


def _train(config: Config, workdir: str, *, data: LoadedData | None = None, evaluate_test: bool = True,
           search_summary: dict | None = None, validation_seed: int | None = None) -> dict[str, Any]:
  """:func:`train_and_evaluate` with a recipe chosen. ``data``: the loaded dataset (None: loaded here);
  ``evaluate_test=False`` (a search's candidate, an ensemble's member) ends with the validation score instead of
  the test set's evaluation: ``{"score": best validation metric, "step", "train_seconds", "samples"}``
  (``samples``: those this invocation trained); ``validation_seed``:
  the seed of the validation split (None: ``--seed`` + 1; an ensemble's members take the first member's)."""
  for line in config.unused_settings():
    logging.warning(line)
  num_shards = config.dist.num_shards or jax.process_count()
  # The shards are the job's processes (one process: its devices); checked here, where the job is known.
  devices = jax.process_count() if jax.process_count() > 1 else jax.device_count()
  if num_shards > devices:
    raise ConfigError("num_shards", num_shards, f"this job has {devices} process(es) to split the output layer "
                      f"over: start {num_shards} (sparsejax-launch -n {num_shards} ...), or give none")
  _check_interface(config)
  if config.network.model == "dense" and config.optim.batch_size % num_shards:
    raise ConfigError("batch_size", config.optim.batch_size,
                      f"data-parallel training splits each batch over {num_shards} processes: must divide by it")
  # A start refused here (bad data, other shapes) leaves no empty work directory behind.
  with checkpoint.new_directories_removed_on_failure(workdir, os.path.join(workdir, "checkpoints")):
    checkpoint.check_writable(workdir)
    read_records(workdir)  # another program's metrics.jsonl is named before anything in workdir is written
    checkpoint.quiet_orbax_logs()
    checkpoints = checkpoint.Checkpoints(workdir, config.checkpoint.keep_checkpoints)
    latest = checkpoints.latest_good_step()  # corrupted ones: named, set aside
    meta = None if latest is None else checkpoints.meta(latest)
    changed = []  # the settings that differ from the checkpoint's
    recorded_recipe = ((meta or {}).get("config") or {}).get("search", {}).get("recipe", recipes.AUTO)
    if config.search.recipe == recipes.AUTO and recorded_recipe in recipes.names():  # the one the search chose
      config = recipes.apply(config, recipes.get(recorded_recipe))
    if latest is not None:
      _restore_config_file(workdir, meta, latest)
      changed = checkpoint.check_resume(meta, latest, config, num_shards, workdir)
      finished = _recorded_final(workdir, config, latest, meta)
      if finished is not None:
        return finished

    data = data if data is not None else _load_data(config)
    train, test, validation = data.train, data.test, None
    if len(test) == 0:
      name = "test_file" if config.data.dataset == "files" else "test_fraction"
      raise ConfigError(name, getattr(config.data, name), "the test set has no samples")
    if config.data.validation_fraction > 0:
      seed = _validation_seed(config) if validation_seed is None else validation_seed
      train, validation = train_test_split(train, config.data.validation_fraction, seed=seed)
      if len(validation) == 0:  # too few samples for the fraction: nothing to select on
        raise ConfigError("validation_fraction", config.data.validation_fraction,
                          f"holds no sample of the {len(train)} training samples: raise it, or 0 for no validation "
                          "split")
    logging.info("data: %d train / %d validation / %d test samples, %d features, %d labels", len(train),
                 0 if validation is None else len(validation), len(test), train.num_features, train.num_labels)
    steps_per_epoch = len(train) // config.optim.batch_size
    if steps_per_epoch == 0:
      raise ConfigError("batch_size", config.optim.batch_size, f"exceeds the {len(train)} training samples")
    max_steps = config.budget.max_steps_for(steps_per_epoch)
    sizes = {"num_features": train.num_features, "num_labels": train.num_labels, "num_train": len(train),
             "steps_per_epoch": steps_per_epoch,
             "max_features": config.data.max_features or max(train.max_features_per_sample(), 1),
             "max_labels": config.data.max_labels or max(train.max_labels_per_sample(), 1)}
    if meta is not None and meta["data"] != sizes and config.checkpoint.resume != "force":
      raise checkpoint.ResumeError(f"{checkpoints.directory}/{latest} was trained on other data: {meta['data']}, "
                                   f"now {sizes}. Use another --workdir for a new run")

    sized = ModelConfig.from_config(config, train.num_features, train.num_labels, num_shards)  # --num_bits=none
    config.check_table_memory(sized.lsh_config.num_bits, sized.table_bucket_size)
    _check_state_memory(config, train.num_features, train.num_labels, num_shards)
    fuse = config.run.centroid_fusion and validation is not None
    run = sharding.make_run(ModelConfig.from_config(config, train.num_features, train.num_labels),
                            seed=config.run.seed, num_shards=num_shards, top=fusion.CANDIDATES if fuse else 5,
                            sampled_ks=tuple(k for k in [config.run.eval_sampled_k] if k))
    abstract = None if latest is None else run.abstract_state()
    differences = [] if latest is None else checkpoints.shape_differences(latest, abstract)
    if differences:  # --resume=force past a setting that changes the model's shapes
      raise checkpoint.ResumeError(
          f"{checkpoints.directory}/{latest} holds a model of other shapes than these settings give ("
          + "; ".join(differences[:3]) + (f"; {len(differences) - 3} more" if len(differences) > 3 else "")
          + "): --resume=force continues a run with new settings only where they keep the model's shapes. Use "
          "another --workdir for a new run")
    restored = checkpoints.restore(abstract) if latest is not None else None
    if restored is None:
      state, position = run.init(), {"epoch": 0, "index": 0, "seconds": 0.0}
    else:
      state, position = restored
      logging.info("resumed from step %d (epoch %d, index %d)", latest, position["epoch"], position["index"])
  start_step = int(sharding.local_value(state.step))
  # The run's identity, in its checkpoints' meta and the seals of its best state and assets: kept when it resumes.
  # A run of an older sparsejax has none: its files so far are taken as they are (unverified) and sealed from now.
  unsealed_run = meta is not None and meta.get("run_id") is None
  run_id = (meta or {}).get("run_id") or seals.new_run_id()
  is_chief = jax.process_index() == 0
  if is_chief:  # only now: a refused or failed start leaves the work directory as it was
    seals.write_json_atomically(os.path.join(workdir, "config.json"), config.to_dict(), indent=1)
    trained.save_assets(workdir, data._replace(train=train), run_id)  # the samples trained on (PSP@k's propensities)
    if restored is None:
      members.remove_former(workdir)
  logging.info("%s model: %s parameters%s; %s", config.network.model, f"{model.num_params(state):,}",
               f" over {num_shards} processes" if num_shards > 1 else "",
               f"training to step {max_steps}" if max_steps is not None else "training on the clock")
  memory.advise_huge_pages(state)

  evaluator = lambda dataset: Evaluator.for_run(dataset, train, config.data.max_features, config.run.propensity_a,
                                                config.run.propensity_b)
  if "batch_size" in changed:  # --resume=force: epochs are counted in steps (not redone here: a known limitation)
    logging.warning("--batch_size changed at step %d: the epochs that metrics.jsonl records and that --num_epochs "
                    "counts are steps of the new batch size, the steps so far included", start_step)
  selection = None
  if validation is not None:
    best = checkpoint.BestCheckpoint(workdir, config.run.selection_metric, run_id=run_id)
    restored_selection = position.get("selection")
    scored_otherwise = [f"--{n}" for n in sorted(set(changed) & _SELECTION_SETTINGS)]
    if meta is not None and meta["data"] != sizes:  # --resume=force past other data
      scored_otherwise.append("the data")
    if scored_otherwise:  # the kept scores are of another validation split or metric: they do not compare
      # (a recipe search's candidate after its calibration's steps, scored on fewer samples: as expected)
      logging.log(logging.INFO if start_step <= search.CALIBRATION_STEPS else logging.WARNING,
                  "model selection starts anew at step %d: %s changed, so the best state kept so far was scored "
                  "otherwise", start_step, ", ".join(scored_otherwise))
      best.discard_after(-1)
      restored_selection = None
    else:
      # A best state newer than the checkpoint resumed from belongs to steps that are trained again now (the
      # process died between an evaluation and the next checkpoint): they will be evaluated and kept again.
      best.discard_after(start_step)
      restored_selection = _kept_selection(best, restored_selection, None if unsealed_run else run_id, start_step)
    selection = _Selection(evaluator(validation), best, config.run, restored_selection, stale_ratio(config),
                           noise_samples=min(config.run.eval_samples or len(validation), len(validation)))
  loop = _Loop(config, run, checkpoints, checkpoint.make_meta(config, num_shards, jax.process_count(), sizes, run_id),
               evaluator(test), selection,
               MetricWriter(workdir, config.run.tensorboard, resume_step=start_step) if is_chief else None,
               steps_per_epoch, max_steps, _step_profiler(config, run, workdir),
               functools.partial(trained.save_serving_index, workdir, run_id) if is_chief else None,
               # Only the final evaluation fuses: the search's candidates and the loop's evaluations score the network.
               (lambda: fusion.label_centroids(train)) if fuse else None,
               functools.partial(trained.save_fusion, workdir, run_id) if is_chief else None)
  # The sampled step's active set holds every label of a sample: a row with more labels than k trains on its first
  # k (a FOLDOC definition with 615 references stopped a k = 512 run with an error).
  max_labels = sizes["max_labels"] if sized.exact_softmax else min(sizes["max_labels"], sized.k)
  if max_labels < sizes["max_labels"]:
    cut = int(np.sum(train.label_counts() > max_labels))
    logging.warning("%d training samples have more labels than the %d active neurons (--active_k): each trains on "
                    "its first %d", cut, sized.k, max_labels)
  batches = BatchIterator(train, config.optim.batch_size, seed=config.run.seed, epoch=position["epoch"],
                          index=position["index"], max_features=sizes["max_features"], max_labels=max_labels)
  # Each batch is padded to its own bucketed widths: a new pair of widths compiles the step again (once).
  feature_widths, label_widths = bucket_widths(sizes["max_features"]), bucket_widths(max_labels)
  logging.info("batches padded to their own widths: features %s, labels %s (at most %d compiled steps)",
               feature_widths, label_widths, len(feature_widths) * len(label_widths))
  try:
    state = loop.train(state, batches, position.get("seconds", 0.0), show_progress=is_chief)
    if checkpoints.latest_step() != loop.step and not _stops_on_kept_checkpoint(loop, checkpoints, state):
      loop.save(state, batches, wait=True)
  except NonFiniteError as e:  # --on_nonfinite: say which checkpoint the run can go back to
    checkpoints.wait()
    good = checkpoints.latest_step()
    if good is not None and good == latest and not checkpoints.is_sealed(good):
      # Issue 35: a damaged checkpoint without checksums (nothing to verify it by) was blamed on the learning rate.
      where = (f". The run resumed from {checkpoints.directory}/{good}, which has no checksums to verify it by (an "
               "older sparsejax, or a crash right after its save): a damaged file there gives this error as well")
    else:
      where = (f". The newest checkpoint, {checkpoints.directory}/{good}, is finite" if good is not None
               else ". No checkpoint was saved")
    raise NonFiniteError(e.step, e.reason + where) from None
  finally:
    batches.close()
  checkpoints.wait()
  if loop.stop_signal is not None:
    raise Interrupted(loop.stop_signal, checkpoints.latest_step(), checkpoints.directory)
  if not evaluate_test:
    return loop.finish_candidate(state, start_step)
  return loop.finish(state, start_step, search_summary)


# The settings that decide what a validation score measures: the data (and so the split), the seed that draws the
# split, the metric and the samples evaluated.
_SELECTION_SETTINGS = {f.name for f in dataclasses.fields(DataConfig)} | {"seed", "selection_metric", "eval_samples"}


def _check_interface(config: Config) -> None:
  """Refuses a ``--netanalysis_iface`` that this host does not have (where the window would sample it)."""
  iface, net = config.netanalysis.netanalysis_iface, "/sys/class/net"
  if config.netanalysis.netanalysis_steps and iface != "auto" and os.path.isdir(net) and \
      not os.path.exists(os.path.join(net, iface)):
    raise ConfigError("netanalysis_iface", iface, f"no such network interface on this host (it has "
                      f"{', '.join(sorted(os.listdir(net)))})")


# A state larger than this is not saved again when a signal stops the run where a periodic checkpoint is kept: a
# 154M-parameter candidate (1.8 GB with Adam's moments) took 2.5 minutes to save and exit on SIGTERM.
QUICK_STOP_BYTES = 512 << 20
# The first steps of a run, each timed on its own (waited for): the median of those that compiled nothing bounds the
# measured step time from below. Subtracting the compilations from the wall time took too much where a run compiles a
# program per new batch width while earlier steps still run: on the suite's labels_heavy the search measured its
# candidates at 3.9-6.2 ms a step where they took 13-22 ms, and planned rounds 3x too long. Costs a few ms of overlap.
TIMED_STEPS = 20


def _stops_on_kept_checkpoint(loop: "_Loop", checkpoints: checkpoint.Checkpoints, state) -> bool:
  """Whether a run stopped by a signal exits on its newest periodic checkpoint instead of saving its state (too
  large to save in seconds); the steps after that checkpoint are trained again by the continued run, as logged."""
  kept = checkpoints.latest_step()
  if loop.stop_signal is None or kept is None:
    return False
  size = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
  if size <= QUICK_STOP_BYTES:
    return False
  logging.warning("stopping at once: the state (%.1f GiB) is not saved again; the run continues from checkpoint %d "
                  "(the %d steps after it are trained again)", size / 2**30, kept, loop.step - kept)
  return True


def _charged_for_search(config: Config, search_wall_seconds: float) -> Config:
  """``config`` with the search's wall seconds taken from ``--max_seconds`` (they count against the budget)."""
  if config.budget.max_seconds is None or not search_wall_seconds:
    return config
  return override(config, max_seconds=max(config.budget.max_seconds - search_wall_seconds, 1e-3))


def _holds_checkpoints(workdir: str) -> bool:
  directory = os.path.join(workdir, "checkpoints")
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def _load_data(config: Config) -> LoadedData:
  t_start = time.time()
  data = load_dataset(config.data, seed=config.run.seed)
  logging.info("loaded %s in %.1f s", config.data.dataset, time.time() - t_start)
  return data


def _data_shape(config: Config, train) -> search.DataShape:
  """The sizes the recipe search's step-cost model needs (of the samples trained on: less the validation split)."""
  num_train = len(train) - round(len(train) * config.data.validation_fraction)
  feature_counts, limit = np.diff(train.indptr), config.data.max_features
  mean_features = float(np.mean(np.minimum(feature_counts, limit) if limit else feature_counts)) if len(train) else 0.0
  return search.DataShape(num_train, train.num_features, train.num_labels, mean_features, len(train) - num_train)


def _append_record(workdir: str, record: dict) -> None:
  """Appends ``record`` to ``WORKDIR/metrics.jsonl`` (the recipe search's records, written between runs)."""
  if jax.process_index() == 0:
    path = os.path.join(workdir, METRICS_FILE)
    with seals.writing(path), open(path, "a") as f:
      f.write(json.dumps(record) + "\n")


def _restore_config_file(workdir: str, meta: dict | None, step: int) -> None:
  """Writes ``WORKDIR/config.json`` from checkpoint ``step``'s settings where it is missing: the messages that refuse
  other settings point to it, and a finished run, which writes nothing, would otherwise never have it again."""
  path = os.path.join(workdir, "config.json")
  if meta is None or os.path.exists(path) or jax.process_index() != 0:
    return
  seals.write_json_atomically(path, meta["config"], indent=1)
  logging.warning("%s was missing: written again from the settings of checkpoint %d", path, step)


def _recorded_final(workdir: str, config: Config, latest: int, meta: dict | None) -> dict | None:
  """The recorded final evaluation if the run in ``workdir`` has spent this config's budget, else None."""
  if meta is None:
    return None
  max_steps = config.budget.max_steps_for(meta["data"]["steps_per_epoch"])
  # A final record names the last step trained in "last_step" and the selected (reported) one in "step".
  finals = [r for r in read_records(workdir) if r.get("final") and r.get("last_step", r["step"]) == latest]
  if not finals:
    return None
  final = finals[-1]
  if final.get("stopped_by") == "early_stopping":
    patience, ratio = config.run.early_stopping_patience, stale_ratio(config)
    bad = final.get("bad_evaluations", 0)
    by_patience = patience is not None and bad >= patience
    improved_step = final.get("improved_step", final.get("step"))  # (a record of before the noise margin: its best)
    by_ratio = (ratio is not None and final.get("stale_evaluations", bad) >= MIN_STALE_EVALUATIONS
                and improved_step is not None and latest >= ratio * improved_step)
    if not (by_patience or by_ratio):
      return None  # patience or ratio raised or lifted: training goes on
    how = ("raise --early_stopping_patience" if by_patience else
           "raise --early_stopping_ratio or give --early_stopping_ratio=none")
    why = (f"no better validation {config.run.selection_metric} in {bad} evaluations" if by_patience else
           f"no validation {config.run.selection_metric} better by more than the noise since step {improved_step}")
    logging.warning("the run in %s stopped early at step %d (%s): nothing to train. To train further, %s; for a new "
                    "run, use another --workdir", workdir, latest, why, how)
    return final
  if max_steps is None or latest < max_steps:
    return None
  logging.warning("the run in %s is finished (step %d of %d): nothing to train. To train further, raise "
                  "--max_steps or --num_epochs; for a new run, use another --workdir", workdir, latest, max_steps)
  return final


def _check_state_memory(config: Config, num_features: int, num_labels: int, num_shards: int) -> None:
  """Raises a :class:`ConfigError` where this process's share of the network's weights and their Adam moments
  cannot fit in this machine's memory: XLA's allocation failed with RESOURCE_EXHAUSTED and a 70-line traceback (a
  header of 10^8 labels asked for 51 GB for the output layer alone), after the data had loaded. Counted from the
  sizes (tracing the state's shapes costs start-up time), so a lower bound: the index and the step's buffers come on
  top."""
  have = memory.machine_memory_bytes()
  if have is None:
    return
  widths = [num_features, *config.network.hidden_dims]
  rows = shard_rows(num_labels, num_shards)
  weights = sum(a * b + b for a, b in zip(widths, widths[1:])) + rows * (widths[-1] + 1)
  averaged = config.optim.average_steps > 0
  need = (3 + averaged) * 4 * weights  # float32 weights, Adam's two moments, the weights' moving average
  if need <= have:
    return
  d = config.data
  if d.dataset == "files":
    name, value = "train_file", d.train_file
  elif d.dataset == "synthetic":
    name = "synthetic_labels" if d.synthetic_labels >= d.synthetic_features else "synthetic_features"
    value = getattr(d, name)
  else:
    name, value = "hidden_dims", config.network.hidden_dims
  size = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
  raise ConfigError(name, value, f"a network of {num_features} features, hidden layers "
                    f"{'x'.join(map(str, config.network.hidden_dims))} and {num_labels} labels needs at least "
                    f"{size(need)} of memory per process for its weights and Adam moments"
                    f"{' and their moving average' if averaged else ''}; this machine has {size(have)}. Lower "
                    "--hidden_dims, or split the output layer over more processes (sparsejax-launch -n P)"
                    f"{', or --average_steps=0' if averaged else ''}")


def _step_profiler(config: Config, run: sharding.Run, workdir: str) -> StepProfiler:
  """Step times for metrics.jsonl and the profiled window of ``config.netanalysis`` (sparsejax.netanalysis)."""
  slide = config.network.model == "slide"
  return StepProfiler.from_config(
      config.netanalysis, workdir, job="sparse" if slide else "dense",
      per_process_batch=config.optim.batch_size // (1 if slide else run.num_shards),
      scope_scaling=model.STEP_SCOPES if slide else dense.STEP_SCOPES)


class _Loop:
  """The training loop's state between steps: budget, measurements, evaluations, checkpoints."""

  def __init__(self, config: Config, run: sharding.Run, checkpoints: checkpoint.Checkpoints, meta: dict,
               evaluator: Evaluator, selection: "_Selection | None", writer: MetricWriter | None,
               steps_per_epoch: int, max_steps: int | None, profiler: StepProfiler,
               save_serving_index: Callable[[int, Any], None] | None = None,
               centroids: Callable[[], fusion.LabelCentroids] | None = None,
               save_fusion: Callable[[fusion.LabelCentroids, float], None] | None = None):
    self.config, self.run, self.checkpoints, self.meta = config, run, checkpoints, meta
    self.save_serving_index, self.centroids, self.save_fusion = save_serving_index, centroids, save_fusion
    self.evaluator, self.selection, self.writer, self.profiler = evaluator, selection, writer, profiler
    self.steps_per_epoch, self.max_steps = steps_per_epoch, max_steps
    self.step, self.last_loss, self.stop_signal = 0, None, None
    self.stopped_by = config.budget.step_limit_name(steps_per_epoch)  # or "max_seconds", "early_stopping"
    self.train_seconds, self.seconds_before = 0.0, 0.0
    # What --max_seconds counts (training and evaluations), and the steady step time measured after the first step
    # (its compilation excluded): the recipe search plans its rounds from it.
    self.budget_seconds, self.eval_seconds, self.step_seconds, self.eval_compile_seconds = 0.0, 0.0, None, 0.0
    self.nonfinite = NonFiniteWatch(config.run.on_nonfinite)

  def train(self, state, batches: BatchIterator, seconds_before: float, show_progress: bool):
    """Steps until the budget is spent or a signal asks to stop; returns the state."""
    config, run, prof = self.config, self.run, self.profiler
    self.step = int(sharding.local_value(state.step))
    self.seconds_before = seconds_before
    self.batches = batches
    batch_size, max_seconds, log_every = config.optim.batch_size, config.budget.max_seconds, config.run.log_every
    progress = Progress(config.run.progress and show_progress, self.max_steps, self.step)
    average_steps = config.optim.average_steps
    average_every = averaging.period(average_steps) if average_steps else 0
    t_loop, eval_seconds, eval_compiling = time.time(), 0.0, 0.0
    window_start, window_steps, metrics = time.time(), 0, None
    start_step, first_step_seconds = self.step, None
    timed_steps = []  # the first TIMED_STEPS steps' own seconds (synchronised), where they compiled nothing
    # The last evaluation's seconds: a run that selects on validation evaluates its last state, so the budget stops
    # training that much earlier (evaluations count against --max_seconds, the last one included).
    last_eval_seconds = 0.0
    try:
      with StopRequests() as stop:
        while self.max_steps is None or self.step < self.max_steps:
          timed = self.step - start_step < TIMED_STEPS
          if timed:
            t_step, compiled_at_step = time.time(), compile_clock.seconds()
          batch = next(batches)
          prof.begin_step(self.step, lambda state=state, batch=batch: run.step_program(state, batch))
          state, metrics = run.step(state, batch)
          self.step += 1
          prof.end_step(self.step, (state, metrics))
          if timed:
            jax.block_until_ready(metrics["loss"])
            if compile_clock.seconds() == compiled_at_step:
              timed_steps.append(time.time() - t_step)
          self.nonfinite.add(self.step, metrics.get("finite"))  # read at the sync points below
          window_steps += 1
          state = prof.maintenance("tables", run.maintain, state, self.step)
          if average_every and self.step % average_every == 0:
            state = prof.maintenance("average", averaging.update_state, state, average_steps)
          if first_step_seconds is None:  # waits for the first step: its compilation is not the step's time
            jax.block_until_ready(metrics["loss"])
            first_step_seconds, compiled_before = time.time() - t_loop, compile_clock.seconds()
          self.train_seconds = time.time() - t_loop - eval_seconds
          last = self.step == self.max_steps
          # Every process must take the same steps: the wall-clock budget is checked every
          # log_every steps and process 0's verdict is followed by all (one process: every step, a clock reading).
          reserve = last_eval_seconds if self.selection is not None else 0.0
          if (not last and max_seconds is not None and (self.step % log_every == 0 or jax.process_count() == 1)
              and sharding.agree(time.time() - t_loop + reserve >= max_seconds)):
            logging.info("wall-clock budget of %.0f s reached at step %d", max_seconds, self.step)
            self.stopped_by, last = "max_seconds", True
          record = {}
          if self.step % log_every == 0 or last:
            self.last_loss = float(sharding.local_value(metrics["loss"]))  # syncs: only every log_every steps
            self.train_seconds = time.time() - t_loop - eval_seconds  # the steps done, not only dispatched
            record = {"loss": self.last_loss, "learning_rate": float(sharding.local_value(metrics["learning_rate"])),
                      "samples_per_sec": window_steps * batch_size / max(time.time() - window_start, 1e-9),
                      **prof.log_record()}
            window_start, window_steps = time.time(), 0
            if self.nonfinite.check() or self.nonfinite.skipped:
              record["skipped_steps"] = self.nonfinite.skipped
          progress.step(self.step, record.get("loss"), record.get("samples_per_sec"))
          # The last step's test-set evaluation comes in finish; its validation evaluation comes here, so that the
          # final checkpoint (saved after the loop) holds the selection state with it: a run continued from that
          # checkpoint had compared its evaluations against a stale best.
          if (self.step % config.run.eval_every == 0 and not last) or (last and self.selection is not None):
            t_eval, compiled_at_eval = time.time(), compile_clock.seconds()
            self.nonfinite.check()
            if self.selection is not None:  # periodic evaluations select the model: on the validation split
              record.update(prof.maintenance("eval", self.selection.evaluate, run, self._evaluated(state),
                                             self.step, config.run.eval_samples))
            else:
              evaluation, _ = prof.maintenance("eval", _evaluate, self.evaluator, run, self._evaluated(state),
                                               config.run.eval_samples, sampled=config.run.sampled_evaluations == "all")
              record.update(evaluation)
            logging.info("step %d: %sP@1 %.4f  P@5 %.4f%s", self.step,
                         "validation " if self.selection is not None else "", record["p@1"], record["p@5"],
                         _retrieval_line(record))
            last_eval_seconds = time.time() - t_eval
            eval_seconds += last_eval_seconds
            eval_compiling += compile_clock.seconds() - compiled_at_eval  # not in train_seconds: not subtracted
            window_start = time.time()
            if self.selection is not None and not last and sharding.agree(self.selection.should_stop(self.step)):
              self._write(record)
              logging.info("early stopping at step %d: %s", self.step, self.selection.stop_reason(self.step))
              self.stopped_by = "early_stopping"
              break
            # An evaluation that spent the rest of the budget ends the run on the state it scored.
            if not last and max_seconds is not None and sharding.agree(time.time() - t_loop >= max_seconds):
              logging.info("wall-clock budget of %.0f s reached at step %d (its evaluation included)", max_seconds,
                           self.step)
              self.stopped_by, last = "max_seconds", True
          if record:
            self._write(record)
          if self.step % config.checkpoint.checkpoint_every == 0 and not last:  # the last: after the loop
            prof.maintenance("checkpoint", self.save, state, batches)
          if config.dist.checksum_every and self.step % config.dist.checksum_every == 0:
            prof.maintenance("checksum", run.check_replicas, state, self.step)
          if stop.requested(self.step):
            self.stop_signal = stop.signum
            logging.warning("stopping after step %d (%s): saving a checkpoint", self.step,
                            signal.Signals(stop.signum).name)
            break
          if last:
            break
      if metrics is not None and self.step % log_every:  # the final record's loss: the last step's
        self.last_loss = float(sharding.local_value(metrics["loss"]))
      prof.finish()  # a window the loop cut short (every process gets here together)
      self.budget_seconds, self.eval_seconds, self.eval_compile_seconds = time.time() - t_loop, eval_seconds, \
          eval_compiling
      if first_step_seconds is not None and self.step - start_step > 1:
        # Nor are later compilations (a batch of a new width): a measured plan would take them for step time.
        compiling = compile_clock.seconds() - compiled_before - eval_compiling
        self.step_seconds = max(self.train_seconds - first_step_seconds - compiling, 0.0) / (self.step - start_step - 1)
        if timed_steps:  # compilations overlap the steps dispatched before them: the subtraction can take too much
          self.step_seconds = max(self.step_seconds, float(np.median(timed_steps)))
    finally:
      prof.close()
      progress.close()
    self.nonfinite.check()
    return state

  def _evaluated(self, state):
    """The state that an evaluation scores (and model selection keeps): its parameters' moving average, if any."""
    return averaging.evaluated(state, self.config.optim.average_steps)

  def _write(self, record: dict) -> None:
    if self.writer is not None:
      self.writer.write({"step": self.step, "epoch": self.step / self.steps_per_epoch,
                         "seconds": self.seconds_before + self.train_seconds, **record})

  def save(self, state, batches: BatchIterator, wait: bool = False) -> None:
    self.nonfinite.check()  # never a checkpoint of a non-finite state
    self.nonfinite.check_state(state, self.step)
    position = {**batches.state(), "seconds": self.seconds_before + self.train_seconds}
    if self.selection is not None:
      position["selection"] = self.selection.to_json()
      # A checkpoint names the best state in its selection record only once that state is sealed on disk: a
      # resumed run then finds it intact or knows it was changed.
      self.selection.best.wait()
    self.checkpoints.save(self.step, state, position, self.meta, wait=wait)

  def finish_candidate(self, state, start_step: int) -> dict[str, Any]:
    """A recipe search's candidate's result: its best validation score (the test set is left alone)."""
    if self.selection.last_step != self.step:  # a candidate resumed at its budget: its state was evaluated
      self._write(self.selection.evaluate(self.run, self._evaluated(state), self.step,
                                          self.config.run.eval_samples))
    self.selection.best.wait()  # sealed: the winner's best state is adopted and checked as the run's
    if self.writer is not None:
      self.writer.close()
    return {"score": self.selection.best_value, "step": self.step, "train_seconds": self.train_seconds,
            "samples": (self.step - start_step) * self.config.optim.batch_size, "step_seconds": self.step_seconds,
            "budget_seconds": self.budget_seconds, "eval_seconds": self.eval_seconds,
            "eval_compile_seconds": self.eval_compile_seconds, "eval_scoring_seconds": self.selection.scoring_seconds}

  def finish(self, state, start_step: int, search_summary: dict | None = None) -> dict[str, Any]:
    """The final evaluation on the whole test set, of the selected state, recorded and logged."""
    step = self.step
    if self.selection is not None:
      if self.selection.last_step != step:  # the last state competes too (the loop evaluated it, if it trained)
        self._write(self.selection.evaluate(self.run, self._evaluated(state), step,
                                            self.config.run.eval_samples))
      if self.selection.is_live(step):  # not a second copy of the state read back from disk
        self.selection.best.wait()
        self.selection.best.check(step, self.selection.best.run_id)  # what is served from it: unchanged on disk
        state = self._evaluated(state)
      else:
        state, step = self.selection.restore_best(self.run, state)  # saved as evaluated: averaged
      logging.info("selected the state of step %d (validation %s %.4f) of %d steps", step,
                   self.selection.metric, self.selection.best_value, self.step)
    else:
      state = self._evaluated(state)
    fused, fusion_record = None, {}
    if self.centroids is not None and self.selection is not None:
      centroids = self.centroids()
      weight, table = self.selection.evaluator.fusion_weight(self.run.exact_predictor(), state, centroids,
                                                             self.selection.metric)
      logging.info("centroid fusion: weight %g (validation %s by weight: %s)", weight, self.selection.metric,
                   ", ".join(f"{w:g} {v:.4f}" for w, v in table.items()))
      fused, fusion_record = (centroids, weight), {"fusion_weight": weight,
                                                   "fusion_validation": {f"{w:g}": v for w, v in table.items()}}
      if self.save_fusion is not None:
        self.save_fusion(centroids, weight)
    final, served = _evaluate(self.evaluator, self.run, state, None, fused)
    if self.run.serving_index is not None:  # a clustered index: served holds the one evaluation queried
      index = self.run.serving_index(served)  # every process: sharded, the shards' indexes are gathered
      if self.save_serving_index is not None:  # sparsejax.load's sampled prediction needs not build it again
        self.save_serving_index(step, index)
    if self.stopped_by == "early_stopping":
      final.update(bad_evaluations=self.selection.bad_evaluations, improved_step=self.selection.improved_step,
                   stale_evaluations=self.selection.stale_evaluations)
    if self.selection is not None:
      final.update({"selected_step": step, "selected_by": f"validation {self.selection.metric}",
                    f"validation_{self.selection.metric}": self.selection.best_value})
    final.update({
        "step": step, "last_step": self.step, "epoch": step / self.steps_per_epoch,
        # The last step's training loss (null when this invocation trained none): not the selected step's.
        "last_loss": self.last_loss,
        "stopped_by": self.stopped_by,
        "samples_per_sec": (self.step - start_step) * self.config.optim.batch_size / max(self.train_seconds, 1e-9),
        "seconds": self.seconds_before + self.train_seconds, "train_seconds": self.train_seconds,
        # What --max_seconds counted: the training and its evaluations (the final test evaluation excluded).
        "budget_seconds": round(self.budget_seconds, 2),
        "num_params": model.num_params(state), "final": True, "num_processes": self.run.num_shards,
        # Where no search ran, config says auto: the record names what trained.
        "recipe": recipes.trained(self.config), **(search_summary or {}), **fusion_record,
    })
    if self.writer is not None:
      self.writer.write(final, curves=[k for k in final if k not in _SUMMARY_FIELDS])
      self.writer.close()
    logging.info("final (%s step %d, test set): P@1 %.4f  P@3 %.4f  P@5 %.4f  (sampled P@1 %s)%s",
                 "selected" if self.selection is not None else "last", step, final["p@1"], final["p@3"],
                 final["p@5"], f"{final['sampled_p@1']:.4f}" if "sampled_p@1" in final else "n/a",
                 _retrieval_line(final))
    return final


def _validation_seed(config: Config) -> int:
  """The seed that draws a run's validation split from its training samples."""
  return config.run.seed + 1


def stale_ratio(config: Config) -> float | None:
  """The ``--early_stopping_ratio`` that a run of ``config`` stops by: a budget in seconds only (None: none)."""
  return config.run.early_stopping_ratio if config.budget.max_seconds is not None else None


class _Selection:
  """Model selection on the validation split: the best checkpoint so far and early stopping.

  Args:
    evaluator: scores the validation split.
    best: where the best state is kept.
    config: the run settings (metric, patience, evaluation size, whether sampled inference is evaluated).
    restored: the selection state of a resumed run (``to_json``), or None.
    stale_ratio: stop at ``stale_ratio`` times the step of the last evaluation that improved (after
      ``MIN_STALE_EVALUATIONS`` that did not); None: never on that account.
    noise_samples: the validation samples an evaluation scores: an improvement counts for ``stale_ratio`` where it
      beats the last improvement by more than ``NOISE_MARGIN`` standard errors of a proportion on that many samples
      (None: any improvement counts). The best state is the best evaluated, whatever the margin.
  """

  def __init__(self, evaluator: Evaluator, best: checkpoint.BestCheckpoint, config, restored: dict | None,
               stale_ratio: float | None = None, noise_samples: int | None = None):
    self.evaluator, self.best, self.metric, self.patience = evaluator, best, config.selection_metric, \
        config.early_stopping_patience
    self.stale_ratio, self.noise_samples = stale_ratio, noise_samples
    self.sampled = config.sampled_evaluations == "all"  # else exact only: what selection reads
    restored = restored or {}
    self.best_value = restored.get("best_value", -float("inf"))
    self.best_step = restored.get("best_step")
    self.bad_evaluations = restored.get("bad_evaluations", 0)
    # The last improvement beyond the noise (a selection recorded before it existed: its best).
    self.improved_value = restored.get("improved_value", self.best_value)
    self.improved_step = restored.get("improved_step", self.best_step)
    self.stale_evaluations = restored.get("stale_evaluations", self.bad_evaluations)
    self.last_step = None
    self.scoring_seconds = 0.0  # this invocation's evaluations' scoring (their best states' saves not included)

  def to_json(self) -> dict:
    return {"best_value": self.best_value, "best_step": self.best_step, "bad_evaluations": self.bad_evaluations,
            "improved_value": self.improved_value, "improved_step": self.improved_step,
            "stale_evaluations": self.stale_evaluations}

  def noise(self, value: float) -> float:
    """The margin an evaluation must beat ``value`` by to count as an improvement (0: no sample count given)."""
    if not self.noise_samples or not math.isfinite(value):
      return 0.0
    p = min(max(value, 0.0), 1.0)
    return NOISE_MARGIN * math.sqrt(p * (1 - p) / self.noise_samples)

  def evaluate(self, run: sharding.Run, state, step: int, num_samples: int | None) -> dict[str, float]:
    """Validation metrics of ``state``; keeps it if it is the best so far."""
    t_scoring = time.time()
    result, _ = _evaluate(self.evaluator, run, state, num_samples, sampled=self.sampled)
    self.scoring_seconds += time.time() - t_scoring
    self.last_step = step
    value = result[self.metric]
    if value > self.best_value:
      self.best_value, self.best_step, self.bad_evaluations = value, step, 0
      self.best.save(step, without_optimizer(state), value)
    else:
      self.bad_evaluations += 1
    if value > self.improved_value + self.noise(self.improved_value):
      self.improved_value, self.improved_step, self.stale_evaluations = value, step, 0
    else:
      self.stale_evaluations += 1
    return {**result, "split": "validation", "best_step": self.best_step}

  def should_stop(self, step: int) -> bool:
    """Whether to stop after evaluating ``step``: ``patience`` evaluations without a better value, or ``step``
    at ``stale_ratio`` times the best one's."""
    return self.stop_reason(step) is not None

  def stop_reason(self, step: int) -> str | None:
    """Why a run stops early after evaluating ``step``, for the log; None: it goes on."""
    if self.patience is not None and self.bad_evaluations >= self.patience:
      return f"no better validation {self.metric} in {self.bad_evaluations} evaluations (--early_stopping_patience)"
    if (self.stale_ratio is not None and self.improved_step is not None
        and self.stale_evaluations >= MIN_STALE_EVALUATIONS and step >= self.stale_ratio * self.improved_step):
      margin = self.noise(self.improved_value)
      beyond = f" by more than {margin:.4f} (noise)" if margin else ""
      return (f"no better validation {self.metric}{beyond} since step {self.improved_step}, "
              f"{step - self.improved_step} steps ago (--early_stopping_ratio={self.stale_ratio:g}; none trains the "
              "whole budget)")
    return None

  def is_live(self, step: int) -> bool:
    """Whether the best state is the live one, ``step``'s (evaluated as the last): then it is not restored."""
    return self.best_step == step == self.last_step

  def restore_best(self, run: sharding.Run, state):
    """``(best state, its step)``; the given state if none was saved. The best state is kept without optimizer
    states: ``state``'s stand in (evaluation and serving do not read them; the state's structure stays whole), and
    its parameters stand in for the average's. The given state's other arrays are deleted (saved in the run's final
    checkpoint): the process holds one state's arrays throughout."""
    self.best.wait()
    if self.best.best_step() is None:
      return state, int(sharding.local_value(state.step))
    self.best.check(self.best.best_step(), self.best.run_id)  # never a changed state reported as the run's
    restored = without_optimizer(run.abstract_state())
    # The parameter average is not read from a selected state (saved as evaluated): the best parameters stand in
    # for its arrays of their shape and dtype, which go with the live parameters.
    average = getattr(state, "average", None)
    shared = None if average is None else jax.tree.map(
        lambda a, p: a.shape == p.shape and a.dtype == p.dtype, average.params, averaging.params_of(state))
    # The live arrays that the best state's replace go first, so that the process never holds the parameters twice
    # beside its state (the 10^9-parameter run did, swapped and aborted here). The final checkpoint has them.
    for field in restored._fields:
      if getattr(restored, field) is not None:
        for array in jax.tree.leaves(getattr(state, field)):
          array.delete()
    if average is not None:
      jax.tree.map(lambda a, same: a.delete() if same else None, average.params, shared)
    best = self.best.restore(restored)
    best = best._replace(**{f: getattr(state, f) for f in best._fields if getattr(best, f) is None})
    if average is not None:
      best = best._replace(average=average._replace(params=jax.tree.map(
          lambda a, p, same: p if same else a, average.params, averaging.params_of(best), shared)))
    return best, int(sharding.local_value(best.step))


def _kept_selection(best: checkpoint.BestCheckpoint, restored: dict | None, run_id: str | None,
                    start_step: int) -> dict | None:
  """The model selection ``restored`` from a checkpoint, if the best state it names is kept intact; else None
  (selection starts anew), with a warning that says what happened to the recorded best state.

  ``run_id``: the run whose seal the kept state must carry (None: a run of an older sparsejax, unsealed: its kept
  state is sealed now as it is).
  """
  recorded, kept = (restored or {}).get("best_step"), best.best_step()
  if recorded is None:
    if kept is not None:  # a state no selection names (scored by no evaluation this run compares with)
      best.discard_after(-1)
    return restored
  where = best.step_directory(recorded)
  if kept is None or kept < recorded:
    logging.warning("the best state recorded at step %d (validation %s %.4f) was lost: %s is missing. Model "
                    "selection starts anew at step %d: the final evaluation selects among the states evaluated from "
                    "now on", recorded, best.metric, restored.get("best_value", float("nan")), where, start_step)
    best.discard_after(-1)
    return None
  if run_id is None:
    best.seal([kept])
    return restored
  try:
    best.check(kept, run_id)
  except seals.IntegrityError as e:
    logging.warning("the best state recorded at step %d cannot be used: %s. It is set aside (renamed .corrupt); "
                    "model selection starts anew at step %d", recorded, e, start_step)
    best.set_aside(kept)
    best.discard_after(-1)
    return None
  return restored


def without_optimizer(state):
  """``state`` (a SLIDE or dense model's) without its optimizer states and parameter average, which a selected state
  does not need: it is evaluated and served, not trained on (``checkpoints/`` keeps them for resuming; a selected
  state's parameters are already the average it was evaluated with). Two thirds of an Adam-trained state's bytes."""
  return state._replace(**{f: None for f in state._fields if checkpoint.is_optimizer_state(f) or f == "average"})


def _evaluate(evaluator: Evaluator, run: sharding.Run, state, num_samples: int | None,
              fused: tuple[fusion.LabelCentroids, float] | None = None, sampled: bool = True):
  """``(test-set metrics, the state evaluated)``: the metrics with retrieval diagnostics and the index's fill where
  the run has them; the state with the index that sampled inference queried.

  Sampled inference is evaluated with a freshly refreshed index (a copy: training goes on with its own), as a
  model saved for serving would have it; between refreshes the training index lags the moving rows. Not
  ``sampled``: exact scores only (no index rebuilt, no diagnostics), what model selection reads.
  """
  if not sampled:
    return evaluator(run.exact_predictor(), state, num_samples, fusion=fused), state
  if run.refresh_index is not None:
    state = run.refresh_index(state)
  result = evaluator(run.predict, state, num_samples, diagnose=run.diagnose, fusion=fused)
  if run.index_fill is not None:
    result.update(run.index_fill(state))
  return result, state


def _retrieval_line(record: dict) -> str:
  """The retrieval diagnostics of an evaluation, for the log (empty if it has none)."""
  if "label_recall" not in record:
    return ""
  return (f"  | label_recall {record['label_recall']:.3f}  topk_recall@{retrieval.TOP} "
          f"{record[f'topk_recall@{retrieval.TOP}']:.3f}  candidates {record['mean_candidates']:.0f}  "
          f"cos(h, label) {record['label_cosine']:.3f}")
