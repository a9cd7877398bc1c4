"""compile_clock: the seconds JAX spent compiling, which a measured step time leaves out (issue 48)."""

import time

import jax
import jax.numpy as jnp

from sparsejax.train import compile_clock


def test_a_new_program_adds_its_compilation_and_a_compiled_one_adds_nothing():
  x = jnp.ones((64, 64))
  f = jax.jit(lambda x: jnp.tanh(x @ x.T) @ x + time.time_ns() % 1)  # a program of its own (traced here)
  before = compile_clock.seconds()
  t = time.perf_counter()
  f(x).block_until_ready()
  first_call = time.perf_counter() - t
  compiled = compile_clock.seconds() - before
  assert 0 < compiled <= first_call
  again = compile_clock.seconds()
  for _ in range(3):
    f(x).block_until_ready()
  assert compile_clock.seconds() == again
  f(jnp.ones((32, 64))).block_until_ready()  # another shape: another program
  assert compile_clock.seconds() > again
