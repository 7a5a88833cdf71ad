"""A leaf-spine fabric of Linux network namespaces (needs root; no vLLM).

``LeafSpine(n_leaves, hosts_per_leaf, n_spines, rate_mbit)`` builds one
namespace per host, leaf and spine, with veth links shaped by ``tc tbf`` in
both directions: leaf-spine links at ``rate_mbit``, host NICs at
``host_rate_mbit`` (default: the same), and routes: hosts
default to their leaf; each leaf reaches the other leaves' hosts over an ECMP
route through every spine; spines route each leaf's /16 back to it.

ECMP hashing on the leaves is ``fib_multipath_hash_policy=3`` with
``fib_multipath_hash_fields=0x37`` (addresses, protocol, both ports, dissected
per packet). With policy 1 a locally generated TCP flow's path follows the
socket's random ``sk_txhash`` instead of its ports (measured: the same
5-tuple took different spines on repeats), so no source-port scheme could
steer it; policy 3 makes a path a function of the 5-tuple.

Addressing: host ``(l, i)`` is ``10.l.i.2/24`` (its leaf ``10.l.i.1``); the
link leaf ``l`` - spine ``s`` is ``192.168.(l*16+s).0/30``. Namespace names
carry a per-run prefix ``ark<pid>x<hex>-``; :func:`sweep_stale` removes those
of dead processes, so a killed run leaves nothing behind for long.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_PREFIX = re.compile(r"^ark(\d+)x[0-9a-f]+-")
_DEV = re.compile(r"\bdev (\S+)")
_LEAF_DEV = re.compile(r"^l\d+$")


def ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def run_in(ns: str, *cmd: str) -> str:
    return ip("netns", "exec", ns, *cmd)


def netns_argv(ns: str, *cmd: str) -> list[str]:
    """``cmd`` as run inside ``ns``: a prefix for launchers (``vllm serve`` in a host)."""
    return ["ip", "netns", "exec", ns, *cmd]


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread that entered ``ns``; sockets it creates stay in ``ns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    box: dict = {}

    def target():
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({ns})")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{ns}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def socket_in(ns: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    return in_netns(ns, lambda: socket.socket(socket.AF_INET, kind))


def sweep_stale() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone; the names removed."""
    removed = []
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _PREFIX.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def host_ip(leaf: int, index: int) -> str:
    return f"10.{leaf}.{index}.2"


class LeafSpine:
    """The fabric; use as a context manager (namespaces go away on exit, even on errors)."""

    def __init__(self, n_leaves: int = 2, hosts_per_leaf: int = 4, n_spines: int = 2,
                 rate_mbit: float = 40.0, burst_kb: int = 128,
                 host_rate_mbit: float | None = None):  # fmt: skip
        if not (2 <= n_leaves <= 15 and 1 <= hosts_per_leaf <= 200 and 1 <= n_spines <= 15):
            raise ValueError("need 2-15 leaves, 1-200 hosts per leaf, 1-15 spines")
        self.n_leaves, self.hosts_per_leaf, self.n_spines = n_leaves, hosts_per_leaf, n_spines
        self.rate_mbit, self.burst_kb = rate_mbit, burst_kb
        self.host_rate_mbit = rate_mbit if host_rate_mbit is None else host_rate_mbit
        self.prefix = f"ark{os.getpid()}x{secrets.token_hex(3)}-"
        self.created: list[str] = []

    def ns(self, kind: str, *index: int) -> str:
        return self.prefix + kind + "_".join(map(str, index))

    def host(self, leaf: int, index: int) -> str:
        return self.ns("h", leaf, index)

    def leaf(self, leaf: int) -> str:
        return self.ns("l", leaf)

    def spine(self, spine: int) -> str:
        return self.ns("s", spine)

    @property
    def hosts(self) -> list[tuple[int, int]]:
        return [(lf, i) for lf in range(self.n_leaves) for i in range(self.hosts_per_leaf)]

    def leaf_of_ip(self) -> dict[str, int]:
        return {host_ip(lf, i): lf for lf, i in self.hosts}

    def __enter__(self) -> LeafSpine:
        try:
            self.build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _add_ns(self, name: str, router: bool) -> None:
        ip("netns", "add", name)
        self.created.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        sysctls = ["net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]
        if router:
            sysctls += ["net.ipv4.ip_forward=1", "net.ipv4.fib_multipath_hash_policy=3",
                        "net.ipv4.fib_multipath_hash_fields=0x37"]  # fmt: skip
        run_in(name, "sysctl", "-q", "-w", *sysctls)

    def _link(self, ns_a: str, dev_a: str, addr_a: str, ns_b: str, dev_b: str, addr_b: str,
              rate_mbit: float):  # fmt: skip
        ip("-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            run_in(
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                f"{self.burst_kb}kb",
                "latency",
                "100ms",
            )

    def build(self) -> None:
        sweep_stale()
        for lf in range(self.n_leaves):
            self._add_ns(self.leaf(lf), router=True)
        for s in range(self.n_spines):
            self._add_ns(self.spine(s), router=True)
        for lf, i in self.hosts:
            self._add_ns(self.host(lf, i), router=False)
            host, gateway = f"{host_ip(lf, i)}/24", f"10.{lf}.{i}.1/24"
            self._link(self.host(lf, i), "eth0", host, self.leaf(lf), f"h{i}", gateway,
                       self.host_rate_mbit)  # fmt: skip
            ip("-n", self.host(lf, i), "route", "add", "default", "via", f"10.{lf}.{i}.1")
        for lf in range(self.n_leaves):
            for s in range(self.n_spines):
                net = f"192.168.{lf * 16 + s}"
                self._link(self.leaf(lf), f"s{s}", f"{net}.1/30", self.spine(s), f"l{lf}",
                           f"{net}.2/30", self.rate_mbit)  # fmt: skip
                ip("-n", self.spine(s), "route", "add", f"10.{lf}.0.0/16", "via", f"{net}.1")
        for lf in range(self.n_leaves):
            for other in range(self.n_leaves):
                if other == lf:
                    continue
                hops = []
                for s in range(self.n_spines):
                    hops += ["nexthop", "via", f"192.168.{lf * 16 + s}.2", "dev", f"s{s}"]
                ip("-n", self.leaf(lf), "route", "add", f"10.{other}.0.0/16", *hops)

    def destroy(self) -> None:
        for name in reversed(self.created):
            ip("netns", "del", name, check=False)
        self.created = []

    def route_spine(self, src: str, dst: str, sport: int, dport: int) -> int | None:
        """The spine the source leaf's FIB picks for this TCP 5-tuple (a probe, not a model)."""
        leaf, index = (int(x) for x in src.split(".")[1:3])
        query = ["route", "get", dst, "from", src, "iif", f"h{index}", "ipproto", "tcp",
                 "sport", str(sport), "dport", str(dport)]  # fmt: skip
        out = ip("-n", self.leaf(leaf), *query, check=False)
        match = _DEV.search(out)
        if not match or not match.group(1).startswith("s"):
            return None
        return int(match.group(1)[1:])

    def spine_tx_bytes(self) -> list[dict[int, int]]:
        """Per spine, bytes sent towards each leaf (the ground truth of where data went)."""
        out = []
        for s in range(self.n_spines):
            links = json.loads(ip("-n", self.spine(s), "-s", "-j", "link", "show"))
            out.append({int(link["ifname"][1:]): int(link["stats64"]["tx"]["bytes"])
                        for link in links if _LEAF_DEV.match(link["ifname"])})  # fmt: skip
        return out
