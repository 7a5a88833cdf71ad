"""HiState's recompute-aware eviction as a vLLM ``CachePolicy`` (vLLM 0.32, 0.33, 0.34).

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
first missing chunk), priced as a prefill from the chunk's start to the
request's depth (the attention term grows with the context); a chunk several
requests share is worth what the deepest of them loses. Where a chunk starts
and ends comes from the positions vLLM records in ``ReqContext``; how deep the
request reaches is the deepest of those positions and, on vLLM 0.34, the
request's own token counts (``num_prompt_tokens``, ``num_computed_tokens``), so
the first chunks of a long prompt are priced by the whole prompt from their
first store on. What vLLM keeps (the manager: ref counts, pinning, chunk pool,
events, one CPU tier) is unchanged; only the victim choice is HiState's. The
one eviction queue over KV *and* snapshots, SSD spill and the checksummed store
belong to HiState's own connector; vLLM's tiering layer is not driven by this
class.

The manager's calls per vLLM release (all served by this one class):

- 0.32: ``insert(key, chunk)``; ``touch`` abstract; ``on_store_miss`` and
  ``on_request_finished`` (both default to ``touch``).
- 0.33: ``insert(key, chunk, req_context)``; ``on_request_access`` added.
- 0.34: ``touch`` removed; ``on_request_finished`` abstract.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx
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


def request_depth(req_context: ReqContext) -> int:
    """Tokens the request reaches by vLLM's own counts (0.34's ``ReqContext``), else 0.

    The prompt counts from the first store on (a chunked prefill will compute
    it), computed tokens once decoding passed it; vLLM 0.32/0.33 have no counts.
    """
    try:
        counts = (
            getattr(req_context, "num_prompt_tokens", None),
            getattr(req_context, "num_computed_tokens", None),
        )
    except LookupError:
        # 0.34's live view of a request its scheduler no longer tracks: positions only
        return 0
    return max((count for count in counts if count is not None), default=0)


@dataclass(slots=True)
class _Depth:
    """How deep one request reaches (tokens); its chunks' losses grow with it."""

    tokens: int = 0


@dataclass(slots=True)
class _RequestSpans:
    """Where the chunks one request showed this policy end, per KV-cache group.

    Positions are vLLM's (``ReqContext.get_offload_key_position``), looked up
    once per key; a key vLLM gave no position gets its ordinal in the request's
    group (vLLM hands keys over head to tail), so tails still rank below heads.
    """

    owner: object
    generation: int
    depth: _Depth = field(default_factory=_Depth)
    positions: dict[OffloadKey, int] = field(default_factory=dict)
    ordinals: dict[OffloadKey, int] = field(default_factory=dict)
    ends: dict[int, list[int]] = field(default_factory=dict)  # group -> sorted, unique

    def observe(self, key: OffloadKey, req_context: ReqContext) -> int:
        """The key's end position, recorded (and the request's depth raised to it)."""
        position = self.positions.get(key)
        if position is None:
            position = req_context.get_offload_key_position(key)
            if position is not None:
                self.positions[key] = position
            else:
                group = get_offload_group_idx(key)
                position = self.ordinals.setdefault(key, len(self.ends.get(group, ())) + 1)
            self._add(get_offload_group_idx(key), position)
        return position

    def start(self, key: OffloadKey, position: int) -> int:
        """Where the chunk ending at ``position`` starts: the previous end of its group."""
        ends = self.ends.get(get_offload_group_idx(key), [])
        at = bisect.bisect_left(ends, position)
        return ends[at - 1] if at else 0

    def _add(self, group: int, position: int) -> None:
        ends = self.ends.setdefault(group, [])
        at = bisect.bisect_left(ends, position)
        if at == len(ends) or ends[at] != position:
            ends.insert(at, position)
        self.depth.tokens = max(self.depth.tokens, position)


@dataclass(slots=True)
class _Estimate:
    """What a chunk loses if it leaves, as one request sees it (see ``_estimate``)."""

    end: int  # where the recompute ends: the request's depth
    tokens: int  # from the chunk's start to ``end``
    depth: _Depth  # the request's live depth: ``end`` follows it


class HiStateCachePolicy(CachePolicy):
    """GreedyDual on recompute loss over vLLM's CPU chunks (settings: ``VLLMEXT_HISTATE_*``).

    A chunk is priced by the request that makes it dearest (:meth:`_learn`); while
    that request goes deeper (more stores, a longer prompt or decode), the chunk's
    loss grows with it. Losses only grow between accesses, so :meth:`evict`
    re-prices a stale heap entry when it surfaces and pushes it back (exact: the
    true minimum is up to date when it is popped).
    """

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self._policy = HiStatePolicy(load_histate_config())
        self.clock = 0.0
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._items: dict[OffloadKey, Item] = {}
        # the live depth of the request each item is priced by
        self._depths: dict[OffloadKey, _Depth] = {}
        # logical access order: ties in score go oldest access first, however late a
        # transfer completes (mark_evictable re-pushes with the same order)
        self._order: dict[OffloadKey, int] = {}
        self._evictable: set[OffloadKey] = set()
        # (score, order, stamp, key); stale entries (older stamp, not evictable) are skipped
        self._heap: list[tuple[float, int, int, OffloadKey]] = []
        self._seq = itertools.count()
        # vLLM 0.32's insert() has no request: estimates from on_store_miss; bounded,
        # since a refused store never inserts its misses
        self._seen: OrderedDict[OffloadKey, _Estimate] = OrderedDict()
        # bumped by clear(): spans a request recorded before a reset are dropped
        self._generation = 0

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(
        self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None
    ) -> None:
        # vLLM 0.33+ passes the storing request; 0.32 calls insert(key, chunk)
        seen = self._seen.pop(key, None)
        estimate = self._estimate(key, req_context) if req_context is not None else seen
        self.chunks[key] = chunk
        self._items[key] = Item(key, Kind.KV, int(MIB), self.clock)
        if estimate is not None:
            self._take(key, estimate)
        self._rescore(key)
        if chunk.ref_cnt == 0:
            self.mark_evictable(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._forget(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # called before insert(): on 0.32 the only moment the storing request is known
        keys = self._observe(keys, req_context)
        for key in keys:
            self._seen[key] = self._estimate(key, req_context)
            self._seen.move_to_end(key)
        while len(self._seen) > 2 * self.cache_capacity + 64:
            self._seen.popitem(last=False)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # vLLM 0.33+: a request's first look at keys (loads and stores, resident or not);
        # a resident chunk's loss is restored now (GreedyDual's hit), not at the finish
        for key in self._observe(keys, req_context):
            if key in self._items:
                self._learn(key, req_context)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # abstract on vLLM 0.32/0.33 (their tiering layer calls it); gone in 0.34
        self.on_request_finished((list(keys),), set(), set(), req_context)

    def on_request_finished(
        self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey], req_context: ReqContext,
    ) -> None:  # fmt: skip
        # every key first, so each chunk is priced against the request's deepest one
        keys = self._observe([key for group in key_groups for key in group], req_context)
        for key in keys:
            if key in self._items:
                self._learn(key, req_context)

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
            if self._catch_up(key):
                continue  # its request went deeper: pushed again at its higher score
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
            self._forget(key)
        return evicted

    def clear(self) -> None:
        self.clock = 0.0
        for table in (self.chunks, self._items, self._seen, self._depths, self._order):
            table.clear()
        self._evictable.clear()
        self._heap.clear()
        self._generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    def score(self, key: OffloadKey) -> float:
        """The key's current eviction score (lowest goes first)."""
        self._catch_up(key)
        return self._items[key].score

    def _spans(self, req_context: ReqContext) -> _RequestSpans:
        spans = req_context.get_state(_RequestSpans)
        if spans is None or spans.owner is not self or spans.generation != self._generation:
            spans = _RequestSpans(self, self._generation)
            req_context.set_state(spans)
        return spans

    def _observe(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
        """Record the keys' end positions in the request's spans; the keys, as a list."""
        keys = list(keys)
        spans = self._spans(req_context)
        for key in keys:
            spans.observe(key, req_context)
        spans.depth.tokens = max(spans.depth.tokens, request_depth(req_context))
        return keys

    def _estimate(self, key: OffloadKey, req_context: ReqContext) -> _Estimate:
        """What ``key`` loses as this request sees it.

        The loss is the chunk's own tokens and everything deeper in the request:
        tokens from the chunk's start to the request's depth, priced as a prefill
        ending at that depth (``Item.position``), so deep context costs more.
        """
        spans = self._spans(req_context)
        position = spans.observe(key, req_context)
        depth = spans.depth
        depth.tokens = max(depth.tokens, request_depth(req_context))
        return _Estimate(depth.tokens, depth.tokens - spans.start(key, position), depth)

    def _learn(self, key: OffloadKey, req_context: ReqContext) -> None:
        self._catch_up(key, push=False)
        estimate = self._estimate(key, req_context)
        # a chunk several requests share is worth what the deepest of them loses, and
        # another request seen part-way (a hit before its stores) never lowers that;
        # the pricing request's own later view (its chunk's start now known) replaces
        # its earlier one
        same_request = self._depths.get(key) is estimate.depth
        if same_request or estimate.tokens > self._items[key].recompute_tokens:
            self._take(key, estimate)
        self._rescore(key)

    def _take(self, key: OffloadKey, estimate: _Estimate) -> None:
        item = self._items[key]
        item.position, item.recompute_tokens = estimate.end, estimate.tokens
        self._depths[key] = estimate.depth

    def _catch_up(self, key: OffloadKey, push: bool = True) -> bool:
        """Follow the pricing request's depth; True if the loss grew (and, with
        ``push``, the item went back on the heap at its new score)."""
        depth = self._depths.get(key)
        item = self._items[key]
        if depth is None or depth.tokens <= item.position:
            return False
        item.recompute_tokens += depth.tokens - item.position
        item.position = depth.tokens
        item.score = self._policy.score(item, item.last_access, spills=False)
        if push:
            self._push(key)
        return True

    def _rescore(self, key: OffloadKey) -> None:
        """An access: GreedyDual's ``H = clock + loss``, and the newest access order."""
        item = self._items[key]
        item.last_access = self.clock
        item.score = self._policy.score(item, self.clock, spills=False)
        self._order[key] = next(self._seq)
        self._push(key)

    def _push(self, key: OffloadKey) -> None:
        item = self._items[key]
        item.stamp += 1
        if key in self._evictable:
            heapq.heappush(self._heap, (item.score, self._order[key], item.stamp, key))
        if len(self._heap) > 2 * len(self._items) + 64:
            live = ((self._items[k], k) for k in self._evictable)
            self._heap = [(i.score, self._order[k], i.stamp, k) for i, k in live]
            heapq.heapify(self._heap)

    def _forget(self, key: OffloadKey) -> None:
        self._items.pop(key, None)
        self._depths.pop(key, None)
        self._order.pop(key, None)
        self._evictable.discard(key)
