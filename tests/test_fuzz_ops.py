"""Fuzzing every public op: random shapes (B = 0, d = 0, N = 0 and 1, k > N), ids (-1, other negatives, >= N, int32
extremes), wrong dtypes, ranks and sizes, NaN/Inf values, eagerly and under jit and vmap.

Hypothesis draws the cases; tests/op_cases.py runs them in a subprocess (a crash fails its case, not pytest)
and compares each valid case with a NumPy reference; an invalid case must raise an error that names the op and
the argument. The number of examples is fixed and derandomized here (CI); ``--fuzz-long`` draws many more from
a random seed. The session summary reports the cases tried.
"""

import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Cases per op: 400 in all take about 40 s of CPU time (1 s per 10 cases).
EXAMPLES = 40
LONG_EXAMPLES = 1000

INT32_EXTREMES = (-(2**31), 2**31 - 1)


def mostly(valid, invalid):
  """Draws from `valid` about 7 times in 8, else from `invalid`."""
  return st.sampled_from([True] * 7 + [False]).flatmap(lambda ok: valid if ok else invalid)


@st.composite
def common(draw, args, *, N=(0, 8), d=(0, 4), k=(0, 5)) -> dict:
  """Sizes, ids, values, transform and at most one corrupted argument."""
  c = dict(B=draw(st.integers(0, 4)), k=draw(st.integers(*k)), N=draw(st.integers(*N)), d=draw(st.integers(*d)),
           ids=draw(mostly(st.sampled_from(["valid", "pad"]), st.just("bad"))),
           values=draw(st.sampled_from(["finite", "nonfinite"])),
           transform=draw(st.sampled_from(["eager", "jit", "vmap"])),
           seed=draw(st.integers(0, 2**31 - 1)))
  # A bad id: -1's neighbours, N and beyond, the int32 extremes.
  c["bad_id"] = draw(st.sampled_from([-2, -7, c["N"], c["N"] + 3, *INT32_EXTREMES]))
  c["corrupt"] = draw(mostly(st.none(), st.tuples(st.sampled_from(args), st.sampled_from(["dtype", "rank", "size"]))))
  return c


@st.composite
def lsh_params(draw, c) -> dict:
  family = draw(st.sampled_from(["simhash", "dwta"]))
  K = draw(st.integers(1, 6)) if family == "simhash" else draw(st.sampled_from([3, 6]))
  return dict(family=family, L=draw(st.integers(1, 3)), K=K, d=max(c["d"], 1) if family == "dwta" else c["d"],
              S=draw(st.integers(1, 4)), policy=draw(st.sampled_from(["fifo", "reservoir"])))


def op_case(op, args, extra=None, **sizes):
  """Cases of one op: common fields plus what `extra(draw, case)` adds."""
  @st.composite
  def case(draw):
    c = draw(common(args, **sizes))
    c["op"] = op
    if extra is not None:
      c.update(extra(draw, c))
    return c
  return case()


def _query_extra(draw, c):
  e = draw(lsh_params(c))
  N = c["N"]
  e.update(k_query=draw(mostly(st.sampled_from(sorted({1, min(2, N), N})), st.sampled_from([N + 1, 0, 2.0]))),
           max_labels=draw(st.integers(0, 3)),
           bad_code=draw(mostly(st.none(), st.sampled_from([-1, 2**e["K"], *INT32_EXTREMES]))),
           traced_num_rows=draw(st.booleans()))
  return e


def _adam_extra(draw, c):
  nan, inf = float("nan"), float("inf")
  hyper = dict(learning_rate=st.sampled_from([0.1, 0.5, 1e-3, 0.0]), b1=st.sampled_from([0.9, 0.0, 0.5]),
               b2=st.sampled_from([0.999, 0.0]), eps=st.sampled_from([1e-8, 0.0, 1e-3]),
               weight_decay=st.sampled_from([0.0, 0.1]))
  bad = dict(learning_rate=st.sampled_from([nan, inf]), b1=st.sampled_from([1.0, -0.1, nan]),
             b2=st.sampled_from([1.0, nan]), eps=st.sampled_from([-1e-8, inf]), weight_decay=st.just(nan))
  hyper = {name: draw(valid) for name, valid in hyper.items()}
  broken = draw(mostly(st.none(), st.sampled_from(sorted(bad))))
  if broken is not None:
    hyper[broken] = draw(bad[broken])
  return dict(layout=draw(st.sampled_from(["weight", "vector", "pair", "rowwise"])),
              moments=draw(st.sampled_from(["float32", "bfloat16"])),
              count=draw(mostly(st.sampled_from([0, 1, 4]), st.just(-1))), hyper=hyper, combine=draw(st.booleans()))


def _topk_extra(draw, c):
  N = c["N"]
  k_topk = draw(mostly(st.sampled_from(sorted({1, min(2, N), N})), st.sampled_from([N + 1, 0, 2.0])))
  return dict(bias=draw(st.booleans()), k_topk=k_topk,
              row_chunk=draw(mostly(st.sampled_from([1, 2, 3, 65536]), st.just(0))),
              sample_chunk=draw(st.sampled_from([None, 1, 2])))


STRATEGIES = {
    "gather_dot": op_case("gather_dot", ["x", "weight", "ids", "bias"], lambda draw, c: dict(bias=draw(st.booleans()))),
    "gather_combine": op_case("gather_combine", ["g", "weight", "ids"]),
    "sparse_logits": op_case("sparse_logits", ["h", "weight", "bias", "ids"]),
    "embedding_bag": op_case("embedding_bag", ["feat_ids", "feat_vals", "weight", "bias"]),
    "lsh_hash": op_case("lsh_hash", ["x"], lambda draw, c: draw(lsh_params(c))),
    "build_tables": op_case("build_tables", ["weight", "rows", "ids"], lambda draw, c: {
        **draw(lsh_params(c)), "num_valid": draw(st.sampled_from([None, 0, c["N"] // 2, c["N"]]))}),
    "lsh_query": op_case("lsh_query", ["queries", "labels"], _query_extra),
    "query_codes": op_case("query_codes", ["codes", "labels"], _query_extra),
    "row_sparse_adam": op_case("row_sparse_adam", ["weight", "mu", "nu", "grad.ids", "grad.g", "grad.x"],
                               _adam_extra),
    "exact_topk": op_case("exact_topk", ["h", "weight", "bias"], _topk_extra, N=(1, 12)),
}


def draw_cases(strategy, n, derandomize) -> list[dict]:
  """n examples of a strategy (drawn, not run: they run in bulk in a subprocess)."""
  cases = []

  @settings(max_examples=n, derandomize=derandomize, database=None, deadline=None,
            suppress_health_check=list(HealthCheck))
  @given(strategy)
  def collect(case):
    cases.append(case)

  collect()
  return cases


def _fix(case):
  """Drops corruptions of arguments a case does not have (e.g. the bias of gather_dot without one)."""
  if case.get("corrupt") and case["corrupt"][0] == "bias" and case.get("bias") is False:
    case["corrupt"] = None
  if case["op"] == "row_sparse_adam" and case.get("corrupt") and case["layout"] == "vector" and \
      case["corrupt"][0] == "grad.x" and case["corrupt"][1] == "size":
    case["corrupt"] = (case["corrupt"][0], "rank")
  return case


def test_every_op_on_random_inputs(op_cases, fuzz_long):
  n = LONG_EXAMPLES if fuzz_long else EXAMPLES
  cases = [_fix(c) for name, strategy in STRATEGIES.items() for c in draw_cases(strategy, n, not fuzz_long)]
  outcomes = op_cases(cases, lambda c: c["op"], timeout=3000 if fuzz_long else 600)
  by_op = collections.defaultdict(collections.Counter)
  for c, o in zip(cases, outcomes):
    by_op[c["op"]][o["status"]] += 1
  bad = [(c, o) for c, o in zip(cases, outcomes) if o["status"] not in ("ok", "error")]
  assert not bad, f"{len(bad)} of {len(cases)} cases failed; first ones:\n" + "\n\n".join(
      f"{o['status']}: {o['message']}\n  case: {c}" for c, o in bad[:8])
  # The draws reach both kinds of outcome for every op.
  assert all(t["ok"] and t["error"] for t in by_op.values()), dict(by_op)
