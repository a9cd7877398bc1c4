"""Reading and writing netanalysis's files: atomic writes, and text rows and JSON values read with errors that say
where a bad value is.

Every reader raises :class:`ProfileError` whose message starts with where the problem is:
``PATH:LINE:`` for text files, ``PATH:LINE:COL:`` for invalid JSON and ``PATH: $.json.path:`` for a
bad value in valid JSON. Writers write a temporary file and rename it, so an interrupted writer never
leaves a broken file.
"""

import json
import math
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from sparsejax.netanalysis.units import ProfileError

# ---------------------------------------------------------------------------------------------------
# Writing: atomic, and checked beforehand.


def write_text_atomic(path: str, text: str) -> None:
  """Write ``text`` to ``path`` through a temporary file in the same directory and a rename.

  An interrupted writer leaves the previous file (or none), never a partial one. The file gets the
  usual permissions (0666 less the umask), not the temporary file's 0600.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def check_output_file(flag: str, path: str) -> None:
  """Raises ValueError where ``--flag=path`` cannot be written as a file (a directory, under a file, or in a
  directory this user cannot write), before anything is computed: the write failed at the end with a traceback."""
  if os.path.isdir(path):
    raise ValueError(f"--{flag}={path}: is a directory (give a file name)")
  existing = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(existing):  # missing directories are created
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f"--{flag}={path}: {existing} is not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"--{flag}={path}: cannot write in {existing}")


def write_json_atomic(path: str, obj: Any) -> None:
  """Write ``obj`` as JSON to ``path`` atomically (see :func:`write_text_atomic`); NaN and inf are refused."""
  write_text_atomic(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def write_checked(path: str, obj: dict, from_dict) -> None:
  """Write a schema document atomically, after checking that its reader accepts it."""
  from_dict(obj, file=f"{path} (being written)")
  write_json_atomic(path, obj)


# ---------------------------------------------------------------------------------------------------
# JSON: a reader that says where a bad value is.


def load_json(path: str) -> Any:
  """Parse a JSON file. Raises :class:`ProfileError` (``PATH:LINE:COL:`` for invalid JSON)."""
  text = read_text(path)
  try:
    return json.loads(text, parse_constant=_refuse_constant)
  except json.JSONDecodeError as e:
    raise ProfileError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
  except ValueError as e:
    raise ProfileError(f"{path}:1:1: invalid JSON: {e}") from None


def _refuse_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


class JsonValue:
  """A JSON value and its path (``$.steps[0].bytes``), with typed getters that raise ProfileError."""

  def __init__(self, file: str, value: Any, path: str = "$"):
    self.file, self.value, self.path = file, value, path

  def error(self, message: str) -> ProfileError:
    return ProfileError(f"{self.file}: {self.path}: {message}")

  def _child(self, key: str | int, value: Any) -> "JsonValue":
    path = f"{self.path}[{key}]" if isinstance(key, int) else f"{self.path}.{key}"
    return JsonValue(self.file, value, path)

  def obj(self, keys: Sequence[str], optional: Sequence[str] = ()) -> dict[str, "JsonValue"]:
    """The members of an object that must have ``keys`` and may have ``optional`` (nothing else)."""
    if not isinstance(self.value, dict):
      raise self.error(f"expected an object, got {_type_name(self.value)}")
    for key in keys:
      if key not in self.value:
        raise self.error(f"missing key {key!r}")
    for key in self.value:
      if key not in keys and key not in optional:
        raise self.error(f"unknown key {key!r} (expected {', '.join(list(keys) + list(optional))})")
    return {k: self._child(k, v) for k, v in self.value.items()}

  def items(self, min_len: int = 0) -> list["JsonValue"]:
    if not isinstance(self.value, list):
      raise self.error(f"expected a list, got {_type_name(self.value)}")
    if len(self.value) < min_len:
      raise self.error(f"expected at least {min_len} item(s), got {len(self.value)}")
    return [self._child(i, v) for i, v in enumerate(self.value)]

  def string(self, choices: Sequence[str] | None = None) -> str:
    if not isinstance(self.value, str):
      raise self.error(f"expected a string, got {_type_name(self.value)}")
    if choices is not None and self.value not in choices:
      raise self.error(f"expected one of {', '.join(choices)}, got {self.value!r}")
    return self.value

  def boolean(self) -> bool:
    if not isinstance(self.value, bool):
      raise self.error(f"expected true or false, got {_type_name(self.value)}")
    return self.value

  def integer(self, minimum: int | None = None, maximum: int | None = None) -> int:
    v = self.value
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
      raise self.error(f"expected a whole number, got {_type_name(v)} {v!r}")
    v = int(v)
    if minimum is not None and v < minimum:
      raise self.error(f"must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
      raise self.error(f"must be <= {maximum}, got {v}")
    return v

  def number(self, minimum: float | None = None, positive: bool = False) -> float:
    v = self.value
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      raise self.error(f"expected a finite number, got {_type_name(v)} {v!r}")
    if positive and v <= 0:
      raise self.error(f"must be > 0, got {v!r}")
    if minimum is not None and v < minimum:
      raise self.error(f"must be >= {minimum}, got {v!r}")
    return float(v)

  def optional(self, getter: str, **kwargs) -> Any:
    return None if self.value is None else getattr(self, getter)(**kwargs)


def _type_name(value: Any) -> str:
  return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
          int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def check_schema(doc: JsonValue, expected: str) -> None:
  """Raises :class:`ProfileError` unless ``doc`` is an object whose ``schema`` is ``expected``."""
  if not isinstance(doc.value, dict):
    raise doc.error(f"expected an object with \"schema\": \"{expected}\", got {_type_name(doc.value)}")
  if "schema" not in doc.value:
    raise doc.error(f"missing key 'schema' (expected \"{expected}\")")
  version = doc.value["schema"]
  if version != expected:
    raise JsonValue(doc.file, version, "$.schema").error(
        f"unsupported schema {version!r} (this version reads {expected!r})")


# ---------------------------------------------------------------------------------------------------
# Text files: lines and rows.


def read_text(path: str) -> str:
  """The file's text (UTF-8). Raises :class:`ProfileError` when it cannot be read."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ProfileError(f"{path}: cannot read: {e.strerror or e}") from None
  # Undecodable bytes become U+FFFD, so they fail as a bad field on their own line.
  return data.decode("utf-8", errors="replace")


def read_lines(path: str) -> list[str]:
  """The file's lines (CRLF accepted) without trailing blank lines. Raises ProfileError when empty."""
  lines = read_text(path).replace("\r\n", "\n").replace("\r", "\n").split("\n")
  while lines and not lines[-1].strip():
    lines.pop()
  if not lines:
    raise ProfileError(f"{path}:1: empty file")
  return lines


def two_fields(path: str, lineno: int, line: str, what: str) -> tuple[str, str]:
  """The two comma-separated fields of row ``lineno`` (``what`` names them in the error), stripped."""
  fields = line.split(",")
  if len(fields) != 2:
    got = "an empty line" if not line.strip() else f"{len(fields)} field(s): {line.strip()[:60]!r}"
    raise ProfileError(f"{path}:{lineno}: expected a row '{what}' (2 comma-separated fields), got {got}")
  return fields[0].strip(), fields[1].strip()


def number_field(path: str, lineno: int, text: str, name: str) -> float:
  """The field ``text`` (``name``) of row ``lineno`` as a finite number >= 0."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or value < 0:
    raise ProfileError(f"{path}:{lineno}: {name} must be a finite number >= 0, got {text!r}")
  return value
