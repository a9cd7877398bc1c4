"""The collectives of a compiled step, read off its HLO: what each one moves and where it came from.

``compiled_collectives(jitted, *args)`` compiles ``jitted`` for ``args`` and lists every collective
instruction XLA kept (after its all-reduce combiner and other passes, so this is what runs, not what
the jaxpr says): name (the same as the profiler's trace event), kind, dtypes, operand shapes, operand
bytes ``S`` (what this process contributes), the named scope(s) from the metadata, and the bytes one
process puts on the wire under a ring algorithm for P processes (:func:`ring_wire_bytes`).
"""

import math
import re
from typing import NamedTuple

# The collective kinds of XLA's HLO that a step's list (and netanalysis's profiles) name.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bytes per element of HLO primitive types (sub-byte types round up to one byte).
_ELEMENT_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}
_ARRAY_RE = re.compile(r"([a-z]\w*)\[([0-9,]*)\]")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_GROUPS_RE = re.compile(r"replica_groups=(\{[^=]*?\}\})")
_GROUPS_IOTA_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


class Collective(NamedTuple):
  """One collective instruction of a compiled program, as one process sees it.

  Attributes:
    name: HLO instruction name, which is also the name of its events in a profiler trace.
    kind: one of :data:`KINDS`.
    dtypes: element type of each operand, e.g. ``("f32", "s32")`` (a combined all-reduce has several).
    shapes: shape of each operand.
    operand_bytes: ``S``, the bytes this process hands to the collective (sum over operands).
    result_bytes: bytes of its result on this process.
    group_size: processes (devices) in each replica group.
    scope: the ``jax.named_scope`` names in its metadata, ``+``-joined in order of first appearance
      (several when XLA combined collectives of different scopes); ``""`` when there are none.
    op_name: the metadata ``op_name`` it was lowered from.
    producers: per operand, the instruction that computes it (through ``get-tuple-element`` and
      ``bitcast``, which run no code), i.e. whose end in a trace is when the operand is ready.
  """
  name: str
  kind: str
  dtypes: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  operand_bytes: int
  result_bytes: int
  group_size: int
  scope: str
  op_name: str
  producers: tuple[str, ...] = ()

  def operand_sizes(self) -> list[int]:
    """Bytes of each operand (one per element of ``shapes``)."""
    return [_nbytes([(t, dims)]) for t, dims in zip(self.dtypes, self.shapes)]

  def model_bytes(self, processes: int | None = None) -> int:
    """``S`` of the cost model for ``processes`` (default: its group): the operand bytes, except for
    all-gather, whose ``S`` is the gathered total (each process's piece times P)."""
    if self.kind == "all-gather":
      return self.operand_bytes * (processes or self.group_size)
    return self.operand_bytes

  def wire_bytes(self, processes: int | None = None) -> float:
    """Bytes one process sends for this collective under a ring over ``processes`` (default: its group)."""
    P = processes or self.group_size
    return ring_wire_bytes(self.kind, self.model_bytes(P), P)

  def to_json(self, processes: int | None = None) -> dict:
    """A JSON-ready dict, units in the key names; ``wire_bytes`` for ``processes`` (default: its group)."""
    return {"name": self.name, "kind": self.kind, "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
            "operand_bytes": self.operand_bytes, "result_bytes": self.result_bytes, "group_size": self.group_size,
            "scope": self.scope, "op_name": self.op_name, "producers": list(self.producers),
            "wire_bytes": self.wire_bytes(processes)}

  @classmethod
  def from_json(cls, obj) -> "Collective":
    """The inverse of :meth:`to_json` (``wire_bytes`` is recomputed, not read)."""
    return cls(name=obj["name"], kind=obj["kind"], dtypes=tuple(obj["dtypes"]),
               shapes=tuple(tuple(s) for s in obj["shapes"]), operand_bytes=obj["operand_bytes"],
               result_bytes=obj["result_bytes"], group_size=obj["group_size"], scope=obj["scope"],
               op_name=obj["op_name"], producers=tuple(obj.get("producers", ())))


def ring_wire_bytes(kind: str, nbytes: float, processes: int) -> float:
  """Bytes one process sends for one collective under the ring algorithm.

  Args:
    kind: one of :data:`KINDS`.
    nbytes: ``S`` of the cost model: the bytes each process contributes (its whole buffer for
      all-reduce, reduce-scatter and all-to-all; the message for collective-permute), and for
      all-gather the gathered total ``S_total`` (P times each process's piece).
    processes: P, the processes taking part.

  Returns:
    all-reduce ``2 (P-1)/P S``; all-gather and reduce-scatter ``(P-1)/P S_total``; all-to-all
    ``(P-1)/P S``; collective-permute ``S`` (0 for a single process).
  """
  P = processes
  if P < 1:
    raise ValueError(f"processes must be >= 1, got {P}")
  if kind == "all-reduce":
    return 2 * (P - 1) / P * nbytes
  if kind in ("all-gather", "reduce-scatter", "all-to-all"):
    return (P - 1) / P * nbytes
  if kind == "collective-permute":
    return float(nbytes) if P > 1 else 0.0
  raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")


def _split_shape(text: str) -> tuple[str, str]:
  """``"(f32[2]{0}, s32[]) all-reduce(...)"`` -> the shape and the rest."""
  if text.startswith("("):
    depth = 0
    for i, ch in enumerate(text):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return text[:i + 1], text[i + 1:].lstrip()
  shape, _, rest = text.partition(" ")
  return shape, rest


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """Element type and dimensions of every array in an HLO shape (a tuple gives several)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY_RE.findall(shape)]


def _nbytes(arrays) -> int:
  return sum(_ELEMENT_BYTES.get(t, 1) * math.prod(dims) for t, dims in arrays)


def _operand_names(args: str) -> list[str]:
  """Operand names of ``"%a, %b), channel_id=..."`` (the text after the opcode's parenthesis)."""
  depth, end = 1, len(args)
  for i, ch in enumerate(args):
    depth += (ch in "({") - (ch in ")}")
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", args[:end])


def _group_size(attrs: str, default: int) -> int:
  m = _GROUPS_IOTA_RE.search(attrs)
  if m:
    return int(m.group(2))
  m = _GROUPS_RE.search(attrs)
  if m:
    first = re.search(r"\{([0-9,\s]*)\}", m.group(1)[1:])
    if first and first.group(1).strip():
      return len(first.group(1).split(","))
  if "source_target_pairs" in attrs:
    return max(default, len(re.findall(r"\{\d+,\d+\}", attrs)))
  return default


_TRANSFORMS = {"jit", "pjit", "jvp", "transpose", "vmap", "remat", "checkpoint", "shard_map", "custom_jvp_call",
               "custom_vjp_call", "while", "cond", "body", "branch"}


def _split_top(text: str, sep: str) -> list[str]:
  """Splits at ``sep`` outside parentheses."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += (ch == "(") - (ch == ")")
    if ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return parts


def _outer_scope(path: str, known) -> str:
  """The outermost named scope of one op_name path (``""`` if none)."""
  components = [c for c in _split_top(path, "/") if c]
  if len(components) == 1 and components[0].startswith("(") and components[0].endswith(")"):
    return "+".join(filter(None, (_outer_scope(p, known) for p in _split_top(components[0][1:-1], ":"))))
  if components and components[-1].startswith("(") and components[-1].endswith(")"):  # combined: .../(a/x:b/y)
    inner = [_outer_scope(p, known) for p in _split_top(components[-1][1:-1], ":")]
    head = _outer_scope("/".join(components[:-1] + ["_"]), known)
    return head or "+".join(dict.fromkeys(filter(None, inner)))
  for c in components[:-1]:  # the last component is the primitive
    if re.fullmatch(r"p?jit\(.*\)", c):
      continue
    for token in re.findall(r"[A-Za-z_]\w*", c):
      if token not in _TRANSFORMS and (known is None or token in known):
        return token
  return ""


def scope_of(op_name: str, known=None) -> str:
  """The named scope of an HLO instruction from its metadata ``op_name``.

  The outermost ``jax.named_scope`` in the path, skipping ``jit(...)``, ``shard_map`` and
  transformation wrappers, so ``.../hidden_bwd/transpose(jvp(hidden_fwd))/dot_general`` is
  ``hidden_bwd``. A collective that XLA combined from several (``.../(a/psum:b/psum)``) gives the
  distinct scopes ``+``-joined (``"a+b"``).

  Args:
    op_name: the metadata's ``op_name``.
    known: if given, only these names count as scopes.
  """
  return _outer_scope(op_name, known)


_NO_CODE = ("get-tuple-element", "bitcast")  # instructions that run no thunk of their own


def _producer(name: str, inputs: dict) -> str:
  """The instruction that computes ``name``, looking through :data:`_NO_CODE` instructions."""
  for _ in range(100):
    if name not in inputs or not inputs[name]:
      return name
    name = inputs[name][0]
  return name


class CompiledStep(NamedTuple):
  """What a profiler trace of a compiled program needs to be read.

  Attributes:
    module: the HLO module name (the trace events' ``hlo_module``, e.g. ``jit_local_step``).
    collectives: its collective instructions, in program order.
    scopes: instruction name -> named scope (:func:`scope_of`) for every instruction with metadata.
  """
  module: str
  collectives: tuple[Collective, ...]
  scopes: dict


def parse_compiled(hlo_text: str, default_group_size: int = 1, known_scopes=None) -> CompiledStep:
  """Reads a compiled HLO module's text (``compiled.as_text()``).

  Collective operand shapes are looked up by operand name among the module's instructions; the
  asynchronous ``*-start`` form counts as its kind (its ``*-done`` is skipped).

  Args:
    hlo_text: the module's text.
    default_group_size: processes per replica group when the instruction does not say.
    known_scopes: if given, the only names that count as named scopes.
  """
  module = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
  shapes, lines, scopes, inputs = {}, [], {}, {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION_RE.match(line)
    if not m:
      continue
    shape, rest = _split_shape(line[m.end():])
    shapes[m.group(1)] = _arrays(shape)
    lines.append((m.group(1), shape, rest))
    opcode, _, args = rest.partition("(")
    if opcode in _NO_CODE:
      inputs[m.group(1)] = _operand_names(args)
    op_name = _OP_NAME_RE.search(rest)
    if op_name:
      scopes[m.group(1)] = scope_of(op_name.group(1), known_scopes)
  out = []
  for name, shape, rest in lines:
    opcode, _, args = rest.partition("(")
    kind = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    if kind not in KINDS:
      continue
    names = _operand_names(args)
    operands = [a for n in names for a in shapes.get(n, [])]
    m = _OP_NAME_RE.search(args)
    op_name = m.group(1) if m else ""
    result = _arrays(shape)
    if opcode.endswith("-start"):  # async start returns (operands, results, ...): count the results only
      result = result[len(operands):2 * len(operands)] or result
    out.append(Collective(
        name=name, kind=kind, dtypes=tuple(t for t, _ in operands), shapes=tuple(d for _, d in operands),
        operand_bytes=_nbytes(operands), result_bytes=_nbytes(result),
        group_size=_group_size(args, default_group_size), scope=scope_of(op_name, known_scopes), op_name=op_name,
        producers=tuple(_producer(n, inputs) for n in names)))
  return CompiledStep(module.group(1) if module else "", tuple(out), scopes)


def compile_step(jitted, *args, known_scopes=None, **kwargs) -> CompiledStep:
  """Compiles ``jitted(*args, **kwargs)`` (does not run it) and reads the result with :func:`parse_compiled`.

  JAX caches the executable: a later call with arguments of the same shapes does not compile again.

  Args:
    jitted: a ``jax.jit``-wrapped function.
    *args, **kwargs: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    known_scopes: if given, the only names that count as named scopes.
  """
  import jax  # deferred: reading HLO text needs no JAX (the network analysis reads it)
  compiled = jitted.lower(*args, **kwargs).compile()
  return parse_compiled(compiled.as_text(), default_group_size=jax.device_count(), known_scopes=known_scopes)


def compiled_collectives(jitted, *args, **kwargs) -> tuple[Collective, ...]:
  """The collectives of ``jitted(*args, **kwargs)`` as XLA compiled them (see :func:`compile_step`)."""
  return compile_step(jitted, *args, **kwargs).collectives


def collective_bytes(fn, *args) -> int:
  """Bytes each process contributes to collectives in one call of the jitted ``fn(*args)``.

  The operand bytes ``S`` of every collective XLA compiled (combined all-reduces included), summed: see
  :func:`compiled_collectives` for the per-collective list and the bytes each one puts on the wire (a ring
  all-reduce of ``S`` bytes over P processes sends ``2 (P - 1) / P * S`` bytes per process).
  """
  return sum(c.operand_bytes for c in compiled_collectives(fn, *args))
