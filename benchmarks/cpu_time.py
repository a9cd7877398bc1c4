"""Where a command's CPU time goes: wall, user and system seconds and page faults of the quick start (or any
``examples/train.py`` arguments), with each allocator, quiet and beside a busy neighbour (issue 48).

Each run starts a fresh work directory and compilation cache (``--compilation_cache=none``), so that compiling is
counted as a new user's first run counts it. The neighbour is one process spinning on one core at the same
priority, as another user's job would. The figures come from the run's own rusage (``os.wait4``).

  python benchmarks/cpu_time.py --json benchmarks/results/cpu_time/quick_start.json
  python benchmarks/cpu_time.py --allocators auto --neighbours 0 --args "--max_steps=200 --recipe=none"
"""

import os
import shlex
import subprocess
import sys
import tempfile
import time

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
_SPIN = "while True: pass"


def run(args: list[str], allocator: str, neighbours: int) -> dict:
  """One run of ``examples/train.py args`` with ``SPARSEJAX_ALLOCATOR=allocator`` beside ``neighbours`` spinners."""
  env = dict(os.environ, SPARSEJAX_ALLOCATOR=allocator)
  env.pop("SPARSEJAX_ALLOCATOR_APPLIED", None)
  spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(neighbours)]
  try:
    with tempfile.TemporaryDirectory() as workdir:
      start = time.perf_counter()
      proc = subprocess.Popen([sys.executable, TRAIN, *args, f"--workdir={workdir}", "--compilation_cache=none",
                               "--noprogress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
      out = proc.stdout.read()
      _, status, usage = os.wait4(proc.pid, 0)
      wall = time.perf_counter() - start
  finally:
    for spinner in spinners:
      spinner.kill()
      spinner.wait()
  if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit(f"examples/train.py {' '.join(args)} failed (SPARSEJAX_ALLOCATOR={allocator})")
  cpu = usage.ru_utime + usage.ru_stime
  return {"allocator": allocator, "neighbours": neighbours, "wall_s": round(wall, 2),
          "user_s": round(usage.ru_utime, 2), "sys_s": round(usage.ru_stime, 2),
          "sys_share": round(usage.ru_stime / max(cpu, 1e-9), 3),
          "cpu_over_wall_x_cores": round(cpu / (wall * harness.usable_cores()), 3),
          "minor_faults": usage.ru_minflt,
          # Written to files (the block layer's 512-byte units: what reached the disk cache's write-back).
          "written_mb": round(usage.ru_oublock * 512 / 2**20, 1),
          "last_line": out.strip().splitlines()[-1] if out.strip() else ""}


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--args", default="", help="examples/train.py's arguments (default: none, the quick start)")
  parser.add_argument("--allocators", default="system,auto", help="SPARSEJAX_ALLOCATOR values, comma-separated")
  parser.add_argument("--neighbours", default="0,1", help="busy neighbours of each run, comma-separated")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  results = []
  for neighbours in [int(n) for n in args.neighbours.split(",")]:
    for allocator in args.allocators.split(","):
      result = run(shlex.split(args.args), allocator, neighbours)
      results.append(result)
      print(f"allocator {allocator:8s} neighbours {neighbours}: wall {result['wall_s']:7.1f} s  user "
            f"{result['user_s']:7.1f}  sys {result['sys_s']:6.1f} ({result['sys_share']:.0%})  faults "
            f"{result['minor_faults']:,}  written {result['written_mb']:,.0f} MB  | {result['last_line'][:60]}",
            flush=True)
  quiet = {r["allocator"]: r["wall_s"] for r in results if r["neighbours"] == 0}
  for r in results:
    if r["neighbours"] and r["allocator"] in quiet:
      r["wall_over_quiet"] = round(r["wall_s"] / quiet[r["allocator"]], 2)
      print(f"allocator {r['allocator']}: beside {r['neighbours']} busy neighbour(s) {r['wall_over_quiet']}x the "
            "quiet wall time")
  harness.write_json(args.json, {"command": "examples/train.py " + args.args, "runs": results})


if __name__ == "__main__":
  main()
