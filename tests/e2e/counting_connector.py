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

from vllm_ext.common.counters import CounterSpec
from vllm_ext.common.prom import PublishesCounters


class CountingMetadata(KVConnectorMetadata):
    pass


class CountingConnector(PublishesCounters, KVConnectorBase_V1, SupportsHMA):
    COUNTER_SYSTEM = "testcount"
    COUNTER_SPECS = (
        CounterSpec("requests_finished", "requests finished (scheduler side)"),
        CounterSpec("worker_steps", "forward steps seen (worker side)"),
    )

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.counters = self.make_counters()

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return CountingMetadata()

    def request_finished(self, request, block_ids):
        self.counters.inc("requests_finished")
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    # worker side
    def start_load_kv(self, forward_context, **kwargs):
        self.counters.inc("worker_steps")

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
