"""``sparsejax-train``: trains a network from its settings' flags in a work directory and prints its final line."""

import os
import signal

from absl import logging

from sparsejax import rundirs
from sparsejax.cli.flags import (
  COMPILATION_CACHE,
  FLAGS,
  USAGE_ERROR,
  Command,
  Flag,
  check_platform,
  config_from_flags,
  fail,
  fail_now,
  run_command,
  usage_error,
  use_compilation_cache,
)
from sparsejax.config import Config
from sparsejax.settings import ConfigError, iter_fields
from sparsejax.train import allocator, console, recipes

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


def print_final(final: dict, workdir: str | None = None) -> None:
  """The one summary line of a finished run (ending with its work directory, where given)."""
  print(console.final_line(final, workdir))


def _first_device_kind(platform: str) -> str:
  """The kind of JAX's first device, ``JAX_PLATFORMS`` being ``platform``; ends the command (status 2) where JAX has
  none of it."""
  from sparsejax.distributed import sharding

  try:
    return sharding.first_device(platform).device_kind
  except RuntimeError as e:
    usage_error(f"--platform={platform}: {e}")


def train(argv: list[str]) -> None:
  """absl main of ``sparsejax-train``: joins the process group, trains, prints the final line."""
  del argv
  check_platform(FLAGS.platform)
  if FLAGS.platform != "cpu" and (FLAGS.coordinator_address or (FLAGS.num_processes or 1) > 1):
    usage_error(f"--platform={FLAGS.platform} runs in one process (the baseline on one device); several processes "
                "train on CPUs")
  # Set, not defaulted: the flag says where the run goes (on CPU, JAX does not probe for accelerators either).
  os.environ["JAX_PLATFORMS"] = FLAGS.platform
  import jax

  use_compilation_cache(FLAGS.compilation_cache)
  from sparsejax.data import XCFormatError
  from sparsejax.distributed import sharding  # imported here: creating a JAX backend must wait for the flags
  from sparsejax.netanalysis.collect import StepProfiler
  from sparsejax.train import train_and_evaluate
  from sparsejax.train.metric_writer import MetricsFileError
  from sparsejax.train.nonfinite import NonFiniteError
  from sparsejax.train.stopping import Interrupted, raise_on_signals
  from sparsejax.workdir import checkpoint
  from sparsejax.workdir.seals import IntegrityError, WriteError

  try:
    sharding.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                        heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_seconds,
                        initialization_timeout=FLAGS.initialization_timeout)
  except ValueError as e:  # a bad process count, rank or address
    usage_error(str(e))
  config = config_from_flags()
  given = {field.name for _, field in iter_fields(Config) if field.name in FLAGS and FLAGS[field.name].present}
  try:
    config = recipes.with_given_settings(config, given)
  except ConfigError as e:
    usage_error(str(e))
  check_platform(FLAGS.platform, config.network.model)
  device = _first_device_kind(FLAGS.platform)
  workdir, new_run = _workdir(config, jax.process_count())
  continuing = (f"add --workdir={workdir} to the command to continue" if new_run
                else "run the same command again to continue")
  logging.info("work directory: %s%s", workdir, f" (a new run: {continuing})" if new_run else "")
  logging.info("platform: %s (%s)", FLAGS.platform, device)
  console.log_settings(config)
  try:
    raise_on_signals()
    print_final(train_and_evaluate(config, workdir, step_observer=StepProfiler.from_config), workdir)
  except KeyboardInterrupt as e:  # outside the training loop, or a second Ctrl-C within it
    signum = _launcher_stop_signal(getattr(e, "signum", signal.SIGINT))
    _remove_if_empty(workdir, new_run)
    # XLA's threads may still be compiling (Ctrl-C during start-up): tearing Python down under them crashed.
    continues = f"the same command with --workdir={workdir} continues" if new_run else "the same command continues"
    fail_now(f"interrupted by {signal.Signals(signum).name}: nothing more was saved. The checkpoints already in "
             f"{workdir} are kept; {continues} from the newest", 128 + signum)
  except XCFormatError as e:  # names the file and line
    _remove_if_empty(workdir, new_run)
    fail(str(e))
  except ConfigError as e:
    _remove_if_empty(workdir, new_run)
    usage_error(str(e))
  except checkpoint.ResumeError as e:
    fail(str(e), USAGE_ERROR)
  except WriteError as e:  # a checkpoint or other file (a full disk): orbax's threads would print pages at shutdown
    fail_now(str(e))
  except (NonFiniteError, MetricsFileError, IntegrityError) as e:  # IntegrityError: a changed best state
    fail(str(e))
  except Interrupted as e:
    signum = _launcher_stop_signal(e.signum)
    # Several processes: exit 0, as every rank does after the same stop (the launcher's contract).
    fail(e.describe(signal.Signals(signum).name, continuing), 0 if jax.process_count() > 1 else 128 + signum)


def _workdir(config: Config, process_count: int) -> tuple[str, bool]:
  """``(work directory, whether it is a new one made for this run)``: ``--workdir``, else the one sparsejax-launch
  chose for its ranks, else a new one under :func:`sparsejax.rundirs.runs_base` (one process)."""
  if FLAGS.workdir:
    return FLAGS.workdir, False
  launched = os.environ.get(rundirs.LAUNCH_WORKDIR_ENV)
  if launched:
    return launched, True
  if process_count > 1:  # each rank would make its own
    usage_error("a job of several processes needs --workdir: one directory that every rank writes to (sparsejax-launch "
                "picks a new one for its ranks where the command gives none)")
  try:
    return rundirs.new_run_directory(config.data.dataset), True
  except OSError as e:
    usage_error(f"cannot make a work directory under {rundirs.runs_base()} ({e.strerror or e}): give --workdir, or "
                f"set {rundirs.RUNS_ENV} to a directory where runs may go")


def _remove_if_empty(workdir: str, new_run: bool) -> None:
  """A new run's directory, when the run stopped before writing anything: not left behind, empty."""
  if new_run:
    try:
      os.rmdir(workdir)
    except OSError:  # not empty (or gone): kept
      pass


def _launcher_stop_signal(signum: int) -> int:
  """The signal a stop came from: the one sparsejax-launch received (Ctrl-C: SIGINT) where it passed it on to this
  rank as SIGTERM (the preemption notice that every rank answers at the same step), else ``signum``."""
  path = os.environ.get(rundirs.LAUNCH_STOP_FILE_ENV)
  if signum != signal.SIGTERM or not path:
    return signum
  try:
    with open(path) as f:
      return int(signal.Signals[f.read().strip()])
  except (OSError, KeyError):  # no stop request of the launcher's (a signal sent to the ranks themselves)
    return signum


def main() -> None:
  """``sparsejax-train``."""
  allocator.adopt()
  run_command(train, TRAIN)


if __name__ == "__main__":  # python -m sparsejax.cli.train: sparsejax-train
  main()
