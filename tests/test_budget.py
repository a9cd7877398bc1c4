"""--max_seconds on any data (issue 48): evaluations count against the budget, a measured search plan is recorded
and replayed, and a signal stops a large run on its newest periodic checkpoint instead of saving it again."""

import signal

import pytest
from absl import logging as absl_logging

from sparsejax.settings import override
from sparsejax.train import loop, search_plan, stopping, train_and_evaluate
from sparsejax.train.metric_writer import read_records
from sparsejax.train.stopping import Interrupted, StopRequests
from sparsejax.workdir.checkpoint import Checkpoints


class _SignalAt(StopRequests):
  """A SIGTERM noted after step 25, as the handler would (no signal is sent)."""

  def requested(self, step):
    if step >= 25:
      self.signum = signal.SIGTERM
    return super().requested(step)


@pytest.mark.parametrize("large", [False, True])
def test_a_signal_stops_a_large_run_on_its_newest_checkpoint(tmp_path, small_config, monkeypatch, large):
  """A state larger than QUICK_STOP_BYTES is not saved again on a stop (2.5 minutes for 154M parameters): the run
  ends at once on its periodic checkpoint (step 15 of checkpoint_every 15), which the message names; a small one is
  saved at the step it stopped."""
  monkeypatch.setattr(loop, "StopRequests", _SignalAt)
  if large:
    monkeypatch.setattr(stopping, "QUICK_STOP_BYTES", 0)
  with pytest.raises(Interrupted) as stopped:
    train_and_evaluate(override(small_config, max_steps=100), str(tmp_path))
  want = 15 if large else 25
  assert stopped.value.step == want and f"after step {want}: checkpoint saved" in str(stopped.value)
  assert Checkpoints(str(tmp_path), writable=False).latest_step() == want


@pytest.fixture
def timed_search(small_config, monkeypatch):
  monkeypatch.setattr(search_plan, "MIN_ROUND_STEPS", 10)
  monkeypatch.setattr(search_plan, "CALIBRATION_STEPS", 5)
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  yield override(small_config, max_steps=None, max_seconds=12.0, validation_fraction=0.1, recipe="auto",
                 hidden_dims=(128,), active_k=1024, eval_every=1000, eval_samples=None, checkpoint_every=1000,
                 search_fraction=0.5, ensemble_members=1)
  absl_logging.set_verbosity(verbosity)


def test_a_timed_search_records_its_measurements_and_a_replay_takes_the_same_rounds(tmp_path, timed_search,
                                                                                      caplog):
  """A real run under --max_seconds: its search measures the candidates (records measured_step_seconds), the
  search and the training it counts stay near the budget, and a rerun with --plan_from takes the same rounds."""
  caplog.set_level("INFO")
  config = timed_search
  first = train_and_evaluate(config, str(tmp_path / "a"))
  records = read_records(str(tmp_path / "a"))
  measured = [r for r in records if "measured_step_seconds" in r]
  assert len(measured) == 1 and measured[0]["calibration_steps"] == 5
  assert all(s > 0 for s in measured[0]["measured_step_seconds"].values())
  # What --max_seconds counts: the search's wall time and the training with its evaluations (a 2-core machine shared
  # by others: a few seconds' slack for the last step and evaluation that a clock check lets finish).
  counted = first.get("search_wall_seconds", 0.0) + first["budget_seconds"]
  assert counted <= config.budget.max_seconds + 5, first
  assert "counted against the budget" in caplog.text
  # --ensemble_members=1 is read by the run (--max_seconds); its search's candidates, trained to a number of steps,
  # do not read it, and no line says so for each of them.
  assert "has no effect" not in caplog.text
  again = train_and_evaluate(override(config, plan_from=str(tmp_path / "a" / "metrics.jsonl")), str(tmp_path / "b"))
  replayed = read_records(str(tmp_path / "b"))
  rounds = lambda rs: [{n: r["steps"] for n, r in x["search"].items()} for x in rs if "search_round" in x]
  if "stopped by the search's clock" not in caplog.text:  # a cap that bound (a busy machine) changes the steps
    assert rounds(replayed) == rounds(records)
    assert again.get("search_scores") == first.get("search_scores")
  assert [r for r in replayed if "measured_step_seconds" in r][0]["measured_step_seconds"] == \
      measured[0]["measured_step_seconds"]


def test_ensemble_members_count_evaluations_against_the_budget(tmp_path):
  """The first network trained 40 s and evaluated 20 s: the budget has 60 s less, and a member is expected to need
  60 s (its evaluations' share included), not 40 s, and is started where the seconds left hold that times
  members.PACE_MARGIN; each member's evaluations come off what is left as well."""
  from sparsejax.config import Config
  from sparsejax.train import members

  batch = Config().optim.batch_size
  final = {"step": 50, "train_seconds": 40.0, "budget_seconds": 60.0, "samples_per_sec": 50 * batch / 40.0}
  budgets = []

  def train_fn(config, workdir, evaluate_test, validation_seed):
    budgets.append(config.budget.max_seconds)
    return {"score": 0.5, "step": 50, "train_seconds": 40.0, "budget_seconds": 65.0, "samples": 50 * batch}

  need = members.PACE_MARGIN * 60.0  # 60 s expected, with the margin a member's pace has been seen to need
  assert need > 70.0
  config = override(Config(), max_seconds=100.0, ensemble_members=3)
  assert members.train(config, final, str(tmp_path), train_fn, 1) == {} and budgets == []  # 40 s left
  # 70 s left: more than the 60 expected, less than the margin asks.
  assert members.train(override(config, max_seconds=130.0), final, str(tmp_path), train_fn, 1) == {} and not budgets
  # 60 + need + 65 (the first member's 60, a member's need, then the 65 it spent): two members, the second with
  # exactly its need left.
  done = members.train(override(config, max_seconds=125.0 + need), final, str(tmp_path), train_fn, 1)
  assert budgets == [65.0 + need, need] and len(done) == 2 and done["members/1"]["budget_seconds"] == 65.0


def test_a_measured_step_time_is_at_least_its_own_steps_where_compilations_overlap_them(tmp_path, small_config,
                                                                                        monkeypatch):
  """Subtracting the compilations from the training's wall time takes too much where programs compile while
  dispatched steps still run (labels_heavy's search measured 4 ms a step where steps took 13): the measured time is
  at least the median of the first steps, each timed on its own. Here every step sleeps 40 ms and the compile clock
  reports 1,000 s of compiling from the 5th step on, so the subtraction alone leaves nothing."""
  import time

  from sparsejax.distributed import sharding

  steps = {"n": 0}
  real_seconds, make_run = loop.compile_clock.seconds, sharding.make_run

  def slow_run(*args, **kwargs):
    run = make_run(*args, **kwargs)

    def step(state, batch):
      steps["n"] += 1
      time.sleep(0.04)
      return run.step(state, batch)
    return run._replace(step=step)

  monkeypatch.setattr(sharding, "make_run", slow_run)
  monkeypatch.setattr(loop.compile_clock, "seconds", lambda: real_seconds() + (1000.0 if steps["n"] >= 5 else 0.0))
  config = override(small_config, max_steps=20, eval_every=1000, checkpoint_every=1000, validation_fraction=0.1)
  result = loop.train_one(config, str(tmp_path), evaluate_test=False)
  assert result["step"] == 20 and result["step_seconds"] >= 0.04
