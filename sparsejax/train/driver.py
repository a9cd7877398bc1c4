"""``train_and_evaluate(config, workdir)``: a run composed of its parts, within one budget: the recipe search
(:mod:`sparsejax.train.search`), the network's training (:func:`sparsejax.train.loop.train_one`) and the
ensemble's members (:mod:`sparsejax.train.members`); the search and the members compose ``train_one`` runs.

Files in ``workdir``: ``metrics.jsonl``, ``checkpoints/``, ``search/`` (a recipe search's candidates), ``members/``
(the ensemble's), ``config.json`` (written once the run has started or resumed), ``assets/`` (label names,
vectorizer: what :func:`sparsejax.load` needs) and, if asked for, ``tensorboard/``.
"""

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from sparsejax import unused_settings
from sparsejax.config import Config
from sparsejax.data import LoadedData
from sparsejax.settings import ConfigError, override
from sparsejax.train import head_ranking, loop, members, metric_writer, plan, recipes, resume, search
from sparsejax.train.console import final_line, log_settings, log_to_console
from sparsejax.train.metric_writer import read_records
from sparsejax.train.step_observer import StepObserverFactory
from sparsejax.workdir import checkpoint


def train_and_evaluate(config: Config, workdir: str, *, data: LoadedData | None = None, verbose: bool = False,
                       step_observer: StepObserverFactory | None = None) -> dict[str, Any]:
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
    step_observer: makes the observer of each network's steps (:mod:`sparsejax.train.step_observer`); the profiled
      window that ``--netanalysis_steps`` asks for is :meth:`sparsejax.netanalysis.collect.StepProfiler.from_config`,
      which ``sparsejax-train`` and :func:`sparsejax.fit` pass. None: none.

  Returns:
    The final evaluation on the test set (exact and sampled P@k, nDCG@k, PSP@k) of the selected state (the
    best on the validation split when there is one, else the last) with ``step`` (the selected one),
    ``last_step``, ``samples_per_sec``, ``train_seconds`` and ``num_params``. For a run that had already
    finished, its recorded final evaluation. An ensemble's (``--ensemble_members``) is the merged ranking's
    evaluation with ``ensemble_members``; ``num_params``, ``train_seconds`` and ``samples_per_sec`` are the members'
    together, and what only the first network measured (its test P@k, retrieval diagnostics, index fill, validation
    score, last loss) is named ``member0_*`` (:func:`sparsejax.train.members.evaluate`).

  Raises:
    ConfigError: an invalid setting or an unwritable work directory (before anything is loaded); also
      ``--netanalysis_steps`` without a ``step_observer``.
    NonFiniteError: a NaN or Inf loss or update (``--on_nonfinite``); the checkpoints on disk are finite.
    ResumeError: ``workdir`` holds checkpoints of another run.
    Interrupted: SIGINT or SIGTERM stopped the run (after saving a checkpoint).
  """
  if verbose:
    with log_to_console():
      logging.info("work directory: %s", workdir)
      log_settings(config)
      final = train_and_evaluate(config, workdir, data=data, step_observer=step_observer)
      logging.info("%s", final_line(final, workdir))
      return final
  config.validate()
  # What the user set and this run does not read, once (not again for each search candidate or member, whose
  # settings the run chose).
  for line in unused_settings.of(config):
    logging.warning(line)
  if config.netanalysis.netanalysis_steps and step_observer is None:
    raise ConfigError("netanalysis_steps", config.netanalysis.netanalysis_steps,
                      "the profiled window is sparsejax.netanalysis's step observer: train with sparsejax-train or "
                      "sparsejax.fit, or pass step_observer=sparsejax.netanalysis.collect.StepProfiler.from_config")
  if step_observer is not None and not callable(step_observer):
    raise TypeError(f"step_observer must make an observer per network (a factory such as "
                    f"StepProfiler.from_config), got a {type(step_observer).__name__}")
  train_one = functools.partial(loop.train_one, step_observer=step_observer)
  t_invocation = time.time()
  config, data, split_record = _with_validation_split(config, workdir, data)
  config, data = plan.resolve_selection_metric(config, workdir, data)
  config, data, search_summary, search_wall_seconds = _with_recipe(config, workdir, data, train_one)
  if split_record:  # in the final record, as the search's figures are
    search_summary = {**(search_summary or {}), **split_record}
  # The head rankers' fit counts against --max_seconds as the search does.
  data, rankers, ranker_seconds = head_ranking.prepare(config, workdir, data, searched=search_wall_seconds > 0)
  config = plan.charged_for_search(config, ranker_seconds)
  if rankers is not None and len(rankers.labels):  # in the final record, as the search's seconds are
    search_summary = {**(search_summary or {}), "ranker_seconds": round(ranker_seconds, 2)}
  final = train_one(config, workdir, data=data, search_summary=search_summary, head_rankers=rankers)
  final = _with_members(config, workdir, data, final, train_one)
  _log_budget(config, final, search_wall_seconds, ranker_seconds, time.time() - t_invocation)
  return final


def _with_validation_split(config: Config, workdir: str,
                           data: LoadedData | None) -> tuple[Config, LoadedData | None, dict]:
  """``(config, data, record)``: ``--validation_split=auto`` decided on the data for a new run (loaded here:
  :func:`sparsejax.train.plan.resolve_validation_split`), so that the search, the network, the head rankers and the
  ensemble's members all hold out the same rows, with the record's fields that say what was measured. A continued
  or finished run keeps the split its ``config.json`` records, the data not loaded for it."""
  if config.data.validation_split != "auto" or config.data.validation_fraction == 0:
    return config, data, {}
  if resume.holds_checkpoints(workdir):
    return override(config, validation_split=_recorded_validation_split(workdir)), data, {}
  data = data if data is not None else plan.load_data(config)
  resolved, record = plan.resolve_validation_split(config, data)
  warned = set(unused_settings.of(config))
  for line in unused_settings.of(resolved):  # what the resolved split leaves unread, not warned about above
    if line not in warned:
      logging.warning(line)
  return resolved, data, record


def _recorded_validation_split(workdir: str) -> str:
  """The validation split that the run in ``workdir`` drew: its ``config.json``'s (``auto``, drawn at random, where
  it records none: a run of an older sparsejax, or the file is unreadable)."""
  recorded = plan.recorded_setting(workdir, "data", "validation_split")
  return recorded if recorded in ("random", "grouped") else "auto"


def _with_recipe(config: Config, workdir: str, data: LoadedData | None,
                 train_one: Callable[..., dict[str, Any]]) -> tuple[Config, LoadedData | None, dict | None, float]:
  """``(config, data, search summary, search seconds)``: the run's config with its recipe applied (named, or the
  winner of a recipe search run here, whose wall seconds are charged to the budget), the data if the search loaded
  it, the search's figures (None without a search in this run's history) and the seconds of a search run in this
  invocation (0 otherwise)."""
  # A run stopped while it took over its search's winner finishes that first (the search runs in one process; a
  # refused --resume=never changes nothing); a run continued after its search reports it. --max_seconds counts
  # this invocation's training: the search's seconds were charged to the invocation that searched.
  search_summary = None
  if config.search.recipe == recipes.AUTO and config.checkpoint.resume != "never" and jax.process_count() == 1:
    search_summary = search.finish_adoption(workdir)
  if config.search.recipe in recipes.names():
    return recipes.apply(config, recipes.get(config.search.recipe)), data, search_summary, 0.0
  # A run continued takes the recipe its checkpoints record (loop.train_one).
  if config.search.recipe != recipes.AUTO or resume.holds_checkpoints(workdir):
    return config, data, search_summary, 0.0
  why_not = search.reason_not_to_search(config, jax.process_count())
  if why_not is not None:
    logging.info("recipe: the defaults, no search (%s)", why_not)
    return config, data, search_summary, 0.0
  if config.checkpoint.resume == "never" and os.path.isdir(os.path.join(workdir, search.SEARCH_DIR)):
    raise checkpoint.ResumeError(f"{os.path.join(workdir, search.SEARCH_DIR)} holds an interrupted recipe search "
                                 "and --resume=never: use another --workdir for a new run (or --resume=auto to "
                                 "continue it)")
  with checkpoint.new_directories_removed_on_failure(workdir):
    checkpoint.check_writable(workdir)
    read_records(workdir)
    data = data if data is not None else plan.load_data(config)
    chosen = search.run(config, workdir, plan.data_shape(config, data.train), functools.partial(train_one, data=data),
                        functools.partial(metric_writer.append_record, workdir))
  if chosen is None:
    return config, data, search_summary, 0.0
  config, search_summary = chosen
  # The search's wall time, measuring, compiling and evaluating included, counts against --max_seconds (the
  # startup of its first training aside: a run without a search spends it as well).
  seconds = search_summary["search_wall_seconds"]
  return plan.charged_for_search(config, seconds), data, search_summary, seconds


def _log_budget(config: Config, final: dict[str, Any], search_wall_seconds: float, ranker_seconds: float,
                total: float) -> None:
  """Logs what this invocation's seconds went to: those that --max_seconds counts (the search, the head rankers'
  fit, the training and its evaluations, the ensemble's members) and the rest (loading, compiling, the final
  evaluations)."""
  if final.get("budget_seconds") is None:  # a finished run's record, returned as it was
    return
  charged = search_wall_seconds + ranker_seconds
  counted = charged + final["budget_seconds"]
  budget = config.budget.max_seconds
  logging.info("seconds: %.1f counted against the budget%s (search %.1f, head rankers %.1f, training and "
               "evaluations %.1f), %.1f besides (loading, compiling, final evaluation); %.1f in all", counted,
               f" of {budget + charged:.0f}" if budget is not None else "", search_wall_seconds, ranker_seconds,
               final["budget_seconds"], total - counted, total)


def _with_members(config: Config, workdir: str, data: LoadedData | None, final: dict[str, Any],
                  train_one: Callable[..., dict[str, Any]]) -> dict[str, Any]:
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
  data = data if data is not None else plan.load_data(trained_config)
  validation_seed = plan.validation_seed(trained_config)
  done = members.train(trained_config, final, workdir, functools.partial(train_one, data=data), validation_seed)
  if not done:
    # Recorded as a run of one network, as a formed ensemble is recorded: a rerun neither loads the data nor tries
    # the members again (with its budget counted afresh: a member the clock stopped would train on).
    final = {**final, "ensemble_members": 1}
    metric_writer.append_record(workdir, final)
    return final
  train, validation = plan.validation_split(trained_config, data.train, validation_seed)
  record = members.evaluate(trained_config, final, workdir, done, (train, validation, data.test))
  metric_writer.append_record(workdir, record)
  logging.info("final (ensemble of %d, test set): P@1 %.4f  P@3 %.4f  P@5 %.4f", record["ensemble_members"],
               record["p@1"], record["p@3"], record["p@5"])
  return record
