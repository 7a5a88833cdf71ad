"""ArkConnector: vLLM P/D disaggregation whose KV moves on ARK-planned source ports.

Extends ``KVConnectorBase_V1`` (checked on vLLM 0.32.0, CPU platform,
``kv_buffer_device=cpu``). Roles: ``kv_producer`` (prefill) and
``kv_consumer`` (decode); one worker per instance (TP = PP = 1); models whose
KV is one attention group (no hybrid / sliding-window groups).

A proxy (:mod:`vllm_ext.ark.proxy`) sends each request first to the prefill
instance with ``kv_transfer_params = {"do_remote_decode": true, "transfer_id",
"remote_host", "remote_port"}`` (the decode instance's KV listener) and
``max_tokens = 1``, then to the decode instance with ``{"do_remote_prefill":
true, "transfer_id"}``.

Prefill, scheduler side (EngineCore): when a request is first scheduled
(before its KV exists) the :class:`~vllm_ext.ark.selector.PortSelector` plans
its source port from this sender's view of its peers' announcements and
announces it; on the step that completes the prompt the metadata tells the
worker which blocks to send, to whom, from which port (a few integers: the KV
never travels in metadata). Worker: after that step's forward
(``wait_for_save``) the blocks are copied out and queued on the
:class:`~vllm_ext.ark.transport.KvSender` lane bound to the planned port; the
blocks are freed once the scheduler has finished the request.

Decode, scheduler side: a request with ``do_remote_prefill`` offers its whole
prompt as an asynchronous external hit (vLLM recomputes the last token);
worker: frames arrive on the :class:`~vllm_ext.ark.transport.KvReceiver`
(``host:data_port``) and are written into the request's blocks when both the
frame and the load order are there. Only the ``kv_senders`` may connect, and
with ``secret_file`` every frame and announcement must carry the secret's HMAC
(:mod:`~vllm_ext.ark.auth`); a forged frame is dropped and counted, so the
request takes its own frame, or none and is recomputed. A frame that never comes within
``load_timeout_s`` or does not fit this cache is a load error: vLLM
recomputes or fails the request per ``kv_load_failure_policy``.

vLLM 0.34 (checked against its code): blocks are copied with torch ops
(``index_select`` to host, ``index_copy_`` back), nothing is registered with
an RDMA engine, so ``kv_cache_access()`` keeps the default ``IN_PROCESS``; the
worker half may be created after warm-up and opens its sender / listener in
``register_kv_caches``, sized from its own ``kv_cache_config`` (the committed
block count; a block split into kernel blocks is addressed as one);
``may_load_async`` is true only on the decode side, for ``do_remote_prefill``;
``requires_kv_delivery`` keeps the default (the prefill
side hands KV off: a request preempted with its hand-off pending is
recomputed); ``unregister_kv_caches`` / ``restore_kv_caches`` keep their
no-op defaults (only torch views are held). The seams are checked in
``__init__`` (:func:`~vllm_ext.common.compat.ensure`).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_ext.ark.announce import Announcer
from vllm_ext.ark.auth import load_secret
from vllm_ext.ark.blocks import LayoutMismatch, block_dim, gather, manager_block_view, scatter
from vllm_ext.ark.config import load_ark_config, parse_endpoint
from vllm_ext.ark.counters import COUNTER_SPECS, SYSTEM
from vllm_ext.ark.fabric import Fabric, Transfer
from vllm_ext.ark.paths import LearnedMap, load_fabric_file
from vllm_ext.ark.selector import PortSelector
from vllm_ext.ark.transport import KvReceiver, KvSender
from vllm_ext.common import compat
from vllm_ext.common.config import ConfigError
from vllm_ext.common.log import get_logger
from vllm_ext.common.prom import PublishesCounters

logger = get_logger(__name__)


@dataclass(frozen=True)
class SendJob:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    dst: tuple[str, int]
    port: int


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]  # this instance's blocks to fill, in order
    first: int  # index of the first of them among the sender's blocks


@dataclass
class ArkMetadata(KVConnectorMetadata):
    sends: list[SendJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


@dataclass
class _Planned:
    request: object
    transfer_id: str
    dst: tuple[str, int]
    port: int


class ArkConnector(PublishesCounters, KVConnectorBase_V1):
    COUNTER_SYSTEM = SYSTEM
    COUNTER_SPECS = COUNTER_SPECS

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        # a seam this vLLM lacks would fail mid-serving: refuse now, in one line
        compat.ensure("ark")
        super().__init__(vllm_config, role, kv_cache_config)
        self.counters = self.make_counters()
        additional = getattr(vllm_config, "additional_config", None) or {}
        self.config = load_ark_config(additional.get(SYSTEM))
        kv_role = self._kv_transfer_config.kv_role
        if kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(f"ArkConnector needs kv_role kv_producer or kv_consumer, "
                              f"got {kv_role!r}")  # fmt: skip
        self.producer = kv_role == "kv_producer"
        if vllm_config.parallel_config.world_size > 1:
            raise ConfigError("ArkConnector supports one worker (TP = PP = 1)")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ConfigError(f"ArkConnector supports models with one KV cache group "
                              f"(plain attention); this one has {len(groups)}")  # fmt: skip
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        spec = groups[0].kv_cache_spec
        self.bytes_per_block = spec.page_size_bytes * len(groups[0].layer_names)
        self._max_model_len = vllm_config.model_config.max_model_len
        self._rng = random.Random()
        self._secret = self._load_secret()
        # scheduler side
        self._planned: dict[str, _Planned] = {}
        self._staged: dict[str, _Planned] = {}
        self._loads: list[LoadJob] = []
        self._loading: set[str] = set()
        self.announcer: Announcer | None = None
        self.selector: PortSelector | None = None
        if role == KVConnectorRole.SCHEDULER and self.producer:
            self._start_planner()
        # worker side
        self._kv: dict = {}
        self._dims: dict[str, int] = {}
        self.sender: KvSender | None = None
        self.receiver: KvReceiver | None = None
        self._awaiting_free: set[str] = set()
        self._finished: set[str] = set()
        self._pending: dict[str, tuple[LoadJob, float]] = {}
        self._load_errors: set[int] = set()

    def _load_secret(self) -> bytes | None:
        cfg = self.config
        if cfg.secret_file is not None:
            return load_secret(cfg.secret_file)
        logger.warning(
            "ARK: no secret_file: KV frames and announcements are not authenticated; anyone "
            "who reaches this instance's ARK ports can %s (see docs/security.md)",
            "steer its port planner" if self.producer else "hand it forged KV for a request",
        )  # fmt: skip
        return None

    def _start_planner(self) -> None:
        cfg = self.config
        fabric, paths = Fabric({}, 1), LearnedMap()
        if cfg.fabric_file is not None:
            try:
                fabric, paths = load_fabric_file(cfg.fabric_file)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"ArkConfig.fabric_file {cfg.fabric_file!r}: {exc}") from exc
        peers = {peer: parse_endpoint(peer) for peer in cfg.peers}
        me = f"{cfg.host}:{cfg.announce_port}"
        self.announcer = Announcer(me, cfg.host, cfg.announce_port, peers,
                                   counters=self.counters, secret=self._secret).start()  # fmt: skip
        self.selector = PortSelector(self.announcer, fabric, paths, min_bytes=cfg.min_bytes)
        logger.info(
            "ARK: planning source ports %d-%d from %s; announcing on %s:%d to %d peers",
            cfg.port_base,
            cfg.port_base + cfg.port_count - 1,
            cfg.fabric_file or "no path map",
            cfg.host,
            cfg.announce_port,
            len(peers),
        )

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if self.producer or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def may_load_async(self, request) -> bool:
        # vLLM >= 0.34 asks before queueing a request: only the decode side ever loads
        params = request.kv_transfer_params
        return not self.producer and bool(params and params.get("do_remote_prefill"))

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if not params:
            return
        if not self.producer:
            if not params.get("do_remote_prefill"):
                return
            params["do_remote_prefill"] = False  # one load per request
            if num_external_tokens > 0:
                first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
                last = math.ceil(request.num_prompt_tokens / self.block_size)
                ids = blocks.get_block_ids()[0][first:last]
                self._loads.append(LoadJob(request.request_id, _transfer_id(request),
                                           tuple(ids), first))  # fmt: skip
                self._loading.add(request.request_id)
            return
        if params.get("do_remote_decode") and request.request_id not in self._planned:
            self._plan(request, params)

    def _plan(self, request, params) -> None:
        try:
            dst = (str(params["remote_host"]), int(params["remote_port"]))
        except (KeyError, TypeError, ValueError):
            logger.warning("ARK: request %s has no decode address in kv_transfer_params; "
                           "its KV is not sent", request.request_id)  # fmt: skip
            return
        cfg = self.config
        nbytes = math.ceil(request.num_prompt_tokens / self.block_size) * self.bytes_per_block
        now = time.monotonic()
        transfer = Transfer(_transfer_id(request), cfg.host, dst[0], nbytes, now,
                            now + nbytes * 8 / (cfg.link_gbps * 1e9),
                            self._rng.choice(cfg.candidates), dst[1])  # fmt: skip
        choice = self.selector.select(transfer, cfg.candidates)
        self._planned[request.request_id] = _Planned(request, transfer.transfer_id, dst,
                                                     choice.port)  # fmt: skip

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = ArkMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, planned in list(self._planned.items()):
            request = planned.request
            n = scheduled.get(req_id, 0)
            if not n or request.num_computed_tokens + n < request.num_prompt_tokens:
                continue
            count = math.ceil(request.num_prompt_tokens / self.block_size)
            ids = self._kv_cache_manager.get_block_ids(req_id)[0][:count]
            meta.sends.append(SendJob(req_id, planned.transfer_id, tuple(ids), planned.dst,
                                      planned.port))  # fmt: skip
            self._staged[req_id] = self._planned.pop(req_id)
        return meta

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        if req_id in self._loading:  # aborted while its KV may still be written: keep blocks
            return True, None
        planned = self._planned.pop(req_id, None)
        if planned is not None and self.announcer is not None:  # never reached its send
            self.announcer.withdraw([planned.transfer_id])
        staged = self._staged.pop(req_id, None)
        if staged is None:
            return False, None
        return True, {"transfer_id": staged.transfer_id, "ark_port": staged.port}

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches) -> None:
        self._kv = {name: manager_block_view(t, self.num_blocks) for name, t in kv_caches.items()}
        self._dims = {name: block_dim(t.shape, self.num_blocks) for name, t in self._kv.items()}
        cfg = self.config
        if self.producer:
            self.sender = KvSender(cfg.host, counters=self.counters, secret=self._secret)
        else:
            # no frame can be larger than a max-length prompt's blocks: a bigger one is refused
            # before any memory is allocated for it
            max_blocks = math.ceil(self._max_model_len / self.block_size)
            self.receiver = KvReceiver(cfg.host, cfg.data_port, ttl_s=cfg.load_timeout_s,
                                       max_payload=max_blocks * self.bytes_per_block,
                                       counters=self.counters,
                                       allowed_hosts=cfg.kv_senders or None,
                                       secret=self._secret)  # fmt: skip
            logger.info("ARK: receiving KV on %s:%d from %s", *self.receiver.address,
                        ", ".join(cfg.kv_senders) or "any address")  # fmt: skip
            if not cfg.kv_senders:
                logger.warning("ARK: kv_senders is empty: KV frames are accepted from any "
                               "address that reaches %s:%d", *self.receiver.address)  # fmt: skip

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        deadline = time.monotonic() + self.config.load_timeout_s
        for job in getattr(meta, "loads", ()):
            self._pending[job.req_id] = (job, deadline)

    def wait_for_layer_load(self, layer_name) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for job in getattr(meta, "sends", ()):
            blocks, payload = gather(self._kv, self._dims, job.block_ids, self.block_size)
            self.sender.send(job.transfer_id, blocks, payload.numpy(), job.dst, job.port)
            self._awaiting_free.add(job.req_id)

    def get_finished(self, finished_req_ids):
        if self.producer:
            # the payload was copied out in wait_for_save: free once vLLM finished the request
            self._finished |= set(finished_req_ids) & self._awaiting_free
            done, self._finished = self._finished, set()
            self._awaiting_free -= done
            return (done or None), None
        return None, (self._try_loads() or None)

    def _try_loads(self) -> set[str]:
        done = set()
        now = time.monotonic()
        for req_id, (job, deadline) in list(self._pending.items()):
            arrived = self.receiver.take(job.transfer_id)
            if arrived is None and now < deadline:
                continue
            del self._pending[req_id]
            done.add(req_id)
            if arrived is None:
                self.counters.inc("load_timeouts")
                self._load_errors.update(job.block_ids)
                logger.warning("ARK: KV of %s (transfer %s) did not arrive within %.0f s",
                               req_id, job.transfer_id, self.config.load_timeout_s)  # fmt: skip
                continue
            try:
                scatter(self._kv, self._dims, arrived.meta, arrived.payload, job.block_ids,
                        job.first, self.block_size)  # fmt: skip
            except LayoutMismatch as exc:
                self.counters.inc("frames_rejected")
                self._load_errors.update(job.block_ids)
                logger.warning("ARK: KV of %s does not fit this cache: %s", req_id, exc)
        self.receiver.sweep()
        return done

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for part in (self.announcer, self.sender, self.receiver):
            if part is not None:
                part.close()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from vllm_ext.ark.prom import ArkPromMetrics

        return ArkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _transfer_id(request) -> str:
    params = request.kv_transfer_params or {}
    transfer_id = params.get("transfer_id")
    return str(transfer_id) if transfer_id else request.request_id
