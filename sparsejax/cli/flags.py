"""The commands' shared command line: every :class:`sparsejax.config.Config` setting as an absl flag, a command's
own flags, ``--help``, parsing and validation, and the one-line errors and warnings of ``sparsejax-train``,
``sparsejax-predict`` and ``sparsejax-plot``.

Each setting's flag has the setting's name and its documentation as ``--help``
(listed by section, with choices and defaults). An invalid value ends the
command with exit status 2 and one line naming the flag, before anything is
loaded.
"""

import dataclasses
import json
import os
import re
import signal
import sys
import textwrap
import typing
from typing import NamedTuple

from absl import app, flags

from sparsejax import flagfiles, platforms, rundirs
from sparsejax.config import Config
from sparsejax.settings import ConfigError, field_type, format_value, iter_fields, override
from sparsejax.train import compilation_cache

FLAGS = flags.FLAGS
USAGE_ERROR = 2


class Flag(NamedTuple):
  """A command's own flag (not a setting): name, default (its type gives the flag's) and help."""
  name: str
  default: typing.Any
  help: str
  kind: type = str


COMPILATION_CACHE = Flag(
    "compilation_cache", compilation_cache.AUTO,
    "Where JAX keeps the programs it compiles, so that the next run of the same shapes starts without compiling: "
    "auto ($JAX_COMPILATION_CACHE_DIR where it is set, else a private per-user directory, "
    "$XDG_CACHE_HOME/sparsejax/jax or ~/.cache/sparsejax/jax, one subdirectory per CPU model), a directory, or none "
    "(compile every time). A directory that cannot be written is named in a warning and not used.")


class Command(NamedTuple):
  """A command: its usage text and its own flags (``settings``: the config's flags too)."""
  usage: str
  flags: tuple[Flag, ...]
  settings: bool = False
  positional: tuple[str, ...] = ()


class _SettingParser(flags.ArgumentParser):
  """Parses a setting's flag value by the field's type; ``none`` where the field allows None."""

  def __init__(self, field: dataclasses.Field):
    self.field = field
    self.base, self.optional = field_type(field)
    self.is_list = typing.get_origin(self.base) is tuple

  def parse(self, argument):
    if not isinstance(argument, str):  # a default or a programmatic value
      return argument
    text = argument.strip()
    if text.lower() == "none":
      if not self.optional:
        raise ValueError("cannot be none")
      return None
    if self.is_list:
      try:
        return tuple(_to_int(x) for x in text.split(",") if x.strip())
      except ValueError:
        raise ValueError("must be a comma-separated list of integers") from None
    if self.base is int:
      return _to_int(text)
    if self.base is float:
      try:
        return float(text)
      except ValueError:
        raise ValueError("must be a number") from None
    return text

  def flag_type(self) -> str:
    kind = {int: "an integer", float: "a number", str: "a string"}.get(self.base, "a list of integers")
    return kind + (", or none" if self.optional else "")


def _to_int(text: str) -> int:
  """``"128"``, ``"100_000"`` and ``"1e6"`` (a whole number) are integers."""
  try:
    return int(text)
  except ValueError:
    pass
  try:
    value = float(text)
  except ValueError:
    raise ValueError("must be an integer") from None
  if not value.is_integer():
    raise ValueError("must be an integer")
  return int(value)


class _SettingSerializer(flags.ArgumentSerializer):
  def serialize(self, value) -> str:
    return format_value(value)


def help_text(field: dataclasses.Field) -> str:
  """A setting's ``--help``: its documentation, then its allowed values."""
  meta = field.metadata
  text = meta["help"]
  if meta.get("bounds") is not None:
    text += f" Allowed: {meta['bounds']}{' or none' if field_type(field)[1] else ''}."
  return text


def define_config_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """One flag per setting of :class:`Config`, named after it (idempotent)."""
  defaults = Config()
  for section, field in iter_fields(Config):
    if field.name in flag_values:
      continue
    default = getattr(getattr(defaults, section), field.name)
    if field_type(field)[0] is bool:
      flags.DEFINE_boolean(field.name, default, help_text(field), flag_values=flag_values)
    elif field.metadata.get("choices"):
      flags.DEFINE_enum(field.name, default, field.metadata["choices"], help_text(field), flag_values=flag_values)
    else:
      flags.DEFINE(_SettingParser(field), field.name, default, help_text(field), flag_values=flag_values,
                   serializer=_SettingSerializer())


def define_flags(command: Command, flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags of ``command`` (idempotent)."""
  if command.settings:
    define_config_flags(flag_values)
  for flag in command.flags:
    if flag.name in flag_values:
      continue
    define = flags.DEFINE_integer if flag.kind is int else flags.DEFINE_string
    define(flag.name, flag.default, flag.help, flag_values=flag_values)


def config_from_flags(flag_values: flags.FlagValues = FLAGS) -> Config:
  """The config the command line describes: ``--config``'s file (or the defaults), then the flags given."""
  base = Config()
  if "config" in flag_values and flag_values["config"].value:
    path = flag_values["config"].value
    try:
      with open(path, encoding="utf-8") as f:
        base = Config.from_dict(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError("config", path, f"cannot read it: {e}") from None
    except UnicodeDecodeError as e:
      raise ConfigError("config", path, f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): not a "
                        "config.json that a run wrote") from None
    except RecursionError:
      raise ConfigError("config", path, "JSON nested too deeply: not a config.json that a run wrote") from None
    except ConfigError as e:  # a setting in the file: named with the file
      raise ConfigError("config", path, e.reason if e.name == "config" else str(e)) from None
  given = {name: flag_values[name].value for _, field in iter_fields(Config)
           if (name := field.name) in flag_values and flag_values[name].present}
  return override(base, **given)


def usage_error(message: str) -> typing.NoReturn:
  """Ends the command with one line on stderr and exit status 2."""
  fail(f"{message} (--help lists the flags)", USAGE_ERROR)


def fail(message: str, status: int = 1) -> typing.NoReturn:
  """Ends the command with one line on stderr."""
  sys.stderr.write(f"{_program()}: error: {message}\n")
  sys.exit(status)


def fail_now(message: str, status: int = 1) -> typing.NoReturn:
  """:func:`fail` without the interpreter's shutdown, for when other threads are still at work and nothing is
  left to save: their errors at shutdown (or a crash under them) would bury the line."""
  sys.stderr.write(f"{_program()}: error: {message}\n")
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def run_command(command_main: typing.Callable[[list[str]], None], command: Command) -> None:
  """Runs an absl main; a Ctrl-C before the command handles it (while JAX imports, say) ends it with one line, and
  a closed stdout ends it without a traceback."""
  define_flags(command)
  try:
    app.run(command_main, flags_parser=_parser(command))
  except KeyboardInterrupt:
    fail("interrupted by SIGINT", 128 + signal.SIGINT)
  except BrokenPipeError:  # stdout's reader went away (`sparsejax-predict ... | head`): stop quietly, as Unix tools do
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit raises it again
    sys.exit(128 + signal.SIGPIPE)


def _program() -> str:
  return os.path.basename(sys.argv[0]) if sys.argv else "sparsejax"


def print_help(command: Command, flag_values: flags.FlagValues = FLAGS) -> None:
  """The usage, then the flags: the settings by section (documentation, allowed values, default), then the rest."""
  out = [command.usage]
  if command.settings:
    sections: dict[str, list[str]] = {}
    for section, field in iter_fields(Config):
      choices = field.metadata.get("choices")
      value = f"=<{'|'.join(choices)}>" if choices else ""
      default = format_value(getattr(getattr(Config(), section), field.name))
      sections.setdefault(section, []).append(_flag_help(f"--{field.name}{value}  (default: {default})",
                                                         help_text(field)))
    for section, lines in sections.items():
      out += [f"{section}: {Config.__dataclass_fields__[section].type.__doc__.strip()}", *lines, ""]
    out.append("work directory and processes:")
  else:
    out.append("flags:")
  out += [_flag_help(f"--{f.name}  (default: {format_value(f.default)})", f.help) for f in command.flags]
  out += ["", "--flagfile=FILE reads flags from a file; --helpfull also lists absl's own flags."]
  try:
    print("\n".join(out))
  except BrokenPipeError:  # e.g. piped into head
    pass


def _flag_help(heading: str, text: str) -> str:
  return "\n".join(["  " + heading, *textwrap.wrap(text, width=100, initial_indent="      ",
                                                   subsequent_indent="      ")])


def parse_flags(argv: list[str], flag_values: flags.FlagValues, command: Command) -> list[str]:
  """absl ``flags_parser``: parses and validates, or exits 2 with one line naming the flag.

  Everything is checked here, before ``main`` runs (so before any data is loaded).
  """
  if any(arg in ("--help", "-h", "-help", "--helpshort", "-?") for arg in argv[1:]):
    print_help(command, flag_values)
    sys.exit(0)
  try:
    rest = flag_values(argv)
  except UnicodeDecodeError as e:  # absl reads flagfiles as text and names none
    path, error = flagfiles.undecodable(argv[1:]) or ("?", e)
    usage_error(f"--flagfile={path}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {error.start})")
  except flags.Error as e:
    message = str(e).strip().splitlines()[0].removeprefix("flag ")
    if message.startswith("ERROR:: Unable to open flagfile: "):  # absl's wording
      message = "--flagfile: cannot open it: " + message.removeprefix("ERROR:: Unable to open flagfile: ")
    usage_error(_with_flagfile_origin(argv, message))
  if len(rest) - 1 > len(command.positional):
    usage_error(f"unexpected argument {rest[1 + len(command.positional)]!r} (flags are written --name=value)")
  if len(rest) - 1 < len(command.positional):
    missing = " ".join(command.positional)
    if "WORKDIR" in command.positional:  # runs go to new directories: say which is the newest
      missing += ": the work directory of a trained run" + rundirs.newest_run_hint()
    usage_error(f"give {missing}")
  if command.settings:
    try:
      config_from_flags(flag_values).validate()
    except ConfigError as e:
      message = _with_flagfile_origin(argv, str(e))
      if (message == str(e) and e.name in flag_values and not flag_values[e.name].present
          and "config" in flag_values and flag_values["config"].value):  # from --config's file
        message += f" (set in {flag_values['config'].value})"
      usage_error(message)
  return rest


_FLAG_NAME = re.compile(r"^Unknown command line flag '([\w-]+)'|^--?([\w-]+)")


def _with_flagfile_origin(argv: list[str], message: str) -> str:
  """``message`` with `` (set in FILE, line N)`` where the flag it names was set by a ``--flagfile``.

  absl's errors name the flag but not the file it came from. The setting that counts is the last one, in the
  order absl reads them (a flagfile's lines where the ``--flagfile`` stands, nested files included); an unknown
  flag is named where it first appears, its origin right after its name (before absl's "Did you mean").
  """
  match = _FLAG_NAME.match(message)
  if not match:
    return message
  name = match.group(1) or match.group(2)
  unknown = match.group(1) is not None
  found = None
  for origin, arg in flagfiles.expand(argv[1:]):
    if re.match(rf"^--?(no)?{re.escape(name)}(=|$)", arg):
      found = origin
      if unknown:
        break
  if not found:
    return message
  where = f" (set in {found[0]}, line {found[1]})"
  return message[:match.end()] + where + message[match.end():] if unknown else message + where


def _parser(command: Command):
  return lambda argv: parse_flags(argv, FLAGS, command)


def warn(message: str) -> None:
  """One line on stderr that says what went wrong and what the command does instead."""
  sys.stderr.write(f"{_program()}: warning: {message}\n")


def use_compilation_cache(setting: str) -> None:
  """``--compilation_cache=setting``: JAX's persistent cache on (by default) or off; call after importing jax, before
  it compiles."""
  _, problem = compilation_cache.configure(setting)
  if problem:
    warn(problem)


def check_platform(platform: str, model: str | None = None) -> None:
  """Ends the command (status 2) unless ``platform`` is one and can run a ``model`` network (None: any)."""
  problem = platforms.problem(platform, model)
  if problem is not None:
    usage_error(f"--platform={platform}: {problem}")
