"""ACCT's vLLM seams: its connector, the attention backends it writes KV through (see
:mod:`vllm_ext.common.compat`)."""

from __future__ import annotations

from vllm_ext.common.seam import Seam
from vllm_ext.common.seams import connector_calls

_KVB = "vllm.distributed.kv_transfer.kv_connector.v1.base"

# words of a `vllm serve` command line that select acct
SELECTED_BY: tuple[str, ...] = ('vllm_ext.acct', 'AcctConnector')

SEAMS: tuple[Seam, ...] = (
    # ACCT (vllm_ext/acct/connector.py)
    Seam("acct", "vllm.forward_context", "ForwardContext.no_compile_layers", "field",
         "the attention layers whose KV cache ACCT writes"),
    Seam("acct", "vllm.model_executor.layers.attention.attention", "Attention.impl", "instance",
         "the backend whose do_kv_cache_update writes converted KV"),
    Seam("acct", "vllm.v1.attention.backends.cpu_attn",
         "CPUAttentionBackendImpl.do_kv_cache_update", "signature",
         "writes converted KV through the CPU backend",
         ("layer", "key", "value", "kv_cache", "slot_mapping")),
    Seam("acct", "vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl.do_kv_cache_update",
         "signature", "writes converted KV through FlashAttention",
         ("layer", "key", "value", "kv_cache", "slot_mapping")),
    Seam("acct", "vllm.v1.outputs", "KVConnectorOutput.invalid_block_ids", "field",
         "blocks a failed import left; vLLM recomputes them"),
    Seam("acct", "vllm.config.kv_transfer", "KVTransferConfig.kv_load_failure_policy", "field",
         "ACCT requires recompute"),
    Seam("acct", _KVB, "KVConnectorBase_V1.get_block_ids_with_load_errors", "signature",
         "failed imports are reported per block", ()),
    Seam("acct", _KVB, "KVConnectorBase_V1._get_connector_metadata", "attribute",
         "the bound step metadata"),
    Seam("acct", "vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", "signature",
         "an import's allocated blocks", ()),
    Seam("acct", "vllm.v1.request", "Request.__init__", "source",
         "the tokens ACCT converts", ("self.all_token_ids",)),
    Seam("acct", "vllm.v1.request", "Request.num_tokens", "attribute",
         "offer the block-aligned prompt prefix minus the last token"),
    Seam("acct", "vllm.v1.kv_cache_interface", "KVCacheConfig.kv_cache_groups", "instance",
         "ACCT imports into one KV-cache group only"),
    # how vLLM calls ACCT's overrides
    *connector_calls("acct", "vllm_ext.acct.connector:AcctConnector"),
)  # fmt: skip
