"""Issue 48, item 2: a multi-label step costs its batch's label width, not the dataset's longest row.

Batches are padded to their own bucketed widths (``BatchIterator(widths="bucketed")``) and the sampled step's
targets come from the labels-first active set (``leading_label_targets``) instead of a ``[B, k, M]`` comparison.
The references: the fixed-width (dataset-wide) batches and ``label_targets``' comparison, which the step used
before.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import data, model
from sparsejax.data.batching import batch_widths, bucket_width, bucket_widths
from sparsejax.loss import label_targets, leading_label_targets, num_distinct_labels
from sparsejax.model_config import ModelConfig
from sparsejax.settings import override


def _heavy_tailed(n=300, num_features=200, num_labels=400, long_row=300, long_features=100, seed=0):
  """Synthetic data with 1 + Poisson(1) labels and about 12 features per sample, one sample (row 7) of
  ``long_row`` labels and one (row 11) of ``long_features`` features."""
  ds = data.make_synthetic(n, num_features, num_labels, labels_per_sample=2.0, features_per_sample=12, seed=seed)
  rng = np.random.default_rng(seed)
  rows = [ds.label_indices[a:b] for a, b in zip(ds.label_indptr[:-1], ds.label_indptr[1:])]
  rows[7] = np.sort(rng.choice(num_labels, long_row, replace=False)).astype(np.int32)
  ids = [ds.indices[a:b] for a, b in zip(ds.indptr[:-1], ds.indptr[1:])]
  vals = [ds.values[a:b] for a, b in zip(ds.indptr[:-1], ds.indptr[1:])]
  ids[11] = np.sort(rng.choice(num_features, long_features, replace=False)).astype(np.int32)
  vals[11] = (rng.random(long_features) / np.sqrt(long_features)).astype(np.float32)

  def pointers(parts):
    return np.concatenate([[0], np.cumsum([len(p) for p in parts])])

  return data.XCDataset(pointers(ids), np.concatenate(ids), np.concatenate(vals), pointers(rows),
                        np.concatenate(rows), num_features, num_labels)


def test_bucket_width_is_the_next_power_of_two_between_the_floor_and_the_cap():
  got = {n: bucket_width(n, 310) for n in (0, 1, 5, 31, 32, 33, 64, 65, 129, 200, 256, 257, 300, 310)}
  assert got == {0: 32, 1: 32, 5: 32, 31: 32, 32: 32, 33: 64, 64: 64, 65: 128, 129: 256, 200: 256, 256: 256,
                 257: 310, 300: 310, 310: 310}
  assert bucket_width(1, 1) == 1 and bucket_width(5, 5) == 5 and bucket_width(3, 20) == 20  # below the floor: cap
  assert bucket_width(5, 0) == 0  # a cap of 0 (no labels at all) stays 0
  assert {n: bucket_width(n, 310, floor=1) for n in (0, 1, 2, 3, 5, 9)} == {0: 1, 1: 1, 2: 2, 3: 4, 5: 8, 9: 16}
  # A heavy tail compiles at most 1 + ceil(log2(max / 32)) widths: 5 for a longest row of 310.
  assert len({bucket_width(n, 310) for n in range(311)}) == 1 + math.ceil(math.log2(310 / 32)) == 5
  assert len({bucket_width(n, 1000) for n in range(1001)}) == 6  # 1,000 features: 32, 64, ..., 512, 1000
  for cap in (0, 1, 5, 21, 32, 33, 64, 310, 1000):  # the widths the loop logs are every width there is
    assert bucket_widths(cap) == sorted({bucket_width(n, cap) for n in range(cap + 1)}), cap


def test_bucketed_batches_are_the_fixed_ones_cut_to_their_own_widths():
  ds = _heavy_tailed()
  mf, ml = ds.max_features_per_sample(), ds.max_labels_per_sample()
  kw = dict(seed=3, num_epochs=2, prefetch=0, max_features=mf, max_labels=ml)
  fixed = list(data.BatchIterator(ds, 32, widths="fixed", **kw))
  bucketed = list(data.BatchIterator(ds, 32, **kw))
  assert len(fixed) == len(bucketed) == 2 * (len(ds) // 32)
  widths = set()
  for epoch in range(2):
    perm = data.epoch_permutation(len(ds), 3, epoch)
    for i in range(len(ds) // 32):
      f, b = fixed[epoch * (len(ds) // 32) + i], bucketed[epoch * (len(ds) // 32) + i]
      rows = perm[32 * i: 32 * (i + 1)]
      longest = max(len(ds.label_indices[ds.label_indptr[r]:ds.label_indptr[r + 1]]) for r in rows)
      wf, wl = b["feat_ids"].shape[1], b["labels"].shape[1]
      assert (wf, wl) == batch_widths(ds, rows, mf, ml)
      assert wl == (ml if longest > 256 else max(32, 2 ** math.ceil(math.log2(max(longest, 1)))))
      widths.add(wl)
      for key, pad in (("feat_ids", -1), ("feat_vals", 0), ("labels", -1)):
        w = b[key].shape[1]
        np.testing.assert_array_equal(b[key], f[key][:, :w])
        assert np.all(f[key][:, w:] == pad)  # nothing is cut: the rest of the fixed batch is padding
  assert widths == {32, ml}  # the long row's batches at 300, the others (1 + Poisson(1) labels) at the floor


def test_bucketed_iterator_resumes_exactly_with_its_widths():
  ds = _heavy_tailed()
  kw = dict(seed=1, num_epochs=3, prefetch=2)
  whole = list(data.BatchIterator(ds, 16, **kw))
  it = data.BatchIterator(ds, 16, **kw)
  head = [next(it) for _ in range(23)]  # into the second epoch
  state = it.state()
  it.close()
  rest = list(data.BatchIterator.from_state(ds, 16, state, **kw))
  assert len(head) + len(rest) == len(whole)
  for a, b in zip(head + rest, whole):
    for key in a:
      assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype
      np.testing.assert_array_equal(a[key], b[key])


def test_widths_are_checked():
  with pytest.raises(ValueError, match="widths"):
    data.BatchIterator(_heavy_tailed(n=40), 8, widths="ragged")


def _config(candidates):
  extra = dict(candidates="lsh", lsh_mips=False) if candidates == "lsh" else {}
  return override(ModelConfig(200, 400), hidden_dims=(16,), active_k=320, learning_rate=1e-2,
                  softmax="sampled", **extra)


@pytest.mark.parametrize("candidates", ["clusters", "lsh"])
def test_leading_label_targets_equal_the_comparison_on_real_queries(candidates):
  """The index puts each sample's distinct labels first (repeated ids, padding, a 300-label row): the targets read
  from the leading slots are label_targets' comparison, float for float."""
  cfg = _config(candidates)
  state = model.init(jax.random.key(0), cfg)
  ds = _heavy_tailed()
  rows = np.arange(40)  # row 7 holds 300 labels
  fi, fv, lab = ds.to_padded(rows, None, None)
  lab[3, :4] = [5, 5, -1, 5]  # a repeated label, padding between
  lab[4] = -1  # an unlabeled sample
  labels = jnp.asarray(lab)
  h = model.hidden(state, jnp.asarray(fi), jnp.asarray(fv))
  active, _ = model.query_active(state, h, config=cfg, k=cfg.network.active_k, num_rows=400, labels=labels, seed=3)
  count = num_distinct_labels(labels)
  want = label_targets(active, labels, count)
  got = leading_label_targets(active, labels, count)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(leading_label_targets(active, labels), label_targets(active, labels))
  assert float(jnp.sum(got[7] > 0)) == 300 and float(got[3, 0]) == 1.0 and not np.any(np.asarray(got[4]))


def _steps(cfg, batches, targets=None):
  """States and losses after stepping a fresh state through ``batches`` (``targets``: the step's target function)."""
  state = model.init(jax.random.key(1), cfg)
  step = jax.jit(functools.partial(model.train_step, config=cfg))
  losses = []
  with pytest.MonkeyPatch.context() as mp:
    if targets is not None:
      mp.setattr(model, "leading_label_targets", targets)
    for batch in batches:
      state, m = step(state, batch)
      losses.append(np.asarray(m["loss"]))
  return state, losses


@pytest.mark.parametrize("candidates", ["clusters", "lsh"])
def test_steps_give_the_same_floats_at_any_width(candidates):
  """Steps on batches of the bucketed widths, and on the same batches padded to the dataset's widths (the longest
  row: 300 labels) with the step's former [B, k, M] targets: the same losses and the same states, bit for bit."""
  cfg = _config(candidates)
  ds = _heavy_tailed()
  mf, ml = ds.max_features_per_sample(), ds.max_labels_per_sample()
  kw = dict(seed=0, num_epochs=1, prefetch=0, max_features=mf, max_labels=ml, drop_remainder=False)
  narrow = list(data.BatchIterator(ds, 32, **kw))  # one epoch: 10 batches, the last one partial
  wide = list(data.BatchIterator(ds, 32, widths="fixed", **kw))
  assert mf == 100 and ml == 300 and all(b["labels"].shape == (32, ml) for b in wide)
  assert {b["feat_ids"].shape[1] for b in narrow} == {32, mf} and {b["labels"].shape[1] for b in narrow} == {32, ml}
  got_state, got_losses = _steps(cfg, narrow)
  want_state, want_losses = _steps(cfg, wide, targets=label_targets)
  np.testing.assert_array_equal(got_losses, want_losses)
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loss_and_gradients_agree_between_width_8_and_310():
  """One batch padded to 8 labels and to 310: the loss and the gradient of the output layer's rows (the change of
  out.w after one step with the Adam state fresh) are the same floats."""
  cfg = _config("clusters")
  ds = _heavy_tailed(long_row=8)
  rows = np.arange(32)
  batches = []
  for width in (8, 310):
    fi, fv, lab = ds.to_padded(rows, 32, width)
    batches.append({"feat_ids": jnp.asarray(fi), "feat_vals": jnp.asarray(fv), "labels": jnp.asarray(lab)})
  assert batches[0]["labels"].shape == (32, 8) and batches[1]["labels"].shape == (32, 310)
  (s8, l8), (s310, l310) = _steps(cfg, batches[:1]), _steps(cfg, batches[1:], targets=label_targets)
  np.testing.assert_array_equal(l8, l310)
  np.testing.assert_array_equal(np.asarray(s8.out.w), np.asarray(s310.out.w))
  np.testing.assert_array_equal(np.asarray(s8.out_w_opt.mu), np.asarray(s310.out_w_opt.mu))  # (1 - b1) * grad
  assert np.any(np.asarray(s8.out_w_opt.mu))


SHARDED_WIDTHS = """
    import dataclasses, functools, json, sys, jax, numpy as np
    sys.path.insert(0, {tests!r})
    from test_label_width import _config, _heavy_tailed
    from sparsejax.loss import label_targets
    from sparsejax import data, model
    from sparsejax.distributed import sharding
    ds = _heavy_tailed(long_row=150)  # (a shard's k is 160: more of its labels in a row fail its query)
    cfg = dataclasses.replace(_config({candidates!r}), num_shards=2)
    mesh = sharding.make_mesh(2)
    kw = dict(seed=0, num_epochs=1, prefetch=0, drop_remainder=False)
    results = []
    for widths, targets in (("bucketed", model.leading_label_targets), ("fixed", label_targets)):
      model.leading_label_targets = targets  # (traced below: each make_train_step compiles its own programs)
      state, step = sharding.init(jax.random.key(0), cfg, mesh), sharding.make_train_step(cfg, mesh)
      losses, label_widths = [], set()
      for b in data.BatchIterator(ds, 32, widths=widths, **kw):
        label_widths.add(b["labels"].shape[1])
        state, m = step(state, sharding.to_global(b, mesh))
        losses.append(float(m["loss"]))
      leaves = [np.asarray(x) for x in jax.tree.leaves((state.out, state.embed, state.hidden))]
      results.append((losses, sorted(label_widths), leaves))
    (l1, w1, s1), (l2, w2, s2) = results
    print(json.dumps(dict(losses=[l1, l2], widths=[w1, w2],
                          same_state=all(np.array_equal(a, b) for a, b in zip(s1, s2)))))
"""


@pytest.mark.parametrize("candidates", ["clusters", "lsh"])
def test_sharded_steps_give_the_same_floats_at_any_width(run_python, candidates):
  """2 shards (each queries its own labels first): bucketed batches with the labels-first targets, and the
  dataset-wide padding with the former comparison, give the same losses and states."""
  import json
  import os

  tests = os.path.dirname(os.path.abspath(__file__))
  out = json.loads(run_python(code=SHARDED_WIDTHS.format(tests=tests, candidates=candidates),
                              devices=2).stdout.splitlines()[-1])
  assert out["widths"] == [[32, 150], [150]]
  assert out["losses"][0] == out["losses"][1] and all(np.isfinite(out["losses"][0]))
  assert out["same_state"]


def test_a_sample_with_more_labels_than_the_active_set_trains_on_its_first_k(tmp_path, caplog):
  """A FOLDOC definition citing 615 terms stopped a run whose recipe had k = 512 (merge_candidates: more distinct
  labels than k). Such a row trains on its first k labels, and the log says how many rows were cut."""
  import logging

  import scipy.sparse

  import sparsejax

  rng = np.random.default_rng(0)
  x = scipy.sparse.random(400, 300, density=0.05, format="csr", random_state=0, dtype=np.float32)
  labels = [[int(rng.integers(100))] for _ in range(400)]
  labels[7] = list(range(60))  # 60 labels, k = 32
  with caplog.at_level(logging.WARNING):
    model = sparsejax.fit(x, labels, num_labels=100, workdir=str(tmp_path), verbose=False, hidden_dims=(16,),
                          active_k=32, softmax="sampled", batch_size=32, max_steps=20, recipe="none",
                          validation_fraction=0.0)
  assert "1 training samples have more labels than the 32 active neurons (--active_k): each trains on its first 32" \
      in caplog.text
  assert model.predict(x[:4], top=3)[1].shape == (4, 3)
