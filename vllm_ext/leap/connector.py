"""LeapConnector: carries probe vectors from the worker to the scheduler with the step's output.

Extends ``KVConnectorBase_V1`` + ``SupportsHMA`` (vLLM 0.32.0); it moves no KV.
Worker side: after each forward, ``build_connector_worker_meta()`` returns the
vectors the probe captured (:mod:`vllm_ext.leap.probe`; on CUDA by default
those of the step before, copied without a sync: ``probe_delivery``). Scheduler side:
``update_connector_output()`` hands them to :class:`~vllm_ext.leap.runtime.LeapRuntime`,
which predicts; ``request_finished_all_groups()`` feeds the true length back
(RLS) and returns ``{"leap": {...}}`` as the request's ``kv_transfer_params``.
Counters reach ``/metrics`` as ``vllm_ext:leap_*_total``. Composes with other
connectors through vLLM's MultiConnector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.platforms import current_platform
from vllm.v1.request import RequestStatus

from vllm_ext.common.connector import NoKVTransfer
from vllm_ext.common.prom import PublishesCounters
from vllm_ext.leap import loader
from vllm_ext.leap.runtime import COUNTERS, LeapRuntime
from vllm_ext.leap.settings import leap_config_from_vllm


@dataclass
class LeapMetadata(KVConnectorMetadata):
    finished_req_ids: frozenset[str] = frozenset()


@dataclass
class LeapWorkerMetadata(KVConnectorWorkerMetadata):
    # req_id -> [hidden] float32 numpy vector (rows of one array copied off the device)
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    # refinement probes: req_id -> (output tokens so far, vector)
    decode: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # tensor-parallel workers see the same batch; any one's vectors will do
        if isinstance(other, LeapWorkerMetadata):
            for req_id, vector in other.vectors.items():
                self.vectors.setdefault(req_id, vector)
            for req_id, probe in other.decode.items():
                self.decode.setdefault(req_id, probe)
        return self


def leap_worker_meta(connector_output, connector) -> KVConnectorWorkerMetadata | None:
    """LEAP's part of a step's worker metadata; ``connector`` is the scheduler's own
    (LEAP's, or a MultiConnector holding it, whose metadata is one entry per connector)."""
    meta = connector_output.kv_connector_worker_meta
    if meta is None or isinstance(connector, LeapConnector):
        return meta
    if not isinstance(connector, MultiConnector):  # someone else's connector: not ours
        return None
    for inner, part in zip(connector.sub_connectors, getattr(meta, "metadata", ()), strict=False):
        if isinstance(inner, LeapConnector):
            return part
    return None


class LeapConnector(PublishesCounters, NoKVTransfer, KVConnectorBase_V1, SupportsHMA):
    COUNTER_SYSTEM = "leap"
    COUNTER_SPECS = COUNTERS

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.counters = self.make_counters()
        self.config = leap_config_from_vllm(vllm_config)
        self.runtime = (
            LeapRuntime(
                self.config,
                self.counters,
                hidden_size=vllm_config.model_config.get_hidden_size(),
                background_rls=self.config.rls_in_background(current_platform.is_cpu()),
                background_predictor=self.config.predictions_in_background(
                    current_platform.is_cpu()
                ),
            )
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self._delivered: LeapWorkerMetadata | None = None

    # ---- scheduler side
    @property
    def requires_kv_delivery(self) -> bool:
        # LEAP hands no KV off when a request finishes, so a request preempted with
        # output still in flight (pipeline parallel, async scheduling) keeps that
        # output; vLLM's default (true for kv_both) would drop it and recompute
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:
        # vLLM 0.34: a configured connector must opt in, or speculative decoding
        # (EAGLE/MTP) loses its lookahead block hashes; LEAP reads no block hash
        return True

    def may_load_async(self, request) -> bool:
        # vLLM 0.34: LEAP never loads KV (vLLM's default reads do_remote_prefill);
        # beside a P/D connector in a MultiConnector, that one answers
        return False

    def build_connector_meta(self, scheduler_output):
        return LeapMetadata(finished_req_ids=frozenset(scheduler_output.finished_req_ids))

    def update_connector_output(self, connector_output):
        self.deliver_probes(connector_output.kv_connector_worker_meta)

    def deliver_probes(self, meta, is_live=None) -> None:
        """Hand a step's probe vectors to the runtime, once per step.

        The LEAP scheduler calls this before vLLM processes the step's outputs
        (vLLM itself calls ``update_connector_output`` only after finishing
        requests, too late for a request whose first token ends it); the later
        call with the same metadata object is then a no-op. ``is_live(req_id)``
        drops vectors of requests aborted meanwhile, so none leaves an entry behind.
        """
        if not isinstance(meta, LeapWorkerMetadata) or meta is self._delivered:
            return
        self._delivered = meta
        self.runtime.on_probes(
            {r: v for r, v in meta.vectors.items() if is_live is None or is_live(r)}
        )
        self.runtime.on_decode_probes(
            {r: p for r, p in meta.decode.items() if is_live is None or is_live(r)}
        )

    def shutdown(self):
        # the scheduler's shutdown: learned weights still in flight reach the checkpoint
        if self.runtime is not None:
            self.runtime.close()
        return super().shutdown()

    def request_finished(self, request, block_ids):
        info = self.runtime.on_finished(
            request.request_id,
            request.num_output_tokens,
            stopped=request.status == RequestStatus.FINISHED_STOPPED,
            length_capped=request.status == RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        return False, {"leap": info}

    # ---- worker side
    def start_load_kv(self, forward_context, **kwargs):
        # Model Runner V2 names the step's rows here, before it asks for the worker
        # metadata; V1 passes no kwargs (its probe reads the bound runner instead)
        steps = loader.V2_STEPS
        if steps is not None and "request_ids" in kwargs:
            # num_tokens: where each row sits when adaptive draft verification trims drafts
            steps.observe(
                kwargs["scheduler_output"], kwargs["request_ids"], kwargs.get("num_tokens")
            )

    def build_connector_worker_meta(self):
        probe = loader.PROBE
        if probe is None:
            return None
        if self.has_connector_metadata():
            probe.forget(self._get_connector_metadata().finished_req_ids)
        started = time.perf_counter()
        vectors, decode = probe.collect()
        self.counters.inc("worker_probe_seconds", time.perf_counter() - started)
        return LeapWorkerMetadata(vectors=vectors, decode=decode) if vectors or decode else None
