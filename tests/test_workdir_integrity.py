"""A work directory's served files are verified (issue 35): ``best_checkpoint/`` and ``assets/`` are sealed with
checksums, the run's id and the step; ``sparsejax.load``, ``sparsejax-predict`` and a resumed run refuse a corrupted
file, another run's, another step's or a lost best state by name, instead of serving or reporting it."""

import collections
import glob
import json
import logging
import os
import shutil
import subprocess
import warnings

import numpy as np
import pytest

import sparsejax
from sparsejax import data
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate
from sparsejax.train.metric_writer import read_records
from sparsejax.workdir import seals
from sparsejax.workdir.seals import IntegrityError


@pytest.fixture(scope="module")
def validated_config(small_config):
  """A run that selects its best state on a validation split and keeps a clustered serving index."""
  return override(small_config, candidates="clusters", reinsert="none", validation_fraction=0.2, max_steps=40,
                  eval_every=20, checkpoint_every=20, recipe="none")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, validated_config):
  """Two runs of the same shapes (other seeds): ``(ours, theirs)`` work directories, kept pristine."""
  base = tmp_path_factory.mktemp("runs")
  train_and_evaluate(validated_config, str(base / "ours"))
  train_and_evaluate(override(validated_config, seed=7), str(base / "theirs"))
  return base / "ours", base / "theirs"


@pytest.fixture
def ours(runs, tmp_path):
  """A copy of our run, free to damage."""
  shutil.copytree(runs[0], tmp_path / "run")
  return tmp_path / "run"


def _flip(path, offset=None):
  content = bytearray(open(path, "rb").read())
  offset = len(content) // 2 if offset is None else offset
  content[offset] ^= 0x01  # one bit
  open(path, "wb").write(bytes(content))


def _best_dir(workdir):
  (step,) = [name for name in os.listdir(workdir / "best_checkpoint") if name.isdigit()]
  return workdir / "best_checkpoint" / step


def _largest_state_file(directory):
  files = [f for f in glob.glob(f"{directory}/state/**/d/*", recursive=True) if os.path.isfile(f)]
  return max(files, key=os.path.getsize)


def test_an_intact_run_is_sealed_and_loads_without_a_warning(ours):
  assert os.path.exists(_best_dir(ours) / "checksums.p0.json")
  seal = json.loads((ours / "assets" / "checksums.json").read_text())
  assert set(seal["files"]) == {"label_frequencies.npy", "serving_index.npz", "centroid_fusion.npz"}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model = sparsejax.load(str(ours))
  assert model.selected_by == "validation p@1" and model.serving_index_kept


def test_a_flipped_bit_in_the_best_state_is_refused_by_load_and_predict(ours, installed_command, tmp_path):
  """Issue 35: one flipped bit made load and predict serve scores of 1e29-1e35, exit 0."""
  path = _largest_state_file(_best_dir(ours))
  _flip(path)
  with pytest.raises(IntegrityError, match=f"{path}: corrupted"):
    sparsejax.load(str(ours))
  test = data.load_dataset(override(_config(ours).data), seed=0).test.subset(np.arange(5))
  data.save_xc_file(test, tmp_path / "test.txt")
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={ours}",
                        f"--input={tmp_path / 'test.txt'}"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and out.stdout == "", out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"sparsejax-predict: error: {path}: corrupted (its SHA-256 differs from the one its run recorded in "
      f"{_best_dir(ours)}/checksums.p0.json)")


def _config(workdir):
  from sparsejax.config import Config

  return Config.from_dict(json.loads((workdir / "config.json").read_text()))


@pytest.mark.parametrize("name", ["label_frequencies.npy", "serving_index.npz"])
def test_a_flipped_bit_in_an_asset_is_refused(ours, name):
  path = ours / "assets" / name
  _flip(path)
  with pytest.raises(IntegrityError, match=f"{path}: corrupted"):
    sparsejax.load(str(ours))


def test_a_flipped_bit_in_a_checkpoint_loaded_by_its_step_is_refused(ours):
  path = _largest_state_file(ours / "checkpoints" / "20")
  _flip(path)
  with pytest.raises(IntegrityError, match="checkpoints/20 has a corrupted file state/"):
    sparsejax.load(str(ours), step=20)


@pytest.mark.parametrize("directory", ["best_checkpoint", "assets"])
def test_another_runs_directory_copied_in_is_refused(ours, runs, directory):
  """Issue 35: another run's best_checkpoint/ (same shapes, other seed) was served and reported as this run's; its
  assets/ gave sampled predictions its index and PSP@k its label frequencies."""
  shutil.rmtree(ours / directory)
  shutil.copytree(runs[1] / directory, ours / directory)
  with pytest.raises(IntegrityError, match=f"{ours / directory}[^ ]*: from another run"):
    sparsejax.load(str(ours))


def test_another_runs_file_copied_into_assets_is_refused(ours, runs):
  shutil.copy(runs[1] / "assets" / "serving_index.npz", ours / "assets" / "serving_index.npz")
  with pytest.raises(IntegrityError, match="serving_index.npz: (corrupted|truncated or replaced)"):
    sparsejax.load(str(ours))



def test_a_centroid_fusion_the_seal_does_not_record_is_refused(ours, runs):
  """A run that fused nothing (--nocentroid_fusion) with another run's centroid_fusion.npz copied in: load re-ranked
  by it unchecked (the seal was checked only for the files it records and the others load reads)."""
  seal_path = ours / "assets" / "checksums.json"
  seal = json.loads(seal_path.read_text())
  del seal["files"]["centroid_fusion.npz"]
  seal_path.write_text(json.dumps(seal))
  with pytest.raises(IntegrityError, match=f"{ours / 'assets' / 'centroid_fusion.npz'}: not recorded in"):
    sparsejax.load(str(ours))


@pytest.mark.parametrize("content", [b"", b'{"p@1": ', b'{"p@0": 0.5}', b'\xff'])
def test_a_damaged_score_of_the_best_state_is_named(ours, content):
  """Found by the fuzzing below: orbax reads best_checkpoint/N/metrics/metrics to choose the best state before any
  seal is checked; a damaged one ended in a JSONDecodeError or KeyError naming no file."""
  path = _best_dir(ours) / "metrics" / "metrics"
  path.write_bytes(content)
  with pytest.raises(IntegrityError, match=f"^{path}: not the validation metrics of a kept state"):
    sparsejax.load(str(ours))
  path.unlink()  # orbax passed the state over: "the best state was lost", naming no file
  with pytest.raises(IntegrityError, match=f"^{path}: missing"):
    sparsejax.load(str(ours))

def _reseal_serving_index(workdir, **arrays):
  """Rewrites the serving index with ``arrays`` replaced and records it in the seal: a bad index its run wrote."""
  path = workdir / "assets" / "serving_index.npz"
  with np.load(path) as f:
    content = {key: f[key] for key in f.files}
  content.update(arrays)
  with open(path, "wb") as f:
    np.savez(f, **content)
  seal_path = workdir / "assets" / "checksums.json"
  seal = json.loads(seal_path.read_text())
  seal["files"]["serving_index.npz"] = seals.file_entry(str(path))
  seal_path.write_text(json.dumps(seal))
  return content


@pytest.mark.parametrize("fill", [np.nan, 0.0])
def test_a_serving_index_of_nan_or_zero_centroids_is_refused(ours, fill):
  """Issue 35: NaN or zero centroids silently changed sampled (--k) predictions."""
  with np.load(ours / "assets" / "serving_index.npz") as f:
    centroids = np.full_like(f["centroids"], fill)
  _reseal_serving_index(ours, centroids=centroids)
  model = sparsejax.load(str(ours))
  what = "are not all finite numbers" if np.isnan(fill) else "are all zero"
  with pytest.raises(IntegrityError, match=f"serving_index.npz: not a serving index of this model: its centroids "
                                           f"{what}"):
    model.predict(model.features(_features(model)), top=3, k=20)


def _features(model):
  import scipy.sparse

  return scipy.sparse.random(4, model.num_features, density=0.05, format="csr", random_state=0, dtype=np.float32)


def test_a_deleted_best_checkpoint_is_named_by_load_and_by_a_resumed_run(ours, validated_config, caplog):
  """Issue 35: deleting best_checkpoint/ then resuming selected another step without saying the best was lost."""
  shutil.rmtree(ours / "best_checkpoint")
  with pytest.raises(IntegrityError, match=r"best_checkpoint: missing: the state the run selected \(step \d+, "
                                           r"recorded in checkpoint 40\) was lost"):
    sparsejax.load(str(ours))
  assert sparsejax.load(str(ours), step=40).step == 40  # a kept checkpoint, asked for by its step
  with caplog.at_level(logging.WARNING):
    final = train_and_evaluate(override(validated_config, max_steps=60), str(ours))
  assert "the best state recorded at step" in caplog.text and "was lost" in caplog.text
  assert "Model selection starts anew at step 40" in caplog.text
  assert final["selected_step"] >= 40  # among the states evaluated after the loss
  assert sparsejax.load(str(ours)).step == final["selected_step"]


def test_a_resumed_run_sets_a_corrupted_best_state_aside(ours, validated_config, caplog):
  """Issue 35: a resumed run's final record reported the corrupted best state (test P@1 0.000)."""
  best = _best_dir(ours)
  _flip(_largest_state_file(best))
  with caplog.at_level(logging.WARNING):
    final = train_and_evaluate(override(validated_config, max_steps=60), str(ours))
  assert f"{best}/state/" in caplog.text and "corrupted" in caplog.text and "set aside" in caplog.text
  assert glob.glob(f"{best}.corrupt.*")
  assert final["selected_step"] >= 40 and final["p@1"] > 0.1
  assert np.isfinite(read_records(str(ours))[-1]["p@1"])
  sparsejax.load(str(ours))  # the new best state is sealed


def test_the_final_evaluation_refuses_a_best_state_changed_during_the_run(tmp_path, validated_config,
                                                                         monkeypatch):
  from sparsejax.workdir import best_checkpoint

  check = best_checkpoint.BestCheckpoint.check

  def flip_then_check(self, step, run_id):  # a bit flips on disk between the save and the final evaluation
    _flip(_largest_state_file(self.step_directory(step)))
    return check(self, step, run_id)

  monkeypatch.setattr(best_checkpoint.BestCheckpoint, "check", flip_then_check)
  with pytest.raises(IntegrityError, match="best_checkpoint/[0-9]+/state/.*: corrupted"):
    train_and_evaluate(validated_config, str(tmp_path / "run"))
  assert not [r for r in read_records(str(tmp_path / "run")) if r.get("final")]


def test_an_older_unsealed_run_loads_with_a_warning(ours):
  """A work directory of a sparsejax before seals: no run id in its meta, no seals. Loaded, with a warning."""
  for step in ("20", "40"):
    os.remove(ours / "checkpoints" / step / "checksums.p0.json")
    meta_path = ours / "checkpoints" / step / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    del meta["run_id"]
    meta_path.write_text(json.dumps(meta))
  os.remove(_best_dir(ours) / "checksums.p0.json")
  os.remove(ours / "assets" / "checksums.json")
  with pytest.warns(seals.UnverifiedWarning, match="loaded without checking them"):
    model = sparsejax.load(str(ours))
  assert model.selected_by == "validation p@1"


def test_a_checkpoint_of_an_older_sparsejax_in_a_continued_run_loads_with_a_warning(ours):
  """A run begun by a sparsejax before seals and continued by this one: its early checkpoints record no run id.
  Loaded by step, they are named as unverified, not refused as another run's."""
  os.remove(ours / "checkpoints" / "20" / "checksums.p0.json")
  meta_path = ours / "checkpoints" / "20" / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())
  del meta["run_id"]
  meta_path.write_text(json.dumps(meta))
  with pytest.warns(seals.UnverifiedWarning, match="checkpoints/20 was written by a sparsejax that did not record"):
    model = sparsejax.load(str(ours), step=20)
  assert model.step == 20 and model.selected_by == "step"


def test_a_removed_seal_is_refused(ours):
  os.remove(_best_dir(ours) / "checksums.p0.json")
  with pytest.raises(IntegrityError, match="has no checksums"):
    sparsejax.load(str(ours))


def test_save_writes_a_directory_that_loads_alone_and_predicts_the_same(ours, tmp_path):
  """model.save(dir) then sparsejax.load(dir), with the run's directory gone: the same state, sealed (no warning),
  the same predictions; a non-empty target is refused."""
  model = sparsejax.load(str(ours))
  features = _features(model)
  want = model.predict(features, top=5)
  saved = model.save(str(tmp_path / "saved"))
  assert sorted(os.listdir(saved)) == ["assets", "best_checkpoint", "checkpoints", "config.json"]
  shutil.rmtree(ours)
  with warnings.catch_warnings():
    warnings.simplefilter("error", seals.UnverifiedWarning)
    again = sparsejax.load(saved)
  assert (again.step, again.selected_by) == (model.step, model.selected_by)
  got = again.predict(features, top=5)
  for a, b in zip(got, want):  # (scores, ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
    again.save(saved)


# --- Fuzzing the served files (issue 35) -------------------------------------------------------------------------
# Random damage to any file of best_checkpoint/ and assets/ (label names and a vectorizer added, as a text run writes
# them): sparsejax.load and predict refuse it with an error sparsejax-predict prints as one line (an OSError or a
# ValueError) naming the file, or serve exactly what the undamaged run serves. A work directory of an older sparsejax
# (no seals) cannot tell a changed weight from the run's: there, any answer, but never another exception (a traceback
# from inside orbax, TensorStore or numpy).

DAMAGE = ("flip", "truncate", "delete", "random bytes", "random span", "empty")


@pytest.fixture(scope="module")
def served(runs, tmp_path_factory):
  """Our run with label names and a vectorizer (sealed as its run seals them), and an unsealed copy as an older
  sparsejax wrote it: ``{"sealed": dir, "unsealed": dir}``, kept pristine, and what the run serves."""
  from sklearn.feature_extraction.text import TfidfVectorizer

  from sparsejax.data.text import TOKEN_PATTERN, save_vectorizer

  base = tmp_path_factory.mktemp("served")
  sealed = base / "sealed"
  shutil.copytree(runs[0], sealed)
  assets = sealed / "assets"
  (assets / "labels.txt").write_text("".join(f"label {i} é\n" for i in range(200)))
  vectorizer = TfidfVectorizer(token_pattern=TOKEN_PATTERN, sublinear_tf=True, dtype=np.float32)
  save_vectorizer(vectorizer.fit([" ".join(f"t{i}" for i in range(1000)), "t0 t1 t2"]), assets / "vectorizer.json")
  seal = json.loads((assets / "checksums.json").read_text())
  for name in ("labels.txt", "vectorizer.json"):
    seal["files"][name] = seals.file_entry(str(assets / name))
  (assets / "checksums.json").write_text(json.dumps(seal))
  unsealed = base / "unsealed"
  shutil.copytree(sealed, unsealed)
  for seal_path in glob.glob(f"{unsealed}/**/checksums*.json", recursive=True):
    os.remove(seal_path)
  for meta_path in glob.glob(f"{unsealed}/checkpoints/*/meta/metadata"):
    meta = json.loads(open(meta_path).read())
    del meta["run_id"]
    open(meta_path, "w").write(json.dumps(meta))
  return {"sealed": sealed, "unsealed": unsealed}, _serve(sealed)


def _serve(workdir) -> list[np.ndarray]:
  """What the model in ``workdir`` serves: exact, sampled (k) and text predictions, and the labels' names."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", seals.UnverifiedWarning)
    model = sparsejax.load(str(workdir))
  features = _rows(model.num_features)
  results = [model.predict(features, top=5), model.predict(features, top=5, k=40),
             model.predict(["t5 t7 t9", "t100 t3 t3"], top=3)]
  return [np.asarray(array) for result in results for array in result] + [model.names(results[0][1])]


def _rows(num_features: int):
  import scipy.sparse

  return scipy.sparse.random(6, num_features, density=0.05, format="csr", random_state=0, dtype=np.float32)


def _damage(path, kind: str, where: int, noise: bytes) -> None:
  """Damages the file at ``path``: ``kind`` of DAMAGE, at byte ``where`` (mod its size), with ``noise`` bytes."""
  import random

  content = bytearray(path.read_bytes())
  at = where % max(1, len(content))
  if kind == "delete":
    path.unlink()
    return
  if kind == "flip" and content:
    content[at] ^= 1 << (where >> 20) % 8
  elif kind == "truncate":
    content = content[:at]
  elif kind == "random bytes":
    content = bytearray(random.Random(noise).randbytes(len(content)))
  elif kind == "random span":
    content[at:at + len(noise)] = noise[:len(content) - at]
  elif kind == "empty":
    content = bytearray()
  path.write_bytes(bytes(content))


def _names_the_file(message: str, workdir, relative: str) -> bool:
  """Whether ``message`` names the damaged file: its path, its directory and its name, or (a file of an orbax state
  without seals, read by orbax as a whole) its state's directory."""
  path = workdir / relative
  if str(path) in message or (str(path.parent) in message and path.name in message):
    return True
  parts = relative.split(os.sep)
  return parts[0] == "best_checkpoint" and "state" in parts and str(workdir.joinpath(*parts[:3])) in message


@pytest.mark.parametrize("kind, cases", [("sealed", 100), ("unsealed", 30)])
def test_fuzz_a_damaged_served_file_is_refused_by_name_or_serves_the_same(served, kind, cases, fuzz_settings,
                                                                          record_cases, tmp_path):
  from hypothesis import given
  from hypothesis import strategies as st

  pristine, want = served
  workdir = tmp_path / "run"
  shutil.copytree(pristine[kind], workdir)
  files = sorted(os.path.relpath(os.path.join(parent, name), workdir) for top in ("best_checkpoint", "assets")
                 for parent, _, names in os.walk(workdir / top) for name in names)
  tally = collections.Counter()

  @fuzz_settings(cases)
  @given(st.sampled_from(files), st.sampled_from(DAMAGE), st.integers(0, 1 << 24), st.binary(min_size=1,
                                                                                               max_size=16))
  def check(relative, damage, where, noise):
    try:
      _damage(workdir / relative, damage, where, noise)
      try:
        got = _serve(workdir)
      except (OSError, ValueError) as e:  # what sparsejax-predict prints as one line
        if kind == "unsealed" and damage == "delete" and not _names_the_file(str(e), workdir, relative):
          # Nothing records the file: the directory is one whose run never wrote it (found by --fuzz-long: no
          # vectorizer.json, so texts are refused as for any model without one).
          tally["refused as a model without the file"] += 1
          return
        assert _names_the_file(str(e), workdir, relative), (relative, damage, str(e))
        tally["refused, naming the file"] += 1
        return
      if kind == "sealed":
        for a, b in zip(got, want):
          np.testing.assert_array_equal(a, b, err_msg=f"{relative} ({damage}) served another answer")
        tally["the undamaged run's answer"] += 1
      else:
        tally["an answer (nothing to check it against)"] += 1
    finally:
      shutil.copy2(pristine[kind] / relative, workdir / relative)

  check()
  record_cases(f"served files damaged ({kind})", tally)
  assert sum(tally.values()) >= cases * 3 // 4


def test_a_small_best_state_is_written_at_the_next_wait_and_only_the_last_one(tmp_path, monkeypatch):
  """The best states between two waits (checkpoints) are copies in memory; a wait writes the last, sealed."""
  import jax.numpy as jnp

  from sparsejax.workdir import best_checkpoint

  best = best_checkpoint.BestCheckpoint(str(tmp_path), "p@1", run_id="run")
  state = {"w": jnp.arange(6.0)}
  best.save(5, state, 0.5)
  best.save(10, {"w": state["w"] + 1}, 0.7)
  state["w"] = state["w"].at[0].set(-1.0)  # the live arrays change after the save: the kept copy does not
  assert best.best_step() is None and not glob.glob(str(tmp_path / "best_checkpoint" / "*" / "state"))
  best.wait()
  assert best.best_step() == 10 and sorted(os.listdir(tmp_path / "best_checkpoint")) == ["10"]
  np.testing.assert_array_equal(best.restore_arrays()["w"], np.arange(6.0) + 1)
  best.check(10, "run")  # sealed
  monkeypatch.setattr(best_checkpoint, "DEFERRED_BYTES", 8)  # a larger state: written at once
  best.save(15, {"w": jnp.zeros(6)}, 0.9)
  best._manager.wait_until_finished()
  assert best.best_step() == 15
  best.wait()
