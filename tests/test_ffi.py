"""The C++ handlers as XLA sees them: typed buffers, result checks, and errors instead of crashes.

Calls that could crash the process (a wrong result shape on the old code overflowed the heap) run in a
subprocess through tests/op_cases.py, so that a crash fails a test instead of killing pytest.
"""

import subprocess
import sys
import textwrap

import pytest

from sparsejax import _ffi

# A valid call of every handler: operands and results as [shape, dtype(, fill value)], and attributes.
_ADAM = lambda moments, weight="float32": dict(
    args=[[[6, 3], weight], [[6, 3], moments], [[6, 3], moments], [[0], "float32"], [[0], moments],
          [[0], moments], [[2, 4], "int32"], [[2, 4], "float32"], [[2, 3], "float32"], [[], "float32", 0.1],
          [[], "int32", 1]],
    results=[[[6, 3], weight], [[6, 3], moments], [[6, 3], moments], [[0], "float32"], [[0], moments],
             [[0], moments], [[8], "int32"], [[2, 3], "float32"]],
    attrs=dict(b1=("float32", 0.9), b2=("float32", 0.999), eps=("float32", 1e-8), weight_decay=("float32", 0.0)))
_TABLES = [[[2, 4, 3], "int32"], [[2, 4], "int32"], [[5, 2], "int32"]]
_GATHER_DOT = lambda weight: dict(
    args=[[[2, 3], "float32"], [[4, 3], weight], [[2, 5], "int32"], [[0], "float32"]], results=[[[2, 5], "float32"]],
    attrs=dict(op=("str", "gather_dot"), ids_name=("str", "ids")))
_GATHER_COMBINE = lambda weight: dict(
    args=[[[2, 5], "float32"], [[4, 3], weight], [[2, 5], "int32"]], results=[[[2, 3], "float32"]],
    attrs=dict(op=("str", "gather_combine"), ids_name=("str", "ids")))
VALID = {
    "gather_dot": _GATHER_DOT("float32"),
    "gather_dot_bfloat16_weight": _GATHER_DOT("bfloat16"),
    "gather_combine": _GATHER_COMBINE("float32"),
    "gather_combine_bfloat16_weight": _GATHER_COMBINE("bfloat16"),
    "simhash": dict(args=[[[2, 3], "float32"], [[3, 8], "float32"]], results=[[[2, 2], "int32"]]),
    "dwta": dict(args=[[[2, 3], "float32"], [[2, 8], "int32"], [[], "uint32"]], results=[[[2, 2], "int32"]]),
    "lsh_tables_insert": dict(args=_TABLES + [[[5], "int32"], [[], "uint32"]], results=_TABLES[:2],
                              attrs=dict(policy=("int32", 0), reset=("bool_", False), num_rows=("int64", 10))),
    "lsh_query": dict(args=_TABLES + [[[5, 0], "int32"], [[], "uint32"], [[], "int32", 10]],
                      results=[[[5, 3], "int32"], [[5], "int32"]]),
    "merge_candidates": dict(args=[[[5, 4], "int32"], [[5, 0], "int32"], [[], "uint32"], [[], "int32", 10]],
                             results=[[[5, 3], "int32"], [[5], "int32"]], attrs=dict(max_from_candidates=("int64", 3))),
    "cluster_probe": dict(args=[[[5, 4], "float32"], [[5], "int32"], [[6], "int32"]], results=[[[5, 3], "int32"]],
                          attrs=dict(probes=("int64", 2))),
    "row_topk": dict(args=[[[5, 4], "float32"]], results=[[[5, 2], "float32"], [[5, 2], "int32"]],
                     attrs=dict(k=("int64", 2))),
    "logistic_regression": dict(
        args=[[[3], "int32", 0], [[0], "int32"], [[0], "float32"], [[3], "int32", 0], [[0], "int32"]],
        results=[[[2, 4], "float32"], [[2], "float32"], [[2], "int32"]],
        attrs=dict(num_features=("int64", 4), c=("float32", 1.0), tolerance=("float32", 0.1),
                   max_epochs=("int64", 5), seed=("int64", 0))),
    "row_sparse_adam_float32": _ADAM("float32"),
    "row_sparse_adam_bfloat16": _ADAM("bfloat16"),
    "row_sparse_adam_float32_bfloat16_weight": _ADAM("float32", "bfloat16"),
    "row_sparse_adam_bfloat16_bfloat16_weight": _ADAM("bfloat16", "bfloat16"),
}
# The op name that starts the handlers' messages.
OP_NAME = {"simhash": "lsh_hash[simhash]", "cluster_probe": "index_probe", "dwta": "lsh_hash[dwta]",
           **{t: "row_sparse_adam" for t in VALID if t.startswith("row_sparse_adam")},
           **{t: t.removesuffix("_bfloat16_weight") for t in VALID if t.startswith("gather")}}
OTHER_DTYPE = {"float32": "int32", "int32": "float32", "uint32": "int32", "bfloat16": "float32"}


def _raw(target, spec, checked=False):
  return dict(op="raw", target=target, checked=checked, **spec)


def _mutations(target):
  """(label, spec): the valid call with one buffer's dtype, rank or (results) shape changed."""
  spec = VALID[target]
  for kind in ("args", "results"):
    for i, (shape, dtype, *fill) in enumerate(spec[kind]):
      def changed(new, kind=kind, i=i):
        buffers = list(spec[kind])
        buffers[i] = new
        return {**spec, kind: buffers}
      yield (kind, i, "dtype"), changed([shape, OTHER_DTYPE[dtype], *fill])
      yield (kind, i, "rank"), changed([shape + [1], dtype, *fill])
      if kind == "results":  # the issue's reproduction: a result too small (or too large) for what is written
        yield (kind, i, "shape"), changed([[shape[0] + 1] + shape[1:] if shape else [1], dtype])
        if shape and shape[0] > 1:
          yield (kind, i, "shape"), changed([[shape[0] - 1] + shape[1:], dtype])


def test_signatures_cover_every_registered_handler():
  from sparsejax import _sparsejax
  assert {f"sparsejax_{t}" for t in _ffi.SIGNATURES} == set(_sparsejax.registrations())
  assert set(VALID) == set(_ffi.SIGNATURES)


@pytest.mark.parametrize("target", sorted(VALID))
def test_wrong_dtype_or_rank_is_named_before_the_handler_runs(target):
  """sparsejax._ffi names the op and the buffer for every dtype/rank mismatch, at trace time."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  sig = _ffi.SIGNATURES[target]
  for (kind, i, change), spec in _mutations(target):
    if change == "shape":
      continue
    name = (sig.args if kind == "args" else sig.results)[i].name
    args = [np.zeros(shape, jnp.dtype(dtype)) for shape, dtype, *_ in spec["args"]]
    results = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)) for shape, dtype in spec["results"]]
    word = "argument" if kind == "args" else "result"
    with pytest.raises((TypeError, ValueError), match=rf"^{target}: {word} '{name}' must have "):
      _ffi.ffi_call(target, results if len(results) > 1 else results[0])(*args)


def test_handlers_agree_with_the_signatures_and_check_result_shapes(op_cases):
  """Called directly (no Python checks), each handler accepts the valid call, XLA's decoding rejects every
  dtype/rank that SIGNATURES rejects (so the two agree), and the handler rejects every wrong result shape
  with an error naming the op and the result (issue 12, defect 2: these overflowed the heap)."""
  cases, expect = [], []
  for target in sorted(VALID):
    cases.append(_raw(target, VALID[target]))
    expect.append(("ok", None))
    sig = _ffi.SIGNATURES[target]
    for (kind, i, change), spec in _mutations(target):
      cases.append(_raw(target, spec))
      buffer = (sig.args if kind == "args" else sig.results)[i]
      if change == "shape" or (change == "rank" and len(buffer.ranks) > 1):  # checked by the handler
        word = "argument" if kind == "args" else "result"
        expect.append(("error", f"{OP_NAME.get(target, target)}: {word} '{buffer.name}' must have shape"))
      else:  # checked by XLA when it decodes the call
        expect.append(("error", f"Wrong buffer {change}"))
  outcomes = op_cases(cases, "handlers called directly")
  wrong = [(c["target"], c, o) for c, o, (status, text) in zip(cases, outcomes, expect)
           if o["status"] != status or (text is not None and text not in o["message"])]
  assert not wrong, "\n".join(f"{t}: {o['status']}: {o['message'][:300]}\n  {c}" for t, c, o in wrong[:6])


def test_kernel_errors_name_the_public_op_and_its_argument():
  """The gather kernels serve sparse_logits and embedding_bag (and their VJPs): a bad id found at run time is
  reported against the op the user called, under its argument's name."""
  import jax
  import jax.numpy as jnp

  from sparsejax import ops
  W, b = jnp.ones((30, 4)), jnp.zeros((4,))
  fids = jnp.array([[1, 30, -1]], jnp.int32)
  bag = lambda v, W: ops.embedding_bag(fids, v, W, b).sum()
  pattern = (r"embedding_bag: argument 'feat_ids' has id 30 at flat position 1 \(row 0, column 1\), "
             r"outside \[0, N = 30\)")
  with pytest.raises(Exception, match=pattern):
    jax.block_until_ready(jax.jit(jax.grad(bag, argnums=(0, 1)))(jnp.ones((1, 3)), W))
  with pytest.raises(Exception, match=r"sparse_logits: argument 'ids' has id -5"):
    jax.block_until_ready(ops.sparse_logits(jnp.ones((1, 4)), W, jnp.zeros((30,)), jnp.array([[0, -5]], jnp.int32)))


def _python(code, timeout=300, **kwargs):
  return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                        timeout=timeout, **kwargs)


def test_issue_reproduction_wrong_result_shape_is_an_exception():
  out = _python("""
      import jax, jax.numpy as j
      from sparsejax import _ffi
      _ffi.ffi_call('gather_dot', jax.ShapeDtypeStruct((1, 1), j.float32))(
          j.ones((2000, 16)), j.ones((100, 16)), j.zeros((2000, 500), j.int32), j.zeros((0,))).block_until_ready()
  """)
  assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
  assert "gather_dot: result 'out' must have shape [B, k] with B = 2000 (from 'ids'), got [1, 1]" in out.stderr


def test_issue_reproduction_out_of_memory_is_an_exception():
  """The issue's command (a query whose scratch exceeds `ulimit -v` on several threads) segfaulted. Now it
  either fits or raises an error naming the op; it never dies of a signal."""
  out = subprocess.run(
      ["bash", "-c", f"ulimit -v 2700000; exec {sys.executable} -P -c \"import jax.numpy as j;"
       "from sparsejax.index import lsh,tables as T;t=T.init_tables(lsh.LSHConfig(num_tables=1,num_bits=1),1);"
       "T.query_codes(t,j.zeros((64,1),j.int32),k=2**22,num_rows=2**23-1)[0].block_until_ready()\""],
      capture_output=True, text=True, timeout=300)
  assert out.returncode in (0, 1), (out.returncode, out.stderr[-2000:])
  if out.returncode == 1:
    assert "lsh_query: out of memory" in out.stderr or "RESOURCE_EXHAUSTED" in out.stderr, out.stderr[-2000:]


# The kernel's scratch, not XLA's result buffer, runs out: the address space is capped just above what the
# process holds once the result is allocated.
_OOM_SCRIPT = """
    import resource, sys
    import jax, jax.numpy as jnp, numpy as np
    from sparsejax.index import lsh, tables
    t = tables.init_tables(lsh.LSHConfig(num_tables=1, num_bits=1), 1)
    B, k, N = 8, 2**21, 2**22 - 1  # scratch per worker: a set of 2k ids (16 MB) and N + 4N bytes (20 MB)
    codes = jnp.zeros((B, 1), jnp.int32)
    query = jax.jit(lambda t, codes: tables.query_codes(t, codes, k=k, num_rows=N)[0])
    query(t, codes[:1, :]).block_until_ready()  # starts the thread pool
    compiled = query.lower(t, codes).compile()
    result_bytes = B * k * 4
    vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + result_bytes + 24 * 2**20,) * 2)
    try:
      compiled(t, codes).block_until_ready()
    except Exception as e:
      print("ERROR:", str(e).splitlines()[0])
      sys.exit(0)
    print("NO ERROR")
"""


def test_running_out_of_memory_in_the_kernel_is_an_error():
  """A bad_alloc in the parallel loop (on the caller's or a pool thread) becomes an error naming the op; no
  thread is left running a chunk whose frame is gone (issue 12, defect 1)."""
  out = _python(_OOM_SCRIPT)
  assert out.returncode == 0, (out.returncode, out.stdout[-500:], out.stderr[-2000:])
  assert "ERROR: RESOURCE_EXHAUSTED: lsh_query: out of memory" in out.stdout, out.stdout[-500:]
