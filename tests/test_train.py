"""train_and_evaluate: logging, bit-identical resume, crash safety, data errors."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from sparsejax import data
from sparsejax.config import Config, override
from sparsejax.train import train_and_evaluate

SMALL = override(
    Config(), dataset="synthetic", synthetic_samples=3000, synthetic_features=1000, synthetic_labels=200,
    hidden_dims=(32,), active_k=32, num_tables=8, batch_size=64, max_steps=40,
    eval_every=20, eval_samples=300, log_every=10, checkpoint_every=15, rebuild_period=7,
    rebuild_growth=1.3, rehash_period=25, reinsert="labels", progress=False, learning_rate=3e-3, candidates="lsh",
    validation_fraction=0.0)


def _restore_latest(workdir):
  import orbax.checkpoint as ocp
  path = os.path.join(workdir, "checkpoints")
  manager = ocp.CheckpointManager(path)
  step = manager.latest_step()
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                           data=ocp.args.JsonRestore()))
  return step, restored["state"], restored["data"]


def test_metrics_jsonl_and_final_result(tmp_path):
  final = train_and_evaluate(SMALL, str(tmp_path))
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [l["step"] for l in lines] == [20, 40, 40]
  for l in lines:
    for key in ("step", "loss", "p@1", "p@5", "samples_per_sec", "psp@5", "sampled_p@1"):
      assert key in l and np.isfinite(l[key]), key
  assert lines[-1]["final"] and final["step"] == 40
  assert Config.from_dict(json.load(open(tmp_path / "config.json"))) == SMALL


def test_resume_is_bit_identical(tmp_path):
  straight, split = tmp_path / "straight", tmp_path / "split"
  train_and_evaluate(SMALL, str(straight))
  # Stop at 22 (between checkpoints, after a rebuild, a rehash is pending), then resume.
  train_and_evaluate(override(SMALL, max_steps=22), str(split))
  train_and_evaluate(SMALL, str(split))
  step_a, state_a, data_a = _restore_latest(str(straight))
  step_b, state_b, data_b = _restore_latest(str(split))
  assert step_a == step_b == 40 and data_a == data_b
  leaves_a, leaves_b = jax.tree.leaves(state_a), jax.tree.leaves(state_b)
  assert len(leaves_a) == len(leaves_b) > 20
  for a, b in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_killed_during_saves_keeps_last_good_checkpoint(tmp_path):
  """SIGKILL while checkpoints are being written; the next run resumes cleanly."""
  config = override(SMALL, synthetic_labels=20000, hidden_dims=(64,), max_steps=100000,
                               checkpoint_every=1, eval_every=10**9, keep_checkpoints=3)
  script = textwrap.dedent(f"""
      from sparsejax.config import Config
      from sparsejax.train import train_and_evaluate
      train_and_evaluate(Config.from_dict({config.to_dict()!r}), {str(tmp_path)!r})
  """)
  proc = subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  ckpt = tmp_path / "checkpoints"
  deadline = time.time() + 120
  while time.time() < deadline:
    steps = [d for d in os.listdir(ckpt) if d.isdigit()] if ckpt.exists() else []
    if len(steps) >= 3:
      break
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    time.sleep(0.2)
  time.sleep(0.37)  # land somewhere inside a save
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  step, state, _ = _restore_latest(str(tmp_path))
  assert step >= 2 and int(state["step"]) == step
  final = train_and_evaluate(override(config, max_steps=step + 3), str(tmp_path))
  assert final["step"] == step + 3


def test_malformed_data_file_error_names_the_line(tmp_path):
  good = data.make_synthetic(50, 30, 10, seed=0)
  data.save_xc_file(good, tmp_path / "train.txt")
  lines = open(tmp_path / "train.txt").read().splitlines()
  lines[7] = "3 1:0.5 x:1"
  (tmp_path / "test.txt").write_text("\n".join(lines) + "\n")
  config = override(SMALL, dataset="files", train_file=str(tmp_path / "train.txt"),
                    test_file=str(tmp_path / "test.txt"))
  with pytest.raises(data.XCFormatError, match=r"test\.txt:8: malformed feature id 'x'"):
    train_and_evaluate(config, str(tmp_path / "wd"))


def test_dense_model_and_budget(tmp_path):
  config = override(SMALL, model="dense", max_steps=None, max_seconds=3.0, eval_every=10**9)
  final = train_and_evaluate(config, str(tmp_path))
  assert 0 < final["step"] and final["train_seconds"] < 30
  assert "sampled_p@1" not in final and 0 <= final["p@1"] <= 1


def test_validation_selects_the_best_checkpoint_and_stops_early(tmp_path):
  config = override(SMALL, candidates="clusters", reinsert="none", validation_fraction=0.2, max_steps=400,
                    eval_every=10, early_stopping_patience=2, learning_rate=3e-2, checkpoint_every=1000)
  final = train_and_evaluate(config, str(tmp_path))
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  periodic, last = lines[:-1], lines[-1]
  assert all(l["split"] == "validation" for l in periodic) and last["final"]
  values = [l["p@1"] for l in periodic]
  best = int(np.argmax(values))  # the first of equal values: later ties are no improvement
  stopped = final["last_step"] < 400
  if stopped:  # stopped after `patience` evaluations without a better value
    assert len(values) - 1 - best == 2 and final["last_step"] == periodic[-1]["step"]
  else:
    assert final["last_step"] == 400
  assert final["selected_step"] == final["step"] == periodic[best]["step"]
  assert final["validation_p@1"] == pytest.approx(values[best])
  # The reported test metrics are those of the restored best state, not of the last one.
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(str(tmp_path / "best_checkpoint"))
  assert manager.all_steps() == [final["selected_step"]]
  state = manager.restore(final["selected_step"], args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  from sparsejax import inference, metrics, model
  loaded = data.load_dataset(config.data, seed=config.run.seed)
  fi, fv, lab = loaded.test.to_padded(None, None)
  best = model.NetworkParams(model.SparseLayer(state["embed"]["w"], state["embed"]["b"]),
                             tuple(tuple(layer) for layer in state["hidden"]),
                             model.SparseLayer(state["out"]["w"], state["out"]["b"]))
  top = np.asarray(inference.predict_exact(best, fi, fv, top=1)[1])
  assert final["p@1"] == pytest.approx(metrics.evaluate_topk(top, lab, ks=(1,))["p@1"], abs=1e-9)
  _, last_state, _ = _restore_latest(str(tmp_path))
  assert int(last_state["step"]) == final["last_step"]
