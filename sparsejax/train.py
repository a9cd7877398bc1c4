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
from sparsejax.data import BatchIterator, load_dataset
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
  train, test = data.train, data.test
  logging.info("data: %d train / %d test samples, %d features, %d labels (%.1f s)", len(train), len(test),
               train.num_features, train.num_labels, time.time() - t_start)
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
  writer = MetricWriter(workdir, config.run.tensorboard) if is_chief else None
  batches = BatchIterator(train, config.optim.batch_size, seed=config.run.seed, epoch=data_state["epoch"],
                          index=data_state["index"], max_features=max_features, max_labels=max_labels)
  start_step = int(distributed.local_value(state.step))
  try:
    state, step, last_metrics, train_seconds = _train(config, run, state, batches, evaluator, writer, checkpoints,
                                                      max_steps, steps_per_epoch, show_progress=is_chief)
  finally:
    batches.close()
  if checkpoints.latest_step() != step:
    checkpoints.save(step, state, batches.state(), wait=True)
  checkpoints.wait()
  final = _evaluate(evaluator, run, state, None)
  final.update({
      "step": step, "epoch": step / steps_per_epoch,
      "loss": float(distributed.local_value(last_metrics["loss"])) if last_metrics is not None else float("nan"),
      "samples_per_sec": (step - start_step) * config.optim.batch_size / max(train_seconds, 1e-9),
      "train_seconds": train_seconds, "num_params": model.num_params(state), "final": True,
      "num_processes": num_shards,
  })
  if writer is not None:
    writer.write(final)
    writer.close()
  logging.info("final (step %d): P@1 %.4f  P@3 %.4f  P@5 %.4f  (sampled P@1 %s)%s", step, final["p@1"],
               final["p@3"], final["p@5"], final.get("sampled_p@1", "n/a"), _retrieval_line(final))
  return final


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


def _train(config: Config, run: distributed.Run, state, batches: BatchIterator, evaluator: Evaluator,
           writer: MetricWriter | None, checkpoints: checkpoint.Checkpoints, max_steps: int | None,
           steps_per_epoch: int, show_progress: bool):
  """The loop: steps, table maintenance, evaluations, checkpoints, until the budget is spent.

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
                  **_evaluate(evaluator, run, state, config.run.eval_samples)}
        if writer is not None:
          writer.write(record)
        logging.info("step %d: loss %.4f  P@1 %.4f  P@5 %.4f  %.0f samples/s%s", step, record["loss"],
                     record["p@1"], record["p@5"], record["samples_per_sec"], _retrieval_line(record))
        eval_seconds += time.time() - t_eval
        losses, window_start, window_steps = [], time.time(), 0
      if step % config.checkpoint.checkpoint_every == 0:
        checkpoints.save(step, state, batches.state())
      if config.dist.checksum_every and step % config.dist.checksum_every == 0:
        run.check_replicas(state, step)
  finally:
    if progress is not None:
      progress.close()
  return state, step, last_metrics, time.time() - t_loop - eval_seconds
