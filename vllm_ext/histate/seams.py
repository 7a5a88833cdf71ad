"""HiState's vLLM seams: connector, KV-cache manager, Mamba groups, offloading policy (see
:mod:`vllm_ext.common.compat`)."""

from __future__ import annotations

from vllm_ext.common.seam import Seam
from vllm_ext.common.seams import connector_calls, worker_meta_calls

_KVB = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_KVPOL = "vllm.v1.kv_offload.cpu.policies.base"
_MAMBA = "vllm.v1.core.single_type_kv_cache_manager"
_POOL = "vllm.v1.core.block_pool"
_MGR = "vllm.v1.kv_offload.cpu.manager"
_POLICY = "vllm_ext.histate.cache_policy:HiStateCachePolicy"

# words of a `vllm serve` command line that select histate
SELECTED_BY: tuple[str, ...] = ('vllm_ext.histate', 'HiStateConnector', '"histate"')

SEAMS: tuple[Seam, ...] = (
    # HiState
    Seam("histate", _KVB, "KVConnectorBase_V1.bind_kv_cache_manager", "signature",
         "the scheduler's KVCacheManager", ("kv_cache_manager",)),
    Seam("histate", _KVB, "KVConnectorBase_V1.get_loaded_kv_cache_group_ids", "signature",
         "a hit restores the Mamba group too", ("request",)),
    Seam("histate", _KVB, "KVConnectorBase_V1.register_kv_caches", "signature",
         "the worker's KV pages", ("kv_caches",)),
    Seam("histate", _KVB, "KVConnectorBase_V1._kv_transfer_config", "instance",
         "kv_connector_extra_config"),
    Seam("histate", _POOL, "BlockPool._maybe_evict_cached_block", "signature",
         "patches/mamba_block_pool_release.py drops a held snapshot's cache entry", ("block",)),
    Seam("histate", _POOL, "BlockPool.free_blocks", "signature",
         "patches/mamba_block_pool_release.py", ("ordered_blocks",)),
    Seam("histate", _POOL, "BlockPool.hash_block_size", "instance",
         "HiState keys blocks by vLLM's block hashes"),
    Seam("histate", _MAMBA, "MambaManager.get_num_blocks_to_allocate", "signature",
         "patches/mamba_external_state_count.py",
         ("request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
          "num_local_computed_tokens")),
    Seam("histate", _MAMBA, "MambaManager.get_num_skipped_tokens", "symbol",
         "patches/mamba_external_state_count.py"),
    Seam("histate", _MAMBA, "MambaManager.block_pool", "instance",
         "patches/mamba_block_pool_release.py wraps it per manager"),
    Seam("histate", _MAMBA, "MambaManager.mamba_cache_mode", "instance", "align mode only"),
    Seam("histate", "vllm.v1.core.kv_cache_manager", "KVCacheManager.coordinator", "instance",
         "the per-group managers (single_type_managers)"),
    Seam("histate", "vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.reset_prefix_cache",
         "source",
         "the pools are deduplicated with dict.fromkeys (the view must hash as its pool)",
         ("fromkeys",)),
    Seam("histate", "vllm.v1.core.kv_cache_utils", "get_block_hash", "symbol",
         "block hash -> bytes"),
    Seam("histate", "vllm.v1.kv_cache_interface", "MambaSpec", "symbol", "group layout"),
    Seam("histate", "vllm.v1.kv_cache_interface", "AttentionSpec", "symbol", "group layout"),
    Seam("histate", "vllm.utils.math_utils", "cdiv", "symbol",
         "patches/mamba_external_state_count.py"),
    # HiState data path (s18-histate): the step state its stores read, its worker output
    Seam("histate", "vllm.v1.core.sched.output", "SchedulerOutput.kv_connector_block_state",
         "attribute", "the blocks of this step's requests (which pages to store)"),
    Seam("histate", "vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens",
         "instance", "the tokens each request computes this step"),
    Seam("histate", "vllm.v1.core.sched.output", "KVConnectorBlockState.get_block_ids",
         "signature", "a request's block ids per KV-cache group", ("req_id",)),
    Seam("histate", "vllm.v1.core.sched.output", "KVConnectorBlockState.boundary_state_offloads",
         "instance", "align-mode boundary states vLLM offers for offload"),
    Seam("histate", "vllm.v1.outputs", "KVConnectorOutput.kv_connector_worker_meta", "attribute",
         "stored keys come back from the worker"),
    Seam("histate", "vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy", "symbol",
         "benchmarks/histate/sim.py: vLLM's own lru baseline"),
    Seam("histate", "vllm.v1.kv_offload.cpu.policies.arc", "ARCCachePolicy", "symbol",
         "benchmarks/histate/sim.py: vLLM's own arc baseline"),
    Seam("histate", "vllm.v1.kv_offload.cpu.policies.base", "CachePolicy.evict", "signature",
         "benchmarks/histate/sim.py drives vLLM's policies", ("n", "protected")),
    Seam("histate", "vllm.v1.kv_offload.cpu.policies.base", "CachePolicy.touch", "signature",
         "benchmarks/histate/sim.py drives vLLM's policies", ("keys", "req_context")),
    # HiState as a vLLM CachePolicy (s19-histate-data: vllm_ext/histate/cache_policy.py)
    Seam("histate", _KVPOL, "CachePolicy", "symbol", "HiStateCachePolicy extends it"),
    Seam("histate", _KVPOL, "CachePolicy.__init__", "signature",
         "the manager builds policies with a chunk count", ("cache_capacity",)),
    Seam("histate", _KVPOL, "CachePolicy.on_store_miss", "signature",
         "new chunks' end positions", ("keys", "req_context")),
    Seam("histate", _KVPOL, "CachePolicy.on_request_finished", "signature",
         "a request's chunks in prefix order",
         ("key_groups", "insertion_only_keys", "reused_keys", "req_context")),
    Seam("histate", _KVPOL, "CachePolicy.mark_evictable", "signature", "ref count 0", ("key",)),
    Seam("histate", _KVPOL, "CachePolicy.mark_non_evictable", "signature", "pinned by a load",
         ("key",)),
    Seam("histate", _KVPOL, "ChunkStatus", "symbol", "the manager's chunk record"),
    Seam("histate", "vllm.v1.kv_offload.cpu.policies.factory",
         "CachePolicyFactory.register_cache_policy", "signature",
         "registers \"histate\"", ("name", "module_path", "class_name")),
    Seam("histate", "vllm.v1.kv_offload.base", "ReqContext.get_offload_key_position",
         "signature", "a chunk's end token prices its recompute", ("key",)),
    Seam("histate", "vllm.v1.kv_offload.base", "OffloadKey", "symbol", "chunk keys"),
    Seam("histate", "vllm.v1.kv_offload.cpu.manager", "CPUOffloadingManager", "symbol",
         "tests/unit/test_histate_cache_policy.py drives the policy through vLLM's manager"),
    Seam("histate", "vllm.distributed.kv_transfer", "get_kv_transfer_group", "symbol",
         "the in-process worker half (HiStateRuntime.drain/close: tests, benchmarks)"),
    Seam("histate", "vllm.distributed.kv_transfer", "has_kv_transfer_group", "symbol",
         "the in-process worker half"),
    # HiState: config and request fields its connector reads (vllm_ext/histate/connector.py)
    Seam("histate", "vllm.config.cache", "CacheConfig.mamba_block_size", "field",
         "chunk ends align to it; a mismatch with the block size is refused at start"),
    Seam("histate", "vllm.config.scheduler", "SchedulerConfig.max_num_scheduled_tokens", "field",
         "the largest chunk the scheduler makes (alignment check)"),
    Seam("histate", "vllm.config.scheduler", "SchedulerConfig.long_prefill_token_threshold",
         "field", "caps a chunk too (alignment check)"),
    Seam("histate", "vllm.v1.kv_cache_interface", "MambaSpec.dtypes", "field",
         "the recurrent state's dtypes (only those HiState can store are accepted)"),
    Seam("histate", "vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", "signature",
         "a request's allocated blocks per group", ()),
    Seam("histate", "vllm.v1.request", "Request.__init__", "source",
         "HiState keys a request's blocks by vLLM's block hashes",
         ("self.block_hashes", "self.num_computed_tokens", "self.num_prompt_tokens")),
    # how vLLM calls HiState's overrides: the connector, and the policy inside vLLM's
    # CPUOffloadingManager (0.33 added req_context to insert; 0.34 stopped calling touch)
    *connector_calls("histate", "vllm_ext.histate.connector:HiStateConnector"),
    *worker_meta_calls("histate", "vllm_ext.histate.metadata:HiStateWorkerMetadata"),
    Seam("histate", _MGR, "CPUOffloadingManager.__init__", "call",
         "the manager builds the policy", ("policy_cls",), ours=f"{_POLICY}.__init__"),
    *(Seam("histate", _MGR, f"CPUOffloadingManager.{caller}", "call",
           "the offloading manager drives the policy", (f"self._policy.{m}",),
           ours=f"{_POLICY}.{m}")
      for caller, m in (
          ("prepare_store", "insert"),
          ("prepare_store", "evict"),
          ("prepare_store", "on_store_miss"),
          ("lookup", "get"),
          ("complete_store", "remove"),
          ("complete_store", "mark_evictable"),
          ("_prepare_load", "mark_non_evictable"),
          ("_record_request_cache_access", "on_request_access"),
          ("on_request_finished", "on_request_finished"),
          ("touch", "touch"),
          ("reset_cache", "clear"),
      )),
)  # fmt: skip
