"""Rendering of netanalysis results: text tables, JSON documents (and the reader of the what-if one) and PNG plots.

Pure functions of already-computed results (nothing here measures or simulates). Every rate in a
header is in bit/s; JSON keys carry their unit (``bandwidth_bps``, ``step_seconds``). PNGs need
matplotlib, the optional extra ``sparsejax[plot]``.
"""

import math
import os
from collections.abc import Sequence

from sparsejax.netanalysis import whatif
from sparsejax.netanalysis.file_io import JsonValue, check_schema, load_json
from sparsejax.rates import format_rate

WHATIF_SCHEMA = "sparsejax.netanalysis.whatif/1"

# One letter per bottleneck in the grids.
_BOTTLENECK_LETTER = {"compute": "C", "bandwidth": "B", "latency": "L", "reduction": "R"}


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
  """Columns padded to their widest cell: the first ``left`` columns left-aligned, the others right-aligned."""
  widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
  lines = []
  for row in [header, *rows]:
    cells = [str(cell).ljust(w) if i < left else str(cell).rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
    lines.append("  ".join(cells).rstrip())
  return "\n".join(lines)


def rate_label(bps: float) -> str:
  """``1e+11 (100gbit)``: the rate in bit/s, then as tc writes it (``~`` when rounded to 3 digits)."""
  rounded = float(f"{bps:.3g}")
  return f"{bps:.4g} ({'' if rounded == bps else '~'}{format_rate(rounded)})"


def _unique(values):
  return list(dict.fromkeys(values))


def _fusion_text(fusion: whatif.Fusion | None) -> str:
  if fusion is None:
    return "none"
  parts = []
  if math.isfinite(fusion.seconds):
    parts.append(f"{fusion.seconds * 1e3:g} ms")
  if math.isfinite(fusion.bytes):
    parts.append(f"{fusion.bytes / whatif.MIB:g} MiB")
  return " or ".join(parts) or "none"


def _needed_text(needed: whatif.Needed) -> str:
  if needed.status == "unreachable":
    return f"unreachable (SF {needed.limit_scaling:.3f}, {needed.cause})"
  if needed.status == "needed":
    return f"{needed.compression:.2f}x"
  return needed.status


def format_whatif(result: whatif.Analysis) -> str:
  """The what-if report: one scaling-factor grid per profile and compression ratio (rows: bandwidth,
  columns: P), then, with a target, the needed compression, the needed bandwidth, the rate below which
  each job is network-bound, and the sparse job's effective compression ratio."""
  out = [f"what-if: model {result.model}, {result.scaling} scaling, fusion {_fusion_text(result.fusion)}"]
  out += [f"note: {note}" for note in result.notes]
  workers = _unique(p.workers for p in result.grid)
  cells = {(p.profile, p.compression, p.bandwidth_bps, p.workers): p for p in result.grid}
  for profile in _unique(p.profile for p in result.grid):
    for c in _unique(p.compression for p in result.grid):
      rows = []
      for b in _unique(p.bandwidth_bps for p in result.grid):
        row = [rate_label(b)]
        for n in workers:
          p = cells[(profile, c, b, n)]
          row.append(f"{p.scaling_factor:.3f} {_BOTTLENECK_LETTER[p.bottleneck]}  {p.step_seconds * 1e3:9.2f}")
        rows.append(row)
      out += ["", f"== {profile}: scaling factor, bottleneck and step (ms) at compression {c:g}x ==",
              format_table(["bandwidth (bit/s)"] + [f"P={n}" for n in workers], rows)]
  out.append("(bottleneck: C compute, B bandwidth, L latency, R reduction cost; SF = compute / step)")
  if result.target_scaling is None:
    return "\n".join(out)
  target = result.target_scaling
  needed = {(n.profile, n.bandwidth_bps, n.workers): n for n in result.needed_compression}
  rows = [[profile, rate_label(b)] + [_needed_text(needed[(profile, b, n)]) for n in workers]
          for profile in _unique(n.profile for n in result.needed_compression)
          for b in _unique(n.bandwidth_bps for n in result.needed_compression)]
  out += ["", f"== compression needed for scaling factor {target:g} ==",
          format_table(["profile", "bandwidth (bit/s)"] + [f"P={n}" for n in workers], rows, left=2)]

  def rates(entries: list[whatif.Needed], text) -> list[list[str]]:
    by = {(e.profile, e.workers): e for e in entries}
    return [[profile] + [text(by[(profile, n)]) for n in workers] for profile in _unique(e.profile for e in entries)]

  def bandwidth_text(e: whatif.Needed) -> str:
    if e.status == "found":
      return rate_label(e.bandwidth_bps)
    if e.status == "below range":
      return f"<= {rate_label(e.bandwidth_bps)}"
    return _needed_text(e)

  def bound_text(e: whatif.Needed) -> str:
    return {"found": rate_label(e.bandwidth_bps) if e.bandwidth_bps else "", "never": "never",
            "always": f"always ({e.cause})"}[e.status]

  out += ["", f"== smallest link rate (bit/s) for scaling factor {target:g} without compression ==",
          format_table(["profile"] + [f"P={n}" for n in workers], rates(result.needed_bandwidth, bandwidth_text)),
          "", "== network-bound (exposed communication >= compute) below this link rate (bit/s) ==",
          format_table(["profile"] + [f"P={n}" for n in workers], rates(result.network_bound, bound_text))]
  if result.effective_compression:
    rows = [[e.sparse, e.dense, str(e.workers), f"{e.compression:.4g}x"] for e in result.effective_compression]
    out += ["", "== effective compression of the sparse job (dense wire bytes / sparse wire bytes per step) ==",
            format_table(["sparse", "dense", "P", "ratio"], rows, left=2)]
  return "\n".join(out)


def format_predictions(result: whatif.Analysis) -> str:
  """One row per prediction: step, compute, channel busy time, exposed communication, SF and bottleneck."""
  rows = [[p.profile, rate_label(p.bandwidth_bps), str(p.workers), f"{p.compression:g}x", f"{p.step_seconds * 1e3:.3f}",
           f"{p.compute_seconds * 1e3:.3f}", f"{p.comm_seconds * 1e3:.3f}", f"{p.exposed_comm_seconds * 1e3:.3f}",
           f"{p.scaling_factor:.4f}", p.bottleneck] for p in result.grid]
  return format_table(["profile", "bandwidth (bit/s)", "P", "c", "step ms", "compute ms", "comm ms", "exposed ms", "SF",
                       "bottleneck"], rows, left=2)


def whatif_json(result: whatif.Analysis) -> dict:
  """The ``sparsejax.netanalysis.whatif/1`` document of an analysis (units in key names, null when unreachable)."""
  finite = lambda x: x if x is not None and math.isfinite(x) else None  # noqa: E731
  doc = {
      "schema": WHATIF_SCHEMA,
      "model": result.model,
      "scaling": result.scaling,
      "fusion": None if result.fusion is None else {"seconds": finite(result.fusion.seconds),
                                                    "bytes": finite(result.fusion.bytes)},
      "notes": list(result.notes),
      "grid": [{"profile": p.profile, "workers": p.workers, "bandwidth_bps": p.bandwidth_bps,
                "compression": float(p.compression), "scaling_factor": p.scaling_factor, "step_seconds": p.step_seconds,
                "exposed_comm_seconds": p.exposed_comm_seconds} for p in result.grid],
      "effective_compression": [e._asdict() for e in result.effective_compression],
      # Everything else the model says about each grid cell (the grid keeps the documented keys only).
      "predictions": [{"profile": p.profile, "workers": p.workers, "bandwidth_bps": p.bandwidth_bps,
                       "compression": float(p.compression), "step_seconds": p.step_seconds,
                       "compute_seconds": p.compute_seconds, "comm_seconds": p.comm_seconds,
                       "exposed_comm_seconds": p.exposed_comm_seconds, "scaling_factor": p.scaling_factor,
                       "bottleneck": p.bottleneck,
                       "critical_path_seconds": {term: p.critical[term] for term in whatif.TERMS}}
                      for p in result.grid],
  }
  if result.target_scaling is not None:
    doc["target_scaling"] = result.target_scaling
    doc["needed_compression"] = [{"profile": n.profile, "workers": n.workers, "bandwidth_bps": n.bandwidth_bps,
                                  "target_scaling": n.target_scaling, "compression": n.compression}
                                 for n in result.needed_compression]
    doc["needed_bandwidth"] = [{"profile": n.profile, "workers": n.workers, "target_scaling": n.target_scaling,
                                "bandwidth_bps": n.bandwidth_bps if n.status == "found" else None}
                               for n in result.needed_bandwidth]
    doc["network_bound_below"] = [{"profile": n.profile, "workers": n.workers, "bandwidth_bps": n.bandwidth_bps,
                                   "status": n.status} for n in result.network_bound]
  return doc


_WHATIF_ENTRIES = {
    "grid": ("profile", "workers", "bandwidth_bps", "compression", "scaling_factor", "step_seconds",
             "exposed_comm_seconds"),
    "needed_compression": ("profile", "workers", "bandwidth_bps", "target_scaling", "compression"),
}


def read_whatif(path: str) -> dict:
  """Read the JSON written by ``netanalysis whatif --json``, checking its schema and the entries of its
  ``grid`` and ``needed_compression`` lists (``compression`` may be null: unreachable).

  Raises:
    ProfileError: invalid JSON, another schema, a missing or unknown key, a wrong type.
  """
  doc = JsonValue(path, load_json(path))
  check_schema(doc, WHATIF_SCHEMA)
  keys = doc.obj(["schema", "model", "scaling", "fusion", "notes", "grid", "effective_compression"],
                 optional=["target_scaling", "needed_compression", "needed_bandwidth", "network_bound_below",
                           "predictions"])
  for name, fields in _WHATIF_ENTRIES.items():
    for entry in keys[name].items() if name in keys else ():
      values = entry.obj(fields)
      values["profile"].string()
      values["workers"].integer(minimum=1)
      for field in fields[2:]:
        if field != "compression" or name == "grid" or values[field].value is not None:
          values[field].number()
  return doc.value


# ---------------------------------------------------------------------------------------------------
# PNG.


def require_matplotlib():
  """The pyplot module (Agg backend). Raises ValueError with what to install when matplotlib is missing."""
  try:
    import matplotlib.pyplot as plt  # deferred: matplotlib is optional (sparsejax[plot]), for PNG output only
  except ImportError:
    raise ValueError("PNG output needs matplotlib: pip install 'sparsejax[plot]' (or pip install matplotlib)") from None
  plt.switch_backend("Agg")  # files, never a window (as matplotlib.use("Agg"), with pyplot imported)
  return plt


def png_path(prefix: str, name: str, main: bool = True) -> str:
  """Where ``--png=PREFIX`` puts the plot ``name``; creates the directory.

  ``DIR/name.png`` for a directory (or a prefix ending in /); ``PREFIX.png`` where PREFIX already ends in the name
  (``--png=runs/whatif``: ``runs/whatif.png``, not ``whatif-whatif.png``); for a PREFIX ending in ``.png``, that
  file for the command's ``main`` plot and ``STEM-name.png`` for the others; else ``PREFIX-name.png``.
  """
  stem, given_png = (prefix[:-4], True) if prefix.lower().endswith(".png") else (prefix, False)
  base = os.path.basename(stem)
  if prefix.endswith(os.sep) or os.path.isdir(prefix):
    path = os.path.join(prefix, f"{name}.png")
  elif given_png:
    path = prefix if main else f"{stem}-{name}.png"
  elif base == name or base.endswith((f"-{name}", f"_{name}", f".{name}")):
    path = f"{stem}.png"
  else:
    path = f"{stem}-{name}.png"
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return path


def _line_styles(result: whatif.Analysis):
  """A colour per profile and a marker per P, so several profiles share one panel."""
  profiles = _unique(p.profile for p in result.grid)
  workers = _unique(p.workers for p in result.grid)
  markers = "osD^v<>ph*"
  return ({name: f"C{i % 10}" for i, name in enumerate(profiles)},
          {n: markers[i % len(markers)] for i, n in enumerate(workers)}, profiles, workers)


def plot_whatif(result: whatif.Analysis, prefix: str) -> list[str]:
  """Write ``whatif.png`` (SF vs bandwidth, one line per profile and P, one panel per compression ratio)
  and, with a target, ``compression.png`` (needed ratio vs bandwidth). Returns the paths written."""
  plt = require_matplotlib()
  colour, marker, profiles, workers = _line_styles(result)
  compressions = _unique(p.compression for p in result.grid)
  cols = min(len(compressions), 3)
  rows = math.ceil(len(compressions) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, sharey=True)
  for ax, c in zip(axes.flat, compressions):
    for name in profiles:
      for n in workers:
        points = sorted((p.bandwidth_bps, p.scaling_factor) for p in result.grid
                        if p.profile == name and p.workers == n and p.compression == c)
        ax.plot(*zip(*points), color=colour[name], marker=marker[n], label=f"{name} P={n}")
    if result.target_scaling is not None:
      ax.axhline(result.target_scaling, color="grey", linestyle=":", linewidth=1)
    ax.set(xscale="log", title=f"compression {c:g}x", xlabel="link rate (bit/s)", ylim=(0, 1.02))
    ax.grid(True, which="major", alpha=0.3)
  for ax in axes.flat[len(compressions):]:
    ax.set_visible(False)
  for ax in axes[:, 0]:
    ax.set_ylabel("scaling factor")
  axes.flat[0].legend(fontsize=7)
  fig.suptitle(f"what-if ({result.model} model, {result.scaling} scaling)")
  fig.tight_layout()
  paths = [png_path(prefix, "whatif")]
  fig.savefig(paths[0], dpi=110)
  plt.close(fig)
  if result.target_scaling is None or not any(e.compression is not None for e in result.needed_compression):
    return paths  # no profile reaches the target by compression: an empty plot says nothing
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in profiles:
    for n in workers:
      points = sorted((e.bandwidth_bps, e.compression) for e in result.needed_compression
                      if e.profile == name and e.workers == n and e.compression is not None)
      if points:
        ax.plot(*zip(*points), color=colour[name], marker=marker[n], label=f"{name} P={n}")
  ax.set(xscale="log", yscale="log", xlabel="link rate (bit/s)", ylabel="compression ratio needed",
         title=f"compression needed for scaling factor {result.target_scaling:g} ({result.model} model)")
  ax.grid(True, which="major", alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  paths.append(png_path(prefix, "compression", main=False))
  fig.savefig(paths[1], dpi=110)
  plt.close(fig)
  return paths
