"""Sampled inference of a finished accuracy run under variants of the serving index (issue 9).

Evaluation and sampled inference build a clustered index on the final rows (``model.serving_index``). This
restores a ``benchmarks/accuracy.py`` sparsejax run's selected state, builds that index under each variant
(config overrides: ``eval_num_clusters``, ``eval_kmeans_iterations``, ``cluster_spread_weight``, ...) and
evaluates the test set exactly and sampled at the training k, with the retrieval diagnostics:

  python benchmarks/accuracy.py --dataset synthetic --system sparsejax --budget 300   # the run
  python benchmarks/serving_index.py --dataset synthetic --tag 300s \\
      --variant "before=eval_num_clusters=2048,eval_kmeans_iterations=3,cluster_spread_weight=0" \\
      --variant "spread=eval_num_clusters=2048,eval_kmeans_iterations=3" \\
      --variant "4096/1=eval_num_clusters=4096,eval_kmeans_iterations=1" \\
      --variant "4096/2 (the defaults)=eval_num_clusters=4096,eval_kmeans_iterations=2" \\
      --variant "4096/3=eval_num_clusters=4096,eval_kmeans_iterations=3" \\
      --json benchmarks/results/serving_index_synthetic.json

A run's ``config.json`` holds the values of its time, so each variant names every setting it compares.
Each variant also times the index build alone (jitted, second call, on this machine's cores) and the top 5 of the
first 1,024 test queries, exact and sampled at the variant's ``serving_k`` (the candidates per query; default
``ModelConfig.serving_k``), from their hidden vectors (best of two calls after a first).
"""

import json
import time

from sparsejax.model_config import ModelConfig

import harness
from harness import finished_runs


def parse_variant(text: str) -> tuple[str, dict]:
  """``NAME=KEY=VALUE,KEY=VALUE`` (values as JSON, else strings) -> ``(NAME, overrides)``."""
  name, _, rest = text.partition("=")
  overrides = {}
  for item in filter(None, rest.split(",")):
    key, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"error: --variant {text!r}: {item!r} is not KEY=VALUE")
    try:
      overrides[key.strip()] = json.loads(value)
    except json.JSONDecodeError:
      overrides[key.strip()] = value
  return name.strip(), overrides


def query_seconds(state, model_config, test, max_features, queries: int = 1024) -> tuple[float, float]:
  """Seconds of the exact and the sampled top 5 of the first ``queries`` test queries' hidden vectors."""
  import jax
  import jax.numpy as jnp

  from sparsejax import inference, model
  from sparsejax.evaluation import padded_width

  rows = min(queries, len(test))
  fi, fv, _ = test.to_padded(range(rows), padded_width(test, max_features), 1)
  h = jax.block_until_ready(jax.jit(model.hidden)(state, jnp.asarray(fi), jnp.asarray(fv)))
  exact = jax.jit(lambda h: inference.exact_topk(h, state.out.w, state.out.b, 5))
  sampled = jax.jit(lambda h: inference.sampled_topk(state, h, config=model_config)[:2])

  def best_seconds(function) -> float:
    jax.block_until_ready(function(h))
    times = []
    for _ in range(2):
      start = time.perf_counter()
      jax.block_until_ready(function(h))
      times.append(time.perf_counter() - start)
    return min(times)

  return best_seconds(exact), best_seconds(sampled)


def main() -> None:
  parser = harness.parser(__doc__)
  finished_runs.add_finished_run_flags(parser, "synthetic")
  parser.add_argument("--variant", action="append", required=True, metavar="NAME=KEY=VALUE,...",
                      help="a serving index (config overrides; 'NAME=' alone: the defaults)")
  harness.add_json_flag(parser)
  args = parser.parse_args()

  import jax

  from sparsejax import model
  from sparsejax.distributed import sharding
  from sparsejax.settings import override

  config, test, _, state, evaluator = finished_runs.finished_run(args)
  results = []
  for name, overrides in map(parse_variant, args.variant):
    cfg = override(config, **overrides) if overrides else config
    model_config = ModelConfig.from_config(cfg, test.num_features, test.num_labels)
    run = sharding.make_run(model_config, seed=cfg.run.seed)
    build = jax.jit(lambda s, c=model_config: model.serving_index(s, c))
    jax.block_until_ready(build(state))
    start = time.perf_counter()
    served = jax.block_until_ready(build(state))
    build_seconds = time.perf_counter() - start
    r = evaluator(run.predict, served, None, diagnose=run.diagnose)
    exact_seconds, sampled_seconds = query_seconds(served, model_config, test, cfg.data.max_features)
    clusters_, iterations = model_config.eval_index_sizes
    row = dict(variant=name, overrides=overrides, clusters=clusters_, iterations=iterations,
               spread_weight=model_config.tables.cluster_spread_weight, build_seconds=build_seconds,
               serving_k=model_config.serving_k, exact_seconds_per_1024=exact_seconds,
               sampled_seconds_per_1024=sampled_seconds,
               **{key: float(r[key]) for key in ("p@1", "sampled_p@1", "label_recall", "topk_recall@10")})
    row["sampled_over_exact_p@1"] = row["sampled_p@1"] / row["p@1"] if row["p@1"] else None
    results.append(row)
    print(f"{name}: {clusters_} clusters, {iterations} iterations, spread weight {row['spread_weight']}, k "
          f"{row['serving_k']}: build {build_seconds:.1f} s; 1,024 queries exact {exact_seconds:.2f} s, sampled "
          f"{sampled_seconds:.2f} s; P@1 {row['p@1']:.4f}, sampled {row['sampled_p@1']:.4f} "
          f"({row['sampled_over_exact_p@1']:.3f} x), label_recall {row['label_recall']:.3f}, "
          f"topk_recall@10 {row['topk_recall@10']:.3f}", flush=True)
  harness.write_json(args.json, dict(dataset=args.dataset, run=finished_runs.finished_run_dir(args),
                                     k=config.network.active_k, test_queries=len(test), results=results))


if __name__ == "__main__":
  main()
