"""Parameter averaging, offline: test P@1 of each kept checkpoint of a run, and of moving averages of them.

The study behind ``--average_steps`` (issue 31, benchmarks/RESULTS.md "Parameter averaging"): train a run that
keeps its raw parameters at a fixed period (no averaging of its own), then score every checkpoint on the test set
with the exact softmax, alone and as the newest snapshot of an exponential moving average (bias-corrected, time
constant H steps, the snapshots being the checkpoints)::

  python benchmarks/accuracy.py --dataset gcide_cloze --system sparsejax --num_epochs 6 --set recipe=wide \\
      --set checkpoint_every=297 --set keep_checkpoints=null --set average_steps=0 --variant wide6ck
  python benchmarks/averaging.py /tmp/sparsejax_accuracy/gcide_cloze/sparsejax-6ep+wide6ck \\
      /tmp/sparsejax_accuracy/gcide_cloze/test.txt --horizons 500,1000,2000

One line per checkpoint: its step, its own test P@1 and each average's.
"""


import jax
import jax.numpy as jnp
import numpy as np

from sparsejax import data as xcdata
from sparsejax import network
from sparsejax.workdir import checkpoint

import harness


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("run_dir", help="a run's work directory, its checkpoints kept (--keep_checkpoints=null)")
  parser.add_argument("test_file", help="the test set (XC format)")
  parser.add_argument("--horizons", default="500,1000,2000", help="time constants of the averages, in steps")
  harness.add_json_flag(parser, help="also write the table here (with the machine)")
  args = parser.parse_args()
  horizons = [float(h) for h in args.horizons.split(",")]
  test = xcdata.load_xc_file(args.test_file)
  fids, fvals, labels = test.to_padded()
  checkpoints = checkpoint.Checkpoints(args.run_dir, writable=False)

  def params_of(step):
    t = checkpoints.restore_arrays(step)
    return (np.asarray(t["embed"]["w"]), np.asarray(t["embed"]["b"]),
            tuple((np.asarray(w), np.asarray(b)) for w, b in t["hidden"]), np.asarray(t["out"]["w"]),
            np.asarray(t["out"]["b"]))

  @jax.jit
  def top1(p, fi, fv):
    ew, eb, hidden, ow, ob = p
    h = network.hidden_forward(ew, (eb, hidden), fi, fv)
    return jnp.argmax(h @ ow.T + ob, axis=1)

  def p_at_1(p):
    hits = 0
    for s in range(0, len(fids), 2048):
      pred = np.asarray(top1(p, fids[s:s + 2048], fvals[s:s + 2048]))
      hits += np.sum(np.any(labels[s:s + 2048] == pred[:, None], axis=1))
    return hits / len(fids)

  sums, weights, previous, rows = {h: None for h in horizons}, {h: 0.0 for h in horizons}, 0, []
  for step in checkpoints.all_steps():
    p = params_of(step)
    row = {"step": step, "single": p_at_1(p)}
    for h in horizons:
      decay = float(np.exp(-(step - previous) / h))
      older = jax.tree.map(np.zeros_like, p) if sums[h] is None else sums[h]
      sums[h] = jax.tree.map(lambda a, x, d=decay: d * a + (1 - d) * x, older, p)
      weights[h] = decay * weights[h] + (1 - decay)
      row[f"average_{int(h)}"] = p_at_1(jax.tree.map(lambda a, w=weights[h]: a / w, sums[h]))
    previous = step
    rows.append(row)
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
  harness.write_json(args.json, {"rows": rows})


if __name__ == "__main__":
  main()
