"""Kill one host of a multi-host run, resume it, and check that nothing was lost (issue 47, item 3).

Emulated hosts (``harness/namespaces.py``: one network namespace per host on a bridge, each link limited with
``tc tbf``) run ``sparsejax-train`` with the explicit multi-host flags (``--coordinator_address``,
``--num_processes``, ``--process_id``) and one work directory, as hosts with a shared filesystem would. Three jobs of
the same command:

1. straight: ``--steps`` steps, a checkpoint every ``--checkpoint_every``;
2. killed: once it has logged step ``--kill_after`` (between two checkpoints), host ``--kill_rank``'s process gets
   SIGKILL (a host that dies): the others must end by themselves, not hang (the seconds they took are recorded);
3. resumed: the same command again on every host: it continues from the newest checkpoint and ends at ``--steps``.

Reports the step the host died at, the checkpoint resumed from, the seconds until the survivors ended and their
exit codes, the resumed run's wall time, and whether its final parameters (every shard, gathered) and the losses
logged after the resume equal the straight run's bit for bit. Needs root (``ip netns``, ``tc``); else says so and
exits 0.

  sudo python benchmarks/cluster_resume.py --processes 4 --rate 1gbit --json out.json
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from sparsejax.workdir.checkpoint import Checkpoints

import harness
from harness.namespaces import can_use_namespaces, in_namespace, setup_namespaces, teardown_namespaces

TRAIN = os.path.join(os.path.dirname(sys.executable), "sparsejax-train")
STARTED: list[subprocess.Popen] = []  # every host's process, killed before the namespaces go (ip netns del does not)


def train_args(args, workdir: str) -> list[str]:
  """The job's flags besides the multi-host ones: synthetic data, a sampled softmax over the sharded output layer."""
  return ["--dataset=synthetic", f"--synthetic_samples={args.samples}", f"--synthetic_features={args.features}",
          f"--synthetic_labels={args.labels}", f"--hidden_dims={args.hidden}", f"--active_k={args.active_k}",
          f"--batch_size={args.batch}", f"--max_steps={args.steps}", "--num_epochs=none",
          f"--checkpoint_every={args.checkpoint_every}", f"--eval_every={args.steps}", "--eval_samples=500",
          "--log_every=10", "--noprogress", "--softmax=sampled", f"--workdir={workdir}"]


def start_hosts(args, workdir: str, port: int, addrs: list[str], logs: str, name: str) -> list[subprocess.Popen]:
  """One ``sparsejax-train`` per emulated host; each one's output in ``logs/NAME_rankI.log``."""
  procs = []
  for rank in range(args.processes):
    command = [TRAIN, *train_args(args, workdir), f"--coordinator_address={addrs[0]}:{port}",
               f"--num_processes={args.processes}", f"--process_id={rank}"]
    with open(os.path.join(logs, f"{name}_rank{rank}.log"), "w") as log:
      procs.append(subprocess.Popen(in_namespace(rank, command, args.processes, args.pin), stdout=log,
                                    stderr=subprocess.STDOUT))
  STARTED.extend(procs)
  return procs


def wait(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
  """The exit codes once every process ended, or None for those still running after ``timeout`` s (killed)."""
  deadline = time.monotonic() + timeout
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(0.1)
  codes = [p.poll() for p in procs]
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()
  return codes


def newest_checkpoint(workdir: str) -> int:
  """The newest finished checkpoint's step (orbax names them by step once written), 0 where none is."""
  try:
    return max((int(name) for name in os.listdir(os.path.join(workdir, "checkpoints")) if name.isdigit()), default=0)
  except FileNotFoundError:
    return 0


def losses(workdir: str) -> dict[int, float]:
  """The training losses logged, by step (the last record of a step where a resume logged it again); a line still
  being written is left out."""
  records = []
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError:
          break
  except FileNotFoundError:
    return {}
  return {r["step"]: r["loss"] for r in records if "loss" in r and not r.get("final")}


def final_state(workdir: str) -> tuple[int, dict]:
  """The newest checkpoint's step and its state, every shard gathered into this process."""
  checkpoints = Checkpoints(workdir, writable=False)
  step = checkpoints.latest_step()
  return step, checkpoints.restore_arrays(step)


def same_state(a, b) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(leaves_a) == len(leaves_b) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                                for x, y in zip(leaves_a, leaves_b))


def run(args, addrs: list[str], out: str) -> dict:
  logs = os.path.join(out, "logs")
  os.makedirs(logs, exist_ok=True)
  straight, split = os.path.join(out, "straight"), os.path.join(out, "split")
  port = 29400 + os.getpid() % 1000

  start = time.monotonic()
  codes = wait(start_hosts(args, straight, port, addrs, logs, "straight"), args.timeout)
  straight_seconds = time.monotonic() - start
  if codes != [0] * args.processes:
    raise SystemExit(f"the straight run failed (exit codes {codes}): see {logs}/straight_rank*.log")
  print(f"straight: {args.steps} steps over {args.processes} hosts in {straight_seconds:.1f} s", flush=True)

  procs = start_hosts(args, split, port + 1, addrs, logs, "killed")
  start = time.monotonic()
  while max(losses(split), default=0) < args.kill_after:
    if time.monotonic() - start > args.timeout or any(p.poll() is not None for p in procs):
      wait(procs, 0)
      raise SystemExit(f"the run to kill ended or stalled before step {args.kill_after}: see {logs}/killed_rank*.log")
    time.sleep(0.02)
  killed_at = max(losses(split))
  procs[args.kill_rank].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  codes = wait(procs, args.survivor_timeout)
  ended = time.monotonic() - killed
  survivors = [c for rank, c in enumerate(codes) if rank != args.kill_rank]
  resume_from = newest_checkpoint(split)
  print(f"killed host {args.kill_rank} at about step {killed_at} (newest checkpoint {resume_from}); the other hosts "
        f"ended in {ended:.1f} s with exit codes {survivors}", flush=True)

  start = time.monotonic()
  codes = wait(start_hosts(args, split, port + 2, addrs, logs, "resumed"), args.timeout)
  resumed_seconds = time.monotonic() - start
  if codes != [0] * args.processes:
    raise SystemExit(f"the resumed run failed (exit codes {codes}): see {logs}/resumed_rank*.log")
  with open(os.path.join(logs, "resumed_rank0.log")) as f:
    resumed_log = f.read()
  (step_a, state_a), (step_b, state_b) = final_state(straight), final_state(split)
  loss_a, loss_b = losses(straight), losses(split)
  after = [s for s in loss_a if s > resume_from]
  result = {
      "processes": args.processes, "rate": args.rate, "steps": args.steps, "labels": args.labels,
      "checkpoint_every": args.checkpoint_every, "straight_seconds": round(straight_seconds, 1),
      "killed_rank": args.kill_rank, "killed_at_step": killed_at, "resumed_from_step": resume_from,
      "steps_redone": killed_at - resume_from, "survivors_ended_seconds": round(ended, 1),
      "survivor_exit_codes": survivors, "survivors_hung": any(c is None for c in survivors),
      "resumed_seconds": round(resumed_seconds, 1),
      "resume_logged": f"resumed from step {resume_from}" in resumed_log,
      "final_steps": [step_a, step_b], "same_final_state": step_a == step_b == args.steps and same_state(state_a,
                                                                                                       state_b),
      "same_losses_after_resume": bool(after) and all(loss_a[s] == loss_b.get(s) for s in after),
  }
  print(f"resumed from step {resume_from} and ended at {step_b} in {resumed_seconds:.1f} s: final state "
        f"{'the same bits as' if result['same_final_state'] else 'DIFFERENT from'} the straight run's, the "
        f"{len(after)} losses logged after the resume {'equal' if result['same_losses_after_resume'] else 'DIFFER'}",
        flush=True)
  return result


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--processes", type=int, default=4, help="emulated hosts, one process each")
  parser.add_argument("--rate", default="1gbit", help="each host's link (tc tbf rate, with a 2 ms bucket)")
  parser.add_argument("--labels", type=int, default=100_000)
  parser.add_argument("--features", type=int, default=10_000)
  parser.add_argument("--samples", type=int, default=20_000)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--active_k", type=int, default=256)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--checkpoint_every", type=int, default=50)
  parser.add_argument("--kill_after", type=int, default=170, help="kill once this step is logged (--log_every 10)")
  parser.add_argument("--kill_rank", type=int, default=2, help="the host that dies")
  parser.add_argument("--survivor_timeout", type=float, default=300, help="seconds the other hosts get to end")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds a whole job gets")
  parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                      help="pin each host to its share of the cores")
  parser.add_argument("--keep", action="store_true", help="keep the work directories and logs")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  if not 0 <= args.kill_rank < args.processes:
    parser.error(f"--kill_rank={args.kill_rank}: not one of the {args.processes} hosts")
  if not 0 < args.kill_after < args.steps:
    parser.error(f"--kill_after={args.kill_after}: not a step before --steps={args.steps}")
  problem = can_use_namespaces()
  if problem:
    print(f"cluster_resume: skipped: {problem}")
    return
  out = tempfile.mkdtemp(prefix="sjcluster_resume_")
  teardown_namespaces(args.processes)  # leftovers of an interrupted run
  try:
    addrs = setup_namespaces(args.processes, args.rate)
    result = run(args, addrs, out)
  finally:
    wait(STARTED, 0)  # an error or Ctrl-C here: no host trains on into a directory about to be removed
    teardown_namespaces(args.processes)
    if not args.keep:
      shutil.rmtree(out, ignore_errors=True)
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
