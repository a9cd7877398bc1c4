"""Command line of sparsejax.netanalysis: ``python -m sparsejax.netanalysis COMMAND [--flags]``.

Each command lives in its own module, which defines its absl flags in ``define_flags(command)`` and
runs in ``main(command, argv) -> int``; only the chosen command's flags are defined, so
``COMMAND --help`` lists its own. Input errors (:class:`ProfileError`, ``ValueError`` from flag values)
print ``error: <message>`` and exit with status 2, without a traceback. ``main`` can be called
several times in one process (tests): flags are defined once per command and reset before parsing.
"""

import importlib
import sys

from absl import flags

from sparsejax.netanalysis.file_io import check_output_file
from sparsejax.netanalysis.units import ProfileError

# command -> (module, one-line description)
COMMANDS = {
    "whatif": ("sparsejax.netanalysis.whatif_cli", "predict steps at other bandwidths, worker counts, compression"),
    "report": ("sparsejax.netanalysis.report_cli", "step breakdown and link utilisation of a profiled run"),
    "probe": ("sparsejax.netanalysis.probe", "measure collective bandwidth and latency between processes"),
    "export-bk": ("sparsejax.netanalysis.report_cli", "write a .bk.log backward profile from a dense run"),
}


_DEFINED: set[str] = set()  # commands whose flags are defined in this process


def _usage() -> str:
  lines = ["usage: python -m sparsejax.netanalysis COMMAND [--flags]   (COMMAND --help for its flags)", ""]
  lines += [f"  {name:<10} {desc}" for name, (_, desc) in COMMANDS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
    print(_usage())
    return 0 if len(argv) >= 2 else 2
  command = argv[1]
  if command not in COMMANDS:
    print(f"error: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2
  module = importlib.import_module(COMMANDS[command][0])
  if command not in _DEFINED:
    module.define_flags(command)
    _DEFINED.add(command)
  if any(arg in ("-h", "--help", "-help", "--helpfull") for arg in argv[2:]):
    print(f"usage: python -m sparsejax.netanalysis {command} [--flags]\n  {COMMANDS[command][1]}\n")
    print(flags.FLAGS.module_help(module.__name__))
    return 0
  flags.FLAGS.unparse_flags()
  try:
    rest = flags.FLAGS([f"{argv[0]} {command}"] + argv[2:])
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  try:
    for name in ("json", "trace"):  # files written at the end: checked before the work
      if name in flags.FLAGS and flags.FLAGS[name].value:
        check_output_file(name, flags.FLAGS[name].value)
    return int(module.main(command, rest) or 0)
  except (ProfileError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
