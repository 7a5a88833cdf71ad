"""One capacity-bounded eviction queue over KV blocks and snapshots (no vLLM types).

The queue owns byte accounting for one tier and decides victims with a
:class:`~vllm_ext.histate.policy.Policy`. Static policies (``lru``,
``histate``) keep a binary heap of ``(score, seq, stamp, key)`` with lazy
invalidation: an update pushes a new entry and gives the item a fresh ``stamp``
(unique in the queue, so a replaced item's entries never match its successor), so
stale entries are skipped when popped; the heap is rebuilt (from each item's
stored score) when stale entries outnumber live ones. Insert, touch and evict
are O(log n). The queue also keeps the GreedyDual clock: the highest score it
has evicted. Marconi's normalised score is recomputed over the evictable items
at each eviction round (O(n log n) per round; rounds are amortised by
``slack``).

Invariants (checked by :meth:`EvictionQueue.check_invariants`):
``used_bytes == sum(item.nbytes)`` and ``used_bytes <= capacity``; a pinned
item is never evicted. Not thread-safe: the tier that owns it holds a lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator

from vllm_ext.histate.policy import Item, Policy


class EvictionQueue:
    """Items of one tier ordered by ``policy``, bounded by ``capacity`` bytes.

    Args:
        policy: eviction order.
        capacity: bytes the tier may hold (>= 0).
        slack: when full, evict down to ``(1 - slack) * capacity`` so that the
            next inserts do not each trigger an eviction round. Default: 0.
        spills: evicted snapshots move to a slower tier rather than vanish
            (the host tier above an SSD tier); the policy prices their loss.
    """

    def __init__(self, policy: Policy, capacity: int, slack: float = 0.0, spills: bool = False):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self.slack = slack
        self.spills = spills
        # GreedyDual clock L: the highest score evicted so far (HiState's "time")
        self.clock = 0.0
        self.used_bytes = 0
        # bytes of items with pins > 0 (they cannot be evicted)
        self.pinned_bytes = 0
        # key -> item; the heap holds (score, seq, stamp, key) and may hold stale entries
        self._items: dict[Hashable, Item] = {}
        self._heap: list[tuple[float, int, int, Hashable]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Item]:
        return iter(list(self._items.values()))

    def get(self, key: Hashable) -> Item | None:
        """The item under ``key``, or None."""
        return self._items.get(key)

    def insert(self, item: Item) -> tuple[bool, list[Item]]:
        """Add ``item`` (replacing one with the same key), evicting to make room.

        Returns:
            ``(inserted, evicted)``: ``inserted`` is False when the item cannot
            fit even after evicting every unpinned item (then nothing is
            evicted); ``evicted`` are the removed items, for spilling.
        """
        old = self._items.get(item.key)
        if old is not None:
            # a re-store keeps readers' pins
            item.pins = old.pins
            self._drop(old)
        if item.nbytes > self.capacity or not self._can_fit(item.nbytes):
            if old is not None:
                self._add(old)
            return False, []
        evicted = self.make_room(item.nbytes)
        self._add(item)
        self.policy.observe(item)
        return True, evicted

    def touch(
        self,
        key: Hashable,
        now: float,
        recompute_tokens: int | None = None,
        position: int | None = None,
    ) -> bool:
        """Record an access at ``now`` (and new recompute facts); False if absent."""
        item = self._items.get(key)
        if item is None:
            return False
        item.last_access = max(item.last_access, now)
        if recompute_tokens is not None:
            item.recompute_tokens = recompute_tokens
        if position is not None:
            item.position = position
        self._push(item)
        self.policy.observe(item)
        return True

    def pin(self, key: Hashable) -> bool:
        """Protect ``key`` from eviction until :meth:`unpin`; False if absent."""
        item = self._items.get(key)
        if item is None:
            return False
        item.pins += 1
        if item.pins == 1:
            self.pinned_bytes += item.nbytes
        return True

    def unpin(self, key: Hashable) -> None:
        """Release one :meth:`pin` (no-op for an absent key)."""
        item = self._items.get(key)
        if item is not None and item.pins > 0:
            item.pins -= 1
            if item.pins == 0:
                self.pinned_bytes -= item.nbytes
                # its heap entry was dropped while it was pinned
                self._push(item)

    def remove(self, key: Hashable) -> Item | None:
        """Remove ``key`` regardless of policy (pins included); the removed item or None."""
        item = self._items.get(key)
        if item is not None:
            self._drop(item)
        return item

    def make_room(self, nbytes: int) -> list[Item]:
        """Evict unpinned items, by policy, until ``nbytes`` more fit; the victims."""
        if self.used_bytes + nbytes <= self.capacity:
            return []
        goal = max(0.0, min(self.capacity - nbytes, self.capacity * (1 - self.slack) - nbytes))
        if self.policy.static:
            return self._evict_from_heap(goal)
        return self._evict_by_order(goal)

    def check_invariants(self) -> None:
        """Raise AssertionError if byte accounting or capacity is broken."""
        total = sum(item.nbytes for item in self._items.values())
        assert total == self.used_bytes, (total, self.used_bytes)
        assert self.used_bytes <= self.capacity, (self.used_bytes, self.capacity)
        assert all(item.pins >= 0 for item in self._items.values())
        pinned = sum(item.nbytes for item in self._items.values() if item.pins)
        assert pinned == self.pinned_bytes, (pinned, self.pinned_bytes)

    def _can_fit(self, nbytes: int) -> bool:
        if self.used_bytes + nbytes <= self.capacity:
            return True
        return self.pinned_bytes + nbytes <= self.capacity

    def _add(self, item: Item) -> None:
        self._items[item.key] = item
        self.used_bytes += item.nbytes
        if item.pins:
            self.pinned_bytes += item.nbytes
        self._push(item)

    def _drop(self, item: Item) -> None:
        del self._items[item.key]
        self.used_bytes -= item.nbytes
        if item.pins:
            self.pinned_bytes -= item.nbytes
        # entries left in the heap are stale now
        item.stamp += 1

    def _push(self, item: Item) -> None:
        # stamps are unique across items: a stale entry of a removed or replaced item with
        # the same key must never match its successor (it would resurrect the old score);
        # they also order accesses at equal times (for non-static policies too)
        item.stamp = next(self._seq)
        if not self.policy.static:
            return
        item.score = self.policy.score(item, self.clock, self.spills)
        heapq.heappush(self._heap, (item.score, item.stamp, item.stamp, item.key))
        if len(self._heap) > 2 * len(self._items) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        # stored scores: re-scoring at today's clock would forget each item's age
        self._heap = [
            (item.score, item.stamp, item.stamp, item.key) for item in self._items.values()
        ]
        heapq.heapify(self._heap)

    def _evict_from_heap(self, goal: float) -> list[Item]:
        evicted: list[Item] = []
        while self.used_bytes > goal and self._heap:
            entry = heapq.heappop(self._heap)
            item = self._items.get(entry[3])
            # stale entry, or pinned: unpin() pushes a fresh entry when the last pin goes
            if item is None or item.stamp != entry[2] or item.pins:
                continue
            self.clock = max(self.clock, entry[0])
            self._drop(item)
            evicted.append(item)
        return evicted

    def _evict_by_order(self, goal: float) -> list[Item]:
        candidates = [item for item in self._items.values() if not item.pins]
        evicted: list[Item] = []
        # pull the next victim only while one is needed: a policy may yield lazily and
        # commit each victim as it yields it (vLLM's CachePolicy.evict in the simulator)
        victims = iter(self.policy.order(candidates))
        while self.used_bytes > goal:
            item = next(victims, None)
            if item is None:
                break
            self._drop(item)
            evicted.append(item)
        return evicted
