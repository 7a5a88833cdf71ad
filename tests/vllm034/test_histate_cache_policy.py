"""HiStateCachePolicy inside vLLM 0.34's own CPUOffloadingManager, with 0.34's request contexts.

0.34's manager calls ``insert(key, chunk, req_context)``, ``on_request_access``
and the (now abstract) ``on_request_finished``, and never ``touch``. The
manager is built as vLLM's ``tests/v1/kv_offload/cpu/test_manager.py`` builds
it, the request contexts are vLLM's: ``ReqContext`` for positions only and the
OffloadingConnector scheduler's ``_VllmReqContext`` with the token counts it
freezes when a request finishes (``_RequestTokens``). Each order test runs the
same calls with vLLM's ``lru`` beside ``histate`` and checks they part where
they should, so it fails with LRU in HiState's place.
"""

from __future__ import annotations

import inspect
import random

import histate_manager_checks
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    _RequestTokens,
    _VllmReqContext,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

from vllm_ext.histate.cache_policy import HiStateCachePolicy, register

CHUNK = 16  # tokens per chunk


def _manager(num_chunks: int, policy: str) -> CPUOffloadingManager:
    register()
    return CPUOffloadingManager(
        num_chunks=num_chunks, cache_policy=policy, enable_events=False, store_threshold=0
    )


def _keys(prefix: str, n: int, group: int = 0) -> list:
    return [make_offload_key(f"{prefix}{i:04d}".encode().ljust(32, b"."), group) for i in range(n)]


def _context(name: str, keys: list, prompt_tokens: int | None = None) -> ReqContext:
    """vLLM's context of a request over ``keys`` (chunk i ends at token (i+1)*CHUNK).

    With ``prompt_tokens``: the OffloadingConnector scheduler's context, whose
    token counts say the prompt is that long (nothing decoded yet).
    """
    if prompt_tokens is None:
        ctx = ReqContext(req_id=name)
    else:
        ctx = _VllmReqContext(req_id=name, _scheduler=None)
        computed = len(keys) * CHUNK
        ctx.set_state(_RequestTokens(computed, 0, prompt_tokens, prompt_tokens))
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * CHUNK)
    return ctx


def _store(manager: CPUOffloadingManager, ctx: ReqContext, keys: list):
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    assert histate_manager_checks.manager_problems(manager) == []
    return out


def test_the_policy_meets_the_0_34_contract():
    # 0.34 dropped touch() and made on_request_finished abstract: nothing left unimplemented
    assert not hasattr(CachePolicy, "touch")
    assert not HiStateCachePolicy.__abstractmethods__
    assert "req_context" in inspect.signature(HiStateCachePolicy.insert).parameters
    assert isinstance(_manager(4, "histate")._policy, HiStateCachePolicy)


def _cheap_newest_scenario(policy: str):
    """A long request (8 chunks), then a short one (1 chunk); a store needs one slot."""
    manager = _manager(9, policy)
    long_keys, short_keys = _keys("long", 8), _keys("short", 1)
    long_ctx, short_ctx = _context("long", long_keys), _context("short", short_keys)
    _store(manager, long_ctx, long_keys)
    manager.on_request_finished(long_ctx)
    _store(manager, short_ctx, short_keys)
    manager.on_request_finished(short_ctx)
    new_keys = _keys("new", 1)
    (victim,) = _store(manager, _context("new", new_keys), new_keys).evicted_keys
    return victim, long_keys, short_keys


def test_the_lowest_loss_goes_first_where_lru_drops_the_older_request():
    victim, _, short_keys = _cheap_newest_scenario("histate")
    # 16 tokens lost at the head of a context vs at least the last 16 of 128
    assert victim == short_keys[0]
    lru_victim, long_keys, _ = _cheap_newest_scenario("lru")
    assert lru_victim == long_keys[-1]  # vLLM's lru: the older request's tail


def _long_prompt_scenario(policy: str, with_counts: bool):
    """A 128-token prompt in chunked prefill has stored its first chunk; a later short
    request stored two chunks and finished; the next store needs one slot."""
    manager = _manager(3, policy)
    long_keys, short_keys = _keys("long", 1), _keys("short", 2)
    long_ctx = _context("long", long_keys, prompt_tokens=128 if with_counts else None)
    short_ctx = _context("short", short_keys)
    _store(manager, long_ctx, long_keys)
    _store(manager, short_ctx, short_keys)
    manager.on_request_finished(short_ctx)
    new_keys = _keys("new", 1)
    (victim,) = _store(manager, _context("new", new_keys), new_keys).evicted_keys
    return victim, long_keys[0], short_keys[-1]


def test_a_long_prompts_first_chunk_is_priced_by_the_prompt_0_34_counts_it():
    victim, long_head, short_tail = _long_prompt_scenario("histate", with_counts=True)
    # the first chunk of a 128-token prompt loses 128 tokens; the short tail 16
    assert victim == short_tail
    # without 0.34's counts (vLLM 0.32/0.33), only the one stored position is known
    victim, long_head, short_tail = _long_prompt_scenario("histate", with_counts=False)
    assert victim == long_head
    # vLLM's lru evicts the older request's chunk, counts or not
    victim, long_head, _ = _long_prompt_scenario("lru", with_counts=True)
    assert victim == long_head


def _reused_prefix_scenario(policy: str):
    """Three 4-chunk requests fill the cache; a 4th loads the oldest one's first two
    chunks (on_request_access on the hit) and then stores 2 new chunks behind them."""
    manager = _manager(12, policy)
    olds = [_keys(f"old{r}", 4) for r in range(3)]
    for r, keys in enumerate(olds):
        ctx = _context(f"old{r}", keys)
        _store(manager, ctx, keys)
        manager.on_request_finished(ctx)
    new_keys = _keys("old0", 2) + _keys("tail", 2)
    ctx = _context("turn2", new_keys)
    hits = [key for key in new_keys if manager.lookup(key, ctx) is LookupResult.HIT]
    assert hits == olds[0][:2]
    manager.prepare_load(hits, ctx)
    manager.complete_load(hits, ctx)
    out = _store(manager, ctx, new_keys)
    manager.on_request_finished(ctx)
    assert out.keys_to_store == new_keys[2:]
    return set(out.evicted_keys), olds


def test_a_hit_refreshes_its_chunks_and_only_request_tails_go():
    victims, olds = _reused_prefix_scenario("histate")
    # every tail loses 16 tokens, old0's third chunk 32 (itself and its tail): two tails
    # go, the earliest stored first; the reused head stays
    assert victims == {olds[0][3], olds[1][3]}
    lru_victims, _ = _reused_prefix_scenario("lru")
    # vLLM's lru: old0's unused part is the oldest access, third chunk included
    assert lru_victims == {olds[0][3], olds[0][2]}


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_keep_the_managers_slots_and_promises(seed):
    rng = random.Random(seed)
    capacity = rng.randint(4, 12)
    manager = _manager(capacity, "histate")
    policy = manager._policy
    loading: dict = {}  # key -> (ctx, loads in flight)
    for step in range(300):
        keys = _keys(rng.choice("abcdef"), rng.randint(1, 6), group=rng.randint(0, 1))
        counts = rng.choice([None, len(keys) * CHUNK + rng.randint(0, 64)])
        ctx = _context(f"r{step}", keys, prompt_tokens=counts)
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
            assert not set(out.evicted_keys) & (set(keys) | set(loading))
            assert set(out.evicted_keys) <= before
            manager.complete_store(out.keys_to_store, ctx, success=rng.random() < 0.9)
        else:
            assert set(policy.chunks) == before  # a refused store changes nothing
        if loading and rng.random() < 0.5:
            done = rng.choice(list(loading))
            manager.complete_load([done], ctx)
            loading[done] -= 1
            if not loading[done]:
                del loading[done]
        manager.on_request_finished(ctx)
        assert histate_manager_checks.manager_problems(manager) == []
        assert len(policy._seen) <= 2 * capacity + 64
        if rng.random() < 0.02 and not loading:
            manager.reset_cache()
    assert policy.evict(capacity + 1, set()) is None
