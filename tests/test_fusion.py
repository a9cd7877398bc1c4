"""Score fusion with label centroids (sparsejax.fusion), against dense numpy references, and in a run."""

import json
import os
import shutil
import zipfile

import numpy as np
import pytest

from sparsejax import fusion, head_rankers
from sparsejax.data import PAD_ID, XCDataset
from sparsejax.serving import assets


def _dataset(rng, n=60, num_features=30, num_labels=12, max_labels=3):
  indptr, indices, values, label_indptr, label_indices = [0], [], [], [0], []
  for _ in range(n):
    f = np.sort(rng.choice(num_features, rng.integers(1, 8), replace=False))
    indices += f.tolist()
    values += rng.uniform(0.1, 1.0, len(f)).tolist()
    indptr.append(len(indices))
    labels = rng.choice(num_labels - 1, rng.integers(1, max_labels + 1), replace=False)  # the last label: unused
    label_indices += labels.tolist()
    label_indptr.append(len(label_indices))
  return XCDataset(np.array(indptr), np.array(indices), np.array(values), np.array(label_indptr),
                   np.array(label_indices), num_features, num_labels)


def _dense(data):
  x = np.zeros((len(data), data.num_features))
  y = np.zeros((len(data), data.num_labels))
  for i in range(len(data)):
    a, b = data.indptr[i], data.indptr[i + 1]
    x[i, data.indices[a:b]] += data.values[a:b]
    y[i, data.label_indices[data.label_indptr[i]:data.label_indptr[i + 1]]] = 1
  return x, y


def test_label_centroids_are_normalised_sums_of_the_labels_rows():
  data = _dataset(np.random.default_rng(0))
  x, y = _dense(data)
  sums = y.T @ x
  norms = np.linalg.norm(sums, axis=1, keepdims=True)
  expected = np.divide(sums, norms, out=np.zeros_like(sums), where=norms > 0)
  centroids = fusion.label_centroids(data)
  np.testing.assert_allclose(centroids.matrix().toarray(), expected, rtol=1e-5, atol=1e-6)
  assert np.diff(centroids.indptr)[-1] == 0  # a label without a training sample: an empty row
  for label in range(data.num_labels):  # increasing feature ids within a row
    row = centroids.indices[centroids.indptr[label]:centroids.indptr[label + 1]]
    assert np.all(np.diff(row) > 0)


def test_host_threads_are_the_usable_cores_at_most_the_kernels_cap(monkeypatch):
  cores = len(os.sched_getaffinity(0))
  monkeypatch.delenv("SPARSEJAX_NUM_THREADS", raising=False)
  assert fusion._host_threads() == cores
  monkeypatch.setenv("SPARSEJAX_NUM_THREADS", "1")
  assert fusion._host_threads() == 1
  monkeypatch.setenv("SPARSEJAX_NUM_THREADS", str(cores + 5))
  assert fusion._host_threads() == cores


@pytest.mark.parametrize("chunk", [1 << 24, 7])  # one chunk, and one sample a chunk
def test_centroid_scores_are_dot_products_with_padding_scored_zero(monkeypatch, chunk):
  monkeypatch.setattr(fusion, "_CHUNK_ENTRIES", chunk)
  rng = np.random.default_rng(1)
  data = _dataset(rng)
  centroids = fusion.label_centroids(data)
  c = centroids.matrix().toarray()
  queries = _dataset(rng, n=9)
  fi, fv, _ = queries.to_padded(np.arange(len(queries)), 10, 1)
  fi[0, :] = PAD_ID  # rows of padding only: the first, and one between others
  fi[4, :] = PAD_ID
  ids = rng.integers(0, data.num_labels, (9, 6))
  ids[1, 4:] = PAD_ID
  ids[2, 5] = data.num_labels  # outside [0, N): padding
  x = np.zeros((9, data.num_features))
  for b in range(9):
    for f, v in zip(fi[b], fv[b]):
      if f >= 0:
        x[b, f] += v
  expected = np.einsum("bf,brf->br", x, c[np.clip(ids, 0, data.num_labels - 1)])
  expected[(ids < 0) | (ids >= data.num_labels)] = 0
  monkeypatch.setattr(fusion, "_host_threads", lambda: 3)  # the chunks over 3 threads (one, where one chunk)
  got = fusion.centroid_scores(centroids, fi, fv, ids)
  assert got.shape == (9, 6) and got.dtype == np.float32
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  monkeypatch.setattr(fusion, "_host_threads", lambda: 1)  # one thread: the same floats
  np.testing.assert_array_equal(fusion.centroid_scores(centroids, fi, fv, ids), got)
  # Centroids without their lookup (as built by hand) make it on the call: the same floats.
  np.testing.assert_array_equal(fusion.centroid_scores(centroids._replace(lookup=None), fi, fv, ids), got)
  assert np.all(got[0] == 0) and np.all(got[4] == 0) and np.any(got[3] != 0) and np.any(got[5] != 0)


def test_rerank_sorts_by_the_fused_score_ties_in_the_networks_order():
  scores = np.array([[3.0, 2.0, 1.0, 0.0], [5.0, 4.0, 4.0, -np.inf]], np.float32)
  ids = np.array([[10, 11, 12, 13], [20, 21, 22, PAD_ID]])
  cent = np.array([[0.0, 0.5, 0.9, 0.1], [0.0, 0.0, 0.0, 1.0]], np.float32)
  s, i = fusion.rerank(scores, ids, cent, 0.0, 3)  # weight 0: the network's ranking
  np.testing.assert_array_equal(i, ids[:, :3])
  s, i = fusion.rerank(scores, ids, cent, 10.0, 3)
  fused = scores + 10 * cent
  for row in range(2):  # brute force: sorted by fused score, stable among equals
    order = sorted(range(4), key=lambda j: (-fused[row, j], j))[:3]
    np.testing.assert_array_equal(i[row], ids[row, order])
    np.testing.assert_allclose(s[row], fused[row, order])
  np.testing.assert_array_equal(i[1], [20, 21, 22])  # -inf + weight stays last; the tie 4 == 4 keeps 21 first


def test_choose_weight_picks_the_best_validation_score_ties_to_the_smaller_weight():
  ids = np.array([[1, 2], [3, 4], [5, 6]])
  scores = np.array([[2.0, 1.0], [2.0, 1.0], [2.0, 1.0]], np.float32)
  cent = np.array([[0.0, 0.5], [0.0, 0.5], [0.0, 0.0]], np.float32)
  labels = np.array([[2], [4], [5]])  # the centroids' favourites are right in the first two rows
  weight, ranker_weight, table, _ = fusion.choose_weights(scores, ids, cent, labels, weights=(0.0, 1.0, 5.0, 10.0))
  assert table == {0.0: pytest.approx(1 / 3), 1.0: pytest.approx(1 / 3), 5.0: pytest.approx(1.0),
                   10.0: pytest.approx(1.0)}
  assert weight == 5.0 and ranker_weight == 0.0  # 5 and 10 tie: the smaller; no rankers: their weight 0
  weight, *_ = fusion.choose_weights(scores, ids, cent, np.array([[1], [3], [5]]), weights=(0.0, 1.0, 5.0))
  assert weight == 0.0  # the centroids only hurt: the network alone


def test_choose_weights_searches_both_terms_together():
  ids = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
  scores = np.full((4, 2), [2.0, 1.0], np.float32)
  cent = np.array([[0.0, 0.5], [0.0, 0.5], [0.0, 0.0], [0.0, 0.0]], np.float32)
  ranker = np.array([[0.0, 0.0], [0.0, -5.0], [-3.0, 0.0], [0.0, 0.0]], np.float32)
  labels = np.array([[2], [3], [6], [7]])
  # Row 0 needs the centroids (w >= 5); row 1 then needs the ranker's -5 on id 4 (w_r >= w / 10); row 2 needs the
  # ranker's -3 on id 5 (w_r > 1/3); row 3 is the network's.
  weight, ranker_weight, table, ranker_table = fusion.choose_weights(
      scores, ids, cent, labels, weights=(0.0, 5.0, 10.0), ranker_score=ranker, ranker_weights=(0.0, 0.5, 1.0))
  assert (weight, ranker_weight) == (5.0, 0.5)  # the best pair; ties: the smaller ranker weight, then weight
  assert table == {0.0: pytest.approx(0.75), 5.0: pytest.approx(1.0), 10.0: pytest.approx(0.75)}  # at w_r = 0.5
  assert ranker_table == {0.0: pytest.approx(0.5), 0.5: pytest.approx(1.0), 1.0: pytest.approx(1.0)}  # at w = 5
  brute = {}
  for w in (0.0, 5.0, 10.0):
    for wr in (0.0, 0.5, 1.0):
      brute[w, wr] = np.mean([ids[b, np.argmax(scores[b] + w * cent[b] + wr * ranker[b])] == labels[b, 0]
                              for b in range(4)])
  assert brute[5.0, 0.5] == max(brute.values()) == 1.0


def test_the_fusion_weight_is_chosen_on_the_first_samples_asked_for():
  from sparsejax.evaluation import Evaluator

  rng = np.random.default_rng(3)
  data, train = _dataset(rng, n=300), _dataset(rng, n=200)
  centroids = fusion.label_centroids(train)
  weights = rng.normal(size=(data.num_features, data.num_labels)).astype(np.float32)
  seen = []

  def predict(state, fi, fv):  # a linear network's 6 best labels, scored by numpy
    x = np.zeros((len(fi), data.num_features), np.float32)
    for b in range(len(fi)):
      real = fi[b] >= 0
      np.add.at(x[b], fi[b][real], fv[b][real])
    seen.append(int((fi >= 0).any(1).sum()))
    logits = x @ weights
    ids = np.argsort(-logits, 1, kind="stable")[:, :6]
    return np.take_along_axis(logits, ids, 1), ids, None

  propensity = np.ones(data.num_labels)
  first = Evaluator(data, propensity, None, batch_size=32).fusion_weights(predict, None, centroids, None, "p@1", 100)
  assert sum(seen) == 100  # the samples after the first 100 are not predicted
  subset = Evaluator(data.subset(np.arange(100)), propensity, None, batch_size=32)
  assert first == subset.fusion_weights(predict, None, centroids, None, "p@1")
  whole = Evaluator(data, propensity, None, batch_size=32).fusion_weights(predict, None, centroids, None, "p@1")
  assert whole[2] != first[2]  # all 300 samples score otherwise


def _train(workdir, **settings):
  from sparsejax.config import Config
  from sparsejax.settings import override
  from sparsejax.train import train_and_evaluate

  config = override(Config(), dataset="synthetic", synthetic_samples=3000, synthetic_features=400,
                    synthetic_labels=300, eval_every=60, progress=False, recipe="none",
                    **{"max_steps": 120, **settings})
  final = train_and_evaluate(config, str(workdir))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert json.loads(f.readlines()[-1])["p@1"] == final["p@1"]
  return final


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory):
  """A fused run of :func:`_train`'s defaults, trained once for the tests that read it or continue a copy:
  ``(workdir, final evaluation)``."""
  workdir = tmp_path_factory.mktemp("fused")
  return workdir, _train(workdir)


def test_a_run_fuses_with_the_weight_chosen_on_validation_and_load_serves_it(fused_run):
  import sparsejax
  from sparsejax.config import Config
  from sparsejax.data import load_dataset
  from sparsejax.settings import override

  workdir, final = fused_run
  weights = {float(w): v for w, v in final["fusion_validation"].items()}
  assert final["fusion_weight"] in weights and weights[final["fusion_weight"]] == max(weights.values())
  assert "network_p@1" in final and final["fusion_weight"] > 0  # the synthetic labels: the centroids help
  model = sparsejax.load(str(workdir))
  assert model.fusion_weight == final["fusion_weight"]
  config = override(Config(), dataset="synthetic", synthetic_samples=3000, synthetic_features=400,
                    synthetic_labels=300)
  test = load_dataset(config.data).test
  again = model.evaluate(test)
  for key in ("p@1", "p@3", "p@5", "sampled_p@1"):
    assert again[key] == pytest.approx(final[key], abs=1e-9), key
  # The served ranking is the network's best CANDIDATES re-ranked by the centroids and the head rankers, as
  # fusion.rerank says.
  scores, ids = model.predict(test, top=5)
  fi, fv, _ = model.features(test).to_padded(np.arange(len(test)), model.max_features, 1)
  net_scores, net_ids = (np.asarray(a) for a in model.network_predictor(min(fusion.CANDIDATES, 300))(model.params, fi,
                                                                                                 fv)[:2])
  fused = model._fusion
  ranker_score = None if fused.rankers is None else head_rankers.ranker_scores(fused.rankers, fi, fv, net_ids)
  expected_scores, expected_ids = fusion.rerank(net_scores, net_ids, fusion.centroid_scores(
      fused.centroids, fi, fv, net_ids), model.fusion_weight, 5, ranker_score, model.ranker_weight)
  np.testing.assert_array_equal(ids, expected_ids)
  np.testing.assert_allclose(scores, expected_scores, rtol=1e-6)


def test_without_fusion_the_run_reports_the_network_alone(tmp_path):
  import sparsejax

  final = _train(tmp_path / "plain", centroid_fusion=False)
  assert "fusion_weight" not in final and "network_p@1" not in final
  assert sparsejax.load(str(tmp_path / "plain")).fusion_weight == 0.0
  assert not os.path.exists(tmp_path / "plain" / "assets" / "centroid_fusion.npz")


def test_a_fused_run_continued_without_fusion_serves_the_network_alone(fused_run, tmp_path):
  import sparsejax

  assert fused_run[1]["fusion_weight"] > 0
  shutil.copytree(fused_run[0], tmp_path / "run")  # continued in a copy: the fused run stays as the others read it
  final = _train(tmp_path / "run", centroid_fusion=False, max_steps=180)  # extended: 60 more steps
  assert final["last_step"] == 180 and "fusion_weight" not in final
  model = sparsejax.load(str(tmp_path / "run"))  # its seal checks out without the former fusion's file
  assert model.fusion_weight == 0.0 and not (tmp_path / "run" / "assets" / "centroid_fusion.npz").exists()


def test_a_fusion_file_stores_the_centroids_and_deflates_the_rankers(tmp_path):
  """Deflating labels_heavy's 104M centroid entries took 73 s of its final evaluation; numpy reads both kinds."""
  rng = np.random.default_rng(0)
  stored = {"values": rng.standard_normal(1000).astype(np.float32), "weight": np.float64(2.5)}
  deflated = {"ranker_weights": np.zeros((500, 3), np.float32)}
  path = str(tmp_path / "f.npz")
  assets._savez(path, stored, deflated)
  with zipfile.ZipFile(path) as archive:
    assert {i.filename: i.compress_type for i in archive.infolist()} == {
        "values.npy": zipfile.ZIP_STORED, "weight.npy": zipfile.ZIP_STORED, "ranker_weights.npy": zipfile.ZIP_DEFLATED}
    assert archive.getinfo("ranker_weights.npy").compress_size < 500 * 3 * 4 // 10
  with np.load(path, allow_pickle=False) as f:
    assert sorted(f.files) == ["ranker_weights", "values", "weight"]
    np.testing.assert_array_equal(f["values"], stored["values"])
    assert float(f["weight"]) == 2.5 and not f["ranker_weights"].any()
