"""Where a network runs: the platforms (``cpu``, ``cuda``, ``rocm``), which networks each one can run, and JAX pinned
to one of them.

SLIDE's kernels (its index, the sampled softmax, row-sparse Adam) are CPU code: an accelerator runs the dense
baseline only. ``sparsejax-train`` and ``sparsejax-predict`` (``--platform``), :func:`sparsejax.fit` and
:func:`sparsejax.load` (``platform=``) decide by :func:`problem`, so that each says the same thing in its own
words for the setting; the Python functions pin JAX with :func:`pin` (the commands set ``JAX_PLATFORMS`` before
JAX starts).
"""

from __future__ import annotations

from sparsejax import model_kinds

PLATFORMS = ("cpu", "cuda", "rocm")
# The platform name of JAX's devices for each of them.
DEVICE_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu"}


def problem(platform: str, model: str | None = None) -> str | None:
  """Why ``platform`` cannot run a ``model`` network, or None where it can.

  Args:
    platform: a platform's name, as given.
    model: a ``--model`` name (:mod:`sparsejax.model_kinds`); None: only the name is checked.

  Returns:
    The message after the setting, which the caller names in its own words (``--platform=cuda: ...``,
    ``platform='cuda': ...``), or None.
  """
  if platform not in PLATFORMS:
    return f"must be one of {', '.join(PLATFORMS)}"
  kind = model_kinds.KINDS.get(model) if model is not None else None
  if platform != "cpu" and model is not None and (kind is None or not kind.accelerators):
    runs = ", ".join(f"model={k.name}" for k in model_kinds.KINDS.values() if k.accelerators)
    return (f"an accelerator runs {runs} only (the full-softmax baseline), not model={model}: SLIDE's kernels "
            "(its index, the sampled softmax, row-sparse Adam) are CPU code; use cpu")
  return None


class PlatformError(ValueError):
  """``platform`` cannot run the network asked for (:func:`problem`): ``str()`` names it as a Python argument,
  ``problem`` says why (for a command to name its flag)."""

  def __init__(self, platform: str, problem: str):
    super().__init__(f"platform={platform!r}: {problem}")
    self.platform, self.problem = platform, problem


class PlatformUnavailable(RuntimeError):
  """JAX cannot run on ``platform`` in this process: it has no device of it, or already runs on another platform.
  ``str()`` and ``problem`` as :class:`PlatformError`'s."""

  def __init__(self, platform: str, problem: str):
    super().__init__(f"platform={platform!r}: {problem}")
    self.platform, self.problem = platform, problem


def check(platform: str, model: str | None = None) -> None:
  """Raises :class:`PlatformError` where :func:`problem` finds one."""
  why = problem(platform, model)
  if why is not None:
    raise PlatformError(platform, why)


def pin(platform: str, model: str | None, caller: str) -> None:
  """Runs this process's JAX on ``platform`` for a ``model`` network, as ``--platform`` does for the commands.

  JAX starts on one platform per process: where it has not started yet, it is set to ``platform``; where it has,
  it must be running there already.

  Args:
    platform: ``cpu``, ``cuda`` or ``rocm``.
    model: a ``--model`` name (None: not known yet; :func:`check` it once known).
    caller: the function that pins (``fit``, ``load``), named in the advice where JAX runs elsewhere.

  Raises:
    PlatformError: ``platform`` is no platform, or cannot run ``model`` (:func:`problem`).
    PlatformUnavailable: JAX has no device of ``platform`` here, or already runs on another platform in this process.
  """
  check(platform, model)
  # deferred: the commands check --platform with this module before JAX may start (sharding imports JAX)
  from sparsejax.distributed import sharding

  try:
    running = sharding.start_on(platform).platform
  except RuntimeError as e:  # no device of it
    raise PlatformUnavailable(platform, str(e)) from None
  if running != DEVICE_PLATFORMS[platform]:
    # The process already uses another platform (e.g. a notebook's earlier GPU work): its devices are the ones the
    # network's arrays would be placed on, and SLIDE's CPU kernels cannot run there.
    other = next((name for name, device in DEVICE_PLATFORMS.items() if device == running), running)
    raise PlatformUnavailable(platform, f"JAX already runs on {running} in this process, and it cannot change once "
                              f"started: call {caller} before anything else uses JAX (or start Python with "
                              f"JAX_PLATFORMS={platform})" + (f", or give platform={other!r} for a model='dense' "
                                                              "network" if running == "gpu" else ""))
