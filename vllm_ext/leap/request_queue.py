"""LeapRequestQueue: vLLM's waiting queue, kept in LEAP's serving order.

Extends ``vllm.v1.core.sched.request_queue.RequestQueue`` (vLLM 0.32.0), the
interface of the scheduler's ``waiting`` queue, over
:class:`~vllm_ext.leap.serving_queue.AgingQueue`. vLLM admits from the head
(``peek_request``/``pop_request``), puts preempted and skipped requests back
with ``prepend_request(s)`` and new ones with ``add_request``; each of those
keys the request once, so a step costs LEAP nothing per queued request.

The scheduler owns the keys: ``describe(request)`` returns ``(key, payload)``
at insertion, and the scheduler calls :meth:`rekey` when a queued request's
prediction changes and :meth:`rebuild` when the policy changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from vllm_ext.leap.serving_queue import AgingQueue


class LeapRequestQueue(RequestQueue):
    """Waiting requests in serving order at :attr:`now` (set by the scheduler each step).

    Args:
        describe: ``request -> (key, payload)``; the payload is kept for the
            scheduler (what it derived from the request when it was keyed).
    """

    def __init__(self, describe: Callable[[Request], tuple[tuple, object]]):
        self._describe = describe
        self._queue = AgingQueue()
        self.now = time.time()

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
        return self._queue.pop(self.now).payload[0]

    def peek_request(self) -> Request:
        return self._queue.peek(self.now).payload[0]

    def remove_request(self, request: Request) -> None:
        if request.request_id not in self._queue:
            raise ValueError(f"request {request.request_id!r} is not in the waiting queue")
        self._queue.remove(request.request_id)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            if request.request_id in self._queue:
                self._queue.remove(request.request_id)

    def __bool__(self) -> bool:
        return len(self._queue) > 0

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return (item.payload[0] for item in self._queue.ordered(self.now))

    # --- what the LEAP scheduler adds ---

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queue

    def payloads(self) -> Iterator:
        """The scheduler's payload of each queued request (any order)."""
        return (item.payload[1] for item in self._queue)

    def payload(self, request_id: str):
        return self._queue.get(request_id).payload[1]

    def rekey(self, request: Request) -> None:
        """Describe ``request`` again (its prediction changed)."""
        key, payload = self._describe(request)
        self._queue.rekey(request.request_id, key, (request, payload))

    def rebuild(self, max_wait_s: float) -> None:
        """Describe every request again (the policy changed); ties keep today's order."""
        entries = []
        for item in self._queue:
            request = item.payload[0]
            key, payload = self._describe(request)
            entries.append((request.request_id, key, (request, payload)))
        self._queue.rebuild(entries, self.now)
        self._queue.max_wait_s = max_wait_s

    def set_head(self, requests: Iterable[Request]) -> None:
        """Admit these first, in order, until the next call (the probe lane's plan)."""
        self._queue.set_head(r.request_id for r in requests)

    @property
    def max_wait_s(self) -> float:
        return self._queue.max_wait_s

    def _push(self, request: Request, front: bool) -> None:
        key, payload = self._describe(request)
        self._queue.push(
            request.request_id, (request, payload), request.arrival_time, key, front=front
        )
