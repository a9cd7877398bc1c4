"""A checkpoint's saved state as the running code reads it: in the layout of its training state (earlier layouts
converted), or as a plain tree of host arrays; and the names of its arrays."""

import os

import jax

from sparsejax import averaging
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
