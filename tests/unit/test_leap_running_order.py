"""running_order: the vectorised running-batch order equals LeapPolicy's per-view rules."""

from __future__ import annotations

import math
import random

import numpy as np

from vllm_ext.leap import running_order
from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.policy import LeapPolicy, RequestView
from vllm_ext.leap.running_order import RunningBatch


def _random_views(rng: random.Random, n: int) -> list[RequestView]:
    views = []
    for i in range(n):
        predicted = rng.choice([None, float(rng.randrange(1, 400)), rng.uniform(1, 400)])
        std = rng.choice([None, 0.0, rng.uniform(0, 2)]) if predicted else None
        spread = rng.choice([0.0, 0.0, rng.uniform(0.05, 1.5)]) if predicted else 0.0
        generated = rng.randrange(0, 300)
        cap = rng.choice([math.inf, float(generated + rng.randrange(1, 300))])
        views.append(
            RequestView(
                f"r{i}",
                float(rng.randrange(8)),  # ties on arrival
                rng.randrange(1, 40),
                generated,
                predicted,
                std,
                error_log_std=spread,  # some with the conditional remaining
                max_tokens=cap,
            )
        )
    return views


def _batch(views: list[RequestView]) -> RunningBatch:
    return RunningBatch.from_columns(
        [v.arrival_time for v in views],
        [v.prompt_tokens for v in views],
        [v.generated_tokens for v in views],
        [math.nan if v.predicted_total is None else v.predicted_total for v in views],
        [v.predicted_log_std or 0.0 for v in views],
        [v.error_log_std for v in views],
        [v.max_tokens for v in views],
    )


def _policy_order_victim_last(policy: LeapPolicy, views, now) -> list[str]:
    order = policy.order(views, now)
    victim = policy.choose_victim(views, now)
    order.remove(victim)
    return [*order, victim]


def test_order_equals_policy_order_with_the_victim_last():
    rng = random.Random(0)
    for trial in range(400):
        policy = LeapPolicy(
            LeapConfig(
                max_wait_s=rng.choice([1.0, 4.0, 30.0]),
                risk_k=rng.choice([0.0, 0.0, 1.5]),
                prior=rng.choice(["fcfs", "prompt_length"]),
            )
        )
        views = _random_views(rng, rng.randrange(1, 40))
        now = rng.uniform(0, 10)
        got = running_order.order(policy, _batch(views), now)
        assert [views[i].request_id for i in got] == _policy_order_victim_last(
            policy, views, now
        ), trial


def test_remaining_equals_policy_remaining_including_overflow():
    rng = random.Random(1)
    policy = LeapPolicy(LeapConfig(risk_k=3.0))
    views = _random_views(rng, 200)
    views.append(RequestView("huge", 0.0, 1, 0, 1e300, 5.0))  # exp overflow -> inf
    got = running_order.remaining(policy, _batch(views))
    for view, value in zip(views, got.tolist(), strict=True):
        want = policy.remaining(view)
        if want is None:
            assert math.isnan(value)
        else:
            assert value == want or math.isclose(value, want, rel_tol=1e-12), view


def test_aged_and_without():
    policy = LeapPolicy(LeapConfig(max_wait_s=2.0))
    views = [RequestView(f"r{i}", float(i), 5, 1, 10.0 + i) for i in range(5)]
    batch = _batch(views)
    assert running_order.aged(policy, batch, now=3.0).tolist() == [True, True, False, False, False]
    rest = batch.without([1, 3])
    assert rest.arrival_time.tolist() == [0.0, 2.0, 4.0]
    assert rest.predicted_total.tolist() == [10.0, 12.0, 14.0]
    assert len(batch.without([])) == 5


def test_empty_batch():
    policy = LeapPolicy(LeapConfig())
    empty = _batch([])
    assert running_order.order(policy, empty, 0.0).tolist() == []
    assert np.asarray(running_order.remaining(policy, empty)).size == 0
