"""Waiting requests in LEAP's serving order, kept incrementally (no vLLM types).

The order is :meth:`LeapPolicy.sort_key`'s: requests that waited ``max_wait_s``
(aged) first by arrival, then all others by their time-independent key
(:meth:`LeapPolicy.unaged_key`). Re-sorting the whole queue every step costs
Python work per queued request per step (milliseconds at a thousand queued
requests); here a change costs O(log n) and a step that changes nothing costs
nothing:

- a heap of ``(key, seq, id)`` gives the unaged order;
- a heap of ``(arrival, seq, id)`` gives the aged ones: aging is monotone in
  arrival time, so the aged requests are always a prefix of arrival order and
  only the oldest needs checking;
- lazy deletion: a removed or re-keyed entry stays in its heap until it
  reaches the top, where it is recognised (its id is gone, or carries another
  seq or key) and dropped; the heaps are rebuilt when stale entries outnumber
  live ones.

``seq`` is an insertion counter: equal keys keep insertion order, and
``push(front=True)`` takes a seq below every earlier one (a deque's
``appendleft``). With one constant key and aging off the queue is therefore a
FIFO deque exactly -- which is how LEAP leaves vLLM's order untouched when it
has no information.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

# rebuild a heap once it holds this many entries more than twice the live ones
_SLACK = 64


@dataclass(slots=True)
class QueuedItem:
    """One queued entry: the caller's payload and what orders it."""

    item_id: str
    payload: Any
    arrival: float
    key: tuple
    seq: int


class AgingQueue:
    """Priority queue by ``key`` with an aging prefix by ``arrival``; see the module doc.

    Args:
        max_wait_s: an item waiting at least this long (``now - arrival``) is
            served before every younger one, oldest first; ``math.inf`` turns
            aging off.
    """

    def __init__(self, max_wait_s: float = math.inf):
        self.max_wait_s = max_wait_s
        self._items: dict[str, QueuedItem] = {}
        self._by_key: list[tuple] = []
        self._by_arrival: list[tuple] = []
        self._next_back = 0
        self._next_front = -1
        self._head: list[str] = []

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    def get(self, item_id: str) -> QueuedItem | None:
        return self._items.get(item_id)

    def push(self, item_id: str, payload, arrival: float, key: tuple, front: bool = False):
        """Queue an item; ``front`` puts it before earlier items of an equal key."""
        if item_id in self._items:
            raise ValueError(f"{item_id!r} is already queued")
        if front:
            seq, self._next_front = self._next_front, self._next_front - 1
        else:
            seq, self._next_back = self._next_back, self._next_back + 1
        self._items[item_id] = QueuedItem(item_id, payload, arrival, key, seq)
        heapq.heappush(self._by_key, (key, seq, item_id))
        heapq.heappush(self._by_arrival, (arrival, seq, item_id))

    def remove(self, item_id: str) -> QueuedItem:
        """Take an item out (KeyError if absent); its heap entries go stale."""
        item = self._items.pop(item_id)
        self._compact_if_sparse()
        return item

    def rekey(self, item_id: str, key: tuple, payload=None) -> None:
        """Give a queued item a new key (keeping its seq, so its tie order)."""
        item = self._items[item_id]
        if payload is not None:
            item.payload = payload
        if key == item.key:
            return
        item.key = key
        heapq.heappush(self._by_key, (key, item.seq, item_id))
        self._compact_if_sparse()

    def rebuild(
        self, keys: Iterable[tuple[str, tuple, Any]], now: float, by_arrival: bool = False
    ) -> None:
        """New keys (and payloads) for all items, ties in today's serving order.

        ``keys`` yields ``(item_id, key, payload)`` for every queued item. The
        current order at ``now`` becomes the insertion order, so items whose new
        keys tie stay as they were served (as a re-sorted deque would);
        ``by_arrival``: ties in arrival order instead (a FCFS queue from here).
        """
        if by_arrival:
            current = sorted(self._items.values(), key=lambda item: (item.arrival, item.seq))
        else:
            current = self.ordered(now)
        order = {item.item_id: seq for seq, item in enumerate(current)}
        new = {}
        for item_id, key, payload in keys:
            old = self._items[item_id]
            new[item_id] = QueuedItem(item_id, payload, old.arrival, key, order[item_id])
        if new.keys() != self._items.keys():
            raise ValueError("rebuild must give every queued item exactly one key")
        self._items = new
        self._next_back, self._next_front = len(new), -1
        self._heapify()

    def set_head(self, item_ids: Iterable[str]) -> None:
        """Serve these items first, in this order, until the next call (a step's plan)."""
        self._head = [i for i in item_ids if i in self._items]

    def peek(self, now: float) -> QueuedItem:
        """The next item to serve at time ``now`` (IndexError if empty)."""
        while self._head:
            item = self._items.get(self._head[0])
            if item is not None:
                return item
            self._head.pop(0)
        oldest = self._top(self._by_arrival, keyed=False)
        if oldest is None:
            raise IndexError("peek from an empty queue")
        if now - oldest.arrival >= self.max_wait_s:
            return oldest
        return self._top(self._by_key, keyed=True)

    def pop(self, now: float) -> QueuedItem:
        """Remove and return :meth:`peek`'s item."""
        item = self.peek(now)
        return self.remove(item.item_id)

    def ordered(self, now: float) -> list[QueuedItem]:
        """All items in serving order at ``now`` (a sort: for inspection, not per step)."""
        head = [self._items[i] for i in self._head if i in self._items]
        in_head = {item.item_id for item in head}
        rest = [item for item in self._items.values() if item.item_id not in in_head]
        aged = [item for item in rest if now - item.arrival >= self.max_wait_s]
        fresh = [item for item in rest if now - item.arrival < self.max_wait_s]
        aged.sort(key=lambda item: (item.arrival, item.seq))
        fresh.sort(key=lambda item: (item.key, item.seq))
        return head + aged + fresh

    def __iter__(self) -> Iterator[QueuedItem]:
        return iter(self._items.values())

    def _top(self, heap: list[tuple], keyed: bool) -> QueuedItem | None:
        items = self._items
        while heap:
            first, seq, item_id = heap[0]
            item = items.get(item_id)
            if item is not None and item.seq == seq and (not keyed or item.key == first):
                return item
            heapq.heappop(heap)
        return None

    def _compact_if_sparse(self) -> None:
        live = len(self._items)
        if len(self._by_key) > 2 * live + _SLACK or len(self._by_arrival) > 2 * live + _SLACK:
            self._heapify()

    def _heapify(self) -> None:
        items = self._items.values()
        self._by_key = [(item.key, item.seq, item.item_id) for item in items]
        self._by_arrival = [(item.arrival, item.seq, item.item_id) for item in items]
        heapq.heapify(self._by_key)
        heapq.heapify(self._by_arrival)
