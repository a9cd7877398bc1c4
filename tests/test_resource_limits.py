"""Settings that cannot fit or that overflow are refused when the config is validated (issue 35), with the memory
they would need and the machine's, instead of aborting the process (SIGABRT inside jit) or a traceback."""

import re
import subprocess

import pytest

from sparsejax import memory
from sparsejax.config import Config, ConfigError, override
from sparsejax.train import train_and_evaluate


@pytest.mark.parametrize("settings, flag", [
    ({"num_bits": 30, "num_tables": 1}, "num_bits=30"),
    ({"bucket_size": 10**9}, "bucket_size=1000000000"),
])
def test_lsh_tables_larger_than_the_machine_are_refused_at_validation(settings, flag):
  config = override(Config(), candidates="lsh", **settings)
  with pytest.raises(ConfigError, match=rf"^--{flag}: LSH tables of \d+ x 2\^\d+ buckets x \d+ ids need [\d,.]+ GiB "
                                        r"of memory; this machine has [\d,.]+ GiB\. Lower --num_bits, --num_tables "
                                        r"or --bucket_size$"):
    config.validate()
  override(config, candidates="clusters").validate()  # no hash tables: nothing to refuse


def test_the_oversized_lsh_command_ends_with_a_named_error_not_an_abort(tmp_path, installed_command):
  """Issue 35: --num_bits=30 --num_tables=1 aborted with SIGABRT after a 256 GiB allocation failed inside jit."""
  out = subprocess.run([installed_command("sparsejax-train"), "--dataset=synthetic", "--synthetic_samples=3000",
                        "--synthetic_features=1000", "--synthetic_labels=200", "--candidates=lsh", "--num_bits=30",
                        "--num_tables=1", "--noprogress", f"--workdir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert re.fullmatch(r"sparsejax-train: error: --num_bits=30: LSH tables of 1 x 2\^30 buckets x 64 ids need "
                      r"260\.0 GiB of memory; this machine has [\d,.]+ GiB\. .*", out.stderr.strip().splitlines()[-1])
  assert not (tmp_path / "run").exists()


def test_tables_sized_by_the_labels_are_checked_once_the_data_is_loaded(small_config, tmp_path, monkeypatch):
  """--num_bits=none: the bits come from the number of labels (3 for 200), known only after loading the data."""
  monkeypatch.setattr(memory, "machine_memory_bytes", lambda: 32 << 10)  # 32 KiB: fits 1 bit, not 3
  config = override(small_config, num_tables=32)
  config.validate()
  with pytest.raises(ConfigError, match=r"--num_tables=32: LSH tables of 32 x 2\^3 buckets x 64 ids need"):
    train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_machine_memory_is_known_here():
  assert memory.machine_memory_bytes() > 1 << 28
