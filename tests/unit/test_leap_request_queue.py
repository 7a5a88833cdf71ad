"""LeapRequestQueue against vLLM's own FCFSRequestQueue, with real vLLM Request objects.

Without information LEAP gives every waiting request one key and turns aging off:
the queue must then be vLLM's deque exactly, for every operation vLLM's scheduler uses.
"""

from __future__ import annotations

import math
import random

from vllm import SamplingParams
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request

from vllm_ext.leap.request_queue import LeapRequestQueue


def _request(i: int, arrival: float, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(f"r{i}", [1, 2, 3], params, None, arrival_time=arrival)


def _ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_one_key_is_vllms_fcfs_queue_exactly():
    rng = random.Random(0)
    ours, vllms = LeapRequestQueue(lambda r: ((), None, None)), FCFSRequestQueue()
    queued, made = [], 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not queued:
            request = _request(made, rng.uniform(0, 100))
            made += 1
            add = rng.choice(["add_request", "prepend_request"])
            getattr(ours, add)(request)
            getattr(vllms, add)(request)
            queued.append(request)
        elif op < 0.4:  # a step's skipped requests go back with prepend_requests
            batch = [_request(made + k, rng.uniform(0, 100)) for k in range(3)]
            made += 3
            ours.prepend_requests(batch)
            vllms.prepend_requests(batch)
            queued += batch
        elif op < 0.55:
            victim = rng.choice(queued)
            ours.remove_request(victim)
            vllms.remove_request(victim)
            queued.remove(victim)
        elif op < 0.65:
            gone = rng.sample(queued, min(3, len(queued)))
            ours.remove_requests(gone)
            vllms.remove_requests(gone)
            queued = [r for r in queued if r not in gone]
        else:
            assert ours.peek_request() is vllms.peek_request()
            popped = ours.pop_request()
            assert popped is vllms.pop_request()
            queued.remove(popped)
        assert len(ours) == len(vllms) and bool(ours) == bool(vllms)
        if queued and op > 0.95:  # the deque's membership test and indexing, now and then
            probe = rng.choice(queued + [_request(-1, 0.0)])
            assert (probe in ours) == (probe in vllms)
            index = rng.randrange(-len(vllms), len(vllms))
            assert ours[index] is vllms[index]
    assert _ids(ours) == _ids(vllms)


def test_head_rank_merges_two_queues_as_vllm_merges_its_fcfs_heads_without_keys():
    """vLLM 0.34 picks between two queues' heads by arrival; with one key, head_rank
    compares the same way; with keys, by key; a plan's picks before both."""
    keys: dict[str, tuple] = {}
    describe = lambda r: (keys.get(r.request_id, ()), None, None)  # noqa: E731
    waiting, async_kv = LeapRequestQueue(describe), LeapRequestQueue(describe)
    early, late = _request(0, 1.0), _request(1, 2.0)
    async_kv.add_request(early)
    waiting.add_request(late)
    assert async_kv.head_rank() < waiting.head_rank()  # FIFO key: the earlier arrival
    keys.update(r0=(0, 9.0), r1=(0, 1.0))  # keyed: the later arrival is the shorter
    async_kv.rekey(early)
    waiting.rekey(late)
    assert waiting.head_rank() < async_kv.head_rank()
    for queue in (waiting, async_kv):
        queue.set_head([early])  # the probe lane's plan names a request of one queue
    assert async_kv.head_rank() < waiting.head_rank()


def test_keys_order_the_queue_and_rekey_and_rebuild_follow_the_describer():
    keys = {"r0": (3.0,), "r1": (1.0,), "r2": (2.0,)}
    queue = LeapRequestQueue(lambda r: (keys[r.request_id], None, f"payload-{r.request_id}"))
    requests = {f"r{i}": _request(i, float(i)) for i in range(3)}
    for request in requests.values():
        queue.add_request(request)
    assert _ids(queue) == ["r1", "r2", "r0"]
    assert sorted(queue.payloads()) == ["payload-r0", "payload-r1", "payload-r2"]
    keys["r0"] = (0.5,)
    queue.rekey(requests["r0"])  # the scheduler's call when a prediction changes
    assert _ids(queue) == ["r0", "r1", "r2"]
    keys.update(r0=(9.0,), r1=(9.0,), r2=(9.0,))
    queue.rebuild(max_wait_s=math.inf)  # a new policy: all tie, today's order stays
    assert _ids(queue) == ["r0", "r1", "r2"]
    queue.set_head([requests["r2"]])  # the probe lane's plan goes first
    assert queue.pop_request() is requests["r2"]


def test_aged_requests_go_first_at_the_schedulers_time():
    keys = {"old": (5.0,), "new": (1.0,)}
    queue = LeapRequestQueue(lambda r: (keys[r.request_id], None, None))
    old = Request("old", [1], SamplingParams(max_tokens=1), None, arrival_time=0.0)
    new = Request("new", [1], SamplingParams(max_tokens=1), None, arrival_time=9.0)
    queue.add_request(old)
    queue.add_request(new)
    queue.rebuild(max_wait_s=5.0)
    queue.now = 4.0
    assert queue.peek_request() is new
    queue.now = 6.0  # old has waited 6 s
    assert queue.peek_request() is old


def test_expected_lengths_stay_sorted_through_every_change():
    rng = random.Random(4)
    length = {}
    queue = LeapRequestQueue(lambda r: ((length[r.request_id] or 0.0,), length[r.request_id], None))
    queued: dict[str, Request] = {}
    for i in range(1500):
        op = rng.random()
        if op < 0.4 or not queued:
            request = _request(i, float(i), max_tokens=rng.randrange(1, 600))
            length[request.request_id] = rng.choice([None, float(rng.randrange(1, 50))])
            getattr(queue, rng.choice(["add_request", "prepend_request"]))(request)
            queued[request.request_id] = request
        elif op < 0.55:  # a prediction arrived or changed
            request_id = rng.choice(sorted(queued))
            length[request_id] = rng.choice([None, float(rng.randrange(1, 50))])
            queue.rekey(queued[request_id])
        elif op < 0.7:
            request = queued.pop(rng.choice(sorted(queued)))
            queue.remove_requests([request])
        elif op < 0.75:
            queue.rebuild(max_wait_s=math.inf)
        else:
            del queued[queue.pop_request().request_id]
        known, unknown_caps = queue.lengths()
        values = [length[i] for i in queued]
        assert known == sorted(v for v in values if v is not None)
        caps = [float(queued[i].max_tokens) for i in queued if length[i] is None]
        assert unknown_caps == sorted(caps)


def test_an_unknown_requests_cap_is_what_it_may_still_write():
    queue = LeapRequestQueue(lambda r: ((), None, None))
    resumed = _request(0, 0.0, max_tokens=10)
    resumed.append_output_token_ids([7, 8, 9])  # preempted after three tokens
    queue.add_request(resumed)
    queue.add_request(_request(1, 1.0, max_tokens=600))
    assert queue.lengths() == ([], [7.0, 600.0])
    queue.pop_request()
    assert queue.lengths() == ([], [600.0])
