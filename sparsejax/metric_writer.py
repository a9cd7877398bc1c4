"""Writes a run's metrics: ``WORKDIR/metrics.jsonl`` and, if asked for, TensorBoard events."""

import json
import os

from absl import logging


class MetricWriter:
  """Appends records (one JSON object per line) to metrics.jsonl, and scalars to TensorBoard.

  Args:
    workdir: the run's work directory.
    tensorboard: also write TensorBoard events to ``WORKDIR/tensorboard`` (needs tensorboardX).
  """

  def __init__(self, workdir: str, tensorboard: bool = False):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:
        logging.warning("tensorboard=True but tensorboardX is not installed (pip install tensorboardX); skipping")

  def write(self, record: dict) -> None:
    """Appends ``record`` (it must hold ``step``)."""
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.tb is not None:
      for key, value in record.items():
        if isinstance(value, (int, float)) and key != "step":
          self.tb.add_scalar(key, value, record["step"])
      self.tb.flush()

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()
