"""Maximum inner product search (MIPS) reduced to cosine similarity (simple-LSH).

The output layer ranks rows by ``<h, w_i> + b_i``, an inner product, while
sign-random-projection hashing and spherical clustering see only angles. The
reduction of Neyshabur & Srebro (2015) makes the two agree: each row becomes
``x_i = [w_i, b_i] / M`` with ``M`` the largest such norm, completed to unit
length by one more coordinate ``sqrt(1 - |x_i|^2)``; a query becomes
``q = [h, 1] / |[h, 1]|`` with a 0 in that coordinate. Then
``<q, x_i> = (<h, w_i> + b_i) / (M |[h, 1]|)``: for each query, the cosine
ranking of the augmented rows is exactly the logit ranking.

:func:`centre_rows` first subtracts the mean row ``[w_mean, b_mean]``, as the
clustered index does: each query's logits all move by one constant, so their
ranking stays, but the direction that every trained row shares (one that the
queries point away from: the raw ``cos(h, label row)`` drifts negative in
training) is gone, and the best rows' cosines with the query become positive
(synthetic 200K labels: median 0.33 for the top row, against -0.15 uncentred).
Rows are centred at build time only; queries are augmented as before. Both
functions scale rows by a power of two (exact) before they sum them or their
squares, so that finite rows near float32's largest give the same unit rows
as any other scale.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def augment_rows(weight: jax.Array, bias: jax.Array | None = None, max_norm: jax.Array | None = None) -> jax.Array:
  """Unit-norm augmented rows ``[N, d + 2]`` (``[N, d + 1]`` without a bias).

  Args:
    weight: ``[N, d]`` rows.
    bias: optional ``[N]`` biases (appended as a coordinate).
    max_norm: ``M``, a scalar or one per row ``[N]`` (the angular serving tables: each row's own norm, so
      each row its unit direction); default: the largest row norm (rows longer than ``M`` get a completion
      coordinate of 0).

  Returns:
    ``[N, d + 2]`` float32 unit vectors (zero rows stay zero but for the
    completion coordinate, which is then 1).
  """
  x = weight if bias is None else jnp.concatenate([weight, bias[:, None]], axis=1)
  # Scaled by a power of two first (exact, so the unit rows are the same): the norms of finite rows near float32's
  # largest overflowed into inf, and every row divided by it into 0.
  exponent = largest_exponent(x)
  x = jnp.ldexp(x.astype(jnp.float32), -exponent)
  max_norm = jnp.max(jnp.linalg.norm(x, axis=1)) if max_norm is None else jnp.ldexp(max_norm, -exponent)
  x = x / jnp.reshape(jnp.maximum(max_norm, 1e-30), (-1, 1))
  completion = jnp.sqrt(jnp.maximum(1.0 - jnp.sum(x * x, axis=1, keepdims=True), 0.0))
  return jnp.concatenate([x, completion], axis=1).astype(jnp.float32)


def centre_rows(weight: jax.Array, bias: jax.Array,
                num_valid: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """``(weight - w_mean, bias - b_mean)``: rows centred on the mean of rows ``[0, num_valid)``.

  Padding rows (``>= num_valid``) become zero, so they set neither the mean nor ``M`` of :func:`augment_rows`; so
  do rows that are not finite (a diverged one), as in the clustered index: one NaN row would otherwise turn the
  mean, so every centred row, into NaN.

  Args:
    weight: ``[N, d]`` rows.
    bias: ``[N]`` biases.
    num_valid: rows below it are real (default: all); may be traced.
  """
  n = weight.shape[0]
  valid = jnp.arange(n) < (n if num_valid is None else num_valid)
  valid &= jnp.all(jnp.isfinite(weight), axis=1) & jnp.isfinite(bias)
  count = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
  w = jnp.where(valid[:, None], weight.astype(jnp.float32), 0.0)
  b = jnp.where(valid, bias.astype(jnp.float32), 0.0)
  # Summed scaled by a power of two (exact): finite rows near float32's largest overflowed the mean row into inf,
  # so every centred row into NaN. A centred value beyond float32's range is its largest.
  exponent = largest_exponent(w, b)
  w, b = jnp.ldexp(w, -exponent), jnp.ldexp(b, -exponent)
  w_mean, b_mean = jnp.sum(w, axis=0) / count, jnp.sum(b) / count
  limit = np.finfo(np.float32).max
  unscaled = lambda x: jnp.clip(jnp.ldexp(x, exponent), -limit, limit)
  return jnp.where(valid[:, None], unscaled(w - w_mean), 0.0), jnp.where(valid, unscaled(b - b_mean), 0.0)


def largest_exponent(*arrays: jax.Array) -> jax.Array:
  """``e`` with the largest finite ``|value|`` of ``arrays`` in ``[2^(e-1), 2^e)`` (0 where none is finite and
  non-zero): ``jnp.ldexp(x, -e)`` scales them exactly (a power of two) to at most 1, where sums of rows and of
  squares do not overflow.
  """
  largest = functools.reduce(jnp.maximum, [jnp.max(jnp.where(jnp.isfinite(a), jnp.abs(a), 0.0)) for a in arrays])
  return jnp.frexp(largest.astype(jnp.float32))[1]


def augment_queries(h: jax.Array, with_bias: bool = True) -> jax.Array:
  """Unit-norm augmented queries ``[B, d + 2]`` (``[B, d + 1]`` without a bias).

  Args:
    h: ``[B, d]`` queries (hidden activations).
    with_bias: whether the rows were augmented with a bias coordinate.
  """
  q = jnp.concatenate([h, jnp.ones_like(h[:, :1])], axis=1) if with_bias else h
  q = q / jnp.maximum(jnp.linalg.norm(q, axis=1, keepdims=True), 1e-30)
  return jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1).astype(jnp.float32)
