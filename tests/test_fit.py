"""sparsejax.fit: training on in-memory matrices equals training on the same data from files, bit for bit; the three
forms of labels train the same network; every bad input is named before anything is trained; the log lines of
sparsejax-train show in Python; the README's notebook example runs as written."""

import contextlib
import io
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import scipy.sparse
from absl import logging

import sparsejax
from sparsejax import data
from sparsejax.config import Config
from sparsejax.settings import ConfigError, override
from sparsejax.train import compilation_cache, train_and_evaluate
from sparsejax.workdir.best_checkpoint import BestCheckpoint
from sparsejax.workdir.checkpoint import Checkpoints

# A few seconds a run: a small network, no recipe search (recipe="none": the same settings for the file path).
SETTINGS = dict(hidden_dims=(16,), active_k=16, batch_size=32, max_steps=30, eval_every=15, log_every=10,
                eval_samples=None, checkpoint_every=20, progress=False, recipe="none", seed=3)
NUM_FEATURES, NUM_LABELS = 300, 40


def _matrices(dataset):
  """``(X [n, F] CSR, Y [n, L] indicator CSR, Y as label-id lists)`` of an XCDataset."""
  x = scipy.sparse.csr_matrix((dataset.values, dataset.indices, dataset.indptr),
                              shape=(len(dataset), dataset.num_features))
  y = scipy.sparse.csr_matrix((np.ones(len(dataset.label_indices)), dataset.label_indices, dataset.label_indptr),
                              shape=(len(dataset), dataset.num_labels))
  lists = [dataset.label_indices[a:b].tolist() for a, b in zip(dataset.label_indptr[:-1], dataset.label_indptr[1:])]
  return x, y, lists


def _state(workdir):
  """Every array of the newest checkpoint of ``workdir``, and of the selected (best) state."""
  checkpoints = Checkpoints(str(workdir), writable=False)
  step = checkpoints.latest_step()
  best = BestCheckpoint.open(str(workdir), "p@1")
  return step, jax.tree.leaves(checkpoints.restore_arrays(step)) + jax.tree.leaves(best.restore_arrays())


def _assert_same_state(a, b):
  (step_a, leaves_a), (step_b, leaves_b) = _state(a), _state(b)
  assert step_a == step_b == SETTINGS["max_steps"]
  assert len(leaves_a) == len(leaves_b) > 10
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same multi-label data trained three ways: from XC files (train_and_evaluate), by fit with an indicator
  matrix and by fit with label-id lists (its log, on stderr, kept)."""
  root = tmp_path_factory.mktemp("fit")
  full = data.make_synthetic(1200, NUM_FEATURES, NUM_LABELS, labels_per_sample=2.5, seed=0)
  train, test = data.train_test_split(full, 0.2, seed=1)
  data.save_xc_file(train, root / "train.txt")
  data.save_xc_file(test, root / "test.txt")
  config = override(Config(), dataset="files", train_file=str(root / "train.txt"),
                    test_file=str(root / "test.txt"), **SETTINGS)
  files_log = io.StringIO()
  with contextlib.redirect_stderr(files_log):
    files_final = train_and_evaluate(config, str(root / "files"), verbose=True)
  (x, y, lists), (x_test, y_test, test_lists) = _matrices(train), _matrices(test)
  indicator = sparsejax.fit(x, y, X_val=x_test, Y_val=y_test, workdir=root / "indicator", verbose=False, **SETTINGS)
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):  # where a notebook's cell shows it
    by_lists = sparsejax.fit(x, lists, X_val=x_test, Y_val=test_lists, num_labels=NUM_LABELS,
                             workdir=root / "lists", **SETTINGS)
  return dict(root=root, files=root / "files", files_final=files_final, indicator=indicator, lists=by_lists,
              log=stderr.getvalue(), files_log=files_log.getvalue(), x_test=x_test, y_test=y_test, test=test,
              lists_train=lists)


def test_fit_trains_what_the_file_path_trains_bit_for_bit(runs):
  _assert_same_state(runs["files"], runs["indicator"].workdir)
  from_files = sparsejax.load(str(runs["files"]))
  scores, ids = runs["indicator"].predict(runs["x_test"], top=5)
  expected_scores, expected_ids = from_files.predict(runs["test"], top=5)
  assert ids.shape == (len(runs["test"]), 5)
  np.testing.assert_array_equal(ids, expected_ids)
  np.testing.assert_array_equal(scores, expected_scores)
  # Its final evaluation is the file path's, and evaluate(X, labels=Y) reproduces it.
  final = [r for r in _records(runs["indicator"].workdir) if r.get("final")][-1]
  for key in ("p@1", "p@5", "ndcg@5", "psp@5", "sampled_p@1", "step"):
    assert final[key] == runs["files_final"][key], key
  assert runs["indicator"].evaluate(runs["x_test"], labels=runs["y_test"])["p@1"] == pytest.approx(final["p@1"])
  assert runs["indicator"].config.data.dataset == "arrays"


def test_labels_as_an_indicator_matrix_or_as_id_lists_train_the_same(runs):
  _assert_same_state(runs["indicator"].workdir, runs["lists"].workdir)


def test_one_label_id_per_sample_is_a_list_of_one_each():
  full = data.make_synthetic(200, 50, 12, labels_per_sample=1, seed=0)
  x, y, lists = _matrices(full)
  ids = full.label_indices.astype(np.int64)
  assert np.array_equal(np.diff(full.label_indptr), np.ones(len(full)))
  for labels in (y, lists, ids, ids.tolist()):
    built = data.from_arrays(x, labels, num_labels=12)
    np.testing.assert_array_equal(built.label_indptr, full.label_indptr)
    np.testing.assert_array_equal(built.label_indices, full.label_indices)
    np.testing.assert_array_equal(built.indices, full.indices)
    np.testing.assert_array_equal(built.values, full.values)


def test_label_id_lists_read_at_once_as_row_by_row(runs):
  from sparsejax.data.arrays import _id_lists_row_by_row, label_rows

  lists = runs["lists_train"]
  at_once, by_row = label_rows(lists, len(lists)), _id_lists_row_by_row(lists, "Y")
  np.testing.assert_array_equal(at_once.indptr, by_row.indptr)
  np.testing.assert_array_equal(at_once.indices, by_row.indices)
  assert len(at_once.indices) > len(lists)  # several labels a sample


def test_one_label_id_per_sample_as_a_list_of_ints_reads_at_once_as_row_by_row(monkeypatch):
  """A list of ints (one label each) took 16 us a row, one by one: 16 s for 10^6 samples."""
  from sparsejax.data import arrays

  ints = np.random.default_rng(0).integers(0, 1000, 5000)
  cases = {"ints": ints.tolist(), "numpy ints": list(ints),
           "mixed": [int(i) if k % 2 else np.int32(i) for k, i in enumerate(ints)]}
  by_row = {name: arrays._id_lists_row_by_row(ids, "Y") for name, ids in cases.items()}

  def one_by_one(*args):
    raise AssertionError("read row by row")

  with monkeypatch.context() as patched:
    patched.setattr(arrays, "_id_lists_row_by_row", one_by_one)
    for name, ids in cases.items():
      at_once = arrays.label_rows(ids, len(ids))
      np.testing.assert_array_equal(at_once.indptr, by_row[name].indptr, err_msg=name)
      np.testing.assert_array_equal(at_once.indices, by_row[name].indices, err_msg=name)
      assert at_once.indices.dtype == np.int64 and at_once.width is None
  # Bad ids get the row-by-row reading's errors, the row named.
  for bad in ([3, -1, 2], [3, True, 2], [3, 2**70, 2], [3, 2**63, -1], [3, 2.0]):
    with pytest.raises((TypeError, ValueError)) as expected:
      arrays._id_lists_row_by_row(bad, "Y")
    with pytest.raises(expected.type, match=f"^{re.escape(str(expected.value))}$"):
      arrays.label_rows(bad, len(bad))


def test_train_and_evaluate_shows_its_log_lines_when_verbose(runs):
  log = runs["files_log"]
  for line in (f"work directory: {runs['files']}", "settings not at their defaults: --dataset=files",
               "step 10/30: loss", "step 15: validation P@1", "final (selected step"):
    assert line in log, line
  assert log.rstrip().endswith(f"in {runs['files']}")


def test_fit_shows_what_sparsejax_train_logs(runs):
  log, workdir = runs["log"], runs["lists"].workdir
  for line in (f"work directory: {workdir}", "settings not at their defaults: --dataset=arrays",
               "data: 912 train / 48 validation / 240 test samples, 300 features, 40 labels",
               "step 10/30: loss", "step 15: validation P@1", "final (selected step",
               f"SAMPLED_P@1 {runs['files_final']['sampled_p@1']:.4f}"):
    assert line in log, line
  assert log.rstrip().endswith(f"in {workdir}")  # the final line, as sparsejax-train prints it
  assert "orbax" not in log  # orbax's INFO lines are filtered as the command line filters them
  # Afterwards, absl's logging is as it was: an INFO line goes nowhere new.
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):
    logging.info("not shown")
  assert "not shown" not in stderr.getvalue()


def test_a_notebook_shows_a_progress_bar_with_the_log_lines_above_it(tmp_path, monkeypatch):
  """In a Jupyter kernel (stderr no terminal) a bar replaces the periodic step lines; evaluations print above it."""
  import types

  kernel = types.SimpleNamespace(config={"IPKernelApp": {}})
  monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel))
  full = data.make_synthetic(400, 60, 10, seed=0)
  x, y, _ = _matrices(full)
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):
    sparsejax.fit(x, y, workdir=tmp_path, **dict(SETTINGS, progress=True, max_steps=20, eval_every=10))
  shown = stderr.getvalue()
  assert re.search(r"20/20 \[.*loss=\d", shown), shown[-2000:]
  assert "step 10: validation P@1" in shown and "final (selected step" in shown
  assert "step 10/20: loss" not in shown  # the bar's postfix says it


def test_fit_searches_the_recipes_on_its_matrices(tmp_path, monkeypatch):
  """recipe="auto" (the default): the candidates train on fit's matrices, the winner trains on, all logged."""
  from sparsejax.train import search_plan

  monkeypatch.setattr(search_plan, "MIN_ROUND_STEPS", 10)  # rounds of a few steps: the whole search in seconds
  full = data.make_synthetic(1000, 300, 60, seed=0)
  x, y, _ = _matrices(full)
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):
    model = sparsejax.fit(x, y, workdir=tmp_path, batch_size=32, max_steps=60, search_fraction=0.6, eval_every=1000,
                          log_every=10, progress=False)
  records = _records(tmp_path)
  winner = [r["search_winner"] for r in records if "search_winner" in r]
  assert len(winner) == 1 and records[-1]["recipe"] == winner[0] == model.config.search.recipe
  first_round = next(r for r in records if r.get("search_round") == 1)
  assert len(first_round["search"]) >= 2  # the candidates that fit the data, each trained and scored
  assert f"recipe search: {winner[0]} wins" in stderr.getvalue()


def test_without_verbose_nothing_is_shown(tmp_path, capsys):
  full = data.make_synthetic(300, 60, 10, seed=0)
  x, y, _ = _matrices(full)
  model = sparsejax.fit(x, y, workdir=tmp_path, verbose=False, **dict(SETTINGS, max_steps=5))
  captured = capsys.readouterr()
  assert "work directory" not in captured.err + captured.out and "final" not in captured.err + captured.out
  assert model.step == 5 and model.predict(x[:3], top=2)[1].shape == (3, 2)


def test_fit_predicts_as_sparsejax_predict_does(runs, installed_command):
  """The acceptance of issue 33: the model fit returns and the command line predict the same labels."""
  model = runs["lists"]
  scores, ids = model.predict(runs["x_test"], top=3)
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={model.workdir}",
                        f"--input={runs['root'] / 'test.txt'}", "--top=3"], capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = [[pair.rsplit(":", 1) for pair in line.split("\t")] for line in out.stdout.splitlines()]
  assert np.array_equal(np.array([[int(label) for label, _ in line] for line in lines]), ids)
  np.testing.assert_allclose(np.array([[float(s) for _, s in line] for line in lines]), scores, rtol=1e-4)


def test_a_second_call_continues_the_run(runs):
  """fit with a finished run's work directory, data and settings: nothing trained again, the same model."""
  model = runs["indicator"]
  before = _records(model.workdir)
  train = data.load_xc_file(runs["root"] / "train.txt")
  x, y, _ = _matrices(train)
  same = sparsejax.fit(x, y, X_val=runs["x_test"], Y_val=runs["y_test"], workdir=model.workdir, verbose=False,
                       **SETTINGS)
  assert _records(model.workdir) == before and same.step == model.step


def _records(workdir):
  from sparsejax.train.metric_writer import read_records

  return read_records(str(workdir))


# --- Bad inputs: each named, before anything is trained ----------------------------------------------------------


def _small():
  full = data.make_synthetic(60, 20, 8, labels_per_sample=2, seed=0)
  x, y, lists = _matrices(full)
  return x, y, lists


def _with(matrix, row, column, value):
  matrix = matrix.astype(np.float64).tolil()  # float32 would hold 1e39 as inf
  matrix[row, column] = value
  return matrix.tocsr()


def _bad_inputs():
  x, y, lists = _small()
  empty_row = [list(labels) for labels in lists]
  empty_row[3] = []
  negative, fraction, twice = ([list(labels) for labels in lists] for _ in range(3))
  negative[1] = [-1]
  fraction[2] = [2.5]
  twice[4] = [3, 5, 3]
  no_label = y.tolil(copy=True)
  row = next(i for i, labels in enumerate(lists) if max(labels) >= 5)  # the first label outside [0, 5)
  label = next(label for label in lists[row] if label >= 5)
  no_label[3, :] = 0
  return [
      (dict(X=x, Y=y, lerning_rate=1e-3), TypeError,
       "fit() got an unknown setting 'lerning_rate'. Did you mean: learning_rate ?"),
      (dict(X=x, Y=y, hidden_dims=0), ConfigError, "--hidden_dims=0: must be >= 1"),
      (dict(X=x, Y=y, max_seconds=float("nan")), ConfigError, "--max_seconds=nan: must be a finite number"),
      (dict(X=x, Y=y, dataset="synthetic"), ConfigError, "--dataset=synthetic: fit trains on the matrices"),
      (dict(X=x.toarray()[0], Y=y), TypeError, "X: must be a 2-D [n, num_features] matrix, got 1 dimension(s)"),
      (dict(X="features.txt", Y=y), TypeError, "X: give a sparse [n, num_features] matrix"),
      (dict(X=_with(x, 2, 5, np.nan), Y=y), ValueError, "X: row 2, column 5 holds nan: feature values must be finite"),
      (dict(X=_with(x, 7, 1, np.inf), Y=y), ValueError, "X: row 7, column 1 holds inf"),
      (dict(X=_with(x, 7, 1, 1e39), Y=y), ValueError, "X: row 7, column 1 holds 1e+39: feature values must be finite"),
      (dict(X=x, Y=y[:-1]), ValueError, "Y: has labels for 59 samples; the features have 60 rows"),
      (dict(X=x, Y=lists[:-1]), ValueError, "Y: has labels for 59 samples; the features have 60 rows"),
      (dict(X=x, Y=_with(y, 4, 6, -1)), ValueError, "Y: row 4, column 6 holds -1.0: an indicator matrix holds 1"),
      (dict(X=x, Y=_with(y, 4, 6, np.nan)), ValueError, "Y: row 4, column 6 holds nan"),
      (dict(X=x, Y=_with(y, 4, 6, 2)), ValueError, "Y: row 4, column 6 holds 2.0"),
      (dict(X=x, Y=no_label.tocsr()), ValueError, "Y: row 3 has no label (an unlabelled sample"),
      (dict(X=x, Y=empty_row), ValueError, "Y: row 3 has no label"),
      (dict(X=x, Y=negative), ValueError, "Y: row 1 holds label -1: label ids are >= 0"),
      (dict(X=x, Y=fraction), ValueError, "Y: row 2 holds 2.5: label ids must be integers"),
      (dict(X=x, Y=twice), ValueError, "Y: row 4 lists label 3 more than once"),
      (dict(X=x, Y=y.toarray()), TypeError, "Y: a dense 2-D array could be an indicator matrix or label-id lists"),
      (dict(X=x, Y="labels.txt"), TypeError, "Y: give labels as a sparse"),
      (dict(X=x, Y=lists, num_labels=5), ValueError, f"Y: row {row} holds label {label}, outside [0, 5) (num_labels=5"),
      (dict(X=x, Y=y, X_val=x), TypeError, "X_val is given without Y_val"),
      (dict(X=x, Y=y, Y_val=y), TypeError, "Y_val is given without X_val"),
      (dict(X=x, Y=y, X_val=x[:, :10], Y_val=y), ValueError, "X_val: has 10 columns (features); X has 20"),
      (dict(X=x, Y=y, X_val=x, Y_val=y[:, :7]), ValueError, "Y_val: has 7 label columns; Y has 8"),
      (dict(X=x, Y=y, X_val=x, Y_val=empty_row), ValueError, "Y_val: row 3 has no label"),
      (dict(X=x, Y=y, label_names=["a", "b"]), ValueError, "label_names: has 2 names for 8 labels"),
      (dict(X=x, Y=y, platfrom="cpu"), TypeError, "unknown setting 'platfrom'. Did you mean: platform ?"),
      (dict(X=x, Y=y, platform="tpu"), ValueError, "platform='tpu': must be one of cpu, cuda, rocm"),
      (dict(X=x, Y=y, platform="cuda"), ValueError, "platform='cuda': an accelerator runs model=dense only"),
      # This process's JAX runs on CPUs already (the suite's), as a notebook's may run on a GPU when fit is called.
      (dict(X=x, Y=y, model="dense", platform="cuda"), RuntimeError,
       "platform='cuda': JAX already runs on cpu in this process, and it cannot change once started"),
  ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_every_bad_input_is_named_before_anything_is_trained(case, tmp_path, monkeypatch):
  arguments, error, message = _bad_inputs()[case]
  monkeypatch.setenv("SPARSEJAX_RUNS", str(tmp_path / "runs"))
  with pytest.raises(error, match=re.escape(message)):
    sparsejax.fit(**arguments, verbose=False, max_steps=5)
  assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")  # no run directory made


FIT_TINY = textwrap.dedent("""
    import sys
    import jax
    import scipy.sparse
    import sparsejax
    from sparsejax.data import make_synthetic
    full = make_synthetic(300, 50, 10, seed=0)
    X = scipy.sparse.csr_matrix((full.values, full.indices, full.indptr), shape=(len(full), 50))
    Y = [full.label_indices[a:b].tolist() for a, b in zip(full.label_indptr[:-1], full.label_indptr[1:])]
    model = sparsejax.fit(X, Y, workdir=sys.argv[1], compilation_cache=sys.argv[2], verbose=False, max_steps=4,
                          hidden_dims=(8,), active_k=8, batch_size=32, eval_every=1000, recipe="none", progress=False)
    print(jax.devices()[0].platform, model.predict(X[:2], top=2)[1].shape)
""")


def test_fit_trains_on_cpus_with_the_commands_compilation_cache(tmp_path):
  """Issue 33: fit used JAX's default platform (a GPU's, where JAX has one: SLIDE's CPU kernels fail there) and no
  persistent compilation cache. Now, like sparsejax-train, it starts JAX on the CPU (here JAX_PLATFORMS=cuda on a
  machine without one stands for a GPU default: JAX failed to start its backend) and fills the per-user cache by
  default; compilation_cache='none' turns it off."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
  entries = lambda root: [n for _, _, names in os.walk(root) for n in names if n.endswith("-cache")]
  for setting in ("none", "auto"):
    env.update(JAX_PLATFORMS="cuda", XDG_CACHE_HOME=str(tmp_path / setting))
    out = subprocess.run([sys.executable, "-P", "-c", FIT_TINY, str(tmp_path / f"run-{setting}"), setting],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "cpu (2, 2)", out.stdout
    cached = entries(tmp_path / setting / "sparsejax" / "jax" / compilation_cache.cpu_id())
    assert (len(cached) > 5) if setting == "auto" else not entries(tmp_path / setting), cached


def test_a_run_refused_at_its_start_leaves_no_empty_directory(tmp_path, monkeypatch):
  monkeypatch.setenv("SPARSEJAX_RUNS", str(tmp_path))
  x, y, _ = _small()
  with pytest.raises(ConfigError, match="--batch_size=500: exceeds the"):
    sparsejax.fit(x, y, batch_size=500, recipe="none", verbose=False)
  assert os.listdir(tmp_path) == []


def test_an_interrupted_fit_says_how_to_continue_it(tmp_path, monkeypatch):
  import signal

  from sparsejax.train import driver
  from sparsejax.train.stopping import Interrupted

  def stopped(config, workdir, **kwargs):
    raise Interrupted(signal.SIGINT, 7, os.path.join(workdir, "checkpoints"))

  monkeypatch.setattr(driver, "train_and_evaluate", stopped)
  x, y, _ = _small()
  with pytest.raises(Interrupted) as stop:
    sparsejax.fit(x, y, workdir=tmp_path / "run", verbose=False)
  assert str(stop.value) == (f"stopped by SIGINT after step 7: checkpoint saved in {tmp_path / 'run' / 'checkpoints'}; "
                             f"fit(...) with workdir={str(tmp_path / 'run')!r} and the same data and settings "
                             "continues the run")


def test_a_setting_is_taken_as_the_command_line_takes_it():
  from sparsejax.fitting import _config

  config = _config(dict(hidden_dims=512, max_steps=np.int64(7), dropout=np.float32(0.5).item()))
  assert config.network.hidden_dims == (512,) and config.budget.max_steps == 7 and type(config.budget.max_steps) is int
  assert config.search.recipe == "none"  # a recipe setting given skips the search, as on the command line
  assert _config(dict(recipe="wide")).search.recipe == "wide"


def test_a_command_line_cannot_train_on_arrays(tmp_path):
  with pytest.raises(ConfigError, match="--dataset=arrays: the matrices given to sparsejax.fit"):
    train_and_evaluate(override(Config(), dataset="arrays", **SETTINGS), str(tmp_path))


# --- The README's example --------------------------------------------------------------------------------------


def test_readme_notebook_example_runs_as_written(root, tmp_path, monkeypatch):
  blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), re.S)
  code = [block for block in blocks if "sparsejax.fit(" in block]
  assert len(code) == 1, "README lost its sparsejax.fit example"
  monkeypatch.chdir(tmp_path)
  stderr, namespace = io.StringIO(), {}
  with contextlib.redirect_stderr(stderr):
    exec(compile(code[0], "README.md", "exec"), namespace)
  model, scores, ids = namespace["model"], namespace["scores"], namespace["ids"]
  assert scores.shape == ids.shape == (namespace["X_test"].shape[0], 5)
  assert f"work directory: {model.workdir}" in stderr.getvalue()
  assert sparsejax.load(model.workdir).step == model.step
  # Better than a constant guess, the most frequent label, whose P@1 is its share of the test samples.
  p1 = model.evaluate(namespace["X_test"], labels=namespace["Y_test"])["p@1"]
  counts = np.bincount([label for labels in namespace["Y_test"] for label in labels])
  assert p1 > 2 * counts.max() / len(namespace["Y_test"]), p1


def test_log_to_console_leaves_absl_loggers_level_as_it_was():
  """absl's logger has no level of its own where no absl.app set one (its messages go as the root logger's level
  says: logging.basicConfig(level=INFO) shows them). log_to_console gave it WARNING for good: afterwards
  basicConfig's INFO no longer showed absl's INFO lines."""
  import logging as python_logging

  from sparsejax.train.console import log_to_console

  absl_logger, verbosity = logging.get_absl_logger(), logging.get_verbosity()
  before = absl_logger.level
  try:
    absl_logger.setLevel(python_logging.NOTSET)
    with log_to_console():
      assert absl_logger.getEffectiveLevel() == python_logging.INFO
    assert absl_logger.level == python_logging.NOTSET and logging.get_verbosity() == verbosity
  finally:
    absl_logger.setLevel(before)
