"""Seconds per call of the evaluation programs, one process or sharded: exact, exact + sampled, with diagnostics.

An evaluation scores its samples in calls of ``--rows`` samples (``--eval_memory_mb`` plans their number:
``inference.rows_within``). This builds a model of ``--labels`` output rows on random weights (hidden width
``--hidden``, the default index), its serving index, and times ``Run.predict_exact``, ``Run.predict`` (exact and
sampled top k) and ``Run.diagnose`` (with the retrieval diagnostics) on random samples of 32 features: the mean
of ``--calls`` calls after one that compiles. It prints too the samples per call that ``--eval_memory_mb`` allows
the final evaluation of this model (XLA's count of its compiled program). One process, or P under the launcher::

  python benchmarks/evaluation_calls.py --labels 400000
  python -m sparsejax.distributed.launch -n 4 benchmarks/evaluation_calls.py --labels 400000 --json=/tmp/eval_p4.json
"""

import time

import numpy as np

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  harness.add_launcher_flags(parser)
  parser.add_argument("--labels", type=int, default=400_000, help="output rows (N)")
  parser.add_argument("--features", type=int, default=20_000, help="input features")
  parser.add_argument("--hidden", type=int, default=128, help="hidden width (d)")
  parser.add_argument("--rows", type=int, default=1024, help="samples per call")
  parser.add_argument("--calls", type=int, default=2, help="timed calls per program")
  parser.add_argument("--eval_memory_mb", type=int, default=512, help="the bound whose samples per call are printed")
  harness.add_json_flag(parser, help="write the results here (process 0, with the machine)")
  args = parser.parse_args()
  from sparsejax.distributed import process_group
  process_group.initialize(args.coordinator_address, args.num_processes, args.process_id)
  import dataclasses

  import jax

  from sparsejax import inference
  from sparsejax.distributed import sharding
  from sparsejax.model_config import ModelConfig
  from sparsejax.settings import override

  num_processes = jax.process_count()
  config = override(ModelConfig(args.features, args.labels), hidden_dims=(args.hidden,))
  run = sharding.make_run(config, seed=0, num_shards=num_processes, top=100)
  state = run.refresh_index(run.init())
  rng = np.random.default_rng(0)
  ids = rng.integers(0, args.features, (args.rows, 32)).astype(np.int32)
  values = rng.random((args.rows, 32)).astype(np.float32)
  labels = rng.integers(0, args.labels, (args.rows, 1)).astype(np.int32)
  seconds = {}
  for name, fn, inputs in (("exact", run.predict_exact, (state, ids, values)),
                           ("predict", run.predict, (state, ids, values)),
                           ("diagnose", run.diagnose, (state, ids, values, labels))):
    jax.block_until_ready(fn(*inputs))  # compiles
    start = time.perf_counter()
    for _ in range(args.calls):
      jax.block_until_ready(fn(*inputs))
    seconds[name] = (time.perf_counter() - start) / args.calls
  sharded = dataclasses.replace(config, num_shards=num_processes)
  planned = inference.rows_within(sharded, args.eval_memory_mb << 20, (sharded.serving_k,))
  if jax.process_index() == 0:
    print(f"N = {args.labels}, {num_processes} process(es), {args.rows} samples per call: "
          + ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items())
          + f"; --eval_memory_mb={args.eval_memory_mb} plans {planned} samples per call "
          f"(serving_k {sharded.serving_k})")
    harness.write_json(args.json, dict(labels=args.labels, hidden=args.hidden, processes=num_processes,
                                       rows=args.rows, seconds_per_call=seconds, eval_memory_mb=args.eval_memory_mb,
                                       planned_rows_per_call=planned))


if __name__ == "__main__":
  main()
