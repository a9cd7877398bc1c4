"""What a command does before its first step: JAX's persistent compilation cache (on by default, per user)."""

import os
import stat
import subprocess

from sparsejax import compilation_cache

# A run whose time is nearly all start-up: a few seconds.
TINY = ["--dataset=synthetic", "--synthetic_samples=600", "--synthetic_features=200", "--synthetic_labels=30",
        "--hidden_dims=8", "--active_k=30", "--batch_size=32", "--max_steps=4", "--eval_every=1000",
        "--eval_samples=32", "--log_every=2", "--checkpoint_every=1000", "--noprogress", "--learning_rate=0.01",
        "--validation_fraction=0"]


def _environment(tmp_path, **extra) -> dict:
  """The test's environment without the suite's cache: JAX's cache and sparsejax's runs in ``tmp_path``."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), SPARSEJAX_RUNS=str(tmp_path / "runs"), **extra)
  return env


def _train(installed_command, env, *args) -> subprocess.CompletedProcess:
  out = subprocess.run([installed_command("sparsejax-train"), *TINY, *args], capture_output=True, text=True,
                       timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def _entries(directory) -> list[str]:
  return [name for _, _, names in os.walk(directory) for name in names if name.endswith("-cache")]


def test_runs_fill_the_compilation_cache_they_are_given_and_none_turns_it_off(tmp_path, installed_command):
  """Issue 33: every run compiled its programs again (JAX's persistent cache was off unless set up by hand)."""
  env = _environment(tmp_path)
  _train(installed_command, env, f"--compilation_cache={tmp_path / 'cache'}")
  entries = _entries(tmp_path / "cache")
  assert any(name.startswith("jit_train_step-") for name in entries), entries
  # Small programs too (JAX's default skips compilations under 1 s: here, all of them).
  assert len(entries) >= 10, entries
  # none: nothing written, neither in the per-user default nor where JAX's own variable points.
  env = _environment(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env-cache"))
  _train(installed_command, env, "--compilation_cache=none")
  assert _entries(tmp_path / "xdg") == [] and _entries(tmp_path / "env-cache") == []
  # auto (the default): JAX's variable where it is set ...
  _train(installed_command, env)
  assert _entries(tmp_path / "env-cache") and _entries(tmp_path / "xdg") == []
  # ... else the per-user directory, private, one subdirectory per CPU.
  _train(installed_command, _environment(tmp_path))
  default = tmp_path / "xdg" / "sparsejax" / "jax" / compilation_cache.cpu_id()
  assert _entries(default) and stat.S_IMODE(default.stat().st_mode) == 0o700


def test_an_unusable_cache_directory_is_a_warning_not_a_failure(tmp_path, installed_command):
  (tmp_path / "file").write_text("")
  out = _train(installed_command, _environment(tmp_path), f"--compilation_cache={tmp_path / 'file' / 'cache'}")
  assert (f"sparsejax-train: warning: compilation cache {tmp_path / 'file' / 'cache'}: cannot write there (Not a "
          "directory); compiling without it") in out.stderr.splitlines()
  assert out.stdout.startswith("step 4 ")


def test_the_default_cache_must_be_the_user_s_own(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.delenv(compilation_cache.DIR_ENV, raising=False)
  directory, is_default = compilation_cache.resolve("auto")
  assert is_default and directory == str(tmp_path / "sparsejax" / "jax" / compilation_cache.cpu_id())
  assert compilation_cache.unusable(directory, private=True) is None
  os.chmod(directory, 0o777)  # others could put code there
  assert compilation_cache.unusable(directory, private=True) == "others can write to it"
  monkeypatch.setenv(compilation_cache.DIR_ENV, "/elsewhere")
  assert compilation_cache.resolve("auto") == ("/elsewhere", False)
  assert compilation_cache.resolve("NONE") == (None, False)
  assert compilation_cache.resolve("~/x") == (os.path.expanduser("~/x"), False)

