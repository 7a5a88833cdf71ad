"""vLLM's own lru/arc CachePolicy classes drive HiState's queue in the simulator's baselines."""

from __future__ import annotations

import random

import pytest

from benchmarks.histate.vllm_policies import StoreThreshold, VllmArcPolicy, VllmLruPolicy
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.policy import Item, Kind, LruPolicy
from vllm_ext.histate.queue import EvictionQueue


def _replay(policy, seed: int, n: int = 400) -> list[list[str]]:
    """Random stores and touches of mixed-size items; each store's victims (a set per store:
    the order inside one eviction round does not change what the tier holds)."""
    rng = random.Random(seed)
    queue = EvictionQueue(policy, capacity=60)
    victims: list[list[str]] = []
    for t in range(n):
        key = f"k{rng.randint(0, 40)}"
        if key in queue and rng.random() < 0.6:
            queue.touch(key, float(t))
            continue
        kind = rng.choice((Kind.KV, Kind.SNAPSHOT))
        ok, evicted = queue.insert(Item(key, kind, rng.randint(1, 8), float(t)))
        assert ok
        if evicted:
            victims.append(sorted(item.key for item in evicted))
        queue.check_invariants()
    return victims


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cls", [VllmLruPolicy, VllmArcPolicy])
def test_vllm_policies_keep_the_tier_within_capacity(seed, cls):
    # _replay checks the byte accounting and the capacity after every store
    victims = _replay(cls(HiStateConfig()), seed)
    assert victims


def _replay_with_pins(policy, seed: int, n: int = 1500) -> list[tuple]:
    """Stores, touches, pins (reads), unpins, removes and re-stores of mixed-size items;
    every store's victims in order."""
    rng = random.Random(seed)
    queue = EvictionQueue(policy, capacity=60)
    getattr(policy, "bind", lambda q: None)(queue)
    out, pinned = [], []
    for t in range(n):
        key, r = f"k{rng.randint(0, 40)}", rng.random()
        if key in queue and r < 0.4:
            queue.touch(key, float(t))
        elif key in queue and r < 0.55 and len(pinned) < 4:
            queue.pin(key)
            queue.touch(key, float(t))
            pinned.append(key)
        elif pinned and r < 0.7:
            queue.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif key in queue and r < 0.75:
            queue.remove(key)
        else:
            item = Item(key, rng.choice((Kind.KV, Kind.SNAPSHOT)), rng.randint(1, 8), float(t))
            ok, evicted = queue.insert(item)
            out.append((t, key, ok, [i.key for i in evicted]))
            queue.check_invariants()
    return out


@pytest.mark.parametrize("seed", range(6))
def test_vllm_lru_evicts_exactly_like_histates_lru(seed):
    # vLLM's LRUCachePolicy behind the adapter and HiState's LruPolicy: the same victims in
    # the same order, pins and re-stores included (the engine's lru baseline is this order)
    ours = _replay_with_pins(LruPolicy(HiStateConfig()), seed)
    assert ours == _replay_with_pins(VllmLruPolicy(HiStateConfig()), seed)


def test_vllm_arc_keeps_single_use_chunks_in_t1():
    # a store is not a reuse: ARC must see items stored once in T1, and a touched one in T2
    policy = VllmArcPolicy(HiStateConfig())
    queue = EvictionQueue(policy, capacity=4)
    policy.bind(queue)
    for t, key in enumerate("abcd"):
        queue.insert(Item(key, Kind.KV, 1, float(t)))
    queue.touch("a", 10.0)
    ok, evicted = queue.insert(Item("e", Kind.KV, 1, 11.0))
    assert ok and [i.key for i in evicted] == ["b"]  # LRU would also say b; T1 holds b, c, d
    impl = policy._impl
    assert set(impl.t1) == {b"c", b"d", b"e"} and set(impl.t2) == {b"a"}


def test_store_threshold_admits_a_new_key_on_its_second_offer():
    """vLLM's store_threshold=2: first offer skipped, second stored; resident keys always."""
    f = StoreThreshold(2, max_tracker_size=2)
    assert not f.admit_store("a", resident=False)
    assert f.admit_store("a", resident=False)
    assert f.admit_store("r", resident=True)
    assert not f.admit_store("b", resident=False)  # the table (2 keys) drops "a", the oldest
    assert not f.admit_store("a", resident=False)
