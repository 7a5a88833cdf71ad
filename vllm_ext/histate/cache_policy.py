"""HiState's recompute-aware eviction as a vLLM ``CachePolicy`` (vLLM 0.32's native offloading).

Extends ``vllm.v1.kv_offload.cpu.policies.base.CachePolicy``, so a user of
vLLM's own ``OffloadingConnector`` (CUDA; ``--kv-offloading-size``) can pick
it: registered as ``"histate"`` in ``CachePolicyFactory`` by HiState's plugin
(:func:`register`), or out of tree with no plugin::

    --kv-transfer-config '{"kv_connector_extra_config": {"eviction_policy":
        "HiStateCachePolicy", "cache_policy_module_path": "vllm_ext.histate.cache_policy"}}'

The order is HiState's (:class:`~vllm_ext.histate.policy.HiStatePolicy`,
GreedyDual on loss): the lowest ``clock + w * recompute_seconds`` goes first.
vLLM's chunks are equal-sized, so the loss per byte is the loss per chunk. A
chunk's loss is the prefill a request loses if it leaves: its own tokens and
every deeper token of the request it was seen in (a prefix hit stops at the
first missing chunk), priced by the chunk's end position (the attention term
grows with it), from the positions vLLM records in ``ReqContext``. What vLLM
keeps (the manager: ref counts, pinning, chunk pool, events, one CPU tier) is
unchanged; only the victim choice is HiState's. The one eviction queue over KV
*and* snapshots, SSD spill and the checksummed store belong to HiState's own
connector; vLLM's tiering layer is not driven by this class.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from vllm_ext.histate.config import load_histate_config
from vllm_ext.histate.policy import MIB, HiStatePolicy, Item, Kind

NAME = "histate"


def register() -> None:
    """Make ``eviction_policy: "histate"`` resolve to :class:`HiStateCachePolicy` (re-entrant)."""
    try:
        CachePolicyFactory.register_cache_policy(NAME, __name__, HiStateCachePolicy.__name__)
    except ValueError:
        pass  # already registered in this process


class HiStateCachePolicy(CachePolicy):
    """GreedyDual on recompute loss over vLLM's CPU chunks (settings: ``VLLMEXT_HISTATE_*``)."""

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self._policy = HiStatePolicy(load_histate_config())
        self.clock = 0.0
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._items: dict[OffloadKey, Item] = {}
        self._evictable: set[OffloadKey] = set()
        # (score, seq, stamp, key); stale entries (older stamp, not evictable) are skipped
        self._heap: list[tuple[float, int, int, OffloadKey]] = []
        self._seq = itertools.count()
        # (end position, recompute tokens) learnt before a key's chunk exists
        self._seen: dict[OffloadKey, tuple[int, int]] = {}

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        position, tokens = self._seen.pop(key, (0, 0))
        self.chunks[key] = chunk
        self._items[key] = Item(key, Kind.KV, int(MIB), 0.0, tokens, position)
        self._rescore(key)
        if chunk.ref_cnt == 0:
            self.mark_evictable(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._items.pop(key, None)
        self._evictable.discard(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # called before insert(): remember where each new chunk ends
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is not None:
                self._seen[key] = (position, self._seen.get(key, (0, position))[1])

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.on_request_finished((list(keys),), set(), set(), req_context)

    def on_request_finished(
        self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey], req_context: ReqContext,
    ) -> None:  # fmt: skip
        for keys in key_groups:
            ends = [(req_context.get_offload_key_position(k), k) for k in keys]
            known = sorted((p, k) for p, k in ends if p is not None)
            deepest = known[-1][0] if known else 0
            previous = 0
            for position, key in known:
                # the chunk's own tokens and everything deeper in this request
                self._learn(key, position, deepest - previous)
                previous = position
            for position, key in ends:
                if position is None and key in self._items:
                    self._rescore(key)  # an access with no position: recency only

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        chosen: list[tuple[float, int, int, OffloadKey]] = []
        skipped: list[tuple[float, int, int, OffloadKey]] = []
        picked: set[OffloadKey] = set()
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            key = entry[3]
            item = self._items.get(key)
            if item is None or item.stamp != entry[2] or key not in self._evictable:
                continue  # stale; mark_evictable pushes a fresh entry
            if key in protected or key in picked:
                skipped.append(entry)
                continue
            chosen.append(entry)
            picked.add(key)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(chosen) < n:
            for entry in chosen:  # atomic: nothing changes on failure
                heapq.heappush(self._heap, entry)
            return None
        evicted = []
        for score, _, _, key in chosen:
            self.clock = max(self.clock, score)
            evicted.append((key, self.chunks.pop(key)))
            del self._items[key]
            self._evictable.discard(key)
        return evicted

    def clear(self) -> None:
        self.clock = 0.0
        for table in (self.chunks, self._items, self._seen):
            table.clear()
        self._evictable.clear()
        self._heap.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    def score(self, key: OffloadKey) -> float:
        """The key's current eviction score (lowest goes first)."""
        return self._items[key].score

    def _learn(self, key: OffloadKey, position: int, tokens: int) -> None:
        item = self._items.get(key)
        if item is None:
            self._seen[key] = (position, tokens)
            return
        item.position = position
        item.recompute_tokens = max(0, tokens)
        self._rescore(key)

    def _rescore(self, key: OffloadKey) -> None:
        item = self._items[key]
        item.last_access = self.clock
        item.score = self._policy.score(item, self.clock, spills=False)
        self._push(key)

    def _push(self, key: OffloadKey) -> None:
        item = self._items[key]
        item.stamp += 1
        if key in self._evictable:
            heapq.heappush(self._heap, (item.score, next(self._seq), item.stamp, key))
        if len(self._heap) > 2 * len(self._items) + 64:
            live = ((self._items[k], k) for k in self._evictable)
            self._heap = [(i.score, next(self._seq), i.stamp, k) for i, k in live]
            heapq.heapify(self._heap)
