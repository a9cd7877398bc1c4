"""Chaos resume: SIGKILL a training run at random moments, restart it, compare with an uninterrupted run.

  python benchmarks/chaos.py --json benchmarks/results/chaos.json      # 20 kills, 1 and 2 processes
  python benchmarks/chaos.py --processes 1 --kills 5                     # a quick look

For each process count P: an uninterrupted reference run of a small model
(synthetic data, frequent table rebuilds and checkpoints), then the same run in
another work directory, killed with SIGKILL ``--kills`` times and restarted
after each kill (for P = 2, a random rank is killed and the launcher ends the
job; then the job is restarted), then run to its end. The final training
states (every array: weights, Adam moments, hash tables, step) must be bit for
bit those of the reference, and so must the data position.

Kills land at random moments: a random delay after the run has made progress
(a new checkpoint since the last kill), right when a checkpoint save is in
flight (its temporary directory exists), or during start-up and restore. Where
each kill landed is read, not guessed: just before the SIGKILL the victim
dumps its Python stacks (``faulthandler`` on SIGUSR1, installed by this script
when it runs the trainer), and the innermost sparsejax frame names the phase
(step, table rebuild, checkpoint save, restore, ...).
"""

import ctypes
import faulthandler
import json
import os
import platform
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
# A small model with frequent table rebuilds and checkpoints (rebuilds and saves are where kills can hurt).
RUN_FLAGS = dict(dataset="synthetic", synthetic_samples=4000, synthetic_features=500, synthetic_labels=2000,
                 hidden_dims="32", active_k=64, num_tables=4, batch_size=32, max_steps=600, num_epochs="none",
                 eval_every=10**6, eval_samples=200, log_every=50, checkpoint_every=10, keep_checkpoints=3,
                 rebuild_period=4, rebuild_growth=1.0, rehash_period=45, reinsert="labels", progress="false",
                 learning_rate=0.003, seed=0, candidates="lsh")
# Where a kill landed: the innermost sparsejax frame of the victim's main thread that matches one of these (function
# names) names the phase; none matching: start-up (imports, data, compilation before the loop).
PHASES = [("restore", re.compile(r"restore")), ("checkpoint save", re.compile(r"save|wait_until_finished")),
          ("table rebuild", re.compile(r"rebuild|rehash|maintain|new_hash_functions")),
          ("evaluation", re.compile(r"^(evaluate\w*|__call__|predict\w*)$")), ("step", re.compile(r"step|^train_one$"))]


# --- Child: the trainer, with a stack dump on SIGUSR1 ------------------------------------------------------------

def child(argv: list[str]) -> None:
  """``chaos.py child DUMP_PREFIX -- TRAIN_FLAGS``: runs examples/train.py; SIGUSR1 dumps stacks to a file."""
  prefix, flags = argv[0], argv[2:]
  rank = next((a.split("=", 1)[1] for a in flags if a.startswith("--process_id=")), "0")
  dump = open(f"{prefix}{rank}.txt", "a")
  # Only the main thread's stack (the harness sends the signal to that thread): dumping all threads reads other
  # threads' frames while they run, which crashed 3 victims with SIGSEGV in 60 kills.
  faulthandler.register(signal.SIGUSR1, file=dump, all_threads=False)
  sys.argv = [TRAIN] + flags
  runpy.run_path(TRAIN, run_name="__main__")


# --- Harness ----------------------------------------------------------------------------------------------------

def _flags(workdir: str) -> list[str]:
  return [f"--{k}={v}" for k, v in dict(RUN_FLAGS, workdir=workdir).items()]


class Job:
  """One start of the run (P processes), its output captured in a file."""

  def __init__(self, processes: int, workdir: str, dumps: str, log: str):
    command = [os.path.abspath(__file__), "child", dumps, "--"] + _flags(workdir)
    if processes == 1:
      command = [sys.executable, "-u"] + command
    else:
      command = [sys.executable, "-m", "sparsejax.distributed.launch", "-n", str(processes),
                 f"--log_dir={workdir}/logs", "--stop_timeout=5"] + command
    self.log_path = log
    self.log = open(log, "w")
    self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
    self.processes, self.dumps = processes, dumps

  def rank_pids(self, timeout: float = 60) -> list[int]:
    if self.processes == 1:
      return [self.proc.pid]
    deadline = time.time() + timeout
    while time.time() < deadline:
      m = re.search(r"\[launch\] \d+ ranks \(pids ([\d, ]+)\)", open(self.log_path).read())
      if m:
        return [int(p) for p in m.group(1).split(", ")]
      time.sleep(0.05)
    raise RuntimeError(f"the launcher did not start its ranks: {open(self.log_path).read()[-2000:]}")

  def wait(self, timeout: float) -> int:
    try:
      return self.proc.wait(timeout=timeout)
    finally:
      self.log.close()

  def output(self) -> str:
    return open(self.log_path).read()


def checkpoint_steps(workdir: str) -> tuple[list[int], set[str]]:
  """Complete checkpoint steps in ``workdir``, and its temporary directories (saves in flight or cut short)."""
  path = os.path.join(workdir, "checkpoints")
  names = os.listdir(path) if os.path.isdir(path) else []
  return sorted(int(n) for n in names if n.isdigit()), {n for n in names if "tmp" in n}


def phase_of(dump: str) -> tuple[str, str]:
  """The phase a faulthandler dump shows the trainer's main thread in, and the frame that says so."""
  blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
  main = next((b for b in blocks if re.search(r"chaos\.py\", line \d+ in child", b)), "")
  frames = re.findall(r'File "([^"]+)", line \d+ in (\w+)', main)  # innermost first
  ours = [(os.path.basename(f), fn) for f, fn in frames if "sparsejax" in f or f.endswith("train.py")]
  for path, function in ours:
    for name, pattern in PHASES:
      if pattern.search(function):
        return name, f"{path}:{function}"
  return "start-up", f"{ours[0][0]}:{ours[0][1]}" if ours else "before the trainer's code"


_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())  # syscall numbers


def _signal_main_thread(pid: int, signum: int) -> None:
  """Sends ``signum`` to the main thread of process ``pid`` (tgkill; os.kill lets any thread take it)."""
  if _TGKILL is None:
    return os.kill(pid, signum)
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.syscall(_TGKILL, pid, pid, signum) != 0:
    errno = ctypes.get_errno()
    raise ProcessLookupError(errno, os.strerror(errno))


def kill_once(job: Job, workdir: str, rng: random.Random, mode: str, last_step: int) -> dict | None:
  """Waits for a moment of kind ``mode``, dumps the victim's stacks, SIGKILLs it; None if the run ended first."""
  leftovers = checkpoint_steps(workdir)[1]  # cut short by an earlier kill
  pids = job.rank_pids()
  t0 = time.time()
  if mode == "start-up":  # a random moment before the first new checkpoint (a fast run would otherwise end early)
    deadline = t0 + rng.uniform(0.5, 25.0)
    while time.time() < deadline and job.proc.poll() is None and max(checkpoint_steps(workdir)[0],
                                                                       default=-1) <= last_step:
      time.sleep(0.01)
  else:  # wait for progress past the last kill, then for the moment
    while job.proc.poll() is None and max(checkpoint_steps(workdir)[0], default=-1) <= last_step:
      time.sleep(0.01)
    if mode == "save":
      while job.proc.poll() is None and not checkpoint_steps(workdir)[1] - leftovers:
        time.sleep(0.001)
    else:
      deadline = time.time() + rng.uniform(0.0, 1.0)
      while time.time() < deadline and job.proc.poll() is None:
        time.sleep(0.005)
  if job.proc.poll() is not None:
    return None
  victim = rng.randrange(len(pids))
  dump_path = f"{job.dumps}{victim}.txt"
  size = os.path.getsize(dump_path) if os.path.exists(dump_path) else 0
  in_flight = bool(checkpoint_steps(workdir)[1] - leftovers)
  try:
    _signal_main_thread(pids[victim], signal.SIGUSR1)
  except ProcessLookupError:
    return None
  deadline, last, stable_since = time.time() + 1.0, size, time.time()
  while time.time() < deadline:  # until the dump has stopped growing for 30 ms
    now_size = os.path.getsize(dump_path) if os.path.exists(dump_path) else size
    if now_size != last:
      last, stable_since = now_size, time.time()
    elif now_size > size and time.time() - stable_since > 0.03:
      break
    time.sleep(0.002)
  try:
    os.kill(pids[victim], signal.SIGKILL)
  except ProcessLookupError:  # it died during the dump: a kill all the same (its exit status says how)
    pass
  dump = open(dump_path).read()[size:] if os.path.exists(dump_path) else ""
  phase, frame = phase_of(dump) if dump else ("start-up", "(no dump: before the handler was installed)")
  code = job.wait(timeout=120)
  if code in (-signal.SIGSEGV, 128 + signal.SIGSEGV):  # faulthandler reads other threads' frames unsafely
    phase, frame = "unknown", "(the stack dump crashed the victim with SIGSEGV before the SIGKILL)"
  return {"mode": mode, "rank": victim, "phase": phase, "frame": frame, "save_in_flight": in_flight,
          "seconds_after_start": round(time.time() - t0, 2), "last_checkpoint": max(checkpoint_steps(workdir)[0],
                                                                                    default=None),
          "job_exit": code}


def final_state(workdir: str) -> tuple[int, dict, list[np.ndarray]]:
  """The newest checkpoint's step, data position and every state array (unsharded into this process)."""
  import jax
  import orbax.checkpoint as ocp
  from absl import logging
  logging.set_verbosity(logging.ERROR)  # orbax warns that a multi-process checkpoint has no single metadata file
  step = max(checkpoint_steps(workdir)[0])
  path = os.path.join(workdir, "checkpoints", str(step))
  checkpointer = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        checkpointer.metadata(os.path.join(path, "state")).item_metadata.tree)
  state = checkpointer.restore(os.path.join(path, "state"), target)
  data = json.load(open(os.path.join(path, "data", "metadata"))) if os.path.exists(
      os.path.join(path, "data", "metadata")) else None
  return step, data, [np.asarray(x) for x in jax.tree.leaves(state)]


def bit_identical(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
  return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                  for x, y in zip(a, b))


def chaos(processes: int, kills: int, root: str, rng: random.Random) -> dict:
  """The reference run, the killed-and-restarted run, and their comparison."""
  reference, chaotic = os.path.join(root, f"reference{processes}"), os.path.join(root, f"chaos{processes}")
  dumps = os.path.join(root, f"dump{processes}_rank")
  t0 = time.time()
  job = Job(processes, reference, dumps, os.path.join(root, f"reference{processes}.log"))
  if job.wait(timeout=1800) != 0:
    raise RuntimeError(f"reference run failed:\n{job.output()[-3000:]}")
  reference_seconds = time.time() - t0
  records, restarts, last_step = [], 0, -1
  modes = ["random"] * 10 + ["save"] * 6 + ["start-up"] * 4
  while len(records) < kills:
    job = Job(processes, chaotic, dumps, os.path.join(root, f"chaos{processes}_{restarts}.log"))
    restarts += 1
    record = kill_once(job, chaotic, rng, rng.choice(modes), last_step)
    if record is None:
      raise RuntimeError(f"the run ended before kill {len(records) + 1} (raise max_steps):\n{job.output()[-3000:]}")
    resumed = re.search(r"resumed from step (\d+)", job.output())
    record["resumed_from"] = int(resumed.group(1)) if resumed else None  # None: killed before it said
    records.append(record)
    last_step = record["last_checkpoint"] if record["last_checkpoint"] is not None else last_step
    print(f"  P={processes} kill {len(records):2d} ({record['mode']:8s}): "
          f"rank {record['rank']} in {record['phase']:16s} "
          f"({record['frame']}), save in flight: {record['save_in_flight']}, resumed from "
          f"{record['resumed_from']}, last checkpoint {record['last_checkpoint']}", flush=True)
  job = Job(processes, chaotic, dumps, os.path.join(root, f"chaos{processes}_final.log"))
  if job.wait(timeout=1800) != 0:
    raise RuntimeError(f"the final restart failed:\n{job.output()[-3000:]}")
  (step_a, data_a, a), (step_b, data_b, b) = final_state(reference), final_state(chaotic)
  # The data position must match; its "seconds" (training time so far, for --max_seconds) is wall-clock time.
  position_a, position_b = ({k: v for k, v in d.items() if k != "seconds"} if d else d for d in (data_a, data_b))
  arrays_identical = bit_identical(a, b)
  identical = step_a == step_b and position_a == position_b and arrays_identical
  phases = {}
  for r in records:
    phases[r["phase"]] = phases.get(r["phase"], 0) + 1
  return {"processes": processes, "kills": len(records), "restarts": restarts, "final_step": step_b,
          "reference_step": step_a, "arrays_compared": len(a), "arrays_identical": arrays_identical,
          "position_identical": position_a == position_b, "bit_identical": identical,
          "kills_by_phase": phases, "kills_with_save_in_flight": sum(r["save_in_flight"] for r in records),
          "reference_seconds": round(reference_seconds, 1), "kill_records": records}


def main():
  if sys.argv[1:2] == ["child"]:
    return child(sys.argv[2:])
  parser = harness.parser(__doc__)
  parser.add_argument("--kills", type=int, default=20)
  parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--seed", type=int, default=0)
  harness.add_json_flag(parser)
  parser.add_argument("--keep", action="store_true", help="Keep the work directories (printed).")
  args = parser.parse_args()
  rng = random.Random(args.seed)
  root = tempfile.mkdtemp(prefix="sparsejax-chaos-")
  results = []
  try:
    for processes in args.processes:
      print(f"P={processes}: reference run, then {args.kills} kills and restarts ({root})", flush=True)
      result = chaos(processes, args.kills, root, rng)
      results.append(result)
      print(f"P={processes}: {result['kills']} kills {result['kills_by_phase']}, "
            f"{result['kills_with_save_in_flight']} with a save in flight; final step {result['final_step']}; "
            f"{result['arrays_compared']} arrays bit-identical to the uninterrupted run: {result['bit_identical']}",
            flush=True)
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)
  summary = {"command": " ".join(["python", "benchmarks/chaos.py"] + sys.argv[1:]),
             "run_flags": RUN_FLAGS, "seed": args.seed, "results": results}
  harness.write_json(args.json, summary)
  return 0 if all(r["bit_identical"] for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
