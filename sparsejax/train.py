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
import numpy as np
from absl import logging

from sparsejax import data as xcdata
from sparsejax import dense, distributed, memory, metrics
from sparsejax import model as slide
from sparsejax.netanalysis import collect as netanalysis


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
  learning_rate: float = 3e-3
  warmup_steps: int = 0
  decay_steps: int = 0
  weight_decay: float = 0.0
  moment_dtype: str = "float32"  # sparse layers' Adam moments: float32 or bfloat16
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
  # Distribution: the output layer is split over this many processes
  # (None: all processes of the jax.distributed job; the dense model then runs
  # data-parallel). Replicated parameters are compared every checksum_every steps.
  num_shards: int | None = None
  checksum_every: int = 500
  # Network analysis (sparsejax.netanalysis.collect): profile netanalysis_steps steps from step
  # netanalysis_start (0: off; the window waits for every step) into workdir/netanalysis/.
  netanalysis_steps: int = 0
  netanalysis_start: int = 20
  link_capacity: str | None = None  # the link's rate, e.g. "1gbit", for utilisations
  netanalysis_iface: str = "auto"  # interface whose tx/rx to count; auto: the one this process advertises
  netanalysis_keep_raw: bool = False  # keep the profiler's raw output

  def model_config(self, num_features: int, num_labels: int) -> slide.ModelConfig:
    return slide.ModelConfig(
        num_features=num_features, num_labels=num_labels, hidden_dims=tuple(self.hidden_dims),
        active_k=self.active_k, lsh_family=self.lsh_family, num_tables=self.num_tables, num_bits=self.num_bits,
        bucket_size=self.bucket_size, table_policy=self.table_policy, learning_rate=self.learning_rate,
        warmup_steps=self.warmup_steps, decay_steps=self.decay_steps, weight_decay=self.weight_decay,
        moment_dtype=self.moment_dtype, reinsert=self.reinsert)

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

  def __init__(self, test: xcdata.XCDataset, train: xcdata.XCDataset, config: TrainConfig, runner: "Runner",
               max_features: int, batch_size: int = 1024):
    self.test, self.runner, self.max_features, self.batch_size = test, runner, max_features, batch_size
    freqs = train.label_frequencies()
    self.propensity = metrics.propensity_scores(freqs, len(train), config.propensity_a, config.propensity_b)

  def __call__(self, state, num_samples: int | None = None) -> dict[str, float]:
    n = len(self.test) if num_samples is None else min(num_samples, len(self.test))
    rows = np.arange(n)
    exact, approx, labels = [], [], []
    for start in range(0, n, self.batch_size):
      idx = rows[start:start + self.batch_size]
      fi, fv, lab = self.test.to_padded(idx, self.max_features)
      pad = self.batch_size - len(idx)  # one compiled shape for every batch
      fi = np.pad(fi, ((0, pad), (0, 0)), constant_values=-1)
      fv = np.pad(fv, ((0, pad), (0, 0)))
      top, sampled = self.runner.predict(state, fi, fv)
      exact.append(top[:len(idx)])
      if sampled is not None:
        approx.append(sampled[:len(idx)])
      labels.append(lab)
    width = max(l.shape[1] for l in labels)
    labels = np.concatenate([np.pad(l, ((0, 0), (0, width - l.shape[1])), constant_values=-1) for l in labels])
    result = metrics.evaluate_topk(np.concatenate(exact), labels, self.propensity)
    if approx:
      sampled_result = metrics.evaluate_topk(np.concatenate(approx), labels, self.propensity)
      result.update({f"sampled_{key}": v for key, v in sampled_result.items()})
    return result


def _local_value(x) -> np.ndarray:
  """This process's copy of a (replicated) array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return np.asarray(x)


class Runner:
  """How one kind of run initializes, steps, maintains and predicts.

  Single process: the SLIDE model or the dense baseline. Several shards
  (processes): the output layer split over a mesh, or the dense baseline run
  data-parallel.
  """

  def __init__(self, config: TrainConfig, mcfg: slide.ModelConfig, num_shards: int):
    self.config, self.num_shards = config, num_shards
    self.is_slide = config.model == "slide"
    self.mcfg = dataclasses.replace(mcfg, num_shards=num_shards) if self.is_slide else mcfg
    self.key = jax.random.key(config.seed)
    self.top = min(5, mcfg.num_labels)
    self.schedule = config.table_schedule()
    if num_shards == 1:
      impl = slide if self.is_slide else dense
      self._step = jax.jit(functools.partial(impl.train_step, config=self.mcfg), donate_argnums=0)
      self._predict = jax.jit(self._local_predict)
      if self.is_slide:
        self._rebuild = jax.jit(slide.rebuild_tables, donate_argnums=0)
        self._rehash = jax.jit(functools.partial(slide.new_hash_functions, config=self.mcfg), donate_argnums=0)
      return
    self.mesh = distributed.make_mesh(num_shards)
    if self.is_slide:
      self._step = distributed.make_train_step(self.mcfg, self.mesh)
      self._rebuild = distributed.make_rebuild(self.mcfg, self.mesh)
      self._rehash = distributed.make_rebuild(self.mcfg, self.mesh, new_hash_functions=True)
      self._predict = distributed.make_predict(self.mcfg, self.mesh, self.top)
      self._checksum = distributed.make_checksum(self.mesh)
    else:
      if config.batch_size % num_shards:
        raise ValueError(f"data-parallel: batch_size {config.batch_size} must divide by {num_shards} processes")
      self._step = distributed.make_dp_train_step(self.mcfg, self.mesh)
      self._predict = jax.jit(self._local_predict)  # the model is replicated
      self._checksum = None

  def _local_predict(self, state, fi, fv):
    exact = slide.predict_exact(state, fi, fv, top=self.top)
    if not self.is_slide:
      return exact, None
    return exact, slide.predict_sampled(state, fi, fv, config=self.mcfg, top=self.top)

  def init(self):
    if self.num_shards == 1:
      return (slide if self.is_slide else dense).init(self.key, self.mcfg)
    if self.is_slide:
      return distributed.init(self.key, self.mcfg, self.mesh)
    replicated = jax.sharding.NamedSharding(self.mesh, distributed.P())
    return jax.jit(lambda: dense.init(self.key, self.mcfg), out_shardings=replicated)()

  def abstract_state(self):
    """Shapes, dtypes and shardings of the state, to restore a checkpoint into."""
    if self.num_shards == 1:
      return jax.eval_shape(self.init)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.init())

  def put_batch(self, batch):
    if self.num_shards == 1:
      return batch
    spec = distributed.P() if self.is_slide else distributed.P(distributed.AXIS)
    return distributed.to_global(batch, self.mesh, spec)

  def step(self, state, batch):
    return self._step(state, self.put_batch(batch))

  def step_scopes(self) -> dict:
    """The step's named scopes and how each scales with P (netanalysis)."""
    return slide.STEP_SCOPES if self.is_slide else dense.STEP_SCOPES

  def compiled_step(self, state, batch):
    """The step as compiled for these arguments: module, collectives, scopes (netanalysis)."""
    from sparsejax.netanalysis import collectives
    return collectives.compile_step(self._step, state, self.put_batch(batch), known_scopes=tuple(self.step_scopes()))

  def maintain(self, state, step: int):
    """Table refreshes due after ``step`` steps (SLIDE only)."""
    if not self.is_slide:
      return state
    if self.schedule.rehash_due(step):
      logging.info("step %d: new hash functions, tables rebuilt", step)
      return self._rehash(state)
    if self.schedule.rebuild_due(step):
      return self._rebuild(state)
    return state

  def predict(self, state, fi, fv):
    if self.num_shards > 1:
      fi, fv = distributed.to_global((fi, fv), self.mesh)
    exact, sampled = self._predict(state, fi, fv)
    return _local_value(exact), None if sampled is None else _local_value(sampled)

  def agree(self, flag: bool) -> bool:
    """Process 0's ``flag``, on every process (decisions that change control flow)."""
    if jax.process_count() == 1:
      return flag
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))

  def check_replicas(self, state, step: int):
    """Raises if the replicated parameters differ between processes."""
    if self.num_shards == 1 or self._checksum is None:
      return
    sums = _local_value(self._checksum(state))
    if len(set(sums.tolist())) != 1:
      raise RuntimeError(f"step {step}: replicated parameters differ between processes "
                         f"(checksums {sums.tolist()}): replicas drifted")


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

  if config.model not in ("slide", "dense"):
    raise ValueError(f"unknown model {config.model!r}: use 'slide' or 'dense'")
  num_shards = config.num_shards or jax.process_count()
  runner = Runner(config, mcfg, num_shards)
  is_chief = jax.process_index() == 0
  manager = _checkpoint_manager(workdir, config.keep_checkpoints)
  restored = _restore(manager, runner.abstract_state())
  if restored is None:
    state, data_state = runner.init(), {"epoch": 0, "index": 0}
  else:
    state, data_state = restored
    logging.info("resumed from step %d (epoch %d, index %d)", int(_local_value(state.step)),
                 data_state["epoch"], data_state["index"])
  logging.info("%s model: %s parameters%s", config.model, f"{slide.num_params(state):,}",
               f" over {num_shards} processes" if num_shards > 1 else "")
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

  evaluator = Evaluator(test, train, config, runner, max_features)
  writer = _MetricsWriter(workdir, config.tensorboard) if is_chief else None
  batches = xcdata.BatchIterator(train, config.batch_size, seed=config.seed, epoch=data_state["epoch"],
                                 index=data_state["index"], max_features=max_features, max_labels=max_labels)
  step = start_step = int(_local_value(state.step))
  progress = None
  if config.progress and is_chief:
    from tqdm.auto import tqdm
    progress = tqdm(total=max_steps, initial=step, unit="step", dynamic_ncols=True, mininterval=1.0)

  losses, window_start, window_steps = [], time.time(), 0
  t_loop, eval_seconds = time.time(), 0.0
  last_metrics = None
  per_process_batch = config.batch_size // (1 if runner.is_slide else num_shards)
  netprof = netanalysis.StepProfiler.from_config(config, workdir, job="sparse" if runner.is_slide else "dense",
                                                 per_process_batch=per_process_batch,
                                                 scope_scaling=runner.step_scopes())
  try:
    while max_steps is None or step < max_steps:
      # Every process must take the same steps: the budget is checked every
      # log_every steps and process 0's verdict is followed by all.
      if (config.max_seconds is not None and step % config.log_every == 0
          and runner.agree(time.time() - t_loop >= config.max_seconds)):
        logging.info("wall-clock budget of %.0f s reached at step %d", config.max_seconds, step)
        break
      batch = next(batches)
      netprof.begin_step(step, lambda: runner.compiled_step(state, batch))
      state, last_metrics = runner.step(state, batch)
      step += 1
      netprof.end_step(step, (state, last_metrics))
      window_steps += 1
      state = netprof.maintenance("tables", runner.maintain, state, step)
      if step % config.log_every == 0 or step == max_steps:
        losses.append(float(_local_value(last_metrics["loss"])))
        step_times = netprof.log_record(step)
        if writer is not None and step_times is not None:
          writer.write(step_times)
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
                  **netprof.maintenance("eval", evaluator, state, config.eval_samples)}
        if writer is not None:
          writer.write(record)
        logging.info("step %d: loss %.4f  P@1 %.4f  P@5 %.4f  %.0f samples/s", step, record["loss"],
                     record["p@1"], record["p@5"], record["samples_per_sec"])
        eval_seconds += time.time() - t_eval
        losses, window_start, window_steps = [], time.time(), 0
      if step % config.checkpoint_every == 0:
        netprof.maintenance("checkpoint", _save, manager, step, state, batches.state(), wait=False)
      if config.checksum_every and step % config.checksum_every == 0:
        netprof.maintenance("checksum", runner.check_replicas, state, step)
    netprof.finish()
  finally:
    netprof.close()
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
      "loss": float(_local_value(last_metrics["loss"])) if last_metrics is not None else float("nan"),
      "samples_per_sec": (step - start_step) * config.batch_size / max(train_seconds, 1e-9),
      "train_seconds": train_seconds, "num_params": slide.num_params(state), "final": True,
      "num_processes": num_shards,
  })
  if writer is not None:
    writer.write(final)
  logging.info("final (step %d): P@1 %.4f  P@3 %.4f  P@5 %.4f  (sampled P@1 %s)", step, final["p@1"],
               final["p@3"], final["p@5"], final.get("sampled_p@1", "n/a"))
  return final
