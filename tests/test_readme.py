"""The README's examples: the custom training loop runs as written; every training command has its own workdir."""

import re

import numpy as np


def _blocks(root, language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", (root / "README.md").read_text(), re.S)


def test_readme_training_loop_example_runs(root):
  code = [block for block in _blocks(root, "python") if "row_sparse_adam" in block]
  assert code, "README lost its custom training loop example"
  namespace = {}
  exec(compile(code[0], "README.md", "exec"), namespace)
  value, dh = namespace["value"], namespace["dh"]
  assert np.isfinite(float(value)) and dh.shape == (64, 128)
  assert float(value) < np.log(512)  # 10 steps on one batch: below the uniform loss over the active set


def test_readme_training_commands_use_their_own_workdirs(root):
  """Issue 11: the README's training examples all defaulted to the same /tmp/sparsejax. Since issue 33 a command
  without --workdir gets a new directory of its own; those that name one must name different ones."""
  commands = [line for block in _blocks(root, "bash") for line in block.replace("\\\n", " ").splitlines()
              if re.search(r"sparsejax-train|examples/train\.py", line) and "--help" not in line]
  assert len(commands) >= 6
  workdirs = [m.group(1) if (m := re.search(r"--workdir=(\S+)", c)) else f"a new run directory ({i})"
              for i, c in enumerate(commands)]
  assert len(set(workdirs)) == len(workdirs), list(zip(workdirs, commands))
