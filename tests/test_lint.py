"""The linter is part of the test suite, so the README's one test command also checks style."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_reports_nothing():
  # Configured in pyproject.toml ([tool.ruff]); ruff is in the [test] extra.
  result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr


def _comparisons_with_string(tree, attribute: str) -> list[int]:
  """Lines of ``tree`` that compare ``<...>.attribute`` (or a name ``attribute``) with a string constant."""
  import ast

  def names_attribute(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attribute) or (isinstance(node, ast.Name)
                                                                             and node.id == attribute)

  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      sides = [node.left, *node.comparators]
      strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)
                 or isinstance(s, (ast.Tuple, ast.Set, ast.List)) and any(
                     isinstance(e, ast.Constant) and isinstance(e.value, str) for e in s.elts)]
      if strings and any(names_attribute(s) for s in sides):
        lines.append(node.lineno)
  return lines


def test_the_model_kind_is_read_by_its_registry_only():
  """``--model``'s value is compared with a name only in ``sparsejax/model_kinds.py``: everywhere else asks the
  kind what it can do (``model_kinds.of(config).sampled``), so a new kind is one entry there (issue 46)."""
  import ast

  found = {}
  for path in sorted((ROOT / "sparsejax").rglob("*.py")):
    if path.name == "model_kinds.py" or "netanalysis" in path.parts:  # netanalysis's "dense" is a profile's job
      continue
    lines = _comparisons_with_string(ast.parse(path.read_text()), "model")
    if lines:
      found[str(path.relative_to(ROOT))] = lines
  assert not found, f"a model kind compared with a string outside model_kinds.py: {found}"


def test_the_registry_check_finds_a_comparison():
  """The check above against code that compares the kind's name, in each form it looks for."""
  import ast

  code = "a = config.network.model == 'slide'\nb = model != 'dense'\nc = cfg.model in ('slide', 'x')\nd = x == 'y'\n"
  assert _comparisons_with_string(ast.parse(code), "model") == [1, 2, 3]
