"""What watches the training loop's steps from outside training: the protocol, and the observer that does nothing.

The loop (:class:`sparsejax.train.loop.Loop`) drives a :class:`StepObserver` through its hooks; the run's caller
chooses one by a :data:`StepObserverFactory` given to :func:`sparsejax.train.driver.train_and_evaluate`. The profiled
window of ``--netanalysis_steps`` is such an observer (:class:`sparsejax.netanalysis.collect.StepProfiler`, which the
commands and :func:`sparsejax.fit` pass): training itself never imports the network analysis.
"""

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sparsejax.distributed.collectives import CompiledStep


class StepObserver(Protocol):
  """The loop's hooks, in the order it calls them."""

  def begin_step(self, step: int, compiled: CompiledStep) -> None:
    """Before step ``step`` (steps taken so far) is dispatched; ``compiled``: the step's compiled program."""

  def end_step(self, step: int, outputs: Any) -> None:
    """After the step's dispatch (``step``: steps taken, this one included; ``outputs``: its results)."""

  def maintenance(self, label: str, fn: Callable, *args, **kwargs) -> Any:
    """Runs ``fn(*args, **kwargs)``, a maintenance job named ``label`` (tables, average, eval, checkpoint,
    checksum), and returns its result."""

  def log_record(self) -> dict:
    """Fields for the log record, right after the loop waited for its last step."""

  def finish(self) -> None:
    """After the loop, on every process (collectives allowed)."""

  def close(self) -> None:
    """On any exit, also after an error (no collectives)."""


class NoObserver:
  """The observer of a run that asks for none."""

  def begin_step(self, step: int, compiled: CompiledStep) -> None:
    pass

  def end_step(self, step: int, outputs: Any) -> None:
    pass

  def maintenance(self, label: str, fn: Callable, *args, **kwargs) -> Any:
    return fn(*args, **kwargs)

  def log_record(self) -> dict:
    return {}

  def finish(self) -> None:
    pass

  def close(self) -> None:
    pass


class StepObserverFactory(Protocol):
  """``factory(settings, workdir, job=..., per_process_batch=..., scope_scaling=...)``: the observer of one network's
  run (``settings``: the config's ``netanalysis`` section; ``job``: :attr:`sparsejax.model_kinds.ModelKind.step_job`;
  ``scope_scaling``: the step's named scope -> ``replicated`` / ``sharded`` / ``batch``)."""

  def __call__(self, settings: Any, workdir: str, *, job: str, per_process_batch: int,
               scope_scaling: Mapping[str, str]) -> StepObserver: ...
