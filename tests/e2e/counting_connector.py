"""A minimal KV connector that counts, used to prove the counter → /metrics path.

Not a system: it moves no KV. The scheduler side counts finished requests, the
worker side counts forward steps, both through
:class:`vllm_ext.common.prom.PublishesCounters`.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_ext.common.connector import NoKVTransfer
from vllm_ext.common.counters import CounterSpec
from vllm_ext.common.prom import PublishesCounters


class CountingMetadata(KVConnectorMetadata):
    pass


class CountingConnector(PublishesCounters, NoKVTransfer, KVConnectorBase_V1, SupportsHMA):
    COUNTER_SYSTEM = "testcount"
    COUNTER_SPECS = (
        CounterSpec("requests_finished", "requests finished (scheduler side)"),
        CounterSpec("worker_steps", "forward steps seen (worker side)"),
    )

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.counters = self.make_counters()

    # scheduler side
    def build_connector_meta(self, scheduler_output):
        return CountingMetadata()

    def request_finished(self, request, block_ids):
        self.counters.inc("requests_finished")
        return False, None

    # worker side
    def start_load_kv(self, forward_context, **kwargs):
        self.counters.inc("worker_steps")
