"""Emulated hosts on one Linux machine: network namespaces on a bridge, each link limited with ``tc tbf``
(``benchmarks/cluster.py`` and ``benchmarks/cluster_resume.py``). Needs root and iproute2.

``ip netns exec`` mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts``: gloo, which advertises the address its hostname
resolves to, then advertises the namespace's own.
"""

import os
import shutil
import socket
import subprocess
import sys

NS_PREFIX = "sjns"
BRIDGE = "sjbr0"
SUBNET = "10.77.0"


def sh(*cmd, check=True):
  return subprocess.run(cmd, check=check, capture_output=True, text=True)


def default_burst(rate: str) -> int:
  """tbf bucket in bytes: 2 ms worth of ``rate``, at least 4 KiB."""
  from sparsejax.rates import parse_rate
  return max(4096, int(parse_rate(rate) / 8 * 0.002))


def default_queue(rate: str) -> int:
  """tbf queue limit in bytes: 100 ms worth of ``rate``, at least 1 MiB.

  With tc's usual ``latency 100ms`` the queue holds only 125 kB at 10 Mbit/s: a TCP window overflows it,
  packets drop (0.5-1.5% in a 10 Mbit/s validation run) and retransmission timeouts cut what the link
  delivers to ~75% of its rate for 512 KiB all-reduces. A 1 MiB queue makes the link deliver its rate.
  """
  from sparsejax.rates import parse_rate
  return max(1 << 20, int(parse_rate(rate) / 8 * 0.1))


def setup_namespaces(n: int, rate: str | None, burst: int | None = None) -> list[str]:
  """P namespaces on a bridge, each link rate-limited (tbf bucket ``burst`` bytes); returns their addresses."""
  hostname = socket.gethostname()
  sh("ip", "link", "add", BRIDGE, "type", "bridge")
  sh("ip", "link", "set", BRIDGE, "up")
  addrs = []
  for i in range(n):
    ns, addr = f"{NS_PREFIX}{i}", f"{SUBNET}.{i + 1}"
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", f"sjv{i}", "type", "veth", "peer", "name", f"sjp{i}")
    sh("ip", "link", "set", f"sjv{i}", "netns", ns)
    sh("ip", "link", "set", f"sjp{i}", "master", BRIDGE)
    sh("ip", "link", "set", f"sjp{i}", "up")
    sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", f"sjv{i}")
    sh("ip", "netns", "exec", ns, "ip", "link", "set", f"sjv{i}", "up")
    sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    if rate:
      sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"sjv{i}", "root", "tbf", "rate", rate,
          "burst", str(burst or default_burst(rate)), "limit", str(default_queue(rate)))
    # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: gloo, which
    # advertises the address its hostname resolves to, then advertises this one.
    os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
    with open(f"/etc/netns/{ns}/hosts", "w") as f:
      f.write(f"127.0.0.1 localhost\n{addr} {hostname}\n")
    addrs.append(addr)
  return addrs


def teardown_namespaces(n: int) -> None:
  for i in range(n):
    sh("ip", "netns", "del", f"{NS_PREFIX}{i}", check=False)
    sh("ip", "link", "del", f"sjp{i}", check=False)
    shutil.rmtree(f"/etc/netns/{NS_PREFIX}{i}", ignore_errors=True)
  sh("ip", "link", "del", BRIDGE, check=False)


def can_use_namespaces() -> str | None:
  """None if namespaces can be made here, else why not."""
  if not sys.platform.startswith("linux"):
    return "network namespaces need Linux"
  if os.geteuid() != 0:
    return "needs root (ip netns, tc)"
  if shutil.which("ip") is None or shutil.which("tc") is None:
    return "needs iproute2 (ip, tc)"
  probe = sh("ip", "netns", "add", f"{NS_PREFIX}probe", check=False)
  if probe.returncode != 0:
    return f"ip netns add failed: {probe.stderr.strip()}"
  sh("ip", "netns", "del", f"{NS_PREFIX}probe", check=False)
  return None


def cores_of(rank: int, processes: int) -> str:
  cpus = os.cpu_count() or 1
  if processes >= cpus:
    return str(rank % cpus)
  per = cpus // processes
  return f"{rank * per}-{rank * per + per - 1}"


def in_namespace(rank: int, command: list[str], processes: int, pin: bool = True) -> list[str]:
  """``command`` run in emulated host ``rank``'s namespace, pinned to its share of the cores (``pin``)."""
  if pin and shutil.which("taskset"):
    command = ["taskset", "-c", cores_of(rank, processes), *command]
  return ["ip", "netns", "exec", f"{NS_PREFIX}{rank}", *command]
