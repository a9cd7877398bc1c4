"""How checkpoints hold the index: today one ``index`` field of the state; before, two fields: ``lsh`` (the hash
functions, None for a clustered index) and ``tables`` (the hash tables or the clustered index). Checkpoints of
both layouts restore."""

from sparsejax.index.hashed import HashedIndex

FIELDS_BEFORE = ("lsh", "tables")


def written_before(saved_fields) -> bool:
  """Whether a checkpoint whose state has the top-level ``saved_fields`` holds its index in the earlier layout."""
  return "index" not in saved_fields and "tables" in saved_fields


def as_written_before(state) -> dict:
  """A state (a NamedTuple with an ``index`` field; abstract or real) as a dict in the earlier layout."""
  fields = state._asdict()
  index = fields.pop("index")
  if isinstance(index, HashedIndex):
    return {**fields, "lsh": index.hash_functions, "tables": index.tables}
  return {**fields, "lsh": None, "tables": index}


def from_written_before(tree: dict, state_type):
  """The ``state_type`` state of a tree restored in the earlier layout (:func:`as_written_before`)."""
  tree = dict(tree)
  functions, tables = (tree.pop(name) for name in FIELDS_BEFORE)
  return state_type(**tree, index=tables if functions is None else HashedIndex(functions, tables))


def index_tree(tree: dict):
  """The index of a checkpoint's state read back as plain dicts (``Checkpoints.restore_arrays``), in today's layout
  (``{"hash_functions": ..., "tables": ...}`` or the clustered index's arrays); None if it holds none."""
  if "index" in tree:
    return tree["index"]
  if tree.get("lsh") is not None:
    return {"hash_functions": tree["lsh"], "tables": tree["tables"]}
  return tree.get("tables")
