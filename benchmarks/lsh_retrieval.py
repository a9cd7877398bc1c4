"""LSH tables against the clustered index as retrievers of a trained layer's largest logits (issue 32, item 2).

Offline: no training. A finished ``accuracy.py`` run (by default the clustered-index run of
``/tmp/sparsejax_accuracy/DATASET/sparsejax-300s``) gives the trained output rows ``W, b`` and the test queries'
hidden vectors ``h``. For each index configuration (a set of ``--candidates`` / LSH settings) the script builds
the index over those rows with the project's own functions (``Index.serving`` of :mod:`sparsejax.index`: what
sampled inference builds), queries it without labels at
the run's training k, and measures, on the same queries:

* ``label_recall``: the share of a query's labels among the index's candidates;
* ``topk_recall@10``: the share of the exact top 10 of ``h W^T + b`` among them;
* ``mean_candidates``: how many of the k active ids came from the index (the rest are random fill);
* ``sampled_p@1`` and its ratio to exact P@1: the argmax over the k active ids (sampled inference);
* build seconds (median of ``--repeats``), query milliseconds per 1,024 queries, and the index's bytes;

and, once per run, the cosines that a hash family sees (:func:`cosine_geometry`).

The variants are the LSH settings of ``TablesConfig`` (``lsh_serving``, ``lsh_family``, ``lsh_projections``,
``lsh_probes``, ``lsh_rerank``, ``lsh_mips``, ``num_tables``, ``num_bits``, ``bucket_size``, ``table_policy``),
each from today's defaults, measured on the serving tables that sampled inference builds; ``training_tables``
measures the tables a training step reads instead; ``num_bits_offset`` sets K relative to the default for the
layer's size; ``uncentred`` hashes MIPS-reduced rows without centring them first (the ``--lsh_mips`` of before
issue 32, kept here only to measure what the centring does).

    python benchmarks/lsh_retrieval.py --dataset synthetic     # -> benchmarks/results/lsh/synthetic.json
    python benchmarks/lsh_retrieval.py --dataset gcide_cloze
    python benchmarks/lsh_retrieval.py --dataset synthetic --variant 'mine:candidates=lsh,num_tables=96'
    python benchmarks/lsh_retrieval.py --dataset synthetic --select clusters --select rows   # some of the list

The retrieval figures do not depend on the machine's load; the times do (run on a quiet machine to compare
them).
"""

import dataclasses
import json
import os
import statistics
import time
from contextlib import contextmanager

import numpy as np

from sparsejax.model_config import ModelConfig

import harness
from harness import finished_runs

# name -> settings (TablesConfig fields), each from today's defaults. Every variant is measured on the serving
# tables that sampled inference builds (index.serving), but "training tables", which reads the tables a training
# step queries (index.init: one bucket per table). "training" serving tables hash as the training tables do (the
# MIPS reduction by the longest row; the default before --lsh_serving), "angular" ones the centred rows'
# directions. The variants measured before the hyperplanes drawn from the rows (DWTA and random SimHash with their
# sizes of then) and norm-ranging are in benchmarks/results/HISTORY.md with the commands and commits that measured
# them.
VARIANTS = {
    "clusters": dict(candidates="clusters"),
    "dwta, 1 probe (the default before 392de11)": dict(candidates="lsh", lsh_family="dwta", lsh_probes=1,
                                                       lsh_rerank=0, lsh_serving="training"),
    "simhash rows, training tables": dict(candidates="lsh", lsh_probes=1, lsh_rerank=0, training_tables=True),
    "training, simhash rows, 3 probes, rerank 4 (the default before)": dict(candidates="lsh", lsh_serving="training",
                                                                            lsh_rerank=4),
    "training, simhash random, 3 probes, rerank 4": dict(candidates="lsh", lsh_serving="training",
                                                         lsh_projections="random", lsh_rerank=4),
    "angular, 1 probe": dict(candidates="lsh", lsh_probes=1, lsh_rerank=0),
    "angular, 3 probes": dict(candidates="lsh", lsh_rerank=0),
    "angular, 3 probes, rerank 4": dict(candidates="lsh", lsh_rerank=4),
    "angular, 3 probes, rerank 8 (default)": dict(candidates="lsh"),
    "angular dwta, 3 probes, rerank 8": dict(candidates="lsh", lsh_family="dwta"),
}


def parse_variant(text: str) -> tuple[str, dict]:
  """``NAME:key=value,key=value`` -> ``(NAME, settings)`` (values as JSON where they parse)."""
  name, _, settings = text.partition(":")
  return name, finished_runs.parse_settings([s for s in settings.split(",") if s])


@contextmanager
def uncentred_rows():
  """MIPS-reduced rows built without centring (what ``--lsh_mips`` did before issue 32)."""
  from sparsejax.index import mips

  centre = mips.centre_rows
  mips.centre_rows = lambda weight, bias, num_valid=None: (weight, bias)
  try:
    yield
  finally:
    mips.centre_rows = centre


def measure(config, state, h, labels, top_ids, exact_hits, settings: dict, repeats: int, seed: int) -> dict:
  """Builds the index of ``settings`` over ``state``'s rows and measures its retrieval of ``h``'s top logits."""
  import jax
  import jax.numpy as jnp

  from sparsejax import index, model, ops, retrieval
  from sparsejax.config import TablesConfig
  from sparsejax.settings import override

  settings = dict(settings)
  uncentred = settings.pop("uncentred", False)
  training_tables = settings.pop("training_tables", False)
  if "num_bits_offset" in settings:  # K relative to the default for this layer's size
    settings["num_bits"] = ModelConfig(1, config.num_labels, tables=TablesConfig()).lsh_config.num_bits + \
        settings.pop("num_bits_offset")
  n = config.num_labels
  # The run's config.json holds the LSH settings of its day: start each variant from today's defaults.
  cfg = override(dataclasses.replace(config, tables=TablesConfig()), **settings)
  k = cfg.k
  # The serving index of these rows (clusters: the evaluation's sizes; LSH: fresh hash functions, as sampled
  # inference without the run's own builds them).
  kind = index.from_config(cfg)
  if training_tables:  # the tables a training step reads
    build = jax.jit(lambda s: kind.init(*jax.random.split(jax.random.key(seed)), s.out.w, s.out.b))
  else:
    build = jax.jit(lambda s: kind.serving(None, s.out.w, s.out.b))
  with uncentred_rows() if uncentred else _nothing():
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      built = jax.block_until_ready(build(state))
      times.append(time.perf_counter() - t)
  index_state = state._replace(index=built)

  @jax.jit
  def query(s, hh):
    active, from_index = model.query_active(s, hh, config=cfg, k=k, num_rows=n, seed=seed)
    return active, from_index, ops.sparse_logits(hh, s.out.w, s.out.b, active)

  per_query, picks, query_ms = [], [], []
  for start in range(0, len(h), 1024):
    hh = jnp.asarray(h[start:start + 1024])
    jax.block_until_ready(query(index_state, hh))  # compiled once per shape
    t = time.perf_counter()
    active, from_index, logits = jax.block_until_ready(query(index_state, hh))
    query_ms.append(1e3 * (time.perf_counter() - t) * 1024 / len(hh))
    per_query.append(jax.device_get(retrieval.per_query(active, from_index, jnp.asarray(labels[start:start + 1024]),
                                                        jnp.asarray(top_ids[start:start + 1024]), hh,
                                                        index_state.out.w)))
    picks.append(np.take_along_axis(np.asarray(active), np.argmax(np.asarray(logits), axis=1)[:, None], 1)[:, 0])
  pick = np.concatenate(picks)
  sampled_hits = np.any(pick[:, None] == labels, axis=1) & (pick >= 0)
  result = retrieval.summarize(per_query, retrieval.TOP)
  return result | {
      "k": k, "sampled_p@1": float(sampled_hits.mean()), "exact_p@1": float(exact_hits.mean()),
      "sampled_over_exact_p@1": float(sampled_hits.mean() / max(exact_hits.mean(), 1e-12)),
      "build_seconds": statistics.median(times), "query_ms_per_1024": statistics.median(query_ms),
      "index_bytes": sum(int(x.nbytes) for x in jax.tree.leaves(built)),
      "settings": settings | ({"uncentred": True} if uncentred else {}) |
                  ({"training_tables": True} if training_tables else {})}


def cosine_geometry(state, h, top_ids, num_queries: int = 256) -> dict:
  """What a hash family is up against: the cosines of MIPS-reduced queries with the reduced rows (centred and
  not), for each query's exact top row and for all rows (per-query mean and standard deviation, median over
  queries). A SimHash bit agrees with probability ``1 - arccos(cos) / pi``."""
  import jax.numpy as jnp

  from sparsejax.index import mips

  q = np.asarray(mips.augment_queries(jnp.asarray(h[:num_queries])), np.float64)
  top = top_ids[:num_queries, 0]
  out = {}
  for name, (w, b) in {"uncentred": (state.out.w, state.out.b),
                       "centred": mips.centre_rows(jnp.asarray(state.out.w), jnp.asarray(state.out.b))}.items():
    x = np.asarray(mips.augment_rows(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)), np.float64)
    cosine = q @ x.T
    out[name] = {"cos_top_row_median": float(np.median(cosine[np.arange(len(q)), top])),
                 "cos_rows_mean_median": float(np.median(cosine.mean(axis=1))),
                 "cos_rows_sd_median": float(np.median(cosine.std(axis=1)))}
  return out


@contextmanager
def _nothing():
  yield


def main():
  parser = harness.parser(__doc__)
  finished_runs.add_finished_run_flags(parser, "synthetic")
  parser.add_argument("--queries", type=int, default=4096, help="test queries measured (the first ones)")
  parser.add_argument("--repeats", type=int, default=1, help="timed builds per variant (median)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the hash functions and the random fill")
  parser.add_argument("--variant", action="append", metavar="NAME:key=value,...",
                      help="measure these instead of the built-in list (repeatable)")
  parser.add_argument("--select", action="append", metavar="TEXT",
                      help="measure only the built-in variants whose names contain one of these (repeatable)")
  parser.add_argument("--out", default=os.path.join(harness.RESULTS_DIR, "lsh"), help="folder of DATASET.json")
  args = parser.parse_args()

  import jax

  from sparsejax import inference, model
  from sparsejax.evaluation import padded_width

  run_config, test, run, state, _ = finished_runs.finished_run(args)
  config = run.config
  rows = np.arange(min(args.queries, len(test)))
  fi, fv, labels = test.to_padded(rows, padded_width(test, run_config.data.max_features), 8)
  h = np.asarray(jax.jit(model.hidden)(state, fi, fv))
  _, top_ids = inference.exact_topk(h, state.out.w, state.out.b, 10)
  top_ids = np.asarray(top_ids)
  exact_hits = np.any(top_ids[:, :1] == labels, axis=1)
  geometry = cosine_geometry(state, h, top_ids)
  print("cosines of the reduced queries:", json.dumps(geometry), flush=True)
  variants = dict(parse_variant(v) for v in args.variant) if args.variant else VARIANTS
  if args.select:
    variants = {name: v for name, v in variants.items() if any(text in name for text in args.select)}
  results = {}
  for name, settings in variants.items():
    r = measure(config, state, h, labels, top_ids, exact_hits, settings, args.repeats, args.seed)
    results[name] = r
    print(f"{name:28s} k={r['k']} candidates {r['mean_candidates']:7.1f} label_recall {r['label_recall']:.3f} "
          f"topk_recall@10 {r['topk_recall@10']:.3f} sampled P@1 {r['sampled_p@1']:.4f} "
          f"({r['sampled_over_exact_p@1']:.3f} x exact {r['exact_p@1']:.4f}) build {r['build_seconds']:.2f} s "
          f"query {r['query_ms_per_1024']:.0f} ms/1024 index {r['index_bytes'] / 2**20:.1f} MiB", flush=True)
  path = os.path.join(args.out, f"{args.dataset}.json")
  harness.write_json(path, {"dataset": args.dataset, "run": finished_runs.finished_run_dir(args),
                            "queries": len(rows), "num_labels": config.num_labels,
                            "hidden": config.hidden_dims[-1], "cosines": geometry, "variants": results})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
