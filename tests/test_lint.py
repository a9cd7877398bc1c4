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
