"""The run of ``sparsejax-train`` once :mod:`.train` has parsed its flags and set ``JAX_PLATFORMS``: joins the process
group, trains in the work directory and prints the final line, or a stop's one line.

Imported by :func:`sparsejax.cli.train.train` only then: this module imports JAX and the training code, which must
not start before the flags say where the run goes, and which ``--help`` and a flag's error need not wait for.
"""

import os
import signal

import jax
from absl import logging

from sparsejax import rundirs
from sparsejax.cli.flags import (
  FLAGS,
  USAGE_ERROR,
  check_platform,
  config_from_flags,
  fail,
  fail_now,
  usage_error,
  use_compilation_cache,
)
from sparsejax.config import Config
from sparsejax.data import XCFormatError
from sparsejax.distributed import ranks, sharding
from sparsejax.netanalysis.collect import StepProfiler
from sparsejax.settings import ConfigError, iter_fields
from sparsejax.train import console, recipes, train_and_evaluate
from sparsejax.train.metric_writer import MetricsFileError
from sparsejax.train.nonfinite import NonFiniteError
from sparsejax.train.stopping import Interrupted, raise_on_signals
from sparsejax.workdir import checkpoint
from sparsejax.workdir.seals import IntegrityError, WriteError


def print_final(final: dict, workdir: str | None = None) -> None:
  """The one summary line of a finished run (ending with its work directory, where given)."""
  print(console.final_line(final, workdir))


def _first_device_kind(platform: str) -> str:
  """The kind of JAX's first device, ``JAX_PLATFORMS`` being ``platform``; ends the command (status 2) where JAX has
  none of it."""
  try:
    return sharding.first_device(platform).device_kind
  except RuntimeError as e:
    usage_error(f"--platform={platform}: {e}")


def run() -> None:
  """Joins the process group, trains and prints the final line (:func:`sparsejax.cli.train.train`, after its flags
  and ``JAX_PLATFORMS``)."""
  use_compilation_cache(FLAGS.compilation_cache)  # before anything compiles
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
  except (RuntimeError, ValueError) as e:  # JaxRuntimeError from a step, ValueError from a jitted all-gather
    lost = ranks.lost_peer(str(e)) if jax.process_count() > 1 else None
    if lost is None:
      raise
    # A peer process died (its host lost, killed, out of memory): this one's collectives failed. Ended here, not at
    # JAX's shutdown barrier, which waits out the heartbeat timeout and aborts with pages of C++ stack.
    fail_now(f"another process of the job was lost ({lost}); this one stops too. The checkpoints already saved in "
             f"{workdir} are kept ({continuing}, on every process)")
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


