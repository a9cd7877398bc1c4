"""NumPy references of the kernels, written from their contracts (loops, float64, Python ints for hashes).

Shared by tests/op_cases.py (the fuzzing worker) and the unit tests.
"""

from collections import Counter

import jax.numpy as jnp
import numpy as np

M64 = (1 << 64) - 1


# --- Hashes the kernels use (as in ffi/common.h) --------------------------------


def splitmix64(x):
  x = (x + 0x9E3779B97F4A7C15) & M64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
  return x ^ (x >> 31)


def hash_combine(a, b):
  return splitmix64(a ^ ((splitmix64(b) + 0x632BE59BD9B4E019) & M64))


def hash3(a, b, c):
  return hash_combine(hash_combine(a, b), c)


def bounded(h, n):
  return (h * n) >> 64


# --- References ----------------------------------------------------------------


def f64(x):
  return np.asarray(x, np.float64)


def gather_dot_ref(x, w, ids, bias=None):
  out = np.zeros(ids.shape, np.float64)
  with np.errstate(all="ignore"):
    for (b, j), i in np.ndenumerate(ids):
      if i >= 0:
        out[b, j] = f64(x[b]) @ f64(w[i]) + (0.0 if bias is None else f64(bias[i]))
  return out


def gather_combine_ref(g, w, ids):
  out = np.zeros((ids.shape[0], w.shape[1]), np.float64)
  with np.errstate(all="ignore"):
    for (b, j), i in np.ndenumerate(ids):
      if i >= 0:
        out[b] += f64(g[b, j]) * f64(w[i])
  return out


def scatter_rows_ref(ids, g, x, n):
  """sum over (b, j) of g[b, j] * x[b] into row ids[b, j] (padding skipped)."""
  out = np.zeros((n, x.shape[1]), np.float64)
  with np.errstate(all="ignore"):
    for (b, j), i in np.ndenumerate(ids):
      if i >= 0:
        out[i] += f64(g[b, j]) * f64(x[b])
  return out


def simhash_ref(projections, x):
  P = f64(projections)  # [L, K, d]
  with np.errstate(all="ignore"):
    prod = np.where(f64(x)[:, None, None, :] == 0, 0.0, f64(x)[:, None, None, :] * P[None])  # zeros are skipped
    acc = prod.sum(-1)
  return ((acc > 0) * (1 << np.arange(P.shape[1]))).sum(-1)


def dwta_ref(bin_idx, seed, x):
  L, bins, size = bin_idx.shape
  bits = int(np.log2(size))
  flat = bin_idx.reshape(L * bins, size)
  out = np.zeros((x.shape[0], L), np.int64)
  for b, row in enumerate(np.asarray(x)):
    win = []
    for j in range(L * bins):
      vals = [v for v in row[flat[j]]]
      ok = [t for t, v in enumerate(vals) if v != 0 and not np.isnan(v)]  # NaN counts as zero
      win.append(max(ok, key=lambda t: (vals[t], -t)) if ok else -1)
    for l in range(L):
      code = 0
      for i in range(bins):
        j = l * bins + i
        w, a = win[j], 1
        while w < 0 and a <= 100:
          w = win[bounded(hash3(int(seed), j, a), L * bins)]
          a += 1
        code |= max(w, 0) << (i * bits)
      out[b, l] = code
  return out


def insert_ref(buckets, counts, codes, ids, seed, policy, reset):
  buckets, counts = np.array(buckets), np.array(counts)
  L, NB, S = buckets.shape
  if reset:
    buckets[:], counts[:] = -1, 0
  for l in range(L):
    for i, row in enumerate(ids):
      if row == -1:
        continue
      c = codes[i, l]
      seen = int(counts[l, c])
      if row in buckets[l, c, :min(seen, S)]:
        continue
      slot = None
      if seen < S:
        slot = seen
      elif policy == "fifo":
        slot = seen % S
      else:
        r = bounded(hash3(int(seed), l * NB + int(c), seen), seen + 1)
        slot = r if r < S else None
      if slot is not None:
        buckets[l, c, slot] = row
      counts[l, c] = seen + 1
  return buckets, counts


def query_ref(buckets, counts, codes, labels, seed, N, k):
  """(active, num_from_tables), or the quoted argument its error must name."""
  L, NB, S = buckets.shape
  B = codes.shape[0]
  if (codes < 0).any() or (codes >= NB).any():
    return "codes"
  if ((labels < -1) | (labels >= N)).any():
    return "labels"
  if not 1 <= k <= N:
    return "num_rows"
  active, ntab = np.zeros((B, k), np.int64), np.zeros(B, np.int64)
  seed = int(seed)
  for b in range(B):
    out, seen = [], set()
    for y in labels[b]:
      if y == -1 or y in seen:
        continue
      seen.add(int(y))
      if len(out) == k:
        return "labels"
      out.append(int(y))
    cand = []
    for l in range(L):
      c = codes[b, l]
      for v in buckets[l, c, :min(max(int(counts[l, c]), 0), S)]:
        if v >= N or v < -1:
          return "tables hold id"
        if v != -1:
          cand.append(int(v))
    freq = Counter(cand)
    ranked = sorted(freq, key=lambda i: (((L * S - freq[i]) << 40) | (hash_combine(seed, i) >> 24), i))
    for i in ranked:
      if len(out) == k:
        break
      if i not in seen:
        seen.add(i)
        out.append(i)
        ntab[b] += 1
    fill_seed = seed ^ 0x5BD1E995
    if 2 * k <= N:
      a = 0
      while len(out) < k:
        i = bounded(hash3(fill_seed, b, a), N)
        a += 1
        if i not in seen:
          seen.add(i)
          out.append(i)
    elif len(out) < k:
      unused = [i for i in range(N) if i not in seen]
      i = 0
      while len(out) < k:
        r = i + bounded(hash3(fill_seed, b, i), len(unused) - i)
        unused[i], unused[r] = unused[r], unused[i]
        out.append(unused[i])
        i += 1
    active[b] = out
  return active, ntab


def adam_ref(w, m, v, count, ids, g, x, lr, b1, b2, eps, wd, bias=None, bm=None, bv=None):
  """One lazy Adam step in float64: new (w, m, v[, bias, bm, bv]) and the touched ids.

  ``v`` of shape ``[N]`` for ``w [N, d]``: row-wise Adam (one second moment per row, of the row's mean
  squared gradient, scaling the whole row's step).
  """
  w, m, v = f64(w).copy(), f64(m).copy(), f64(v).copy()
  vec = w.ndim == 1
  rowwise = not vec and v.ndim == 1
  if vec:
    w, m, v = w[:, None], m[:, None], v[:, None]
  if rowwise:
    v = v[:, None]
  N = w.shape[0]
  grad = scatter_rows_ref(ids, g, x, N)
  rows = np.unique(ids[ids >= 0])
  t = count + 1
  outs = []
  with np.errstate(all="ignore"):
    def step(w, m, v, gr, rowwise=False):
      m[rows] = b1 * m[rows] + (1 - b1) * gr[rows]
      sq = np.mean(gr[rows] ** 2, axis=1, keepdims=True) if rowwise else gr[rows] ** 2
      v[rows] = b2 * v[rows] + (1 - b2) * sq
      upd = (m[rows] / (1 - b1**t)) / (np.sqrt(v[rows] / (1 - b2**t)) + eps)
      w[rows] -= lr * (upd + wd * w[rows])
    step(w, m, v, grad, rowwise)
    outs = [w[:, 0], m[:, 0], v[:, 0]] if vec else [w, m, v[:, 0] if rowwise else v]
    if bias is not None:
      bias, bm, bv = f64(bias)[:, None].copy(), f64(bm)[:, None].copy(), f64(bv)[:, None].copy()
      step(bias, bm, bv, scatter_rows_ref(ids, g, np.ones((len(x), 1)), N))
      outs += [bias[:, 0], bm[:, 0], bv[:, 0]]
  touched = np.full(ids.size, -1)
  touched[:len(rows)] = rows
  return outs, touched


def total_order(x):
  """Sortable ints for float32 values (-0.0 < +0.0, as XLA's top_k orders them)."""
  bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
  return np.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def topk_ref(h, w, bias, k):
  logits = np.asarray(jnp.dot(jnp.asarray(h), jnp.asarray(w).T, precision="highest"))
  if bias is not None:
    logits = np.asarray(jnp.asarray(logits) + jnp.asarray(bias)[None])  # float32, as the op computes them
  # Score descending with -0 == +0, NaN after every number, then the lower id (sparsejax.selection.row_topk).
  key = total_order(np.where(np.isnan(logits), -np.inf, logits + np.float32(0.0)))  # -0 + 0 = +0
  order = np.lexsort((np.broadcast_to(np.arange(w.shape[0]), logits.shape), -key, np.isnan(logits)),
                     axis=-1)[:, :k]
  return np.take_along_axis(logits, order, 1), order
