"""The measurements of ``netanalysis probe`` (:mod:`.probe`): the jitted collectives and the local reduction timed on
every process, gathered, fitted and written by process 0.

Imported by :func:`sparsejax.netanalysis.probe.main` once its flags are checked: this module imports JAX (and joins
the process group), which ``--help``, a flag's error and the fits of :mod:`.probe` need not.
"""

import os
import sys
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax.distributed import sharding
from sparsejax.distributed.sharding import AXIS
from sparsejax.netanalysis import cost_tables, probe_results
from sparsejax.netanalysis.collect import broadcast_int, gather_json
from sparsejax.netanalysis.probe import ELEMENT_BYTES, FLAGS, fit, format_table, probe_row, sizes


def _programs(mesh, processes: int) -> dict:
  ring = [(i, (i + 1) % processes) for i in range(processes)]
  bodies = {"all-reduce": lambda x: jax.lax.psum(x, AXIS),
            "all-gather": lambda x: jax.lax.all_gather(x, AXIS, tiled=True),
            "collective-permute": lambda x: jax.lax.ppermute(x, AXIS, perm=ring)}
  return {kind: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
          for kind, body in bodies.items()}


def _input(mesh, elements: int):
  """A float32 array of ``elements`` per process, sharded over the mesh."""
  return jax.make_array_from_callback((elements * mesh.size,), NamedSharding(mesh, P(AXIS)),
                                      lambda index: np.ones(elements, np.float32))


def _calls(fn, args, n: int) -> list[float]:
  """Seconds of each of ``n`` calls of ``fn(*args)``, waiting for each."""
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return times


def measure(kinds, max_bytes: int, max_call: float, iters: int, warmup: int, budget: float) -> dict:
  """This process's call times: ``{kind: [(bytes, [seconds...]), ...]}``.

  Process 0 decides (broadcast) whether to time a size and how many calls, so that every process
  makes the same calls: a size is skipped, and the kind ends, when the first warm-up call takes
  longer than ``max_call`` or the budget is spent; ``4 * iters`` calls are timed while they are cheap.
  """
  mesh = sharding.make_mesh()
  P = mesh.size
  programs = _programs(mesh, P)
  t_start = time.time()
  out = {}
  for i, kind in enumerate(kinds):
    deadline = t_start + budget * (i + 1) / len(kinds)
    out[kind] = []
    for nbytes in sizes(max_bytes, P, kind):
      x = _input(mesh, nbytes // ELEMENT_BYTES // (P if kind == "all-gather" else 1))
      fn = programs[kind].lower(x).compile()
      first = _calls(fn, (x,), 1)[0]
      calls = 4 * iters if first * 4 * iters < 0.2 else iters
      # A size whose calls (judged by the first) would end past the deadline is not started.
      over = first > max_call or time.time() + first * (max(warmup - 1, 0) + calls) > deadline
      calls = broadcast_int(0 if over else calls)
      if not calls:
        break
      _calls(fn, (x,), max(warmup - 1, 0))
      times = _calls(fn, (x,), calls)
      out[kind].append((nbytes, times))
      if broadcast_int(int(float(np.median(times)) > max_call)):
        break
  return out


def reduce_cost(max_bytes: int, budget: float) -> cost_tables.CostTable:
  """Seconds of a jitted add of two float32 buffers on this process, by buffer size (4 B doubling)."""
  add = jax.jit(lambda a, b: a + b)
  rows, s, t_start = [], ELEMENT_BYTES, time.time()
  while s <= max_bytes and time.time() - t_start < budget:
    a = jax.device_put(np.ones(s // ELEMENT_BYTES, np.float32))
    b = jax.device_put(np.ones(s // ELEMENT_BYTES, np.float32))
    fn = add.lower(a, b).compile()
    _calls(fn, (a, b), 2)
    times = _calls(fn, (a, b), 5)
    while len(times) < 50 and sum(times) < 0.05:
      times += _calls(fn, (a, b), 5)
    rows.append((float(s), float(np.median(times))))
    s *= 2
  return cost_tables.cost_table(rows, path="reduce cost")


def run(kinds: list[str], capacity: float | None) -> int:
  """Joins the process group and probes ``kinds`` (checked flags); process 0 prints the table and writes the files.

  Args:
    kinds: the collectives to time (:data:`sparsejax.netanalysis.probe.KINDS`).
    capacity: ``--link_capacity`` in bit/s, or None.
  """
  sharding.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  if jax.process_count() < 2:
    raise ValueError("probe needs at least 2 processes: python -m sparsejax.distributed.launch -n P python -m "
                     "sparsejax.netanalysis probe ...")
  t0 = time.time()
  measured = measure(kinds, FLAGS.max_bytes, FLAGS.max_call_seconds, FLAGS.iters, FLAGS.warmup, FLAGS.budget_seconds)
  cost = reduce_cost(min(FLAGS.max_bytes, 64 * 1024 * 1024), budget=5.0)
  everything = gather_json(measured)
  if everything is None:
    return 0
  P = jax.process_count()
  fits = {}
  for kind in kinds:
    rows = []
    for i, (nbytes, _) in enumerate(everything[0][kind]):
      per_call = np.max([rank[kind][i][1] for rank in everything], axis=0)  # the slowest rank's, call by call
      rows.append(probe_row(kind, P, nbytes, per_call.tolist()))
    if len(rows) >= 2:
      fits[kind] = fit(kind, P, rows)
    else:
      logging.warning("probe: %s measured at fewer than 2 sizes; no fit", kind)
  probe = probe_results.Probe(workers=P, dtype="float32", link_capacity_bps=capacity, collectives=fits,
                              reduce_cost=cost)
  print(format_table(probe))
  print(f"# probe took {time.time() - t0:.1f} s")
  if FLAGS.out:
    probe_results.write_probe(FLAGS.out, probe)
    cost_path = FLAGS.reduce_cost_out or os.path.splitext(FLAGS.out)[0] + ".reduce_cost.log"
    cost_tables.write_cost_table(cost_path, cost, comment="jitted float32 a + b on one process (netanalysis probe): "
                              "bytes per buffer, seconds")
    print(f"wrote {FLAGS.out} and {cost_path}")
  sys.stdout.flush()
  return 0
