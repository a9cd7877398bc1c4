"""Which state a loaded model serves, and its network: the run's selected state (or a checkpoint asked for by its
step) read back and checked against the run's seals (:class:`sparsejax.serving.model.TrainedModel` loads it)."""

import json
import os
import warnings
from typing import NamedTuple

from sparsejax import averaging, network
from sparsejax.config import Config
from sparsejax.network import SparseLayer
from sparsejax.workdir import best_checkpoint, checkpoint, seals


class ServedState(NamedTuple):
  """A restored state's arrays (``restore_arrays``' plain tree), its step, why that one (``"validation p@1"``,
  ``"newest"``, ``"step"``) and whether it is the run's best state."""
  tree: dict
  step: int
  selected_by: str
  from_best: bool


def recorded_model(workdir: str) -> str | None:
  """The ``--model`` that ``WORKDIR/config.json`` records (None: no readable one)."""
  try:
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      return json.load(f)["network"]["model"]
  except (OSError, ValueError, KeyError, TypeError, RecursionError):
    return None


def served_state(workdir: str, checkpoints: checkpoint.Checkpoints, config: Config, run_id: str | None, newest: int,
                 step: int | None) -> ServedState:
  """The state a model loaded from ``workdir`` serves, checked against the run's seals: the one the run selected on
  its validation split (and reported), not its last one, unless ``step`` asks. ``newest``: the newest checkpoint's
  step; ``run_id``: the run's (None: an older sparsejax's, unsealed)."""
  best = best_checkpoint.BestCheckpoint.open(workdir, config.run.selection_metric)
  saved = checkpoints.all_steps()
  if step is None and best is not None:
    served_step, selected_by, from_best = best.best_step(), f"validation {best.metric}", True
    check_selected(checkpoints, newest, served_step, best.step_directory(served_step))
  elif step is None or step in saved:
    served_step, from_best = newest if step is None else step, False
    selected_by = "newest" if step is None else "step"
    if step is None:  # a run that selected a state must not serve its newest instead, unsaid
      check_selected(checkpoints, newest, None, os.path.join(workdir, "best_checkpoint"))
  elif best is not None and step == best.best_step():
    served_step, selected_by, from_best = step, "step", True
  else:
    kept = ", ".join(map(str, saved)) + (f"; best: {best.best_step()}" if best is not None else "")
    raise ValueError(f"{workdir}: no checkpoint of step {step} (checkpoints kept: {kept})")
  if from_best:
    if run_id is not None:
      best.check(served_step, run_id)
    return ServedState(best.restore_arrays(), served_step, selected_by, True)
  problem = checkpoints.verify(served_step)
  if problem is not None:
    raise seals.IntegrityError(f"checkpoint {checkpoints.directory}/{served_step} {problem}")
  other_run = (checkpoints.meta(served_step) or {}).get("run_id")
  if run_id is not None and other_run is None:  # saved by an older sparsejax before the run was continued
    warnings.warn(seals.UnverifiedWarning(
        f"checkpoint {checkpoints.directory}/{served_step} was written by a sparsejax that did not record its "
        "run: loaded without checking that it is this run's"), stacklevel=4)
  elif run_id is not None and other_run != run_id:
    raise seals.IntegrityError(f"checkpoint {checkpoints.directory}/{served_step}: from another run (run "
                               f"{other_run}; the newest checkpoint is of run {run_id})")
  return ServedState(checkpoints.restore_arrays(served_step), served_step, selected_by, False)


def check_members(entries: list[dict], members: tuple, recorded: str, num_features: int, num_labels: int) -> None:
  """Raises :class:`IntegrityError` unless each loaded ensemble member (a
  :class:`sparsejax.serving.model.TrainedModel`) is the one that its entry of ``recorded`` (the assets' ensemble
  file) names, of the model's ``num_features`` and ``num_labels``."""
  for entry, member in zip(entries, members):
    if (member.num_features, member.num_labels) != (num_features, num_labels):
      raise seals.IntegrityError(f"{member.workdir}: not a member of this ensemble ({member.num_features} "
                                 f"features, {member.num_labels} labels; the model: {num_features}, "
                                 f"{num_labels})")
    if entry["run_id"] is None:
      warnings.warn(seals.UnverifiedWarning(
          f"{recorded} was written by a sparsejax that did not record its members' runs: {member.workdir} is "
          "loaded without checking that it is the member trained with this run"), stacklevel=5)
    elif (member.run_id, member.step) != (entry["run_id"], entry["step"]):
      raise seals.IntegrityError(f"{member.workdir}: not the member that {recorded} records: run "
                                 f"{member.run_id} step {member.step}, recorded run {entry['run_id']} "
                                 f"step {entry['step']}")


def check_selected(checkpoints, newest: int, kept: int | None, where: str) -> None:
  """Raises :class:`IntegrityError` where the best state kept (step ``kept``, None: none) is not the one that the
  newest checkpoint's model selection recorded: lost, or an earlier step's."""
  recorded = (checkpoints.position(newest).get("selection") or {}).get("best_step")
  if recorded is None:
    return
  if kept is None:
    raise seals.IntegrityError(f"{where}: missing: the state the run selected (step {recorded}, recorded in "
                               f"checkpoint {newest}) was lost. Load a kept checkpoint by its step "
                               f"({', '.join(map(str, checkpoints.all_steps()))}), or train again")
  # A later step is the final evaluation's (the last state, evaluated after the last checkpoint).
  if kept < recorded:
    raise seals.IntegrityError(f"{where}: from another step: the run selected step {recorded}, this is step {kept}")


def network_params(tree: dict, num_labels: int, average_steps: int) -> network.NetworkParams:
  """The network's parameters as the run evaluated them, from a restored state's arrays: a checkpoint's averaged
  (a selected state's are already), a sharded run's padding output rows (after the ``num_labels`` real ones) cut."""
  params = _network_params(tree)
  if tree.get("average") is not None:  # a checkpoint, not the selected state: served as the run evaluated it
    average = tree["average"]
    params = averaging.averaged_params(
        params, averaging.ParamAverage(_network_params(average["params"]), average["weight"], average["step"]),
        tree["step"], average_steps)
  return params._replace(out=SparseLayer(params.out.w[:num_labels], params.out.b[:num_labels]))


def _network_params(tree: dict):
  """The ``embed``, ``hidden`` and ``out`` of a state read back as plain dicts (``restore_arrays``)."""
  return network.NetworkParams(network.SparseLayer(tree["embed"]["w"], tree["embed"]["b"]),
                               tuple((w, b) for w, b in tree["hidden"]),
                               network.SparseLayer(tree["out"]["w"], tree["out"]["b"]))
