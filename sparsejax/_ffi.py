"""Lazy registration of the C++ FFI handlers with XLA's CPU backend.

Targets are registered on first use, not at import: registering before the CPU
backend exists fails for stateful types, and creating the backend at import
time would break a later ``jax.distributed.initialize``.
"""

import threading

import jax

from sparsejax import _sparsejax

_lock = threading.Lock()
_registered = False


def ensure_registered() -> None:
  """Registers every sparsejax FFI target with XLA (idempotent, thread-safe)."""
  global _registered
  if _registered:
    return
  with _lock:
    if _registered:
      return
    for name, capsule in _sparsejax.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _registered = True


def ffi_call(name: str, result_shape_dtypes, **kwargs):
  """``jax.ffi.ffi_call`` for target ``sparsejax_<name>``, registering first."""
  ensure_registered()
  return jax.ffi.ffi_call(f"sparsejax_{name}", result_shape_dtypes, **kwargs)
