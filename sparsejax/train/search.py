"""The recipe search: successive halving over :mod:`sparsejax.train.recipes` on the validation split, within the budget.

A fresh run with ``--recipe=auto`` (the default) spends at most ``--search_fraction`` of its training budget
comparing the recipes. Each candidate trains in ``WORKDIR/search/NAME`` (an ordinary run directory: an
interrupted search resumes), is scored on the whole validation split, and the better half goes on for twice
the budget, until one is left. The winner's directory then becomes the run's: it trains on from the steps it
took in the search, so they are not lost. ``metrics.jsonl`` gets one ``"search"`` record per round (each
candidate's steps, training seconds and validation score) and one naming the winner.

Rounds are measured in steps, never in measured seconds, so that the same seed chooses the same recipe and
yields bit-identical parameters on any machine. With ``--max_seconds`` a candidate's steps are its share of
the search's seconds over its *modelled* step time (:func:`modelled_step_seconds`: the step's multiply-adds and
row updates at rates measured on 2 cores); with ``--max_steps`` or ``--num_epochs`` every candidate of a round
gets the same steps.
"""

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

from absl import logging

from sparsejax import step_cost
from sparsejax.config import Config, override
from sparsejax.train import recipes, seals
from sparsejax.train.metric_writer import METRICS_FILE

SEARCH_DIR = "search"
# A round shorter than this tells recipes apart by noise (a few hundred steps of Adam at the default rate): a
# budget that gives fewer steps to the first round compares fewer recipes, down to none.
MIN_ROUND_STEPS = 100


@dataclasses.dataclass(frozen=True)
class DataShape:
  """What the step cost depends on: the training set's sizes and a sample's mean non-zero features."""
  num_train: int
  num_features: int
  num_labels: int
  mean_features: float


def modelled_step_seconds(config: Config, shape: DataShape) -> float:
  """Modelled wall time of one training step of ``config`` on data of ``shape`` (one process):
  :mod:`sparsejax.step_cost`'s model, with the output layer on the path the run takes (``--softmax``).

  Multiply-adds: the input layer's ``nnz x d0`` per sample (forward, and its row gradients), the hidden layers'
  ``d_i x d_i+1`` (three products each), the output layer's ``k x d`` gathered (three products), or ``N x d`` in
  dense matmuls on the exact path. Row updates: the input rows a batch touches and the output rows
  (``min(B k, N)``; ``N`` exact), times ``d``.
  """
  from sparsejax.model_config import ModelConfig

  model = ModelConfig.from_config(config, shape.num_features, shape.num_labels)
  b, dims = config.optim.batch_size, model.hidden_dims
  return (step_cost.input_and_hidden_seconds(b, dims, shape.mean_features, shape.num_features)
          + step_cost.output_layer_seconds(b, model.num_labels, model.k, dims[-1], exact=model.exact_softmax))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The search's rounds: ``steps[name]`` is each candidate's step count at the end of round 0 (round r:
  ``2**r`` times it); ``rounds`` how many rounds it takes to leave one."""
  candidates: tuple[recipes.Recipe, ...]
  steps: dict[str, int]
  rounds: int


def _round_units(count: int) -> tuple[int, int]:
  """``(rounds, units)``: successive halving of ``count`` candidates; ``units`` is the total of round-0 budgets
  it spends (round r trains ``ceil(count / 2**r)`` candidates from ``2**(r-1)`` to ``2**r`` round-0 budgets)."""
  rounds, alive, units = 0, count, 0
  while alive > 1:
    units += alive * (1 if rounds == 0 else 2 ** (rounds - 1))
    alive, rounds = -(-alive // 2), rounds + 1
  return rounds, units


def plan(config: Config, shape: DataShape, candidates: tuple[recipes.Recipe, ...]) -> Plan | None:
  """The rounds that fit ``config``'s budget, or None where no two candidates fit (too small a budget)."""
  steps_per_epoch = max(shape.num_train // config.optim.batch_size, 1)
  max_steps = config.budget.max_steps_for(steps_per_epoch)
  fraction = config.search.search_fraction
  candidates = tuple(candidates)
  while len(candidates) > 1:
    rounds, units = _round_units(len(candidates))
    configs = {r.name: recipes.apply(config, r) for r in candidates}
    if config.budget.max_seconds is not None:
      share = fraction * config.budget.max_seconds / units  # round-0 seconds of each candidate
      steps = {n: int(share / modelled_step_seconds(c, shape)) for n, c in configs.items()}
      if max_steps is not None:  # a step or epoch limit too: no candidate past its share of those
        steps = {n: min(s, int(fraction * max_steps / units)) for n, s in steps.items()}
    else:
      steps = {n: int(fraction * max_steps / units) for n in configs}
    if min(steps.values()) >= MIN_ROUND_STEPS:
      return Plan(candidates, steps, rounds)
    candidates = candidates[:-1]  # the costliest last: drop it and plan again
  return None


def reason_not_to_search(config: Config, num_processes: int) -> str | None:
  """Why ``config`` trains without a search (None: it searches)."""
  if config.search.recipe != recipes.AUTO:
    return f"--recipe={config.search.recipe}"
  explicit = recipes.explicit_settings(config)
  if explicit:
    return "recipe settings given: " + ", ".join(f"--{n}" for n in explicit)
  if config.network.model != "slide":
    return "--model=dense"
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
      its directory) and returns ``{"score": best validation metric, "train_seconds": ...}``.
    write_record: appends a record to the run's ``metrics.jsonl``.
    candidates: the recipes, cheapest first.

  Returns:
    None where the budget fits no comparison (the log says so; the run trains the defaults).
  """
  the_plan = plan(config, shape, candidates)
  if the_plan is None:
    logging.info("recipe search: the budget is too small to compare recipes (< %d steps each): training the "
                 "defaults", MIN_ROUND_STEPS)
    return None
  metric = config.run.selection_metric
  logging.info("recipe search over %s: %d round(s) of successive halving on validation %s; first round: %s",
               ", ".join(r.name for r in the_plan.candidates), the_plan.rounds, metric,
               ", ".join(f"{n} {s} steps" for n, s in the_plan.steps.items()))
  alive = list(the_plan.candidates)
  scores: dict[str, float] = {}
  search_seconds = 0.0
  # Rounds already done (an interrupted search run again): their results, not their training again. A candidate
  # of a later round has trained past an earlier round's steps, so replaying that round would score another state.
  done_path = os.path.join(workdir, SEARCH_DIR, _ROUNDS_FILE)
  done = _read_rounds(done_path)
  # Each round continues the candidate's own directory: under --resume=force too (a changed setting), else auto.
  resume = "force" if config.checkpoint.resume == "force" else "auto"
  for round_index in range(the_plan.rounds):
    if round_index < len(done):
      results = done[round_index]
      logging.info("recipe search, round %d: done before (%s)", round_index + 1,
                   ", ".join(f"{n} {r['score']:.4f}" for n, r in results.items()))
    else:
      results = {}
      for recipe in alive:
        steps = the_plan.steps[recipe.name] * 2 ** round_index
        candidate = override(recipes.apply(config, recipe), max_steps=steps, num_epochs=None, max_seconds=None,
                             early_stopping_patience=None, resume=resume)
        result = train_fn(candidate, os.path.join(workdir, SEARCH_DIR, recipe.name), evaluate_test=False)
        results[recipe.name] = {"steps": steps, "score": result["score"],
                                "train_seconds": round(result["train_seconds"], 2)}
        logging.info("recipe search, round %d: %s (%s) after %d steps: validation %s %.4f", round_index + 1,
                     recipe.name, recipe.summary, steps, metric, result["score"])
    for name, result in results.items():
      scores[name] = result["score"]
      search_seconds += result["train_seconds"]
    # The better half goes on; ties keep the cheaper recipe (the candidates' order), for a deterministic choice; a
    # non-finite score (a diverged candidate) ranks last.
    ranked = sorted(alive, key=lambda r: -scores[r.name] if math.isfinite(scores[r.name]) else math.inf)
    alive = ranked[:-(-len(alive) // 2)]
    if round_index >= len(done):
      done.append(results)
      _write_rounds(done_path, done)
      write_record({"step": 0, "search_round": round_index + 1, "search": results,
                    "search_kept": [r.name for r in alive]})
    for recipe in the_plan.candidates:  # the eliminated ones' states are not needed again (their records stay)
      if recipe not in alive:
        _remove_states(os.path.join(workdir, SEARCH_DIR, recipe.name))
  winner = alive[0]
  summary = {"recipe": winner.name, "search_seconds": round(search_seconds, 2),
             "search_scores": {name: round(value, 4) for name, value in scores.items()}}
  logging.info("recipe search: %s wins (validation %s %.4f; %s) after %.0f s of search training", winner.name,
               metric, scores[winner.name], winner.summary, search_seconds)
  write_record({"step": 0, "search_winner": winner.name, **summary})
  # The adoption is several moves: rounds.json says it began (and how long metrics.jsonl was), so that a run
  # stopped halfway finishes it (finish_adoption) instead of resuming from half the winner's files.
  metrics_path = os.path.join(workdir, METRICS_FILE)
  _write_rounds(done_path, done, adoption={"summary": summary, "done": False,
                                           "metrics_bytes": os.path.getsize(metrics_path)
                                           if os.path.exists(metrics_path) else 0})
  finish_adoption(workdir)
  # The run continues the winner's checkpoints (a fresh run's: there were none before the search).
  return override(recipes.apply(config, winner), resume="auto"), summary


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
