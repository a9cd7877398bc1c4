"""A checkpoint's saved state as the running code reads it: in the layout of its training state (earlier layouts
converted), or as a plain tree of host arrays; and the names of its arrays."""

import functools
import gc
import os

import jax
import numpy as np

from sparsejax import averaging, memory
from sparsejax.index import saved
from sparsejax.workdir.orbax_logs import quiet
from sparsejax.workdir.seals import IntegrityError


def top_level_fields(ocp, step_directory: str) -> set[str]:
  """The top-level fields of the state saved in a checkpoint's step directory."""
  with quiet():
    return set(ocp.StandardCheckpointer().metadata(os.path.join(step_directory, "state")).item_metadata.tree)


def in_saved_layout(abstract_state, saved_fields):
  """``(target, as_state)``: ``abstract_state`` in the layout of a checkpoint whose state has ``saved_fields``, and
  the function that turns what was restored into it back into a state: the state itself, but for a checkpoint
  that holds the index in its earlier layout (two fields, ``lsh`` and ``tables``: :mod:`sparsejax.index.saved`) or
  no parameter average (saved by an earlier sparsejax, or with ``--average_steps=0``: the average then starts anew
  from the restored parameters, with no snapshot)."""
  fields = getattr(abstract_state, "_fields", ())
  state_type = type(abstract_state)
  target, as_state = abstract_state, lambda state: state
  if "index" in fields:
    if saved.written_before(saved_fields):
      target, as_state = saved.as_written_before(abstract_state), lambda tree: saved.from_written_before(tree,
                                                                                                          state_type)
  if "average" in fields and "average" not in saved_fields:
    # A dict without the field (orbax refuses a target with a field the checkpoint lacks, even a None one: a
    # selected state is restored without its average).
    as_tree = as_state if isinstance(target, dict) else (lambda tree: state_type(**tree))
    target = {k: v for k, v in (target if isinstance(target, dict) else target._asdict()).items() if k != "average"}
    wanted = abstract_state.average is not None

    def as_state(tree):
      state = as_tree(tree)
      return state._replace(average=averaging.started(state) if wanted else None)
  return target, as_state


# Local bytes restored per orbax call at most (one array more where a single array's shard is larger): the arrays
# of one call are read at once, each beside its read buffer. The 10^9-parameter run's 3.4 GB per process restored
# in one call peaked at 6.4-7.6 GB and the kernel killed a rank of four on the 24 GB VM without swap.
RESTORE_STAGE_BYTES = 512 << 20


def local_bytes(leaf) -> int:
  """Bytes of this process's part of an abstract or concrete array (its shard's, where it is sharded)."""
  sharding = getattr(leaf, "sharding", None)
  shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
  size = 1
  for n in shape:
    size *= n
  return size * np.dtype(leaf.dtype).itemsize


def _owned(array):
  """``array`` copied into a buffer of JAX's own, the restored one freed. Orbax's arrays wrap the host buffers they
  were read into: the first step that donated them kept those too, until the next one (the 10^9-parameter run's
  first step after a resume took 2.5 GB more per process and a rank was killed)."""
  return jax.block_until_ready(_copy_donated(array))


@functools.partial(jax.jit, donate_argnums=0)
def _copy_donated(array):
  return array.copy()


def restore_in_stages(ocp, restore, target):
  """``restore(partial_target)`` called on groups of ``target``'s arrays of at most :data:`RESTORE_STAGE_BYTES`
  local bytes each (an array larger than that alone), the others orbax's placeholders (not read); each array is
  copied into a buffer of JAX's own (that a training step can donate) and the freed read buffers are returned to
  the system between groups. Returns ``(state, result)``: ``target`` with what the calls restored in its
  ``"state"`` items, and the last call's whole result (its other items: the data position). One group where
  everything fits: a single call."""
  leaves, treedef = jax.tree_util.tree_flatten(target)
  groups, size = [[]], 0
  for i, leaf in enumerate(leaves):
    nbytes = local_bytes(leaf)
    if groups[-1] and size + nbytes > RESTORE_STAGE_BYTES:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += nbytes
  restored, result = list(leaves), None
  for group in groups:
    wanted = set(group)
    part = treedef.unflatten([leaf if i in wanted else ocp.PLACEHOLDER for i, leaf in enumerate(leaves)])
    with memory.freed_memory_returned():
      result = restore(part)
      got = treedef.flatten_up_to(result["state"])
      gc.collect()  # orbax's read buffers, in reference cycles
      for i in group:
        restored[i] = _owned(got[i])
      del got
      gc.collect()
  return treedef.unflatten(restored), result


def restore_arrays(ocp, path: str):
  """The state saved in ``path`` as a plain tree of host arrays on one device (see ``restore_arrays``)."""
  checkpointer = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  try:
    with quiet():  # it warns that the step's own metadata file is not in the item's directory
      target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                            checkpointer.metadata(path).item_metadata.tree)
      return checkpointer.restore(path, target)
  # A damaged file of a state no seal covers (an older sparsejax's) fails anywhere in orbax or TensorStore, with any
  # exception type (KeyError, AttributeError, bare Exception) and pages of detail: named by its directory instead.
  except Exception as e:  # noqa: BLE001 -- see above
    reason = (str(e).strip().splitlines() or [""])[0][:200]
    raise IntegrityError(f"{path}: unreadable as a saved state: a file in it is damaged ({type(e).__name__}: "
                         f"{reason})") from None


def path_name(path) -> str:
  """``embed.w``, ``hidden.0.1``: a tree path, the same for a named tuple's field as for a dict's key."""
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def is_optimizer_state(field: str) -> bool:
  """Whether a model state's field holds optimizer state (``embed_opt``, ``out_w_opt``, a dense state's ``opt``)."""
  return field == "opt" or field.endswith("_opt")


def parameters_first(name: str) -> tuple[bool, str]:
  """Sort key: the layers' arrays before the optimizer states'."""
  return any(is_optimizer_state(part) for part in name.split(".")), name
