"""HiState's eviction as a vLLM CachePolicy, driven through vLLM's own CPUOffloadingManager.

vLLM's native OffloadingConnector does not run on the CPU build (its worker needs CUDA or
XPU), so these tests make the calls its scheduler makes — prepare_store / complete_store
(success and failure), lookup, prepare_load / complete_load, touch, on_request_finished,
reset — on the manager vLLM builds from ``eviction_policy: "histate"``, and check what the
manager promises its callers (capacity, atomic eviction, in-flight chunks and the keys of
the store itself never evicted) on random workloads, plus the recompute-aware order.
"""

from __future__ import annotations

import random

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from tests.histate_manager_checks import manager_problems
from vllm_ext.histate.cache_policy import HiStateCachePolicy, register

CHUNK = 16  # tokens per chunk


def _key(prefix: str, i: int):
    return make_offload_key(f"{prefix}{i:04d}".encode().ljust(32, b"."), 0)


def _request(name: str, prefix: str, n: int) -> tuple[ReqContext, list]:
    """A request whose prompt is ``n`` chunks of prefix ``prefix``; positions recorded."""
    ctx = ReqContext(req_id=name)
    keys = [_key(prefix, i) for i in range(n)]
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * CHUNK)
    return ctx, keys


def _store(manager, ctx, keys, success: bool = True):
    out = manager.prepare_store(keys, ctx)
    if out is not None:
        manager.complete_store(out.keys_to_store, ctx, success=success)
    return out


def test_registered_name_and_out_of_tree_path_resolve_to_the_policy():
    register()
    register()  # re-entrant: every vLLM process runs the plugin
    assert CachePolicyFactory.get_cache_policy_cls("histate") is HiStateCachePolicy
    cls = CachePolicyFactory.get_cache_policy_cls(
        "HiStateCachePolicy", "vllm_ext.histate.cache_policy"
    )
    assert cls is HiStateCachePolicy
    assert isinstance(CPUOffloadingManager(4, cache_policy="histate")._policy, HiStateCachePolicy)


def _first_victim(policy: str):
    register()
    manager = CPUOffloadingManager(9, cache_policy=policy)
    long_ctx, long_keys = _request("long", "a", 8)
    _store(manager, long_ctx, long_keys)
    manager.on_request_finished(long_ctx)
    short_ctx, short_keys = _request("short", "b", 1)
    _store(manager, short_ctx, short_keys)
    manager.on_request_finished(short_ctx)
    out = _store(manager, *_request("next", "c", 1))
    (victim,) = out.evicted_keys
    return victim, long_keys, short_keys


def test_the_cheapest_recompute_goes_first_where_lru_drops_the_older_request():
    victim, long_keys, short_keys = _first_victim("histate")
    # the one-chunk request loses 16 tokens; any chunk of the long one at least 16 tokens
    # deeper in the context (and the first chunk all 128): the short one goes, though newest
    assert victim == short_keys[0]
    lru_victim, *_ = _first_victim("lru")
    assert lru_victim in long_keys  # vLLM's lru: a chunk of the older request


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_the_managers_promises(seed):
    register()
    rng = random.Random(seed)
    capacity = rng.randint(4, 12)
    manager = CPUOffloadingManager(capacity, cache_policy="histate")
    policy = manager._policy
    loading: dict[bytes, int] = {}  # key -> loads in flight
    for step in range(300):
        ctx, keys = _request(f"r{step}", rng.choice("abcdef"), rng.randint(1, 6))
        keys = keys[rng.randint(0, len(keys) - 1) :]
        if rng.random() < 0.3:
            hits = [k for k in keys if manager.lookup(k, ctx) is LookupResult.HIT]
            if hits:
                manager.prepare_load(hits, ctx)
                for k in hits:
                    loading[k] = loading.get(k, 0) + 1
        before = set(policy.chunks)
        out = manager.prepare_store(keys, ctx)
        if out is not None:
            # never the store's own keys, never a chunk a load is reading
            assert not set(out.evicted_keys) & (set(keys) | set(loading))
            assert set(out.evicted_keys) <= before
            assert all(manager.lookup(k, ctx) is LookupResult.MISS for k in out.evicted_keys)
            manager.complete_store(out.keys_to_store, ctx, success=rng.random() < 0.9)
        else:
            assert set(policy.chunks) == before  # a refused store changes nothing
        assert len(policy.chunks) <= capacity
        if loading and rng.random() < 0.5:
            done = rng.choice(list(loading))
            manager.complete_load([done], ctx)
            loading[done] -= 1
            if not loading[done]:
                del loading[done]
        if rng.random() < 0.2:
            manager.touch(keys, ctx)  # 0.32's manager still forwards touch() to the policy
        manager.on_request_finished(ctx)
        assert manager_problems(manager) == []  # no slot lost, none freed twice
        assert len(policy._seen) <= 2 * capacity + 64  # refused stores' misses are bounded
        if rng.random() < 0.02 and not loading:
            manager.reset_cache()
    assert policy.evict(0, set()) == []
    assert policy.evict(capacity + 1, set()) is None  # more than it holds: nothing changes


def test_0_32s_two_argument_insert_prices_chunks_from_the_store_miss():
    # vLLM 0.32's manager calls insert(key, chunk): the estimate comes from on_store_miss
    register()
    manager = CPUOffloadingManager(8, cache_policy="histate")
    ctx, keys = _request("r", "a", 4)
    _store(manager, ctx, keys)
    items = manager._policy._items
    # chunk i: its own tokens and the deeper ones, a prefill ending at the request's depth
    assert [items[k].recompute_tokens for k in keys] == [64, 48, 32, 16]
    assert {items[k].position for k in keys} == {64}
    assert manager._policy._seen == {}


def test_the_slot_checks_see_a_leak_and_a_double_free():
    register()
    manager = CPUOffloadingManager(4, cache_policy="histate")
    ctx, keys = _request("r", "a", 3)
    _store(manager, ctx, keys)
    assert manager_problems(manager) == []
    manager._free_list.append(manager._policy.chunks[keys[0]].chunk_id)  # freed, still held
    assert any("both free and held" in p for p in manager_problems(manager))
    manager._free_list.clear()
    del manager._policy.chunks[keys[1]]  # dropped, never freed
    assert any("leaked" in p for p in manager_problems(manager))
