"""Checkpoints written before the candidate index became one protocol (one ``index`` field of the state, issue 32)
still restore: ``sparsejax.load`` predicts from them, and a run resumes from them, as the code that wrote them
did (``tests/data/checkpoints_before_index``, written at main 32051d6 by its ``make.py``)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import scipy.sparse as sp

import sparsejax
from sparsejax.config import Config
from sparsejax.settings import override
from sparsejax.train import driver
from sparsejax.workdir.checkpoint import Checkpoints

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoints_before_index")
INPUTS = sp.random(5, 40, density=0.2, format="csr", random_state=1, dtype=np.float32)  # as make.py drew them


def _expected(kind: str) -> dict:
  with open(os.path.join(FIXTURE, f"expected_{kind}.json")) as f:
    return json.load(f)


def _assert_predicts(workdir: str, want: dict, kind: str) -> None:
  model = sparsejax.load(workdir)
  assert model.step == want["step"]
  for name, k in (("exact", None), ("sampled", 8)):
    scores, ids = model.predict(INPUTS, top=3, k=k)
    if name == "sampled" and kind == "lsh":
      # Sampled inference builds LSH tables of their own sizes from the rows (issue 32), not the training tables
      # of the code that wrote the checkpoint: its picks differ from then, but each score is that label's exact
      # logit, and every label of the exact top 3 that it found is ranked as exact scoring ranks it.
      all_scores, all_ids = model.predict(INPUTS, top=model.num_labels)
      exact = np.zeros((INPUTS.shape[0], model.num_labels), np.float32)
      np.put_along_axis(exact, np.asarray(all_ids), np.asarray(all_scores, np.float32), axis=1)
      np.testing.assert_allclose(np.asarray(scores, np.float32), np.take_along_axis(exact, np.asarray(ids), 1),
                                 rtol=1e-5, atol=1e-6)
      assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)
      continue
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want[f"{name}_ids"]), err_msg=name)
    # Within a float32 ulp or so: another XLA, or the same XLA on another CPU, fuses and sums in another order
    # (JAX 0.12: one ulp apart on 5 of 15 scores; JAX 0.10.2 on an AMD EPYC without AVX-512, where the fixture's
    # machine had it: the same 5, 1.1e-7 relative). A changed prediction moves far more than that.
    np.testing.assert_allclose(np.asarray(scores, np.float32), np.asarray(want[f"{name}_scores"], np.float32),
                               rtol=1e-6, atol=0, err_msg=name)


@pytest.mark.parametrize("kind", ["clusters", "lsh"])
def test_old_checkpoint_loads_and_predicts_as_before(kind, tmp_path):
  workdir = shutil.copytree(os.path.join(FIXTURE, kind), tmp_path / "run")
  saved = Checkpoints(str(workdir), writable=False).restore_arrays(6)
  assert "index" not in saved and "tables" in saved  # the earlier layout
  _assert_predicts(str(workdir), _expected(kind)["at_step_6"], kind)


@pytest.mark.parametrize("kind", ["clusters", "lsh"])
def test_run_resumes_from_old_checkpoint_as_before(kind, tmp_path):
  workdir = shutil.copytree(os.path.join(FIXTURE, kind), tmp_path / "run")
  with open(workdir / "config.json") as f:
    config = override(Config.from_dict(json.load(f)), max_steps=10)
  assert config.tables.candidates == kind
  driver.train_and_evaluate(config, str(workdir))
  assert Checkpoints(str(workdir), writable=False).latest_step() == 10
  assert "index" in Checkpoints(str(workdir), writable=False).restore_arrays(10)  # saved anew
  _assert_predicts(str(workdir), _expected(kind)["resumed_to_10"], kind)


def test_a_state_restored_without_its_average_leaves_the_field_out_of_the_target():
  """A selected state (restored without optimizer states or average, ``model_selection.without_optimizer``) from a
  checkpoint written before parameter averaging: orbax refuses a target with a field that the checkpoint lacks, even
  a None one, so the target leaves ``average`` out and the state gets it back as None (restoring the 10^6-label
  run's selected state failed with "tree structures do not match: average")."""
  from sparsejax.model import SlideState
  from sparsejax.workdir import saved_state

  state = SlideState(step=1, rng=None, embed=2, hidden=(), out=3, embed_opt=None, out_w_opt=None, out_b_opt=None,
                     dense_opt=None, index=None, average=None)
  saved = set(SlideState._fields) - {"average"}
  target, as_state = saved_state.in_saved_layout(state, saved)
  assert isinstance(target, dict) and "average" not in target and target["out"] == 3
  restored = as_state(target)
  assert isinstance(restored, SlideState) and restored.average is None and restored.out == 3


def test_a_checkpoint_is_restored_in_stages_of_bounded_bytes(tmp_path, monkeypatch):
  """Restoring reads at most RESTORE_STAGE_BYTES of arrays per orbax call (a larger array alone), the others left
  as placeholders: the 10^9-parameter run restored in one call peaked 2-3 GB over its state per process and a rank
  was killed without swap. The stages give back the saved arrays exactly, the data position with them."""
  import jax.numpy as jnp
  import orbax.checkpoint as ocp

  from sparsejax.workdir import saved_state

  rng = np.random.default_rng(0)
  state = {"big": jnp.asarray(rng.normal(size=(300, 4)), jnp.float32),  # 4,800 bytes: alone
           "pair": {"a": jnp.arange(200, dtype=jnp.int32), "b": jnp.asarray(rng.normal(size=100), jnp.float32)},
           "small": jnp.arange(5, dtype=jnp.float32)}
  checkpoints = Checkpoints(str(tmp_path))
  checkpoints.save(7, state, {"epoch": 3, "index": 11}, {}, wait=True)
  calls = []
  manager_restore = checkpoints._manager.restore

  def restore(step, args):
    read = [leaf for leaf in jax.tree.leaves(args["state"].item) if leaf is not ocp.PLACEHOLDER]
    calls.append(sum(saved_state.local_bytes(leaf) for leaf in read))
    return manager_restore(step, args=args)

  monkeypatch.setattr(checkpoints._manager, "restore", restore)
  monkeypatch.setattr(saved_state, "RESTORE_STAGE_BYTES", 1000)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored, position = checkpoints.restore(abstract)
  assert calls == [4800, 800, 400 + 20]  # "big" alone; a (800) + b (400) over 1,000: b with "small"
  assert position == {"epoch": 3, "index": 11}
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  monkeypatch.setattr(saved_state, "RESTORE_STAGE_BYTES", 1 << 20)
  calls.clear()
  jax.tree.map(np.testing.assert_array_equal, checkpoints.restore(abstract)[0], state)
  assert calls == [4800 + 800 + 400 + 20]  # everything in one call where it fits


def test_a_restored_state_is_donated_by_the_first_step_without_a_second_copy(tmp_path):
  """A restored array is the process's only copy: the first step that donates it updates it in place (orbax's
  arrays kept their host read buffers beside the step's output until the next step: 2.5 GB more per process after
  the 10^9-parameter run's resume, and a rank was killed). Resident memory counted, a 128 MB array."""
  import jax.numpy as jnp

  from sparsejax import memory

  def resident_mb():
    with open("/proc/self/status") as f:
      return int(f.read().split("VmRSS:")[1].split()[0]) / 1024

  checkpoints = Checkpoints(str(tmp_path))
  checkpoints.save(1, {"w": jnp.ones((250_000, 128), jnp.float32)}, {}, {}, wait=True)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  state, _ = checkpoints.restore({"w": jax.ShapeDtypeStruct((250_000, 128), jnp.float32, sharding=device)})
  step = jax.jit(lambda s: {"w": s["w"].at[0].add(1.0)}, donate_argnums=0)
  memory.release_free_memory()
  before = resident_mb()
  state = jax.block_until_ready(step(state))
  memory.release_free_memory()
  assert resident_mb() - before < 32  # the 122 MB array once, not twice
  assert float(state["w"][0, 0]) == 2.0 and float(state["w"][1, 0]) == 1.0
