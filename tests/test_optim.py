"""Row-sparse Adam against optax and a NumPy lazy-Adam reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references

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


@pytest.mark.parametrize("B,k,N", [(0, 0, 5), (3, 0, 5), (3, 2, 0)])
def test_no_active_ids_leave_everything_unchanged(B, k, N):
  # ids [B, 0] (and [0, 0]), or only padding in a layer of no rows: no slot, so no row is touched.
  # Regression: the kernel divided by k = 0 and by N = 0 (SIGFPE); the first found by tests/test_fuzz_ops.py in CI.
  rng = np.random.default_rng(3)
  W = jnp.asarray(rng.normal(size=(N, 4)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  g = RowSparseGrad(jnp.full((B, k), -1, jnp.int32), jnp.ones((B, k), jnp.float32),
                    jnp.asarray(rng.normal(size=(B, 4)), jnp.float32))
  opt = optim.row_sparse_adam(0.1)
  (new_w, new_b), state, touched, dx = optim.apply_row_sparse_adam((W, b), opt.init((W, b)), g, 0.1, combine=True)
  np.testing.assert_array_equal(new_w, W)
  np.testing.assert_array_equal(new_b, b)
  np.testing.assert_array_equal(state[0].mu, 0.0)
  assert touched.shape == (B * k,) and np.all(np.asarray(touched) == -1) and dx.shape == (B, 4)
  np.testing.assert_array_equal(dx, 0.0)


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



@pytest.mark.parametrize("d", [8, 100])
def test_dense_and_sparse_id_ranges_both_match_the_reference(d):
  # The kernel orders each id range's slots by a counting sort where the range holds many slots for its
  # width (here ids 0-299, many repeated) and by a comparison sort elsewhere (the ids spread over the rest).
  # It sums a row's slots 64 columns at a time, then the rest: d = 100 takes both, d = 8 only the second.
  rng = np.random.default_rng(12)
  N, B, k = 20_000, 8, 96
  ids = rng.integers(300, N, size=(B, k)).astype(np.int32)
  ids[:, : k // 2] = rng.integers(0, 300, size=(B, k // 2))
  ids[3, 5:9] = -1
  g = RowSparseGrad(jnp.asarray(ids), jnp.asarray(rng.normal(size=(B, k)), jnp.float32),
                    jnp.asarray(rng.normal(size=(B, d)), jnp.float32))
  W = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  opt = optim.row_sparse_adam(0.1)
  (new_w, new_b), _, touched, dx = optim.apply_row_sparse_adam((W, b), opt.init((W, b)), g, 0.1, combine=True)
  outs, _ = references.adam_ref(W, np.zeros((N, d)), np.zeros((N, d)), 0, ids, np.asarray(g.g), np.asarray(g.x),
                                 0.1, 0.9, 0.999, 1e-8, 0.0, b, np.zeros(N), np.zeros(N))
  np.testing.assert_allclose(new_w, outs[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(new_b, outs[3], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dx, references.gather_combine_ref(np.asarray(g.g), np.asarray(W), ids),
                             rtol=1e-5, atol=1e-5)
  want = np.unique(ids[ids >= 0])
  np.testing.assert_array_equal(np.asarray(touched)[: len(want)], want)
  assert np.all(np.asarray(touched)[len(want):] == -1)

def test_weight_and_bias_pair_equals_two_separate_updates():
  """The fused layer update gives the bits of separate weight and bias updates."""
  rng = np.random.default_rng(5)
  W0 = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
  b0 = jnp.asarray(rng.normal(size=(30,)), jnp.float32)
  opt = optim.row_sparse_adam(0.05, weight_decay=0.01)
  W, b, sw, sb = W0, b0, opt.init(W0), opt.init(b0)
  (Wp, bp), (swp, sbp) = (W0, b0), opt.init((W0, b0))
  grads = [_grad(rng) for _ in range(3)]
  for g in grads:
    W, sw = opt.update(g, sw, W)
    b, sb = opt.update(g._replace(x=jnp.ones((5, 1))), sb, b)
    (Wp, bp), (swp, sbp) = opt.update(g, (swp, sbp), (Wp, bp))
  for got, want in ((Wp, W), (bp, b), (swp.mu, sw.mu), (swp.nu, sw.nu), (sbp.mu, sb.mu), (sbp.nu, sb.nu)):
    np.testing.assert_array_equal(got, want)
  assert int(swp.count) == int(sbp.count) == 3
  ref = _lazy_adam_reference(b0[:, None], [g._replace(x=jnp.ones((5, 1))) for g in grads], [0.05] * 3, wd=0.01)
  np.testing.assert_allclose(bp, ref[:, 0], rtol=1e-5, atol=1e-6)


def test_bfloat16_moments_round_stochastically_and_track_float32():
  """With round-to-nearest, v = 0.999 v + 0.001 g^2 would never move in bfloat16."""
  N, d, steps = 64, 32, 300
  rng = np.random.default_rng(6)
  W0 = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
  ids = jnp.asarray(np.arange(N).reshape(4, 16), jnp.int32)
  runs = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    opt = optim.row_sparse_adam(1e-3, moment_dtype=dtype)
    update = jax.jit(opt.update, donate_argnums=(1, 2))
    W, state = jnp.array(W0, copy=True), opt.init(W0)
    assert state.mu.dtype == dtype and state.nu.dtype == dtype
    grng = np.random.default_rng(7)
    for _ in range(steps):
      g = RowSparseGrad(ids, jnp.asarray(1.0 + 0.1 * grng.normal(size=(4, 16)), jnp.float32),
                        jnp.asarray(grng.normal(size=(4, d)), jnp.float32))
      W, state = update(g, state, W)
    runs[dtype] = (np.asarray(W), np.asarray(state.nu.astype(jnp.float32)), np.asarray(state.mu.astype(jnp.float32)))
  (w32, v32, m32), (w16, v16, m16) = runs[jnp.float32], runs[jnp.bfloat16]
  # After 300 steps v has grown to ~26% of E[g^2]; frozen rounding would leave it near its first value.
  assert np.mean(v16) / np.mean(v32) == pytest.approx(1.0, abs=0.01)
  np.testing.assert_allclose(v16, v32, rtol=0.1)  # rounding noise random-walks a few %
  np.testing.assert_allclose(m16, m32, rtol=0.05, atol=0.02 * np.abs(m32).max())
  # Weights move almost exactly as with float32 moments.
  np.testing.assert_allclose(w16 - np.asarray(W0), w32 - np.asarray(W0), rtol=0.02, atol=3e-3)


@pytest.mark.parametrize("moment_dtype", [jnp.float32, jnp.bfloat16])
def test_bfloat16_weights_round_stochastically_and_track_float32(moment_dtype):
  """At lr 1e-3 every step is below half a bfloat16 step of a weight ~1: round-to-nearest would never move it."""
  N, d, B, k, steps = 64, 32, 4, 16, 300
  rng = np.random.default_rng(9)
  W0 = jnp.asarray(rng.normal(size=(N, d)), jnp.float32).astype(jnp.bfloat16)
  b0 = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  ids = np.arange(N - 8).reshape(B, -1)
  ids = jnp.asarray(np.concatenate([ids, np.full((B, k - ids.shape[1]), -1)], axis=1), jnp.int32)  # 8 rows idle
  runs = {}
  opt = optim.row_sparse_adam(1e-3, moment_dtype=moment_dtype)
  update = jax.jit(lambda g, s, p: opt.update(g, s, p, combine=True), donate_argnums=(1, 2))
  # The input gradient reads the rows before the update, widened exactly: the bits of their float32 copy's.
  g = _grad(rng, B=B, k=k, N=N, d=d)
  combined = lambda w: opt.update(g, opt.init((w, jnp.array(b0, copy=True))), (w, jnp.array(b0, copy=True)),
                                  combine=True)[2]
  np.testing.assert_array_equal(combined(jnp.array(W0, copy=True)), combined(W0.astype(jnp.float32)))
  for dtype in (jnp.float32, jnp.bfloat16):
    params = (jnp.array(W0, dtype, copy=True), jnp.array(b0, copy=True))  # both donated
    state = opt.init(params)
    grng = np.random.default_rng(10)
    for _ in range(steps):
      g = RowSparseGrad(ids, jnp.asarray(1.0 + 0.1 * grng.normal(size=(B, k)), jnp.float32),
                        jnp.asarray(1.0 + 0.3 * grng.normal(size=(B, d)), jnp.float32))  # a steady drift
      params, state, _ = update(g, state, params)
    assert params[0].dtype == dtype and params[1].dtype == jnp.float32
    runs[dtype] = np.asarray(params[0].astype(jnp.float32)), np.asarray(params[1])
  (w32, b32), (w16, b16) = runs[jnp.float32], runs[jnp.bfloat16]
  start = np.asarray(W0.astype(jnp.float32))
  moved32, moved16 = w32 - start, w16 - start
  assert np.abs(moved32[:N - 8]).mean() > 0.2  # ~lr per step: far more than a bfloat16 step (<= 0.016) in total
  # Each rounding adds a zero-mean error of under a bfloat16 step: the weights random-walk around the float32 ones.
  assert abs(np.mean(moved16[:N - 8] - moved32[:N - 8])) < 0.01  # unbiased
  assert np.sqrt(np.mean((moved16 - moved32) ** 2)) < 0.06  # ~0.03: the walk of ~300 roundings
  # Round-to-nearest would leave every weight above 0.25 in magnitude where it started.
  assert np.abs(moved16[:N - 8]).mean() == pytest.approx(np.abs(moved32[:N - 8]).mean(), rel=0.05)
  np.testing.assert_array_equal(w16[N - 8:], start[N - 8:])  # untouched rows keep their bits
  np.testing.assert_array_equal(b16, b32)  # the float32 bias: its gradient does not read the weight


def test_moment_dtype_is_checked():
  rng = np.random.default_rng(8)
  W = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
  with pytest.raises(ValueError, match="moment_dtype must be float32 or bfloat16, got float16"):
    optim.row_sparse_adam(0.1, moment_dtype=jnp.float16)
  state = optim.row_sparse_adam(0.1).init(W)
  with pytest.raises(ValueError, match=r"'state.nu' must be float32 of shape \(30, 4\).*got bfloat16"):
    optim.apply_row_sparse_adam(W, state._replace(nu=state.nu.astype(jnp.bfloat16)), _grad(rng), 0.1)


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
  W0 = np.asarray(W)
  with pytest.raises(Exception, match=r"row_sparse_adam: argument 'ids' has id 30 .*N = 30"):
    jax.block_until_ready(opt.update(g._replace(ids=g.ids.at[3, 2].set(30)), state, W))
  with pytest.raises(Exception, match=r"'ids' has id -2"):
    jax.block_until_ready(opt.update(g._replace(ids=g.ids.at[3, 2].set(-2)), state, W))
  np.testing.assert_array_equal(W, W0)  # W is still alive (not donated) and unchanged
  with pytest.raises(ValueError, match=r"'grad.x' must have shape \[B, d\] with d = 4"):
    opt.update(g._replace(x=jnp.ones((5, 3))), state, W)
  with pytest.raises(TypeError, match="'grad.ids' must have dtype int32"):
    opt.update(g._replace(ids=g.ids.astype(jnp.int64) if jax.config.jax_enable_x64 else g.ids.astype(jnp.float32)),
               state, W)
  with pytest.raises(ValueError, match=r"'state.mu' must be float32 of shape \(30, 4\)"):
    opt.update(g, state._replace(mu=state.mu[:10]), W)
  # No state (a bare NoneType error before), and a float16 weight (its message left bfloat16 out).
  with pytest.raises(TypeError, match=r"row_sparse_adam.update: argument 'state' must be what init gave .*NoneType"):
    opt.update(g, None, W)
  with pytest.raises(TypeError, match=r"'weight' must have dtype float32 or bfloat16, got float16"):
    opt.update(g, state, W.astype(jnp.float16))


@pytest.mark.parametrize("moment_dtype", [jnp.float32, jnp.bfloat16])
def test_combined_is_the_input_gradient_from_the_rows_before_the_update(moment_dtype):
  # Enough rows that the ids spread over many of the kernel's slabs.
  rng = np.random.default_rng(7)
  N, d, B, k = 3000, 8, 6, 40
  g = _grad(rng, B=B, k=k, N=N, d=d)
  W = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  opt = optim.row_sparse_adam(0.1, moment_dtype=moment_dtype)
  want_dx = references.gather_combine_ref(np.asarray(g.g), np.asarray(W), np.asarray(g.ids))
  outs, _ = references.adam_ref(W, np.zeros((N, d)), np.zeros((N, d)), 0, np.asarray(g.ids), np.asarray(g.g),
                                 np.asarray(g.x), 0.1, 0.9, 0.999, 1e-8, 0.0, b, np.zeros(N), np.zeros(N))
  (new_w, new_b), _, dx = jax.jit(lambda p, s: opt.update(g, s, p, combine=True))((W, b), opt.init((W, b)))
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_w, outs[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(new_b, outs[3], rtol=1e-4, atol=1e-5)
  # Without combine: the same update, and the pair of results only.
  (w2, b2), _ = opt.update(g, opt.init((W, b)), (W, b))
  np.testing.assert_array_equal(w2, new_w)
  np.testing.assert_array_equal(b2, new_b)


@pytest.mark.parametrize("moment_dtype", [jnp.float32, jnp.bfloat16])
def test_rowwise_adam_matches_the_reference_over_steps(moment_dtype):
  rng = np.random.default_rng(8)
  N, d = 40, 6
  W0 = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
  b0 = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  opt = optim.row_sparse_adam(0.05, weight_decay=0.1, moment_dtype=moment_dtype, second_moment="row")
  state = opt.init((W0, b0))
  assert state[0].nu.shape == (N,) and state[1].nu.shape == (N,)
  update = jax.jit(opt.update)
  params, ref = (W0, b0), [np.asarray(a, np.float64) for a in (W0, np.zeros((N, d)), np.zeros(N), b0, np.zeros(N),
                                                               np.zeros(N))]
  tol = dict(rtol=1e-4, atol=1e-5) if moment_dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-3)
  for t in range(4):
    g = _grad(rng, B=5, k=6, N=N, d=d)
    ref, _ = references.adam_ref(*ref[:3], t, np.asarray(g.ids), np.asarray(g.g), np.asarray(g.x), 0.05, 0.9, 0.999,
                                 1e-8, 0.1, *ref[3:])
    params, state = update(g, state, params)
    np.testing.assert_allclose(params[0], ref[0], **tol)
    np.testing.assert_allclose(params[1], ref[3], **tol)
    np.testing.assert_allclose(np.asarray(state[0].nu, np.float64), ref[2], **tol)
  # Row-wise differs from Adam once a row's gradient entries differ in size.
  (w_adam, _), _ = optim.row_sparse_adam(0.05).update(g, optim.row_sparse_adam(0.05).init((W0, b0)), (W0, b0))
  (w_row, _), _ = opt.update(g, opt.init((W0, b0)), (W0, b0))
  assert not np.allclose(w_adam, w_row)


def test_second_moment_must_be_element_or_row():
  with pytest.raises(ValueError, match="row_sparse_adam: second_moment must be one of"):
    optim.row_sparse_adam(0.1, second_moment="column")


@pytest.mark.parametrize("rowwise", [False, True])
def test_adam_all_rows_is_the_kernel_with_every_row_touched(rowwise):
  """The exact step's portable Adam (optim.adam_all_rows) against the row-sparse kernel given every row: the same
  weights, bias and moments (float32), element-wise and row-wise second moments, with weight decay."""
  rng = np.random.default_rng(5)
  n, d, batch = 9, 6, 4
  W = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(batch, d)), jnp.float32)
  opt = optim.row_sparse_adam(0.1, weight_decay=0.01, second_moment="row" if rowwise else "element")
  state = opt.init((W, b))
  every_row = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
  want_params, want_state, _, _ = optim.apply_row_sparse_adam(
      (W, b), state, RowSparseGrad(every_row, g, x), 0.1, weight_decay=0.01, combine=True)
  got_params, got_state = optim.adam_all_rows((W, b), state, (g.T @ x, jnp.sum(g, axis=0)), 0.1,
                                              jax.random.key(0), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
  for got, want in zip(jax.tree.leaves((got_params, got_state)), jax.tree.leaves((want_params, want_state))):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
