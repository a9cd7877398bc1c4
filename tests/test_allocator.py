"""The allocator a command runs with (sparsejax/train/allocator.py): the environment it chooses, and that the
process it runs again faults far fewer pages for a program's large temporaries than glibc's default does."""

import os
import subprocess
import sys
import textwrap

import pytest

from sparsejax.train import allocator

TC = "libtcmalloc_minimal.so.4"


def test_tcmalloc_is_preloaded_where_installed_after_the_users_preloads():
  new = allocator.environment({"PATH": "/bin", "LD_PRELOAD": "libmine.so"}, TC)
  assert new["LD_PRELOAD"] == f"{TC} libmine.so" and new["PATH"] == "/bin"
  assert "GLIBC_TUNABLES" not in new and new["SPARSEJAX_ALLOCATOR_APPLIED"] == "1"


def test_without_tcmalloc_glibc_is_asked_for_huge_pages_beside_the_users_tunables():
  assert allocator.environment({}, None)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  new = allocator.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, None)
  assert new["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1" and "LD_PRELOAD" not in new


@pytest.mark.parametrize("environ", [
    {"SPARSEJAX_ALLOCATOR": "system"},  # the user's choice
    {"SPARSEJAX_ALLOCATOR_APPLIED": "1"},  # already run again (or a rank of a command that was)
    {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},  # the user's own allocator
    {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},  # the user's own huge-page choice (without tcmalloc)
])
def test_the_process_is_left_as_it_started(environ):
  assert allocator.environment(environ, TC if "GLIBC_TUNABLES" not in environ else None) is None


def test_a_bad_choice_is_named():
  with pytest.raises(ValueError, match="SPARSEJAX_ALLOCATOR='fast': must be one of auto, tcmalloc, system"):
    allocator.environment({"SPARSEJAX_ALLOCATOR": "fast"}, TC)
  with pytest.raises(ValueError, match="no tcmalloc library found"):
    allocator.environment({"SPARSEJAX_ALLOCATOR": "tcmalloc"}, None)


# A program whose 32 MiB temporary ([64, 131072] float32 logits) glibc maps anew at each of 8 calls: its page faults
# after the warm-up call, and the allocator in force.
_FAULTS = textwrap.dedent("""
    import os, resource, sys
    from sparsejax.train import allocator
    allocator.adopt()
    import jax, jax.numpy as jnp
    w, x = jnp.ones((64, 131072), jnp.float32), jnp.ones((64, 64), jnp.float32)
    f = jax.jit(lambda x, w: jnp.max(jax.nn.log_softmax(x @ w), axis=1))
    f(x, w).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
      f(x, w).block_until_ready()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, os.getpid(), sys.argv[1])
""")


def _faults(choice: str) -> tuple[int, int, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEJAX_ALLOCATOR")}
  env.update(SPARSEJAX_ALLOCATOR=choice, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-c", _FAULTS, "argument"], stdout=subprocess.PIPE, text=True, env=env)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0
  faults, pid, argument = out.split()
  assert int(pid) == proc.pid  # run again in the same process, with its arguments
  return int(faults), int(pid), argument


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and exec: Linux")
def test_the_chosen_allocator_reuses_large_temporaries_that_glibc_faults_in_at_every_call():
  system, _, _ = _faults("system")
  chosen, _, argument = _faults("auto")
  assert argument == "argument"
  assert system > 8 * 32 * 256 // 2  # glibc: at least half the temporaries' 4 KiB pages, at each call
  assert chosen < system / 4, (chosen, system)
