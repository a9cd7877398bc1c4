"""Where a training step's time goes inside ``train_and_evaluate``.

For each N (synthetic data with N labels) it measures, per training step:

- ``loop_step_s``: the training loop's wall time per step in a real ``train_and_evaluate`` run (steady state:
  evaluations and the first ``log_every`` window, with the step's compilation, excluded; table maintenance
  included), and ``loop_samples_per_sec`` the run's own figure (compilation included);
- ``isolated_step_s``: the jitted step alone on one prepared batch, state donated (as ``benchmarks/ops.py``
  times its whole step), and ``loop_over_isolated_rate`` = isolated / loop step time (>= 0.9 is the target);
- ``batch_prep_s``: preparing one padded batch (``BatchIterator`` with ``prefetch=0``); it runs on a background
  thread in the loop, so it only costs the loop when it is slower than the step or steals its cores;
- ``host_overhead_s``: loop minus isolated step minus the refreshes inside the timed windows (dispatch,
  bookkeeping, prefetch contention);
- ``refresh_s``: one refresh of the training index; ``refresh_period`` the schedule's first period (lengthened by
  ``--refresh_budget`` where refreshes are expensive); ``maintenance_per_step_s`` their share per step over the
  first ``--horizon`` steps, and ``loop_over_isolated_rate_over_horizon`` the loop's rate with that share in
  place of the few refreshes of the profiled steps;
- ``parts``: each jitted part timed alone on the same state and batch: hidden forward, candidate query, logits,
  loss, the output layer's Adam pass (which also computes the hidden gradient dh), the hidden layers' vjp, the
  other optimizer updates (input layer, dense layers), table maintenance amortised over its schedule,
  evaluation amortised over ``eval_every``;
- ``dense_loop_step_s``: the same loop with ``--model=dense`` (full softmax), and ``sparse_over_dense_rate``.

The parts run as separate jits, so their sum exceeds the fused step (no cross-part fusion, extra dispatches).

  taskset -c 0,1 python benchmarks/train_profile.py --cores 2 --json benchmarks/results/train_profile_2cores.json
  python benchmarks/train_profile.py --sizes 20000 --steps 100   # quick
  python benchmarks/train_profile.py --short --batch_compare      # smoke test of every mode (tiny sizes)
  python benchmarks/train_profile.py --sizes= --batch_compare   # only batch 1024 vs 128 at 200K labels
  python benchmarks/train_profile.py --dataset icd10              # the built-in dataset (exact softmax)

``--trace DIR`` also writes a ``jax.profiler`` trace of a few loop steps (TensorBoard / Perfetto).
"""

import argparse
import json
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import model, ops, optim
from sparsejax.config import Config
from sparsejax.data import BatchIterator, load_dataset
from sparsejax.distributed import sharding
from sparsejax.evaluation import Evaluator
from sparsejax.loss import label_targets, num_distinct_labels, sharded_softmax_cross_entropy
from sparsejax.model_config import ModelConfig, local_active_k, uses_exact_path
from sparsejax.network import dense_optimizer, hidden_forward
from sparsejax.schedule import TableSchedule, refresh_cost_in_steps
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate
from sparsejax.train.metric_writer import read_records

import harness
from harness import finished_runs


def time_steps(step, state, batch, repeats):
  """Median seconds of a donating ``step(state, batch) -> (state, metrics)``; returns (seconds, state)."""
  for _ in range(2):
    state, m = step(state, batch)
  jax.block_until_ready(m)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), state


def base_config(args, N: int, **changes) -> Config:
  sizes = dict(synthetic_labels=N, synthetic_samples=args.samples, synthetic_features=args.features) \
      if args.dataset == "synthetic" else {}
  return override(Config(), dataset=args.dataset, **sizes, validation_fraction=0.0, batch_size=args.batch_size,
                  max_steps=args.steps, eval_every=args.eval_every, checkpoint_every=10**9, progress=False,
                  log_every=max(1, args.steps // 10), **{**finished_runs.parse_settings(args.set), **changes})


def loop_seconds_per_step(config: Config, first_refresh: int = 0) -> tuple[float, dict]:
  """Steady-state training seconds per step of a real run, and its final record.

  From the loop's own ``samples_per_sec`` windows (``log_every`` steps each, evaluations excluded), leaving out
  the first window; later windows include table maintenance. Compilations are one-offs a real run amortises
  over its length: a warm-up run fills the persistent compilation cache first, so they are loaded, not redone
  (through ``first_refresh``, the step of the first refresh, where the run gets that far).
  """
  warm_up = min(first_refresh, config.budget.max_steps or first_refresh)
  with tempfile.TemporaryDirectory() as workdir:  # fills the compilation cache (the step, the refresh)
    train_and_evaluate(override(config, max_steps=max(warm_up, config.run.log_every) + 1), workdir)
  with tempfile.TemporaryDirectory() as workdir:
    final = train_and_evaluate(config, workdir)
    records = [r for r in read_records(workdir) if "samples_per_sec" in r and not r.get("final")]
  steps = [b["step"] - a["step"] for a, b in zip(records, records[1:])]
  seconds = sum(n * config.optim.batch_size / r["samples_per_sec"] for n, r in zip(steps, records[1:]))
  return seconds / max(sum(steps), 1), final


def parts(run, config: ModelConfig, state, batch, repeats) -> dict[str, float]:
  """Each jitted part of a SLIDE step alone, on ``state`` and ``batch``."""
  fids, fvals, labels = batch["feat_ids"], batch["feat_vals"], batch["labels"]
  k = local_active_k(config, 1)
  dense_params = (state.embed.b, state.hidden)
  hidden = jax.jit(lambda s: model.hidden(s, fids, fvals))
  h = hidden(state)
  query = jax.jit(lambda s, h: model.query_active(s, h, config=config, k=k, num_rows=config.num_labels,
                                                  labels=labels, seed=jnp.uint32(1),
                                                  max_from_index=config.max_from_index))
  active, _ = query(state, h)
  logits_fn = jax.jit(lambda s, h, a: ops.sparse_logits(h, s.out.w, s.out.b, a))
  logits = logits_fn(state, h, active)
  loss_fn = jax.jit(lambda lg, a: sharded_softmax_cross_entropy(
      lg, label_targets(a, labels, num_distinct_labels(labels))))
  _, g_out = loss_fn(logits, active)

  adam = config.adam_args()
  lr = config.schedule()(state.step)
  # As train_step: the output layer's Adam pass also computes the hidden gradient dh from the rows it reads.
  # Copies: the optimizer kernels update in place, the state must survive for the other parts.
  out_adam = jax.jit(lambda w, b, mw, mb, g, a, h: optim.apply_row_sparse_adam(
      (w, b), (mw, mb), ops.RowSparseGrad(a, g, h), lr, combine=True, **adam), donate_argnums=(0, 1, 2, 3))
  dh = out_adam(*jax.tree.map(jnp.copy, (state.out.w, state.out.b, state.out_w_opt, state.out_b_opt)), g_out,
                active, h)[3]

  def backward(s, dh):  # the hidden layers' vjp
    _, vjp = jax.vjp(lambda dp, tap: hidden_forward(s.embed.w, dp, fids, fvals, tap), dense_params,
                     jnp.zeros((fids.shape[0], config.hidden_dims[0]), jnp.float32))
    return vjp(dh)

  backward = jax.jit(backward)
  d_dense, d_embed = backward(state, dh)
  embed_adam = jax.jit(lambda w, m, d: optim.apply_row_sparse_adam(
      w, m, ops.RowSparseGrad(fids, fvals, d), lr, **adam)[:2], donate_argnums=(0, 1))
  dense_update = jax.jit(lambda d, o, p: dense_optimizer(config).update(d, o, p))
  copy = lambda x: jax.tree.map(jnp.copy, x)
  res = {"hidden_forward_s": harness.median_seconds(hidden, state, repeats=repeats),
         "query_s": harness.median_seconds(query, state, h, repeats=repeats),
         "logits_s": harness.median_seconds(logits_fn, state, h, active, repeats=repeats),
         "loss_s": harness.median_seconds(loss_fn, logits, active, repeats=repeats),
         "hidden_backward_s": harness.median_seconds(backward, state, dh, repeats=repeats)}
  w, b, mw, mb = copy((state.out.w, state.out.b, state.out_w_opt, state.out_b_opt))
  times = []
  for _ in range(repeats + 2):
    t0 = time.perf_counter()
    (w, b), (mw, mb), _, _ = jax.block_until_ready(out_adam(w, b, mw, mb, g_out, active, h))
    times.append(time.perf_counter() - t0)
  res["adam_out_with_dh_s"] = float(np.median(times[2:]))
  w, m = copy((state.embed.w, state.embed_opt))
  times = []
  for _ in range(repeats + 2):
    t0 = time.perf_counter()
    w, m = jax.block_until_ready(embed_adam(w, m, d_embed))
    times.append(time.perf_counter() - t0)
  res["adam_embed_s"] = float(np.median(times[2:]))
  res["adam_dense_s"] = harness.median_seconds(dense_update, d_dense, state.dense_opt, dense_params, repeats=repeats)
  return res


def time_refresh(run, state, repeats: int) -> tuple[float, Any]:
  """Seconds of one refresh of the training index (``run.maintain`` at its first due step), and the state.

  The training index, not the finer serving index that evaluation builds. ``run.maintain`` donates the state, so
  the new one is returned. 0 where the run never refreshes.
  """
  schedule = run.schedule  # the first refresh comes within the longer of the two periods (none where both are 0)
  due = next((s for s in range(1, max(schedule.period, schedule.rehash_period) + 1)
              if schedule.rebuild_due(s) or schedule.rehash_due(s)), None)
  if due is None:
    return 0.0, state
  times = []
  for _ in range(max(2, repeats // 3) + 1):
    t0 = time.perf_counter()
    state = jax.block_until_ready(run.maintain(state, due))
    times.append(time.perf_counter() - t0)
  return float(np.median(times[1:])), state


def refreshes_between(schedule: TableSchedule, first: int, last: int) -> int:
  """Refreshes the schedule makes after steps ``first + 1 .. last``."""
  return sum(schedule.rebuild_due(s) or schedule.rehash_due(s) for s in range(first + 1, last + 1))


def bench_size(args, N: int) -> dict:
  config = base_config(args, N)
  data = load_dataset(config.data, seed=config.run.seed)
  train = data.train
  res = {"dataset": args.dataset, "N": train.num_labels, "batch_size": args.batch_size, "steps": args.steps}
  mf, ml = max(train.max_features_per_sample(), 1), max(train.max_labels_per_sample(), 1)
  mcfg = ModelConfig.from_config(config, train.num_features, train.num_labels)
  res["exact_path"] = uses_exact_path(mcfg)

  it = BatchIterator(train, args.batch_size, seed=0, max_features=mf, max_labels=ml, prefetch=0)
  batch = next(it)
  t0 = time.perf_counter()
  for _ in range(args.repeats):
    next(it)
  res["batch_prep_s"] = (time.perf_counter() - t0) / args.repeats

  run = sharding.make_run(mcfg, seed=0)
  state = run.init()
  res["isolated_step_s"], state = time_steps(run.step, state, batch, args.repeats)
  if not res["exact_path"]:
    res["parts"] = parts(run, mcfg, state, jax.tree.map(jnp.asarray, batch), args.repeats)
  schedule = run.schedule
  res["refresh_s"], state = time_refresh(run, state, args.repeats)
  res["refresh_period"] = schedule.period  # first period, after --refresh_budget (refresh_cost_in_steps)
  res["refresh_cost_in_steps_estimate"] = refresh_cost_in_steps(mcfg)
  res["refresh_cost_in_steps_measured"] = res["refresh_s"] / res["isolated_step_s"]
  # Amortised over a long run (--horizon steps of the schedule), not only over this profile's few hundred steps.
  res["maintenance_count"] = refreshes_between(schedule, 0, args.horizon)
  res["maintenance_per_step_s"] = res["refresh_s"] * res["maintenance_count"] / args.horizon
  evaluator = Evaluator.for_run(data.test, train, config.data.max_features, config.run.propensity_a,
                                config.run.propensity_b)
  t0 = time.perf_counter()
  evaluator(run.exact_predictor(), state, config.run.eval_samples)  # a periodic evaluation scores exactly
  res["evaluation_s"] = time.perf_counter() - t0
  res["evaluation_per_step_s"] = res["evaluation_s"] / config.run.eval_every
  del state

  res["loop_step_s"], final = loop_seconds_per_step(config, schedule.period)
  res["loop_samples_per_sec"] = final["samples_per_sec"]
  res["loop_over_isolated_rate"] = res["isolated_step_s"] / res["loop_step_s"]
  # The loop's timed windows (after the first log window) hold this many refreshes: take them out, then add the
  # long-run share, for the rate over the whole horizon.
  first = config.run.log_every
  in_loop = refreshes_between(schedule, first, args.steps)
  res["loop_refreshes"] = in_loop
  loop_without = res["loop_step_s"] - in_loop * res["refresh_s"] / max(args.steps - first, 1)
  res["host_overhead_s"] = loop_without - res["isolated_step_s"]
  res["loop_over_isolated_rate_over_horizon"] = res["isolated_step_s"] / (loop_without + res["maintenance_per_step_s"])
  if args.dense:
    res["dense_loop_step_s"], _ = loop_seconds_per_step(override(config, model="dense"))
    res["sparse_over_dense_rate"] = res["dense_loop_step_s"] / res["loop_step_s"]
  return res


def batch_comparison(args) -> dict:
  """Batch ``--large_batch`` (linear LR scaling, a quarter-epoch warm-up) against batch 128, same epochs and data.

  The 200K-label synthetic set of the README (``--compare_labels``, ``--compare_samples``, 100,000 features,
  ``active_k`` 512), evaluated exactly on the same test samples. Reports each run's P@1/P@5 and samples/s (the
  run's own, evaluation excluded) and the ratios ``large_over_128_p@1`` (target >= 1) and
  ``large_over_128_samples_per_sec`` (target >= 2).
  """
  common = override(Config(), dataset="synthetic", synthetic_labels=args.compare_labels,
                    synthetic_samples=args.compare_samples, synthetic_features=args.compare_features,
                    active_k=args.compare_active_k, num_epochs=args.compare_epochs, validation_fraction=0.0,
                    eval_every=10**9, checkpoint_every=10**9, progress=False, log_every=50)
  num_train = args.compare_samples - round(args.compare_samples * common.data.test_fraction)
  runs = {}
  for batch in (128, args.large_batch):
    changes = {} if batch == 128 else dict(lr_scaling="linear", warmup_steps=max(1, num_train // batch // 4))
    config = override(common, batch_size=batch, **changes)
    with tempfile.TemporaryDirectory() as workdir:
      final = train_and_evaluate(config, workdir)
    runs[batch] = {"batch_size": batch, **changes, **{k: final[k] for k in ("p@1", "p@5", "samples_per_sec", "step")}}
    print(json.dumps(runs[batch]), flush=True)
  small, large = runs[128], runs[args.large_batch]
  return {"labels": args.compare_labels, "samples": args.compare_samples, "epochs": args.compare_epochs,
          "runs": list(runs.values()), "large_over_128_p@1": large["p@1"] / max(small["p@1"], 1e-9),
          "large_over_128_samples_per_sec": large["samples_per_sec"] / small["samples_per_sec"]}


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--sizes", default="20000,200000,1000000",
                      help="label counts N, comma-separated (synthetic); empty: none (e.g. --batch_compare only)")
  parser.add_argument("--dataset", default="synthetic", choices=("synthetic", "icd10", "gcide", "gcide_cloze"),
                      help="icd10, gcide, gcide_cloze: a built-in dataset, once (its own N and split; --sizes, "
                      "--samples and --features are for synthetic data)")
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--steps", type=int, default=300, help="steps of each training run")
  parser.add_argument("--eval_every", type=int, default=500, help="--eval_every of the runs (amortised evaluation)")
  parser.add_argument("--samples", type=int, default=50_000, help="synthetic samples")
  parser.add_argument("--features", type=int, default=20_000, help="synthetic feature space")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--horizon", type=int, default=10_000,
                      help="steps of the refresh schedule that maintenance is amortised over")
  parser.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                      help="also run the dense full-softmax loop (skipped above 2e5 labels)")
  parser.add_argument("--cores", type=int, default=None, help="cores the run was given (taskset): recorded")
  parser.add_argument("--trace", default=None, help="directory for a jax.profiler trace of the last size's loop")
  parser.add_argument("--batch_compare", action=argparse.BooleanOptionalAction, default=False,
                      help="also train batch --large_batch against batch 128 on the 200K-label synthetic set")
  parser.add_argument("--large_batch", type=int, default=1024)
  parser.add_argument("--compare_labels", type=int, default=200_000)
  parser.add_argument("--compare_samples", type=int, default=500_000)
  parser.add_argument("--compare_features", type=int, default=100_000)
  parser.add_argument("--compare_active_k", type=int, default=512)
  parser.add_argument("--compare_epochs", type=float, default=1.0)
  parser.add_argument("--short", action="store_true",
                      help="a quick check: N = 2e4 only, 60 steps, 3 repeats, small data (no acceptance figures)")
  parser.add_argument("--set", action="append", metavar="NAME=VALUE",
                      help="a sparsejax setting of every run (repeatable), e.g. --set candidates=lsh")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  if args.short:
    args.sizes, args.steps, args.repeats, args.samples, args.eval_every = "20000", 60, 3, 5000, 1000
    args.compare_labels, args.compare_samples, args.compare_features = 2000, 4000, 2000
    args.compare_epochs = min(args.compare_epochs, 1.0)
  cache = tempfile.mkdtemp(prefix="train_profile_jax_cache_")
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  sizes = [int(float(s)) for s in args.sizes.split(",") if s] if args.dataset == "synthetic" else [0]
  results = {"cores": args.cores or harness.usable_cores(), "sizes": []}
  for N in sizes:
    dense = args.dense and N <= 200_000
    res = bench_size(argparse.Namespace(**{**vars(args), "dense": dense}), N)
    results["sizes"].append(res)
    print(json.dumps(res), flush=True)
  if args.batch_compare:
    results["batch_comparison"] = batch_comparison(args)
  if args.trace and sizes:
    with jax.profiler.trace(args.trace):
      loop_seconds_per_step(override(base_config(args, sizes[-1]), max_steps=min(args.steps, 30)))
  harness.write_json(args.json, results)


if __name__ == "__main__":
  main()
