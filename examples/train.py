r"""Trains a SLIDE network (or its dense baseline) and reports P@k.

  python examples/train.py                              # ICD-10-CM, built in
  python examples/train.py --dataset=synthetic --synthetic_labels=200000
  python examples/train.py --dataset=files --train_file=train.txt --test_file=test.txt
  python examples/train.py --model=dense                # full-softmax baseline

Distributed (the output layer split over P processes):

  python -m sparsejax.launch -n 4 examples/train.py --dataset=synthetic ...      # one machine
  python examples/train.py --coordinator_address=host0:1234 --num_processes=4 --process_id=$RANK ...

Every TrainConfig field is a flag; see sparsejax/train.py.
"""

import dataclasses
import types
import typing

from absl import app, flags, logging

from sparsejax import distributed
from sparsejax.train import TrainConfig, train_and_evaluate

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/sparsejax", "Output directory (metrics, checkpoints); resumed if present.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's rank.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout_seconds", 20, "A peer silent this long ends the job.")


def _base_type(field) -> type:
  """int for ``int``, ``int | None`` and the like."""
  t = field.type
  if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
    t = next(a for a in typing.get_args(t) if a is not type(None))
  return t


def _define_flags():
  """One flag per TrainConfig field, typed after its annotation."""
  for field in dataclasses.fields(TrainConfig):
    t, name, default, doc = _base_type(field), field.name, field.default, f"TrainConfig.{field.name}"
    if t is bool:
      flags.DEFINE_bool(name, default, doc)
    elif typing.get_origin(t) is tuple:
      flags.DEFINE_list(name, [str(x) for x in default], doc + " (comma-separated)")
    elif t is int:
      flags.DEFINE_integer(name, default, doc)
    elif t is float:
      flags.DEFINE_float(name, default, doc)
    else:
      flags.DEFINE_string(name, default, doc)


_define_flags()


def _config_from_flags() -> TrainConfig:
  values = {}
  for field in dataclasses.fields(TrainConfig):
    value = flags.FLAGS[field.name].value
    if typing.get_origin(_base_type(field)) is tuple:
      value = tuple(int(x) for x in value)
    values[field.name] = value
  return TrainConfig(**values)


def main(argv):
  del argv
  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                         heartbeat_timeout_seconds=_HEARTBEAT.value)
  config = _config_from_flags()
  logging.info("config: %s", config)
  final = train_and_evaluate(config, _WORKDIR.value)
  keys = ["p@1", "p@3", "p@5", "ndcg@5", "psp@5", "sampled_p@1", "sampled_p@5"]
  print(f"step {final['step']}  " + "  ".join(f"{k.upper()} {final[k]:.4f}" for k in keys if k in final)
        + f"  ({final['samples_per_sec']:,.0f} samples/s)")


if __name__ == "__main__":
  app.run(main)
