"""Input errors shared by every netanalysis module (rates: :mod:`sparsejax.rates`)."""


class ProfileError(ValueError):
  """Bad input to netanalysis. The message starts with where: ``PATH:LINE:`` (or ``PATH: $.key:``)."""
