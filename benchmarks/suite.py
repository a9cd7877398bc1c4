"""Issue 48 (items 3 and 5): a suite of data shapes, each trained by PECOS XR-Linear, napkinXC and sparsejax.

sparsejax was tuned on five built-in sets; this suite asks how it does on shapes it was not tuned on. Every shape
is written once as Extreme Classification Repository train/test files (``--cache``), and every system trains on
the same files and cores: sparsejax with its defaults only (``sparsejax-train --dataset=files --train_file=...
--test_file=... --max_seconds=300``), the peers on the training samples minus sparsejax's validation split (as
``accuracy.py`` runs them, through ``harness.peers``). Each run writes ``OUT/SHAPE-SYSTEM.json``: test P@1, P@3,
P@5, training seconds, wall seconds. ``--report`` sets them side by side (``OUT/summary.json``, ``summary.md``)
with, per shape, the training seconds sparsejax needed to reach PECOS's test P@1 (its validation curve in
metrics.jsonl, else the final test evaluation) against PECOS's training seconds: time to accuracy against the trees.

The shapes (:data:`SHAPES`): synthetic ones that vary one thing at a time from a base (``make_synthetic``: 10^4
Zipf labels, 100K training samples, 10 per label on average, 30 non-zeros per sample, one label each), and real
multi-label sets with heavy-tailed label counts built from Debian packages (see :func:`build_debian_depends`,
:func:`build_foldoc_xrefs`). The suite is split into a tuned half and a held-out half, fixed here before any
result was seen: the held-out half must never be used to choose defaults. ``large`` shapes (10^6 labels, 10^6
training samples, 1,000 non-zeros) are left out unless named or ``--large`` is given.

The whole suite (a quiet 2-core machine; the peers take seconds to minutes per shape, sparsejax 300 s of training
plus its evaluations):

  python benchmarks/suite.py --build                       # data files and OUT/shapes.json (their properties)
  python benchmarks/suite.py --system pecos --pecos_python PECOS_VENV/bin/python
  python benchmarks/suite.py --system napkinxc
  python benchmarks/suite.py --system sparsejax
  python benchmarks/suite.py --report

Add ``--large`` (or name shapes: ``--shapes n_1m spl_100``) for the large shapes, ``--half held_out`` for one
half. PECOS needs numpy < 2: give it a venv of its own (``python -m venv V && V/bin/pip install libpecos``).
The real sets need ``apt-get`` (Debian bookworm's package lists and the ``dict-foldoc`` package, fetched into
the cache without installing anything).

Smoke test of the harness: ``python benchmarks/suite.py --shapes tiny --build --system napkinxc``.
"""

import datetime
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from sparsejax import data as xcdata

import harness
from harness import peers
from harness.finished_runs import curve_and_selection

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sparsejax-suite")
DEFAULT_OUT = os.path.join(harness.RESULTS_DIR, "suite")
SYSTEMS = ("pecos", "napkinxc", "sparsejax")
SEED = 0  # every shape's data and split
TRAIN_MAIN = "import sys; from sparsejax.cli.train import main; sys.argv[0] = 'sparsejax-train'; main()"

# The synthetic base: make_synthetic's defaults (30 non-zeros, Zipf 1 labels, noise 0.2, dropout 0.3), 10^4 labels,
# 10 training samples per label on average (the head labels hold most: Zipf), 100K features (as accuracy.py's
# synthetic set). Test: 10K samples of the same distribution.
BASE = dict(num_train=100_000, num_test=10_000, num_features=100_000, num_labels=10_000, labels_per_sample=1,
            features_per_sample=30, noise=0.2, dropout=0.3)

# name: (half, what varies from BASE, source, large). Halves chosen by axis before any run: each axis has a value
# in each half where it has two; the nearly linear structure, the heavy label tail and FOLDOC are held out.
SHAPES = {
    "base": ("tuned", {}, "synthetic", False),
    "labels_5": ("tuned", dict(labels_per_sample=5), "synthetic", False),
    "labels_heavy": ("held_out", dict(labels_per_sample="heavy"), "synthetic", False),
    "nnz_10": ("held_out", dict(features_per_sample=10), "synthetic", False),
    "nnz_100": ("tuned", dict(features_per_sample=100), "synthetic", False),
    "nnz_1000": ("held_out", dict(features_per_sample=1000), "synthetic", True),
    "spl_1": ("tuned", dict(num_train=15_000), "synthetic", False),  # 1.5 training samples per label
    "spl_100": ("held_out", dict(num_train=1_000_000), "synthetic", True),
    # N labels at 100K training samples (so 0.5 and 0.1 per label): n_200k is accuracy.py's synthetic set.
    "n_200k": ("tuned", dict(num_labels=200_000), "synthetic", False),
    "n_1m": ("held_out", dict(num_labels=1_000_000), "synthetic", True),
    # Nearly linear: little noise and dropout, so a label's own features all but decide it (one-vs-all's ground).
    "linear": ("held_out", dict(noise=0.02, dropout=0.05), "synthetic", False),
    "debian_depends": ("tuned", {}, "debian_depends", False),
    "foldoc_xrefs": ("held_out", {}, "foldoc_xrefs", False),
    # The harness's own smoke test (no half: never reported with the suite).
    "tiny": (None, dict(num_train=3_000, num_test=500, num_features=2_000, num_labels=500,
                        labels_per_sample="heavy"), "synthetic", False),
}
HEAVY_MAX_LABELS = 500  # labels_per_sample="heavy": Zipf(2) counts capped here (mean ~4, ~0.6% of samples >= 100)


def suite_shapes(half: str | None = None, large: bool = False) -> list[str]:
  """The suite's shapes (of one half), the large ones only with ``large``."""
  return [name for name, (h, _, _, is_large) in SHAPES.items()
          if h is not None and (half in (None, h)) and (large or not is_large)]


# ---------------------------------------------------------------------------------------------------- synthetic data


def heavy_tailed_counts(rng: np.random.Generator, n: int, cap: int = HEAVY_MAX_LABELS) -> np.ndarray:
  """``[n]`` labels per sample ~ Zipf(2) capped at ``cap``: most samples have 1 or 2, a few hundreds."""
  return np.minimum(rng.zipf(2.0, n), cap).astype(np.int64)


def _heavy_synthetic(num_samples: int, num_features: int, num_labels: int, *, features_per_sample: float,
                     noise: float, dropout: float, seed: int) -> xcdata.XCDataset:
  """make_synthetic's model with heavy-tailed label counts per sample (which it does not offer: its counts are
  fixed or 1 + Poisson): Zipf label popularity, a sparse log-normal prototype per label (sized for the mean
  count, as make_synthetic sizes it), each prototype feature kept w.p. 1 - dropout, Zipf noise features,
  TF-IDF-like values, L2-normalised rows. A sample's non-zeros grow with its labels, as a long document's do."""
  rng = np.random.default_rng(seed)
  counts = np.minimum(heavy_tailed_counts(rng, num_samples), num_labels)
  proto_size = max(1, round(features_per_sample * (1 - noise) / ((1 - dropout) * counts.mean())))
  proto_ids = rng.integers(0, num_features, (num_labels, proto_size))
  proto_w = rng.lognormal(0.0, 0.5, (num_labels, proto_size)).astype(np.float32)
  feature_rank = rng.permutation(num_features)
  idf = (1.0 + np.log1p(feature_rank)).astype(np.float32)
  by_rank = np.argsort(feature_rank)

  def zipf_draw(n_items, size):
    cdf = np.cumsum(np.arange(1, n_items + 1, dtype=np.float64) ** -1.0)
    return np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(size), side="right"), n_items - 1)

  # Distinct labels per sample: draw with replacement, then redraw duplicates until none is left (a few rounds).
  rows = np.repeat(np.arange(num_samples), counts)
  labels = zipf_draw(num_labels, len(rows))
  for _ in range(200):
    key = rows * num_labels + labels
    order = np.argsort(key, kind="stable")
    dup = np.zeros(len(key), bool)
    dup[order[1:]] = key[order[1:]] == key[order[:-1]]
    if not dup.any():
      break
    labels[dup] = zipf_draw(num_labels, int(dup.sum()))
  rows, labels = rows[~dup], labels[~dup]
  order = np.lexsort((labels, rows))
  rows, labels = rows[order], labels[order]
  slot_rows = np.repeat(rows, proto_size)
  slots = (labels[:, None] * proto_size + np.arange(proto_size)).reshape(-1)
  keep = rng.random(len(slots)) >= dropout
  noise_counts = rng.poisson(noise * features_per_sample, num_samples)
  all_rows = np.concatenate([slot_rows[keep], np.repeat(np.arange(num_samples), noise_counts)])
  ids = np.concatenate([proto_ids.reshape(-1)[slots[keep]], by_rank[zipf_draw(num_features, noise_counts.sum())]])
  weight = np.concatenate([proto_w.reshape(-1)[slots[keep]], np.ones(noise_counts.sum(), np.float32)])
  vals = (1 + rng.poisson(0.5, len(ids))).astype(np.float32) * idf[ids] * weight
  key = all_rows * num_features + ids
  order = np.argsort(key, kind="stable")
  key, vals = key[order], vals[order]
  first = np.ones(len(key), bool)
  first[1:] = key[1:] != key[:-1]
  starts = np.flatnonzero(first)
  vals, key = np.add.reduceat(vals, starts), key[starts]
  feature_rows = key // num_features
  norms = np.sqrt(np.bincount(feature_rows, weights=vals.astype(np.float64) ** 2, minlength=num_samples))
  vals = vals / np.maximum(norms, 1e-12).astype(np.float32)[feature_rows]

  def ptr(counts):
    return np.concatenate([[0], np.cumsum(counts)])

  return xcdata.XCDataset(ptr(np.bincount(feature_rows, minlength=num_samples)), key % num_features, vals,
                          ptr(np.bincount(rows, minlength=num_samples)), labels, num_features, num_labels)


def build_synthetic(params: dict, seed: int = SEED):
  """``(train, test, info)`` of a synthetic shape: BASE with ``params`` (the first num_train samples train)."""
  p = {**BASE, **params}
  n = p["num_train"] + p["num_test"]
  if p["labels_per_sample"] == "heavy":
    full = _heavy_synthetic(n, p["num_features"], p["num_labels"], features_per_sample=p["features_per_sample"],
                            noise=p["noise"], dropout=p["dropout"], seed=seed)
  else:
    full = xcdata.make_synthetic(n, p["num_features"], p["num_labels"], labels_per_sample=p["labels_per_sample"],
                                 features_per_sample=p["features_per_sample"], noise=p["noise"],
                                 dropout=p["dropout"], seed=seed)
  train, test = full.subset(np.arange(p["num_train"])), full.subset(np.arange(p["num_train"], n))
  generator = "heavy-tailed make_synthetic model (suite.py)" if p["labels_per_sample"] == "heavy" else \
      "sparsejax.data.make_synthetic"
  return train, test, {"source": f"{generator}, seed {seed}", "parameters": p}


# -------------------------------------------------------------------------------------------------------- real data


def _apt_lists(cache: str) -> str:
  """Debian bookworm's package lists with English descriptions, fetched into ``cache/apt`` by ``apt-get update``
  (the system's own lists are left alone; they carry no long descriptions)."""
  lists = os.path.join(cache, "apt", "lists")
  if not glob.glob(os.path.join(lists, "*_main_i18n_Translation-en*")):
    os.makedirs(os.path.join(lists, "partial"), exist_ok=True)
    subprocess.run(["apt-get", "update", "-o", f"Dir::State::Lists={lists}", "-o", "Acquire::Languages=en"],
                   check=True, stdout=subprocess.DEVNULL)
  return lists


def _read_lz4(path: str) -> str:
  return subprocess.run(["lz4cat", path], check=True, capture_output=True).stdout.decode("utf-8", "replace")


def deb822(text: str):
  """The stanzas of a Debian control file: ``{field: value}`` (continuation lines joined with newlines)."""
  for block in text.split("\n\n"):
    fields, key = {}, None
    for line in block.split("\n"):
      if line.startswith((" ", "\t")) and key:
        fields[key] += "\n" + line[1:]
      elif ":" in line:
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    if fields:
      yield fields


def package_names(relation: str) -> list[str]:
  """The package names of a Depends-like field (alternatives, versions, architectures and profiles dropped)."""
  names = (re.split(r"[\s(:\[<]", part.strip(), maxsplit=1)[0] for part in re.split(r"[,|]", relation))
  return sorted({name for name in names if name})


def _split_and_vectorize(texts, label_names, groups, seed: int, test_fraction: float = 0.2, min_count: int = 2,
                         max_features: int = 100_000):
  """TF-IDF train/test sets (sparsejax.data.text's vectorizer, fitted on the training texts): labels kept where
  they name ``min_count`` samples or more, samples without a kept label dropped, the test split drawn by
  ``groups`` (a group's samples all in train or all in test: near-duplicates never straddle the split)."""
  from sparsejax.data.text import tfidf_datasets

  counts = {}
  for names in label_names:
    for name in names:
      counts[name] = counts.get(name, 0) + 1
  vocab = sorted(name for name, c in counts.items() if c >= min_count)
  index = {name: i for i, name in enumerate(vocab)}
  kept = [i for i, names in enumerate(label_names) if any(name in index for name in names)]
  texts = [texts[i] for i in kept]
  labels = [sorted(index[name] for name in label_names[i] if name in index) for i in kept]
  group_names, group_ids = np.unique(np.asarray([groups[i] for i in kept]), return_inverse=True)
  is_test = np.random.default_rng(seed).random(len(group_names))[group_ids] < test_fraction
  train, test, _ = tfidf_datasets(texts, labels, is_test, len(vocab), max_features=max_features, min_df=2)
  return train, test


def build_debian_depends(cache: str, seed: int = SEED):
  """Debian bookworm (main, amd64): a package's name, section and description -> the packages it Depends on,
  Pre-Depends on or Recommends (alternatives included). Labels per sample are heavy-tailed: most packages name
  a few, metapackages hundreds. Split by source package."""
  lists = _apt_lists(cache)
  prefix = os.path.join(lists, "deb.debian.org_debian_dists_bookworm_main_")
  descriptions = {}
  for fields in deb822(_read_lz4(prefix + "i18n_Translation-en.lz4")):
    if "Description-md5" in fields and "Description-en" in fields:
      descriptions[fields["Description-md5"]] = fields["Description-en"]
  texts, label_names, groups = [], [], []
  for fields in deb822(_read_lz4(prefix + "binary-amd64_Packages.lz4")):
    if "Package" not in fields:
      continue
    names = set()
    for field in ("Depends", "Pre-Depends", "Recommends"):
      names.update(package_names(fields.get(field, "")))
    names.discard(fields["Package"])
    description = descriptions.get(fields.get("Description-md5"), fields.get("Description", ""))
    texts.append(" ".join([re.sub(r"[-.+]", " ", fields["Package"]), fields.get("Section", ""), description]))
    label_names.append(names)
    groups.append(fields.get("Source", fields["Package"]).split()[0])
  train, test = _split_and_vectorize(texts, label_names, groups, seed)
  with open(os.path.join(lists, "deb.debian.org_debian_dists_bookworm_InRelease"), errors="replace") as f:
    date = next((line.split(":", 1)[1].strip() for line in f if line.startswith("Date:")), None)
  return train, test, {"source": f"Debian bookworm main amd64 Packages + Translation-en (Release of {date}): name, "
                                 "section, description -> Depends, Pre-Depends, Recommends; split by source package"}


def _dictd_entries(prefix: str):
  """``(headword, text)`` of a dictd database (``PREFIX.index`` offsets into ``PREFIX.dict.dz``)."""
  alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

  def b64(text):
    value = 0
    for ch in text:
      value = value * 64 + alphabet.index(ch)
    return value

  raw = gzip.open(prefix + ".dict.dz").read()
  with open(prefix + ".index", encoding="utf-8", errors="replace") as f:
    for line in f:
      parts = line.rstrip("\n").split("\t")
      if len(parts) >= 3 and not parts[0].startswith("00-database"):
        start, size = b64(parts[1]), b64(parts[2])
        yield parts[0], raw[start:start + size].decode("utf-8", "replace")


def build_foldoc_xrefs(cache: str, seed: int = SEED):
  """FOLDOC (Debian's dict-foldoc): a computing term's definition, its {cross-references} cut out -> the terms it
  cross-references. Most entries name a few, survey entries hundreds. Split at random (20% test)."""
  root = os.path.join(cache, "dict-foldoc")
  prefix = os.path.join(root, "usr", "share", "dictd", "foldoc")
  if not os.path.exists(prefix + ".index"):
    os.makedirs(root, exist_ok=True)
    subprocess.run(["apt-get", "download", "dict-foldoc"], cwd=root, check=True, stdout=subprocess.DEVNULL)
    deb = sorted(glob.glob(os.path.join(root, "dict-foldoc_*.deb")))[-1]
    subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
  version = os.path.basename(sorted(glob.glob(os.path.join(root, "dict-foldoc_*.deb")))[-1])
  texts, label_names, groups = [], [], []
  for i, (head, body) in enumerate(_dictd_entries(prefix)):
    refs = {re.sub(r"\s+", " ", ref).strip().lower() for ref in re.findall(r"\{([^{}]+)\}", body)}
    refs.discard(head.lower())
    texts.append(head + " " + re.sub(r"\{[^{}]*\}", " ", body))  # the answers cut out of the question
    label_names.append(refs)
    groups.append(str(i))
  train, test = _split_and_vectorize(texts, label_names, groups, seed)
  return train, test, {"source": f"FOLDOC ({version}): a term's definition with its {{references}} removed -> "
                                 "the terms it references; random split"}


# ----------------------------------------------------------------------------------------------------- files, stats


def shape_dir(cache: str, name: str) -> str:
  return os.path.join(cache, name)


def build_shape(name: str, cache: str) -> tuple[str, str, dict]:
  """``(train_path, test_path, info)``: the shape's files, written once (``info`` saved beside them)."""
  folder = shape_dir(cache, name)
  paths = [os.path.join(folder, f) for f in ("train.txt", "test.txt", "info.json")]
  if all(os.path.exists(p) for p in paths):
    with open(paths[2]) as f:
      return paths[0], paths[1], json.load(f)
  _, params, source, _ = SHAPES[name]
  t = time.time()
  if source == "synthetic":
    train, test, info = build_synthetic(params)
  elif source == "debian_depends":
    train, test, info = build_debian_depends(cache)
  else:
    train, test, info = build_foldoc_xrefs(cache)
  os.makedirs(folder, exist_ok=True)
  for ds, path in ((train, paths[0]), (test, paths[1])):
    write_xc_file(ds, path)
  info = {"shape": name, "half": SHAPES[name][0], **info, **shape_properties(train, test),
          "build_seconds": time.time() - t}
  harness.write_json(paths[2], info, record_machine=False)
  return paths[0], paths[1], info


def write_xc_file(ds, path: str, rows_per_chunk: int = 50_000) -> None:
  """``save_xc_file`` a chunk of rows at a time (it formats a whole set's ids and values as strings at once: some
  10 GB for the 10^8 non-zeros of nnz_1000), then moved into place."""
  with open(path + ".tmp", "w", encoding="ascii", newline="\n") as out:
    out.write(f"{len(ds)} {ds.num_features} {ds.num_labels}\n")
    for start in range(0, len(ds), rows_per_chunk):
      xcdata.save_xc_file(ds.subset(np.arange(start, min(start + rows_per_chunk, len(ds)))), path + ".chunk")
      with open(path + ".chunk") as chunk:
        chunk.readline()  # the chunk's own header
        out.write(chunk.read())
  if os.path.exists(path + ".chunk"):
    os.remove(path + ".chunk")
  os.replace(path + ".tmp", path)


def shape_properties(train, test) -> dict:
  """What the report's shape table states: sizes, labels per sample, non-zeros per sample, samples per label."""
  labels = np.concatenate([np.diff(train.label_indptr), np.diff(test.label_indptr)])
  nnz = np.concatenate([np.diff(train.indptr), np.diff(test.indptr)])
  per_label = np.bincount(train.label_indices, minlength=train.num_labels)
  return {"train_samples": len(train), "test_samples": len(test), "features": train.num_features,
          "labels": train.num_labels,
          "labels_per_sample": {"mean": float(labels.mean()), "median": float(np.median(labels)),
                                "max": int(labels.max()), "share_at_least_100": float(np.mean(labels >= 100))},
          "nnz_per_sample": {"mean": float(nnz.mean()), "median": float(np.median(nnz)), "max": int(nnz.max())},
          "train_samples_per_label": {"mean": float(per_label.mean()), "median": float(np.median(per_label)),
                                      "labels_without_any": float(np.mean(per_label == 0))}}


# ------------------------------------------------------------------------------------------------------------- runs


def run_sparsejax(train_path: str, test_path: str, run_dir: str, args) -> dict:
  """``sparsejax-train --dataset=files ... --max_seconds=300`` and nothing else (its defaults), as a subprocess of
  this Python (its entry point, :data:`TRAIN_MAIN`); the curve and final test record from its metrics.jsonl."""
  import shutil

  from sparsejax.train.metric_writer import read_records

  if os.path.exists(run_dir) and not args.collect:  # a new run: the suite never resumes one
    shutil.rmtree(run_dir)
  flags = ["--dataset=files", f"--train_file={train_path}", f"--test_file={test_path}",
           f"--max_seconds={args.budget:g}", f"--workdir={run_dir}"]
  # sparsejax-train's entry point in this Python, named as the command (its log and errors say sparsejax-train).
  command = [sys.executable, "-c", TRAIN_MAIN, *flags]
  t, wall = time.time(), None
  if not args.collect:
    subprocess.run(["nice", "-n", str(args.nice), *command] if args.nice else command, check=True)
    wall = time.time() - t
  finals = [r for r in read_records(run_dir) if r.get("final")] if os.path.exists(run_dir) else []
  if not finals:
    raise SystemExit(f"sparsejax-train wrote no final record in {run_dir}")
  shown = [re.sub(r"=(/.*)", lambda m: "=" + harness.portable_path(m.group(1)), flag) for flag in flags]
  return {"command": ["sparsejax-train", *shown], "final": finals[-1], "wall_seconds": wall,
          **curve_and_selection(run_dir, finals[-1])}


def run_one(name: str, system: str, args) -> str:
  train_path, test_path, info = build_shape(name, args.cache)
  run_dir = os.path.join(shape_dir(args.cache, name), system)
  if system == "pecos":
    result = peers.run_pecos(train_path, test_path, run_dir, seed=SEED, pecos_python=args.pecos_python,
                             nice=args.nice)
  elif system == "napkinxc":
    result = peers.run_napkinxc(train_path, test_path, run_dir, seed=SEED)
  else:
    result = run_sparsejax(train_path, test_path, run_dir, args)
  final = result["final"]
  # sparsejax: training seconds on its curve's clock, the recipe search's other candidates included (the final
  # record's train_seconds leaves out the search); evaluations excluded, as the peers' figures leave out prediction.
  seconds = final["seconds"] + result["search_losers_seconds"] if system == "sparsejax" else final["train_seconds"]
  report = {"shape": name, "half": SHAPES[name][0], "system": system,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_average_at_end": os.getloadavg(), "test": {k: final[k] for k in ("p@1", "p@3", "p@5")},
            "train_seconds": seconds, "wall_seconds": result["wall_seconds"], **result}
  path = os.path.join(args.out, f"{name}-{system}.json")
  harness.write_json(path, report)
  print(f"{name} {system}: test P@1 {final['p@1']:.4f}  P@3 {final['p@3']:.4f}  P@5 {final['p@5']:.4f}  "
        f"({seconds:.1f} s training, {result['wall_seconds'] or 0:.1f} s wall); wrote {path}", flush=True)
  return path


def seconds_to_reach(run: dict, target: float) -> dict:
  """When a sparsejax run first reached ``target`` P@1: the first validation point at or above it (training
  seconds), else its final test P@1 if that reaches it (the run's training seconds), else None."""
  for point in run.get("curve", []):
    if point.get("p@1") is not None and point["p@1"] >= target:
      return {"seconds": point["seconds"], "by": f"{point['split']} curve, step {point['step']}"}
  if run["test"]["p@1"] >= target:
    return {"seconds": run["train_seconds"], "by": "final test evaluation"}
  return {"seconds": None, "by": "never reached"}


def report(args, names: list[str]) -> dict:
  """OUT/summary.json and OUT/summary.md: per shape its properties, each system's test P@1/P@3/P@5 and seconds,
  and the training seconds sparsejax took to reach PECOS's test P@1 against PECOS's."""
  shapes_path = os.path.join(args.out, "shapes.json")
  table = {}
  if os.path.exists(shapes_path):
    with open(shapes_path) as f:
      table = json.load(f)
  rows = {}
  for name in names:
    runs = {}
    for system in SYSTEMS:
      path = os.path.join(args.out, f"{name}-{system}.json")
      if os.path.exists(path):
        with open(path) as f:
          runs[system] = json.load(f)
    if name not in table and not runs:
      continue
    row = {"half": SHAPES[name][0], "large": SHAPES[name][3], "properties": table.get(name),
           **{system: {"test": run["test"], "train_seconds": run["train_seconds"],
                       "wall_seconds": run["wall_seconds"], "load_average_at_end": run["load_average_at_end"]}
              for system, run in runs.items()}}
    if "pecos" in runs and "sparsejax" in runs:
      row["sparsejax_to_pecos_p@1"] = {**seconds_to_reach(runs["sparsejax"], runs["pecos"]["test"]["p@1"]),
                                       "pecos_train_seconds": runs["pecos"]["train_seconds"]}
    rows[name] = row
  summary = {"shapes": rows, "note": "seconds measured on the machine each run's JSON names (load average there)"}
  harness.write_json(os.path.join(args.out, "summary.json"), summary, record_machine=False)
  lines = ["# The shapes", "", "| shape | half | train + test samples | features | labels | labels per sample "
           "(mean / median / max) | nnz per sample (mean) | training samples per label (mean / median) | source |",
           "|---|---|---|---|---|---|---|---|---|"]
  for name, row in rows.items():
    p = row["properties"]
    if p:
      lps, spl = p["labels_per_sample"], p["train_samples_per_label"]
      lines.append(f"| {name}{' (large)' if row['large'] else ''} | {row['half']} | {p['train_samples']:,} + "
                   f"{p['test_samples']:,} | {p['features']:,} | {p['labels']:,} | {lps['mean']:.2f} / "
                   f"{lps['median']:g} / {lps['max']} | {p['nnz_per_sample']['mean']:.1f} | {spl['mean']:.1f} / "
                   f"{spl['median']:g} | {p['source']} |")
  lines += ["", "# Test P@1 and training seconds (wall seconds in the JSON)", "",
            "| shape | half | " + " | ".join(f"{s} P@1 | {s} s" for s in SYSTEMS) + " | sparsejax s to PECOS P@1 |",
            "|---|---|" + "---|---|" * len(SYSTEMS) + "---|"]
  for name, row in rows.items():
    cells = " | ".join(f"{row[s]['test']['p@1']:.4f} | {row[s]['train_seconds']:.0f}" if s in row else "- | -"
                       for s in SYSTEMS)
    reach = row.get("sparsejax_to_pecos_p@1")
    if reach is not None:
      got = "never" if reach["seconds"] is None else f"{reach['seconds']:.0f}"
      reach = f"{got} (PECOS {reach['pecos_train_seconds']:.0f}; {reach['by']})"
    lines.append(f"| {name} | {row['half']} | {cells} | {reach or '-'} |")
  # P@3 and P@5 beside: on multi-label shapes they part from P@1 (labels_5: P@1 saturated, P@5 far apart).
  lines += ["", "# Test P@3 / P@5", "", "| shape | half | " + " | ".join(f"{s} P@3 / P@5" for s in SYSTEMS) + " |",
            "|---|---|" + "---|" * len(SYSTEMS)]
  for name, row in rows.items():
    cells = " | ".join(f"{row[s]['test']['p@3']:.4f} / {row[s]['test']['p@5']:.4f}" if s in row else "-"
                       for s in SYSTEMS)
    lines.append(f"| {name} | {row['half']} | {cells} |")
  with open(os.path.join(args.out, "summary.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return summary


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--shapes", nargs="*", default=None, choices=sorted(SHAPES),
                      help="the shapes to build or run (default: the suite's, --half's, large ones with --large)")
  parser.add_argument("--half", choices=("tuned", "held_out"), default=None, help="one half of the suite")
  parser.add_argument("--large", action="store_true", help="include the large shapes (n_1m, spl_100, nnz_1000)")
  parser.add_argument("--build", action="store_true", help="write the shapes' files and OUT/shapes.json")
  parser.add_argument("--system", choices=SYSTEMS, action="append", help="train this system on each shape")
  parser.add_argument("--report", action="store_true", help="OUT/summary.json and a table of the runs in OUT")
  parser.add_argument("--collect", action="store_true",
                      help="--system sparsejax: write the JSON of the finished run in the cache, not training again")
  parser.add_argument("--budget", type=float, default=300, help="sparsejax's --max_seconds (the issue's 300)")
  parser.add_argument("--cache", default=DEFAULT_CACHE, help="the shapes' files and run directories")
  parser.add_argument("--out", default=DEFAULT_OUT, help="the results' JSON")
  parser.add_argument("--nice", type=int, default=0, help="run PECOS and sparsejax under nice -n NICE (shared)")
  parser.add_argument("--pecos_python", default=os.environ.get("PECOS_PYTHON", sys.executable),
                      help="the Python of an environment with libpecos (default $PECOS_PYTHON, else this one)")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  names = args.shapes or suite_shapes(args.half, args.large)
  if not (args.build or args.system or args.report):
    parser.error("give --build, --system SYSTEM or --report")
  if args.build:
    shapes_path = os.path.join(args.out, "shapes.json")
    table = {}
    if os.path.exists(shapes_path):
      with open(shapes_path) as f:
        table = json.load(f)
    for name in names:
      table[name] = build_shape(name, args.cache)[2]
      p = table[name]
      print(f"{name}: {p['train_samples']} + {p['test_samples']} samples, {p['features']} features, "
            f"{p['labels']} labels; labels per sample mean {p['labels_per_sample']['mean']:.2f} max "
            f"{p['labels_per_sample']['max']}; nnz mean {p['nnz_per_sample']['mean']:.1f}", flush=True)
    if "tiny" not in names or len(names) > 1:
      harness.write_json(shapes_path, {k: v for k, v in table.items() if SHAPES[k][0]}, record_machine=False)
  for system in args.system or ():
    for name in names:
      run_one(name, system, args)
  if args.report:
    report(args, args.shapes or suite_shapes(args.half, large=True))


if __name__ == "__main__":
  main()
