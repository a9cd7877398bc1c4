"""Typed, checked settings as dataclass fields: the machinery that :mod:`sparsejax.config` builds its sections of.

A setting is a field made by :func:`option` (its default, its ``--help`` text, its choices or bounds, whether it is
part of what a run *is*); a section is a frozen dataclass of such fields deriving from :class:`Section`, whose
``validate`` checks each value (type, bounds, finiteness, choices, 32-bit limits) and then their combinations,
raising a :class:`ConfigError` that names the setting as its flag. :func:`override` changes settings of a sectioned
config by their unique names, :func:`from_dict` reads one back from JSON and :func:`non_default_settings`
says which differ from the defaults. Free of JAX.
"""

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from absl.flags import _helpers


class ConfigError(ValueError):
  """An invalid setting; ``str()`` names it as its flag: ``--name=value: reason``.

  Attributes:
    name: the field (and flag) name.
    value: the rejected value.
    reason: what a valid value looks like.
  """

  def __init__(self, name: str, value: Any, reason: str):
    self.name, self.value, self.reason = name, value, reason
    super().__init__(f"--{name}={format_value(value)}: {reason}")


def format_value(value: Any) -> str:
  """A value as it is written on the command line (``none``, ``128,64``, ``true``)."""
  if value is None:
    return "none"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, (tuple, list)):
    return ",".join(format_value(v) for v in value)
  return str(value)


@dataclasses.dataclass(frozen=True)
class Range:
  """Allowed numeric values: ``lo <(=) value <(=) hi`` (``None``: unbounded)."""
  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False
  hi_open: bool = False

  def __str__(self) -> str:
    lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
    hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi:g}"
    return " and ".join(s for s in (lo, hi) if s)

  def contains(self, value: float) -> bool:
    if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
      return False
    return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)


# Every setting's limits beyond its own bounds: counts, ids and seeds become JAX's 32-bit integers, and numbers
# float32s (a larger value overflowed in Python or numpy, or became inf, long after validation).
INT_LIMIT = 2**31 - 1
FLOAT_LIMIT = 3.4028234663852886e38  # float32's largest
POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, bounds: Range | None = None,
           identity: bool = True) -> Any:
  """A documented config field.

  Args:
    default: the default value (the one default of this setting).
    help: one or more sentences: what the setting does and what ``none``
      means where allowed. It is the flag's ``--help`` text.
    choices: the allowed strings (an enum).
    bounds: the allowed numbers (each element of a tuple, for tuples).
    identity: whether the setting is part of what a run *is* (changes what is
      trained). Settings that only say how long, how often or how verbosely
      (budgets, periods, logging) are not, and may change when a run resumes.
  """
  metadata = {"help": help, "choices": choices, "bounds": bounds, "identity": identity}
  if isinstance(default, (list, dict, set)):
    raise TypeError("use an immutable default (a tuple)")
  return dataclasses.field(default=default, metadata=metadata)


def section(cls) -> Any:
  """A field of a sectioned config holding section ``cls`` (its defaults)."""
  return dataclasses.field(default_factory=cls)


def is_section(field: dataclasses.Field) -> bool:
  return dataclasses.is_dataclass(field.type) if isinstance(field.type, type) else False


def field_type(field: dataclasses.Field) -> tuple[type, bool]:
  """``(base type, accepts None)`` of a field: ``(int, True)`` for ``int | None``."""
  t = field.type
  if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0], len(args) < len(typing.get_args(t))
  return t, False


def _check_field(field: dataclasses.Field, value: Any) -> None:
  """Raises a ConfigError unless ``value`` is valid for ``field`` on its own."""
  base, optional = field_type(field)
  meta = field.metadata
  if value is None:
    if not optional:
      raise ConfigError(field.name, value, "cannot be none")
    return
  if typing.get_origin(base) is tuple:
    items = value if isinstance(value, (tuple, list)) else None
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
      raise ConfigError(field.name, value, "must be a non-empty comma-separated list of integers")
    elements = items
  elif base is bool:
    if not isinstance(value, bool):
      raise ConfigError(field.name, value, "must be true or false")
    return
  elif base is int:
    if not isinstance(value, int) or isinstance(value, bool):
      raise ConfigError(field.name, value, "must be an integer")
    elements = (value,)
  elif base is float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
      raise ConfigError(field.name, value, "must be a number")
    if not math.isfinite(value):
      raise ConfigError(field.name, value, "must be a finite number")
    elements = (value,)
  else:
    if not isinstance(value, str):
      raise ConfigError(field.name, value, "must be a string")
    if meta.get("choices") and value not in meta["choices"]:
      raise ConfigError(field.name, value, f"must be one of {', '.join(meta['choices'])}")
    return
  bounds = meta.get("bounds")
  if bounds is not None and not all(bounds.contains(v) for v in elements):
    raise ConfigError(field.name, value, f"must be {bounds}{' or none' if optional else ''}")
  if base is float and any(abs(v) > FLOAT_LIMIT for v in elements):
    raise ConfigError(field.name, value, f"must be at most {FLOAT_LIMIT:.4g} in size (the computations are float32)")
  if base is not float and any(not -INT_LIMIT - 1 <= v <= INT_LIMIT for v in elements):
    raise ConfigError(field.name, value, f"must be at most {INT_LIMIT} (steps, sizes, ids and seeds are 32-bit "
                      "integers)")


class Section:
  """Base of the config sections: :meth:`validate` checks each field, then their combinations."""

  def __post_init__(self) -> None:
    # A list for a list setting (override(config, hidden_dims=[16])) is kept as a tuple, as from_dict keeps it: a
    # list left the model's static config unhashable, which failed deep inside jit at the first step.
    for field in dataclasses.fields(self):
      if isinstance(value := getattr(self, field.name), list):
        object.__setattr__(self, field.name, tuple(value))

  def validate(self) -> None:
    """Raises :class:`ConfigError` naming the first invalid setting."""
    for field in dataclasses.fields(self):
      _check_field(field, getattr(self, field.name))
    self.check_combinations()

  def check_combinations(self) -> None:
    """Checks that need several fields (after each field passed on its own)."""


def from_dict(cls, values: Mapping[str, Any], name: str = "config"):
  """``cls`` (a sectioned config or a section) from a JSON-ready mapping; missing fields keep their defaults,
  unknown ones raise a :class:`ConfigError`."""
  if not isinstance(values, Mapping):  # a JSON string or list: named, not a TypeError from deep inside
    raise ConfigError(name, values, f"must be an object of {cls.__name__}'s settings, got {type(values).__name__}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for name in values:
    if name not in fields:
      raise ConfigError(name, values[name], f"unknown setting of {cls.__name__}")
  kwargs = {}
  for name, value in values.items():
    field = fields[name]
    if is_section(field):
      kwargs[name] = from_dict(field.type, value, name)
    elif isinstance(value, list):
      kwargs[name] = tuple(value)
    else:
      kwargs[name] = value
  return cls(**kwargs)


def iter_fields(obj_or_cls: Any) -> list[tuple[str, dataclasses.Field]]:
  """``(section name, field)`` of every setting of a sectioned config, in order."""
  cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
  return [(s.name, f) for s in dataclasses.fields(cls) if is_section(s) for f in dataclasses.fields(s.type)]


def override(obj: Any, **changes: Any) -> Any:
  """A copy of a sectioned config with settings changed by their (unique) names.

  ``override(config, learning_rate=1e-2, dataset="synthetic")`` sets
  ``config.optim.learning_rate`` and ``config.data.dataset``. Works for
  :class:`Config` and :class:`sparsejax.model_config.ModelConfig` (whose own fields,
  such as ``num_labels``, may be given too).

  Raises:
    TypeError: for a name that is no setting.
  """
  own = {f.name for f in dataclasses.fields(obj)}
  direct = {k: v for k, v in changes.items() if k in own}
  by_section: dict[str, dict[str, Any]] = {}
  for name, value in changes.items():
    if name in own:
      continue
    section = next((s for s, f in iter_fields(obj) if f.name == name), None)
    if section is None:
      names = [f.name for _, f in iter_fields(obj)] + sorted(own)
      raise TypeError(f"{type(obj).__name__} has no setting {name!r}{did_you_mean(name, names)}")
    by_section.setdefault(section, {})[name] = value
  for section, values in by_section.items():
    direct[section] = dataclasses.replace(getattr(obj, section), **values)
  return dataclasses.replace(obj, **direct)


def did_you_mean(name: str, names: list[str]) -> str:
  """``". Did you mean: learning_rate ?"`` for a misspelt setting, worded and chosen as absl words and chooses them
  for an unknown flag on the command line; empty where no name is close."""
  suggestions = _helpers.get_flag_suggestions(name, names)  # absl's own, for the same mistake
  return f". Did you mean: {', '.join(suggestions)} ?" if suggestions else ""


def flat_items(config: Any) -> dict[str, Any]:
  """``{setting name: value}`` over all sections."""
  return {f.name: getattr(getattr(config, s), f.name) for s, f in iter_fields(config)}


def non_default_settings(config: Any) -> dict[str, Any]:
  """``{setting name: value}`` of the settings of a sectioned config that differ from its class's defaults."""
  defaults = flat_items(type(config)())
  return {name: value for name, value in flat_items(config).items() if value != defaults[name]}
