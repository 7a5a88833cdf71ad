"""Scheduler-side HiState runtime: tiers, hit planning, background stores (no vLLM types).

The connector's scheduler half owns one :class:`HiStateRuntime`. It keeps the
:class:`~vllm_ext.histate.tiers.TieredCache` (host memory + SSD files), so
the index that decides a hit and the bytes that serve it live in one place:

- :meth:`plan_load` finds the longest prefix whose KV (vLLM's own device hit,
  else our host tier) and boundary snapshot exist, and **reads the payloads
  right away**. A load is therefore never promised for bytes that may vanish
  before the worker copies them (vLLM 0.32 cannot recover a failed
  synchronous load of a hybrid model); an unreadable item (corrupt or
  evicted file) is dropped and the lookup retried, i.e. a shorter hit or a miss.
- :meth:`submit` hands payloads copied out by the worker to a background
  thread that inserts them into the host tier (evicting and spilling to the
  SSD by policy), so no store ever blocks a scheduler step. A failing store
  is counted and dropped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_ext.common.counters import Counters, CounterSpec
from vllm_ext.common.log import get_logger
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.counters import COUNTER_SPECS as ALGORITHM_SPECS
from vllm_ext.histate.lookup import BranchTracker, longest_hit
from vllm_ext.histate.policy import (
    BRANCH,
    DECODE_END,
    INTERVAL,
    PROMPT_END,
    Kind,
    kv_key,
    snap_key,
)
from vllm_ext.histate.snapfile import SnapshotStore
from vllm_ext.histate.tiers import HOST, SSD, TieredCache

logger = get_logger(__name__)

DEVICE = "device"
ADAPTER_SPECS = (
    CounterSpec("hit_requests", "requests whose prefix was served (in part) from HiState tiers"),
    CounterSpec("hit_tokens", "prompt tokens restored from HiState tiers instead of recomputed"),
    CounterSpec("kv_blocks_loaded", "KV blocks copied from host memory into the device pool"),
    CounterSpec("snapshots_loaded_host", "recurrent-state snapshots restored from host memory"),
    CounterSpec("snapshots_loaded_ssd", "recurrent-state snapshots restored from the SSD tier"),
    CounterSpec("load_bytes_host", "payload bytes restored from host memory"),
    CounterSpec("load_bytes_ssd", "payload bytes restored from the SSD tier"),
    CounterSpec("load_failures", "items found unreadable while planning a hit; treated as misses"),
    CounterSpec("kv_blocks_stored", "KV blocks copied out of the device pool into host memory"),
    CounterSpec("snapshots_stored", "boundary snapshots copied out into host memory"),
    CounterSpec("store_bytes_host", "payload bytes stored into host memory"),
    CounterSpec("store_failures", "stores that failed (I/O or internal error); serving continued"),
    CounterSpec(
        "device_snapshots_released",
        "freed device blocks whose snapshot a tier holds, uncached so vLLM reuses them first",
    ),
)
COUNTER_SPECS = ALGORITHM_SPECS + ADAPTER_SPECS


@dataclass(frozen=True)
class StoreItem:
    """One payload the worker copied out, with what the policy needs to rank it."""

    key: str
    kind: Kind
    payload: bytes
    position: int
    recompute_tokens: int


@dataclass
class LoadPlan:
    """A hit the scheduler promised: blocks ``first..blocks-1`` of KV plus one snapshot.

    ``kv_payloads[i]`` is the KV of block ``first + i``; ``snapshot`` the state
    at the end of block ``blocks - 1``.
    """

    first: int
    blocks: int
    kv_payloads: list[bytes]
    snapshot: bytes
    snapshot_tier: str


def snapshot_reason(
    boundary: int, num_prompt_tokens: int, block_size: int, interval: int,
    branch: int | None = None,
) -> str | None:  # fmt: skip
    """Why a state at the end of block ``boundary - 1`` (``boundary`` blocks) is worth keeping.

    ``prompt_end`` is the deepest boundary a request with the same prompt can
    hit (vLLM never serves the last prompt token from cache); boundaries past
    it were crossed while decoding (``decode_end``: the next turn of a
    conversation hits there). None: not a candidate.
    """
    if boundary < 1:
        return None
    if branch is not None and boundary == branch:
        return BRANCH
    prompt_end = (num_prompt_tokens - 1) // block_size
    if boundary > prompt_end:
        return DECODE_END
    if boundary == prompt_end:
        return PROMPT_END
    return INTERVAL if boundary % interval == 0 else None


class HiStateRuntime:
    """Tiers + hit planning + background stores for one engine.

    Args:
        config: HiState settings.
        namespace: layout text for snapshot files (model, dtype, layers, block size, ranks).
        counters: where everything is counted (must declare :data:`COUNTER_SPECS`).
    """

    def __init__(self, config: HiStateConfig, namespace: str, counters: Counters):
        self.config = config
        self.counters = counters
        store = None
        if config.directory is not None and config.ssd_bytes > 0:
            store = SnapshotStore(
                config.directory, namespace, fsync=config.fsync, counters=counters
            )
        self.tiers = TieredCache(config, ssd_store=store, counters=counters)
        self.branches = BranchTracker()
        self._t0 = time.monotonic()
        self._queue: queue.Queue[list[StoreItem] | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="histate-store", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds since start (the policy's clock)."""
        return time.monotonic() - self._t0

    # ---- hits
    def plan_load(
        self, chain: Sequence[str], local_blocks: int, max_blocks: int
    ) -> LoadPlan | None:
        """The longest hit beyond vLLM's own ``local_blocks``, payloads in hand; None = miss."""
        device = set(chain[:local_blocks])
        while True:
            hit = longest_hit(
                chain,
                lambda h: DEVICE if h in device else self.tiers.tier_of(kv_key(h)),
                lambda h: self.tiers.tier_of(snap_key(h)),
                max_blocks=max_blocks,
            )
            if hit.blocks <= local_blocks:
                return None
            plan = self._read(chain, local_blocks, hit.blocks)
            if plan is not None:
                return plan

    def _read(self, chain: Sequence[str], first: int, blocks: int) -> LoadPlan | None:
        now = self.now()
        kv: list[bytes] = []
        for h in chain[first:blocks]:
            data = self._load(kv_key(h), now)
            if data is None:
                return None
            kv.append(data)
        key = snap_key(chain[blocks - 1])
        tier = self.tiers.tier_of(key)
        snapshot = self._load(key, now)
        if snapshot is None or tier is None:
            return None
        # KV blocks are only kept in host memory
        self.counters.inc("load_bytes_host", sum(map(len, kv)))
        self.counters.inc("load_bytes_host" if tier == HOST else "load_bytes_ssd", len(snapshot))
        return LoadPlan(first, blocks, kv, snapshot, tier)

    def _load(self, key: str, now: float) -> bytes | None:
        self.tiers.pin(key)
        try:
            data = self.tiers.load(key)
        finally:
            self.tiers.unpin(key)
        if data is None:
            # vanished or corrupt (the SSD store quarantined and counted it): never offer it again
            self.counters.inc("load_failures")
            self.tiers.remove(key)
            return None
        self.tiers.touch(key, now)
        return data

    def record_hit(self, plan: LoadPlan, block_size: int) -> None:
        """Count a hit the scheduler committed to."""
        self.counters.inc("hit_requests")
        self.counters.inc("hit_tokens", (plan.blocks - plan.first) * block_size)
        self.counters.inc("kv_blocks_loaded", len(plan.kv_payloads))
        name = "snapshots_loaded_host" if plan.snapshot_tier == HOST else "snapshots_loaded_ssd"
        self.counters.inc(name)

    def has(self, key: str) -> bool:
        """Is ``key`` in a tier already (a store of it would only touch it)?"""
        return self.tiers.tier_of(key) is not None

    def admit(self, reason: str | None) -> bool:
        return reason is not None and self.tiers.admit(reason)

    # ---- stores
    def submit(self, items: list[StoreItem]) -> None:
        """Queue payloads for the host tier; returns at once."""
        if items and not self._closed:
            self._queue.put(items)

    def drain(self) -> None:
        """Wait until every submitted store has been applied (tests, shutdown)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            items = self._queue.get()
            try:
                if items is None:
                    return
                for item in items:
                    self._store(item)
            finally:
                self._queue.task_done()

    def _store(self, item: StoreItem) -> None:
        try:
            result = self.tiers.store(
                item.key, item.kind, len(item.payload), self.now(),
                recompute_tokens=item.recompute_tokens, position=item.position,
                payload=item.payload,
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - a store is best effort; serving goes on
            self.counters.inc("store_failures")
            logger.exception("HiState: storing %s failed; dropped", item.key)
            return
        if result.stored:
            self.counters.inc("store_bytes_host", len(item.payload))
            self.counters.inc("kv_blocks_stored" if item.kind is Kind.KV else "snapshots_stored")
        # SSD write failures (on spill) are counted by the snapshot store, which drops the item

    # ---- lifecycle
    def close(self, persist: bool = True) -> None:
        """Finish queued stores, stop the thread; with ``persist``, move host snapshots to SSD.

        Snapshots in host memory would be lost with the process; writing them
        to the SSD tier lets a restarted engine (same folder, same layout) hit them.
        """
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=60)
        if persist:
            self._persist_host_snapshots()
        if self.tiers.ssd_store is not None:
            self.tiers.ssd_store.close()

    def _persist_host_snapshots(self) -> None:
        store = self.tiers.ssd_store
        if store is None:
            return
        written = 0
        for item in list(self.tiers.host):
            if item.kind is not Kind.SNAPSHOT:
                continue
            data = self.tiers.load(item.key)
            if data is not None and store.put(item.key, data):
                written += 1
        logger.info("HiState: persisted %d host snapshots to %s", written, store.root)

    def check_idle(self) -> None:
        """Raise AssertionError if an item is still pinned or a tier's accounting is off."""
        self.tiers.check_invariants()
        for tier in (self.tiers.host, self.tiers.ssd):
            assert tier.pinned_bytes == 0, f"{tier.pinned_bytes} bytes still pinned"


__all__ = ["COUNTER_SPECS", "DEVICE", "HOST", "SSD", "HiStateRuntime", "LoadPlan", "StoreItem"]
