r"""Trains a SLIDE network (or its dense baseline) and reports P@k.

  python examples/train.py                              # ICD-10-CM, built in
  python examples/train.py --dataset=synthetic --synthetic_labels=200000
  python examples/train.py --dataset=files --train_file=train.txt --test_file=test.txt
  python examples/train.py --model=dense                # full-softmax baseline

Every TrainConfig field is a flag; see sparsejax/train.py.
"""

import dataclasses

from absl import app, flags, logging

from sparsejax.train import TrainConfig, train_and_evaluate

FLAGS = flags.DEFINE_string("workdir", "/tmp/sparsejax", "Output directory (metrics, checkpoints); resumed if present.")


def _define_flags():
  """One flag per TrainConfig field, typed after its default."""
  for field in dataclasses.fields(TrainConfig):
    default, name, doc = field.default, field.name, f"TrainConfig.{field.name}"
    if isinstance(default, bool):
      flags.DEFINE_bool(name, default, doc)
    elif isinstance(default, tuple):
      flags.DEFINE_list(name, [str(x) for x in default], doc + " (comma-separated)")
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, doc)
    elif isinstance(default, float):
      flags.DEFINE_float(name, default, doc)
    else:  # str or None
      flags.DEFINE_string(name, None if default is None else str(default), doc)


_define_flags()


def _config_from_flags() -> TrainConfig:
  values = {}
  for field in dataclasses.fields(TrainConfig):
    value = flags.FLAGS[field.name].value
    if isinstance(field.default, tuple):
      value = tuple(int(x) for x in value)
    elif field.default is None and value is not None and field.type in ("int | None", "float | None"):
      value = (int if field.type.startswith("int") else float)(value)
    values[field.name] = value
  return TrainConfig(**values)


def main(argv):
  del argv
  config = _config_from_flags()
  logging.info("config: %s", config)
  final = train_and_evaluate(config, FLAGS.value)
  keys = ["p@1", "p@3", "p@5", "ndcg@5", "psp@5", "sampled_p@1", "sampled_p@5"]
  print(f"step {final['step']}  " + "  ".join(f"{k.upper()} {final[k]:.4f}" for k in keys if k in final)
        + f"  ({final['samples_per_sec']:,.0f} samples/s)")


if __name__ == "__main__":
  app.run(main)
