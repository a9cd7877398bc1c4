"""The README's examples (issue 33): every fenced code block is run or checked, so that an edit that breaks one
fails here.

Python blocks run, each on its own (standalone): the custom training loop here, the ``sparsejax.fit`` example in
test_fit.py, the serving examples here after a small run of the README's synthetic command. Shell blocks are
checked: every command is one this test knows, every script it names exists, and its flags parse with the
command's own parser (settings validated as the command validates them); the serving commands and the paper's
what-if analysis also run. The layout block is test_docs.py's.
"""

import contextlib
import copy
import importlib
import io
import os
import re
import shlex
import subprocess
import tomllib

import numpy as np
import pytest
from absl import flags

from sparsejax.cli import flags as cli_flags
from sparsejax.cli.plot import PLOT
from sparsejax.cli.predict import PREDICT
from sparsejax.cli.train import TRAIN
from sparsejax.distributed import launch
from sparsejax.netanalysis.__main__ import COMMANDS as NETANALYSIS_COMMANDS
from sparsejax.netanalysis.__main__ import main as netanalysis_main

# The scripts the README runs, and the command each one is (its flags).
SCRIPTS = {"examples/train.py": TRAIN}
# The installed commands and their flags.
COMMANDS = {"sparsejax-train": TRAIN, "sparsejax-predict": PREDICT, "sparsejax-plot": PLOT}
# Commands of the shell around sparsejax's (set-up and tests), run as written by those who copy them.
OTHER_COMMANDS = {".", "echo", "pytest"}
# Shell variables the README's commands take from the environment.
SHELL_ENV = {"HOME": "/home/user", "RANK": "0"}

# The README's synthetic run, at a size that trains in seconds: README text -> what this test runs instead.
SMALL_SYNTHETIC = {"--synthetic_labels=200000": "--synthetic_labels=2000",
                   "--synthetic_features=100000": "--synthetic_features=1000",
                   "--synthetic_samples=500000": "--synthetic_samples=3000", "--max_seconds=600": "--max_steps=30"}
# The data files the README's commands take from the user (made empty where the flags are checked), and the
# placeholders it writes for them.
USER_FILES = ("train.txt", "test.txt")
PLACEHOLDERS = {"--train_file=...": "--train_file=train.txt", "--test_file=...": "--test_file=test.txt"}
SYNTH = re.compile(r"/tmp/synth\b")  # that run's work directory in the README


def _blocks(root, language: str) -> list[str]:
  return [code for lang, code in _fenced_blocks(root) if lang == language]


def _fenced_blocks(root) -> list[tuple[str, str]]:
  """Every fenced code block of README.md, in order: (language, code)."""
  return re.findall(r"^```(\w*)\n(.*?)^```", (root / "README.md").read_text(), re.S | re.M)


def _shell_lines(root) -> list[str]:
  """The lines of the README's bash blocks, joined at their backslashes."""
  return [line for block in _blocks(root, "bash") for line in block.replace("\\\n", " ").splitlines()]


def _shell_commands(block: str) -> list[list[str]]:
  """A bash block's simple commands as argument lists, in order.

  Lines are joined at their backslashes, comments dropped, ``$VARS`` expanded (``NAME=value`` lines set them),
  lines split at ``&&``, ``||``, ``|`` and ``;``, and redirections dropped with their files.
  """
  env, commands = dict(SHELL_ENV), []
  for line in block.replace("\\\n", " ").splitlines():
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    command: list[str] = []
    tokens = iter(list(lexer) + [";"])
    for token in tokens:
      if token in ("&&", "||", "|", ";"):
        if len(command) == 1 and re.fullmatch(r"\w+=\S*", command[0]):  # an assignment
          name, value = command[0].split("=", 1)
          env[name] = value
        elif command:
          commands.append(command)
        command = []
      elif token in (">", ">>", "<", "2>"):
        next(tokens)
      else:
        command.append(re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], token))
  return commands


def _parse_problem(parse, *args) -> str | None:
  """What ``parse(*args)`` says on stderr where it ends the command with a non-zero status (else None)."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      parse(*args)
    except SystemExit as e:
      if e.code:
        return err.getvalue().strip() or f"exit status {e.code}"
  return None


def _absl_problem(command: cli_flags.Command, name: str, args: list[str]) -> str | None:
  """Whether ``args`` parse, and their settings validate, as ``command``'s (sparsejax-train's, ...) flags."""
  flag_values = flags.FlagValues()
  cli_flags.define_flags(command, flag_values)
  return _parse_problem(cli_flags.parse_flags, [name, *args], flag_values, command)


def _netanalysis_problem(args: list[str]) -> str | None:
  """Whether ``python -m sparsejax.netanalysis COMMAND ARGS`` names a command and flags it defines."""
  if not args or args[0] not in NETANALYSIS_COMMANDS:
    return f"no netanalysis command {args[:1]}"
  module = importlib.import_module(NETANALYSIS_COMMANDS[args[0]][0])
  module.define_flags(args[0])
  # A copy of the command's own flags: the global ones hold every command's defined in this process.
  own = flags.FlagValues()
  for flag in flags.FLAGS.get_flags_for_module(module.__name__):
    own[flag.name] = copy.deepcopy(flag)
  try:
    rest = own([f"netanalysis {args[0]}", *args[1:]])
  except flags.Error as e:
    return str(e)
  return f"unexpected arguments {rest[1:]}" if rest[1:] else None


def _launch_problem(root, args: list[str]) -> str | None:
  """Whether ``sparsejax-launch ARGS`` parse, and then the command it launches."""
  parsed = []
  problem = _parse_problem(lambda: parsed.append(launch.argument_parser().parse_args(args)))
  if problem:
    return problem
  command = parsed[0].command[1:] if parsed[0].command[:1] == ["--"] else parsed[0].command
  if not command:
    return "no command to launch"
  return _command_problem(root, ["python", *command] if command[0].endswith(".py") else command)


def _command_problem(root, args: list[str]) -> str | None:
  """What is wrong with one README command (None: nothing): an unknown program, script, extra or flag."""
  program = args[0]
  if program in COMMANDS:
    return _absl_problem(COMMANDS[program], program, args[1:])
  if program == "sparsejax-launch":
    return _launch_problem(root, args[1:])
  if program in ("python", "python3"):
    if args[1] == "-m":
      if args[2] == "sparsejax.netanalysis":
        return _netanalysis_problem(args[3:])
      if args[2] == "sparsejax.distributed.launch":
        return _launch_problem(root, args[3:])
      return None if args[2:4] == ["venv", ".venv"] else f"python -m {args[2]}: a module this test does not know"
    if not (root / args[1]).is_file():
      return f"{args[1]}: no such script"
    if args[1] not in SCRIPTS:
      return f"{args[1]}: a script this test does not know (add its command to SCRIPTS)"
    return _absl_problem(SCRIPTS[args[1]], args[1], args[2:])
  if program == "pip":
    return _pip_problem(root, args[1:])
  return None if program in OTHER_COMMANDS else f"{program}: a command this test does not know"


def _pip_problem(root, args: list[str]) -> str | None:
  """``pip install .`` or ``.[EXTRA]``: the extras exist (other packages are pip's business)."""
  extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  for target in args[1:]:
    if match := re.fullmatch(r"\.\[([\w,-]+)\]", target):
      missing = [name for name in match.group(1).split(",") if name not in extras]
      if missing:
        return f"pip install {target}: pyproject.toml has no extra {missing}"
  return None


def _readme_commands(root) -> list[list[str]]:
  return [command for block in _blocks(root, "bash") for command in _shell_commands(block)]


# --- Every block is run or checked ------------------------------------------------------------------------------


def test_every_readme_code_block_is_run_or_checked(root):
  blocks = _fenced_blocks(root)
  assert {lang for lang, _ in blocks} == {"bash", "python", ""}, "a block in a language this test cannot check"
  unmarked = [code for lang, code in blocks if not lang]
  assert len(unmarked) == 1 and unmarked[0].startswith("ffi/"), "only the Layout block has no language"
  runners = {"the training loop test here": "row_sparse_adam", "test_fit.py's README test": "sparsejax.fit(",
             "the serving test here": "/tmp/synth"}
  for code in _blocks(root, "python"):
    compile(code, "README.md", "exec")
    claimed = [name for name, marker in runners.items() if marker in code]
    assert len(claimed) == 1, f"a Python block that no test (or several: {claimed}) runs:\n{code}"


def test_readme_commands_exist_and_their_flags_parse(root, tmp_path, monkeypatch):
  commands = _readme_commands(root)
  assert len(commands) >= 30, commands  # the parser found them all (it found 37 when written)
  monkeypatch.chdir(tmp_path)  # where the user's data files are (the settings' validation looks for them)
  for name in USER_FILES:
    (tmp_path / name).touch()
  problems = [f"{shlex.join(command)}\n  {problem}" for command in commands
              if (problem := _command_problem(root, [PLACEHOLDERS.get(arg, arg) for arg in command]))]
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command, problem", [
    ("sparsejax-train --dataset=synthetic --synthetic_lables=10", "Unknown command line flag 'synthetic_lables'"),
    ("sparsejax-train --dataset=synthetic --active_k=0", "--active_k=0"),
    ("sparsejax-predict --workdir=/tmp/x --topk=5", "Unknown command line flag 'topk'"),
    ("python examples/trian.py --max_steps=3", "examples/trian.py: no such script"),
    ("python benchmarks/ops.py", "a script this test does not know"),
    ("sparsejax-launch -n 4 examples/train.py --max_step=3", "Unknown command line flag 'max_step'"),
    ("sparsejax-launch --procs=4 examples/train.py", "required: -n/--num_processes"),
    ("python -m sparsejax.netanalysis whatif --bandwidth=1gbit", "Unknown command line flag 'bandwidth'"),
    ("python -m sparsejax.netanalysis simulate", "no netanalysis command ['simulate']"),
    ('pip install ".[plots]"', "pyproject.toml has no extra ['plots']"),
    ("sparsejax-serve --workdir=/tmp/x", "sparsejax-serve: a command this test does not know"),
])
def test_the_command_check_finds_a_broken_command(root, command, problem):
  [args] = _shell_commands(command)
  assert problem in (_command_problem(root, args) or "")


def test_shell_commands_are_split_as_a_shell_would():
  block = ('D=tests/data\n# a comment: not a command\nsparsejax-train --a=$D/x \\\n    --workdir=$HOME/w  # trailing\n'
           'echo "two words" | \\\n    sparsejax-predict --input=- > out.txt && pytest\n')
  assert _shell_commands(block) == [
      ["sparsejax-train", "--a=tests/data/x", f"--workdir={SHELL_ENV['HOME']}/w"], ["echo", "two words"],
      ["sparsejax-predict", "--input=-"], ["pytest"]]


# --- Blocks that run -------------------------------------------------------------------------------------------


def test_readme_training_loop_example_runs(root):
  code = [block for block in _blocks(root, "python") if "row_sparse_adam" in block]
  assert code, "README lost its custom training loop example"
  namespace = {}
  exec(compile(code[0], "README.md", "exec"), namespace)
  value, dh = namespace["value"], namespace["dh"]
  assert np.isfinite(float(value)) and dh.shape == (64, 128)
  assert float(value) < np.log(512)  # 10 steps on one batch: below the uniform loss over the active set


def test_readme_serving_examples_run(root, tmp_path, monkeypatch, installed_command):
  """The synthetic run (made small, SMALL_SYNTHETIC), then as written: the Python blocks that use it, each on its
  own, and the sparsejax-predict commands on it."""
  workdir = str(tmp_path / "synth")
  [train] = [line for line in _shell_lines(root) if line.startswith("sparsejax-train") and SYNTH.search(line)]
  for readme, small in SMALL_SYNTHETIC.items():
    assert readme in train.split(), f"the synthetic command lost {readme}: update SMALL_SYNTHETIC"
    train = train.replace(readme, small)
  args = shlex.split(SYNTH.sub(workdir, train))
  trained = subprocess.run([installed_command(args[0]), *args[1:]], capture_output=True, text=True, timeout=300)
  assert trained.returncode == 0, trained.stderr[-3000:]

  monkeypatch.chdir(tmp_path)
  namespaces = []
  for code in [code for code in _blocks(root, "python") if SYNTH.search(code)]:
    namespaces.append({})
    exec(compile(SYNTH.sub(workdir, code), "README.md", "exec"), namespaces[-1])
  assert len(namespaces) == 2, "README's serving examples: writing the test set, then loading the model"
  test_set, model = namespaces[0]["test_set"], namespaces[1]["model"]
  assert os.path.getsize("test.txt") > 0 and len(namespaces[1]["test_set"]) == len(test_set)
  assert repr(model).startswith(f"TrainedModel(workdir={workdir!r}, step=30, selected_by=")
  assert namespaces[1]["ids"].shape == (len(test_set), 5)

  predicts = [line for line in _shell_lines(root) if line.startswith("sparsejax-predict") and SYNTH.search(line)]
  assert len(predicts) == 2, predicts
  env = dict(os.environ, PATH=os.path.dirname(installed_command("sparsejax-predict")) + os.pathsep + os.environ["PATH"])
  for line in predicts:
    predicted = subprocess.run(["bash", "-c", SYNTH.sub(workdir, line)], env=env, capture_output=True, text=True,
                               timeout=300)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
  # The exact predictions are the model's top 5, as Python computes them; the sampled ones as model.predict's k=1024.
  _, exact_ids = model.predict(test_set, top=5)
  for path, ids in (("predictions.txt", exact_ids), ("sampled.txt", namespaces[1]["ids"])):
    lines = open(path).read().splitlines()
    written = np.array([[int(pair.split(":")[0]) for pair in line.split("\t")] for line in lines])
    np.testing.assert_array_equal(written, ids, err_msg=path)


def test_readme_whatif_example_runs(root, tmp_path, monkeypatch, capsys):
  """The paper's what-if analysis runs as written (on the vendored profiles), its files written to tmp_path."""
  [block] = [block for block in _blocks(root, "bash") if "--model=paper" in block]
  [whatif] = [args for args in _shell_commands(block) if "--model=paper" in args]
  monkeypatch.chdir(root)
  args = [re.sub(r"=/tmp/", f"={tmp_path}/", arg) for arg in whatif[3:]]
  assert netanalysis_main(["netanalysis", *args]) == 0, capsys.readouterr().err
  assert "scaling factor" in capsys.readouterr().out
  assert sorted(os.listdir(tmp_path)) == ["whatif-compression.png", "whatif.json", "whatif.png"]


def test_readme_training_commands_use_their_own_workdirs(root):
  """Issue 11: the README's training examples all defaulted to the same /tmp/sparsejax. Since issue 33 a command
  without --workdir gets a new directory of its own; those that name one must name different ones."""
  commands = [line for line in _shell_lines(root)
              if re.search(r"sparsejax-train|examples/train\.py", line) and "--help" not in line]
  assert len(commands) >= 6
  workdirs = [m.group(1) if (m := re.search(r"--workdir=(\S+)", c)) else f"a new run directory ({i})"
              for i, c in enumerate(commands)]
  assert len(set(workdirs)) == len(workdirs), list(zip(workdirs, commands))
