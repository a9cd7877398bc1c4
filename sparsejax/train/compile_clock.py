"""Seconds this process has spent tracing, lowering and compiling JAX programs (a persistent-cache read included).

A run's measured step time must not count compilations: with batches padded to their own widths (a few bucketed
widths, one program each), the first steps of a run compile one program per new width, and the recipe search's
20 measuring steps on a real multi-label set (debian_depends: 7 feature and 5 label widths) measured 242 ms a step
where the steps took 45 (issue 48). JAX reports each phase's duration to its monitoring listeners; this adds them.
"""

import threading

import jax

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")
_lock = threading.Lock()
_seconds = 0.0
_registered = False


def _record(event: str, seconds: float, **_) -> None:
  global _seconds
  if event in _EVENTS:
    with _lock:
      _seconds += seconds


def seconds() -> float:
  """Compilation seconds so far (since the first call: it registers the listener)."""
  global _registered
  with _lock:
    if not _registered:
      jax.monitoring.register_event_duration_secs_listener(_record)
      _registered = True
    return _seconds
