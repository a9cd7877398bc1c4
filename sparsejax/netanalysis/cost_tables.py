"""Measured costs of a local operation by size: ``bytes,seconds`` tables such as the paper's ``cuda_vec_add.log``
or the reduction cost that ``netanalysis probe`` measures, linearly interpolated."""

import bisect
import dataclasses
import math
from collections.abc import Sequence

from sparsejax.netanalysis.file_io import number_field, read_lines, two_fields, write_text_atomic
from sparsejax.netanalysis.units import ProfileError


@dataclasses.dataclass(frozen=True)
class CostTable:
  """A measured cost of a local operation by size (``bytes,seconds``), linearly interpolated.

  Attributes:
    sizes: bytes, strictly increasing (at least 2).
    seconds: seconds >= 0, one per size.
    path: where it came from (for messages; not part of equality).
  """
  sizes: tuple[float, ...]
  seconds: tuple[float, ...]
  path: str = dataclasses.field(default="", compare=False)

  def __call__(self, nbytes: float) -> float:
    """Seconds for ``nbytes``: linear between rows, the first/last row's time outside the table."""
    if nbytes <= self.sizes[0]:
      return self.seconds[0]
    if nbytes >= self.sizes[-1]:
      return self.seconds[-1]
    i = bisect.bisect_right(self.sizes, nbytes)
    x0, x1, y0, y1 = self.sizes[i - 1], self.sizes[i], self.seconds[i - 1], self.seconds[i]
    return y0 + (y1 - y0) * ((nbytes - x0) / (x1 - x0))

  def rows(self) -> list[list[float]]:
    return [[s, t] for s, t in zip(self.sizes, self.seconds)]


def cost_table(rows: Sequence[tuple[float, float]], where: Sequence[str] | None = None, path: str = "") -> CostTable:
  """Build a :class:`CostTable` from ``(bytes, seconds)`` rows, checking it.

  Args:
    rows: ``(bytes, seconds)`` pairs.
    where: one location prefix per row for messages (``PATH:LINE``); default ``PATH: $.reduce_cost[i]``.
    path: file the rows came from.

  Raises:
    ProfileError: fewer than 2 rows, sizes that do not increase, negative or non-finite values.
  """
  where = list(where) if where is not None else [f"{path}: $.reduce_cost[{i}]" for i in range(len(rows))]
  if len(rows) < 2:
    at = where[-1] if where else f"{path}:1"
    raise ProfileError(f"{at}: a bytes,seconds table needs at least 2 rows to interpolate, found {len(rows)}")
  for i, (size, seconds) in enumerate(rows):
    if not (math.isfinite(size) and size >= 0):
      raise ProfileError(f"{where[i]}: bytes must be a finite number >= 0, got {size!r}")
    if not (math.isfinite(seconds) and seconds >= 0):
      raise ProfileError(f"{where[i]}: seconds must be a finite number >= 0, got {seconds!r}")
    if i and size <= rows[i - 1][0]:
      raise ProfileError(f"{where[i]}: sizes must increase, got {size:g} bytes after {rows[i - 1][0]:g}")
  return CostTable(tuple(float(s) for s, _ in rows), tuple(float(t) for _, t in rows), path)


def read_cost_table(path: str) -> CostTable:
  """Read a ``bytes,seconds`` table such as ``cuda_vec_add.log`` (lines starting with ``#`` are comments).

  Raises:
    ProfileError: ``PATH:LINE: ...`` for a malformed row, fewer than 2 rows, sizes that do not
      increase or negative times.
  """
  rows, where = [], []
  for lineno, line in enumerate(read_lines(path), start=1):
    if line.lstrip().startswith("#"):
      continue
    size_text, seconds_text = two_fields(path, lineno, line, "bytes,seconds")
    rows.append((number_field(path, lineno, size_text, "bytes"), number_field(path, lineno, seconds_text, "seconds")))
    where.append(f"{path}:{lineno}")
  return cost_table(rows, where, path)


def write_cost_table(path: str, table: CostTable, comment: str = "") -> None:
  """Write ``table`` as ``bytes,seconds`` rows (the format of ``cuda_vec_add.log``), atomically."""
  lines = [f"# {line}" for line in comment.splitlines()]
  lines += [f"{s:.17g},{t:.17g}" for s, t in zip(table.sizes, table.seconds)]
  write_text_atomic(path, "\n".join(lines) + "\n")
