"""Kernel outputs (the head rankers' solve included), and each candidate index built and queried, are bit-identical
whatever the number of threads."""

import json
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import hashlib, jax, jax.numpy as jnp, numpy as np
    from sparsejax import ops, optim
    from sparsejax.index import lsh, tables
    rng = np.random.default_rng(0)
    N, d, B, k = 20000, 32, 64, 256
    W = jnp.asarray(rng.normal(size=(N, d)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(B, d)), jnp.float32)
    digest = hashlib.sha256()
    for family, bits in (("simhash", 9), ("dwta", 9)):
      cfg = lsh.LSHConfig(family, 8, bits)
      params = lsh.init_lsh(jax.random.key(0), cfg, d)
      for policy in ("fifo", "reservoir"):
        t = tables.build_tables(tables.init_tables(cfg, 8, policy=policy), params, W)
        ids, n = tables.lsh_query(t, params, h, k=k, num_rows=N, seed=5)
        for a in (t.buckets, t.counts, ids, n):
          digest.update(np.asarray(a).tobytes())
    g = jnp.asarray(rng.normal(size=(B, k)), jnp.float32)
    digest.update(np.asarray(ops.gather_dot(h, W, ids)).tobytes())
    digest.update(np.asarray(ops.gather_combine(g, W, ids)).tobytes())
    b = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    digest.update(np.asarray(ops.gather_dot(h, W, ids, b)).tobytes())
    grad = ops.RowSparseGrad(ids % 500, g, h)  # many duplicates
    big = ops.RowSparseGrad(ids, g, h)  # ids over all of W: the optimizer's pass spans many slabs
    Wb = W.astype(jnp.bfloat16)  # bfloat16 weights: gathers, and updates rounded stochastically
    digest.update(np.asarray(ops.gather_dot(h, Wb, ids, b)).tobytes())
    digest.update(np.asarray(ops.gather_combine(g, Wb, ids)).tobytes())
    for moment_dtype in (jnp.float32, jnp.bfloat16):  # bfloat16: stochastic rounding
      for second_moment in ("element", "row"):
        opt = optim.row_sparse_adam(0.01, moment_dtype=moment_dtype, second_moment=second_moment)
        for gr, weight in ((grad, W), (big, W), (big, Wb)):
          (W2, b2), (s, sb), dh = opt.update(gr, opt.init((weight, b)), (weight, b), combine=True)  # dh: over slabs
          for a in (W2, s.mu, s.nu, b2, sb.mu, sb.nu, dh):
            digest.update(np.asarray(a).tobytes())
    # The head rankers' logistic regressions: a label per task.
    from sparsejax import data as sj_data, head_rankers
    synthetic = sj_data.make_synthetic(num_samples=3000, num_features=500, num_labels=40, labels_per_sample=3,
                                       features_per_sample=12, seed=0)
    rankers = head_rankers.fit(synthetic, head_rankers.head_labels(synthetic, 8, min_share=0.0), max_epochs=4)
    for a in rankers:
      digest.update(np.asarray(a).tobytes())
    # The index of each kind: built, queried, refreshed from moved rows and given new hash functions (seeds). The
    # kernels' digest goes on in a copy per kind: one process gives both kinds' digests.
    import json
    from sparsejax import index, model
    from sparsejax.settings import override
    from sparsejax.model_config import ModelConfig
    digests = {}
    for kind in KINDS:
      cfg = override(ModelConfig(10, N), hidden_dims=(d,), active_k=k, candidates=kind, num_tables=8,
                     num_clusters=64, kmeans_sample=16)
      idx = index.from_config(cfg)
      state = idx.init(*jax.random.split(jax.random.key(1)), W, b)
      active, n = idx.query(state, h, k=k, num_rows=N, seed=5)
      state = idx.renew(idx.refresh(state, W + 0.1 * W[::-1], b), jax.random.key(2), W, b)
      kind_digest = digest.copy()
      for a in (*jax.tree.leaves(state), active, n, *jax.tree.leaves(idx.serving(state, W, b))):
        kind_digest.update(np.asarray(a).tobytes())
      digests[kind] = kind_digest.hexdigest()
    print(json.dumps(digests))
""")
KINDS = ("clusters", "lsh")


@pytest.fixture(scope="module")
def digests(run_python):
  """``{threads: {kind: digest}}`` for one thread, the default (SPARSEJAX_NUM_THREADS unset: every core) and 3: one
  process per thread count computes the kernels once and each kind's index after them."""
  with pytest.MonkeyPatch.context() as mp:
    mp.delenv("SPARSEJAX_NUM_THREADS", raising=False)
    found = {}
    for threads in (1, None, 3):
      env = {"SPARSEJAX_NUM_THREADS": str(threads)} if threads else {}
      out = run_python(code=SCRIPT.replace("KINDS", repr(KINDS)), env=env)
      found[threads] = json.loads(out.stdout.strip().splitlines()[-1])
  return found


@pytest.mark.parametrize("kind", KINDS)
def test_results_do_not_depend_on_thread_count(digests, kind):
  one = digests[1][kind]
  assert len(one) == 64
  assert digests[None][kind] == one
  assert digests[3][kind] == one


@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5"])
def test_a_thread_cap_that_is_no_positive_integer_is_named(run_python, value):
  """A fresh-user review: SPARSEJAX_NUM_THREADS=abc (or 0, -1) silently ran the kernels on every core."""
  out = run_python(code="""
      import jax.numpy as jnp
      from sparsejax import ops
      ops.gather_dot(jnp.ones((1, 2)), jnp.ones((3, 2)), jnp.zeros((1, 1), jnp.int32))
  """, env={"SPARSEJAX_NUM_THREADS": value}, check=False, isolated=False)
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1] == (
      f"ValueError: SPARSEJAX_NUM_THREADS={value!r}: must be a positive integer (the kernels' thread cap), or unset "
      "for all cores")
