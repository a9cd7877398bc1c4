"""Regularisation and learning-rate decay against the default, by the checkpoint that model selection keeps.

Trains the default network for the same number of epochs with each variant, evaluates on the validation split
once per epoch, keeps the best state (as ``sparsejax-train`` does) and reports its test P@1 with the selected
step and the last epoch's validation P@1 (how far the run fell from its peak). JSON lines, and ``--json``::

  python benchmarks/regularization.py --dataset gcide --epochs 8
  python benchmarks/regularization.py --dataset synthetic --epochs 4
  python benchmarks/regularization.py --dataset gcide_cloze --epochs 6

A variant is ``name:flag=value,flag=value`` (``Config`` field names), ``;``-separated in ``--variants``; the
first is the reference. Timings are not compared, only accuracy.
"""

import json
import math
import tempfile

from sparsejax.config import Config
from sparsejax.data import load_dataset
from sparsejax.settings import override
from sparsejax.train import train_and_evaluate
from sparsejax.train.metric_writer import read_records

import harness

DEFAULT_VARIANTS = ("default:;dropout 0.25:dropout=0.25;dropout 0.5:dropout=0.5;weight decay 1e-4:weight_decay=1e-4;"
                    "weight decay 1e-3:weight_decay=1e-3;cosine decay:decay_steps=EPOCHS")


def _parse(text: str, epoch_steps: int, epochs: float) -> list[tuple[str, dict]]:
  variants = []
  for item in filter(None, (v.strip() for v in text.split(";"))):
    name, _, changes = item.partition(":")
    fields = {}
    for change in filter(None, changes.split(",")):
      key, _, value = change.partition("=")
      value = value.replace("EPOCHS", str(int(epoch_steps * epochs)))
      fields[key.strip()] = json.loads(value) if value.strip()[0].isdigit() or value in ("true", "false") else value
    variants.append((name.strip(), fields))
  return variants


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--dataset", default="gcide", choices=("gcide", "gcide_cloze", "synthetic", "icd10"))
  parser.add_argument("--labels", type=int, default=200_000, help="synthetic labels")
  parser.add_argument("--samples", type=int, default=110_000, help="synthetic samples")
  parser.add_argument("--features", type=int, default=100_000, help="synthetic features")
  parser.add_argument("--epochs", type=float, default=8.0)
  parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                      help="name:field=value,... ;-separated (EPOCHS in a value: the run's steps)")
  harness.add_json_flag(parser)
  args = parser.parse_args()
  base = override(Config(), dataset=args.dataset, num_epochs=args.epochs, checkpoint_every=10**9, progress=False,
                  log_every=100, **(dict(synthetic_labels=args.labels, synthetic_samples=args.samples,
                                         synthetic_features=args.features) if args.dataset == "synthetic" else {}))
  if args.dataset in ("gcide", "gcide_cloze"):
    base = override(base, test_fraction=0.2)
  loaded = load_dataset(base.data, seed=base.run.seed)
  num_train = loaded.train.num_samples - round(loaded.train.num_samples * base.data.validation_fraction)
  epoch_steps = math.ceil(num_train / base.optim.batch_size)
  base = override(base, eval_every=epoch_steps)
  runs = []
  for name, fields in _parse(args.variants, epoch_steps, args.epochs):
    config = override(base, **fields)
    with tempfile.TemporaryDirectory() as workdir:
      final = train_and_evaluate(config, workdir)
      validation = [r for r in read_records(workdir) if r.get("split") == "validation"]
    run = {"variant": name, **fields, "test_p@1": final["p@1"], "test_p@5": final["p@5"],
           "selected_step": final.get("selected_step"), "last_step": final.get("last_step"),
           "validation_p@1_best": max((r["p@1"] for r in validation), default=None),
           "validation_p@1_last": validation[-1]["p@1"] if validation else None,
           "validation_p@1_by_epoch": [round(r["p@1"], 4) for r in validation]}
    print(json.dumps(run), flush=True)
    runs.append(run)
  harness.write_json(args.json, {"dataset": args.dataset, "epochs": args.epochs, "epoch_steps": epoch_steps,
                                 "runs": runs})


if __name__ == "__main__":
  main()
