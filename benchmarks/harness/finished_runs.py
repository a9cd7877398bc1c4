"""The runs of ``benchmarks/accuracy.py`` as other benchmarks find and restore them: their layout under
``--workdir`` (``DATASET/train.txt``, ``DATASET/test.txt``, ``DATASET/sparsejax-TAG``), the flags that name one,
its selected state, and the ``--set NAME=VALUE`` settings they were trained with."""

import argparse
import json
import os

from sparsejax import data as xcdata

DATASETS = ("synthetic", "synthetic_1m", "synthetic_1m_2m", "synthetic_8m", "gcide", "gcide_cloze", "icd10", "wordnet",
            "tiny")
DEFAULT_WORKDIR = "/tmp/sparsejax_accuracy"


def parse_settings(settings: list[str] | None) -> dict:
  """``["name=value", ...]`` (values as JSON where they parse, else strings) -> override keywords."""
  out = {}
  for item in settings or ():
    name, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"--set {item!r}: expected NAME=VALUE (a sparsejax setting, e.g. learning_rate=0.01)")
    try:
      out[name] = json.loads(value)
    except json.JSONDecodeError:
      out[name] = value
  return out


def restored_state(config, run_dir: str, test):
  """``(run, state)``: the run's selected (else latest) state as saved, for data shaped like ``test``."""
  from sparsejax.distributed import sharding
  from sparsejax.model_config import ModelConfig
  from sparsejax.train.model_selection import without_optimizer
  from sparsejax.workdir import best_checkpoint, checkpoint

  run = sharding.make_run(ModelConfig.from_config(config, test.num_features, test.num_labels), seed=config.run.seed)
  # The selected state is kept without its optimizer states (evaluated and served, not trained on).
  state = best_checkpoint.BestCheckpoint(run_dir, config.run.selection_metric).restore(
      without_optimizer(run.abstract_state()))
  if state is None:
    state = checkpoint.Checkpoints(run_dir, writable=False).restore(run.abstract_state())[0]
  return run, state


def add_finished_run_flags(parser: argparse.ArgumentParser, dataset: str) -> None:
  """The flags that name a finished sparsejax run of this benchmark (see :func:`finished_run`)."""
  parser.add_argument("--dataset", default=dataset, choices=DATASETS)
  parser.add_argument("--tag", default="300s", help="the run's tag (300s for --budget 300, 1ep for --num_epochs 1)")
  parser.add_argument("--workdir", default=DEFAULT_WORKDIR, help="accuracy.py's --workdir")


def finished_run_dir(args) -> str:
  """The directory of the run that :func:`add_finished_run_flags`'s flags name."""
  return os.path.join(args.workdir, args.dataset, f"sparsejax-{args.tag}")


def finished_run(args):
  """A finished sparsejax run named by :func:`add_finished_run_flags`'s flags, restored for evaluation.

  Returns:
    ``(config, test, run, state, evaluator)``: the run's config, the test set, the run and its selected state
    as saved (its callers build the serving index themselves, under their variants or timed), and an evaluator
    of the test set as the run's own evaluations are made.
  """
  from sparsejax.config import Config
  from sparsejax.evaluation import Evaluator

  workdir = os.path.join(args.workdir, args.dataset)
  run_dir = finished_run_dir(args)
  with open(os.path.join(run_dir, "config.json")) as f:
    config = Config.from_dict(json.load(f))
  train = xcdata.load_xc_file(os.path.join(workdir, "train.txt"))
  test = xcdata.load_xc_file(os.path.join(workdir, "test.txt"))
  run, state = restored_state(config, run_dir, test)
  evaluator = Evaluator.for_run(test, train, config.data.max_features, config.run.propensity_a,
                                config.run.propensity_b)
  return config, test, run, state, evaluator


def curve_and_selection(run_dir: str, final: dict) -> dict:
  """The run's evaluation curve (metrics.jsonl) and, with a validation split, its selected and last step."""
  from sparsejax.train.metric_writer import read_records

  records = read_records(run_dir)
  # A recipe search trained the other candidates first: their seconds come before the winner's on the clock.
  winner = final.get("recipe")
  winner_search_seconds = sum(r["search"][winner]["train_seconds"] for r in records
                              if winner in r.get("search", {}))
  losers_seconds = max(final.get("search_seconds", 0.0) - winner_search_seconds, 0.0)
  curve = [{key: record.get(key) for key in ("step", "epoch", "seconds", "p@1", "p@5", "split")}
           for record in records if "p@1" in record and not record.get("final")]
  for point in curve:
    point["seconds"] += losers_seconds
  if "selected_step" in final and final["selected_step"] == final["last_step"] and \
      (not curve or curve[-1]["step"] != final["last_step"]):
    # The last state's validation evaluation (made by the final selection) is not in metrics.jsonl.
    curve.append({"step": final["last_step"], "epoch": final["epoch"], "seconds": final["seconds"] + losers_seconds,
                  "p@1": final["validation_p@1"], "p@5": None, "split": "validation"})
  result = {"curve": curve, "search_losers_seconds": losers_seconds}
  if "selected_step" in final:
    result["selection"] = {"selected_step": final["selected_step"], "last_step": final["last_step"],
                           "validation_p@1_selected": final.get("validation_p@1"),
                           "validation_p@1_by_step": {point["step"]: point["p@1"] for point in curve}}
  return result
