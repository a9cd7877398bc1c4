"""Training-step throughput against labels per sample (issue 48, item 2): does a multi-label step cost its batch's
label count, or the dataset's longest row?

At fixed sizes (default: 44,000 samples, 18,000 features, 22,873 labels, mean 12 non-zero features, B 128, the
default sampled SLIDE model) it times the jitted training step, state donated, over the batches a
``BatchIterator`` gives, for each label distribution:

- ``1``, ``5``, ``30``: exactly that many labels per sample;
- ``heavy``: a heavy tail as on a real multi-label set (5.3 labels mean, 310 longest): ``round(4 e^(0.8 z))``
  labels per sample, z standard normal (mean about 5.5, 99.9th percentile about 47), and one row of 300 labels;
- ``zipf``: a heavier tail, ``min(300, Zipf(1.9))`` labels per sample (mean about 5.8, 0.4% of the rows past 256:
  about every second batch holds one), one row of 300.

Each distribution runs two ways: ``fixed`` (the former behaviour: every batch padded to the dataset's longest rows,
the sampled step's targets from label_targets' ``[B, k, M]`` comparison) and ``bucketed`` (today's: each batch padded
to its own widths rounded up to a power of two, targets from the labels-first active set). Per run:
``samples_per_sec`` (steady state, every width compiled beforehand), the batches' label and feature widths, the
programs compiled (one per distinct pair of widths) and their compile seconds. The acceptance: heavy-tailed
bucketed samples/s >= 0.5x single-label.

  nice -n 5 python benchmarks/label_width.py --json benchmarks/results/label_width.json
  python benchmarks/label_width.py --samples 4000 --steps 20 --labels 1,heavy   # quick
"""

import contextlib
import os
import time

import jax
import numpy as np

from sparsejax import model
from sparsejax.config import Config
from sparsejax.data import BatchIterator, XCDataset, make_synthetic
from sparsejax.distributed import sharding
from sparsejax.loss import label_targets
from sparsejax.model_config import ModelConfig
from sparsejax.settings import override

import harness

LONG_ROW = 300


def heavy_tailed(ds: XCDataset, tail: str = "heavy", seed: int = 0, long_row: int = LONG_ROW) -> XCDataset:
  """``ds`` with ``tail``'s labels per sample (see the module docstring; its own label first, the others drawn
  uniformly) and row 0 of ``long_row`` labels."""
  rng = np.random.default_rng(seed)
  if tail == "heavy":
    counts = np.clip(np.round(4 * np.exp(0.8 * rng.standard_normal(len(ds)))), 1, long_row).astype(np.int64)
  else:
    counts = np.minimum(rng.zipf(1.9, len(ds)), long_row)
  counts[0] = long_row
  ptr = np.zeros(len(ds) + 1, np.int64)
  np.cumsum(counts, out=ptr[1:])
  labels = rng.integers(0, ds.num_labels, ptr[-1]).astype(np.int32)
  labels[ptr[:-1]] = ds.label_indices[ds.label_indptr[:-1]]  # the planted (learnable) label first
  labels[ptr[0]:ptr[1]] = rng.choice(ds.num_labels, long_row, replace=False)
  # Distinct labels per row: a repeat is moved to another id (rows of the tail repeat rarely; the loss counts
  # distinct ids anyway).
  for i in np.flatnonzero(counts > 1):
    row = labels[ptr[i]:ptr[i + 1]]
    uniq = np.unique(row)
    if len(uniq) < len(row):
      extra = np.setdiff1d(rng.choice(ds.num_labels, 2 * len(row), replace=False), uniq)[:len(row) - len(uniq)]
      labels[ptr[i]:ptr[i + 1]] = np.concatenate([[row[0]], np.setdiff1d(uniq, [row[0]]), extra])
  return XCDataset(ds.indptr, ds.indices, ds.values, ptr, labels, ds.num_features, ds.num_labels)


def dataset(args, labels: str) -> XCDataset:
  per_sample = 1 if labels in ("heavy", "zipf") else int(labels)
  ds = make_synthetic(args.samples, args.features, args.num_labels, labels_per_sample=per_sample,
                      features_per_sample=args.features_per_sample, seed=0)
  return heavy_tailed(ds, labels) if labels in ("heavy", "zipf") else ds


class Runner:
  """One run (a label distribution at ``widths``): its batches, its state, every width compiled at construction."""

  def __init__(self, args, ds: XCDataset, widths: str):
    config = override(Config(), batch_size=args.batch_size)
    mcfg = ModelConfig.from_config(config, ds.num_features, ds.num_labels)
    mf, ml = max(ds.max_features_per_sample(), 1), max(ds.max_labels_per_sample(), 1)
    it = BatchIterator(ds, args.batch_size, seed=0, max_features=mf, max_labels=ml, widths=widths, prefetch=0)
    self.batches = [next(it) for _ in range(args.steps)]
    it.close()
    if ml > 1 and not any(b["labels"].shape[1] == ml for b in self.batches):  # the longest row's batch, if not drawn
      it = BatchIterator(ds, args.batch_size, seed=0, max_features=mf, max_labels=ml, widths=widths, prefetch=0)
      self.batches[-1] = next(b for b in it if b["labels"].shape[1] == ml)
      it.close()
    self.widths, self.former_targets = widths, widths == "fixed"
    with self.targets():
      self.run = sharding.make_run(mcfg, seed=0)
      self.state = self.run.init()
      self.shapes = {}
      for b in self.batches:
        self.shapes.setdefault((b["feat_ids"].shape[1], b["labels"].shape[1]), b)
      t0 = time.perf_counter()
      for b in self.shapes.values():  # compile every width first
        self.state, m = self.run.step(self.state, b)
      jax.block_until_ready(self.state)
      self.compile_s = time.perf_counter() - t0
    self.seconds = []

  @contextlib.contextmanager
  def targets(self):
    """The step's targets as this run computes them: ``fixed`` runs the former step (label_targets' comparison).
    Patched at trace time only, so the compiled programs keep what they were traced with."""
    original = model.leading_label_targets
    if self.former_targets:
      model.leading_label_targets = label_targets
    try:
      yield
    finally:
      model.leading_label_targets = original

  def time_window(self) -> None:
    """Times one pass over the batches (every width already compiled)."""
    t0 = time.perf_counter()
    for b in self.batches:
      self.state, m = self.run.step(self.state, b)
    jax.block_until_ready((self.state, m))
    self.seconds.append(time.perf_counter() - t0)
    self.loss = float(m["loss"])

  def result(self, batch_size: int) -> dict:
    seconds = min(self.seconds)  # the quietest window of a shared machine
    label_widths = [b["labels"].shape[1] for b in self.batches]
    return {"widths": self.widths, "samples_per_sec": batch_size * len(self.batches) / seconds,
            "samples_per_sec_median": batch_size * len(self.batches) / float(np.median(self.seconds)),
            "step_ms": 1e3 * seconds / len(self.batches), "label_width_mean": float(np.mean(label_widths)),
            "label_widths": sorted(set(label_widths)), "feature_widths": sorted({w for w, _ in self.shapes}),
            "programs": len(self.shapes), "compile_s": self.compile_s, "loss_last": self.loss}


def main():
  p = harness.parser(__doc__)
  p.add_argument("--samples", type=int, default=44_000)
  p.add_argument("--features", type=int, default=18_000)
  p.add_argument("--num_labels", type=int, default=22_873)
  p.add_argument("--features_per_sample", type=float, default=12)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--steps", type=int, default=100, help="steps per timed window")
  p.add_argument("--repeats", type=int, default=5, help="timed windows per run, round-robin over the runs; the "
                 "fastest counts (a shared machine's noise)")
  p.add_argument("--labels", default="1,5,30,heavy,zipf", help="label distributions (see above), comma-separated")
  p.add_argument("--widths", default="fixed,bucketed", help="fixed, bucketed or both")
  harness.add_json_flag(p)
  args = p.parse_args()
  result = {"args": vars(args), "runs": []}
  runners = []
  for labels in args.labels.split(","):
    ds = dataset(args, labels)
    counts = ds.label_counts()
    for widths in args.widths.split(","):
      info = {"labels": labels, "labels_mean": float(counts.mean()), "labels_max": int(counts.max())}
      runners.append((info, Runner(args, ds, widths)))
  # Round-robin windows: on a shared machine every run sees the same spread of load, and the fastest counts.
  for _ in range(args.repeats):
    for _, runner in runners:
      runner.time_window()
  for info, runner in runners:
    r = {**info, **runner.result(args.batch_size)}
    result["runs"].append(r)
    print(f"labels {r['labels']:>5} (mean {r['labels_mean']:.1f}, max {r['labels_max']}) {r['widths']:>8}: "
          f"{r['samples_per_sec']:8.0f} samples/s, {r['step_ms']:.2f} ms/step, label widths {r['label_widths']}, "
          f"{r['programs']} programs ({r['compile_s']:.1f} s)", flush=True)
  single = {r["widths"]: r["samples_per_sec"] for r in result["runs"] if r["labels"] == "1"}
  for r in result["runs"]:
    if r["widths"] in single:
      r["vs_single_label"] = r["samples_per_sec"] / single[r["widths"]]
  heavy = [r for r in result["runs"] if r["labels"] == "heavy" and r["widths"] == "bucketed"]
  if heavy and "bucketed" in single:
    result["heavy_over_single"] = heavy[0]["vs_single_label"]
    print(f"heavy-tailed / single-label (bucketed): {result['heavy_over_single']:.2f}x (acceptance >= 0.5x)")
  result["load_average"] = os.getloadavg()  # (1, 5, 15 minutes) at the end: how shared the machine was
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
