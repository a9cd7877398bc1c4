"""Link rates as ``tc`` writes them: a number followed by ``bit``, ``kbit``, ``mbit``, ``gbit`` or ``tbit`` (powers
of 1000, case-insensitive), or a bare number of bit/s. ``mbps`` and the like are refused: in tc they mean bytes
per second, which is exactly the ambiguity to avoid. Read by the settings (``--link_capacity``) and by
:mod:`sparsejax.netanalysis`, which the training path does not import.
"""

import math
import re

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_rate(text: str | float | int) -> float:
  """A rate in bit/s from ``"1gbit"``, ``"100Mbit"``, ``"2.5e9"`` or a number.

  Raises:
    ValueError: not a positive finite rate, or a unit other than bit/kbit/mbit/gbit/tbit.
  """
  if isinstance(text, (int, float)):
    value = float(text)
  else:
    m = _RATE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in _RATE_UNITS):
      raise ValueError(f"rate {text!r}: write a number of bit/s with one of the units "
                       f"{', '.join(_RATE_UNITS)} (powers of 1000), e.g. 1gbit or 100mbit")
    value = float(m.group(1)) * _RATE_UNITS[unit or "bit"]
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"rate {text!r} must be a positive, finite number of bit/s")
  return value


def format_rate(bps: float) -> str:
  """``1e9 -> "1gbit"``, ``2.5e8 -> "250mbit"``: the shortest tc-style spelling."""
  for unit, scale in sorted(_RATE_UNITS.items(), key=lambda kv: -kv[1]):
    if bps >= scale and abs(bps / scale - round(bps / scale, 3)) < 1e-9:
      return f"{round(bps / scale, 3):g}{unit}"
  return f"{bps:g}bit"
