"""The CI script (.ci/run)."""

import os
import subprocess


def test_a_leg_whose_venv_cannot_be_made_fails(root, tmp_path):
  """A leg's venv made by a Python that fails: the leg fails, not its tests run with whatever pip is on PATH (venv()
  is called in an && list, where set -e does not stop a function at its failing command)."""
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / "python").write_text("#!/bin/sh\nexit 0\n")  # the pip that the leg would have used: touches nothing
  (fake / "python").chmod(0o755)
  script = f"""
      set -euo pipefail
      SCRATCH={tmp_path}
      eval "$(sed -n '/^venv() {{/,/^}}/p' {root / '.ci' / 'run'})"
      (venv readme false && echo "tests ran")
  """
  out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"))
  assert out.returncode != 0 and "tests ran" not in out.stdout, (out.stdout, out.stderr)
