"""Settings that cannot fit or that overflow are refused when the config is validated (issue 35), with the memory
they would need and the machine's, instead of aborting the process (SIGABRT inside jit) or a traceback."""

import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import memory
from sparsejax.config import Config
from sparsejax.settings import ConfigError, override
from sparsejax.train import train_and_evaluate


@pytest.mark.parametrize("settings, flag", [
    ({"num_bits": 30, "num_tables": 1}, "num_bits=30"),
    ({"bucket_size": 10**9}, "bucket_size=1000000000"),
])
def test_lsh_tables_larger_than_the_machine_are_refused_at_validation(settings, flag):
  config = override(Config(), candidates="lsh", **settings)
  with pytest.raises(ConfigError, match=rf"^--{flag}: LSH tables of \d+ x 2\^\d+ buckets x \d+ ids and the "
                                        r"evaluations' \(4x as many\) need [\d,.]+ GiB "
                                        r"of memory; this machine has [\d,.]+ GiB\. Lower --num_bits, --num_tables "
                                        r"or --bucket_size \(or --lsh_serving=training: smaller evaluation "
                                        r"tables\)$"):
    config.validate()
  override(config, candidates="clusters").validate()  # no hash tables: nothing to refuse


def test_the_oversized_lsh_command_ends_with_a_named_error_not_an_abort(tmp_path, installed_command):
  """Issue 35: --num_bits=30 --num_tables=1 aborted with SIGABRT after a 256 GiB allocation failed inside jit."""
  out = subprocess.run([installed_command("sparsejax-train"), "--dataset=synthetic", "--synthetic_samples=3000",
                        "--synthetic_features=1000", "--synthetic_labels=200", "--candidates=lsh", "--num_bits=30",
                        "--num_tables=1", "--noprogress", f"--workdir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert re.fullmatch(r"sparsejax-train: error: --num_bits=30: LSH tables of 1 x 2\^30 buckets x 64 ids and the "
                      r"evaluations' \(4x as many\) need 2,324\.0 GiB of memory; this machine has [\d,.]+ GiB\. .*",
                      out.stderr.strip().splitlines()[-1])
  assert not (tmp_path / "run").exists()


def test_tables_sized_by_the_labels_are_checked_once_the_data_is_loaded(small_config, tmp_path, monkeypatch):
  """--num_bits=none: the bits come from the number of labels (3 for 200 with random hyperplanes: about 32 rows
  per bucket), known only after loading the data."""
  # 512 KiB: fits 1 bit (17 KiB of training tables, 257 KiB of serving ones), not 3 (66 + 1,028 KiB)
  monkeypatch.setattr(memory, "machine_memory_bytes", lambda: 512 << 10)
  config = override(small_config, num_tables=32, lsh_projections="random")
  config.validate()
  with pytest.raises(ConfigError, match=r"--num_tables=32: LSH tables of 32 x 2\^3 buckets x 64 ids and"):
    train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_a_header_of_more_labels_than_memory_holds_ends_with_a_named_error(tmp_path, installed_command):
  """Issue 35: an XC header of 10^8 labels ended in XLA's RESOURCE_EXHAUSTED (a 51 GB allocation) and a 70-line
  traceback. Now one line names the file, the network's size and the machine's memory, before anything is built."""
  for name, rows in (("train.txt", 40), ("test.txt", 10)):
    lines = [f"{rows} 50 1000000000"] + [f"{(i * 7919) % 10**9} {i % 50}:1" for i in range(rows)]
    (tmp_path / name).write_text("\n".join(lines) + "\n")
  out = subprocess.run([installed_command("sparsejax-train"), "--dataset=files",
                        f"--train_file={tmp_path / 'train.txt'}", f"--test_file={tmp_path / 'test.txt'}",
                        "--validation_fraction=0", "--batch_size=8",
                        "--recipe=none", "--noprogress", f"--workdir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert re.fullmatch(rf"sparsejax-train: error: --train_file={re.escape(str(tmp_path / 'train.txt'))}: a network of "
                      r"50 features, hidden layers 128 and 1000000000 labels needs at least 192\d\.\d GiB of memory "
                      r"per process for its weights and Adam moments and their moving average; this machine has "
                      r"[\d,.]+ GiB\. Lower --hidden_dims, or split the output layer over more processes "
                      r"\(sparsejax-launch -n P\), or --average_steps=0 .*",
                      out.stderr.strip().splitlines()[-1]), out.stderr[-3000:]
  assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_the_network_s_memory_is_checked_against_the_machine_s(small_config, tmp_path, monkeypatch):
  """The synthetic set's labels are named (and a sharded run's share would count: the output layer's rows / P)."""
  monkeypatch.setattr(memory, "machine_memory_bytes", lambda: 16 << 10)  # 16 KiB: not the network's 68 KiB
  expected = (r"^--synthetic_labels=200: a network of 150 features, hidden layers 16 and 200 labels needs at least "
              r"0\.09 MiB of memory per process for its weights and Adam moments and their moving average; this "
              r"machine has 0\.02 MiB")
  with pytest.raises(ConfigError, match=expected):
    train_and_evaluate(override(small_config, hidden_dims=(16,), synthetic_labels=200, synthetic_features=150,
                                candidates="clusters", reinsert="none"), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.skipif(memory.peak_resident_mb(reset=False) is None, reason="no /proc/self/status (not Linux)")
def test_peak_resident_memory_is_each_stages_own():
  """What each metrics.jsonl record states: the peak since the record before, not since the process started."""
  import numpy as np

  memory.peak_resident_mb()
  baseline = memory.peak_resident_mb()
  block = np.ones(200 << 17)  # 200 MB, touched
  with_block = memory.peak_resident_mb()
  del block
  after = memory.peak_resident_mb()  # counted from the reset above, which the block was still resident for
  assert with_block - baseline > 180
  assert after >= with_block - 5
  assert memory.peak_resident_mb() < with_block - 180  # the next stage's own peak: the block is gone


def test_machine_memory_is_known_here():
  assert memory.machine_memory_bytes() > 1 << 28


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_huge_page_advice_covers_the_large_arrays_only_and_leaves_their_contents():
  big = jnp.arange(20 << 20, dtype=jnp.float32) + 0  # 80 MB, a buffer of its own
  small = jnp.ones(1000, jnp.float32)
  expected = np.asarray(big).copy()
  advised = memory.advise_huge_pages({"big": big, "small": small})
  # The 2 MiB pages wholly inside the 80 MB buffer: all but at most the two partial ones at its ends.
  assert (20 << 22) - (4 << 20) <= advised <= 20 << 22
  np.testing.assert_array_equal(np.asarray(big), expected)
  assert memory.advise_huge_pages({"small": small}) == 0


@pytest.mark.parametrize("flag, value, message", [
    ("seed", 2**63, "must be at most 2147483647 (steps, sizes, ids and seeds are 32-bit integers)"),
    ("warmup_steps", 10**18, "must be at most 2147483647"),
    ("synthetic_samples", 10**30, "must be at most 2147483647"),
    ("hidden_dims", (64, 2**40), "must be at most 2147483647"),
    ("num_epochs", 1e308, "must be > 0 and <= 1e+06 or none"),
    ("propensity_b", 1e308, "must be > 0 and <= 1e+06"),
    ("eps", 1e308, "must be > 0 and <= 1"),
    ("learning_rate", 1e39, "must be at most 3.403e+38 in size (the computations are float32)"),
    ("synthetic_labels_per_sample", 201.0, "exceeds --synthetic_labels=200: a sample holds each label at most once"),
    ("synthetic_labels_per_sample", 0.5, "must be >= 1"),
])
def test_absurd_flag_values_get_one_clear_error_at_validation(small_config, flag, value, message):
  """Issue 35: values the validator accepted and Python or numpy then overflowed on (or a traceback refused)."""
  config = override(small_config, **{flag: value})
  with pytest.raises(ConfigError, match=re.escape(f"--{flag}=") + ".*" + re.escape(message)):
    config.validate()


def test_absurd_flag_values_end_the_command_with_one_line(tmp_path, installed_command):
  out = subprocess.run([installed_command("sparsejax-train"), "--dataset=synthetic", f"--seed={2**63}",
                        f"--workdir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith(
      f"sparsejax-train: error: --seed={2**63}: must be at most 2147483647 (steps, sizes, ids and seeds are 32-bit "
      "integers)"), out.stderr[-3000:]


@pytest.mark.parametrize("settings, message", [
    ({"num_shards": 2}, "--num_shards=2: this job has 1 process(es) to split the output layer over: start 2"),
    ({"netanalysis_iface": "foo0", "netanalysis_steps": 5}, "--netanalysis_iface=foo0: no such network interface on "
                                                             "this host"),
])
def test_settings_the_job_or_host_cannot_take_are_refused_before_loading(small_config, tmp_path, settings, message):
  from sparsejax.netanalysis.collect import StepProfiler

  with pytest.raises(ConfigError, match=re.escape(message)):  # with the step observer that sparsejax-train passes
    train_and_evaluate(override(small_config, **settings), str(tmp_path / "run"),
                       step_observer=StepProfiler.from_config)
  assert not (tmp_path / "run").exists()
