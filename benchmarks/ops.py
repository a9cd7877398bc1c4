"""Times the sparse ops against a dense training step of the same output layer.

For each N: LSH query (hash + lookup), sparse_logits forward+backward, the
row-sparse Adam step, a whole sparse step (query, forward, then the Adam pass
that also computes the input gradient dh, as sparsejax.model.train_step does;
one jit, state donated) and the dense step (full logits, jnp + optax.adam).
``--compare_unfused`` also times the step with dh from a separate gather.
Table builds are timed separately and excluded from the step.

Per N it also measures, in the same run, the memory floor under the step: the
bare optimizer update of the distinct rows the step touches, on as many
threads as this process may use (``row_floor_s``; ``benchmarks/row_memory.cc``,
built here as a library), and the step's ratio to it.

  python benchmarks/ops.py [--sizes 100000,1000000,2000000] [--json PATH]
  python benchmarks/ops.py --short   # a quick check at small N
  python benchmarks/ops.py --weight_dtype bfloat16 --moment_dtype bfloat16   # 6 bytes per weight element
  taskset -c 0,1 python benchmarks/ops.py ...   # on 2 cores of a bigger machine
"""

import ctypes
import hashlib
import os
import pathlib
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax import memory, ops, optim
from sparsejax.index import lsh, tables

import harness

HUGE_PAGES = True

ROW_MEMORY_SOURCE = pathlib.Path(__file__).with_name("row_memory.cc")
# Kinds of floor in row_memory.cc (its enum Kind).
FLOOR_READ, FLOOR_ADAM, FLOOR_ADAM_BF16, FLOOR_ROWWISE_ADAM = 0, 2, 3, 5
FLOOR_ADAM_BF16_WEIGHT, FLOOR_ADAM_ALL_BF16 = 6, 7


def row_memory_library() -> ctypes.CDLL:
  """benchmarks/row_memory.cc built as a shared library (cached by its source's hash)."""
  source = ROW_MEMORY_SOURCE.read_bytes()
  lib = pathlib.Path(tempfile.gettempdir()) / f"sparsejax_row_memory_{hashlib.sha256(source).hexdigest()[:12]}.so"
  if not lib.exists():
    tmp = lib.with_suffix(f".{os.getpid()}.so")
    subprocess.run(["g++", "-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-DROW_MEMORY_LIBRARY",
                    str(ROW_MEMORY_SOURCE), "-o", str(tmp)], check=True)
    tmp.replace(lib)
  dll = ctypes.CDLL(str(lib))
  dll.row_memory_floor.restype = ctypes.c_double
  dll.row_memory_floor.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int]
  return dll


def row_floor(kind: int, rows: np.ndarray, N: int, d: int) -> float:
  """Best seconds of row_memory.cc's `kind` update over `rows` of an [N, d] array, caches flushed first."""
  rows = np.ascontiguousarray(np.unique(rows[rows >= 0]), np.int64)
  s = row_memory_library().row_memory_floor(kind, rows.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), rows.size,
                                            N, d, harness.usable_cores())
  if s < 0:
    raise RuntimeError(f"row_memory_floor failed (kind {kind}, N={N}, d={d}): out of memory?")
  return s


def softmax_ce_first(logits):
  """Cross-entropy with the (single) label in column 0 of the active set."""
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[:, 0])


def floor_kind(moment_dtype, second_moment, weight_dtype) -> int:
  """The row_memory.cc update that moves the bytes the step's optimizer moves per row."""
  if second_moment == "row":  # (float32 weights; with bfloat16 ones this floor is the higher one)
    return FLOOR_ROWWISE_ADAM
  bf16_moments = jnp.dtype(moment_dtype) == jnp.bfloat16
  if jnp.dtype(weight_dtype) == jnp.bfloat16:
    return FLOOR_ADAM_ALL_BF16 if bf16_moments else FLOOR_ADAM_BF16_WEIGHT
  return FLOOR_ADAM_BF16 if bf16_moments else FLOOR_ADAM


def bench_size(N, d, B, k, lsh_cfg, bucket_size, repeats, moment_dtype=jnp.float32, compare_unfused=False,
               second_moment="element", weight_dtype=jnp.float32):
  rng = np.random.default_rng(0)
  W = jnp.asarray(rng.normal(size=(N, d)).astype(np.float32) / np.sqrt(d))
  b = jnp.zeros((N,), jnp.float32)
  h = jnp.asarray(np.maximum(rng.normal(size=(B, d)), 0).astype(np.float32))
  labels = jnp.asarray(rng.integers(0, N, size=(B, 1)), jnp.int32)
  params = lsh.init_lsh(jax.random.key(0), lsh_cfg, d)
  t = tables.init_tables(lsh_cfg, bucket_size)
  build = jax.jit(tables.build_tables, donate_argnums=0)
  t0 = time.perf_counter()
  t = jax.block_until_ready(build(t, params, W))
  build_s = time.perf_counter() - t0
  res = {"N": N, "table_build_s": build_s, "table_bytes": t.nbytes}

  query = jax.jit(lambda t, h, y, s: tables.lsh_query(t, params, h, k=k, num_rows=N, labels=y, seed=s))
  res["query_s"] = harness.median_seconds(query, t, h, labels, jnp.uint32(1), repeats=repeats)
  ids, from_tables = query(t, h, labels, jnp.uint32(1))
  res["mean_from_tables"] = float(jnp.mean(from_tables))
  # Distinct rows a step reads and updates: at small N the samples' active
  # sets overlap more, so a step touches fewer rows.
  res["distinct_active_rows"] = int(np.unique(np.asarray(ids)).size)
  # The floor under the step: the bare optimizer update of those rows
  # (default: Adam over float32 W, m, v; row-wise: one v per row), and reading them.
  res["row_floor_s"] = row_floor(floor_kind(moment_dtype, second_moment, weight_dtype), np.asarray(ids), N, d)
  res["row_read_floor_s"] = row_floor(FLOOR_READ, np.asarray(ids), N, d)
  W = W.astype(weight_dtype)  # the sparse layer's weights (the tables were built from float32 ones)

  def loss_fn(h, tap, W, b, ids):
    return softmax_ce_first(ops.sparse_logits(h, W, b, ids) + tap)

  fwd_bwd = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
  res["sparse_logits_fwd_bwd_s"] = harness.median_seconds(fwd_bwd, h, jnp.zeros((B, k)), W, b, ids, repeats=repeats)

  # Row-sparse Adam on the layer's weight and bias (one fused pass).
  opt = optim.row_sparse_adam(1e-3, moment_dtype=moment_dtype, second_moment=second_moment)
  opt_w, opt_b = opt.init((W, b))
  if HUGE_PAGES:
    memory.advise_huge_pages((W, b, opt_w, opt_b, t))
  g = jnp.asarray(rng.normal(size=(B, k)).astype(np.float32))
  adam = jax.jit(lambda p, s, ids, g, h: opt.update(ops.RowSparseGrad(ids, g, h), s, p), donate_argnums=(0, 1))
  layer, layer_opt = (W, b), (opt_w, opt_b)
  for _ in range(2):
    layer, layer_opt = adam(layer, layer_opt, ids, g, h)
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    layer, layer_opt = jax.block_until_ready(adam(layer, layer_opt, ids, g, h))
    ts.append(time.perf_counter() - t0)
  res["row_sparse_adam_s"] = float(np.median(ts))
  (W, b), (opt_w, opt_b) = layer, layer_opt
  del layer, layer_opt

  def sparse_step(state, tabs, h, y, seed):
    # As sparsejax.model.train_step: the optimizer's pass over the rows also gives dh.
    W, b, sw, sb = state
    ids, _ = tables.lsh_query(tabs, params, h, k=k, num_rows=N, labels=y, seed=seed)
    loss, g = jax.value_and_grad(softmax_ce_first)(ops.sparse_logits(h, W, b, ids))
    (W, b), (sw, sb), dh = opt.update(ops.RowSparseGrad(ids, g, h), (sw, sb), (W, b), combine=True)
    return (W, b, sw, sb), loss, dh

  def unfused_step(state, tabs, h, y, seed):
    # dh from its own gather of the rows (gather_combine), then the update.
    W, b, sw, sb = state
    ids, _ = tables.lsh_query(tabs, params, h, k=k, num_rows=N, labels=y, seed=seed)
    (loss, (dh, g)) = jax.value_and_grad(loss_fn, argnums=(0, 1))(h, jnp.zeros((B, k)), W, b, ids)
    (W, b), (sw, sb) = opt.update(ops.RowSparseGrad(ids, g, h), (sw, sb), (W, b), after=dh)
    return (W, b, sw, sb), loss, dh

  state = (W, b, opt_w, opt_b)
  for key, fn in (("sparse_step_s", sparse_step), ("unfused_sparse_step_s", unfused_step)):
    if key != "sparse_step_s" and not compare_unfused:
      continue
    step = jax.jit(fn, donate_argnums=0)
    for i in range(2):
      state, loss, dh = jax.block_until_ready(step(state, t, h, labels, jnp.uint32(i)))
    ts = []
    for i in range(repeats):
      t0 = time.perf_counter()
      state, loss, dh = jax.block_until_ready(step(state, t, h, labels, jnp.uint32(100 + i)))
      ts.append(time.perf_counter() - t0)
    res[key] = float(np.median(ts))
  W, b = state[0].astype(jnp.float32), state[1]  # the dense step trains float32 weights
  del state, opt_w, opt_b, t

  dense_opt = optax.adam(1e-3)

  def dense_step(state, h, y):
    (W, b), s = state

    def loss(W, b, h):
      logits = h @ W.T + b
      return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y, axis=1)[:, 0])

    l, (gW, gb, dh) = jax.value_and_grad(loss, argnums=(0, 1, 2))(W, b, h)
    updates, s = dense_opt.update((gW, gb), s, (W, b))
    return (optax.apply_updates((W, b), updates), s), l, dh

  dstep = jax.jit(dense_step, donate_argnums=0)
  dstate = ((W, b), dense_opt.init((W, b)))
  dense_repeats = max(3, repeats // 3)
  for _ in range(1):
    dstate, l, dh = jax.block_until_ready(dstep(dstate, h, labels))
  ts = []
  for _ in range(dense_repeats):
    t0 = time.perf_counter()
    dstate, l, dh = jax.block_until_ready(dstep(dstate, h, labels))
    ts.append(time.perf_counter() - t0)
  res["dense_step_s"] = float(np.median(ts))
  res["step_speedup_vs_dense"] = res["dense_step_s"] / res["sparse_step_s"]
  res["step_over_row_floor"] = res["sparse_step_s"] / res["row_floor_s"]
  return res


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--sizes", default="100000,1000000,2000000")
  parser.add_argument("--d", type=int, default=128)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--k", type=int, default=1024)
  parser.add_argument("--family", default="simhash")
  parser.add_argument("--num_tables", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--moment_dtype", default="float32", choices=["float32", "bfloat16"],
                      help="row-sparse Adam moments")
  parser.add_argument("--second_moment", default="element", choices=optim.SECOND_MOMENTS,
                      help="row-sparse Adam's second moments: per element, or per row (row-wise Adam)")
  parser.add_argument("--weight_dtype", default="float32", choices=["float32", "bfloat16"],
                      help="the sparse layer's weights (the dense step keeps float32)")
  parser.add_argument("--short", action="store_true",
                      help="a quick check: --sizes 20000,100000 --repeats 3 (no acceptance keys)")
  parser.add_argument("--compare_unfused", action="store_true",
                      help="also time the step with dh from a separate gather (unfused_sparse_step_s)")
  harness.add_json_flag(parser)
  parser.add_argument("--no_huge_pages", action="store_true", help="leave arrays on 4 KiB pages")
  args = parser.parse_args()
  global HUGE_PAGES
  HUGE_PAGES = not args.no_huge_pages
  if args.short:
    args.sizes, args.repeats = "20000,100000", min(args.repeats, 3)
  sizes = [int(float(s)) for s in args.sizes.split(",")]
  results = []
  for N in sizes:
    cfg = tables.default_lsh_config(N, args.family, args.num_tables)
    r = bench_size(N, args.d, args.batch, args.k, cfg, tables.default_bucket_size(), args.repeats,
                   jnp.dtype(args.moment_dtype), args.compare_unfused, args.second_moment, jnp.dtype(args.weight_dtype))
    r["lsh"] = cfg._asdict()
    results.append(r)
    print(f"N={N:>9,}  query {r['query_s']*1e3:7.2f} ms  fwd+bwd {r['sparse_logits_fwd_bwd_s']*1e3:7.2f} ms  "
          f"adam {r['row_sparse_adam_s']*1e3:7.2f} ms  sparse step {r['sparse_step_s']*1e3:7.2f} ms  "
          f"dense step {r['dense_step_s']*1e3:8.1f} ms  speedup {r['step_speedup_vs_dense']:6.1f}x  "
          f"(build {r['table_build_s']:.1f} s, tables {r['table_bytes']/2**20:.0f} MiB, "
          f"{r['mean_from_tables']:.0f} ids/query from tables, {r['distinct_active_rows']:,} distinct rows/step)  "
          f"row floor {r['row_floor_s']*1e3:.2f} ms (step {r['step_over_row_floor']:.2f}x)"
          + (f"  unfused step {r['unfused_sparse_step_s']*1e3:.2f} ms" if args.compare_unfused else ""),
          flush=True)
  by_n = {r["N"]: r for r in results}
  summary = {
      "config": vars(args),
      "results": results,
  }
  if 1_000_000 in by_n:
    summary["step_speedup_vs_dense_at_1e6"] = by_n[1_000_000]["step_speedup_vs_dense"]
    summary["step_over_row_floor_at_1e6"] = by_n[1_000_000]["step_over_row_floor"]
  if 100_000 in by_n and 2_000_000 in by_n:
    a, b = by_n[100_000], by_n[2_000_000]
    summary["sparse_step_growth_1e5_to_2e6"] = b["sparse_step_s"] / a["sparse_step_s"]
    summary["per_distinct_row_step_growth_1e5_to_2e6"] = (
        (b["sparse_step_s"] / b["distinct_active_rows"]) / (a["sparse_step_s"] / a["distinct_active_rows"]))
  for key in ("step_speedup_vs_dense_at_1e6", "step_over_row_floor_at_1e6", "sparse_step_growth_1e5_to_2e6",
              "per_distinct_row_step_growth_1e5_to_2e6"):
    if key in summary:
      print(f"{key}: {summary[key]:.2f}")
  harness.write_json(args.json, summary, indent=2)


if __name__ == "__main__":
  main()
