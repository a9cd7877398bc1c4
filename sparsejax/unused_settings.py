"""The settings a run changed from their defaults but does not read: each one a warning at the start of a run, so a
flag that does nothing never passes silently (``--num_tables=8 --candidates=clusters``)::

  for line in unused_settings.of(config):
    logging.warning(line)
"""

from sparsejax import model_kinds  # (no JAX)
from sparsejax.config import Config
from sparsejax.index import kinds as index_kinds  # (no JAX)
from sparsejax.settings import format_value, non_default_settings


def of(config: Config) -> list[str]:
  """Settings of ``config`` changed from their defaults that its run does not read, one line each (logged as
  warnings)."""
  d, t = config.data, config.tables
  unused = {}  # setting name -> why
  if d.dataset != "synthetic":
    for name in ("synthetic_samples", "synthetic_features", "synthetic_labels", "synthetic_labels_per_sample"):
      unused[name] = f"only read with --dataset=synthetic (the dataset is {d.dataset})"
  if d.dataset != "icd10":
    unused["icd10_labels"] = f"only read with --dataset=icd10 (the dataset is {d.dataset})"
  if d.dataset == "files":
    unused["test_fraction"] = "not read with --dataset=files (--test_file is the test set)"
  if d.validation_fraction == 0 or not config.run.centroid_fusion:
    unused["head_rankers"] = "fused only with --centroid_fusion and a validation split (--validation_fraction > 0)"
  if d.validation_fraction == 0:
    for name in ("early_stopping_patience", "early_stopping_ratio", "ensemble_members", "validation_split"):
      unused[name] = "needs a validation split (--validation_fraction > 0)"
  elif config.budget.max_seconds is None:
    unused["early_stopping_ratio"] = "only read with --max_seconds (a step or epoch budget is trained whole)"
    # (sparsejax.train.members.reason_not_to_train: members train the time an early stop leaves of a budget)
    unused["ensemble_members"] = "only read with --max_seconds (a step or epoch budget trains one network)"
    unused["plan_from"] = "only read with --max_seconds (a step or epoch budget plans the search in steps)"
  if d.validation_fraction > 0 and d.validation_split == "grouped":
    unused.setdefault("early_stopping_ratio", "a grouped validation split does not stop a run on a plateau "
                      "(--validation_split)")
    unused.setdefault("ensemble_members", "a grouped validation split trains one network its whole budget "
                      "(--validation_split)")
  if not model_kinds.of(config).sampled:
    for name in ("candidates", "num_clusters", "lsh_family", "lsh_projections", "num_tables", "num_bits", "lsh_mips",
                 "lsh_probes", "lsh_rerank", "lsh_serving"):
      unused[name] = "not read by --model=dense (every output is computed)"
    unused.setdefault("ensemble_members", "not read by --model=dense (only SLIDE's runs train members)")
  else:
    unused.update(index_kinds.unused_settings(t))
  changed = non_default_settings(config)
  return [f"--{name}={format_value(changed[name])} has no effect: {why}" for name, why in unused.items()
          if name in changed]
