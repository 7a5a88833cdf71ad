"""``ArkNixlConnector``: vLLM's NIXL (pull) connector with ARK's source ports on UCX TCP.

UCX opens its data connections inside native code, so the port is applied by the
``LD_PRELOAD`` shim (``csrc/ark/ark_bind_shim.c``): before the decode worker's first
NIXL handshake with a prefill host (the connection that carries the KV is opened
right after, when the remote agent is added), this connector gives the shim the
port list for that host, one port per NIXL worker thread (vLLM creates its agent
with ``num_threads=4``, so up to four connections per pair: the shim rotates the
list over them). In pull mode the KV flows prefill listener -> this port, so the
port picks the flow's 5-tuple. Honoured per connection: UCX keeps a connection per
agent pair for the instance's life, so this is per peer, not per transfer.

Run the decode instance with ``LD_PRELOAD=$(python -c 'from vllm_ext.ark.shim import
build; print(build())')``; without it nothing is applied and a warning says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from vllm_ext.ark.config import SYSTEM, load_ark_config
from vllm_ext.ark.shim import NIXL_THREADS, PortHook, ShimPorts

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ArkNixlConnector(NixlPullConnector):
    """``NixlPullConnector`` whose worker registers ARK's ports before each new handshake."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER and self.connector_worker is not None:
            additional = getattr(vllm_config, "additional_config", None) or {}
            cfg = load_ark_config(additional.get(SYSTEM))
            hook = PortHook(ShimPorts(), cfg.port_base, cfg.port_count, NIXL_THREADS)
            worker = self.connector_worker
            # per instance, so vLLM's class stays untouched
            worker._nixl_handshake = hook.wrap(worker._nixl_handshake)
