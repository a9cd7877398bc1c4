"""Maximum inner product search (MIPS) reduced to cosine similarity (simple-LSH).

The output layer ranks rows by ``<h, w_i> + b_i``, an inner product, while
sign-random-projection hashing and spherical clustering see only angles. The
reduction of Neyshabur & Srebro (2015) makes the two agree: each row becomes
``x_i = [w_i, b_i] / M`` with ``M`` the largest such norm, completed to unit
length by one more coordinate ``sqrt(1 - |x_i|^2)``; a query becomes
``q = [h, 1] / |[h, 1]|`` with a 0 in that coordinate. Then
``<q, x_i> = (<h, w_i> + b_i) / (M |[h, 1]|)``: for each query, the cosine
ranking of the augmented rows is exactly the logit ranking.
"""

import jax
import jax.numpy as jnp


def augment_rows(weight: jax.Array, bias: jax.Array | None = None, max_norm: jax.Array | None = None) -> jax.Array:
  """Unit-norm augmented rows ``[N, d + 2]`` (``[N, d + 1]`` without a bias).

  Args:
    weight: ``[N, d]`` rows.
    bias: optional ``[N]`` biases (appended as a coordinate).
    max_norm: ``M``; default: the largest row norm (rows longer than ``M``
      get a completion coordinate of 0).

  Returns:
    ``[N, d + 2]`` float32 unit vectors (zero rows stay zero but for the
    completion coordinate, which is then 1).
  """
  x = weight if bias is None else jnp.concatenate([weight, bias[:, None]], axis=1)
  if max_norm is None:
    max_norm = jnp.max(jnp.linalg.norm(x, axis=1))
  x = x / jnp.maximum(max_norm, 1e-30)
  completion = jnp.sqrt(jnp.maximum(1.0 - jnp.sum(x * x, axis=1, keepdims=True), 0.0))
  return jnp.concatenate([x, completion], axis=1).astype(jnp.float32)


def augment_queries(h: jax.Array, with_bias: bool = True) -> jax.Array:
  """Unit-norm augmented queries ``[B, d + 2]`` (``[B, d + 1]`` without a bias).

  Args:
    h: ``[B, d]`` queries (hidden activations).
    with_bias: whether the rows were augmented with a bias coordinate.
  """
  q = jnp.concatenate([h, jnp.ones_like(h[:, :1])], axis=1) if with_bias else h
  q = q / jnp.maximum(jnp.linalg.norm(q, axis=1, keepdims=True), 1e-30)
  return jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1).astype(jnp.float32)
