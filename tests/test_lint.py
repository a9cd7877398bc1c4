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


# The layers below the training application: none of them imports it (docs/architecture.md, "The layers").
_BELOW_TRAIN = ("sparsejax/serving", "sparsejax/workdir", "sparsejax/evaluation.py", "sparsejax/platforms.py",
                "sparsejax/index", "sparsejax/distributed")


def _imported_modules(tree) -> list[tuple[int, str]]:
  """``(line, module)`` of every import in ``tree``, at any depth (inside functions too)."""
  import ast

  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
  return found


def _lines_importing(tree, packages) -> list[int]:
  """Lines of ``tree`` that import any of ``packages`` or a module inside one (``from sparsejax import cli`` too)."""
  return sorted({line for line, module in _imported_modules(tree)
                 if any(module == package or module.startswith(package + ".") for package in packages)})


def _files_importing(prefixes, packages) -> dict[str, list[int]]:
  """``{file: lines}`` of the modules under ``prefixes`` (folders or files) that import any of ``packages``."""
  import ast

  found = {}
  for prefix in prefixes:
    root = ROOT / prefix
    for path in sorted(root.rglob("*.py") if root.is_dir() else [root]):
      lines = _lines_importing(ast.parse(path.read_text()), packages)
      if lines:
        found[str(path.relative_to(ROOT))] = lines
  return found


def test_the_layers_below_training_do_not_import_it():
  """Serving, the work directory, evaluation, the platforms, the index and the distributed runtime never import
  ``sparsejax.train`` (issue 46): a loaded model needs no training code, and the arrows point one way."""
  found = _files_importing(_BELOW_TRAIN, ("sparsejax.train",))
  assert not found, f"imports of sparsejax.train below it: {found}"


def test_the_layer_check_finds_an_import():
  import ast

  code = ("import sparsejax.train.loop\nfrom sparsejax.train import seals\n"
          "def f():\n  from sparsejax.train.driver import x\n")
  modules = [m for _, m in _imported_modules(ast.parse(code)) if m.startswith("sparsejax.train")]
  assert modules == ["sparsejax.train.loop", "sparsejax.train", "sparsejax.train.seals", "sparsejax.train.driver",
                     "sparsejax.train.driver.x"]


# The top layer: the commands (sparsejax/cli/) and sparsejax.fit (sparsejax/fitting.py). Only they, and the package's
# __init__.py (sparsejax.fit imported on first use), import it (docs/architecture.md, "The layers").
_TOP_LAYER = ("sparsejax.cli", "sparsejax.fitting")
_IN_THE_TOP_LAYER = ("sparsejax/cli", "sparsejax/fitting.py", "sparsejax/__init__.py")


def test_nothing_below_the_commands_imports_them():
  """The commands and ``fit`` sit above training, serving and the network analysis, and may import them all; no
  module of those imports the commands or ``fit`` (issue 46)."""
  found = {where: lines for where, lines in _files_importing(("sparsejax",), _TOP_LAYER).items()
           if not any(where == top or where.startswith(top + "/") for top in _IN_THE_TOP_LAYER)}
  assert not found, f"imports of the commands or sparsejax.fitting below them: {found}"


def test_the_top_layer_check_finds_an_import():
  import ast

  code = ("import sparsejax.cli.flags\nfrom sparsejax import cli\nimport sparsejax.client\n"
          "def f():\n  from sparsejax.fitting import fit\n")
  assert _lines_importing(ast.parse(code), _TOP_LAYER) == [1, 2, 5]


# The training path: none of it imports the network analysis (issue 46), which reaches a run only as the step
# observer that its caller hands over (sparsejax/train/step_observer.py).
_TRAINING_PATH = ("sparsejax/config.py", "sparsejax/settings.py", "sparsejax/rates.py", "sparsejax/model.py",
                  "sparsejax/model_config.py", "sparsejax/model_kinds.py", "sparsejax/distributed", "sparsejax/train")


def test_the_training_path_does_not_import_the_network_analysis():
  found = _files_importing(_TRAINING_PATH, ("sparsejax.netanalysis",))
  assert not found, f"imports of sparsejax.netanalysis in the training path: {found}"
