"""AcctConnector: import a long prefix's KV into vLLM's paged cache instead of prefilling it.

Extends ``KVConnectorBase_V1`` (checked on vLLM 0.32.0, CPU platform,
single-group attention models). Configured by ``--additional-config
'{"acct": {...}}'`` (:class:`~vllm_ext.acct.config.AcctConfig`).

Scheduler side: ``get_num_new_matched_tokens`` offers the block-aligned
prompt prefix past vLLM's own cache hit, never the last prompt token (it
yields the first output token), for prefixes of at least
``min_prefix_tokens``; the load is synchronous. ``update_state_after_alloc``
turns the offer into an :class:`~vllm_ext.acct.importer.ImportJob` (token ids
and block ids only: no KV crosses the process boundary).

Worker side: ``start_load_kv`` runs the source and the converters and writes
each layer through the attention backend's own ``do_kv_cache_update``
(``cpu_attn_reshape_and_cache`` on CPU, ``reshape_and_cache_flash`` on CUDA);
on CUDA on a side stream, and ``wait_for_layer_load`` makes layer ``j`` wait
for its own import only. After the forward the online check runs; a failed
check or an error reports the request's imported blocks through
``get_block_ids_with_load_errors`` and vLLM recomputes them
(``kv_load_failure_policy="recompute"``, required). A request that failed is
not offered again.

Offline gate: a converter checkpoint is loaded only if it was fitted for the
served model (shape and weights digest) and its stored gate report passes
``max_delta_nll`` / ``min_top1``; otherwise the engine does not start.

vLLM 0.34 (checked against its code): the KV cache is reached in process
only (the backend's write op), so ``kv_cache_access()`` keeps the default
``IN_PROCESS`` and the extensible KV cache stays on; the worker half may be
created after warm-up (``extend_kv_cache``) and needs nothing before
``register_kv_caches``; an import is a synchronous load, so vLLM runs
``start_load_kv`` before the forward (``SchedulerOutput.has_sync_kv_loads``);
``may_load_async`` is False (no async load ever) and ``requires_kv_delivery``
False (nothing is handed off); ``unregister_kv_caches`` / ``restore_kv_caches``
keep their no-op defaults: only torch views are held, which sleep mode keeps
valid. The seams are checked in ``__init__``
(:func:`~vllm_ext.common.compat.ensure`).

Limits: one worker (tensor/pipeline parallel size 1), Llama-architecture
models from a local folder, one KV-cache group (no hybrids). The source and
converters on the device are outside vLLM's memory budget (they load after the
KV cache is sized, on every release).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_ext.acct import checkpoint as ckpt
from vllm_ext.acct.config import from_additional_config
from vllm_ext.acct.counters import COUNTER_SPECS
from vllm_ext.acct.gate import check_offline_gate
from vllm_ext.acct.importer import CheckSettings, ImportJob, ImportStep
from vllm_ext.acct.llama import TorchLlama
from vllm_ext.common import compat
from vllm_ext.common.config import ConfigError
from vllm_ext.common.log import get_logger
from vllm_ext.common.prom import PublishesCounters

logger = get_logger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class AcctMetadata(KVConnectorMetadata):
    jobs: list[ImportJob] = field(default_factory=list)


def layer_index(layer_name: str) -> int:
    found = _LAYER_INDEX.findall(f".{layer_name}.")
    if len(found) != 1:
        raise ConfigError(f"cannot tell the decoder layer of attention layer {layer_name!r}")
    return int(found[0])


class AcctConnector(PublishesCounters, KVConnectorBase_V1):
    COUNTER_SYSTEM = "acct"
    COUNTER_SPECS = COUNTER_SPECS

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        # a seam this vLLM lacks would fail mid-serving: refuse now, in one line
        compat.ensure("acct")
        super().__init__(vllm_config, role, kv_cache_config)
        self.counters = self.make_counters()
        self.config = from_additional_config(vllm_config.additional_config)
        self.block_size = vllm_config.cache_config.block_size
        self._check_setup(vllm_config, kv_cache_config)
        self.model_dir = Path(vllm_config.model_config.model)
        self.meta = self._check_checkpoint()
        self.model_dtype = vllm_config.model_config.dtype
        # scheduler state
        self._jobs: list[ImportJob] = []
        self._offers: dict[str, int] = {}  # request -> vLLM's own hit when the offer was made
        self._imported_blocks: dict[str, set[int]] = {}
        self._declined: set[str] = set()
        # worker state
        self._pipeline = None
        self._caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._step: ImportStep | None = None
        if role == KVConnectorRole.WORKER:
            target = TorchLlama.from_pretrained(self.model_dir)
            self._pipeline, _ = ckpt.load_pipeline(self.config.checkpoint, self.model_dir, target)

    def _check_setup(self, vllm_config, kv_cache_config) -> None:
        if self.config.checkpoint is None:
            raise ConfigError(
                'AcctConnector needs --additional-config \'{"acct": {"checkpoint": ...}}\' '
                "(a folder from `python -m vllm_ext.acct train`, or 'identity')"
            )
        if vllm_config.parallel_config.world_size > 1:
            raise ConfigError(
                "AcctConnector supports one worker (tensor and pipeline parallel size 1); "
                f"got world size {vllm_config.parallel_config.world_size}"
            )
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                "AcctConnector supports models with one KV-cache group (attention only); "
                f"this one has {len(kv_cache_config.kv_cache_groups)}"
            )
        policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        if self.config.check_tokens > 0 and policy != "recompute":
            raise ConfigError(
                "AcctConnector's online check falls back to vLLM's own prefill: set "
                f'kv_load_failure_policy="recompute" in --kv-transfer-config (got {policy!r}), '
                "or turn the check off with acct.check_tokens=0"
            )
        if not Path(vllm_config.model_config.model).is_dir():
            raise ConfigError(
                f"AcctConnector needs the model as a local folder, got "
                f"{vllm_config.model_config.model!r}"
            )

    def _check_checkpoint(self):
        if self.config.checkpoint == ckpt.IDENTITY:
            logger.warning("ACCT: identity import (the target's own KV; as costly as a prefill)")
            return None
        meta = ckpt.read_meta(self.config.checkpoint)
        diffs = ckpt.identity_mismatch(meta.target, ckpt.target_identity(self.model_dir))
        if diffs:
            raise ConfigError(
                f"ACCT checkpoint {self.config.checkpoint} was fitted for another model: "
                + "; ".join(diffs)
            )
        check_offline_gate(
            meta.gate, self.config.max_delta_nll, self.config.min_top1, self.config.checkpoint
        )
        logger.info(
            "ACCT: checkpoint %s (first %d layers + converters, %d exact sinks, %d exact tail), "
            "held-out delta NLL %.3f, top-1 %.3f",
            self.config.checkpoint, meta.source_layers, meta.sink_tokens, meta.tail_tokens,
            meta.gate["delta_nll"], meta.gate["top1"],
        )  # fmt: skip
        return meta

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self._declined or num_computed_tokens % self.block_size:
            return 0, False
        # the last prompt token is always computed: it yields the first output token
        end = (request.num_tokens - 1) // self.block_size * self.block_size
        if end < self.config.min_prefix_tokens or end <= num_computed_tokens:
            self._offers.pop(request.request_id, None)
            return 0, False
        self._offers[request.request_id] = num_computed_tokens
        return end - num_computed_tokens, False

    def may_load_async(self, request) -> bool:
        # vLLM >= 0.34 asks before queueing a request; ACCT's imports are synchronous
        return False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        start = self._offers.pop(request.request_id, None)
        if num_external_tokens == 0 or start is None:
            return
        (block_ids,) = blocks.get_block_ids()
        end = start + num_external_tokens
        job = ImportJob(
            request.request_id,
            tuple(request.all_token_ids[:end]),
            tuple(block_ids[: end // self.block_size]),
            start,
        )
        self._jobs.append(job)
        self._imported_blocks[request.request_id] = set(job.written_blocks(self.block_size))

    def build_connector_meta(self, scheduler_output) -> AcctMetadata:
        meta = AcctMetadata(jobs=self._jobs)
        self._jobs = []
        return meta

    def update_connector_output(self, connector_output) -> None:
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for req_id, blocks in list(self._imported_blocks.items()):
            if blocks & invalid:
                self._declined.add(req_id)

    def request_finished(self, request, block_ids):
        self._imported_blocks.pop(request.request_id, None)
        self._offers.pop(request.request_id, None)
        self._declined.discard(request.request_id)
        return False, None

    def idle_state(self) -> dict[str, int]:
        """Sizes of per-request bookkeeping (all 0 once no request is live; tests)."""
        return {
            "jobs": len(self._jobs),
            "offers": len(self._offers),
            "imported": len(self._imported_blocks),
            "declined": len(self._declined),
        }

    # worker side
    def register_kv_caches(self, kv_caches) -> None:
        self._caches = dict(kv_caches)
        self._layer_of = {name: layer_index(name) for name in kv_caches}
        layers = sorted(self._layer_of.values())
        expected = list(range(self._pipeline.num_layers))
        if layers != expected:
            raise ConfigError(f"ACCT: attention layers {layers}, the model has {expected}")
        device = next(iter(kv_caches.values())).device
        # CPU computes in fp32 (CPU bf16 matmuls are slow); CUDA in the model dtype
        dtype = torch.float32 if device.type == "cpu" else self.model_dtype
        self._pipeline.target.to(device=device, dtype=dtype)
        if self._pipeline.converters is not None:
            self._pipeline.converters.to(device=device, dtype=dtype)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._step = None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, AcctMetadata) or not meta.jobs:
            return
        names = {index: name for name, index in self._layer_of.items()}
        layers = forward_context.no_compile_layers

        def write(index, key, value, slots):
            name = names[index]
            layer = layers[name]
            layer.impl.do_kv_cache_update(layer, key, value, self._caches[name], slots)

        check = CheckSettings(self.config.check_tokens, self.config.check_max_gap)
        self._step = ImportStep(
            self._pipeline, meta.jobs, self.block_size, write, self.model_dtype, check
        )
        self._step.run()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._step is not None:
            self._step.wait(self._layer_of[layer_name])

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        step, self._step = self._step, None
        if step is None:
            return set()
        result = step.finish()
        self.counters.inc("conversion_seconds", result.seconds)
        self.counters.inc("imported_tokens", sum(job.tokens for job in result.imported))
        failed = result.gate_failed + result.errors
        if result.gate_failed:
            self.counters.inc("gate_failures", len(result.gate_failed))
        for job in result.errors:
            logger.error(
                "ACCT: import of %s failed (%s); vLLM recomputes it",
                job.req_id, step.errors[job.req_id],
            )  # fmt: skip
        for job in result.gate_failed:
            verdict = step.verdicts[job.req_id]
            logger.warning(
                "ACCT: online check rejected %s (NLL %.3f over the import, %.3f over the sinks "
                "alone); vLLM recomputes it", job.req_id, verdict.nll_import, verdict.nll_local,
            )  # fmt: skip
        self.counters.inc("recomputes", len(failed))
        return {block for job in failed for block in job.written_blocks(self.block_size)}

    @property
    def requires_kv_delivery(self) -> bool:
        return False
