"""Build and locate ARK's LD_PRELOAD bind/connect shim (``csrc/ark/ark_bind_shim.c``).

The shim applies planned source ports to TCP connections that native code
opens (NIXL/UCX, Mooncake TCP): see the C file for its rules. It is compiled
on first use with the system C compiler into the asset cache, keyed by the
source's hash, so an edited source is rebuilt and a built one is reused.
Use: ``LD_PRELOAD=<path> ARK_SPORT_MAP="10.0.0.1:47001=40001,40002" cmd``, or
``ctypes.CDLL(None).ark_shim_set(b"10.0.0.1", 47001, 40001)`` inside the
preloaded process.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "ark" / "ark_bind_shim.c"
NIXL_THREADS = 4  # vLLM's nixl_agent_config(num_threads=4) in nixl/base_worker.py


def nixl_ucx_workers(num_threads: int = NIXL_THREADS) -> int:
    """UCX workers of a NIXL agent: one per worker thread plus the agent's own.

    Each opens one TCP connection to a peer it adds (so this many connections per
    pair) and, on the side being read, one listener from ``UCX_TCP_PORT_RANGE``.
    """
    return num_threads + 1
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm_ext" / "ark"


class ShimBuildError(RuntimeError):
    """The shim could not be built (no compiler, no source, compiler error)."""


def build(
    cache: Path = CACHE, source: Path = SOURCE, libs: tuple[str, ...] = ("-ldl", "-lpthread")
) -> Path:
    """Path of the compiled shared object of ``source`` (default: the shim), built if needed."""
    if not source.is_file():
        raise ShimBuildError(f"shim source not found at {source} (needs a source checkout)")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    digest = hashlib.sha256(source.read_bytes() + " ".join(libs).encode()).hexdigest()[:16]
    out = cache / f"{source.stem}-{digest}.so"
    if out.is_file():
        return out
    if compiler is None:
        raise ShimBuildError("no C compiler found (set CC or install gcc)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(tmp),
           str(source), *libs]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ShimBuildError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    tmp.replace(out)
    return out


ANY_PORT = 0  # the shim's wildcard destination port


class ShimPorts:
    """The preloaded shim's runtime map, from Python (``ctypes.CDLL(None)``).

    ``available`` is False when the process was started without the shim in
    ``LD_PRELOAD``: then :meth:`register` applies nothing and says so.
    """

    def __init__(self, lib=None) -> None:
        import ctypes

        self._lib = ctypes.CDLL(None) if lib is None else lib
        self.available = hasattr(self._lib, "ark_shim_set")
        if self.available:
            self._lib.ark_shim_applied.restype = ctypes.c_ulong
            self._lib.ark_shim_fallbacks.restype = ctypes.c_ulong
        self._done: set[tuple[str, int]] = set()

    def register(self, dst_ip: str, ports: list[int], dst_port: int = ANY_PORT) -> bool:
        """Give ``(dst_ip, dst_port)`` the port list ``ports`` (rotated over its connections).

        Idempotent per destination; False when the shim is absent or refuses an entry.
        """
        if not self.available or not ports:
            return False
        if (dst_ip, dst_port) in self._done:
            return True
        ok = all(self._lib.ark_shim_set(dst_ip.encode(), dst_port, p) == 0 for p in ports)
        if ok:
            self._done.add((dst_ip, dst_port))
        return ok

    def exempt(self, dst_ip: str, dst_port: int) -> bool:
        """Keep ``(dst_ip, dst_port)`` (a control channel) on ephemeral ports."""
        return self.available and self._lib.ark_shim_exempt(dst_ip.encode(), dst_port) == 0

    def applied(self) -> int:
        return int(self._lib.ark_shim_applied()) if self.available else 0

    def fallbacks(self) -> int:
        return int(self._lib.ark_shim_fallbacks()) if self.available else 0


def peer_ports(peer: str, port_base: int, port_count: int, per_peer: int) -> list[int]:
    """``per_peer`` distinct candidate ports for one peer, its offset drawn from its name.

    Several peers get different slices of the candidate range, so connections to
    different peers do not compete for one port; the list covers one connection per
    UCX worker of the NIXL agent (:func:`nixl_ucx_workers`).
    """
    if per_peer < 1 or port_count < 1:
        raise ValueError(f"per_peer and port_count must be >= 1, got {per_peer}, {port_count}")
    start = int(hashlib.sha256(peer.encode()).hexdigest()[:8], 16) % port_count
    n = min(per_peer, port_count)
    return [port_base + (start + i) % port_count for i in range(n)]


class PortHook:
    """Registers a peer's ports with the shim before the wrapped handshake runs.

    ``plan(ip)`` gives ``{destination port: ports}`` for the peer's connections
    (ARK's path-map plan, :class:`vllm_ext.ark.connplan.ListenerPlans`); without
    it every connection to the peer takes one of :func:`peer_ports`.
    """

    def __init__(self, shim: ShimPorts, port_base: int, port_count: int,
                 per_peer: int = nixl_ucx_workers(),
                 plan: Callable[[str], dict[int, list[int]]] | None = None) -> None:  # fmt: skip
        self.shim, self.port_base, self.port_count, self.per_peer = (
            shim, port_base, port_count, per_peer)  # fmt: skip
        self.plan = plan
        self.warned = False
        self._entries: dict[str, dict[int, list[int]]] = {}

    def ports_for(self, host: str) -> dict[int, list[int]]:
        """The peer's ports, planned once (a repeated handshake keeps them)."""
        if host not in self._entries:
            if self.plan is not None:
                self._entries[host] = self.plan(host)
            else:
                ports = peer_ports(host, self.port_base, self.port_count, self.per_peer)
                self._entries[host] = {ANY_PORT: ports}
        return self._entries[host]

    def before_handshake(self, host: str, side_channel_port: int | None = None) -> bool:
        try:  # vLLM's side-channel host may be a name ("localhost"); the shim keys on IPv4
            ip = socket.gethostbyname(host)
        except OSError:
            ip = host
        if side_channel_port:  # the handshake's own ZMQ connection carries no KV
            self.shim.exempt(ip, side_channel_port)
        entries = self.ports_for(ip)
        ok = bool(entries) and all(
            self.shim.register(ip, ports, dport) for dport, ports in entries.items() if ports
        )
        if not ok and not self.warned:
            self.warned = True
            logger.warning("ARK: shim not preloaded (LD_PRELOAD) or refused ports for %s: "
                           "NIXL connections keep ephemeral ports", host)  # fmt: skip
        return ok

    def wrap(self, handshake):
        @functools.wraps(handshake)
        def ported(host: str, port: int, *args, **kwargs):
            self.before_handshake(host, port)
            return handshake(host, port, *args, **kwargs)

        return ported
