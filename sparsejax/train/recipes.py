"""Network recipes: named sets of settings (width, depth, regularisers, learning rate) that a run can take whole.

A sample's cost in a SLIDE network is ``nnz x d0`` in the input layer and ``k x d`` in the output layer, not
``N x d``: capacity is what sparsity makes cheap. The recipes span that trade, from the fastest step to the most
capacity; :mod:`sparsejax.train.search` picks one per run by measurement on the validation split (``--recipe=auto``), or
the user names one (``--recipe=wide``)::

  config = recipes.apply(config, recipes.get("wide"))   # its settings where the config has the defaults

A recipe's settings apply only where the config still has the default: a setting given explicitly wins.
"""

from typing import Any, NamedTuple

from sparsejax.config import Config
from sparsejax.settings import ConfigError, flat_items, non_default_settings, override


class Recipe(NamedTuple):
  """A named set of settings.

  Attributes:
    name: the ``--recipe`` value.
    settings: ``(name, value)`` pairs of :class:`sparsejax.config.Config` settings (hashable).
    summary: one line for the log and ``--help``.
  """
  name: str
  settings: tuple[tuple[str, Any], ...]
  summary: str


# Measured on GCIDE cloze (21K labels) on 2 cores, 150 s each, test P@1 of the selected state (benchmarks/RESULTS.md,
# "Recipes"): small 0.0949 (peaks after 38 s, then memorises), 512 wide 0.1021, with dropout 0.25 and 512 active
# neurons 0.1028 at twice the speed, 1024 wide with dropout 0.5, 512 active neurons and a rate of 2e-3 0.1003 and
# still rising at 150 s. Not adopted: input dropout 0.2 (0.0972), a second hidden layer (1024 then 256: 0.0726).
RECIPES = (
    Recipe("small", (), "one hidden layer of 128 (the defaults): the fastest step"),
    Recipe("wide", (("hidden_dims", (512,)), ("dropout", 0.25), ("active_k", 512)),
           "one hidden layer of 512, dropout 0.25, 512 active neurons"),
    Recipe("wider", (("hidden_dims", (1024,)), ("dropout", 0.5), ("active_k", 512), ("learning_rate", 2e-3)),
           "one hidden layer of 1024, dropout 0.5, 512 active neurons, learning rate 2e-3"),
)

AUTO = "auto"
NONE = "none"  # no recipe and no search: the settings as given


def names() -> tuple[str, ...]:
  return tuple(r.name for r in RECIPES)


def get(name: str) -> Recipe:
  """The recipe called ``name``; a :class:`ConfigError` naming the choices otherwise."""
  for recipe in RECIPES:
    if recipe.name == name:
      return recipe
  raise ConfigError("recipe", name, f"must be one of {', '.join((AUTO, NONE, *names()))}")


def with_given_settings(config: Config, given: set[str]) -> Config:
  """``config`` as a command line meant it, knowing which settings it gave (``given``: names of the flags set).

  A recipe setting given explicitly skips the search (``--recipe=auto`` becomes ``none``), even at its default
  value, which :func:`explicit_settings` cannot tell from an unset one. With a named recipe, a setting given at its
  default where the recipe sets another value is refused: the recipe would replace it (``--recipe=none`` takes every
  setting as given).
  """
  named = [name for name in recipe_settings() if name in given]
  if not named:
    return config
  if config.search.recipe == AUTO:
    return override(config, recipe=NONE)
  if config.search.recipe == NONE:
    return config
  now, changed = flat_items(config), non_default_settings(config)
  recipe = dict(get(config.search.recipe).settings)
  for name in named:
    if name in recipe and name not in changed and recipe[name] != now[name]:
      raise ConfigError(name, now[name], f"is the default, which --recipe={config.search.recipe} replaces by "
                        f"{recipe[name]}: give --recipe=none to take every setting as given")
  return config


def recipe_settings() -> tuple[str, ...]:
  """The names of the settings that some recipe sets, in a fixed order."""
  seen = {}
  for recipe in RECIPES:
    seen.update((name, None) for name, _ in recipe.settings)
  return tuple(seen)


def explicit_settings(config: Config) -> list[str]:
  """The recipe settings that ``config`` sets away from their defaults (``--name=value`` strings' names)."""
  changed = non_default_settings(config)
  return [name for name in recipe_settings() if name in changed]


def trained(config: Config) -> str:
  """The recipe that a run of ``config`` trains, as its records name it: a recipe's name, or ``none`` (the settings
  as given) where no recipe applies: ``--recipe=none``, or ``auto`` where no search chose one (a dense model, a
  budget too small to compare recipes, recipe settings given, no validation split, several processes)."""
  return NONE if config.search.recipe == AUTO else config.search.recipe


def apply(config: Config, recipe: Recipe) -> Config:
  """``config`` with ``recipe`` named and its settings where ``config`` has the default."""
  changed = non_default_settings(config)
  changes = {name: value for name, value in recipe.settings if name not in changed}
  return override(config, recipe=recipe.name, **changes)
