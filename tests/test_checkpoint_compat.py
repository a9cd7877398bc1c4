"""Checkpoints written before the candidate index became one protocol (one ``index`` field of the state, issue 32)
still restore: ``sparsejax.load`` predicts from them, and a run resumes from them, as the code that wrote them
did (``tests/data/checkpoints_before_index``, written at main 32051d6 by its ``make.py``)."""

import json
import os
import shutil

import numpy as np
import pytest
import scipy.sparse as sp

import sparsejax
from sparsejax.config import Config
from sparsejax.settings import override
from sparsejax.train import driver
from sparsejax.workdir.checkpoint import Checkpoints

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoints_before_index")
INPUTS = sp.random(5, 40, density=0.2, format="csr", random_state=1, dtype=np.float32)  # as make.py drew them


def _expected(kind: str) -> dict:
  with open(os.path.join(FIXTURE, f"expected_{kind}.json")) as f:
    return json.load(f)


def _assert_predicts(workdir: str, want: dict, kind: str) -> None:
  model = sparsejax.load(workdir)
  assert model.step == want["step"]
  for name, k in (("exact", None), ("sampled", 8)):
    scores, ids = model.predict(INPUTS, top=3, k=k)
    if name == "sampled" and kind == "lsh":
      # Sampled inference builds LSH tables of their own sizes from the rows (issue 32), not the training tables
      # of the code that wrote the checkpoint: its picks differ from then, but each score is that label's exact
      # logit, and every label of the exact top 3 that it found is ranked as exact scoring ranks it.
      all_scores, all_ids = model.predict(INPUTS, top=model.num_labels)
      exact = np.zeros((INPUTS.shape[0], model.num_labels), np.float32)
      np.put_along_axis(exact, np.asarray(all_ids), np.asarray(all_scores, np.float32), axis=1)
      np.testing.assert_allclose(np.asarray(scores, np.float32), np.take_along_axis(exact, np.asarray(ids), 1),
                                 rtol=1e-5, atol=1e-6)
      assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)
      continue
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want[f"{name}_ids"]), err_msg=name)
    np.testing.assert_array_equal(np.asarray(scores, np.float32), np.asarray(want[f"{name}_scores"], np.float32),
                                  err_msg=name)


@pytest.mark.parametrize("kind", ["clusters", "lsh"])
def test_old_checkpoint_loads_and_predicts_as_before(kind, tmp_path):
  workdir = shutil.copytree(os.path.join(FIXTURE, kind), tmp_path / "run")
  saved = Checkpoints(str(workdir), writable=False).restore_arrays(6)
  assert "index" not in saved and "tables" in saved  # the earlier layout
  _assert_predicts(str(workdir), _expected(kind)["at_step_6"], kind)


@pytest.mark.parametrize("kind", ["clusters", "lsh"])
def test_run_resumes_from_old_checkpoint_as_before(kind, tmp_path):
  workdir = shutil.copytree(os.path.join(FIXTURE, kind), tmp_path / "run")
  with open(workdir / "config.json") as f:
    config = override(Config.from_dict(json.load(f)), max_steps=10)
  assert config.tables.candidates == kind
  driver.train_and_evaluate(config, str(workdir))
  assert Checkpoints(str(workdir), writable=False).latest_step() == 10
  assert "index" in Checkpoints(str(workdir), writable=False).restore_arrays(10)  # saved anew
  _assert_predicts(str(workdir), _expected(kind)["resumed_to_10"], kind)


def test_a_state_restored_without_its_average_leaves_the_field_out_of_the_target():
  """A selected state (restored without optimizer states or average, ``model_selection.without_optimizer``) from a
  checkpoint written before parameter averaging: orbax refuses a target with a field that the checkpoint lacks, even
  a None one, so the target leaves ``average`` out and the state gets it back as None (restoring the 10^6-label
  run's selected state failed with "tree structures do not match: average")."""
  from sparsejax.model import SlideState
  from sparsejax.workdir import saved_state

  state = SlideState(step=1, rng=None, embed=2, hidden=(), out=3, embed_opt=None, out_w_opt=None, out_b_opt=None,
                     dense_opt=None, index=None, average=None)
  saved = set(SlideState._fields) - {"average"}
  target, as_state = saved_state.in_saved_layout(state, saved)
  assert isinstance(target, dict) and "average" not in target and target["out"] == 3
  restored = as_state(target)
  assert isinstance(restored, SlideState) and restored.average is None and restored.out == 3
