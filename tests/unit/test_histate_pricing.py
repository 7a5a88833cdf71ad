"""Chain pricing (issue 36 part 3): HiState no longer recomputes more than LRU on engine-sized
traces because a prefix block was priced once, at its first store, below its descendants.

- the simulator with the connector's old rules (``connector_v1``) reproduces the engine's
  finding deterministically (HiState recomputes more than LRU); with chain pricing, under
  the same device-snapshot release, it never does on the same grid;
- the connector's scheduler half re-prices held prefix items when a later turn stores into
  the chain (the old code skipped every held key: the test fails on it).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ext.common.counters import Counters
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.costmodel import CostModel
from vllm_ext.histate.policy import Kind, kv_key, snap_key
from vllm_ext.histate.pricing import chain_prices, held_snapshot_positions
from vllm_ext.histate.runtime import COUNTER_SPECS, HiStateRuntime
from vllm_ext.histate.scheduler_side import SchedulerSide
from vllm_ext.histate.simulator import InstanceSim
from vllm_ext.histate.traces import agentic_trace

pytestmark = pytest.mark.unit
KIB, MIB = 1024, 1 << 20


def _engine_sized(device_mib: int, prefill_s: float) -> CostModel:
    """The tiny hybrid of benchmarks.histate.engine: 384 KiB KV blocks, 512 KiB snapshots,
    a 12 MiB host tier (agentic12_host12M)."""
    return CostModel(kv_bytes_per_token=1024, state_bytes=512 * KIB,
                     device_bytes=device_mib * MIB, prefill_s_per_token=prefill_s,
                     host_bytes=12 * MIB, ssd_bytes=1024 * MIB, chunk_tokens=1536,
                     decode_s_per_token=0.01)  # fmt: skip


def _computed(trace, cost, **kw) -> dict[str, float]:
    return {
        v: InstanceSim(trace, cost, v, HiStateConfig(), **kw).run()["computed_tokens"]
        for v in ("lru", "histate")
    }


def test_connector_v1_pricing_reproduces_histate_recomputing_more_than_lru():
    trace = agentic_trace(12, seed=1, scale=0.02, session_rate=0.2, block_size=384)
    cost = _engine_sized(12, 2e-3)
    old = _computed(trace, cost, connector_v1=True)
    assert old["histate"] > old["lru"], old
    # the same device-snapshot release under both policies: only the pricing differs
    new = _computed(trace, cost, release_all=True)
    assert new["histate"] <= new["lru"], new


@pytest.mark.parametrize("seed", range(4))
def test_chain_pricing_never_recomputes_more_than_lru_on_engine_sized_traces(seed):
    trace = agentic_trace(12, seed=seed, scale=0.02, session_rate=0.2, block_size=384)
    for device in (6, 9, 12):
        for prefill in (4e-5, 2e-3):
            got = _computed(trace, _engine_sized(device, prefill), release_all=True)
            assert got["histate"] <= got["lru"], (seed, device, prefill, got)


def test_chain_prices_never_price_a_prefix_block_below_its_descendants():
    chain = [f"h{i}" for i in range(10)]
    prices = {k: t for k, t, _ in chain_prices(chain, 10, 16, {4, 8})}
    kv = [prices[kv_key(h)] for h in chain]
    # blocks before the deepest snapshot: losing one drops the hit to the snapshot before it
    assert kv == [8 * 16] * 4 + [4 * 16] * 4 + [0, 0]
    assert all(a >= b for a, b in zip(kv, kv[1:], strict=False))
    assert prices[snap_key("h3")] == 4 * 16 and prices[snap_key("h7")] == 4 * 16
    held = {snap_key("h3"), snap_key("h7")}
    assert held_snapshot_positions(chain, 10, held.__contains__) == [4, 8]


def _side(host_bytes: int = 64 * MIB):
    config = HiStateConfig(host_bytes=host_bytes, ssd_bytes=0, evict_slack=0)
    runtime = HiStateRuntime(config, Counters("histate", COUNTER_SPECS))
    return SchedulerSide(config, runtime, block_size=4, attn_group=0, mamba_group=1), runtime


def _request(req_id: str, hashes: list[bytes], prompt: int, computed: int):
    return SimpleNamespace(request_id=req_id, block_hashes=hashes, num_prompt_tokens=prompt,
                           num_computed_tokens=computed, num_tokens=prompt)  # fmt: skip


def _step(side, request, n_tokens: int):
    blocks = len(request.block_hashes)
    ids = ([10 + j for j in range(blocks)], [100 + j for j in range(blocks)])
    state = SimpleNamespace(get_block_ids=lambda _req: ids, boundary_state_offloads={})
    out = SimpleNamespace(kv_connector_block_state=state,
                          num_scheduled_tokens={request.request_id: n_tokens})  # fmt: skip
    side.on_new_request(request)
    # the fields of HiStateMetadata the scheduler half fills
    return side.build_connector_meta(out, SimpleNamespace(stores=[], loads=[], ops=[]))


def _report(side, meta) -> None:
    stored = {key: 100 for key, _group, _block in meta.stores}
    side.update_connector_output(SimpleNamespace(
        stored=stored, failed=[], staged=[], stage_failed=[], spill_failed=[]))  # fmt: skip


def test_connector_reprices_held_prefix_blocks_when_a_later_turn_extends_the_chain():
    side, runtime = _side()
    hashes = [bytes([i]) * 4 for i in range(8)]
    # turn 0: a 9-token prompt, 2 full blocks, stored with its prompt-end snapshot
    turn0 = _request("t0", hashes[:2], prompt=9, computed=0)
    _report(side, _step(side, turn0, 8))
    short = runtime.tiers.host.get(kv_key(hashes[0].hex())).recompute_tokens
    # turn 1 extends the chain to 8 blocks: its prefix blocks are worth the longer hit now
    turn1 = _request("t1", hashes, prompt=33, computed=8)
    _report(side, _step(side, turn1, 24))
    first = runtime.tiers.host.get(kv_key(hashes[0].hex()))
    tail = runtime.tiers.host.get(kv_key(hashes[6].hex()))
    assert first is not None and tail is not None and first.kind is Kind.KV
    assert first.recompute_tokens > short
    assert first.recompute_tokens >= tail.recompute_tokens
