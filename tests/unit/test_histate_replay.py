"""Closed-loop trace replay of the HiState engine benchmark (no engine: pure bookkeeping)."""

from __future__ import annotations

import pytest

from benchmarks.histate.engine import metrics
from benchmarks.histate.replay import ClosedLoopReplay, first_prompt
from vllm_ext.histate.traces import agentic_trace, bfcl_trace


@pytest.fixture(scope="module")
def trace():
    return agentic_trace(6, seed=0, scale=0.02, session_rate=0.5, block_size=16)


def _first_turns(trace):
    return [r for r in trace.requests if r.turn == 0]


def test_first_prompts_share_exactly_the_shared_prefix_blocks(trace):
    a, b = _first_turns(trace)[:2]
    pa, pb = first_prompt(a, 16), first_prompt(b, 16)
    assert len(pa) == a.prompt_tokens and len(pb) == b.prompt_tokens
    shared_blocks = next(
        i for i, (x, y) in enumerate(zip(a.blocks, b.blocks, strict=False)) if x != y
    )
    assert shared_blocks >= 640 // 16  # aiperf's L1 tools/system layer at scale 0.02
    shared = shared_blocks * 16
    assert pa[:shared] == pb[:shared]
    assert pa[shared : shared + 16] != pb[shared : shared + 16]
    assert first_prompt(a, 16) == pa  # deterministic


def test_turns_are_sent_when_due_and_prompts_grow_by_outputs_and_new_tokens(trace):
    plan = ClosedLoopReplay(trace, time_scale=0.5, max_delay_s=1.0)
    start = min(r.arrival_s for r in trace.requests) * 0.5
    assert plan.pop_due(start - 1e-6) == []
    (turn,) = plan.pop_due(start)
    assert turn.turn == 0 and turn.due_s == start
    session = plan.sessions[turn.session_id]
    second = session.turns[1]
    plan.finished(turn, [1, 2, 3], now_s=100.0)
    due = 100.0 + min(second.delay_s * 0.5, 1.0)
    assert [t.session_id for t in plan.pop_due(due - 1e-6)].count(turn.session_id) == 0
    (nxt,) = [t for t in plan.pop_due(due) if t.session_id == turn.session_id]
    assert nxt.prompt[: len(turn.prompt)] == turn.prompt
    assert nxt.prompt[len(turn.prompt) : len(turn.prompt) + 3] == [1, 2, 3]
    assert len(nxt.prompt) == len(turn.prompt) + 3 + second.new_tokens
    assert nxt.max_tokens == second.output_tokens


def test_a_session_ends_before_a_turn_past_the_length_cap():
    trace = bfcl_trace(1, seed=0, scale=0.5, session_rate=1.0, block_size=16)
    turns = sorted(trace.requests, key=lambda r: r.turn)
    cap = turns[1].prompt_tokens + turns[1].output_tokens - 1
    plan = ClosedLoopReplay(trace, max_tokens_total=cap)
    (turn,) = plan.pop_due(1e9)
    plan.finished(turn, [5] * turns[0].output_tokens, now_s=0.0)
    assert plan.pop_due(1e9) == []
    assert plan.pending() == 0 and plan.skipped_turns == len(turns) - 1


def test_time_scale_must_be_positive(trace):
    with pytest.raises(ValueError, match="time_scale"):
        ClosedLoopReplay(trace, time_scale=0)


def test_metrics_split_hits_between_device_and_tiers():
    def rec(i, ttft, prompt, cached, sha):
        return dict(
            id=f"s{i}/t0", ttft_s=ttft, prompt_tokens=prompt, cached_tokens=cached, output_sha=sha
        )

    native = {
        "records": [rec(0, 1.0, 1000, 0, "a"), rec(1, 3.0, 1000, 384, "b")],
        "counters": {},
        "wall_s": 5.0,
    }
    ours = {
        "records": [rec(0, 0.5, 1000, 768, "a"), rec(1, 0.5, 1000, 768, "x")],
        "counters": {"hit_tokens": 768.0, "load_bytes_ssd": 2.0 * (1 << 20)},
        "wall_s": 4.0,
    }
    m = metrics(ours, native)
    assert m["token_hit_rate"] == pytest.approx(1536 / 2000)
    assert m["tier_loaded_tokens"] == 768
    assert m["recomputed_tokens"] == 464
    assert m["ssd_read_MB"] == pytest.approx(2.0)
    assert m["first_turns_equal_native"] == 0.5
    assert metrics(native, None)["ttft_mean_s"] == 2.0
