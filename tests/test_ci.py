"""The CI script (.ci/run)."""

import os
import re
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


def _quick_start(root, tmp_path, prints: str):
  """Runs .ci/run's quick_start with a fake `python` that prints ``prints`` and exits 0."""
  fake = tmp_path / "bin"
  fake.mkdir(exist_ok=True)
  (fake / "python").write_text(f"#!/bin/sh\nprintf '%s\\n' 'loading...' '{prints}'\n")
  (fake / "python").chmod(0o755)
  script = f"""
      set -euo pipefail
      SCRATCH={tmp_path}
      cd {root}
      eval "$(sed -n '/^quick_start() {{/,/^}}/p' {root / '.ci' / 'run'})"
      quick_start
  """
  return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"))


def test_ci_times_the_quick_start_against_the_time_the_readme_states(root, tmp_path):
  """The quick start's stated time is what CI measures: quick_start prints its seconds next to the README's figure,
  and fails where the run does not end with its metrics line."""
  stated = re.search(r"^The run takes about (\d+) seconds on 2 cores", (root / "README.md").read_text(), re.M)
  assert stated, "README.md no longer states the quick start's time in the sentence .ci/run reads"
  metrics = "step 2500  P@1 0.9405  P@3 0.3209  P@5 0.1939  in /tmp/x"
  out = _quick_start(root, tmp_path, metrics)
  assert out.returncode == 0, out.stderr
  assert re.search(rf"CI: quick start took \d+ s on \d+ cores \(README: about {stated[1]} s on 2 cores\): "
                   + re.escape(metrics), out.stdout), out.stdout
  bad = _quick_start(root, tmp_path, "Traceback: something broke")
  assert bad.returncode != 0 and "not its metrics line" in bad.stderr
