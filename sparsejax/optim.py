"""Row-sparse ("lazy") Adam for sparse layers, optax-style.

Only the rows a step touched have their moments and weights updated, by a C++
kernel that writes into the (donated) parameter and moment buffers in place.
Bias correction uses the global step count, as optax's Adam does; untouched
rows keep stale moments (the usual lazy-Adam trade-off, as in TF's LazyAdam).

Example::

  opt = row_sparse_adam(1e-3)
  state = opt.init(weight)                   # weight: [N, d]
  weight, state = opt.update(grad, state, weight)  # grad: RowSparseGrad

  # A sparse linear layer's weight and bias, updated in one pass:
  state = opt.init((weight, bias))
  (weight, bias), state = opt.update(grad, state, (weight, bias))

Dense parameters keep using plain optax.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax import _ffi
from sparsejax._checks import Dims, check_array, check_weight
from sparsejax.ops import RowSparseGrad

# The moment dtypes the row_sparse_adam kernel implements.
MOMENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Second moments: one per element (Adam), or one per row (row-wise Adam).
SECOND_MOMENTS = ("element", "row")


class RowSparseAdamState(NamedTuple):
  """State of :func:`row_sparse_adam` for one ``[N, d]`` (or ``[N]``) parameter.

  Attributes:
    count: ``[]`` int32 number of updates applied.
    mu: first moments, the parameter's shape.
    nu: second moments, the parameter's shape; or ``[N]`` for a ``[N, d]``
      weight under row-wise Adam (one second moment per row).
  """
  count: jax.Array
  mu: jax.Array
  nu: jax.Array


class RowSparseOptimizer(NamedTuple):
  """A pair of pure functions, like ``optax.GradientTransformation``.

  ``update`` returns new parameters rather than updates, because the new rows
  are written into the parameter buffer in place.
  """
  init: Callable
  update: Callable


def _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay) -> None:
  """Static hyperparameters: Adam's constants in range, all finite (a traced learning rate is not checked)."""
  for name, value, low, high in (("b1", b1, 0.0, 1.0), ("b2", b2, 0.0, 1.0), ("eps", eps, 0.0, math.inf),
                                 ("weight_decay", weight_decay, -math.inf, math.inf)):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
      raise TypeError(f"row_sparse_adam: argument '{name}' must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and low <= value < high):
      raise ValueError(f"row_sparse_adam: argument '{name}' must be finite and in [{low}, {high}), got {value}")
  if isinstance(learning_rate, (int, float, np.integer, np.floating)) and not math.isfinite(learning_rate):
    raise ValueError(f"row_sparse_adam: argument 'learning_rate' must be finite, got {learning_rate}")


def apply_row_sparse_adam(
    params, state, grad: RowSparseGrad, learning_rate: jax.Array | float, *,
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
    after=None, combine: bool = False,
):
  """One lazy Adam step on the rows named by ``grad.ids``.

  Args:
    params: a ``[N, d]`` float32 weight; or ``[N]`` (a bias on its own, then
      ``grad.x`` is ``[B, 1]``, normally ones); or a pair ``(weight [N, d],
      bias [N])`` of one sparse linear layer, whose bias gradient is implied
      (``db[ids[b, j]] += g[b, j]``). A pair is updated in one pass that sorts
      the ids once and fetches each row's weight and bias together.
    state: the :class:`RowSparseAdamState` of ``params`` (a pair of them for
      a pair). Moments are float32 or bfloat16 (see :func:`row_sparse_adam`).
      A weight's ``nu`` of shape ``[N]`` selects row-wise Adam. The weight
      may be bfloat16 (half the bytes per touched row): it is updated in
      float32 and stored rounded stochastically, with bits hashed from
      (step, row, column) like bfloat16 moments'; a bias stays float32.
    grad: row-sparse gradient factors (``ids [B, k]``, ``g [B, k]``,
      ``x [B, d]``) of the weight. Duplicate ids are summed before the update.
    learning_rate: scalar step size (may be traced, e.g. from a schedule).
    b1, b2, eps: Adam's constants (as in ``optax.adam``).
    weight_decay: decoupled (AdamW) weight decay, applied to touched rows only.
    after: optional pytree of values computed from other reads of the weight
      in the same step (e.g. the input gradient). The update is ordered after
      them, so that XLA can write the weight in place instead of copying it.
    combine: also return ``combined [B, d]``, ``combined[b] = sum_j
      grad.g[b, j] * weight[grad.ids[b, j]]`` with the weight read before
      this update: for a sparse layer whose ``g`` is the cotangent of
      ``ops.sparse_logits(x, weight, bias, ids)``, the gradient with respect
      to its input ``x`` (what ``ops.gather_combine`` gives), computed in the
      same pass over the rows, which saves the separate gather's read of
      every row. Its summation order differs from ``gather_combine``'s (so
      may its last bits); it does not depend on the thread count.

  Returns:
    ``(new_params, new_state, touched)``, the first two shaped like
    ``params`` and ``state``; ``touched`` is ``[B * k]`` int32: the distinct
    updated row ids in increasing order, then -1s. With ``combine``,
    ``(new_params, new_state, touched, combined)``.
  """
  op = "row_sparse_adam"
  is_pair = isinstance(params, (tuple, list))
  if is_pair and (len(params) != 2 or not isinstance(state, (tuple, list)) or len(state) != 2):
    raise TypeError(f"{op}: a (weight, bias) pair of params needs a pair of states, got {len(params)} params "
                    f"and a state of type {type(state).__name__}")
  weight, bias = params if is_pair else (params, None)
  if not all(hasattr(p, "ndim") for p in ((weight, bias) if is_pair else (weight,))):  # e.g. an optax-style dict
    raise TypeError(f"{op}: argument 'params' must be an [N, d] weight, an [N] bias or a (weight, bias) pair of "
                    f"arrays, got {type(params).__name__}")
  w_state, b_state = state if is_pair else (state, None)
  for name, s in (("state", w_state), ("bias state", b_state)):
    if s is not None and not isinstance(s, RowSparseAdamState):
      raise TypeError(f"{op}: argument '{name}' must be a RowSparseAdamState, got {type(s).__name__}")
  if not isinstance(grad, RowSparseGrad):
    raise TypeError(f"{op}: argument 'grad' must be a RowSparseGrad, got {type(grad).__name__}")
  _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay)
  dims = Dims(op)
  if getattr(weight, "ndim", None) == 1 and not is_pair:  # a bias on its own: rows of width 1
    check_weight(dims, "weight", weight, ("N",))
    dims["d"], dims.source["d"] = 1, "weight"
  else:
    check_weight(dims, "weight", weight, ("N", "d"))
  moment_dtype = getattr(w_state.mu, "dtype", None)
  if moment_dtype not in MOMENT_DTYPES:
    raise ValueError(f"row_sparse_adam: argument 'state.mu' must be float32 or bfloat16, got {moment_dtype}")
  rowwise = weight.ndim == 2 and getattr(w_state.nu, "ndim", None) == 1
  moments = [("state.mu", w_state.mu, weight.shape), ("state.nu", w_state.nu, weight.shape[:1] if rowwise else
                                                      weight.shape)]
  if is_pair:
    check_array(dims, "bias", bias, jnp.float32, ("N",))
    moments += [("bias state.mu", b_state.mu, bias.shape), ("bias state.nu", b_state.nu, bias.shape)]
  else:
    empty = jnp.zeros((0,), jnp.float32)
    bias, b_state = empty, RowSparseAdamState(w_state.count, empty.astype(moment_dtype), empty.astype(moment_dtype))
  for name, moment, shape in moments:
    if getattr(moment, "shape", None) != shape or getattr(moment, "dtype", None) != moment_dtype:
      raise ValueError(f"row_sparse_adam: argument '{name}' must be {moment_dtype} of shape "
                       f"{tuple(shape)} (its parameter's shape and the moments' dtype), "
                       f"got {getattr(moment, 'dtype', type(moment).__name__)} {getattr(moment, 'shape', '')}")
  check_array(dims, "grad.ids", grad.ids, jnp.int32, ("B", "k"))
  check_array(dims, "grad.g", grad.g, jnp.float32, ("B", "k"))
  check_array(dims, "grad.x", grad.x, jnp.float32, ("B", "d"))
  count = w_state.count + 1
  lr = jnp.asarray(learning_rate, jnp.float32)
  shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                 for a in (weight, w_state.mu, w_state.nu, bias, b_state.mu, b_state.nu))
  d = 1 if weight.ndim == 1 else weight.shape[1]
  shapes += (jax.ShapeDtypeStruct((grad.ids.size,), jnp.int32),
             jax.ShapeDtypeStruct((grad.ids.shape[0] if combine else 0, d), jnp.float32))
  # One kernel per moment dtype (the C++ handlers are typed).
  call = _ffi.ffi_call(f"row_sparse_adam_{jnp.dtype(moment_dtype).name}{_ffi.weight_suffix(weight)}", shapes,
                       input_output_aliases={i: i for i in range(6)}, vmap_method="sequential")
  new_w, mu, nu, new_b, b_mu, b_nu, touched, combined = call(
      weight, w_state.mu, w_state.nu, bias, b_state.mu, b_state.nu,
      grad.ids, grad.g, grad.x, lr, count.astype(jnp.int32),
      # XLA may only overwrite `weight` once every read of it is done. Passing
      # values computed from those reads (unread by the kernel) makes that
      # order explicit, which spares a defensive O(N d) copy.
      *jax.tree.leaves(after),
      b1=np.float32(b1), b2=np.float32(b2), eps=np.float32(eps), weight_decay=np.float32(weight_decay))
  new_w_state = RowSparseAdamState(count, mu, nu)
  if is_pair:
    new_params, new_state = (new_w, new_b), (new_w_state, RowSparseAdamState(b_state.count + 1, b_mu, b_nu))
  else:
    new_params, new_state = new_w, new_w_state
  return (new_params, new_state, touched) + ((combined,) if combine else ())


def row_sparse_adam(
    learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, weight_decay: float = 0.0, moment_dtype=jnp.float32, second_moment: str = "element",
) -> RowSparseOptimizer:
  """Lazy Adam over the rows a :class:`RowSparseGrad` touches.

  Args:
    learning_rate: a float or an optax schedule ``step -> lr`` (called with
      the number of updates already applied, like optax).
    b1, b2, eps: Adam's constants.
    weight_decay: decoupled weight decay on touched rows.
    moment_dtype: ``jnp.float32`` or ``jnp.bfloat16``. bfloat16 moments halve
      the optimizer's memory and the bytes a step moves; they are rounded
      stochastically (unbiased) with bits hashed from (step, row, column), so
      runs stay deterministic. The weight update itself uses the unrounded
      float32 moments.
    second_moment: ``"element"`` (Adam) or ``"row"``: row-wise Adam, as
      FBGEMM's row-wise optimizers, keeps one second moment per row of a
      ``[N, d]`` weight, ``nu = b2 nu + (1 - b2) mean_i(g_i^2)``, and scales
      the whole row's step by it: a third fewer bytes per touched row than
      Adam's three ``[N, d]`` arrays. A bias (``[N]``) is unaffected.

  Returns:
    A :class:`RowSparseOptimizer`. Jit the caller with the parameter and state
    donated to update them in place; the caller must return them in the order
    it takes them (``step(W, state, ...) -> (W, state, ...)``), because jit
    pairs donated inputs with same-shaped outputs in order, and a mismatch
    costs an O(N d) copy.
  """

  if jnp.dtype(moment_dtype) not in MOMENT_DTYPES:
    raise ValueError(f"row_sparse_adam: moment_dtype must be float32 or bfloat16, got {jnp.dtype(moment_dtype)}")
  if second_moment not in SECOND_MOMENTS:
    raise ValueError(f"row_sparse_adam: second_moment must be one of {SECOND_MOMENTS}, got {second_moment!r}")
  _check_hyperparameters(None if callable(learning_rate) else learning_rate, b1, b2, eps, weight_decay)

  def init_one(p: jax.Array) -> RowSparseAdamState:
    # Two distinct buffers: both are donated to the in-place update.
    nu_shape = p.shape[:1] if second_moment == "row" else p.shape  # a bias [N]: the same either way
    return RowSparseAdamState(jnp.zeros((), jnp.int32), jnp.zeros(p.shape, moment_dtype),
                              jnp.zeros(nu_shape, moment_dtype))

  def init(params):
    """State for a weight, a bias, or a ``(weight, bias)`` pair."""
    pieces = tuple(params) if isinstance(params, (tuple, list)) else (params,)
    if not 1 <= len(pieces) <= 2 or not all(getattr(p, "ndim", None) in (1, 2) for p in pieces):
      # an optax-style dict of parameters: one sparse layer's rows are what this optimizer updates
      raise TypeError("row_sparse_adam.init: params must be an [N, d] weight, an [N] bias or a (weight, bias) pair "
                      f"of arrays, got {type(params).__name__}")
    return tuple(map(init_one, pieces)) if isinstance(params, (tuple, list)) else init_one(params)

  def update(grad: RowSparseGrad, state, params, after=None, combine=False):
    """``(new_params, new_state)``, and ``combined`` with ``combine`` (see :func:`apply_row_sparse_adam`)."""
    states = (state,) if isinstance(state, RowSparseAdamState) else state
    if not isinstance(states, (tuple, list)) or not states or \
        not all(isinstance(s, RowSparseAdamState) for s in states):
      raise TypeError("row_sparse_adam.update: argument 'state' must be what init gave (a RowSparseAdamState, or a "
                      f"pair of them for a (weight, bias) pair), got {type(state).__name__}")
    count = states[0].count
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    out = apply_row_sparse_adam(
        params, state, grad, lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, after=after, combine=combine)
    return out[:2] + out[3:]

  return RowSparseOptimizer(init, update)


def round_stochastically(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
  """``x`` (float32) in ``dtype``; to bfloat16 rounded stochastically (unbiased), as the row-sparse kernel does.

  Round-to-nearest would lose every update below half a bfloat16 step (Adam's second moment would freeze).
  """
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    return x.astype(dtype)
  u = jax.lax.bitcast_convert_type(x, jnp.uint32)
  finite = (u & 0x7F800000) != 0x7F800000
  u = jnp.where(finite, u + (jax.random.bits(key, x.shape, jnp.uint32) & 0xFFFF), u)
  return jax.lax.bitcast_convert_type((u >> 16).astype(jnp.uint16), jnp.bfloat16)


def adam_all_rows(params, states, grads, lr, key, *, b1, b2, eps, weight_decay):
  """Adam on every row of ``params`` (the exact step): what :func:`apply_row_sparse_adam`'s kernel does when every
  row is touched, in portable jnp (the all-rows twin of the kernel, as ``ops.gather_dot_jnp`` is of its kernel).

  ``key`` draws the bits that round bfloat16 weights and moments.
  """
  count = states[0].count + 1
  t = count.astype(jnp.float32)
  inv_bc1, inv_bc2 = 1.0 / (1.0 - b1 ** t), 1.0 / (1.0 - b2 ** t)
  new_params, new_states = [], []
  for i, (w, state, g) in enumerate(zip(params, states, grads)):
    k_w, k_mu, k_nu = jax.random.split(jax.random.fold_in(key, i), 3)
    mu = b1 * state.mu.astype(jnp.float32) + (1.0 - b1) * g
    rowwise = w.ndim == 2 and state.nu.ndim == 1  # row-wise Adam: one second moment per row, of mean(g^2)
    nu = b2 * state.nu.astype(jnp.float32) + (1.0 - b2) * (jnp.mean(g * g, axis=1) if rowwise else g * g)
    denom = jnp.sqrt(nu * inv_bc2) + eps
    w32 = w.astype(jnp.float32)
    w32 = w32 - lr * ((mu * inv_bc1) / (denom[:, None] if rowwise else denom) + weight_decay * w32)
    new_params.append(round_stochastically(w32, w.dtype, k_w))
    new_states.append(RowSparseAdamState(state.count + 1, round_stochastically(mu, state.mu.dtype, k_mu),
                                               round_stochastically(nu, state.nu.dtype, k_nu)))
  return tuple(new_params), tuple(new_states)
