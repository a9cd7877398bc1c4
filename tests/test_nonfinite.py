"""NaN and Inf in training (--on_nonfinite): a non-finite step is never applied nor saved; stop names it, skip_step
skips exactly it; single process, dense baseline and two processes (which must agree)."""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import dense, model
from sparsejax.config import Config
from sparsejax.model_config import ModelConfig, uses_exact_path
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate
from sparsejax.train.metric_writer import read_records
from sparsejax.train.nonfinite import NonFiniteError
from sparsejax.workdir.checkpoint import Checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(rng, B=8, F=50, N=40):
  return {"feat_ids": jnp.asarray(rng.integers(0, F, (B, 4)), jnp.int32), "feat_vals": jnp.ones((B, 4)),
          "labels": jnp.asarray(rng.integers(0, N, (B, 1)), jnp.int32)}


def _equal_but_step(a, b):
  same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a._replace(step=0),
                      b._replace(step=0))
  return all(jax.tree.leaves(same))


@pytest.mark.parametrize("kind", ["sampled", "exact", "dense"])
def test_a_nan_step_changes_nothing_but_the_step_counter(kind):
  """SLIDE's sampled step (output rows written in place), its exact step (k near N) and the dense baseline."""
  config = override(ModelConfig(50, 40), hidden_dims=(8,), active_k=8, num_tables=2, candidates="lsh",
                    reinsert="none" if kind == "dense" else "labels", lsh_mips=False,
                    softmax="exact" if kind == "exact" else "sampled")
  assert uses_exact_path(config) == (kind == "exact")
  init, step = ((dense.init, dense.train_step) if kind == "dense" else (model.init, model.train_step))
  step = jax.jit(functools.partial(step, config=config))
  rng = np.random.default_rng(0)
  state, metrics = step(init(jax.random.key(0), config), _batch(rng))
  assert bool(metrics["finite"]) and np.isfinite(float(metrics["loss"]))
  before = jax.tree.map(np.array, state)  # the step donates its input
  poisoned = _batch(rng)
  poisoned["feat_vals"] = poisoned["feat_vals"].at[3, 1].set(jnp.nan)
  after, metrics = step(state, poisoned)
  assert not bool(metrics["finite"]) and np.isnan(float(metrics["loss"]))
  assert int(after.step) == int(before.step) + 1
  assert _equal_but_step(before, after)  # weights, moments, Adam counts, tables: untouched
  after2, metrics = step(after, _batch(rng))  # and training goes on from there
  assert bool(metrics["finite"]) and not _equal_but_step(before, after2)


def _write_xc(path, n, poisoned_sample=None, seed=0):
  rng = np.random.default_rng(seed)
  lines = [f"{n} 50 10"]
  for i in range(n):
    value = "3e38" if i == poisoned_sample else "1.0"  # finite in float32; overflows in the embedding sum
    lines.append(f"{rng.integers(10)} " + " ".join(f"{f}:{value}" for f in sorted(rng.choice(50, 4, replace=False))))
  path.write_text("\n".join(lines) + "\n")


def _poisoned_config(tmp_path, policy, **kw):
  _write_xc(tmp_path / "train.txt", 160, poisoned_sample=37)
  _write_xc(tmp_path / "test.txt", 40, seed=1)
  return override(
      _tiny_config(), dataset="files", train_file=str(tmp_path / "train.txt"),
      test_file=str(tmp_path / "test.txt"), on_nonfinite=policy, **kw)


def _tiny_config():
  return override(Config(), hidden_dims=(8,), active_k=8, batch_size=16, max_steps=10, num_tables=2, progress=False,
                  candidates="lsh", validation_fraction=0.0, log_every=5, checkpoint_every=1, keep_checkpoints=None,
                  eval_every=100)


def _assert_checkpoints_finite(workdir):
  checkpoints = Checkpoints(str(workdir), writable=False)
  steps = checkpoints._manager.all_steps()
  assert steps
  for step in steps:
    state = checkpoints.restore_arrays(step)
    for leaf in jax.tree.leaves(state):
      if np.issubdtype(np.asarray(leaf).dtype, np.floating):
        assert np.isfinite(leaf).all(), step
  return steps


def test_a_poisoned_sample_stops_the_run_naming_its_step_or_is_skipped(tmp_path):
  """The same poisoned sample (a feature value of 3e38): skip_step skips one step; stop names that step."""
  skip = tmp_path / "skip"
  final = train_and_evaluate(_poisoned_config(tmp_path, "skip_step"), str(skip))
  records = [r for r in read_records(str(skip)) if not r.get("final")]
  assert records[-1]["skipped_steps"] == 1 and np.isfinite(final["last_loss"]) and final["last_step"] == 10
  steps = _assert_checkpoints_finite(skip)
  assert max(steps) == 10

  stop = tmp_path / "stop"
  with pytest.raises(NonFiniteError) as error:
    train_and_evaluate(_poisoned_config(tmp_path, "stop"), str(stop))
  bad = error.value.step
  assert 1 <= bad <= 10 and str(error.value).startswith(f"step {bad}: the loss or an update is NaN or Inf")
  if bad > 1:  # the step skip_step skipped: its checkpoint equals the one before it, but for the counter
    skipped = Checkpoints(str(skip), writable=False)
    before, after = skipped.restore_arrays(bad - 1), skipped.restore_arrays(bad)
    assert after.pop("step") == before.pop("step") + 1
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))
  steps = _assert_checkpoints_finite(stop) if bad > 1 else []
  assert max(steps, default=0) == bad - 1  # every step before it was saved (checkpoint_every=1); it was not
  assert (f"The newest checkpoint, {stop}/checkpoints/{bad - 1}, is finite" in str(error.value)) == (bad > 1)


def test_a_diverging_dense_run_exits_1_naming_the_step(tmp_path, installed_command):
  """A huge learning rate: step 1 is finite (weights ~1e30), step 2 overflows. The CLI exits 1 in one line."""
  workdir = tmp_path / "run"
  out = subprocess.run(
      [installed_command("sparsejax-train"), "--dataset=synthetic", "--synthetic_samples=300",
       "--synthetic_features=50", "--synthetic_labels=40", "--hidden_dims=8", "--batch_size=16", "--max_steps=6",
       "--model=dense", "--progress=false", "--validation_fraction=0", "--learning_rate=1e30",
       "--checkpoint_every=1", "--log_every=3", f"--workdir={workdir}"],
      capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 1, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("sparsejax-train: error: step 2: the loss or an update is NaN or Inf"), last
  assert f"{workdir}/checkpoints/1, is finite" in last
  assert _assert_checkpoints_finite(workdir) == [1]


def test_two_processes_skip_the_same_poisoned_step(tmp_path):
  """Every process decides alike: the replicas stay identical (checksummed every step) and the run finishes."""
  _write_xc(tmp_path / "train.txt", 160, poisoned_sample=37)
  _write_xc(tmp_path / "test.txt", 40, seed=1)
  workdir = tmp_path / "run"
  args = [f"--train_file={tmp_path / 'train.txt'}", f"--test_file={tmp_path / 'test.txt'}", "--dataset=files",
          "--hidden_dims=8", "--active_k=16", "--batch_size=16", "--max_steps=10", "--num_tables=2",
          "--progress=false", "--candidates=lsh", "--validation_fraction=0", "--log_every=5",
          "--checkpoint_every=5", "--eval_every=100", "--checksum_every=1", "--on_nonfinite=skip_step",
          f"--workdir={workdir}"]
  proc = subprocess.run([sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", "2",
                         os.path.join(ROOT, "examples", "train.py"), *args],
                        capture_output=True, text=True, timeout=400, cwd=ROOT)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  log = proc.stdout + proc.stderr
  assert "over 2 processes" in log
  skipped = [re.findall(r"step (\d+): NaN or Inf loss or update, skipped", text)
             for text in (log, (workdir / "logs" / "rank1.log").read_text())]
  assert len(skipped[0]) == 1 and skipped[0] == skipped[1], log[-4000:]  # each rank skipped the same one step
  records = [r for r in map(json.loads, open(workdir / "metrics.jsonl")) if not r.get("final")]
  assert records[-1]["skipped_steps"] == 1
  assert _assert_checkpoints_finite(workdir) == [5, 10]
