"""Row-sparse ("lazy") Adam for sparse layers, optax-style.

Only the rows a step touched have their moments and weights updated, by a C++
kernel that writes into the (donated) parameter and moment buffers in place.
Bias correction uses the global step count, as optax's Adam does; untouched
rows keep stale moments (the usual lazy-Adam trade-off, as in TF's LazyAdam).

Example::

  opt = row_sparse_adam(1e-3)
  state = opt.init(weight)                   # weight: [N, d]
  weight, state = opt.update(grad, state, weight)  # grad: RowSparseGrad

Dense parameters keep using plain optax.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax import _ffi
from sparsejax._checks import Dims, check_array
from sparsejax.ops import RowSparseGrad


class RowSparseAdamState(NamedTuple):
  """State of :func:`row_sparse_adam` for one ``[N, d]`` (or ``[N]``) parameter.

  Attributes:
    count: ``[]`` int32 number of updates applied.
    mu: first moments, the parameter's shape.
    nu: second moments, the parameter's shape.
  """
  count: jax.Array
  mu: jax.Array
  nu: jax.Array


class RowSparseOptimizer(NamedTuple):
  """A pair of pure functions, like ``optax.GradientTransformation``.

  ``update`` returns new parameters rather than updates, because the new rows
  are written into the parameter buffer in place.
  """
  init: Callable[[jax.Array], RowSparseAdamState]
  update: Callable[[RowSparseGrad, RowSparseAdamState, jax.Array], tuple[jax.Array, RowSparseAdamState]]


def apply_row_sparse_adam(
    weight: jax.Array, state: RowSparseAdamState, grad: RowSparseGrad,
    learning_rate: jax.Array | float, *, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, weight_decay: float = 0.0, after=None,
) -> tuple[jax.Array, RowSparseAdamState, jax.Array]:
  """One lazy Adam step on the rows named by ``grad.ids``.

  Args:
    weight: ``[N, d]`` float32 parameter, or ``[N]`` (a bias; then ``grad.x``
      is ``[B, 1]``, normally ones).
    state: its :class:`RowSparseAdamState`.
    grad: row-sparse gradient factors (``ids [B, k]``, ``g [B, k]``,
      ``x [B, d]``). Duplicate ids are summed before the update.
    learning_rate: scalar step size (may be traced, e.g. from a schedule).
    b1, b2, eps: Adam's constants (as in ``optax.adam``).
    weight_decay: decoupled (AdamW) weight decay, applied to touched rows only.
    after: optional pytree of values computed from other reads of ``weight``
      in the same step (e.g. the input gradient). The update is ordered after
      them, so that XLA can write ``weight`` in place instead of copying it.

  Returns:
    ``(new_weight, new_state, touched)`` where ``touched`` is ``[B * k]``
    int32: the distinct updated row ids in increasing order, then -1s.
  """
  dims = Dims("row_sparse_adam")
  if weight.ndim == 1:  # a bias: rows of width 1
    check_array(dims, "weight", weight, jnp.float32, ("N",))
    dims["d"], dims.source["d"] = 1, "weight"
  else:
    check_array(dims, "weight", weight, jnp.float32, ("N", "d"))
  for name, moment in (("state.mu", state.mu), ("state.nu", state.nu)):
    if moment.shape != weight.shape or moment.dtype != jnp.float32:
      raise ValueError(f"row_sparse_adam: argument '{name}' must be float32 of the weight's shape "
                       f"{tuple(weight.shape)}, got {moment.dtype} {tuple(moment.shape)}")
  check_array(dims, "grad.ids", grad.ids, jnp.int32, ("B", "k"))
  check_array(dims, "grad.g", grad.g, jnp.float32, ("B", "k"))
  check_array(dims, "grad.x", grad.x, jnp.float32, ("B", "d"))
  count = state.count + 1
  lr = jnp.asarray(learning_rate, jnp.float32)
  shapes = (jax.ShapeDtypeStruct(weight.shape, jnp.float32),) * 3 + (
      jax.ShapeDtypeStruct((grad.ids.size,), jnp.int32),)
  call = _ffi.ffi_call("row_sparse_adam", shapes, input_output_aliases={0: 0, 1: 1, 2: 2})
  new_w, mu, nu, touched = call(
      weight, state.mu, state.nu, grad.ids, grad.g, grad.x, lr, count.astype(jnp.int32),
      # XLA may only overwrite `weight` once every read of it is done. Passing
      # values computed from those reads (unread by the kernel) makes that
      # order explicit, which spares a defensive O(N d) copy.
      *jax.tree.leaves(after),
      b1=np.float32(b1), b2=np.float32(b2), eps=np.float32(eps), weight_decay=np.float32(weight_decay))
  return new_w, RowSparseAdamState(count, mu, nu), touched


def row_sparse_adam(
    learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, weight_decay: float = 0.0,
) -> RowSparseOptimizer:
  """Lazy Adam over the rows a :class:`RowSparseGrad` touches.

  Args:
    learning_rate: a float or an optax schedule ``step -> lr`` (called with
      the number of updates already applied, like optax).
    b1, b2, eps: Adam's constants.
    weight_decay: decoupled weight decay on touched rows.

  Returns:
    A :class:`RowSparseOptimizer`. Jit the caller with the parameter and state
    donated to update them in place; the caller must return them in the order
    it takes them (``step(W, state, ...) -> (W, state, ...)``), because jit
    pairs donated inputs with same-shaped outputs in order, and a mismatch
    costs an O(N d) copy.
  """

  def init(weight: jax.Array) -> RowSparseAdamState:
    return RowSparseAdamState(jnp.zeros((), jnp.int32), jnp.zeros_like(weight), jnp.zeros_like(weight))

  def update(grad: RowSparseGrad, state: RowSparseAdamState, weight: jax.Array, after=None):
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    new_w, new_state, _ = apply_row_sparse_adam(
        weight, state, grad, lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, after=after)
    return new_w, new_state

  return RowSparseOptimizer(init, update)
