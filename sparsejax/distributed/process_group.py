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

Checked before JAX starts, because JAX crashes on it: rank 0 must be able to
listen on the coordinator's port (JAX binds ``[::]:PORT``, or
``JAX_COORDINATOR_BIND_ADDRESS``); a port another program holds made
``jax.distributed.initialize`` end the process with SIGSEGV. Now a
``ValueError`` names ``--coordinator_address`` and the port. A rank other than
0 cannot tell a foreign program on the port from a coordinator still waiting
for its ranks; when it gives up, its message says whether anything listened
at the address at all.

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

import errno
import json
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable

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


def _bind_address(coordinator_address: str) -> tuple[str, int]:
  """The host and port rank 0's coordination service listens on, as ``jax.distributed.initialize`` chooses them."""
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or "[::]:" + coordinator_address.rpartition(":")[2]
  host, _, port = bind.rpartition(":")
  return host.strip("[]"), int(port)


def check_coordinator_port(coordinator_address: str) -> None:
  """Raises ValueError unless this process can listen where rank 0's coordinator will.

  JAX 0.10 ends the process with SIGSEGV when its gRPC server cannot bind the
  port (``Failed to add port to server``), and the other ranks then wait out
  their timeout for a coordinator that never started. SO_REUSEADDR as a
  server sets it: a port left in TIME_WAIT by a job that just ended is free.
  """
  host, port = _bind_address(coordinator_address)
  families = [socket.AF_INET6, socket.AF_INET] if ":" in host else [socket.AF_INET]
  for family in families:
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0" if family == socket.AF_INET and host == "::" else host, port))
      return
    except OSError as e:
      if e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL) and family != families[-1]:
        continue  # no IPv6 on this host: gRPC falls back to IPv4 likewise
      held = ": another program holds it" if e.errno == errno.EADDRINUSE else ""
      raise ValueError(f"--coordinator_address={coordinator_address}: rank 0 cannot listen on port {port} for the "
                       f"job's coordinator ({e.strerror or e}{held}); start every rank with a free port") from None


def _probe(coordinator_address: str, timeout: float = 2.0) -> str:
  """What a TCP connection to the coordinator's address shows, as words for a message."""
  host, _, port = coordinator_address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
      return ("a program accepts connections there: rank 0's coordinator waiting for other ranks, or another program "
              "that holds the port (rank 0 then fails saying so)")
  except ConnectionRefusedError:
    return "nothing listens there: rank 0 was not started, failed to start, or was given another address"
  except OSError as e:
    return f"it cannot be reached ({e.strerror or e}): check the host name and firewall"


def waiting_message(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
                    seconds: float, probe: str | None = None) -> str:
  """What a rank that is still waiting for the job to assemble after ``seconds`` says (``probe``: what a connection
  to the coordinator showed, for a rank other than 0)."""
  who = f"rank {process_id if process_id is not None else '?'} of {num_processes or '?'}"
  ranks = f"0..{num_processes - 1}" if num_processes else "0..P-1"
  expected = (f"expected ranks {ranks} to start with --coordinator_address={coordinator_address} "
              f"--num_processes={num_processes or 'P'} and a --process_id each")
  if process_id == 0:
    return (f"{who} (the coordinator, at {coordinator_address}): the job did not assemble within {seconds:g} s: "
            f"{expected}, but not all of them joined (a rank that never started, crashed before joining, or was given "
            "another coordinator address or --num_processes)")
  seen = f" ({probe})" if probe else ""
  return (f"{who}: could not join the job within {seconds:g} s: no answer from the coordinator (rank 0) at "
          f"{coordinator_address}{seen}, or not every rank joined, or another process with --process_id={process_id} "
          f"took this one's place; {expected}")


class _Watchdog:
  """Ends the process with a message unless cancelled in time (JAX waits in C++, where Python cannot interrupt)."""

  def __init__(self, seconds: float, message: Callable[[], str]):
    self._timer = threading.Timer(seconds, self._fire, args=(message,))
    self._timer.daemon = True

  def __enter__(self):
    self._timer.start()
    return self

  def __exit__(self, *exc):
    self._timer.cancel()

  @staticmethod
  def _fire(message: Callable[[], str]) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"sparsejax.distributed.process_group: StartupError: {message()}\n")
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
      ``[0, P)``, an address that is not ``host:port``, a port rank 0 cannot
      listen on).
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
  if coordinator_address is not None and process_id == 0:
    check_coordinator_port(coordinator_address)
  t0 = time.monotonic()

  def message() -> str:  # at the timeout: what the address shows then
    probe = _probe(coordinator_address) if coordinator_address is not None and process_id != 0 else None
    return waiting_message(coordinator_address, num_processes, process_id, initialization_timeout, probe)

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
