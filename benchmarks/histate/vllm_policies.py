"""vLLM's own offloading policies (``lru``, ``arc``) as HiState queue policies, for baselines.

vLLM 0.32's ``CachePolicy`` (vllm/v1/kv_offload/cpu/policies/) orders equal-sized chunks of
its CPU tier; the simulator's tiers hold KV blocks and snapshots of different sizes. This
adapter drives the real vLLM class, as vLLM's ``CPUOffloadingManager`` does, one call per
event as the queue sees it (:meth:`Policy.observe`): a store of a new item is
``on_store_miss`` + ``insert`` of a ready chunk (``ref_cnt`` 0, as after a completed store:
not a reuse), every later access is a ``touch`` (a reuse: ARC moves the chunk to T2), a
pinned item (being read) is a chunk with ``ref_cnt`` 1 (``mark_non_evictable``: it keeps its
recency), and victims are whatever ``evict(1, protected)`` returns, one at a time, until the
queue has room. The chunk capacity (which ARC's adaptation uses) is the number of items the
tier held the first time it filled. Nothing of either policy is re-implemented here.

Earlier versions fed the vLLM class lazily at each eviction round and touched every new
chunk right after inserting it; against ``LruPolicy`` their victims differed after ~20-25
operations. Three causes: (1) HiState's own queue resurrected a stale heap entry when a key
was re-stored (per-item stamps restarted at 0; fixed in ``vllm_ext.histate.queue``: stamps
are unique per queue), so *our* LRU was wrong there; (2) the adapter forgot pinned items
(the queue does not offer them) and re-inserted them later as new, and registered accesses
made between two rounds in sync order rather than in the order they happened; (3) the
insert-then-touch made ARC count every store as a second access (all chunks in T2: ARC
degenerated to LRU). tests/unit/test_histate_vllm_policies.py checks that vLLM's LRU now
evicts exactly like ``LruPolicy``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from vllm_ext.histate.policy import Item, LruPolicy
from vllm_ext.histate.queue import EvictionQueue

_CONTEXT = ReqContext(req_id="histate-sim")


class VllmCachePolicy(LruPolicy):
    """A vLLM ``CachePolicy`` behind HiState's ``Policy`` interface (admits like ``lru``).

    :meth:`bind` it to the queue it orders: the queue offers only unpinned items to
    :meth:`order`, and the vLLM policy must tell a pinned item (kept, not evictable) from
    one removed from the tier (gone).
    """

    static = False  # victims come from the vLLM class, not from a score
    vllm_cls: type[CachePolicy]

    def __init__(self, config):
        super().__init__(config)
        # ARC's capacity (in chunks) is only known when the tier first fills: set then
        self._impl: CachePolicy = self.vllm_cls(1)
        self._sized = False
        self._queue: EvictionQueue | None = None
        self._chunks: dict[str, ChunkStatus] = {}

    def bind(self, queue: EvictionQueue) -> None:
        """Order ``queue``'s items."""
        self._queue = queue

    def observe(self, item: Item) -> None:
        """A store of a new key is ``on_store_miss`` + ``insert`` (ready, ``ref_cnt`` 0,
        as after a completed store; not a reuse); any later access is a ``touch``."""
        key = item.key.encode()
        if item.key in self._chunks:
            self._impl.touch([key], _CONTEXT)
            return
        self._impl.on_store_miss([key], _CONTEXT)
        chunk = ChunkStatus(len(self._chunks))
        chunk.ref_cnt = 0
        self._impl.insert(key, chunk)
        self._chunks[item.key] = chunk

    def order(self, items: Sequence[Item]) -> Iterator[Item]:
        held = {i.key: i for i in self._queue} if self._queue is not None else {}
        offered = {item.key: item for item in items}
        held.update(offered)
        if not self._sized:
            self._impl.cache_capacity = max(1, len(held))
            self._sized = True
        for key in [k for k in self._chunks if k not in held]:
            self._impl.remove(key.encode())  # left the tier some other way (removed)
            del self._chunks[key]
        for key in held:
            self._set_pinned(key, key not in offered)
        while True:
            victims = self._impl.evict(1, set())
            if not victims:
                return
            key = victims[0][0].decode()
            self._chunks.pop(key, None)
            if key in offered:
                yield offered[key]

    def _set_pinned(self, key: str, pinned: bool) -> None:
        """A pinned item (being read) is a chunk in use, as vLLM's ``ref_cnt`` > 0."""
        chunk = self._chunks.get(key)
        if chunk is None or (chunk.ref_cnt > 0) == pinned:
            return
        chunk.ref_cnt = 1 if pinned else 0
        if pinned:
            self._impl.mark_non_evictable(key.encode())
        else:
            self._impl.mark_evictable(key.encode())


class StoreThreshold:
    """vLLM's ``store_threshold`` admission filter (``CPUOffloadingManager.prepare_store``).

    Every offer of a key for storage is counted (resident or not) in a table of at most
    ``max_tracker_size`` keys, oldest dropped first; a key not yet in the tier is stored only
    once it has been offered ``threshold`` times. vLLM keeps this table in its manager, not in
    the ``CachePolicy``, so it is kept here beside the adapter; the defaults are vLLM's.
    """

    def __init__(self, threshold: int, max_tracker_size: int = 64_000):
        self.threshold = threshold
        self.max_tracker_size = max_tracker_size
        self._counts: OrderedDict[str, int] = OrderedDict()

    def admit_store(self, key: str, resident: bool) -> bool:
        """Count one offer of ``key``; may it be stored (a resident key always may)?"""
        if key in self._counts:
            self._counts.move_to_end(key)
            self._counts[key] += 1
        else:
            if len(self._counts) >= self.max_tracker_size:
                self._counts.popitem(last=False)
            self._counts[key] = 1
        return resident or self._counts[key] >= self.threshold


def with_store_threshold(cls: type[VllmCachePolicy], threshold: int) -> type[VllmCachePolicy]:
    """``cls`` behind vLLM's ``store_threshold`` filter (``threshold`` >= 2 filters)."""

    def __init__(self, config):
        cls.__init__(self, config)
        self._filter = StoreThreshold(threshold)

    def admit_store(self, key: str, resident: bool) -> bool:
        return self._filter.admit_store(key, resident)

    attrs = {"__init__": __init__, "admit_store": admit_store, "store_threshold": threshold}
    return type(f"{cls.__name__}T{threshold}", (cls,), attrs)


class VllmLruPolicy(VllmCachePolicy):
    name = "vllm_lru"
    vllm_cls = LRUCachePolicy


class VllmArcPolicy(VllmCachePolicy):
    name = "vllm_arc"
    vllm_cls = ARCCachePolicy


VLLM_POLICIES = {cls.name: cls for cls in (VllmLruPolicy, VllmArcPolicy)}
