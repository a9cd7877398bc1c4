"""sparsejax: LSH-sampled sparse training of huge output layers in JAX."""

import importlib.machinery as _machinery
import os as _os


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
  import importlib.metadata

  try:
    installed = _os.path.abspath(str(importlib.metadata.distribution("sparsejax").locate_file("sparsejax")))
  except importlib.metadata.PackageNotFoundError:
    return
  if installed != here and any(_os.path.exists(_os.path.join(installed, n)) for n in names):
    __path__.append(installed)


_use_installed_extension()


def load(workdir: str, step: int | None = None):
  """The model trained in ``workdir``: ``predict(inputs, top=k)`` and ``evaluate(dataset)``.

  See :mod:`sparsejax.trained`.
  """
  from sparsejax.trained import load as _load

  return _load(workdir, step)
