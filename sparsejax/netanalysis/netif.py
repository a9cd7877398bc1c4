"""Network interface byte counters: which interface carries the job's traffic, and its tx/rx over time.

Linux only (``/sys/class/net/IFACE/statistics``). On a real host the counters include every other
flow on that interface, not just the job's collectives; on one machine running several processes
over loopback, ``lo`` counts all of them together.
"""

import fcntl
import os
import socket
import struct
import threading
import time

_SIOCGIFADDR = 0x8915
SYS_NET = "/sys/class/net"


def interface_addresses() -> dict[str, str]:
  """IPv4 address of each interface that has one (``{"lo": "127.0.0.1", "eth0": ...}``)."""
  out = {}
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for _, name in socket.if_nameindex():
      try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
      except OSError:
        continue
      out[name] = socket.inet_ntoa(packed[20:24])
  return out


def advertised_address() -> str:
  """The address this process's collectives use: what its hostname resolves to (gloo advertises that)."""
  return socket.gethostbyname(socket.gethostname())


def resolve_interface(name: str = "auto") -> str | None:
  """The interface to count: ``name`` itself, or for ``"auto"`` the one holding :func:`advertised_address`.

  Returns:
    the interface name, or None when ``"auto"`` finds none or counters are unavailable (not Linux).

  Raises:
    ValueError: an explicit ``name`` that is not an interface of this host.
  """
  if not os.path.isdir(SYS_NET):
    return None
  if name != "auto":
    if not os.path.isdir(os.path.join(SYS_NET, name)):
      raise ValueError(f"netanalysis_iface={name!r}: no such interface (have {', '.join(sorted(os.listdir(SYS_NET)))})")
    return name
  try:
    address = advertised_address()
  except OSError:
    return None
  if address.startswith("127."):
    return "lo"
  for iface, addr in interface_addresses().items():
    if addr == address:
      return iface
  return None


def read_counters(iface: str) -> tuple[int, int]:
  """``(tx_bytes, rx_bytes)`` of ``iface`` since boot."""
  base = os.path.join(SYS_NET, iface, "statistics")
  with open(os.path.join(base, "tx_bytes")) as tx, open(os.path.join(base, "rx_bytes")) as rx:
    return int(tx.read()), int(rx.read())


class CounterSampler:
  """Samples an interface's counters every ``period`` seconds on a background thread.

  ``samples`` holds ``(time.time(), tx_bytes, rx_bytes)``; one sample is taken at start and one at stop.
  """

  def __init__(self, iface: str, period: float = 0.01):
    self.iface, self.period = iface, period
    self.samples: list[tuple[float, int, int]] = []
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _sample(self):
    self.samples.append((time.time(), *read_counters(self.iface)))

  def _run(self):
    while not self._stop.wait(self.period):
      self._sample()

  def start(self) -> "CounterSampler":
    self._sample()
    self._thread = threading.Thread(target=self._run, name="netanalysis-counters", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> list[tuple[float, int, int]]:
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
      self._sample()
    return self.samples
