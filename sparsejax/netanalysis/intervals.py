"""Sets of time intervals: union, intersection, difference and length (seconds).

A set is a sorted list of disjoint ``(start, end)`` pairs with ``start < end``, as :func:`union`
returns; the other functions take and return such sets.
"""

from collections.abc import Iterable

Span = tuple[float, float]


def union(spans: Iterable[Span]) -> list[Span]:
  """The union of possibly overlapping ``(start, end)`` pairs as a sorted disjoint set (empty pairs dropped)."""
  out: list[Span] = []
  for start, end in sorted((a, b) for a, b in spans if b > a):
    if out and start <= out[-1][1]:
      if end > out[-1][1]:
        out[-1] = (out[-1][0], end)
    else:
      out.append((start, end))
  return out


def length(spans: list[Span]) -> float:
  """Total length of a disjoint set."""
  return sum(b - a for a, b in spans)


def intersect(x: list[Span], y: list[Span]) -> list[Span]:
  """``x ∩ y`` of two disjoint sets."""
  out, i, j = [], 0, 0
  while i < len(x) and j < len(y):
    start, end = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
    if start < end:
      out.append((start, end))
    if x[i][1] < y[j][1]:
      i += 1
    else:
      j += 1
  return out


def subtract(x: list[Span], y: list[Span]) -> list[Span]:
  """``x - y`` of two disjoint sets."""
  out, j = [], 0
  for start, end in x:
    while j < len(y) and y[j][1] <= start:
      j += 1
    k, cursor = j, start
    while k < len(y) and y[k][0] < end:
      if y[k][0] > cursor:
        out.append((cursor, y[k][0]))
      cursor = max(cursor, y[k][1])
      k += 1
    if cursor < end:
      out.append((cursor, end))
  return out


def clip(x: list[Span], start: float, end: float) -> list[Span]:
  """``x ∩ [start, end]``."""
  return intersect(x, [(start, end)]) if end > start else []
