"""The training application: the training loop and what a run writes and reads back.

A run's settings (:mod:`sparsejax.config`) come from the command line (:mod:`sparsejax.cli`) or ``sparsejax.fit``
(:mod:`sparsejax.fitting`); :func:`train_and_evaluate` (:mod:`.driver`) composes the run of the recipe search
(:mod:`.recipes`, :mod:`.search`), the network's training (:mod:`.loop`: the model of :mod:`sparsejax.model`, one
process or several through :mod:`sparsejax.distributed`) and the ensemble's members (:mod:`.members`), with
checkpoints (:mod:`sparsejax.workdir`), evaluations (:mod:`sparsejax.evaluation`), metrics
(:mod:`.metric_writer`, :mod:`.console`) and stops (:mod:`.stopping`, :mod:`.nonfinite`);
:mod:`sparsejax.serving` serves the model it saved (``sparsejax.load``).

This package imports the model core and the distributed runtime; neither imports it.
"""


def __getattr__(name: str):
  """``train_and_evaluate``, imported on first use: the driver imports JAX, and ``sparsejax.workdir.seals`` or
  ``.console`` need not."""
  if name == "train_and_evaluate":
    # deferred: the commands import this package's light modules (allocator, recipes) before JAX may start
    from sparsejax.train.driver import train_and_evaluate

    return train_and_evaluate
  raise AttributeError(f"module 'sparsejax.train' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), "train_and_evaluate"])
