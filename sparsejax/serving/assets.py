"""A trained run's assets, ``WORKDIR/assets``: what serving needs beside the network's state, written by training
and read by :func:`sparsejax.load`, in one place (the schema).

Files: the label names (``labels.txt``, one per line), the fitted text vectorizer (``vectorizer.json``), the training
set's label frequencies (``label_frequencies.npy``, for PSP@k), the serving index that the final evaluation built
for the selected state (``serving_index.npz``; runs with a clustered index), the centroid fusion
(``centroid_fusion.npz``), the ensemble's other members (``ensemble.json``), and their seal (``checksums.json``:
each file's checksum and the run's id, :mod:`sparsejax.workdir.seals`). Each file is written whole or not at all.
"""

import json
import os
import re
import zipfile
import zlib

import numpy as np

from sparsejax.config import Config
from sparsejax.data import LoadedData
from sparsejax.data.text import VectorizerFormatError, read_vectorizer, save_vectorizer
from sparsejax.fusion import Fusion, LabelCentroids
from sparsejax.head_rankers import HeadRankers
from sparsejax.index import clusters
from sparsejax.workdir import best_checkpoint, checkpoint, seals

ASSETS = "assets"
LABELS, VECTORIZER, FREQUENCIES = "labels.txt", "vectorizer.json", "label_frequencies.npy"
SERVING_INDEX = "serving_index.npz"
FUSION = "centroid_fusion.npz"  # the labels' centroids, head rankers and weights the run chose (sparsejax.fusion)
ENSEMBLE = "ensemble.json"  # the run's other members' directories (sparsejax.ensemble, sparsejax.train.members)
SEAL = "checksums.json"  # the assets' seal (sparsejax.workdir.seals)
# A member's directory, relative to the run's: nothing else is opened (a work directory from elsewhere must not make
# load read other files).
_MEMBER_DIRECTORY = re.compile(r"members/[1-9][0-9]{0,2}")
# What numpy raises reading a damaged .npy or .npz: a cut-short file ends in EOFError, a changed byte in an npz member
# in zipfile.BadZipFile (its CRC), neither an OSError nor a ValueError.
# zlib.error: a damaged compressed member (the fusion asset's head rankers are written compressed).
DAMAGED_ARRAYS = (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error)


def save_assets(workdir: str, data: LoadedData, run_id: str | None = None) -> None:
  """Writes the label names, the vectorizer and the label frequencies of ``data`` to ``WORKDIR/assets``, and their
  seal (``checksums.json``: each file's checksum and run ``run_id``, :mod:`sparsejax.workdir.seals`).

  ``data.train`` is what the run trains on (without its validation split): its label frequencies and its size
  (the run's ``meta``) give the propensities of PSP@k. Each file is written whole or not at all (a rename). A
  serving index that this run kept before (a resumed run) stays recorded; any other file of a former run's (a
  serving index, label names) is removed: it would describe another model.
  """
  directory = os.path.join(workdir, ASSETS)
  with seals.writing(directory):
    os.makedirs(directory, exist_ok=True)
  files = {FREQUENCIES: _write_asset(directory, FREQUENCIES,
                                      lambda path: np.save(path, data.train.label_frequencies()))}
  if data.label_names is not None:
    if any("\n" in name for name in data.label_names):
      raise ValueError("label names must not contain line breaks")
    files[LABELS] = _write_asset(directory, LABELS, lambda path: _write_lines(path, data.label_names))
  if data.vectorizer is not None:
    files[VECTORIZER] = _write_asset(directory, VECTORIZER, lambda path: save_vectorizer(data.vectorizer, path))
  previous = _own_seal(directory, run_id)
  if previous is not None and SERVING_INDEX in previous["files"]:
    files[SERVING_INDEX] = previous["files"][SERVING_INDEX]  # its checksum as written, never recomputed
  # A former fusion is not kept: the run's next final evaluation chooses it again (or, --nocentroid_fusion, none),
  # and until then the model served is not the one it was chosen for.
  for name in (LABELS, VECTORIZER, SERVING_INDEX, FUSION, ENSEMBLE):
    if name not in files and os.path.exists(os.path.join(directory, name)):
      os.remove(os.path.join(directory, name))
  if run_id is not None:
    seals.write_json_atomically(os.path.join(directory, SEAL), {"run_id": run_id, "step": None, "files": files})


def _write_asset(directory: str, name: str, write) -> list:
  """Writes ``name`` in ``directory`` whole or not at all (``write(path)`` writes a partial file, then renamed);
  returns its seal entry (``[size, sha256]`` of the bytes written, computed before the rename)."""
  partial = os.path.join(directory, f".partial.{name}")  # the same suffix: numpy adds none
  path = os.path.join(directory, name)
  with seals.writing(path, partial):  # a full disk: one line naming the file (numpy's OSError names none)
    write(partial)
    entry = seals.file_entry(partial)
    os.replace(partial, path)
  return entry


def _record_asset(directory: str, run_id: str | None, name: str, write) -> None:
  """Writes ``name`` in ``directory`` as :func:`_write_asset` does, and adds it to the assets' seal where that is
  run ``run_id``'s (an asset written after :func:`save_assets`: the serving index, the fusion, the ensemble)."""
  entry = _write_asset(directory, name, write)
  seal = _own_seal(directory, run_id)
  if seal is not None:
    seal["files"][name] = entry
    seals.write_json_atomically(os.path.join(directory, SEAL), seal)


def _write_lines(path: str, lines) -> None:
  with open(path, "w") as f:
    f.writelines(line + "\n" for line in lines)


def _own_seal(directory: str, run_id: str | None) -> dict | None:
  """The assets' seal if it is run ``run_id``'s and readable, else None."""
  path = os.path.join(directory, SEAL)
  if run_id is None or not os.path.exists(path):
    return None
  try:
    seal = seals.read_seal(path)
  except seals.IntegrityError:
    return None
  return seal if seal.get("run_id") == run_id else None


def save_serving_index(workdir: str, run_id: str | None, step: int, index) -> None:
  """Keeps the clustered serving index that a run's final evaluation built for the state of ``step``, and
  records it in the assets' seal.

  ``sparsejax.load`` then uses it for sampled prediction instead of building it again from the rows (seconds
  to minutes at 10^5-10^6 labels). Written whole or not at all (a rename).
  """
  directory = os.path.join(workdir, ASSETS)
  _record_asset(directory, run_id, SERVING_INDEX, lambda path: np.savez(
      path, step=np.int64(step), centroids=np.asarray(index.centroids), offsets=np.asarray(index.offsets),
      rows=np.asarray(index.rows)))


def save_fusion(workdir: str, run_id: str | None, fused: Fusion) -> None:
  """Keeps the labels' centroids, the head rankers (where the run chose a weight for them) and the weights that a
  run's final evaluation chose (:mod:`sparsejax.fusion`), recorded in the assets' seal: :func:`load`'s model re-ranks
  as the run's final evaluation did."""
  directory = os.path.join(workdir, ASSETS)
  centroids, rankers = fused.centroids, fused.rankers if fused.ranker_weight else None
  ranked = {} if rankers is None else {
      "ranker_weight": np.float64(fused.ranker_weight), "ranker_labels": rankers.labels,
      "ranker_weights": rankers.weights, "ranker_bias": rankers.bias}
  # The head rankers' members compressed (their weights are 0 for the features no training row has), the centroids
  # stored: deflating labels_heavy's 104M centroid entries (0.8 GB to 0.5 GB) took most of the final evaluation's
  # minute on 2 cores, and a file of them is read as fast as it is inflated.
  _record_asset(directory, run_id, FUSION, lambda path: _savez(path, {
      "weight": np.float64(fused.weight), "indptr": centroids.indptr, "indices": centroids.indices,
      "values": centroids.values, "num_features": np.int64(centroids.num_features)}, ranked))


def _savez(path: str, stored: dict[str, np.ndarray], compressed: dict[str, np.ndarray]) -> None:
  """An ``.npz`` file as :func:`numpy.savez` writes one (:func:`numpy.load` reads it), ``compressed``'s members
  deflated and ``stored``'s not."""
  with zipfile.ZipFile(path, "w", allowZip64=True) as archive:
    for members, method in ((stored, zipfile.ZIP_STORED), (compressed, zipfile.ZIP_DEFLATED)):
      for name, array in members.items():
        info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = method
        with archive.open(info, "w", force_zip64=True) as f:
          np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)


def save_ensemble(workdir: str, run_id: str | None, members: list[str]) -> None:
  """Records the run's other ensemble members (directories relative to ``workdir``, ``members/M``) in its assets,
  sealed, each with the run id and the step of the state it serves (its own seals': :func:`load` refuses another
  run put in its place): :func:`load` serves the ensemble (:mod:`sparsejax.ensemble`)."""
  for member in members:
    if not _MEMBER_DIRECTORY.fullmatch(member):
      raise ValueError(f"save_ensemble: a member's directory must be members/M (M in 1..999), got {member!r}")
  recorded = [{"directory": member, **_served_state(os.path.join(workdir, member))} for member in members]
  directory = os.path.join(workdir, ASSETS)
  _record_asset(directory, run_id, ENSEMBLE, lambda path: _write_json(path, {"members": recorded}))


def _served_state(workdir: str) -> dict:
  """``{"run_id", "step"}`` of what :func:`load` serves from ``workdir``: its newest checkpoint's run (None: an
  unsealed run) and its selected state's step (else its newest checkpoint's)."""
  checkpoints = checkpoint.Checkpoints(workdir, writable=False)
  newest = checkpoints.latest_step()
  meta = checkpoints.meta(newest) if newest is not None else None
  if meta is None:
    raise FileNotFoundError(f"{workdir}: no checkpoint with its settings: not a trained member")
  best = best_checkpoint.BestCheckpoint.open(workdir, Config.from_dict(meta["config"]).run.selection_metric)
  return {"run_id": meta.get("run_id"), "step": newest if best is None else best.best_step()}


def _write_json(path: str, value) -> None:
  with open(path, "w") as f:
    json.dump(value, f)


def read_ensemble(path: str) -> list[dict]:
  """The members that :func:`save_ensemble` recorded: ``{"directory", "run_id", "step"}`` each, the directory
  checked to be ``members/M``. An entry that is a directory alone (an earlier sparsejax's) has run id and step
  None: not checked."""
  try:
    with open(path, encoding="utf-8") as f:
      members = json.load(f)["members"]
  except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
    raise seals.IntegrityError(f"{path}: unreadable as an ensemble ({type(e).__name__}: {e})") from None
  if isinstance(members, list):
    members = [{"directory": m, "run_id": None, "step": None} if isinstance(m, str) else m for m in members]
    directories = [m.get("directory") if isinstance(m, dict) else m for m in members]
  if not isinstance(members, list) or not all(isinstance(d, str) and _MEMBER_DIRECTORY.fullmatch(d)
                                              for d in directories) or len(set(directories)) != len(directories):
    raise seals.IntegrityError(f"{path}: members must be distinct directories members/M, got {members!r}"[:300])
  for m in members:
    if set(m) != {"directory", "run_id", "step"} or not isinstance(m["run_id"], (str, type(None))) or not (
        m["step"] is None or (isinstance(m["step"], int) and not isinstance(m["step"], bool))):
      raise seals.IntegrityError(f"{path}: a member must record its directory, run_id and step, got {m!r}"[:300])
  return members


def member_directory(workdir: str, member: str, recorded_in: str) -> str:
  """The directory of ``member`` (``members/M``, as ``recorded_in`` names it), checked to be a real directory
  under ``WORKDIR/members`` (no link out of it) that is no ensemble itself (which would nest, or loop)."""
  path = os.path.join(workdir, member)
  root = os.path.realpath(os.path.join(workdir, "members"))
  if (os.path.islink(os.path.join(workdir, "members")) or os.path.islink(path) or not os.path.isdir(path)
      or os.path.dirname(os.path.realpath(path)) != root):
    raise seals.IntegrityError(f"{recorded_in}: names the ensemble member {member}, but {path} is not a directory "
                               "of this work directory's members/")
  if os.path.exists(os.path.join(path, ASSETS, ENSEMBLE)):
    raise seals.IntegrityError(f"{path}: an ensemble member that is an ensemble itself ({recorded_in} names it)")
  return path


def _read_fusion_file(path: str, num_labels: int, num_features: int) -> Fusion:
  """The fusion of a :func:`save_fusion` file, checked against the model's sizes."""
  try:
    with np.load(path, allow_pickle=False) as f:
      weight, indptr, indices, values, features = (float(f["weight"]), f["indptr"], f["indices"], f["values"],
                                                   int(f["num_features"]))
      ranked = ("ranker_weight" in f.files) and (float(f["ranker_weight"]), f["ranker_labels"], f["ranker_weights"],
                                                 f["ranker_bias"])
  except DAMAGED_ARRAYS as e:
    raise seals.IntegrityError(f"{path}: unreadable as centroid fusion ({type(e).__name__}: {e})") from None
  if (features != num_features or indptr.shape != (num_labels + 1,) or indices.shape != values.shape
      or indices.ndim != 1 or indptr[0] != 0 or indptr[-1] != len(indices) or np.any(np.diff(indptr) < 0)
      or not np.isfinite(weight) or weight < 0
      or (len(indices) and (indices.min() < 0 or indices.max() >= num_features))):
    raise seals.IntegrityError(f"{path}: not the centroids of {num_labels} labels over {num_features} features")
  centroids = LabelCentroids.of(indptr, indices, values, num_features)
  if not ranked:  # no head rankers (or a run of an older sparsejax)
    return Fusion(centroids, weight)
  ranker_weight, labels, weights, bias = ranked
  K = len(labels) if labels.ndim == 1 else -1
  if (K < 0 or weights.shape != (num_features, K) or bias.shape != (K,) or not np.isfinite(ranker_weight)
      or ranker_weight < 0 or (K and (labels.min() < 0 or labels.max() >= num_labels))
      or not np.all(np.isfinite(weights)) or not np.all(np.isfinite(bias))):
    raise seals.IntegrityError(f"{path}: not head rankers of {num_labels} labels over {num_features} features")
  rankers = HeadRankers(labels.astype(np.int32), weights.astype(np.float32), bias.astype(np.float32))
  return Fusion(centroids, weight, rankers, ranker_weight)


def check_assets(directory: str, run_id: str | None) -> None:
  """Raises :class:`IntegrityError` unless every file in ``directory`` that load reads is the one run ``run_id``
  wrote (its seal's checksums). An older sparsejax's run (``run_id`` None) has no seal: nothing is checked."""
  if run_id is None:
    return
  seal_path = os.path.join(directory, SEAL)
  if not os.path.exists(seal_path):
    raise seals.IntegrityError(f"{directory}: has no checksums ({SEAL} is missing): its run wrote them with the "
                               "files, so they were changed since")
  seal = seals.read_seal(seal_path)
  seals.check_identity(seal, seal_path, directory, run_id)
  read = (LABELS, VECTORIZER, FREQUENCIES, SERVING_INDEX, FUSION, ENSEMBLE)
  present = {name for name in read if os.path.exists(os.path.join(directory, name))}
  # The serving index is a cache: one removed is built again from the rows (the same index).
  names = (set(seal["files"]) - {SERVING_INDEX}) | present
  for name in sorted(names):
    seals.check_file(directory, name, seal, seal_path)


def not_utf8(path: str) -> str:
  """``not UTF-8 text (byte 0xff at offset 34)``: where the file at ``path`` stops being UTF-8."""
  with open(path, "rb") as f:
    content = f.read()
  try:
    content.decode("utf-8")
  except UnicodeDecodeError as e:
    return f"not UTF-8 text (byte {content[e.start]:#04x} at offset {e.start})"
  return "not UTF-8 text"


def check_serving_index(path: str, centroids: np.ndarray, offsets: np.ndarray, rows: np.ndarray,
                         num_labels: int) -> None:
  """Raises :class:`IntegrityError` unless the arrays of ``path`` make an index of ``num_labels`` rows: finite,
  not all-zero centroids, ascending offsets from 0, member ids in [0, N) each once."""
  def refuse(what: str):
    raise seals.IntegrityError(f"{path}: not a serving index of this model: {what}")

  if not np.issubdtype(centroids.dtype, np.floating) or not np.all(np.isfinite(centroids)):
    refuse("its centroids are not all finite numbers")
  if not np.any(centroids):
    refuse("its centroids are all zero")
  if not (np.issubdtype(offsets.dtype, np.integer) and np.issubdtype(rows.dtype, np.integer)):
    refuse("its offsets and rows are not integers")
  if offsets[0] != 0 or np.any(np.diff(offsets) < 0) or offsets[-1] > num_labels:
    refuse(f"its offsets do not ascend from 0 to at most {num_labels}")
  members = rows[:offsets[-1]]
  if np.any((members < 0) | (members >= num_labels)) or len(np.unique(members)) != len(members):
    refuse(f"its member ids are not distinct label ids in [0, {num_labels})")


def read_label_names(directory: str, num_labels: int) -> tuple[str, ...] | None:
  """The ``num_labels`` names that :func:`save_assets` wrote in ``directory`` (None: the run had none)."""
  path = os.path.join(directory, LABELS)
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      names = tuple(line.rstrip("\n") for line in f)
  except UnicodeDecodeError:
    raise seals.IntegrityError(f"{path}: {not_utf8(path)}") from None
  if len(names) != num_labels:
    raise seals.IntegrityError(f"{path}: names {len(names)} labels; the model predicts {num_labels}")
  return names


def read_saved_vectorizer(directory: str, num_features: int) -> dict | None:
  """The saved text vectorizer of ``directory``, its schema checked (:func:`sparsejax.data.text.read_vectorizer`)
  and its vocabulary ``num_features`` terms (None: the run had none)."""
  path = os.path.join(directory, VECTORIZER)
  if not os.path.exists(path):
    return None
  saved = read_vectorizer(path)
  terms = len(saved["vocabulary"])
  if terms != num_features:  # another run's: its columns name other features
    raise VectorizerFormatError(path, "vocabulary", f"has {terms} terms; the model reads {num_features} features")
  return saved


def read_fusion(directory: str, num_labels: int, num_features: int) -> Fusion | None:
  """The run's fusion (:func:`save_fusion`), checked against the model's sizes; None where the run fused
  nothing."""
  path = os.path.join(directory, FUSION)
  return _read_fusion_file(path, num_labels, num_features) if os.path.exists(path) else None


def read_frequencies(directory: str, num_labels: int) -> np.ndarray:
  """The training set's ``[num_labels]`` label frequencies (PSP@k's propensities)."""
  path = os.path.join(directory, FREQUENCIES)
  try:
    frequencies = np.load(path, allow_pickle=False)
  except DAMAGED_ARRAYS as e:
    raise seals.IntegrityError(f"{path}: unreadable ({e})") from None
  if frequencies.shape != (num_labels,) or not np.all(np.isfinite(frequencies)):
    raise seals.IntegrityError(f"{path}: not {num_labels} finite label frequencies (shape {frequencies.shape})")
  return frequencies


def read_serving_index(directory: str, step: int, num_labels: int, hidden: int):
  """The clustered serving index that :func:`save_serving_index` kept for the state of ``step`` (a
  :class:`sparsejax.index.clusters.ClusterIndex` over ``num_labels`` rows of width ``hidden``), or None: none kept
  (only a run with a clustered index keeps one), or another step's or layout's (built afresh)."""
  path = os.path.join(directory, SERVING_INDEX)
  if not os.path.exists(path):
    return None
  try:
    with np.load(path, allow_pickle=False) as f:
      kept_step, centroids, offsets, rows = int(f["step"]), f["centroids"], f["offsets"], f["rows"]
  except DAMAGED_ARRAYS as e:  # not an npz, or not one of these arrays
    raise seals.IntegrityError(f"{path}: unreadable as a serving index ({type(e).__name__}: {e})") from None
  # C clusters: the run's eval_num_clusters, or, sharded, every shard's (see clusters.merge_shards).
  if kept_step != step or centroids.ndim != 2 or centroids.shape[1] != hidden + 2 or \
      offsets.shape != (len(centroids) + 1,) or rows.shape != (num_labels,):
    return None
  check_serving_index(path, centroids, offsets, rows, num_labels)
  return clusters.ClusterIndex(centroids, offsets, rows)
