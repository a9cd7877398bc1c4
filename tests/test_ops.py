"""Sparse layers against dense jnp references: values, gradients, jit, errors."""

import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from sparsejax import ops, optim

jax.config.update("jax_enable_x64", False)


def _data(B=6, d=12, N=40, k=9, seed=0, pad=True):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(B, d)), jnp.float32)
  W = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  ids = rng.integers(0, N, size=(B, k)).astype(np.int32)
  ids[0, 0] = ids[0, 1]  # a duplicate within a row
  if pad:
    ids[1, -2:] = -1  # padding
  return h, W, b, jnp.asarray(ids)


def _dense_logits(h, W, b, ids):
  vals = jnp.einsum("bd,bkd->bk", h, W[jnp.maximum(ids, 0)]) + b[jnp.maximum(ids, 0)]
  return jnp.where(ids < 0, 0.0, vals)


def test_gather_dot_and_combine_match_dense():
  h, W, _, ids = _data()
  g = jnp.asarray(np.random.default_rng(1).normal(size=ids.shape), jnp.float32)
  rows = jnp.where((ids >= 0)[..., None], W[jnp.maximum(ids, 0)], 0.0)
  np.testing.assert_allclose(ops.gather_dot(h, W, ids), jnp.einsum("bd,bkd->bk", h, rows), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ops.gather_combine(g, W, ids), jnp.einsum("bk,bkd->bd", g, rows), rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_give_the_float32_products_of_their_values():
  """A bfloat16 weight is widened exactly and summed in the same order: the bits of its float32 copy's results."""
  h, W, b, ids = _data()
  Wb = W.astype(jnp.bfloat16)
  W32 = Wb.astype(jnp.float32)
  g = jnp.asarray(np.random.default_rng(1).normal(size=ids.shape), jnp.float32)
  np.testing.assert_array_equal(ops.gather_dot(h, Wb, ids, b), ops.gather_dot(h, W32, ids, b))
  np.testing.assert_array_equal(ops.gather_combine(g, Wb, ids), ops.gather_combine(g, W32, ids))
  np.testing.assert_allclose(ops.sparse_logits(h, Wb, b, ids), _dense_logits(h, W32, b, ids), rtol=1e-5, atol=1e-5)
  dh, dW = jax.grad(lambda h, W: jnp.sum(ops.sparse_logits(h, W, b, ids) * g), argnums=(0, 1))(h, Wb)
  assert dW.dtype == jnp.bfloat16
  np.testing.assert_array_equal(dh, ops.gather_combine(jnp.where(ids < 0, 0.0, g), W32, ids))
  fids, fvals = ids[:, :4], jnp.abs(g[:, :4])
  np.testing.assert_array_equal(ops.embedding_bag(fids, fvals, Wb, b[:12]), ops.embedding_bag(fids, fvals, W32, b[:12]))


def test_sparse_logits_forward_and_jit():
  h, W, b, ids = _data()
  ref = _dense_logits(h, W, b, ids)
  np.testing.assert_allclose(ops.sparse_logits(h, W, b, ids), ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jax.jit(ops.sparse_logits)(h, W, b, ids), ref, rtol=1e-5, atol=1e-5)
  assert float(ops.sparse_logits(h, W, b, ids)[1, -1]) == 0.0  # padding


def test_sparse_logits_grads_match_dense_reference():
  h, W, b, ids = _data()
  g = jnp.asarray(np.random.default_rng(2).normal(size=ids.shape), jnp.float32)
  f = lambda h, W, b: jnp.sum(ops.sparse_logits(h, W, b, ids) * g)
  f_ref = lambda h, W, b: jnp.sum(_dense_logits(h, W, b, ids) * g)
  for got, want in zip(jax.grad(f, argnums=(0, 1, 2))(h, W, b), jax.grad(f_ref, argnums=(0, 1, 2))(h, W, b)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  check_grads(lambda h, W, b: ops.sparse_logits(h, W, b, ids), (h, W, b), order=1, modes=["rev"],
              atol=1e-2, rtol=1e-2)


def test_row_sparse_grad_factors_equal_dense_weight_grad():
  h, W, b, ids = _data()
  g = jnp.asarray(np.random.default_rng(3).normal(size=ids.shape), jnp.float32)
  dense = jax.grad(lambda W: jnp.sum(_dense_logits(h, W, b, ids) * g))(W)
  np.testing.assert_allclose(ops.RowSparseGrad(ids, jnp.where(ids < 0, 0, g), h).to_dense(W.shape[0]), dense,
                             rtol=1e-5, atol=1e-5)
  # Ids outside [0, N) add nothing, whatever their sign (a fresh-user review: -3 wrapped to row N - 3).
  N = W.shape[0]
  outside = ops.RowSparseGrad(jnp.asarray([[-3, N + 5, 1]], jnp.int32), jnp.ones((1, 3), jnp.float32), h[:1])
  want = np.zeros((N, h.shape[1]), np.float32)
  want[1] = h[0]
  np.testing.assert_array_equal(outside.to_dense(N), want)


def _dense_bag(fids, fvals, W, bias):
  rows = jnp.where((fids >= 0)[..., None], W[jnp.maximum(fids, 0)], 0.0)
  return jnp.einsum("bf,bfd->bd", fvals, rows) + bias


def test_embedding_bag_forward_and_grads():
  rng = np.random.default_rng(4)
  B, F, nf, d = 5, 7, 30, 8
  fids = rng.integers(0, nf, size=(B, F)).astype(np.int32)
  fids[2, 4:] = -1
  fids, fvals = jnp.asarray(fids), jnp.asarray(rng.random((B, F)), jnp.float32)
  W = jnp.asarray(rng.normal(size=(nf, d)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
  np.testing.assert_allclose(ops.embedding_bag(fids, fvals, W, bias), _dense_bag(fids, fvals, W, bias),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jax.jit(ops.embedding_bag)(fids, fvals, W, bias), _dense_bag(fids, fvals, W, bias),
                             rtol=1e-5, atol=1e-5)
  cot = jnp.asarray(rng.normal(size=(B, d)), jnp.float32)
  f = lambda v, W, b: jnp.sum(ops.embedding_bag(fids, v, W, b) * cot)
  f_ref = lambda v, W, b: jnp.sum(_dense_bag(fids, v, W, b) * cot)
  got, want = jax.grad(f, argnums=(0, 1, 2))(fvals, W, bias), jax.grad(f_ref, argnums=(0, 1, 2))(fvals, W, bias)
  np.testing.assert_allclose(got[0], jnp.where(fids < 0, 0, want[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5)
  # Row-sparse factor form of the weight gradient.
  np.testing.assert_allclose(ops.RowSparseGrad(fids, fvals, cot).to_dense(nf), want[1], rtol=1e-5, atol=1e-5)
  check_grads(lambda v, W, b: ops.embedding_bag(fids, v, W, b), (fvals, W, bias), order=1, modes=["rev"],
              atol=1e-2, rtol=1e-2)


def test_training_step_has_no_dense_weight_work():
  """A jitted step (logits, loss, dh, row-sparse Adam) holds no [N, d] temporary."""
  N, d, B, k = 5003, 24, 4, 16
  h, W, b, ids = _data(B=B, d=d, N=N, k=k, pad=False)
  opt = optim.row_sparse_adam(1e-2)

  def step(W, b, sw, sb, h, ids):
    def loss(h, tap):
      logits = ops.sparse_logits(h, W, b, ids) + tap
      return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0])
    dh, g = jax.grad(loss, argnums=(0, 1))(h, jnp.zeros((B, k)))
    W, sw = opt.update(ops.RowSparseGrad(ids, g, h), sw, W, after=dh)
    b, sb = opt.update(ops.RowSparseGrad(ids, g, jnp.ones((B, 1))), sb, b)
    return W, b, sw, sb, dh

  compiled = jax.jit(step, donate_argnums=(0, 1, 2, 3)).lower(W, b, opt.init(W), opt.init(b), h, ids).compile()
  hlo = compiled.as_text()
  big = [l.strip() for l in hlo.splitlines()
         if re.search(rf"= f32\[{N},{d}\]", l) and not re.search(r"parameter\(|get-tuple-element\(|bitcast\(", l)]
  # Only the three in-place Adam outputs (one custom call) are [N, d].
  assert all("custom-call" in l and "row_sparse_adam" in l for l in big), big
  assert "scatter" not in hlo
  assert not re.search(rf"= f32\[{N}\]\S* (copy|broadcast|scatter)", hlo)


@pytest.mark.parametrize("bad,pattern", [
    (lambda h, W, b, ids: (h, W, b, ids.at[0, 3].set(40)), r"'ids' has id 40 .*row 0, column 3.*N = 40"),
    (lambda h, W, b, ids: (h, W, b, ids.at[2, 1].set(-3)), r"'ids' has id -3"),
])
def test_out_of_range_ids_raise(bad, pattern):
  args = bad(*_data())
  with pytest.raises(Exception, match=pattern):
    jax.block_until_ready(ops.sparse_logits(*args))
  with pytest.raises(Exception, match=pattern):
    jax.block_until_ready(jax.jit(ops.sparse_logits)(*args))


def test_wrong_dtype_and_shape_raise_named_errors():
  h, W, b, ids = _data()
  with pytest.raises(TypeError, match="'ids' must have dtype int32, got float32"):
    ops.sparse_logits(h, W, b, ids.astype(jnp.float32))
  with pytest.raises(TypeError, match="'weight' must have dtype float32 or bfloat16, got float16"):
    ops.sparse_logits(h, W.astype(jnp.float16), b, ids)
  with pytest.raises(TypeError, match="'bias' must have dtype float32, got bfloat16"):  # bfloat16: weights only
    ops.sparse_logits(h, W.astype(jnp.bfloat16), b.astype(jnp.bfloat16), ids)
  with pytest.raises(ValueError, match=r"'h' must have shape \[B, d\] with d = 12 \(from 'weight'\), got \(6, 5\)"):
    ops.sparse_logits(h[:, :5], W, b, ids)
  with pytest.raises(ValueError, match=r"'bias' must have shape \[N\] with N = 40"):
    ops.sparse_logits(h, W, b[:-1], ids)
  with pytest.raises(ValueError, match=r"'h' must have shape \[B, d\] with B = 6 \(from 'ids'\)"):
    ops.sparse_logits(h[:4], W, b, ids)
  with pytest.raises(ValueError, match=r"'feat_vals' must have shape \[B, F\]"):
    ops.embedding_bag(ids, jnp.ones((6, 3)), W, b[:12])


def test_ffi_handler_validates_even_without_wrapper_checks():
  """The C++ side rejects bad shapes by itself (callers may bypass the wrappers)."""
  from sparsejax import _ffi
  h, W, b, ids = _data()
  call = _ffi.ffi_call("gather_dot", jax.ShapeDtypeStruct(ids.shape, jnp.float32))
  no_bias = jnp.zeros((0,), jnp.float32)
  with pytest.raises(Exception, match=r"gather_dot: argument 'x' must have shape \[B, d\] with d = 12 "
                                     r"\(from 'weight'\), got \[6, 5\]"):
    jax.block_until_ready(call(h[:, :5], W, ids, no_bias))
  with pytest.raises(Exception, match=r"argument 'ids' must have dtype int32, got float32"):
    jax.block_until_ready(call(h, W, ids.astype(jnp.float32), no_bias))
  with pytest.raises(Exception, match=r"gather_dot: argument 'bias' must have shape \[N\] "
                                     r"\(or \[0\] for none\) with N = 40 .*got \[7\]"):
    jax.block_until_ready(call(h, W, ids, b[:7]))


def test_empty_batch():
  _, W, b, _ = _data()
  out = ops.sparse_logits(jnp.zeros((0, 12)), W, b, jnp.zeros((0, 9), jnp.int32))
  assert out.shape == (0, 9)
  assert ops.gather_combine(jnp.zeros((0, 9)), W, jnp.zeros((0, 9), jnp.int32)).shape == (0, 12)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_gather_and_adam_kernels_keep_their_prefetches():
  """GCC silently deletes loops that only hold __builtin_prefetch; the kernels must still prefetch."""
  from sparsejax import _sparsejax
  asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", _sparsejax.__file__],
                       capture_output=True, text=True, check=True).stdout
  counts = {}
  name = ""
  for line in asm.splitlines():
    if line.endswith(">:"):
      name = line
    elif "prefetch" in line:
      for kernel in ("GatherDotRows", "GatherCombineRows", "UpdateRanges"):
        if kernel in name:
          counts[kernel] = counts.get(kernel, 0) + 1
  assert set(counts) == {"GatherDotRows", "GatherCombineRows", "UpdateRanges"}, counts
