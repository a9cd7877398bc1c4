"""``train_and_evaluate(config, workdir)``: the training loop of a SLIDE network or its dense baseline.

It validates the config, loads the data (:func:`sparsejax.data.load_dataset`),
builds the run (:func:`sparsejax.distributed.make_run`: one process or
several, SLIDE or dense), resumes from the newest checkpoint in ``workdir``
(:mod:`sparsejax.checkpoint`), trains until the budget is spent, evaluating
(:mod:`sparsejax.evaluation`) and writing metrics
(:mod:`sparsejax.metric_writer`) on the way, and returns the final
evaluation. A resumed run continues exactly as an uninterrupted one would.

Files in ``workdir``: ``metrics.jsonl`` (one JSON object per evaluation),
``checkpoints/``, ``config.json`` and, if asked for, ``tensorboard/``.
"""

import json
import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from sparsejax import checkpoint, distributed, memory, model, retrieval
from sparsejax.config import Config, ConfigError
from sparsejax.data import BatchIterator, load_dataset, train_test_split
from sparsejax.evaluation import Evaluator
from sparsejax.metric_writer import MetricWriter


def train_and_evaluate(config: Config, workdir: str) -> dict[str, Any]:
  """Trains and evaluates; resumes from ``workdir`` if it holds a checkpoint.

  Args:
    config: the run (validated here, before any data is loaded).
    workdir: output directory (created).

  Returns:
    The final evaluation (exact and sampled P@k, nDCG@k, PSP@k) with
    ``step``, ``samples_per_sec``, ``train_seconds`` and ``num_params``.

  Raises:
    ConfigError: an invalid setting (before anything is loaded).
  """
  config.validate()
  num_shards = config.dist.num_shards or jax.process_count()
  if config.network.model == "dense" and config.optim.batch_size % num_shards:
    raise ConfigError("batch_size", config.optim.batch_size,
                      f"data-parallel training splits each batch over {num_shards} processes: must divide by it")
  os.makedirs(workdir, exist_ok=True)
  checkpoint.quiet_orbax_logs()
  t_start = time.time()
  data = load_dataset(config.data, seed=config.run.seed)
  train, test, validation = data.train, data.test, None
  if config.data.validation_fraction > 0:
    train, validation = train_test_split(train, config.data.validation_fraction, seed=config.run.seed + 1)
  logging.info("data: %d train / %d validation / %d test samples, %d features, %d labels (%.1f s)", len(train),
               0 if validation is None else len(validation), len(test), train.num_features, train.num_labels,
               time.time() - t_start)
  steps_per_epoch = len(train) // config.optim.batch_size
  if steps_per_epoch == 0:
    raise ConfigError("batch_size", config.optim.batch_size, f"exceeds the {len(train)} training samples")
  max_steps = config.budget.max_steps_for(steps_per_epoch)
  max_features = config.data.max_features or max(train.max_features_per_sample(), 1)
  max_labels = config.data.max_labels or max(train.max_labels_per_sample(), 1)

  run = distributed.make_run(config.model_config(train.num_features, train.num_labels), seed=config.run.seed,
                             num_shards=num_shards, sampled_ks=tuple(k for k in [config.run.eval_sampled_k] if k))
  checkpoints = checkpoint.Checkpoints(workdir, config.checkpoint.keep_checkpoints)
  restored = checkpoints.restore(run.abstract_state())
  if restored is None:
    state, data_state = run.init(), {"epoch": 0, "index": 0}
  else:
    state, data_state = restored
    logging.info("resumed from step %d (epoch %d, index %d)", int(distributed.local_value(state.step)),
                 data_state["epoch"], data_state["index"])
  is_chief = jax.process_index() == 0
  if is_chief:  # only once the run has started or resumed: a failed start leaves the old config in place
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config.to_dict(), f, indent=1)
  logging.info("%s model: %s parameters%s", config.network.model, f"{model.num_params(state):,}",
               f" over {num_shards} processes" if num_shards > 1 else "")
  memory.advise_huge_pages(state)

  evaluator = Evaluator.for_run(test, train, max_features, config.run.propensity_a, config.run.propensity_b)
  selection = None
  if validation is not None:
    selection = _Selection(Evaluator.for_run(validation, train, max_features, config.run.propensity_a,
                                             config.run.propensity_b),
                           checkpoint.BestCheckpoint(workdir, config.run.selection_metric), config.run,
                           data_state.get("selection"))
  writer = MetricWriter(workdir, config.run.tensorboard) if is_chief else None
  batches = BatchIterator(train, config.optim.batch_size, seed=config.run.seed, epoch=data_state["epoch"],
                          index=data_state["index"], max_features=max_features, max_labels=max_labels)
  start_step = int(distributed.local_value(state.step))
  try:
    state, step, last_metrics, train_seconds = _train(config, run, state, batches, selection or evaluator,
                                                      writer, checkpoints, max_steps, steps_per_epoch,
                                                      show_progress=is_chief)
  finally:
    batches.close()
  if checkpoints.latest_step() != step:
    checkpoints.save(step, state, _data_state(batches, selection), wait=True)
  checkpoints.wait()
  last_step = step
  if selection is not None:
    if selection.last_step != step:  # the last state competes too
      selection.evaluate(run, state, step, config.run.eval_samples)
    state, step = selection.restore_best(run, state)
    logging.info("selected the checkpoint of step %d (validation %s %.4f) of %d steps", step,
                 config.run.selection_metric, selection.best_value, last_step)
  final = _evaluate(evaluator, run, state, None)
  if selection is not None:
    final.update({"selected_step": step, "selected_by": f"validation {config.run.selection_metric}",
                  f"validation_{config.run.selection_metric}": selection.best_value})
  final.update({
      "step": step, "last_step": last_step, "epoch": step / steps_per_epoch,
      "loss": float(distributed.local_value(last_metrics["loss"])) if last_metrics is not None else float("nan"),
      "samples_per_sec": (step - start_step) * config.optim.batch_size / max(train_seconds, 1e-9),
      "train_seconds": train_seconds, "num_params": model.num_params(state), "final": True,
      "num_processes": num_shards,
  })
  if writer is not None:
    writer.write(final)
    writer.close()
  logging.info("final (%s step %d, test set): P@1 %.4f  P@3 %.4f  P@5 %.4f  (sampled P@1 %s)%s",
               "selected" if selection is not None else "last", step, final["p@1"], final["p@3"], final["p@5"],
               final.get("sampled_p@1", "n/a"), _retrieval_line(final))
  return final


def _data_state(batches: BatchIterator, selection: "_Selection | None") -> dict:
  """What a checkpoint records besides the arrays: the data position and the model selection so far."""
  return {**batches.state(), **({"selection": selection.to_json()} if selection is not None else {})}


class _Selection:
  """Model selection on the validation split: the best checkpoint so far and early stopping.

  Args:
    evaluator: scores the validation split.
    best: where the best state is kept.
    config: the run settings (metric, patience, evaluation size).
    restored: the selection state of a resumed run (``to_json``), or None.
  """

  def __init__(self, evaluator: Evaluator, best: checkpoint.BestCheckpoint, config, restored: dict | None):
    self.evaluator, self.best, self.metric, self.patience = evaluator, best, config.selection_metric, \
        config.early_stopping_patience
    restored = restored or {}
    self.best_value = restored.get("best_value", -float("inf"))
    self.best_step = restored.get("best_step")
    self.bad_evaluations = restored.get("bad_evaluations", 0)
    self.last_step = None

  def to_json(self) -> dict:
    return {"best_value": self.best_value, "best_step": self.best_step, "bad_evaluations": self.bad_evaluations}

  def evaluate(self, run: distributed.Run, state, step: int, num_samples: int | None) -> dict[str, float]:
    """Validation metrics of ``state``; keeps it if it is the best so far."""
    result = _evaluate(self.evaluator, run, state, num_samples)
    self.last_step = step
    value = result[self.metric]
    if value > self.best_value:
      self.best_value, self.best_step, self.bad_evaluations = value, step, 0
      self.best.save(step, state, value)
    else:
      self.bad_evaluations += 1
    return {**result, "split": "validation", "best_step": self.best_step}

  def should_stop(self) -> bool:
    return self.patience is not None and self.bad_evaluations >= self.patience

  def restore_best(self, run: distributed.Run, state):
    """``(best state, its step)``; the given state if none was saved."""
    self.best.wait()
    best = self.best.restore(run.abstract_state())
    if best is None:
      return state, int(distributed.local_value(state.step))
    return best, int(distributed.local_value(best.step))


def _evaluate(evaluator: Evaluator, run: distributed.Run, state, num_samples: int | None) -> dict[str, float]:
  """Test-set metrics, with retrieval diagnostics and the index's fill where the run has them.

  Sampled inference is evaluated with a freshly refreshed index (a copy: training goes on with its own), as a
  model saved for serving would have it; between refreshes the training index lags the moving rows.
  """
  if run.refresh_index is not None:
    state = run.refresh_index(state)
  result = evaluator(run.predict, state, num_samples, diagnose=run.diagnose)
  if run.diagnose is not None:
    result.update(retrieval.index_fill(state.tables))
  return result


def _retrieval_line(record: dict) -> str:
  """The retrieval diagnostics of an evaluation, for the log (empty if it has none)."""
  if "label_recall" not in record:
    return ""
  return (f"  | label_recall {record['label_recall']:.3f}  topk_recall@{retrieval.TOP} "
          f"{record[f'topk_recall@{retrieval.TOP}']:.3f}  candidates {record['mean_candidates']:.0f}  "
          f"cos(h, label) {record['label_cosine']:.3f}")


def _train(config: Config, run: distributed.Run, state, batches: BatchIterator, evaluator: "Evaluator | _Selection",
           writer: MetricWriter | None, checkpoints: checkpoint.Checkpoints, max_steps: int | None,
           steps_per_epoch: int, show_progress: bool):
  """The loop: steps, table maintenance, evaluations, checkpoints, until the budget is spent.

  ``evaluator``: the test set's, or the validation split's :class:`_Selection`, which also keeps the best
  checkpoint and may stop training early.

  Returns:
    ``(state, step, metrics of the last step or None, training seconds without periodic evaluations)``.
  """
  step = int(distributed.local_value(state.step))
  batch_size, max_seconds = config.optim.batch_size, config.budget.max_seconds
  progress = None
  if config.run.progress and show_progress:
    from tqdm.auto import tqdm
    progress = tqdm(total=max_steps, initial=step, unit="step", dynamic_ncols=True, mininterval=1.0)
  losses, window_start, window_steps = [], time.time(), 0
  t_loop, eval_seconds = time.time(), 0.0
  last_metrics = None
  try:
    while max_steps is None or step < max_steps:
      # Every process must take the same steps: the wall-clock budget is checked every
      # log_every steps and process 0's verdict is followed by all.
      if (max_seconds is not None and step % config.run.log_every == 0
          and distributed.agree(time.time() - t_loop - eval_seconds >= max_seconds)):
        logging.info("wall-clock budget of %.0f s reached at step %d", max_seconds, step)
        break
      state, last_metrics = run.step(state, next(batches))
      step += 1
      window_steps += 1
      state = run.maintain(state, step)
      if step % config.run.log_every == 0 or step == max_steps:
        losses.append(float(distributed.local_value(last_metrics["loss"])))  # syncs: only every log_every steps
        if progress is not None:
          samples_per_sec = window_steps * batch_size / max(time.time() - window_start, 1e-9)
          progress.set_postfix(loss=f"{losses[-1]:.4f}", samples_per_s=f"{samples_per_sec:,.0f}")
      if progress is not None:
        progress.update(1)
      if step % config.run.eval_every == 0:
        t_eval = time.time()
        record = {"step": step, "epoch": step / steps_per_epoch, "train_seconds": t_eval - t_loop - eval_seconds,
                  "loss": float(np.mean(losses)) if losses else float(distributed.local_value(last_metrics["loss"])),
                  "samples_per_sec": window_steps * batch_size / max(time.time() - window_start, 1e-9),
                  **(evaluator.evaluate(run, state, step, config.run.eval_samples) if isinstance(evaluator, _Selection)
                     else _evaluate(evaluator, run, state, config.run.eval_samples))}
        if writer is not None:
          writer.write(record)
        logging.info("step %d: loss %.4f  P@1 %.4f  P@5 %.4f  %.0f samples/s%s", step, record["loss"],
                     record["p@1"], record["p@5"], record["samples_per_sec"], _retrieval_line(record))
        eval_seconds += time.time() - t_eval
        losses, window_start, window_steps = [], time.time(), 0
        if isinstance(evaluator, _Selection) and distributed.agree(evaluator.should_stop()):
          logging.info("early stopping at step %d: no better validation %s in %d evaluations (best: step %d)",
                       step, evaluator.metric, evaluator.bad_evaluations, evaluator.best_step)
          break
      if step % config.checkpoint.checkpoint_every == 0:
        checkpoints.save(step, state, _data_state(batches, evaluator if isinstance(evaluator, _Selection) else None))
      if config.dist.checksum_every and step % config.dist.checksum_every == 0:
        run.check_replicas(state, step)
  finally:
    if progress is not None:
      progress.close()
  return state, step, last_metrics, time.time() - t_loop - eval_seconds
