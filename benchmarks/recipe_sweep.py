"""Network recipes compared at the same wall-clock budget: the sweeps behind ``sparsejax.train.recipes``.

Each variant trains ``sparsejax-train --dataset=NAME --max_seconds=BUDGET`` with its settings (no recipe search:
the settings are explicit), one after another in this process (the dataset is loaded once), and prints one JSON
line: the selected state's test P@1/P@5/PSP@5, the step and epoch selected, samples/s, the validation curve
(epoch, training seconds, P@1) and the machine (``harness.machine``)::

  python benchmarks/recipe_sweep.py --dataset gcide_cloze --budget 150 \\
      'h512d25k512:{"hidden_dims": [512], "dropout": 0.25, "active_k": 512}' 'small:{}'

A variant is ``NAME:JSON`` (``Config`` settings by name; ``NAME:`` alone is the defaults). Run it on a quiet
machine: the budget is wall-clock.
"""

import json
import sys
import tempfile
import time

from sparsejax.config import Config
from sparsejax.settings import override
from sparsejax.train import driver, plan
from sparsejax.train.metric_writer import read_records

import harness


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--dataset", required=True)
  parser.add_argument("--budget", type=float, required=True, help="training seconds per variant")
  parser.add_argument("variants", nargs="+", help="NAME:JSON settings")
  args = parser.parse_args()
  loaded = {}
  load = plan.load_dataset

  def load_once(config, seed=0):  # the variants share the data: load it once
    if (config, seed) not in loaded:
      loaded[(config, seed)] = load(config, seed=seed)
    return loaded[(config, seed)]

  plan.load_dataset = load_once
  for spec in args.variants:
    name, _, settings = spec.partition(":")
    settings = json.loads(settings or "{}")
    config = override(Config(), dataset=args.dataset, max_seconds=args.budget, checkpoint_every=10**9,
                      progress=False, **settings)
    if not settings:  # the defaults, as they are, without a search
      config = override(config, recipe="small")
    with tempfile.TemporaryDirectory() as workdir:
      t = time.time()
      final = driver.train_and_evaluate(config, workdir)
      curve = [(round(r["epoch"], 2), round(r["seconds"]), round(r["p@1"], 4)) for r in read_records(workdir)
               if r.get("split") == "validation"]
    print(json.dumps({"dataset": args.dataset, "budget": args.budget, "name": name, **settings,
                      "test_p@1": round(final["p@1"], 4), "test_p@5": round(final["p@5"], 4),
                      "psp@5": round(final.get("psp@5", 0), 4), "sel_step": final.get("selected_step"),
                      "last_step": final.get("last_step"), "epoch_sel": round(final["epoch"], 2),
                      "sps": round(final["samples_per_sec"]), "wall": round(time.time() - t), "val": curve,
                      "machine": harness.machine()}),
          flush=True)


if __name__ == "__main__":
  sys.exit(main())
