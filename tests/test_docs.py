"""The README's layout and docs/architecture.md list every module (issue 11)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules():
  files = sorted((ROOT / "sparsejax").rglob("*.py")) + sorted((ROOT / "ffi").glob("*.[ch]*"))
  return [f for f in files if "__pycache__" not in f.parts]


def _layout_block() -> str:
  readme = (ROOT / "README.md").read_text()
  block = re.search(r"## Layout\n\n```\n(.*?)```", readme, re.S)
  assert block, "README.md has no '## Layout' code block"
  return block.group(1)


def _architecture_table() -> str:
  doc = (ROOT / "docs" / "architecture.md").read_text()
  return doc[doc.index("## Modules"):]


@pytest.mark.parametrize("where", ["README layout", "docs/architecture.md"])
def test_every_module_is_listed(where):
  text = _layout_block() if where == "README layout" else _architecture_table()
  words = set(re.findall(r"[\w.]+\.(?:py|cc|h)\b", text))
  missing = [str(f.relative_to(ROOT)) for f in _modules()
             if f.name not in words and not (f.parent.name == "data" and f.name == "__init__.py")]
  assert not missing, f"{where} does not list: {missing}"
