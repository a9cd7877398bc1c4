"""Steps with a NaN or Inf loss or update: found without a per-step host sync, then stopped or skipped.

A training step never applies a non-finite update: it decides from its loss
and gradients (replicated values, so every process agrees) before any row is
written, and reports the verdict as ``metrics["finite"]``, a device scalar
(:func:`sparsejax.model.train_step`, :func:`sparsejax.dense.train_step`). The
loop hands these flags to a :class:`NonFiniteWatch`, which reads them only
where the loop waits for the device anyway (loss readings every
``--log_every`` steps, evaluations, checkpoints), and applies
``--on_nonfinite``: ``stop`` raises :class:`NonFiniteError` naming the first
bad step, ``skip_step`` logs the skipped steps and goes on (and stops after
:data:`MAX_SKIPPED_IN_A_ROW` in a row: the model itself has diverged). Before
a checkpoint is written, :meth:`NonFiniteWatch.check_state` makes sure no
non-finite value reaches the disk.
"""

import jax
from absl import logging

from sparsejax import model
from sparsejax.distributed import sharding

# A run that skips this many steps in a row has diverged (its parameters make every step non-finite).
MAX_SKIPPED_IN_A_ROW = 20


class NonFiniteError(RuntimeError):
  """A NaN or Inf stopped the run; ``step`` is the step that produced it (nothing of it was applied or saved)."""

  def __init__(self, step: int, reason: str):
    self.step, self.reason = step, reason
    super().__init__(f"step {step}: {reason}")


class NonFiniteWatch:
  """Collects the steps' finiteness flags and acts on them at the loop's sync points.

  Args:
    policy: ``stop`` or ``skip_step`` (``--on_nonfinite``).
  """

  def __init__(self, policy: str):
    self.policy = policy
    self.skipped = 0  # steps skipped in this invocation
    self._in_a_row = 0
    self._pending: list[tuple[int, jax.Array]] = []
    self._all_finite = None

  def add(self, step: int, finite: jax.Array | None) -> None:
    """Records step ``step``'s flag (a device scalar: not read now)."""
    if finite is not None:
      self._pending.append((step, finite))

  def check(self) -> list[int]:
    """Reads the pending flags; returns the steps skipped among them.

    Raises:
      NonFiniteError: a non-finite step under ``stop``, or too many skipped in a row under ``skip_step``.
    """
    pending, self._pending = self._pending, []
    bad = []
    for step, finite in pending:
      if bool(sharding.local_value(finite)):
        self._in_a_row = 0
        continue
      if self.policy == "stop":
        raise NonFiniteError(step, "the loss or an update is NaN or Inf; stopped (--on_nonfinite=stop) without "
                             "applying or saving it. Lower --learning_rate, check the data, or pass "
                             "--on_nonfinite=skip_step to skip such steps")
      bad.append(step)
      self._in_a_row += 1
      if self._in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise NonFiniteError(step, f"{self._in_a_row} steps in a row had a NaN or Inf loss or update "
                             "(--on_nonfinite=skip_step skipped them): the model has diverged; stopped. Lower "
                             "--learning_rate or check the data")
    if bad:
      self.skipped += len(bad)
      logging.warning("step%s %s: NaN or Inf loss or update, skipped (--on_nonfinite=skip_step; %d skipped so far)",
                      "s" if len(bad) > 1 else "", ", ".join(map(str, bad)), self.skipped)
    return bad

  def check_state(self, state, step: int) -> None:
    """Raises :class:`NonFiniteError` if a float of ``state`` (about to be saved as step ``step``) is not finite.

    One pass over the state: about the cost of writing it, paid only when a checkpoint is.
    """
    if self._all_finite is None:
      self._all_finite = jax.jit(model.all_finite)
    if not bool(sharding.local_value(self._all_finite(state))):
      raise NonFiniteError(step, "the state to be saved holds NaN or Inf values (an update overflowed); not saved. "
                           "Lower --learning_rate")
