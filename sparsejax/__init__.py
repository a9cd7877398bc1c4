"""sparsejax: LSH-sampled sparse training of huge output layers in JAX."""

import importlib.machinery as _machinery
import importlib.metadata
import os as _os
import tomllib


def _use_installed_extension() -> None:
  """Lets a source checkout without a built ``_sparsejax`` use the installed one.

  ``python -c "from sparsejax import ops"`` run from the repository root
  imports this source tree, not the installed package, and the compiled
  extension exists only where ``pip install .`` put it: that directory then
  joins the package's search path (for the extension; Python modules still
  come from the source tree).
  """
  here = _os.path.dirname(_os.path.abspath(__file__))
  names = ["_sparsejax" + suffix for suffix in _machinery.EXTENSION_SUFFIXES]
  if any(_os.path.exists(_os.path.join(here, n)) for n in names):
    return

  try:
    installed = _os.path.abspath(str(importlib.metadata.distribution("sparsejax").locate_file("sparsejax")))
  except importlib.metadata.PackageNotFoundError:
    return
  if installed != here and any(_os.path.exists(_os.path.join(installed, n)) for n in names):
    __path__.append(installed)


_use_installed_extension()


def _version(source_root: str | None = None) -> str:
  """The installed distribution's version, else (a source tree never installed) the version in
  ``source_root/pyproject.toml`` (default: the directory above the package)."""
  try:
    return importlib.metadata.version("sparsejax")
  except importlib.metadata.PackageNotFoundError:
    pass

  source_root = source_root or _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
  try:
    with open(_os.path.join(source_root, "pyproject.toml"), "rb") as f:
      return tomllib.load(f)["project"]["version"]
  except (OSError, KeyError, tomllib.TOMLDecodeError):
    return "unknown"


__version__ = _version()


def load(workdir: str, step: int | None = None, platform: str = "cpu"):
  """The model trained in ``workdir``: ``predict(inputs, top=k)`` and ``evaluate(dataset)``, its network on
  ``platform`` (``"cpu"``; ``"cuda"`` or ``"rocm"`` for a dense model; JAX is pinned to it, as ``fit`` pins it).

  See :mod:`sparsejax.serving.model`.
  """
  from sparsejax.serving.model import load as _load  # deferred: import sparsejax stays free of JAX

  return _load(workdir, step, platform)


def __getattr__(name: str):
  """``sparsejax.fit``, imported on first use: ``import sparsejax`` stays free of JAX."""
  if name == "fit":
    from sparsejax.fitting import fit  # deferred: import sparsejax stays free of JAX

    return fit
  raise AttributeError(f"module 'sparsejax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), "fit"])
