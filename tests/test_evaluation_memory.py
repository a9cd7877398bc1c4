"""Evaluation's samples per call within a memory bound (``--eval_memory_mb``): the planned rows against XLA's own
count of the temporaries of the program compiled at those rows (``memory_analysis``), for both index kinds."""

import functools

import jax
import jax.numpy as jnp
import pytest

from sparsejax import inference, model
from sparsejax.model_config import ModelConfig
from sparsejax.settings import override

N, F = 60_000, 1_000


def _exact_temp_bytes(config: ModelConfig, rows: int) -> int:
  state = jax.eval_shape(functools.partial(model.init, jax.random.key(0), config))
  fi, fv = jax.ShapeDtypeStruct((rows, 32), jnp.int32), jax.ShapeDtypeStruct((rows, 32), jnp.float32)
  program = jax.jit(functools.partial(inference.predict_exact, top=5))
  return program.lower(state, fi, fv).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("candidates,settings,ks", [
    ("clusters", {}, (20_000,)),
    ("clusters", {"eval_num_clusters": 8_000}, (4_000, 1_000)),
    ("lsh", {}, (20_000,)),  # re-ranks 8 x k of the ids found (--lsh_rerank=8)
    ("lsh", {"lsh_rerank": 0}, (4_000,)),  # a fixed part: the rows centred for the query, O(N d)
])
def test_planned_rows_keep_the_compiled_temporaries_within_the_bound(candidates, settings, ks):
  memory = 96 << 20
  config = override(ModelConfig(F, N), hidden_dims=(64,), candidates=candidates, **settings)
  rows = inference.rows_within(config, memory, ks)
  assert rows & (rows - 1) == 0 and 1 <= rows <= inference.MAX_ROWS_PER_CALL
  assert inference.temp_bytes(config, ks, rows) <= memory
  if rows < inference.MAX_ROWS_PER_CALL:  # not needlessly few: 4x the rows would not fit
    assert inference.temp_bytes(config, ks, 4 * rows) > memory


def test_exact_evaluations_keep_their_bound():
  config = override(ModelConfig(F, N), hidden_dims=(128,))
  rows = inference.rows_within(config, 64 << 20)
  assert rows == 512 == (64 << 20) // inference.EXACT_ROW_BYTES
  assert _exact_temp_bytes(config, rows) <= 64 << 20
  assert inference.rows_within(config, 512 << 20) == inference.MAX_ROWS_PER_CALL
  assert _exact_temp_bytes(config, inference.MAX_ROWS_PER_CALL) <= 512 << 20


def test_rows_follow_the_bound_and_a_shard_plans_for_every_candidate():
  config = override(ModelConfig(F, 400_000), hidden_dims=(32,), candidates="clusters")
  k = config.serving_k  # 10,000: (N / 4000)^2
  one = inference.rows_within(config, 32 << 20, (k,))
  assert inference.rows_within(config, 128 << 20, (k,)) >= 2 * one
  assert inference.rows_within(config, 1, (k,)) == 1
  # A shard of a clustered index has room for all k candidates (the best clusters may all be its own): its
  # program over a quarter of the rows is counted at k, not k / 4, and takes as many samples per call.
  sharded = override(config, num_shards=4)
  assert inference.temp_bytes(sharded, (k,), 64) >= 0.8 * inference.temp_bytes(config, (k,), 64)
  assert inference.rows_within(sharded, 32 << 20, (k,)) == one


def test_a_call_that_fits_at_the_most_rows_compiles_one_program(monkeypatch):
  """Where every sample per call fits (most runs), XLA counts one program, not the two that place the line, and the
  answer is the one the line gives."""
  config = override(ModelConfig(F, 4_000), hidden_dims=(32,), candidates="clusters")
  ks, memory = (config.serving_k,), 512 << 20
  counted = []
  counter = inference._temp_bytes_counter

  def spy(*args, **kwargs):
    count = counter(*args, **kwargs)
    return lambda rows: counted.append(rows) or count(rows)
  monkeypatch.setattr(inference, "_temp_bytes_counter", spy)
  assert inference.rows_within(config, memory, ks) == inference.MAX_ROWS_PER_CALL
  assert counted == [inference.MAX_ROWS_PER_CALL]
  small, large = (inference.temp_bytes(config, ks, rows) for rows in inference.PROBE_ROWS)
  per_row = (large - small) / (inference.PROBE_ROWS[1] - inference.PROBE_ROWS[0])
  assert small + per_row * (inference.MAX_ROWS_PER_CALL - inference.PROBE_ROWS[0]) <= memory  # the line agrees
  # Too little memory for that many: the line is placed, and the rows it gives are checked.
  tight = inference.temp_bytes(config, ks, 256)
  counted.clear()
  assert inference.rows_within(config, tight, ks) == 256
  assert counted[:3] == [inference.MAX_ROWS_PER_CALL, *inference.PROBE_ROWS]
