"""LeapPolicy: FCFS equivalence without predictions, SJF, aging bound, victims, risk, prior."""

from __future__ import annotations

import math
import random

import pytest

from vllm_ext.leap.config import LeapConfig
from vllm_ext.leap.policy import LeapPolicy, RequestView


def _view(rid, arrival, predicted=None, generated=0, prompt=10, std=None):
    return RequestView(rid, float(arrival), prompt, generated, predicted, std)


def _policy(**kwargs):
    return LeapPolicy(LeapConfig(**kwargs))


def _fcfs(views):
    """Expected FCFS: by arrival time, ties in insertion (list) order."""
    return [
        v.request_id for _, v in sorted(enumerate(views), key=lambda p: (p[1].arrival_time, p[0]))
    ]


def _random_views(rng, n, predict_share):
    views = []
    for i in range(n):
        predicted = rng.uniform(1, 2000) if rng.random() < predict_share else None
        std = rng.choice([None, rng.uniform(0, 2)]) if predicted else None
        views.append(
            _view(
                f"r{rng.randrange(10**6)}-{i}",
                rng.randrange(6),
                predicted,
                rng.randrange(300),
                rng.randrange(1, 500),
                std,
            )
        )
    return views


def test_no_predictions_is_exactly_fcfs():
    # prior fcfs: what the scheduler uses whenever no informative model is loaded
    rng = random.Random(0)
    for _ in range(300):
        policy = _policy(
            max_wait_s=rng.choice([0.5, 2.0, 30.0]), risk_k=rng.choice([0.0, 3.0]), prior="fcfs"
        )
        views = _random_views(rng, rng.randrange(1, 12), predict_share=0.0)
        rng.shuffle(views)  # any insertion order; ties in arrival must keep it
        now = rng.uniform(0, 8)  # some requests aged, some not
        assert policy.order(views, now) == _fcfs(views)
        assert policy.choose_victim(views, now) == _fcfs(views)[-1]  # vLLM's default victim


def test_predicted_requests_shortest_remaining_first():
    policy = _policy()
    views = [
        _view("long", 0, predicted=900),
        _view("nearly-done", 1, predicted=500, generated=490),  # 10 left
        _view("short", 2, predicted=50),
        _view("tie-late", 4, predicted=50),
        _view("overrun", 5, predicted=20, generated=80),  # past its prediction: 1 left
        _view("tie-early", 3, predicted=50),
    ]
    order = policy.order(views, now=6)
    assert order == ["overrun", "nearly-done", "short", "tie-early", "tie-late", "long"]
    assert policy.remaining(views[1]) == 10 and policy.remaining(views[4]) == 1


def test_unpredicted_go_ahead_of_predicted_and_aged_go_first():
    policy = _policy(max_wait_s=10)
    views = [
        _view("predicted-short", 5, predicted=3),
        _view("new-b", 7),
        _view("aged-long", 0, predicted=5000),
        _view("new-a", 6),
        _view("aged-new", 1),
    ]
    assert policy.order(views, now=11) == [
        "aged-long",
        "aged-new",
        "new-a",
        "new-b",
        "predicted-short",
    ]
    assert policy.is_aged(views[4], now=11) and not policy.is_aged(views[4], now=10.99)


@pytest.mark.parametrize("shorts_predicted", [True, False])
def test_long_job_waits_at_most_max_wait(shorts_predicted):
    """One request served per tick, two short jobs arriving per tick (the queue grows)."""
    max_wait = 10

    def start_tick(policy, ticks=60):
        queue = [_view("long", 0, predicted=10_000)]
        for tick in range(ticks):
            short = 5 if shorts_predicted else None
            queue += [_view(f"s{tick}-{j}", tick, predicted=short) for j in range(2)]
            first = policy.order(queue, now=tick)[0]
            if first == "long":
                return tick
            queue = [v for v in queue if v.request_id != first]
        return None

    assert start_tick(_policy(max_wait_s=max_wait)) <= max_wait + 1
    # without the bound the long job starves behind the stream: the test can fail
    assert start_tick(_policy(max_wait_s=1e6)) is None


def test_victim_is_longest_predicted_non_aged():
    policy = _policy(max_wait_s=10)
    running = [
        _view("aged-huge", 0, predicted=8000),  # protected by the aging bound
        _view("a", 5, predicted=100, generated=10),  # 90 left
        _view("b", 6, predicted=500, generated=450),  # 50 left
        _view("probing", 9),  # no prediction yet: protected while predicted ones exist
    ]
    assert policy.choose_victim(running, now=12) == "a"
    tie = [_view("x", 5, predicted=90), _view("y", 7, predicted=90), _view("z", 6, predicted=90)]
    assert policy.choose_victim(tie, now=8) == "y"  # ties: latest arrival


def test_preemption_pairs_shortest_waiting_with_longest_running():
    policy = _policy()
    runners = [("long", 400.0), ("mid", 120.0), ("short", 20.0)]
    # a burst of four unknown requests (prior 100) and one known short one
    waiting = [100.0, 100.0, 10.0, 100.0, 100.0]
    # shortest waiting first: 10 vs long (400 > 15), 100 vs mid (120 <= 150) stops
    assert policy.preemption_victims(waiting, runners, free_slots=0, margin=0.5) == ["long"]
    assert policy.preemption_victims(waiting, runners, free_slots=0, margin=0.0) == ["long", "mid"]
    # a free slot admits the shortest waiting one: the pairing starts at the next
    assert policy.preemption_victims(waiting, runners, free_slots=1, margin=0.5) == ["long"]
    assert policy.preemption_victims(waiting, runners, free_slots=5, margin=0.0) == []
    # never more victims than waiting requests left after the free slots
    assert policy.preemption_victims([1.0], runners, free_slots=0, margin=0.0) == ["long"]
    assert policy.preemption_victims([], runners, free_slots=0, margin=0.0) == []


def test_preemption_movable_check_equals_filtering_and_is_asked_lazily():
    policy, rng = _policy(), random.Random(3)
    for _ in range(300):
        runners = [(f"r{i}", float(rng.randrange(1, 400))) for i in range(rng.randrange(12))]
        waiting = [float(rng.randrange(1, 300)) for _ in range(rng.randrange(12))]
        pinned = {rid for rid, _ in runners if rng.random() < 0.3}
        free, margin = rng.randrange(3), rng.choice([0.0, 0.5])
        asked = []

        def movable(rid, asked=asked, pinned=pinned):
            asked.append(rid)
            return rid not in pinned

        lazy = policy.preemption_victims(waiting, runners, free, margin, movable=movable)
        movable_only = [r for r in runners if r[0] not in pinned]
        assert lazy == policy.preemption_victims(waiting, movable_only, free, margin)
        # asked only up to where the pairing stopped: the victims and the pinned it skipped
        assert len(asked) <= len(lazy) + len(pinned)


def test_victim_without_predictions_or_all_aged_is_fcfs_last():
    policy = _policy(max_wait_s=10)
    same_time = [_view("first", 3), _view("second", 3), _view("early", 1)]
    assert policy.choose_victim(same_time, now=4) == "second"
    mixed = [_view("aged-pred", 0, predicted=9000), _view("new-1", 5), _view("new-2", 6)]
    assert policy.choose_victim(mixed, now=12) == "new-2"  # only unpredicted non-aged
    all_aged = [_view("p", 2, predicted=10), _view("q", 1, predicted=9000)]
    assert policy.choose_victim(all_aged, now=50) == "p"
    with pytest.raises(ValueError, match="at least one"):
        policy.choose_victim([], now=0)


def test_victim_is_last_in_serving_order():
    rng = random.Random(1)
    for _ in range(300):
        policy = _policy(
            max_wait_s=rng.choice([1.0, 4.0]), risk_k=rng.choice([0.0, 1.0]), prior="fcfs"
        )
        views = _random_views(rng, rng.randrange(1, 10), predict_share=0.6)
        now = rng.uniform(0, 7)
        assert policy.choose_victim(views, now) == policy.order(views, now)[-1]


def test_risk_k_reorders_only_where_sigma_differs():
    rng = random.Random(2)
    for _ in range(200):
        sigma = rng.uniform(0, 2)
        views = [
            _view(f"r{i}", rng.randrange(5), rng.uniform(1, 3000), rng.randrange(500), std=sigma)
            for i in range(8)
        ]
        assert _policy(risk_k=2.5).order(views, 6) == _policy(risk_k=0.0).order(views, 6)
    sure = _view("sure", 0, predicted=100, std=0.0)
    unsure = _view("unsure", 1, predicted=80, std=0.5)
    assert _policy(risk_k=0.0).order([sure, unsure], 2) == ["unsure", "sure"]
    assert _policy(risk_k=1.0).order([sure, unsure], 2) == ["sure", "unsure"]
    assert _policy(risk_k=1.0).remaining(unsure) == pytest.approx(80 * math.exp(0.5))
    assert _policy(risk_k=1.0).remaining(_view("no-std", 0, predicted=80)) == 80
    assert _policy(risk_k=2000.0).remaining(unsure) == math.inf  # no OverflowError


def test_prompt_length_prior_orders_unpredicted_by_prompt():
    policy = _policy(prior="prompt_length", max_wait_s=10)
    views = [
        _view("long-prompt", 1, prompt=900),
        _view("predicted", 0, predicted=2),
        _view("short-late", 3, prompt=20),
        _view("short-early", 2, prompt=20),
        _view("aged", -20, prompt=5000),
    ]
    assert policy.order(views, now=4) == [
        "aged",
        "short-early",
        "short-late",
        "long-prompt",
        "predicted",
    ]
    # victim without predictions stays vLLM's FCFS last, whatever the prior
    assert policy.choose_victim([v for v in views if v.predicted_total is None], 4) == "short-late"


def test_conditional_remaining_stops_favouring_a_runner_past_its_prediction():
    policy = _policy()
    overdue = dict(rid="overdue", arrival=0, predicted=100, generated=150)  # 1 left by the point
    fresh = dict(rid="fresh", arrival=1, predicted=60)
    point = [_view(**overdue), _view(**fresh)]
    assert policy.order(point, now=2) == ["overdue", "fresh"]
    assert policy.choose_victim(point, now=2) == "fresh"
    spread = [RequestView(**{**_args(v), "error_log_std": 0.8}) for v in point]
    assert policy.order(spread, now=2) == ["fresh", "overdue"]
    assert policy.choose_victim(spread, now=2) == "overdue"
    assert policy.remaining(spread[0]) > 60  # the log-normal's mean residual life
    # the request's max_tokens bounds both rules
    capped = RequestView(**{**_args(spread[0]), "max_tokens": 160})
    assert policy.remaining(capped) <= 10
    assert policy.remaining(RequestView(**{**_args(point[0]), "max_tokens": 80})) == 1


def _args(view: RequestView) -> dict:
    return {name: getattr(view, name) for name in RequestView.__slots__}


def test_remaining_and_view_validation():
    policy = _policy()
    assert policy.remaining(_view("x", 0)) is None
    assert policy.remaining(_view("x", 0, predicted=30, generated=5)) == 25
    for kwargs in (
        {"predicted": 0.0},
        {"predicted": math.nan},
        {"predicted": 5, "std": -1},
        {"generated": -1},
        {"arrival": math.inf},
        {"prompt": 2.5},
    ):
        args = {"rid": "bad", "arrival": 0, **kwargs}
        with pytest.raises(ValueError, match="RequestView"):
            _view(**args)
    for kwargs in ({"error_log_std": -0.1}, {"error_log_std": math.inf}, {"max_tokens": 0}):
        with pytest.raises(ValueError, match="RequestView"):
            RequestView("bad", 0.0, 1, 0, 10.0, **kwargs)
    with pytest.raises(ValueError, match="duplicate"):
        policy.order([_view("a", 0), _view("a", 1)], 2)


def _plan(policy, waiting, runners, slots=4, prior=100.0, lane=1, now=0.0):
    return policy.plan_slots(waiting, runners, slots, prior, lane, now)


def test_probe_lane_probes_unknown_requests_and_parks_the_probed_long_one():
    policy = _policy(prior="prompt_length", preempt_margin=0.5, max_wait_s=30.0)
    unknown = [_view(f"u{i}", i, prompt=p) for i, p in enumerate((300, 20, 90))]
    # a burst: nothing probed yet -> three decode slots on the prior (shortest prompt
    # first), the fourth slot probes the next unknown one
    plan = _plan(policy, [*unknown, _view("u3", 3, prompt=5)], [])
    assert plan.park == []
    assert plan.admit == ["u3", "u1", "u2"]
    assert plan.probe == ["u0"]
    # the probe came back long: parked, and the lane probes the next unknown one;
    # the decoders keep their slots (10 left: not clearly longer than the short one's 7)
    decoders = [(_view(f"d{i}", 0, predicted=20, generated=10), True) for i in range(3)]
    probed = (_view("p", 1, predicted=500, generated=1), True)
    waiting = [_view("short", 2, predicted=8, generated=1), *unknown]
    plan = _plan(policy, waiting, [*decoders, probed])
    assert plan.park == ["p"]
    assert plan.admit == []
    assert plan.probe == ["u1"]
    # ... until the decoders are clearly longer than the known short one
    decoders = [(_view(f"d{i}", 0, predicted=60 + i, generated=0), True) for i in range(3)]
    plan = _plan(policy, waiting, [*decoders, probed])
    assert plan.park == ["d2", "p"]
    assert plan.admit == ["short"]


def test_probe_lane_respects_pinned_runners_margin_and_aging():
    policy = _policy(preempt_margin=0.5, max_wait_s=10.0, prior="fcfs")
    # an unpredicted runner occupies the lane: no second probe, decode slot on the prior
    runners = [(_view("probing", 0), False), (_view("d", 0, predicted=140), True)]
    waiting = [_view("u", 1), _view("v", 2)]
    plan = _plan(policy, waiting, runners, slots=3)
    assert (plan.park, plan.admit, plan.probe) == ([], ["u"], [])
    # margin: 140 remaining vs prior 100 -> stays (140 / 1.5 < 100); 160 would not
    plan = _plan(policy, waiting, runners, slots=2)
    assert (plan.park, plan.admit, plan.probe) == ([], [], [])
    runners[1] = (_view("d", 0, predicted=160), True)
    plan = _plan(policy, waiting, runners, slots=2)
    assert (plan.park, plan.admit) == (["d"], ["u"])
    # an aged waiting request outranks every expected length; pinned runners never move
    aged = _view("old", -20, predicted=5000)
    plan = _plan(policy, [aged], [(_view("d", 0, predicted=2), True)], slots=1, lane=0)
    assert (plan.park, plan.admit) == (["d"], ["old"])
    plan = _plan(policy, [aged], [(_view("d", 0, predicted=2), False)], slots=1, lane=0)
    assert (plan.park, plan.admit) == ([], [])
    # no lane width: the lane never opens; never more admits than free slots
    plan = _plan(policy, [_view(f"u{i}", i) for i in range(6)], [], slots=4, lane=0)
    assert (plan.admit, plan.probe) == (["u0", "u1", "u2", "u3"], [])


@pytest.mark.parametrize("prior", ["fcfs", "prompt_length"])
def test_order_with_the_callers_unaged_keys_equals_order_without(prior):
    rng = random.Random(7)
    policy = _policy(prior=prior, max_wait_s=3.0, risk_k=0.5)
    views = _random_views(rng, 200, 0.6)
    keys = {v.request_id: policy.unaged_key(v) for v in views}
    for now in (2.0, 5.0, 9.0):  # arrivals 0..5: none, some and all aged
        assert policy.order(views, now, keys) == policy.order(views, now)
        # a partial map: the missing keys are computed
        half = dict(list(keys.items())[::2])
        assert policy.order(views, now, half) == policy.order(views, now)


def test_probe_lane_scores_an_unprobed_request_by_the_prior_capped_at_its_max_tokens():
    policy = _policy(preempt_margin=0.0)
    runner = (_view("r", 0, predicted=60, generated=10), True)  # 50 left
    free_writer = _view("big", 1)
    capped = RequestView("small", 2.0, 10, 0, None, None, 0.0, 8.0)  # may write 8 tokens
    # no lane: one decode slot; the prior (100) loses to the runner, max_tokens 8 wins
    assert _plan(policy, [free_writer], [runner], slots=1, lane=0).park == []
    plan = _plan(policy, [free_writer, capped], [runner], slots=1, lane=0)
    assert (plan.park, plan.admit) == (["r"], ["small"])
