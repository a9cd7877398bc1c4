"""Learning curves of a run from its ``metrics.jsonl``: training loss and test P@k against steps and wall-clock."""

import os

from sparsejax.metric_writer import read_records


class MissingMatplotlib(ImportError):
  """Plotting needs matplotlib."""


def plot_run(workdir: str, output: str) -> str:
  """Draws the run in ``workdir`` to the PNG ``output`` and returns its path.

  Four panels: training loss and test P@1/P@3/P@5 (the periodic evaluations and
  the final one, on the whole test set), each against steps and against
  training seconds (cumulative over resumed sessions, evaluations excluded).

  Raises:
    MissingMatplotlib: matplotlib is not installed.
    ValueError: ``workdir`` holds no metrics.
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    raise MissingMatplotlib("sparsejax-plot needs matplotlib: pip install matplotlib") from None
  records = read_records(workdir)
  if not records:
    raise ValueError(f"{os.path.join(workdir, 'metrics.jsonl')}: no metrics to plot (train with --workdir={workdir})")
  fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex="col")
  for col, x_key, x_label in ((0, "step", "step"), (1, "seconds", "training seconds")):
    train = [r for r in records if "loss" in r and not r.get("final") and x_key in r]
    axes[0, col].plot([r[x_key] for r in train], [r["loss"] for r in train], color="tab:blue")
    axes[0, col].set_ylabel("training loss")
    for k, color in ((1, "tab:green"), (3, "tab:orange"), (5, "tab:red")):
      evals = [r for r in records if f"p@{k}" in r and x_key in r]
      axes[1, col].plot([r[x_key] for r in evals], [r[f"p@{k}"] for r in evals], marker=".", color=color,
                        label=f"P@{k}")
    axes[1, col].set_ylabel("test precision")
    axes[1, col].set_xlabel(x_label)
    axes[1, col].legend()
    for row in (0, 1):
      axes[row, col].grid(alpha=0.3)
  fig.suptitle(os.path.abspath(workdir))
  fig.tight_layout()
  fig.savefig(output, dpi=100)
  plt.close(fig)
  return output
