"""Command line: every :class:`sparsejax.config.Config` setting as an absl flag; ``sparsejax-train/predict/plot``.

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
import warnings
from typing import NamedTuple

from absl import app, flags, logging

from sparsejax import flagfiles, model_kinds, platforms, rundirs
from sparsejax.config import Config, ConfigError, field_type, format_value, iter_fields, override
from sparsejax.train import allocator, compilation_cache, console, recipes

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


TRAIN = Command("""\
sparsejax-train: trains a SLIDE network (or its dense baseline) and reports P@k.

  sparsejax-train                                       # ICD-10-CM, built in, in a new ~/sparsejax/runs/...
  sparsejax-train --dataset=synthetic --synthetic_labels=200000 --workdir=/tmp/synth
  sparsejax-train --dataset=files --train_file=train.txt --test_file=test.txt --workdir=/tmp/xc
  sparsejax-train --model=dense --workdir=/tmp/dense    # the full-softmax baseline
  sparsejax-train --model=dense --platform=cuda         # ... on a GPU (pip install "jax[cuda12]")
  sparsejax-train --flagfile=run.flags                  # flags from a file, one --flag=value per line
  sparsejax-train --config=/tmp/synth/config.json       # a run's settings (flags given too override them)

Distributed (the output layer split over P processes):

  python -m sparsejax.distributed.launch -n 4 sparsejax-train --dataset=synthetic ...   # one machine
  sparsejax-train --coordinator_address=host0:1234 --num_processes=4 --process_id=$RANK ...

Without --workdir, each run gets a new work directory under $SPARSEJAX_RUNS
(default ~/sparsejax/runs), named by its start (UTC) and dataset, printed in
its first log line and its last line. The same command with --workdir=THAT_DIR
continues the run from its newest checkpoint (Ctrl-C or SIGTERM saves one
before stopping). An invalid flag ends the command with exit status 2 and one
line naming it, before any data is loaded.
""", (
    Flag("workdir", None, "Work directory: metrics, checkpoints, config.json, assets. A run continues from it. "
         "Default: a new directory per run, $SPARSEJAX_RUNS/<UTC start>-<dataset> (without $SPARSEJAX_RUNS: "
         "~/sparsejax/runs)."),
    Flag("config", None, "A config.json (e.g. WORKDIR/config.json of an earlier run) to start from; flags given on "
         "the command line override its settings."),
    Flag("coordinator_address", None, "host:port of process 0's coordinator (multi-process runs; the launcher "
         "sets it)."),
    Flag("num_processes", None, "Processes in the job (multi-process runs).", int),
    Flag("process_id", None, "This process's rank in [0, num_processes).", int),
    Flag("heartbeat_timeout_seconds", 20, "A peer silent this long ends the job.", int),
    Flag("platform", "cpu", "Where the network runs (sets JAX_PLATFORMS): cpu, or an accelerator (cuda, rocm) for "
         "--model=dense in one process: the full-softmax baseline on a GPU. SLIDE's kernels are CPU code."),
    Flag("initialization_timeout", 45, "Seconds to wait for every process to join the job; then each one ends, "
         "saying which rank it is and what it waited for.", int),
    COMPILATION_CACHE,
), settings=True)

PREDICT = Command("""\
sparsejax-predict: the top labels of each input sample, with their scores, from a trained work directory.

  sparsejax-predict --workdir=/tmp/synth --input=test.txt --top=5          # XC repository or svmlight file
  echo "type 2 diabetes with kidney complications" | sparsejax-predict --workdir=/tmp/icd10 --input=-

Writes one line per input sample: LABEL:SCORE pairs separated by tabs, best
first (LABEL is the label's name where the dataset has names, e.g. an ICD-10
code and its title, else its id; SCORE is the output layer's logit). A text
none of whose words the model knows is named in a warning on stderr.
""", (
    Flag("workdir", None, "Work directory of a trained run. Its selected checkpoint is used (the best on the "
         "validation split, the one its final evaluation reported), else its newest."),
    Flag("step", None, "Use the checkpoint of this step instead (one that the work directory kept).", int),
    Flag("input", None, "Input samples: a file, or - for stdin."),
    Flag("input_format", "auto", "auto (text if the model has a text vectorizer, e.g. ICD-10; else xc if the first "
         "line is an XC header, else svmlight), xc (Extreme Classification Repository file with its header line), "
         "svmlight (lines of 'labels id:value ...', no header) or text (one sample per line)."),
    Flag("top", 5, "Labels written per sample.", int),
    Flag("platform", "cpu", "Where the network runs (sets JAX_PLATFORMS): cpu, or an accelerator (cuda, rocm) for a "
         "model trained with --model=dense. SLIDE's kernels are CPU code."),
    Flag("k", 0, "0: exact, every label scored. K > 0: sampled (SLIDE models): each sample's K best candidates "
         "from the serving index (kept by the run, else built from the model's rows) are scored, as the run's "
         "sampled_p@k; faster where K is a small share of the labels.", int),
    Flag("output", "-", "Where to write the predictions (- for stdout)."),
    COMPILATION_CACHE,
))

PLOT = Command("""\
sparsejax-plot: learning curves of a run: training loss and P@k against steps and wall-clock time.

  sparsejax-plot /tmp/synth                     # writes /tmp/synth/curves.png
  sparsejax-plot /tmp/synth --output=run.png

P@k is the periodic evaluations' on the validation split (on the test set where
the run has none), with the final evaluation's test P@k marked at the step it
reports (the selected one).

Needs matplotlib (pip install matplotlib).
""", (
    Flag("output", None, "PNG to write (default: WORKDIR/curves.png)."),
), positional=("WORKDIR",))


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


def define_flags(command: Command = TRAIN, flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags of ``command`` (by default ``sparsejax-train``'s; idempotent)."""
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


def _run(command_main: typing.Callable[[list[str]], None], command: Command) -> None:
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


def print_help(command: Command = TRAIN, flag_values: flags.FlagValues = FLAGS) -> None:
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


def parse_flags(argv: list[str], flag_values: flags.FlagValues = FLAGS, command: Command = TRAIN) -> list[str]:
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


# --- sparsejax-train ---------------------------------------------------------------------


def print_final(final: dict, workdir: str | None = None) -> None:
  """The one summary line of a finished run (ending with its work directory, where given)."""
  print(console.final_line(final, workdir))


def warn(message: str) -> None:
  """One line on stderr that says what went wrong and what the command does instead."""
  sys.stderr.write(f"{_program()}: warning: {message}\n")


def _use_compilation_cache() -> None:
  """``--compilation_cache``: JAX's persistent cache on (by default) or off; call after importing jax, before it
  compiles."""
  _, problem = compilation_cache.configure(FLAGS.compilation_cache)
  if problem:
    warn(problem)


PLATFORMS = platforms.PLATFORMS


def _check_platform(platform: str, model: str | None = None) -> None:
  """Ends the command (status 2) unless ``platform`` is one and can run a ``model`` network (None: any)."""
  problem = platforms.problem(platform, model)
  if problem is not None:
    usage_error(f"--platform={platform}: {problem}")


def _first_device_kind(platform: str) -> str:
  """The kind of JAX's first device, ``JAX_PLATFORMS`` being ``platform``; ends the command (status 2) where JAX has
  none of it."""
  from sparsejax.distributed import sharding

  try:
    return sharding.first_device(platform).device_kind
  except RuntimeError as e:
    usage_error(f"--platform={platform}: {e}")


def train(argv: list[str]) -> None:
  """absl main of ``sparsejax-train``: joins the process group, trains, prints the final line."""
  del argv
  _check_platform(FLAGS.platform)
  if FLAGS.platform != "cpu" and (FLAGS.coordinator_address or (FLAGS.num_processes or 1) > 1):
    usage_error(f"--platform={FLAGS.platform} runs in one process (the baseline on one device); several processes "
                "train on CPUs")
  # Set, not defaulted: the flag says where the run goes (on CPU, JAX does not probe for accelerators either).
  os.environ["JAX_PLATFORMS"] = FLAGS.platform
  import jax

  _use_compilation_cache()
  from sparsejax.data import XCFormatError
  from sparsejax.distributed import sharding  # imported here: creating a JAX backend must wait for the flags
  from sparsejax.train import train_and_evaluate
  from sparsejax.train.metric_writer import MetricsFileError
  from sparsejax.train.nonfinite import NonFiniteError
  from sparsejax.train.stopping import Interrupted, raise_on_signals
  from sparsejax.workdir import checkpoint
  from sparsejax.workdir.seals import IntegrityError, WriteError

  try:
    sharding.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                        heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_seconds,
                        initialization_timeout=FLAGS.initialization_timeout)
  except ValueError as e:  # a bad process count, rank or address
    usage_error(str(e))
  config = config_from_flags()
  given = {field.name for _, field in iter_fields(Config) if field.name in FLAGS and FLAGS[field.name].present}
  try:
    config = recipes.with_given_settings(config, given)
  except ConfigError as e:
    usage_error(str(e))
  _check_platform(FLAGS.platform, config.network.model)
  device = _first_device_kind(FLAGS.platform)
  workdir, new_run = _workdir(config, jax.process_count())
  continuing = (f"add --workdir={workdir} to the command to continue" if new_run
                else "run the same command again to continue")
  logging.info("work directory: %s%s", workdir, f" (a new run: {continuing})" if new_run else "")
  logging.info("platform: %s (%s)", FLAGS.platform, device)
  console.log_settings(config)
  try:
    raise_on_signals()
    print_final(train_and_evaluate(config, workdir), workdir)
  except KeyboardInterrupt as e:  # outside the training loop, or a second Ctrl-C within it
    signum = _launcher_stop_signal(getattr(e, "signum", signal.SIGINT))
    _remove_if_empty(workdir, new_run)
    # XLA's threads may still be compiling (Ctrl-C during start-up): tearing Python down under them crashed.
    continues = f"the same command with --workdir={workdir} continues" if new_run else "the same command continues"
    fail_now(f"interrupted by {signal.Signals(signum).name}: nothing more was saved. The checkpoints already in "
             f"{workdir} are kept; {continues} from the newest", 128 + signum)
  except XCFormatError as e:  # names the file and line
    _remove_if_empty(workdir, new_run)
    fail(str(e))
  except ConfigError as e:
    _remove_if_empty(workdir, new_run)
    usage_error(str(e))
  except checkpoint.ResumeError as e:
    fail(str(e), USAGE_ERROR)
  except WriteError as e:  # a checkpoint or other file (a full disk): orbax's threads would print pages at shutdown
    fail_now(str(e))
  except (NonFiniteError, MetricsFileError, IntegrityError) as e:  # IntegrityError: a changed best state
    fail(str(e))
  except Interrupted as e:
    signum = _launcher_stop_signal(e.signum)
    # Several processes: exit 0, as every rank does after the same stop (the launcher's contract).
    fail(e.describe(signal.Signals(signum).name, continuing), 0 if jax.process_count() > 1 else 128 + signum)


def _workdir(config: Config, process_count: int) -> tuple[str, bool]:
  """``(work directory, whether it is a new one made for this run)``: ``--workdir``, else the one sparsejax-launch
  chose for its ranks, else a new one under :func:`sparsejax.rundirs.runs_base` (one process)."""
  if FLAGS.workdir:
    return FLAGS.workdir, False
  launched = os.environ.get(rundirs.LAUNCH_WORKDIR_ENV)
  if launched:
    return launched, True
  if process_count > 1:  # each rank would make its own
    usage_error("a job of several processes needs --workdir: one directory that every rank writes to (sparsejax-launch "
                "picks a new one for its ranks where the command gives none)")
  try:
    return rundirs.new_run_directory(config.data.dataset), True
  except OSError as e:
    usage_error(f"cannot make a work directory under {rundirs.runs_base()} ({e.strerror or e}): give --workdir, or "
                f"set {rundirs.RUNS_ENV} to a directory where runs may go")


def _remove_if_empty(workdir: str, new_run: bool) -> None:
  """A new run's directory, when the run stopped before writing anything: not left behind, empty."""
  if new_run:
    try:
      os.rmdir(workdir)
    except OSError:  # not empty (or gone): kept
      pass


def _launcher_stop_signal(signum: int) -> int:
  """The signal a stop came from: the one sparsejax-launch received (Ctrl-C: SIGINT) where it passed it on to this
  rank as SIGTERM (the preemption notice that every rank answers at the same step), else ``signum``."""
  path = os.environ.get(rundirs.LAUNCH_STOP_FILE_ENV)
  if signum != signal.SIGTERM or not path:
    return signum
  try:
    with open(path) as f:
      return int(signal.Signals[f.read().strip()])
  except (OSError, KeyError):  # no stop request of the launcher's (a signal sent to the ranks themselves)
    return signum


def main() -> None:
  """``sparsejax-train``."""
  allocator.adopt()
  _run(train, TRAIN)


# --- sparsejax-predict ----------------------------------------------------------------


def read_inputs(path: str, input_format: str, model):
  """The samples of ``path`` (``-``: stdin) as ``model.predict`` takes them."""
  if input_format == "auto" and model.text_input:
    input_format = "text"
  if path == "-" and input_format != "text":
    return _read_stdin_as_file(input_format, model)
  if input_format == "auto":
    input_format = _sniff(path)
  if input_format == "text":
    with (sys.stdin if path == "-" else open(path)) as f:
      return [line.rstrip("\n") for line in f]
  if input_format == "xc":
    from sparsejax.data import load_xc_file

    data = load_xc_file(path)
    if data.num_features != model.num_features:
      raise ValueError(f"{path}: header has {data.num_features} features; the model reads {model.num_features}")
    return data
  from sklearn.datasets import load_svmlight_file

  try:
    x, _ = load_svmlight_file(path, n_features=model.num_features, multilabel=True, zero_based=True)
  except ValueError as e:
    where = _svmlight_id_out_of_range(path, model.num_features) or _not_an_xc_header(path)
    raise ValueError(where or f"{path}: not a svmlight file with feature ids in [0, {model.num_features}): {e}") \
        from None
  import numpy as np

  from sparsejax.data.xc_format import FLOAT32_OVERFLOW

  if not (np.abs(x.data) < FLOAT32_OVERFLOW).all():  # scikit-learn reads nan, inf and 1e39; a row of them scored NaN
    raise ValueError(_svmlight_value_not_finite(path) or f"{path}: a feature value is not finite in float32")
  return x


def _open_svmlight(path: str) -> typing.TextIO:
  """``path`` as text, decompressed as scikit-learn's svmlight reader decompresses it (by the name's ending)."""
  if path.endswith((".gz", ".bz2")):
    import bz2
    import gzip

    return (gzip if path.endswith(".gz") else bz2).open(path, "rt", errors="replace")
  return open(path, errors="replace")


def _not_an_xc_header(path: str) -> str | None:
  """``FILE:1: ...`` where the first line looks like a malformed XC header (numbers, no ``id:value`` pair), which the
  format sniffer then took for svmlight (scikit-learn's error said "need more than 1 value to unpack")."""
  with _open_svmlight(path) as f:
    tokens = f.readline().removeprefix("\ufeff").split("#", 1)[0].split()
  if len(tokens) < 2 or any(":" in t for t in tokens) or not tokens[0].isdigit():
    return None
  return (f"{path}:1: {' '.join(tokens)[:80]!r} is neither an XC header (three integers: samples, features, labels) "
          "nor a svmlight row (labels, then id:value pairs)")


def _svmlight_value_not_finite(path: str) -> str | None:
  """``FILE:LINE: ...`` of the first feature value that is not finite in float32 (NaN, inf, 1e39), as the XC reader
  words it."""
  import math

  import numpy as np

  from sparsejax.data.xc_format import FLOAT32_MAX, FLOAT32_OVERFLOW

  with _open_svmlight(path) as f:
    for number, line in enumerate(f, 1):
      for item in line.split("#", 1)[0].split():
        name, sep, text = item.partition(":")
        if not sep or name == "qid":
          continue
        try:
          value = float(text)
        except ValueError:  # a form scikit-learn reads and float() does not (hex): named without its line
          continue
        if not math.isfinite(value):
          return f"{path}:{number}: non-finite feature value in {item!r}"
        if abs(value) >= FLOAT32_OVERFLOW:
          largest = np.float32(FLOAT32_MAX)
          return f"{path}:{number}: feature value in {item!r} overflows float32 (its largest is {largest!s})"
  return None


def _svmlight_id_out_of_range(path: str, num_features: int) -> str | None:
  """``FILE:LINE: ...`` of the first feature id outside ``[0, num_features)`` (scikit-learn names no line)."""
  with _open_svmlight(path) as f:
    for number, line in enumerate(f, 1):
      for item in line.split("#", 1)[0].split()[1:]:
        name, sep, _ = item.partition(":")
        if sep and name.lstrip("-").isdigit() and not 0 <= int(name) < num_features:
          return f"{path}:{number}: feature id {name} out of range: the model reads ids in [0, {num_features})"
  return None


def _read_stdin_as_file(input_format: str, model):
  """Feature rows (xc, svmlight) from stdin: their readers take files, so stdin is copied to one first."""
  import shutil
  import tempfile

  with tempfile.NamedTemporaryFile(prefix="sparsejax-stdin-") as f:
    shutil.copyfileobj(sys.stdin.buffer, f)
    f.flush()
    try:
      return read_inputs(f.name, input_format, model)
    except ValueError as e:  # name what the user gave, not the copy
      raise ValueError(str(e).replace(f.name, "<stdin>")) from None


def _sniff(path: str) -> str:
  """``xc`` if the file starts with an XC header line (three integers), else ``svmlight``."""
  from sparsejax.data.xc_format import UTF8_BOM, open_bytes

  with open_bytes(path) as f:  # gzipped or not, with or without a byte-order mark, as the XC reader takes it
    first = f.readline().removeprefix(UTF8_BOM).split()
  return "xc" if len(first) == 3 and all(t.isdigit() for t in first) else "svmlight"


def predict(argv: list[str]) -> None:
  """absl main of ``sparsejax-predict``."""
  del argv
  _check_platform(FLAGS.platform)  # the model's kind is checked as it loads
  # Set, not defaulted, as sparsejax-train sets it: SLIDE's kernels are CPU code, whatever JAX_PLATFORMS says.
  os.environ["JAX_PLATFORMS"] = FLAGS.platform
  from sparsejax.platforms import PlatformError, PlatformUnavailable
  from sparsejax.serving.model import UnknownWordsWarning, load
  from sparsejax.workdir.checkpoint import quiet_orbax_logs

  quiet_orbax_logs()  # stdout is the predictions; stderr only says what went wrong

  if not FLAGS.workdir:
    usage_error("give --workdir: the work directory of a trained run" + rundirs.newest_run_hint())
  if not FLAGS.input:
    usage_error("give --input: a file of input samples, or - for stdin")
  if FLAGS.input_format not in ("auto", "xc", "svmlight", "text"):
    usage_error(f"--input_format={FLAGS.input_format}: must be one of auto, xc, svmlight, text")
  if FLAGS.top < 1:  # before the model loads (its upper bound, the model's labels, after)
    usage_error(f"--top={FLAGS.top}: must be >= 1")
  if FLAGS.k < 0 or 0 < FLAGS.k < FLAGS.top:
    usage_error(f"--k={FLAGS.k}: must be 0 (exact) or at least --top={FLAGS.top}")
  # Files first: a missing input or an unwritable output is named before the model loads and predicts.
  if FLAGS.input != "-" and not os.path.isfile(FLAGS.input):
    usage_error(f"--input={FLAGS.input}: {'is a directory' if os.path.isdir(FLAGS.input) else 'no such file'}")
  if FLAGS.output != "-":
    parent = os.path.dirname(os.path.abspath(FLAGS.output))
    if os.path.isdir(FLAGS.output) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
      usage_error(f"--output={FLAGS.output}: " + ("is a directory" if os.path.isdir(FLAGS.output) else
                                                  f"cannot write a file in {parent}"))
  _use_compilation_cache()  # before anything compiles
  try:
    model = load(FLAGS.workdir, FLAGS.step, FLAGS.platform)
    if not 1 <= FLAGS.top <= model.num_labels:
      usage_error(f"--top={FLAGS.top}: must be in [1, {model.num_labels}] (the model's labels)")
    if FLAGS.k > model.num_labels:
      usage_error(f"--k={FLAGS.k}: must be at most {model.num_labels} (the model's labels)")
    if FLAGS.k and not model_kinds.of(model.config).sampled:
      usage_error(f"--k={FLAGS.k}: sampled prediction needs a SLIDE model; this one was trained with "
                  f"--model={model.config.network.model}")
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", UnknownWordsWarning)
      scores, ids = model.predict(read_inputs(FLAGS.input, FLAGS.input_format, model), top=FLAGS.top,
                                  k=FLAGS.k or None)
  except (PlatformError, PlatformUnavailable) as e:  # a dense model only off the CPU; a device of it
    usage_error(f"--platform={e.platform}: {e.problem}")
  except (OSError, ValueError) as e:
    fail(str(e))
  for warning in caught:  # one line per input line whose words the model does not know
    if issubclass(warning.category, UnknownWordsWarning):
      warn(f"{FLAGS.input if FLAGS.input != '-' else '<stdin>'}:{warning.message.row + 1}: {warning.message}")
    else:
      warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
  names = model.names(ids)
  # Tabs between the pairs: a label's name may hold spaces (ICD-10: its code and title); splitting on whitespace
  # still works for names without them.
  lines = ("\t".join(f"{n}:{s:.5g}" for n, s in zip(row_names, row_scores)) + "\n"
           for row_names, row_scores in zip(names, scores))
  if FLAGS.output == "-":
    sys.stdout.writelines(lines)
    return
  try:
    with open(FLAGS.output, "w") as f:
      f.writelines(lines)
  except OSError as e:
    fail(f"--output={FLAGS.output}: {e.strerror or e}")


def predict_main() -> None:
  """``sparsejax-predict``."""
  allocator.adopt()
  _run(predict, PREDICT)


# --- sparsejax-plot -------------------------------------------------------------------------


def plot(argv: list[str]) -> None:
  """absl main of ``sparsejax-plot``."""
  from sparsejax.train import plot as plotting

  workdir = argv[1]
  try:
    path = plotting.plot_run(workdir, FLAGS.output or os.path.join(workdir, "curves.png"))
  except (plotting.MissingMatplotlib, OSError, ValueError) as e:
    fail(str(e))
  print(path)


def plot_main() -> None:
  """``sparsejax-plot``."""
  _run(plot, PLOT)



if __name__ == "__main__":  # python -m sparsejax.train.cli: sparsejax-train
  main()
