"""HiStateRuntime, the scheduler's index: what it decides becomes ordered ids for the worker.

Random stores into a small host tier: every key the index holds in host memory is one the
worker was told to keep (replaying the operations on a set of host keys gives the index's
host keys), spills precede drops of the same key, refused copies are dropped, a disk-full
spill shrinks the SSD tier and drops its victims, an unreadable file leaves the index, and
a pinned plan is never evicted.
"""

from __future__ import annotations

import errno
import random

import pytest

from vllm_ext.common.counters import Counters
from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.policy import Kind, kv_key, snap_key
from vllm_ext.histate.runtime import COUNTER_SPECS, HiStateRuntime
from vllm_ext.histate.worker_store import DROP, SPILL


def _runtime(host: int, ssd: int, files=None) -> HiStateRuntime:
    config = HiStateConfig(host_bytes=host, ssd_bytes=ssd, directory="/nonexistent", evict_slack=0)
    return HiStateRuntime(config, Counters("histate", COUNTER_SPECS), files or {})


@pytest.mark.parametrize("seed", range(5))
def test_operations_replayed_on_the_worker_give_the_index(seed):
    rng = random.Random(seed)
    runtime = _runtime(host=40, ssd=30)
    host, ssd = set(), set()  # what a worker applying the operations holds
    for step in range(200):
        kind = rng.choice((Kind.KV, Kind.SNAPSHOT))
        key = (kv_key if kind is Kind.KV else snap_key)(f"{rng.randint(0, 60)}")
        if runtime.has(key):
            continue
        host.add(key)  # the worker copied it out and reported it
        runtime.stored(key, kind, rng.randint(1, 12), step, rng.randint(0, 2000))
        ops = runtime.take_ops()
        for i, (op, k, _) in enumerate(ops):
            if op == SPILL:
                host.discard(k)
                ssd.add(k)
            elif op == DROP:
                # an item spilled and evicted in one round: its spill is listed first
                assert (SPILL, k, "") not in ops[i:]
                host.discard(k)
                ssd.discard(k)
        assert host == {i.key for i in runtime.tiers.host}
        assert ssd == {i.key for i in runtime.tiers.ssd}
        runtime.check_idle()


def test_a_copy_the_index_refuses_is_dropped_on_the_worker():
    runtime = _runtime(host=10, ssd=0)
    assert not runtime.stored(kv_key("big"), Kind.KV, 11, 0, 100)
    assert runtime.take_ops() == [(DROP, kv_key("big"), "")]


def test_disk_full_shrinks_the_ssd_tier_and_drops_its_victims():
    files = {snap_key(f"old{i}"): 10 for i in range(5)}
    runtime = _runtime(host=100, ssd=100, files=files)
    assert runtime.take_ops() == []  # every file fits
    runtime.spill_failed(snap_key("old4"), errno.ENOSPC, 10)
    ops = runtime.take_ops()
    assert runtime.tiers.ssd.capacity == 40  # what the disk held without the failed file
    assert len(ops) == 1 and ops[0][0] == DROP  # room for one more file of that size
    assert runtime.counters.value("ssd_disk_full") == 1
    runtime.spill_failed(snap_key("old3"), errno.EIO, 10)  # not a capacity signal
    assert runtime.tiers.ssd.capacity == 40 and snap_key("old3") not in runtime.tiers.ssd


def test_an_unreadable_file_leaves_the_index_and_its_file_is_dropped():
    runtime = _runtime(host=100, ssd=100, files={snap_key("bad"): 10})
    runtime.unreadable(snap_key("bad"))
    assert not runtime.has(snap_key("bad"))
    assert runtime.take_ops() == [(DROP, snap_key("bad"), "")]
    assert runtime.counters.value("load_failures") == 1


def test_a_pinned_plan_is_not_evicted_until_unpinned():
    runtime = _runtime(host=30, ssd=0)
    chain = ["a", "b"]
    runtime.stored(kv_key("a"), Kind.KV, 10, 16, 16)
    runtime.stored(snap_key("a"), Kind.SNAPSHOT, 10, 16, 16)
    plan = runtime.plan_load(chain, 0, 2)
    assert plan is not None and plan.blocks == 1 and plan.snapshot_tier == "host"
    runtime.pin(plan)
    assert not runtime.stored(kv_key("c"), Kind.KV, 20, 32, 32)  # no unpinned room
    runtime.unpin(plan)
    assert runtime.stored(kv_key("c"), Kind.KV, 20, 32, 32)
    dropped = {k for op, k, _ in runtime.take_ops() if op == DROP}
    assert dropped & {kv_key("a"), snap_key("a")}
    runtime.check_idle()
