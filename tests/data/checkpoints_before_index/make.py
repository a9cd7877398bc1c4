"""Writes tests/data/checkpoints_before_index/{clusters,lsh}: work directories of tiny runs written by sparsejax
at main 32051d6 (before SlideState's `lsh` and `tables` fields became one `index`), with expected.json: what
sparsejax.load predicts from them, and what a run resumed from them to step 10 predicts. Run with that
sparsejax: python make.py OUTDIR (the test reads each run's settings from its config.json)."""
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import scipy.sparse as sp

import sparsejax
from sparsejax.config import Config
from sparsejax.settings import override
from sparsejax.train import driver


def settings(kind, max_steps):
  return override(Config(), dataset="synthetic", synthetic_samples=300, synthetic_features=40, synthetic_labels=30,
                  hidden_dims=(8,), active_k=8, num_tables=2, num_bits=3, batch_size=16, max_steps=max_steps,
                  eval_every=6, eval_samples=60, checkpoint_every=3, rebuild_period=4, progress=False,
                  softmax="sampled", candidates=kind, num_clusters=3, eval_num_clusters=4, validation_fraction=0.0,
                  seed=5)

def predictions(workdir, inputs):
  m = sparsejax.load(workdir)
  s, i = m.predict(inputs, top=3)
  ss, si = m.predict(inputs, top=3, k=8)
  return {"step": int(m.step), "exact_scores": np.asarray(s).tolist(), "exact_ids": np.asarray(i).tolist(),
          "sampled_scores": np.asarray(ss).tolist(), "sampled_ids": np.asarray(si).tolist()}

def main(out):
  for kind in ("clusters", "lsh"):
    d = os.path.join(out, kind)
    shutil.rmtree(d, ignore_errors=True)
    driver.train_and_evaluate(settings(kind, 6), d)
    inputs = sp.random(5, 40, density=0.2, format="csr", random_state=1, dtype=np.float32)
    expected = {"at_step_6": predictions(d, inputs)}
    with tempfile.TemporaryDirectory() as t:
      resumed = os.path.join(t, "run")
      shutil.copytree(d, resumed)
      driver.train_and_evaluate(settings(kind, 10), resumed)
      expected["resumed_to_10"] = predictions(resumed, inputs)
    with open(os.path.join(out, f"expected_{kind}.json"), "w") as f:
      json.dump(expected, f, indent=0)


if __name__ == "__main__":
  main(sys.argv[1])
