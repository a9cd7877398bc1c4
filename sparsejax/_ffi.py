"""Lazy registration of the C++ FFI handlers with XLA's CPU backend, and their signatures.

Targets are registered on first use, not at import: registering before the CPU
backend exists fails for stateful types, and creating the backend at import
time would break a later ``jax.distributed.initialize``.

Each handler declares its buffers' dtypes and ranks in C++ (``ffi/*.cc``);
XLA enforces them when it decodes a call, but its message names neither the
op nor the argument. :func:`ffi_call` checks the same dtypes and ranks at
trace time, from :data:`SIGNATURES`, so that every caller gets an error that
names both. The kernels check everything else (sizes that must agree, ids).
"""

import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

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
    thread_cap()  # checked: the kernels read it once and would run uncapped on anything else, silently
    for name, capsule in _sparsejax.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _registered = True


def thread_cap() -> int | None:
  """``SPARSEJAX_NUM_THREADS``: the most threads the kernels (and the host's centroid scoring) use; None: unset or
  empty (all cores). Raises ValueError where it is not a positive integer."""
  threads = os.environ.get("SPARSEJAX_NUM_THREADS")
  if not threads:
    return None
  if not (threads.strip().isdigit() and int(threads) > 0):
    raise ValueError(f"SPARSEJAX_NUM_THREADS={threads!r}: must be a positive integer (the kernels' thread cap), or "
                     "unset for all cores")
  return int(threads)


def _varying_axes(x) -> frozenset:
  """The mesh axes over which ``x`` varies inside ``shard_map`` (none outside)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10; earlier versions name it vma
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def on_cpu(kernel: Callable, portable: Callable, *args):
  """``kernel(*args)`` where XLA compiles for the CPU, ``portable(*args)`` (the same math in ``jnp``) elsewhere.

  The kernels are CPU code. The ops that the dense baseline runs (the input layer, exact top-k) take the portable
  path on an accelerator, so ``--model=dense`` trains on a GPU; only the branch of the compiled-for platform is
  lowered, so a CPU program is the kernel's alone.
  """
  # Inside shard_map(check_vma=True) both branches must agree on which mesh axes their outputs vary over: the
  # portable ops' vary over their inputs' axes, a kernel's over none, so the kernel's are cast to match.
  axes = tuple(sorted(frozenset().union(*map(_varying_axes, args))))

  def typed_kernel(*args):
    return jax.tree.map(lambda out: jax.lax.pcast(out, axes, to="varying"), kernel(*args)) if axes else kernel(*args)

  return jax.lax.platform_dependent(*args, cpu=typed_kernel, default=portable)


class Buffer(NamedTuple):
  """One operand or result of a handler: its name, dtype and allowed ranks."""
  name: str
  dtype: str
  ranks: tuple[int, ...]


class Signature(NamedTuple):
  """A handler's buffers, as its C++ binding declares them.

  Attributes:
    args: the operands, in order.
    results: the results, in order.
    extra_args: whether more (unread) operands may follow ``args``.
    default_attrs: attributes passed unless the caller gives them.
  """
  args: tuple[Buffer, ...]
  results: tuple[Buffer, ...]
  extra_args: bool = False
  default_attrs: tuple[tuple[str, Any], ...] = ()


def _adam_signature(moments: str, weight: str = "float32") -> Signature:
  param = lambda name, dtype: Buffer(name, dtype, (1, 2))  # [N, d], or [N] for a bias alone
  state = (param("weight", weight), param("mu", moments), param("nu", moments), Buffer("bias", "float32", (1,)),
           Buffer("bias_mu", moments, (1,)), Buffer("bias_nu", moments, (1,)))
  return Signature(
      args=state + (Buffer("ids", "int32", (2,)), Buffer("g", "float32", (2,)), Buffer("x", "float32", (2,)),
                    Buffer("learning_rate", "float32", (0,)), Buffer("count", "int32", (0,))),
      results=state + (Buffer("touched", "int32", (1,)), Buffer("combined", "float32", (2,))),
      extra_args=True)


_TABLES = (Buffer("buckets", "int32", (3,)), Buffer("counts", "int32", (2,)), Buffer("codes", "int32", (2,)))
# The op (and its ids argument) that the gather kernels' errors name: the public op that calls them.
_GATHER_NAMES = lambda op: (("op", op), ("ids_name", "ids"))

# The weight dtypes of the gather and Adam kernels, and the suffix of their targets' names.
_WEIGHTS = (("float32", ""), ("bfloat16", "_bfloat16_weight"))
WEIGHT_DTYPES = tuple(jnp.dtype(w) for w, _ in _WEIGHTS)


def weight_suffix(weight) -> str:
  """The suffix of the kernel for a weight of ``weight``'s dtype (which the caller has checked)."""
  return dict(_WEIGHTS)[jnp.dtype(weight.dtype).name]


# Mirrors the bindings in ffi/*.cc (tests/test_ffi.py checks that they agree).
SIGNATURES: dict[str, Signature] = {
    **{f"gather_dot{suffix}": Signature(
        (Buffer("x", "float32", (2,)), Buffer("weight", weight, (2,)), Buffer("ids", "int32", (2,)),
         Buffer("bias", "float32", (1,))),
        (Buffer("out", "float32", (2,)),), default_attrs=_GATHER_NAMES("gather_dot"))
       for weight, suffix in _WEIGHTS},
    **{f"gather_combine{suffix}": Signature(
        (Buffer("g", "float32", (2,)), Buffer("weight", weight, (2,)), Buffer("ids", "int32", (2,))),
        (Buffer("out", "float32", (2,)),), default_attrs=_GATHER_NAMES("gather_combine"))
       for weight, suffix in _WEIGHTS},
    "simhash": Signature(
        (Buffer("x", "float32", (2,)), Buffer("projections_t", "float32", (2,))),
        (Buffer("codes", "int32", (2,)),)),
    "dwta": Signature(
        (Buffer("x", "float32", (2,)), Buffer("bin_idx", "int32", (2,)), Buffer("seed", "uint32", (0,))),
        (Buffer("codes", "int32", (2,)),)),
    "lsh_tables_insert": Signature(
        _TABLES + (Buffer("ids", "int32", (1,)), Buffer("seed", "uint32", (0,))),
        _TABLES[:2]),
    "lsh_query": Signature(
        _TABLES + (Buffer("labels", "int32", (2,)), Buffer("seed", "uint32", (0,)), Buffer("num_rows", "int32", (0,))),
        (Buffer("active", "int32", (2,)), Buffer("num_from_tables", "int32", (1,)))),
    "merge_candidates": Signature(
        (Buffer("candidates", "int32", (2,)), Buffer("labels", "int32", (2,)), Buffer("seed", "uint32", (0,)),
         Buffer("num_rows", "int32", (0,))),
        (Buffer("active", "int32", (2,)), Buffer("num_from_candidates", "int32", (1,)))),
    "cluster_probe": Signature(
        (Buffer("scores", "float32", (2,)), Buffer("offsets", "int32", (1,)), Buffer("rows", "int32", (1,))),
        (Buffer("ids", "int32", (2,)),)),
    "row_topk": Signature(
        (Buffer("scores", "float32", (2,)),), (Buffer("values", "float32", (2,)), Buffer("columns", "int32", (2,)))),
    "logistic_regression": Signature(
        (Buffer("indptr", "int32", (1,)), Buffer("indices", "int32", (1,)), Buffer("values", "float32", (1,)),
         Buffer("positive_offsets", "int32", (1,)), Buffer("positive_rows", "int32", (1,))),
        (Buffer("weights", "float32", (2,)), Buffer("bias", "float32", (1,)), Buffer("epochs", "int32", (1,)))),
    **{f"row_sparse_adam_{moments}{suffix}": _adam_signature(moments, weight)
       for weight, suffix in _WEIGHTS for moments in ("float32", "bfloat16")},
}


def _check(op: str, kind: str, spec: Buffer, x: Any) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{op}: {kind} '{spec.name}' must be an array, got {type(x).__name__}")
  if jnp.dtype(x.dtype) != jnp.dtype(spec.dtype):
    raise TypeError(f"{op}: {kind} '{spec.name}' must have dtype {spec.dtype}, got {jnp.dtype(x.dtype).name}")
  if len(x.shape) not in spec.ranks:
    ranks = " or ".join(str(r) for r in spec.ranks)
    raise ValueError(f"{op}: {kind} '{spec.name}' must have rank {ranks}, got shape {tuple(x.shape)}")


def ffi_call(name: str, result_shape_dtypes, **kwargs):
  """``jax.ffi.ffi_call`` for target ``sparsejax_<name>``, registering first.

  Operands and results are checked against ``SIGNATURES[name]`` (dtypes and
  ranks) when the returned function is called.
  """
  sig = SIGNATURES[name]
  results = result_shape_dtypes if isinstance(result_shape_dtypes, (tuple, list)) else (result_shape_dtypes,)
  if len(results) != len(sig.results):
    raise ValueError(f"{name}: expected {len(sig.results)} results, got {len(results)}")
  for spec, result in zip(sig.results, results):
    _check(name, "result", spec, result)
  ensure_registered()
  call = jax.ffi.ffi_call(f"sparsejax_{name}", result_shape_dtypes, **kwargs)

  def checked_call(*args, **attrs):
    if len(args) < len(sig.args) or (len(args) > len(sig.args) and not sig.extra_args):
      raise TypeError(f"{name}: expected {len(sig.args)} operands, got {len(args)}")
    for spec, arg in zip(sig.args, args):
      _check(name, "argument", spec, arg)
    return call(*args, **{**dict(sig.default_attrs), **attrs})

  return checked_call
