"""Row-sparse Adam against optax and a NumPy lazy-Adam reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsejax import optim
from sparsejax.ops import RowSparseGrad


def _grad(rng, B=5, k=6, N=30, d=4):
  ids = rng.integers(0, N, size=(B, k)).astype(np.int32)
  ids[0, :3] = ids[1, 0]  # duplicates within and across samples
  ids[2, -1] = -1  # padding
  return RowSparseGrad(jnp.asarray(ids), jnp.asarray(rng.normal(size=(B, k)), jnp.float32),
                       jnp.asarray(rng.normal(size=(B, d)), jnp.float32))


def _lazy_adam_reference(W, grads, lrs, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
  W = np.asarray(W, np.float64).copy()
  m, v = np.zeros_like(W), np.zeros_like(W)
  for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
    dense = np.asarray(g.to_dense(W.shape[0]), np.float64)
    rows = np.unique(np.asarray(g.ids)[np.asarray(g.ids) >= 0])
    m[rows] = b1 * m[rows] + (1 - b1) * dense[rows]
    v[rows] = b2 * v[rows] + (1 - b2) * dense[rows] ** 2
    mhat, vhat = m[rows] / (1 - b1**t), v[rows] / (1 - b2**t)
    W[rows] -= lr * (mhat / (np.sqrt(vhat) + eps) + wd * W[rows])
  return W


def test_first_step_equals_optax_adam():
  rng = np.random.default_rng(0)
  W = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
  g = _grad(rng)
  opt = optim.row_sparse_adam(0.1)
  new_w, state = opt.update(g, opt.init(W), W)
  dense = optax.adam(0.1)
  upd, _ = dense.update(g.to_dense(30), dense.init(W), W)
  np.testing.assert_allclose(new_w, optax.apply_updates(W, upd), rtol=1e-5, atol=1e-6)
  assert int(state.count) == 1


def test_multi_step_matches_lazy_reference_with_schedule_and_decay():
  rng = np.random.default_rng(1)
  W0 = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
  grads = [_grad(rng) for _ in range(6)]
  schedule = optax.linear_schedule(0.05, 0.01, 6)
  opt = optim.row_sparse_adam(schedule, weight_decay=0.1)
  update = jax.jit(opt.update, donate_argnums=(1, 2))
  W, state = jnp.array(W0, copy=True), opt.init(W0)
  for g in grads:
    W, state = update(g, state, W)
  ref = _lazy_adam_reference(W0, grads, [float(schedule(t)) for t in range(6)], wd=0.1)
  np.testing.assert_allclose(W, ref, rtol=1e-4, atol=1e-5)
  # Rows never touched are exactly unchanged.
  touched = np.unique(np.concatenate([np.asarray(g.ids).ravel() for g in grads]))
  untouched = np.setdiff1d(np.arange(30), touched)
  assert len(untouched) > 0
  np.testing.assert_array_equal(np.asarray(W)[untouched], np.asarray(W0)[untouched])


def test_bias_vector_and_touched_ids():
  rng = np.random.default_rng(2)
  b0 = jnp.asarray(rng.normal(size=(30,)), jnp.float32)
  g = _grad(rng, d=1)
  g = g._replace(x=jnp.ones((5, 1)))
  state = optim.row_sparse_adam(0.1).init(b0)
  b, state, touched = optim.apply_row_sparse_adam(b0, state, g, 0.1)
  ref = _lazy_adam_reference(b0[:, None], [g], [0.1])[:, 0]
  np.testing.assert_allclose(b, ref, rtol=1e-5, atol=1e-6)
  ids = np.asarray(g.ids)
  want = np.unique(ids[ids >= 0])
  np.testing.assert_array_equal(np.asarray(touched)[:len(want)], want)
  assert np.all(np.asarray(touched)[len(want):] == -1)


def test_update_is_in_place_when_donated():
  rng = np.random.default_rng(3)
  W = jnp.asarray(rng.normal(size=(1000, 8)), jnp.float32)
  opt = optim.row_sparse_adam(0.1)
  state = opt.init(W)
  ptrs = (W.unsafe_buffer_pointer(), state.mu.unsafe_buffer_pointer(), state.nu.unsafe_buffer_pointer())
  # Donated inputs pair with outputs of the same shape in order: a step that
  # takes and returns (W, state) in one order updates truly in place.
  step = jax.jit(lambda W, state, g: opt.update(g, state, W), donate_argnums=(0, 1))
  g = _grad(rng, N=1000, d=8)
  W, state = step(W, state, g)
  assert (W.unsafe_buffer_pointer(), state.mu.unsafe_buffer_pointer(), state.nu.unsafe_buffer_pointer()) == ptrs


def test_bad_arguments_raise_and_leave_weights_unchanged():
  rng = np.random.default_rng(4)
  W = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
  opt = optim.row_sparse_adam(0.1)
  state = opt.init(W)
  g = _grad(rng)
  with pytest.raises(Exception, match=r"row_sparse_adam: argument 'ids' has id 30 .*N = 30"):
    jax.block_until_ready(opt.update(g._replace(ids=g.ids.at[3, 2].set(30)), state, W))
  with pytest.raises(Exception, match=r"'ids' has id -2"):
    jax.block_until_ready(opt.update(g._replace(ids=g.ids.at[3, 2].set(-2)), state, W))
  np.testing.assert_array_equal(W, W)  # W is still alive (not donated) and valid
  with pytest.raises(ValueError, match=r"'grad.x' must have shape \[B, d\] with d = 4"):
    opt.update(g._replace(x=jnp.ones((5, 3))), state, W)
  with pytest.raises(TypeError, match="'grad.ids' must have dtype int32"):
    opt.update(g._replace(ids=g.ids.astype(jnp.int64) if jax.config.jax_enable_x64 else g.ids.astype(jnp.float32)),
               state, W)
  with pytest.raises(ValueError, match=r"'state.mu' must be float32 of the weight's shape \(30, 4\)"):
    opt.update(g, state._replace(mu=state.mu[:10]), W)
