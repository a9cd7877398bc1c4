"""What-if model of a distributed step: collective costs, an event-driven simulator and its inversions.

A :class:`~sparsejax.netanalysis.profiles.Profile` describes a step as compute segments on one compute
stream and collectives on one network channel. :func:`predict` replays it for another link rate
``B`` (bit/s), number of processes ``P`` and gradient compression ratio ``c``: segments run in order,
segment ``j`` starting only once every collective needed before it has finished; collectives are
served one at a time in the order they become ready; optionally ready gradient all-reduces are fused
as Horovod does. The result is deterministic and exact (no emulated clocks).

Cost of one collective of ``S`` bytes (``alpha`` seconds per hop, ``gamma(s)`` the time to add two
buffers of ``s`` bytes, ``c`` only for compressible collectives):

* all-reduce: ``2 (P-1) alpha + 2 (P-1)/P * 8 S / (B c) + (P-1) gamma(S/P)``
* all-gather (``S`` = gathered total): ``(P-1) alpha + (P-1)/P * 8 S / (B c)``
* reduce-scatter: ``(P-1) alpha + (P-1)/P * 8 S / (B c) + (P-1) gamma(S/P)``
* all-to-all: ``(P-1) alpha + (P-1)/P * 8 S / (B c)``
* collective-permute: ``alpha + 8 S / (B c)``

Modes: :func:`paper_model` (Zhang et al. 2020: no latency, fusion every 5 ms or 64 MiB),
:func:`ideal_model` (the link fully used at its nominal rate, no latency) and :func:`measured_model`
(latency, achieved bandwidth and reduction cost from a probe). The scaling factor is
``SF = compute / step``: the fraction of the step not spent waiting for the network; for a
data-parallel profile with the per-process batch fixed this is the paper's ``T_n / (n T_1)``.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from sparsejax.distributed.collectives import KINDS
from sparsejax.netanalysis.probe_results import Probe
from sparsejax.netanalysis.profiles import END, Chain, Profile, ProfileError, Segment

MIB = 1024 * 1024
COMPRESSION_RANGE = (1.0, 1e4)  # searched by needed_compression
BANDWIDTH_RANGE = (1e3, 1e15)  # bit/s, searched by needed_bandwidth and network_bound_below
SEARCH_TOLERANCE = 0.01  # relative: bisections stop when hi / lo <= 1.01
TERMS = ("compute", "bandwidth", "latency", "reduction")  # what a critical path is made of


@dataclasses.dataclass(frozen=True)
class Fusion:
  """Horovod-style tensor fusion: flush the ready gradients once this much compute time or data accumulated.

  Attributes:
    seconds: flush when the compute time since the last flush reaches this (``inf``: never).
    bytes: flush when the pending gradient bytes reach this (``inf``: never).
  """
  seconds: float = math.inf
  bytes: float = math.inf


PAPER_FUSION = Fusion(seconds=0.005, bytes=64 * MIB)


class Cost(NamedTuple):
  """Seconds one collective takes, by term."""
  latency: float
  bandwidth: float
  reduction: float

  @property
  def total(self) -> float:
    return self.latency + self.bandwidth + self.reduction


# kind -> (hops(P), wire factor(P): bytes on the wire per operand byte, reduces)
_RING = {
    "all-reduce": (lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p, True),
    "all-gather": (lambda p: p - 1, lambda p: (p - 1) / p, False),
    "reduce-scatter": (lambda p: p - 1, lambda p: (p - 1) / p, True),
    "all-to-all": (lambda p: p - 1, lambda p: (p - 1) / p, False),
    "collective-permute": (lambda p: 1, lambda p: 1.0, False),
}


@dataclasses.dataclass(frozen=True)
class CostModel:
  """How much collectives cost, and whether gradients are fused.

  Attributes:
    name: ``paper``, ``ideal`` or ``measured``.
    alpha_s: latency per hop by collective kind, seconds (missing kinds: 0).
    efficiency: achieved over nominal bandwidth by collective kind (missing kinds: 1).
    reduce_cost: ``gamma(bytes) -> seconds``, the local cost of adding two buffers, or None (free).
    fusion: tensor fusion of ready compressible all-reduces, or None.
  """
  name: str
  alpha_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
  efficiency: Mapping[str, float] = dataclasses.field(default_factory=dict)
  reduce_cost: Callable[[float], float] | None = None
  fusion: Fusion | None = None

  def cost(self, kind: str, nbytes: float, workers: int, bandwidth_bps: float, compression: float = 1.0) -> Cost:
    """Cost of one collective (the closed forms of the module docstring).

    Args:
      kind: one of :data:`~sparsejax.distributed.collectives.KINDS`.
      nbytes: ``S``, bytes (all-gather: the gathered total).
      workers: ``P`` processes, one link each.
      bandwidth_bps: nominal link rate ``B``, bit/s (scaled by ``efficiency[kind]``).
      compression: ``c >= 1`` dividing the bytes on the wire (pass 1 for incompressible collectives).

    Returns:
      the latency, bandwidth and reduction terms, seconds.
    """
    hops, wire, reduces = _RING[kind]
    if workers <= 1:
      return Cost(0.0, 0.0, 0.0)
    rate = bandwidth_bps * self.efficiency.get(kind, 1.0) * compression
    reduction = (workers - 1) * self.reduce_cost(nbytes / workers) if reduces and self.reduce_cost else 0.0
    return Cost(hops(workers) * self.alpha_s.get(kind, 0.0), wire(workers) * nbytes * 8 / rate, reduction)


def paper_model(reduce_cost: Callable[[float], float] | None = None, fusion: Fusion | None = PAPER_FUSION) -> CostModel:
  """The paper's simulator: ring all-reduce at full link rate, no latency, fusion every 5 ms or 64 MiB."""
  return CostModel("paper", reduce_cost=reduce_cost, fusion=fusion)


def ideal_model(reduce_cost: Callable[[float], float] | None = None, fusion: Fusion | None = None) -> CostModel:
  """The link fully used at its nominal rate, no latency (what the paper calls fully utilised)."""
  return CostModel("ideal", reduce_cost=reduce_cost, fusion=fusion)


# A kind the probe did not measure borrows the fit of the nearest kind it did.
_FALLBACK = {"reduce-scatter": "all-reduce", "all-to-all": "all-gather", "all-gather": "all-reduce",
             "collective-permute": "all-reduce", "all-reduce": "all-gather"}


def measured_model(probe: Probe, reduce_cost: Callable[[float], float] | None = None,
                   fusion: Fusion | None = None) -> tuple[CostModel, float]:
  """Latency, achieved bandwidth and reduction cost measured by ``netanalysis probe``.

  Bandwidth is modelled as a fraction of a reference rate: the probe's ``link_capacity_bps`` when
  it recorded one (so predictions at other nominal rates keep the measured utilisation), else the
  fitted all-reduce bandwidth (the all-reduce then runs at exactly the nominal rate).

  Args:
    probe: the probe file's content.
    reduce_cost: overrides the probe's reduction-cost table.
    fusion: optional tensor fusion.

  Returns:
    ``(model, reference_bps)``: predicting at ``reference_bps`` reproduces the probed link.

  Raises:
    ProfileError: the probe has no collective fits.
  """
  if not probe.collectives:
    raise ProfileError("probe file: no collective fits (the probe measured nothing)")
  fits = {}
  for kind in KINDS:
    fits[kind] = (probe.collectives.get(kind) or probe.collectives.get(_FALLBACK[kind])
                  or probe.collectives.get("all-reduce") or next(iter(probe.collectives.values())))
  reference = probe.link_capacity_bps or fits["all-reduce"].bw_bps
  model = CostModel("measured", alpha_s={k: f.alpha_s for k, f in fits.items()},
                    efficiency={k: f.bw_bps / reference for k, f in fits.items()},
                    reduce_cost=reduce_cost or probe.reduce_cost, fusion=fusion)
  return model, reference


def wire_bytes_per_step(profile: Profile, workers: int) -> float:
  """Bytes one process sends per step under ring collectives for ``workers`` processes (mean over steps)."""
  total = math.fsum(_RING[c.kind][1](workers) * c.bytes for chain in profile.steps for c in chain.collectives)
  return total / len(profile.steps) if workers > 1 else 0.0


# ---------------------------------------------------------------------------------------------------
# Simulation of one step.


class Message(NamedTuple):
  """What went over the channel: one collective, or several fused gradient all-reduces."""
  members: tuple[int, ...]  # indices into the chain's collectives
  kind: str
  bytes: int
  ready: float
  start: float
  finish: float
  cost: Cost
  after: tuple[str, int]  # what it waited for: ("message", m), ("segment", j) or ("start", -1)


class Simulation(NamedTuple):
  """One simulated step. Times in seconds from the step's start.

  Attributes:
    step_seconds: when the last segment and every collective needed at the end are done.
    compute_seconds: sum of the segments.
    comm_seconds: sum of the messages' costs (the channel's busy time).
    exposed_comm_seconds: ``step - compute``, time the compute stream idled on the network.
    critical: seconds of the critical path by term (:data:`TERMS`); they add up to the step.
    segments: ``(start, end)`` of each segment.
    messages: what went over the channel, in order.
  """
  step_seconds: float
  compute_seconds: float
  comm_seconds: float
  exposed_comm_seconds: float
  critical: dict[str, float]
  segments: tuple[tuple[float, float], ...]
  messages: tuple[Message, ...]


CostFn = Callable[[str, int, bool], Cost]


def simulate(chain: Chain, cost: CostFn, fusion: Fusion | None = None) -> Simulation:
  """Replay one step: one compute stream, one network channel, collectives in ready order.

  Fusion (if given) applies to compressible all-reduces, as Horovod fuses gradients: after each
  segment the compute time since the last flush and the pending bytes are checked; reaching
  ``fusion.seconds`` or ``fusion.bytes`` sends the pending gradients as one message ready now and
  resets both counters (with nothing pending, only the counters reset). Pending gradients are also
  sent before a segment that needs one of them, and after the last segment.

  Args:
    chain: the step.
    cost: ``cost(kind, bytes, compressible) -> Cost`` for the scenario at hand.
    fusion: optional fusion thresholds.

  Returns:
    the :class:`Simulation`.
  """
  collectives = chain.collectives
  n = len(chain.segments)
  ready_after = {}
  for k, c in sorted(enumerate(collectives), key=lambda kc: kc[1].ready_after):
    ready_after.setdefault(c.ready_after, []).append(k)
  needed = [n if c.needed_before == END else c.needed_before for c in collectives]
  needed_by = {}
  for k, need in enumerate(needed):
    needed_by.setdefault(need, []).append(k)
  finish = [math.nan] * len(collectives)
  messages: list[Message] = []
  pending: list[int] = []
  # The segments that pending gradients are needed before: scanning `pending` at every segment was quadratic
  # where fusion holds many back (10^5 layers of 0.1 us each under the paper's 5 ms window).
  pending_needed: set[int] = set()
  acc = {"seconds": 0.0, "bytes": 0}

  def send(members: list[int], ready: float, source: tuple[str, int]) -> None:
    first = collectives[members[0]]
    nbytes = sum(collectives[k].bytes for k in members)
    c = cost(first.kind, nbytes, first.compressible)
    start, after = ready, source
    if messages and messages[-1].finish > ready:
      start, after = messages[-1].finish, ("message", len(messages) - 1)
    messages.append(Message(tuple(members), first.kind, nbytes, ready, start, start + c.total, c, after))
    for k in members:
      finish[k] = start + c.total

  def flush(now: float, source: tuple[str, int]) -> None:
    if pending:
      send(list(pending), now, source)
      pending.clear()
      pending_needed.clear()
    acc["seconds"], acc["bytes"] = 0.0, 0

  def release(j: int, now: float) -> None:
    """Collectives ready after segment j (-1: at the start) become ready at ``now``."""
    source = ("segment", j) if j >= 0 else ("start", -1)
    for k in ready_after.get(j, ()):
      c = collectives[k]
      if fusion is not None and c.kind == "all-reduce" and c.compressible:
        pending.append(k)
        pending_needed.add(needed[k])
        acc["bytes"] += c.bytes
      else:
        send([k], now, source)
    if fusion is not None and (acc["seconds"] >= fusion.seconds or acc["bytes"] >= fusion.bytes):
      flush(now, source)

  release(-1, 0.0)
  spans, blocked_by = [], []
  t = 0.0
  for j, segment in enumerate(chain.segments):
    if j in pending_needed:
      flush(t, ("segment", j - 1) if j else ("start", -1))
    start, blocker = t, None
    for k in needed_by.get(j, ()):
      if finish[k] > start:
        start, blocker = finish[k], k
    spans.append((start, start + segment.seconds))
    blocked_by.append(blocker)
    t = start + segment.seconds
    if fusion is not None:
      acc["seconds"] += segment.seconds
    release(j, t)
  flush(t, ("segment", n - 1))
  step, last = t, None
  for k in needed_by.get(n, ()):
    if finish[k] > step:
      step, last = finish[k], k

  message_of = {k: m for m, msg in enumerate(messages) for k in msg.members}
  critical = dict.fromkeys(TERMS, 0.0)
  node = ("message", message_of[last]) if last is not None else ("segment", n - 1)
  while node[0] != "start" and node[1] >= 0:
    if node[0] == "segment":
      j = node[1]
      critical["compute"] += chain.segments[j].seconds
      node = ("message", message_of[blocked_by[j]]) if blocked_by[j] is not None else ("segment", j - 1)
    else:
      msg = messages[node[1]]
      for term, seconds in zip(("latency", "bandwidth", "reduction"), msg.cost):
        critical[term] += seconds
      node = msg.after
  compute = chain.compute_seconds
  return Simulation(step, compute, math.fsum(m.cost.total for m in messages), step - compute, critical,
                    tuple(spans), tuple(messages))


# ---------------------------------------------------------------------------------------------------
# Predictions.


def scale_chain(chain: Chain, from_workers: int, to_workers: int, scaling: str = "weak") -> Chain:
  """The chain's segments for ``to_workers`` processes.

  ``replicated`` segments stay; ``sharded`` ones scale by ``from_workers / to_workers``; ``batch``
  ones stay under ``scaling="weak"`` (per-process batch fixed) and scale like ``sharded`` under
  ``"strong"`` (global batch fixed). Collectives keep their bytes.
  """
  if scaling not in ("weak", "strong"):
    raise ValueError(f"scaling must be 'weak' or 'strong', got {scaling!r}")
  ratio = from_workers / to_workers
  scaled = {"replicated": 1.0, "sharded": ratio, "batch": ratio if scaling == "strong" else 1.0}
  if ratio == 1.0:
    return chain
  return Chain(tuple(Segment(s.seconds * scaled[s.scales], s.scope, s.scales) for s in chain.segments),
               chain.collectives)


class Prediction(NamedTuple):
  """Predicted step of one profile in one scenario (means over the profile's steps). Seconds.

  Attributes:
    profile: profile name.
    workers: P.
    bandwidth_bps: nominal link rate, bit/s.
    compression: ratio applied to compressible collectives.
    step_seconds: predicted step.
    compute_seconds: compute per step (the communication-free step).
    comm_seconds: time the network channel is busy per step.
    exposed_comm_seconds: ``step - compute``.
    scaling_factor: ``compute / step``.
    bottleneck: the largest term of the critical path: compute, bandwidth, latency or reduction.
    critical: seconds of the critical path by term.
  """
  profile: str
  workers: int
  bandwidth_bps: float
  compression: float
  step_seconds: float
  compute_seconds: float
  comm_seconds: float
  exposed_comm_seconds: float
  scaling_factor: float
  bottleneck: str
  critical: dict[str, float]


def predict(profile: Profile, model: CostModel, workers: int, bandwidth_bps: float, compression: float = 1.0,
            scaling: str = "weak") -> Prediction:
  """Predict ``profile``'s step with ``workers`` processes on links of ``bandwidth_bps`` at ``compression``.

  Args:
    profile: the measured or file profile.
    model: collective costs and fusion.
    workers: P >= 1.
    bandwidth_bps: nominal link rate, bit/s > 0.
    compression: c >= 1 for compressible collectives.
    scaling: ``weak`` or ``strong`` (see :func:`scale_chain`).

  Returns:
    the :class:`Prediction`, averaged over the profile's steps.
  """

  def cost(kind: str, nbytes: int, compressible: bool) -> Cost:
    return model.cost(kind, nbytes, workers, bandwidth_bps, compression if compressible else 1.0)

  sims = [simulate(scale_chain(chain, profile.workers, workers, scaling), cost, model.fusion)
          for chain in profile.steps]
  mean = lambda values: math.fsum(values) / len(sims)  # noqa: E731
  step = mean(s.step_seconds for s in sims)
  compute = mean(s.compute_seconds for s in sims)
  critical = {term: mean(s.critical[term] for s in sims) for term in TERMS}
  return Prediction(profile.name, workers, bandwidth_bps, compression, step, compute,
                    mean(s.comm_seconds for s in sims), step - compute, compute / step if step > 0 else 1.0,
                    max(TERMS, key=lambda term: critical[term]), critical)


def grid(profiles: Sequence[Profile], model: CostModel, workers: Sequence[int], bandwidths: Sequence[float],
         compressions: Sequence[float] = (1.0,), scaling: str = "weak") -> list[Prediction]:
  """:func:`predict` for every (profile, workers, bandwidth, compression), in that nesting order."""
  return [predict(p, model, n, b, c, scaling) for p in profiles for n in workers for b in bandwidths
          for c in compressions]


# ---------------------------------------------------------------------------------------------------
# Inversions.


def _bisect(reaches: Callable[[float], bool], lo: float, hi: float) -> float:
  """Smallest x in (lo, hi] with ``reaches(x)`` to :data:`SEARCH_TOLERANCE`, for monotone ``reaches``.

  ``reaches(lo)`` must be False and ``reaches(hi)`` True; the result ``x`` reaches, ``x / 1.01`` not.
  """
  while hi / lo > 1 + SEARCH_TOLERANCE:
    mid = math.sqrt(lo * hi)
    if reaches(mid):
      hi = mid
    else:
      lo = mid
  return hi


def _limiting_cause(prediction: Prediction) -> str:
  """What keeps the step from reaching compute speed: the largest non-compute term of the critical path."""
  return max(TERMS[1:], key=lambda term: prediction.critical[term])


class Needed(NamedTuple):
  """Answer of an inversion.

  Attributes:
    profile: profile name.
    workers: P.
    bandwidth_bps: the link rate searched at (compression inversions) or found (bandwidth ones), bit/s;
      None when unreachable.
    target_scaling: the scaling factor asked for (network-bound rate: None).
    compression: needed ratio (1.0 when none is needed), None when unreachable.
    status: ``none needed``, ``needed``, ``unreachable`` (bandwidth inversions: ``below range``, ``found``;
      network-bound rate: ``found``, ``never``, ``always``).
    limit_scaling: for ``unreachable``: the scaling factor at the end of the searched range.
    cause: for ``unreachable``: latency, reduction or bandwidth (of incompressible collectives).
  """
  profile: str
  workers: int
  bandwidth_bps: float | None
  target_scaling: float | None
  compression: float | None
  status: str
  limit_scaling: float | None = None
  cause: str | None = None


def needed_compression(profile: Profile, model: CostModel, workers: int, bandwidth_bps: float, target: float,
                       scaling: str = "weak") -> Needed:
  """Smallest compression ratio in [1, 1e4] whose scaling factor reaches ``target`` (to 1%, by bisection).

  SF does not decrease with ``c``, so the result ``c*`` reaches the target and ``c* / 1.01`` does not.
  """
  sf = lambda c: predict(profile, model, workers, bandwidth_bps, c, scaling)  # noqa: E731
  lo, hi = COMPRESSION_RANGE
  if sf(lo).scaling_factor >= target:
    return Needed(profile.name, workers, bandwidth_bps, target, 1.0, "none needed")
  top = sf(hi)
  if top.scaling_factor < target:
    return Needed(profile.name, workers, bandwidth_bps, target, None, "unreachable", top.scaling_factor,
                  _limiting_cause(top))
  c = _bisect(lambda c: sf(c).scaling_factor >= target, lo, hi)
  return Needed(profile.name, workers, bandwidth_bps, target, c, "needed")


def needed_bandwidth(profile: Profile, model: CostModel, workers: int, target: float, compression: float = 1.0,
                     scaling: str = "weak") -> Needed:
  """Smallest link rate in [1 kbit/s, 1 Pbit/s] whose scaling factor reaches ``target`` at ``compression``."""
  sf = lambda b: predict(profile, model, workers, b, compression, scaling)  # noqa: E731
  lo, hi = BANDWIDTH_RANGE
  if sf(lo).scaling_factor >= target:
    return Needed(profile.name, workers, lo, target, compression, "below range")
  top = sf(hi)
  if top.scaling_factor < target:
    return Needed(profile.name, workers, None, target, compression, "unreachable", top.scaling_factor,
                  _limiting_cause(top))
  return Needed(profile.name, workers, _bisect(lambda b: sf(b).scaling_factor >= target, lo, hi), target,
                compression, "found")


def network_bound_below(profile: Profile, model: CostModel, workers: int, compression: float = 1.0,
                        scaling: str = "weak") -> Needed:
  """The link rate below which the step is network-bound (exposed communication >= compute).

  Returns:
    ``status="found"`` with the rate (to 1%); ``never`` when even 1 kbit/s leaves the job compute-bound;
    ``always`` when even 1 Pbit/s does not (latency or reduction cost dominate; ``cause`` says which).
  """
  bound = lambda b: predict(profile, model, workers, b, compression, scaling)  # noqa: E731
  compute_bound = lambda p: p.exposed_comm_seconds < p.compute_seconds  # noqa: E731
  lo, hi = BANDWIDTH_RANGE
  if compute_bound(bound(lo)):
    return Needed(profile.name, workers, None, None, compression, "never")
  top = bound(hi)
  if not compute_bound(top):
    return Needed(profile.name, workers, None, None, compression, "always", top.scaling_factor, _limiting_cause(top))
  return Needed(profile.name, workers, _bisect(lambda b: compute_bound(bound(b)), lo, hi), None, compression, "found")


def effective_compression(sparse: Profile, dense: Profile, workers: int) -> float:
  """Dense over sparse ring wire bytes per step: the compression ratio the sparse job amounts to."""
  sparse_bytes = wire_bytes_per_step(sparse, workers)
  return wire_bytes_per_step(dense, workers) / sparse_bytes if sparse_bytes else math.inf


class EffectiveCompression(NamedTuple):
  """The sparse job's traffic expressed as a compression ratio of the dense job's (same P)."""
  sparse: str
  dense: str
  workers: int
  compression: float


@dataclasses.dataclass
class Analysis:
  """Everything ``netanalysis whatif`` computes; :mod:`sparsejax.netanalysis.report` renders it.

  Attributes:
    model: cost model name.
    scaling: ``weak`` or ``strong``.
    fusion: fusion thresholds used, or None.
    target_scaling: the target of the inversions, or None (then the inversion lists are empty).
    grid: one prediction per (profile, workers, bandwidth, compression).
    needed_compression: per (profile, workers, bandwidth).
    needed_bandwidth: per (profile, workers), at c = 1.
    network_bound: per (profile, workers), at c = 1: the rate below which exposed comm >= compute.
    effective_compression: per (sparse profile, dense profile, workers).
    notes: remarks for the reader (assumptions the inputs forced).
  """
  model: str
  scaling: str
  fusion: Fusion | None
  target_scaling: float | None
  grid: list[Prediction]
  needed_compression: list[Needed] = dataclasses.field(default_factory=list)
  needed_bandwidth: list[Needed] = dataclasses.field(default_factory=list)
  network_bound: list[Needed] = dataclasses.field(default_factory=list)
  effective_compression: list[EffectiveCompression] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)


def analyse(profiles: Sequence[Profile], model: CostModel, workers: Sequence[int], bandwidths: Sequence[float],
            compressions: Sequence[float] = (1.0,), target: float | None = None, scaling: str = "weak",
            notes: Sequence[str] = ()) -> Analysis:
  """The grid of predictions and, with a ``target`` scaling factor, every inversion.

  Args:
    profiles: profiles to analyse.
    model: cost model.
    workers: numbers of processes.
    bandwidths: nominal link rates, bit/s.
    compressions: compression ratios of the grid.
    target: target scaling factor in (0, 1], or None.
    scaling: ``weak`` or ``strong``.
    notes: remarks to carry to the report.
  """
  notes = list(notes)
  if any(c != 1 for c in compressions) or target is not None:
    notes += [f"{p.name}: no compressible collective (it exchanges activations and softmax sums, not gradients): "
              "compression changes nothing" for p in profiles
              if not any(c.compressible for chain in p.steps for c in chain.collectives)]
  result = Analysis(model.name, scaling, model.fusion, target,
                    grid(profiles, model, workers, bandwidths, compressions, scaling), notes=notes)
  for sparse in (p for p in profiles if p.job == "sparse"):
    for dense in (p for p in profiles if p.job == "dense"):
      result.effective_compression += [EffectiveCompression(sparse.name, dense.name, n,
                                                            effective_compression(sparse, dense, n)) for n in workers]
  if target is None:
    return result
  for p in profiles:
    for n in workers:
      result.needed_compression += [needed_compression(p, model, n, b, target, scaling) for b in bandwidths]
      result.needed_bandwidth.append(needed_bandwidth(p, model, n, target, 1.0, scaling))
      result.network_bound.append(network_bound_below(p, model, n, 1.0, scaling))
  return result
