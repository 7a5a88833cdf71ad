"""HiStateConnector: HiState's host/SSD tiers inside a vLLM 0.32 engine.

Extends ``KVConnectorBase_V1`` + ``SupportsHMA`` (checked on vLLM 0.32.0,
CPU platform, hybrid Gated-DeltaNet + attention models with
``--enable-prefix-caching``, i.e. ``mamba_cache_mode="align"``).

Scheduler side (EngineCore): a :class:`~vllm_ext.histate.runtime.HiStateRuntime`
owns the tiers. ``get_num_new_matched_tokens`` offers the longest prefix past
vLLM's own device hit whose KV blocks (device, else our host tier) and the
recurrent-state snapshot at exactly its end (host or SSD) exist, never the
last prompt token, with the payloads already read. ``update_state_after_alloc``
maps it onto the request's new blocks: attention-group blocks for the KV and
the Mamba-group block at the hit boundary for the state. ``build_connector_meta``
ships these loads and this step's stores (attention blocks the step fills,
plus the exact boundary states vLLM offers in ``boundary_state_offloads``,
admitted by the policy) to the worker.

Worker side: loads are written into the registered pages in ``start_load_kv``
(synchronous: before the forward); stores are copied out of the pages in
``wait_for_save`` (after the forward) and return to the scheduler as worker
metadata, where a background thread inserts them into the tiers (evict, spill
to SSD). Nothing relies on the two halves sharing a process.

Device pool (``bind_kv_cache_manager``, see :mod:`vllm_ext.histate.device_pool`):
with ``release_device_snapshots`` (default) a freed Mamba-group block whose
snapshot a tier holds loses its prefix-cache entry, so vLLM reuses it before
cached KV (counted as ``device_snapshots_released``); a later hit loads the
state back. Always: the Mamba manager's admission count includes the block a
hit's state is loaded into, which vLLM 0.32 leaves out
(:mod:`vllm_ext.patches.mamba_external_state_count`).

Limits: one worker (tensor/pipeline parallel size 1; checked at start).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import get_block_hash

from vllm_ext.common import compat
from vllm_ext.common.config import ConfigError
from vllm_ext.common.log import get_logger
from vllm_ext.common.prom import PublishesCounters
from vllm_ext.common.systems import config_from_vllm
from vllm_ext.histate.alignment import chunk_limit, chunking_problem, state_dtype_problem
from vllm_ext.histate.config import SYSTEM, reject_connector_extra_config
from vllm_ext.histate.device_pool import keep_snapshots_off_device
from vllm_ext.histate.metadata import (
    HiStateMetadata,
    HiStateWorkerMetadata,
    LoadJob,
    cache_layout,
    cache_namespace,
)
from vllm_ext.histate.pages import PageCopier
from vllm_ext.histate.policy import Kind, kv_key, snap_key
from vllm_ext.histate.runtime import (
    COUNTER_SPECS,
    HiStateRuntime,
    LoadPlan,
    StoreItem,
    snapshot_reason,
)
from vllm_ext.patches import mamba_external_state_count

logger = get_logger(__name__)


@dataclass(frozen=True)
class _Pending:
    """What a store sent to the worker needs once its bytes come back."""

    kind: Kind
    position: int
    recompute_tokens: int


class HiStateConnector(PublishesCounters, KVConnectorBase_V1, SupportsHMA):
    COUNTER_SYSTEM = SYSTEM
    COUNTER_SPECS = COUNTER_SPECS

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        if not compat.require("histate"):
            # a seam missing in this vLLM would fail mid-serving: refuse now, naming it
            raise compat.VllmCompatError(
                "HiStateConnector cannot run on this vLLM: " + "; ".join(compat.problems("histate"))
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self.counters = self.make_counters()
        # the scheduler and the worker read the same block of --additional-config
        reject_connector_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.config = config_from_vllm(SYSTEM, vllm_config)
        if vllm_config.parallel_config.world_size > 1:
            raise ConfigError(
                "HiStateConnector supports one worker (tensor and pipeline parallel size 1); "
                f"got world size {vllm_config.parallel_config.world_size}"
            )
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError("HiStateConnector needs --enable-prefix-caching (Mamba align mode)")
        self.attn_group, self.mamba_group, self.groups = cache_layout(kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.runtime: HiStateRuntime | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._check_chunking(vllm_config, kv_cache_config)
            self.runtime = HiStateRuntime(
                self.config, cache_namespace(vllm_config, kv_cache_config), self.counters
            )
        # scheduler state
        self._requests: dict = {}
        self._branch: dict[str, int | None] = {}
        self._plans: dict[str, tuple[int, LoadPlan]] = {}
        self._loads: list[LoadJob] = []
        self._inflight: dict[str, _Pending] = {}
        self._last_snapshot: dict[str, int] = {}
        # worker state
        self._pages: PageCopier | None = None
        self._out = HiStateWorkerMetadata()

    # ---------------------------------------------------------------- scheduler side
    def _check_chunking(self, vllm_config, kv_cache_config) -> None:
        """Refuse a configuration under which no snapshot could ever be stored; log the layout."""
        sched = vllm_config.scheduler_config
        limit = chunk_limit(
            sched.max_num_scheduled_tokens or sched.max_num_batched_tokens,
            sched.long_prefill_token_threshold,
        )
        mamba_block = vllm_config.cache_config.mamba_block_size
        spec = kv_cache_config.kv_cache_groups[self.mamba_group].kv_cache_spec
        dtypes = [str(d).removeprefix("torch.") for d in getattr(spec, "dtypes", ())]
        problem = chunking_problem(self.block_size, mamba_block, limit) or state_dtype_problem(
            dtypes
        )
        if problem is not None:
            raise ConfigError(problem)
        ssd = (
            f"{self.config.ssd_bytes >> 20} MiB in {self.config.directory}"
            if self.config.directory
            else "off"
        )
        logger.info(
            "HiState: block size %d tokens, prefill chunks up to %d tokens aligned to %s, state "
            "dtypes %s; tiers: host %d MiB, SSD %s; policy %s",
            self.block_size, limit, mamba_block, "/".join(dtypes),
            self.config.host_bytes >> 20, ssd, self.config.policy,
        )  # fmt: skip

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        hash_size = kv_cache_manager.block_pool.hash_block_size
        if hash_size != self.block_size:
            raise ConfigError(
                f"HiStateConnector keys blocks by vLLM's block hashes and needs the hash block "
                f"size ({hash_size}) to equal the block size ({self.block_size})"
            )
        # vLLM 0.32 under-counts the Mamba block a hit's state is loaded into
        mamba_external_state_count.apply(kv_cache_manager)
        if self.config.release_device_snapshots and self.runtime is not None:
            keep_snapshots_off_device(kv_cache_manager, self._held_in_tier, self._released)

    def _held_in_tier(self, block) -> bool:
        """Does a tier hold the snapshot cached in this Mamba-group block?"""
        key = snap_key(get_block_hash(block.block_hash).hex())
        return self.runtime.has(key)

    def _released(self, n: int) -> None:
        self.counters.inc("device_snapshots_released", n)

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        req_id = request.request_id
        self._requests.setdefault(req_id, request)
        if num_computed_tokens % self.block_size:
            return 0, False
        local = num_computed_tokens // self.block_size
        cached = self._plans.get(req_id)
        if cached is not None and cached[0] == local:
            # asked again (e.g. no room this step): the payloads are already in hand
            plan = cached[1]
            return (plan.blocks - local) * self.block_size, False
        # the last prompt token is always computed (it yields the first output token)
        max_blocks = (request.num_tokens - 1) // self.block_size
        chain = self._chain(request, max_blocks)
        if req_id not in self._branch:
            self._branch[req_id] = self.runtime.branches.branch_point(chain, len(chain))
            self.runtime.branches.observe(chain)
        plan = self.runtime.plan_load(chain, local, max_blocks)
        if plan is None:
            self._plans.pop(req_id, None)
            return 0, False
        self._plans[req_id] = (local, plan)
        return (plan.blocks - local) * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        cached = self._plans.pop(request.request_id, None)
        if num_external_tokens == 0 or cached is None:
            return
        local, plan = cached
        if num_external_tokens != (plan.blocks - local) * self.block_size:
            raise RuntimeError(
                f"HiState: vLLM allocated {num_external_tokens} external tokens for "
                f"{request.request_id}, the plan covers {(plan.blocks - local) * self.block_size}"
            )
        block_ids = blocks.get_block_ids()
        attn = block_ids[self.attn_group][local : plan.blocks]
        mamba = block_ids[self.mamba_group]
        # align mode: vLLM caches the boundary state in block ``blocks - 1`` and, before
        # the forward (and before start_load_kv), copies that block into the request's
        # running-state block (the last one); the load must fill both
        state_blocks = (mamba[plan.blocks - 1], mamba[-1]) if len(mamba) > plan.blocks else (0,)
        if len(attn) != len(plan.kv_payloads) or 0 in attn or 0 in state_blocks:
            raise RuntimeError(
                f"HiState: unexpected blocks for a {plan.blocks}-block hit of "
                f"{request.request_id}: attention {attn}, recurrent {mamba}"
            )
        self._loads.append(
            LoadJob(
                request.request_id,
                list(zip(attn, plan.kv_payloads, strict=True)),
                state_blocks,
                plan.snapshot,
            )
        )
        self._last_snapshot[request.request_id] = plan.blocks
        self.runtime.record_hit(plan, self.block_size)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(sorted((self.attn_group, self.mamba_group)))

    def build_connector_meta(self, scheduler_output) -> HiStateMetadata:
        meta = HiStateMetadata(loads=self._loads)
        self._loads = []
        state = scheduler_output.kv_connector_block_state
        if state is None:
            return meta
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            self._plan_stores(meta, state, req_id, n)
        for req_id, offers in state.boundary_state_offloads.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            for group_id, block_id, boundary_tokens in offers:
                if group_id == self.mamba_group and boundary_tokens % self.block_size == 0:
                    self._plan_snapshot_store(meta, request, block_id, boundary_tokens)
        return meta

    def _chain(self, request, blocks: int | None = None) -> list[str]:
        hashes = request.block_hashes if blocks is None else request.block_hashes[:blocks]
        return [bytes(h).hex() for h in hashes]

    def _plan_stores(self, meta: HiStateMetadata, state, req_id: str, n: int) -> None:
        """KV blocks this step fills, and the state if the step ends on a block boundary."""
        request = self._requests.get(req_id)
        if request is None:
            return
        bs = self.block_size
        before, after = request.num_computed_tokens, request.num_computed_tokens + n
        first, last = before // bs, min(after // bs, len(request.block_hashes))
        if last <= first:
            return
        block_ids = state.get_block_ids(req_id)
        if block_ids is None:
            return
        ids = block_ids[self.attn_group]
        # a KV block is worth what its loss costs: the prompt hit it supports
        supported = max((request.num_prompt_tokens - 1) // bs, 1)
        for j in range(first, min(last, len(ids))):
            key = kv_key(bytes(request.block_hashes[j]).hex())
            if ids[j] == 0 or key in self._inflight or self.runtime.has(key):
                continue
            meta.stores.append((key, self.attn_group, ids[j]))
            recompute = max(supported, j + 1) * bs
            self._inflight[key] = _Pending(Kind.KV, (j + 1) * bs, recompute)
        if after % bs == 0 and after // bs == last:
            # align mode keeps the running state of a step ending at token k*bs in the
            # block of index k-1; after the forward it is exactly the boundary state.
            # vLLM offers only some of these (none while decoding), so take them here.
            mamba = block_ids[self.mamba_group]
            if len(mamba) >= last:
                self._plan_snapshot_store(meta, request, mamba[last - 1], after)

    def _plan_snapshot_store(self, meta, request, block_id: int, boundary_tokens: int) -> None:
        k = boundary_tokens // self.block_size
        if not 0 < k <= len(request.block_hashes) or block_id == 0:
            return
        req_id = request.request_id
        key = snap_key(bytes(request.block_hashes[k - 1]).hex())
        if key in self._inflight or self.runtime.has(key):
            return
        reason = snapshot_reason(
            k, request.num_prompt_tokens, self.block_size,
            self.config.snapshot_interval_blocks, self._branch.get(req_id),
        )  # fmt: skip
        if reason is None:
            return
        if not self.runtime.admit(reason):
            self.counters.inc("store_rejected")
            return
        previous = self._last_snapshot.get(req_id, 0)
        previous = previous if previous < k else 0
        self._last_snapshot[req_id] = k
        meta.stores.append((key, self.mamba_group, block_id))
        self._inflight[key] = _Pending(
            Kind.SNAPSHOT, boundary_tokens, (k - previous) * self.block_size
        )

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, HiStateWorkerMetadata):
            return
        items = []
        for key, payload in meta.payloads.items():
            info = self._inflight.pop(key, None)
            if info is not None:
                items.append(
                    StoreItem(key, info.kind, payload, info.position, info.recompute_tokens)
                )
        for key in meta.failed:
            self._inflight.pop(key, None)
            self.counters.inc("store_failures")
        self.runtime.submit(items)

    def request_finished_all_groups(self, request, block_ids):
        req_id = request.request_id
        for table in (self._requests, self._branch, self._plans, self._last_snapshot):
            table.pop(req_id, None)
        return False, None

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def shutdown(self):
        if self.runtime is not None:
            self.runtime.close(persist=True)

    def idle_state(self) -> dict[str, int]:
        """Sizes of per-request bookkeeping (all 0 once no request is live; tests)."""
        return {
            "requests": len(self._requests),
            "plans": len(self._plans),
            "loads": len(self._loads),
            "inflight": len(self._inflight),
        }

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches) -> None:
        self._pages = PageCopier(kv_caches, self.groups, self.num_blocks)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiStateMetadata) or not meta.loads:
            return
        assert self._pages is not None, "HiState: KV caches were never registered"
        for job in meta.loads:
            # a failed write here would compute on a wrong state: let it raise
            for block_id, payload in job.kv:
                self._pages.write(self.attn_group, block_id, payload)
            for block_id in job.snapshot_blocks:
                self._pages.write(self.mamba_group, block_id, job.snapshot)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiStateMetadata) or not meta.stores:
            return
        for key, group_id, block_id in meta.stores:
            try:
                self._out.payloads[key] = self._pages.read(group_id, block_id)
            except Exception:  # noqa: BLE001 - a lost store is a future miss, never an error
                logger.exception("HiState: copying out %s (block %d) failed", key, block_id)
                self._out.failed.append(key)

    def build_connector_worker_meta(self) -> HiStateWorkerMetadata | None:
        if not self._out.payloads and not self._out.failed:
            return None
        out, self._out = self._out, HiStateWorkerMetadata()
        return out

    @property
    def requires_kv_delivery(self) -> bool:
        # a dropped store is a future miss; preempted requests need no hand-off
        return False
