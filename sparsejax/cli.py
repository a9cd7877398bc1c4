"""Command line: every :class:`sparsejax.config.Config` setting as an absl flag, and ``sparsejax-train``.

Each setting's flag has the setting's name and its documentation as ``--help``
(listed by section, with choices and defaults). An invalid value ends the
command with exit status 2 and one line naming the flag, before anything is
loaded.
"""

import dataclasses
import json
import sys
import textwrap
import typing

from absl import app, flags, logging

from sparsejax.config import Config, ConfigError, field_type, format_value, iter_fields, override

FLAGS = flags.FLAGS
USAGE_ERROR = 2

TRAIN_USAGE = """\
sparsejax-train: trains a SLIDE network (or its dense baseline) and reports P@k.

  sparsejax-train                                       # ICD-10-CM, built in
  sparsejax-train --dataset=synthetic --synthetic_labels=200000 --workdir=/tmp/synth
  sparsejax-train --dataset=files --train_file=train.txt --test_file=test.txt --workdir=/tmp/xc
  sparsejax-train --model=dense --workdir=/tmp/dense    # the full-softmax baseline
  sparsejax-train --flagfile=run.flags                  # flags from a file, one --flag=value per line
  sparsejax-train --config=/tmp/synth/config.json       # a run's settings (flags given too override them)

Distributed (the output layer split over P processes):

  python -m sparsejax.launch -n 4 sparsejax-train --dataset=synthetic ...   # one machine
  sparsejax-train --coordinator_address=host0:1234 --num_processes=4 --process_id=$RANK ...

An invalid flag ends the command with exit status 2 and one line naming it,
before any data is loaded.
"""

_RUN_FLAGS = (
    ("workdir", "/tmp/sparsejax", "Work directory: metrics, checkpoints, config.json. A run resumes from it."),
    ("config", None, "A config.json (e.g. WORKDIR/config.json of an earlier run) to start from; flags given on the "
     "command line override its settings."),
    ("coordinator_address", None, "host:port of process 0's coordinator (multi-process runs; sparsejax-launch "
     "sets it)."),
)
_PROCESS_FLAGS = (
    ("num_processes", None, "Processes in the job (multi-process runs)."),
    ("process_id", None, "This process's rank in [0, num_processes)."),
    ("heartbeat_timeout_seconds", 20, "A peer silent this long ends the job."),
)


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


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags of ``sparsejax-train``: the settings, the work directory and the process group (idempotent)."""
  define_config_flags(flag_values)
  for name, default, text in _RUN_FLAGS:
    if name not in flag_values:
      flags.DEFINE_string(name, default, text, flag_values=flag_values)
  for name, default, text in _PROCESS_FLAGS:
    if name not in flag_values:
      flags.DEFINE_integer(name, default, text, flag_values=flag_values)


def config_from_flags(flag_values: flags.FlagValues = FLAGS) -> Config:
  """The config the command line describes: ``--config``'s file (or the defaults), then the flags given."""
  base = Config()
  if "config" in flag_values and flag_values["config"].value:
    path = flag_values["config"].value
    try:
      with open(path) as f:
        base = Config.from_dict(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError("config", path, f"cannot read it: {e}") from None
  given = {name: flag_values[name].value for _, field in iter_fields(Config)
           if (name := field.name) in flag_values and flag_values[name].present}
  return override(base, **given)


def usage_error(message: str) -> typing.NoReturn:
  """Ends the command with one line on stderr and exit status 2."""
  sys.stderr.write(f"{_program()}: error: {message} (--help lists the flags)\n")
  sys.exit(USAGE_ERROR)


def _program() -> str:
  return sys.argv[0].rsplit("/", 1)[-1] if sys.argv else "sparsejax"


def print_help(flag_values: flags.FlagValues = FLAGS, usage: str = TRAIN_USAGE) -> None:
  """``usage``, then the flags: the settings by section (documentation, allowed values, default), then the rest."""
  out = [usage]
  sections: dict[str, list[str]] = {}
  for section, field in iter_fields(Config):
    if field.name in flag_values:
      choices = field.metadata.get("choices")
      value = f"=<{'|'.join(choices)}>" if choices else ""
      default = format_value(getattr(getattr(Config(), section), field.name))
      sections.setdefault(section, []).append(_flag_help(f"--{field.name}{value}  (default: {default})",
                                                         help_text(field)))
  for section, lines in sections.items():
    out += [f"{section}: {Config.__dataclass_fields__[section].type.__doc__.strip()}", *lines, ""]
  out.append("run directory and processes:")
  for name, default, text in _RUN_FLAGS + _PROCESS_FLAGS:
    if name in flag_values:
      out.append(_flag_help(f"--{name}  (default: {format_value(default)})", text))
  out += ["", "--flagfile=FILE reads flags from a file; --helpfull also lists absl's own flags."]
  try:
    print("\n".join(out))
  except BrokenPipeError:  # e.g. piped into head
    pass


def _flag_help(heading: str, text: str) -> str:
  return "\n".join(["  " + heading, *textwrap.wrap(text, width=100, initial_indent="      ",
                                                   subsequent_indent="      ")])


def parse_flags(argv: list[str], flag_values: flags.FlagValues = FLAGS) -> list[str]:
  """absl ``flags_parser``: parses and validates, or exits 2 with one line naming the flag.

  Everything is checked here, before ``main`` runs (so before any data is loaded).
  """
  if any(arg in ("--help", "-h", "-help", "--helpshort", "-?") for arg in argv[1:]):
    print_help(flag_values)
    sys.exit(0)
  try:
    rest = flag_values(argv)
  except flags.Error as e:
    usage_error(str(e).strip().splitlines()[0].removeprefix("flag "))
  if len(rest) > 1:
    usage_error(f"unexpected argument {rest[1]!r} (flags are written --name=value)")
  try:
    config_from_flags(flag_values).validate()
  except ConfigError as e:
    usage_error(str(e))
  return rest


def print_final(final: dict) -> None:
  """The one summary line of a finished run."""
  keys = ["p@1", "p@3", "p@5", "ndcg@5", "psp@5", "sampled_p@1", "sampled_p@5"]
  print(f"step {final['step']}  " + "  ".join(f"{k.upper()} {final[k]:.4f}" for k in keys if k in final)
        + f"  ({final['samples_per_sec']:,.0f} samples/s)")


def train(argv: list[str]) -> None:
  """absl main of ``sparsejax-train``: joins the process group, trains, prints the final line."""
  del argv
  from sparsejax import distributed  # imported here: creating a JAX backend must wait for the flags
  from sparsejax.train import train_and_evaluate

  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                         heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_seconds)
  config = config_from_flags()
  logging.info("config: %s", json.dumps(config.to_dict()))
  print_final(train_and_evaluate(config, FLAGS.workdir))


def main() -> None:
  """``sparsejax-train``."""
  define_flags()
  app.run(train, flags_parser=parse_flags)
