"""Checkpoints held in memory (sparsejax.workdir.held): a recipe search's candidates keep theirs between rounds, and
only the survivors' are written, with the same floats as a search that writes every one (issue 48)."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.settings import override
from sparsejax.train import loop, search_plan, train_and_evaluate
from sparsejax.train.metric_writer import read_records
from sparsejax.train.stopping import Interrupted, StopRequests
from sparsejax.workdir import checkpoint, held
from sparsejax.workdir.checkpoint import Checkpoints

META = {"config": {"a": (1, 2)}, "data": {"steps_per_epoch": 3}}


def _state(seed: int):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((40, 8), np.float32)), "step": jnp.asarray(seed, jnp.int32)}


def _on_disk(workdir) -> list[str]:
  directory = os.path.join(workdir, "checkpoints")
  return sorted(n for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []


def test_a_held_checkpoint_is_read_as_a_written_one_and_written_when_the_block_ends(tmp_path):
  root = tmp_path / "search"
  workdir = str(root / "a")
  first, second = _state(1), _state(2)
  expected = jax.tree.map(np.asarray, second)
  with checkpoint.held_in_memory(str(root)):
    Checkpoints(workdir).save(5, first, {"index": 7, "pair": (1, 2)}, META, wait=True, last=True)
    assert _on_disk(workdir) == []
    Checkpoints(workdir, writable=False).write_held()  # a reader neither writes nor drops it
    assert _on_disk(workdir) == [] and held.get(os.path.join(workdir, "checkpoints")).step == 5
    opened = Checkpoints(workdir)  # another run in the directory, as the next round opens it
    assert opened.latest_good_step() == 5 and opened.latest_step() == 5 and opened.all_steps() == [5]
    assert opened.meta(5) == {"config": {"a": [1, 2]}, "data": {"steps_per_epoch": 3}}  # as JSON gives it back
    assert opened.position(5) == {"index": 7, "pair": [1, 2]}
    assert opened.shape_differences(5, first) == []
    assert opened.shape_differences(5, {"w": jnp.zeros((41, 8)), "step": first["step"]}) == \
        ["w: saved (40, 8), now (41, 8)"]
    state, position = opened.restore(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), first))
    assert state["w"] is first["w"] and position["index"] == 7  # the arrays themselves: trained on from here
    assert opened.latest_step() == 5  # held until the training's first step donates them
    for array in jax.tree.leaves(state):
      array.delete()
    assert opened.latest_step() is None and held.get(opened.directory) is None  # spent: nothing on disk either
    # A checkpoint saved mid-training is a copy: the training donates (deletes) the arrays it saved.
    opened.save(9, second, {"index": 8}, META)
    for array in jax.tree.leaves(second):
      array.delete()
    assert _on_disk(workdir) == []
  assert _on_disk(workdir) == ["9"]
  written = Checkpoints(workdir, writable=False)
  assert written.verify(9) is None and written.position(9) == {"index": 8}
  jax.tree.map(np.testing.assert_array_equal, written.restore_arrays(9), expected)


def test_a_dropped_checkpoint_is_never_written_and_one_over_the_limit_is_written_at_once(tmp_path, monkeypatch):
  root = tmp_path / "search"
  with checkpoint.held_in_memory(str(root)):
    Checkpoints(str(root / "eliminated")).save(3, _state(3), {}, META, last=True)
    held.drop(str(root / "eliminated"))
    monkeypatch.setattr(held, "HELD_BYTES", 100)  # smaller than the state's 1,284 bytes
    big = Checkpoints(str(root / "big"))
    big.save(4, _state(4), {}, META, wait=True)
    assert _on_disk(root / "big") == ["4"] and held.get(big.directory) is None
  assert _on_disk(root / "eliminated") == [] and _on_disk(root / "big") == ["4"]


def test_an_error_in_the_block_writes_what_is_held_before_it_is_raised(tmp_path):
  """Held checkpoints are written as a signal's stop leaves the block, one restored by a training that did not
  step yet as well."""
  root = tmp_path / "search"
  state = _state(6)
  with pytest.raises(KeyboardInterrupt), checkpoint.held_in_memory(str(root)):
    Checkpoints(str(root / "a")).save(6, state, {}, META, last=True)
    Checkpoints(str(root / "b")).save(8, _state(8), {}, META, last=True)
    Checkpoints(str(root / "b")).restore(_state(8))
    raise KeyboardInterrupt  # a signal's stop, as the training raises it
  assert _on_disk(root / "a") == ["6"] and _on_disk(root / "b") == ["8"] and held.under(str(root)) == []
  jax.tree.map(np.testing.assert_array_equal, Checkpoints(str(root / "a"), writable=False).restore_arrays(),
               jax.tree.map(np.asarray, state))


def test_a_failed_write_leaves_the_others_written_and_nothing_held(tmp_path, monkeypatch):
  root = tmp_path / "search"
  real_check = checkpoint.check_disk_space

  def full_for_a(directory, *args):
    if f"{os.sep}a{os.sep}" in directory:
      raise checkpoint.CheckpointError("saving checkpoint a failed (no space left on device)")
    return real_check(directory, *args)

  with pytest.raises(checkpoint.CheckpointError, match="no space"), checkpoint.held_in_memory(str(root)):
    Checkpoints(str(root / "a")).save(1, _state(1), {}, META, last=True)
    Checkpoints(str(root / "b")).save(2, _state(2), {}, META, last=True)
    monkeypatch.setattr(checkpoint, "check_disk_space", full_for_a)
  assert _on_disk(root / "a") == [] and _on_disk(root / "b") == ["2"] and held.under(str(root)) == []


def test_outside_the_block_a_save_is_written(tmp_path):
  Checkpoints(str(tmp_path)).save(2, _state(2), {}, META, wait=True, last=True)
  assert _on_disk(tmp_path) == ["2"]


def _untimed(record):
  """``record`` without what is measured (times, memory: what differs between two runs of the same steps)."""
  if not isinstance(record, dict):
    return record
  return {k: _untimed(v) for k, v in record.items()
          if "seconds" not in k and k not in ("samples_per_sec", "peak_rss_mb")}


@pytest.fixture
def search_config(small_config, monkeypatch):
  monkeypatch.setattr(search_plan, "MIN_ROUND_STEPS", 10)
  # Periodic checkpoints inside the rounds (copies held) and at their ends (the last states held).
  return override(small_config, recipe="auto", validation_fraction=0.1, max_steps=80, search_fraction=0.6,
                  eval_every=1000, checkpoint_every=7, hidden_dims=(128,), active_k=1024)


def test_a_search_holding_its_candidates_checkpoints_trains_the_same_floats_and_writes_only_the_winners(
    tmp_path, search_config, monkeypatch):
  """The same search, its candidates' checkpoints held (the default) and all written (a limit of 0 bytes): the same
  rounds, scores, final parameters and metrics; held, the candidates' directories received one checkpoint in all
  (the winner's, written before it is adopted), written, one per candidate per training and more."""
  saves = []
  real_check = checkpoint.check_disk_space  # called by every save that writes
  monkeypatch.setattr(checkpoint, "check_disk_space", lambda d, *a: (saves.append(d), real_check(d, *a))[1])
  results, written = {}, {}
  for how in ("held", "written"):
    if how == "written":
      monkeypatch.setattr(held, "HELD_BYTES", 0)
    saves.clear()
    results[how] = train_and_evaluate(search_config, str(tmp_path / how))
    written[how] = [d for d in saves if f"{os.sep}search{os.sep}" in d]
  assert len(written["held"]) == 1 and len(written["written"]) >= 6, written
  records = {how: [_untimed(r) for r in read_records(str(tmp_path / how)) if "search" in r or "final" in r]
             for how in results}
  assert records["held"] == records["written"]
  arrays = {how: Checkpoints(str(tmp_path / how), writable=False).restore_arrays() for how in results}
  jax.tree.map(np.testing.assert_array_equal, arrays["held"], arrays["written"])



def test_a_search_stopped_by_a_signal_mid_round_continues_to_the_same_floats(tmp_path, search_config, monkeypatch):
  """A SIGTERM in round 1 at step 12 of its second candidate (wide; small trained its 24 steps before): both held
  checkpoints are written as the search stops, and the same command continues it to the same final state as a
  search never stopped."""
  passed, stopped = [], []

  class _SignalInTheSecondTraining(StopRequests):
    def requested(self, step):
      if step == 12:
        passed.append(step)
        if len(passed) == 2:  # (each training passes step 12 once)
          stopped.append(step)
          self.signum = signal.SIGTERM
      return super().requested(step)

  unbroken = train_and_evaluate(search_config, str(tmp_path / "unbroken"))
  monkeypatch.setattr(loop, "StopRequests", _SignalInTheSecondTraining)
  with pytest.raises(Interrupted):
    train_and_evaluate(search_config, str(tmp_path / "stopped"))
  assert stopped and held.under(str(tmp_path)) == []
  search = tmp_path / "stopped" / "search"
  assert _on_disk(search / "small") == ["24"] and _on_disk(search / "wide") == ["12"]
  continued = train_and_evaluate(search_config, str(tmp_path / "stopped"))
  assert continued["recipe"] == unbroken["recipe"] and continued["step"] == unbroken["step"]
  arrays = [Checkpoints(str(tmp_path / d), writable=False).restore_arrays() for d in ("unbroken", "stopped")]
  jax.tree.map(np.testing.assert_array_equal, *arrays)
