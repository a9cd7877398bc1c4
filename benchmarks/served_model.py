"""A trained work directory served as a user serves it: ``sparsejax.load(W).predict`` on a test file, exact and
sampled, with P@1, seconds and the process's peak resident memory (VmHWM) of each stage.

Loads the run once (its sealed files checked), then predicts the top 5 of every test sample: exact (every label
scored, the run's centroid fusion applied as its final evaluation ranked) and sampled at each ``--k`` candidates
from the run's serving index. One process, whatever the number of processes the run trained on::

  python benchmarks/served_model.py --workdir W --test /tmp/sparsejax_accuracy/synthetic_8m/test.txt --k 500000 16384
"""

import time

import numpy as np

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--workdir", required=True, help="the trained run's work directory")
  parser.add_argument("--test", required=True, help="the test set (an XC repository file)")
  parser.add_argument("--k", type=int, nargs="*", default=[], help="candidates of sampled prediction (none: exact)")
  harness.add_json_flag(parser)
  args = parser.parse_args()

  import sparsejax
  from sparsejax import memory
  from sparsejax.data.xc_format import load_xc_file

  test = load_xc_file(args.test)
  labels = [set(test.label_indices[a:b].tolist()) for a, b in zip(test.label_indptr[:-1], test.label_indptr[1:])]
  memory.peak_resident_mb(reset=True)
  start = time.perf_counter()
  model = sparsejax.load(args.workdir)
  result = dict(workdir=args.workdir, samples=len(test), load_seconds=time.perf_counter() - start,
                load_peak_mb=memory.peak_resident_mb(reset=True), predict={})
  print(f"loaded in {result['load_seconds']:.1f} s (peak {result['load_peak_mb']:.0f} MB)", flush=True)
  for k in [None, *args.k]:
    start = time.perf_counter()
    _, ids = model.predict(test, top=5, k=k)
    seconds = time.perf_counter() - start
    p1 = float(np.mean([ids[i, 0] in labels[i] for i in range(len(labels))]))
    name = "exact" if k is None else f"k{k}"
    result["predict"][name] = dict(k=k, p_at_1=p1, seconds=seconds, samples_per_sec=len(test) / seconds,
                                   peak_mb=memory.peak_resident_mb(reset=True))
    print(f"{name}: P@1 {p1:.4f}, {seconds:.1f} s ({len(test) / seconds:.1f} samples/s), peak "
          f"{result['predict'][name]['peak_mb']:.0f} MB", flush=True)
  harness.write_json(args.json, result)


if __name__ == "__main__":
  main()
