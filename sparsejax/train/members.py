"""Ensemble members trained with the budget that an early stop leaves (``--ensemble_members``).

A run with ``--max_seconds`` stops once its network has peaked (``--early_stopping_ratio``); on GCIDE cloze,
WordNet and ICD-10 that is within the first half of a 300 s budget. The rest trains more networks of the same
recipe from other seeds (``seed + m``: another initialisation and sample order; the same data, validation split
and test set), each for as many steps as the first took to its last improvement beyond the noise (its
selected state, unless the best crept up by noise after it: ``improved_step``), in ``WORKDIR/members/M`` (an
ordinary run directory: an interrupted member resumes). Their rankings are merged by mean logit
(:mod:`sparsejax.ensemble`), the centroid fusion's weight is chosen again on the validation split for the
ensemble, and the final record is the ensemble's test evaluation, through the model :func:`sparsejax.load`
serves. Members are added while the budget lasts: one is started where the first one's pace says it would finish
in the seconds left, and one that the clock stops before its steps anyway is left out, so a budget that does not
bind gives the same ensemble on any machine. A run that formed no ensemble records ``ensemble_members`` 1: run
again, it does not try the members again (its budget was spent as it was). A run that starts afresh removes the
members a former run left in its work directory (:func:`remove_former`).
"""

import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from sparsejax import fusion, model_kinds
from sparsejax.config import Config
from sparsejax.evaluation import Evaluator
from sparsejax.serving import assets
from sparsejax.serving.model import load
from sparsejax.settings import override
from sparsejax.train import head_ranking
from sparsejax.train.nonfinite import NonFiniteError
from sparsejax.workdir import checkpoint
from sparsejax.workdir.checkpoint import ResumeError

MEMBERS_DIR = "members"
# A member is started only where the budget left holds its expected seconds times this: one the clock stops is left
# out, its seconds spent for nothing. Measured: on base of the suite (VM (Zen 3), 2026-12-07) a member expected to
# need 69 s of the 70 left (the first network's pace, its evaluations' share included) was stopped at step 3,892 of
# 4,500: it would have needed about 81 s, 18% more (its own compilations, evaluations and checkpoints).
PACE_MARGIN = 1.25
# Fields of the first network's final record that describe the run (the schedule every member followed): the
# ensemble's record keeps them as they are.
_RUN_FIELDS = ("step", "last_step", "epoch", "stopped_by", "seconds", "final", "num_processes", "selected_step",
               "selected_by", "bad_evaluations", "improved_step", "stale_evaluations", "recipe", "search_seconds",
               "search_wall_seconds", "search_scores", "ranker_seconds", "validation_split", "near_neighbours")


def remove_former(workdir: str) -> None:
  """Removes ``WORKDIR/members`` as a run starts afresh (no checkpoint to resume): a former run's members, which
  would otherwise be resumed (a finished one taken as it is) and served with another first network."""
  path = os.path.join(workdir, MEMBERS_DIR)
  if os.path.islink(path):
    os.remove(path)  # the link only, never what it points to
  elif os.path.isdir(path):
    logging.warning("%s holds a former run's ensemble members: removed (the run in %s starts afresh)", path, workdir)
    shutil.rmtree(path)


def reason_not_to_train(config: Config, final: dict[str, Any], num_processes: int) -> str | None:
  """Why a run that ended with ``final`` trains no more members (None: it does)."""
  if config.search.ensemble_members <= 1:
    return "--ensemble_members=1"
  if config.budget.max_seconds is None:
    return "no --max_seconds budget"
  if config.data.validation_fraction <= 0:
    return "no validation split"
  if not model_kinds.of(config).sampled:
    return f"--model={config.network.model}"
  if num_processes > 1 or (config.dist.num_shards or 1) > 1:
    return "several processes"
  if final.get("stopped_by") != "early_stopping":
    if config.data.validation_split == "grouped" and final.get("stopped_by") == "max_seconds":
      return "a grouped validation split trains one network its whole budget (--validation_split)"
    return f"the budget was spent (stopped by {final.get('stopped_by')})"
  return None


TrainFn = Callable[..., dict[str, Any]]


def train(config: Config, final: dict[str, Any], workdir: str, train_fn: TrainFn,
          validation_seed: int) -> dict[str, dict[str, float]]:
  """Trains members ``1 .. --ensemble_members - 1`` while the budget lasts; returns the directories (relative to
  ``workdir``) of those that trained their steps, each with its ``{"train_seconds", "samples"}`` (trained by this
  invocation).

  Args:
    config: the first member's settings (its recipe applied; ``--max_seconds`` what its invocation had).
    final: the first member's final record: its selected ``step`` and ``train_seconds``.
    workdir: the run's directory.
    train_fn: ``train_fn(config, workdir, evaluate_test=False, validation_seed=...)`` trains a member to its
      budget (resuming its directory) and returns ``{"score", "step", "train_seconds", "samples"}``.
    validation_seed: the seed of the first member's validation split, which every member keeps.
  """
  # As many steps as the first took to its last improvement beyond the noise (its selected step where it was not
  # stopped early): the steps after it crept up by noise, and a member's budget is better spent on another member.
  steps = int(final.get("improved_step") or final["step"])
  # Evaluations count against the budget: the first member's training and evaluations, as its loop counted them.
  spent = final.get("budget_seconds", final.get("train_seconds", 0.0))
  left = config.budget.max_seconds - spent
  # A member's seconds, at the first one's measured pace (its evaluations' share included) with PACE_MARGIN: one that
  # would not finish is not started (it would be left out, its seconds spent for nothing).
  rate = final.get("samples_per_sec") or 0.0
  with_evaluations = spent / final["train_seconds"] if final.get("train_seconds") else 1.0
  need = PACE_MARGIN * steps * config.optim.batch_size / rate * with_evaluations if rate > 0 else 0.0
  done = {}
  for m in range(1, config.search.ensemble_members):
    if left < need or left <= 0:
      logging.info("ensemble: no member %d: it needs about %.0f s of training (%.0f s at the first one's pace, times "
                   "%.2f), %.0f s of the budget are left", m, need, need / PACE_MARGIN, PACE_MARGIN, max(left, 0.0))
      break
    member = os.path.join(MEMBERS_DIR, str(m))
    # A member's directory is continued as the search's candidates are (config.json may record the --resume of the
    # command that started the run: a --resume=never there must not refuse the member's own checkpoints).
    member_config = override(config, seed=config.run.seed + m, max_steps=steps, num_epochs=None, max_seconds=left,
                             ensemble_members=1, centroid_fusion=False, early_stopping_ratio=None,
                             early_stopping_patience=None,
                             resume="force" if config.checkpoint.resume == "force" else "auto")
    logging.info("ensemble: member %d (seed %d) trains %d steps in %s (%.0f s of the budget left)", m,
                 member_config.run.seed, steps, os.path.join(workdir, member), left)
    try:
      result = train_fn(member_config, os.path.join(workdir, member), evaluate_test=False,
                        validation_seed=validation_seed)
    except (NonFiniteError, ResumeError) as e:  # the run stays served by the members it has
      logging.warning("ensemble: member %d left out: %s", m, e)
      break
    left -= result.get("budget_seconds", result["train_seconds"])
    if result["step"] < steps:
      logging.info("ensemble: member %d stopped by the clock at step %d of %d: left out (%.0f s of the budget spent "
                   "on it)", m, result["step"], steps, result.get("budget_seconds", result["train_seconds"]))
      break
    logging.info("ensemble: member %d: validation %s %.4f", m, config.run.selection_metric, result["score"])
    done[member] = {"train_seconds": result["train_seconds"], "samples": result["samples"],
                    "budget_seconds": result.get("budget_seconds", result["train_seconds"])}
  return done


def evaluate(config: Config, final: dict[str, Any], workdir: str, members: dict[str, dict[str, float]],
             splits) -> dict[str, Any]:
  """The ensemble's final record: ``members`` recorded in the run's assets, the centroid fusion's weight chosen
  again on the validation split, and the test set's metrics of the model that :func:`sparsejax.load` serves.

  Args:
    config: the run's settings.
    final: the first member's final record: what the ensemble does not measure again (its test P@k, retrieval
      diagnostics and index fill, validation score, last loss) becomes ``member0_*``; ``num_params``,
      ``train_seconds``, ``seconds`` and ``samples_per_sec`` become the members' together.
    workdir: the run's directory.
    members: the other members' directories, relative to ``workdir``, with what :func:`train` returns of them.
    splits: ``(train, validation, test)``: the first member's training samples, validation split and test set.
  """
  train_set, validation, test = splits
  checkpoints = checkpoint.Checkpoints(workdir, writable=False)
  run_id = (checkpoints.meta(checkpoints.latest_step()) or {}).get("run_id")
  assets.save_ensemble(workdir, run_id, list(members))
  model = load(workdir)
  evaluator = lambda dataset: Evaluator.for_run(dataset, train_set, config.data.max_features,
                                                config.run.propensity_a, config.run.propensity_b)
  record = {f"member0_{key}": final[key] for key in ("p@1", "p@5", "network_p@1", "validation_p@1") if key in final}
  if config.run.centroid_fusion:
    listed = min(fusion.CANDIDATES, model.num_labels)
    fused, fusion_record = evaluator(validation).choose_fusion(
        model.network_predictor(listed), model.params, fusion.label_centroids(train_set),
        head_ranking.read(config, workdir, train_set), config.run.selection_metric, config.run.eval_samples,
        who="ensemble: ")
    assets.save_fusion(workdir, run_id, fused)
    model.use_fusion(fused)  # what load reads back from the file just written (not loaded again)
    record.update(fusion_record)
  network = evaluator(test)(model.network_predictor(min(5, model.num_labels)), model.params)
  record.update({f"network_{key}": value for key, value in network.items()})
  record.update(model.evaluate(test))
  record["ensemble_members"] = 1 + len(members)
  record["member_train_seconds"] = [final.get("train_seconds", 0.0), *(m["train_seconds"] for m in members.values())]
  record["train_seconds"] = sum(record["member_train_seconds"])
  record["budget_seconds"] = round(final.get("budget_seconds", 0.0) + sum(
      m.get("budget_seconds", m["train_seconds"]) for m in members.values()), 2)
  record["seconds"] = final.get("seconds", 0.0) + sum(record["member_train_seconds"][1:])
  samples = final.get("samples_per_sec", 0.0) * final.get("train_seconds", 0.0) + sum(
      m["samples"] for m in members.values())
  record["samples_per_sec"] = samples / max(record["train_seconds"], 1e-9)
  record["num_params"] = sum(int(np.prod(np.shape(x))) for m in (model, *model.members)
                             for x in jax.tree.leaves(m.params))
  # What the first network alone measured and the ensemble did not measure again (its retrieval diagnostics, index
  # fill, validation score, last loss) is named as the first member's; the fields that describe the run stay.
  record.update({f"member0_{key}": value for key, value in final.items()
                 if key not in record and key not in _RUN_FIELDS})
  logging.info("ensemble of %d networks (test set): P@1 %.4f (the first alone %.4f), network alone %.4f",
               record["ensemble_members"], record["p@1"], final["p@1"], record["network_p@1"])
  return {**{key: value for key, value in final.items() if key in _RUN_FIELDS}, **record}
