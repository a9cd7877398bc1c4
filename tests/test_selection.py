"""row_topk (sparsejax.selection) against a brute-force ranking: ties, signed zeros, NaN, -inf and any k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import selection


def _reference(scores, k):
  """Each row's columns by (score descending with -0 == +0 and NaN after every number, then column)."""
  values, columns = [], []
  for row in scores:
    key = [(1, 0.0, c) if np.isnan(x) else (0, -float(x) + 0.0, c) for c, x in enumerate(row)]
    cols = [c for _, _, c in sorted(key)[:k]]
    columns.append(cols)
    values.append(row[cols])
  return np.asarray(values, np.float32).reshape(len(scores), k), np.asarray(columns, np.int32).reshape(-1, k)


def _assert_same(got, want):
  np.testing.assert_array_equal(np.asarray(got[1]), want[1])
  # Bit for bit (NaN where NaN, the sign of a zero as the score had it).
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint32), want[0].view(np.uint32))


@pytest.mark.parametrize("C,k", [(1, 1), (7, 1), (16, 3), (33, 1), (33, 5), (100, 16), (100, 17), (100, 40), (100, 100),
                                 (4096, 10)])
def test_row_topk_against_brute_force(C, k):
  """Many ties (few distinct values), NaN, -inf, both zeros; rows of all NaN, all -inf, NaN but one -inf,
  ascending scores (every score enters: the buffer is cut back many times) and widths around the 16 lanes."""
  rng = np.random.default_rng(C * 1000 + k)
  scores = rng.choice(np.float32([-1.0, -0.0, 0.0, 0.5, 2.0, np.nan, -np.inf]), size=(40, C))
  scores[0] = np.nan
  scores[1] = -np.inf
  scores[2] = np.nan
  scores[2, -1] = -np.inf  # the only number is -inf: it comes first
  scores[3] = rng.standard_normal(C).astype(np.float32)
  scores[4] = np.arange(C, dtype=np.float32)  # ascending
  scores[5] = np.arange(C, dtype=np.float32)[::-1]
  _assert_same(selection.row_topk(jnp.asarray(scores), k), _reference(scores, k))
  _assert_same(jax.jit(selection.row_topk, static_argnums=1)(jnp.asarray(scores), k), _reference(scores, k))


def test_row_topk_matches_lax_top_k_on_distinct_numbers():
  scores = np.random.default_rng(0).standard_normal((300, 5000)).astype(np.float32)
  values, columns = selection.row_topk(jnp.asarray(scores), 17)
  want_v, want_c = jax.lax.top_k(jnp.asarray(scores), 17)
  np.testing.assert_array_equal(np.asarray(columns), np.asarray(want_c))
  np.testing.assert_array_equal(np.asarray(values), np.asarray(want_v))


def test_row_topk_same_result_under_vmap_and_on_no_rows():
  scores = np.random.default_rng(1).standard_normal((3, 4, 9)).astype(np.float32)
  values, columns = jax.vmap(lambda s: selection.row_topk(s, 2))(jnp.asarray(scores))
  for i in range(3):
    _assert_same((values[i], columns[i]), _reference(scores[i], 2))
  values, columns = selection.row_topk(jnp.zeros((0, 9), jnp.float32), 3)
  assert values.shape == (0, 3) and columns.shape == (0, 3)


def test_row_topk_rejects_bad_arguments():
  with pytest.raises(ValueError, match=r"row_topk: argument 'k' must be in \[1, 4\], got 5"):
    selection.row_topk(jnp.zeros((3, 4), jnp.float32), 5)
  with pytest.raises(ValueError, match=r"row_topk: argument 'k' must be in \[1, 4\], got 0"):
    selection.row_topk(jnp.zeros((3, 4), jnp.float32), 0)
  with pytest.raises(TypeError, match=r"row_topk: argument 'scores' must have dtype float32"):
    selection.row_topk(jnp.zeros((3, 4), jnp.int32), 1)
  with pytest.raises(ValueError, match=r"row_topk: argument 'scores' must have shape \[n, C\]"):
    selection.row_topk(jnp.zeros((4,), jnp.float32), 1)
