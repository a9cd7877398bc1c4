"""Is the dense baseline a fair one? Its step against a plain jnp + optax model of the same network.

A reviewer's first question about "sparse vs dense" ratios: is the dense side what a competent JAX user writes?
This times, back to back and interleaved, one training step of

* ``sparsejax``: ``--model=dense`` (:func:`sparsejax.dense.train_step`: full softmax, AdamW on every parameter,
  the sparse model's targets and non-finite guard), and
* ``plain``: the same network written from scratch in jnp (a gather-and-sum input layer, ReLU layers, all N
  logits, targets by a scatter of the labels, ``optax.adam``), the textbook model,

on random batches of ``--batch_size`` samples with ``--features_per_sample`` features and ``--labels_per_sample``
labels each (multi-label data is where the dense baseline's targets were once O(B·N·M)). Both steps donate their
state. Prints and writes (``--json``) the milliseconds per step and the ratio plain / sparsejax (1.0: as fast).

  python benchmarks/dense_step.py --json benchmarks/results/dense_step.json
  python benchmarks/dense_step.py --labels 200000 --features 100000 --labels_per_sample 1,310
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsejax import dense
from sparsejax.model_config import ModelConfig
from sparsejax.network import NetworkParams, init_params
from sparsejax.settings import override

import harness


def plain_init(params: NetworkParams, learning_rate: float):
  weights = {"embed": params.embed.w, "embed_b": params.embed.b, "hidden": params.hidden,
             "out": params.out.w, "out_b": params.out.b}
  return weights, optax.adam(learning_rate).init(weights)


def plain_step(state, batch, *, num_labels: int, learning_rate: float):
  """The textbook dense step: what a JAX user writes for this network."""
  weights, opt_state = state
  labels = batch["labels"]
  B = labels.shape[0]
  valid = labels >= 0
  count = jnp.maximum(jnp.sum(valid, axis=1), 1)
  targets = jnp.zeros((B, num_labels), jnp.float32).at[
      jnp.arange(B)[:, None], jnp.where(valid, labels, num_labels)].set(
      jnp.where(valid, 1.0 / count[:, None], 0.0), mode="drop")

  def loss_fn(w):
    rows = jnp.take(w["embed"], jnp.maximum(batch["feat_ids"], 0), axis=0)
    vals = jnp.where(batch["feat_ids"] >= 0, batch["feat_vals"], 0.0)
    h = jax.nn.relu(jnp.einsum("bf,bfd->bd", vals, rows) + w["embed_b"])
    for hw, hb in w["hidden"]:
      h = jax.nn.relu(h @ hw + hb)
    logits = h @ w["out"].T + w["out_b"]
    return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=1))

  loss, grads = jax.value_and_grad(loss_fn)(weights)
  updates, opt_state = optax.adam(learning_rate).update(grads, opt_state, weights)
  return (optax.apply_updates(weights, updates), opt_state), loss


def random_batch(rng, batch_size, num_features, features_per_sample, num_labels, labels_per_sample):
  return {"feat_ids": jnp.asarray(rng.integers(0, num_features, (batch_size, features_per_sample)), jnp.int32),
          "feat_vals": jnp.asarray(rng.random((batch_size, features_per_sample)), jnp.float32),
          "labels": jnp.asarray(np.stack([rng.choice(num_labels, labels_per_sample, replace=False)
                                          for _ in range(batch_size)]), jnp.int32)}


def time_steps(step, state, batches, repeats):
  """Median seconds per step over ``repeats`` passes of the batches (the state carried, as in training)."""
  times = []
  for _ in range(repeats):
    for batch in batches:
      t = time.perf_counter()
      state, out = step(state, batch)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t)
  return state, float(np.median(times))


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--labels", type=int, default=20_912, help="N (default: GCIDE cloze's)")
  parser.add_argument("--features", type=int, default=50_000)
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--features_per_sample", type=int, default=32)
  parser.add_argument("--labels_per_sample", default="1,32,310", help="comma-separated M values to time")
  parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of 4 steps each")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  lr = 3e-3
  config = override(ModelConfig(args.features, args.labels), hidden_dims=(args.hidden,), learning_rate=lr)
  rng = np.random.default_rng(0)
  rows = []
  for m in [int(x) for x in args.labels_per_sample.split(",")]:
    batches = [random_batch(rng, args.batch_size, args.features, args.features_per_sample, args.labels, m)
               for _ in range(4)]
    ours = jax.jit(functools.partial(dense.train_step, config=config), donate_argnums=0)
    plain = jax.jit(functools.partial(plain_step, num_labels=args.labels, learning_rate=lr), donate_argnums=0)
    ours_state = dense.init(jax.random.key(0), config)
    plain_state = plain_init(init_params(jax.random.key(0), config), lr)
    ours_state, _ = time_steps(ours, ours_state, batches, 1)  # compile and warm up
    plain_state, _ = time_steps(plain, plain_state, batches, 1)
    ours_s, plain_s = [], []
    for _ in range(args.repeats):  # interleaved: drift of the machine hits both alike
      ours_state, t = time_steps(ours, ours_state, batches, 1)
      ours_s.append(t)
      plain_state, t = time_steps(plain, plain_state, batches, 1)
      plain_s.append(t)
    row = {"labels_per_sample": m, "sparsejax_dense_ms": 1e3 * float(np.median(ours_s)),
           "plain_jnp_optax_ms": 1e3 * float(np.median(plain_s))}
    row["plain_over_sparsejax"] = row["plain_jnp_optax_ms"] / row["sparsejax_dense_ms"]
    rows.append(row)
    print(f"M={m:>4}: sparsejax --model=dense {row['sparsejax_dense_ms']:8.2f} ms/step, plain jnp+optax "
          f"{row['plain_jnp_optax_ms']:8.2f} ms/step: sparsejax runs at {row['plain_over_sparsejax']:.2f}x the "
          "plain model's speed", flush=True)
  harness.write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
  main()
