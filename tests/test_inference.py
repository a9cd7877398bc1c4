"""Tests for sparsejax.inference: exact chunked top-k against brute force."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import inference
from sparsejax.inference import exact_topk, exact_topk_batches
from sparsejax.metrics import evaluate_topk, propensity_scores


def _brute_topk(h, w, b, k):
  logits = h.astype(np.float64) @ w.astype(np.float64).T
  if b is not None:
    logits = logits + b
  order = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # ties: lower id first
  return np.take_along_axis(logits, order, axis=1), order


def _int_problem(seed, n, num_out, d, lo=-2, hi=3):
  # Small integers: float32 products are exact and ties are plentiful.
  rng = np.random.default_rng(seed)
  h = rng.integers(lo, hi, size=(n, d)).astype(np.float32)
  w = rng.integers(lo, hi, size=(num_out, d)).astype(np.float32)
  b = rng.integers(lo, hi, size=num_out).astype(np.float32)
  return h, w, b


@pytest.mark.parametrize(
    "num_out,row_chunk,k",
    [(1000, 128, 7), (1000, 1000, 5), (1000, 4096, 5), (130, 128, 5), (64, 3, 5), (5, 2, 5)],
)
def test_exact_topk_matches_brute_force(num_out, row_chunk, k):
  h, w, b = _int_problem(num_out, n=17, num_out=num_out, d=6)
  scores, ids = exact_topk(h, w, b, k, row_chunk=row_chunk)
  want_s, want_i = _brute_topk(h, w, b, k)
  assert ids.dtype == jnp.int32 and ids.shape == (17, k)
  np.testing.assert_array_equal(np.asarray(ids), want_i)
  np.testing.assert_array_equal(np.asarray(scores), want_s)


def test_exact_topk_ties_lower_id_wins_across_chunks():
  num_out, k = 300, 5
  w = np.zeros((num_out, 4), np.float32)
  h = np.ones((2, 4), np.float32)
  b = np.zeros(num_out, np.float32)
  b[[3, 130, 260, 299]] = 5.0  # tied maxima in three different chunks of 128
  b[[1, 200]] = 4.0
  _, ids = exact_topk(h, w, b, k, row_chunk=128)
  np.testing.assert_array_equal(np.asarray(ids), [[3, 130, 260, 299, 1]] * 2)
  # All equal: ids 0..k-1 in order.
  _, ids = exact_topk(h, w, None, k, row_chunk=7)
  np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2, 3, 4]] * 2)


def test_exact_topk_last_chunk_overlap_not_duplicated():
  # N=130, chunk=128: the last chunk re-reads rows 2..127, which must stay masked.
  num_out = 130
  w = np.zeros((num_out, 2), np.float32)
  h = np.ones((3, 2), np.float32)
  b = np.arange(num_out, dtype=np.float32)[::-1].copy()  # row 0 best, row 129 worst
  b[129] = 1000.0
  _, ids = exact_topk(h, w, b, 5, row_chunk=128)
  np.testing.assert_array_equal(np.asarray(ids), [[129, 0, 1, 2, 3]] * 3)


def test_exact_topk_sample_batching_and_iterator():
  h, w, b = _int_problem(7, n=53, num_out=500, d=5)
  want_s, want_i = _brute_topk(h, w, b, 6)
  for sample_chunk in (10, 53, 1000):
    s, i = exact_topk(h, w, b, 6, row_chunk=64, sample_chunk=sample_chunk)
    np.testing.assert_array_equal(np.asarray(i), want_i)
    np.testing.assert_array_equal(np.asarray(s), want_s)
  parts = list(exact_topk_batches((h[:20], h[20:]), w, b, 6, row_chunk=64))
  np.testing.assert_array_equal(np.concatenate([np.asarray(p[1]) for p in parts]), want_i)
  # JAX inputs, random floats (no ties): same as brute force.
  rng = np.random.default_rng(3)
  hf = rng.standard_normal((9, 16)).astype(np.float32)
  wf = rng.standard_normal((777, 16)).astype(np.float32)
  _, i = exact_topk(jnp.asarray(hf), jnp.asarray(wf), None, 5, row_chunk=100, precision="highest")
  np.testing.assert_array_equal(np.asarray(i), _brute_topk(hf, wf, None, 5)[1])


def test_exact_topk_never_materialises_full_logits():
  n, num_out, chunk = 8, 1000, 128
  h, w, b = _int_problem(0, n=n, num_out=num_out, d=4)
  jaxpr = str(jax.make_jaxpr(lambda h, w, b: inference._exact_topk_jit(h, w, b, 5, chunk, None))(h, w, b))
  assert f"f32[{n},{chunk}]" in jaxpr
  assert f"f32[{n},{num_out}]" not in jaxpr


def test_exact_topk_stays_a_top_k_when_the_caller_slices_it():
  """Evaluation's diagnostics take [:, :5] and [:, :10] of one exact top 10. XLA:CPU once folded those slices into
  its top_k and then sorted every row of [B, N] in full (25x slower at N = 25K): the compiled result must select
  with the row_topk kernel and sort nothing."""
  h = jnp.ones((64, 8), jnp.float32)
  w = jnp.asarray(np.random.default_rng(0).normal(size=(3000, 8)), jnp.float32)

  def sliced(h, w):
    scores, ids = exact_topk(h, w, None, 10)
    return scores[:, :5], ids[:, :5], ids[:, :10]

  hlo = jax.jit(sliced).lower(h, w).compile().as_text()
  assert " sort(" not in hlo and "TopK" not in hlo
  assert 'custom_call_target="sparsejax_row_topk"' in hlo
  got = jax.jit(sliced)(h, w)
  want = exact_topk(h, w, None, 10)
  np.testing.assert_array_equal(got[2], want[1])


def test_exact_topk_validation():
  h, w, b = _int_problem(0, n=2, num_out=10, d=3)
  with pytest.raises(ValueError):
    exact_topk(h, w, b, 11)
  with pytest.raises(ValueError):
    exact_topk(h, w, b[:5], 3)
  with pytest.raises(ValueError):
    exact_topk(h[:, :2], w, b, 3)


def test_end_to_end_topk_then_evaluate():
  # Labels equal to the brute-force top-3 -> P@3 = nDCG@3 = PSP@3 = 1.
  rng = np.random.default_rng(5)
  h = rng.standard_normal((20, 8)).astype(np.float32)
  w = rng.standard_normal((300, 8)).astype(np.float32)
  _, ids = exact_topk(h, w, None, 5, row_chunk=64, precision="highest")
  labels = np.asarray(ids)[:, :3]
  prop = propensity_scores(np.full(300, 5), 1000)  # uniform propensity
  out = evaluate_topk(np.asarray(ids), labels, prop)
  for key in ("p@1", "p@3", "ndcg@1", "ndcg@3", "ndcg@5", "psp@1", "psp@3", "psp@5"):
    assert out[key] == pytest.approx(1.0), key
  assert out["p@5"] == pytest.approx(3 / 5)


SHARDED_INFERENCE = """
    import json, jax, numpy as np
    from sparsejax.distributed import sharding
    from sparsejax import data, model
    from sparsejax.settings import override
    from sparsejax.model_config import ModelConfig
    N, P = 91, 3  # 31 rows per shard: the last holds 29 real rows and 2 of padding (random weights, bias 0)
    ds = data.make_synthetic(64, 200, N, labels_per_sample=3, seed=1)
    batch = next(data.BatchIterator(ds, 64, seed=0, max_labels=4, prefetch=0))
    config = override(ModelConfig(200, N), hidden_dims=(16,), active_k=12, softmax="sampled")
    out = {}
    for shards in (1, P):
      run = sharding.make_run(config, seed=0, num_shards=shards, top=5, sampled_ks=(20,))
      state = run.init()
      scores, ids, sampled, extra = run.diagnose(state, batch["feat_ids"], batch["feat_vals"], batch["labels"])
      out[shards] = dict(scores=scores.tolist(), ids=ids.tolist(), sampled=sampled.tolist(),
                         predict_ids=run.predict(state, batch["feat_ids"], batch["feat_vals"])[1].tolist(),
                         exact=[None if x is None else x.tolist()
                                for x in run.predict_exact(state, batch["feat_ids"], batch["feat_vals"])],
                         k20=extra["sampled"]["sampled_k20"].tolist(),
                         **{k: v.tolist() for k, v in extra["retrieval"].items()})
    one = model.init(jax.random.key(0), config)  # the parameters of both runs (a sharded init draws the same)
    out["h"] = np.asarray(model.hidden(one, batch["feat_ids"], batch["feat_vals"])).tolist()
    out["w"], out["b"] = np.asarray(one.out.w).tolist(), np.asarray(one.out.b).tolist()
    out["labels"] = np.asarray(batch["labels"]).tolist()
    print(json.dumps(out))
"""


def test_sharded_run_predicts_and_diagnoses_with_the_one_process_functions(run_python):
  """A run over 3 shards (padding rows on the last) and a one-process run of the same parameters call the same
  inference functions: both give the exact top 5 of a float64 reference over the N real rows (its exact predictor
  too, which samples nothing), the labels' mean
  cosine, and active sets of k candidates in all (sampled ids are real rows)."""
  got = json.loads(run_python(code=SHARDED_INFERENCE, devices=3).stdout.splitlines()[-1])
  h, w, b, labels = (np.asarray(got[key]) for key in ("h", "w", "b", "labels"))
  want_scores, want_ids = _brute_topk(h, w, b, 5)
  rows = w / np.linalg.norm(w, axis=1, keepdims=True)
  cosines = (h / np.linalg.norm(h, axis=1, keepdims=True)) @ rows.T
  want_cosine = [np.mean([cosines[i, y] for y in set(row) if y >= 0]) for i, row in enumerate(labels)]
  for shards in ("1", "3"):
    run = got[shards]
    np.testing.assert_array_equal(run["ids"], want_ids)
    np.testing.assert_array_equal(run["predict_ids"], want_ids)
    exact_scores, exact_ids, no_sampled = run["exact"]  # the exact predictor: the same exact top, nothing sampled
    np.testing.assert_array_equal(exact_ids, want_ids)
    np.testing.assert_allclose(exact_scores, want_scores, rtol=1e-5, atol=1e-6)
    assert no_sampled is None
    np.testing.assert_allclose(run["scores"], want_scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run["label_cosine"], want_cosine, rtol=1e-4, atol=1e-6)
    assert run["num_candidates"] == [12.0] * len(h)  # the shards' candidates add up to k
    for key in ("sampled", "k20"):
      assert np.all((np.asarray(run[key]) >= 0) & (np.asarray(run[key]) < 91)), key
