"""What a run is planned from before anything is built: its data, its validation split (the seed, random or grouped),
the sizes the recipe search models, the budget a search leaves, and the checks that refuse a run this machine cannot
hold."""

import json
import os
import time
from typing import NamedTuple

import jax
import numpy as np
from absl import logging

from sparsejax import memory, model_kinds
from sparsejax.config import Config
from sparsejax.data import BatchIterator, LoadedData, XCDataset, grouped_split, load_dataset
from sparsejax.data.batching import bucket_widths
from sparsejax.model_config import ModelConfig
from sparsejax.settings import ConfigError, override
from sparsejax.shard import shard_rows
from sparsejax.train import search_plan


def load_data(config: Config) -> LoadedData:
  t_start = time.time()
  data = load_dataset(config.data, seed=config.run.seed)
  logging.info("loaded %s in %.1f s", config.data.dataset, time.time() - t_start)
  return data


# --selection_metric=auto selects by P@5 where the training rows' median label count is at least this, else by P@1.
# On the suite's labels_5 (5 labels a row) validation P@1 was 0.9996 by step 1,500: the run stopped early there, at
# test P@5 0.845 against PECOS's 0.936; selected by P@5 it trained its whole budget: test P@5 0.932, P@1 0.9999.
# Not below 5: on WordNet (median 4) selecting by P@5 gave test P@1 0.7067 and P@5 0.5072 against 0.7210 and 0.5092
# by P@1 (2026-12-07, one run each); on debian_depends (median 3) P@5 0.3535 against 0.3605.
MULTI_LABEL_MEDIAN = 5


def resolve_selection_metric(config: Config, workdir: str, data: LoadedData | None
                             ) -> tuple[Config, LoadedData | None]:
  """``(config, data)``: ``--selection_metric=auto`` decided: as the run in ``workdir`` recorded it (its
  ``config.json``), else on the training rows' label counts (the data loaded here where not given). Other values are
  kept as they are."""
  if config.run.selection_metric != "auto":
    return config, data
  recorded = recorded_setting(workdir, "run", "selection_metric")
  if recorded not in (None, "auto"):
    return override(config, selection_metric=recorded), data
  data = data if data is not None else load_data(config)
  counts = np.diff(data.train.label_indptr)
  median = float(np.median(counts)) if len(counts) else 0.0
  metric = "p@5" if median >= MULTI_LABEL_MEDIAN else "p@1"
  logging.info("selection metric: %s (the training rows' median label count is %g)", metric, median)
  return override(config, selection_metric=metric), data


def recorded_setting(workdir: str, section: str, name: str):
  """Setting ``name`` of ``section`` as the run in ``workdir`` recorded it in its ``config.json`` (None: no such
  file, unreadable, or not recorded: a run of an older sparsejax)."""
  try:
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      return json.load(f)[section].get(name)
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None


def validation_seed(config: Config) -> int:
  """The seed that draws a run's validation split from its training samples."""
  return config.run.seed + 1


def resolve_validation_split(config: Config, data: LoadedData) -> tuple[Config, dict]:
  """``(config, record)``: ``config`` with ``--validation_split=auto`` decided on ``data``
  (:func:`sparsejax.data.grouped_split.looks_grouped`: grouped where the test set looks split by groups of
  near-duplicates, else random), and the final record's fields that say what was measured (none where nothing
  was). Other values, and a run without a validation split, are kept as they are."""
  if config.data.validation_split != "auto" or config.data.validation_fraction == 0:
    return config, {}
  test = grouped_split.looks_grouped(data.train, data.test)
  kind = "grouped" if test.grouped else "random"
  logging.info("validation split: %s (a training row within cosine %g for %.1f%% of the test set's rows and for "
               "%.1f%% of the training rows among themselves; %.1f s)", kind, grouped_split.NEIGHBOUR_COSINE,
               100 * test.test_rate, 100 * test.train_rate, test.seconds)
  return override(config, validation_split=kind), {
      "validation_split": kind, "near_neighbours": {"train": test.train_rate, "test": test.test_rate}}


def validation_split(config: Config, train: XCDataset, seed: int) -> tuple[XCDataset, XCDataset]:
  """``(train, validation)``: ``--validation_fraction`` of ``train`` held out by ``seed``, grouped or at random as
  ``--validation_split`` says (``auto``, not resolved by :func:`resolve_validation_split`: at random)."""
  return grouped_split.split(train, config.data.validation_fraction, seed, config.data.validation_split == "grouped")


def data_shape(config: Config, train) -> search_plan.DataShape:
  """The sizes the recipe search's step-cost model needs (of the samples trained on: less the validation split)."""
  num_train = len(train) - round(len(train) * config.data.validation_fraction)
  feature_counts, limit = np.diff(train.indptr), config.data.max_features
  mean_features = float(np.mean(np.minimum(feature_counts, limit) if limit else feature_counts)) if len(train) else 0.0
  return search_plan.DataShape(num_train, train.num_features, train.num_labels, mean_features, len(train) - num_train)


def charged_for_search(config: Config, search_wall_seconds: float) -> Config:
  """``config`` with the search's wall seconds taken from ``--max_seconds`` (they count against the budget)."""
  if config.budget.max_seconds is None or not search_wall_seconds:
    return config
  return override(config, max_seconds=max(config.budget.max_seconds - search_wall_seconds, 1e-3))


def check_interface(config: Config) -> None:
  """Refuses a ``--netanalysis_iface`` that this host does not have (where the window would sample it)."""
  iface, net = config.netanalysis.netanalysis_iface, "/sys/class/net"
  if config.netanalysis.netanalysis_steps and iface != "auto" and os.path.isdir(net) and \
      not os.path.exists(os.path.join(net, iface)):
    raise ConfigError("netanalysis_iface", iface, f"no such network interface on this host (it has "
                      f"{', '.join(sorted(os.listdir(net)))})")


def check_state_memory(config: Config, num_features: int, num_labels: int, num_shards: int) -> None:
  """Raises a :class:`ConfigError` where this process's share of the network's weights and their Adam moments
  cannot fit in this machine's memory: XLA's allocation failed with RESOURCE_EXHAUSTED and a 70-line traceback (a
  header of 10^8 labels asked for 51 GB for the output layer alone), after the data had loaded. Counted from the
  sizes (tracing the state's shapes costs start-up time), so a lower bound: the index and the step's buffers come on
  top."""
  have = memory.machine_memory_bytes()
  if have is None:
    return
  widths = [num_features, *config.network.hidden_dims]
  rows = shard_rows(num_labels, num_shards)
  weights = sum(a * b + b for a, b in zip(widths, widths[1:])) + rows * (widths[-1] + 1)
  averaged = config.optim.average_steps > 0
  need = (3 + averaged) * 4 * weights  # float32 weights, Adam's two moments, the weights' moving average
  if need <= have:
    return
  d = config.data
  if d.dataset == "files":
    name, value = "train_file", d.train_file
  elif d.dataset == "synthetic":
    name = "synthetic_labels" if d.synthetic_labels >= d.synthetic_features else "synthetic_features"
    value = getattr(d, name)
  else:
    name, value = "hidden_dims", config.network.hidden_dims
  size = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
  raise ConfigError(name, value, f"a network of {num_features} features, hidden layers "
                    f"{'x'.join(map(str, config.network.hidden_dims))} and {num_labels} labels needs at least "
                    f"{size(need)} of memory per process for its weights and Adam moments"
                    f"{' and their moving average' if averaged else ''}; this machine has {size(have)}. Lower "
                    "--hidden_dims, or split the output layer over more processes (sparsejax-launch -n P)"
                    f"{', or --average_steps=0' if averaged else ''}")


def num_shards(config: Config) -> int:
  """The processes the output layer is split over (``--num_shards``, else every process of the job), checked against
  the job (here, where it is known) with the settings that depend on it."""
  shards = config.dist.num_shards or jax.process_count()
  # The shards are the job's processes (one process: its devices).
  devices = jax.process_count() if jax.process_count() > 1 else jax.device_count()
  if shards > devices:
    raise ConfigError("num_shards", shards, f"this job has {devices} process(es) to split the output layer "
                      f"over: start {shards} (sparsejax-launch -n {shards} ...), or give none")
  check_interface(config)
  if model_kinds.of(config).data_parallel and config.optim.batch_size % shards:
    raise ConfigError("batch_size", config.optim.batch_size,
                      f"data-parallel training splits each batch over {shards} processes: must divide by it")
  return shards


class DataPlan(NamedTuple):
  """The samples a run trains, selects and tests on, and the sizes its checkpoints record.

  Attributes:
    train: the samples trained on (the validation split taken out).
    validation: the validation split, or None (``--validation_fraction=0``).
    test: the test set.
    sizes: ``num_features``, ``num_labels``, ``num_train``, ``steps_per_epoch``, ``max_features``, ``max_labels``
      (the widest rows, or the limits given): a resumed run must find the same.
    max_steps: the step budget (None: the clock's).
  """
  train: XCDataset
  validation: XCDataset | None
  test: XCDataset
  sizes: dict[str, int]
  max_steps: int | None

  @property
  def steps_per_epoch(self) -> int:
    return self.sizes["steps_per_epoch"]


def split_data(config: Config, data: LoadedData, seed: int | None = None) -> DataPlan:
  """``data`` split for a run of ``config``: the validation split drawn by ``seed`` (None: :func:`validation_seed`;
  an ensemble's members take the first member's). Refuses an empty test set or validation split, and a batch larger
  than the training set."""
  train, test, validation = data.train, data.test, None
  if len(test) == 0:
    name = "test_file" if config.data.dataset == "files" else "test_fraction"
    raise ConfigError(name, getattr(config.data, name), "the test set has no samples")
  if config.data.validation_fraction > 0:
    seed = validation_seed(config) if seed is None else seed
    train, validation = validation_split(config, train, seed)
    if len(validation) == 0:  # too few samples for the fraction: nothing to select on
      raise ConfigError("validation_fraction", config.data.validation_fraction,
                        f"holds no sample of the {len(train)} training samples: raise it, or 0 for no validation "
                        "split")
  logging.info("data: %d train / %d validation / %d test samples, %d features, %d labels", len(train),
               0 if validation is None else len(validation), len(test), train.num_features, train.num_labels)
  steps_per_epoch = len(train) // config.optim.batch_size
  if steps_per_epoch == 0:
    raise ConfigError("batch_size", config.optim.batch_size, f"exceeds the {len(train)} training samples")
  sizes = {"num_features": train.num_features, "num_labels": train.num_labels, "num_train": len(train),
           "steps_per_epoch": steps_per_epoch,
           "max_features": config.data.max_features or max(train.max_features_per_sample(), 1),
           "max_labels": config.data.max_labels or max(train.max_labels_per_sample(), 1)}
  return DataPlan(train, validation, test, sizes, config.budget.max_steps_for(steps_per_epoch))


def batch_iterator(config: Config, split: DataPlan, position: dict, sized: ModelConfig) -> BatchIterator:
  """The training batches from ``position``, each padded to its own bucketed widths."""
  train, sizes = split.train, split.sizes
  # The sampled step's active set holds every label of a sample: a row with more labels than k trains on its first
  # k (a FOLDOC definition with 615 references stopped a k = 512 run with an error).
  max_labels = sizes["max_labels"] if sized.exact_softmax else min(sizes["max_labels"], sized.k)
  if max_labels < sizes["max_labels"]:
    cut = int(np.sum(train.label_counts() > max_labels))
    logging.warning("%d training samples have more labels than the %d active neurons (--active_k): each trains on "
                    "its first %d", cut, sized.k, max_labels)
  batches = BatchIterator(train, config.optim.batch_size, seed=config.run.seed, epoch=position["epoch"],
                          index=position["index"], max_features=sizes["max_features"], max_labels=max_labels)
  # A new pair of widths compiles the step again (once).
  feature_widths, label_widths = bucket_widths(sizes["max_features"]), bucket_widths(max_labels)
  logging.info("batches padded to their own widths: features %s, labels %s (at most %d compiled steps)",
               feature_widths, label_widths, len(feature_widths) * len(label_widths))
  return batches
