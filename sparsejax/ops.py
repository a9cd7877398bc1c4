"""Sparse layers as JAX ops backed by C++ FFI kernels, with custom VJPs.

Both sparse layers reduce to two kernels over gathered weight rows:

* ``gather_dot(x, W, ids)[b, j] = <x[b], W[ids[b, j]]>``
* ``gather_combine(g, W, ids)[b] = sum_j g[b, j] * W[ids[b, j]]``

Their weight gradients are row-sparse and are kept as factors
(:class:`RowSparseGrad`): ``dW[ids[b, j]] += g[b, j] * x[b]``. Training code
obtains ``g`` and ``x`` without ever forming a dense ``[N, d]`` array (see
``sparsejax.model``), and :func:`sparsejax.optim.row_sparse_adam` consumes the
factors directly. Id ``-1`` is padding everywhere: it contributes nothing.

Off the CPU (the dense baseline on a GPU: ``--platform=cuda``) XLA compiles
the kernels' ``jnp`` twins (:func:`gather_dot_jnp`, :func:`gather_combine_jnp`)
instead; see :func:`sparsejax._ffi.on_cpu`.

The VJPs below also return the mathematically complete dense cotangents for
the weights, so ``jax.grad`` with respect to a weight is correct (and
checkable against a dense reference). Under ``jax.jit`` they are dead code and
removed whenever that cotangent is not requested, as in a training step.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import _ffi
from sparsejax._checks import Dims, check_array, check_weight
from sparsejax.padding import PAD_ID


class RowSparseGrad(NamedTuple):
  """Gradient of a weight ``W [N, d]`` as factors.

  ``dW = sum_{b, j} g[b, j] * outer(e_{ids[b, j]}, x[b])``; entries with id
  ``-1`` are padding. Duplicate ids are allowed (their rows add up).

  Attributes:
    ids: ``[B, k]`` int32 row ids.
    g: ``[B, k]`` float32 scale of each (b, j) contribution.
    x: ``[B, d]`` float32 row direction shared by sample b.
  """
  ids: jax.Array
  g: jax.Array
  x: jax.Array

  def to_dense(self, num_rows: int) -> jax.Array:
    """The dense ``[num_rows, d]`` gradient (O(N d): for tests and debugging); ids outside ``[0, num_rows)``, the
    padding -1 among them, add nothing."""
    rows = self.g[..., None] * self.x[:, None, :]
    # Dropped, not wrapped: a negative index counts from the end even with mode="drop".
    safe = jnp.where((self.ids < 0) | (self.ids >= num_rows), num_rows, self.ids)
    return jnp.zeros((num_rows, self.x.shape[-1]), self.x.dtype).at[safe].add(rows, mode="drop")


def _gather_dot(x, weight, ids, bias, op, ids_name):
  """The gather_dot kernel (arguments checked by the caller); its errors name `op` and its ids `ids_name`."""
  def kernel(x, weight, ids, bias):
    out = jax.ShapeDtypeStruct(ids.shape, jnp.float32)
    call = _ffi.ffi_call("gather_dot" + _ffi.weight_suffix(weight), out, vmap_method="sequential")
    return call(x, weight, ids, bias, op=op, ids_name=ids_name)

  return _ffi.on_cpu(kernel, gather_dot_jnp, x, weight, ids, bias)


def _gather_combine(g, weight, ids, op, ids_name):
  """The gather_combine kernel (arguments checked by the caller); its errors name `op` and `ids_name`."""
  def kernel(g, weight, ids):
    out = jax.ShapeDtypeStruct((ids.shape[0], weight.shape[1]), jnp.float32)
    call = _ffi.ffi_call("gather_combine" + _ffi.weight_suffix(weight), out, vmap_method="sequential")
    return call(g, weight, ids, op=op, ids_name=ids_name)

  return _ffi.on_cpu(kernel, gather_combine_jnp, g, weight, ids)


def _rows_at(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``table[ids]`` as float32, zero where ``ids`` is outside ``[0, len(table))`` (padding)."""
  if table.shape[0] == 0:  # no rows: every id is out of range (jnp.take refuses to gather from an empty axis)
    return jnp.zeros(ids.shape + table.shape[1:], jnp.float32)
  safe = jnp.where(ids < 0, table.shape[0], ids)  # dropped, not wrapped
  return jnp.take(table, safe, axis=0, mode="fill", fill_value=0).astype(jnp.float32)


def gather_dot_jnp(x, weight, ids, bias):
  """What the gather_dot kernel computes, in ``jnp`` (where there is no kernel: accelerators).

  Unlike the kernel it does not check ``ids``: one outside ``[0, N)`` contributes 0, as padding does.
  ``bias`` may be empty (``[0]``: no bias).
  """
  out = jnp.einsum("bd,bkd->bk", x, _rows_at(weight, ids))
  return out + _rows_at(bias, ids) if bias.shape[0] else out


def gather_combine_jnp(g, weight, ids):
  """What the gather_combine kernel computes, in ``jnp`` (ids outside ``[0, N)`` contribute 0, unchecked)."""
  return jnp.einsum("bk,bkd->bd", g, _rows_at(weight, ids))


_NO_BIAS = np.zeros((0,), np.float32)  # NumPy: no JAX array (nor backend) at import


def _check_gather(op, dense, dense_name, dense_shape, weight, ids):
  dims = Dims(op)
  check_array(dims, "ids", ids, jnp.int32, ("B", "k"))
  check_weight(dims, "weight", weight, ("N", "d"))
  check_array(dims, dense_name, dense, jnp.float32, dense_shape)
  return dims


def gather_dot(x: jax.Array, weight: jax.Array, ids: jax.Array, bias: jax.Array | None = None) -> jax.Array:
  """``out[b, j] = <x[b], weight[ids[b, j]]> + bias[ids[b, j]]`` (0 where ``ids`` is -1).

  Args:
    x: ``[B, d]`` float32.
    weight: ``[N, d]`` float32 or bfloat16.
    ids: ``[B, k]`` int32 in ``[0, N)`` or -1.
    bias: optional ``[N]`` float32, read in the same pass as the rows.

  Returns:
    ``[B, k]`` float32.
  """
  dims = _check_gather("gather_dot", x, "x", ("B", "d"), weight, ids)
  if bias is None:
    bias = _NO_BIAS
  else:
    check_array(dims, "bias", bias, jnp.float32, ("N",))
  return _gather_dot(x, weight, ids, bias, "gather_dot", "ids")


def gather_combine(g: jax.Array, weight: jax.Array, ids: jax.Array) -> jax.Array:
  """``out[b] = sum_j g[b, j] * weight[ids[b, j]]`` (skipping ``ids == -1``).

  Args:
    g: ``[B, k]`` float32.
    weight: ``[N, d]`` float32 or bfloat16.
    ids: ``[B, k]`` int32 in ``[0, N)`` or -1.

  Returns:
    ``[B, d]`` float32.
  """
  _check_gather("gather_combine", g, "g", ("B", "k"), weight, ids)
  return _gather_combine(g, weight, ids, "gather_combine", "ids")


def _scatter_bias(g, ids, n):
  safe = jnp.where(ids == PAD_ID, n, ids)
  return jnp.zeros((n,), g.dtype).at[safe].add(g, mode="drop")


# --- Sparse output layer ------------------------------------------------------

@jax.custom_vjp
def _sparse_logits(h, weight, bias, ids):
  return _gather_dot(h, weight, ids, bias, "sparse_logits", "ids")


def _sparse_logits_fwd(h, weight, bias, ids):
  return _sparse_logits(h, weight, bias, ids), (h, weight, bias, ids)


def _sparse_logits_bwd(res, g):
  h, weight, bias, ids = res
  g = jnp.where(ids == PAD_ID, 0.0, g)
  dh = _gather_combine(g, weight, ids, "sparse_logits", "ids")
  dweight = RowSparseGrad(ids, g, h).to_dense(weight.shape[0]).astype(weight.dtype)  # DCE'd unless asked for
  dbias = _scatter_bias(g, ids, bias.shape[0])
  return dh, dweight, dbias, None


_sparse_logits.defvjp(_sparse_logits_fwd, _sparse_logits_bwd)


def sparse_logits(h: jax.Array, weight: jax.Array, bias: jax.Array, ids: jax.Array) -> jax.Array:
  """Logits of a few output neurons per sample: ``h[b] . W[ids[b, j]] + b[ids[b, j]]``.

  Args:
    h: ``[B, d]`` float32 inputs (hidden activations).
    weight: ``[N, d]`` float32 (or bfloat16) output-layer weights.
    bias: ``[N]`` float32 output-layer biases.
    ids: ``[B, k]`` int32 active neuron ids per sample, in ``[0, N)`` or -1
      (padding, whose logit is 0 and gets no gradient).

  Returns:
    ``[B, k]`` float32 logits. Differentiable in ``h`` (an O(B k d) kernel),
    ``weight`` and ``bias``; the weight gradient for training is
    ``RowSparseGrad(ids, dlogits, h)``.
  """
  dims = _check_gather("sparse_logits", h, "h", ("B", "d"), weight, ids)
  check_array(dims, "bias", bias, jnp.float32, ("N",))
  return _sparse_logits(h, weight, bias, ids)


# --- Sparse input layer (embedding bag) ----------------------------------------

@jax.custom_vjp
def _embedding_bag(feat_ids, feat_vals, weight, bias):
  return _gather_combine(feat_vals, weight, feat_ids, "embedding_bag", "feat_ids") + bias


def _embedding_bag_fwd(feat_ids, feat_vals, weight, bias):
  return _embedding_bag(feat_ids, feat_vals, weight, bias), (feat_ids, feat_vals, weight)


def _embedding_bag_bwd(res, dout):
  feat_ids, feat_vals, weight = res
  dvals = _gather_dot(dout, weight, feat_ids, _NO_BIAS, "embedding_bag", "feat_ids")
  dweight = RowSparseGrad(feat_ids, feat_vals, dout).to_dense(weight.shape[0]).astype(weight.dtype)  # DCE'd if unused
  return None, dvals, dweight, dout.sum(axis=0)


_embedding_bag.defvjp(_embedding_bag_fwd, _embedding_bag_bwd)


def embedding_bag(feat_ids: jax.Array, feat_vals: jax.Array, weight: jax.Array,
                  bias: jax.Array) -> jax.Array:
  """Sparse feature vectors times a weight matrix: ``sum_f v[b, f] W[i[b, f]] + bias``.

  Args:
    feat_ids: ``[B, F]`` int32 feature ids in ``[0, num_features)``, -1 padding.
    feat_vals: ``[B, F]`` float32 feature values (ignored where padded).
    weight: ``[num_features, d]`` float32 or bfloat16.
    bias: ``[d]`` float32.

  Returns:
    ``[B, d]`` float32. The weight gradient for training is
    ``RowSparseGrad(feat_ids, feat_vals, dout)``.
  """
  dims = Dims("embedding_bag")
  check_array(dims, "feat_ids", feat_ids, jnp.int32, ("B", "F"))
  check_array(dims, "feat_vals", feat_vals, jnp.float32, ("B", "F"))
  check_weight(dims, "weight", weight, ("num_features", "d"))
  check_array(dims, "bias", bias, jnp.float32, ("d",))
  return _embedding_bag(feat_ids, feat_vals, weight, bias)
