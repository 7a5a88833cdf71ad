"""LEAP's scheduler on vLLM 0.34's ``Scheduler``, built and stepped as vLLM's own tests do.

The 0.32 engine tests' order and preemption (``tests/engine/test_leap_engine.py``),
then what 0.34 adds around the waiting queue: ``async_kv_waiting`` (requests that
may load KV asynchronously, with ``max_num_inflight_kv_loads``), whose head vLLM
merges with ``waiting``'s by arrival; and cache-aware admission, which reorders
``waiting`` inside ``schedule()``. Each test also runs with vLLM's plain scheduler
(LEAP's connector still configured) and must then see FCFS order instead.
"""

from __future__ import annotations

import pytest
from leap034_helpers import (
    Stepper,
    leap_scheduler,
    request,
    with_remote_prefill,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from vllm_ext.leap.scheduler import LeapAsyncScheduler, LeapScheduler, find_leap_connector

PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((40, 70, 90, 13))]

# policy: LEAP's scheduler, or vLLM's plain one (FCFS) beside the same connector
POLICIES = ["leap", "fcfs"]


def _scheduler_cls(policy: str):
    from vllm_ext.leap.scheduler import make_scheduler

    return make_scheduler if policy == "leap" else Scheduler


def _assert_nothing_leaked(scheduler) -> None:
    from tests.v1.kv_connector.unit.utils import assert_scheduler_empty

    scheduler.schedule()  # hands the last finished ids on, as the next step would
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("policy", POLICIES)
def test_hints_serve_shortest_predicted_first(policy):
    scheduler = leap_scheduler(scheduler_cls=_scheduler_cls(policy), max_num_seqs=1)
    for rid, n in (("a", 24), ("b", 4), ("c", 12), ("d", 8)):
        scheduler.add_request(request(rid, PROMPTS[0], n, hint=n))
    stepper = Stepper(scheduler)
    stepper.run()
    expected = ["b", "d", "c", "a"] if policy == "leap" else ["a", "b", "c", "d"]
    assert stepper.started == expected
    assert {rid: len(out) for rid, out in stepper.outputs.items()} == {
        "a": 24, "b": 4, "c": 12, "d": 8,
    }  # fmt: skip
    _assert_nothing_leaked(scheduler)


@pytest.mark.parametrize("policy", POLICIES)
def test_shorter_arrival_preempts_longest_and_outputs_are_unchanged(policy):
    scheduler = leap_scheduler(
        {"preempt_margin": 0.5}, scheduler_cls=_scheduler_cls(policy), max_num_seqs=1
    )
    stepper = Stepper(scheduler)
    # as the engine test: one request served alone first (LEAP's prior needs one finished)
    scheduler.add_request(request("solo", PROMPTS[2], 40, hint=40))
    stepper.run()
    scheduler.add_request(request("long", PROMPTS[2], 40, hint=40))
    for _ in range(6):
        stepper.step()
    scheduler.add_request(request("short", PROMPTS[3], 3, hint=3))
    stepper.run()
    counters = find_leap_connector(scheduler.connector).counters
    if policy == "leap":
        assert stepper.finished == ["solo", "short", "long"]
        assert counters.value("preemptions") == 1
    else:
        assert stepper.finished == ["solo", "long", "short"]
        assert counters.value("preemptions") == 0
    # the preempted request resumes where it stopped: every token once, none dropped
    assert stepper.outputs == {"solo": [7] * 40, "long": [7] * 40, "short": [7] * 3}
    _assert_nothing_leaked(scheduler)


def test_a_preempted_request_keeps_output_still_in_flight():
    """Async scheduling: LEAP hands no KV off, so a request preempted while its output
    is in flight keeps that output (vLLM drops it only for a connector that must
    deliver KV, ``requires_kv_delivery``, whose default is true for kv_both).

    vLLM's ``test_kv_pressure_preempt_mid_handoff`` with LEAP's connector: KV pressure
    preempts the request whose only token (max_tokens=1) is in flight.
    """
    # LEAP's async variant by name: the CPU platform turns async scheduling off in the
    # config, which make_scheduler reads (vLLM's helper, too, picks AsyncScheduler itself)
    scheduler = leap_scheduler(
        scheduler_cls=LeapAsyncScheduler,
        async_scheduling=True,
        num_blocks=5,
        max_num_batched_tokens=512,
    )
    decoder = request("decoder", list(range(1, 33)), 8)
    handoff = request("handoff", list(range(40, 72)), 1)
    scheduler.add_request(decoder)
    scheduler.add_request(handoff)
    first = scheduler.schedule()
    assert handoff.num_output_placeholders == 1
    scheduler.schedule()  # the decoder's next block: the pool is out, handoff preempted
    assert handoff.status == RequestStatus.PREEMPTED
    assert handoff.drop_stale_output is False
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(first.num_scheduled_tokens)
    scheduler.update_from_output(
        first,
        ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids], pooler_output=[]
        ),
    )
    # delivered, not dropped and recomputed
    assert handoff.is_finished()
    assert handoff.num_output_tokens == 1
    assert scheduler.requires_kv_delivery is False


@pytest.mark.parametrize("policy", POLICIES)
def test_async_kv_loads_start_shortest_predicted_first(monkeypatch, policy):
    """Under the in-flight load cap, the load that starts is LEAP's shortest, and the
    slot goes to it first once loaded."""
    scheduler = leap_scheduler(
        scheduler_cls=_scheduler_cls(policy),
        inflight_kv_loads=1,
        max_num_seqs=1,
        **with_remote_prefill(monkeypatch),
    )
    assert isinstance(scheduler, LeapScheduler) == (policy == "leap")
    for rid, n in (("r24", 24), ("r4", 4), ("r12", 12)):
        scheduler.add_request(request(rid, PROMPTS[1], n, hint=n, remote=True))
    assert len(scheduler.async_kv_waiting) == 3
    stepper = Stepper(scheduler)
    stepper.run()
    expected = ["r4", "r12", "r24"] if policy == "leap" else ["r24", "r4", "r12"]
    assert stepper.loads == expected
    assert stepper.started == expected
    _assert_nothing_leaked(scheduler)


@pytest.mark.parametrize("policy", POLICIES)
def test_waiting_and_async_kv_heads_merge_in_leaps_order(monkeypatch, policy):
    """vLLM 0.34 picks between ``waiting``'s head and ``async_kv_waiting``'s by arrival;
    LEAP by its order. ``remote`` is flagged for an async load but its remote holds
    nothing (the false positive ``may_load_async`` allows), so it needs a running
    slot like the local requests, and the merge decides who gets it."""
    scheduler = leap_scheduler(
        scheduler_cls=_scheduler_cls(policy),
        inflight_kv_loads=2,
        max_num_seqs=1,
        **with_remote_prefill(monkeypatch),
    )
    remote = request("remote", PROMPTS[0], 30, hint=30, remote=True)
    remote.kv_transfer_params["remote_empty"] = True
    scheduler.add_request(remote)
    scheduler.add_request(request("short", PROMPTS[2], 4, hint=4))
    scheduler.add_request(request("mid", PROMPTS[3], 10, hint=10))
    assert [len(scheduler.waiting), len(scheduler.async_kv_waiting)] == [2, 1]
    stepper = Stepper(scheduler)
    stepper.run()
    expected = ["short", "mid", "remote"] if policy == "leap" else ["remote", "short", "mid"]
    assert stepper.started == expected
    assert stepper.loads == []
    _assert_nothing_leaked(scheduler)


@pytest.mark.parametrize("policy", POLICIES)
def test_cache_aware_admission_breaks_only_leaps_ties(policy):
    """Cache-aware admission moves the waiting requests with a cached prefix to the
    front of its window, inside ``schedule()`` after LEAP ordered ``waiting``: LEAP's
    order must hold (a shorter request first though its prefix is not cached)."""
    scheduler = leap_scheduler(
        scheduler_cls=_scheduler_cls(policy),
        max_num_seqs=1,
        enable_prefix_caching=True,
        cache_aware_admission_window=8,
        cache_aware_admission_threshold=0.0,
    )
    assert scheduler.cache_aware_window == 8
    stepper = Stepper(scheduler)
    scheduler.add_request(request("warm", PROMPTS[1], 2, hint=2))
    stepper.run()  # PROMPTS[1] is now in the prefix cache
    scheduler.add_request(request("runner", PROMPTS[0], 6, hint=6))
    stepper.step()  # holds the only slot while the next two queue
    fresh_short = request("fresh_short", PROMPTS[2], 3, hint=3)
    cached_long = request("cached_long", PROMPTS[1] + [5, 6], 20, hint=20)
    scheduler.add_request(fresh_short)
    scheduler.add_request(cached_long)
    cached = scheduler.kv_cache_manager.get_num_cached_tokens
    assert cached(cached_long) > 0 and cached(fresh_short) == 0
    stepper.run()
    expected = ["fresh_short", "cached_long"]  # LEAP's: shortest predicted first
    if policy == "fcfs":
        expected.reverse()  # vLLM's: the cached prefix first, though it arrived later
    assert stepper.started[2:] == expected
    _assert_nothing_leaked(scheduler)


@pytest.mark.parametrize("connector", ["none", "leap"])
def test_leap_keeps_speculative_lookahead_block_hashes(connector):
    """vLLM 0.34 gives EAGLE/MTP lookahead block hashes only where the configured
    connector opts in (``supports_lookahead_block_hashes``): LEAP's reads no block
    hash, so configuring it must not turn them off (vLLM's own MTP setup)."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    model_config = ModelConfig(
        model="Qwen/Qwen3-Next-80B-A3B-Instruct", max_model_len=128, skip_tokenizer_init=True
    )
    kwargs = dict(
        model=model_config.model,
        max_model_len=128,
        max_num_batched_tokens=128,
        enable_prefix_caching=True,
        block_size=4,
        speculative_config=SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=1,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        ),
    )
    if connector == "none":
        from tests.v1.core.utils import create_scheduler

        scheduler = create_scheduler(**kwargs)
    else:
        scheduler = leap_scheduler(**kwargs)
        assert find_leap_connector(scheduler.connector) is not None
    assert scheduler.num_hash_lookahead_tokens == 1


def test_leap_alone_starts_no_async_kv_load():
    """LEAP loads no KV: with --max-num-inflight-kv-loads and no loading connector, a
    request flagged for remote prefill waits in ``waiting`` (vLLM's default
    ``may_load_async`` reads the flag and would park it in ``async_kv_waiting``)."""
    scheduler = leap_scheduler(inflight_kv_loads=2, max_num_seqs=1)
    flagged = request("flagged", PROMPTS[0], 2, hint=2, remote=True)
    scheduler.add_request(flagged)
    assert list(scheduler.waiting) == [flagged]
    assert not scheduler.async_kv_waiting
    Stepper(scheduler).run()
    _assert_nothing_leaked(scheduler)
