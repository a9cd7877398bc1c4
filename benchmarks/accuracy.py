"""Issue 9's accuracy benchmark: sparsejax, all-active, dense full softmax and napkinXC, side by side.

Every system trains on the same files (written once per dataset, Extreme
Classification Repository format) and the same cores, and is evaluated
exactly on the same test set:

* ``sparsejax``: the default configuration (sampled output layer, clustered
  index, validation split and best-checkpoint selection).
* ``all_active``: the same network with every output neuron active
  (``active_k >= N``: the exact softmax through the sparse kernels).
* ``dense``: the same network trained densely (``--model=dense``: jnp +
  optax, full softmax).
* ``dense_gpu``: ``dense`` on the machine's GPU (``--platform=cuda``; needs
  ``jax[cuda12]`` and a GPU): the baseline users reach for, same budget.
* ``pecos``: PECOS XR-Linear (PIFA label embeddings, hierarchical k-means,
  its default solver), run by ``pecos_xrlinear.py`` in an environment of its
  own (``libpecos`` needs numpy < 2: ``--pecos_python``), on the samples
  napkinXC trains on.
* ``napkinxc``: napkinXC's probabilistic label tree (``PLT``, liblinear
  nodes; benchmark-only: ``pip install napkinxc``), trained on the same
  training samples (the validation split left out, as for the others), one
  point per run.

One invocation trains one system on one dataset, either for a wall-clock
budget (``--budget``, periodic evaluations excluded) or for a number of
epochs (``--num_epochs``: the fixed-epoch comparison of sparsejax with
all-active), and writes ``OUT/DATASET-SYSTEM-TAG.json`` (TAG: ``300s`` or
``1ep``): the validation P@1/P@5 against training seconds, the final test
metrics of the selected checkpoint (exact and sampled P@k at the training k
and at 2% of N, label_recall and the other retrieval diagnostics, selected
and last step, samples/s) and, for sparsejax, the speed of sampled against
exact inference on the selected state. Fixed-epoch sparsejax runs also sweep
the selected state's sampled inference over k (the training k, 2% of N,
``--sweep_k``) on the test queries whose labels were trained on and on the
others, with the label_recall an ideal index (the exact top-k) would reach;
``--evaluate_again`` re-measures that for a finished run. ``--report`` then
reads a dataset's files, checks them against issue 9's acceptance targets
(``OUT/DATASET-summary.json``) and plots P@1 against seconds
(``OUT/DATASET.png``, if matplotlib is installed).

The same-budget comparison (a quiet 2-core machine, nothing else running;
each invocation takes at most about 9 minutes):

  for d in synthetic gcide gcide_cloze; do
    for s in sparsejax all_active dense napkinxc; do
      python benchmarks/accuracy.py --dataset $d --system $s --budget 300
    done
    python benchmarks/accuracy.py --dataset $d --report
  done

Against a GPU: on a machine with one, ``--system dense_gpu`` trains the dense
model there for the same budget, and ``--report`` sets it beside sparsejax's
CPU run (copy that run's JSON over, or run it on the machine's CPU cores).

The fixed-epoch comparison (accuracy only: fine on a busy machine, but slow):

  python benchmarks/accuracy.py --dataset synthetic --system sparsejax --num_epochs 0.25 --evals_per_epoch 4
  python benchmarks/accuracy.py --dataset synthetic --system all_active --num_epochs 0.25

A run with other settings (``--set``) is named with ``--variant``: it gets its own files (``4ep+k512``) and
``--report`` lists it apart from the acceptance figures:

  python benchmarks/accuracy.py --dataset gcide_cloze --system sparsejax --num_epochs 4 --set active_k=512 \
    --variant k512

Smoke test of the benchmark itself: ``--dataset tiny --budget 8``.
"""

import datetime
import glob
import json
import os
import re
import statistics
import sys
import time

import numpy as np

from sparsejax import data as xcdata

import harness
from harness import peers
from harness.finished_runs import DATASETS, DEFAULT_WORKDIR, curve_and_selection, parse_settings, restored_state

SYSTEMS = ("sparsejax", "all_active", "dense", "dense_gpu", "napkinxc", "pecos")
PEER_SYSTEMS = ("napkinxc", "pecos")
SLIDE_SYSTEMS = ("sparsejax", "all_active")
DEFAULT_OUT = os.path.join(harness.RESULTS_DIR, "accuracy")


# The synthetic sets (make_synthetic, one Zipf label per sample): training samples, test samples, features, labels.
SYNTHETIC_SETS = {
    "synthetic": (100_000, 10_000, 100_000, 200_000),  # the acceptance set of issue 9
    # Scale (issue 34): 10^6 labels, 1 and 2 training samples per label on average (the head labels hold most).
    "synthetic_1m": (1_000_000, 10_000, 200_000, 1_000_000),
    "synthetic_1m_2m": (2_000_000, 10_000, 200_000, 1_000_000),
    # 10^9 parameters: 8·10^6 labels x (128 + 1) plus 200K x 128 inputs; most labels have no sample.
    "synthetic_8m": (1_000_000, 5_000, 200_000, 8_000_000),
    "tiny": (3_000, 300, 2_000, 2_000),  # smoke tests of the benchmark itself
}


def write_files(dataset: str, workdir: str, seed: int) -> tuple[str, str]:
  """The benchmark's train and test files (written once per workdir)."""
  train_path, test_path = os.path.join(workdir, "train.txt"), os.path.join(workdir, "test.txt")
  if os.path.exists(train_path) and os.path.exists(test_path):
    return train_path, test_path
  if dataset in SYNTHETIC_SETS:
    num_train, num_test, num_features, num_labels = SYNTHETIC_SETS[dataset]
    full = xcdata.make_synthetic(num_train + num_test, num_features, num_labels, seed=seed)
    train, test = full.subset(np.arange(num_train)), full.subset(np.arange(num_train, num_train + num_test))
  elif dataset == "gcide":
    train, test, _ = xcdata.load_gcide(seed=seed)
  elif dataset == "gcide_cloze":
    train, test, _ = xcdata.load_gcide_cloze(seed=seed)
  elif dataset == "icd10":
    train, test, _ = xcdata.load_icd10(seed=seed)
  elif dataset == "wordnet":
    train, test, _ = xcdata.load_wordnet(seed=seed)
  else:
    raise ValueError(f"unknown dataset {dataset!r}")
  os.makedirs(workdir, exist_ok=True)
  xcdata.save_xc_file(train, train_path + ".tmp")
  xcdata.save_xc_file(test, test_path + ".tmp")
  os.replace(train_path + ".tmp", train_path)
  os.replace(test_path + ".tmp", test_path)
  return train_path, test_path


def sampled_k_for(num_labels: int) -> int:
  """The second active set size of sampled inference: 2% of N (issue 9's "k <= 2% of N")."""
  return max(1, int(0.02 * num_labels))



def run_sparsejax(system: str, train_path: str, test_path: str, run_dir: str, args) -> dict:
  """One sparsejax run (default, all-active or dense); returns its curve and final test metrics."""
  from sparsejax.config import Config
  from sparsejax.settings import override
  from sparsejax.train import train_and_evaluate

  num_labels = xcdata.load_xc_file(test_path).num_labels
  settings = dict(dataset="files", train_file=train_path, test_file=test_path, max_seconds=args.budget,
                  num_epochs=args.num_epochs, eval_samples=args.eval_samples, checkpoint_every=10**9, progress=False,
                  seed=args.seed, eval_sampled_k=args.sampled_k or sampled_k_for(num_labels),
                  **parse_settings(args.set))
  # The run's settings in one place: the one-process run overrides Config with them, --processes passes them as
  # sparsejax-train's flags.
  if system == "all_active":
    settings["active_k"] = 2**31 - 1
  elif system in ("dense", "dense_gpu"):
    settings["model"] = "dense"
  config = override(Config(), **settings)
  steps_per_epoch = int(len(xcdata.load_xc_file(train_path)) * (1 - config.data.validation_fraction)) \
      // config.optim.batch_size
  # sparsejax evaluates as `sparsejax-train` does (--eval_every's default), unless told otherwise: its budget runs
  # are the acceptance command's. The slower baselines get 4 points per epoch for their curves.
  evals_per_epoch = args.evals_per_epoch or (None if system == "sparsejax" else 4)
  if evals_per_epoch is not None:
    settings["eval_every"] = max(1, steps_per_epoch // evals_per_epoch)
    config = override(Config(), **settings)
  peak_rss = None
  if args.collect:  # the run in run_dir finished (its final record written): collect its results only
    from sparsejax.train.metric_writer import read_records

    final, wall = [r for r in read_records(run_dir) if r.get("final")][-1], None
  elif args.processes > 1:
    final, wall, peak_rss = launch_sparsejax(settings, run_dir, args.processes)
  else:
    if os.path.exists(run_dir):  # a new run: the benchmark never resumes an earlier one
      import shutil

      shutil.rmtree(run_dir)
    t = time.time()
    final = train_and_evaluate(config, run_dir)
    wall = time.time() - t
  # The settings the run trained with: a recipe search (--recipe=auto) chose some of them.
  with open(os.path.join(run_dir, "config.json")) as f:
    config = Config.from_dict(json.load(f))
  result = {"config": config.to_dict(), "final": final, "wall_seconds": wall, **curve_and_selection(run_dir, final)}
  if peak_rss is not None:
    result["processes"] = {"count": args.processes, "peak_rss_bytes": peak_rss}
  if system == "sparsejax" and args.processes == 1:  # the served state of one process (P > 1: its shards)
    run, state = selected_state(config, run_dir, test_path)
    result["inference"] = time_inference(config, run, state, test_path, args)
    if args.num_epochs is not None:  # the budget runs leave it out (each invocation stays under ~9 minutes)
      result["sweep"] = sweep_inference_k(config, state, train_path, test_path, args)
  return result


def launch_sparsejax(settings: dict, run_dir: str, processes: int) -> tuple[dict, float, list[int]]:
  """Trains with ``settings`` as ``sparsejax-launch -n processes sparsejax-train`` (the output layer sharded over the
  processes); returns the final record, the wall seconds and each rank's peak resident memory (VmHWM, bytes),
  read from /proc while it runs."""
  import shutil
  import subprocess

  from sparsejax.train.metric_writer import read_records

  if os.path.exists(run_dir):  # a new run, as in one process
    shutil.rmtree(run_dir)
  flags = [f"--{name}={_flag_value(value)}" for name, value in settings.items() if value is not None]
  command = [sys.executable, "-m", "sparsejax.distributed.launch", "-n", str(processes), _train_command(), *flags,
             f"--workdir={run_dir}"]
  peak: dict[int, int] = {}
  t = time.time()
  with subprocess.Popen(command) as launcher:
    while launcher.poll() is None:
      for pid, rss in _children_peak_rss(launcher.pid).items():
        peak[pid] = max(peak.get(pid, 0), rss)
      time.sleep(2)
  wall = time.time() - t
  if launcher.returncode:
    raise SystemExit(f"sparsejax-launch -n {processes} failed (status {launcher.returncode}); logs in {run_dir}/logs")
  return [r for r in read_records(run_dir) if r.get("final")][-1], wall, sorted(peak.values(), reverse=True)


def _train_command() -> str:
  """``sparsejax-train`` beside this Python (its environment need not be on PATH)."""
  beside = os.path.join(os.path.dirname(sys.executable), "sparsejax-train")
  return beside if os.path.exists(beside) else "sparsejax-train"


def _flag_value(value) -> str:
  return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _children_peak_rss(pid: int) -> dict[int, int]:
  """``{pid: VmHWM bytes}`` of ``pid``'s child processes (the launcher's ranks)."""
  out = {}
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      children = [int(c) for c in f.read().split()]
  except OSError:
    return out
  for child in children:
    try:
      with open(f"/proc/{child}/status") as f:
        for line in f:
          if line.startswith("VmHWM:"):
            out[child] = int(line.split()[1]) * 1024
    except OSError:
      pass
  return out


def most_frequent_label_p1(train, test) -> float:
  """P@1 of answering every sample of ``test`` with ``train``'s most frequent label: the floor a model must beat."""
  top = int(np.bincount(train.label_indices, minlength=train.num_labels).argmax())
  has = np.zeros(len(test), bool)
  rows = np.repeat(np.arange(len(test)), np.diff(test.label_indptr))
  has[rows[test.label_indices == top]] = True
  return float(has.mean())


def selected_state(config, run_dir: str, test_path: str):
  """``(run, state)``: the run's selected (else latest) state, its index refreshed as for serving."""
  run, state = restored_state(config, run_dir, xcdata.load_xc_file(test_path))
  return run, run.refresh_index(state)





def exact_label_ranks(state, dataset, max_features: int, batch: int = 1024, row_chunk: int = 32768) -> np.ndarray:
  """``[n, M]`` rank of each true label among all N logits of its query (0: first; -1 where padding).

  ``rank < k`` says whether an ideal index (one returning the exact top-k) would find the label: the
  ceiling of ``label_recall`` at k. Chunked over output rows (never ``[batch, N]``).
  """
  import jax
  import jax.numpy as jnp

  from sparsejax import model
  from sparsejax.data import PAD_ID

  w, b = state.out.w, state.out.b
  n_rows = w.shape[0]
  chunks = -(-n_rows // row_chunk)
  w_pad = jnp.pad(w, ((0, chunks * row_chunk - n_rows), (0, 0)))
  b_pad = jnp.pad(b, (0, chunks * row_chunk - n_rows), constant_values=-jnp.inf)

  @jax.jit
  def ranks(state, fi, fv, labels):
    h = model.hidden(state, fi, fv)
    safe = jnp.maximum(labels, 0)
    own = jnp.einsum("bd,bmd->bm", h, w[safe], precision="highest") + b[safe]  # [B, M]

    def body(c, count):
      wc = jax.lax.dynamic_slice_in_dim(w_pad, c * row_chunk, row_chunk)
      bc = jax.lax.dynamic_slice_in_dim(b_pad, c * row_chunk, row_chunk)
      logits = jnp.dot(h, wc.T, precision="highest") + bc  # [B, chunk]
      return count + jnp.sum(logits[:, None, :] > own[:, :, None], axis=2)

    count = jax.lax.fori_loop(0, chunks, body, jnp.zeros(labels.shape, jnp.int32))
    return jnp.where(labels >= 0, count, -1)

  max_labels = max(dataset.max_labels_per_sample(), 1)
  out = []
  for start in range(0, len(dataset), batch):
    rows = np.arange(start, min(start + batch, len(dataset)))
    fi, fv, lab = dataset.to_padded(rows, max_features, max_labels)
    pad = batch - len(rows)
    out.append(np.asarray(ranks(state, np.pad(fi, ((0, pad), (0, 0)), constant_values=PAD_ID),
                                np.pad(fv, ((0, pad), (0, 0))), np.pad(lab, ((0, pad), (0, 0)),
                                                                        constant_values=PAD_ID)))[:len(rows)])
  return np.concatenate(out) if out else np.zeros((0, max_labels), np.int32)


def sweep_inference_k(config, state, train_path: str, test_path: str, args) -> dict:
  """Sampled inference and retrieval of the selected state at several active set sizes k.

  Evaluated on the test queries whose labels all occur in the training split and on the others (a label never
  trained on cannot be retrieved by any index: its row is still the random initialisation), and on the whole
  test set (their weighted means: every query of the benchmark's datasets has a label).
  """
  from sparsejax.distributed import sharding
  from sparsejax.evaluation import Evaluator, padded_width
  from sparsejax.model_config import ModelConfig
  from sparsejax.settings import override

  train, test = xcdata.load_xc_file(train_path), xcdata.load_xc_file(test_path)
  if config.data.validation_fraction > 0:  # the labels the run trained on (the run's own validation split)
    from sparsejax.train import plan

    train, _ = plan.validation_split(config, train, plan.validation_seed(config))
  seen = np.zeros(test.num_labels, bool)
  seen[train.label_indices] = True
  counts = np.diff(test.label_indptr)
  unseen_per_query = np.add.reduceat(~seen[test.label_indices], test.label_indptr[:-1]) if len(counts) else counts
  seen_query = (counts > 0) & (np.where(counts > 0, unseen_per_query, 0) == 0)
  splits = {"test_seen_labels": np.flatnonzero(seen_query), "test_unseen_labels": np.flatnonzero(~seen_query)}
  ks = sorted({config.network.active_k, sampled_k_for(test.num_labels), *(args.sweep_k or ())})
  keys = ("p@1", "p@5", "sampled_p@1", "sampled_p@5", "label_recall", "topk_recall@10", "mean_candidates")
  out = {"seen_label_queries": float(np.mean(seen_query)) if len(test) else 0.0, "k": {}}
  label_ranks = exact_label_ranks(state, test, padded_width(test, config.data.max_features))
  labelled = label_ranks >= 0
  for k in ks:
    sized = ModelConfig.from_config(override(config, active_k=k), test.num_features, test.num_labels)
    run = sharding.make_run(sized, seed=config.run.seed)
    row = {}
    for name, rows in splits.items():  # disjoint: the whole test set's figures are their weighted means
      if len(rows):
        evaluator = Evaluator.for_run(test.subset(rows), train, config.data.max_features, config.run.propensity_a,
                                      config.run.propensity_b)
        r = evaluator(run.predict, state, None, diagnose=run.diagnose)
        row[name] = {key: r[key] for key in keys} | {"queries": len(rows)}
    row["test"] = {key: sum(v[key] * v["queries"] for v in row.values()) / len(test) for key in keys} | \
        {"queries": len(test)}  # every query has a label (label_recall's mean is over labelled ones)
    # label_recall of an ideal index (the exact top-k): the model's own ceiling at this k
    found = np.sum((label_ranks < k) & labelled, axis=1) / np.maximum(np.sum(labelled, axis=1), 1)
    for name, rows in (*splits.items(), ("test", np.arange(len(test)))):
      if name in row:
        row[name]["exact_topk_label_recall"] = float(found[rows].mean())
    for v in row.values():
      v["sampled_over_exact_p@1"] = _ratio(v["sampled_p@1"], v["p@1"])
    out["k"][str(k)] = row
    print(f"k={k}: " + "; ".join(f"{name}: sampled/exact P@1 {v['sampled_over_exact_p@1'] or 0:.3f} "
                                 f"label_recall {v['label_recall']:.3f} (exact top-k: "
                                 f"{v['exact_topk_label_recall']:.3f}) topk_recall@10 {v['topk_recall@10']:.3f}"
                                 for name, v in row.items()), flush=True)
  return out


def time_inference(config, run, state, test_path: str, args) -> dict:
  """Milliseconds per batch of exact and sampled inference on ``state`` (the selected one)."""
  import jax

  from sparsejax import inference
  from sparsejax.data import PAD_ID
  from sparsejax.evaluation import padded_width

  test = xcdata.load_xc_file(test_path)
  rows = np.arange(min(args.inference_batch, len(test)))
  fi, fv, _ = test.to_padded(rows, padded_width(test, config.data.max_features), 0)  # as predict pads them
  pad = args.inference_batch - len(rows)
  fi = np.pad(fi, ((0, pad), (0, 0)), constant_values=PAD_ID)
  fv = np.pad(fv, ((0, pad), (0, 0)))
  model_config = run.config
  functions = {"exact": jax.jit(lambda s, i, v: inference.predict_exact(s, i, v, top=5))}
  for k in (model_config.k, config.run.eval_sampled_k):
    functions[f"sampled_k{k}"] = jax.jit(lambda s, i, v, k=k: inference.predict_sampled(s, i, v, config=model_config,
                                                                                         top=5, k=k))
  ms = {}
  for name, fn in functions.items():
    jax.block_until_ready(fn(state, fi, fv))  # compile
    times = []
    for _ in range(args.inference_repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn(state, fi, fv))
      times.append(time.perf_counter() - t)
    ms[name] = 1e3 * statistics.median(times)
  return {"batch": args.inference_batch, "num_labels": test.num_labels, "ms_per_batch": ms,
          "speedup": {name: ms["exact"] / t for name, t in ms.items() if name != "exact"}}


def run_pecos(train_path: str, test_path: str, run_dir: str, args) -> dict:
  """PECOS XR-Linear in its own environment (``--pecos_python``), on the same samples as napkinXC."""
  result = peers.run_pecos(train_path, test_path, run_dir, seed=args.seed, budget=args.budget,
                           pecos_python=args.pecos_python)
  result["wall_seconds"] = result["final"]["train_seconds"]  # as this benchmark's committed peer runs record it
  return result


def run_napkinxc(train_path: str, test_path: str, run_dir: str, args) -> dict:
  """napkinXC PLT with its defaults (liblinear nodes), on the training samples minus the validation split."""
  result = peers.run_napkinxc(train_path, test_path, run_dir, seed=args.seed, budget=args.budget)
  result["wall_seconds"] = result["final"]["train_seconds"]
  return result


def tag_of(budget: float | None, num_epochs: float | None, variant: str | None = None) -> str:
  """``300s`` or ``4ep``, and ``+VARIANT`` for a run that is not the systems' defaults (see ``--variant``)."""
  tag = f"{budget:g}s" if budget is not None else f"{num_epochs:g}ep"
  return f"{tag}+{variant}" if variant else tag


def train_one(args) -> str:
  """Trains ``args.system`` on ``args.dataset``; returns the path of the JSON it wrote."""
  workdir = os.path.join(args.workdir, args.dataset)
  train_path, test_path = write_files(args.dataset, workdir, args.seed)
  tag = tag_of(args.budget, args.num_epochs, args.variant)
  run_dir = os.path.join(workdir, f"{args.system}-{tag}")
  if args.system == "napkinxc":
    result = run_napkinxc(train_path, test_path, run_dir, args)
  elif args.system == "pecos":
    result = run_pecos(train_path, test_path, run_dir, args)
  else:
    result = run_sparsejax(args.system, train_path, test_path, run_dir, args)
  final = result["final"]
  result["most_frequent_label_p@1"] = most_frequent_label_p1(xcdata.load_xc_file(train_path),
                                                             xcdata.load_xc_file(test_path))
  report = {
      "dataset": args.dataset, "system": args.system, "budget_seconds": args.budget, "num_epochs": args.num_epochs,
      "settings": args.set or [],
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "load_average_at_end": os.getloadavg(),
      "machine": harness.machine(device=_device_kind(args.system)),
      **result,
  }
  path = os.path.join(args.out, f"{args.dataset}-{args.system}-{tag}.json")
  harness.write_json(path, report)
  extra = "".join(f"  {key} {final[key]:.4f}" for key in sorted(final)
                  if key.startswith("sampled") and key.endswith("_p@1") or key == "label_recall")
  print(f"{args.dataset} {args.system} ({tag}): test P@1 {final['p@1']:.4f}  P@5 {final['p@5']:.4f}{extra}  "
        f"(selected step {final.get('selected_step', final.get('step'))} of {final.get('last_step', '-')}; "
        f"{final.get('train_seconds', 0):.0f} s training, {result['wall_seconds'] or 0:.0f} s in all)", flush=True)
  if "inference" in result:
    inf = result["inference"]
    timings = ", ".join(f"{name} {ms:.1f}" for name, ms in inf["ms_per_batch"].items())
    print(f"inference ms per batch of {inf['batch']}: {timings}")
  print(f"wrote {path}")
  return path


def _device_kind(system: str) -> str:
  """The device a run trained on (a GPU's model for dense_gpu, else the CPU)."""
  if system in PEER_SYSTEMS:
    return "cpu"
  import jax

  return jax.devices()[0].device_kind


def evaluate_again(args) -> str:
  """Re-measures inference (speed, the k sweep) of a finished sparsejax run and updates its JSON."""
  from sparsejax.config import Config

  workdir = os.path.join(args.workdir, args.dataset)
  train_path, test_path = write_files(args.dataset, workdir, args.seed)
  tag = tag_of(args.budget, args.num_epochs, args.variant)
  run_dir = os.path.join(workdir, f"sparsejax-{tag}")
  path = os.path.join(args.out, f"{args.dataset}-sparsejax-{tag}.json")
  with open(path) as f:
    report = json.load(f)
  with open(os.path.join(run_dir, "config.json")) as f:
    config = Config.from_dict(json.load(f))
  run, state = selected_state(config, run_dir, test_path)
  report.update(curve_and_selection(run_dir, report["final"]))
  report["inference"] = time_inference(config, run, state, test_path, args)
  report["sweep"] = sweep_inference_k(config, state, train_path, test_path, args)
  harness.write_json(path, report)
  print(f"updated {path}")
  return path


def _ratio(a, b):
  return None if a is None or b in (None, 0) else a / b


def summarize(runs: dict) -> dict:
  """Issue 9's acceptance figures from a dataset's runs (``{(system, tag): report}``); None where a run is missing."""
  def final(system, tag, key):
    run = runs.get((system, tag))
    return None if run is None else run["final"].get(key)

  budget_tags = sorted({tag for _, tag in runs if tag.endswith("s")})
  epoch_tags = sorted({tag for _, tag in runs if tag.endswith("ep")})
  out = {}
  for tag in epoch_tags:  # same epochs: sparsejax default against all-active
    sj, aa = final("sparsejax", tag, "p@1"), final("all_active", tag, "p@1")
    out[f"{tag}: p@1 sparsejax"], out[f"{tag}: p@1 all_active"] = sj, aa
    out[f"{tag}: p@1 gap points (target <= 1.0)"] = None if sj is None or aa is None else 100 * (aa - sj)
    out[f"{tag}: samples/s ratio (target >= 5)"] = _ratio(final("sparsejax", tag, "samples_per_sec"),
                                                          final("all_active", tag, "samples_per_sec"))
  for tag in epoch_tags + budget_tags:
    run = runs.get(("sparsejax", tag))
    if run is None:
      continue
    f = run["final"]
    for key in sorted(f):
      if key.startswith("sampled") and key.endswith("_p@1"):
        out[f"{tag}: {key} / exact (target >= 0.9)"] = _ratio(f[key], f["p@1"])
    out[f"{tag}: label_recall (target >= 0.8)"] = f.get("label_recall")
    out[f"{tag}: topk_recall@10"] = f.get("topk_recall@10")
    if "selection" in run:
      out[f"{tag}: selected step / last step"] = [run["selection"]["selected_step"], run["selection"]["last_step"]]
    if "sweep" in run:
      sweep = run["sweep"]
      out[f"{tag}: test queries whose labels were all trained on"] = sweep["seen_label_queries"]
      for k, row in sweep["k"].items():
        for split, v in ((s, v) for s, v in row.items() if s != "test_unseen_labels"):
          out[f"{tag}: k={k} {split}: sampled/exact P@1 (target >= 0.9), label_recall (target >= 0.8), "
              f"label_recall of the exact top-k, topk_recall@10"] = [
                  v["sampled_over_exact_p@1"], v["label_recall"], v.get("exact_topk_label_recall"), v["topk_recall@10"]]
    if "inference" in run:
      for name, speedup in run["inference"]["speedup"].items():
        out[f"{tag}: {name} inference speedup over exact (target >= 5 at N >= 2e5)"] = speedup
  for tag in budget_tags:  # the same wall-clock budget: sparsejax against dense and napkinXC
    sj, dense, napkin, pecos = (final(s, tag, "p@1") for s in ("sparsejax", "dense", "napkinxc", "pecos"))
    out[f"{tag}: p@1 sparsejax, dense, napkinxc, pecos"] = [sj, dense, napkin, pecos]
    out[f"{tag}: sparsejax beats every peer (napkinxc, pecos)"] = None if sj is None else all(
        sj >= peer for peer in (napkin, pecos) if peer is not None)
    out[f"{tag}: sparsejax beats dense"] = None if sj is None or dense is None else sj > dense
    if (gpu := final("dense_gpu", tag, "p@1")) is not None:
      out[f"{tag}: p@1 dense on {runs[('dense_gpu', tag)]['machine']['device']}, sparsejax minus it"] = [
          gpu, None if sj is None else sj - gpu]
    out[f"{tag}: napkinxc minus sparsejax, points (target <= 3)"] = None if sj is None or napkin is None else \
        100 * (napkin - sj)
  return out


def plot(runs: dict, path: str, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for (system, tag), run in sorted(runs.items()):
    points = [p for p in run["curve"] if p.get("seconds") is not None]
    validation = system not in PEER_SYSTEMS  # the trees' one point is their test P@1; a network's are its evaluations
    line = ax.plot([p["seconds"] for p in points], [p["p@1"] for p in points], "o" if len(points) == 1 else "-o",
                   markersize=3, label=f"{system} ({tag})" + (", validation" if validation else ", test"))
    f = run["final"]
    if validation:  # the selected state's test P@1, at the training seconds it was reached
      reached = [p["seconds"] for p in points if p.get("step") == f.get("selected_step")]
      ax.plot([reached[0] if reached else f["seconds"]], [f["p@1"]], "*", markersize=10, color=line[0].get_color())
  ax.set_xlabel("training seconds (evaluations excluded)")
  ax.set_ylabel("P@1 (lines: validation split; stars: selected state on the test set, when reached)", fontsize=8)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def report(args) -> None:
  runs, variants = {}, {}
  for path in sorted(glob.glob(os.path.join(args.out, f"{args.dataset}-*.json"))):
    name = os.path.basename(path)[len(args.dataset) + 1:-len(".json")]
    if name == "summary":
      continue
    system, tag = name.rsplit("-", 1)
    with open(path) as f:
      (variants if "+" in tag else runs)[(system, tag)] = json.load(f)
  if not runs and not (args.plot_variants and variants):
    raise SystemExit(f"no runs of {args.dataset} in {args.out}: train some first")
  summary = {"dataset": args.dataset, "runs": sorted(f"{s}-{t}" for s, t in runs), "acceptance": summarize(runs),
             # Runs with other settings: listed, never part of the acceptance figures or the plot.
             "variants": {f"{s}-{t}": {key: run["final"].get(key) for key in ("p@1", "p@5", "samples_per_sec")}
                          | {"settings": run.get("settings")} for (s, t), run in sorted(variants.items())}}
  path = os.path.join(args.out, f"{args.dataset}-summary.json")
  harness.write_json(path, summary, record_machine=False)
  for key, value in summary["acceptance"].items():
    print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
  for name, figures in summary["variants"].items():
    print(f"variant {name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
  print(f"wrote {path}")
  try:
    plot(runs | (variants if args.plot_variants else {}), os.path.join(args.out, f"{args.dataset}.png"),
         f"{args.dataset}: P@1 against training time ({os.cpu_count()} cores)")
    print(f"wrote {os.path.join(args.out, args.dataset + '.png')}")
  except ImportError:
    print("matplotlib is not installed: no plot")


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--dataset", default="synthetic", choices=DATASETS,
                      help="synthetic: issue 9's 200K-label set; tiny: 2K labels, to check the benchmark runs")
  parser.add_argument("--system", choices=SYSTEMS, help="what to train (one per invocation)")
  budget = parser.add_mutually_exclusive_group()
  budget.add_argument("--budget", type=float, default=None, help="training seconds (evaluations excluded)")
  budget.add_argument("--num_epochs", type=float, default=None, help="epochs (the fixed-epoch comparison)")
  parser.add_argument("--report", action="store_true", help="summarize and plot the dataset's runs in --out")
  parser.add_argument("--plot_variants", action="store_true",
                      help="with --report: the plot shows the --variant runs too (a set whose runs are all variants)")
  parser.add_argument("--set", action="append", metavar="NAME=VALUE",
                      help="a sparsejax setting for every system's run (repeatable), e.g. --set learning_rate=0.01")
  parser.add_argument("--collect", action="store_true",
                      help="write the JSON of the finished run in the run directory without training it again (a run "
                      "whose final record was written but whose benchmark process stopped before its JSON)")
  parser.add_argument("--evaluate_again", action="store_true",
                      help="re-measure inference speed and the k sweep of the finished sparsejax run (same --budget "
                      "or --num_epochs) and update its JSON")
  parser.add_argument("--evals_per_epoch", type=int, default=None,
                      help="validation evaluations per epoch; default: --eval_every's default for sparsejax (as "
                      "sparsejax-train evaluates), 4 per epoch for all_active and dense")
  parser.add_argument("--eval_samples", type=int, default=5000, help="validation samples of periodic evaluations")
  parser.add_argument("--sampled_k", type=int, default=None,
                      help="second active set size of sampled inference in the evaluations; default 2%% of N")
  parser.add_argument("--sweep_k", type=int, nargs="*", default=None,
                      help="further k of the selected state's sampled-inference sweep (besides active_k, 2%% of N)")
  parser.add_argument("--inference_batch", type=int, default=1024, help="samples per timed inference batch")
  parser.add_argument("--inference_repeats", type=int, default=5, help="timed inference calls (median)")
  parser.add_argument("--workdir", default=DEFAULT_WORKDIR, help="data files and run directories")
  parser.add_argument("--out", default=DEFAULT_OUT, help="directory of the JSON files (and the plot)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--processes", type=int, default=1,
                      help="sparsejax only: train as sparsejax-launch -n P (the output layer sharded over P processes, "
                      "each one's peak memory recorded); no inference timing")
  parser.add_argument("--pecos_python", default=os.environ.get("PECOS_PYTHON", sys.executable),
                      help="the Python of an environment with libpecos (--system pecos; default $PECOS_PYTHON, else "
                      "this one)")
  parser.add_argument("--variant", default=None, metavar="NAME",
                      help="name a run whose settings differ from the defaults (with --set): its run directory and "
                      "JSON get TAG+NAME (e.g. 4ep+k512), so it overwrites no default run, and --report lists it "
                      "apart from the acceptance figures and the plot")
  args = parser.parse_args()
  # Before anything creates JAX's backend: sparsejax's kernels are CPU code, the GPU baseline needs the GPU.
  os.environ["JAX_PLATFORMS"] = "cuda" if args.system == "dense_gpu" else "cpu"
  if args.system == "dense_gpu" and not args.report:
    from sparsejax.distributed.sharding import first_device

    try:
      first_device("cuda")
    except RuntimeError as e:
      parser.error(f"--system dense_gpu needs a CUDA GPU: {e}")
  if args.variant is not None and not re.fullmatch(r"[A-Za-z0-9_.=]+", args.variant):
    parser.error(f"--variant must be letters, digits, '_', '.' or '=' (it names files), got {args.variant!r}")
  overwrites_defaults = args.workdir == DEFAULT_WORKDIR or args.out == DEFAULT_OUT
  if args.set and args.variant is None and not args.report and overwrites_defaults:
    parser.error("--set changes the systems' settings: name the run with --variant NAME (or give it its own "
                 "--workdir and --out), so that it does not overwrite the default run's files")
  if args.report:
    return report(args)
  if args.evaluate_again:
    if args.budget is None and args.num_epochs is None:
      parser.error("--evaluate_again needs the run's --budget or --num_epochs")
    return evaluate_again(args)
  if args.system is None:
    parser.error("--system is required (or --report)")
  if args.budget is None and args.num_epochs is None:
    parser.error("give --budget SECONDS or --num_epochs E")
  train_one(args)


if __name__ == "__main__":
  main()
