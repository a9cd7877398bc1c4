"""Training loop: data, steps, table maintenance, evaluation, logging, checkpoints.

``train_and_evaluate(config, workdir)`` trains a SLIDE network (or, with
``model="dense"``, the dense full-softmax baseline of the same network) and
returns the final evaluation. It resumes from the newest checkpoint in
``workdir`` and then continues exactly as an uninterrupted run would.

Files in ``workdir``: ``metrics.jsonl`` (one JSON object per evaluation),
``checkpoints/`` (orbax; a save interrupted by a crash never replaces the last
good one), ``config.json``, and TensorBoard events if asked for.
"""

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from sparsejax import data as xcdata
from sparsejax import dense, memory, metrics
from sparsejax import model as slide


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A training run. Every field has a flag of the same name in ``examples/train.py``."""
  # Data.
  dataset: str = "icd10"  # "icd10", "synthetic" or "files"
  train_file: str | None = None
  test_file: str | None = None
  icd10_labels: str = "category"  # or "hierarchy" (chapter + block + category)
  synthetic_samples: int = 100_000
  synthetic_features: int = 20_000
  synthetic_labels: int = 10_000
  synthetic_labels_per_sample: float = 1.0
  test_fraction: float = 0.1
  max_features: int | None = None  # per-sample padding width; None: data max
  max_labels: int | None = None
  # Model.
  model: str = "slide"  # or "dense" (full softmax baseline)
  hidden_dims: tuple[int, ...] = (128,)
  active_k: int = 1024
  lsh_family: str = "simhash"
  num_tables: int = 32
  num_bits: int | None = None
  bucket_size: int | None = None
  table_policy: str = "fifo"
  reinsert: str = "none"
  rebuild_period: int = 50
  rebuild_growth: float = 1.05
  rebuild_max_period: int = 2000
  rehash_period: int = 0
  # Optimization.
  batch_size: int = 128
  learning_rate: float = 1e-3
  warmup_steps: int = 0
  decay_steps: int = 0
  weight_decay: float = 0.0
  # Budget: training stops at whichever comes first.
  max_steps: int | None = None
  num_epochs: float | None = 5.0
  max_seconds: float | None = None
  # Evaluation, logging, checkpoints.
  eval_every: int = 500
  eval_samples: int | None = 5000  # test samples of periodic evaluations; final uses all
  log_every: int = 50
  checkpoint_every: int = 1000
  keep_checkpoints: int = 2
  propensity_a: float = 0.55
  propensity_b: float = 1.5
  tensorboard: bool = False
  progress: bool = True
  seed: int = 0

  def model_config(self, num_features: int, num_labels: int) -> slide.ModelConfig:
    return slide.ModelConfig(
        num_features=num_features, num_labels=num_labels, hidden_dims=tuple(self.hidden_dims),
        active_k=self.active_k, lsh_family=self.lsh_family, num_tables=self.num_tables, num_bits=self.num_bits,
        bucket_size=self.bucket_size, table_policy=self.table_policy, learning_rate=self.learning_rate,
        warmup_steps=self.warmup_steps, decay_steps=self.decay_steps, weight_decay=self.weight_decay,
        reinsert=self.reinsert)

  def table_schedule(self) -> slide.TableSchedule:
    return slide.TableSchedule(self.rebuild_period, self.rebuild_growth, self.rebuild_max_period,
                               self.rehash_period)


def load_data(config: TrainConfig) -> tuple[xcdata.XCDataset, xcdata.XCDataset]:
  """The (train, test) sets named by the config."""
  if config.dataset == "icd10":
    train, test, _ = xcdata.load_icd10(label_level=config.icd10_labels, seed=config.seed,
                                       test_fraction=config.test_fraction)
  elif config.dataset == "synthetic":
    full = xcdata.make_synthetic(config.synthetic_samples, config.synthetic_features, config.synthetic_labels,
                                 labels_per_sample=config.synthetic_labels_per_sample, seed=config.seed)
    train, test = xcdata.train_test_split(full, config.test_fraction, seed=config.seed)
  elif config.dataset == "files":
    if not config.train_file or not config.test_file:
      raise ValueError("dataset='files' needs train_file and test_file (extreme classification repository format)")
    train, test = xcdata.load_xc_file(config.train_file), xcdata.load_xc_file(config.test_file)
    if (train.num_features, train.num_labels) != (test.num_features, test.num_labels):
      raise ValueError(f"{config.test_file}: header has {test.num_features} features / {test.num_labels} labels, "
                       f"but {config.train_file} has {train.num_features} / {train.num_labels}")
  else:
    raise ValueError(f"unknown dataset {config.dataset!r}: use 'icd10', 'synthetic' or 'files'")
  return train, test


class Evaluator:
  """Exact (all N outputs, chunked) and LSH-sampled ranking metrics on a test set."""

  def __init__(self, test: xcdata.XCDataset, train: xcdata.XCDataset, config: TrainConfig, mcfg: slide.ModelConfig,
               max_features: int, batch_size: int = 1024):
    self.test, self.mcfg, self.max_features, self.batch_size = test, mcfg, max_features, batch_size
    freqs = train.label_frequencies()
    self.propensity = metrics.propensity_scores(freqs, len(train), config.propensity_a, config.propensity_b)
    self._hidden = jax.jit(lambda s, fi, fv: slide.hidden_forward(
        s.embed.w, (s.embed.b, s.hidden), fi, fv))
    self.top = min(5, mcfg.num_labels)
    self._sampled = jax.jit(functools.partial(slide.predict_sampled, config=mcfg, top=self.top))

  def __call__(self, state, num_samples: int | None = None, sampled: bool = True) -> dict[str, float]:
    n = len(self.test) if num_samples is None else min(num_samples, len(self.test))
    rows = np.arange(n)
    exact, approx, labels = [], [], []
    k = self.top
    for start in range(0, n, self.batch_size):
      idx = rows[start:start + self.batch_size]
      fi, fv, lab = self.test.to_padded(idx, self.max_features)
      pad = self.batch_size - len(idx)  # one compiled shape for every batch
      fi = np.pad(fi, ((0, pad), (0, 0)), constant_values=-1)
      fv = np.pad(fv, ((0, pad), (0, 0)))
      h = self._hidden(state, fi, fv)
      _, top = metrics.exact_topk(h, state.out.w, state.out.b, k)
      exact.append(np.asarray(top)[:len(idx)])
      if sampled and isinstance(state, slide.SlideState):
        approx.append(np.asarray(self._sampled(state, fi, fv))[:len(idx)])
      labels.append(lab)
    width = max(l.shape[1] for l in labels)
    labels = np.concatenate([np.pad(l, ((0, 0), (0, width - l.shape[1])), constant_values=-1) for l in labels])
    result = metrics.evaluate_topk(np.concatenate(exact), labels, self.propensity)
    if approx:
      sampled_result = metrics.evaluate_topk(np.concatenate(approx), labels, self.propensity)
      result.update({f"sampled_{key}": v for key, v in sampled_result.items()})
    return result


def _checkpoint_manager(workdir: str, keep: int):
  import orbax.checkpoint as ocp  # imported lazily: heavy
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def _save(manager, step: int, state, data_state: dict, wait: bool):
  import orbax.checkpoint as ocp
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             data=ocp.args.JsonSave(data_state)))
  if wait:
    manager.wait_until_finished()


def _restore(manager, abstract_state):
  import orbax.checkpoint as ocp
  step = manager.latest_step()
  if step is None:
    return None
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                           data=ocp.args.JsonRestore()))
  return restored["state"], restored["data"]


class _DropOrbaxInfo:
  """absl logging filter: orbax logs every step of every save at INFO."""

  def filter(self, record) -> bool:
    return record.levelno > 20 or "orbax" not in record.pathname


def _quiet_orbax_logs():
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _DropOrbaxInfo) for f in handler.filters):
    handler.addFilter(_DropOrbaxInfo())


class _MetricsWriter:
  """Appends evaluations to metrics.jsonl (and TensorBoard, if enabled)."""

  def __init__(self, workdir: str, tensorboard: bool):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:
        logging.warning("tensorboard=True but tensorboardX is not installed (pip install tensorboardX); skipping")

  def write(self, record: dict):
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.tb is not None:
      for key, value in record.items():
        if isinstance(value, (int, float)) and key != "step":
          self.tb.add_scalar(key, value, record["step"])
      self.tb.flush()


def train_and_evaluate(config: TrainConfig, workdir: str) -> dict[str, Any]:
  """Trains and evaluates; resumes from ``workdir`` if it holds a checkpoint.

  Args:
    config: the run.
    workdir: output directory (created).

  Returns:
    The final evaluation (exact and sampled P@k, nDCG@k, PSP@k) with
    ``step``, ``samples_per_sec``, ``train_seconds`` and ``num_params``.
  """
  os.makedirs(workdir, exist_ok=True)
  _quiet_orbax_logs()
  t_start = time.time()
  train, test = load_data(config)
  logging.info("data: %d train / %d test samples, %d features, %d labels (%.1f s)",
               len(train), len(test), train.num_features, train.num_labels, time.time() - t_start)
  mcfg = config.model_config(train.num_features, train.num_labels)
  max_features = config.max_features or max(int(np.diff(train.indptr).max(initial=1)), 1)
  max_labels = config.max_labels or max(int(np.diff(train.label_indptr).max(initial=1)), 1)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(config), f, indent=1)

  impl = {"slide": slide, "dense": dense}.get(config.model)
  if impl is None:
    raise ValueError(f"unknown model {config.model!r}: use 'slide' or 'dense'")
  init_fn = functools.partial(impl.init, jax.random.key(config.seed), mcfg)
  step_fn = jax.jit(functools.partial(impl.train_step, config=mcfg), donate_argnums=0)
  manager = _checkpoint_manager(workdir, config.keep_checkpoints)
  restored = _restore(manager, jax.eval_shape(init_fn))
  if restored is None:
    state, data_state = init_fn(), {"epoch": 0, "index": 0}
  else:
    state, data_state = restored
    logging.info("resumed from step %d (epoch %d, index %d)", int(state.step), data_state["epoch"],
                 data_state["index"])
  logging.info("%s model: %s parameters", config.model, f"{slide.num_params(state):,}")
  memory.advise_huge_pages(state)

  steps_per_epoch = len(train) // config.batch_size
  if steps_per_epoch == 0:
    raise ValueError(f"batch_size {config.batch_size} exceeds the {len(train)} training samples")
  max_steps = config.max_steps
  if config.num_epochs is not None:
    by_epochs = int(math.ceil(config.num_epochs * steps_per_epoch))
    max_steps = by_epochs if max_steps is None else min(max_steps, by_epochs)
  if max_steps is None and config.max_seconds is None:
    raise ValueError("set a budget: max_steps, num_epochs or max_seconds")

  evaluator = Evaluator(test, train, config, mcfg, max_features)
  writer = _MetricsWriter(workdir, config.tensorboard)
  schedule = config.table_schedule()
  batches = xcdata.BatchIterator(train, config.batch_size, seed=config.seed, epoch=data_state["epoch"],
                                 index=data_state["index"], max_features=max_features, max_labels=max_labels)
  step = start_step = int(state.step)
  progress = None
  if config.progress:
    from tqdm.auto import tqdm
    progress = tqdm(total=max_steps, initial=step, unit="step", dynamic_ncols=True, mininterval=1.0)

  losses, window_start, window_steps = [], time.time(), 0
  t_loop, eval_seconds = time.time(), 0.0
  last_metrics = None
  try:
    while max_steps is None or step < max_steps:
      if config.max_seconds is not None and time.time() - t_loop >= config.max_seconds:
        logging.info("wall-clock budget of %.0f s reached at step %d", config.max_seconds, step)
        break
      batch = next(batches)
      state, last_metrics = step_fn(state, batch)
      step += 1
      window_steps += 1
      if config.model == "slide":
        if schedule.rehash_due(step):
          state = slide.new_hash_functions(state, mcfg)
          logging.info("step %d: new hash functions, tables rebuilt", step)
        elif schedule.rebuild_due(step):
          state = slide.rebuild_tables(state)
          logging.debug("step %d: tables rebuilt", step)
      if step % config.log_every == 0 or step == max_steps:
        losses.append(float(last_metrics["loss"]))  # syncs: only every log_every steps
        elapsed = time.time() - window_start
        samples_per_sec = window_steps * config.batch_size / max(elapsed, 1e-9)
        if progress is not None:
          progress.set_postfix(loss=f"{losses[-1]:.4f}", samples_per_s=f"{samples_per_sec:,.0f}")
      if progress is not None:
        progress.update(1)
      if step % config.eval_every == 0:
        t_eval = time.time()
        record = {"step": step, "epoch": step / steps_per_epoch,
                  "loss": float(np.mean(losses)) if losses else float(last_metrics["loss"]),
                  "samples_per_sec": window_steps * config.batch_size / max(time.time() - window_start, 1e-9),
                  **evaluator(state, config.eval_samples)}
        writer.write(record)
        logging.info("step %d: loss %.4f  P@1 %.4f  P@5 %.4f  %.0f samples/s", step, record["loss"],
                     record["p@1"], record["p@5"], record["samples_per_sec"])
        eval_seconds += time.time() - t_eval
        losses, window_start, window_steps = [], time.time(), 0
      if step % config.checkpoint_every == 0:
        _save(manager, step, state, batches.state(), wait=False)
  finally:
    if progress is not None:
      progress.close()
    batches.close()
  train_seconds = time.time() - t_loop - eval_seconds  # budget used by training (periodic evals excluded)
  if manager.latest_step() != step:
    _save(manager, step, state, batches.state(), wait=True)
  manager.wait_until_finished()
  final = evaluator(state, None)
  final.update({
      "step": step, "epoch": step / steps_per_epoch,
      "loss": float(last_metrics["loss"]) if last_metrics is not None else float("nan"),
      "samples_per_sec": (step - start_step) * config.batch_size / max(train_seconds, 1e-9),
      "train_seconds": train_seconds, "num_params": slide.num_params(state), "final": True,
  })
  writer.write(final)
  logging.info("final (step %d): P@1 %.4f  P@3 %.4f  P@5 %.4f  (sampled P@1 %s)", step, final["p@1"],
               final["p@3"], final["p@5"], final.get("sampled_p@1", "n/a"))
  return final
