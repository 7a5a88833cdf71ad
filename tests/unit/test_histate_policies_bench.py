"""The deterministic policy benchmark (benchmarks.histate.policies), the ShareGPT chat trace and
the simulator's exact_end tail snapshots (issue 36 parts 2-3)."""

from __future__ import annotations

import json

import pytest

from benchmarks.histate import policies
from vllm_ext.bench import validate_headline
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.costmodel import GB, CostModel, qwen3_next_80b_h100
from vllm_ext.histate.simulator import InstanceSim, tail_key
from vllm_ext.histate.traces import (
    Trace,
    TraceRequest,
    agentic_trace,
    bfcl_trace,
    block_chain,
    sharegpt_trace,
)

pytestmark = pytest.mark.unit


def test_sharegpt_trace_is_deterministic_multi_turn_chat():
    a = sharegpt_trace(20, seed=0, session_rate=2.0, block_size=64)
    assert a == sharegpt_trace(20, seed=0, session_rate=2.0, block_size=64)
    assert a != sharegpt_trace(20, seed=1, session_rate=2.0, block_size=64)
    by_session: dict[str, list[TraceRequest]] = {}
    for req in a.requests:
        by_session.setdefault(req.session_id, []).append(req)
    assert len(by_session) == 20
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert len(turns) >= 2 and turns[0].prompt_tokens == turns[0].new_tokens
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.blocks[: len(prev.blocks)] == prev.blocks
            assert cur.prompt_tokens == prev.prompt_tokens + prev.output_tokens + cur.new_tokens
    # no shared system prompt: reuse is within a conversation only
    firsts = [t[0].blocks[0] for t in by_session.values() if t[0].blocks]
    assert len(set(firsts)) == len(firsts)


def _two_turns(block: int = 16) -> Trace:
    """Turn 0: 20 prompt + 7 output tokens (1 full block); turn 1 adds 5 tokens."""
    chain = block_chain([("p", 20), ("o", 7), ("n", 5), ("o2", 3)], block)
    t0 = TraceRequest("s", 0, 0.0, 0.0, 20, 20, 7, tuple(chain[:1]))
    t1 = TraceRequest("s", 1, 1.0, 1.0, 32, 5, 3, tuple(chain[:2]))
    return Trace("two", block, (t0, t1), {})


def _tiny_cost(**kw) -> CostModel:
    base = dict(device_bytes=0, kv_bytes_per_token=1, state_bytes=64, host_bytes=10**6)
    return CostModel(**{**base, **kw})


def test_exact_end_continuation_recomputes_only_its_new_tokens():
    trace = _two_turns()
    exact = InstanceSim(trace, _tiny_cost(), "histate", HiStateConfig(), exact_end=True)
    m = exact.run()
    # the previous turn computed 20 + 7 - 1 = 26 tokens: all of them are a hit
    assert m["tail_hits"] == 1 and m["tail_hit_tokens"] == 26
    assert exact.tiers.tier_of(tail_key("s", 0)) is not None
    # recomputed: only the last sampled token of turn 0, which was never computed
    assert m["recomputed_tokens"] == 1
    aligned = InstanceSim(trace, _tiny_cost(), "histate", HiStateConfig()).run()
    assert aligned["tail_hits"] == 0 and aligned["recomputed_tokens"] == 32 - 5 - 16


def test_exact_end_is_for_tiered_variants_and_needs_the_blocks_kv():
    trace = _two_turns()
    native = InstanceSim(trace, _tiny_cost(device_bytes=10**6), "native", HiStateConfig(),
                         exact_end=True)  # fmt: skip
    assert not native.exact_end and native.run()["tail_hits"] == 0
    # a host tier too small for the tail item (state + partial KV) gives no tail hit
    small = InstanceSim(trace, _tiny_cost(host_bytes=80, ssd_bytes=0), "histate",
                        HiStateConfig(), exact_end=True)  # fmt: skip
    assert small.run()["tail_hits"] == 0


def test_qwen3_next_cost_model_numbers():
    cost = qwen3_next_80b_h100(host_bytes=32 * GB)
    assert cost.kv_bytes_per_token == 24 * 1024  # 12 attention layers x 2 x 2 heads x 256 x 2 B
    assert 37 << 20 < cost.state_bytes < 38 << 20  # 36 GDN layers x (1 MiB + 48 KiB)
    assert cost.host_bytes == 32 * GB and cost.chunk_tokens % policies.B == 0


def test_policies_benchmark_end_to_end(tmp_path, monkeypatch):
    tiny = {
        "sharegpt": (sharegpt_trace, dict(n_sessions=6, session_rate=2.0, block_size=64)),
        "agentic": (agentic_trace, dict(n_sessions=4, scale=0.02, session_rate=1.0,
                                        block_size=64)),  # fmt: skip
        "bfcl": (bfcl_trace, dict(n_sessions=4, session_rate=2.0, block_size=64)),
    }
    monkeypatch.setattr(policies, "TRACES", tiny)
    monkeypatch.setattr(policies, "HOST_GB", (0.001, 1.0))
    assert policies.main(["--workers", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "histate_policies.json").read_text()
    data = json.loads(text)
    validate_headline(data["headline"])
    rows = data["config"]["checks"]
    assert {(r["trace"], r["host_GB"]) for r in rows} == {
        (t, h) for t in tiny for h in (0.001, 1.0)
    }
    for row in rows:
        # no policy beats the no-eviction floor; exact_end only adds hits
        assert row["floor_recomputed"] <= row["histate_recomputed"]
        assert row["histate_exact_end_recomputed"] <= row["histate_recomputed"]
    assert set(data["config"]["cross_check_engine"]["per_policy"]) == {
        "native", "lru", "marconi", "histate"
    }
    assert str(tmp_path) not in text and "/root" not in text and "/work" not in text
    assert (tmp_path / "histate_policies.png").stat().st_size > 0
