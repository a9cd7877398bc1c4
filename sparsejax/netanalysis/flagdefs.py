"""absl flag definitions shared by the netanalysis commands."""

import sys

from absl import flags


def define_flag(kind: str, name: str, *args, **kwargs) -> None:
  """``flags.DEFINE_<kind>(name, *args, **kwargs)``, listed under the calling module's ``--help``.

  Commands share flag names (``--json``, ``--probe``, ``--link_capacity``, each meaning the same thing)
  and several commands may run one after another in one process (tests): a flag that exists already is
  not defined again, only listed for the caller too.
  """
  module = sys._getframe(1).f_globals["__name__"]
  if name in flags.FLAGS:
    if name not in {f.name for f in flags.FLAGS.get_flags_for_module(module)}:
      flags.FLAGS.register_flag_by_module(module, flags.FLAGS[name])
    return
  getattr(flags, f"DEFINE_{kind}")(name, *args, module_name=module, **kwargs)
