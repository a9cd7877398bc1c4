"""Using a trained model: sparsejax.load, sparsejax-predict, sparsejax-plot, the installed commands."""

import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest
import scipy.sparse

import sparsejax
from sparsejax import data, memory
from sparsejax.data import XCDataset
from sparsejax.serving import model as serving_model
from sparsejax.serving import restore
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate
from sparsejax.train.metric_writer import read_records


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory, small_config):
  """200 steps on a small synthetic set: ``(workdir, final evaluation, test set)``."""
  workdir = tmp_path_factory.mktemp("synthetic")
  config = override(small_config, max_steps=200, eval_every=100, log_every=50, checkpoint_every=100)
  final = train_and_evaluate(config, str(workdir))
  return workdir, final, data.load_dataset(config.data, seed=config.run.seed).test


def _pairs(line: str) -> list[tuple[str, float]]:
  """A sparsejax-predict line's ``(label, score)`` pairs: tab-separated, as a name may hold spaces."""
  return [(label, float(score)) for label, score in (pair.rsplit(":", 1) for pair in line.split("\t"))]


def test_predict_command_writes_top_labels_per_sample(synthetic_run, tmp_path, installed_command):
  workdir, _, test = synthetic_run
  data.save_xc_file(test, tmp_path / "test.txt")
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                        f"--input={tmp_path / 'test.txt'}", "--top=5"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stderr == ""  # no log lines (orbax logs each restore at INFO): stdout holds the predictions
  lines = out.stdout.splitlines()
  assert len(lines) == len(test) == 300
  scores, ids = sparsejax.load(str(workdir)).predict(test, top=5)
  for line, want_ids, want_scores in zip(lines, ids, scores):
    pairs = _pairs(line)
    assert [int(label) for label, _ in pairs] == want_ids.tolist()
    np.testing.assert_allclose([s for _, s in pairs], want_scores, rtol=1e-4)
    assert all(a >= b for (_, a), (_, b) in zip(pairs, pairs[1:]))
  # svmlight (the same lines without the header) gives the same predictions.
  (tmp_path / "test.svm").write_text("".join((tmp_path / "test.txt").read_text().splitlines(True)[1:]))
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                        f"--input={tmp_path / 'test.svm'}", "--top=5", f"--output={tmp_path / 'pred.txt'}"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert (tmp_path / "pred.txt").read_text().splitlines() == lines
  # Feature rows from stdin (they once had to come as files), and an error there names stdin.
  for name in ("test.txt", "test.svm"):
    out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}", "--input=-", "--top=5"],
                         input=(tmp_path / name).read_text(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.splitlines() == lines, out.stderr[-3000:]
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}", "--input=-",
                        "--input_format=xc"], input="1 1000 200\n0 1;2\n", capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and out.stderr.startswith("sparsejax-predict: error: <stdin>:2: "), out.stderr[-3000:]
  # A gzipped XC file that starts with a UTF-8 byte-order mark is recognised as training reads it (the mark once
  # made it look like svmlight).
  with open(tmp_path / "test.txt", "rb") as f, gzip.open(tmp_path / "test.txt.gz", "wb") as g:
    g.write(b"\xef\xbb\xbf" + f.read())
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                        f"--input={tmp_path / 'test.txt.gz'}", "--top=5"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.splitlines() == lines, out.stderr[-3000:]


def test_load_evaluate_reproduces_the_final_evaluation(synthetic_run):
  workdir, final, test = synthetic_run
  model = sparsejax.load(str(workdir))
  assert model.step == 200 and model.label_names is None
  result = model.evaluate(test)
  for key in ("p@1", "p@3", "p@5", "ndcg@5", "psp@5", "sampled_p@1", "sampled_p@5"):
    assert result[key] == final[key], key  # exactly: the same computation on the same parameters (and tables)
  assert final["p@1"] > 0.3  # it learned (chance: 1/200)
  # Inputs it cannot score are refused by name (a fresh-user review: each returned metrics, P@1 0 or a number).
  unlabelled = scipy.sparse.csr_matrix((test.values, test.indices, test.indptr), shape=(len(test), test.num_features))
  wider = XCDataset(test.indptr, test.indices, test.values, test.label_indptr, test.label_indices,
                    test.num_features, test.num_labels + 1)
  for args, error, message in (
      ((unlabelled,), TypeError, "evaluate needs labelled samples, an XCDataset; got csr_matrix"),
      ((wider,), ValueError, f"the dataset has {test.num_labels + 1} labels; the model predicts {test.num_labels}"),
      ((test, 0), ValueError, "num_samples must be an integer >= 1 or None (all), got 0"),
      ((test, 2.5), ValueError, "num_samples must be an integer >= 1 or None (all), got 2.5"),
  ):
    with pytest.raises(error, match=re.escape(message)):
      model.evaluate(*args)
  assert model.names(np.array([[0, 7]])).tolist() == [["0", "7"]]  # no names in this dataset: the ids
  for outside in (-1, test.num_labels):
    with pytest.raises(ValueError, match=re.escape(f"names: label ids must be in [0, {test.num_labels}), got "
                                                   f"{outside}")):
      model.names(np.array([1, outside]))
  first_seven = model.evaluate(test.subset(np.arange(7)), sampled=False)["p@1"]
  assert model.evaluate(test, 7, sampled=False)["p@1"] == first_seven


def test_predict_keeps_every_feature_of_rows_wider_than_any_training_row(synthetic_run):
  """A query may have more features than the widest training sample: none of them is dropped (the run set no
  --max_features), so its logits are those of a numpy forward pass over all of its features."""
  workdir, _, test = synthetic_run
  model = sparsejax.load(str(workdir))
  width = model.max_features
  rng = np.random.default_rng(0)
  perm = rng.permutation(model.num_features)
  assert len(perm) >= 5 * width
  # The same first `width` features (and values), then different ones.
  rows = [np.concatenate([perm[:width], perm[a * width:(a + 2) * width]]) for a in (1, 3)]
  vals = np.ones(3 * width, np.float32)
  vals[:width] = 2.0  # the shared features have the largest values: a cut to `width` would keep only them
  x = np.zeros((2, model.num_features), np.float32)
  for i, ids in enumerate(rows):
    x[i, ids] = vals
  p = model.params
  h = np.maximum(x @ np.asarray(p.embed.w) + np.asarray(p.embed.b), 0.0)
  for w, b in p.hidden:
    h = np.maximum(h @ np.asarray(w) + np.asarray(b), 0.0)
  logits = h @ np.asarray(p.out.w).T + np.asarray(p.out.b)
  dataset = data.XCDataset(np.arange(3) * 3 * width, np.concatenate(rows), np.tile(vals, 2), np.arange(3),
                           np.zeros(2), model.num_features, model.num_labels)
  scores, ids = model.predict(dataset, top=5)
  np.testing.assert_array_equal(ids, np.argsort(-logits, axis=1, kind="stable")[:, :5])
  np.testing.assert_allclose(scores, np.take_along_axis(logits, ids, axis=1), rtol=1e-4, atol=1e-5)
  assert not np.array_equal(scores[0], scores[1])


@pytest.fixture(scope="module")
def selected_run(tmp_path_factory, small_config):
  """A clustered-index run whose validation P@1 peaks before its last step: ``(workdir, final, test set)``."""
  workdir = tmp_path_factory.mktemp("selected")
  config = override(small_config, candidates="clusters", reinsert="none", validation_fraction=0.2, max_steps=400,
                    eval_every=10, early_stopping_patience=2, learning_rate=3e-2, checkpoint_every=1000,
                    eval_num_clusters=20)  # 10 rows each (by default 200: one row each, sampled = exact)
  final = train_and_evaluate(config, str(workdir))
  return workdir, final, data.load_dataset(config.data, seed=config.run.seed).test


def test_load_gives_the_state_the_run_selected_and_reported(selected_run, tmp_path, installed_command):
  workdir, final, test = selected_run
  assert final["selected_step"] < final["last_step"]  # else this test could not tell the two apart
  model = sparsejax.load(str(workdir))
  assert (model.step, model.selected_by) == (final["selected_step"], "validation p@1")
  result = model.evaluate(test)
  for key in ("p@1", "p@5", "ndcg@5", "psp@5", "sampled_p@1", "sampled_p@5"):
    assert result[key] == final[key], key  # exact and sampled: the run's final evaluation, recomputed
  last = sparsejax.load(str(workdir), step=final["last_step"])
  assert (last.step, last.selected_by) == (final["last_step"], "step")
  assert not np.array_equal(np.asarray(last.params.out.w), np.asarray(model.params.out.w))
  with pytest.raises(ValueError, match=rf"no checkpoint of step 3 \(checkpoints kept: {final['last_step']}; best: "
                                       rf"{final['selected_step']}\)"):
    sparsejax.load(str(workdir), step=3)
  # The command predicts with the same state, and --step picks another.
  data.save_xc_file(test, tmp_path / "test.txt")
  for flags, chosen in (([], model), ([f"--step={final['last_step']}"], last)):
    out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                          f"--input={tmp_path / 'test.txt'}", "--top=3", *flags], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
    _, ids = chosen.predict(test, top=3)
    assert [[int(label) for label, _ in _pairs(line)] for line in out.stdout.splitlines()] == ids.tolist()


def test_sampled_predict_scores_the_index_candidates(selected_run, tmp_path, installed_command):
  workdir, final, test = selected_run
  model = sparsejax.load(str(workdir))  # the network's own ranking (fusion=False): its logits, its candidates
  n = model.num_labels
  all_scores, all_ids = model.predict(test, top=n, fusion=False)  # every logit, as the exact path ranks them
  logits = np.zeros_like(all_scores)
  np.put_along_axis(logits, all_ids.astype(np.int64), all_scores, axis=1)
  # k = N: every row is a candidate, so sampled inference is exact inference.
  scores, ids = model.predict(test, top=5, k=n, fusion=False)
  np.testing.assert_array_equal(ids, all_ids[:, :5])
  np.testing.assert_allclose(scores, all_scores[:, :5], rtol=1e-5, atol=1e-5)
  # k < N: distinct ids, best first, each with its own logit; mostly the exact top label (the run's sampled P@1).
  k = model.config.network.active_k
  scores, ids = model.predict(test, top=5, k=k, fusion=False)
  assert all(len(set(row)) == 5 for row in ids.tolist())
  np.testing.assert_allclose(scores, np.take_along_axis(logits, ids.astype(np.int64), axis=1), rtol=1e-5, atol=1e-5)
  assert np.all(np.diff(scores, axis=1) <= 0)
  assert np.mean(ids[:, 0] == all_ids[:, 0]) > 0.5  # the index finds the top label
  # With top = k the candidates themselves come back: a sample of the rows, not the exact top k.
  _, candidates = model.predict(test, top=k, k=k, fusion=False)
  np.testing.assert_array_equal(candidates[:, :5], ids)
  exact_top_k = [set(row) for row in all_ids[:, :k].tolist()]
  assert sum(set(row) != top for row, top in zip(candidates.tolist(), exact_top_k)) > len(test) // 2
  with pytest.raises(ValueError, match=r"k must be in \[top = 5, 200\]"):
    model.predict(test, top=5, k=4)
  data.save_xc_file(test, tmp_path / "test.txt")
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                        f"--input={tmp_path / 'test.txt'}", "--top=5", f"--k={k}"], capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
  served = model.predict(test, top=5, k=k)[1]  # the command serves the run's fusion, as load does by default
  assert [[int(label) for label, _ in _pairs(line)] for line in out.stdout.splitlines()] == served.tolist()
  for flag, message in (("--k=3", "--k=3: must be 0 (exact) or at least --top=5"),
                        ("--k=201", "--k=201: must be at most 200 (the model's labels)")):
    out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                          f"--input={tmp_path / 'test.txt'}", "--top=5", flag], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and out.stderr.startswith(f"sparsejax-predict: error: {message}"), out.stderr


def test_the_accuracy_benchmark_restores_the_selected_state(selected_run, benchmark_module):
  """benchmarks/accuracy.py times inference on the state the run selected; the selected state is kept without
  optimizer states, and the benchmark once restored it into the whole state's structure (an orbax error)."""
  finished_runs = benchmark_module("harness.finished_runs")  # what accuracy.py and the benchmarks of its runs use
  workdir, final, test = selected_run
  model = sparsejax.load(str(workdir))
  _, state = finished_runs.restored_state(model.config, str(workdir), test)
  assert int(state.step) == final["selected_step"]
  np.testing.assert_array_equal(np.asarray(state.out.w)[:model.num_labels], np.asarray(model.params.out.w))


def test_the_run_keeps_its_serving_index_for_sampled_prediction(selected_run, tmp_path):
  workdir, final, test = selected_run
  with np.load(workdir / "assets" / "serving_index.npz") as f:
    assert int(f["step"]) == final["selected_step"]  # built by the final evaluation of the selected state
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  model = sparsejax.load(str(copy))
  assert model.serving_index_kept
  kept = model.predict(test, top=5, k=32)
  assert not sparsejax.load(str(copy), step=final["last_step"]).serving_index_kept  # another step's
  (copy / "assets" / "serving_index.npz").unlink()
  rebuilt = sparsejax.load(str(copy))
  assert not rebuilt.serving_index_kept
  for a, b in zip(kept, rebuilt.predict(test, top=5, k=32)):
    np.testing.assert_array_equal(a, b)  # the same index, kept or built again


def test_sampled_predict_needs_a_slide_model(tmp_path, small_config, installed_command):
  train_and_evaluate(override(small_config, model="dense", max_steps=10, eval_every=1000), str(tmp_path))
  model = sparsejax.load(str(tmp_path))
  assert "sampled_p@1" not in model.evaluate(model.features(data.load_dataset(
      model.config.data, seed=model.config.run.seed).test))
  with pytest.raises(ValueError, match="sampled prediction .* needs a SLIDE model; this one was trained with "
                                       "--model=dense"):
    model.predict(data.load_dataset(model.config.data, seed=model.config.run.seed).test, top=5, k=32)
  data.save_xc_file(data.load_dataset(model.config.data, seed=model.config.run.seed).test, tmp_path / "test.txt")
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={tmp_path}",
                        f"--input={tmp_path / 'test.txt'}", "--k=32"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and "sampled prediction needs a SLIDE model" in out.stderr, out.stderr


def test_a_long_input_row_pads_a_few_rows_not_the_batch(synthetic_run, monkeypatch):
  """One line of 2M id:value pairs took 23.7 GB: each batch of 1,024 rows was padded to its longest row. Now the
  long row's batch holds few rows, and the other rows' predictions do not change."""
  import tracemalloc

  from sparsejax.evaluation import padded_width

  workdir, _, test = synthetic_run
  model = sparsejax.load(str(workdir))
  normal = test.subset(np.arange(40))
  want_scores, want_ids = model.predict(normal, top=5)
  rng = np.random.default_rng(0)
  long_ids = rng.integers(0, model.num_features, 200_000)  # repeats add up, as a sum over the row's features
  long_vals = rng.random(200_000, dtype=np.float32) * 1e-3
  rows = [normal.indices[normal.indptr[i]:normal.indptr[i + 1]] for i in range(40)]
  vals = [normal.values[normal.indptr[i]:normal.indptr[i + 1]] for i in range(40)]
  rows.insert(7, long_ids)
  vals.insert(7, long_vals)
  mixed = XCDataset(np.concatenate([[0], np.cumsum([len(r) for r in rows])]), np.concatenate(rows),
                    np.concatenate(vals), np.zeros(42, np.int64), np.zeros(0, np.int32), model.num_features,
                    model.num_labels)
  padded, to_padded = [], XCDataset.to_padded

  def bounded_to_padded(self, batch, max_features=None, max_labels=None):
    padded.append((len(batch), max_features))
    assert len(batch) * max_features <= 1 << 22, padded[-1]  # before numpy allocates it (GiBs, it was)
    return to_padded(self, batch, max_features, max_labels)

  monkeypatch.setattr(XCDataset, "to_padded", bounded_to_padded)
  tracemalloc.start()
  try:
    scores, ids = model.predict(mixed, top=5)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 64 << 20, peak  # numpy's arrays: 16 rows of 2^18 ids and values padded (32 MiB), the rest small
  # The other rows as wide as alone; the long one 2^18 wide, in a call of 16 rows (2^22 elements), not 1,024.
  assert padded == [(40, padded_width(normal, None)), (1, 1 << 18)]
  keep = np.arange(41) != 7
  np.testing.assert_array_equal(ids[keep], want_ids)
  np.testing.assert_array_equal(scores[keep], want_scores)
  # The long row keeps every feature: its logits are a dense forward pass's.
  x = np.bincount(long_ids, weights=long_vals.astype(np.float64), minlength=model.num_features).astype(np.float32)
  p = model.params
  h = np.maximum(x @ np.asarray(p.embed.w) + np.asarray(p.embed.b), 0.0)
  for w, b in p.hidden:
    h = np.maximum(h @ np.asarray(w) + np.asarray(b), 0.0)
  logits = h @ np.asarray(p.out.w).T + np.asarray(p.out.b)
  np.testing.assert_allclose(scores[7], np.sort(logits)[::-1][:5], rtol=1e-3, atol=1e-4)



def _labelled(label_rows: list, num_features: int, num_labels: int, seed: int = 0) -> XCDataset:
  """Samples of 3 random features each with the given label rows."""
  rng = np.random.default_rng(seed)
  n = len(label_rows)
  offsets = lambda parts: np.concatenate([[0], np.cumsum([len(r) for r in parts])]).astype(np.int64)
  return XCDataset(np.arange(0, 3 * n + 1, 3, dtype=np.int64), rng.integers(0, num_features, 3 * n).astype(np.int32),
                   rng.random(3 * n, dtype=np.float32), offsets(label_rows),
                   np.concatenate(label_rows).astype(np.int32), num_features, num_labels)


@pytest.mark.parametrize("with_propensity", [True, False])
def test_scoring_labels_give_the_metrics_of_all_labels(with_propensity):
  """A sample's labels cut to its hits among the candidates and its 5 heaviest: every ranking of the candidates
  scores as against all its labels (metrics.evaluate_topk of the full, widest-row padding), duplicates included."""
  from sparsejax import metrics
  from sparsejax.evaluation import scoring_labels

  rng = np.random.default_rng(3)
  num_labels = 300
  label_rows = [rng.choice(num_labels, size, replace=False) for size in (0, 1, 3, 7, 40, 299, 300, 120)]
  label_rows[4] = np.concatenate([label_rows[4], label_rows[4][:5]])  # a label given twice counts once
  dataset = _labelled(label_rows, 50, num_labels)
  candidates = rng.integers(-1, num_labels, (len(label_rows), 12))
  candidates[5, :8] = label_rows[5][:8]  # many hits
  propensity = rng.uniform(0.05, 1.0, num_labels) if with_propensity else None
  labels = scoring_labels(dataset, len(dataset), candidates, propensity)
  assert labels.shape == (len(dataset), 12 + 5)
  full = dataset.to_padded(None, 0, None)[2]
  for ranking in (candidates[:, :5], candidates[:, 7:], candidates[:, ::-1][:, :5]):
    assert metrics.evaluate_topk(ranking, labels, propensity) == metrics.evaluate_topk(ranking, full, propensity)


def test_evaluating_a_sample_with_every_label_pads_the_labels_to_the_candidates_not_to_it(synthetic_run,
                                                                                       monkeypatch):
  """Issue 35: the Evaluator padded every sample's labels to the widest row's, [n, max labels] at once: one sample
  with 2M labels among 100K made 800 GB. Now the metrics see at most the candidates' width plus 5 labels per
  sample, and equal those of the old padding."""
  from sparsejax import evaluation, metrics

  workdir, _, test = synthetic_run
  model = sparsejax.load(str(workdir))
  label_rows = [test.label_indices[test.label_indptr[i]:test.label_indptr[i + 1]] for i in range(40)]
  label_rows[11] = np.arange(model.num_labels)  # every label
  mixed = _labelled(label_rows, model.num_features, model.num_labels)
  mixed = XCDataset(test.indptr[:41], test.indices[:test.indptr[40]], test.values[:test.indptr[40]],
                    mixed.label_indptr, mixed.label_indices, model.num_features, model.num_labels)
  with monkeypatch.context() as unbounded:  # the old labels: every row padded to the widest
    unbounded.setattr(evaluation, "scoring_labels", lambda dataset, n, candidates, propensity:
                      dataset.to_padded(np.arange(n), 0, None)[2])
    want = model.evaluate(mixed)
  widths, evaluate_topk = [], metrics.evaluate_topk

  def recorded(topk_ids, labels, *args, **kwargs):
    widths.append(labels.shape[1])
    return evaluate_topk(topk_ids, labels, *args, **kwargs)

  monkeypatch.setattr(metrics, "evaluate_topk", recorded)
  got = model.evaluate(mixed)
  assert "sampled_p@1" in got and got == want
  assert widths and max(widths) <= 5 + 5 + 5 < model.num_labels  # exact and sampled top 5, and the 5 heaviest

def test_evaluating_a_long_row_pads_a_few_rows_and_gives_the_same_metrics(synthetic_run, monkeypatch):
  """Issue 35: the Evaluator (model.evaluate, a run's evaluations) padded every batch of 1,024 rows to the test set's
  widest row, as predict did: one row of 200K features made 1,024 x 2^18 padded ids and values (2 GiB). Now it pads
  as predict does, and the metrics equal those of the old padding (one width for all rows, here in 48-row batches)."""

  from sparsejax import evaluation
  from sparsejax.evaluation import padded_width
  from sparsejax.serving import model as trained

  workdir, _, test = synthetic_run
  model = sparsejax.load(str(workdir))
  normal = test.subset(np.arange(40))
  rng = np.random.default_rng(1)
  long_ids = rng.integers(0, model.num_features, 200_000)
  long_vals = rng.random(200_000, dtype=np.float32) * 1e-3
  rows = [normal.indices[normal.indptr[i]:normal.indptr[i + 1]] for i in range(40)]
  vals = [normal.values[normal.indptr[i]:normal.indptr[i + 1]] for i in range(40)]
  labels = [normal.label_indices[normal.label_indptr[i]:normal.label_indptr[i + 1]] for i in range(40)]
  rows.insert(7, long_ids)
  vals.insert(7, long_vals)
  labels.insert(7, np.array([3], np.int32))
  offsets = lambda parts: np.concatenate([[0], np.cumsum([len(r) for r in parts])])
  mixed = XCDataset(offsets(rows), np.concatenate(rows), np.concatenate(vals), offsets(labels),
                    np.concatenate(labels).astype(np.int32), model.num_features, model.num_labels)

  with monkeypatch.context() as unbounded:  # the old padding: every row to the widest, smaller batches to fit here
    unbounded.setattr(evaluation, "PADDED_ELEMENTS", 1 << 40)
    unbounded.setattr(trained, "Evaluator", lambda *args, **_: evaluation.Evaluator(*args[:3], batch_size=48))
    want = model.evaluate(mixed)

  padded, to_padded = [], XCDataset.to_padded

  def bounded_to_padded(self, batch, max_features=None, max_labels=None):
    padded.append((len(batch), max_features))
    assert len(batch) * max_features <= evaluation.PADDED_ELEMENTS, padded[-1]  # before numpy allocates it
    return to_padded(self, batch, max_features, max_labels)

  monkeypatch.setattr(XCDataset, "to_padded", bounded_to_padded)
  got = model.evaluate(mixed)
  assert padded == [(40, padded_width(normal, None)), (1, 1 << 18), (41, 0)]  # (41, 0): the labels, no features
  assert "sampled_p@1" in got and got == want
  assert model.evaluate(mixed, 5) == model.evaluate(mixed.subset(np.arange(5)))  # num_samples: the first rows


def test_predict_errors_are_one_line(synthetic_run, tmp_path, installed_command):
  workdir, _, _ = synthetic_run
  predict = installed_command("sparsejax-predict")
  (tmp_path / "x").write_text("1 0:0.5\n")
  out = subprocess.run([predict, f"--workdir={tmp_path / 'nothing'}", f"--input={tmp_path / 'x'}"],
                       capture_output=True, text=True)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines() == [f"sparsejax-predict: error: {tmp_path / 'nothing' / 'checkpoints'}: no "
                                             f"checkpoints (nothing was trained with --workdir={tmp_path / 'nothing'})"]
  out = subprocess.run([predict, f"--workdir={workdir}", "--input=nowhere", "--top=0"], capture_output=True,
                       text=True)
  assert out.returncode == 2 and "--top=0: must be >= 1" in out.stderr
  out = subprocess.run([predict, f"--workdir={workdir}", f"--input={tmp_path / 'x'}", "--top=201"],
                       capture_output=True, text=True)
  assert out.returncode == 2 and "--top=201: must be in [1, 200]" in out.stderr
  # Files are checked before the model loads and predicts: a missing input, an output nowhere to be written.
  for flags, message in (([f"--input={tmp_path / 'missing.txt'}"], f"--input={tmp_path / 'missing.txt'}: no such file"),
                         ([f"--input={tmp_path}"], f"--input={tmp_path}: is a directory"),
                         ([f"--input={tmp_path / 'x'}", f"--output={tmp_path / 'no' / 'p.txt'}"],
                          f"--output={tmp_path / 'no' / 'p.txt'}: cannot write a file in {tmp_path / 'no'}")):
    out = subprocess.run([predict, f"--workdir={workdir}", *flags], capture_output=True, text=True)
    assert (out.returncode, out.stderr) == (2, f"sparsejax-predict: error: {message} (--help lists the flags)\n")
  (tmp_path / "bad.svm").write_text("1 0:0.5 3:1\n1 0:0.5 999999:1\n")
  out = subprocess.run([predict, f"--workdir={workdir}", f"--input={tmp_path / 'bad.svm'}"], capture_output=True,
                       text=True)
  assert (out.returncode, out.stderr) == (1, f"sparsejax-predict: error: {tmp_path / 'bad.svm'}:2: feature id 999999 "
                                             "out of range: the model reads ids in [0, 1000)\n")
  (tmp_path / "bad.svm").write_text("1 0:0.5 3;1\n")
  out = subprocess.run([predict, f"--workdir={workdir}", f"--input={tmp_path / 'bad.svm'}"], capture_output=True,
                       text=True)
  assert out.returncode == 1 and f"{tmp_path / 'bad.svm'}: not a svmlight file" in out.stderr
  # A reader that stops reading (`sparsejax-predict ... | head`): no BrokenPipeError traceback, SIGPIPE's status.
  proc = subprocess.Popen([predict, f"--workdir={workdir}", f"--input={tmp_path / 'x'}"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  proc.stdout.close()  # before the predictions are written
  err = proc.stderr.read()
  assert (proc.wait(timeout=300), err) == (128 + signal.SIGPIPE, "")


@pytest.mark.parametrize("value, message", [
    ("nan", "non-finite feature value in '3:nan'"),
    ("-inf", "non-finite feature value in '3:-inf'"),
    ("1e39", "feature value in '3:1e39' overflows float32 (its largest is 3.4028235e+38)"),
])
def test_predict_refuses_svmlight_values_not_finite_in_float32(tmp_path, monkeypatch, value, message):
  """As the XC reader does, by file and line (scikit-learn reads them: the row's scores were NaN)."""
  import gzip
  import io
  import types

  from sparsejax.cli.predict_run import read_inputs

  model = types.SimpleNamespace(text_input=False, num_features=10)  # what read_inputs asks of a model
  content = f"1 0:0.5 2:3.4028235e+38\n2 qid:7 1:0.25 3:{value}\n"
  (tmp_path / "x.svm").write_text(content)
  with gzip.open(tmp_path / "x.svm.gz", "wt") as f:
    f.write(content)
  for path in (tmp_path / "x.svm", tmp_path / "x.svm.gz"):
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: {message}")):
      read_inputs(str(path), "svmlight", model)
  monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(content.encode())))
  with pytest.raises(ValueError, match=re.escape(f"<stdin>:2: {message}")):
    read_inputs("-", "svmlight", model)
  # The largest float32 is finite: read as it is.
  (tmp_path / "x.svm").write_text(content.splitlines(True)[0])
  assert read_inputs(str(tmp_path / "x.svm"), "svmlight", model).data.astype(np.float32)[1] == np.finfo(np.float32).max


@pytest.mark.parametrize("header", ["3 200 x", "3 200", "3 200 30 5"])
def test_a_malformed_xc_header_is_named_as_one(tmp_path, header):
  """Issue 35: a first line that is no XC header (nor a svmlight row) was read as svmlight, and the error said "not a
  svmlight file ... need more than 1 value to unpack"."""
  import types

  from sparsejax.cli.predict_run import read_inputs

  (tmp_path / "x.txt").write_text(f"{header}\n1 0:0.5 3:1\n2 5:1\n")
  with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'x.txt'}:1: {header!r} is neither an XC header (three "
                                                 "integers: samples, features, labels) nor a svmlight row")):
    read_inputs(str(tmp_path / "x.txt"), "auto", types.SimpleNamespace(text_input=False, num_features=200))


def _vectorizer_of(num_features: int):
  """A vectorizer of ``num_features`` one-word terms (``t0``, ``t1``, ...), fitted as the real datasets fit theirs."""
  from sklearn.feature_extraction.text import TfidfVectorizer

  from sparsejax.data.text import TOKEN_PATTERN

  vectorizer = TfidfVectorizer(token_pattern=TOKEN_PATTERN, sublinear_tf=True, dtype=np.float32)
  return vectorizer.fit([" ".join(f"t{i}" for i in range(num_features)), "t0 t1 t2"])


def _as_the_run_wrote_it(path, write) -> None:
  """``write()`` an asset at ``path`` and record it in the assets' seal, as if the run had written it: what these
  tests check is the file's content (a file changed after the run is refused by its seal: test_workdir_integrity)."""
  from sparsejax.workdir import seals

  write()
  seal_path = path.parent / "checksums.json"
  seal = json.loads(seal_path.read_text())
  seal["files"][path.name] = seals.file_entry(str(path))
  seal_path.write_text(json.dumps(seal))


def test_a_work_directory_s_vectorizer_is_data_checked_before_use(synthetic_run, tmp_path, installed_command):
  from sparsejax.data.text import save_vectorizer

  workdir = tmp_path / "run"
  shutil.copytree(synthetic_run[0], workdir)
  path = workdir / "assets" / "vectorizer.json"
  vectorizer = _vectorizer_of(1000)
  _as_the_run_wrote_it(path, lambda: save_vectorizer(vectorizer, path))
  model = sparsejax.load(str(workdir))  # a good one: texts give the rows it gives
  texts = ["t5 t7 t7", "t0 t999 nothing"]
  np.testing.assert_array_equal(model.predict(texts, top=3)[1], model.predict(vectorizer.transform(texts), top=3)[1])
  # Received from someone else: texts opened as file names. Refused by name, one line, before anything is read.
  secret = tmp_path / "secret.txt"
  secret.write_text("t1 t2 t3\n")
  (tmp_path / "texts.txt").write_text(f"{secret}\n")
  hostile = json.loads(path.read_text())
  hostile["params"]["input"] = "filename"
  _as_the_run_wrote_it(path, lambda: path.write_text(json.dumps(hostile)))
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                        f"--input={tmp_path / 'texts.txt'}"], capture_output=True, text=True, timeout=300)
  assert (out.returncode, out.stdout) == (1, "")
  assert out.stderr == (f"sparsejax-predict: error: {path}: params.input: must be 'content' (the texts themselves, "
                        "never names of files to read), got \"filename\"\n")
  # Another run's (another vocabulary): its columns would name other features.
  _as_the_run_wrote_it(path, lambda: save_vectorizer(_vectorizer_of(40), path))
  with pytest.raises(ValueError, match=re.escape(f"{path}: vocabulary: has 40 terms; the model reads 1000 features")):
    sparsejax.load(str(workdir))


def test_a_text_model_imports_scikit_learn_only_for_texts(synthetic_run, tmp_path, run_python):
  """Issue 33: loading a model with a vectorizer imported scikit-learn (about 1.5 s of sparsejax-predict's 2.7 s of
  imports, 2 busy cores) also for feature-row inputs, which never use it. Now it is imported at the first text."""
  from sparsejax.data.text import save_vectorizer

  workdir = tmp_path / "run"
  shutil.copytree(synthetic_run[0], workdir)
  path = workdir / "assets" / "vectorizer.json"
  _as_the_run_wrote_it(path, lambda: save_vectorizer(_vectorizer_of(1000), path))
  out = run_python(str(workdir), code="""
      import sys
      import scipy.sparse
      import sparsejax
      model = sparsejax.load(sys.argv[1])
      print(repr(model).endswith("text_input=True)"), "sklearn" in sys.modules)
      model.predict(scipy.sparse.csr_matrix(([1.0], ([0], [5])), shape=(1, 1000)), top=3)
      print("sklearn" in sys.modules)
      model.predict(["t5 t7"], top=3)
      print("sklearn" in sys.modules)
  """)
  assert out.stdout.split() == ["True", "False", "False", "True"], out.stdout


def test_texts_without_a_known_word_are_named_in_a_warning(synthetic_run, tmp_path, installed_command):
  """Issue 33: a text none of whose words the vectorizer knows got confident predictions (those of an empty feature
  row, the same for any such text) without a word."""
  from sparsejax.data.text import save_vectorizer
  from sparsejax.serving.inputs import UnknownWordsWarning

  workdir = tmp_path / "run"
  shutil.copytree(synthetic_run[0], workdir)
  path = workdir / "assets" / "vectorizer.json"
  _as_the_run_wrote_it(path, lambda: save_vectorizer(_vectorizer_of(1000), path))
  model = sparsejax.load(str(workdir))
  texts = ["t1 t2 t3", "nothing known here", "", "t5 and unknown words"]
  with pytest.warns(UnknownWordsWarning) as caught:
    _, ids = model.predict(texts, top=3)
  assert [(w.message.row, w.message.more) for w in caught] == [(1, 0), (2, 0)]
  assert "no word of 'nothing known here' is in the model's vocabulary" in str(caught[0].message)
  np.testing.assert_array_equal(ids[1], ids[2])  # the same empty row: the same "prediction"
  # Many such texts: the first ten one by one, the rest in one warning.
  with pytest.warns(UnknownWordsWarning) as caught:
    model.predict(["t1"] + [f"unknown {i}" for i in range(25)], top=3)
  assert [(w.message.row, w.message.more) for w in caught] == [*((i, 0) for i in range(1, 11)), (11, 14)]
  # The command: one line per such input line, with its line number; the predictions as before.
  (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={workdir}",
                        f"--input={tmp_path / 'texts.txt'}", "--top=3"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stderr.splitlines() == [
      f"sparsejax-predict: warning: {tmp_path / 'texts.txt'}:2: no word of 'nothing known here' is in the model's "
      "vocabulary: its labels are a guess, the same for any such text",
      f"sparsejax-predict: warning: {tmp_path / 'texts.txt'}:3: no word of '' is in the model's vocabulary: its "
      "labels are a guess, the same for any such text"]
  assert [[int(label) for label, _ in _pairs(line)] for line in out.stdout.splitlines()] == ids.tolist()


def test_a_trained_model_s_repr_says_what_and_where(synthetic_run):
  """Issue 33: ``TrainedModel`` printed as ``<sparsejax.train.trained.TrainedModel object at 0x...>``."""
  workdir = str(synthetic_run[0])
  model = sparsejax.load(workdir)
  assert repr(model) == (f"TrainedModel(workdir={workdir!r}, step=200, selected_by='newest', model='slide', "
                         "features=1000, hidden_dims=(32,), labels=200, named_labels=False, text_input=False)")
  assert model.workdir == workdir


def test_loading_returns_what_the_restore_freed(synthetic_run, monkeypatch):
  """Issue 47: under tcmalloc (the commands' allocator) what the restore and the slicing off of a sharded layer's
  padding rows freed stayed resident: sparsejax-predict peaked at 12.6 GB on the 10^9-parameter run, 9.4 under glibc.
  The restore and the network's arrays are made within ``memory.freed_memory_returned``, which gives it back."""
  inside, seen = [], []

  @contextlib.contextmanager
  def recording():
    inside.append(True)
    try:
      yield
    finally:
      inside.pop()

  def spied(method):
    def call(*args):
      seen.append((method.__name__, bool(inside)))
      return method(*args)
    return call

  monkeypatch.setattr(memory, "freed_memory_returned", recording)
  monkeypatch.setattr(restore, "served_state", spied(restore.served_state))
  for name in ("_set_network", "_read_assets"):
    monkeypatch.setattr(serving_model.TrainedModel, name, spied(getattr(serving_model.TrainedModel, name)))
  sparsejax.load(str(synthetic_run[0]))
  assert seen == [("served_state", True), ("_set_network", True), ("_read_assets", False)]


def test_commands_that_need_a_work_directory_name_the_newest_run(tmp_path, installed_command):
  """Runs go to new directories (issue 33): predict and plot without one say so and name the newest run."""
  runs = tmp_path / "runs"
  env = dict(os.environ, SPARSEJAX_RUNS=str(runs))
  for name, args in (("sparsejax-predict", ["--input=-"]), ("sparsejax-plot", [])):
    out = subprocess.run([installed_command(name), *args], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stderr.endswith(f"the work directory of a trained run (no run under {runs} "
                                                       "yet) (--help lists the flags)\n"), out.stderr
  for run in ("20250102T030405Z-icd10", "20250102T030405Z-icd10-2", "20241231T235959Z-synthetic", "notes"):
    (runs / run).mkdir(parents=True)
  for name, args in (("sparsejax-predict", ["--input=-"]), ("sparsejax-plot", [])):
    out = subprocess.run([installed_command(name), *args], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and f"(the newest run: {runs / '20250102T030405Z-icd10-2'})" in out.stderr, out.stderr


def test_icd10_text_in_codes_out(tmp_path, small_config, installed_command):
  config = override(small_config, dataset="icd10", hidden_dims=(16,), active_k=64, max_steps=30, eval_every=1000,
                    eval_samples=500, batch_size=128, learning_rate=1e-2)
  train_and_evaluate(config, str(tmp_path))
  loaded = data.load_dataset(config.data, seed=config.run.seed)
  model = sparsejax.load(str(tmp_path))
  assert model.label_names == loaded.label_names
  texts = ["Type 2 diabetes mellitus without complications", "Fracture of neck of right femur"]
  want = loaded.vectorizer.transform(texts)
  got = model.vectorizer.transform(texts)
  assert (want != got).nnz == 0  # the saved vectorizer featurizes text exactly as the fitted one
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={tmp_path}", "--input=-", "--top=3"],
                       input="\n".join(texts) + "\n", capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert len(lines) == 2
  _, ids = model.predict(texts, top=3)
  _, one = model.predict(texts[1], top=3)  # one string: one text (not one text per character)
  np.testing.assert_array_equal(one, ids[1:])
  # A given batch size does not change the predictions; no texts give no rows; bad arguments are named.
  np.testing.assert_array_equal(model.predict(texts, top=3, batch_size=1)[1], ids)
  scores, none = model.predict([], top=3)
  assert scores.shape == none.shape == (0, 3)
  for kwargs, error, message in ((dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
                                 (dict(top=2.5), TypeError, "top must be an integer, got 2.5"),
                                 (dict(k=True), TypeError, "k must be an integer, got True")):
    with pytest.raises(error, match=re.escape(message)):
      model.predict(texts, **{"top": 1, **kwargs})
  for line, row in zip(lines, ids):
    names = [name for name, _ in _pairs(line)]
    assert names == [loaded.label_names[i] for i in row]
    # Issue 33: an ICD-10-CM category's code and its title, not the bare code.
    assert all(re.fullmatch(r"[A-Z][0-9][0-9A-Z] [A-Z][^\t\n]+", name) for name in names), names
  assert "E11 Type 2 diabetes mellitus" in model.label_names


def test_plot_draws_learning_curves(synthetic_run, tmp_path, installed_command, run_python):
  workdir, _, _ = synthetic_run
  out = subprocess.run([installed_command("sparsejax-plot"), str(workdir), f"--output={tmp_path / 'c.png'}"],
                       capture_output=True, text=True, timeout=300)
  if out.returncode == 1 and "needs matplotlib" in out.stderr:
    pytest.skip("matplotlib is not installed")
  assert out.returncode == 0, out.stderr[-3000:]
  assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  records = read_records(str(workdir))
  assert all("seconds" in r for r in records)  # the wall-clock axis
  # Without matplotlib: one line saying what to install.
  (tmp_path / "fake" / "matplotlib").mkdir(parents=True)
  (tmp_path / "fake" / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
  out = run_python(str(workdir), code="from sparsejax.cli.plot import plot_main; plot_main()",
                   env={"PYTHONPATH": str(tmp_path / "fake")}, check=False, isolated=False, cwd=tmp_path)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1].endswith("error: sparsejax-plot needs matplotlib: pip install matplotlib")


def test_a_plot_is_titled_by_its_run_s_name_and_says_which_split_it_shows(synthetic_run, tmp_path, monkeypatch,
                                                                          installed_command):
  """Issue 33: the title was the work directory's absolute path, and --help said "test P@k" for curves drawn on the
  validation split."""
  figure = pytest.importorskip("matplotlib.figure")
  from sparsejax.train import plot

  titles = []
  suptitle = figure.Figure.suptitle
  monkeypatch.setattr(figure.Figure, "suptitle", lambda fig, text, **kw: (titles.append(text),
                                                                           suptitle(fig, text, **kw))[1])
  workdir = synthetic_run[0]
  plot.plot_run(str(workdir) + "/", str(tmp_path / "c.png"))
  assert titles == [workdir.name]
  out = subprocess.run([installed_command("sparsejax-plot"), "--help"], capture_output=True, text=True, timeout=120)
  assert out.stdout.splitlines()[0] == ("sparsejax-plot: learning curves of a run: training loss and P@k against "
                                        "steps and wall-clock time.")
  assert "P@k is the periodic evaluations' on the validation split (on the test set where" in out.stdout


def test_the_package_has_a_version(monkeypatch, root):
  """Issue 33: no ``sparsejax.__version__``; it is the installed one's, else (never installed) pyproject.toml's."""
  import importlib.metadata
  import tomllib

  assert sparsejax.__version__ == importlib.metadata.version("sparsejax")

  def not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(importlib.metadata, "version", not_installed)
  assert sparsejax._version(str(root)) == tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def test_installed_commands_answer_help(installed_command):
  for name in ("sparsejax-train", "sparsejax-predict", "sparsejax-plot"):
    out = subprocess.run([installed_command(name), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"{name}: "), (name, out.stderr[-2000:])


def test_import_from_the_repository_root_uses_the_installed_extension(root, run_python):
  """Issue 11: `python -c "from sparsejax import ops"` in the repository failed (the source tree shadowed the
  installed package, which alone has the compiled _sparsejax)."""
  out = run_python(code="""
      import jax.numpy as jnp, sparsejax
      from sparsejax import ops
      h, w, ids = jnp.ones((2, 3)), jnp.ones((5, 3)), jnp.array([[0, 4], [1, -1]], jnp.int32)
      print(sparsejax.__file__, ops.gather_dot(h, w, ids).tolist())
  """, cwd=root, isolated=False)
  path, values = out.stdout.strip().split(" ", 1)
  assert path == str(root / "sparsejax" / "__init__.py")  # the source tree, as before
  assert json.loads(values) == [[3.0, 3.0], [3.0, 0.0]]
