"""What a run resumes from: its work directory's checkpoints, its config file and its recorded final evaluation."""

import os
from typing import NamedTuple

import jax
from absl import logging

from sparsejax.config import MIN_STALE_EVALUATIONS, Config
from sparsejax.train import recipes
from sparsejax.train.metric_writer import read_records
from sparsejax.train.model_selection import stale_ratio
from sparsejax.workdir import checkpoint, orbax_logs, seals


def holds_checkpoints(workdir: str) -> bool:
  directory = os.path.join(workdir, "checkpoints")
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def restore_config_file(workdir: str, meta: dict | None, step: int) -> None:
  """Writes ``WORKDIR/config.json`` from checkpoint ``step``'s settings where it is missing: the messages that refuse
  other settings point to it, and a finished run, which writes nothing, would otherwise never have it again."""
  path = os.path.join(workdir, "config.json")
  if meta is None or os.path.exists(path) or jax.process_index() != 0:
    return
  seals.write_json_atomically(path, meta["config"], indent=1)
  logging.warning("%s was missing: written again from the settings of checkpoint %d", path, step)


def recorded_final(workdir: str, config: Config, latest: int, meta: dict | None) -> dict | None:
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


class Opened(NamedTuple):
  """A work directory's checkpoints as a run opens them: the newest good one, its meta, the settings changed since
  (``--resume=force``), the config with the recipe they record, and the recorded final evaluation of a finished
  run (None: it trains)."""
  config: Config
  checkpoints: checkpoint.Checkpoints
  latest: int | None
  meta: dict | None
  changed: list[str]
  finished: dict | None


def open_checkpoints(config: Config, workdir: str, num_shards: int) -> Opened:
  """The checkpoints of ``workdir``, checked against ``config`` (corrupted ones named and set aside)."""
  checkpoint.check_writable(workdir)
  read_records(workdir)  # another program's metrics.jsonl is named before anything in workdir is written
  orbax_logs.quiet_orbax_logs()
  checkpoints = checkpoint.Checkpoints(workdir, config.checkpoint.keep_checkpoints)
  latest = checkpoints.latest_good_step()  # corrupted ones: named, set aside
  meta = None if latest is None else checkpoints.meta(latest)
  changed, finished = [], None  # the settings that differ from the checkpoint's
  recorded_recipe = ((meta or {}).get("config") or {}).get("search", {}).get("recipe", recipes.AUTO)
  if config.search.recipe == recipes.AUTO and recorded_recipe in recipes.names():  # the one the search chose
    config = recipes.apply(config, recipes.get(recorded_recipe))
  if latest is not None:
    restore_config_file(workdir, meta, latest)
    changed = checkpoint.check_resume(meta, latest, config, num_shards, workdir)
    finished = recorded_final(workdir, config, latest, meta)
  return Opened(config, checkpoints, latest, meta, changed, finished)
