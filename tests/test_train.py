"""train_and_evaluate: metrics, bit-identical resume, safe work directories, stopping on signals, crash safety."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import sparsejax
from sparsejax import data
from sparsejax.config import Config
from sparsejax.network import NetworkParams, SparseLayer
from sparsejax.settings import ConfigError, override
from sparsejax.train import train_and_evaluate
from sparsejax.train.metric_writer import MetricWriter, read_records
from sparsejax.workdir.checkpoint import Checkpoints, ResumeError


def _latest(workdir):
  checkpoints = Checkpoints(str(workdir), writable=False)
  step = checkpoints.latest_step()
  return step, checkpoints.restore_arrays(step)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, small_config):
  """``small_config`` trained to its end (40 steps): ``(workdir, final result)``. Read only; a test that changes
  the run works on its own copy (``_copy_of``)."""
  workdir = tmp_path_factory.mktemp("finished")
  return workdir, train_and_evaluate(small_config, str(workdir))


def _copy_of(finished_run, tmp_path):
  """A copy of the finished run's work directory (file times kept) at ``tmp_path / "run"``: its path."""
  return shutil.copytree(finished_run[0], tmp_path / "run")


def test_metrics_jsonl_and_final_result(finished_run, small_config):
  workdir, final = finished_run
  records = read_records(str(workdir))
  # Training loss every log_every (10) steps, test metrics every eval_every (20) but the last, then the final one
  # (its step the selected one, its loss the last step's: named so, not "loss").
  assert [r["step"] for r in records] == [10, 20, 30, 40, 40]
  assert [("loss" in r, "p@1" in r, bool(r.get("final"))) for r in records] == [
      (True, False, False), (True, True, False), (True, False, False), (True, False, False), (False, True, True)]
  assert records[-1]["last_loss"] == records[-2]["loss"] and records[-1]["stopped_by"] == "max_steps"
  for key in ("last_loss", "p@1", "p@5", "samples_per_sec", "psp@5", "sampled_p@1", "seconds"):
    assert np.isfinite(records[-1][key]), key
  assert final == records[-1] and final["step"] == 40
  for r in records[:-1]:  # step times (mean: no window, so no per-step sync) and bytes; one process: none sent
    assert r["steps_timed"] == 10 and 0 < r["step_seconds_mean"] < r["seconds"], r
    assert r["collective_bytes_per_step"] == r["wire_bytes_per_step"] == 0
    assert "step_seconds_median" not in r
  # (as resolved: --selection_metric=auto recorded as the metric it chose, P@1 on single-label data)
  assert Config.from_dict(json.load(open(workdir / "config.json"))) == override(small_config, selection_metric="p@1")


class _RecordingObserver:
  """A step observer that records the loop's calls (train/step_observer.py's protocol)."""

  def __init__(self, calls, settings, workdir, *, job, per_process_batch, scope_scaling):
    self.calls = calls
    calls.append(("made", job, per_process_batch, dict(scope_scaling)))

  def begin_step(self, step, compiled):
    self.calls.append(("begin", step, type(compiled).__name__))

  def end_step(self, step, outputs):
    self.calls.append(("end", step))

  def maintenance(self, label, fn, *args, **kwargs):
    self.calls.append(("maintenance", label))
    return fn(*args, **kwargs)

  def log_record(self):
    return {"observed": len(self.calls)}

  def finish(self):
    self.calls.append(("finish",))

  def close(self):
    self.calls.append(("close",))


def test_a_step_observer_sees_every_step_and_job_and_adds_to_the_records(tmp_path, small_config):
  calls = []
  observer = lambda *args, **kwargs: _RecordingObserver(calls, *args, **kwargs)  # noqa: E731
  train_and_evaluate(override(small_config, max_steps=20, eval_every=10, checkpoint_every=15), str(tmp_path),
                     step_observer=observer)
  from sparsejax.model import STEP_SCOPES

  assert calls[0] == ("made", "sparse", 64, STEP_SCOPES)
  steps = [c for c in calls if c[0] in ("begin", "end")]
  assert steps == [x for s in range(20) for x in (("begin", s, "CompiledStep"), ("end", s + 1))]
  jobs = [c[1] for c in calls if c[0] == "maintenance"]
  assert jobs.count("tables") == 20 and jobs.count("eval") == 1 and jobs.count("checkpoint") == 1, jobs
  assert calls[-2:] == [("finish",), ("close",)]
  records = read_records(str(tmp_path))
  assert [r["observed"] > 0 for r in records if "loss" in r] == [True, True]  # its fields in each log record


def test_the_profiled_window_needs_its_observer(tmp_path, small_config):
  with pytest.raises(ConfigError, match="--netanalysis_steps=5: the profiled window is sparsejax.netanalysis"):
    train_and_evaluate(override(small_config, netanalysis_steps=5), str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("changes", [{}, dict(softmax="exact", lr_scaling="sqrt", warmup_steps=30),
                                     dict(candidates="clusters", reinsert="none"),  # LSH, exact, clustered
                                     dict(candidates="clusters", reinsert="none", average_steps=12)])  # averaged
def test_resume_is_bit_identical(tmp_path, small_config, changes, finished_run):
  small_config = override(small_config, **changes)
  straight, split = tmp_path / "straight", tmp_path / "split"
  if changes:
    train_and_evaluate(small_config, str(straight))
  else:  # the straight run of small_config itself
    straight = finished_run[0]
  # Stop at 22 (between checkpoints, after a rebuild, a rehash is pending), then resume.
  train_and_evaluate(override(small_config, max_steps=22), str(split))
  train_and_evaluate(small_config, str(split))
  (step_a, state_a), (step_b, state_b) = _latest(straight), _latest(split)
  assert step_a == step_b == 40
  leaves_a, leaves_b = jax.tree.leaves(state_a), jax.tree.leaves(state_b)
  assert len(leaves_a) == len(leaves_b) > 20
  for a, b in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_metrics_never_repeat_a_step_after_resuming_from_an_earlier_checkpoint(tmp_path, small_config, finished_run):
  """Issue 12 defect 14: steps measured after the last checkpoint were recorded again after a crash."""
  workdir = _copy_of(finished_run, tmp_path)
  shutil.rmtree(workdir / "checkpoints" / "40")  # as if it crashed after step 40's metrics, before its checkpoint
  train_and_evaluate(small_config, str(workdir))
  steps = [r["step"] for r in read_records(str(workdir)) if not r.get("final")]
  assert steps == [10, 20, 30, 40]
  assert [r["step"] for r in read_records(str(workdir)) if r.get("final")] == [40]


def test_another_configuration_is_refused_naming_the_differences(tmp_path, small_config, finished_run):
  """Issue 11: --model=dense or another --lsh_family failed inside orbax; a new --learning_rate resumed the
  finished run and overwrote config.json (issue 12 defect 5: config.json changed before the restore)."""
  workdir = _copy_of(finished_run, tmp_path)
  saved = (workdir / "config.json").read_text()
  with pytest.raises(ResumeError, match=r"--lsh_family=simhash \(now dwta\), --model=slide \(now dense\)"):
    train_and_evaluate(override(small_config, model="dense", lsh_family="dwta"), str(workdir))
  with pytest.raises(ResumeError, match=r"--learning_rate=0.003 \(now 0.01\).*--resume=force"):
    train_and_evaluate(override(small_config, learning_rate=0.01), str(workdir))
  assert (workdir / "config.json").read_text() == saved
  with pytest.raises(ResumeError, match="--resume=never"):
    train_and_evaluate(override(small_config, resume="never"), str(workdir))


def test_a_finished_run_is_not_resumed_but_can_be_extended(tmp_path, small_config, caplog, finished_run):
  workdir, final = _copy_of(finished_run, tmp_path), finished_run[1]
  mtime = os.path.getmtime(workdir / "metrics.jsonl")
  again = train_and_evaluate(override(small_config, eval_every=5, log_every=1), str(workdir))  # not identity
  assert again == final and os.path.getmtime(workdir / "metrics.jsonl") == mtime
  assert "is finished (step 40 of 40): nothing to train. To train further, raise --max_steps" in caplog.text
  longer = train_and_evaluate(override(small_config, max_steps=50), str(workdir))
  assert longer["step"] == 50
  forced = train_and_evaluate(override(small_config, max_steps=55, learning_rate=0.01, resume="force"),
                              str(workdir))
  assert forced["step"] == 55
  assert Config.from_dict(json.load(open(workdir / "config.json"))).optim.learning_rate == 0.01


def test_periodic_evaluations_score_exactly_unless_asked_for_sampled_inference(tmp_path, small_config):
  """Issue 48: a periodic validation evaluation rebuilt the serving index and ran sampled inference (4 of a 200K-label
  evaluation's 6 s) that selection never reads. By default they score exactly (the same P@1 as a run that samples
  them too), and only the final test evaluation runs sampled inference and the retrieval diagnostics."""
  periodic = {}
  for sampled_evaluations in ("final", "all"):
    config = override(_selecting(small_config), max_steps=30, sampled_evaluations=sampled_evaluations)
    train_and_evaluate(config, str(tmp_path / sampled_evaluations))
    records = read_records(str(tmp_path / sampled_evaluations))
    periodic[sampled_evaluations] = [r for r in records if r.get("split") == "validation"]
    assert [r["step"] for r in periodic[sampled_evaluations]] == [10, 20, 30]
    for r in periodic[sampled_evaluations]:
      assert ("sampled_p@1" in r) == ("label_recall" in r) == (sampled_evaluations == "all"), r
    assert records[-1]["final"] and "sampled_p@1" in records[-1] and "label_recall" in records[-1]
  assert [r["p@1"] for r in periodic["final"]] == [r["p@1"] for r in periodic["all"]]  # exact scores alike


def _selecting(small_config, **changes):
  """A clustered-index run with a validation split whose P@1 varies from one evaluation to the next."""
  return override(small_config, candidates="clusters", reinsert="none", validation_fraction=0.2, eval_every=10,
                  learning_rate=3e-2, checkpoint_every=20, **changes)


def test_a_validation_split_too_small_to_hold_a_sample_is_refused_before_training(tmp_path, small_config):
  """A user audit: 10 training samples and --validation_fraction=0.05 split off an empty validation set, trained,
  then crashed in the final evaluation (``need at least one array to concatenate``). Its 3 labels, fewer than
  P@5 ranks, crashed every evaluation too."""
  rows = "".join(f"{i % 3} {i}:1\n" for i in range(10))
  (tmp_path / "train.txt").write_text(f"10 20 3\n{rows}")
  (tmp_path / "test.txt").write_text(f"10 20 3\n{rows}")
  config = override(small_config, dataset="files", train_file=str(tmp_path / "train.txt"),
                    test_file=str(tmp_path / "test.txt"), validation_fraction=0.05, batch_size=4, max_steps=3)
  with pytest.raises(ConfigError, match=r"--validation_fraction=0.05: holds no sample of the 10 training samples"):
    train_and_evaluate(config, str(tmp_path / "run"))
  final = train_and_evaluate(override(config, validation_fraction=0.0), str(tmp_path / "run"))
  # One label of 3 each: the top 3 holds it, so P@3 = 1/3 and P@5 = 1/5 (the last two places are empty).
  assert final["last_step"] == 3 and final["p@3"] == pytest.approx(1 / 3) and final["p@5"] == pytest.approx(1 / 5)


def test_a_finished_run_that_selected_an_earlier_step_is_not_trained_again(tmp_path, small_config, caplog):
  """The final record's "step" is the selected step; finished means its "last_step" is the newest checkpoint."""
  config = _selecting(small_config, max_steps=150)
  final = train_and_evaluate(config, str(tmp_path))
  assert final["selected_step"] < final["last_step"] == 150 and final["stopped_by"] == "max_steps"
  records = (tmp_path / "metrics.jsonl").read_text()
  assert train_and_evaluate(config, str(tmp_path)) == final
  assert (tmp_path / "metrics.jsonl").read_text() == records  # no second final record
  assert "is finished (step 150 of 150): nothing to train" in caplog.text
  # A deleted config.json is written again from the checkpoint (a fresh-user review: a finished run never wrote it
  # again, and the message refusing other settings pointed to the missing file).
  saved = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").unlink()
  assert train_and_evaluate(config, str(tmp_path)) == final
  assert json.loads((tmp_path / "config.json").read_text()) == saved
  # Every evaluation the selection compared is recorded: the last step's too.
  periodic = [r for r in read_records(str(tmp_path)) if r.get("split") == "validation"]
  assert [r["step"] for r in periodic] == list(range(10, 160, 10))
  assert final["validation_p@1"] == max(r["p@1"] for r in periodic)


def _selection_so_far(records: list[dict], noise_samples: int = 300) -> dict:
  """The selection state that a run's validation records give: the first best value, its step, and the
  evaluations since it; the last value that beat the one before by more than half a standard error on
  ``noise_samples`` (``_selecting``'s 300 evaluated samples), its step and the evaluations since it."""
  values = [r["p@1"] for r in records]
  best = int(np.argmax(values))
  improved = 0
  for i, value in enumerate(values):
    p = values[improved]
    if value > p + 0.5 * np.sqrt(p * (1 - p) / noise_samples):
      improved = i
  return {"best_value": values[best], "best_step": records[best]["step"], "bad_evaluations": len(values) - 1 - best,
          "improved_value": values[improved], "improved_step": records[improved]["step"],
          "stale_evaluations": len(values) - 1 - improved}


def test_a_continued_run_selects_against_every_evaluation_before_it(tmp_path, small_config, caplog):
  """A fresh-user review: the last step's validation evaluation ran after the final checkpoint was saved, so a run
  continued from that checkpoint compared its evaluations against a stale best (its records named a best step that
  best_checkpoint/ did not hold, and its final record paired the selected step with another step's score)."""
  import orbax.checkpoint as ocp

  config = _selecting(small_config, max_steps=150)
  train_and_evaluate(config, str(tmp_path))
  periodic = [r for r in read_records(str(tmp_path)) if r.get("split") == "validation"]
  assert periodic[-1]["step"] == 150
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"))
  position = manager.restore(150, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
  assert position["selection"] == _selection_so_far(periodic)  # the last evaluation included
  longer = train_and_evaluate(override(config, max_steps=250), str(tmp_path))
  periodic = [r for r in read_records(str(tmp_path)) if r.get("split") == "validation"]
  assert [r["step"] for r in periodic] == list(range(10, 260, 10))
  for i, record in enumerate(periodic):
    assert record["best_step"] == _selection_so_far(periodic[:i + 1])["best_step"], record["step"]
  selection = _selection_so_far(periodic)
  assert longer["selected_step"] == selection["best_step"] and longer["validation_p@1"] == selection["best_value"]
  assert os.listdir(tmp_path / "best_checkpoint") == [str(selection["best_step"])]
  # --resume=force past a change of the data (here the seed, which draws the split): the scores kept so far are of
  # another validation split, so selection starts anew, and the change is named.
  forced = train_and_evaluate(override(config, max_steps=300, seed=7, resume="force"), str(tmp_path))
  assert "--resume=force: continuing" in caplog.text and "--seed=0 (now 7)" in caplog.text
  assert "model selection starts anew at step 250: --seed" in caplog.text
  assert "--batch_size changed" not in caplog.text
  after = [r for r in read_records(str(tmp_path)) if r.get("split") == "validation" and r["step"] > 250]
  assert forced["selected_step"] == _selection_so_far(after)["best_step"] > 250
  assert os.listdir(tmp_path / "best_checkpoint") == [str(forced["selected_step"])]
  # A batch size changed under force: its epochs counted in steps of the new size are named as such.
  train_and_evaluate(override(config, max_steps=310, seed=7, batch_size=32, resume="force"), str(tmp_path))
  assert "--batch_size changed at step 300: the epochs that metrics.jsonl records" in caplog.text


def test_a_best_state_that_is_the_last_one_is_not_read_back(tmp_path, small_config, monkeypatch):
  """Issue 47: restoring the best state beside the live one held two copies of the state at the end (the 10^9-
  parameter run swapped and aborted there). Where the last evaluation is the best, the live state is used: same
  test metrics as reading it back, and the kept state is never restored."""
  from sparsejax.workdir.best_checkpoint import BestCheckpoint

  config = override(_selecting(small_config, max_steps=30), eval_every=1000)  # one evaluation, the last: the best
  restores = []
  original = BestCheckpoint.restore
  monkeypatch.setattr(BestCheckpoint, "restore", lambda self, *a: restores.append(1) or original(self, *a))
  live = train_and_evaluate(config, str(tmp_path / "live"))
  assert live["selected_step"] == live["last_step"] == 30 and restores == []
  monkeypatch.setattr("sparsejax.train.model_selection.Selection.is_live", lambda self, step: False)  # read it back
  read_back = train_and_evaluate(config, str(tmp_path / "read_back"))
  assert restores == [1]
  measured = ("samples_per_sec", "peak_rss_mb")  # (and the seconds)
  assert {k: v for k, v in live.items() if "seconds" not in k and k not in measured} == \
      {k: v for k, v in read_back.items() if "seconds" not in k and k not in measured}


def test_a_best_state_read_back_replaces_the_live_parameters_never_beside_them(tmp_path, small_config, monkeypatch):
  """Issue 47: where the best state is not the last one it is read back, after the live parameters it replaces are
  deleted (the final checkpoint keeps them): the process's arrays grow by no second copy (bytes counted)."""
  import jax

  from sparsejax.workdir.best_checkpoint import BestCheckpoint

  config = override(_selecting(small_config, max_steps=30), eval_every=1000)
  from sparsejax.train.model_selection import Selection

  monkeypatch.setattr(Selection, "is_live", lambda self, step: False)  # read it back
  original_select, original, counted = Selection.restore_best, BestCheckpoint.restore, {}

  def restore_best(self, run, state):
    counted["before"] = sum(a.nbytes for a in jax.live_arrays())  # the live state, and whatever else lives
    return original_select(self, run, state)

  def restore(self, abstract):
    restored = original(self, abstract)
    counted["after"] = sum(a.nbytes for a in jax.live_arrays())  # the peak: the best state read back
    counted["restored"] = sum(a.nbytes for a in jax.tree.leaves(restored))
    return restored

  monkeypatch.setattr(Selection, "restore_best", restore_best)
  monkeypatch.setattr(BestCheckpoint, "restore", restore)
  final = train_and_evaluate(config, str(tmp_path))
  assert final["selected_step"] == 30 and counted["restored"] > 100_000  # the parameters, index and step
  assert counted["after"] - counted["before"] <= 0.01 * counted["restored"], counted


@pytest.mark.parametrize("read_back", [False, True])
def test_the_final_evaluation_holds_no_optimizer_states(tmp_path, small_config, monkeypatch, read_back):
  """Issue 47: the final evaluation and the serving index read the parameters and the index only; the optimizer
  states (two thirds of an Adam state's bytes) are deleted first, the final checkpoint keeping them: the arrays
  alive when the test set is scored are those of the state without them (bytes counted), whether the selected
  state is the live one or read back; the run resumes from that checkpoint as before."""
  import gc

  import jax

  from sparsejax import evaluation
  from sparsejax.train import model_selection
  from sparsejax.workdir.checkpoint import Checkpoints

  config = override(_selecting(small_config, max_steps=30), eval_every=1000)
  if read_back:
    monkeypatch.setattr(model_selection.Selection, "is_live", lambda self, step: False)
  original, counted = evaluation.evaluate_state, {}

  def evaluate_state(evaluator, run, state, *args, **kwargs):
    if "sampled" not in kwargs:  # the final evaluation (model selection's say whether they sample)
      counted["live"] = sum(a.nbytes for a in jax.live_arrays() if id(a) not in before)
      counted["state"] = sum(a.nbytes for a in jax.tree.leaves(state))
      counted["optimizer"] = [f for f in state._fields if "opt" in f and getattr(state, f) is not None]
    return original(evaluator, run, state, *args, **kwargs)

  monkeypatch.setattr(evaluation, "evaluate_state", evaluate_state)
  gc.collect()
  before = {id(a) for a in jax.live_arrays()}  # (another test's, not yet collected)
  final = train_and_evaluate(config, str(tmp_path))
  assert final["selected_step"] == 30 and counted["optimizer"] == []
  assert counted["live"] <= 1.01 * counted["state"] + 100_000, counted  # (and the evaluator's few small arrays)
  checkpoints = Checkpoints(str(tmp_path), writable=False)
  saved = checkpoints.restore_arrays(30)  # what a resumed run reads: the optimizer states too
  assert any("opt" in key and jax.tree.leaves(value) for key, value in saved.items())


def test_an_early_stopped_run_is_finished_until_its_patience_is_raised(tmp_path, small_config, caplog):
  config = _selecting(small_config, max_steps=400, early_stopping_patience=1)
  final = train_and_evaluate(config, str(tmp_path))
  assert final["stopped_by"] == "early_stopping" and final["bad_evaluations"] == 1 and final["last_step"] < 400
  assert train_and_evaluate(config, str(tmp_path)) == final
  assert f"stopped early at step {final['last_step']} (no better validation p@1 in 1 evaluations)" in caplog.text
  longer = train_and_evaluate(override(config, early_stopping_patience=4), str(tmp_path))
  assert longer["last_step"] > final["last_step"]


def test_a_best_state_newer_than_the_newest_checkpoint_does_not_block_resuming(tmp_path, small_config):
  """A process that died between an evaluation and the next checkpoint left best_checkpoint/ ahead of
  checkpoints/: the resumed run trains those steps again and keeps their best state again, as an unbroken run."""
  config = _selecting(small_config, max_steps=60, keep_checkpoints=5)
  final = train_and_evaluate(config, str(tmp_path / "whole"))
  shutil.copytree(tmp_path / "whole", tmp_path / "cut")
  best = int(os.listdir(tmp_path / "cut" / "best_checkpoint")[0])
  for step in os.listdir(tmp_path / "cut" / "checkpoints"):
    if int(step) >= best:  # the checkpoints written at and after the best state's step never happened
      shutil.rmtree(tmp_path / "cut" / "checkpoints" / step)
  records = [r for r in read_records(str(tmp_path / "cut")) if r["step"] < best]
  with open(tmp_path / "cut" / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  again = train_and_evaluate(config, str(tmp_path / "cut"))
  for key in ("step", "last_step", "p@1", "p@5", "sampled_p@1", "validation_p@1"):
    assert again[key] == final[key], key
  assert os.listdir(tmp_path / "cut" / "best_checkpoint") == [str(final["selected_step"])]


def test_forcing_a_resume_past_a_change_of_shapes_is_refused_by_name(tmp_path, small_config, finished_run):
  workdir = _copy_of(finished_run, tmp_path)
  with pytest.raises(ResumeError, match=r"checkpoints/40 holds a model of other shapes than these settings give "
                                        r"\(.*embed\.w: saved \(1000, 32\), now \(1000, 16\)"):
    train_and_evaluate(override(small_config, hidden_dims=(16,), max_steps=50, resume="force"), str(workdir))


def test_a_changed_process_count_is_named(tmp_path, small_config, run_python):
  """Issue 11: a changed process count gave a bare 'Topology mismatch'."""
  sharded = override(small_config, num_shards=2, max_steps=10)
  run_python(code=f"""
      from sparsejax.config import Config
      from sparsejax.train import train_and_evaluate
      train_and_evaluate(Config.from_dict({sharded.to_dict()!r}), {str(tmp_path)!r})
  """, devices=2)
  with pytest.raises(ResumeError, match=r"output layer split 2 way\(s\); this one splits it 1 way\(s\)"):
    train_and_evaluate(override(sharded, num_shards=None), str(tmp_path))
  # One process still loads the sharded model (its padding rows dropped) and reproduces the run's P@1.
  final = [r for r in read_records(str(tmp_path)) if r.get("final")][-1]
  test = data.load_dataset(sharded.data, seed=sharded.run.seed).test
  assert sparsejax.load(str(tmp_path)).evaluate(test)["p@1"] == pytest.approx(final["p@1"], abs=1 / len(test))


def test_unwritable_work_or_checkpoint_directory_fails_at_once(tmp_path, small_config):
  """Issue 12 defect 8: an unwritable checkpoint directory stalled the first save ~300 s, then a TimeoutError."""
  with pytest.raises(ConfigError, match=r"--workdir=/proc/sparsejax: cannot write there"):
    train_and_evaluate(small_config, "/proc/sparsejax")
  (tmp_path / "checkpoints").write_text("not a directory")
  t0 = time.time()
  with pytest.raises(ConfigError, match=r"checkpoints: cannot write there"):
    train_and_evaluate(small_config, str(tmp_path))
  assert time.time() - t0 < 10


def test_keep_checkpoints_none_keeps_every_one(tmp_path, small_config):
  """Issue 12 defect 3: --keep_checkpoints=0 deleted every checkpoint (0 is now refused; none keeps all)."""
  with pytest.raises(ConfigError, match="--keep_checkpoints=0: must be >= 1 or none"):
    train_and_evaluate(override(small_config, keep_checkpoints=0), str(tmp_path))
  train_and_evaluate(override(small_config, keep_checkpoints=None, checkpoint_every=10), str(tmp_path))
  assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [10, 20, 30, 40]


def test_max_steps_beyond_the_default_epochs(tmp_path, small_config):
  """Issue 11: the default of 5 epochs silently capped --max_steps."""
  config = override(small_config, synthetic_samples=400, batch_size=64, max_steps=40, eval_every=1000)
  assert train_and_evaluate(config, str(tmp_path))["step"] == 40  # 5 epochs would be 25 steps


def _start(root, workdir, *flags):
  args = ["--dataset=synthetic", "--synthetic_samples=3000", "--synthetic_features=500", "--synthetic_labels=100",
          "--hidden_dims=16", "--active_k=16", "--num_tables=4", "--batch_size=32", "--max_steps=1000000",
          "--eval_every=1000000", "--checkpoint_every=1000", "--log_every=5", f"--workdir={workdir}", *flags]
  return subprocess.Popen([sys.executable, "-P", str(root / "examples" / "train.py"), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait_for(proc, pattern: str, timeout: float = 120) -> list[str]:
  lines, deadline = [], time.time() + timeout
  while time.time() < deadline:
    line = proc.stderr.readline()
    assert line or proc.poll() is None, "".join(lines)[-3000:]
    lines.append(line)
    if pattern in line:
      return lines
  raise AssertionError(f"no {pattern!r} in {''.join(lines)[-3000:]}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_a_checkpoint_and_exits_non_zero(tmp_path, root, signum):
  """Issue 11: Ctrl-C at step 450 left no checkpoint (checkpoint_every 1000); SIGTERM likewise.

  Also: with --noprogress (or no terminal) a plain line reports step, loss and throughput every log_every steps.
  """
  proc = _start(root, tmp_path, "--noprogress")
  lines = _wait_for(proc, "step 20/1000000: loss ")
  assert any("step 15/1000000: loss " in line and "samples/s" in line for line in lines)
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signum, err[-3000:]
  step = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert step >= 20
  last = err.strip().splitlines()[-1]
  assert last == (f"train.py: error: stopped by {signal.Signals(signum).name} after step {step}: checkpoint saved in "
                  f"{tmp_path / 'checkpoints'}; run the same command again to continue")


def _signal_while_busy(tmp_path, module: str, name: str, signum: int) -> tuple[int, str]:
  """Runs sparsejax-train with ``module.name`` replaced by a busy wait, signals it there: (exit status, stderr)."""
  code = textwrap.dedent(f"""
      import sys, time
      import {module}
      from sparsejax.cli.train import main

      def busy(*args, **kwargs):
        print("ready", flush=True)
        for _ in range(1200):  # short sleeps: a signal that lands on another thread waits for the next bytecode
          time.sleep(0.1)

      {module}.{name} = busy
      sys.argv = ["sparsejax-train", "--workdir=" + sys.argv[1]]
      main()
  """)
  # SIGINT as a terminal gives it: a job started in the background (CI under nohup, '&') inherits it ignored.
  proc = subprocess.Popen([sys.executable, "-P", "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  assert proc.stdout.readline() == "ready\n"
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=60)
  return proc.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_outside_the_training_loop_ends_the_run_with_one_true_line(tmp_path, signum):
  """A user audit: Ctrl-C while the data loaded (or in the final evaluation) said "interrupted before training
  started: nothing to save" even where checkpoints existed, and SIGTERM there killed the process without a word."""
  # The busy wait stands for loading data or the final evaluation.
  code, err = _signal_while_busy(tmp_path, "sparsejax.train", "train_and_evaluate", signum)
  assert code == 128 + signum, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      f"sparsejax-train: error: interrupted by {signal.Signals(signum).name}: nothing more was saved. The "
      f"checkpoints already in {tmp_path} are kept; the same command continues from the newest")


def test_a_signal_during_a_garbage_collection_callback_is_not_lost(tmp_path):
  """A user audit: Ctrl-C while the data loaded landed in JAX's gc callback (``_xla_gc_callback``), where Python
  prints an exception and drops it: the run trained to its end and exited 0. The signal now comes again after the
  callback and ends the run with the one line."""
  code = textwrap.dedent("""
      import gc, sys, time
      import sparsejax.train.loop
      from sparsejax.cli.train import main

      def _xla_gc_callback(phase, info):  # JAX's name: a signal handled in it must not raise there
        if phase == "start":
          gc.callbacks.remove(_xla_gc_callback)  # once
          print("ready", flush=True)
          for _ in range(30):
            time.sleep(0.1)

      def busy(*args, **kwargs):
        gc.callbacks.append(_xla_gc_callback)
        gc.collect()
        for _ in range(50):
          time.sleep(0.1)
        print("the signal was lost", file=sys.stderr)
        sys.exit(0)

      sparsejax.train.train_and_evaluate = busy
      sys.argv = ["sparsejax-train", "--workdir=" + sys.argv[1]]
      main()
  """)
  proc = subprocess.Popen([sys.executable, "-P", "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == "ready\n"
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
  assert "Exception ignored" not in err and "lost" not in err, err[-3000:]
  assert err.strip().splitlines()[-1].startswith("sparsejax-train: error: interrupted by SIGINT: nothing more was")


def test_ctrl_c_while_the_command_starts_ends_it_with_one_line(tmp_path):
  """A user audit: Ctrl-C in the first half second (imports, joining the process group) printed a traceback."""
  # The busy wait stands for importing JAX or joining the process group.
  code, err = _signal_while_busy(tmp_path, "sparsejax.distributed.sharding", "initialize", signal.SIGINT)
  assert code == 128 + signal.SIGINT, err[-3000:]
  assert err.strip().splitlines() == ["sparsejax-train: error: interrupted by SIGINT"]


@pytest.mark.parametrize("columns", [160, 0])
def test_log_lines_go_above_the_progress_bar(tmp_path, root, columns):
  """Issue 11: evaluation lines were glued onto the tqdm bar. A user audit: on a terminal that reports no width
  (0 columns, no stty size) neither the bar nor the loss lines showed; there the plain lines are printed."""
  import fcntl
  import pty
  import struct
  import termios

  leader, follower = pty.openpty()
  fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
  args = ["--dataset=synthetic", "--synthetic_samples=2000", "--synthetic_features=300", "--synthetic_labels=50",
          "--hidden_dims=16", "--active_k=16", "--num_tables=4", "--batch_size=32", "--max_steps=60",
          "--eval_every=20", "--log_every=5", f"--workdir={tmp_path}"]
  proc = subprocess.Popen([sys.executable, "-P", str(root / "examples" / "train.py"), *args], stdin=follower,
                          stdout=follower, stderr=follower)
  os.close(follower)
  output = b""
  while True:
    try:
      chunk = os.read(leader, 65536)
    except OSError:  # the terminal closed: the process ended
      break
    if not chunk:
      break
    output += chunk
  proc.wait(timeout=60)
  os.close(leader)
  assert proc.returncode == 0
  text = output.decode(errors="replace")
  evaluations = [line for line in text.split("\n") if "] step " in line and "P@1 " in line]
  assert len(evaluations) == 3, text[-3000:]  # steps 20 and 40, and the last step's validation evaluation (60)
  for line in evaluations:
    visible = line.rstrip("\r").split("\r")[-1]  # on screen after carriage returns (the pty ends lines \r\n)
    assert visible.startswith("I") and "loop.py" in visible, repr(line)  # the absl line, not the bar's text
  if columns:
    assert "step/s" in text or "s/step" in text  # the bar was there
  else:
    assert "step/s" not in text and "s/step" not in text
    assert "step 5/60: loss " in text and "step 60/60: loss " in text, text[-3000:]


def test_killed_during_saves_keeps_last_good_checkpoint(tmp_path, small_config):
  """SIGKILL while checkpoints are being written; the next run resumes cleanly."""
  config = override(small_config, synthetic_labels=20000, hidden_dims=(64,), max_steps=100000,
                    checkpoint_every=1, eval_every=10**9, keep_checkpoints=3)
  script = textwrap.dedent(f"""
      from sparsejax.config import Config
      from sparsejax.train import train_and_evaluate
      train_and_evaluate(Config.from_dict({config.to_dict()!r}), {str(tmp_path)!r})
  """)
  proc = subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  ckpt = tmp_path / "checkpoints"
  deadline = time.time() + 120
  while time.time() < deadline:
    steps = [d for d in os.listdir(ckpt) if d.isdigit()] if ckpt.exists() else []
    if len(steps) >= 3:
      break
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    time.sleep(0.2)
  time.sleep(0.37)  # land somewhere inside a save
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  step, state = _latest(tmp_path)
  assert step >= 2 and int(state["step"]) == step
  final = train_and_evaluate(override(config, max_steps=step + 3), str(tmp_path))
  assert final["step"] == step + 3


def test_malformed_data_file_error_names_the_line(tmp_path, small_config):
  good = data.make_synthetic(50, 30, 10, seed=0)
  data.save_xc_file(good, tmp_path / "train.txt")
  lines = open(tmp_path / "train.txt").read().splitlines()
  lines[7] = "3 1:0.5 x:1"
  (tmp_path / "test.txt").write_text("\n".join(lines) + "\n")
  config = override(small_config, dataset="files", train_file=str(tmp_path / "train.txt"),
                    test_file=str(tmp_path / "test.txt"))
  with pytest.raises(data.XCFormatError, match=r"test\.txt:8: malformed feature id 'x'"):
    train_and_evaluate(config, str(tmp_path / "wd"))


def test_dense_model_and_budget(tmp_path, small_config):
  config = override(small_config, model="dense", max_steps=None, max_seconds=3.0, eval_every=10**9)
  final = train_and_evaluate(config, str(tmp_path))
  assert 0 < final["step"] and final["train_seconds"] < 30
  assert "sampled_p@1" not in final and 0 <= final["p@1"] <= 1


def _events(directory) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` as TensorBoard shows them: a session's purge step hides earlier events from it on."""
  import struct

  from tensorboardX.proto.event_pb2 import Event

  shown = []
  for name in sorted(os.listdir(directory)):
    raw = (directory / name).read_bytes()
    at = 0
    while at < len(raw):
      (length,) = struct.unpack("<Q", raw[at:at + 8])
      event = Event.FromString(raw[at + 12:at + 12 + length])
      at += 12 + length + 4  # length, its CRC, the record, its CRC
      if event.HasField("session_log") and event.session_log.status == event.session_log.START:
        shown = [e for e in shown if e[0] < event.step]
      for value in event.summary.value:
        shown.append((event.step, value.tag, value.simple_value))
  return shown


def test_tensorboard_tags_are_the_metrics_keys_without_repeats(tmp_path, small_config, caplog):
  """Issue 11: 72 'Summary name p@1 is illegal' warnings, tags unlike metrics.jsonl's keys, final/num_params
  drawn as curves, steps repeated after a restart."""
  pytest.importorskip("tensorboardX")
  config = override(small_config, tensorboard=True)
  train_and_evaluate(config, str(tmp_path))
  shutil.rmtree(tmp_path / "checkpoints" / "40")  # a crash after step 40's events, before its checkpoint
  train_and_evaluate(config, str(tmp_path))
  events = _events(tmp_path / "tensorboard")
  keys = {k for r in read_records(str(tmp_path)) for k in r}
  tags = {tag for _, tag, _ in events}
  assert {"loss", "p@1", "p@5", "psp@5", "sampled_p@1", "samples_per_sec"} <= tags <= keys
  assert not tags & {"final", "num_params", "num_processes", "step", "train_seconds"}
  assert len({(step, tag) for step, tag, _ in events}) == len(events)  # each (step, tag) once
  assert sorted({step for step, tag, _ in events if tag == "loss"}) == [10, 20, 30, 40]
  assert "illegal" not in caplog.text


def test_a_restart_in_the_same_second_keeps_the_earlier_sessions_events(tmp_path, monkeypatch):
  """The CI caught it once start-up got faster: event files were named by the second they were opened, so a
  session opened in the same second as the last one overwrote its events (all but the resumed steps lost)."""
  pytest.importorskip("tensorboardX")
  monkeypatch.setattr(time, "time", lambda: 1_700_000_000.25)  # the second tensorboardX names its files by
  first = MetricWriter(str(tmp_path), tensorboard=True)
  for step, loss in ((10, 1.0), (20, 0.5)):
    first.write({"step": step, "loss": loss})
  first.close()
  second = MetricWriter(str(tmp_path), tensorboard=True, resume_step=10)  # a crash after step 10's checkpoint
  second.write({"step": 20, "loss": 0.75})
  second.close()
  assert len(os.listdir(tmp_path / "tensorboard")) == 2
  assert [e for e in _events(tmp_path / "tensorboard") if e[1] == "loss"] == [(10, "loss", 1.0), (20, "loss", 0.75)]


def test_a_cut_short_last_record_is_left_out_and_a_foreign_file_is_named(tmp_path, installed_command):
  """A user audit: a partial last line in metrics.jsonl (a crash or a full disk while it was written) made the run
  impossible to resume (a JSONDecodeError traceback), and a metrics.jsonl of another program a KeyError."""
  writer = MetricWriter(str(tmp_path))
  for step in (10, 20):
    writer.write({"step": step, "loss": 1.0 / step})
  writer.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 30, "loss": 0.0')
  assert [r["step"] for r in read_records(str(tmp_path))] == [10, 20]
  MetricWriter(str(tmp_path), resume_step=20).write({"step": 30, "loss": 0.5})  # a resumed run appends after it
  assert [(r["step"], r["loss"]) for r in read_records(str(tmp_path))] == [(10, 0.1), (20, 0.05), (30, 0.5)]

  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
  (foreign / "config.json").write_text("{}")
  out = subprocess.run([installed_command("sparsejax-train"), f"--workdir={foreign}", "--max_steps=1"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"sparsejax-train: error: {foreign / 'metrics.jsonl'}:1: not a sparsejax metrics record (no integer \"step\"); "
      "is this work directory another program's?")
  assert (foreign / "config.json").read_text() == "{}"  # nothing written


def test_validation_selects_the_best_checkpoint_and_stops_early(tmp_path, small_config):
  config = override(small_config, candidates="clusters", reinsert="none", validation_fraction=0.2, max_steps=400,
                    eval_every=10, early_stopping_patience=2, learning_rate=3e-2, checkpoint_every=1000)
  final = train_and_evaluate(config, str(tmp_path))
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  periodic, last = lines[:-1], lines[-1]
  assert all(l["split"] == "validation" for l in periodic) and last["final"]
  values = [l["p@1"] for l in periodic]
  best = int(np.argmax(values))  # the first of equal values: later ties are no improvement
  stopped = final["last_step"] < 400
  if stopped:  # stopped after `patience` evaluations without a better value
    assert len(values) - 1 - best == 2 and final["last_step"] == periodic[-1]["step"]
  else:
    assert final["last_step"] == 400
  assert final["selected_step"] == final["step"] == periodic[best]["step"]
  assert final["validation_p@1"] == pytest.approx(values[best])
  # The reported test metrics are those of the restored best state, not of the last one.
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(str(tmp_path / "best_checkpoint"))
  assert manager.all_steps() == [final["selected_step"]]
  state = manager.restore(final["selected_step"], args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  assert not [key for key in state if key.endswith("_opt") and state[key]]  # parameters only: no optimizer states
  from sparsejax import inference, metrics
  loaded = data.load_dataset(config.data, seed=config.run.seed)
  fi, fv, lab = loaded.test.to_padded(None, None)
  best = NetworkParams(SparseLayer(state["embed"]["w"], state["embed"]["b"]),
                             tuple(tuple(layer) for layer in state["hidden"]),
                             SparseLayer(state["out"]["w"], state["out"]["b"]))
  top = np.asarray(inference.predict_exact(best, fi, fv, top=1)[1])
  # The network's own P@1 (p@1 is its ranking fused with the label centroids: tests/test_fusion.py).
  assert final["network_p@1"] == pytest.approx(metrics.evaluate_topk(top, lab, ks=(1,))["p@1"], abs=1e-9)
  last_step, last_state = _latest(tmp_path)
  assert int(last_state["step"]) == final["last_step"]


def test_selection_keeps_the_first_best_and_stops_after_patience_evaluations_without_one():
  """Selection against scripted validation values: ties are no improvement; its state survives a resume."""
  import collections
  import types

  from sparsejax.train.model_selection import Selection

  State = collections.namedtuple("State", "name out_opt")  # kept without its optimizer state
  state = lambda step: State(f"state{step}", "moments")
  kept = lambda step: State(f"state{step}", None)

  values = iter([0.2, 0.5, 0.5, 0.4, 0.6])
  saved = []
  best = types.SimpleNamespace(save=lambda step, state, value: saved.append((step, state, value)))
  run = types.SimpleNamespace(refresh_index=None, predict=None, diagnose=None, index_fill=None,
                              exact_predictor=lambda: None)
  evaluator = lambda predict, state, num_samples, diagnose=None, fusion=None: {"p@1": next(values)}
  settings = types.SimpleNamespace(selection_metric="p@1", early_stopping_patience=2, sampled_evaluations="final")
  selection = Selection(evaluator, best, settings, None)
  stops = []
  for step in (10, 20, 30):
    record = selection.evaluate(run, state(step), step, None)
    stops.append(selection.should_stop(step))
  assert record == {"p@1": 0.5, "split": "validation", "best_step": 20}
  assert stops == [False, False, False] and saved == [(10, kept(10), 0.2), (20, kept(20), 0.5)]
  resumed = Selection(evaluator, best, settings, json.loads(json.dumps(selection.to_json())))
  resumed.evaluate(run, state(40), 40, None)  # 0.4: the second evaluation in a row without a better value
  assert resumed.should_stop(40) and resumed.best_step == 20 and resumed.best_value == 0.5
  assert len(saved) == 2
  resumed.evaluate(run, state(50), 50, None)  # 0.6: a new best resets the count
  assert not resumed.should_stop(50) and saved[-1] == (50, kept(50), 0.6)
  never = Selection(evaluator, best, types.SimpleNamespace(selection_metric="p@1", early_stopping_patience=None,
                                                            sampled_evaluations="final"), None)
  assert not never.should_stop(10**6)


def test_selection_stops_at_ratio_times_the_best_step_after_three_worse_evaluations():
  """--early_stopping_ratio against scripted validation values: the stop comes at the first evaluation that is both
  at least `ratio` times the best one's step and the third or later without a better value."""
  import types

  from sparsejax.config import MIN_STALE_EVALUATIONS
  from sparsejax.train.model_selection import Selection

  assert MIN_STALE_EVALUATIONS == 3
  import collections

  State = collections.namedtuple("State", "name")
  best = types.SimpleNamespace(save=lambda step, state, value: None)
  run = types.SimpleNamespace(refresh_index=None, predict=None, diagnose=None, index_fill=None,
                              exact_predictor=lambda: None)
  settings = types.SimpleNamespace(selection_metric="p@1", early_stopping_patience=None, sampled_evaluations="final")

  def stops(values, ratio, steps):
    scripted = iter(values)
    evaluator = lambda predict, state, num_samples, diagnose=None, fusion=None: {"p@1": next(scripted)}
    selection = Selection(evaluator, best, settings, None, stale_ratio=ratio)
    for step in steps:
      selection.evaluate(run, State(step), step, None)
      if selection.should_stop(step):
        return step, selection.stop_reason(step)
    return None, None

  steps = range(100, 2100, 100)
  # Best at 400 (0.5): 800 is twice 400 and the fourth evaluation without a better value.
  step, reason = stops([0.1, 0.3, 0.4, 0.5] + [0.45] * 16, 2.0, steps)
  assert step == 800 and "since step 400, 400 steps ago (--early_stopping_ratio=2" in reason
  # Best at 100: twice its step comes after one evaluation; the stop waits for the third worse one (400).
  assert stops([0.5] + [0.4] * 19, 2.0, steps)[0] == 400
  # A ratio of 3 waits longer; a rising curve never stops; no ratio (a step budget) never stops.
  assert stops([0.1, 0.3, 0.4, 0.5] + [0.45] * 16, 3.0, steps)[0] == 1200
  assert stops([i / 100 for i in range(20)], 2.0, steps) == (None, None)
  assert stops([0.1, 0.3, 0.4, 0.5] + [0.45] * 16, None, steps) == (None, None)
  # A tie is no improvement: the best stays the first 0.5.
  assert stops([0.1, 0.5] + [0.5] * 18, 2.0, steps)[0] == 500


def test_a_plateau_whose_best_creeps_up_by_noise_stops_at_ratio_times_its_last_real_improvement():
  """Issue 48: WordNet's validation P@1 was 0.6965 at step 3,000 and 0.6981 at 20,000 (5,000 samples: a standard
  error of 0.0065); each new best by noise moved the stop, and the run spent 140 s on the plateau. An improvement
  counts for --early_stopping_ratio where it beats the last one by more than NOISE_MARGIN standard errors
  (sqrt(p (1 - p) / n)); the state selected is still the best evaluated."""
  import collections
  import math
  import types

  from sparsejax.config import NOISE_MARGIN
  from sparsejax.train.model_selection import Selection

  State = collections.namedtuple("State", "name")
  saved = []
  best = types.SimpleNamespace(save=lambda step, state, value: saved.append(step))
  run = types.SimpleNamespace(exact_predictor=lambda: None)
  settings = types.SimpleNamespace(selection_metric="p@1", early_stopping_patience=None, sampled_evaluations="final")
  margin = NOISE_MARGIN * math.sqrt(0.5 * 0.5 / 5000)  # at 0.5 on 5,000 samples: 0.0035
  # Rising to 0.5 at step 300, then creeping up by a fifth of the margin per evaluation.
  values = [0.1, 0.3, 0.5] + [0.5 + 0.2 * margin * i for i in range(1, 18)]

  def run_through(noise_samples, restored=None, start=0):
    scripted = iter(values[start:])
    evaluator = lambda predict, state, num_samples, diagnose=None, fusion=None: {"p@1": next(scripted)}
    selection = Selection(evaluator, best, settings, restored, stale_ratio=2.0, noise_samples=noise_samples)
    for step in range(100 * (start + 1), 2100, 100):
      selection.evaluate(run, State(step), step, None)
      if selection.should_stop(step):
        return step, selection
    return None, selection

  step, selection = run_through(5000)
  # 300's is the last real improvement: 400-600 creep (stale), 600 is twice 300 and the third stale evaluation.
  assert step == 600 and selection.improved_step == 300 and selection.best_step == 600 and saved[-1] == 600
  assert "by more than 0.0035 (noise) since step 300, 300 steps ago" in selection.stop_reason(600)
  # Each evaluation is a new best without a sample count (no margin): never stopped.
  assert run_through(None)[0] is None
  # One beat by more than the margin is an improvement: a jump of 1.2 margins at 500 moves the stop to 1,000.
  values[4] = 0.5 + 1.2 * margin
  values[5:] = [values[4] + 0.1 * margin * i for i in range(1, 16)]
  assert run_through(5000)[0] == 1000
  # A selection recorded before the margin existed resumes from its best.
  old = {"best_value": values[2], "best_step": 300, "bad_evaluations": 0}
  step, selection = run_through(5000, restored=old, start=3)
  assert selection.improved_step == 500 and step == 1000


def test_a_run_with_a_seconds_budget_stops_at_twice_its_best_step_and_stays_stopped(tmp_path, small_config, caplog):
  """The default --early_stopping_ratio=2 under --max_seconds: the run stops once its step is twice the selected
  one's; the same command again trains nothing; --early_stopping_ratio=none trains on; a step budget alone (no
  --max_seconds) trains whole."""
  config = override(_selecting(small_config, max_steps=600, max_seconds=600.0), eval_every=20, synthetic_samples=600,
                    ensemble_members=1)  # the members trained with the budget left: tests/test_ensemble.py
  with caplog.at_level(logging.INFO, logger="absl"):
    final = train_and_evaluate(config, str(tmp_path / "run"))
  assert final["stopped_by"] == "early_stopping", final
  assert 2 * final["improved_step"] <= final["last_step"] < 600 and final["stale_evaluations"] >= 3
  assert final["selected_step"] >= final["improved_step"]
  assert f"early stopping at step {final['last_step']}: no better validation p@1 by more than " in caplog.text
  assert f"(noise) since step {final['improved_step']}" in caplog.text
  assert train_and_evaluate(config, str(tmp_path / "run")) == final
  assert "give --early_stopping_ratio=none" in caplog.text
  assert f"no validation p@1 better by more than the noise since step {final['improved_step']})" in caplog.text
  on = train_and_evaluate(override(config, early_stopping_ratio=None), str(tmp_path / "run"))
  assert on["last_step"] == 600
  whole = train_and_evaluate(override(config, max_seconds=None), str(tmp_path / "steps"))
  assert whole["last_step"] == 600 and whole["stopped_by"] == "max_steps"
