"""A work directory's checkpoints (orbax): the state, the data position, and the config that made them.

``WORKDIR/checkpoints/<step>/`` holds one checkpoint: ``state`` (every array
of the training state; each process writes its shards), ``data`` (the batch
iterator's position). A save runs in the background; one interrupted by a
crash never replaces the last complete checkpoint.
"""

import os

from absl import logging


class _DropOrbaxInfo:
  """absl logging filter: orbax logs every step of every save at INFO."""

  def filter(self, record) -> bool:
    return record.levelno > 20 or "orbax" not in record.pathname


def quiet_orbax_logs() -> None:
  """Keeps orbax's INFO lines out of the log (warnings and errors still show)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _DropOrbaxInfo) for f in handler.filters):
    handler.addFilter(_DropOrbaxInfo())


class Checkpoints:
  """Save and restore training states in ``WORKDIR/checkpoints``.

  Args:
    workdir: the run's work directory.
    keep: newest checkpoints kept (None: all).
  """

  def __init__(self, workdir: str, keep: int | None):
    import orbax.checkpoint as ocp  # imported lazily: heavy

    self._ocp = ocp
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._manager = ocp.CheckpointManager(self.directory,
                                          options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step (None: none yet)."""
    return self._manager.latest_step()

  def save(self, step: int, state, data_state: dict, *, wait: bool = False) -> None:
    """Saves ``state`` and the data position as checkpoint ``step`` (in the background unless ``wait``)."""
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     data=ocp.args.JsonSave(data_state)))
    if wait:
      self.wait()

  def restore(self, abstract_state):
    """``(state, data_state)`` of the newest checkpoint, or None if there is none.

    Args:
      abstract_state: shapes, dtypes and shardings to restore into.
    """
    step = self.latest_step()
    if step is None:
      return None
    ocp = self._ocp
    restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                   data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

  def wait(self) -> None:
    """Blocks until background saves are on disk."""
    self._manager.wait_until_finished()


class BestCheckpoint:
  """The best state by a validation metric, in ``WORKDIR/best_checkpoint`` (orbax ``best_fn``, one kept).

  Args:
    workdir: the run's work directory.
    metric: the name of the (higher-is-better) metric it is selected by.
  """

  def __init__(self, workdir: str, metric: str):
    import orbax.checkpoint as ocp

    self._ocp, self.metric = ocp, metric
    self.directory = os.path.abspath(os.path.join(workdir, "best_checkpoint"))
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=1, best_fn=lambda metrics: metrics[metric], best_mode="max", create=True))

  def save(self, step: int, state, value: float) -> None:
    """Saves ``state`` of step ``step`` whose metric is ``value`` (orbax keeps the best one)."""
    self._manager.save(step, args=self._ocp.args.Composite(state=self._ocp.args.StandardSave(state)),
                       metrics={self.metric: float(value)}, force=True)

  def best_step(self) -> int | None:
    return self._manager.best_step()

  def restore(self, abstract_state):
    """The best state (None if none was saved)."""
    self._manager.wait_until_finished()
    step = self.best_step()
    if step is None:
      return None
    restored = self._manager.restore(step, args=self._ocp.args.Composite(
        state=self._ocp.args.StandardRestore(abstract_state)))
    return restored["state"]

  def wait(self) -> None:
    self._manager.wait_until_finished()
