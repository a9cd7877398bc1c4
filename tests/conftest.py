"""Shared test helpers, as fixtures: the repository's paths, Python subprocesses, small training configs.

Tests import the installed package (``--import-mode=importlib``; subprocesses
run ``python -P``), so helpers live here rather than in an importable module.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def root() -> pathlib.Path:
  """The repository's root directory."""
  return ROOT


def _run_python(*args: str, code: str | None = None, devices: int | None = None, env: dict | None = None,
                timeout: float = 300, cwd=None, check: bool = True, isolated: bool = True):
  """Runs ``python [-P] [-c code] args`` and returns the CompletedProcess (text).

  Args:
    args: the script and its arguments (or further arguments after ``code``).
    code: a program (dedented) to run with ``-c``.
    devices: virtual CPU devices for JAX (``--xla_force_host_platform_device_count``).
    env: extra environment variables.
    timeout: seconds.
    cwd: working directory.
    check: assert a zero exit status (showing the end of stderr otherwise).
    isolated: ``-P``: do not put the current directory first on the path (import the installed package).
  """
  full_env = dict(os.environ, **(env or {}))
  if devices:
    full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  command = [sys.executable, *(["-P"] if isolated else []), *(["-c", textwrap.dedent(code)] if code else []), *args]
  out = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
  if check:
    assert out.returncode == 0, out.stderr[-4000:]
  return out


@pytest.fixture(scope="session")
def run_python():
  """``run_python(*args, code=None, devices=None, env=None, timeout=300, cwd=None, check=True, isolated=True)``."""
  return _run_python


@pytest.fixture(scope="session")
def installed_command():
  """``installed_command(name)``: the path of a console script installed next to this Python."""
  def path(name: str) -> str:
    found = os.path.join(os.path.dirname(sys.executable), name)
    assert os.path.exists(found), f"{name} is not installed (pip install .)"
    return found
  return path


@pytest.fixture(scope="session")
def small_config():
  """A config that trains a small synthetic problem in a few seconds (override what a test needs)."""
  from sparsejax.config import Config, override

  return override(
      Config(), dataset="synthetic", synthetic_samples=3000, synthetic_features=1000, synthetic_labels=200,
      hidden_dims=(32,), active_k=32, num_tables=8, batch_size=64, max_steps=40, eval_every=20, eval_samples=300,
      log_every=10, checkpoint_every=15, rebuild_period=7, rebuild_growth=1.3, rehash_period=25, reinsert="labels",
      progress=False, learning_rate=3e-3)
