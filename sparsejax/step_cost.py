"""The modelled wall time of a training step, from the sizes alone: one model for the recipe search's step budget
(:func:`sparsejax.train.search_plan.modelled_step_seconds`) and for the choice between the exact and the sampled softmax
(:func:`sparsejax.model_config.uses_exact_path`).

A step costs a fixed time, one per multiply-add of dense matmuls (the hidden layers; the output layer on the exact
path), a larger one per multiply-add of gathered rows (the input layer, the sampled output layer) and one per
element of a row that Adam updates. The index's query and refresh are left out (the refresh's share of the
training time is bounded apart, by ``--refresh_budget``).
"""

from collections.abc import Sequence

# Fitted to training steps measured on the 2-vCPU VM (benchmarks/RESULTS.md, "Recipes": ICD-10, GCIDE cloze and
# the 200K-label synthetic set, within 30%). A faster machine changes the seconds, not the ratios that choose.
SECONDS_PER_STEP = 5e-4
SECONDS_PER_DENSE_MAC = 1e-11
SECONDS_PER_GATHERED_MAC = 4e-11
SECONDS_PER_ROW_ELEMENT = 1e-9


def output_layer_seconds(batch_size: int, rows: int, k: int, width: int, *, exact: bool) -> float:
  """Modelled seconds of the output layer's share of one step, on one shard.

  Exact: logits, input gradient and weight gradient as ``[B, d] x [d, rows]`` matmuls (three products of
  ``B x rows x d``) and Adam on every row. Sampled: the same three products over ``B x k`` gathered rows, and Adam
  on the rows they touch (at most ``min(B k, rows)``).

  Args:
    batch_size: B, samples per step.
    rows: the shard's output rows.
    k: active rows per sample on the shard.
    width: d, the last hidden layer's width.
    exact: which softmax.
  """
  if exact:
    return SECONDS_PER_DENSE_MAC * 3 * batch_size * rows * width + SECONDS_PER_ROW_ELEMENT * rows * width
  return (SECONDS_PER_GATHERED_MAC * 3 * batch_size * k * width
          + SECONDS_PER_ROW_ELEMENT * min(batch_size * k, rows) * width)


def input_and_hidden_seconds(batch_size: int, dims: Sequence[int], mean_features: float, num_features: int) -> float:
  """Modelled seconds of the rest of one step: the fixed cost, the input layer (``nnz x d0`` gathered per sample,
  forward and row gradients, and Adam on the rows a batch touches) and the hidden layers (``d_i x d_i+1``, three
  products each).

  Args:
    batch_size: B.
    dims: the hidden layers' widths, ``(d0, ..., d)``.
    mean_features: a sample's mean non-zero features.
    num_features: F, the input layer's rows.
  """
  dense_macs = 3 * batch_size * sum(x * y for x, y in zip(dims[:-1], dims[1:]))
  gathered_macs = batch_size * 2 * mean_features * dims[0]
  row_elements = min(batch_size * mean_features, num_features) * dims[0]
  return (SECONDS_PER_STEP + SECONDS_PER_DENSE_MAC * dense_macs + SECONDS_PER_GATHERED_MAC * gathered_macs
          + SECONDS_PER_ROW_ELEMENT * row_elements)
