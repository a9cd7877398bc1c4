"""The kinds of model, by their ``--model`` name: what each one trains and can do. The one place that reads a model's
name; everything else asks its :class:`ModelKind` (``model_kinds.of(config)``).

Free of JAX (the settings are validated before JAX is imported), as :mod:`sparsejax.index.kinds` for the index.
"""

from typing import NamedTuple


class ModelKind(NamedTuple):
  """One kind of model, as the rest of the package sees it.

  Attributes:
    name: the ``--model`` value.
    sampled: the output layer is trained on each sample's active neurons, picked by a candidate index (SLIDE): it
      has an index and its settings, serves sampled inference (``k``), and the recipe search and ensemble members
      train it. False: every output is computed at every step (the full-softmax baseline).
    data_parallel: each process trains its share of every batch (the batch divides by the processes); False: the
      output layer is split over the processes and each one sees the whole batch.
    accelerators: can run on a GPU or TPU (``--platform``); False: its kernels are CPU code.
    step_job: the name that a profiled window of its step goes by (:mod:`sparsejax.netanalysis`).
    summary: one line for ``--help``.
  """
  name: str
  sampled: bool
  data_parallel: bool
  accelerators: bool
  step_job: str
  summary: str


KINDS = {
    "slide": ModelKind("slide", sampled=True, data_parallel=False, accelerators=False, step_job="sparse",
                       summary="LSH-sampled active neurons, row-sparse updates"),
    "dense": ModelKind("dense", sampled=False, data_parallel=True, accelerators=True, step_job="dense",
                       summary="the full-softmax baseline: every output, every step"),
}
SLIDE, DENSE = KINDS["slide"], KINDS["dense"]


def names() -> tuple[str, ...]:
  return tuple(KINDS)


def get(name: str) -> ModelKind:
  """The kind called ``name`` (a validated ``--model`` value)."""
  return KINDS[name]


def of(config) -> ModelKind:
  """The kind of model that ``config`` trains (a :class:`sparsejax.config.Config` or
  :class:`sparsejax.model_config.ModelConfig`: anything with ``network.model``)."""
  return KINDS[config.network.model]
