"""The dense baseline (sparsejax.dense) split over processes (data parallelism)."""

import json

DATA_PARALLEL_VS_ONE = """
import functools, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from sparsejax.distributed import sharding
from sparsejax import data, dense, model
from sparsejax.settings import override
from sparsejax.model_config import ModelConfig

ds = data.make_synthetic(500, 300, 40, labels_per_sample=2, seed=1)
fi, fv, lab = ds.to_padded(np.arange(32))
batch = {"feat_ids": jnp.asarray(fi), "feat_vals": jnp.asarray(fv), "labels": jnp.asarray(lab)}
mesh = sharding.make_mesh(2)
differences = []
for dropouts in ({}, {"dropout": 0.5}, {"input_dropout": 0.3}):
  cfg = override(ModelConfig(300, 40), hidden_dims=(16, 8), learning_rate=1e-2, model="dense", **dropouts)
  one, _ = jax.jit(functools.partial(dense.train_step, config=cfg))(dense.init(jax.random.key(0), cfg), batch)
  fresh = jax.jit(functools.partial(dense.init, jax.random.key(0), cfg), out_shardings=NamedSharding(mesh, P()))
  split, _ = sharding.make_dp_train_step(cfg, mesh)(fresh(),
                                                    sharding.to_global(batch, mesh, P(sharding.AXIS)))
  differences.append(max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves((one.embed, one.hidden, one.out)), jax.tree.leaves((split.embed, split.hidden, split.out)))))
print(json.dumps(differences))
"""


def test_data_parallel_step_equals_one_process_with_dropout(run_python):
  """The batch split over 2 processes takes the step one process takes, without dropout, with hidden dropout and
  with input dropout: each process drops its samples' rows of the whole batch's masks. Each drew [B / 2, ...] masks
  from the same key before, so both halves of the batch got the same masks (the weights 0.02 apart after a step)."""
  differences = json.loads(run_python(code=DATA_PARALLEL_VS_ONE, devices=2).stdout.splitlines()[-1])
  assert len(differences) == 3 and max(differences) < 1e-6, differences
