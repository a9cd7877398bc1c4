"""Ensembles (sparsejax.ensemble, sparsejax.train.members): the merge against brute force, and a run that trains a
second member with the budget its early stop leaves, serves the ensemble and reproduces its final evaluation."""

import json
import os

import jax
import numpy as np
import pytest
import scipy.sparse

from sparsejax.ensemble import merge_top


def _brute_merge(scores, ids, top):
  """merge_top by dictionaries: each label of any list, the mean over the members that list any label of its logit
  or the member's lowest listed one."""
  out_s, out_i = [], []
  for r in range(len(ids[0])):
    lists = [{int(i): float(s) for s, i in zip(sc[r], idx[r]) if i >= 0 and np.isfinite(s)}
             for sc, idx in zip(scores, ids)]
    order = []  # first appearance: member by member, in their order
    for d in lists:
      order += [label for label in d if label not in order]
    listing = [d for d in lists if d]
    merged = [(np.mean([d.get(label, min(d.values())) for d in listing]), label) for label in order]
    merged.sort(key=lambda x: -x[0])  # stable: ties keep the first appearance
    merged += [(-np.inf, -1)] * (top - len(merged))
    out_s.append([s for s, _ in merged[:top]])
    out_i.append([i for _, i in merged[:top]])
  return np.asarray(out_s, np.float32), np.asarray(out_i)


def test_merge_top_averages_the_members_logits_with_each_ones_floor_for_labels_it_did_not_rank():
  rng = np.random.default_rng(0)
  n, num_labels, t = 50, 40, 6
  logits = [rng.normal(size=(n, num_labels)).astype(np.float32) for _ in range(3)]
  ids = [np.argsort(-x, axis=1)[:, :t] for x in logits]
  scores = [np.take_along_axis(x, i, axis=1) for x, i in zip(logits, ids)]
  for top in (1, 5, 18):
    got_s, got_i = merge_top(scores, ids, top)
    want_s, want_i = _brute_merge(scores, ids, top)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-6)
  # Independent of the brute force: a label both members rank first wins with the mean of its two logits.
  s, i = merge_top([np.array([[3.0, 1.0]]), np.array([[5.0, 0.0]])], [np.array([[7, 2]]), np.array([[7, 4]])], 3)
  np.testing.assert_array_equal(i, [[7, 2, 4]])
  np.testing.assert_allclose(s, [[4.0, 0.5, 0.5]])


def test_merge_top_skips_missing_labels_and_keeps_ties_in_member_order():
  scores = [np.array([[2.0, -np.inf]], np.float32), np.array([[1.0, 1.0]], np.float32)]
  ids = [np.array([[3, -1]]), np.array([[5, 3]])]
  s, i = merge_top(scores, ids, 4)
  # 3: (2 + 1) / 2; 5: (member 0's floor 2 + 1) / 2, a tie that keeps member 0's label first; then nothing.
  np.testing.assert_array_equal(i, [[3, 5, -1, -1]])
  np.testing.assert_allclose(s, [[1.5, 1.5, -np.inf, -np.inf]])
  with pytest.raises(ValueError, match="top must be in"):
    merge_top(scores, ids, 5)
  # A member that lists nothing for a sample (a sampled ranking's NaN padding) leaves the mean to the others.
  padded = [np.array([[np.nan, np.nan], [1.0, 0.0]], np.float32), np.array([[4.0, 2.0], [3.0, 1.0]], np.float32)]
  listed = [np.array([[-1, -1], [8, 9]]), np.array([[6, 7], [9, 8]])]
  s, i = merge_top(padded, listed, 2)
  # Row 0: the second member's alone. Row 1: 9 is (0 + 3) / 2, 8 is (1 + 1) / 2.
  np.testing.assert_array_equal(i, [[6, 7], [9, 8]])
  np.testing.assert_allclose(s, [[4.0, 2.0], [1.5, 1.0]])
  np.testing.assert_array_equal(i, _brute_merge(padded, listed, 2)[1])
  with pytest.raises(ValueError, match="must be"):
    merge_top(scores, [ids[0], np.array([[5]])], 1)


def _config(**changes):
  from sparsejax.config import Config

  # A small problem whose validation P@1 stops rising within a few hundred steps: --early_stopping_ratio stops it
  from sparsejax.settings import override
  # well before its --max_seconds, and the second member trains in the time left.
  return override(
      Config(), dataset="synthetic", synthetic_samples=600, synthetic_features=1000, synthetic_labels=200,
      hidden_dims=(32,), active_k=32, batch_size=64, max_steps=600, eval_every=20, eval_samples=300, log_every=10,
      checkpoint_every=20, progress=False, learning_rate=3e-2, candidates="clusters", validation_fraction=0.2,
      softmax="sampled", max_seconds=600.0, recipe="none", **changes)


@pytest.fixture(scope="module")
def ensemble_run(tmp_path_factory):
  from sparsejax.train import train_and_evaluate

  workdir = str(tmp_path_factory.mktemp("ensemble") / "run")
  return workdir, train_and_evaluate(_config(), workdir)


def test_a_run_stopped_early_trains_a_second_member_and_serves_the_ensemble(ensemble_run):
  import sparsejax
  from sparsejax.data import load_dataset

  workdir, final = ensemble_run
  assert final["stopped_by"] == "early_stopping" and final["ensemble_members"] == 2, final
  assert "member0_p@1" in final and "network_p@1" in final
  first, second = final["member_train_seconds"]
  assert second > 0 and final["train_seconds"] == first + second
  model = sparsejax.load(workdir)
  assert len(model.members) == 1 and model.members[0].workdir == os.path.join(workdir, "members", "1")
  assert model.members[0].step <= final["step"] and "ensemble_members=2" in repr(model)
  assert sparsejax.load(workdir, step=final["last_step"]).members == ()  # another state: the network alone
  # The member trained the first member's steps to its last improvement beyond the noise (at most its selected
  # step) from another seed: another network.
  member_config = json.load(open(os.path.join(workdir, "members", "1", "config.json")))
  assert member_config["budget"]["max_steps"] == final["improved_step"] <= final["step"]
  assert member_config["run"]["seed"] == 1
  assert not np.array_equal(model.params.out.w, model.members[0].params.out.w)
  test = load_dataset(model.config.data, seed=model.config.run.seed).test
  # The served model reproduces the run's final (ensemble) evaluation, and its ranking is the members' merged.
  assert model.evaluate(test)["p@1"] == final["p@1"]
  _, ids = model.predict(test, top=5, fusion=False)
  lists = [m._network_fn(100)(m.params, *test.to_padded(np.arange(len(test)), test.max_features_per_sample(), 0)[:2])
           for m in (model, *model.members)]
  np.testing.assert_array_equal(ids, merge_top([s for s, _, _ in lists], [i for _, i, _ in lists], 5)[1])


def test_the_ensemble_record_says_what_each_field_measures(ensemble_run):
  """The first network's retrieval diagnostics, parameters and pace sat next to the ensemble's P@k, unnamed."""
  import sparsejax

  _, final = ensemble_run
  workdir = ensemble_run[0]
  model = sparsejax.load(workdir)
  networks = (model, *model.members)
  assert final["num_params"] == sum(x.size for m in networks for x in jax.tree.leaves(m.params))
  # The first network trained last_step steps, the member the first one's to its last improvement (from step 0).
  samples = (final["last_step"] + final["improved_step"]) * model.config.optim.batch_size
  assert final["samples_per_sec"] == pytest.approx(samples / final["train_seconds"], rel=1e-6)
  for key in ("label_recall", "mean_candidates", "label_cosine", "validation_p@1", "last_loss"):
    assert key not in final and f"member0_{key}" in final, key
  assert final["step"] == final["selected_step"] and final["stopped_by"] == "early_stopping"


def test_evaluating_the_ensemble_loads_it_once(ensemble_run, tmp_path, monkeypatch):
  import shutil

  from sparsejax.data import load_dataset, train_test_split
  from sparsejax.serving import model as trained
  from sparsejax.train import members
  from sparsejax.train.plan import validation_seed

  workdir, final = ensemble_run
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  model = trained.load(copy)
  config = model.config
  data = load_dataset(config.data, seed=config.run.seed)
  train, validation = train_test_split(data.train, config.data.validation_fraction, seed=validation_seed(config))
  first = {key[len("member0_"):]: value for key, value in final.items() if key.startswith("member0_")}
  first.update({key: final[key] for key in ("p@1", "train_seconds", "samples_per_sec") if key not in first})
  loads = []
  original = trained.TrainedModel.__init__
  monkeypatch.setattr(trained.TrainedModel, "__init__",
                      lambda self, *a, **k: loads.append(a) or original(self, *a, **k))
  record = members.evaluate(config, {**first, "step": final["step"]}, copy,
                            {"members/1": {"train_seconds": 1.0, "samples": 64}}, (train, validation, data.test))
  assert len(loads) == 2  # the ensemble and its member, once
  assert record["p@1"] == final["p@1"] and record["fusion_weight"] == final["fusion_weight"]


def test_an_ensemble_run_run_again_trains_nothing_and_its_saved_copy_predicts_the_same(ensemble_run, tmp_path):
  import sparsejax
  from sparsejax.train import train_and_evaluate

  workdir, final = ensemble_run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = f.read()
  assert train_and_evaluate(_config(), workdir) == final
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    assert f.read() == records
  model = sparsejax.load(workdir)
  copy = sparsejax.load(model.save(str(tmp_path / "served")))
  assert len(copy.members) == 1 and copy.members[0].workdir == str(tmp_path / "served" / "members" / "1")
  # Saved from another step (the network alone), the copy's selected state is still the ensemble.
  other = sparsejax.load(sparsejax.load(workdir, step=final["last_step"]).save(str(tmp_path / "other")))
  assert len(other.members) == 1
  inputs = scipy.sparse.random(8, 1000, density=0.01, format="csr", random_state=0, dtype=np.float32)
  for a, b in zip(model.predict(inputs, top=5), copy.predict(inputs, top=5)):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def same_seed_run(tmp_path_factory):
  """The ensemble run's settings trained again in another directory: the same networks, another run id."""
  from sparsejax.train import train_and_evaluate

  workdir = str(tmp_path_factory.mktemp("ensemble") / "again")
  return workdir, train_and_evaluate(_config(), workdir)


def test_the_same_seed_trains_the_same_ensemble_and_one_member_trains_none(ensemble_run, same_seed_run, tmp_path):
  import sparsejax
  from sparsejax.train import train_and_evaluate

  workdir, final = ensemble_run
  again_dir, again = same_seed_run
  assert again["p@1"] == final["p@1"] and again["ensemble_members"] == 2
  for a, b in zip(jax.tree.leaves(sparsejax.load(workdir).members[0].params),
                  jax.tree.leaves(sparsejax.load(again_dir).members[0].params)):
    np.testing.assert_array_equal(a, b)
  single = train_and_evaluate(_config(ensemble_members=1), str(tmp_path / "single"))
  assert "ensemble_members" not in single and not os.path.exists(tmp_path / "single" / "members")
  assert single["p@1"] == final["member0_p@1"]


def test_an_ensemble_file_names_only_member_directories(tmp_path):
  """A work directory from elsewhere must not make load open other files: member paths are members/M, nothing else."""
  from sparsejax.serving import assets
  from sparsejax.workdir import seals

  path = tmp_path / "ensemble.json"
  for members in (["../../etc"], ["/tmp/x"], ["members/1", "members/1"], ["members/0"], "members/1", [1]):
    path.write_text(json.dumps({"members": members}))
    with pytest.raises(seals.IntegrityError, match="members must be distinct directories members/M"):
      assets.read_ensemble(str(path))
  path.write_text("{")
  with pytest.raises(seals.IntegrityError, match="unreadable as an ensemble"):
    assets.read_ensemble(str(path))
  with pytest.raises(ValueError, match="members/M"):
    assets.save_ensemble(str(tmp_path), None, ["members/1/../../x"])
  for member in ({"directory": "members/1", "run_id": "ab", "step": True}, {"directory": "members/1", "step": 3},
                 {"directory": "members/1", "run_id": 7, "step": 3}):
    path.write_text(json.dumps({"members": [member]}))
    with pytest.raises(seals.IntegrityError, match="must record its directory, run_id and step"):
      assets.read_ensemble(str(path))
  recorded = [{"directory": "members/1", "run_id": "ab", "step": 40}, {"directory": "members/12", "run_id": None,
                                                                       "step": None}]
  path.write_text(json.dumps({"members": recorded}))
  assert assets.read_ensemble(str(path)) == recorded
  # An earlier sparsejax recorded the directories alone: read with no run or step to check.
  path.write_text(json.dumps({"members": ["members/1"]}))
  assert assets.read_ensemble(str(path)) == [{"directory": "members/1", "run_id": None, "step": None}]


def test_a_member_swapped_for_another_run_of_the_same_sizes_is_refused(ensemble_run, same_seed_run, tmp_path):
  """A sealed member of another run (here: the same settings trained again, the same networks) put in a member's
  place would be served as this ensemble's: assets/ensemble.json records each member's run and step."""
  import shutil

  import sparsejax
  from sparsejax.workdir import seals

  workdir, final = ensemble_run
  recorded = json.load(open(os.path.join(workdir, "assets", "ensemble.json")))["members"]
  member = sparsejax.load(workdir).members[0]
  assert recorded == [{"directory": "members/1", "run_id": member.run_id, "step": member.step}]
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy)
  shutil.rmtree(os.path.join(copy, "members", "1"))
  shutil.copytree(os.path.join(same_seed_run[0], "members", "1"), os.path.join(copy, "members", "1"))
  with pytest.raises(seals.IntegrityError, match=r"members/1: not the member that .*ensemble.json records: run "):
    sparsejax.load(copy)


def test_a_member_directory_that_links_out_or_nests_an_ensemble_is_refused(ensemble_run, tmp_path):
  import shutil

  import sparsejax
  from sparsejax.workdir import seals

  workdir, _ = ensemble_run
  copy = str(tmp_path / "copy")
  shutil.copytree(workdir, copy, symlinks=True)
  member = os.path.join(copy, "members", "1")
  shutil.copy(os.path.join(copy, "assets", "ensemble.json"), os.path.join(member, "assets", "ensemble.json"))
  with pytest.raises(seals.IntegrityError, match="an ensemble member that is an ensemble itself"):
    sparsejax.load(copy)
  shutil.rmtree(member)
  os.symlink(copy, member)  # a loop back to the run itself
  with pytest.raises(seals.IntegrityError, match="is not a directory of this work directory's members/"):
    sparsejax.load(copy)


def test_each_model_keeps_its_own_compiled_functions_and_is_freed_when_dropped(ensemble_run):
  """A cache shared by all models (8 entries) had an ensemble of 4 or more members recompile at every call, the
  members evicting each other's functions; and it kept every model it had served alive."""
  import gc
  import weakref

  import sparsejax

  workdir, _ = ensemble_run
  model = sparsejax.load(workdir)
  member = model.members[0]
  kept = member._network_fn(5)
  for top in range(1, 10):  # more functions than a cache of 8 holds, all the first network's
    model._network_fn(top)
  assert member._network_fn(5) is kept
  dropped = weakref.ref(model)
  del model
  gc.collect()
  assert dropped() is None


def test_a_run_whose_members_were_all_left_out_is_not_tried_again(tmp_path, monkeypatch):
  """A rerun of a finished run that formed no ensemble loaded the data and trained members again, its budget
  counted afresh (a member the clock had stopped would train on)."""
  from sparsejax.train import members, plan, train_and_evaluate

  tried = []
  monkeypatch.setattr(members, "train", lambda *args: tried.append(args[2]) or {})  # every member left out
  workdir = str(tmp_path / "run")
  final = train_and_evaluate(_config(), workdir)
  assert final["stopped_by"] == "early_stopping" and final["ensemble_members"] == 1 and tried == [workdir]
  monkeypatch.setattr(plan, "load_data", lambda config: pytest.fail("a finished run loaded its data"))
  assert train_and_evaluate(_config(), workdir) == final
  assert tried == [workdir] and os.path.exists(os.path.join(workdir, "assets", "checksums.json"))
  assert "member0_p@1" not in final and not os.path.exists(os.path.join(workdir, "assets", "ensemble.json"))


def test_a_run_started_afresh_removes_a_former_runs_members(tmp_path):
  """A member directory left by an earlier run of the work directory was resumed (a finished one taken as it was)
  and served with the new run's first network."""
  from sparsejax.settings import override
  from sparsejax.train import train_and_evaluate

  workdir = tmp_path / "run"
  former = workdir / "members" / "1"
  former.mkdir(parents=True)
  (former / "config.json").write_text("{}")
  outside = tmp_path / "outside"
  outside.mkdir()
  train_and_evaluate(override(_config(ensemble_members=1), max_seconds=None, max_steps=40), str(workdir))
  assert not (workdir / "members").exists()
  # Resumed, the run keeps what it has; a link in the members' place is removed, never followed.
  (workdir / "members").symlink_to(outside)
  train_and_evaluate(override(_config(ensemble_members=1), max_seconds=None, max_steps=60), str(workdir))
  assert (workdir / "members").is_symlink() and outside.exists()
