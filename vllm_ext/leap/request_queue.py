"""LeapRequestQueue: vLLM's waiting queue, kept in LEAP's serving order.

Extends ``vllm.v1.core.sched.request_queue.RequestQueue`` (vLLM 0.32.0), the
interface of the scheduler's ``waiting`` queue, over
:class:`~vllm_ext.leap.serving_queue.AgingQueue`. vLLM admits from the head
(``peek_request``/``pop_request``), puts preempted and skipped requests back
with ``prepend_request(s)`` and new ones with ``add_request``; each of those
keys the request once, so a step costs LEAP nothing per queued request.

The scheduler owns the keys: ``describe(request)`` returns ``(key, length,
payload)`` at insertion, and the scheduler calls :meth:`rekey` when a queued request's
prediction changes and :meth:`rebuild` when the policy changes.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from vllm_ext.leap.serving_queue import AgingQueue


class _Queued(NamedTuple):
    request: Request
    length: float | None  # expected remaining tokens, None if unknown
    payload: object
    cap: float  # output tokens it may still write, taken at insertion (removal finds the same)


class LeapRequestQueue(RequestQueue):
    """Waiting requests in serving order at :attr:`now` (set by the scheduler each step).

    Besides the order it keeps the queued requests' expected lengths sorted, and
    the output caps of those without one (:meth:`lengths`), for the scheduler's
    preemption pairing.

    Args:
        describe: ``request -> (key, length, payload)``: its queue key, its
            expected remaining tokens (None if unknown), and whatever else the
            scheduler derived from it (kept, see :meth:`payloads`).
    """

    def __init__(self, describe: Callable[[Request], tuple[tuple, float | None, object]]):
        self._describe = describe
        self._queue = AgingQueue()
        self._known: list[float] = []  # sorted lengths of the queued requests that have one
        self._unknown_caps: list[float] = []  # sorted output caps of the others
        self.now = time.time()
        # request id -> position in the step's plan (set_head), across all queues
        self._plan_rank: dict[str, int] = {}

    # --- vLLM's RequestQueue interface ---

    def add_request(self, request: Request) -> None:
        self._push(request, front=False)

    def prepend_request(self, request: Request) -> None:
        self._push(request, front=True)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # like deque.extendleft (vLLM's FCFS queue): the last one ends up first
        for request in requests:
            self._push(request, front=True)

    def pop_request(self) -> Request:
        return self._remove(self._queue.peek(self.now).item_id)

    def peek_request(self) -> Request:
        return self._queue.peek(self.now).payload.request

    def remove_request(self, request: Request) -> None:
        if request.request_id not in self._queue:
            raise ValueError(f"request {request.request_id!r} is not in the waiting queue")
        self._remove(request.request_id)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            if request.request_id in self._queue:
                self._remove(request.request_id)

    def __bool__(self) -> bool:
        return len(self._queue) > 0

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return (item.payload.request for item in self._queue.ordered(self.now))

    # --- what the LEAP scheduler adds ---

    def __contains__(self, request: Request | str) -> bool:
        # a request, as in vLLM's deque-based FCFS queue, or its id
        request_id = request if isinstance(request, str) else request.request_id
        return request_id in self._queue

    def __getitem__(self, index: int) -> Request:
        # vLLM's FCFS queue is a deque and is indexed as one (a sort: inspection only)
        return self._queue.ordered(self.now)[index].payload.request

    def payloads(self) -> Iterator:
        """The scheduler's payload of each queued request (any order)."""
        return (item.payload.payload for item in self._queue)

    def lengths(self) -> tuple[list[float], list[float]]:
        """Expected lengths of the queued requests that have one, ascending, and the
        output caps (tokens they may still write) of those that have none, ascending.
        The lists are the queue's own: read them, do not change them."""
        return self._known, self._unknown_caps

    def rekey(self, request: Request) -> None:
        """Describe ``request`` again (its prediction changed)."""
        old = self._queue.get(request.request_id).payload
        queued, key = self._described(request)
        self._track(old, added=False)
        self._track(queued, added=True)
        self._queue.rekey(request.request_id, key, queued)

    def rebuild(self, max_wait_s: float, by_arrival: bool = False) -> None:
        """Describe every request again (the policy changed); ties keep today's order
        (``by_arrival``: arrival order)."""
        entries = []
        self._known, self._unknown_caps = [], []
        for item in self._queue:
            queued, key = self._described(item.payload.request)
            self._track(queued, added=True)
            entries.append((item.item_id, key, queued))
        self._queue.rebuild(entries, self.now, by_arrival)
        self._queue.max_wait_s = max_wait_s

    def set_head(self, requests: Iterable[Request]) -> None:
        """Admit these first, in order, until the next call (the probe lane's plan).

        The plan may name requests of other queues too: :meth:`head_rank` keeps
        their positions, so heads of two queues compare in the plan's order.
        """
        self._plan_rank = {r.request_id: i for i, r in enumerate(requests)}
        self._queue.set_head(self._plan_rank)

    def head_rank(self) -> tuple:
        """Where the head stands in LEAP's order at :attr:`now`, comparable across the
        queues of one scheduler (the lowest is served first): a planned head by its
        place in the plan, then aged ones by arrival, then the others by key (the FIFO
        key ``()`` leaves arrival, as vLLM's own merge of two FCFS heads)."""
        item = self._queue.peek(self.now)
        planned = self._plan_rank.get(item.item_id)
        if planned is not None:
            return (0, planned)
        if self.now - item.arrival >= self._queue.max_wait_s:
            return (1, item.arrival)
        return (2, item.key, item.arrival)

    def _described(self, request: Request) -> tuple[_Queued, tuple]:
        key, length, payload = self._describe(request)
        return _Queued(request, length, payload, _output_cap(request)), key

    def _push(self, request: Request, front: bool) -> None:
        queued, key = self._described(request)
        self._queue.push(request.request_id, queued, request.arrival_time, key, front=front)
        self._track(queued, added=True)

    def _remove(self, request_id: str) -> Request:
        queued = self._queue.remove(request_id).payload
        self._track(queued, added=False)
        return queued.request

    def _track(self, queued: _Queued, added: bool) -> None:
        if queued.length is None:
            values, value = self._unknown_caps, queued.cap
        else:
            values, value = self._known, queued.length
        if added:
            bisect.insort(values, value)
        else:  # equal values are interchangeable: drop the first
            del values[bisect.bisect_left(values, value)]


def _output_cap(request: Request) -> float:
    """Output tokens ``request`` may still write (>= 1); fixed while it waits."""
    return float(max(request.max_tokens - request.num_output_tokens, 1))
