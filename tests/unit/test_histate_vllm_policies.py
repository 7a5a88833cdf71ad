"""vLLM's own lru/arc CachePolicy classes drive HiState's queue in the simulator's baselines."""

from __future__ import annotations

import random

import pytest

from benchmarks.histate.vllm_policies import VllmArcPolicy, VllmLruPolicy
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.policy import Item, Kind
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
