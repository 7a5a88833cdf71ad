"""ARK's vLLM seams: its connector, the NIXL connector it wraps, counters (see
:mod:`vllm_ext.common.compat`)."""

from __future__ import annotations

from vllm_ext.common.seam import Seam
from vllm_ext.common.seams import connector_calls, prom_metrics_calls

_KVB = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_KVM = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"

# words of a `vllm serve` command line that select ark
SELECTED_BY: tuple[str, ...] = ('vllm_ext.ark', 'ArkConnector', 'ArkNixlConnector')

SEAMS: tuple[Seam, ...] = (
    # ARK (vllm_ext/ark/connector.py, prom.py)
    Seam("ark", _KVB, "KVConnectorBase_V1._kv_transfer_config", "instance",
         "kv_role: which side of a P/D pair this connector is"),
    Seam("ark", _KVB, "KVConnectorBase_V1._kv_cache_manager", "instance",
         "the prefill side reads a finished request's blocks (bind_kv_cache_manager)"),
    Seam("ark", _KVB, "KVConnectorBase_V1._get_connector_metadata", "attribute",
         "the bound step metadata"),
    Seam("ark", "vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", "signature",
         "the decode side's allocated blocks", ()),
    Seam("ark", "vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids", "signature",
         "a finished prefill's blocks", ("request_id",)),
    Seam("ark", _KVM, "KVConnectorPromMetrics._counter_cls", "instance",
         "vLLM's counter class for ARK's counters"),
    Seam("ark", "vllm.v1.request", "Request.__init__", "source",
         "the P/D handshake rides in kv_transfer_params",
         ("self.kv_transfer_params", "self.num_computed_tokens", "self.num_prompt_tokens")),
    Seam("ark", "vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens", "field",
         "which requests run this step"),
    Seam("ark", "vllm.v1.outputs", "KVConnectorOutput.finished_recving", "field",
         "loads done on the decode side"),
    Seam("ark", "vllm.config.kv_transfer", "KVTransferConfig.kv_role", "field",
         "kv_producer / kv_consumer"),
    # ARK: NIXL wrapper (vllm_ext/ark/nixl.py)
    Seam("ark", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
         "NixlPullConnector.__init__", "signature",
         "ArkNixlConnector extends vLLM's NIXL pull connector",
         ("vllm_config", "role", "kv_cache_config")),
    Seam("ark", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
         "NixlBaseConnectorWorker._nixl_handshake", "signature",
         "wrapped per worker instance: ARK's ports reach the shim before UCX connects",
         ("host", "port", "remote_tp_size", "expected_engine_id")),
    # how vLLM calls ARK's overrides
    *connector_calls("ark", "vllm_ext.ark.connector:ArkConnector"),
    *connector_calls("ark", "vllm_ext.ark.nixl:ArkNixlConnector"),
    *prom_metrics_calls("ark", "vllm_ext.ark.prom:ArkPromMetrics"),
)  # fmt: skip

# our overrides vLLM does not call (so no call entry), each with the reason
UNCALLED: dict[str, str] = {
    "ArkPromMetrics.__init__": "built by ArkConnector.build_prom_metrics, not by vLLM",
}
