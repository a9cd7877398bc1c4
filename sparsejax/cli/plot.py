"""``sparsejax-plot``: the learning curves of a run (training loss and P@k against steps and wall-clock time) as a
PNG."""

import os

from sparsejax.cli.flags import FLAGS, Command, Flag, fail, run_command

PLOT = Command("""\
sparsejax-plot: learning curves of a run: training loss and P@k against steps and wall-clock time.

  sparsejax-plot /tmp/synth                     # writes /tmp/synth/curves.png
  sparsejax-plot /tmp/synth --output=run.png

P@k is the periodic evaluations' on the validation split (on the test set where
the run has none), with the final evaluation's test P@k marked at the step it
reports (the selected one).

Needs matplotlib (pip install matplotlib).
""", (
    Flag("output", None, "PNG to write (default: WORKDIR/curves.png)."),
), positional=("WORKDIR",))


def plot(argv: list[str]) -> None:
  """absl main of ``sparsejax-plot``."""
  # deferred: it imports JAX (through the metrics' seals); --help and a flag's error need not wait for it
  from sparsejax.train import plot as plotting

  workdir = argv[1]
  try:
    path = plotting.plot_run(workdir, FLAGS.output or os.path.join(workdir, "curves.png"))
  except (plotting.MissingMatplotlib, OSError, ValueError) as e:
    fail(str(e))
  print(path)


def plot_main() -> None:
  """``sparsejax-plot``."""
  run_command(plot, PLOT)
