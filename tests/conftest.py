"""Shared pytest options: ``--fuzz-long`` runs the fuzz tests with many more examples."""

import pytest

FUZZ_LONG_FACTOR = 25


def pytest_addoption(parser):
  parser.addoption("--fuzz-long", action="store_true", default=False,
                   help=f"run the fuzz tests with {FUZZ_LONG_FACTOR}x more (and randomly seeded) examples")


@pytest.fixture
def fuzz_settings(request):
  """``fuzz_settings(n)``: hypothesis settings for n examples (derandomized), or 25 n random ones with --fuzz-long."""
  from hypothesis import HealthCheck, settings

  long = request.config.getoption("--fuzz-long")

  def make(max_examples: int):
    return settings(max_examples=max_examples * (FUZZ_LONG_FACTOR if long else 1), derandomize=not long,
                    deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

  return make
