"""``train_one(config, workdir)``: one network trained, SLIDE or dense, with its recipe chosen.

It opens the work directory's checkpoints (:mod:`sparsejax.train.resume`), plans the data
(:mod:`sparsejax.train.plan`), builds the run (:func:`sparsejax.distributed.sharding.make_run`: one process or
several), resumes from the newest checkpoint when it continues the same run, and steps (:class:`Loop`) until the
budget is spent or a signal asks it to stop (:mod:`sparsejax.train.stopping`). After each step come its periodic
actions: the index's maintenance and the parameter average, the clock (:mod:`sparsejax.train.step_clock`), the log
record, the evaluation and model selection (:mod:`sparsejax.train.model_selection`), the checkpoint. It ends as
:mod:`sparsejax.train.finish` says: a candidate's validation score or the final evaluation. A resumed run continues
exactly as an uninterrupted one would. :func:`sparsejax.train.driver.train_and_evaluate` composes these runs.
"""

import functools
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from sparsejax import averaging, dense, evaluation, fusion, inference, memory, model, model_kinds
from sparsejax.config import Config
from sparsejax.data import BatchIterator, LoadedData
from sparsejax.distributed import collectives, sharding
from sparsejax.evaluation import Evaluator
from sparsejax.head_rankers import HeadRankers
from sparsejax.index import kinds as index_kinds
from sparsejax.model_config import ModelConfig
from sparsejax.serving.assets import save_assets, save_fusion, save_serving_index
from sparsejax.train import compile_clock, finish, head_ranking, members, model_selection, plan
from sparsejax.train.console import Progress
from sparsejax.train.metric_writer import MetricWriter
from sparsejax.train.nonfinite import NonFiniteError, NonFiniteWatch
from sparsejax.train.resume import Opened, open_checkpoints
from sparsejax.train.step_clock import LoopClock, StepMeans, StepTimer
from sparsejax.train.step_observer import NoObserver, StepObserver, StepObserverFactory
from sparsejax.train.stopping import Interrupted, StopRequests, stops_on_kept_checkpoint
from sparsejax.workdir import checkpoint, seals


def train_one(config: Config, workdir: str, *, data: LoadedData | None = None, evaluate_test: bool = True,
              search_summary: dict | None = None, validation_seed: int | None = None,
              step_observer: StepObserverFactory | None = None,
              head_rankers: HeadRankers | None = None) -> dict[str, Any]:
  """One network of a run (:func:`sparsejax.train.driver.train_and_evaluate`) with its recipe chosen.

  Args:
    config: the run's settings.
    workdir: its directory (a run there continues).
    data: the loaded dataset (None: loaded here).
    evaluate_test: False (a search's candidate, an ensemble's member): end with the validation score instead of the
      test set's evaluation (:func:`sparsejax.train.finish.candidate_result`).
    search_summary: the recipe search's figures, for the final record.
    validation_seed: the seed of the validation split (None: ``--seed`` + 1; an ensemble's members take the first
      member's).
    step_observer: makes the observer of the loop's steps (None: none; :mod:`sparsejax.train.step_observer`).
    head_rankers: the run's head rankers, just fitted (:mod:`sparsejax.train.head_ranking`), kept in ``workdir``
      once the run has started; None: those kept there, if any.

  Returns:
    The final record (:func:`sparsejax.train.finish.final_evaluation`), or the candidate's result.
  """
  num_shards = plan.num_shards(config)
  config, data = plan.resolve_selection_metric(config, workdir, data)  # (train_and_evaluate's callers: done)
  # A start refused here (bad data, other shapes) leaves no empty work directory behind.
  with checkpoint.new_directories_removed_on_failure(workdir, os.path.join(workdir, "checkpoints")):
    opened = open_checkpoints(config, workdir, num_shards)
    if opened.finished is not None:
      return opened.finished
    config = opened.config
    data = data if data is not None else plan.load_data(config)
    split = plan.split_data(config, data, validation_seed)
    meta, checkpoints, latest = opened.meta, opened.checkpoints, opened.latest
    if meta is not None and meta["data"] != split.sizes and config.checkpoint.resume != "force":
      raise checkpoint.ResumeError(f"{checkpoints.directory}/{latest} was trained on other data: {meta['data']}, "
                                   f"now {split.sizes}. Use another --workdir for a new run")
    sized = ModelConfig.from_config(config, split.train.num_features, split.train.num_labels, num_shards)
    # Only the final evaluation fuses: the search's candidates and the loop's evaluations score the network.
    fuse = config.run.centroid_fusion and split.validation is not None
    run, state, position = _build(config, split, opened, sized, top=fusion.CANDIDATES if fuse else 5)
  start_step = int(sharding.local_value(state.step))
  # The run's identity, in its checkpoints' meta and the seals of its best state and assets: kept when it resumes.
  # A run of an older sparsejax has none: its files so far are taken as they are (unverified) and sealed from now.
  run_id = (meta or {}).get("run_id") or seals.new_run_id()
  is_chief = jax.process_index() == 0
  if is_chief:  # only now: a refused or failed start leaves the work directory as it was
    seals.write_json_atomically(os.path.join(workdir, "config.json"), config.to_dict(), indent=1)
    save_assets(workdir, data._replace(train=split.train), run_id)  # the samples trained (PSP@k's propensities)
    if head_rankers is not None:
      head_ranking.save(config, workdir, head_rankers, split.train)
    elif latest is None:
      head_ranking.remove(workdir)
    if latest is None:
      members.remove_former(workdir)
  logging.info("%s model: %s parameters%s; %s", config.network.model, f"{model.num_params(state):,}",
               f" over {num_shards} processes" if num_shards > 1 else "",
               f"training to step {split.max_steps}" if split.max_steps is not None else "training on the clock")
  memory.advise_huge_pages(state)
  if "batch_size" in opened.changed:  # --resume=force: epochs are counted in steps (not redone here: a limitation)
    logging.warning("--batch_size changed at step %d: the epochs that metrics.jsonl records and that --num_epochs "
                    "counts are steps of the new batch size, the steps so far included", start_step)
  evaluator = lambda dataset: Evaluator.for_run(dataset, split.train, config.data.max_features,  # noqa: E731
                                                config.run.propensity_a, config.run.propensity_b,
                                                functools.partial(_sampled_rows_per_call, config, run))
  selection = model_selection.for_run(config, workdir, opened, split, position, run_id, start_step, evaluator)
  loop = Loop(config, run, checkpoints,
              checkpoint.make_meta(config, num_shards, jax.process_count(), split.sizes, run_id),
              evaluator(split.test), selection,
              MetricWriter(workdir, config.run.tensorboard, resume_step=start_step) if is_chief else None,
              split.steps_per_epoch, split.max_steps, _step_observer(step_observer, config, run, workdir),
              functools.partial(save_serving_index, workdir, run_id) if is_chief else None,
              (lambda: (fusion.label_centroids(split.train),
                        head_rankers if head_rankers is not None else head_ranking.read(config, workdir, split.train)))
              if fuse else None,
              functools.partial(save_fusion, workdir, run_id) if is_chief else None)
  state = _train_steps(loop, state, plan.batch_iterator(config, split, position, sized), opened, position, is_chief)
  if not evaluate_test:
    return finish.candidate_result(loop, state, start_step)
  return finish.final_evaluation(loop, state, start_step, search_summary)


def _sampled_rows_per_call(config: Config, run: sharding.Run) -> int:
  """Samples per call of the run's evaluations with sampled inference (at ``serving_k`` and ``--eval_sampled_k``
  candidates) within ``--eval_memory_mb`` of temporaries (the exact ones keep 1,024: 128 KB a sample)."""
  ks = (run.config.serving_k, *[k for k in [config.run.eval_sampled_k] if k])
  rows = inference.rows_within(run.config, config.run.eval_memory_mb << 20, ks)
  logging.info("sampled evaluations: %d samples per call (--eval_memory_mb=%d, %s candidates)", rows,
               config.run.eval_memory_mb, " and ".join(f"{k:,}" for k in ks))
  return rows


def _build(config: Config, split: plan.DataPlan, opened: Opened, sized: ModelConfig, top: int):
  """``(run, state, position)``: the run's programs, and its state and data position, restored from the newest
  checkpoint or new. Refuses a network this machine cannot hold, and a checkpoint of other shapes. ``sized``: the
  model's settings with one shard's sizes (``--num_bits=none`` resolved); ``top``: the predictions per sample its
  evaluations rank (the fusion's candidates where the final evaluation fuses)."""
  train, checkpoints, latest = split.train, opened.checkpoints, opened.latest
  if model_kinds.of(config).sampled:
    index_kinds.check_table_memory(config.tables, sized.lsh_config.num_bits, sized.table_bucket_size)
  plan.check_state_memory(config, train.num_features, train.num_labels, sized.num_shards)
  run = sharding.make_run(ModelConfig.from_config(config, train.num_features, train.num_labels),
                          seed=config.run.seed, num_shards=sized.num_shards, top=top,
                          sampled_ks=tuple(k for k in [config.run.eval_sampled_k] if k))
  if latest is None:
    # The initialisation's temporaries (random weights, the index's k-means: 3 GB each at 2·10^6 rows) returned as
    # they are freed, not kept resident beside the state (sparsejax.memory.freed_memory_returned).
    with memory.freed_memory_returned():
      state = jax.block_until_ready(run.init())
    return run, state, {"epoch": 0, "index": 0, "seconds": 0.0}
  abstract = run.abstract_state()
  differences = checkpoints.shape_differences(latest, abstract)
  if differences:  # --resume=force past a setting that changes the model's shapes
    raise checkpoint.ResumeError(
        f"{checkpoints.directory}/{latest} holds a model of other shapes than these settings give ("
        + "; ".join(differences[:3]) + (f"; {len(differences) - 3} more" if len(differences) > 3 else "")
        + "): --resume=force continues a run with new settings only where they keep the model's shapes. Use "
        "another --workdir for a new run")
  with memory.freed_memory_returned():
    state, position = checkpoints.restore(abstract)
  logging.info("resumed from step %d (epoch %d, index %d)", latest, position["epoch"], position["index"])
  return run, state, position


def _train_steps(loop: "Loop", state, batches: BatchIterator, opened: Opened, position: dict, is_chief: bool):
  """Trains ``state`` with ``loop`` and saves its last checkpoint; a signal that stopped it raises
  :class:`Interrupted` once that is saved, a non-finite step a :class:`NonFiniteError` naming the checkpoint to go
  back to."""
  checkpoints = opened.checkpoints
  try:
    state = loop.train(state, batches, position.get("seconds", 0.0), show_progress=is_chief)
    if checkpoints.latest_step() != loop.step and not stops_on_kept_checkpoint(loop.stop_signal, loop.step,
                                                                                  checkpoints, state):
      loop.save(state, batches, wait=True, last=True)
  except NonFiniteError as e:  # --on_nonfinite: say which checkpoint the run can go back to
    checkpoints.wait()
    good = checkpoints.latest_step()
    if good is not None and good == opened.latest and not checkpoints.is_sealed(good):
      # Issue 35: a damaged checkpoint without checksums (nothing to verify it by) was blamed on the learning rate.
      where = (f". The run resumed from {checkpoints.directory}/{good}, which has no checksums to verify it by (an "
               "older sparsejax, or a crash right after its save): a damaged file there gives this error as well")
    else:
      where = (f". The newest checkpoint, {checkpoints.directory}/{good}, is finite" if good is not None
               else ". No checkpoint was saved")
    raise NonFiniteError(e.step, e.reason + where) from None
  finally:
    batches.close()
  checkpoints.wait()
  if loop.stop_signal is not None:
    raise Interrupted(loop.stop_signal, checkpoints.latest_step(), checkpoints.directory)
  return state


def _step_observer(factory: StepObserverFactory | None, config: Config, run: sharding.Run,
                   workdir: str) -> StepObserver:
  """The observer that ``factory`` makes for this network's run (e.g. the profiled window of ``config.netanalysis``)."""
  if factory is None:
    return NoObserver()
  kind = model_kinds.of(config)
  return factory(
      config.netanalysis, workdir, job=kind.step_job,
      per_process_batch=config.optim.batch_size // (run.num_shards if kind.data_parallel else 1),
      scope_scaling=model.STEP_SCOPES if kind.sampled else dense.STEP_SCOPES)


class Loop:
  """The training loop's state between steps: budget, measurements, evaluations, checkpoints."""

  def __init__(self, config: Config, run: sharding.Run, checkpoints: checkpoint.Checkpoints, meta: dict,
               evaluator: Evaluator, selection: "model_selection.Selection | None", writer: MetricWriter | None,
               steps_per_epoch: int, max_steps: int | None, observer: StepObserver,
               save_serving_index: Callable[[int, Any], None] | None = None,
               fusion_terms: Callable[[], tuple[fusion.LabelCentroids, HeadRankers | None]] | None = None,
               save_fusion: Callable[[fusion.Fusion], None] | None = None):
    self.config, self.run, self.checkpoints, self.meta = config, run, checkpoints, meta
    self.save_serving_index, self.fusion_terms, self.save_fusion = save_serving_index, fusion_terms, save_fusion
    self.evaluator, self.selection, self.writer, self.observer = evaluator, selection, writer, observer
    self.compiled: collectives.CompiledStep | None = None  # the step's program, compiled before its first run
    self.step_means = StepMeans()
    self.steps_per_epoch, self.max_steps = steps_per_epoch, max_steps
    self.step, self.last_loss, self.stop_signal = 0, None, None
    self.stopped_by = config.budget.step_limit_name(steps_per_epoch)  # or "max_seconds", "early_stopping"
    self.train_seconds, self.seconds_before = 0.0, 0.0
    # What --max_seconds counts (training and evaluations), and the steady step time measured after the first step
    # (its compilation excluded): the recipe search plans its rounds from it.
    self.budget_seconds, self.eval_seconds, self.step_seconds, self.eval_compile_seconds = 0.0, 0.0, None, 0.0
    self.nonfinite = NonFiniteWatch(config.run.on_nonfinite)

  def train(self, state, batches: BatchIterator, seconds_before: float, show_progress: bool):
    """Steps until the budget is spent or a signal asks to stop; returns the state.

    After each step come its periodic actions, in this order: the index's maintenance and the parameter average
    (:meth:`_maintain`), the clock (:meth:`_clock_says_last`), the log record, the evaluation with its early stop
    (:meth:`_evaluate_periodically`), the checkpoint and the replicas' checksum (:meth:`_save_periodically`), and a
    signal's stop.
    """
    config = self.config
    self.step = int(sharding.local_value(state.step))
    self.seconds_before = seconds_before
    progress = Progress(config.run.progress and show_progress, self.max_steps, self.step)
    clock = LoopClock()
    timer = StepTimer(self.step, clock.start)
    self._window = [time.time(), 0]  # the log record's samples/s: since the last record or evaluation
    metrics = None
    try:
      with StopRequests() as stop:
        while self.max_steps is None or self.step < self.max_steps:
          state, metrics = self._step(state, batches, timer)
          state = self._maintain(state)
          timer.after_step(metrics)
          self.train_seconds = clock.train_seconds()
          last = self.step == self.max_steps or self._clock_says_last(clock)
          record = self._log_record(metrics, last, clock) if self.step % config.run.log_every == 0 or last else {}
          progress.step(self.step, record.get("loss"), record.get("samples_per_sec"))
          # The last step's test-set evaluation comes in finish; its validation evaluation comes here, so that the
          # final checkpoint (saved after the loop) holds the selection state with it: a run continued from that
          # checkpoint had compared its evaluations against a stale best.
          if (self.step % config.run.eval_every == 0 and not last) or (last and self.selection is not None):
            stopped_early, last = self._evaluate_periodically(state, record, last, clock)
            if stopped_early:
              break
          if record:
            self.write(record)
          self._save_periodically(state, batches, last)
          if stop.requested(self.step):
            self.stop_signal = stop.signum
            logging.warning("stopping after step %d (%s): saving a checkpoint", self.step,
                            signal.Signals(stop.signum).name)
            break
          if last:
            break
      if metrics is not None and self.step % config.run.log_every:  # the final record's loss: the last step's
        self.last_loss = float(sharding.local_value(metrics["loss"]))
      self.observer.finish()  # a window the loop cut short (every process gets here together)
      self.budget_seconds, self.eval_seconds, self.eval_compile_seconds = clock.elapsed(), clock.eval_seconds, \
          clock.eval_compiling
      self.step_seconds = timer.step_seconds(self.train_seconds, self.step, clock.eval_compiling)
    finally:
      self.observer.close()
      progress.close()
    self.nonfinite.check()
    return state

  def _step(self, state, batches: BatchIterator, timer: "StepTimer"):
    """One training step on the next batch, profiled and timed: ``(state, metrics)``."""
    timer.begin(self.step)
    batch = next(batches)
    if self.compiled is None:  # the log records' collective bytes; the step reuses this compilation
      jitted, args, scopes = self.run.step_program(state, batch)
      self.compiled = collectives.compile_step(jitted, *args, known_scopes=scopes)
    self.observer.begin_step(self.step, self.compiled)  # (a window's start is not the step's time)
    self.step_means.begin()
    state, metrics = self.run.step(state, batch)
    self.step += 1
    self.step_means.end()
    self.observer.end_step(self.step, (state, metrics))
    timer.end(self.step, metrics)
    self.nonfinite.add(self.step, metrics.get("finite"))  # read at the sync points
    self._window[1] += 1
    return state, metrics

  def _maintain(self, state):
    """The step's maintenance: the index's refresh on its schedule, the parameter average every period."""
    state = self.observer.maintenance("tables", self.run.maintain, state, self.step)
    average_steps = self.config.optim.average_steps
    if average_steps and self.step % averaging.period(average_steps) == 0:
      state = self.observer.maintenance("average", averaging.update_state, state, average_steps)
    return state

  def _clock_says_last(self, clock: "LoopClock") -> bool:
    """Whether the wall-clock budget ends the run at this step (stopped_by noted). Every process must take the same
    steps: the clock is read every log_every steps and process 0's verdict is followed by all (one process: every
    step). A run that selects on validation evaluates its last state: it stops that evaluation's seconds earlier
    (evaluations count against --max_seconds, the last one included)."""
    max_seconds = self.config.budget.max_seconds
    if max_seconds is None or not (self.step % self.config.run.log_every == 0 or jax.process_count() == 1):
      return False
    reserve = clock.last_eval_seconds if self.selection is not None else 0.0
    if not sharding.agree(clock.elapsed() + reserve >= max_seconds):
      return False
    logging.info("wall-clock budget of %.0f s reached at step %d", max_seconds, self.step)
    self.stopped_by = "max_seconds"
    return True

  def _log_record(self, metrics, last: bool, clock: "LoopClock") -> dict:
    """The record of a logged step: loss, learning rate, samples/s, the step's times and bytes (syncs with the
    device: only every log_every steps and at the last)."""
    self.last_loss = float(sharding.local_value(metrics["loss"]))
    self.train_seconds = clock.train_seconds()  # the steps done, not only dispatched
    window_start, window_steps = self._window
    record = {"loss": self.last_loss, "learning_rate": float(sharding.local_value(metrics["learning_rate"])),
              "samples_per_sec": window_steps * self.config.optim.batch_size / max(time.time() - window_start, 1e-9),
              **self.step_means.record(self.compiled, self.observer.log_record())}
    self._window = [time.time(), 0]
    if self.nonfinite.check() or self.nonfinite.skipped:
      record["skipped_steps"] = self.nonfinite.skipped
    return record

  def _evaluate_periodically(self, state, record: dict, last: bool, clock: "LoopClock") -> tuple[bool, bool]:
    """Evaluates the state into ``record`` (the validation split where the run selects on it, else the test set);
    returns ``(stopped early, last)``: an early stop writes the record itself, and an evaluation that spent the rest
    of the budget makes this step the last."""
    config, run, prof = self.config, self.run, self.observer
    t_eval, compiled_at_eval = time.time(), compile_clock.seconds()
    self.nonfinite.check()
    if self.selection is not None:  # periodic evaluations select the model: on the validation split
      record.update(prof.maintenance("eval", self.selection.evaluate, run, self.evaluated(state), self.step,
                                     config.run.eval_samples))
    else:
      scored, _ = prof.maintenance("eval", evaluation.evaluate_state, self.evaluator, run, self.evaluated(state),
                                   config.run.eval_samples, sampled=config.run.sampled_evaluations == "all")
      record.update(scored)
    logging.info("step %d: %sP@1 %.4f  P@5 %.4f%s", self.step, "validation " if self.selection is not None else "",
                 record["p@1"], record["p@5"], evaluation.retrieval_line(record))
    clock.evaluated(time.time() - t_eval, compile_clock.seconds() - compiled_at_eval)
    self._window[0] = time.time()
    if self.selection is not None and not last and sharding.agree(self.selection.should_stop(self.step)):
      self.write(record)
      logging.info("early stopping at step %d: %s", self.step, self.selection.stop_reason(self.step))
      self.stopped_by = "early_stopping"
      return True, last
    # An evaluation that spent the rest of the budget ends the run on the state it scored.
    max_seconds = self.config.budget.max_seconds
    if not last and max_seconds is not None and sharding.agree(clock.elapsed() >= max_seconds):
      logging.info("wall-clock budget of %.0f s reached at step %d (its evaluation included)", max_seconds, self.step)
      self.stopped_by, last = "max_seconds", True
    return False, last

  def _save_periodically(self, state, batches: BatchIterator, last: bool) -> None:
    """The periodic checkpoint (the last one comes after the loop) and the replicas' checksum."""
    config = self.config
    if self.step % config.checkpoint.checkpoint_every == 0 and not last:
      self.observer.maintenance("checkpoint", self.save, state, batches)
    if config.dist.checksum_every and self.step % config.dist.checksum_every == 0:
      self.observer.maintenance("checksum", self.run.check_replicas, state, self.step)

  def evaluated(self, state):
    """The state that an evaluation scores (and model selection keeps): its parameters' moving average, if any."""
    return averaging.evaluated(state, self.config.optim.average_steps)

  def write(self, record: dict) -> None:
    if self.writer is not None:
      self.writer.write({"step": self.step, "epoch": self.step / self.steps_per_epoch,
                         "seconds": self.seconds_before + self.train_seconds, **record})

  def save(self, state, batches: BatchIterator, wait: bool = False, last: bool = False) -> None:
    """Saves ``state`` as the step's checkpoint; ``last``: it is trained no further (a held checkpoint keeps it)."""
    self.nonfinite.check()  # never a checkpoint of a non-finite state
    self.nonfinite.check_state(state, self.step)
    position = {**batches.state(), "seconds": self.seconds_before + self.train_seconds}
    if self.selection is not None:
      position["selection"] = self.selection.to_json()
      # A checkpoint names the best state in its selection record only once that state is sealed on disk: a
      # resumed run then finds it intact or knows it was changed.
      self.selection.best.wait()
    self.checkpoints.save(self.step, state, position, self.meta, wait=wait, last=last)
