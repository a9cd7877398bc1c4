"""Head rankers (sparsejax.head_rankers): the kernel's solve against the primal's and liblinear's solutions, its
errors, the scores against dense numpy, and the fusion's saved form."""

import os
import re
import time

import numpy as np
import pytest
import scipy.sparse as sp

from sparsejax import fusion, head_rankers
from sparsejax.data import PAD_ID, XCDataset


def _dataset(rng, n=400, num_features=50, num_labels=8):
  """Rows whose labels follow a linear rule of their features (so that the rankers have something to find)."""
  x = sp.random(n, num_features, density=0.15, random_state=rng, format="csr", dtype=np.float64)
  truth = rng.normal(size=(num_features, num_labels)) * 3
  z = x @ truth - np.linspace(0.5, 3, num_labels)
  y = (z + rng.normal(size=z.shape) > 0)
  y[np.arange(n), rng.integers(0, num_labels, n)] = True  # a label on every row
  label_indptr = np.concatenate([[0], np.cumsum(y.sum(1))])
  return XCDataset(x.indptr, x.indices, x.data.astype(np.float32), label_indptr, np.nonzero(y)[1], num_features,
                   num_labels), x.toarray(), y


def test_head_labels_are_the_most_frequent_above_the_share_at_most_most():
  rng = np.random.default_rng(0)
  data, _, y = _dataset(rng)
  counts = y.sum(0)
  order = sorted(range(8), key=lambda label: (-counts[label], label))
  np.testing.assert_array_equal(head_rankers.head_labels(data, 3, min_share=0.0), order[:3])
  share = np.sort(counts)[::-1][4] / len(data)  # the fifth most frequent's share: five labels at least that
  assert list(head_rankers.head_labels(data, 8, min_share=share)) == [label for label in order
                                                                       if counts[label] >= share * len(data)]
  assert len(head_rankers.head_labels(data, 0)) == 0
  assert head_rankers.head_labels(data, 3).dtype == np.int32


def _primal_solution(x, y, c):
  """``(w, b)`` minimising ``0.5 (|w|^2 + b^2) + c sum_i log(1 + exp(-y_i (x_i . w + b)))`` (``y`` in {0, 1}) by
  scipy's L-BFGS on the primal, to a tight tolerance: a reference independent of the kernel's dual method."""
  import scipy.optimize
  a = np.hstack([x, np.ones((len(x), 1))])
  sign = np.where(y, 1.0, -1.0)

  def loss_and_gradient(theta):
    margin = sign * (a @ theta)
    return (0.5 * theta @ theta + c * np.logaddexp(0.0, -margin).sum(),
            theta - c * a.T @ (sign * scipy.special.expit(-margin)))

  theta = scipy.optimize.minimize(loss_and_gradient, np.zeros(a.shape[1]), jac=True, method="L-BFGS-B",
                                  options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 10_000}).x
  return theta[:-1], theta[-1]


def test_fit_solves_each_labels_l2_logistic_regression():
  from sklearn.linear_model import LogisticRegression

  rng = np.random.default_rng(1)
  data, x, y = _dataset(rng)
  labels = np.array([5, 0, 2], np.int32)
  rankers = head_rankers.fit(data, labels, c=2.0, tolerance=1e-6, max_epochs=10_000)
  assert rankers.weights.shape == (50, 3) and rankers.weights.dtype == np.float32 and rankers.bias.shape == (3,)
  np.testing.assert_array_equal(rankers.labels, labels)
  for j, label in enumerate(labels):
    w, b = _primal_solution(x, y[:, label], 2.0)
    np.testing.assert_allclose(rankers.weights[:, j], w, atol=1e-4)
    assert rankers.bias[j] == pytest.approx(b, abs=1e-4)
    # liblinear's solution of the same objective (its bias a feature of value 1, penalised).
    reference = LogisticRegression(solver="liblinear", C=2.0, tol=1e-10, max_iter=100_000).fit(x, y[:, label])
    np.testing.assert_allclose(rankers.weights[:, j], reference.coef_[0], atol=1e-4)
  # A feature no row has keeps weight 0 (what keeps the saved rankers small on wide data): 5 more features.
  wider = XCDataset(data.indptr, data.indices, data.values, data.label_indptr, data.label_indices, 55, 8)
  padded = head_rankers.fit(wider, labels, c=2.0, tolerance=1e-6, max_epochs=10_000)
  assert padded.weights.shape == (55, 3) and np.all(padded.weights[50:] == 0)
  np.testing.assert_array_equal(padded.weights[:50], rankers.weights)
  # The same data, the same bits; another seed visits the rows in another order (a solution as close).
  again = head_rankers.fit(data, labels, c=2.0, tolerance=1e-6, max_epochs=10_000)
  np.testing.assert_array_equal(again.weights, rankers.weights)
  other = head_rankers.fit(data, labels, c=2.0, tolerance=1e-6, max_epochs=10_000, seed=1)
  assert not np.array_equal(other.weights, rankers.weights)
  np.testing.assert_allclose(other.weights, rankers.weights, atol=1e-4)


def test_fit_stops_at_the_tolerance_or_the_epoch_cap(info_logs):
  rng = np.random.default_rng(5)
  data, x, y = _dataset(rng)
  w, b = _primal_solution(x, y[:, 1], head_rankers.C)
  loose = head_rankers.fit(data, np.array([1], np.int32), tolerance=0.5)
  one = head_rankers.fit(data, np.array([1], np.int32), tolerance=1e-9, max_epochs=1)
  error = lambda r: np.abs(r.weights[:, 0] - w).max()
  solved = error(head_rankers.fit(data, np.array([1], np.int32)))
  assert error(one) > solved and error(loose) > solved
  head_rankers.fit(data, np.array([1, 3], np.int32), tolerance=1e-9, max_epochs=3)
  assert "3-3 epochs of dual coordinate descent" in info_logs.text


def test_fit_sums_a_feature_repeated_in_a_row_and_solves_degenerate_labels():
  """A row may list a feature twice (the kernel's |x_i|^2 needs it summed: a review found the curvature wrong); a
  label on no row and one on every row give finite models of the right sign; bad labels and settings are named."""
  rng = np.random.default_rng(6)
  data, x, y = _dataset(rng, n=120)
  split = lambda a: np.repeat(a, 2)  # every stored feature twice, at half its value
  indptr = data.indptr * 2
  repeated = XCDataset(indptr, split(data.indices), split(data.values) / 2, data.label_indptr, data.label_indices,
                       50, 8)
  labels = np.array([0, 3], np.int32)
  want = head_rankers.fit(data, labels, tolerance=1e-6, max_epochs=10_000)
  got = head_rankers.fit(repeated, labels, tolerance=1e-6, max_epochs=10_000)
  np.testing.assert_allclose(got.weights, want.weights, atol=1e-5)
  np.testing.assert_allclose(got.bias, want.bias, atol=1e-5)
  # Label 8 on no row, label 9 on every row (two more labels in a copy of the data).
  rows = zip(data.label_indptr[:-1], data.label_indptr[1:])
  label_lists = [list(data.label_indices[a:b]) + [9] for a, b in rows]
  label_indptr = np.concatenate([[0], np.cumsum([len(r) for r in label_lists])])
  both = XCDataset(data.indptr, data.indices, data.values, label_indptr, np.concatenate(label_lists), 50, 10)
  rankers = head_rankers.fit(both, np.array([8, 9], np.int32))
  assert np.isfinite(rankers.weights).all() and rankers.bias[0] < -1 and rankers.bias[1] > 1
  z = x @ rankers.weights.astype(np.float64) + rankers.bias
  assert (z[:, 0] < 0).all() and (z[:, 1] > 0).all()
  with pytest.raises(ValueError, match=r"labels must be distinct ids in \[0, 8\), got \[1, 1\]"):
    head_rankers.fit(data, np.array([1, 1], np.int32))
  with pytest.raises(ValueError, match=r"labels must be distinct ids in \[0, 8\), got \[8\]"):
    head_rankers.fit(data, np.array([8], np.int32))
  with pytest.raises(ValueError, match="c, tolerance and max_epochs must be positive, got 0.0, 0.01, 100"):
    head_rankers.fit(data, labels, c=0.0)


def test_without_a_cpu_backend_a_run_fits_no_rankers(tmp_path, small_config, monkeypatch, info_logs):
  """The kernel is CPU code: a dense network on a GPU (JAX_PLATFORMS=cuda starts no CPU backend) is fused without
  head rankers, with a warning, instead of failing at the fit."""
  import jax

  from sparsejax.settings import override
  from sparsejax.train import head_ranking

  def no_cpu(backend=None):
    raise RuntimeError(f"Unknown backend {backend}")

  assert head_rankers.cpu_available()
  monkeypatch.setattr(jax, "local_devices", no_cpu)
  assert not head_rankers.cpu_available()
  config = override(small_config, validation_fraction=0.1)
  assert head_ranking.wanted(config)
  assert head_ranking.prepare(config, str(tmp_path), None, searched=False) == (None, None, 0.0)
  assert "head rankers: none fitted: their kernel is CPU code and this process's JAX has no CPU backend" in \
      info_logs.text


@pytest.mark.parametrize("change, message", [
    (dict(indptr=[0, 2, 1, 3]), "argument 'indptr' must be non-decreasing from 0 to nnz (from 'indices') = 3, got "
                                "indptr[2] = 1 after 2"),
    (dict(indptr=[0, 1, 2, 2]), "argument 'indptr' must be non-decreasing from 0 to nnz (from 'indices') = 3, got "
                                "indptr[3] = 2 after 2"),
    (dict(indices=[0, 4, 1]), "argument 'indices' has id 4 at flat position 1, outside [0, F = 4)"),
    (dict(positive_rows=[3]), "argument 'positive_rows' has id 3 at flat position 0, outside [0, n = 3)"),
    (dict(positive_offsets=[0, 2]), "argument 'positive_offsets' must be non-decreasing from 0 to P (from "
                                    "'positive_rows') = 1, got positive_offsets[1] = 2"),
    (dict(c=0.0), "attribute 'c' must be a positive number"),
    (dict(tolerance=float("nan")), "attribute 'tolerance' must be a positive number"),
    (dict(max_epochs=0), "attribute 'max_epochs' must be in [1, 2^31), got 0"),
    (dict(max_epochs=2**31), "attribute 'max_epochs' must be in [1, 2^31), got 2147483648"),
    (dict(num_features=0), "attribute 'num_features' must be in [1, 2^31), got 0"),
    (dict(indptr=[1, 1, 2, 3]), "argument 'indptr' must be non-decreasing from 0 to nnz (from 'indices') = 3, got "
                                "indptr[0] = 1"),
])
def test_the_kernel_names_a_bad_argument(change, message):
  import jax
  import jax.numpy as jnp

  from sparsejax import _ffi
  arrays = dict(indptr=[0, 1, 2, 3], indices=[0, 3, 1], values=[1.0, 2.0, 3.0], positive_offsets=[0, 1],
                positive_rows=[2])
  attrs = dict(num_features=4, c=1.0, tolerance=0.1, max_epochs=5)
  arrays.update({k: v for k, v in change.items() if k in arrays})
  attrs.update({k: v for k, v in change.items() if k in attrs})
  K = len(arrays["positive_offsets"]) - 1
  call = _ffi.ffi_call("logistic_regression", (jax.ShapeDtypeStruct((K, 4), jnp.float32),
                                               jax.ShapeDtypeStruct((K,), jnp.float32),
                                               jax.ShapeDtypeStruct((K,), jnp.int32)))
  args = [np.asarray(arrays[k], np.float32 if k == "values" else np.int32) for k in
          ("indptr", "indices", "values", "positive_offsets", "positive_rows")]
  with pytest.raises(Exception, match="logistic_regression: " + re.escape(message)):
    jax.block_until_ready(call(*args, num_features=np.int64(attrs["num_features"]), c=np.float32(attrs["c"]),
                               tolerance=np.float32(attrs["tolerance"]), max_epochs=np.int64(attrs["max_epochs"]),
                               seed=np.int64(0)))


def test_ranker_scores_are_the_log_odds_of_head_candidates_and_0_elsewhere():
  rng = np.random.default_rng(2)
  data, _, _ = _dataset(rng)
  rankers = head_rankers.fit(data, np.array([3, 1], np.int32), max_epochs=20)
  queries, x, _ = _dataset(rng, n=7)
  fi, fv, _ = queries.to_padded(np.arange(7), 20, 1)
  fi[2, :] = PAD_ID  # a row of padding only
  fi[3, -1], fv[3, -1] = 50, 9.0  # a feature id outside [0, F): not scored
  ids = np.array([[1, 3, 0, 7], [3, 3, 2, PAD_ID], [1, 3, 5, 6], [0, 2, 4, 8], [1, 1, 1, 1], [3, 0, 0, 0],
                  [7, 6, 3, 1]])  # 8: outside [0, N)
  x[2] = 0
  z = x @ rankers.weights.astype(np.float64) + rankers.bias
  expected = np.zeros(ids.shape)
  for b in range(7):
    for r, label in enumerate(ids[b]):
      if label in (3, 1):
        expected[b, r] = z[b, list(rankers.labels).index(label)]
  got = head_rankers.ranker_scores(rankers, fi, fv, ids)
  assert got.dtype == np.float32 and got.shape == ids.shape
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  assert got[2, 0] == pytest.approx(rankers.bias[1]) and got[3].tolist() == [0, 0, 0, 0]
  empty = head_rankers.HeadRankers(np.zeros(0, np.int32), np.zeros((50, 0), np.float32), np.zeros(0, np.float32))
  assert not head_rankers.ranker_scores(empty, fi, fv, ids).any()


def test_the_fused_ranking_adds_the_rankers_log_odds_at_their_weight():
  rng = np.random.default_rng(3)
  data, _, _ = _dataset(rng)
  rankers = head_rankers.fit(data, head_rankers.head_labels(data, 4, min_share=0.0), max_epochs=30)
  centroids = fusion.label_centroids(data)
  queries, _, _ = _dataset(rng, n=5)
  fi, fv, _ = queries.to_padded(np.arange(5), 20, 1)
  ids = np.tile(np.arange(8), (5, 1))
  scores = np.sort(rng.normal(size=(5, 8)).astype(np.float32), axis=1)[:, ::-1]
  fused_scores, fused_ids = fusion.fused_top(fusion.Fusion(centroids, 2.0, rankers, 0.5), scores, ids, fi, fv, 3)
  total = (scores + 2.0 * fusion.centroid_scores(centroids, fi, fv, ids)
           + 0.5 * head_rankers.ranker_scores(rankers, fi, fv, ids))
  for b in range(5):
    order = sorted(range(8), key=lambda r: (-total[b, r], r))[:3]
    np.testing.assert_array_equal(fused_ids[b], ids[b, order])
    np.testing.assert_allclose(fused_scores[b], total[b, order], rtol=1e-5)
  # Weight 0: the rankers change nothing.
  unweighted = fusion.fused_top(fusion.Fusion(centroids, 2.0, rankers, 0.0), scores, ids, fi, fv, 3)[1]
  np.testing.assert_array_equal(unweighted, fusion.fused_top(fusion.Fusion(centroids, 2.0), scores, ids, fi, fv, 3)[1])


def test_saved_rankers_load_back_and_damaged_ones_are_refused(tmp_path):
  from sparsejax.serving import assets
  from sparsejax.workdir.seals import IntegrityError

  rng = np.random.default_rng(4)
  data, _, _ = _dataset(rng)
  rankers = head_rankers.fit(data, np.array([2, 6], np.int32), max_epochs=10)
  fused = fusion.Fusion(fusion.label_centroids(data), 1.0, rankers, 2.0)
  (tmp_path / assets.ASSETS).mkdir()
  assets.save_fusion(str(tmp_path), None, fused)
  back = assets.read_fusion(str(tmp_path / assets.ASSETS), 8, 50)
  assert (back.weight, back.ranker_weight) == (1.0, 2.0)
  for got, want in zip(back.rankers, rankers):
    np.testing.assert_array_equal(got, want)
  # Weight 0: the rankers are not kept (nothing to serve).
  assets.save_fusion(str(tmp_path), None, fused._replace(ranker_weight=0.0))
  assert assets.read_fusion(str(tmp_path / assets.ASSETS), 8, 50).rankers is None
  path = tmp_path / assets.ASSETS / assets.FUSION
  with np.load(path) as f:
    arrays = dict(f)
  np.savez(path, **{**arrays, "ranker_weight": np.float64(1.0), "ranker_labels": np.array([2, 9]),
                    "ranker_weights": rankers.weights, "ranker_bias": rankers.bias})
  with pytest.raises(IntegrityError, match="not head rankers of 8 labels over 50 features"):
    assets.read_fusion(str(tmp_path / assets.ASSETS), 8, 50)


def test_a_run_fits_its_rankers_once_keeps_them_and_records_their_weight(tmp_path, small_config, monkeypatch):
  from sparsejax.data import load_dataset
  from sparsejax.settings import override
  from sparsejax.train import head_ranking, plan, train_and_evaluate

  config = override(small_config, validation_fraction=0.1, synthetic_labels_per_sample=3, max_steps=40,
                    recipe="none", ensemble_members=1)
  fits = []
  real_fit = head_rankers.fit

  def timed_fit(*args, **kwargs):
    t_start = time.time()
    fitted = real_fit(*args, **kwargs)
    fits.append(time.time() - t_start)
    return fitted

  monkeypatch.setattr(head_rankers, "fit", timed_fit)
  real_load = plan.load_data
  monkeypatch.setattr(plan, "load_data", lambda c: time.sleep(2) or real_load(c))  # a slow load: not charged
  (tmp_path / head_ranking.FILE).write_bytes(b"another run's")  # a new run's are its own
  final = train_and_evaluate(config, str(tmp_path))
  assert len(fits) == 1 and final["ranker_seconds"] < fits[0] + 1.0
  # The rankers kept are those of the run's training split (its validation split held out), fitted again here.
  data = load_dataset(config.data, seed=config.run.seed)
  train = head_ranking.training_split(config, data)
  assert len(train) == len(plan.split_data(config, data).train)
  expected = real_fit(train, head_rankers.head_labels(train, config.run.head_rankers))
  kept = head_ranking.read(config, str(tmp_path), train)
  assert len(kept.labels) > 0 and final["ranker_labels"] == len(kept.labels)
  for got, want in zip(kept, expected):
    np.testing.assert_array_equal(got, want)
  table = {float(w): v for w, v in final["ranker_validation"].items()}
  assert table[final["ranker_weight"]] == max(table.values())
  assert final["ranker_seconds"] > 0  # what the fit charged to the budget (none here: a step budget)
  # Continued: the kept rankers, not a second fit.
  final = train_and_evaluate(override(config, max_steps=60), str(tmp_path))
  assert final["last_step"] == 60 and len(fits) == 1 and "ranker_weight" in final and "ranker_seconds" not in final
  # Continued without them (deleted): fused without, not fitted again (nor charged).
  os.remove(tmp_path / head_ranking.FILE)
  final = train_and_evaluate(override(config, max_steps=70), str(tmp_path))
  assert final["last_step"] == 70 and len(fits) == 1 and not any(key.startswith("ranker_") for key in final)
  head_ranking.save(config, str(tmp_path), kept, train)
  # Kept for another --head_rankers, or for other data: not used.
  assert head_ranking.read(override(config, head_rankers=5), str(tmp_path), train) is None
  assert head_ranking.read(config, str(tmp_path), train.subset(np.arange(10))) is None


def test_without_head_rankers_a_run_fits_none(tmp_path, small_config):
  from sparsejax.settings import override
  from sparsejax.train import head_ranking, train_and_evaluate

  (tmp_path / head_ranking.FILE).write_bytes(b"another run's")  # removed: not this new run's
  final = train_and_evaluate(override(small_config, validation_fraction=0.1, head_rankers=0), str(tmp_path))
  assert "ranker_weight" not in final and "fusion_weight" in final
  assert not (tmp_path / head_ranking.FILE).exists()


def test_a_damaged_kept_file_is_not_used(tmp_path, small_config):
  from sparsejax.data import load_dataset
  from sparsejax.settings import override
  from sparsejax.train import head_ranking

  config = override(small_config, validation_fraction=0.1)
  train = head_ranking.training_split(config, load_dataset(config.data, seed=config.run.seed))
  (tmp_path / head_ranking.FILE).write_bytes(b"PK\x03\x04 not a zip")
  assert head_ranking.read(config, str(tmp_path), train) is None



def test_where_no_label_has_a_ranker_the_run_records_none(tmp_path, small_config, monkeypatch):
  from sparsejax.settings import override
  from sparsejax.train import train_and_evaluate

  monkeypatch.setattr(head_rankers, "head_labels", lambda train, most: np.zeros(0, np.int32))  # none frequent enough
  final = train_and_evaluate(override(small_config, validation_fraction=0.1), str(tmp_path))
  assert "fusion_weight" in final and not any(key.startswith("ranker_") for key in final)
