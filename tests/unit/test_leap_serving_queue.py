"""AgingQueue: LEAP's waiting order kept incrementally, checked against plain sorting."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest

from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.policy import LeapPolicy, RequestView
from vllm_ext.leap.serving_queue import AgingQueue


def _brute_next(items: dict, now: float, max_wait_s: float) -> str:
    """The next id by the definition: aged first by (arrival, seq), else by (key, seq)."""
    aged = [(a, s, i) for i, (a, k, s) in items.items() if now - a >= max_wait_s]
    if aged:
        return min(aged)[2]
    return min((k, s, i) for i, (a, k, s) in items.items())[2]


def test_random_operations_serve_in_the_defined_order():
    rng = random.Random(0)
    for trial in range(60):
        max_wait_s = rng.choice([math.inf, 2.0, 5.0])
        queue, model = AgingQueue(max_wait_s), {}  # model: id -> (arrival, key, seq)
        back, front, next_id = 0, -1, 0
        for _ in range(300):
            now = rng.uniform(0, 10)
            op = rng.random()
            if op < 0.4 or not model:
                item_id, arrival = f"r{next_id}", rng.uniform(0, 8)
                key = (rng.randrange(3), float(rng.randrange(5)))  # many ties
                at_front = rng.random() < 0.3
                queue.push(item_id, None, arrival, key, front=at_front)
                seq = front if at_front else back
                front, back = front - at_front, back + (not at_front)
                model[item_id], next_id = (arrival, key, seq), next_id + 1
            elif op < 0.6:
                item_id = rng.choice(sorted(model))
                key = (rng.randrange(3), float(rng.randrange(5)))
                queue.rekey(item_id, key)
                model[item_id] = (model[item_id][0], key, model[item_id][2])
            elif op < 0.75:
                item_id = rng.choice(sorted(model))
                queue.remove(item_id)
                del model[item_id]
            else:
                expected = _brute_next(model, now, max_wait_s)
                assert queue.peek(now).item_id == expected, trial
                assert queue.pop(now).item_id == expected
                del model[expected]
            assert len(queue) == len(model)
            # lazy deletion stays bounded
            assert len(queue._by_key) <= 2 * len(model) + 65
        # the full order agrees with popping one by one
        now = rng.uniform(0, 10)
        listed = [item.item_id for item in queue.ordered(now)]
        popped = [queue.pop(now).item_id for _ in range(len(model))]
        assert listed == popped
        with pytest.raises(IndexError):
            queue.peek(now)


def test_constant_key_without_aging_is_a_deque():
    # how LEAP leaves vLLM's FCFS queue alone: append, appendleft, remove, popleft
    rng = random.Random(1)
    queue, reference, next_id = AgingQueue(), deque(), 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.35 or not reference:
            queue.push(f"r{next_id}", None, rng.uniform(0, 9), ())
            reference.append(f"r{next_id}")
            next_id += 1
        elif op < 0.55:
            queue.push(f"r{next_id}", None, rng.uniform(0, 9), (), front=True)
            reference.appendleft(f"r{next_id}")
            next_id += 1
        elif op < 0.7:
            victim = rng.choice(list(reference))
            queue.remove(victim)
            reference.remove(victim)
        else:
            assert queue.pop(now=100.0).item_id == reference.popleft()
    assert [item.item_id for item in queue.ordered(100.0)] == list(reference)


def test_keyed_by_unaged_key_equals_policy_order():
    rng = random.Random(2)
    for _ in range(100):
        prior = rng.choice(["fcfs", "prompt_length"])
        policy = LeapPolicy(LeapConfig(max_wait_s=rng.choice([1.0, 4.0]), prior=prior))
        views = [
            RequestView(
                f"r{i}",
                float(rng.randrange(6)),
                rng.randrange(1, 50),
                rng.randrange(20),
                rng.choice([None, float(rng.randrange(1, 60))]),
            )
            for i in range(rng.randrange(1, 30))
        ]
        queue = AgingQueue(policy.config.max_wait_s)
        for view in views:
            queue.push(view.request_id, view, view.arrival_time, policy.unaged_key(view))
        now = rng.uniform(0, 8)
        assert [item.item_id for item in queue.ordered(now)] == policy.order(views, now)
        assert [queue.pop(now).item_id for _ in views] == policy.order(views, now)


def test_rebuild_keeps_todays_order_for_ties_and_needs_every_item():
    queue = AgingQueue()
    for i, key in enumerate([(3,), (1,), (2,)]):
        queue.push(f"r{i}", None, float(i), key)
    assert [item.item_id for item in queue.ordered(0.0)] == ["r1", "r2", "r0"]
    queue.rebuild([(f"r{i}", (), None) for i in range(3)], now=0.0)  # all tie now
    assert [item.item_id for item in queue.ordered(0.0)] == ["r1", "r2", "r0"]
    queue.push("r3", None, 0.5, ())
    queue.push("r4", None, 0.6, (), front=True)
    assert [queue.pop(0.0).item_id for _ in range(5)] == ["r4", "r1", "r2", "r0", "r3"]
    queue.push("a", None, 0.0, (1,))
    with pytest.raises(ValueError, match="every queued item"):
        queue.rebuild([], now=0.0)


def test_head_goes_first_then_the_order_resumes():
    queue = AgingQueue(max_wait_s=5.0)
    for i in range(4):
        queue.push(f"r{i}", None, float(i), (float(-i),))  # r3 first by key
    queue.set_head(["r1", "gone", "r0"])
    assert [queue.pop(now=0.0).item_id for _ in range(4)] == ["r1", "r0", "r3", "r2"]


def test_aged_items_come_first_oldest_first():
    queue = AgingQueue(max_wait_s=5.0)
    queue.push("young_short", None, 9.0, (0.0,))
    queue.push("old_long", None, 1.0, (9.0,))
    queue.push("older_long", None, 0.0, (8.0,))
    assert [queue.pop(now=7.0).item_id for _ in range(3)] == [
        "older_long",
        "old_long",
        "young_short",
    ]


def test_misuse_is_a_named_error():
    queue = AgingQueue()
    queue.push("a", None, 0.0, ())
    with pytest.raises(ValueError, match="already queued"):
        queue.push("a", None, 0.0, ())
    with pytest.raises(KeyError):
        queue.remove("b")
