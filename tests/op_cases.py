"""Runs op cases in a subprocess and checks each against a NumPy reference (not a test module).

Usage: ``python tests/op_cases.py CASES.json [FIRST]``. Each case is a dict made by
tests/test_fuzz_ops.py (or tests/test_ffi.py): an op, sizes, how its ids and
values are drawn, an optional corruption of one argument, and a transform
(eager, jit or vmap). For each case this prints ``start <i>`` before running
it and one JSON line with its outcome after, so that the parent can name the
case that crashed the process. Outcomes:

* ``ok``: a valid case whose result equals the reference;
* ``error``: an invalid case that raised an exception naming the op and
  the argument;
* ``fail``: anything else (a wrong result, an unexpected or badly named
  error, no error where one was due), with the reason.

Values are drawn from small dyadic numbers, so that float32 sums are exact
whatever their order and the references can demand (nearly) exact results.
"""

import json
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from references import (
  adam_ref,
  dwta_ref,
  f64,
  gather_combine_ref,
  gather_dot_ref,
  insert_ref,
  query_ref,
  scatter_rows_ref,
  simhash_ref,
  topk_ref,
)

from sparsejax import _ffi, inference, ops, optim
from sparsejax.index import lsh, tables

VALUES = np.array([-2.0, -1.0, -0.5, 0.0, 0.0, 0.5, 1.0, 2.0], np.float32)
NONFINITE = np.array([np.nan, np.inf, -np.inf], np.float32)
OTHER_DTYPE = {"float32": ("int32", "float16", "bfloat16", "uint32"), "int32": ("float32", "uint32", "int16", "int8"),
               "uint32": ("int32", "float32"), "bfloat16": ("float32", "float16")}


class CaseFailure(Exception):
  """The case's outcome is wrong."""


# --- Drawing arrays ------------------------------------------------------------


def floats(rng, shape, nonfinite):
  x = rng.choice(VALUES, size=shape).astype(np.float32)
  if nonfinite and x.size:
    hit = rng.random(shape) < 0.25
    x[hit] = rng.choice(NONFINITE, size=int(hit.sum()))
  return x


def ids_array(rng, shape, n, mode, bad_value):
  """Ids in [0, n), with padding (-1) for mode 'pad', one bad id for mode 'bad'."""
  ids = rng.integers(0, max(n, 1), size=shape).astype(np.int32) if n > 0 else np.full(shape, -1, np.int32)
  if mode in ("pad", "bad") and ids.size:
    ids[rng.random(shape) < 0.3] = -1
  if mode == "bad" and ids.size:
    ids.flat[rng.integers(ids.size)] = bad_value
  return ids


def has_bad_ids(ids, n):
  """Whether ids hold anything but [0, n) and the padding -1."""
  ids = np.asarray(ids)
  return bool(((ids < -1) | (ids >= n)).any())


def corrupt(rng, x, kind, name=""):
  """(x with a wrong dtype, rank or size, the axis grown by one for kind 'size')."""
  x = np.asarray(x)
  if kind == "dtype":
    # A weight may be bfloat16 (the ops that take one accept float32 and bfloat16 weights).
    other = [t for t in OTHER_DTYPE[x.dtype.name] if not (name == "weight" and t == "bfloat16")]
    return x.astype(jnp.dtype(rng.choice(other))), None
  if kind == "rank":
    return (x[None] if x.ndim == 0 or rng.random() < 0.5 else x[..., None]), None
  axis = int(rng.integers(x.ndim))
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, 1)
  return (np.pad(x, pad, mode="edge") if x.shape[axis] else np.pad(x, pad)), axis


def cot_for(shape):
  """A fixed cotangent for outputs of this shape."""
  return np.resize(np.array([1.0, -0.5, 2.0, -1.0, 0.5], np.float32), shape)


# --- Comparing -------------------------------------------------------------------


def assert_close(got, want, rtol, atol, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    raise CaseFailure(f"{what}: shape {got.shape}, reference {want.shape}")
  if not np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True) or (np.isnan(got) != np.isnan(want)).any():
    bad = np.argwhere(~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True))[:3].tolist()
    raise CaseFailure(f"{what} differs from the reference at {bad}: {got.ravel()[:8]} vs {want.ravel()[:8]}")


def assert_equal(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape or not np.array_equal(got, want):
    raise CaseFailure(f"{what} differs from the reference: {got.ravel()[:12]} vs {want.ravel()[:12]}")


# --- Cases -----------------------------------------------------------------------
#
# A case type defines: the arguments' shape symbols (for size corruptions),
# build(c, rng) -> dict of arguments, call(c, args) -> outputs, and
# check(c, args, outputs) raising CaseFailure. `batched` names the arguments
# that vmap maps over.


class Op:
  name = ""
  ops = ()  # op names an error may start with
  shapes: dict = {}  # corruptible argument -> shape symbols
  batched = ()  # arguments vmap maps over
  aliases: dict = {}  # argument -> other names an error may give it (e.g. a kernel's)

  def shapes_for(self, c):
    return self.shapes

  def fixed_symbols(self, c):
    """Symbols whose size is fixed by something not in `shapes` -> names an error may quote."""
    return {}

  def dtype_ok(self, c, arg, dtype):
    """Whether the op accepts `arg` with this other dtype (promotion)."""
    return False

  def invalid(self, c, args):
    """The names one of which an error must quote, or None for a valid case."""
    return None

  def may_skip(self, c, args):
    """Whether XLA may skip the kernel (its result is empty), so that invalid ids go unnoticed."""
    return False


def names_for(op, c, args, axis, new_dtype):
  """Names an error must quote (one of) for the case's corruption; None if none is due."""
  arg, kind = c["corrupt"]
  names = lambda a: {a} | set(op.aliases.get(a, ()))
  if kind == "rank" or (kind == "dtype" and not op.dtype_ok(c, arg, new_dtype)):
    return names(arg)
  if kind == "dtype":
    return None
  # A size error is due when the grown axis shares its symbol with another argument.
  shapes = op.shapes_for(c)
  symbol = shapes[arg][axis]
  sharing = {a for a, s in shapes.items() if symbol in s and args.get(a) is not None}
  fixed = op.fixed_symbols(c).get(symbol, set())
  if len(sharing) > 1 or fixed:
    return set().union(*(names(a) for a in sharing)) | fixed
  return None


class GatherDot(Op):
  name, ops = "gather_dot", ("gather_dot",)
  shapes = {"x": ("B", "d"), "weight": ("N", "d"), "ids": ("B", "k"), "bias": ("N",)}
  batched = ("x", "ids")

  def build(self, c, rng):
    nf = c["values"] == "nonfinite"
    return dict(x=floats(rng, (c["B"], c["d"]), nf), weight=floats(rng, (c["N"], c["d"]), nf),
                ids=ids_array(rng, (c["B"], c["k"]), c["N"], c["ids"], c["bad_id"]),
                bias=floats(rng, (c["N"],), nf) if c.get("bias") else None)

  def invalid(self, c, a):
    return {"ids"} if has_bad_ids(a["ids"], len(a["weight"])) else None

  def call(self, c, a):
    return ops.gather_dot(a["x"], a["weight"], a["ids"], a["bias"])

  def reference(self, c, a):
    return gather_dot_ref(a["x"], a["weight"], a["ids"], a["bias"])

  def check(self, c, a, out):
    assert_close(out, self.reference(c, a), 1e-6, 1e-6, "out")


class GatherCombine(GatherDot):
  name, ops = "gather_combine", ("gather_combine",)
  shapes = {"g": ("B", "k"), "weight": ("N", "d"), "ids": ("B", "k")}
  batched = ("g", "ids")

  def build(self, c, rng):
    nf = c["values"] == "nonfinite"
    return dict(g=floats(rng, (c["B"], c["k"]), nf), weight=floats(rng, (c["N"], c["d"]), nf),
                ids=ids_array(rng, (c["B"], c["k"]), c["N"], c["ids"], c["bad_id"]))

  def may_skip(self, c, a):
    return a["weight"].shape[-1] == 0

  def call(self, c, a):
    return ops.gather_combine(a["g"], a["weight"], a["ids"])

  def check(self, c, a, out):
    if self.may_skip(c, a):
      assert_equal(np.shape(out), (len(a["ids"]), 0), "shape of out")
      return
    assert_close(out, gather_combine_ref(a["g"], a["weight"], a["ids"]), 1e-6, 1e-6, "out")


class SparseLogits(GatherDot):
  """Forward and VJP (h, weight, bias) against dense references."""
  name, ops = "sparse_logits", ("sparse_logits",)
  shapes = {"h": ("B", "d"), "weight": ("N", "d"), "bias": ("N",), "ids": ("B", "k")}
  batched = ("h", "ids")

  def build(self, c, rng):
    a = super().build(c, rng)
    a["h"] = a.pop("x")
    a["bias"] = floats(rng, (c["N"],), c["values"] == "nonfinite")
    return a

  def call(self, c, a):
    def loss(h, w, b):
      logits = ops.sparse_logits(h, w, b, a["ids"])
      return jnp.sum(logits * cot_for(logits.shape))
    out = ops.sparse_logits(a["h"], a["weight"], a["bias"], a["ids"])
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a["h"], a["weight"], a["bias"])  # jit: compiles once

  def check(self, c, a, out):
    logits, (dh, dw, db) = out
    ids, N = a["ids"], len(a["weight"])
    assert_close(logits, gather_dot_ref(a["h"], a["weight"], ids, a["bias"]), 1e-6, 1e-6, "logits")
    cot = np.where(ids >= 0, cot_for(ids.shape), 0.0)
    assert_close(dh, gather_combine_ref(cot, a["weight"], ids), 1e-6, 1e-6, "dh")
    assert_close(dw, scatter_rows_ref(ids, cot, a["h"], N), 1e-6, 1e-6, "dweight")
    assert_close(db, scatter_rows_ref(ids, cot, np.ones((len(ids), 1)), N)[:, 0], 1e-6, 1e-6, "dbias")


class EmbeddingBag(Op):
  """Forward and VJP (feat_vals, weight, bias)."""
  name, ops = "embedding_bag", ("embedding_bag",)
  shapes = {"feat_ids": ("B", "F"), "feat_vals": ("B", "F"), "weight": ("num_features", "d"), "bias": ("d",)}
  batched = ("feat_ids", "feat_vals")

  def build(self, c, rng):
    nf = c["values"] == "nonfinite"
    return dict(feat_ids=ids_array(rng, (c["B"], c["k"]), c["N"], c["ids"], c["bad_id"]),
                feat_vals=floats(rng, (c["B"], c["k"]), nf), weight=floats(rng, (c["N"], c["d"]), nf),
                bias=floats(rng, (c["d"],), nf))

  def invalid(self, c, a):
    return {"feat_ids"} if has_bad_ids(a["feat_ids"], len(a["weight"])) else None

  def call(self, c, a):
    def loss(v, w, b):
      out = ops.embedding_bag(a["feat_ids"], v, w, b)
      return jnp.sum(out * cot_for(out.shape))
    out = ops.embedding_bag(a["feat_ids"], a["feat_vals"], a["weight"], a["bias"])
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a["feat_vals"], a["weight"], a["bias"])

  def check(self, c, a, out):
    y, (dv, dw, db) = out
    fids, vals = a["feat_ids"], a["feat_vals"]
    cot = cot_for((len(fids), a["weight"].shape[1]))
    with np.errstate(all="ignore"):
      assert_close(y, gather_combine_ref(vals, a["weight"], fids) + f64(a["bias"]), 1e-6, 1e-6, "out")
      assert_close(dv, np.where(fids >= 0, gather_dot_ref(cot, a["weight"], fids), 0.0), 1e-6, 1e-6, "dvals")
      assert_close(dw, scatter_rows_ref(fids, vals, cot, len(a["weight"])), 1e-6, 1e-6, "dweight")
      assert_close(db, f64(cot).sum(0), 1e-6, 1e-6, "dbias")


def make_lsh(c):
  """Hash functions of the case's family and sizes, drawn in NumPy (init_lsh would compile for every size)."""
  cfg = lsh.LSHConfig(c["family"], c["L"], c["K"])
  rng = np.random.default_rng(c["seed"] + 7)
  L, K, d = c["L"], c["K"], c["d"]
  if c["family"] == "simhash":
    return lsh.SimHashParams(rng.choice(np.float32([-1, 0, 0, 1]), size=(L, K, d))), cfg
  bins = K // int(np.log2(cfg.bin_size))
  return lsh.DWTAParams(rng.integers(0, d, size=(L, bins, cfg.bin_size)).astype(np.int32),
                        np.uint32(rng.integers(2**32))), cfg


def codes_ref(params, x):
  if isinstance(params, lsh.SimHashParams):
    return simhash_ref(params.projections, x)
  return dwta_ref(np.asarray(params.bin_idx), params.seed, x)


class Hashed(Op):
  """An op that hashes its inputs (the d of SimHash functions is fixed; DWTA reads any d above its dims)."""

  def fixed_symbols(self, c):
    return {"d": {"projections"}} if c["family"] == "simhash" else {}


class LshHash(Hashed):
  name, ops = "lsh_hash", ("lsh_hash",)
  shapes = {"x": ("B", "d")}
  batched = ("x",)

  def build(self, c, rng):
    params, _ = make_lsh(c)
    a = dict(x=floats(rng, (c["B"], c["d"]), c["values"] == "nonfinite"), params=params)
    if c["ids"] == "bad" and c["family"] == "dwta":  # a bin reading a dim the input does not have
      idx = np.array(params.bin_idx)
      idx.flat[rng.integers(idx.size)] = c["bad_id"] if c["bad_id"] < 0 or c["bad_id"] >= c["d"] else c["d"]
      a["params"] = params._replace(bin_idx=idx)
    return a

  def invalid(self, c, a):
    return {"bin_idx"} if c["ids"] == "bad" and c["family"] == "dwta" else None

  def may_skip(self, c, a):
    return len(a["x"]) == 0

  def call(self, c, a):
    return lsh.lsh_hash(a["params"], a["x"])

  def check(self, c, a, out):
    assert_equal(out, codes_ref(a["params"], a["x"]), "codes")


class BuildTables(Hashed):
  """build_tables then insert_rows, against the insertion reference."""
  name, ops = "build_tables", ("build_tables", "insert_rows", "lsh_tables_insert", "lsh_hash")
  shapes = {"weight": ("N", "d_weight"), "rows": ("n", "d_rows"), "ids": ("n",)}  # two calls: d may differ
  batched = ("weight",)

  def fixed_symbols(self, c):
    return {"d_weight": {"projections"}, "d_rows": {"projections"}} if c["family"] == "simhash" else {}

  def build(self, c, rng):
    params, cfg = make_lsh(c)
    nf = c["values"] == "nonfinite"
    n = c["k"]
    return dict(params=params, cfg=cfg, weight=floats(rng, (c["N"], c["d"]), nf), rows=floats(rng, (n, c["d"]), nf),
                ids=ids_array(rng, (n,), c["N"], c["ids"], c["bad_id"]))

  def invalid(self, c, a):
    return {"ids"} if has_bad_ids(a["ids"], c["N"]) else None

  def call(self, c, a):
    t = tables.init_tables(a["cfg"], c["S"], policy=c["policy"], seed=c["seed"])
    t = tables.build_tables(t, a["params"], a["weight"], num_valid=c["num_valid"])
    t2 = tables.insert_rows(t, a["params"], a["rows"], a["ids"], c["N"])
    return t.buckets, t.counts, t2.buckets, t2.counts

  def check(self, c, a, out):
    p, N = a["params"], len(a["weight"])
    codes = codes_ref(p, a["weight"])
    nv = N if c["num_valid"] is None else c["num_valid"]
    ids = np.where(np.arange(N) < nv, np.arange(N), -1)
    L, NB = c["L"], 2 ** c["K"]
    b, n = insert_ref(np.full((L, NB, c["S"]), -1), np.zeros((L, NB), np.int64), codes, ids, c["seed"], c["policy"],
                      True)
    assert_equal(out[0], b, "built buckets")
    assert_equal(out[1], n, "built counts")
    b, n = insert_ref(b, n, codes_ref(p, a["rows"]), a["ids"], c["seed"], c["policy"], False)
    assert_equal(out[2], b, "buckets after insert")
    assert_equal(out[3], n, "counts after insert")


class LshQuery(Hashed):
  name, ops = "lsh_query", ("lsh_query", "lsh_hash")
  shapes = {"queries": ("B", "d"), "labels": ("B", "max_labels")}
  batched = ("queries", "labels")

  def build(self, c, rng):
    params, _ = make_lsh(c)
    L, NB, S = c["L"], 2 ** c["K"], c["S"]
    W = floats(rng, (c["N"], c["d"]), False)
    buckets, counts = insert_ref(np.full((L, NB, S), -1), np.zeros((L, NB)), codes_ref(params, W), np.arange(c["N"]),
                                 c["seed"], c["policy"], True)
    t = tables.HashTables(jnp.asarray(buckets, jnp.int32), jnp.asarray(counts, jnp.int32), jnp.uint32(c["seed"]),
                          c["policy"])
    labels = ids_array(rng, (c["B"], c["max_labels"]), c["N"], c["ids"], c["bad_id"])
    return dict(params=params, tables=t, queries=floats(rng, (c["B"], c["d"]), c["values"] == "nonfinite"),
                labels=labels)

  def invalid(self, c, a):
    # (Too many distinct labels for k is known once run: see run_case.)
    bad = set()
    if not isinstance(c["k_query"], int) or not 1 <= c["k_query"] <= c["N"]:
      bad.add("k")
    if c["N"] < 1:  # a layer of no rows: a static num_rows is rejected first, by name
      bad.add("num_rows")
    if has_bad_ids(a["labels"], c["N"]):
      bad.add("labels")
    return bad or None

  def call(self, c, a):
    return tables.lsh_query(a["tables"], a["params"], a["queries"], k=c["k_query"], num_rows=c["N"],
                            labels=a["labels"], seed=c["seed"])

  def codes(self, c, a):
    return codes_ref(a["params"], a["queries"])

  def expected(self, c, a):
    t = a["tables"]
    return query_ref(np.asarray(t.buckets), np.asarray(t.counts), self.codes(c, a), np.asarray(a["labels"]),
                     np.uint32(c["seed"] % 2**32), c["N"], c["k_query"])

  def check(self, c, a, out):
    want = self.expected(c, a)
    if isinstance(want, str):
      raise CaseFailure(f"expected an error naming {want!r}, got a result")
    assert_equal(out[0], want[0], "active")
    assert_equal(out[1], want[1], "num_from_tables")


class QueryCodes(LshQuery):
  """query_codes with arbitrary (possibly out-of-range) codes and a static or traced num_rows."""
  name, ops = "query_codes", ("lsh_query",)
  shapes = {"codes": ("B", "L"), "labels": ("B", "max_labels")}
  batched = ("codes", "labels")

  def fixed_symbols(self, c):
    return {"L": {"tables.buckets"}}

  def build(self, c, rng):
    a = super().build(c, rng)
    codes = rng.integers(0, 2 ** c["K"], size=(c["B"], c["L"])).astype(np.int32)
    if c["bad_code"] is not None and codes.size:
      codes.flat[rng.integers(codes.size)] = c["bad_code"]
    a["codes"] = codes
    return a

  def invalid(self, c, a):
    bad = super().invalid(c, a) or set()
    if c["bad_code"] is not None and a["codes"].size:
      bad.add("codes")
    return bad or None

  def call(self, c, a):
    num_rows = jnp.int32(c["N"]) if c["traced_num_rows"] else c["N"]
    return tables.query_codes(a["tables"], a["codes"], k=c["k_query"], num_rows=num_rows, labels=a["labels"],
                              seed=c["seed"])

  def codes(self, c, a):
    return np.asarray(a["codes"])


class RowSparseAdam(Op):
  """apply_row_sparse_adam on a weight (Adam or row-wise), a bias, or a (weight, bias) pair, from a random state."""
  name, ops = "row_sparse_adam", ("row_sparse_adam",)
  batched = ("weight", "mu", "nu", "bias", "bias_mu", "bias_nu")
  aliases = {"grad.ids": ("ids",), "mu": ("state.mu", "state.nu"), "nu": ("state.nu", "state.mu"),
             "weight": ("state.mu", "state.nu"), "bias": ("bias state.mu", "bias state.nu")}

  def shapes_for(self, c):
    if c["layout"] == "vector":
      return {"weight": ("N",), "mu": ("N",), "nu": ("N",), "grad.ids": ("B", "k"), "grad.g": ("B", "k"),
              "grad.x": ("B", 1)}
    shapes = {"weight": ("N", "d"), "mu": ("N", "d"), "nu": ("N",) if c["layout"] == "rowwise" else ("N", "d"),
              "grad.ids": ("B", "k"), "grad.g": ("B", "k"), "grad.x": ("B", "d")}
    return {**shapes, "bias": ("N",)} if c["layout"] == "pair" else shapes

  def build(self, c, rng):
    nf = c["values"] == "nonfinite"
    d = 1 if c["layout"] == "vector" else c["d"]
    wshape = (c["N"],) if c["layout"] == "vector" else (c["N"], d)
    md = jnp.dtype(c["moments"])
    a = dict(weight=floats(rng, wshape, nf), mu=floats(rng, wshape, False).astype(md),
             nu=np.abs(floats(rng, wshape[:1] if c["layout"] == "rowwise" else wshape, False)).astype(md),
             bias=floats(rng, (c["N"],), nf) if c["layout"] == "pair" else None,
             **{"grad.ids": ids_array(rng, (c["B"], c["k"]), c["N"], c["ids"], c["bad_id"]),
                "grad.g": floats(rng, (c["B"], c["k"]), nf), "grad.x": floats(rng, (c["B"], d), nf)})
    if a["bias"] is not None:
      a["bias_mu"] = floats(rng, (c["N"],), False).astype(md)
      a["bias_nu"] = np.abs(floats(rng, (c["N"],), False)).astype(md)
    return a

  def invalid(self, c, a):
    h = c["hyper"]
    bad = {n for n in ("b1", "b2") if not 0 <= h[n] < 1} | ({"eps"} if not 0 <= h["eps"] < math.inf else set())
    bad |= {n for n in ("learning_rate", "weight_decay") if not math.isfinite(h[n])}
    if has_bad_ids(a["grad.ids"], c["N"]):
      bad |= {"ids", "grad.ids"}
    if c["count"] < 0:
      bad.add("count")
    return bad or None

  def may_skip(self, c, a):
    # Every result empty: XLA need not run the kernel.
    return np.size(a["weight"]) == 0 and (a["bias"] is None or np.size(a["bias"]) == 0) and np.size(a["grad.ids"]) == 0

  def call(self, c, a):
    h = c["hyper"]
    count = jnp.int32(c["count"])
    state = optim.RowSparseAdamState(count, a["mu"], a["nu"])
    params = a["weight"]
    if a["bias"] is not None:
      state = (state, optim.RowSparseAdamState(count, a["bias_mu"], a["bias_nu"]))
      params = (a["weight"], a["bias"])
    grad = ops.RowSparseGrad(a["grad.ids"], a["grad.g"], a["grad.x"])
    return optim.apply_row_sparse_adam(params, state, grad, h["learning_rate"], b1=h["b1"], b2=h["b2"],
                                       eps=h["eps"], weight_decay=h["weight_decay"], combine=c.get("combine", False))

  def check(self, c, a, out):
    new_params, new_state, touched = out[:3]
    if c.get("combine", False):  # the weight's rows before the update, combined by g
      weight = np.asarray(a["weight"])
      weight = weight if weight.ndim == 2 else weight[:, None]  # a vector layout is a weight of width 1
      assert_close(out[3], gather_combine_ref(a["grad.g"], weight, a["grad.ids"]), 1e-4, 1e-5, "combined")
    h = c["hyper"]
    pair = a["bias"] is not None
    moments = lambda *xs: [np.asarray(x, np.float32) for x in xs]
    want, want_touched = adam_ref(
        a["weight"], *moments(a["mu"], a["nu"]), c["count"], a["grad.ids"], a["grad.g"], a["grad.x"],
        h["learning_rate"], h["b1"], h["b2"], h["eps"], h["weight_decay"], a["bias"],
        *(moments(a["bias_mu"], a["bias_nu"]) if pair else ()))
    got = ([new_params[0], new_state[0].mu, new_state[0].nu, new_params[1], new_state[1].mu, new_state[1].nu]
           if pair else [new_params, new_state.mu, new_state.nu])
    mrtol = 1e-5 if c["moments"] == "float32" else 2.0**-7  # bfloat16: stochastic rounding, < 1 ulp
    for i, (g, w) in enumerate(zip(got, want)):
      tol = (1e-4, 1e-5) if i % 3 == 0 else (mrtol, 1e-6)
      assert_close(np.asarray(g, np.float32), w, *tol, ["weight", "mu", "nu", "bias", "bias_mu", "bias_nu"][i])
    assert_equal(touched, want_touched, "touched")


class ExactTopk(Op):
  name, ops = "exact_topk", ("exact_topk",)
  shapes = {"h": ("B", "d"), "weight": ("N", "d"), "bias": ("N",)}
  batched = ("h",)

  def dtype_ok(self, c, arg, dtype):
    return arg != "weight" or jnp.issubdtype(dtype, jnp.floating)  # h and bias are promoted

  def build(self, c, rng):
    nf = c["values"] == "nonfinite"
    return dict(h=floats(rng, (c["B"], c["d"]), nf), weight=floats(rng, (c["N"], c["d"]), nf),
                bias=floats(rng, (c["N"],), nf) if c["bias"] else None)

  def invalid(self, c, a):
    k = c["k_topk"]
    if not isinstance(k, int) or not 1 <= k <= len(a["weight"]):
      return {"k"}
    return {"row_chunk"} if c["row_chunk"] < 1 else None

  def call(self, c, a):
    return inference.exact_topk(a["h"], a["weight"], a["bias"], c["k_topk"], row_chunk=c["row_chunk"],
                              sample_chunk=c["sample_chunk"])

  def check(self, c, a, out):
    scores, ids = out
    want_s, want_i = topk_ref(a["h"], a["weight"], a["bias"], c["k_topk"])
    assert_equal(ids, want_i, "ids")
    assert_close(scores, want_s, 0, 0, "scores")


OPS = {op.name: op for op in (GatherDot(), GatherCombine(), SparseLogits(), EmbeddingBag(), LshHash(), BuildTables(),
                              LshQuery(), QueryCodes(), RowSparseAdam(), ExactTopk())}


def run_raw(c):
  """A handler called directly with the given buffers (tests/test_ffi.py)."""
  args = [np.full(shape, fill[0] if fill else 0, jnp.dtype(dtype)) for shape, dtype, *fill in c["args"]]
  results = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)) for shape, dtype, *_ in c["results"]]
  results = results if len(results) > 1 else results[0]
  attrs = {name: value if dtype == "str" else getattr(np, dtype)(value)
           for name, (dtype, value) in c.get("attrs", {}).items()}
  if c.get("checked", True):
    call = _ffi.ffi_call(c["target"], results)
  else:  # bypassing sparsejax._ffi's checks: only the handler stands guard
    _ffi.ensure_registered()
    call = jax.ffi.ffi_call(f"sparsejax_{c['target']}", results)
  try:
    jax.block_until_ready(call(*args, **attrs))
  except Exception as e:  # noqa: BLE001 - any exception is an outcome to check
    return "error", str(e).split("\n--------------------")[0][:800]
  return "ok", None


def call_transformed(c, op, samples):
  """Runs op.call under the case's transform. vmap maps over op.batched, stacking the samples."""
  args = samples[0]
  arrays = {k: v for k, v in args.items() if isinstance(v, np.ndarray) and (c["transform"] == "jit" or k in op.batched)}
  if c["transform"] == "vmap":
    arrays = {k: np.stack([s[k] for s in samples]) for k in arrays}
  rest = {k: v for k, v in args.items() if k not in arrays}
  f = lambda arr: op.call(c, {**rest, **arr})
  if c["transform"] == "jit":
    return jax.jit(f)(arrays)
  if c["transform"] == "vmap":
    return jax.vmap(f)(arrays)
  return op.call(c, args)


def run_case(c):
  if c["op"] == "raw":
    return run_raw(c)
  op = OPS[c["op"]]
  rng = np.random.default_rng(c["seed"])
  args = op.build(c, rng)
  names = None
  if c.get("corrupt"):
    arg = c["corrupt"][0]
    args[arg], axis = corrupt(rng, args[arg], c["corrupt"][1], arg)
    names = names_for(op, c, args, axis, args[arg].dtype)
  invalid = op.invalid(c, args)
  if invalid is not None:
    names = (names or set()) | invalid
  samples = [args]
  if c["transform"] == "vmap":
    # A second sample: new values for the mapped arguments (same shapes and dtypes).
    other = op.build(c, np.random.default_rng(c["seed"] + 1))
    samples.append({**args, **{k: other[k] for k in op.batched if args.get(k) is not None and
                               np.shape(other[k]) == np.shape(args[k]) and other[k].dtype == args[k].dtype}})
  try:
    out = jax.block_until_ready(call_transformed(c, op, samples))
  except Exception as e:  # noqa: BLE001 - any exception is an outcome to check
    msg = str(e).split("\n--------------------")[0].strip()
    if names is None and "more distinct labels than k" in msg:
      if any(op.expected(c, s) == "labels" for s in samples):
        names = {"labels"}
    if names is None:
      raise CaseFailure(f"unexpected {type(e).__name__}: {msg[:600]}") from None
    if not any(f"'{n}'" in msg or f" {n} " in msg for n in names):
      raise CaseFailure(f"{type(e).__name__} does not name {sorted(names)}: {msg[:600]}") from None
    if not any(o in msg for o in op.ops):
      raise CaseFailure(f"{type(e).__name__} does not name the op ({op.ops}): {msg[:600]}") from None
    return "error", msg.split("\n")[0][:300]
  if names is not None and not (c.get("corrupt") is None and op.may_skip(c, args)):
    raise CaseFailure(f"expected an error naming {sorted(names)}, got a result")
  for i, s in enumerate(samples):
    op.check(c, s, jax.tree.map(lambda x, i=i: x[i], out) if c["transform"] == "vmap" else out)
  return "ok", None


def main():
  with open(sys.argv[1]) as f:
    cases = json.load(f)
  first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
  for i in range(first, len(cases)):
    print(f"start {i}", flush=True)
    start = time.perf_counter()
    try:
      status, message = run_case(cases[i])
    except CaseFailure as e:
      status, message = "fail", str(e)
    except Exception as e:  # noqa: BLE001 - a bug in the case itself is a failure too
      status, message = "fail", f"harness: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    print(json.dumps({"i": i, "status": status, "message": message, "seconds": time.perf_counter() - start}),
          flush=True)


if __name__ == "__main__":
  main()
