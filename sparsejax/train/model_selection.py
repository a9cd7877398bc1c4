"""Model selection on the validation split: the best state so far, kept on disk (a small one written at the next
checkpoint: :class:`sparsejax.workdir.best_checkpoint.BestCheckpoint`), and early stopping.

A run with a validation split evaluates it every ``--eval_every`` steps (:class:`Selection`): the best state is
saved without its optimizer states (:func:`without_optimizer`), and the run stops early after ``patience``
evaluations without a better value, or at ``--early_stopping_ratio`` times the step of the last improvement beyond
the noise. The selection's state travels in each checkpoint (``to_json``), so a resumed run compares with the same
best; :func:`kept_selection` checks that the best state it names is still intact.
"""

import dataclasses
import math
import time
from typing import TYPE_CHECKING

import jax
from absl import logging

from sparsejax import averaging, evaluation
from sparsejax.config import MIN_STALE_EVALUATIONS, NOISE_MARGIN, Config, DataConfig
from sparsejax.distributed import sharding
from sparsejax.evaluation import Evaluator
from sparsejax.train import search_plan
from sparsejax.workdir import best_checkpoint, saved_state, seals

if TYPE_CHECKING:  # (resume reads stale_ratio from here)
  from sparsejax.train.plan import DataPlan
  from sparsejax.train.resume import Opened

# The settings that decide what a validation score measures: the data (and so the split), the seed that draws the
# split, the metric and the samples evaluated.
SELECTION_SETTINGS = {f.name for f in dataclasses.fields(DataConfig)} | {"seed", "selection_metric", "eval_samples"}


def stale_ratio(config: Config) -> float | None:
  """The ``--early_stopping_ratio`` that a run of ``config`` stops by: a budget in seconds only, and a random
  validation split (None: none). A grouped split's evaluations (few groups: noisy) do not stop a run on a plateau:
  on debian_depends its scores rose slowly with the test set's to the end of the budget, and a stop at twice the
  last improvement beyond the noise would have kept step 2,500 (test P@1 0.660 against 0.677 at 9,500)."""
  if config.budget.max_seconds is None or config.data.validation_split == "grouped":
    return None
  return config.run.early_stopping_ratio


class Selection:
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

  def __init__(self, evaluator: Evaluator, best: best_checkpoint.BestCheckpoint, config, restored: dict | None,
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
    result, _ = evaluation.evaluate_state(self.evaluator, run, state, num_samples, sampled=self.sampled)
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
    checkpoint): the process holds one state's arrays throughout (besides a small best state's copy, written and
    dropped first)."""
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


def kept_selection(best: best_checkpoint.BestCheckpoint, restored: dict | None, run_id: str | None,
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
  return state._replace(**{f: None for f in state._fields if saved_state.is_optimizer_state(f) or f == "average"})


def for_run(config: Config, workdir: str, opened: "Opened", split: "DataPlan", position: dict, run_id: str,
            start_step: int, evaluator) -> "Selection | None":
  """A run's model selection on its validation split (None: it has none), continued where a checkpoint left it
  (``position``'s, of the checkpoints ``opened``) when its scores compare; ``evaluator(dataset)`` scores a split."""
  if split.validation is None:
    return None
  meta = opened.meta
  best = best_checkpoint.BestCheckpoint(workdir, config.run.selection_metric, run_id=run_id)
  restored_selection = position.get("selection")
  scored_otherwise = [f"--{n}" for n in sorted(set(opened.changed) & SELECTION_SETTINGS)]
  if meta is not None and meta["data"] != split.sizes:  # --resume=force past other data
    scored_otherwise.append("the data")
  if scored_otherwise:  # the kept scores are of another validation split or metric: they do not compare
    # (a recipe search's candidate after its calibration's steps, scored on fewer samples: as expected)
    logging.log(logging.INFO if start_step <= search_plan.CALIBRATION_STEPS else logging.WARNING,
                "model selection starts anew at step %d: %s changed, so the best state kept so far was scored "
                "otherwise", start_step, ", ".join(scored_otherwise))
    best.discard_after(-1)
    restored_selection = None
  else:
    # A best state newer than the checkpoint resumed from belongs to steps that are trained again now (the
    # process died between an evaluation and the next checkpoint): they will be evaluated and kept again.
    best.discard_after(start_step)
    unsealed_run = meta is not None and meta.get("run_id") is None
    restored_selection = kept_selection(best, restored_selection, None if unsealed_run else run_id, start_step)
  validation = split.validation
  return Selection(
      evaluator(validation), best, config.run, restored_selection, stale_ratio(config),
      noise_samples=min(config.run.eval_samples or len(validation), len(validation)))
