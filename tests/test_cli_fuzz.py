"""CLI fuzzing: random invalid flag values of sparsejax-train, sparsejax-predict and sparsejax-launch end the command
with exit status 2 and one line naming the flag, before anything is loaded (in-process: fast)."""

import collections
import dataclasses
import functools
import math

import pytest
from absl import flags
from hypothesis import given
from hypothesis import strategies as st

from sparsejax.cli import flags as cli_flags
from sparsejax.cli import predict
from sparsejax.cli.train import TRAIN
from sparsejax.config import Config
from sparsejax.distributed import launch
from sparsejax.settings import field_type, iter_fields

SETTINGS = [field for _, field in iter_fields(Config)]
# Text that is no number (nor an integer), none of the spellings absl or the parsers accept.
NOT_A_NUMBER = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=12).filter(
    lambda t: _number(t) is None and t.strip().lower() != "none")


def _number(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None


def _outside(bounds, integer: bool):
  """Values outside ``bounds`` (a Range), or nothing if it has none."""
  options = []
  if bounds is not None and bounds.lo is not None:
    below = bounds.lo if bounds.lo_open else bounds.lo - (1 if integer else 1e-6)
    options.append(st.integers(-2**40, int(math.floor(below))) if integer else
                   st.floats(-1e30, below, allow_nan=False))
  if bounds is not None and bounds.hi is not None:
    above = bounds.hi if bounds.hi_open else bounds.hi + (1 if integer else 1e-6)
    options.append(st.integers(int(math.ceil(above)), 2**40) if integer else st.floats(above, 1e30, allow_nan=False))
  # Beyond every setting's own bounds: 32-bit integers, float32 numbers (settings.INT_LIMIT, settings.FLOAT_LIMIT).
  options.append(st.integers(2**31, 2**70) if integer else st.floats(3.5e38, 1e308, allow_nan=False))
  return [o.map(repr) for o in options]


@st.composite
def invalid_setting(draw):
  """``(flag name, invalid value text)`` for a random setting."""
  field: dataclasses.Field = draw(st.sampled_from(SETTINGS))
  base, optional = field_type(field)
  meta = field.metadata
  if base is bool:
    value = draw(st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1, max_size=8).filter(
        lambda t: t.strip().lower() not in ("true", "false", "t", "f", "1", "0", "yes", "no", "y", "n")))
  elif meta.get("choices"):
    value = draw(st.text(max_size=10, alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"))).filter(
        lambda t: t not in meta["choices"]))
  elif base is int or typing_tuple(base):
    options = [NOT_A_NUMBER.filter(bool), st.floats(allow_nan=False).filter(lambda x: not float(x).is_integer()).map(
        repr), st.sampled_from(["nan", "inf", "-inf", "1e400"]), *_outside(meta.get("bounds"), True)]
    if not optional:
      options.append(st.just("none"))
    value = draw(st.one_of(options))
    if typing_tuple(base) and draw(st.booleans()):
      value = f"16,{value}"  # a bad element after a good one
  elif base is float:
    options = [NOT_A_NUMBER.filter(bool), st.sampled_from(["nan", "inf", "-inf", "NaN", "1e400", "-1e400"]),
               *_outside(meta.get("bounds"), False)]
    if not optional:
      options.append(st.just("none"))
    value = draw(st.one_of(options))
  else:  # a path setting: only invalid in combination (train_file without --dataset=files)
    value = draw(st.sampled_from(["/etc/hostname", "/no/such/file"]))
  return field.name, value


def typing_tuple(base) -> bool:
  return getattr(base, "__origin__", None) is tuple


def _one_line_exit_2(capsys, call) -> str:
  with pytest.raises(SystemExit) as exit_info:
    call()
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.endswith("\n"), repr(err)
  return err


def test_invalid_train_flags_exit_2_with_one_line_naming_the_flag(capsys, fuzz_settings, record_cases,
                                                                  monkeypatch):
  def load_nothing(*args, **kwargs):
    raise AssertionError("data loaded for an invalid command line")

  monkeypatch.setattr("sparsejax.data.load_dataset", load_nothing)
  monkeypatch.setattr("sys.argv", ["sparsejax-train"])  # the program name of the error line
  tally = collections.Counter()

  @fuzz_settings(400)
  @given(invalid_setting(), st.sampled_from([[], ["--dataset=synthetic"], ["--model=dense", "--batch_size=64"]]))
  def check(bad, valid):
    name, value = bad
    flag_values = flags.FlagValues()
    cli_flags.define_flags(TRAIN, flag_values)
    err = _one_line_exit_2(capsys, lambda: cli_flags.parse_flags(["sparsejax-train", *valid, f"--{name}={value}"],
                                                                flag_values, TRAIN))
    assert err.startswith("sparsejax-train: error: ") and f"--{name}" in err, (name, value, err)
    tally["exit 2 naming the flag"] += 1

  check()
  record_cases("sparsejax-train (invalid flag values)", tally)
  assert tally["exit 2 naming the flag"] >= 300


PREDICT_BAD = st.one_of(
    st.tuples(st.just("top"), st.one_of(NOT_A_NUMBER.filter(bool), st.integers(-2**31, 0).map(str),
                                        st.floats(0.1, 100).filter(lambda x: not x.is_integer()).map(repr))),
    st.tuples(st.just("input_format"), st.text(max_size=10).filter(lambda t: t not in ("auto", "xc", "svmlight",
                                                                                        "text") and "\n" not in t
                                                                     and "\r" not in t)))


def test_invalid_predict_flags_exit_2_with_one_line_naming_the_flag(tmp_path, capsys, fuzz_settings, record_cases,
                                                                    monkeypatch):
  import sparsejax.serving.model

  monkeypatch.setattr(sparsejax.serving.model, "load", lambda *a: pytest.fail("the model was loaded"))
  tally = collections.Counter()

  @fuzz_settings(100)
  @given(PREDICT_BAD)
  def check(bad):
    name, value = bad
    flag_values = flags.FlagValues()
    cli_flags.define_flags(predict.PREDICT, flag_values)
    monkeypatch.setattr(predict, "FLAGS", flag_values)  # where sparsejax-predict's main reads its flags
    argv = ["sparsejax-predict", f"--workdir={tmp_path}", "--input=-", f"--{name}={value}"]

    def run():
      rest = cli_flags.parse_flags(argv, flag_values, predict.PREDICT)
      predict.predict(rest)

    err = _one_line_exit_2(capsys, run)
    assert err.startswith("sparsejax-predict: error: ") and f"--{name}" in err, (name, value, err)
    tally["exit 2 naming the flag"] += 1

  monkeypatch.setattr("sys.argv", ["sparsejax-predict"])
  check()
  record_cases("sparsejax-predict (invalid flag values)", tally)


LAUNCH_BAD = st.one_of(
    st.tuples(st.sampled_from(["-n", "--num_processes"]),
              st.one_of(NOT_A_NUMBER.filter(lambda t: t and not t.startswith("-")), st.integers(-100, 0).map(str))),
    st.tuples(st.just("--port"), NOT_A_NUMBER.filter(lambda t: t and not t.startswith("-"))),
    st.tuples(st.just("--stop_timeout"), st.one_of(st.floats(-1e9, -1e-9).map(repr),
                                                   NOT_A_NUMBER.filter(lambda t: t and not t.startswith("-")))),
    st.tuples(st.just("--console"), st.text(min_size=1, max_size=8).filter(
        lambda t: t not in ("rank0", "all") and not t.startswith("-") and "\n" not in t and "\r" not in t)))


def test_invalid_launch_flags_exit_2_with_one_line_naming_the_flag(capsys, fuzz_settings, record_cases,
                                                                   monkeypatch):
  monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
  tally = collections.Counter()

  @fuzz_settings(100)
  @given(LAUNCH_BAD)
  def check(bad):
    name, value = bad
    argv = (["-n", "2"] if name not in ("-n", "--num_processes") else []) + [f"{name}={value}", "examples/train.py"]
    err = _one_line_exit_2(capsys, lambda: launch.main(argv))
    names = ("-n", "--num_processes") if name in ("-n", "--num_processes") else (name,)
    assert err.startswith("sparsejax-launch: error: ") and any(n in err for n in names), (name, value, err)
    tally["exit 2 naming the flag"] += 1

  check()
  record_cases("sparsejax-launch (invalid flag values)", tally)


def _unreadable_files(tmp_path) -> list[tuple[list[str], str]]:
  """Command lines naming files that are no text or no config (issue 35: each ended in a Python traceback), and the
  error line each gets."""
  (tmp_path / "latin1.flags").write_bytes(b"--max_steps=2\n--dataset=synthetic\n\xff\xfe caf\xe9\n")
  (tmp_path / "outer.flags").write_text(f"--max_steps=3\n--flagfile={tmp_path / 'latin1.flags'}\n")
  (tmp_path / "latin1.json").write_bytes(b'{"a": "\xff"}')
  (tmp_path / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
  return [
      ([f"--flagfile={tmp_path / 'latin1.flags'}"],
       f"--flagfile={tmp_path / 'latin1.flags'}: not UTF-8 text (byte 0xff at offset 34)"),
      ([f"--flagfile={tmp_path / 'outer.flags'}"],  # nested: the file at fault is named
       f"--flagfile={tmp_path / 'latin1.flags'}: not UTF-8 text (byte 0xff at offset 34)"),
      ([f"--config={tmp_path / 'latin1.json'}"],
       f"--config={tmp_path / 'latin1.json'}: not UTF-8 text (byte 0xff at offset 7): not a config.json that a run "
       "wrote"),
      ([f"--config={tmp_path / 'nested.json'}"],
       f"--config={tmp_path / 'nested.json'}: JSON nested too deeply: not a config.json that a run wrote"),
  ]


@pytest.mark.parametrize("case", range(4))
def test_flagfiles_and_configs_that_are_no_text_end_with_one_line(case, tmp_path, capsys, monkeypatch):
  """Issue 35: a non-UTF-8 --flagfile or --config and a deeply nested --config ended in tracebacks
  (UnicodeDecodeError, RecursionError)."""
  args, message = _unreadable_files(tmp_path)[case]
  monkeypatch.setattr("sys.argv", ["sparsejax-train"])
  flag_values = flags.FlagValues()
  cli_flags.define_flags(TRAIN, flag_values)
  err = _one_line_exit_2(capsys, lambda: cli_flags.parse_flags(["sparsejax-train", *args], flag_values, TRAIN))
  assert err == f"sparsejax-train: error: {message} (--help lists the flags)\n"


def test_a_metrics_file_line_that_is_no_text_is_named(tmp_path):
  """Issue 35: a metrics.jsonl line that is not UTF-8 ended resume and sparsejax-plot in a UnicodeDecodeError (a
  traceback, or a line naming no file); a cut-short last line is still left out with a warning."""
  from sparsejax.train.metric_writer import MetricsFileError, read_records

  (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "note": "\xff"}\n{"step": 3}\n')
  with pytest.raises(MetricsFileError, match=rf"^{tmp_path / 'metrics.jsonl'}:2: not UTF-8 text \(byte 0xff at "
                                             r"column 22\)$"):
    read_records(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n' + b"[" * 100_000 + b"]" * 100_000 + b'\n{"step": 3}\n')
  with pytest.raises(MetricsFileError, match=r":2: not a JSON record \(nested too deeply\)$"):
    read_records(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "note": "caf\xc3')  # cut inside a character
  assert read_records(str(tmp_path)) == [{"step": 1}]


def test_a_data_file_that_is_a_directory_is_named_as_one(tmp_path, capsys, monkeypatch):
  """Issue 35: --train_file=DIR said "no such file" (the path exists); an unreadable file is named as such too."""
  (tmp_path / "test.txt").write_text("1 5 2\n0 1:1\n")
  monkeypatch.setattr("sys.argv", ["sparsejax-train"])
  flag_values = flags.FlagValues()
  cli_flags.define_flags(TRAIN, flag_values)
  err = _one_line_exit_2(capsys, lambda: cli_flags.parse_flags(
      ["sparsejax-train", "--dataset=files", f"--train_file={tmp_path}", f"--test_file={tmp_path / 'test.txt'}"],
      flag_values, TRAIN))
  assert err == f"sparsejax-train: error: --train_file={tmp_path}: is a directory (--help lists the flags)\n"


NUMERIC = [field for field in SETTINGS if field_type(field)[0] in (int, float) or typing_tuple(field_type(field)[0])]
# Over every numeric setting's bounds, whatever its own: not a number, beyond float32's range; an integer's also beyond
# 32 and 64 bits.
EXTREMES = ["nan", "inf", "-inf", "1e400", "-1e400", "1e308", "-1e308"]
INTEGER_EXTREMES = [str(2**31), str(-2**31 - 1), str(2**63), str(-2**63 - 1), "1e18"]


def test_every_numeric_flag_at_its_extremes_exits_2_naming_the_flag(capsys, monkeypatch):
  """Issue 35: values the validator accepted and Python then overflowed on (--seed >= 2^63, --num_epochs=1e308,
  --warmup_steps=1e18 ...). Each numeric flag, each extreme: one usage line naming it (not only a random sample of
  them, as the fuzzing above draws)."""
  monkeypatch.setattr("sparsejax.data.load_dataset", lambda *a, **k: pytest.fail("data loaded"))
  monkeypatch.setattr("sys.argv", ["sparsejax-train"])
  assert len(NUMERIC) > 30
  for field in NUMERIC:
    integer = field_type(field)[0] is not float
    for value in EXTREMES + (INTEGER_EXTREMES if integer else []):
      flag_values = flags.FlagValues()
      cli_flags.define_flags(TRAIN, flag_values)
      argv = ["sparsejax-train", f"--{field.name}={value}"]
      err = _one_line_exit_2(capsys, functools.partial(cli_flags.parse_flags, argv, flag_values, TRAIN))
      assert err.startswith("sparsejax-train: error: ") and f"--{field.name}" in err, (field.name, value, err)
