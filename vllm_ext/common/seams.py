"""The shared plumbing's vLLM seams (vllm_ext.common, vllm_ext.plugin, vllm_ext.vllm_main).

Also where vLLM calls any KV connector: :func:`connector_calls` gives a system
the ``call`` entries for its connector class (a method it does not override is
vLLM's own, and its entry holds trivially). See :mod:`vllm_ext.common.compat`.
"""

from __future__ import annotations

from vllm_ext.common.seam import Seam

_KVB = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_KVF = "vllm.distributed.kv_transfer.kv_connector.factory"
_KVM = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
_SCHED = "vllm.v1.core.sched.scheduler"
_V2_KV = "vllm.v1.worker.gpu.kv_connector"
_LINEAR = "vllm.model_executor.layers.linear"
_ATTN_KV = "vllm.model_executor.layers.attention.kv_transfer_utils"
_KVU = "vllm.distributed.kv_transfer.kv_connector.utils"
_QCFG = "vllm_ext.common.quantization_config:CheckpointQuantizationConfig"
_STATS = "vllm_ext.common.prom:CounterStats"

# (vLLM's calling module, function, call expression, the connector method it reaches)
CONNECTOR_CALL_SITES: tuple[tuple[str, str, str, str], ...] = (
    (_KVF, "KVConnectorFactory.create_connector", "connector_cls", "__init__"),
    (_SCHED, "Scheduler._build_kv_connector_meta", "connector.build_connector_meta",
     "build_connector_meta"),
    *((_SCHED, f"Scheduler.{caller}", f"self.connector.{method}", method) for caller, method in (
        ("__init__", "bind_kv_cache_manager"),
        ("add_request", "on_new_request"),
        ("schedule", "get_num_new_matched_tokens"),
        ("schedule", "update_state_after_alloc"),
        ("schedule", "get_loaded_kv_cache_group_ids"),
        ("_connector_finished", "request_finished"),
        ("_connector_finished", "request_finished_all_groups"),
        ("_update_from_kv_xfer_finished", "update_connector_output"),
        ("update_from_output", "get_kv_connector_stats"),
        ("shutdown", "shutdown"),
    )),
    (_ATTN_KV, "maybe_transfer_kv_layer", "connector.wait_for_layer_load", "wait_for_layer_load"),
    (_ATTN_KV, "maybe_transfer_kv_layer", "connector.save_kv_layer", "save_kv_layer"),
    (_KVB, "KVConnectorBase_V1.get_transfer_results", "self.get_finished", "get_finished"),
    # Model Runner V2's worker side (vLLM 0.34 has no other)
    *((_V2_KV, f"ActiveKVConnector.{caller}", f"self.kv_connector.{method}", method)
      for caller, method in (
        ("__init__", "register_kv_caches"),
        ("_start_load_kv", "start_load_kv"),
        ("post_forward", "wait_for_save"),
        ("post_forward", "build_connector_worker_meta"),
        ("post_forward", "get_block_ids_with_load_errors"),
    )),
)  # fmt: skip

# call sites a later vLLM added: (module, function, expression, method, releases)
LATER_CONNECTOR_CALL_SITES: tuple[tuple[str, str, str, str, str], ...] = (
    # 0.34: a request that may load asynchronously waits in async_kv_waiting
    (_SCHED, "Scheduler._enqueue_waiting_request", "self.connector.may_load_async",
     "may_load_async", ">=0.34"),
)  # fmt: skip


def connector_calls(system: str, connector: str) -> tuple[Seam, ...]:
    """``call`` entries: each connector method vLLM calls must bind to ``connector``'s
    (``"vllm_ext.<module>:<Class>"``)."""
    sites = [(*site, "") for site in CONNECTOR_CALL_SITES] + list(LATER_CONNECTOR_CALL_SITES)
    return tuple(
        Seam(system, module, caller, "call", "vLLM calls the connector with this shape",
             (expression,), ours=f"{connector}.{method}", releases=releases)
        for module, caller, expression, method, releases in sites
    )


def worker_meta_calls(system: str, metadata: str) -> tuple[Seam, ...]:
    """``call`` entry: TP ranks' worker metadata (``metadata``) are merged by vLLM."""
    return (
        Seam(system, _KVU, "KVOutputAggregator.aggregate", "call",
             "TP ranks' worker metadata are merged",
             ("aggregated_kv_connector_worker_meta.aggregate",), ours=f"{metadata}.aggregate"),
    )


def prom_metrics_calls(system: str, metrics: str) -> tuple[Seam, ...]:
    """``call`` entry: vLLM's per-connector Prometheus logger feeds ``metrics``."""
    return (
        Seam(system, _KVM, "KVConnectorProm.observe", "call", "connector stats reach /metrics",
             ("self.prom_metrics.observe",), ours=f"{metrics}.observe"),
    )


def quant_method_calls(system: str, method: str) -> tuple[Seam, ...]:
    """``call`` entries: how vLLM's linear layers call a ``LinearMethodBase`` (``method``)."""
    return tuple(
        Seam(system, _LINEAR, f"{layer}.{caller}", "call",
             "vLLM's linear layers call the quantization method with this shape",
             (f"self.quant_method.{name}",), ours=f"{method}.{name}")
        for layer in ("ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear")
        for caller, name in (("__init__", "create_weights"), ("forward", "apply"))
    ) + (
        Seam(system, "vllm.model_executor.model_loader.utils", "process_weights_after_loading",
             "call", "the loader finishes each layer's weights",
             ("quant_method.process_weights_after_loading",),
             ours=f"{method}.process_weights_after_loading"),
    )


# words of a `vllm serve` command line that select the shared plumbing: none (every
# selected system checks these entries first, see compat.refusal)
SELECTED_BY: tuple[str, ...] = ()

SEAMS: tuple[Seam, ...] = (
    # shared plumbing (vllm_ext.common, vllm_ext.plugin, vllm_ext.vllm_main)
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
    Seam("common", _KVB, "KVConnectorBase_V1.requires_kv_delivery", "attribute",
         "NoKVTransfer answers False: a preempted request keeps output still in flight"),
    Seam("common", _SCHED, "Scheduler.__init__", "source",
         "vLLM reads the connector's requires_kv_delivery once", ("requires_kv_delivery",)),
    Seam("common", _KVB, "KVConnectorBase_V1.may_load_async", "signature",
         "NoKVTransfer, ACCT and ARK's prefill side load nothing asynchronously", ("request",),
         releases=">=0.34"),
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
    # registered patches (patches/README.md)
    Seam("common", "vllm.entrypoints.cli.main", "importlib", "attribute",
         "patches/vllm_cpu_cli_version.py replaces the module's importlib"),
    # the base of TVQ's and ETAPS's quantization configs (common/quantization_config.py)
    Seam("common", "vllm.model_executor.layers.quantization.base_config", "QuantizationConfig",
         "symbol", "CheckpointQuantizationConfig's base (TVQ, ETAPS)"),
    # how vLLM calls our counters' stats and the quantization configs' base
    *(Seam("common", module, caller, "call", "vLLM merges, reduces and tests connector stats",
           (expression,), ours=f"{_STATS}.{expression.rpartition('.')[2]}")
      for module, caller, expression in (
          ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
           "kv_connector_stats.aggregate"),
          ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output",
           "scheduler_kv_connector_stats.is_empty"),
          (_KVU, "KVOutputAggregator.aggregate", "aggregated_kv_connector_stats.aggregate"),
          (_KVM, "KVConnectorLogging.observe", "self.transfer_stats_accumulator.aggregate"),
          (_KVM, "KVConnectorLogging.log", "self.transfer_stats_accumulator.reduce"),
          (_KVM, "KVConnectorLogging.log", "self.transfer_stats_accumulator.is_empty"),
      )),
    *prom_metrics_calls("common", "vllm_ext.common.prom:CounterPromMetrics"),
    *(Seam("common", module, caller, "call", "vLLM reads a checkpoint's quantization config",
           (expression,), ours=f"{_QCFG}.{expression.rpartition('.')[2]}")
      for module, caller, expression in (
          ("vllm.model_executor.model_loader.weight_utils", "get_quant_config",
           "quant_cls.from_config"),
          ("vllm.model_executor.model_loader.weight_utils", "get_quant_config",
           "quant_cls.get_config_filenames"),
          ("vllm.config.vllm", "VllmConfig._get_quantization_config",
           "quant_config.get_supported_act_dtypes"),
          ("vllm.model_executor.layers.quantization.base_config", "resolve_quant_method",
           "quant_config.get_quant_method"),
      )),
)  # fmt: skip

# our overrides vLLM does not call (so no call entry), each with the reason
UNCALLED: dict[str, str] = {
    "CounterStats.reset": "vLLM's KVConnectorStats calls it from its own __post_init__ only",
    "CounterPromMetrics.__init__": "built by our build_prom_metrics, not by vLLM",
    "CheckpointQuantizationConfig.__init__": "built by our from_config, not by vLLM",
    "CheckpointQuantizationConfig.get_name": "called with no arguments",
}
