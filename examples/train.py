r"""Trains a SLIDE network (or its dense baseline) and reports P@k: ``sparsejax-train`` as a script.

  python examples/train.py                              # ICD-10-CM, built in
  python examples/train.py --dataset=synthetic --synthetic_labels=200000 --workdir=/tmp/synth
  python examples/train.py --help                       # every setting, by section

The flags, their documentation and their validation live in sparsejax/cli/flags.py,
sparsejax/cli/train.py and sparsejax/config.py; the training loop is sparsejax.train.train_and_evaluate.
"""

from absl import app

from sparsejax.cli import flags, train
from sparsejax.train import allocator

if __name__ == "__main__":
  allocator.adopt()  # as sparsejax-train: large temporaries reused, not page-faulted anew (runs itself again)
  flags.define_flags(train.TRAIN)
  app.run(train.train, flags_parser=lambda argv: flags.parse_flags(argv, flags.FLAGS, train.TRAIN))
