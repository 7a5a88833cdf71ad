"""ARK configuration: one frozen dataclass, read from ``--additional-config '{"ark": {...}}'``.

Every field can also be set as an environment variable (``<PREFIX>ARK_<FIELD>``,
see :mod:`vllm_ext.common.config`); the mapping wins over the environment,
the environment over the defaults.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_ext.common.config import ConfigError, load_config, option

SYSTEM = "ark"


@dataclass(frozen=True)
class ArkConfig:
    """Where an instance listens, who its peers are, and how it picks source ports."""

    host: str = option(
        "127.0.0.1",
        doc="this instance's IPv4 address: KV data is sent from / received on it, "
        "announcements are sent from it",
    )
    data_port: int = option(7100, doc="decode side: TCP port of the KV data listener")
    announce_port: int = option(7200, doc="prefill side: UDP port for announcements")
    peers: tuple[str, ...] = option(
        (), doc="prefill side: announce endpoints ('host:port') of the other prefill senders"
    )
    port_base: int = option(40000, doc="prefill side: first candidate source port")
    port_count: int = option(16, doc="prefill side: number of candidate source ports (>= 1)")
    fabric_file: str | None = option(
        None,
        path="file",
        doc="JSON with the host-to-leaf map and the probed path map "
        "(see docs/ark.md); None: paths unknown, each transfer keeps a random candidate port",
    )
    min_bytes: int = option(1 << 20, doc="transfers smaller than this keep their port (>= 0)")
    link_gbps: float = option(
        25.0, doc="prefill side: rate used to estimate a transfer's end in announcements (> 0)"
    )
    nixl_listener_ports: str | None = option(
        None,
        doc="decode side with ArkNixlConnector: the prefill instances' UCX TCP listener ports, "
        "'first-last' (their UCX_TCP_PORT_RANGE: at least one port per UCX worker of their NIXL "
        "agent, 5 with vLLM's num_threads=4; at most 16 ports); with fabric_file each NIXL "
        "connection's port is planned from the path map; None: per-peer candidate ports",
    )
    kv_senders: tuple[str, ...] = option(
        (),
        doc="decode side: IPv4 addresses of the prefill instances allowed to send KV frames; "
        "connections from any other address are closed unread; empty: any address "
        "(a warning at start)",
    )
    secret_file: str | None = option(
        None,
        path="file",
        doc="file holding a shared secret (>= 16 bytes, the same on every instance; set this "
        "key or VLLMEXT_ARK_SECRET_FILE, never the secret itself): every KV frame and "
        "announcement carries an HMAC-SHA256 tag, and one without a valid tag is dropped and "
        "counted; None: unauthenticated (a warning at start)",
    )
    load_timeout_s: float = option(
        30.0,
        doc="decode side: give up waiting for a transfer's KV after this long "
        "(the request is recomputed, per kv_load_failure_policy) (> 0)",
    )

    def __post_init__(self) -> None:
        try:
            ipaddress.IPv4Address(self.host)
        except ValueError:
            message = f"ArkConfig.host must be an IPv4 address, got {self.host!r}"
            raise ConfigError(message) from None
        for name in ("data_port", "announce_port", "port_base"):
            _check_port(name, getattr(self, name))
        if not 1 <= self.port_count <= 4096 or self.port_base + self.port_count - 1 > 65535:
            raise ConfigError(
                f"ArkConfig.port_count must be 1..4096 with port_base + port_count - 1 <= "
                f"65535, got port_base={self.port_base}, port_count={self.port_count}"
            )
        for peer in self.peers:
            parse_endpoint(peer)
        for sender in self.kv_senders:
            try:
                ipaddress.IPv4Address(sender)
            except ValueError:
                message = f"ArkConfig.kv_senders: {sender!r} is not an IPv4 address"
                raise ConfigError(message) from None
        if self.secret_file is not None and (
            not isinstance(self.secret_file, str) or not self.secret_file
        ):
            raise ConfigError(
                f"ArkConfig.secret_file must be a file path, got {self.secret_file!r}"
            )
        if self.min_bytes < 0:
            raise ConfigError(f"ArkConfig.min_bytes must be >= 0, got {self.min_bytes}")
        if self.nixl_listener_ports is not None and not 1 <= len(self.listener_ports) <= 16:
            raise ConfigError(f"ArkConfig.nixl_listener_ports: {self.nixl_listener_ports!r} "
                              "names more than 16 ports")  # fmt: skip
        for name in ("link_gbps", "load_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"ArkConfig.{name} must be > 0, got {value}")

    @property
    def candidates(self) -> tuple[int, ...]:
        return tuple(range(self.port_base, self.port_base + self.port_count))

    @property
    def listener_ports(self) -> tuple[int, ...]:
        """The ports of ``nixl_listener_ports`` (empty when unset)."""
        if self.nixl_listener_ports is None:
            return ()
        return parse_port_range(self.nixl_listener_ports)


def parse_port_range(text: str) -> tuple[int, ...]:
    """``"47000-47003"`` or ``"47000"`` -> the ports; a clear error otherwise."""
    first, _, last = text.strip().partition("-")
    if not first.isdigit() or (last and not last.isdigit()) \
            or not 1 <= int(first) <= int(last or first) <= 65535:  # fmt: skip
        raise ConfigError(f"ArkConfig.nixl_listener_ports: {text!r} is not 'port' or "
                          "'first-last' with 1 <= first <= last <= 65535")  # fmt: skip
    return tuple(range(int(first), int(last or first) + 1))


def _check_port(name: str, value: int) -> None:
    if not 1 <= value <= 65535:
        raise ConfigError(f"ArkConfig.{name} must be in 1..65535, got {value}")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"10.0.0.2:7200"`` → ``("10.0.0.2", 7200)``; a clear error otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"ArkConfig.peers: {text!r} is not 'host:port'")
    return host, int(port)


def load_ark_config(
    mapping: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> ArkConfig:
    return load_config(ArkConfig, SYSTEM, mapping, environ)
