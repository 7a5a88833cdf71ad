"""``ArkNixlConnector``: vLLM's NIXL (pull) connector with ARK's source ports on UCX TCP.

UCX opens its data connections inside native code, so the port is applied by the
``LD_PRELOAD`` shim (``csrc/ark/ark_bind_shim.c``): before the decode worker's first
NIXL handshake with a prefill host (the connection that carries the KV is opened
right after, when the remote agent is added), this connector gives the shim the
port list for that host, one port per UCX worker of the agent: vLLM creates it with
``num_threads=4`` (``kv_connector_extra_config``), i.e. five UCX workers, each of which
connects once to the peer (five connections per pair; the shim rotates the list over
them). In pull mode the KV flows prefill listener -> this port, so the port picks the
flow's 5-tuple. Honoured per connection: UCX keeps a connection per
agent pair for the instance's life, so this is per peer, not per transfer.

With ``fabric_file`` and ``nixl_listener_ports`` (the prefill instances'
``UCX_TCP_PORT_RANGE``) the ports are planned from the probed path map of the KV
direction (:class:`vllm_ext.ark.connplan.ListenerPlans`); otherwise each peer gets
a slice of the candidate range. That range must hold a listener per UCX worker of
the prefill's agent (5 ports at least): UCX retries a busy range forever, so with
fewer ports the prefill worker hangs in its NIXL agent's creation. The handshake's
own ZMQ connection keeps an ephemeral port.

vLLM 0.34: ``kv_cache_access()`` is inherited from vLLM's NIXL connector
(``REGISTERS | EXPORTS_FABRIC``: UCX registers the device KV cache and peers on
a host map it; ``IN_PROCESS`` with ``kv_buffer_device="cpu"``, where NIXL
registers host staging buffers), and so are ``unregister_kv_caches`` /
``restore_kv_caches`` and ``supports_sleep_mode``. ARK's seams are checked in
``__init__``.

Run the decode instance with ``LD_PRELOAD=$(python -c 'from vllm_ext.ark.shim import
build; print(build())')``; without it nothing is applied and a warning says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from vllm_ext.ark.config import SYSTEM, ArkConfig, load_ark_config
from vllm_ext.ark.connplan import ListenerPlans
from vllm_ext.ark.paths import load_fabric_file
from vllm_ext.ark.shim import NIXL_THREADS, PortHook, ShimPorts, nixl_ucx_workers
from vllm_ext.common import compat
from vllm_ext.common.config import ConfigError
from vllm_ext.common.log import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


def check_listener_range(cfg: ArkConfig, connections: int) -> None:
    """Refuse a ``nixl_listener_ports`` range that cannot hold the prefill's listeners.

    Each UCX worker of the prefill's NIXL agent listens on a port of its
    ``UCX_TCP_PORT_RANGE``, and UCX retries a busy range forever: a range with fewer
    ports than workers hangs the prefill worker's start-up without an error.
    """
    if cfg.listener_ports and len(cfg.listener_ports) < connections:
        raise ConfigError(
            f"ArkConfig.nixl_listener_ports {cfg.nixl_listener_ports!r} has "
            f"{len(cfg.listener_ports)} ports; the prefill's UCX_TCP_PORT_RANGE needs one "
            f"per UCX worker of its NIXL agent ({connections}: num_threads + 1), else its "
            "worker hangs at start-up in UCX's listener bind")


def listener_plans(cfg: ArkConfig) -> ListenerPlans | None:
    """The path-map plan of ``cfg``, or None without ``fabric_file`` / listener ports."""
    if cfg.fabric_file is None or not cfg.listener_ports:
        return None
    try:
        fabric, paths = load_fabric_file(cfg.fabric_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"ArkConfig.fabric_file {cfg.fabric_file!r}: {exc}") from exc
    return ListenerPlans(cfg.host, fabric, paths, cfg.candidates, cfg.listener_ports)


class ArkNixlConnector(NixlPullConnector):
    """``NixlPullConnector`` whose worker registers ARK's ports before each new handshake."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any):
        # a seam this vLLM lacks would fail mid-serving: refuse now, in one line
        compat.ensure("ark")
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER and self.connector_worker is not None:
            additional = getattr(vllm_config, "additional_config", None) or {}
            cfg = load_ark_config(additional.get(SYSTEM))
            # one connection per UCX worker of this agent, as vLLM configures it
            threads = vllm_config.kv_transfer_config.get_from_extra_config(
                "num_threads", NIXL_THREADS)
            connections = nixl_ucx_workers(int(threads))
            check_listener_range(cfg, connections)
            plans = listener_plans(cfg)
            plan = None if plans is None else _logged(plans, connections)
            hook = PortHook(ShimPorts(), cfg.port_base, cfg.port_count, connections, plan)
            worker = self.connector_worker
            # per instance, so vLLM's class stays untouched
            worker._nixl_handshake = hook.wrap(worker._nixl_handshake)


def _logged(plans: ListenerPlans, connections: int):
    def plan(peer: str) -> dict[int, list[int]]:
        ports = plans.ports(peer, connections)
        planned, kept = plans.counts()
        logger.info("ARK: NIXL ports for %s per listener port %s (planned %d, kept %d)",
                    peer, ports, planned, kept)  # fmt: skip
        return ports

    return plan
