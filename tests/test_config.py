"""The one config and its command line: documented flags, validation before anything loads, exit status 2."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from absl import flags

from sparsejax import unused_settings
from sparsejax.cli import flags as cli_flags
from sparsejax.cli.train import TRAIN
from sparsejax.config import BudgetConfig, Config
from sparsejax.model_config import ModelConfig
from sparsejax.settings import ConfigError, iter_fields, override

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train.py")


def _parse(*args: str) -> Config:
  """The validated config of a command line (in-process, fresh flags)."""
  flag_values = flags.FlagValues()
  cli_flags.define_flags(TRAIN, flag_values)
  cli_flags.parse_flags(["sparsejax-train", *args], flag_values, TRAIN)
  return cli_flags.config_from_flags(flag_values)


def _usage_error(capsys, *args: str) -> str:
  """The one line a bad command line prints (and checks that it exits with status 2)."""
  with pytest.raises(SystemExit) as exit_info:
    _parse(*args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  return err


# Issue 12 defects 6, 9 and 12 and issue 11's typo'd enum: each exits 2 naming its flag, before loading data.
BAD = [
    ("--learning_rate=nan", "--learning_rate=nan: must be a finite number"),
    ("--learning_rate=inf", "--learning_rate=inf: must be a finite number"),
    ("--learning_rate=-0.1", "--learning_rate=-0.1: must be > 0"),
    ("--weight_decay=nan", "--weight_decay=nan: must be a finite number"),
    ("--batch_size=0", "--batch_size=0: must be >= 1"),
    ("--eval_every=0", "--eval_every=0"),
    ("--log_every=0", "--log_every=0"),
    ("--checkpoint_every=0", "--checkpoint_every=0"),
    ("--test_fraction=0", "--test_fraction=0.0: must be > 0 and < 1"),
    ("--eval_samples=0", "--eval_samples=0: must be >= 1 or none"),
    ("--max_steps=-5", "--max_steps=-5"),
    ("--num_epochs=-1", "--num_epochs=-1.0"),
    ("--max_seconds=0", "--max_seconds=0.0"),
    ("--warmup_steps=-1", "--warmup_steps=-1"),
    ("--decay_steps=-1", "--decay_steps=-1"),
    ("--rebuild_period=-1", "--rebuild_period=-1"),
    ("--rehash_period=-3", "--rehash_period=-3"),
    ("--rebuild_growth=0.9", "--rebuild_growth=0.9: must be >= 1"),
    ("--rebuild_max_period=0", "--rebuild_max_period=0: must be >= 1"),
    ("--rebuild_max_period=10", "--rebuild_max_period=10: must be >= --rebuild_period (50)"),
    ("--keep_checkpoints=0", "--keep_checkpoints=0: must be >= 1 or none"),
    ("--lsh_family=wta", "--lsh_family=wta: value should be one of <simhash|dwta>"),
    ("--moment_dtype=float16", "--moment_dtype=float16"),
    ("--hidden_dims=128,x", "--hidden_dims=128,x: must be a comma-separated list of integers"),
    ("--hidden_dims=0", "--hidden_dims=0: must be >= 1"),
    ("--batch_size=12.5", "--batch_size=12.5: must be an integer"),
    ("--b1=1", "--b1=1.0: must be >= 0 and < 1"),
    ("--eps=0", "--eps=0.0: must be > 0"),
    ("--num_bits=31", "--num_bits=31: must be >= 1 and <= 30 or none"),
    ("--lsh_family=dwta --num_bits=8", "--num_bits=8: dwta packs 3-bit bins"),
    ("--active_k=0", "--active_k=0"),
    ("--seed=-1", "--seed=-1"),
    ("--progress=maybe", "--progress=maybe"),
    ("--num_shards=0", "--num_shards=0"),
    ("--synthetic_labels_per_sample=nan", "--synthetic_labels_per_sample=nan"),
    ("--dataset=synthetic --synthetic_samples=100 --batch_size=200", "--batch_size=200: exceeds the 90"),
    ("--train_file=/etc/hostname", "--train_file=/etc/hostname: only read with --dataset=files"),
    ("--dataset=files --test_file=/etc/hostname", "--train_file=none: --dataset=files needs --train_file"),
    ("--dataset=files --train_file=/no/such --test_file=/etc/hostname", "--train_file=/no/such: no such file"),
    ("--propensity_b=-100", "--propensity_b=-100.0: must be > 0"),
    ("--propensity_a=0", "--propensity_a=0.0: must be > 0"),
    ("--flagfile=/no/such.flags", "--flagfile: cannot open it: [Errno 2] No such file or directory: '/no/such.flags'"),
    ("--lerning_rate=1", "Unknown command line flag 'lerning_rate'"),
    ("positional", "unexpected argument 'positional'"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[b[0] for b in BAD])
def test_invalid_flags_exit_2_with_one_line_naming_the_flag(capsys, args, message):
  assert message in _usage_error(capsys, *args.split())


def test_bad_flag_exits_2_from_the_script_before_loading_anything(tmp_path):
  """Issue 11: --lsh_family=wta used to fail after the data loaded, with a 38-line traceback."""
  workdir = tmp_path / "wd"
  out = subprocess.run([sys.executable, "-P", EXAMPLE, "--lsh_family=wta", f"--workdir={workdir}"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
      "train.py: error: --lsh_family=wta: value should be one of <simhash|dwta> (--help lists the flags)"]
  assert not workdir.exists()  # nothing was started


def test_a_malformed_data_file_ends_the_command_with_one_line_naming_file_and_line(tmp_path, installed_command):
  """A user audit: every data error printed a 25-line traceback (its last line named the file and line)."""
  (tmp_path / "bad.txt").write_text("2 10 3\n0 1:0.5 2:1\n1 3;0.25\n")
  (tmp_path / "train.txt").write_text("2 10 3\n0 1:0.5 2:1\n1 3:0.25\n")
  (tmp_path / "test.txt").write_text("1 12 3\n0 1:0.5\n")
  (tmp_path / "unlabelled.txt").write_text("2 12 3\n 1:0.5 2:1\n 3:0.25\n")  # it trained, to loss 0.0000
  for train, message in (
      ("bad.txt", f"{tmp_path / 'bad.txt'}:3: malformed feature '3;0.25' (expected 'id:value')"),
      ("train.txt", f"{tmp_path / 'test.txt'}:1: header has 12 features / 3 labels, but {tmp_path / 'train.txt'} "
                    "has 10 / 3"),
      ("unlabelled.txt", f"{tmp_path / 'unlabelled.txt'}:1: no sample has a label: nothing to train on")):
    out = subprocess.run([installed_command("sparsejax-train"), "--dataset=files", f"--train_file={tmp_path / train}",
                          f"--test_file={tmp_path / 'test.txt'}", f"--workdir={tmp_path / 'wd'}", "--noprogress",
                          "--batch_size=1", "--validation_fraction=0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"sparsejax-train: error: {message}"
    # A refused start leaves the work directory as it was: none made (it left an empty checkpoints/), and a
    # user's own files where it existed.
    if train == "bad.txt":
      assert not (tmp_path / "wd").exists()
      (tmp_path / "wd").mkdir()
      (tmp_path / "wd" / "notes.txt").write_text("mine")
    else:
      assert sorted(p.name for p in (tmp_path / "wd").iterdir()) == ["notes.txt"]


def test_train_file_without_dataset_files_is_refused(tmp_path, capsys):
  """Issue 11: --train_file/--test_file without --dataset=files silently trained on ICD-10."""
  train = tmp_path / "train.txt"
  train.write_text("1 3 2\n0 1:0.5\n")
  err = _usage_error(capsys, f"--train_file={train}", f"--test_file={train}")
  assert "--train_file" in err and "add --dataset=files" in err
  config = _parse("--dataset=files", f"--train_file={train}", f"--test_file={train}")
  assert config.data.train_file == str(train)


def test_data_files_are_kept_as_absolute_paths(tmp_path, monkeypatch):
  """A user audit: relative --train_file/--test_file were stored as given, so the same run resumed from another
  directory was refused as "trained with other settings" (the same files), and its config.json named files that
  did not exist from there."""
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "train.txt").write_text("1 3 2\n0 1:0.5\n")
  monkeypatch.chdir(tmp_path)
  config = _parse("--dataset=files", "--train_file=data/train.txt", "--test_file=./data/../data/train.txt")
  want = str(tmp_path / "data" / "train.txt")
  assert config.data.train_file == config.data.test_file == want
  monkeypatch.chdir(tmp_path / "data")  # stored and read back elsewhere: the same files, the same settings
  assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
  assert _parse("--dataset=files", "--train_file=train.txt", "--test_file=train.txt") == config


def test_settings_a_run_does_not_read_are_named():
  """A user audit: --early_stopping_patience without a validation split, LSH flags with the clustered index and
  synthetic-set flags with --dataset=files were accepted and silently ignored."""
  config = override(Config(), dataset="files", train_file="/etc/hostname", test_file="/etc/hostname",
                    validation_fraction=0.0, early_stopping_patience=2, num_tables=50, lsh_family="dwta",
                    synthetic_labels=7, test_fraction=0.5, active_k=512)
  assert unused_settings.of(config) == [
      "--synthetic_labels=7 has no effect: only read with --dataset=synthetic (the dataset is files)",
      "--test_fraction=0.5 has no effect: not read with --dataset=files (--test_file is the test set)",
      "--early_stopping_patience=2 has no effect: needs a validation split (--validation_fraction > 0)",
      "--lsh_family=dwta has no effect: only read with --candidates=lsh",
      "--num_tables=50 has no effect: only read with --candidates=lsh"]
  read = override(config, candidates="lsh", validation_fraction=0.1, dataset="synthetic", train_file=None,
                  test_file=None, kmeans_sample=16)
  assert unused_settings.of(read) == ["--kmeans_sample=16 has no effect: only read with --candidates=clusters"]
  assert unused_settings.of(Config()) == []
  # --ensemble_members trains networks with what an early stop leaves of a --max_seconds budget.
  members = override(Config(), ensemble_members=3, max_steps=100)
  assert unused_settings.of(members) == [
      "--ensemble_members=3 has no effect: only read with --max_seconds (a step or epoch budget trains one network)"]
  assert unused_settings.of(override(members, validation_fraction=0.0)) == [
      "--ensemble_members=3 has no effect: needs a validation split (--validation_fraction > 0)"]
  assert unused_settings.of(override(members, max_steps=None, max_seconds=60.0, model="dense")) == [
      "--ensemble_members=3 has no effect: not read by --model=dense (only SLIDE's runs train members)"]
  assert unused_settings.of(override(members, max_steps=None, max_seconds=60.0)) == []


def test_help_documents_every_flag_and_lists_every_choice(capsys):
  with pytest.raises(SystemExit) as exit_info:
    _parse("--help")
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  for section, field in iter_fields(Config):
    heading = next(line for line in text.splitlines() if line.startswith(f"  --{field.name}=")
                   or line.startswith(f"  --{field.name} "))
    body = text.split(heading, 1)[1].split("\n  --", 1)[0].split("\n\n", 1)[0]
    assert len(body.split()) >= 4 and body.strip().endswith("."), (field.name, body)  # a sentence
    if field.metadata.get("choices"):
      assert f"<{'|'.join(field.metadata['choices'])}>" in heading
    assert f"\n{section}: " in text
  for name in ("workdir", "config", "coordinator_address", "num_processes", "process_id"):
    assert f"  --{name}  (default:" in text


def test_every_setting_is_settable_by_flag_and_none_where_optional():
  config = _parse("--b1=0.8", "--b2=0.99", "--eps=1e-6", "--init_scale=0.5", "--hidden_dims=64,32",
                  "--num_epochs=none", "--max_steps=1e3", "--keep_checkpoints=none", "--noprogress",
                  "--model=dense")
  assert (config.optim.b1, config.optim.b2, config.optim.eps, config.network.init_scale) == (0.8, 0.99, 1e-6, 0.5)
  assert config.network.hidden_dims == (64, 32) and config.network.model == "dense"
  assert config.budget.num_epochs is None and config.budget.max_steps == 1000
  assert config.checkpoint.keep_checkpoints is None and not config.run.progress
  assert _parse() == Config()  # the flags' defaults are the config's


def test_flag_names_are_unique_across_sections():
  names = [f.name for _, f in iter_fields(Config)]
  assert len(names) == len(set(names))


def test_config_and_flag_files(tmp_path):
  first = override(Config(), dataset="synthetic", learning_rate=1e-2, hidden_dims=(16, 8))
  (tmp_path / "config.json").write_text(json.dumps(first.to_dict()))
  config = _parse(f"--config={tmp_path / 'config.json'}", "--learning_rate=0.02")
  assert config == override(first, learning_rate=0.02)  # the file, then the flags given
  (tmp_path / "run.flags").write_text("--dataset=synthetic\n--active_k=77\n")
  assert _parse(f"--flagfile={tmp_path / 'run.flags'}") == override(Config(), dataset="synthetic", active_k=77)
  assert Config.from_dict(json.loads(json.dumps(first.to_dict()))) == first
  # A list is kept as the tuple from_dict gives (a fresh-user review: a list made the model config unhashable,
  # which failed inside jit at the first step).
  listed = override(Config(), hidden_dims=[16, 8])
  assert listed == override(Config(), hidden_dims=(16, 8)) and hash(ModelConfig.from_config(listed, 10, 5))
  with pytest.raises(ConfigError, match="--learning_rat=0.1: unknown setting"):
    Config.from_dict({"optim": {"learning_rat": 0.1}})


def test_a_bad_flag_from_a_flagfile_names_the_file_and_line(capsys, tmp_path):
  """A fresh-user review: an unknown flag or a bad value inside a --flagfile named neither the file nor the line."""
  inner = tmp_path / "inner.flags"
  inner.write_text("# epochs\n\n--num_epochs=-3\n")
  outer = tmp_path / "run.flags"
  outer.write_text(f"--dataset=synthetic\n--flagfile={inner}\n--lerning_rate=0.1\n")
  assert f"Unknown command line flag 'lerning_rate' (set in {outer}, line 3). Did you mean" in _usage_error(
      capsys, f"--flagfile={outer}")
  outer.write_text(f"--dataset=synthetic\n--flagfile={inner}\n")
  assert f"--num_epochs=-3.0: must be > 0 and <= 1e+06 or none (set in {inner}, line 3)" in _usage_error(
      capsys, f"--flagfile={outer}")
  (tmp_path / "value.flags").write_text("--active_k=many\n")
  assert f"--active_k=many: must be an integer (set in {tmp_path / 'value.flags'}, line 1)" in _usage_error(
      capsys, f"--flagfile={tmp_path / 'value.flags'}")
  # The setting that counts is the last one: a command-line value after the file is named without the file.
  assert "--num_epochs=-2.0: must be > 0 and <= 1e+06 or none (--help" in _usage_error(capsys, f"--flagfile={outer}",
                                                                            "--num_epochs=-2")
  assert f"(set in {inner}, line 3)" in _usage_error(capsys, "--num_epochs=-2", f"--flagfile={outer}")


def test_a_bad_config_file_is_named_in_one_line(capsys, tmp_path):
  """A fresh-user review: a --config file of JSON that is not an object gave a TypeError traceback, and its bad
  settings were named without the file."""
  path = tmp_path / "c.json"
  for text, message in (
      ('"hello"', f"--config={path}: must be an object of Config's settings, got str"),
      ("[1, 2]", f"--config={path}: must be an object of Config's settings, got list"),
      ('{"optim": 5}', f"--config={path}: --optim=5: must be an object of OptimizerConfig's settings, got int"),
      ('{"optim": {"learning_rat": 0.1}}', f"--config={path}: --learning_rat=0.1: unknown setting of OptimizerConfig"),
      ('{"optim": {"learning_rate": -1}}', f"--learning_rate=-1: must be > 0 (set in {path})")):
    path.write_text(text)
    assert f"error: {message} (--help lists the flags)" in _usage_error(capsys, f"--config={path}")
  # A value on the command line is named as the command line's, not as the file's.
  assert "--learning_rate=-2.0: must be > 0 (--help" in _usage_error(capsys, f"--config={path}", "--learning_rate=-2")


def test_budgets_never_cap_each_other_by_default():
  """Issue 11: the default --num_epochs=5 silently capped --max_steps and --max_seconds."""
  assert BudgetConfig(max_steps=1000).max_steps_for(steps_per_epoch=10) == 1000
  assert BudgetConfig(max_seconds=60.0).max_steps_for(10) is None  # wall clock only
  assert BudgetConfig().max_steps_for(10) == 50  # nothing set: 5 epochs
  assert BudgetConfig(max_steps=1000, num_epochs=2.5).max_steps_for(10) == 25  # both set: the first reached
  # The final record's stopped_by names the limit reached (it said "step_budget" for an epoch budget too).
  assert BudgetConfig(max_steps=1000).step_limit_name(10) == "max_steps"
  assert BudgetConfig().step_limit_name(10) == "num_epochs"
  assert BudgetConfig(max_steps=1000, num_epochs=2.5).step_limit_name(10) == "num_epochs"
  assert BudgetConfig(max_steps=20, num_epochs=2.5).step_limit_name(10) == "max_steps"


def test_model_config_is_derived_not_repeated():
  """Issue 11: TrainConfig repeated 14 ModelConfig fields with drifted defaults."""
  config = override(Config(), learning_rate=0.5, num_tables=3, active_k=9)
  mcfg = ModelConfig.from_config(config, 100, 200)
  assert mcfg.optim is config.optim and mcfg.tables is config.tables and mcfg.network is config.network
  assert {f.name for f in dataclasses.fields(ModelConfig)} == {
      "num_features", "num_labels", "network", "tables", "optim", "num_shards"}
  assert ModelConfig(1, 2).optim == Config().optim  # one set of defaults
  assert mcfg.k == 9 and mcfg.lsh_config.num_tables == 3 and float(mcfg.schedule()(0)) == 0.5


def test_train_and_evaluate_validates_before_touching_the_workdir(tmp_path):
  from sparsejax.train import train_and_evaluate

  with pytest.raises(ConfigError, match="--learning_rate=nan"):
    train_and_evaluate(override(Config(), learning_rate=float("nan")), str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()
  with pytest.raises(TypeError, match="no setting 'learning_rat'"):
    override(Config(), learning_rat=1.0)


def test_simhash_hyperplane_setting_is_named_unused_under_dwta():
  """--lsh_projections draws SimHash hyperplanes: with --lsh_family=dwta it has no effect, and the run says so."""
  config = override(Config(), candidates="lsh", lsh_family="dwta", lsh_projections="random")
  assert unused_settings.of(config) == [
      "--lsh_projections=random has no effect: only read with --lsh_family=simhash (dwta draws no hyperplanes)"]
  assert unused_settings.of(override(Config(), candidates="lsh", lsh_projections="random")) == []
