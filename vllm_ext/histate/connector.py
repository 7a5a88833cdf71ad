"""HiStateConnector: HiState's host/SSD tiers inside a vLLM 0.32 engine.

Extends ``KVConnectorBase_V1`` + ``SupportsHMA`` (checked on vLLM 0.32.0,
CPU platform, hybrid Gated-DeltaNet + attention models with
``--enable-prefix-caching``, i.e. ``mamba_cache_mode="align"``). Only ids and
sizes cross between the two halves (:mod:`vllm_ext.histate.metadata`).

Scheduler side (EngineCore): :class:`~vllm_ext.histate.scheduler_side.SchedulerSide`
over the index and policy (:class:`~vllm_ext.histate.runtime.HiStateRuntime`).
``get_num_new_matched_tokens`` offers the longest prefix past vLLM's own
device hit whose KV blocks (device, else our host tier) and the recurrent-state
snapshot at exactly its end (host, or SSD once the worker has staged it)
exist, never the last prompt token. ``update_state_after_alloc`` maps it onto
the request's new blocks: attention-group blocks for the KV and the
Mamba-group block at the hit boundary for the state. ``build_connector_meta``
sends the tier operations the index decided (drop, spill, stage), these
loads and this step's stores (attention blocks the step fills, plus the exact
boundary states vLLM offers in ``boundary_state_offloads``, admitted by the
policy); ``update_connector_output`` indexes what the worker reports.

Worker side: :class:`~vllm_ext.histate.worker_store.WorkerStore` holds the
bytes (host tensors, pinned on CUDA; the SSD files) and applies operations
and loads in ``start_load_kv`` (before the forward when the step loads) and
stores in ``wait_for_save`` (after it). Nothing relies on the two halves
sharing a process.

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

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, get_block_hash

from vllm_ext.common import compat
from vllm_ext.common.config import ConfigError
from vllm_ext.common.log import get_logger
from vllm_ext.common.prom import PublishesCounters
from vllm_ext.common.systems import config_from_vllm
from vllm_ext.histate.alignment import chunk_limit, chunking_problem, state_dtype_problem
from vllm_ext.histate.config import SYSTEM, reject_connector_extra_config
from vllm_ext.histate.device_pool import keep_snapshots_off_device
from vllm_ext.histate.folder_safety import FolderPolicy, ensure_safe_folder
from vllm_ext.histate.metadata import (
    HiStateMetadata,
    HiStateWorkerMetadata,
    cache_layout,
    cache_namespace,
)
from vllm_ext.histate.pages import PageCopier
from vllm_ext.histate.policy import snap_key
from vllm_ext.histate.runtime import COUNTER_SPECS, HiStateRuntime
from vllm_ext.histate.scheduler_side import SchedulerSide
from vllm_ext.histate.snapfile import SnapshotStore, scan
from vllm_ext.histate.ssd_tier import sized_ssd_tier
from vllm_ext.histate.worker_store import WorkerStore
from vllm_ext.patches import mamba_external_state_count

logger = get_logger(__name__)


class HiStateConnector(PublishesCounters, KVConnectorBase_V1, SupportsHMA):
    COUNTER_SYSTEM = SYSTEM
    COUNTER_SPECS = COUNTER_SPECS

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        # a seam missing in this vLLM would fail mid-serving: refuse now, naming it
        compat.ensure("histate")
        super().__init__(vllm_config, role, kv_cache_config)
        self.counters = self.make_counters()
        # the scheduler and the worker read the same block of --additional-config
        reject_connector_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        # SSD folder as served: "~" expanded, capacity capped by its disk (logged)
        self.config = sized_ssd_tier(config_from_vllm(SYSTEM, vllm_config))
        # before anything in the folder is read (the namespace reads its fingerprint cache)
        ensure_safe_folder(self.config)
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
        self.namespace = cache_namespace(vllm_config, kv_cache_config, self.config.directory)
        self.runtime: HiStateRuntime | None = None
        self.side: SchedulerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._check_chunking(vllm_config, kv_cache_config)
            has_ssd = self.config.directory is not None and self.config.ssd_bytes > 0
            # the files are the worker's; the index only reads their headers
            access = FolderPolicy.of(self.config)
            files = scan(self.config.directory, self.namespace, access=access) if has_ssd else {}
            self.runtime = HiStateRuntime(self.config, self.counters, files, _local_worker)
            self.side = SchedulerSide(
                self.config, self.runtime, self.block_size, self.attn_group, self.mamba_group,
                _tail_extra if _tails_supported(self.config, vllm_config) else None,
            )  # fmt: skip
        self._pages: PageCopier | None = None
        self.store: WorkerStore | None = None
        self._tails_copied: set[str] = set()  # worker: requests whose tails are copied

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
        self.side.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(sorted((self.attn_group, self.mamba_group)))

    def build_connector_meta(self, scheduler_output) -> HiStateMetadata:
        return self.side.build_connector_meta(scheduler_output, HiStateMetadata())

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HiStateWorkerMetadata):
            self.side.update_connector_output(meta)

    def request_finished_all_groups(self, request, block_ids):
        # True: the blocks stay until the worker has copied the request's tail
        return self.side.request_finished(request, block_ids), None

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def shutdown(self):
        if self.runtime is not None:
            self.runtime.close(persist=True)
        if self.store is not None:
            self.store.close(persist=True)

    def idle_state(self) -> dict[str, int]:
        """Sizes of per-request bookkeeping (all 0 once no request is live; tests)."""
        return self.side.idle_state()

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches) -> None:
        self._pages = PageCopier(kv_caches, self.groups, self.num_blocks)
        ssd = None
        if self.config.directory is not None and self.config.ssd_bytes > 0:
            ssd = SnapshotStore(
                self.config.directory, self.namespace, fsync=self.config.fsync,
                counters=self.counters, access=FolderPolicy.of(self.config),
            )  # fmt: skip
        self.store = WorkerStore(self._pages, ssd, self.attn_group, self.mamba_group)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, HiStateMetadata):
            return
        assert self.store is not None, "HiState: KV caches were never registered"
        # the scheduler decided these before planning this step's loads: apply them first
        self.store.apply(meta.ops)
        # a failed write here would compute on a wrong state: let it raise
        self.store.load(meta.loads)
        # finished requests' tails: their blocks are held, so any time this step will do
        if meta.final_stores:
            self.store.store(meta.final_stores)
        self._tails_copied.update(meta.releases)

    def get_finished(self, finished_req_ids):
        done, self._tails_copied = self._tails_copied, set()
        return (done or None), None

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, HiStateMetadata) and meta.stores:
            self.store.store(meta.stores)

    def build_connector_worker_meta(self) -> HiStateWorkerMetadata | None:
        report = self.store.take_report() if self.store is not None else None
        return None if report is None else HiStateWorkerMetadata(**vars(report))

    @property
    def requires_kv_delivery(self) -> bool:
        # a dropped store is a future miss; preempted requests need no hand-off
        return False


def _tails_supported(config, vllm_config) -> bool:
    """Tails need the state at a request's last computed token: not with speculative
    decoding (rejected drafts move it back), and not when switched off."""
    return config.tail_snapshots and vllm_config.speculative_config is None


def _tail_extra(request, start: int, end: int):
    """What vLLM hashes beside a request's tokens ``start..end`` (LoRA, salt, images)."""
    return generate_block_hash_extra_keys(request, start, end, 0)[0]


def _local_worker() -> WorkerStore | None:
    """The worker half's store when it runs in this process (in-process engines), else None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    worker = get_kv_transfer_group()
    return getattr(worker, "store", None)
