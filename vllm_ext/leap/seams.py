"""LEAP's vLLM seams: scheduler, request queue, connector, loader, probe layout (see
:mod:`vllm_ext.common.compat`)."""

from __future__ import annotations

from vllm_ext.common.seam import Seam
from vllm_ext.common.seams import connector_calls, worker_meta_calls

_LOADER = "vllm.model_executor.model_loader"
_MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
_QUEUE = "vllm.v1.core.sched.request_queue"
_SCHED = "vllm.v1.core.sched.scheduler"
_V1 = "vllm.v1.worker.gpu_model_runner"
_V1_BATCH = "vllm.v1.worker.gpu_input_batch"
_V2_KV = "vllm.v1.worker.gpu.kv_connector"

# words of a `vllm serve` command line that select leap
SELECTED_BY: tuple[str, ...] = ('vllm_ext.leap', 'LeapConnector', '--load-format leap')

SEAMS: tuple[Seam, ...] = (
    # LEAP: scheduler
    Seam("leap", _SCHED, "Scheduler.__init__", "signature",
         "make_scheduler reads vllm_config", ("vllm_config",)),
    Seam("leap", _SCHED, "Scheduler.schedule", "symbol", "overridden: queue order before vLLM's"),
    Seam("leap", _SCHED, "Scheduler.update_from_output", "signature",
         "overridden: probes first", ("scheduler_output", "model_runner_output")),
    Seam("leap", _SCHED, "Scheduler._preempt_request", "signature",
         "SRPT preemption through vLLM's own", ("request", "timestamp", "drop_stale_output")),
    Seam("leap", _SCHED, "Scheduler.running", "instance",
         "rewritten in place: serving order, victim last"),
    Seam("leap", _SCHED, "Scheduler.waiting", "instance", "replaced by LeapRequestQueue"),
    Seam("leap", _SCHED, "Scheduler.requires_kv_delivery", "instance",
         "LEAP's preemptions drop in-flight output only where a connector needs delivery"),
    Seam("leap", _SCHED, "Scheduler.kv_holding_waiting", "instance",
         "replaced by a LeapRequestQueue (requests holding KV blocks)"),
    Seam("leap", _SCHED, "Scheduler.async_kv_waiting", "instance",
         "replaced by a LeapRequestQueue (requests that may load KV asynchronously)",
         releases=">=0.34"),
    Seam("leap", _SCHED, "Scheduler._next_waiting_queue", "signature",
         "overridden: waiting's and async_kv_waiting's heads compared by LEAP's rank",
         ("take_async_kv",), releases=">=0.34"),
    *(Seam("leap", _SCHED, "Scheduler.schedule", "call",
           "vLLM takes each next waiting request through _next_waiting_queue",
           ("self._next_waiting_queue",), ours=f"vllm_ext.leap.scheduler:{cls}._next_waiting_queue",
           releases=">=0.34")
      for cls in ("LeapScheduler", "LeapAsyncScheduler")),
    Seam("leap", _SCHED, "Scheduler.requests", "instance", "request lookup"),
    Seam("leap", _SCHED, "Scheduler.finished_req_ids", "instance", "forget finished requests"),
    Seam("leap", _SCHED, "Scheduler.max_num_active_reqs", "instance",
         "free decode slots, as vLLM admits them"),
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
    Seam("leap", _MULTI, "MultiConnector.sub_connectors", "attribute",
         "LEAP inside a MultiConnector"),
    Seam("leap", _MULTI, "MultiKVConnectorWorkerMetadata", "symbol",
         "LEAP's part of a MultiConnector's worker metadata (field `metadata`)"),
    # LEAP: loader
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
    # LEAP: probe batch layout, one per model runner
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
         "V2 hands start_load_kv the step's rows (num_tokens: where rows after trimmed drafts sit)",
         ("request_ids=", "scheduler_output=", "num_tokens="), runner="v2"),
    Seam("leap", _V2_KV, "ActiveKVConnector.post_forward", "source",
         "the step's rows reach the connector before its worker metadata is asked for",
         ("_start_load_kv", "build_connector_worker_meta"), runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "SchedulerOutput.scheduled_spec_decode_tokens",
         "field", "V2 layout: draft tokens a verifying request adds to its rows", runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens", "field",
         "V2 layout: each request's row count", runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "NewRequestData.prompt_token_ids", "field",
         "V2 layout: a new row's prompt length", runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "NewRequestData.num_computed_tokens", "field",
         "V2 layout: a new row's cached prefix", runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "CachedRequestData.num_computed_tokens", "field",
         "V2 layout: a running row's computed tokens", runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "NewRequestData", "symbol",
         "V2 layout: prompt length and computed tokens of new rows", runner="v2"),
    Seam("leap", "vllm.v1.core.sched.output", "CachedRequestData", "symbol",
         "V2 layout: computed tokens of running rows", runner="v2"),
    # how vLLM calls LEAP's overrides
    *connector_calls("leap", "vllm_ext.leap.connector:LeapConnector"),
    *(Seam("leap", "vllm.v1.engine.core", "EngineCore.step", "call",
           "the engine steps the scheduler", (f"self.scheduler.{m}",),
           ours=f"vllm_ext.leap.scheduler:LeapScheduler.{m}")
      for m in ("schedule", "update_from_output")),
    *(Seam("leap", _SCHED, f"Scheduler.{caller}", "call", "the scheduler drives its waiting queue",
           (f"{queue}.{m}",), ours=f"vllm_ext.leap.request_queue:LeapRequestQueue.{m}")
      for caller, queue, m in (
          ("_enqueue_waiting_request", "self.waiting", "add_request"),
          ("_preempt_request", "self.waiting", "prepend_request"),
          ("schedule", "self.waiting", "prepend_requests"),
          ("schedule", "request_queue", "peek_request"),
          ("schedule", "request_queue", "pop_request"),
          ("finish_requests", "self.waiting", "remove_requests"),
      )),
    *worker_meta_calls("leap", "vllm_ext.leap.connector:LeapWorkerMetadata"),
    *(Seam("leap", "vllm.v1.engine.core", "EngineCore.__init__", "call",
           "the engine builds the scheduler (--scheduler-cls)", ("Scheduler",),
           ours=f"vllm_ext.leap.scheduler:{cls}.__init__")
      for cls in ("LeapScheduler", "LeapAsyncScheduler")),
    *(Seam("leap", module, caller, "call", "vLLM builds and drives our loader", (expression,),
           ours=f"vllm_ext.leap.loader:LeapModelLoader.{method}")
      for module, caller, expression, method in (
          (_LOADER, "get_model_loader", "_LOAD_FORMAT_TO_MODEL_LOADER[load_format]", "__init__"),
          (_LOADER, "get_model", "loader.load_model", "load_model"),
          ("vllm.v1.worker.gpu_worker", "Worker.init_device",
           "get_model_loader(self.load_config).get_external_weight_memory",
           "get_external_weight_memory"),
      )),
)  # fmt: skip

# our overrides vLLM does not call (so no call entry), each with the reason
UNCALLED: dict[str, str] = {
    "LeapModelLoader.download_model": "vLLM calls it from loaders' own load_model, which ours "
    "replaces; ours forwards to the inner loader",
    "LeapModelLoader.load_weights": "as download_model: forwarded to the inner loader",
    "LeapRequestQueue.remove_request": "vLLM's scheduler removes through remove_requests",
}
