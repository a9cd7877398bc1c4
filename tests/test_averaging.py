"""Parameter averaging (sparsejax.averaging): the moving average against a numpy reference, and a run that evaluates,
saves and serves it."""

import numpy as np
import pytest

import sparsejax
from sparsejax import averaging
from sparsejax.network import NetworkParams, SparseLayer
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate
from sparsejax.train.metric_writer import read_records
from sparsejax.workdir.checkpoint import Checkpoints


def _params(rng, scale=1.0):
  return NetworkParams(SparseLayer(rng.normal(size=(7, 3)).astype(np.float32) * scale, rng.normal(size=3).astype(
      np.float32)), ((rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2).astype(np.float32)),),
                       SparseLayer(rng.normal(size=(5, 2)).astype(np.float32), rng.normal(size=5).astype(np.float32)))


def _reference(snapshots, average_steps):
  """The moving average of ``[(step, params)]`` from its definition: snapshot j weighs ``(1 - d_j)`` times the
  decays ``d_i = exp(-(s_i - s_(i-1)) / min(max(s_i / 4, 1), average_steps))`` of every later snapshot i."""
  decays = [np.exp(-(s - prev) / min(max(s / 4, 1), average_steps))
            for prev, s in zip([0] + [s for s, _ in snapshots[:-1]], [s for s, _ in snapshots])]
  weights = [(1 - d) * np.prod(decays[j + 1:]) for j, d in enumerate(decays)]
  flat = [np.concatenate([np.ravel(x).astype(np.float64) for x in _leaves(p)]) for _, p in snapshots]
  return sum(w * f for w, f in zip(weights, flat)) / sum(weights)


def _leaves(p):
  return [p.embed.w, p.embed.b, *[x for layer in p.hidden for x in layer], p.out.w, p.out.b]


@pytest.mark.parametrize("steps", [[250], [250, 500, 750, 1000, 1300, 4000, 4010], [1, 2, 3, 50]])
def test_the_average_is_the_decayed_weighted_mean_of_its_snapshots(steps):
  rng = np.random.default_rng(0)
  snapshots = [(s, _params(rng)) for s in steps]
  average = averaging.init(_params(rng, scale=100.0))  # a placeholder that must not leak into the mean
  for s, p in snapshots:
    average = averaging.update(average, p, s, 1000)
  got = np.concatenate([np.ravel(np.asarray(x)) for x in _leaves(average.params)])
  np.testing.assert_allclose(got, _reference(snapshots, 1000), rtol=2e-5, atol=2e-6)
  assert int(average.step) == steps[-1]


def test_the_first_snapshot_is_taken_whole_and_a_second_at_the_same_step_changes_nothing():
  rng = np.random.default_rng(1)
  first, other = _params(rng), _params(rng)
  average = averaging.update(averaging.init(_params(rng)), first, 300, 1000)
  for a, b in zip(_leaves(average.params), _leaves(first)):
    np.testing.assert_array_equal(np.asarray(a), b)
  again = averaging.update(average, other, 300, 1000)
  for a, b in zip(_leaves(again.params), _leaves(first)):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert float(again.weight) == float(average.weight)


def _as_params(t):
  """A checkpoint's parameters read back as dicts (``restore_arrays``), as NetworkParams."""
  return NetworkParams(SparseLayer(t["embed"]["w"], t["embed"]["b"]), tuple((w, b) for w, b in t["hidden"]),
                       SparseLayer(t["out"]["w"], t["out"]["b"]))


def _run_config(small_config, **changes):
  return override(small_config, **{**dict(candidates="clusters", reinsert="none", average_steps=12,
                                          checkpoint_every=3, keep_checkpoints=None), **changes})


def test_a_run_evaluates_and_serves_the_average_of_its_snapshots(tmp_path, small_config):
  # No validation split: the last state is evaluated and served, from the newest checkpoint (step 40), as the
  # average of the snapshots every 3 steps (average_steps 12: a quarter) and of step 40's own parameters.
  final = train_and_evaluate(_run_config(small_config), str(tmp_path))
  checkpoints = Checkpoints(str(tmp_path), writable=False)

  raw = lambda step: _as_params(checkpoints.restore_arrays(step))

  snapshots = [(s, raw(s)) for s in range(3, 40, 3)] + [(40, raw(40))]
  served = sparsejax.load(str(tmp_path)).params
  got = np.concatenate([np.ravel(np.asarray(x)) for x in _leaves(served)])
  np.testing.assert_allclose(got, _reference(snapshots, 12), rtol=1e-4, atol=1e-6)
  # ... and it is not the last parameters themselves.
  assert not np.allclose(got, np.concatenate([np.ravel(np.asarray(x)) for x in _leaves(raw(40))]), atol=1e-4)
  assert final["step"] == 40


@pytest.mark.parametrize("network", ["slide", "dense"])  # the dense baseline is evaluated as the sparse model is
def test_the_selected_state_is_the_average_and_is_what_load_serves(tmp_path, small_config, network):
  # A checkpoint at every evaluation (the selected step's is read), not every 3 steps.
  final = train_and_evaluate(_run_config(small_config, validation_fraction=0.2, eval_every=10, checkpoint_every=10,
                                         model=network), str(tmp_path))
  validation = {r["step"]: r["p@1"] for r in read_records(str(tmp_path)) if r.get("split") == "validation"}
  model = sparsejax.load(str(tmp_path))
  assert model.step == final["selected_step"] and final["validation_p@1"] == max(validation.values())
  step = final["selected_step"]
  checkpoints = Checkpoints(str(tmp_path), writable=False)
  t = checkpoints.restore_arrays(step)
  # The best state holds the parameters that evaluation scored: the average with that step's as the newest snapshot.
  expected = averaging.averaged_params(_as_params(t), averaging.ParamAverage(
      _as_params(t["average"]["params"]), t["average"]["weight"], t["average"]["step"]), t["step"], 12)
  np.testing.assert_array_equal(np.asarray(model.params.out.w), np.asarray(expected.out.w))
  assert not np.array_equal(np.asarray(model.params.out.w), np.asarray(t["out"]["w"]))


def test_without_averaging_the_state_keeps_no_average(tmp_path, small_config):
  # Only the last checkpoint is read: none every 3 steps (the snapshots' steps, which an average would need).
  final = train_and_evaluate(_run_config(small_config, average_steps=0, checkpoint_every=1000), str(tmp_path))
  saved = Checkpoints(str(tmp_path), writable=False).restore_arrays(40)
  assert saved.get("average") is None
  # What is served is the last parameters themselves.
  np.testing.assert_array_equal(np.asarray(sparsejax.load(str(tmp_path)).params.out.w), saved["out"]["w"])
  assert final["step"] == 40
