"""The recipe search: successive halving over :mod:`sparsejax.train.recipes` on the validation split, within the budget.

A fresh run with ``--recipe=auto`` (the default) spends at most ``--search_fraction`` of its training budget
comparing the recipes. Each candidate trains in ``WORKDIR/search/NAME`` (an ordinary run directory: an
interrupted search resumes), is scored on the whole validation split, and the better half goes on for twice
the budget, until one is left. The winner's directory then becomes the run's: it trains on from the steps it
took in the search, so they are not lost. ``metrics.jsonl`` gets one ``"search"`` record per round (each
candidate's steps, training seconds and validation score) and one naming the winner.

Rounds are measured in steps, never in measured seconds, so that the same seed chooses the same recipe and
yields bit-identical parameters on any machine. With ``--max_steps`` or ``--num_epochs`` every candidate of a
round gets the same steps. With ``--max_seconds`` each candidate first trains ``search_plan.CALIBRATION_STEPS``
steps in its directory (kept: round 1 trains on from them), which measures its step time on this machine and data
(the first step's compilation excluded) and the seconds a round costs besides its steps (compiling, the validation
evaluation, the checkpoints); a candidate's steps are then its share of the search's seconds over its measured step
time. ``metrics.jsonl`` records the measurements (``measured_step_seconds``): a continued search plans from them
again, and ``--plan_from`` makes another run take the same plan, so the same seed takes the same steps. The modelled
step time (:func:`sparsejax.train.search_plan.modelled_step_seconds`) stands in only where a candidate could not be
measured; the plan itself is :func:`sparsejax.train.search_plan.plan`. A candidate that the budget buys fewer than
:data:`MIN_SEARCH_EPOCHS` epochs at its measured step time is not compared, and the costlier ones are not measured:
where that leaves the cheapest alone, all of the budget trains it. While the rounds run, the clock is compared
with the plan: a round that the seconds left cannot hold is not started (round 1: the candidates that do not fit
are left out; later: the search ends with the leader so far), as logged.

The candidates' checkpoints are held in memory between their trainings (:mod:`sparsejax.workdir.held`): those of the
eliminated ones are never written, the winner's as the search ends (or all of those left, where a signal or an error
stops it).
"""

import functools
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from sparsejax import model_kinds
from sparsejax.config import NO_RECORDED_PLAN, Config, recorded_plan
from sparsejax.settings import ConfigError, override
from sparsejax.train import recipes, search_plan
from sparsejax.train.metric_writer import METRICS_FILE
from sparsejax.train.search_plan import DataShape, Measured, Plan
from sparsejax.workdir import checkpoint, held, seals

SEARCH_DIR = "search"
# Validation samples the calibration evaluates (of --eval_samples): its evaluation, less its compilation, is scaled
# to a round's (the score of 20 steps decides nothing; 5,000 samples took 3-11 s a candidate at 200K labels).
CALIBRATION_EVAL_SAMPLES = 1000
# The largest share of the search's seconds that measuring the candidates may take: those not measured by then are
# not compared (a step so slow that 20 of them take a tenth of the budget leaves no room for a search anyway).
CALIBRATION_SHARE = 0.5
# A candidate that the budget buys fewer epochs than this, at its measured step time, is not compared (nor are the
# costlier ones measured); a budget that buys the cheapest fewer all goes to training it: a comparison's seconds
# would cost it a large share of its epochs, and a larger network gets fewer still. Tuned on n_200k of the suite's
# tuned half (200K labels; 9.2 epochs of `small` in 300 s on a 2-core Zen 3 VM), test P@1: searched, comparing small
# with wide 0.7516 (156 s of search); measured, comparing nothing 0.7732 (134 s); not searched 0.7817 (PECOS
# 0.7787). Per candidate: on that VM the budget bought `wider` 5.4-9.5 epochs on six of the ten shapes, where it
# was last in every search, its measuring and first round about 50 s of the 300 (debian_depends, labels_5; 2026-12-07,
# HISTORY.md).
MIN_SEARCH_EPOCHS = 10
# The search's clock (a test's fake clock replaces it).
_clock = time.monotonic


def reason_not_to_search(config: Config, num_processes: int) -> str | None:
  """Why ``config`` trains without a search (None: it searches)."""
  if config.search.recipe != recipes.AUTO:
    return f"--recipe={config.search.recipe}"
  explicit = recipes.explicit_settings(config)
  if explicit:
    return "recipe settings given: " + ", ".join(f"--{n}" for n in explicit)
  if not model_kinds.of(config).sampled:
    return f"--model={config.network.model}"
  if config.data.validation_fraction <= 0:
    return "no validation split (--validation_fraction=0)"
  if num_processes > 1 or (config.dist.num_shards or 1) > 1:
    return "several processes"
  return None


TrainFn = Callable[..., dict[str, Any]]


def run(config: Config, workdir: str, shape: DataShape, train_fn: TrainFn, write_record: Callable[[dict], None],
        candidates: tuple[recipes.Recipe, ...] = recipes.RECIPES) -> tuple[Config, dict[str, Any]] | None:
  """Successive halving over ``candidates``; returns ``(the winner's config, the search's summary)``.

  Args:
    config: the run (``--recipe=auto``, its budget the whole run's).
    workdir: the run's directory; candidates train in ``WORKDIR/search/NAME``, and the winner's files are moved
      to ``workdir`` (its checkpoints, best state, assets, metrics), from where the run continues.
    shape: the training data's sizes.
    train_fn: ``train_fn(config, workdir, evaluate_test=False)`` trains a candidate to its budget (resuming
      its directory) and returns ``{"score": best validation metric, "train_seconds": ...}`` (and, measured,
      ``"step_seconds"``: its steady step time).
    write_record: appends a record to the run's ``metrics.jsonl``.
    candidates: the recipes, cheapest first.

  Returns:
    None where the budget fits no comparison (the log says so; the run trains the defaults). The summary's
    ``search_wall_seconds`` is the wall time the search took (what ``--max_seconds`` is charged).
  """
  # The candidates' checkpoints stay in memory between their trainings (those of the eliminated ones are never
  # written); the winner's are written as the block ends, or all of those left where a signal or an error ends it.
  with checkpoint.held_in_memory(os.path.join(workdir, SEARCH_DIR)):
    searched = _search(config, workdir, shape, train_fn, write_record, candidates)
  if searched is None:
    return None
  winner, summary, done = searched
  return _adopt_winner(config, workdir, winner, summary, done, write_record)


def _search(config: Config, workdir: str, shape: DataShape, train_fn: TrainFn, write_record: Callable[[dict], None],
            candidates: tuple[recipes.Recipe, ...]) -> tuple[recipes.Recipe, dict[str, Any], list[dict]] | None:
  """:func:`run`'s measuring and rounds: ``(the winner, the search's summary, the rounds' results)``, or None."""
  t_start = _clock()
  candidate_config = functools.partial(_candidate_config, config)
  planned = _planned(config, workdir, shape, candidates, candidate_config, train_fn, write_record)
  if planned is None:
    return None
  the_plan, measured, calibration_scores, startup = planned
  for recipe in candidates:  # measured, then left out by the plan: never trained again
    if recipe not in the_plan.candidates:
      _remove_states(os.path.join(workdir, SEARCH_DIR, recipe.name))
  metric = config.run.selection_metric
  logging.info("recipe search over %s: %d round(s) of successive halving on validation %s; first round: %s",
               ", ".join(r.name for r in the_plan.candidates), the_plan.rounds, metric,
               ", ".join(f"{n} {s} steps" for n, s in the_plan.steps.items()))
  alive = list(the_plan.candidates)
  # (A winner by default is reported with the score of its measured steps.)
  scores: dict[str, float] = ({n: s for n, s in calibration_scores.items()
                                if n in {r.name for r in the_plan.candidates}} if the_plan.rounds == 0 else {})
  search_seconds = 0.0
  # Rounds already done (an interrupted search run again): their results, not their training again. A candidate
  # of a later round has trained past an earlier round's steps, so replaying that round would score another state.
  done_path = os.path.join(workdir, SEARCH_DIR, _ROUNDS_FILE)
  done = _read_rounds(done_path)
  clock = _Budget(config, measured, t_start + startup)
  rounds = _Rounds(the_plan, measured is not None, clock, metric, write_record,
                   lambda recipe, steps, cap: train_fn(candidate_config(recipe, steps, cap),
                                                       os.path.join(workdir, SEARCH_DIR, recipe.name),
                                                       evaluate_test=False))
  ended_early = False
  for round_index in range(the_plan.rounds):
    if len(alive) < 2:  # the others were left out of the rounds by the clock
      break
    if round_index < len(done):
      results = done[round_index]
      logging.info("recipe search, round %d: done before (%s)", round_index + 1,
                   ", ".join(f"{n} {r['score']:.4f}" for n, r in results.items()))
    else:
      results = rounds.train(round_index, alive, done[round_index - 1] if round_index else {})
      if results is None:
        ended_early = True
        break
    for name, result in results.items():
      scores[name] = result["score"]
      search_seconds += result["train_seconds"]
    alive = _better_half(alive, results, scores)
    if round_index >= len(done):
      done.append(results)
      _write_rounds(done_path, done)
      write_record({"step": 0, "search_round": round_index + 1, "search": results,
                    "search_kept": [r.name for r in alive]})
    _remove_eliminated(workdir, the_plan, alive)
  if ended_early:  # the leader of the last round trained: the others' states go
    alive = alive[:1]
    _remove_eliminated(workdir, the_plan, alive)
  summary = {"recipe": alive[0].name, "search_seconds": round(search_seconds, 2),
             "search_wall_seconds": round(_clock() - t_start - startup, 2),
             "search_scores": {name: round(value, 4) for name, value in scores.items()}}
  logging.info("recipe search: %s wins (validation %s %.4f; %s) after %.0f s of search training (%.0f s in all, "
               "measuring and evaluating included)", alive[0].name, metric, scores.get(alive[0].name, math.nan),
               alive[0].summary, search_seconds, summary["search_wall_seconds"])
  return alive[0], summary, done


def _candidate_config(config: Config, recipe: recipes.Recipe, steps: int, cap: float | None = None) -> Config:
  """A candidate's settings: ``recipe``'s, trained to ``steps``. Under ``--max_seconds`` the search's seconds left
  (``cap``) bound it too, which binds only where its steps run much slower than measured (they then stop short, as
  logged and recorded); no early stop (a candidate trains its steps). Each round continues the candidate's own
  directory: under --resume=force too (a changed setting), else auto."""
  resume = "force" if config.checkpoint.resume == "force" else "auto"
  return override(recipes.apply(config, recipe), max_steps=steps, num_epochs=None, max_seconds=cap,
                  early_stopping_patience=None, resume=resume, plan_from=None,
                  **({"early_stopping_ratio": None} if cap is not None else {}))


def _planned(config: Config, workdir: str, shape: DataShape, candidates, candidate_config, train_fn: TrainFn,
             write_record: Callable[[dict], None]):
  """``(plan, measured, calibration scores, startup seconds)`` of a search (the step times measured on this machine
  under ``--max_seconds``), or None where the budget fits no comparison (the log says so; the measured
  directories removed)."""
  measured, calibration_scores, startup = None, {}, 0.0
  # Measured only where the modelled step time (faster than most machines measure) leaves room for a comparison.
  if config.budget.max_seconds is not None and search_plan.plan(config, shape, candidates) is not None:
    measured, calibration_scores, startup = _measure(config, workdir, shape, candidates, candidate_config, train_fn,
                                                     write_record)
  # Measured candidates that the budget buys fewer than MIN_SEARCH_EPOCHS epochs: not compared.
  epochs = {n: budget_epochs(config, shape, s) for n, s in (measured.step_seconds if measured else {}).items()}
  few_epochs = {n: e for n, e in epochs.items() if e < MIN_SEARCH_EPOCHS}
  the_plan = search_plan.plan(config, shape, tuple(r for r in candidates if r.name not in few_epochs), measured)
  cheapest = candidates[0].name
  if the_plan is not None and few_epochs:
    logging.info("recipe search: %s: not compared", _few_epochs_reason(few_epochs))
  if the_plan is None and measured is not None and measured.step_seconds.get(cheapest) is not None:
    # The cheapest candidate's measured steps are kept: it wins, with no rounds (the run trains it on).
    if cheapest in few_epochs:
      reason = f"{_few_epochs_reason(few_epochs)}: all of it goes to training it"
    elif few_epochs and set(measured.step_seconds) - set(few_epochs) == {cheapest}:
      reason = (f"{_few_epochs_reason(few_epochs)}: no other to compare {cheapest} with; all of it goes to "
                f"training {cheapest}")
    else:
      reason = (f"by the measured step times the budget is too small to compare recipes (< "
                f"{search_plan.MIN_ROUND_STEPS} steps each)")
    logging.info("recipe search: %s: %s trains on from its %d measured steps", reason, cheapest,
                 search_plan.CALIBRATION_STEPS)
    the_plan = Plan((candidates[0],), {cheapest: search_plan.CALIBRATION_STEPS}, 0)
  if the_plan is None:
    logging.info("recipe search: the budget is too small to compare recipes (< %d steps each): training the "
                 "defaults", search_plan.MIN_ROUND_STEPS)
    if measured is not None:  # the measured directories: the run trains the defaults afresh in workdir
      shutil.rmtree(os.path.join(workdir, SEARCH_DIR), ignore_errors=True)
      held.drop(os.path.join(workdir, SEARCH_DIR))
    return None
  return the_plan, measured, calibration_scores, startup


def _few_epochs_reason(epochs: dict[str, float]) -> str:
  """``"the budget buys wide 8.0 epochs, wider 5.4 at their measured step times (< 10)"``."""
  listed = ", ".join(f"{n} {e:.1f}" + (" epochs" if i == 0 else "") for i, (n, e) in enumerate(epochs.items()))
  at = "their measured step times" if len(epochs) > 1 else "its measured step time"
  return f"the budget buys {listed} at {at} (< {MIN_SEARCH_EPOCHS})"


class _Rounds:
  """Trains the candidates of a round of the search, within the search's clock.

  Args:
    the_plan: the search's plan (each candidate's first-round steps; each later round doubles them).
    measured: whether the candidates' first steps were measured (they start from those).
    clock: the search's seconds.
    metric: the validation metric compared.
    write_record: appends a record to the run's ``metrics.jsonl``.
    train: ``train(recipe, steps, cap seconds) -> result`` trains a candidate to ``steps``.
  """

  def __init__(self, the_plan: Plan, measured: bool, clock: "_Budget", metric: str,
               write_record: Callable[[dict], None], train: Callable[..., dict[str, Any]]):
    self.plan, self.measured, self.clock, self.metric = the_plan, measured, clock, metric
    self.write_record, self.train_candidate = write_record, train

  def train(self, round_index: int, alive: list, before: dict) -> dict[str, dict] | None:
    """Round ``round_index``'s results by candidate name (``steps``, ``score``, ``train_seconds``), or None where
    the clock says the round would overrun the search's budget (the search ends with the leader so far)."""
    clock = self.clock
    trained_to = {r.name: before[r.name]["steps"] if r.name in before else
                  (search_plan.CALIBRATION_STEPS if self.measured else 0) for r in alive}
    targets = {r.name: self.plan.steps[r.name] * 2 ** round_index for r in alive}
    if round_index > 0 and not clock.fits(alive, trained_to, targets):
      logging.warning("recipe search: round %d would take about %.0f s, %.0f s of the search's %.0f s are left "
                      "(its steps ran slower than measured): the search ends with the leader so far",
                      round_index + 1, clock.cost(alive, trained_to, targets), clock.left(), clock.budget)
      self.write_record({"step": 0, "search_ended_early": round_index + 1,
                         "search_seconds_left": round(clock.left(), 2)})
      return None
    results = {}
    for position, recipe in enumerate(alive):
      steps = targets[recipe.name]
      # Round 1 shares the seconds left equally (as planned, where the steps run as measured): a candidate whose
      # part cannot buy a round's least steps is left out (the others are compared).
      cap = clock.cap(len(alive) - position)
      affordable = clock.affordable(recipe.name, trained_to[recipe.name], cap)
      if round_index == 0 and results and affordable < min(steps, search_plan.MIN_ROUND_STEPS):
        logging.warning("recipe search, round 1: %s left out: the %.0f s left of the search's %.0f s buy it %d "
                        "steps at the pace seen so far (a round takes at least %d)", recipe.name, clock.left(),
                        clock.budget, affordable, search_plan.MIN_ROUND_STEPS)
        continue
      t_call = _clock()
      result = self.train_candidate(recipe, steps, cap)
      trained = result.get("step", steps)
      clock.observed(recipe.name, trained_to[recipe.name], trained, _clock() - t_call)
      results[recipe.name] = {"steps": trained, "score": result["score"],
                              "train_seconds": round(result["train_seconds"], 2)}
      if trained < steps:
        logging.warning("recipe search, round %d: %s stopped by the search's clock at step %d of %d (its steps "
                        "ran slower than measured)", round_index + 1, recipe.name, trained, steps)
      logging.info("recipe search, round %d: %s (%s) after %d steps: validation %s %.4f", round_index + 1,
                   recipe.name, recipe.summary, trained, self.metric, result["score"])
    return results


def _better_half(alive: list, results: dict, scores: dict[str, float]) -> list:
  """The candidates that go on after a round: the better half; ties keep the cheaper recipe (the candidates' order),
  for a deterministic choice; a non-finite score (a diverged candidate) ranks last; one left out of the round (the
  clock) goes no further."""
  ranked = sorted((r for r in alive if r.name in results),
                  key=lambda r: -scores[r.name] if math.isfinite(scores[r.name]) else math.inf)
  return ranked[:-(-len(alive) // 2)]


def _remove_eliminated(workdir: str, the_plan: Plan, alive: list) -> None:
  """Removes the states of the candidates no longer in the search (their records stay)."""
  for recipe in the_plan.candidates:
    if recipe not in alive:
      _remove_states(os.path.join(workdir, SEARCH_DIR, recipe.name))


def _adopt_winner(config: Config, workdir: str, winner: recipes.Recipe, summary: dict, done: list,
                  write_record: Callable[[dict], None]) -> tuple[Config, dict[str, Any]]:
  """The winner's files moved into the run's directory; ``(the config the run continues with, summary)``."""
  write_record({"step": 0, "search_winner": winner.name, **summary})
  # The adoption is several moves: rounds.json says it began (and how long metrics.jsonl was), so that a run
  # stopped halfway finishes it (finish_adoption) instead of resuming from half the winner's files.
  metrics_path = os.path.join(workdir, METRICS_FILE)
  _write_rounds(os.path.join(workdir, SEARCH_DIR, _ROUNDS_FILE), done,
                adoption={"summary": summary, "done": False,
                          "metrics_bytes": os.path.getsize(metrics_path) if os.path.exists(metrics_path) else 0})
  finish_adoption(workdir)
  # The run continues the winner's checkpoints (a fresh run's: there were none before the search).
  return override(recipes.apply(config, winner), resume="auto"), summary


def budget_epochs(config: Config, shape: DataShape, step_seconds: float | None) -> float:
  """The epochs ``--max_seconds`` buys a network whose steps take ``step_seconds`` (infinite: not measured)."""
  if not step_seconds:
    return math.inf
  return config.budget.max_seconds / step_seconds / max(shape.num_train // config.optim.batch_size, 1)


def _calibration_samples(config: Config, shape: DataShape) -> tuple[int | None, float]:
  """``(the samples a calibration's evaluation scores, a round's evaluation over the calibration's)``: a round
  scores ``--eval_samples`` (none: all; at most the validation split's, where known), the calibration at most
  :data:`CALIBRATION_EVAL_SAMPLES`."""
  eval_samples, num_validation = config.run.eval_samples, shape.num_validation
  round_samples = eval_samples if num_validation is None else min(eval_samples or num_validation, num_validation)
  calibration_samples = (CALIBRATION_EVAL_SAMPLES if num_validation is None else
                         min(CALIBRATION_EVAL_SAMPLES, num_validation))
  if round_samples is not None and round_samples > calibration_samples:
    return calibration_samples, round_samples / calibration_samples
  return eval_samples, 1.0


def _round_fixed_seconds(step_seconds: dict, call_seconds: dict, eval_seconds: dict, one_evaluation: dict,
                         repeat: float, eval_scale: float) -> None:
  """Sets each measured candidate's ``call_seconds`` to a round's fixed seconds: the first one's repeat's, in
  proportion to a step's (a bigger network evaluates and restores more), at most what a candidate's first training
  took besides its steps, and a round's larger last evaluation (``eval_scale`` times the calibration's)."""
  first = next(iter(call_seconds), None)
  if first is None:
    return
  for name in call_seconds:
    ratio = (step_seconds[name] / step_seconds[first]) if step_seconds[name] and step_seconds[first] else 1.0
    call_seconds[name] = round((repeat * max(ratio, 1.0) if name == first else
                                min(call_seconds[name], repeat * max(ratio, 1.0)))
                               + (eval_scale - 1) * one_evaluation[name], 3)
    eval_seconds[name] = round(eval_seconds[name], 3)


def _measure(config: Config, workdir: str, shape: DataShape, candidates, candidate_config, train_fn: TrainFn,
             write_record: Callable[[dict], None]) -> tuple[Measured, dict[str, float], float]:
  """The candidates' step times: recorded (a continued search; ``--plan_from``) or measured now, by training each
  ``CALIBRATION_STEPS`` steps in its directory (cheapest first, while the calibration's share of the search's
  seconds lasts), and recorded in ``metrics.jsonl``; with the validation scores of the measured steps (none where
  recorded) and the startup seconds of this invocation's first training (not charged to the search)."""
  recorded = read_measurements(workdir, required=False)
  if recorded is not None:
    logging.info("recipe search: step times as measured before: %s", _describe(recorded))
    return recorded, {}, 0.0
  replayed = read_measurements(config.search.plan_from) if config.search.plan_from else None
  limit = CALIBRATION_SHARE * config.search.search_fraction * config.budget.max_seconds
  eval_samples, eval_scale = _calibration_samples(config, shape)
  calibration_config = lambda recipe: override(candidate_config(recipe, search_plan.CALIBRATION_STEPS),  # noqa: E731
                                               eval_samples=eval_samples)
  # (one evaluation at the last step, and one every --eval_every steps before it)
  calibration_evaluations = -(-search_plan.CALIBRATION_STEPS // config.run.eval_every)
  one_evaluation = {}
  t_start = _clock()
  step_seconds, call_seconds, scores, startup, first_wall, repeat = {}, {}, {}, 0.0, 0.0, 0.0
  eval_seconds = {}
  for recipe in candidates:
    if replayed is not None and recipe.name not in replayed.step_seconds:
      continue  # the recorded run did not measure it (its calibration ran out of time): the plan leaves it out
    # A candidate's first training compiles its network as the process's first did: expected as long as that one.
    if replayed is None and step_seconds and _clock() - t_start - startup + first_wall >= limit:
      logging.warning("recipe search: measuring %s would take about %.0f s, %.0f s of the %.0f s for measuring "
                      "are left: not compared", recipe.name, first_wall, limit - (_clock() - t_start - startup), limit)
      continue
    # The steps are trained even where the plan is replayed: the candidates' states are those of a measured run.
    t_call = _clock()
    # (No cap: the clock would count the first step's compilation against it and stop before a step was timed.)
    result = train_fn(calibration_config(recipe), os.path.join(workdir, SEARCH_DIR, recipe.name),
                      evaluate_test=False)
    wall = _clock() - t_call
    scores[recipe.name] = result["score"]
    # The scoring only (not the best state's save, which does not grow with the samples), less its compilation.
    scoring = result.get("eval_scoring_seconds", result.get("eval_seconds")) or 0.0
    one_evaluation[recipe.name] = max(scoring - (result.get("eval_compile_seconds") or 0.0), 0.0) / \
        calibration_evaluations
    eval_seconds[recipe.name] = eval_scale * one_evaluation[recipe.name]
    seconds = result.get("step_seconds")
    step_seconds[recipe.name] = None if seconds is None else round(seconds, 6)
    # A round's seconds besides its steps: the call's wall time less its training (the first step's compilation
    # with it: the first call compiles what later ones mostly find compiled; slower later rounds are seen by the
    # clock as they run).
    call_seconds[recipe.name] = round(max(wall - result["train_seconds"], 0.0), 3)
    # (A replay decides by the recorded step time, as the recorded run did.)
    decisive = replayed.step_seconds.get(recipe.name) if replayed is not None else step_seconds[recipe.name]
    few_epochs = budget_epochs(config, shape, decisive) < MIN_SEARCH_EPOCHS
    if len(call_seconds) == 1:  # the process's first training: its startup is any run's, not the search's
      startup, first_wall = call_seconds[recipe.name], wall
      if few_epochs:
        break  # the cheapest trains on (_planned says why): measuring the others would only spend its seconds
      # Its directory once more, at its steps already: what a round costs besides its steps once the programs
      # are compiled (the split, the state restored, the validation evaluation); a first training's compilations
      # took 2-5x that on 2 busy cores. Run in a replay as well: the candidates' states stay a measured run's.
      t_again = _clock()
      train_fn(calibration_config(recipe), os.path.join(workdir, SEARCH_DIR, recipe.name), evaluate_test=False)
      repeat = _clock() - t_again
    elif few_epochs:
      break  # not compared (_planned says why), nor the costlier ones after it: measuring them would spend seconds
  _round_fixed_seconds(step_seconds, call_seconds, eval_seconds, one_evaluation, repeat, eval_scale)
  measured = Measured(step_seconds, call_seconds, round(_clock() - t_start - startup, 3), round(startup, 3),
                      eval_seconds)
  if replayed is not None:
    logging.info("recipe search: planned from the step times recorded in %s (%s); measured here: %s",
                 config.search.plan_from, _describe(replayed), _describe(measured))
    write_record({"step": 0, **replayed.record(), "plan_from": config.search.plan_from,
                  "measured_here": measured.record()})
    return replayed, scores, startup
  logging.info("recipe search: measured %s (%.1f s of startup in the first)", _describe(measured), startup)
  write_record({"step": 0, **measured.record()})
  return measured, scores, startup


def _describe(measured: Measured) -> str:
  return ", ".join(f"{n} {1e3 * s:.1f} ms/step + {measured.call_seconds.get(n, 0.0):.1f} s a round"
                   if s is not None else f"{n} not measured" for n, s in measured.step_seconds.items())


def read_measurements(path: str, required: bool = True) -> Measured | None:
  """The step times recorded in ``path`` (a ``metrics.jsonl``, or a work directory holding one): its last
  ``measured_step_seconds`` record. None where there is none and not ``required`` (else a :class:`ConfigError`)."""
  found = recorded_plan(path)
  if found is None:
    if required:
      raise ConfigError("plan_from", path, NO_RECORDED_PLAN)
    return None
  return Measured.from_record(found)


class _Budget:
  """The search's seconds as the clock spends them: what a round is expected to cost, from the measured step times
  scaled by how much slower the candidate's trainings ran than expected."""

  def __init__(self, config: Config, measured: Measured | None, t_start: float):
    self.measured, self.t_start, self.eval_every = measured, t_start, config.run.eval_every
    self.budget = (config.search.search_fraction * config.budget.max_seconds
                   if config.budget.max_seconds is not None else None)
    self.slowdown: dict[str, float] = {}

  def left(self) -> float:
    return self.budget - (_clock() - self.t_start)

  def cap(self, still_to_train: int) -> float | None:
    """The seconds a candidate's training may take: its part of those left, shared with the round's others."""
    if self.budget is None or self.measured is None:
      return None
    return max(self.left() / still_to_train, 1.0)

  def _expected(self, name: str, start: int, end: int) -> float | None:
    seconds = self.measured.rate(name, self.eval_every) if self.measured is not None else None
    if seconds is None:
      return None
    return self.measured.call_seconds.get(name, 0.0) + (end - start) * seconds

  def affordable(self, name: str, start: int, seconds: float | None) -> float:
    """The steps a candidate at step ``start`` would reach in ``seconds`` (infinite: no cap, or unmeasured)."""
    step_seconds = self.measured.rate(name, self.eval_every) if self.measured is not None else None
    if seconds is None or not step_seconds:
      return math.inf
    slowdown = self.slowdown.get(name, max(self.slowdown.values(), default=1.0))
    return start + max(seconds - self.measured.call_seconds.get(name, 0.0) * slowdown, 0.0) / (
        step_seconds * slowdown)

  def cost(self, recipes_: list, start: dict[str, int], end: dict[str, int]) -> float:
    """Expected seconds of training ``recipes_`` from ``start`` to ``end`` steps (0 where unmeasured)."""
    total = 0.0
    # One not trained yet is expected as slow as the slowest seen: a shared machine slows every candidate.
    slowest = max(self.slowdown.values(), default=1.0)
    for r in recipes_:
      expected = self._expected(r.name, start[r.name], end[r.name])
      total += 0.0 if expected is None else expected * self.slowdown.get(r.name, slowest)
    return total

  def fits(self, recipes_: list, start: dict[str, int], end: dict[str, int]) -> bool:
    """Whether training them fits in the search's seconds left (always, without a budget in seconds)."""
    return self.budget is None or self.measured is None or self.cost(recipes_, start, end) <= self.left()

  def observed(self, name: str, start: int, end: int, wall: float) -> None:
    """Notes a training's wall time: later rounds expect the candidate as much slower (or faster: a first
    training's compilations are not repeated) than measured."""
    expected = self._expected(name, start, end)
    if expected:
      self.slowdown[name] = wall / expected


def finish_adoption(workdir: str) -> dict | None:
  """Completes an adoption of the search's winner that a stopped run left halfway (a no-op once done).

  Returns:
    The search's summary (``recipe``, ``search_seconds``, ``search_scores``) where ``workdir``'s run came from a
    finished recipe search, else None: a continued run reports it (its seconds were charged to the invocation that
    searched).
  """
  path = os.path.join(workdir, SEARCH_DIR, _ROUNDS_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  adoption = saved.get("adoption")
  if adoption is None:
    return None
  if not adoption["done"]:
    metrics_path = os.path.join(workdir, METRICS_FILE)
    if os.path.exists(metrics_path):  # the winner's records, if the stopped run appended them: once, not twice
      with open(metrics_path, "r+b") as f:
        f.truncate(adoption["metrics_bytes"])
    _adopt(os.path.join(workdir, SEARCH_DIR, adoption["summary"]["recipe"]), workdir)
    _write_rounds(path, saved["rounds"], adoption={**adoption, "done": True})
  return adoption["summary"]


_ROUNDS_FILE = "rounds.json"


def _read_rounds(path: str) -> list[dict]:
  """The results of the rounds an earlier, interrupted search finished (empty: none)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)["rounds"]


def _write_rounds(path: str, rounds: list[dict], adoption: dict | None = None) -> None:
  """Records the finished rounds (and the winner's adoption), whole or not at all (a rename)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  seals.write_json_atomically(path, {"rounds": rounds} | ({"adoption": adoption} if adoption is not None else {}))


def _remove_states(candidate_dir: str) -> None:
  """A candidate's states and assets (what a run continues or serves from); its records stay."""
  held.drop(candidate_dir)
  for name in ("checkpoints", "best_checkpoint", "assets"):
    shutil.rmtree(os.path.join(candidate_dir, name), ignore_errors=True)


# What a run directory holds that the run continues from (metrics.jsonl is appended, not moved).
_RUN_FILES = ("checkpoints", "best_checkpoint", "assets", "config.json")


def _adopt(candidate_dir: str, workdir: str) -> None:
  """Makes the winner's run directory the run's: its files moved to ``workdir``, its records appended.

  Run again after a stop, it moves what is still in ``candidate_dir`` (each move is one rename).
  """
  for name in _RUN_FILES:
    source, target = os.path.join(candidate_dir, name), os.path.join(workdir, name)
    if not os.path.exists(source):  # not written by the candidate, or moved before a stop
      continue
    if os.path.isdir(target):
      shutil.rmtree(target)
    os.replace(source, target)
  source = os.path.join(candidate_dir, METRICS_FILE)
  if os.path.exists(source):
    with open(source) as f, open(os.path.join(workdir, METRICS_FILE), "a") as out:
      out.write(f.read())
