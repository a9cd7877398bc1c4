"""``sparsejax-train``: trains a network from its settings' flags in a work directory and prints its final line."""

import os

from sparsejax.cli.flags import COMPILATION_CACHE, FLAGS, Command, Flag, check_platform, run_command, usage_error
from sparsejax.train import allocator

TRAIN = Command("""\
sparsejax-train: trains a SLIDE network (or its dense baseline) and reports P@k.

  sparsejax-train                                       # ICD-10-CM, built in, in a new ~/sparsejax/runs/...
  sparsejax-train --dataset=synthetic --synthetic_labels=200000 --workdir=/tmp/synth
  sparsejax-train --dataset=files --train_file=train.txt --test_file=test.txt --workdir=/tmp/xc
  sparsejax-train --model=dense --workdir=/tmp/dense    # the full-softmax baseline
  sparsejax-train --model=dense --platform=cuda         # ... on a GPU (pip install "jax[cuda12]")
  sparsejax-train --flagfile=run.flags                  # flags from a file, one --flag=value per line
  sparsejax-train --config=/tmp/synth/config.json       # a run's settings (flags given too override them)

Distributed (the output layer split over P processes):

  python -m sparsejax.distributed.launch -n 4 sparsejax-train --dataset=synthetic ...   # one machine
  sparsejax-train --coordinator_address=host0:1234 --num_processes=4 --process_id=$RANK ...

Without --workdir, each run gets a new work directory under $SPARSEJAX_RUNS
(default ~/sparsejax/runs), named by its start (UTC) and dataset, printed in
its first log line and its last line. The same command with --workdir=THAT_DIR
continues the run from its newest checkpoint (Ctrl-C or SIGTERM saves one
before stopping). An invalid flag ends the command with exit status 2 and one
line naming it, before any data is loaded.
""", (
    Flag("workdir", None, "Work directory: metrics, checkpoints, config.json, assets. A run continues from it. "
         "Default: a new directory per run, $SPARSEJAX_RUNS/<UTC start>-<dataset> (without $SPARSEJAX_RUNS: "
         "~/sparsejax/runs)."),
    Flag("config", None, "A config.json (e.g. WORKDIR/config.json of an earlier run) to start from; flags given on "
         "the command line override its settings."),
    Flag("coordinator_address", None, "host:port of process 0's coordinator (multi-process runs; the launcher "
         "sets it)."),
    Flag("num_processes", None, "Processes in the job (multi-process runs).", int),
    Flag("process_id", None, "This process's rank in [0, num_processes).", int),
    Flag("heartbeat_timeout_seconds", 20, "A peer silent this long ends the job.", int),
    Flag("platform", "cpu", "Where the network runs (sets JAX_PLATFORMS): cpu, or an accelerator (cuda, rocm) for "
         "--model=dense in one process: the full-softmax baseline on a GPU. SLIDE's kernels are CPU code."),
    Flag("initialization_timeout", 45, "Seconds to wait for every process to join the job; then each one ends, "
         "saying which rank it is and what it waited for.", int),
    COMPILATION_CACHE,
), settings=True)


def train(argv: list[str]) -> None:
  """absl main of ``sparsejax-train``: joins the process group, trains, prints the final line
  (:func:`sparsejax.cli.train_run.run`)."""
  del argv
  check_platform(FLAGS.platform)
  if FLAGS.platform != "cpu" and (FLAGS.coordinator_address or (FLAGS.num_processes or 1) > 1):
    usage_error(f"--platform={FLAGS.platform} runs in one process (the baseline on one device); several processes "
                "train on CPUs")
  # Set, not defaulted: the flag says where the run goes (on CPU, JAX does not probe for accelerators either).
  os.environ["JAX_PLATFORMS"] = FLAGS.platform
  # deferred: JAX (and the training code) must not load before --platform sets JAX_PLATFORMS; --help stays fast
  from sparsejax.cli import train_run

  train_run.run()


def main() -> None:
  """``sparsejax-train``."""
  allocator.adopt()
  run_command(train, TRAIN)


if __name__ == "__main__":  # python -m sparsejax.cli.train: sparsejax-train
  main()
