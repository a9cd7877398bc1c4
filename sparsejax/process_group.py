"""Joining a jax.distributed process group, with start-up faults reported by rank.

:func:`initialize` wraps ``jax.distributed.initialize`` so that a job that
cannot assemble ends every process within ``initialization_timeout`` seconds
with a message naming the rank and what it expected, instead of a bare
``DEADLINE_EXCEEDED`` from C++ after JAX's own timeout, or a job that runs
with a process count some ranks were not started with:

- While JAX waits for every rank to register (in C++, out of Python's reach),
  a watchdog thread ends the process after ``initialization_timeout`` seconds,
  saying which rank it is, the coordinator it waited for and the ranks it
  expected. This covers an unreachable coordinator and a rank that never
  starts (or crashed before joining, or was given another coordinator).
- Once every rank has joined, each one posts what it was started with to the
  coordination service's key-value store and reads everyone's: a rank started
  with another ``--num_processes`` than the coordinator (JAX itself follows
  the coordinator's count) makes every rank raise :class:`StartupError`
  naming it.

What JAX itself reports, immediately and naming the task: a ``process_id``
outside the coordinator's ``[0, P)`` (``Unexpected task registered``) and a
``process_id`` taken by two processes (``... with a different incarnation``
or ``... from a newer incarnation``). Of two processes with one
``process_id``, one is left out and ends by the watchdog, naming its rank; if
it connects only after the job assembled, the coordination service fails the
whole job and JAX aborts every process (the coordinator's log names the
task; the others say only that the service reported a fatal error, because
JAX 0.10's error callback cannot be set from Python).
"""

import json
import os
import platform
import sys
import threading
import time

import jax
from absl import logging

# JAX's own registration timeout is set this much later than ours, so that ours,
# with its message, always comes first.
_JAX_TIMEOUT_MARGIN_SECONDS = 15
_KEY_PREFIX = "sparsejax/startup/rank"


class StartupError(RuntimeError):
  """The processes of a job were started inconsistently (the message names the ranks)."""


def _cluster_env() -> bool:
  """Whether a SLURM or Open MPI launch with several tasks is visible."""
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
    if int(os.environ.get(var, "1") or 1) > 1:
      return True
  return False


def _validate(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, num_processes = {num_processes}), got {process_id}")
  if coordinator_address is not None:
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"coordinator_address must be 'host:port' with a port in [1, 65535], "
                       f"got {coordinator_address!r}")


def waiting_message(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
                    seconds: float) -> str:
  """What a rank that is still waiting for the job to assemble after ``seconds`` says."""
  who = f"rank {process_id if process_id is not None else '?'} of {num_processes or '?'}"
  ranks = f"0..{num_processes - 1}" if num_processes else "0..P-1"
  expected = (f"expected ranks {ranks} to start with --coordinator_address={coordinator_address} "
              f"--num_processes={num_processes or 'P'} and a --process_id each")
  if process_id == 0:
    return (f"{who} (the coordinator, at {coordinator_address}): the job did not assemble within {seconds:g} s: "
            f"{expected}, but not all of them joined (a rank that never started, crashed before joining, or was given "
            "another coordinator address or --num_processes)")
  return (f"{who}: could not join the job within {seconds:g} s: no answer from the coordinator (rank 0) at "
          f"{coordinator_address}, or not every rank joined, or another process with --process_id={process_id} "
          f"took this one's place; {expected}")


class _Watchdog:
  """Ends the process with a message unless cancelled in time (JAX waits in C++, where Python cannot interrupt)."""

  def __init__(self, seconds: float, message: str):
    self._timer = threading.Timer(seconds, self._fire, args=(message,))
    self._timer.daemon = True

  def __enter__(self):
    self._timer.start()
    return self

  def __exit__(self, *exc):
    self._timer.cancel()

  @staticmethod
  def _fire(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"sparsejax.process_group: StartupError: {message}\n")
    sys.stderr.flush()
    os._exit(1)


def _coordination_client():
  # The key-value store of the coordination service jax.distributed connected
  # to; there is no public accessor (orbax reads it the same way).
  return jax._src.distributed.global_state.client  # pylint: disable=protected-access


def check_membership(num_processes: int, process_id: int, timeout_seconds: float) -> None:
  """Every rank posts what it was started with, reads everyone's and checks that they agree.

  Args:
    num_processes: this rank's P.
    process_id: this rank's id.
    timeout_seconds: how long to wait for the others' records.

  Raises:
    StartupError: on every rank, when some rank's P differs from the
      coordinator's; the message names the ranks, hosts and processes.
  """
  client = _coordination_client()
  me = {"process_id": process_id, "num_processes": num_processes, "host": platform.node(), "pid": os.getpid()}
  client.key_value_set(f"{_KEY_PREFIX}{process_id}", json.dumps(me))
  deadline = time.monotonic() + timeout_seconds

  def record(rank: int) -> dict:
    timeout_ms = max(1, int(1000 * (deadline - time.monotonic())))
    return json.loads(client.blocking_key_value_get(f"{_KEY_PREFIX}{rank}", timeout_ms))

  coordinator = record(0)
  expected = coordinator["num_processes"]
  records = [coordinator] + [record(r) for r in range(1, expected)]
  wrong = [r for r in records if r["num_processes"] != expected]
  if wrong:
    where = lambda r: f"rank {r['process_id']} (host {r['host']}, pid {r['pid']})"
    listed = "; ".join(f"{where(r)} was started with --num_processes={r['num_processes']}" for r in wrong)
    raise StartupError(f"rank {process_id}: the coordinator, {where(coordinator)}, runs a job of "
                       f"--num_processes={expected}, but {listed}. Start every rank with the same --num_processes.")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_seconds: int = 20,
               initialization_timeout: int = 45) -> bool:
  """Joins the process group (a no-op for a single process); see the module docstring for start-up faults.

  Explicit arguments win; otherwise a SLURM / Open MPI launch is detected as
  JAX does (``jax.distributed.initialize()`` with no arguments). Call before
  anything creates a JAX backend.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator.
    num_processes: P.
    process_id: this process's rank in ``[0, P)``.
    heartbeat_timeout_seconds: a peer silent this long is declared dead and
      the job fails (JAX's default is 100 s).
    initialization_timeout: seconds to wait for all processes to join; then
      this process exits with status 1 and a message saying what it waited for.

  Returns:
    Whether a multi-process group was initialized.

  Raises:
    ValueError: on an argument that cannot be right (P < 1, a rank outside
      ``[0, P)``, an address that is not ``host:port``).
    StartupError: when the ranks were started with different P.
  """
  _validate(coordinator_address, num_processes, process_id)
  if num_processes == 1:
    return False
  if coordinator_address is None and num_processes is None and not _cluster_env():
    if process_id is not None:  # a rank of no job: training alone would silently ignore it
      raise ValueError(f"process_id={process_id} needs num_processes and coordinator_address (or a SLURM / Open "
                       "MPI launch) to say which job it is a rank of")
    return False
  # Gloo is JAX's default CPU collective implementation; say so explicitly.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  t0 = time.monotonic()
  message = waiting_message(coordinator_address, num_processes, process_id, initialization_timeout)
  with _Watchdog(initialization_timeout, message):
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
        initialization_timeout=initialization_timeout + _JAX_TIMEOUT_MARGIN_SECONDS,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=max(10, heartbeat_timeout_seconds))
    state = jax._src.distributed.global_state  # pylint: disable=protected-access
    check_membership(state.num_processes, state.process_id,
                     max(1.0, initialization_timeout - (time.monotonic() - t0)))
  logging.info("process %d of %d joined (%d devices in all)", jax.process_index(), jax.process_count(),
               jax.device_count())
  return True
