"""``sparsejax-predict``: the top labels of each input sample, with their scores, from a trained work directory;
its inputs read as text, XC or svmlight files (sniffed where not given), their faults named by file and line."""

import os

from sparsejax.cli.flags import COMPILATION_CACHE, FLAGS, Command, Flag, check_platform, run_command
from sparsejax.train import allocator

PREDICT = Command("""\
sparsejax-predict: the top labels of each input sample, with their scores, from a trained work directory.

  sparsejax-predict --workdir=/tmp/synth --input=test.txt --top=5          # XC repository or svmlight file
  echo "type 2 diabetes with kidney complications" | sparsejax-predict --workdir=/tmp/icd10 --input=-

Writes one line per input sample: LABEL:SCORE pairs separated by tabs, best
first (LABEL is the label's name where the dataset has names, e.g. an ICD-10
code and its title, else its id; SCORE is the output layer's logit). A text
none of whose words the model knows is named in a warning on stderr.
""", (
    Flag("workdir", None, "Work directory of a trained run. Its selected checkpoint is used (the best on the "
         "validation split, the one its final evaluation reported), else its newest."),
    Flag("step", None, "Use the checkpoint of this step instead (one that the work directory kept).", int),
    Flag("input", None, "Input samples: a file, or - for stdin."),
    Flag("input_format", "auto", "auto (text if the model has a text vectorizer, e.g. ICD-10; else xc if the first "
         "line is an XC header, else svmlight), xc (Extreme Classification Repository file with its header line), "
         "svmlight (lines of 'labels id:value ...', no header) or text (one sample per line)."),
    Flag("top", 5, "Labels written per sample.", int),
    Flag("platform", "cpu", "Where the network runs (sets JAX_PLATFORMS): cpu, or an accelerator (cuda, rocm) for a "
         "model trained with --model=dense. SLIDE's kernels are CPU code."),
    Flag("k", 0, "0: exact, every label scored. K > 0: sampled (SLIDE models): each sample's K best candidates "
         "from the serving index (kept by the run, else built from the model's rows) are scored, as the run's "
         "sampled_p@k; faster where K is a small share of the labels.", int),
    Flag("output", "-", "Where to write the predictions (- for stdout)."),
    COMPILATION_CACHE,
))


def predict(argv: list[str]) -> None:
  """absl main of ``sparsejax-predict``."""
  del argv
  check_platform(FLAGS.platform)  # the model's kind is checked as it loads
  # Set, not defaulted, as sparsejax-train sets it: SLIDE's kernels are CPU code, whatever JAX_PLATFORMS says.
  os.environ["JAX_PLATFORMS"] = FLAGS.platform
  # deferred: JAX (and the model's code) must not load before --platform sets JAX_PLATFORMS; --help stays fast
  from sparsejax.cli import predict_run

  predict_run.run(FLAGS)


def predict_main() -> None:
  """``sparsejax-predict``."""
  allocator.adopt()
  run_command(predict, PREDICT)
