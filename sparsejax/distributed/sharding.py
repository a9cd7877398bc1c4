"""Distributed SLIDE over jax.distributed CPU processes (gloo collectives).

Model parallelism for the output layer (Yan et al., 2022): P processes form
one mesh axis ``"shard"``; process p holds rows ``[p * R, (p + 1) * R)`` of
the N-wide output layer (``R = ceil(N / P)``, the last shard padded), their
Adam moments and their own LSH tables. The batch, the input and hidden
layers are replicated and updated identically everywhere (the kernels are
deterministic). Per step the processes exchange only ``O(B d)`` numbers: one
all-gather of ``[4, B]`` softmax partials and one psum of ``dh [B, d]``.

For comparison, :func:`make_dp_train_step` is the dense data-parallel
baseline (Horovod-style): every process holds the whole model, takes a slice
of each batch and all-reduces every gradient, ``O(params)`` bytes per step.

:func:`make_run` packs one kind of run (one process or several, SLIDE or
dense) into a :class:`Run`: the few functions a training loop calls. This module
holds the mesh, the partition specs and the ``shard_map`` wiring only: a sharded
run steps with :func:`sparsejax.model.train_step` and predicts with
:mod:`sparsejax.inference`, the functions a one-process run calls, given
:data:`SHARD` (their collectives do nothing in one process).

Everything here also runs in one process over several (virtual) CPU devices
(``--xla_force_host_platform_device_count``), which is how the sharded math is
unit-tested; across processes it needs :func:`initialize` first.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax._src import xla_bridge
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsejax import dense, index, inference, model, model_kinds
from sparsejax.distributed import process_group
from sparsejax.model_config import ModelConfig, softmax_choice, uses_exact_path
from sparsejax.network import NetworkParams, SparseLayer, init_params
from sparsejax.schedule import TableSchedule, refresh_cost_in_steps
from sparsejax.shard import Shard, shard_rows

AXIS = "shard"
SHARD = Shard(AXIS)  # inside shard_map: the output layer's split, for the functions that merge over it


# --- Process group ---------------------------------------------------------------

# Joining the group, with start-up faults reported by rank (re-exported here).
initialize = process_group.initialize


def first_device(platform: str):
  """This process's first JAX device, ``JAX_PLATFORMS`` being ``platform``; a RuntimeError that names the platform
  where JAX has no device of it (JAX itself raises a bare AssertionError where no such device is visible)."""
  try:
    return jax.devices()[0]
  except (RuntimeError, AssertionError) as e:
    raise RuntimeError(f"JAX has no {platform} device here ({str(e) or 'none found'}; an accelerator needs JAX's "
                       "plugin for it, e.g. pip install 'jax[cuda12]')") from None


def start_on(platform: str):
  """This process's first JAX device (:func:`first_device`), JAX started on ``platform`` where it has not started yet:
  it reads ``jax_platforms`` when it starts its backends, and keeps them."""
  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", platform)
  return first_device(platform)


def make_mesh(num_shards: int | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh over the first ``num_shards`` devices (default: all, one per process)."""
  devices = jax.devices()
  if jax.process_count() > 1:
    # One device per process: the shards are the processes.
    devices = [min((d for d in devices if d.process_index == p), key=lambda d: d.id)
               for p in range(jax.process_count())]
  n = num_shards or len(devices)
  if n > len(devices):
    raise ValueError(f"num_shards = {n} but only {len(devices)} devices: start more processes "
                     "(python -m sparsejax.distributed.launch -n P ...) or set --xla_force_host_platform_device_count")
  return jax.sharding.Mesh(np.array(devices[:n]), (AXIS,))


def to_global(tree, mesh: jax.sharding.Mesh, spec: P = P()):
  """Host arrays held identically by every process -> global arrays with ``spec``."""
  sharding = NamedSharding(mesh, spec)
  return jax.tree.map(
      lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]), tree)


# --- Sharded SLIDE -------------------------------------------------------------

def state_specs(state: model.SlideState, config: ModelConfig):
  """PartitionSpecs of a sharded :class:`model.SlideState` (output layer split)."""
  specs = jax.tree.map(lambda _: P(), state)
  split = P(AXIS)
  return specs._replace(
      out=SparseLayer(split, split),
      out_w_opt=specs.out_w_opt._replace(mu=split, nu=split),
      out_b_opt=specs.out_b_opt._replace(mu=split, nu=split),
      index=index.from_config(config).partition(state.index, split, P()),  # each shard indexes its own rows
      average=None if state.average is None else specs.average._replace(
          params=specs.average.params._replace(out=SparseLayer(split, split))))


def _local_index(config, state):  # a sharded run's stacked index as one shard's
  return state._replace(index=index.from_config(config).to_shard(state.index))


def _stacked_index(config, state):
  return state._replace(index=index.from_config(config).from_shard(state.index))


def _num_valid(config: ModelConfig, rows: int):
  return SHARD.row_range(rows, config.num_labels)[1]


def _shard_map(fn, mesh, in_specs, out_specs):
  # check_vma=False: the step does its own collectives (explicit all_gather/psum),
  # and replicated values are replicated by construction.
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _abstract_specs(config: ModelConfig, mesh) -> Any:
  rows = shard_rows(config.num_labels, config.num_shards)
  local = jax.eval_shape(lambda: model.init_from_params(
      jax.random.key(0), config, init_params(jax.random.key(0), dataclasses.replace(config, num_labels=rows))))
  return state_specs(local, config)


def init(rng: jax.Array, config: ModelConfig, mesh: jax.sharding.Mesh) -> model.SlideState:
  """A sharded initial state.

  The parameters equal :func:`model.init`'s for the same key (each process
  generates only its own rows); each shard builds tables over its rows.

  Args:
    rng: PRNG key (the same on every process).
    config: the model, with ``num_shards`` equal to the mesh size.
    mesh: from :func:`make_mesh`.
  """
  if config.num_shards != mesh.size:
    raise ValueError(f"config.num_shards = {config.num_shards} but the mesh has {mesh.size} devices")
  rows = shard_rows(config.num_labels, config.num_shards)
  padded = dataclasses.replace(config, num_labels=rows * config.num_shards)
  abstract = jax.eval_shape(lambda: init_params(rng, padded))
  param_specs = _broadcast_specs(NetworkParams(P(), P(), SparseLayer(P(AXIS), P(AXIS))), abstract)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs, is_leaf=lambda x: isinstance(x, P))
  # Counter-based (partitionable) RNG: each process computes only its rows,
  # and the first N rows equal the unsharded init's.
  with jax.threefry_partitionable(True):
    params = jax.jit(lambda: init_params(rng, padded), out_shardings=shardings)()

  specs = _abstract_specs(config, mesh)
  the_index = index.from_config(config)

  # The index first, by a program of its own (model.init_index: in one program with the optimizer states, XLA
  # held the build's temporaries beside them), then the rest of the state around the parameters and the index.
  def local_index(params):
    return the_index.from_shard(model.init_index(rng, config, params.out, _num_valid(config, rows)))

  def local_init(params, index_state):
    return _stacked_index(config, model.init_from_params(rng, config, params, _num_valid(config, rows),
                                                         index_state=the_index.to_shard(index_state)))

  index_state = jax.jit(_shard_map(local_index, mesh, (param_specs,), specs.index))(params)
  fn = _shard_map(local_init, mesh, (param_specs, specs.index), specs)
  return jax.jit(fn, donate_argnums=(0, 1))(params, index_state)  # donated: no second copy of the weights


def _broadcast_specs(specs, tree):
  """Expands a spec prefix (one spec per subtree) to one spec per leaf of ``tree``."""
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree,
                      is_leaf=lambda x: isinstance(x, P))


def make_train_step(config: ModelConfig, mesh: jax.sharding.Mesh):
  """``step(state, batch) -> (state, metrics)``: jitted, state donated, batch replicated."""
  specs = _abstract_specs(config, mesh)

  def local_step(state, batch):
    state, m = model.train_step(_local_index(config, state), batch, config=config, shard=SHARD)
    return _stacked_index(config, state), m

  return jax.jit(_shard_map(local_step, mesh, (specs, P()), (specs, P())), donate_argnums=0)


def make_rebuild(config: ModelConfig, mesh: jax.sharding.Mesh, new_hash_functions: bool = False):
  """``rebuild(state) -> state``: every shard re-hashes its rows (optionally with new functions)."""
  specs = _abstract_specs(config, mesh)
  rows = shard_rows(config.num_labels, config.num_shards)

  def local(state):
    state = _local_index(config, state)
    n = _num_valid(config, rows)
    if new_hash_functions:
      state = model.new_hash_functions(state, config, n)
    else:
      state = model.rebuild_tables(state, config, n)
    return _stacked_index(config, state)

  return jax.jit(_shard_map(local, mesh, (specs,), specs), donate_argnums=0)


def _by_structure(make_program):
  """``program(state, *args)`` compiled by ``make_program(specs_of(state))`` once for each set of the state's fields
  that are None (a state without its optimizer states, as the final evaluation holds it: ``specs_of`` gives the
  full state's partition specs with those fields None)."""
  programs = {}

  def call(state, *args):
    missing = tuple(f for f in state._fields if getattr(state, f) is None)
    if missing not in programs:
      programs[missing] = make_program(lambda specs: specs._replace(**{f: None for f in missing}))
    return programs[missing](state, *args)
  return call


def _per_shard(fn, config: ModelConfig, mesh: jax.sharding.Mesh, num_inputs: int):
  """``fn(state, *inputs, shard=...)`` on every shard (:mod:`sparsejax.inference`'s functions): jitted, the state
  sharded (with or without its optimizer states), the ``num_inputs`` inputs and the results replicated."""
  def local(state, *inputs):
    return fn(_local_index(config, state), *inputs, shard=SHARD)

  specs = _abstract_specs(config, mesh)
  return _by_structure(lambda specs_of: jax.jit(_shard_map(local, mesh, (specs_of(specs), *[P()] * num_inputs),
                                                           P())))


def make_serving_index(config: ModelConfig, mesh: jax.sharding.Mesh):
  """``serving_index(state) -> state`` with every shard's evaluation index built afresh from its real rows, as
  one process builds its own (:func:`model.serving_index`, ``config.eval_index_sizes`` per shard). Not donated:
  the training state keeps its own index; only the index is new (no copy of the rows)."""
  specs = _abstract_specs(config, mesh)
  rows = shard_rows(config.num_labels, config.num_shards)

  def local(state):
    served = model.serving_index(_local_index(config, state), config, _num_valid(config, rows))
    return _stacked_index(config, served).index

  build = _by_structure(lambda specs_of: jax.jit(_shard_map(local, mesh, (specs_of(specs),), specs.index)))
  return lambda state: state._replace(index=build(state))


def make_merged_index(config: ModelConfig, mesh: jax.sharding.Mesh):
  """``merged_index(state) -> index`` (host arrays): every shard's (clustered) index gathered and merged into one
  over the N global rows (:func:`inference.gather_index`, :func:`inference.merge_index`)."""
  gather = jax.jit(_shard_map(lambda t: inference.gather_index(t, SHARD), mesh,
                              (_abstract_specs(config, mesh).index,), P()))
  return lambda state: inference.merge_index(jax.tree.map(local_value, gather(state.index)), config)


def make_index_fill(config: ModelConfig, mesh: jax.sharding.Mesh):
  """``index_fill(state) -> dict``: :attr:`sparsejax.index.Index.fill` over every shard's index together (their
  cluster sizes or bucket counts all-gathered: ``O(P C)``)."""
  the_index = index.from_config(config)
  gather = jax.jit(_shard_map(lambda t: jax.lax.all_gather(the_index.occupancy(t), AXIS), mesh,
                              (_abstract_specs(config, mesh).index,), P()))
  return lambda state: the_index.fill(local_value(gather(state.index)))


def make_checksum(mesh: jax.sharding.Mesh):
  """``checksum(state) -> [P] uint32``: each process's hash of its replicated parameters.

  All entries are equal while replicas agree; a difference means they drifted.
  """
  def local(embed, hidden, embed_opt, dense_opt):
    leaves = jax.tree.leaves((embed, hidden, embed_opt, dense_opt))
    total = jnp.uint32(0)
    for i, x in enumerate(leaves):
      bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) if x.dtype != jnp.uint32 else x
      weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
      total = total * jnp.uint32(31) + jnp.sum(bits.reshape(-1) * weights) + jnp.uint32(i)
    return jax.lax.all_gather(total, AXIS)

  fn = jax.jit(_shard_map(local, mesh, (P(), P(), P(), P()), P()))
  return lambda state: fn(state.embed, state.hidden, state.embed_opt, state.dense_opt)


# --- Dense data-parallel baseline --------------------------------------------

def dense_state_specs(state):
  return jax.tree.map(lambda _: P(), state)


def make_dp_train_step(config: ModelConfig, mesh: jax.sharding.Mesh):
  """Dense data-parallel step: replicated model, batch split over processes, all gradients all-reduced."""
  abstract = jax.eval_shape(lambda: dense.init(jax.random.key(0), config))
  specs = dense_state_specs(abstract)
  local = functools.partial(dense.train_step, config=config, axis=AXIS)
  return jax.jit(_shard_map(local, mesh, (specs, P(AXIS)), (specs, P())), donate_argnums=0)


# --- Runs: one interface for the four kinds ------------------------------------------


def local_value(x) -> np.ndarray:
  """This process's copy of a (replicated) array, as numpy."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return np.asarray(x)


def agree(flag: bool) -> bool:
  """Process 0's ``flag``, on every process (for decisions that change control flow)."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


class Run(NamedTuple):
  """How one kind of run initializes, steps, maintains and predicts (built by :func:`make_run`).

  Attributes:
    config: the model (``num_shards`` set for a sharded SLIDE run).
    num_shards: processes the run is spread over (1: this process alone).
    init: ``() -> state``, a fresh state.
    abstract_state: ``() -> state`` of ``jax.ShapeDtypeStruct`` with shardings, to restore a checkpoint into.
    step: ``(state, batch) -> (state, metrics)``; the state is donated, the batch is host arrays (the same
      on every process).
    maintain: ``(state, steps) -> state``: the table refreshes due after ``steps`` steps.
    predict: ``(state, feat_ids, feat_vals) -> (scores, ids, sampled_ids or None)``: numpy ``[n, top]``,
      exact over all outputs and, for SLIDE, over the index-sampled active set (:func:`inference.predict`, one
      process or on every shard).
    check_replicas: ``(state, steps) -> None``; raises if replicated parameters differ between processes.
    diagnose: ``(state, feat_ids, feat_vals, labels) -> (scores, ids, sampled_ids, extra)`` for SLIDE (one
      process or sharded, :func:`inference.diagnose`): ``predict`` plus ``extra = {"sampled": {name: ids [n, top]} of
      sampled inference at other active set sizes, "retrieval": per-query retrieval diagnostics}``
      (:func:`sparsejax.retrieval.per_query`), numpy; else None.
    refresh_index: ``state -> state`` with a freshly rebuilt index (not donated: the training state is left
      as it is), to evaluate sampled inference as a saved model would serve it (sharded: each shard's index of
      its rows); None where unavailable.
    index_fill: ``state -> dict``: the fill of the state's index (:attr:`sparsejax.index.Index.fill`; sharded:
      every shard's index together); None where there is no index.
    step_program: ``(state, batch) -> (jitted, args, scopes)``: the step as the jitted function it calls, its
      arguments for this batch and the step's named scopes, for whatever reads the compiled program (the step
      profiler: :func:`sparsejax.distributed.collectives.compile_step`; compiling it does not run it, and the step
      reuses that compilation).
    schedule: when ``maintain`` refreshes the index (periods lengthened by ``--refresh_budget``).
    predict_exact: ``predict`` without sampled inference (SLIDE; None: ``predict`` is exact only): what an
      evaluation that only selects reads, without the index rebuilt for it.
    serving_index: ``state -> index`` of host arrays: the (clustered) index of a ``refresh_index``-ed state as one
      process queries it, to keep with the model (sharded: the shards' indexes merged over the global rows,
      :func:`inference.merge_index`; a collective, so every process calls it); None for an index that is not kept
      (:attr:`sparsejax.index.Index.merge_shards` None: LSH tables, rebuilt from the rows).
  """
  config: ModelConfig
  num_shards: int
  init: Callable[[], Any]
  abstract_state: Callable[[], Any]
  step: Callable[[Any, dict], tuple[Any, dict]]
  maintain: Callable[[Any, int], Any]
  predict: Callable[[Any, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]
  check_replicas: Callable[[Any, int], None]
  diagnose: Callable[[Any, np.ndarray, np.ndarray, np.ndarray], tuple] | None = None
  refresh_index: Callable[[Any], Any] | None = None
  index_fill: Callable[[Any], dict] | None = None
  step_program: Callable[[Any, dict], tuple[Any, tuple, tuple[str, ...]]] | None = None
  schedule: TableSchedule | None = None
  serving_index: Callable[[Any], Any] | None = None
  predict_exact: Callable[[Any, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, None]] | None = None

  def exact_predictor(self):
    """``predict`` without its sampled inference: ``(scores, ids, None)``, exact over all outputs."""
    return self.predict if self.predict_exact is None else self.predict_exact


def make_run(config: ModelConfig, *, seed: int, num_shards: int = 1, top: int = 5,
             sampled_ks: tuple[int, ...] = ()) -> Run:
  """The run of ``config`` (SLIDE or dense, by ``config.network.model``) over ``num_shards`` processes.

  Args:
    config: the model, ``num_shards == 1`` (set here for a sharded run).
    seed: the PRNG seed of the initial state.
    num_shards: 1 (this process) or the processes of the job, one mesh device each.
    top: predictions per sample (sampled inference: at most the candidates it scores).
    sampled_ks: further active set sizes at which sampled inference is evaluated (SLIDE).
  """
  key = jax.random.key(seed)
  top = min(top, config.num_labels)
  schedule = TableSchedule.from_config(config.tables)
  slide = model_kinds.of(config).sampled
  if slide:
    sharded = dataclasses.replace(config, num_shards=num_shards)
    logging.info("%s", softmax_choice(sharded))
    if uses_exact_path(sharded):
      # Nothing to sample: the index is refreshed only for evaluation (sampled inference), not on a schedule.
      schedule = TableSchedule(0, 1.0, 1)
    else:
      schedule = _budgeted_schedule(sharded)
  if num_shards == 1:
    run = _single_slide(config, key, schedule, top, sampled_ks) if slide else _single_dense(config, key, schedule, top)
  elif slide:
    run = _sharded_slide(config, key, schedule, top, make_mesh(num_shards), sampled_ks)
  else:
    run = _data_parallel_dense(config, key, schedule, top, make_mesh(num_shards))
  return run._replace(schedule=schedule)


def _budgeted_schedule(config: ModelConfig) -> TableSchedule:
  """:meth:`TableSchedule.for_model`, logged where ``--refresh_budget`` lengthened its periods."""
  schedule, tables = TableSchedule.for_model(config), config.tables
  if tables.rebuild_period and schedule.period > tables.rebuild_period:
    logging.info("index refresh: about %.0f steps of work each (estimated from the sizes); first refresh after %d "
                 "steps instead of --rebuild_period=%d, so that refreshes take at most %g%% of the training time "
                 "(--refresh_budget=%g; 0 keeps the periods as given)", refresh_cost_in_steps(config),
                 schedule.period, tables.rebuild_period, 100 * tables.refresh_budget, tables.refresh_budget)
  return schedule


def _maintainer(schedule: TableSchedule, rebuild, rehash):
  def maintain(state, steps: int):
    if schedule.rehash_due(steps):
      logging.info("step %d: new hash functions, tables rebuilt", steps)
      return rehash(state)
    if schedule.rebuild_due(steps):
      return rebuild(state)
    return state
  return maintain


def _host(predict):
  """``predict`` with numpy results (this process's copy)."""
  def call(state, fi, fv):
    return tuple(None if x is None else local_value(x) for x in predict(state, fi, fv))
  return call


def _no_check(state, steps):
  del state, steps


def _program(jitted, step_scopes: dict, place=lambda batch: batch):
  """``step_program`` of a run whose step is ``jitted(state, place(batch))``."""
  return lambda state, batch: (jitted, (state, place(batch)), tuple(step_scopes))


def _committed(init, key):
  """``() -> init(key)``, the state committed to this process's device (the same buffers).

  A state restored from a checkpoint comes back committed, and jit keys its compilations on that too: an
  uncommitted fresh state made every evaluation compile again once the best state was restored.
  """
  return lambda: jax.device_put(init(key), jax.devices()[0])


def _single_slide(config, key, schedule, top, sampled_ks) -> Run:
  predict = jax.jit(functools.partial(inference.predict, config=config, top=top))
  diagnose = jax.jit(functools.partial(inference.diagnose, config=config, top=top, sampled_ks=sampled_ks))
  the_index = index.from_config(config)
  fresh = _committed(functools.partial(model.init, config=config), key)
  rebuild = jax.jit(functools.partial(model.rebuild_tables, config=config), donate_argnums=0)
  rehash = jax.jit(functools.partial(model.new_hash_functions, config=config), donate_argnums=0)
  refresh = functools.partial(model.serving_index, config=config)
  step = jax.jit(functools.partial(model.train_step, config=config), donate_argnums=0)
  return Run(config, 1, fresh, lambda: jax.eval_shape(fresh), step,
             _maintainer(schedule, rebuild, rehash), _host(predict), _no_check,
             lambda state, fi, fv, labels: jax.tree.map(np.asarray, diagnose(state, fi, fv, labels)),
             jax.jit(refresh), lambda state: the_index.fill(the_index.occupancy(state.index)),
             _program(step, model.STEP_SCOPES),
             serving_index=(lambda state: inference.merge_index(inference.gather_index(state.index), config))
             if the_index.merge_shards is not None else None,  # (a kept serving index)
             predict_exact=_host(jax.jit(_exact_only(top))))


def _exact_only(top):
  def predict(state, fi, fv):
    return (*inference.predict_exact(state, fi, fv, top=top), None)
  return predict


def _single_dense(config, key, schedule, top) -> Run:
  fresh = _committed(functools.partial(dense.init, config=config), key)
  step = jax.jit(functools.partial(dense.train_step, config=config), donate_argnums=0)
  return Run(config, 1, fresh, lambda: jax.eval_shape(fresh), step,
             lambda state, steps: state, _host(jax.jit(_exact_only(top))), _no_check,
             step_program=_program(step, dense.STEP_SCOPES))


def _global_abstract(init):
  return lambda: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), init())


def _sharded_slide(config, key, schedule, top, mesh, sampled_ks=()) -> Run:
  config = dataclasses.replace(config, num_shards=mesh.size)
  fresh = functools.partial(init, key, config, mesh)
  step = make_train_step(config, mesh)
  predict = _per_shard(functools.partial(inference.predict, config=config, top=top), config, mesh, 2)
  diagnose = _per_shard(functools.partial(inference.diagnose, config=config, top=top, sampled_ks=sampled_ks),
                        config, mesh, 3)
  exact = _per_shard(lambda state, fi, fv, shard: inference.predict_exact(
      state, fi, fv, top=top, shard=shard, num_labels=config.num_labels), config, mesh, 2)
  checksum = make_checksum(mesh)

  def host_diagnose(state, fi, fv, labels):
    return jax.tree.map(local_value, diagnose(state, *to_global((fi, fv, labels), mesh)))

  def check_replicas(state, steps):
    sums = local_value(checksum(state))
    if len(set(sums.tolist())) != 1:
      raise RuntimeError(f"step {steps}: replicated parameters differ between processes "
                         f"(checksums {sums.tolist()}): replicas drifted")

  return Run(config, mesh.size, fresh, _global_abstract(fresh),
             lambda state, batch: step(state, to_global(batch, mesh)),
             _maintainer(schedule, make_rebuild(config, mesh), make_rebuild(config, mesh, new_hash_functions=True)),
             _host(lambda state, fi, fv: predict(state, *to_global((fi, fv), mesh))), check_replicas,
             diagnose=host_diagnose, refresh_index=make_serving_index(config, mesh),
             index_fill=make_index_fill(config, mesh),
             step_program=_program(step, model.STEP_SCOPES, lambda batch: to_global(batch, mesh)),
             serving_index=make_merged_index(config, mesh) if index.from_config(config).merge_shards else None,
             predict_exact=_host(lambda state, fi, fv: (*exact(state, *to_global((fi, fv), mesh)), None)))


def _data_parallel_dense(config, key, schedule, top, mesh) -> Run:
  replicated = NamedSharding(mesh, P())
  fresh = jax.jit(functools.partial(dense.init, key, config), out_shardings=replicated)
  step = make_dp_train_step(config, mesh)
  predict = jax.jit(_exact_only(top))  # the model is replicated
  return Run(config, mesh.size, fresh, _global_abstract(fresh),
             lambda state, batch: step(state, to_global(batch, mesh, P(AXIS))), lambda state, steps: state,
             _host(lambda state, fi, fv: predict(state, *to_global((fi, fv), mesh))), _no_check,
             step_program=_program(step, dense.STEP_SCOPES, lambda batch: to_global(batch, mesh, P(AXIS))))
