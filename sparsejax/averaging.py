"""Parameter averaging: the model evaluated and served is a moving average of the parameters it trains.

A network trained on sparse extreme-classification data peaks early and then memorises: one state's validation
P@1 jitters by tenths of a point from one evaluation to the next and falls after the peak, so the state that model
selection keeps is partly luck. An exponential moving average of the parameters (Polyak averaging; the horizon
``average_steps`` as the time constant, in steps) is flatter and higher: on GCIDE cloze the best single state of
a 6-epoch run scored test P@1 0.1034 and its average over about 1,000 steps 0.1059, still 0.106 four epochs later
where the single state had fallen to 0.097 (benchmarks/RESULTS.md, "Parameter averaging").

The average takes a snapshot every ``period(average_steps)`` steps, not every step (an evaluation adds the current
parameters as a last snapshot to what it evaluates, without changing the training state): an update reads and writes
every parameter (O(F d + N d)), which amortised over a quarter of the horizon costs about as much
as the index refreshes. It lives in the training state (:class:`ParamAverage` in ``SlideState.average``), so that
checkpoints carry it and a resumed run is bit-identical to an uninterrupted one::

  state = model.init(rng, config)                          # average: no snapshot yet
  if step % averaging.period(n) == 0:
    state = averaging.update_state(state, n)
  evaluated = averaging.evaluated(state, n)                # the parameters to evaluate, select and serve
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsejax.network import NetworkParams


class ParamAverage(NamedTuple):
  """An exponential moving average of a network's parameters, normalised by its weight.

  Attributes:
    params: the average, float32, shaped like the parameters (the output layer's rows sharded as they are).
    weight: ``[]`` float32: the total weight of the snapshots averaged (0: no snapshot yet; the average is then the
      parameters it started from and is not used).
    step: ``[]`` int32: the training step of the newest snapshot.
  """
  params: NetworkParams
  weight: jax.Array
  step: jax.Array


def init(params: NetworkParams, step: jax.Array | int = 0) -> ParamAverage:
  """An average of no snapshot yet (``params`` copied in float32 as a placeholder of the right shapes)."""
  # Copies (never the parameters' own buffers: the training step donates both).
  return ParamAverage(jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params),
                      jnp.zeros((), jnp.float32), jnp.asarray(step, jnp.int32))


def period(average_steps: int) -> int:
  """Steps between two scheduled updates of an average over about ``average_steps`` steps: a quarter of it."""
  return max(1, average_steps // 4)


def update(average: ParamAverage, params: NetworkParams, step: jax.Array, average_steps: int) -> ParamAverage:
  """The average with one more snapshot, ``params`` at training step ``step``.

  The older snapshots' weights decay by ``exp(-elapsed / horizon)``: a moving average in continuous time, the same
  for any update schedule. The horizon is ``average_steps``, but at most a quarter of the steps trained, so that a
  short run (or a recipe search's short round) is not judged by its first, untrained parameters. The result is the
  normalised average (``a + (1 - decay) / w' * (p - a)``, ``w' = decay * w + 1 - decay``): the first snapshot is
  taken whole, and it needs no correction when read. A second update at the same step changes nothing.
  """
  step = jnp.asarray(step, jnp.int32)
  horizon = jnp.clip(step.astype(jnp.float32) / 4.0, 1.0, float(average_steps))
  decay = jnp.exp(-(step - average.step).astype(jnp.float32) / horizon)
  weight = decay * average.weight + (1.0 - decay)
  rate = (1.0 - decay) / jnp.maximum(weight, 1e-30)
  first = average.weight == 0  # taken whole (not a + 1 * (p - a), which rounds)
  mean = jax.tree.map(lambda a, p: jnp.where(first, p.astype(jnp.float32), a + rate * (p.astype(jnp.float32) - a)),
                      average.params, params)
  return ParamAverage(mean, weight, step)


def params_of(state) -> NetworkParams:
  """A training state's parameters (its own buffers, not copies)."""
  return NetworkParams(state.embed, state.hidden, state.out)


@functools.partial(jax.jit, static_argnums=1)
def _update_state(state, average_steps):
  return state._replace(average=update(state.average, params_of(state), state.step, average_steps))


def update_state(state, average_steps: int):
  """``state`` with its parameters added to its ``average`` as of its step (jitted; the state is not donated: a
  checkpoint save may still be reading it). A state without an average is returned as is."""
  if getattr(state, "average", None) is None:
    return state
  return _update_state(state, average_steps)


def started(state) -> ParamAverage:
  """A new average for ``state``'s parameters (no snapshot yet), placed as they are (sharded rows stay sharded)."""
  return jax.jit(init)(params_of(state), state.step)


@functools.partial(jax.jit, static_argnums=3)
def averaged_params(params: NetworkParams, average: ParamAverage, step: jax.Array,
                    average_steps: int) -> NetworkParams:
  """The parameters to evaluate and serve: ``average`` with ``params`` (those of training step ``step``) as its
  newest snapshot, in the parameters' dtypes; ``params`` themselves while the average holds no snapshot."""
  average = update(average, params, step, average_steps)
  return jax.tree.map(lambda a, p: jnp.where(average.weight > 0, a.astype(p.dtype), p), average.params, params)


def evaluated(state, average_steps: int):
  """The state to evaluate, select and serve: its parameters replaced by :func:`averaged_params`. A state without
  an average is returned as is.

  The training state is not changed (its average takes snapshots on its own schedule only, so that evaluations,
  stops and resumes leave the training trajectory alone). The result keeps the ``average`` field (the same pytree
  as the training state's, so the evaluation's jitted functions are not traced again); it is not trained on.
  """
  if getattr(state, "average", None) is None:
    return state
  params = averaged_params(params_of(state), state.average, state.step, average_steps)
  return state._replace(embed=params.embed, hidden=params.hidden, out=params.out)
