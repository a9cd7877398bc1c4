"""Learning curves of a run from its ``metrics.jsonl``: training loss and P@k against steps and wall-clock."""

import os

from sparsejax.train.metric_writer import read_records


class MissingMatplotlib(ImportError):
  """Plotting needs matplotlib."""


def run_title(workdir: str) -> str:
  """The plot's title: the work directory's name (``20250614T153012Z-icd10``), not its whole path."""
  return os.path.basename(os.path.normpath(os.path.abspath(workdir)))


def plot_run(workdir: str, output: str) -> str:
  """Draws the run in ``workdir`` to the PNG ``output`` and returns its path.

  Four panels, each against steps and against training seconds (cumulative over resumed sessions, evaluations
  excluded): the training loss; P@1/P@3/P@5 of the periodic evaluations (on the validation split where the run
  has one, else on the test set), with the final evaluation on the whole test set marked at the step it reports
  (the selected one).

  Raises:
    MissingMatplotlib: matplotlib is not installed.
    ValueError: ``workdir`` holds no metrics.
  """
  try:
    import matplotlib.pyplot as plt  # deferred: matplotlib is optional (sparsejax[plot]), for plots only
  except ImportError:
    raise MissingMatplotlib("sparsejax-plot needs matplotlib: pip install matplotlib") from None
  plt.switch_backend("Agg")  # a file, never a window (as matplotlib.use("Agg"), with pyplot imported)
  records = read_records(workdir)
  if not records:
    raise ValueError(f"{os.path.join(workdir, 'metrics.jsonl')}: no metrics to plot (train with --workdir={workdir})")
  fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex="col")
  for col, x_key, x_label in ((0, "step", "step"), (1, "seconds", "training seconds")):
    train = [r for r in records if "loss" in r and not r.get("final") and x_key in r]
    axes[0, col].plot([r[x_key] for r in train], [r["loss"] for r in train], color="tab:blue")
    axes[0, col].set_ylabel("training loss")
    periodic = [r for r in records if "p@1" in r and not r.get("final") and x_key in r]
    split = "validation" if any(r.get("split") == "validation" for r in periodic) else "test"
    final = next((r for r in reversed(records) if r.get("final") and "p@1" in r), None)
    final_x = None
    if final is not None:  # a final record's "seconds" are the run's last; its "step" the selected one
      last = final.get("last_step", final["step"]) == final["step"]
      final_x = final["step"] if x_key == "step" else final.get("seconds") if last else next(
          (r["seconds"] for r in periodic if r["step"] == final["step"]), None)
    for k, color in ((1, "tab:green"), (3, "tab:orange"), (5, "tab:red")):
      evals = [r for r in periodic if f"p@{k}" in r]
      axes[1, col].plot([r[x_key] for r in evals], [r[f"p@{k}"] for r in evals], marker=".", color=color,
                        label=f"P@{k} ({split})")
      if final_x is not None and f"p@{k}" in final:
        axes[1, col].plot([final_x], [final[f"p@{k}"]], marker="*", markersize=12, linestyle="none", color=color,
                          label=f"P@{k} final (test)")
    axes[1, col].set_ylabel("precision")
    axes[1, col].set_xlabel(x_label)
    axes[1, col].legend()
    for row in (0, 1):
      axes[row, col].grid(alpha=0.3)
  fig.suptitle(run_title(workdir))
  fig.tight_layout()
  fig.savefig(output, dpi=100)
  plt.close(fig)
  return output
