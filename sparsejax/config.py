"""The configuration of a training run: one nested, documented, validated dataclass.

:class:`Config` groups the settings in sections (``data``, ``network``, ``tables``, ``optim``, ``budget``, ``run``,
``checkpoint``, ``dist``, ``netanalysis``, ``search``), each a :class:`sparsejax.settings.Section` of fields made by
:func:`sparsejax.settings.option`, which documents the field once: the command line (:mod:`sparsejax.cli.flags`)
turns every field into a flag of the same name with that text as its ``--help``, so field names are unique across
sections. :meth:`Config.validate` checks every value (types, ranges, finiteness, choices, combinations) before
anything is loaded and raises a :class:`sparsejax.settings.ConfigError` naming the field.

The model's static jit argument, :class:`sparsejax.model_config.ModelConfig`, is built from the ``network``,
``tables`` and ``optim`` sections (it holds them, it does not copy their fields)::

  config = override(Config(), dataset="synthetic", learning_rate=1e-2)   # sparsejax.settings.override
  model_config = ModelConfig.from_config(config.validate(), num_features, num_labels)

To add settings, add a field (with ``option``) to the section it belongs to, or a new section dataclass and a field
of that type in :class:`Config`.
"""

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from sparsejax import model_kinds  # (no JAX)
from sparsejax.index import kinds as index_kinds  # (no JAX)
from sparsejax.rates import parse_rate
from sparsejax.settings import (
  AT_LEAST_ONE,
  NON_NEGATIVE,
  POSITIVE,
  ConfigError,
  Range,
  Section,
  from_dict,
  iter_fields,
  option,
  section,
)

# --early_stopping_ratio stops no sooner than this many evaluations after the best: one or two worse evaluations
# are noise, and early in a run the best is often the last evaluation but one.
MIN_STALE_EVALUATIONS = 3
# --early_stopping_ratio counts an evaluation as better where it beats the last better one by more than this many
# standard errors of a proportion on the evaluated samples: on a plateau the best creeps up by noise (WordNet: 0.6965
# at step 3,000, 0.6981 at 20,000 on 5,000 samples, whose standard error is 0.0065), and the run spent 140 s there.
NOISE_MARGIN = 0.5

# --- Sections ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
  """What to train and evaluate on."""
  dataset: str = option(
      "icd10", "Training data: icd10 (ICD-10-CM code descriptions -> categories, built in), gcide (dictionary "
      "definitions -> their headwords, 25K labels; needs the gcide extra), gcide_cloze (dictionary definitions with "
      "one word removed -> that word, 21K Zipf-distributed labels; needs the gcide extra), wordnet (WordNet noun and "
      "verb glosses -> their hypernym ancestors, 14K labels, 4.2 per sample; needs apt-get install wordnet-base), "
      "synthetic (generated, with power-law labels and planted structure), files (--train_file and --test_file) or "
      "arrays (the matrices given to sparsejax.fit in Python: what its runs record; not read from a command line).",
      choices=("icd10", "gcide", "gcide_cloze", "wordnet", "synthetic", "files", "arrays"))
  train_file: str | None = option(
      None, "Training set in the Extreme Classification Repository text format (needs --dataset=files).")
  test_file: str | None = option(
      None, "Test set in the Extreme Classification Repository text format (needs --dataset=files).")

  def __post_init__(self) -> None:
    super().__post_init__()
    # Absolute paths: the run's config.json names the same files from any directory (resuming, sparsejax.load).
    for name in ("train_file", "test_file"):
      path = getattr(self, name)
      if isinstance(path, str) and path:
        object.__setattr__(self, name, os.path.abspath(os.path.expanduser(path)))

  icd10_labels: str = option(
      "category", "ICD-10 labels: category (one 3-character category per text) or hierarchy (its chapter, "
      "block and category).", choices=("category", "hierarchy"))
  synthetic_samples: int = option(100_000, "Samples of the synthetic dataset (train and test).", bounds=Range(2))
  synthetic_features: int = option(20_000, "Feature space of the synthetic dataset.", bounds=AT_LEAST_ONE)
  synthetic_labels: int = option(10_000, "Labels of the synthetic dataset.", bounds=AT_LEAST_ONE)
  synthetic_labels_per_sample: float = option(
      1.0, "Mean number of labels per synthetic sample (at most --synthetic_labels).", bounds=AT_LEAST_ONE)
  test_fraction: float = option(
      0.1, "Fraction of the samples held out for testing (icd10, gcide, gcide_cloze, wordnet and synthetic).",
      bounds=Range(0, 1, lo_open=True, hi_open=True))
  validation_fraction: float = option(
      0.05, "Fraction of the training samples held out for validation (never the test set): periodic evaluations "
      "score it, it selects the checkpoint evaluated on the test set at the end and drives early stopping; 0: "
      "no validation split (periodic evaluations score the test set and the last step is reported).",
      bounds=Range(0, 1, hi_open=True))
  validation_split: str = option(
      "auto", "How the validation split is drawn: random (rows at random); grouped (each row drawn brings every "
      "training row within cosine 0.7 of it, so near-duplicates are held out together as a test set split by "
      "groups holds them out; its evaluations, over few groups, do not stop a run on a plateau "
      "(--early_stopping_ratio is not read; --early_stopping_patience is), so one network trains the whole budget "
      "and no ensemble members train); auto: grouped where the test set's rows have such a near neighbour among "
      "the training rows far less often than the training rows have one among themselves (a test set split by "
      "groups), else random. auto reads the test set's features, never its labels; the log gives both shares. A "
      "continued run keeps the split it started with.", choices=("auto", "random", "grouped"),
      identity=False)
  max_features: int | None = option(
      None, "Features kept per sample (those of largest |value|); none: the training set's maximum. Each batch "
      "is padded to its own longest row rounded up to a power of two (at least 32), at most this.",
      bounds=AT_LEAST_ONE)
  max_labels: int | None = option(
      None, "Labels kept per training sample; none: the training set's maximum. Each batch is padded to its own "
      "longest row rounded up to a power of two (at least 32), at most this.", bounds=AT_LEAST_ONE)

  def check_combinations(self) -> None:
    if self.dataset == "files":
      for name in ("train_file", "test_file"):
        path = getattr(self, name)
        if not path:
          raise ConfigError(name, path, "--dataset=files needs --train_file and --test_file")
        if not os.path.isfile(path):
          raise ConfigError(name, path, "is a directory" if os.path.isdir(path) else "no such file")
        if not os.access(path, os.R_OK):  # else a PermissionError traceback once the data loads
          raise ConfigError(name, path, "cannot be read (no read permission)")
    else:
      for name in ("train_file", "test_file"):
        if getattr(self, name):
          raise ConfigError(name, getattr(self, name),
                            f"only read with --dataset=files (the dataset is {self.dataset}): add --dataset=files")
    if self.dataset == "synthetic" and self.synthetic_labels_per_sample > self.synthetic_labels:
      raise ConfigError("synthetic_labels_per_sample", self.synthetic_labels_per_sample,
                        f"exceeds --synthetic_labels={self.synthetic_labels}: a sample holds each label at most once")


@dataclasses.dataclass(frozen=True)
class NetworkConfig(Section):
  """The network: sparse input layer -> dense ReLU layers -> output layer over the labels."""
  model: str = option(
      "slide", "How the output layer is trained: slide (LSH-sampled active neurons, row-sparse updates) or dense "
      "(the full-softmax baseline: every output, every step).", choices=model_kinds.names())
  hidden_dims: tuple[int, ...] = option(
      (128,), "Widths of the hidden ReLU layers, comma-separated (the first is the sparse input layer's output).",
      bounds=AT_LEAST_ONE)
  active_k: int = option(
      1024, "Output neurons computed per sample: its labels, then candidates from the index (--candidates), then "
      "random ones (clamped to the number of labels; >= the number of labels computes the exact softmax).",
      bounds=AT_LEAST_ONE)
  random_negatives: float = option(
      0.5, "Fraction of the active neurons kept for uniformly random ones (the rest: labels and index candidates).",
      bounds=Range(0, 1, hi_open=True))
  dropout: float = option(
      0.0, "Dropout rate on the last hidden layer during training (SLIDE model; inference uses every unit).",
      bounds=Range(0, 1, hi_open=True))
  input_dropout: float = option(
      0.0, "Dropout rate on the input features during training (each of a sample's non-zero features is dropped "
      "with this probability, the rest scaled up to keep the sum's expectation; SLIDE model; O(features) per step).",
      bounds=Range(0, 1, hi_open=True))
  tail_correction: bool = option(
      True, "Weight the random active neurons as the sample of the whole tail they are (sampled softmax: their "
      "logits get + log(tail rows / random rows)), so that the loss estimates the full softmax's.")
  softmax: str = option(
      "auto", "Which softmax the SLIDE model trains: sampled (the active neurons only), exact (every output "
      "neuron each step, dense matmuls: faster when the active set covers most of the labels) or auto (the path "
      "whose output layer costs less per step by the step-cost model, sparsejax.step_cost: with the default batch, "
      "exact when --active_k x 4 >= the labels of a shard; the log says which, with both modelled costs).",
      choices=("auto", "sampled", "exact"))
  label_weights: str = option(
      "per_sample", "How a multi-label sample's labels share its loss: per_sample (SLIDE's 1/|y| on each label: "
      "every sample weighs the same) or per_label (each (sample, label) pair weighs the same: the sum of the "
      "labels' log-losses, which ranks labels by P(label in y | x), what P@k scores; Menon et al. 2019). The same "
      "on single-label data.", choices=("per_sample", "per_label"))
  init_scale: float = option(
      1.0, "Standard deviation of the output layer's initial weights, in units of 1/sqrt(last hidden width).",
      bounds=POSITIVE)


@dataclasses.dataclass(frozen=True)
class TablesConfig(Section):
  """The candidate index over the output layer's rows (a clustered index or LSH tables) and its maintenance."""
  candidates: str = option(
      "clusters", "Where each sample's candidate neurons come from: clusters (spherical k-means of the rows, the "
      "best-scoring clusters' members first; finds the largest logits) or lsh (hash tables, as in SLIDE).",
      choices=("clusters", "lsh"))
  num_clusters: int | None = option(
      None, "Clusters of the clustered index; none: about sqrt(rows).", bounds=AT_LEAST_ONE)
  cluster_probes: int | None = option(
      None, "Clusters whose members a sample may take, best first; none: all (ranked).", bounds=AT_LEAST_ONE)
  cluster_spread_weight: float = option(
      1.0, "Clusters are ranked by their members' mean logit plus this many times the spread of their logits "
      "(estimated from the rows' distance to their cluster's mean row); 0: the mean logit alone.",
      bounds=NON_NEGATIVE)
  kmeans_iterations: int = option(
      2, "Lloyd iterations of each refresh of the clustered index (each a pass over rows x clusters).",
      bounds=NON_NEGATIVE)
  kmeans_sample: int = option(
      64, "Rows per cluster that the Lloyd iterations of each refresh see (an evenly spread sample; the final "
      "assignment covers every row, so a refresh costs about one pass instead of --kmeans_iterations + 1); "
      "0: all rows.", bounds=NON_NEGATIVE)
  eval_num_clusters: int | None = option(
      None, "Clusters of the index that evaluation and sampled inference build on the final rows (once per "
      "evaluation); none: the larger of 4 x num_clusters and 4096 (finer clusters: more of the k candidates come "
      "from the best ones).",
      bounds=AT_LEAST_ONE)
  eval_kmeans_iterations: int = option(
      2, "Lloyd iterations of the index built for evaluation and sampled inference.", bounds=NON_NEGATIVE)
  serving_k: int | None = option(
      None, "Candidates per query of sampled inference (the evaluations' sampled_p@k and the retrieval diagnostics, "
      "predict_sampled's default), which scores them exactly and keeps the best; none: (labels / 4000)^2, at most a "
      "sixteenth of the labels, at least --active_k (the share of the rows a query needs grows with the labels: at "
      "10^6 labels --active_k found the top label for 8% of the queries, a sixteenth of them for 99%).",
      bounds=AT_LEAST_ONE)
  lsh_mips: bool = option(
      True, "LSH: hash rows centred on their mean row and reduced from inner products to cosines (simple-LSH), "
      "and queries reduced to match, instead of raw ones (raw rows share a direction the queries point away from: "
      "their tables return almost none of the largest logits; benchmarks/lsh_retrieval.py).")
  lsh_family: str = option(
      "simhash", "Hash family: simhash (signed projections; with --lsh_projections=rows the tables that retrieve "
      "best) or dwta (densified winner-take-all: better than random projections, worse than drawn ones).",
      choices=("simhash", "dwta"))
  lsh_projections: str = option(
      "rows", "SimHash's hyperplanes (dwta has none): random (sparse +-1 projections) or rows (normals of rows "
      "drawn from the layer in proportion to their squared norms, jittered, and drawn again at each rebuild: they "
      "split the rows where the largest logits lie; benchmarks/lsh_retrieval.py). The training tables'; the "
      "angular serving tables' (--lsh_serving) are random.", choices=("random", "rows"))
  num_tables: int = option(
      16, "Hash tables (L) of training; sampled inference and the evaluations build 4x as many (--lsh_serving, "
      "read with --lsh_probes): more find more candidates at a higher query and rebuild cost. 16 trained as well "
      "per step as 64 on the synthetic 200K-label set at a third of the step time (benchmarks/train_profile.py).",
                           bounds=AT_LEAST_ONE)
  lsh_probes: int = option(
      3, "LSH: buckets each query of sampled inference and of the evaluations reads per table: its own and its "
      "nearest other codes (simhash: one bit flipped, the least certain first; dwta: a bin's runner-up). Training "
      "queries read one (their labels are forced in; the rest are negatives). The angular serving tables with "
      "--lsh_rerank=8 found the exact top label for 0.94x (synthetic 200K) and 0.97x (GCIDE cloze) of the queries "
      "exact scoring does with 3 probes, 0.72x and 0.63x with one and no re-ranking (benchmarks/lsh_retrieval.py).",
      bounds=AT_LEAST_ONE)
  lsh_rerank: int = option(
      8, "LSH: sampled inference re-ranks this many times k of the ids found most often by their exact logits and "
      "keeps the best k (a gather of rerank x k rows per query, O(rerank k d)); 0: none (the k found most often). "
      "8 against 4 on the synthetic 200K-label set's LSH layer: 0.940x against 0.923x of exact P@1, "
      "topk_recall@10 0.542 against 0.455, 22% slower queries (benchmarks/lsh_retrieval.py).",
      bounds=NON_NEGATIVE)
  lsh_serving: str = option(
      "angular", "LSH: how the tables of sampled inference and of the evaluations hash the rows. angular: rows "
      "centred on their mean row, each scaled to unit length, random SimHash hyperplanes (about 100 rows per "
      "bucket; dwta: its bins, sized as training's): a query's candidates are the rows nearest its direction, "
      "re-ranked by their exact logits (--lsh_rerank). training: as the training tables (--lsh_mips, "
      "--lsh_projections), in fuller buckets. On the synthetic 200K-label set's trained LSH layers angular found "
      "the top label for 0.94x of the queries exact scoring does, training 0.34-0.52x: one reduction by the longest "
      "row leaves the others' cosines with a query small, where hash bits are nearly coin flips "
      "(benchmarks/lsh_retrieval.py).",
      choices=("angular", "training"))
  num_bits: int | None = option(
      None, "Bits per hash code of the training tables (K; dwta: a multiple of 3); none: chosen from the number of "
      "labels (about 200 rows per bucket with --lsh_projections=rows, else 32). Sampled inference builds tables of "
      "its own (--lsh_serving): angular simhash about 100 rows per bucket (one bit more than drawn hyperplanes', "
      "2 fewer than random ones') in 2x the slots; else 2 fewer bits (dwta: 3), at least 6, in 4x the slots.",
      bounds=Range(1, 30))
  bucket_size: int | None = option(
      None, "Row ids a bucket of the training tables holds; none: 64.", bounds=AT_LEAST_ONE)
  table_policy: str = option(
      "reservoir", "What a full bucket keeps: reservoir (a uniform sample of the rows offered) or fifo (the newest "
      "ids: a full bucket of a rebuild keeps only its highest row ids).", choices=("fifo", "reservoir"))
  reinsert: str = option(
      "none", "Rows re-inserted into the tables after each step: none, labels (the batch's label rows, cheap) or "
      "all (every row the step updated).", choices=("none", "labels", "all"))
  rebuild_period: int = option(
      50, "Steps before the first refresh of the index (re-clustering or re-hashing every row); 0: never.",
      bounds=NON_NEGATIVE)
  rebuild_growth: float = option(
      1.05, "Each period between rebuilds is this times the previous one (1: a fixed period).", bounds=Range(1))
  rebuild_max_period: int = option(
      2000, "Longest period between rebuilds, in steps (>= --rebuild_period).", bounds=AT_LEAST_ONE)
  rehash_period: int = option(
      0, "Steps between drawing new hash functions (and rebuilding); 0: keep the first ones.", bounds=NON_NEGATIVE)
  refresh_budget: float = option(
      0.25, "Largest share of the training time that refreshing the index may take, estimated from the index's "
      "and the step's sizes: where one refresh costs many steps (large N) the periods between refreshes are "
      "lengthened to fit (the log says so); 0: the periods as given. Fresher indexes give harder negatives and "
      "better sampled inference, rarer ones more steps per second.", bounds=Range(0, 1, hi_open=True))

  def check_combinations(self) -> None:
    if self.reinsert != "none" and not index_kinds.KINDS[self.candidates].reinserts(self):
      raise ConfigError("reinsert", self.reinsert, "needs --candidates=lsh and --lsh_mips=false (a clustered or "
                        "MIPS-reduced index is refreshed as a whole: its rows are centred and scaled together)")
    if self.rebuild_period and self.rebuild_max_period < self.rebuild_period:
      raise ConfigError("rebuild_max_period", self.rebuild_max_period,
                        f"must be >= --rebuild_period ({self.rebuild_period})")
    if self.lsh_family == "dwta" and self.num_bits is not None and self.num_bits % 3:
      raise ConfigError("num_bits", self.num_bits, "dwta packs 3-bit bins: must be a multiple of 3")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
  """Mini-batches and Adam (row-sparse for the sparse layers, optax for the dense ones)."""
  batch_size: int = option(128, "Samples per training step.", bounds=AT_LEAST_ONE)
  learning_rate: float = option(3e-3, "Peak learning rate at --reference_batch_size (see --lr_scaling).",
                                bounds=POSITIVE)
  lr_scaling: str = option(
      "none", "How the peak learning rate follows --batch_size: none (as given), linear (times batch_size / "
      "reference_batch_size) or sqrt (times its square root). Large batches (512-2048) trade steps for "
      "throughput: linear with a short --warmup_steps (about a quarter of an epoch) kept batch 128's accuracy "
      "at batch 1024.", choices=("none", "linear", "sqrt"))
  reference_batch_size: int = option(
      128, "The batch size --learning_rate was tuned for (the reference of --lr_scaling).", bounds=AT_LEAST_ONE)
  warmup_steps: int = option(0, "Steps of linear warm-up from 0 to the peak rate; 0: none.", bounds=NON_NEGATIVE)
  decay_steps: int = option(
      0, "Steps of cosine decay to 10% of the peak rate, after the warm-up; 0: a constant rate.", bounds=NON_NEGATIVE)
  b1: float = option(0.9, "Adam's decay rate of the first moment.", bounds=Range(0, 1, hi_open=True))
  b2: float = option(0.999, "Adam's decay rate of the second moment.", bounds=Range(0, 1, hi_open=True))
  eps: float = option(1e-8, "Adam's epsilon (added to the root of the second moment).",
                      bounds=Range(0, 1, lo_open=True))
  weight_decay: float = option(0.0, "Decoupled weight decay (AdamW).", bounds=NON_NEGATIVE)
  average_steps: int = option(
      1000, "The model evaluated, selected and served is an exponential moving average of the trained parameters "
      "over about this many steps (Polyak averaging: flatter and higher validation curves where a network "
      "memorises; updated every quarter of it, at O(parameters) each time, and one more copy of the parameters in "
      "memory); 0: the parameters themselves.", bounds=NON_NEGATIVE)
  moment_dtype: str = option(
      "float32", "Adam moments of the sparse layers: float32 or bfloat16 (half the memory, rounded "
      "stochastically).", choices=("float32", "bfloat16"))
  weight_dtype: str = option(
      "float32", "The output layer's weights: float32 or bfloat16 (half the bytes of every row a step touches; "
      "updated in float32 and rounded stochastically; products and sums stay float32).",
      choices=("float32", "bfloat16"))
  second_moment: str = option(
      "element", "Adam's second moments in the sparse layers: one per element, or one per row (row-wise Adam, as "
      "FBGEMM's: a third fewer bytes per updated row).", choices=("element", "row"))


DEFAULT_EPOCHS = 5.0


@dataclasses.dataclass(frozen=True)
class BudgetConfig(Section):
  """When training stops: at the first budget reached of those set (none: no limit)."""
  max_steps: int | None = option(
      None, f"Training steps in all (a resumed run counts the steps already taken); none: no step limit. If "
      f"--max_steps, --num_epochs and --max_seconds are all none, training runs {DEFAULT_EPOCHS:g} epochs.",
      bounds=AT_LEAST_ONE, identity=False)
  num_epochs: float | None = option(
      None, "Passes over the training set in all (fractions allowed); none: no epoch limit.",
      bounds=Range(0, 1e6, lo_open=True), identity=False)
  max_seconds: float | None = option(
      None, "Wall-clock seconds of training in this invocation, its evaluations and a recipe search's "
      "candidates included (loading, compiling and the final test evaluation come on top); none: no limit.",
      bounds=POSITIVE, identity=False)

  def max_steps_for(self, steps_per_epoch: int) -> int | None:
    """The step budget (None: wall-clock only) given the epoch length."""
    epochs = self.num_epochs
    if self.max_steps is None and epochs is None and self.max_seconds is None:
      epochs = DEFAULT_EPOCHS
    by_epochs = None if epochs is None else int(math.ceil(epochs * steps_per_epoch))
    limits = [s for s in (self.max_steps, by_epochs) if s is not None]
    return min(limits) if limits else None

  def step_limit_name(self, steps_per_epoch: int) -> str:
    """The flag whose limit :meth:`max_steps_for` is: ``max_steps`` or ``num_epochs`` (also the default)."""
    if self.max_steps is not None and self.max_steps == self.max_steps_for(steps_per_epoch):
      return "max_steps"
    return "num_epochs"


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
  """Seed, evaluation and logging."""
  seed: int = option(0, "Seed of the initialization, the data split and order, and the LSH sampling.",
                     bounds=NON_NEGATIVE)
  eval_every: int = option(
      500, "Steps between periodic evaluations: of the validation split (the test set with "
      "--validation_fraction=0).", bounds=AT_LEAST_ONE, identity=False)
  eval_samples: int | None = option(
      5000, "Samples of the periodic evaluations and of the centroid fusion's choice of weight; none: all (the final "
      "evaluation on the test set always uses all).",
      bounds=AT_LEAST_ONE, identity=False)
  eval_memory_mb: int = option(
      512, "Megabytes of temporaries per process that one call of an evaluation (and of the served model's "
      "predict) may take: its samples per call are planned from it (sampled inference's candidates cost about "
      "12-72 bytes per sample each, sparsejax.inference.rows_within): at 8·10^6 labels over 4 processes, 1,024 "
      "samples x 125,000 candidates took 6-8 GB per process.", bounds=AT_LEAST_ONE, identity=False)
  selection_metric: str = option(
      "auto", "Validation metric that selects the best checkpoint (higher is better). auto: p@5 where the training "
      "rows' median label count is 5 or more (P@1 saturates there and stopped runs early), else p@1; decided once "
      "on a new run's data.",
      choices=("auto", "p@1", "p@3", "p@5", "ndcg@3", "ndcg@5", "psp@1", "psp@3", "psp@5"), identity=False)
  centroid_fusion: bool = option(
      True, "Re-rank the network's best labels by logit + w * cos(x, label centroid) (the label's training rows "
      "summed; sparsejax.fusion), w chosen on the validation split at the end (0: the network alone); served by "
      "sparsejax.load. Needs a validation split.", identity=False)
  head_rankers: int = option(
      20, "With --centroid_fusion, a logistic regression per label in at least 2% of the training samples (at most "
      "this many; sparsejax.head_rankers), fitted at the start within the budget and fused as a third term, its "
      "weight chosen on the validation split; 0: none.", bounds=NON_NEGATIVE, identity=False)
  early_stopping_patience: int | None = option(
      None, "Stop after this many validation evaluations in a row without a better selection metric; none: "
      "train the whole budget (the best checkpoint is still the one reported).", bounds=AT_LEAST_ONE,
      identity=False)
  early_stopping_ratio: float | None = option(
      2.0, "With --max_seconds, stop once the step count reaches this many times the step of the last validation "
      "evaluation that improved (2: as many steps again without a better one), after at least "
      f"{MIN_STALE_EVALUATIONS} evaluations without one: a budget in seconds is a ceiling, and a run that has "
      f"peaked spends the rest memorising. An improvement counts where it is larger than {NOISE_MARGIN:g} "
      "standard errors of a proportion (the metric's value) on the evaluated samples (a plateau's best creeps up "
      "by noise); the best state evaluated is selected all the same. Counted in steps, so a seed stops at the same "
      "step on any machine. "
      "none: train the whole budget. Without --max_seconds, step and epoch budgets are trained whole (see "
      "--early_stopping_patience).",
      bounds=Range(1, 1e6, lo_open=True), identity=False)
  sampled_evaluations: str = option(
      "final", "Which evaluations also run sampled inference (on an index rebuilt from the rows) and the retrieval "
      "diagnostics: final (the test set's at the end; the periodic ones score exactly, what selection reads: the "
      "rebuild took 4 of a 200K-label validation evaluation's 6 s), or all.", choices=("final", "all"),
      identity=False)
  eval_sampled_k: int | None = option(
      None, "Also evaluate sampled inference with this many candidates (e.g. 2% of the labels), where sampled "
      "inference is evaluated (--sampled_evaluations); none: only with --serving_k.", bounds=AT_LEAST_ONE,
      identity=False)
  log_every: int = option(50, "Steps between training-loss readings (progress bar, logs).", bounds=AT_LEAST_ONE,
                          identity=False)
  propensity_a: float = option(0.55, "Propensity model parameter A of the PSP@k metrics (Jain et al. 2016).",
                               bounds=Range(0, 100, lo_open=True), identity=False)
  propensity_b: float = option(1.5, "Propensity model parameter B of the PSP@k metrics.",
                               bounds=Range(0, 1e6, lo_open=True), identity=False)
  tensorboard: bool = option(False, "Also write TensorBoard events to WORKDIR/tensorboard (needs tensorboardX).",
                             identity=False)
  on_nonfinite: str = option(
      "stop", "What a step with a NaN or Inf loss or update does (it is never applied, nor saved): stop (the run "
      "ends with an error naming the step; the checkpoints on disk are those of earlier steps) or skip_step (the "
      "run goes on without it; it stops if 20 steps in a row are skipped). Checked at each --log_every reading.",
      choices=("stop", "skip_step"), identity=False)
  progress: bool = option(
      True, "Show a progress bar when the console is a terminal or a Jupyter notebook (otherwise, and with "
      "--noprogress, log a line with the step, the loss and the throughput every --log_every steps).", identity=False)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
  """Checkpoints in WORKDIR/checkpoints (a run resumes from the newest one)."""
  checkpoint_every: int = option(1000, "Steps between checkpoints (one is also written at the end).",
                                 bounds=AT_LEAST_ONE, identity=False)
  keep_checkpoints: int | None = option(2, "Newest checkpoints kept; none: keep all.", bounds=AT_LEAST_ONE,
                                        identity=False)
  resume: str = option(
      "auto", "What to do when WORKDIR holds checkpoints: auto (continue the run if its settings are these, else "
      "stop and list the differences), force (continue it with these settings, e.g. a new learning rate) or never "
      "(stop: a new run needs a new WORKDIR).", choices=("auto", "force", "never"), identity=False)


@dataclasses.dataclass(frozen=True)
class DistConfig(Section):
  """The output layer split over processes (Distributed SLIDE)."""
  num_shards: int | None = option(
      None, "Processes the output layer is split over; none: every process of the job (then --model=dense runs "
      "data-parallel).", bounds=AT_LEAST_ONE)
  checksum_every: int = option(
      500, "Steps between checks that replicated parameters agree across processes; 0: never.", bounds=NON_NEGATIVE,
      identity=False)


@dataclasses.dataclass(frozen=True)
class NetanalysisConfig(Section):
  """In-run network analysis (:mod:`sparsejax.netanalysis.collect`): is the network the bottleneck?"""
  netanalysis_steps: int = option(
      0, "Steps of the profiled window (per-collective timing, compute/communication breakdown, link "
      "utilisation, written to WORKDIR/netanalysis/); 0: none. The window waits for each step, which the normal "
      "loop does not, and with a window every step is timed that way.", bounds=NON_NEGATIVE, identity=False)
  netanalysis_start: int = option(
      20, "Step at which the profiled window starts (at least 2 steps after the process started, so that "
      "compilation is never profiled).", bounds=NON_NEGATIVE, identity=False)
  link_capacity: str | None = option(
      None, "The link's rate for utilisation figures, as tc writes it (1gbit, 100mbit, or bit/s); none: "
      "utilisations are omitted.", identity=False)
  netanalysis_iface: str = option(
      "auto", "Network interface whose tx/rx byte counters are sampled in the window; auto: the one holding the "
      "address this process advertises.", identity=False)
  netanalysis_keep_raw: bool = option(
      False, "Keep the profiler's raw output under WORKDIR/netanalysis/raw/.", identity=False)

  def check_combinations(self) -> None:
    # Linux interface names: 1-15 bytes, no '/' and no whitespace (IFNAMSIZ); whether it exists is checked where the
    # process runs (hosts differ).
    iface = self.netanalysis_iface
    if iface != "auto" and (not 0 < len(iface.encode()) <= 15 or "/" in iface or any(c.isspace() for c in iface)):
      raise ConfigError("netanalysis_iface", iface,
                        "is not an interface name (auto, or 1-15 characters without '/' or spaces, e.g. eth0)")
    if self.link_capacity is not None:
      try:
        parse_rate(self.link_capacity)
      except ValueError as e:
        raise ConfigError("link_capacity", self.link_capacity, str(e)) from None


@dataclasses.dataclass(frozen=True)
class RecipeConfig(Section):
  """The network recipe (width, depth, regularisers, learning rate), given or chosen by a search on validation."""
  recipe: str = option(
      "auto", "The network recipe (sparsejax.train.recipes): its settings apply where you set none of them. auto: "
      "with a validation split, a fresh run compares the recipes that fit the data on it by successive halving within "
      "--search_fraction of the budget, then trains the winner on (logged, and in metrics.jsonl); any recipe "
      "setting given explicitly (e.g. --hidden_dims) skips the search. none: no recipe, no search, the settings "
      "as given. Or a recipe's name (no search): "
      "small (one hidden layer of 128: the fastest step), wide (512, dropout 0.25, --active_k=512) or wider (1024, "
      "dropout 0.5, --active_k=512, --learning_rate=2e-3: the most capacity).",
      choices=("auto", "none", "small", "wide", "wider"))
  search_fraction: float = option(
      0.5, "Largest share of the training budget that the recipe search may spend, the winner's own steps "
      "included (they are kept: it trains on from them). With --max_seconds the run's seconds, the search's "
      "included (planned from step times measured on the first steps of each candidate, and cut short where the "
      "clock says the rest would overrun); with --max_steps or --num_epochs the winner still trains all of them, so "
      "the other candidates' steps come on top.",
      bounds=Range(0, 1, lo_open=True, hi_open=True))
  plan_from: str | None = option(
      None, "With --max_seconds: plan the recipe search's rounds from the step times that another run measured "
      "(its metrics.jsonl, or its work directory) instead of measuring them, so that the run takes the same steps "
      "as that one (a rerun that must match bit for bit). none: measure them (a continued search reuses its own).",
      identity=False)
  ensemble_members: int = option(
      2, "Most networks in the run's ensemble. A run with --max_seconds that stops early (--early_stopping_ratio) "
      "trains more with the budget left, in WORKDIR/members/M: the same recipe from seed + M, each for as many "
      "steps as the first took to its selected state; their rankings are merged by mean logit (sparsejax.ensemble) "
      "and served so by sparsejax.load. A member the clock stops before its steps is left out. 1: one network.",
      bounds=Range(1, 999), identity=False)

  def check_combinations(self) -> None:
    if self.plan_from is not None and recorded_plan(self.plan_from) is None:
      raise ConfigError("plan_from", self.plan_from, NO_RECORDED_PLAN)


NO_RECORDED_PLAN = ("holds no measured_step_seconds record (a run with --max_seconds and a recipe search writes one "
                    "in its metrics.jsonl; give that file or its work directory)")


def recorded_plan(path: str) -> dict | None:
  """The last ``measured_step_seconds`` record (the recipe search's measured step times) in ``path``: a
  ``metrics.jsonl``, or a work directory holding one. None where there is none (or no such file)."""
  file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
  found = None
  try:
    with open(file, errors="replace") as f:
      for line in f:
        if '"measured_step_seconds"' in line:
          try:
            found = json.loads(line)
          except ValueError:  # a line cut by a crash: the one before stands
            continue
  except OSError:
    return None
  return found


@dataclasses.dataclass(frozen=True)
class Config:
  """A training run: every setting, in sections (see the module docstring)."""
  data: DataConfig = section(DataConfig)
  network: NetworkConfig = section(NetworkConfig)
  tables: TablesConfig = section(TablesConfig)
  optim: OptimizerConfig = section(OptimizerConfig)
  budget: BudgetConfig = section(BudgetConfig)
  run: RunConfig = section(RunConfig)
  checkpoint: CheckpointConfig = section(CheckpointConfig)
  dist: DistConfig = section(DistConfig)
  netanalysis: NetanalysisConfig = section(NetanalysisConfig)
  search: RecipeConfig = section(RecipeConfig)

  def validate(self) -> "Config":
    """Checks every setting; raises :class:`ConfigError` naming the first bad one. Returns ``self``."""
    for field in dataclasses.fields(self):
      getattr(self, field.name).validate()
    if self.data.dataset == "synthetic":
      num_train = self.data.synthetic_samples - round(self.data.synthetic_samples * self.data.test_fraction)
      if self.optim.batch_size > num_train:
        raise ConfigError("batch_size", self.optim.batch_size,
                          f"exceeds the {num_train} synthetic training samples")
    if model_kinds.of(self).sampled:
      index_kinds.check_table_memory(self.tables)
    return self

  def to_dict(self) -> dict[str, dict[str, Any]]:
    """JSON-ready nested dict (tuples as lists)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "Config":
    """The inverse of :meth:`to_dict`; missing fields keep their defaults, unknown ones raise."""
    return from_dict(cls, values)


def identity_fields() -> set[str]:
  """Names of the settings that define what a run trains (see :func:`option`)."""
  return {f.name for _, f in iter_fields(Config) if f.metadata.get("identity", True)}

