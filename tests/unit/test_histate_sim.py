"""HiState traces (determinism, prefix chains, JSONL round trip) and simulator sanity."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.costmodel import GB, CostModel
from vllm_ext.histate.policy import LruPolicy
from vllm_ext.histate.simulator import VARIANTS, InstanceSim, simulate
from vllm_ext.histate.traces import (
    Trace,
    TraceRequest,
    agentic_trace,
    bfcl_trace,
    block_chain,
    load_trace,
    save_trace,
)


@pytest.fixture(scope="module")
def small_trace():
    return agentic_trace(12, seed=3, scale=0.05, session_rate=0.5, block_size=64)


def test_block_chain_is_a_prefix_hash_chain():
    a = block_chain([("sys", 100), ("user/1", 60)], 32)
    b = block_chain([("sys", 100), ("user/2", 60)], 32)
    assert len(a) == 5 and a[:3] == b[:3] and a[3] != b[3]
    # same tokens cut into different segments are different content
    assert block_chain([("x", 64)], 32) == block_chain([("x", 64), ("y", 0)], 32)
    assert block_chain([("x", 31)], 32) == []


def test_agentic_trace_is_deterministic_and_chains_extend(small_trace):
    again = agentic_trace(12, seed=3, scale=0.05, session_rate=0.5, block_size=64)
    assert again == small_trace
    assert agentic_trace(12, seed=4, scale=0.05, session_rate=0.5, block_size=64) != small_trace
    by_session: dict[str, list[TraceRequest]] = {}
    for req in small_trace.requests:
        by_session.setdefault(req.session_id, []).append(req)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.blocks[: len(prev.blocks)] == prev.blocks
            assert cur.prompt_tokens == prev.prompt_tokens + prev.output_tokens + cur.new_tokens
            assert cur.arrival_s == pytest.approx(prev.arrival_s + cur.delay_s)
    # the global L1 prefix is shared by every session
    firsts = {turns[0].blocks[0] for turns in by_session.values()}
    assert len(firsts) == 1


def test_trace_jsonl_round_trip(tmp_path, small_trace):
    path = save_trace(small_trace, tmp_path / "t.jsonl")
    assert load_trace(path) == small_trace
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3] + ['{"session_id": 1}'] + lines[4:]) + "\n")
    with pytest.raises(ValueError, match=":4:"):
        load_trace(path)


def test_bfcl_trace_deterministic_and_tools_shared():
    a = bfcl_trace(6, seed=0, session_rate=2.0, categories=("base",))
    assert a == bfcl_trace(6, seed=0, session_rate=2.0, categories=("base",))
    assert all(r.output_tokens >= 1 and r.new_tokens >= 1 for r in a.requests)
    # every session starts with the same system prompt block
    assert len({r.blocks[0] for r in a.requests if r.turn == 0}) == 1


def _cost(**kw):
    return dataclasses.replace(CostModel(), **kw)


def test_infinite_capacity_every_repeated_prefix_hits(small_trace):
    cost = _cost(device_bytes=10**15)
    sim = InstanceSim(small_trace, cost, "native", HiStateConfig())
    sim.run()
    B = small_trace.block_size
    by_key = {(r.session_id, r.turn): r for r in small_trace.requests}
    for (sid, turn), blocks in sim.hit_blocks.items():
        if turn == 0:
            continue
        prev = by_key[(sid, turn - 1)]
        expected = min(len(prev.blocks), (by_key[(sid, turn)].prompt_tokens - 1) // B)
        assert blocks >= expected, (sid, turn, blocks, expected)


def test_zero_host_and_ssd_degenerates_to_native(small_trace):
    cost = _cost(device_bytes=2 * GB, host_bytes=0, ssd_bytes=0)
    native = InstanceSim(small_trace, cost, "native", HiStateConfig())
    ours = InstanceSim(small_trace, cost, "histate", HiStateConfig())
    native.run()
    metrics = ours.run()
    assert ours.ttft == native.ttft and ours.hit_blocks == native.hit_blocks
    assert metrics["hit_rate_host"] == metrics["hit_rate_ssd"] == 0.0


def test_tiers_help_under_device_pressure(small_trace):
    cost = _cost(device_bytes=1 * GB, host_bytes=8 * GB, ssd_bytes=100 * GB)
    native = simulate(small_trace, cost, "native")
    ours = simulate(small_trace, cost, "histate")
    assert ours["token_hit_rate"] > native["token_hit_rate"]
    assert ours["hit_rate_host"] + ours["hit_rate_ssd"] > 0
    assert ours["requests"] == native["requests"] == len(small_trace.requests)


def test_simulation_is_deterministic_and_checks_variant(small_trace):
    cost = _cost(device_bytes=1 * GB, host_bytes=2 * GB, ssd_bytes=10 * GB)
    assert simulate(small_trace, cost, "marconi") == simulate(small_trace, cost, "marconi")
    with pytest.raises(ValueError, match="variant"):
        InstanceSim(small_trace, cost, "fifo", HiStateConfig())


def test_policy_class_replaces_the_tiers_policy(small_trace):
    cost = _cost(device_bytes=1 * GB, host_bytes=2 * GB, ssd_bytes=10 * GB)
    sim = InstanceSim(small_trace, cost, "histate", HiStateConfig(), LruPolicy)
    assert isinstance(sim.tiers.policy, LruPolicy)
    # the policy gets the simulator's config (cost-model calibration), not the caller's
    assert sim.tiers.policy.config.ssd_read_bytes_per_s == cost.ssd_read_bytes_per_s
    # with the device copies kept (as for lru), HiState's tiers under LRU are the lru variant
    keep = HiStateConfig(release_device_snapshots=False)
    assert simulate(small_trace, cost, "histate", keep, LruPolicy) == simulate(
        small_trace, cost, "lru"
    )


def test_empty_trace():
    empty = Trace("empty", 64, (), {})
    assert simulate(empty, CostModel(), "histate")["requests"] == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_leaked_pins_and_consistent_accounting_after_a_run(small_trace, variant):
    cost = _cost(device_bytes=1 * GB, host_bytes=2 * GB, ssd_bytes=10 * GB)
    sim = InstanceSim(small_trace, cost, variant, HiStateConfig())
    sim.run()
    sim.device.check_invariants()
    assert sim.device.pinned_bytes == 0 and not sim._running
    if sim.tiers is not None:
        sim.tiers.check_invariants()
        assert sim.tiers.host.pinned_bytes == 0 and sim.tiers.ssd.pinned_bytes == 0


@pytest.mark.parametrize("variant", ["marconi", "marconi_device", "histate", "native"])
def test_decode_end_snapshot_inside_the_prompt_block_is_kept(variant):
    """Turn 0 decodes 1 token without crossing a block boundary; turn 1 still hits 2 blocks."""
    chain = block_chain([("p", 10), ("o", 1), ("n", 5), ("o2", 1)], 4)
    t0 = TraceRequest("s", 0, 0.0, 0.0, 10, 10, 1, tuple(chain[:2]))
    t1 = TraceRequest("s", 1, 1.0, 1.0, 16, 5, 1, tuple(chain[:4]))
    trace = Trace("tiny", 4, (t0, t1), {})
    device = 0 if variant in ("marconi", "histate") else 10**12
    cost = _cost(device_bytes=device, kv_bytes_per_token=1, state_bytes=8, host_bytes=10**6)
    sim = InstanceSim(trace, cost, variant, HiStateConfig())
    sim.run()
    assert sim.hit_blocks[("s", 1)] == 2


def test_held_snapshots_release_their_device_copies_only_when_configured(small_trace):
    cost = _cost(device_bytes=1 * GB, host_bytes=8 * GB, ssd_bytes=100 * GB)
    released = InstanceSim(
        small_trace, cost, "histate", HiStateConfig(release_device_snapshots=True)
    )
    kept = InstanceSim(small_trace, cost, "histate", HiStateConfig(release_device_snapshots=False))
    with_release, without = released.run(), kept.run()
    assert with_release["device_snapshots_released"] > 0
    assert without["device_snapshots_released"] == 0
    from vllm_ext.histate.policy import Kind

    def device_snapshots(sim):
        return sum(item.kind is Kind.SNAPSHOT for item in sim.device)

    assert device_snapshots(released) < device_snapshots(kept)
    assert with_release["requests"] == without["requests"]
