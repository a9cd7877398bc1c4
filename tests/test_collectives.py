"""distributed.collectives: the per-collective list of a compiled step vs independent counts (jaxpr, HLO results)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sparsejax.distributed import collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs on P virtual devices (one process) or as one rank of P processes (launcher flags in argv).
# Prints, per job and N: the compiled list, the jaxpr's collective operand bytes (an independent
# walk of the traced program) and the compiled module's operand bytes derived from result shapes.
LISTS = """
import dataclasses, json, re, sys
import numpy as np
from sparsejax.distributed import sharding
args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
sharding.initialize(args.get("coordinator_address"), int(args.get("num_processes", 1)),
                    int(args.get("process_id", 0)))
import jax, jax.extend, jax.numpy as jnp
from sparsejax import dense, model
from sparsejax.settings import override
from sparsejax.distributed import collectives
from sparsejax.model_config import ModelConfig

def jaxpr_bytes(fn, *a):
  total = 0
  def walk(jaxpr):
    nonlocal total
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
                                "reduce_scatter", "psum_invariant"):
        total += sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*a).jaxpr)
  return total

SIZES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "bf16": 2}
def hlo_result_bytes(fn, *a):
  total = 0
  for line in fn.lower(*a).compile().as_text().splitlines():
    m = re.match(r"\\s*(?:ROOT )?%\\S+ = (.*?) "
                 r"(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)\\(", line)
    if m:
      size = sum(SIZES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                 for t, dims in re.findall(r"([a-z0-9]+)\\[([0-9,]*)\\]", m.group(1)))
      group = len(re.search(r"replica_groups=\\{\\{([0-9,]*)\\}", line).group(1).split(","))
      total += size // group if m.group(2) == "all-gather" else size * group if m.group(2) == "reduce-scatter" else size
  return total

batch = {"feat_ids": jnp.zeros((24, 8), jnp.int32), "feat_vals": jnp.ones((24, 8)),
         "labels": jnp.zeros((24, 2), jnp.int32)}
out = {}
for P in ([jax.process_count()] if jax.process_count() > 1 else [2, 3]):
  mesh = sharding.make_mesh(P)
  for N in (600, 4800):
    cfg = override(ModelConfig(300, N, num_shards=P), hidden_dims=(16,), active_k=48, num_tables=4,
                   candidates="lsh")
    # Abstract states (shapes and shardings): compiling needs no initialised weights or tables.
    jobs = {"sparse": (sharding.make_train_step(cfg, mesh),
                       jax.eval_shape(lambda: sharding.init(jax.random.key(0), cfg, mesh)))}
    if N == 600:
      dcfg = dataclasses.replace(cfg, num_shards=1)
      replicated = jax.sharding.NamedSharding(mesh, sharding.P())
      jobs["dense"] = (sharding.make_dp_train_step(dcfg, mesh),
                    jax.eval_shape(jax.jit(lambda: dense.init(jax.random.key(0), dcfg), out_shardings=replicated)))
    for job, (step, state) in jobs.items():
      spec = sharding.P() if job == "sparse" else sharding.P(sharding.AXIS)
      gbatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=jax.sharding.NamedSharding(mesh, spec)), batch)
      listed = collectives.compiled_collectives(step, state, gbatch)
      out[f"{P}/{job}/{N}"] = {"list": [c.to_json() for c in listed], "jaxpr": jaxpr_bytes(step, state, gbatch),
                               "hlo": hlo_result_bytes(step, state, gbatch),
                               "collective_bytes": collectives.collective_bytes(step, state, gbatch)}
if jax.process_index() == 0:
  print("RESULT " + json.dumps(out))
"""


def _result(output: str) -> dict:
  lines = [l for l in output.splitlines() if "RESULT " in l]
  assert lines, output[-3000:]
  return json.loads(lines[-1].split("RESULT ", 1)[1])


def _virtual() -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
  out = subprocess.run([sys.executable, "-P", "-c", LISTS], env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-4000:]
  return _result(out.stdout)


def _processes(P: int, tmp_path) -> dict:
  script = tmp_path / "lists.py"
  script.write_text(LISTS)
  out = subprocess.run([sys.executable, "-P", "-m", "sparsejax.distributed.launch", "-n", str(P), sys.executable, "-P",
                        str(script)], capture_output=True, text=True, timeout=400, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  return _result(out.stdout)


def _check(result: dict, P: int):
  result = {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith(f"{P}/")}
  assert set(result) == {"sparse/600", "sparse/4800", "dense/600"}
  for key, r in result.items():
    listed = sum(c["operand_bytes"] for c in r["list"])
    assert listed == r["jaxpr"] == r["hlo"] == r["collective_bytes"] > 0, (key, listed, r)
    for c in r["list"]:
      assert c["group_size"] == P
      ring = {"all-reduce": 2 * (P - 1) / P, "all-gather": P - 1}[c["kind"]]  # all-gather: (P-1)/P of P operands
      assert c["wire_bytes"] == pytest.approx(ring * c["operand_bytes"])
  # The sparse job's collectives do not depend on N (O(batch x hidden)); the dense one's carry every gradient.
  strip = lambda lst: [{k: v for k, v in c.items() if k != "producers"} for c in lst]
  assert strip(result["sparse/600"]["list"]) == strip(result["sparse/4800"]["list"])
  assert sum(c["operand_bytes"] for c in result["sparse/600"]["list"]) <= 4 * (24 * 16 + 8 * 24 + 8)
  n_params = 300 * 16 + 16 + 600 * 16 + 600
  assert max(c["operand_bytes"] for c in result["dense/600"]["list"]) >= 4 * n_params
  # Two collectives per sparse step: the softmax partials' all-gather, then the psum of dh.
  assert [(c["kind"], c["scope"]) for c in result["sparse/600"]["list"]] == [
      ("all-gather", "softmax_reduce"), ("all-reduce", "dh_reduce")]
  assert {c["scope"] for c in result["dense/600"]["list"]} == {"forward", "grad_reduce"}


def test_lists_match_jaxpr_and_hlo_on_virtual_devices():
  result = _virtual()
  for P in (2, 3):
    _check(result, P)


@pytest.mark.parametrize("P", [2, 3])
def test_lists_match_jaxpr_and_hlo_across_processes(P, tmp_path):
  _check(_processes(P, tmp_path), P)


def test_ring_wire_bytes_closed_forms():
  S = 1200
  assert collectives.ring_wire_bytes("all-reduce", S, 4) == 2 * 3 / 4 * S
  assert collectives.ring_wire_bytes("all-gather", S, 3) == 2 / 3 * S
  assert collectives.ring_wire_bytes("reduce-scatter", S, 3) == 2 / 3 * S
  assert collectives.ring_wire_bytes("all-to-all", S, 4) == 3 / 4 * S
  assert collectives.ring_wire_bytes("collective-permute", S, 4) == S
  assert collectives.ring_wire_bytes("all-reduce", S, 1) == 0
  with pytest.raises(ValueError, match="unknown collective kind"):
    collectives.ring_wire_bytes("broadcast", S, 2)


HLO = textwrap.dedent("""\
    HloModule jit_step, is_scheduled=true

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    ENTRY %main (p0: f32[8,4], p1: s32[3]) -> f32[8,4] {
      %p0 = f32[8,4]{1,0} parameter(0)
      %p1 = s32[3]{0} parameter(1)
      %fusion.1 = (f32[8,4]{1,0}, s32[3]{0}) fusion(%p0, %p1), kind=kLoop, metadata={op_name="jit(step)/shard_map/hidden_bwd/transpose(jvp(hidden_fwd))/mul"}
      %gte = f32[8,4]{1,0} get-tuple-element(%fusion.1), index=0
      %all-reduce.3 = (f32[8,4]{1,0}, s32[3]{0}) all-reduce(%gte, %p1), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(step)/shard_map/(a/psum:b/psum)"}
      %ag = f32[32,4]{1,0} all-gather(%p0), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, metadata={op_name="jit(step)/shard_map/gather/all_gather"}
      %cp = f32[8,4]{1,0} collective-permute-start(%p0), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
      %cpd = f32[8,4]{1,0} collective-permute-done(%cp)
      ROOT %rs = f32[2,4]{1,0} reduce-scatter(%p0), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
    }
    """)  # noqa: E501 (compiled HLO lines as XLA prints them)


def test_parse_compiled_hand_written_module():
  step = collectives.parse_compiled(HLO, known_scopes=("a", "b", "gather", "hidden_bwd", "hidden_fwd"))
  assert step.module == "jit_step"
  by = {c.name: c for c in step.collectives}
  assert list(by) == ["all-reduce.3", "ag", "cp", "rs"]
  ar = by["all-reduce.3"]
  assert (ar.kind, ar.dtypes, ar.shapes, ar.operand_bytes, ar.group_size) == (
      "all-reduce", ("f32", "s32"), ((8, 4), (3,)), 8 * 4 * 4 + 12, 4)
  assert ar.scope == "a+b" and ar.producers == ("fusion.1", "p1")  # through get-tuple-element
  ag = by["ag"]
  assert (ag.kind, ag.operand_bytes, ag.result_bytes, ag.group_size) == ("all-gather", 128, 512, 4)
  assert ag.model_bytes() == 512 and ag.wire_bytes() == 3 / 4 * 512
  assert (by["cp"].kind, by["cp"].operand_bytes, by["cp"].group_size, by["cp"].wire_bytes()) == (
      "collective-permute", 128, 4, 128)
  assert (by["rs"].kind, by["rs"].operand_bytes, by["rs"].wire_bytes()) == ("reduce-scatter", 128, 3 / 4 * 128)
  assert step.scopes["fusion.1"] == "hidden_bwd"
  assert collectives.Collective.from_json(ar.to_json()) == ar


@pytest.mark.parametrize("op_name,known,scope", [
    ("jit(local_step)/shard_map/softmax_reduce/pmax", None, "softmax_reduce"),
    ("jit(f)/jit(main)/shard_map/hidden_bwd/transpose(jvp(hidden_fwd))/dot_general", None, "hidden_bwd"),
    ("jit(f)/transpose(jvp(forward))/mul", None, "forward"),
    ("jit(f)/psum", None, ""),
    ("jit(s)/shard_map/(dh_reduce/psum:dh_reduce/psum:softmax_reduce/psum)", None, "dh_reduce+softmax_reduce"),
    ("jit(s)/shard_map/lsh_query/jit(_threefry_fold_in)/train_step/while/body/add", ("lsh_query",), "lsh_query"),
    ("jit(s)/shard_map/unknown_scope/add", ("lsh_query",), ""),
])
def test_scope_of(op_name, known, scope):
  assert collectives.scope_of(op_name, known) == scope
