"""The recipe search's plan: each candidate's step time (measured on this machine and data, or modelled) and the
search's seconds give each round's steps (:func:`plan`); :mod:`sparsejax.train.search` runs the rounds.

Rounds are counted in steps, never in seconds, so that the same plan takes the same steps on any machine:
``metrics.jsonl`` records the measurements (:class:`Measured`), from which a continued search or ``--plan_from``
plans again.
"""

import dataclasses
from typing import Any

from sparsejax import step_cost
from sparsejax.config import Config
from sparsejax.model_config import ModelConfig
from sparsejax.train import recipes

# A round shorter than this tells recipes apart by noise (a few hundred steps of Adam at the default rate): a
# budget that gives fewer steps to the first round compares fewer recipes, down to none.
MIN_ROUND_STEPS = 100
# Steps that measure a candidate's step time under --max_seconds (the first, compiled, not counted); kept.
CALIBRATION_STEPS = 20


@dataclasses.dataclass(frozen=True)
class Measured:
  """What the calibration measured on this machine and data (or a recorded run's, replayed).

  Attributes:
    step_seconds: each measured candidate's steady step time (its first step, compiled, excluded).
    call_seconds: each one's seconds of a round besides its steps: the split, building and restoring the state,
      the validation evaluation, the checkpoints (measured by training the first candidate's directory once more,
      in proportion to each one's step time, at most its first training's seconds besides its steps).
    calibration_seconds: the wall time the calibration took, all candidates together, less ``startup_seconds``.
    startup_seconds: the first training's seconds besides its steps, which a run without a search spends as well
      (the process's first compilations, the first checkpoint): not charged to the search.
    eval_seconds: each one's seconds of a validation evaluation (a round evaluates every ``--eval_every`` steps):
      the calibration's scoring of ``CALIBRATION_EVAL_SAMPLES`` samples, less its compilation, scaled to the samples
      a round's evaluation scores (``--eval_samples``, at most the validation split's).
  """
  step_seconds: dict[str, float]
  call_seconds: dict[str, float]
  calibration_seconds: float
  startup_seconds: float = 0.0
  eval_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

  def record(self) -> dict[str, Any]:
    return {"measured_step_seconds": self.step_seconds, "measured_call_seconds": self.call_seconds,
            "measured_eval_seconds": self.eval_seconds, "calibration_seconds": self.calibration_seconds,
            "startup_seconds": self.startup_seconds, "calibration_steps": CALIBRATION_STEPS}

  @classmethod
  def from_record(cls, record: dict[str, Any]) -> "Measured":
    return cls(dict(record["measured_step_seconds"]), dict(record.get("measured_call_seconds", {})),
               float(record.get("calibration_seconds", 0.0)), float(record.get("startup_seconds", 0.0)),
               dict(record.get("measured_eval_seconds", {})))

  def rate(self, name: str, eval_every: int) -> float | None:
    """Seconds per step of a round: the step's, and its share of the periodic evaluations."""
    step = self.step_seconds.get(name)
    return None if step is None else step + self.eval_seconds.get(name, 0.0) / eval_every


@dataclasses.dataclass(frozen=True)
class DataShape:
  """What the step cost depends on: the training set's sizes and a sample's mean non-zero features (and the
  validation split's samples, which a round's evaluations score; None: not known)."""
  num_train: int
  num_features: int
  num_labels: int
  mean_features: float
  num_validation: int | None = None


def modelled_step_seconds(config: Config, shape: DataShape) -> float:
  """Modelled wall time of one training step of ``config`` on data of ``shape`` (one process):
  :mod:`sparsejax.step_cost`'s model, with the output layer on the path the run takes (``--softmax``).

  Multiply-adds: the input layer's ``nnz x d0`` per sample (forward, and its row gradients), the hidden layers'
  ``d_i x d_i+1`` (three products each), the output layer's ``k x d`` gathered (three products), or ``N x d`` in
  dense matmuls on the exact path. Row updates: the input rows a batch touches and the output rows
  (``min(B k, N)``; ``N`` exact), times ``d``.
  """
  model = ModelConfig.from_config(config, shape.num_features, shape.num_labels)
  b, dims = config.optim.batch_size, model.hidden_dims
  return (step_cost.input_and_hidden_seconds(b, dims, shape.mean_features, shape.num_features)
          + step_cost.output_layer_seconds(b, model.num_labels, model.k, dims[-1], exact=model.exact_softmax))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The search's rounds: ``steps[name]`` is each candidate's step count at the end of round 0 (round r:
  ``2**r`` times it); ``rounds`` how many rounds it takes to leave one."""
  candidates: tuple[recipes.Recipe, ...]
  steps: dict[str, int]
  rounds: int


def _round_calls(count: int) -> int:
  """How many candidate trainings successive halving of ``count`` candidates takes (each round's survivors)."""
  calls, alive = 0, count
  while alive > 1:
    calls, alive = calls + alive, -(-alive // 2)
  return calls


def _round_units(count: int) -> tuple[int, int]:
  """``(rounds, units)``: successive halving of ``count`` candidates; ``units`` is the total of round-0 budgets
  it spends (round r trains ``ceil(count / 2**r)`` candidates from ``2**(r-1)`` to ``2**r`` round-0 budgets)."""
  rounds, alive, units = 0, count, 0
  while alive > 1:
    units += alive * (1 if rounds == 0 else 2 ** (rounds - 1))
    alive, rounds = -(-alive // 2), rounds + 1
  return rounds, units


def plan(config: Config, shape: DataShape, candidates: tuple[recipes.Recipe, ...],
         measured: Measured | None = None) -> Plan | None:
  """The rounds that fit ``config``'s budget, or None where no two candidates fit (too small a budget).

  Args:
    config: the run.
    shape: the training data's sizes.
    candidates: the recipes, cheapest first.
    measured: with ``--max_seconds``, the calibration's measurements: candidates it did not measure are left out,
      the seconds it took and the rounds' fixed costs come off the search's seconds, and a candidate's steps (its
      calibration steps included) are its share over its measured step time. None: the modelled step time.
  """
  steps_per_epoch = max(shape.num_train // config.optim.batch_size, 1)
  max_steps = config.budget.max_steps_for(steps_per_epoch)
  fraction = config.search.search_fraction
  candidates = tuple(candidates)
  if measured is not None and config.budget.max_seconds is not None:
    candidates = tuple(r for r in candidates if r.name in measured.step_seconds)
  while len(candidates) > 1:
    rounds, units = _round_units(len(candidates))
    configs = {r.name: recipes.apply(config, r) for r in candidates}
    if config.budget.max_seconds is not None and measured is not None:
      rates = {n: measured.rate(n, config.run.eval_every) or modelled_step_seconds(c, shape)
               for n, c in configs.items()}
      # Each training of a candidate costs its fixed seconds; the rounds after the first train the calibration's
      # steps again (round r trains 2**(r-1) round-0 step counts, those steps included).
      fixed = _round_calls(len(candidates)) * max(measured.call_seconds.get(n, 0.0) for n in configs)
      again = (units - len(candidates)) * CALIBRATION_STEPS * max(rates.values())
      share = (fraction * config.budget.max_seconds - measured.calibration_seconds - fixed - again) / units
      steps = {n: CALIBRATION_STEPS + max(int(share / rates[n]), 0) for n in configs}
    elif config.budget.max_seconds is not None:
      share = fraction * config.budget.max_seconds / units  # round-0 seconds of each candidate
      steps = {n: int(share / modelled_step_seconds(c, shape)) for n, c in configs.items()}
      if max_steps is not None:  # a step or epoch limit too: no candidate past its share of those
        steps = {n: min(s, int(fraction * max_steps / units)) for n, s in steps.items()}
    else:
      steps = {n: int(fraction * max_steps / units) for n in configs}
    if min(steps.values()) >= MIN_ROUND_STEPS:
      return Plan(candidates, steps, rounds)
    candidates = candidates[:-1]  # the costliest last: drop it and plan again
  return None
