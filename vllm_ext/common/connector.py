"""Shared KV-connector parts (vLLM ``KVConnectorBase_V1`` contract, 0.32 and 0.34).

:class:`NoKVTransfer` is for systems that use the connector slot only as a
channel — worker → scheduler metadata, finish hooks, stats — and load or save
nothing: it answers the KV-transfer half of the contract with "nothing to do" so
such connectors implement only what they use. Put it before
``KVConnectorBase_V1`` in the bases.
"""

from __future__ import annotations


class NoKVTransfer:
    """No external KV: nothing matched, nothing loaded, nothing saved."""

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def may_load_async(self, request):
        # vLLM >= 0.34 asks before queueing a request; its default says yes for P/D
        # remote-prefill requests, which would hold back other connectors' async loads
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        # nothing is handed off, so vLLM need not drop a preempted request's in-flight
        # output and recompute it (its default is true for every producer role)
        return False

    def request_finished_all_groups(self, request, block_ids):
        # hybrid (SupportsHMA) finish: same as the single-group hook
        return self.request_finished(request, block_ids)

    # worker side
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
