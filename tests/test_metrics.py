"""Tests for sparsejax.metrics."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.metrics import (
    evaluate_topk,
    inverse_propensity,
    label_frequencies,
    pad_ranking,
    propensity_scores,
    ranking_metrics,
    ranking_metrics_jax,
)

LOG2_3 = math.log2(3.0)


# ---------------------------------------------------------------------------
# Propensity
# ---------------------------------------------------------------------------


def test_propensity_hand_computed():
  # N = 100, N_l = 10, A = 0.55, B = 1.5:
  # C = (ln 100 - 1) * 2.5**0.55 = 3.605170 * 1.655263 = 5.967505
  # p = 1 / (1 + 5.967505 * 11.5**-0.55) = 1 / (1 + 5.967505 * 0.260985) = 0.391017
  p = propensity_scores(np.array([10.0]), 100)
  np.testing.assert_allclose(p, [0.3910173106040255], rtol=1e-12)
  np.testing.assert_allclose(inverse_propensity([10.0], 100), 1.0 / p, rtol=1e-12)


def test_propensity_monotone_and_params():
  freqs = np.array([0, 1, 10, 100, 10_000])
  p = propensity_scores(freqs, 100_000)
  assert p.shape == (5,)
  assert np.all(np.diff(p) > 0)  # frequent labels are more likely to be observed
  assert np.all((p > 0) & (p <= 1))
  # Non-default A, B reach the formula.
  a, b, n = 0.6, 2.6, 1000
  c = (math.log(n) - 1) * (b + 1) ** a
  expected = 1 / (1 + c * (freqs + b) ** -a)
  np.testing.assert_allclose(propensity_scores(freqs, n, A=a, B=b), expected, rtol=1e-12)
  # Below N = e the formula's C would be negative (propensities -3.08 and 9e15 for N = 1): no correction there.
  for n in (1, 2):
    np.testing.assert_array_equal(propensity_scores([0, 1, 5], n), [1.0, 1.0, 1.0])
  with pytest.raises(ValueError, match=r"A > 0 and B > 0, got A = 0.55, B = -100"):
    propensity_scores([0, 1, 5], 10, B=-100)


def test_label_frequencies_dedupes_and_ignores_padding():
  labels = np.array([[0, 2, 2, -1], [2, -1, -1, -1], [-1, -1, -1, -1], [3, 0, -1, -1]])
  np.testing.assert_array_equal(label_frequencies(labels, 5), [2, 0, 2, 1, 0])
  with pytest.raises(ValueError):
    label_frequencies(labels, 3)


# ---------------------------------------------------------------------------
# Ranking metrics: hand-computed examples
# ---------------------------------------------------------------------------

# Row 0: labels {2, 5}; predictions [5, 1, 2, 7, 9] -> hits at ranks 1 and 3.
# Row 1: labels {0};    predictions [3, 4, 0, 1, 2] -> hit at rank 3.
# Row 2: no labels.
TOPK = np.array([[5, 1, 2, 7, 9], [3, 4, 0, 1, 2], [0, 1, 2, 3, 4]])
LABELS = np.array([[2, 5, -1], [0, -1, -1], [-1, -1, -1]], dtype=np.int32)


def test_precision_and_ndcg_hand_computed():
  m = ranking_metrics(TOPK, LABELS)
  np.testing.assert_allclose(m["p@1"], [1.0, 0.0, 0.0])
  np.testing.assert_allclose(m["p@3"], [2 / 3, 1 / 3, 0.0])
  np.testing.assert_allclose(m["p@5"], [2 / 5, 1 / 5, 0.0])
  # Row 0: DCG@3 = 1/log2(2) + 1/log2(4) = 1.5; IDCG@3 = 1 + 1/log2(3) (|y| = 2).
  ndcg3_row0 = (1 + 1 / math.log2(4)) / (1 + 1 / LOG2_3)
  assert ndcg3_row0 == pytest.approx(0.9197207891481876)
  # Row 1: DCG@3 = 1/log2(4) = 0.5; IDCG = 1 (|y| = 1).
  np.testing.assert_allclose(m["ndcg@1"], [1.0, 0.0, 0.0])
  np.testing.assert_allclose(m["ndcg@3"], [ndcg3_row0, 0.5, 0.0])
  np.testing.assert_allclose(m["ndcg@5"], [ndcg3_row0, 0.5, 0.0])


def test_evaluate_topk_means_and_keys():
  out = evaluate_topk(TOPK, LABELS)
  assert list(out) == ["p@1", "p@3", "p@5", "ndcg@1", "ndcg@3", "ndcg@5"]
  assert all(type(v) is float for v in out.values())
  # The label-less row counts as 0 in every mean (denominator 3).
  assert out["p@1"] == pytest.approx(1 / 3)
  assert out["p@3"] == pytest.approx((2 / 3 + 1 / 3) / 3)
  assert out["p@5"] == pytest.approx((0.4 + 0.2) / 3)
  assert out["ndcg@3"] == pytest.approx((0.9197207891481876 + 0.5) / 3)
  propensity = np.ones(10)
  propensity[5] = np.nan  # was PSP 0, silently
  with pytest.raises(ValueError, match=r"propensities must be positive and finite; label 5 has nan"):
    evaluate_topk(TOPK, LABELS, propensity)


def test_pad_ranking_keeps_precision_at_k_divided_by_k():
  short = np.array([[3, 1], [2, 0]])  # two predictions per sample
  padded = pad_ranking(short)
  np.testing.assert_array_equal(padded, [[3, 1, -1, -1, -1], [2, 0, -1, -1, -1]])
  labels = np.array([[1, 3, 4], [7, -1, -1]])
  out = evaluate_topk(padded, labels)
  assert out["p@5"] == pytest.approx((2 / 5 + 0) / 2) and out["p@3"] == pytest.approx((2 / 3 + 0) / 2)
  wide = np.arange(12).reshape(2, 6)
  np.testing.assert_array_equal(pad_ranking(wide), wide)  # wide enough: unchanged, not cut
  assert pad_ranking(short, k=3).shape == (2, 3)


def test_psp_hand_computed_and_conventions():
  # Inverse propensities: label 2 -> 4, label 5 -> 2, label 7 -> 3, others 1.
  inv = np.ones(10)
  inv[2], inv[5], inv[7] = 4.0, 2.0, 3.0
  topk = np.array([[5, 1, 2, 0, 3], [1, 0, 2, 3, 4]])
  labels = np.array([[2, 5, 7], [1, -1, -1]])
  m = ranking_metrics(topk, labels, inv_propensity=inv)
  # Row 0: raw@1 = w5 = 2, ideal@1 = w2 = 4; raw@3 = (2 + 4)/3, ideal@3 = (4 + 3 + 2)/3.
  # Row 1: raw = ideal = w1/k (single label predicted first).
  np.testing.assert_allclose(m["psp_raw@1"], [2.0, 1.0])
  np.testing.assert_allclose(m["psp_ideal@1"], [4.0, 1.0])
  np.testing.assert_allclose(m["psp_raw@3"], [2.0, 1 / 3])
  np.testing.assert_allclose(m["psp_ideal@3"], [3.0, 1 / 3])
  np.testing.assert_allclose(m["psp_raw@5"], [6 / 5, 1 / 5])
  np.testing.assert_allclose(m["psp_ideal@5"], [9 / 5, 1 / 5])

  prop = 1.0 / inv
  ds = evaluate_topk(topk, labels, prop)  # default: dataset-level (XC repository)
  assert list(ds)[6:] == ["psp@1", "psp@3", "psp@5"]
  assert ds["psp@1"] == pytest.approx((2 + 1) / (4 + 1))
  assert ds["psp@3"] == pytest.approx((2 + 1 / 3) / (3 + 1 / 3))
  sm = evaluate_topk(topk, labels, prop, psp_normalization="sample")
  assert sm["psp@1"] == pytest.approx((0.5 + 1.0) / 2)
  assert sm["psp@3"] == pytest.approx((2 / 3 + 1.0) / 2)
  raw = evaluate_topk(topk, labels, prop, psp_normalization="none")
  assert raw["psp@1"] == pytest.approx((2 + 1) / 2)
  with pytest.raises(ValueError):
    evaluate_topk(topk, labels, prop, psp_normalization="bogus")


def test_psp_perfect_prediction_is_one_and_bounded():
  rng = np.random.default_rng(0)
  n, num_labels, m = 200, 50, 8
  prop = propensity_scores(rng.integers(0, 1000, num_labels), 10_000)
  inv = 1 / prop
  labels = np.full((n, m), -1)
  perfect = np.zeros((n, 5), dtype=np.int64)
  for i in range(n):
    y = rng.choice(num_labels, rng.integers(1, m + 1), replace=False)
    labels[i, : y.size] = y
    ranked = y[np.argsort(-inv[y], kind="stable")]
    rest = np.setdiff1d(np.arange(num_labels), y)
    perfect[i] = np.concatenate([ranked, rest])[:5]
  for norm in ("dataset", "sample"):
    out = evaluate_topk(perfect, labels, prop, psp_normalization=norm)
    for k in (1, 3, 5):
      assert out[f"psp@{k}"] == pytest.approx(1.0)
      assert out[f"ndcg@{k}"] == pytest.approx(1.0)
  random_preds = np.stack([rng.permutation(num_labels)[:5] for _ in range(n)])
  per = ranking_metrics(random_preds, labels, inv_propensity=inv)
  for k in (1, 3, 5):
    assert np.all(per[f"psp_raw@{k}"] <= per[f"psp_ideal@{k}"] + 1e-12)
    out = evaluate_topk(random_preds, labels, prop)
    assert 0.0 <= out[f"psp@{k}"] < 1.0


def test_padding_duplicates_and_negative_predictions_ignored():
  base = ranking_metrics(np.array([[3, 1, 4, 0, 2]]), np.array([[3, 4]]))
  # Same set with padding in front, in the middle, and a duplicate.
  for lab in ([[-1, 3, -1, 4]], [[4, -1, -1, 3, -1]], [[3, 3, 4, -1]]):
    other = ranking_metrics(np.array([[3, 1, 4, 0, 2]]), np.array(lab))
    for key in base:
      np.testing.assert_allclose(other[key], base[key], err_msg=f"{lab} {key}")
  # -1 predictions never match -1 padding.
  m = ranking_metrics(np.array([[-1, -1, -1, -1, -1]]), np.array([[3, -1]]))
  assert m["p@5"][0] == 0.0 and m["ndcg@5"][0] == 0.0
  # ...nor the previous row's largest label id (guards flat-index aliasing).
  m = ranking_metrics(np.array([[9, 0, 1, 2, 3], [-1, 4, 5, 6, 7]]), np.array([[9], [8]]))
  np.testing.assert_array_equal(m["p@1"], [1.0, 0.0])
  np.testing.assert_array_equal(m["p@5"], [0.2, 0.0])
  # nDCG ideal uses min(k, |y|): 6 labels, top-5 all correct -> nDCG@5 = 1, P@5 = 1.
  m = ranking_metrics(np.array([[0, 1, 2, 3, 4]]), np.array([[5, 4, 3, 2, 1, 0]]))
  assert m["p@5"][0] == 1.0 and m["ndcg@5"][0] == pytest.approx(1.0)


def test_input_validation():
  with pytest.raises(ValueError):
    ranking_metrics(TOPK[:, :3], LABELS)  # k=5 requested but only 3 predictions
  with pytest.raises(ValueError):
    ranking_metrics(TOPK, LABELS[:2])
  with pytest.raises(ValueError):  # label 5 is outside a 4-label propensity table
    ranking_metrics(TOPK, LABELS, inv_propensity=np.ones(4))
  with pytest.raises(TypeError):
    ranking_metrics(TOPK.astype(np.float32), LABELS)


def _reference_metrics(topk, labels, inv, ks):
  """Straightforward per-row Python implementation."""
  out = {}
  for k in ks:
    p, nd, raw, ideal = [], [], [], []
    for preds, lab in zip(topk, labels):
      y = {int(v) for v in lab if v >= 0}
      rel = [1.0 if int(t) in y else 0.0 for t in preds[:k]]
      p.append(sum(rel) / k)
      dcg = sum(r / math.log2(i + 2) for i, r in enumerate(rel))
      idcg = sum(1 / math.log2(i + 2) for i in range(min(k, len(y))))
      nd.append(dcg / idcg if idcg else 0.0)
      raw.append(sum(r * inv[t] for r, t in zip(rel, preds[:k])) / k)
      ideal.append(sum(sorted((inv[l] for l in y), reverse=True)[:k]) / k)
    out[f"p@{k}"], out[f"ndcg@{k}"] = np.array(p), np.array(nd)
    out[f"psp_raw@{k}"], out[f"psp_ideal@{k}"] = np.array(raw), np.array(ideal)
  return out


def _random_problem(seed, n=300, num_labels=40, m=6, kk=7):
  rng = np.random.default_rng(seed)
  labels = rng.integers(-1, num_labels, size=(n, m))  # includes padding and duplicates
  labels[rng.random(n) < 0.1] = -1  # some label-less rows
  topk = np.stack([rng.permutation(num_labels)[:kk] for _ in range(n)])
  inv = 1 / propensity_scores(rng.integers(0, 500, num_labels), 5000)
  return topk, labels.astype(np.int32), inv


def test_numpy_matches_reference_on_random_data():
  topk, labels, inv = _random_problem(1)
  ks = (1, 2, 3, 5, 7)
  got = ranking_metrics(topk, labels, inv_propensity=inv, ks=ks)
  ref = _reference_metrics(topk, labels, inv, ks)
  assert set(got) == set(ref)
  for key in ref:
    np.testing.assert_allclose(got[key], ref[key], rtol=1e-12, atol=1e-12, err_msg=key)


def test_jax_variant_matches_numpy():
  topk, labels, inv = _random_problem(2, m=3)  # m < max(ks) exercises the ideal padding
  ks = (1, 3, 5)
  want = ranking_metrics(topk, labels, inv_propensity=inv, ks=ks)
  got = ranking_metrics_jax(jnp.asarray(topk), jnp.asarray(labels), jnp.asarray(inv), ks=ks)
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  no_psp = ranking_metrics_jax(jnp.asarray(TOPK), jnp.asarray(LABELS))
  np.testing.assert_allclose(np.asarray(no_psp["p@3"]), [2 / 3, 1 / 3, 0.0], rtol=1e-6)
  # ks as a list (an unhashable-argument error from jit before) gives the tuple's numbers.
  as_list = ranking_metrics_jax(jnp.asarray(topk), jnp.asarray(labels), jnp.asarray(inv), ks=list(ks))
  for key in want:
    np.testing.assert_array_equal(np.asarray(as_list[key]), np.asarray(got[key]), err_msg=key)


@pytest.mark.parametrize("ks, error, message", [
    (3, TypeError, r"argument 'ks' must be a non-empty list or tuple of ints, got 3"),
    ((), TypeError, r"argument 'ks' must be a non-empty list or tuple of ints, got \(\)"),
    ((1, 0), ValueError, r"argument 'ks' must be in \[1, inf\], got 0"),
    ((1, 2.0), TypeError, r"argument 'ks' must be an integer, got float 2.0"),
    ((1, 9), ValueError, r"max\(ks\) = 9 exceeds the width of 'topk_ids' 5"),
])
def test_jax_variant_names_bad_cutoffs(ks, error, message):
  with pytest.raises(error, match="ranking_metrics_jax: " + message):
    ranking_metrics_jax(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 3), jnp.int32), ks=ks)
