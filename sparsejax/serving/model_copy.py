"""A loaded model copied into a new directory, which :func:`sparsejax.load` opens as it opens a run's
(:meth:`sparsejax.serving.model.TrainedModel.save`)."""

import os
import shutil
from collections.abc import Callable

from sparsejax.serving import assets
from sparsejax.serving.assets import ASSETS
from sparsejax.workdir import checkpoint


def save(workdir: str, step: int | None, directory: str, save_member: Callable[[str, str], str]) -> str:
  """Copies what serving the model of ``workdir`` needs into ``directory`` (new, or empty): the run's newest
  checkpoint (its settings and data sizes), checkpoint ``step`` where a model loaded by its step asks for it (None:
  the selected best state), the best state, the assets (vectorizer, label names and frequencies, serving index) and
  ``config.json``, with their seals; no training records, no other checkpoints. ``save_member(member's directory,
  target)`` copies each ensemble member the assets name, at the same place relative to the copy. Written whole or
  not at all; returns the directory's absolute path."""
  target = os.path.abspath(os.path.expanduser(directory))
  if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
    raise FileExistsError(f"save: {target} exists and is not an empty directory (save makes a new one)")
  checkpoints = checkpoint.Checkpoints(workdir, writable=False)
  steps = {str(checkpoints.latest_step())}
  if step is not None and step in checkpoints.all_steps():
    steps.add(str(step))
  partial = target + ".partial"
  shutil.rmtree(partial, ignore_errors=True)
  os.makedirs(os.path.join(partial, "checkpoints"))
  for name in os.listdir(checkpoints.directory):  # the steps kept, and orbax's own files beside them
    if name in steps or not (name.isdigit() or name.endswith(".corrupt")):
      source = os.path.join(checkpoints.directory, name)
      (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, os.path.join(partial, "checkpoints", name))
  for name in ("best_checkpoint", ASSETS):
    if os.path.isdir(os.path.join(workdir, name)):
      shutil.copytree(os.path.join(workdir, name), os.path.join(partial, name))
  # The members at the same place relative to the copy: every one the assets name (loaded at another step, this
  # model serves none, but the copy's selected state must).
  ensemble = os.path.join(workdir, ASSETS, assets.ENSEMBLE)
  for member in (assets.read_ensemble(ensemble) if os.path.exists(ensemble) else ()):
    member = member["directory"]
    save_member(assets.member_directory(workdir, member, ensemble), os.path.join(partial, member))
  if os.path.exists(os.path.join(workdir, "config.json")):
    shutil.copy2(os.path.join(workdir, "config.json"), os.path.join(partial, "config.json"))
  if os.path.isdir(target):
    os.rmdir(target)
  os.replace(partial, target)
  return target
