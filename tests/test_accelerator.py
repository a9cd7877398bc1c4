"""The dense baseline off the CPU: where XLA compiles for an accelerator, the ops that ``--model=dense`` runs (the
input layer, exact top-k) take their ``jnp`` twins instead of the CPU kernels.

There is no accelerator here, so: the twins are compared with the kernels on CPU; the dense programs are lowered
for CUDA (``jax.export`` needs no GPU) and must hold no sparsejax kernel, while their CPU lowering must; the dense
model trained on the twins must match the one trained on the kernels; and the command line refuses what cannot
run, in one line, before anything is written. Training, ``sparsejax.fit``, ``sparsejax.load`` and
``sparsejax-predict`` decide by one check (``sparsejax.platforms``) and pin JAX to the platform asked for.
"""

import functools
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import sparsejax
from sparsejax import _ffi, data, dense, inference, ops, platforms, selection
from sparsejax.config import Config
from sparsejax.model_config import ModelConfig
from sparsejax.settings import override


def _gather_data(weight_dtype=jnp.float32, seed=0, B=6, k=9, N=40, d=12):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, N, size=(B, k)).astype(np.int32)
  ids[0, 0] = ids[0, 1]  # a duplicate within a row
  ids[1, -3:] = -1  # padding
  ids[2, :] = -1  # a row of padding only
  return (jnp.asarray(rng.normal(size=(B, d)), jnp.float32), jnp.asarray(rng.normal(size=(N, d)), weight_dtype),
          jnp.asarray(ids), jnp.asarray(rng.normal(size=(N,)), jnp.float32),
          jnp.asarray(rng.normal(size=(B, k)), jnp.float32))


@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.bfloat16])
def test_the_jnp_gathers_match_the_kernels(weight_dtype):
  x, w, ids, bias, g = _gather_data(weight_dtype)
  for b in (bias, None):
    np.testing.assert_allclose(ops.gather_dot_jnp(x, w, ids, np.zeros(0, np.float32) if b is None else b),
                               ops.gather_dot(x, w, ids, b), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ops.gather_combine_jnp(g, w, ids), ops.gather_combine(g, w, ids), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(ops.gather_dot_jnp(x, w, ids, bias))[2] == 0)  # padding contributes nothing


@pytest.mark.parametrize("B,k,N,d", [(3, 2, 0, 4), (3, 0, 5, 4), (0, 2, 5, 4), (3, 2, 5, 0), (0, 0, 0, 0)])
def test_the_jnp_gathers_trace_and_agree_at_empty_sizes(B, k, N, d):
  """Both branches are traced wherever an op is, so the twin must trace at every size the kernel takes (the op
  fuzzer found N = 0 refused by jnp.take)."""
  x, g = jnp.ones((B, d), jnp.float32), jnp.ones((B, k), jnp.float32)
  w, bias, ids = jnp.ones((N, d), jnp.float32), jnp.ones((N,), jnp.float32), jnp.full((B, k), -1, jnp.int32)
  for fn in (jax.jit(ops.gather_dot), ops.gather_dot):
    np.testing.assert_array_equal(fn(x, w, ids, bias), ops.gather_dot_jnp(x, w, ids, bias))
  np.testing.assert_array_equal(ops.gather_combine(g, w, ids), ops.gather_combine_jnp(g, w, ids))
  np.testing.assert_array_equal(ops.gather_dot_jnp(x, w, ids, bias), np.zeros((B, k)))  # padding only


def _scores_with_every_tie_and_nan():
  rng = np.random.default_rng(3)
  s = rng.normal(size=(6, 40)).astype(np.float32)
  s[0, [3, 5]] = [np.nan, -np.nan]  # NaNs of both signs rank last
  s[1, :] = 0.0
  s[1, [7, 30]] = -0.0  # -0 == +0: ties, lower column first
  s[2, :4], s[2, 4:] = -np.inf, np.nan  # -inf still ranks above NaN
  s[3, ::2] = 1.5  # many equal maxima
  s[4, :] = np.nan
  s[5, :] = [np.finfo(np.float32).max, np.finfo(np.float32).tiny, -np.finfo(np.float32).tiny, np.inf] * 10
  return jnp.asarray(s)


@pytest.mark.parametrize("k", [1, 7, 40])
def test_the_jnp_row_topk_ranks_as_the_kernel_does(k):
  s = _scores_with_every_tie_and_nan()
  values, columns = jax.jit(selection.row_topk_jnp, static_argnums=1)(s, k)
  want_values, want_columns = selection.row_topk(s, k)
  np.testing.assert_array_equal(columns, want_columns)
  np.testing.assert_array_equal(values, want_values)  # NaN where NaN (assert_array_equal takes NaN == NaN)
  # and both against the order written out: score descending, -0 == +0, lower column first, NaN last
  key = np.where(np.isnan(s), -np.inf, s)
  order = [sorted(range(s.shape[1]), key=lambda c, r=r: (np.isnan(s[r, c]), -key[r, c], c))[:k]
           for r in range(s.shape[0])]
  np.testing.assert_array_equal(columns, order)


@functools.cache
def _dense_programs():
  config = ModelConfig.from_config(Config(), 100, 30)
  state = jax.eval_shape(functools.partial(dense.init, config=config), jax.random.key(0))
  B, F, M = 4, 6, 2
  batch = {"feat_ids": jax.ShapeDtypeStruct((B, F), jnp.int32), "feat_vals": jax.ShapeDtypeStruct((B, F), jnp.float32),
           "labels": jax.ShapeDtypeStruct((B, M), jnp.int32)}
  return [(jax.jit(functools.partial(dense.train_step, config=config)), (state, batch)),
          (jax.jit(functools.partial(inference.predict_exact, top=5)), (state, batch["feat_ids"], batch["feat_vals"]))]


def test_the_dense_baseline_lowers_for_cuda_without_the_cpu_kernels():
  """Its training step and exact prediction compile for a GPU (no sparsejax kernel in them); on CPU, the same
  programs call the kernels (embedding_bag's gather_combine, row_topk)."""
  for fn, args in _dense_programs():
    cuda = export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "stablehlo" in cuda and "sparsejax_" not in cuda
  cpu = [fn.lower(*args).as_text() for fn, args in _dense_programs()]
  assert "sparsejax_gather_combine" in cpu[0]
  assert "sparsejax_gather_combine" in cpu[1] and "sparsejax_row_topk" in cpu[1]


def _train_dense(steps=25):
  from sparsejax.data import make_synthetic

  data = make_synthetic(512, 200, 60, seed=1)
  config = ModelConfig.from_config(override(Config(), hidden_dims=(32,), batch_size=64, learning_rate=3e-3), 200, 60)
  state = dense.init(jax.random.key(0), config)
  step = jax.jit(functools.partial(dense.train_step, config=config))
  losses = []
  for i in range(steps):
    fi, fv, labels = data.to_padded(np.arange(64) + (64 * i) % 448, 16, 4)
    state, metrics = step(state, {"feat_ids": fi, "feat_vals": fv, "labels": labels})
    losses.append(float(metrics["loss"]))
  fi, fv, _ = data.to_padded(np.arange(448, 512), 16, 4)
  scores, ids = inference.predict_exact(state, fi, fv, top=5)
  return np.array(losses), state, np.asarray(scores), np.asarray(ids)


def test_the_dense_baseline_trains_the_same_on_the_jnp_twins(monkeypatch):
  """What a GPU runs, run on CPU: every kernel call takes its jnp twin. The same losses, parameters and
  predictions, up to the order of float sums."""
  kernels = _train_dense()
  monkeypatch.setattr(_ffi, "on_cpu", lambda kernel, portable, *args: portable(*args))
  jax.clear_caches()  # module-level jitted functions traced with the kernels must trace again
  try:
    twins = _train_dense()
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  np.testing.assert_allclose(twins[0], kernels[0], rtol=1e-4)
  assert kernels[0][-1] < kernels[0][0] - 0.5  # it learned something
  for a, b in zip(jax.tree.leaves(twins[1]), jax.tree.leaves(kernels[1])):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
  np.testing.assert_allclose(twins[2], kernels[2], rtol=1e-4, atol=1e-5)
  assert np.mean(twins[3] == kernels[3]) > 0.95


@pytest.mark.parametrize("args,message", [
    ("--platform=tpu", "--platform=tpu: must be one of cpu, cuda, rocm"),
    ("--platform=cuda", "--platform=cuda: an accelerator runs model=dense only (the full-softmax baseline), not "
     "model=slide: SLIDE's kernels"),
    ("--platform=cuda --model=dense --num_processes=2", "--platform=cuda runs in one process"),
    ("--platform=cuda --model=dense", "--platform=cuda: JAX has no cuda device here"),
])
def test_a_platform_that_cannot_run_ends_the_command_in_one_line(tmp_path, installed_command, args, message):
  if "no cuda device" in message and jax.devices("cpu") and _has_cuda():
    pytest.skip("this machine has a CUDA device")
  workdir = tmp_path / "wd"
  out = subprocess.run([installed_command("sparsejax-train"), *args.split(), f"--workdir={workdir}"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"sparsejax-train: error: {message}"), out.stderr[-2000:]
  assert not workdir.exists()  # nothing was started


def _has_cuda() -> bool:
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


# --- One platform check for training and serving (issue 35) ------------------------------------------------------


def test_the_platform_check_allows_slide_on_cpus_only_and_the_dense_model_anywhere():
  assert [platforms.problem(p, m) for p in ("cpu", "cuda", "rocm") for m in ("slide", "dense")] == \
      [None, None, platforms.problem("cuda", "slide"), None, platforms.problem("rocm", "slide"), None]
  assert platforms.problem("cuda", "slide") == (
      "an accelerator runs model=dense only (the full-softmax baseline), not model=slide: SLIDE's kernels (its index, "
      "the sampled softmax, row-sparse Adam) are CPU code; use cpu")
  assert platforms.problem("tpu", "dense") == platforms.problem("tpu") == "must be one of cpu, cuda, rocm"
  assert platforms.problem("cuda") is None  # the model not known yet: the name only
  # A model name no kind has (a damaged config.json that load reads): refused with the message, not a KeyError.
  assert platforms.problem("cuda", "foo") == platforms.problem("cuda", "slide").replace("model=slide:", "model=foo:")


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, small_config):
  """A SLIDE run and a dense run, 20 steps each: ``{model: workdir}``, and the test set as an XC file."""
  from sparsejax.train import train_and_evaluate

  root = tmp_path_factory.mktemp("platforms")
  runs = {}
  for name in ("slide", "dense"):
    config = override(small_config, model=name, max_steps=20, eval_every=20)
    train_and_evaluate(config, str(root / name))
    runs[name] = str(root / name)
  test_file = root / "test.txt"
  data.save_xc_file(data.load_dataset(config.data, seed=config.run.seed).test, str(test_file))
  return runs, str(test_file)


def test_load_refuses_a_platform_that_cannot_run_the_model(trained_runs):
  runs, _ = trained_runs
  with pytest.raises(platforms.PlatformError, match=r"^platform='cuda': an accelerator runs model=dense only .*, "
                     r"not model=slide: SLIDE's kernels"):
    sparsejax.load(runs["slide"], platform="cuda")
  with pytest.raises(ValueError, match=r"^platform='tpu': must be one of cpu, cuda, rocm$"):
    sparsejax.load(runs["dense"], platform="tpu")
  if _has_cuda():
    pytest.skip("this machine has a CUDA device: this process's JAX may run there")
  # A dense model may go to a GPU, but this process's JAX runs on its CPUs already, as fit says.
  with pytest.raises(RuntimeError, match=r"^platform='cuda': JAX already runs on cpu in this process, and it cannot "
                     r"change once started: call load before"):
    sparsejax.load(runs["dense"], platform="cuda")
  assert sparsejax.load(runs["slide"]).step == 20  # platform="cpu", the default


@pytest.mark.parametrize("args,message", [
    ("--platform=cuda", "--platform=cuda: an accelerator runs model=dense only (the full-softmax baseline), not "
     "model=slide: SLIDE's kernels"),
    ("--platform=tpu", "--platform=tpu: must be one of cpu, cuda, rocm"),
])
def test_predict_refuses_a_platform_that_cannot_run_the_model_in_one_line(trained_runs, installed_command, args,
                                                                         message):
  runs, test_file = trained_runs
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={runs['slide']}", f"--input={test_file}",
                        *args.split()], capture_output=True, text=True, timeout=120)
  assert out.returncode == 2 and not out.stdout, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"sparsejax-predict: error: {message}"), out.stderr[-2000:]


def test_load_and_predict_run_on_the_cpus_whatever_jax_platforms_says(trained_runs, installed_command, run_python):
  """JAX_PLATFORMS=cuda (a GPU machine's setting, or none here: JAX then fails to start) does not move serving off
  the CPUs, where SLIDE's kernels run: both pin the platform, as training does."""
  runs, test_file = trained_runs
  env = dict(os.environ, JAX_PLATFORMS="cuda")
  out = subprocess.run([installed_command("sparsejax-predict"), f"--workdir={runs['slide']}", f"--input={test_file}",
                        "--top=3"], capture_output=True, text=True, timeout=120, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  expected = sparsejax.load(runs["slide"]).predict(data.load_xc_file(test_file), top=3)[1]
  written = [[int(pair.split(":")[0]) for pair in line.split("\t")] for line in out.stdout.splitlines()]
  np.testing.assert_array_equal(written, expected)
  out = run_python(code=f"""
      import jax, sparsejax
      model = sparsejax.load({runs['slide']!r})
      print(jax.devices()[0].platform, model.params.out.w.devices().pop().platform)
  """, env={"JAX_PLATFORMS": "cuda"})
  assert out.stdout.split() == ["cpu", "cpu"]
