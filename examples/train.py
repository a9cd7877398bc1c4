r"""Trains a SLIDE network (or its dense baseline) and reports P@k: ``sparsejax-train`` as a script.

  python examples/train.py                              # ICD-10-CM, built in
  python examples/train.py --dataset=synthetic --synthetic_labels=200000 --workdir=/tmp/synth
  python examples/train.py --help                       # every setting, by section

The flags, their documentation and their validation live in sparsejax/train/cli.py
and sparsejax/config.py; the training loop is sparsejax.train.train_and_evaluate.
"""

from absl import app

from sparsejax.train import allocator, cli

if __name__ == "__main__":
  allocator.adopt()  # as sparsejax-train: large temporaries reused, not page-faulted anew (runs itself again)
  cli.define_flags()
  app.run(cli.train, flags_parser=cli.parse_flags)
