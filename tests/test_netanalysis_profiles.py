"""netanalysis file readers: schemas round-trip, every bad input of issue 8 section 8 names its place, fuzzing."""

import json
import os
import random

import pytest

from sparsejax.netanalysis import ProfileError, cost_tables, probe_results, profiles, whatif
from sparsejax.netanalysis.__main__ import main as cli

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "training_bottleneck")
BK = os.path.join(DATA, "resnet50.bk.log")
COST = os.path.join(DATA, "cuda_vec_add.log")
GOOD_ROWS = "552.6,4000\n27.1,8192000\n"


def _run_cli(capsys, *args) -> tuple[int, str, str]:
  status = cli(["netanalysis", "whatif", *args])
  out, err = capsys.readouterr()
  return status, out, err


def _assert_cli_error(capsys, prefix: str, *args) -> None:
  status, _, err = _run_cli(capsys, *args)
  assert status == 2, err
  assert err.startswith(f"error: {prefix}"), err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------------
# Good input.


def test_bk_log_maps_onto_the_profile_schema():
  p = profiles.read_bk_log(BK, 0.1281)
  assert (p.name, p.job, p.workers, p.step_seconds, len(p.steps)) == ("resnet50", "backward", 1, 0.1281, 1)
  chain = p.steps[0]
  assert len(chain.segments) == 162 and len(chain.collectives) == 161
  assert chain.segments[0].scope == "forward"
  assert chain.compute_seconds == pytest.approx(0.1281, rel=1e-12)
  assert chain.segments[1].seconds == pytest.approx(552.6383717854818e-6, rel=1e-15)
  first = chain.collectives[0]
  assert (first.kind, first.bytes, first.compressible, first.ready_after, first.needed_before) == (
      "all-reduce", 4000, True, 1, "end")
  assert chain.collective_bytes == 102_228_128


def test_accepts_crlf_trailing_blank_lines_spaces_and_whole_floats(tmp_path):
  path = tmp_path / "x.bk.log"
  path.write_bytes(b"header\r\n1\r\n 2 \r\n 552.6 , 4000.0 \r\n27.1,8192000\r\n\r\n  \r\n")
  p = profiles.read_bk_log(str(path), 0.01)
  assert [c.bytes for c in p.steps[0].collectives] == [4000, 8192000]


def test_profile_json_round_trip(tmp_path):
  p = profiles.read_bk_log(BK, 0.1281)
  path = tmp_path / "sub" / "profile.json"
  profiles.write_profile(str(path), p)
  assert profiles.read_profile(str(path)) == p
  assert profiles.read_any_profile(str(path)) == p
  assert not [f for f in os.listdir(path.parent) if f != "profile.json"]  # no temporary left behind
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # not the temporary file's 0600
  run = profiles.Profile("run", "run", "/runs/x", "sparse", 4, 32, 0.085, (profiles.Chain(
      (profiles.Segment(0.01, "hidden_fwd", "replicated"), profiles.Segment(0.02, "out_logits", "sharded")),
      (profiles.Collective("all-reduce.3", "all-reduce", 4096, False, 0, 1, 1e-4, 2e-5, "dh_reduce", "f32", (32, 32)),
       profiles.Collective("all-gather.1", "all-gather", 8192, False, 1, "end"))),))
  profiles.write_profile(str(path), run)
  assert profiles.read_profile(str(path)) == run


def test_probe_round_trip_and_cost_table(tmp_path):
  table = cost_tables.read_cost_table(COST)
  assert len(table.sizes) == 25
  assert table(40) == 1.04448e-05 and table(1) == 1.04448e-05 and table(1e12) == 0.00243368  # clamped
  assert table(60) == pytest.approx((1.04448e-05 + 9.7792e-06) / 2, rel=1e-12)
  row = probe_results.ProbeRow(1024, 256, 1e-4, 9e-5, 2e-4, 8e7, 1.2e8)
  probe = probe_results.Probe(4, "float32", 1e9, {"all-reduce": probe_results.ProbeFit(3e-5, 9.1e8, 0.998, (row,)),
                                                  "collective-permute": probe_results.ProbeFit(2e-5, 9.5e8, None)},
                              table)
  probe_results.write_probe(str(tmp_path / "probe.json"), probe)
  assert probe_results.read_probe(str(tmp_path / "probe.json")) == probe
  cost_tables.write_cost_table(str(tmp_path / "add.log"), table, comment="jitted add\nfloat32")
  assert cost_tables.read_cost_table(str(tmp_path / "add.log")) == table


# ---------------------------------------------------------------------------------------------------
# Bad input: one case per item of section 8. (content, line of the error, text expected in the message)

BK_CASES = {
    "empty file": ("", 1, "empty file"),
    "only blank lines": ("\n \n\r\n", 1, "empty file"),
    "missing header line": ("header\n1\n", 2, "3 header lines"),
    "batches not an integer": ("header\nx\n2\n" + GOOD_ROWS, 2, "number of batches"),
    "batches zero": ("header\n0\n2\n" + GOOD_ROWS, 2, "positive integer"),
    "batches negative": ("header\n-1\n2\n" + GOOD_ROWS, 2, "positive integer"),
    "layers not an integer": ("header\n1\n2.5\n" + GOOD_ROWS, 3, "number of layers"),
    "layers zero": ("header\n1\n0\n", 3, "positive integer"),
    "row with one field": ("header\n1\n2\n552.6\n27.1,8192000\n", 4, "2 comma-separated fields"),
    "row with three fields": ("header\n1\n2\n552.6,4000,1\n27.1,8192000\n", 4, "2 comma-separated fields"),
    "blank line inside rows": ("header\n1\n2\n\n27.1,8192000\n", 4, "empty line"),
    "wait text": ("header\n1\n2\n552.6,4000\nabc,8192000\n", 5, "wait_us"),
    "wait nan": ("header\n1\n2\nnan,4000\n27.1,8192000\n", 4, "finite number >= 0"),
    "wait inf": ("header\n1\n2\n552.6,4000\ninf,8192000\n", 5, "finite number >= 0"),
    "wait negative": ("header\n1\n2\n-1,4000\n27.1,8192000\n", 4, "finite number >= 0"),
    "bytes fractional": ("header\n1\n2\n552.6,4000.5\n27.1,8192000\n", 4, "whole number"),
    "bytes negative": ("header\n1\n2\n552.6,-4000\n27.1,8192000\n", 4, "whole number"),
    "bytes text": ("header\n1\n2\n552.6,4k\n27.1,8192000\n", 4, "whole number"),
    "fewer rows": ("header\n2\n2\n" + GOOD_ROWS + "1,1\n", 6, "3 of 4 rows"),
    "rows beyond count": ("header\n1\n2\n" + GOOD_ROWS + "1,1\n", 6, "beyond the declared"),
    "zero gradient bytes": ("header\n1\n2\n552.6,0\n27.1,0\n", 4, "no gradient bytes"),
}


def _check_bad_file(capsys, path, content, line, text, read, *cli_args) -> None:
  """Reading ``content`` raises a ProfileError at ``path:line:`` that says ``text``; so does the CLI (status 2)."""
  path.write_text(content)
  with pytest.raises(ProfileError, match=text) as e:
    read(str(path))
  assert str(e.value).startswith(f"{path}:{line}: "), str(e.value)
  _assert_cli_error(capsys, f"{path}:{line}: ", *cli_args)


@pytest.mark.parametrize("case", sorted(BK_CASES))
def test_bad_bk_log(case, tmp_path, capsys):
  path = tmp_path / "bad.bk.log"
  _check_bad_file(capsys, path, *BK_CASES[case], lambda p: profiles.read_bk_log(p, 0.2), f"--profile={path}",
                  "--iteration_time_ms=200")


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_missing_or_unreadable_file(what, tmp_path, capsys):
  path = tmp_path / "nope.bk.log"
  if what == "directory":
    path.mkdir()
  with pytest.raises(ProfileError, match="cannot read") as e:
    profiles.read_bk_log(str(path), 0.2)
  assert str(e.value).startswith(f"{path}: cannot read"), str(e.value)
  _assert_cli_error(capsys, f"{path}: cannot read", f"--profile={path}", "--iteration_time_ms=200")


def test_iteration_time_shorter_than_backward(tmp_path, capsys):
  with pytest.raises(ProfileError, match="shorter than batch 1's backward pass") as e:
    profiles.read_bk_log(BK, 0.05)
  assert str(e.value).startswith(f"{BK}:4: ")
  _assert_cli_error(capsys, f"{BK}:4: ", f"--profile={BK}", "--iteration_time_ms=50")


COST_CASES = {
    "one row": ("40,1e-5\n", 1, "at least 2 rows"),
    "no rows": ("# only a comment\n", 1, "at least 2 rows"),
    "sizes equal": ("40,1e-5\n80,1e-5\n80,2e-5\n", 3, "sizes must increase"),
    "sizes decrease": ("40,1e-5\n80,1e-5\n60,2e-5\n", 3, "sizes must increase"),
    "negative time": ("40,1e-5\n80,-1e-5\n", 2, "seconds must be a finite number >= 0"),
    "three fields": ("40,1e-5\n80,1e-5,3\n", 2, "2 comma-separated fields"),
}


@pytest.mark.parametrize("case", sorted(COST_CASES))
def test_bad_cost_table(case, tmp_path, capsys):
  path = tmp_path / "add.log"
  _check_bad_file(capsys, path, *COST_CASES[case], cost_tables.read_cost_table, f"--profile={BK}",
                  "--iteration_time_ms=128.1", f"--reduce_cost={path}")


def _good_profile_json() -> dict:
  return profiles.profile_to_dict(profiles.read_bk_log(BK, 0.1281))


def _edit(doc: dict, path: list, value=None, delete=False) -> dict:
  target = doc
  for key in path[:-1]:
    target = target[key]
  if delete:
    del target[path[-1]]
  else:
    target[path[-1]] = value
  return doc


JSON_CASES = {
    "invalid JSON": (lambda: '{"schema": "sparsejax.netanalysis.profile/1",\n "name": }', "{path}:2:10: invalid JSON"),
    "NaN": (lambda: json.dumps(_edit(_good_profile_json(), ["step_seconds"], float("nan"))), "{path}:"),
    "wrong schema version": (lambda: json.dumps(_edit(_good_profile_json(), ["schema"], "sparsejax.netanalysis.x/2")),
                             "{path}: $.schema: unsupported schema"),
    "missing key": (lambda: json.dumps(_edit(_good_profile_json(), ["steps", 0, "collectives", 3, "bytes"],
                                             delete=True)),
                    "{path}: $.steps[0].collectives[3]: missing key 'bytes'"),
    "wrong type": (lambda: json.dumps(_edit(_good_profile_json(), ["workers"], "4")),
                   "{path}: $.workers: expected a whole number"),
    "bad scales": (lambda: json.dumps(_edit(_good_profile_json(), ["steps", 0, "segments", 1, "scales"], "all")),
                   "{path}: $.steps[0].segments[1].scales: expected one of replicated, sharded, batch"),
    "needed before ready": (lambda: json.dumps(_edit(_good_profile_json(), ["steps", 0, "collectives", 0,
                                                                            "needed_before"], 1)),
                            "{path}: $.steps[0].collectives[0].needed_before: must be >= 2"),
    "unknown key": (lambda: json.dumps(_edit(_good_profile_json(), ["step_ms"], 3)),
                    "{path}: $: unknown key 'step_ms'"),
    "not an object": (lambda: "[1, 2]", "{path}: $: expected an object"),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_bad_profile_json(case, tmp_path, capsys):
  make, prefix = JSON_CASES[case]
  path = tmp_path / "profile.json"
  path.write_text(make())
  prefix = prefix.format(path=path)
  with pytest.raises(ProfileError) as e:
    profiles.read_profile(str(path))
  assert str(e.value).startswith(prefix), str(e.value)
  _assert_cli_error(capsys, prefix, f"--profile={path}")


def test_bad_probe_json(tmp_path):
  fits = {"all-reduce": probe_results.ProbeFit(1e-5, 1e9, 0.99)}
  good = probe_results.probe_to_dict(probe_results.Probe(2, "float32", None, fits, cost_tables.read_cost_table(COST)))
  path = tmp_path / "probe.json"
  cases = [(_edit(json.loads(json.dumps(good)), ["collectives", "all-reduce", "bw_bps"], 0),
            "$.collectives.all-reduce.bw_bps: must be > 0"),
           (_edit(json.loads(json.dumps(good)), ["collectives", "ring"], {}), "$.collectives: unknown key 'ring'"),
           (_edit(json.loads(json.dumps(good)), ["reduce_cost", 3, 0], 1.0), "$.reduce_cost[3]: sizes must increase"),
           (_edit(json.loads(json.dumps(good)), ["schema"], "x"), "$.schema: unsupported schema")]
  for doc, message in cases:
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError) as e:
      probe_results.read_probe(str(path))
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)


FLAG_CASES = {
    "rate zero": (["--bandwidths=0gbit"], "--bandwidths: rate '0gbit' must be a positive"),
    "rate negative": (["--bandwidths=-1gbit"], "--bandwidths: rate '-1gbit'"),
    "rate unknown unit": (["--bandwidths=10mbps"], "--bandwidths: rate '10mbps': write a number of bit/s with one of"),
    "compression below 1": (["--compression=1,0.5"], "--compression: 0.5 must be >= 1"),
    "workers below 2": (["--workers=1,4"], "--workers: 1 must be >= 2"),
    "workers not a number": (["--workers=four"], "--workers: 'four' is not a whole number"),
    "target zero": (["--target_scaling=0"], "--target_scaling: 0.0 must be in (0, 1]"),
    "target above one": (["--target_scaling=1.5"], "--target_scaling: 1.5 must be in (0, 1]"),
    "fusion negative": (["--fusion_ms=-5"], "--fusion_ms: -5.0 must be > 0"),
    "iteration time zero": (["--iteration_time_ms=0"], "--iteration_time_ms: 0 must be > 0"),
    "unknown model": (["--model=fast"], "flag --model=fast"),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_bad_flag_values(case, capsys):
  args, message = FLAG_CASES[case]
  base = {"--profile": BK, "--iteration_time_ms": "128.1"}
  base.update(dict(a.split("=", 1) for a in args))
  _assert_cli_error(capsys, message, *[f"{k}={v}" for k, v in base.items()])


# ---------------------------------------------------------------------------------------------------
# Fuzzing: byte-level mutations give a valid result or a ProfileError, never another exception.


def _mutate(data: bytes, rng: random.Random) -> bytes:
  data = bytearray(data)
  alphabet = b"0123456789,.-+eE\n\r \tnaif\x00\xff{}[]\":"
  for _ in range(rng.randint(1, 4)):
    op = rng.randrange(4)
    i = rng.randrange(len(data) + 1)
    if op == 0 and i < len(data):
      data[i] = rng.choice(alphabet) if rng.random() < 0.8 else rng.randrange(256)
    elif op == 1 and i < len(data):
      del data[i:i + rng.randint(1, 8)]
    elif op == 2:
      data[i:i] = bytes([rng.choice(alphabet)])
    else:
      j = rng.randrange(len(data) + 1)
      data[i:i] = data[j:j + rng.randint(1, 40)]
  return bytes(data)


def test_random_mutations_give_a_result_or_a_profile_error(tmp_path):
  rng = random.Random(20200610)
  table = cost_tables.read_cost_table(COST)
  model = whatif.paper_model(table)
  good_json = tmp_path / "good.json"
  profiles.write_profile(str(good_json), profiles.read_bk_log(os.path.join(DATA, "vgg16.bk.log"), 0.1945))
  sources = [os.path.join(DATA, f) for f in ("resnet50.bk.log", "resnet101.bk.log", "vgg16.bk.log", "cuda_vec_add.log")]
  sources.append(str(good_json))
  outcomes = {"valid": 0, "error": 0}
  for trial in range(200):
    source = sources[trial % len(sources)]
    path = tmp_path / f"m{trial}{os.path.splitext(source)[1]}"
    path.write_bytes(_mutate(open(source, "rb").read(), rng))
    try:
      if source.endswith("cuda_vec_add.log"):
        model_with_table = whatif.paper_model(cost_tables.read_cost_table(str(path)))
        whatif.predict(profiles.read_bk_log(BK, 0.1281), model_with_table, 16, 1e10)
      else:
        profile = profiles.read_any_profile(str(path), 0.2)
        whatif.predict(profile, model, 16, 1e10, 2.0)
        whatif.needed_compression(profile, model, 4, 1e9, 0.9)
      outcomes["valid"] += 1
    except ProfileError as e:
      assert str(e).startswith(str(path)), str(e)
      outcomes["error"] += 1
  assert outcomes["valid"] > 10 and outcomes["error"] > 10, outcomes


def test_vendored_files_match_the_shared_copy():
  shared = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                        "training-bottleneck")
  if not os.path.isdir(shared):
    pytest.skip("no shared data directory beside the checkout")
  for name in ("resnet50.bk.log", "resnet101.bk.log", "vgg16.bk.log", "cuda_vec_add.log", "LICENSE"):
    assert open(os.path.join(DATA, name), "rb").read() == open(os.path.join(shared, name), "rb").read(), name
  assert "netx-repo/training-bottleneck" in open(os.path.join(DATA, "NOTICE")).read()
