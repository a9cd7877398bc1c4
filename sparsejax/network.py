"""The network's parameters and forward pass, shared by SLIDE (:mod:`sparsejax.model`) and the dense baseline
(:mod:`sparsejax.dense`): sparse features -> input layer (an embedding bag) -> dense ReLU layers -> output rows.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from sparsejax import ops
from sparsejax.model_config import ModelConfig
from sparsejax.padding import PAD_ID


class SparseLayer(NamedTuple):
  """A layer whose rows are read and updated sparsely: ``w [rows, d]``, ``b``."""
  w: jax.Array
  b: jax.Array


def dense_optimizer(config: ModelConfig) -> optax.GradientTransformation:
  """optax AdamW with the model's schedule and constants (the dense layers; every layer of the dense baseline)."""
  return optax.adamw(config.schedule(), **config.adam_args())


class NetworkParams(NamedTuple):
  """The trainable parameters: ``embed``, ``hidden`` and ``out`` as in :class:`sparsejax.model.SlideState`."""
  embed: SparseLayer
  hidden: tuple
  out: SparseLayer


def init_params(rng: jax.Array, config: ModelConfig) -> NetworkParams:
  """Initial parameters (shared by the dense baseline, for like-for-like runs)."""
  config.validate()
  dims = config.hidden_dims
  k_embed, k_out, k_hidden = jax.random.split(jax.random.fold_in(rng, 0), 3)
  glorot = jax.nn.initializers.glorot_uniform()
  # A feature vector sums ~tens of input rows: rows of std 1/sqrt(d0) keep
  # the first layer's activations O(1) for L2-normalised inputs.
  embed = SparseLayer(
      jax.random.normal(k_embed, (config.num_features, dims[0]), jnp.float32) * (1.0 / math.sqrt(dims[0])),
      jnp.zeros((dims[0],), jnp.float32))
  hidden = tuple(
      (glorot(k, (dims[i], dims[i + 1]), jnp.float32), jnp.zeros((dims[i + 1],), jnp.float32))
      for i, k in enumerate(jax.random.split(k_hidden, len(dims) - 1)))
  # Random (not zero) output rows: the LSH tables need rows that hash apart.
  out = SparseLayer(
      jax.random.normal(k_out, (config.num_labels, dims[-1]), jnp.float32)
      * (config.network.init_scale / math.sqrt(dims[-1])),
      jnp.zeros((config.num_labels,), jnp.float32))
  return NetworkParams(embed, hidden, out)


# The parameters and the index are each built by one jitted program (also when init, or dense.init, runs outside
# jit). Op by op, init compiled ~100 small ops one at a time (4.5 s of a small run's start). As one program with
# the rest of the state, XLA held every temporary of the index build at once: 9.7 GB peak at N = 2·10^6, d = 128,
# against 5.6 GB op by op and 4.6 GB as these two programs.
jitted_init_params = jax.jit(init_params, static_argnums=1)


def hidden_forward(embed_w: jax.Array, dense_params, feat_ids: jax.Array, feat_vals: jax.Array,
                   embed_tap: jax.Array | None = None) -> jax.Array:
  """Sparse features to the last hidden layer's activations ``[B, d]``.

  ``embed_tap`` (zeros) is added to the input layer's pre-activation; its
  gradient is the cotangent that the input layer's row-sparse gradient needs.
  """
  embed_b, hidden = dense_params
  z = ops.embedding_bag(feat_ids, feat_vals, embed_w, embed_b)
  if embed_tap is not None:
    z = z + embed_tap
  h = jax.nn.relu(z)
  for w, b in hidden:
    h = jax.nn.relu(h @ w + b)
  return h


def input_dropout(feat_ids: jax.Array, feat_vals: jax.Array, rate: float,
                  key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inverted dropout on the input features: ``(feat_ids, feat_vals)`` ``[B, F]`` with each feature dropped with
  probability ``rate`` (its id made padding, its value 0) and the others' values divided by ``1 - rate``, so that
  the embedding bag's expectation is unchanged. A dropped feature's input row is neither read nor updated (lazy
  Adam leaves it alone, as for a feature the sample does not have): the step stays O(B F)."""
  keep = jax.random.bernoulli(key, 1.0 - rate, feat_vals.shape) & (feat_ids >= 0)
  return (jnp.where(keep, feat_ids, PAD_ID),
          jnp.where(keep, feat_vals / (1.0 - rate), 0.0).astype(feat_vals.dtype))


def dropout(config: ModelConfig, rng: jax.Array, step: jax.Array, feat_ids: jax.Array, feat_vals: jax.Array
            ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """A training step's dropout, its masks drawn from ``(rng, step)`` (the sparse and dense models share it).

  Args:
    config: ``config.network.input_dropout`` and ``.dropout`` are the rates (0: none).
    rng: ``[2]`` uint32 key data of the run (``SlideState.rng``).
    step: the step number.
    feat_ids, feat_vals: ``[B, F]`` the batch's features.

  Returns:
    ``(feat_ids, feat_vals, keep)``: the features after :func:`input_dropout`, and the ``[B, d]`` inverted-dropout
    factor (0 or ``1/(1-rate)``) to multiply the last hidden layer's activations by, or None without dropout.
  """
  key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
  if config.network.input_dropout > 0:
    feat_ids, feat_vals = input_dropout(feat_ids, feat_vals, config.network.input_dropout,
                                        jax.random.fold_in(key, 0x1d))
  keep = None
  if config.network.dropout > 0:
    keep = jax.random.bernoulli(jax.random.fold_in(key, 0x0d), 1.0 - config.network.dropout,
                                (feat_ids.shape[0], config.hidden_dims[-1]))
    keep = keep.astype(jnp.float32) / (1.0 - config.network.dropout)
  return feat_ids, feat_vals, keep
