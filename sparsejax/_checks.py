"""Trace-time argument checks whose errors name the op, the argument and the
expected shape. The C++ handlers check again at run time (for callers that
bypass these wrappers)."""

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np


class Dims(dict):
  """Symbolic dimension sizes bound while checking one op's arguments."""

  def __init__(self, op: str):
    super().__init__()
    self.op = op
    self.source: dict[str, str] = {}


def check_array(dims: Dims, name: str, x: Any, dtype, shape: Sequence[str | int]):
  """Checks ``x``'s dtype and shape, binding symbolic dims in ``dims``.

  Args:
    dims: the op's symbolic dims; names seen first bind, later ones must match.
    name: the argument's name, used in the error.
    x: the array (or tracer).
    dtype: required dtype.
    shape: one entry per axis: an int, or a symbol such as ``"B"``.

  Raises:
    TypeError: wrong dtype. ValueError: wrong rank or size.
  """
  spec = "[" + ", ".join(str(s) for s in shape) + "]"
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{dims.op}: argument '{name}' must be an array of shape {spec}, got {type(x).__name__}")
  if jnp.dtype(x.dtype) != jnp.dtype(dtype):
    raise TypeError(f"{dims.op}: argument '{name}' must have dtype {jnp.dtype(dtype).name}, "
                    f"got {jnp.dtype(x.dtype).name}")
  if len(x.shape) != len(shape):
    raise ValueError(f"{dims.op}: argument '{name}' must have shape {spec} (rank {len(shape)}), got {tuple(x.shape)}")
  for axis, (want, got) in enumerate(zip(shape, x.shape)):
    if isinstance(want, (int, np.integer)):
      if got != want:
        raise ValueError(f"{dims.op}: argument '{name}' must have shape {spec} with axis {axis} = {want}, "
                         f"got {tuple(x.shape)}")
    elif want in dims:
      if got != dims[want]:
        raise ValueError(
            f"{dims.op}: argument '{name}' must have shape {spec} with {want} = {dims[want]} "
            f"(from '{dims.source[want]}'), got {tuple(x.shape)}")
    else:
      dims[want] = got
      dims.source[want] = name


INT32_MAX = 2**31 - 1


def check_int(op: str, name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
  """Checks that a static argument is an integer in ``[low, high]`` and returns it as an ``int``.

  Raises:
    TypeError: not an integer (a float such as ``2.0`` included, a bool too).
    ValueError: out of range.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{op}: argument '{name}' must be an integer, got {type(value).__name__} {value!r}")
  value = int(value)
  if (low is not None and value < low) or (high is not None and value > high):
    bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
    raise ValueError(f"{op}: argument '{name}' must be in {bounds}, got {value}")
  return value


def check_index(op: str, name: str, value: Any, low: int, high: int = INT32_MAX):
  """An integer in ``[low, high]`` given either statically or as a traced integer scalar.

  Returns:
    The ``int``, or the scalar array (its value is the caller's to check: a kernel checks it, or the caller clips
    it).
  """
  if not isinstance(value, (int, np.integer)) and hasattr(value, "shape") and hasattr(value, "dtype"):
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(f"{op}: argument '{name}' must be an integer scalar, got {jnp.dtype(value.dtype).name} "
                      f"of shape {tuple(value.shape)}")
    return value
  return check_int(op, name, value, low, high)


# Weights of the sparse layers' kernels: float32, or bfloat16 (half the bytes per row; sums stay float32).
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_weight(dims: Dims, name: str, x: Any, shape: Sequence[str | int]):
  """:func:`check_array` for a sparse layer's weight: float32 or bfloat16."""
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jnp.dtype(dtype) not in WEIGHT_DTYPES:
    raise TypeError(f"{dims.op}: argument '{name}' must have dtype float32 or bfloat16, got {jnp.dtype(dtype).name}")
  check_array(dims, name, x, dtype if dtype is not None else jnp.float32, shape)
