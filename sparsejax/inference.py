"""Inference with a trained network: exact top-k over all N outputs, or over the LSH-sampled active set.

* :func:`exact_topk` / :func:`exact_topk_batches` -- exact top-k of a linear
  layer, computed in chunks of output rows so that the ``[n, N]`` logit
  matrix is never materialised.
* :func:`predict_exact` / :func:`predict_sampled` -- the top labels of a
  batch for a model state (SLIDE's or the dense baseline's).
* :func:`sampled_topk` -- the top labels among the index candidates of
  given hidden vectors, with the active set (for retrieval diagnostics).
"""

from collections.abc import Iterable, Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import model, ops, selection
from sparsejax._checks import check_int


def predict_exact(state, feat_ids: jax.Array, feat_vals: jax.Array, *, top: int = 5) -> tuple[jax.Array, jax.Array]:
  """Top ``top`` outputs over all N (chunked, never ``[B, N]``).

  Works for any state with ``embed``, ``hidden`` and ``out`` (the dense
  baseline's too).

  Returns:
    ``(scores [B, top] float32, ids [B, top] int32)``, scores descending.
  """
  return exact_topk(model.hidden(state, feat_ids, feat_vals), state.out.w, state.out.b, top)


def predict_sampled(state: model.SlideState, feat_ids, feat_vals, *, config: model.ModelConfig, top: int = 5,
                    seed: int = 0, k: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Fast inference: top ``top`` outputs among the index-sampled active set.

  Args:
    k: active neurons per sample (default: the training ``config.k``).

  Returns:
    ``(scores [B, top], ids [B, top])``, scores descending.
  """
  scores, ids, _, _ = sampled_topk(state, model.hidden(state, feat_ids, feat_vals), config=config, top=top,
                                   seed=seed, k=k)
  return scores, ids


def sampled_topk(state: model.SlideState, h: jax.Array, *, config: model.ModelConfig, top: int = 5, seed: int = 0,
                 k: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Top ``top`` outputs among the index candidates of ``h [B, d]`` (queried without labels).

  Returns:
    ``(scores [B, top], ids [B, top], active [B, k], num_from_index [B])``.
  """
  k = min(k or config.k, config.num_labels)
  active, from_index = model.query_active(state, h, config=config, k=k, num_rows=config.num_labels, seed=seed)
  logits = ops.sparse_logits(h, state.out.w, state.out.b, active)
  scores, pos = selection.row_topk(logits, top)
  return scores, jnp.take_along_axis(active, pos, axis=1), active, from_index


# Output rows scored per step by default. Smaller chunks keep more of the [n, chunk] logits in cache for the
# selection that reads them (benchmarks/exact_topk.py, N = 2e5, top 10, 2-vCPU VM: 446-452 ms for 1,024 queries
# against 538-555 with chunks of 65,536 and 517-521 with 4,096; 62-64 against 92-93 ms for 128 queries).
ROW_CHUNK = 16384


@partial(jax.jit, static_argnames=("k", "chunk", "precision"))
def _exact_topk_jit(h, weight, bias, k, chunk, precision):
  num_out = weight.shape[0]
  num_chunks = -(-num_out // chunk)
  nan = jnp.array(jnp.nan, dtype=jnp.result_type(h.dtype, weight.dtype))

  def top_k(scores):  # ties: lower index first; NaN last (the scores keep their NaNs)
    values, pos = selection.row_topk(scores.astype(jnp.float32), k)
    return values.astype(scores.dtype), pos

  def chunk_topk(c):
    # The last chunk is shifted back to stay in bounds; rows it re-reads
    # (ids < c * chunk) were already seen and are masked to NaN: they rank
    # after every number and, on ties with NaN, after the running top-k.
    start = jnp.minimum(c * chunk, num_out - chunk)
    w = jax.lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)
    logits = jnp.dot(h, w.T, precision=precision)
    if bias is not None:
      logits = logits + jax.lax.dynamic_slice_in_dim(bias, start, chunk)[None, :]
    ids = start + jnp.arange(chunk, dtype=jnp.int32)
    logits = jnp.where(ids[None, :] >= c * chunk, logits, nan)
    scores, idx = top_k(logits)  # lower index = lower id
    return scores, (start + idx).astype(jnp.int32)

  def body(c, carry):
    best_s, best_i = carry
    s, i = chunk_topk(c)
    # Running ids are all < this chunk's ids and come first, so "lower id
    # wins" holds on ties across chunks too (and a masked row, NaN, never
    # displaces one of them).
    merged_s = jnp.concatenate([best_s, s], axis=1)
    merged_i = jnp.concatenate([best_i, i], axis=1)
    top_s, pos = top_k(merged_s)
    return top_s, jnp.take_along_axis(merged_i, pos, axis=1)

  init = chunk_topk(0)
  return jax.lax.fori_loop(1, num_chunks, body, init)


def _prepare_topk_args(weight, bias, k, row_chunk):
  op = "exact_topk"
  weight = jnp.asarray(weight)
  if weight.ndim != 2 or not jnp.issubdtype(weight.dtype, jnp.floating):
    raise ValueError(f"{op}: argument 'weight' must be a float array of shape [N, d], "
                     f"got {weight.dtype} {weight.shape}")
  num_out = weight.shape[0]
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (num_out,):
      raise ValueError(f"{op}: argument 'bias' must have shape [N] = ({num_out},), got {bias.shape}")
  k = check_int(op, "k", k, 1)
  if k > num_out:
    raise ValueError(f"{op}: argument 'k' = {k} must lie in [1, N = {num_out}]")
  row_chunk = check_int(op, "row_chunk", row_chunk, 1)
  chunk = min(max(row_chunk, k), num_out)
  return weight, bias, chunk


def exact_topk_batches(
    h_batches: Iterable[np.ndarray | jax.Array],
    weight: jax.Array,
    bias: jax.Array | None,
    k: int,
    *,
    row_chunk: int = ROW_CHUNK,
    precision: jax.lax.Precision | str | None = "highest",
) -> Iterator[tuple[jax.Array, jax.Array]]:
  """Exact top-k of ``h @ weight.T + bias`` for a stream of sample batches.

  Each batch is processed by one jitted call (batches of equal shape share a
  compilation; pad the last batch yourself to avoid a recompile, or use
  :func:`exact_topk` with ``sample_chunk``).

  Args:
    h_batches: iterable of ``[b, d]`` hidden representations.
    weight: ``[N, d]`` output-layer weights.
    bias: ``[N]`` output-layer bias, or ``None``.
    k: number of outputs to keep per sample (``1 <= k <= N``).
    row_chunk: output rows scored per step; peak memory is
      ``O(b * row_chunk + b * k)`` besides the weights.
    precision: ``jnp.dot`` precision. The default ``"highest"`` gives
      true float32 products; ``None`` (backend default) lets recent GPUs
      use TF32, which is faster (~25% end to end on an H100) but can
      reorder near-tied outputs (~0.3% of top-5 ids differed in a
      670K-output test).

  Yields:
    ``(scores [b, k], ids [b, k] int32)`` per batch, scores descending.
  """
  weight, bias, chunk = _prepare_topk_args(weight, bias, k, row_chunk)
  for h in h_batches:
    yield _exact_topk_jit(jnp.asarray(h), weight, bias, int(k), chunk, precision)


def exact_topk(
    h: np.ndarray | jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    k: int,
    *,
    row_chunk: int = ROW_CHUNK,
    sample_chunk: int | None = None,
    precision: jax.lax.Precision | str | None = "highest",
) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of ``logits = h @ weight.T + bias`` without materialising ``[n, N]``.

  Output rows are scored ``row_chunk`` at a time inside a jitted
  ``fori_loop`` and merged into a running top-k, both by
  :func:`sparsejax.selection.row_topk`. Ties are broken deterministically:
  the lower output id wins (and comes first), ``-0 == +0``; NaN logits rank
  after every number (their score stays NaN).

  Args:
    h: ``[n, d]`` hidden representations (NumPy or JAX).
    weight: ``[N, d]`` output-layer weights.
    bias: ``[N]`` output-layer bias, or ``None``.
    k: number of outputs to keep per sample (``1 <= k <= N``).
    row_chunk: output rows scored per step (raised to ``k`` if smaller,
      capped at ``N``). ``N`` need not be divisible by it.
    sample_chunk: if given, samples are processed in batches of this size
      (the last batch is padded, so there is a single compilation);
      memory is then ``O(sample_chunk * row_chunk)`` regardless of ``n``.
    precision: ``jnp.dot`` precision, see :func:`exact_topk_batches`.

  Returns:
    ``(scores [n, k], ids [n, k] int32)`` with scores in descending order.
  """
  weight, bias, chunk = _prepare_topk_args(weight, bias, k, row_chunk)
  h = h if hasattr(h, "shape") else np.asarray(h)
  if h.ndim != 2 or h.shape[1] != weight.shape[1]:
    raise ValueError(f"exact_topk: argument 'h' must have shape [n, d] with d = {weight.shape[1]} (from 'weight'), "
                     f"got {tuple(h.shape)}")
  n = h.shape[0]
  if sample_chunk is not None:
    sample_chunk = check_int("exact_topk", "sample_chunk", sample_chunk, 1)
  if sample_chunk is None or sample_chunk >= n:
    return _exact_topk_jit(jnp.asarray(h), weight, bias, int(k), chunk, precision)
  scores, ids = [], []
  for start in range(0, n, sample_chunk):
    hb = h[start : start + sample_chunk]
    rows = hb.shape[0]
    if rows < sample_chunk:
      pad = [(0, sample_chunk - rows), (0, 0)]
      hb = jnp.pad(jnp.asarray(hb), pad) if isinstance(hb, jax.Array) else np.pad(hb, pad)
    s, i = _exact_topk_jit(jnp.asarray(hb), weight, bias, int(k), chunk, precision)
    scores.append(s[:rows])
    ids.append(i[:rows])
  return jnp.concatenate(scores, axis=0), jnp.concatenate(ids, axis=0)
