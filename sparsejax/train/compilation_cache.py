"""JAX's persistent compilation cache for the commands, on by default in a per-user directory.

Every run compiles its programs first (seconds at any size); the cache keeps the compiled programs across runs, so
a second run of the same shapes starts without compiling. The commands (``sparsejax-train``, ``sparsejax-predict``
and so ``sparsejax-launch``'s ranks) call :func:`configure` with their ``--compilation_cache`` before JAX creates
its backend:

* ``auto`` (the default): ``$JAX_COMPILATION_CACHE_DIR`` where it is set, else the per-user directory
  :func:`default_directory`, ``$XDG_CACHE_HOME/sparsejax/jax/<CPU>`` or ``~/.cache/sparsejax/jax/<CPU>``;
* a directory: that one;
* ``none``: no cache.

The entries are native code for the CPU that compiled them, so the default directory has one subdirectory per CPU
model and instruction set (a home directory shared by different machines keeps them apart), and it is created
private to the user (mode 0700): no one else can put code there. A directory that cannot be used (not writable,
not the user's own) is named in a warning and the command compiles without a cache.
"""

import functools
import hashlib
import importlib.util
import inspect
import os
import platform
import tempfile
import warnings

AUTO, NONE = "auto", "none"
# JAX's own settings of the cache, read from the environment when jax is imported.
DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
MIN_ENTRY_SIZE_ENV = "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"
# JAX's names of a bounded cache's files (jax/_src/lru_cache.py): an entry and its access time (8 bytes, ns, little
# endian), by which the least recently used entries are evicted.
_CACHE_SUFFIX, _ATIME_SUFFIX = "-cache", "-atime"
# The default directory's bound: the least recently used entries go beyond it (where JAX can lock the directory).
MAX_BYTES = 2 << 30


def cpu_id() -> str:
  """A short name of this CPU's model and instruction set (``x86_64-1a2b3c4d5e6f``): compiled code is for it."""
  description = [platform.machine(), platform.processor()]
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part")):
          description.append(" ".join(line.split()))
        elif not line.strip() and len(description) > 2:  # the first processor's block is enough
          break
  except OSError:  # not Linux: the machine and processor names stand for it
    pass
  return f"{platform.machine() or 'cpu'}-{hashlib.sha256(chr(10).join(description).encode()).hexdigest()[:12]}"


def default_directory() -> str:
  """The per-user cache: ``$XDG_CACHE_HOME/sparsejax/jax/<CPU>``, else ``~/.cache/sparsejax/jax/<CPU>``."""
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache_home, "sparsejax", "jax", cpu_id())


def resolve(setting: str | None) -> tuple[str | None, bool]:
  """``(directory or None, whether it is the per-user default)`` that ``--compilation_cache=setting`` names."""
  setting = (setting or AUTO).strip()
  if setting.lower() == NONE:
    return None, False
  if setting.lower() == AUTO:
    if os.environ.get(DIR_ENV):
      return os.environ[DIR_ENV], False
    return default_directory(), True
  return os.path.abspath(os.path.expanduser(setting)), False


def unusable(directory: str, private: bool) -> str | None:
  """Why ``directory`` cannot hold the cache (creating it first), or None. ``private``: it must be the user's own
  and writable by no one else (the per-user default)."""
  try:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if private and hasattr(os, "getuid"):
      status = os.stat(directory)
      if status.st_uid != os.getuid():
        return "it belongs to another user"
      if status.st_mode & 0o022:
        return "others can write to it"
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
      pass
  except OSError as e:
    return f"cannot write there ({e.strerror or e})"
  return None


def configure(setting: str | None) -> tuple[str | None, str | None]:
  """Turns JAX's persistent compilation cache on in the directory ``setting`` names (see the module), or off.

  Call after importing jax and before it compiles anything. Small programs are cached too (JAX's defaults skip
  compilations under 1 s, most of a small run's), unless the environment sets JAX's thresholds.

  Returns:
    ``(directory used or None, warning or None)``: the warning says why a directory named could not be used (the
    command then compiles without a cache).
  """
  import jax  # deferred: the commands' flags import this module before JAX may start

  directory, is_default = resolve(setting)
  if directory is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None, None
  problem = unusable(directory, private=is_default)
  if problem is not None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None, f"compilation cache {directory}: {problem}; compiling without it"
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  if MIN_COMPILE_TIME_ENV not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if MIN_ENTRY_SIZE_ENV not in os.environ:
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no minimum, whatever the filesystem
  if is_default and importlib.util.find_spec("filelock") is not None:  # JAX needs it to bound a cache
    restore_access_times(directory)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  write_from_every_process()
  return directory, None


def write_from_every_process() -> bool:
  """Lets every process of a multi-process job write its own programs to the cache, not only process 0.

  JAX writes entries from process 0 alone (against contention on shared filesystems), but a CPU program's key
  hashes the topology of the process that compiles it, so each rank's keys are its own: the other ranks' programs
  were never cached, and each of them compiled every program again in every run while the others waited for it in
  the first collective (a 2-process, 24-step run: rank 1 missed all 24 of its programs, run after run). Different
  keys do not contend. CPU programs only: on GPUs JAX makes the keys the same on every process, and process 0 alone
  writes them, as before. Where JAX's private ``_cache_write`` is not the one this was written against (JAX
  0.10-0.12), nothing changes.

  Returns:
    Whether the writes of the other processes are on.
  """
  try:
    from jax._src import compilation_cache as jax_cache, compiler, config, distributed  # noqa: I001 deferred: after jax
    original = compiler._cache_write
    signature = inspect.signature(original)
    min_compile_seconds = config.persistent_cache_min_compile_time_secs
    put = jax_cache.put_executable_and_time
  except (ImportError, AttributeError, TypeError, ValueError):  # another JAX: as it is
    return False
  if getattr(original, "from_every_process", False):
    return True
  if not {"cache_key", "compile_time_secs", "module_name", "backend", "executable"} <= set(signature.parameters):
    return False
  should_raise = getattr(compiler, "_should_raise_persistent_cache_error", lambda e: False)

  @functools.wraps(original)
  def cache_write(*args, **kwargs):
    given = signature.bind(*args, **kwargs).arguments
    # Process 0, and every process on GPUs, whose keys JAX makes the same on every process (one writer, as JAX's).
    if distributed.global_state.process_id == 0 or getattr(given["backend"], "platform", "cpu") != "cpu":
      return original(*args, **kwargs)
    if given.get("host_callbacks") or given["compile_time_secs"] < min_compile_seconds.value:
      return None  # as process 0 would: programs with host callbacks, or quicker to compile than the threshold
    try:
      put(given["cache_key"], given["module_name"], given["executable"], given["backend"],
          int(given["compile_time_secs"]))
    except Exception as e:  # a full disk or a racing writer: the program runs all the same, as JAX's own write
      if should_raise(e):
        raise
      warnings.warn(f"Error writing persistent compilation cache entry for '{given['module_name']}': "
                    f"{type(e).__name__}: {e}", stacklevel=2)
    return None

  cache_write.from_every_process = True
  compiler._cache_write = cache_write
  return True


def restore_access_times(directory: str) -> list[str]:
  """Gives each entry of a bounded cache that has no access-time file one (its modification time); returns them.

  JAX writes an entry (``KEY-cache``), then its access time (``KEY-atime``); a process killed between the two
  (Ctrl-C while a program is being cached) leaves an entry without one, and from then on JAX's eviction, which reads
  every entry's access time before each write, fails: no program is cached again in that directory, each write a
  warning ("Error writing persistent compilation cache entry ... FileNotFoundError"). Writing the missing time is
  safe beside a process that is caching that entry right now (it writes its own time after).
  """
  restored = []
  try:
    names = set(os.listdir(directory))
  except OSError:
    return restored
  for name in sorted(names):
    key = name.removesuffix(_CACHE_SUFFIX)
    if key == name or key + _ATIME_SUFFIX in names:
      continue
    try:
      mtime = os.stat(os.path.join(directory, name)).st_mtime_ns
      with open(os.path.join(directory, key + _ATIME_SUFFIX), "xb") as f:  # "x": never over another's time
        f.write(mtime.to_bytes(8, "little"))
      restored.append(key)
    except OSError:  # gone, or its time written meanwhile
      pass
  return restored
