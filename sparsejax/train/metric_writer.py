"""Writes a run's metrics: ``WORKDIR/metrics.jsonl`` and, if asked for, TensorBoard events.

``metrics.jsonl`` holds one JSON object per line: a record per step at which
something was measured (the training loss every ``log_every`` steps, the test
metrics every ``eval_every`` steps) and a last record with ``"final": true``.
TensorBoard tags are the record keys, unchanged (``p@1`` stays ``p@1``).
When a run resumes from a checkpoint at step ``s``, records after ``s`` (written
before a crash, by steps that will be taken again) are dropped from both, so
no step appears twice.
"""

import json
import os
import time
from collections.abc import Iterable

import jax
from absl import logging

from sparsejax import memory
from sparsejax.workdir import seals

METRICS_FILE = "metrics.jsonl"


class MetricsFileError(ValueError):
  """``metrics.jsonl`` holds a line that is not a run's record; the message names the file and line."""


def read_records(workdir: str) -> list[dict]:
  """The records of ``WORKDIR/metrics.jsonl`` (empty if there is none).

  An incomplete last line (a crash or a full disk while it was written) is left out, with a warning.

  Raises:
    MetricsFileError: another line is not JSON, or not a record with an integer ``step`` (another program's
      file in the work directory, say).
  """
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:  # decoded line by line: a line that is not UTF-8 is named by its number
    lines = f.readlines()
  records = []
  for number, raw in enumerate(lines, 1):
    if not raw.strip():
      continue
    try:
      record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
      if number == len(lines) and not isinstance(e, RecursionError):
        logging.warning("%s:%d: the last record is incomplete (its write was cut short): left out", path, number)
        break
      if isinstance(e, UnicodeDecodeError):
        why = f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"
      else:
        why = f"not a JSON record ({e.msg if isinstance(e, json.JSONDecodeError) else 'nested too deeply'})"
      raise MetricsFileError(f"{path}:{number}: {why}") from None
    step = record.get("step") if isinstance(record, dict) else None
    if type(step) is not int:
      raise MetricsFileError(f"{path}:{number}: not a sparsejax metrics record (no integer \"step\"); is this "
                             "work directory another program's?")
    records.append(record)
  return records


class MetricWriter:
  """Appends records to metrics.jsonl, and their curves to TensorBoard.

  Args:
    workdir: the run's work directory.
    tensorboard: also write TensorBoard events to ``WORKDIR/tensorboard`` (needs tensorboardX).
    resume_step: the step the run continues from; later records are dropped.
  """

  def __init__(self, workdir: str, tensorboard: bool = False, resume_step: int = 0):
    self.path = os.path.join(workdir, METRICS_FILE)
    kept = [r for r in read_records(workdir) if r["step"] <= resume_step]
    if os.path.exists(self.path):
      tmp = self.path + ".tmp"
      with seals.writing(self.path, tmp):
        with open(tmp, "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
    self.tb = None
    if tensorboard:
      try:
        import tensorboardX.proto.summary_pb2  # deferred: optional (pip install tensorboardX), for --tensorboard only
      except ImportError:
        logging.warning("--tensorboard needs tensorboardX (pip install tensorboardX): not writing events")
      else:
        # purge_step: TensorBoard hides events at and after it from earlier (crashed) sessions. The suffix: the
        # file is named by the second it was opened, and a session that opened it in the same second as the last
        # one (a quick restart) overwrote that session's events.
        self.tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1,
                                             filename_suffix=f".{time.time_ns()}")
        self._summary = tensorboardX.proto.summary_pb2.Summary  # the proto, for write()

  def write(self, record: dict, curves: Iterable[str] | None = None) -> None:
    """Appends ``record`` (it must hold ``step``), adding to it (in place: what a run returns is what it wrote)
    ``peak_rss_mb``: this process's peak resident memory since the record before
    (:func:`sparsejax.memory.peak_resident_mb`), where the record does not give its own.

    Args:
      record: JSON-ready values.
      curves: the keys drawn in TensorBoard (default: every number but ``step``).
    """
    peak = memory.peak_resident_mb()
    if peak is not None and "peak_rss_mb" not in record:
      record["peak_rss_mb"] = peak
    with seals.writing(self.path), open(self.path, "a") as f:  # a partial last line is dropped when read
      f.write(json.dumps(record) + "\n")
    if self.tb is None:
      return
    keys = [k for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"]
    if curves is not None:
      keys = [k for k in keys if k in set(curves)]
    # The Summary proto directly: add_scalar would rename tags such as "p@1" (with a warning each time).
    summary = self._summary(value=[self._summary.Value(tag=k, simple_value=float(record[k])) for k in keys])
    self.tb._get_file_writer().add_summary(summary, record["step"])  # noqa: SLF001
    self.tb.flush()

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


def append_record(workdir: str, record: dict) -> None:
  """Appends ``record`` to ``WORKDIR/metrics.jsonl`` (the recipe search's records, written between runs)."""
  if jax.process_index() == 0:
    path = os.path.join(workdir, METRICS_FILE)
    with seals.writing(path), open(path, "a") as f:
      f.write(json.dumps(record) + "\n")
