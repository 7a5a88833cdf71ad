"""HiState tiers (spill, pinning, SSD-backed restart) and the longest-hit lookup."""

from __future__ import annotations

import pytest

from vllm_ext.histate.config import HiStateConfig
from vllm_ext.histate.lookup import (
    MISS,
    BranchTracker,
    longest_hit,
    recompute_tokens,
    snapshot_positions,
)
from vllm_ext.histate.policy import Kind
from vllm_ext.histate.snapfile import SnapshotStore
from vllm_ext.histate.tiers import HOST, SSD, TieredCache

MB = 1 << 20


def _cfg(**kw):
    base = dict(policy="lru", host_bytes=3 * MB, ssd_bytes=2 * MB, evict_slack=0.0)
    return HiStateConfig(**{**base, **kw})


def test_snapshots_spill_to_ssd_kv_is_dropped():
    cache = TieredCache(_cfg(), keep_payloads=False)
    cache.store("snap:a", Kind.SNAPSHOT, MB, 0.0)
    cache.store("kv:a", Kind.KV, MB, 1.0)
    cache.store("kv:b", Kind.KV, MB, 2.0)
    result = cache.store("kv:c", Kind.KV, MB, 3.0)
    assert [i.key for i in result.spilled] == ["snap:a"] and result.evicted == []
    assert cache.tier_of("snap:a") == SSD
    result = cache.store("kv:d", Kind.KV, MB, 4.0)
    assert [i.key for i in result.evicted] == ["kv:a"] and cache.tier_of("kv:a") is None
    cache.check_invariants()


def test_ssd_full_evicts_by_the_same_policy():
    cache = TieredCache(_cfg(host_bytes=MB), keep_payloads=False)
    for t, key in enumerate(["snap:1", "snap:2", "snap:3", "snap:4"]):
        cache.store(key, Kind.SNAPSHOT, MB, float(t))
    # host holds snap:4; SSD (2 MiB) holds the two most recent spills
    assert cache.tier_of("snap:4") == HOST
    assert cache.tier_of("snap:3") == SSD and cache.tier_of("snap:2") == SSD
    assert cache.tier_of("snap:1") is None
    cache.check_invariants()


def test_no_spill_when_disabled():
    cache = TieredCache(_cfg(host_bytes=MB, spill_to_ssd=False), keep_payloads=False)
    cache.store("snap:1", Kind.SNAPSHOT, MB, 0.0)
    result = cache.store("snap:2", Kind.SNAPSHOT, MB, 1.0)
    assert [i.key for i in result.evicted] == ["snap:1"] and cache.tier_of("snap:1") is None


def test_pinned_item_survives_pressure():
    cache = TieredCache(_cfg(host_bytes=2 * MB, ssd_bytes=0), keep_payloads=False)
    cache.store("kv:a", Kind.KV, MB, 0.0)
    cache.store("kv:b", Kind.KV, MB, 1.0)
    assert cache.pin("kv:a") == HOST
    cache.store("kv:c", Kind.KV, MB, 2.0)
    assert cache.tier_of("kv:a") == HOST and cache.tier_of("kv:b") is None
    cache.unpin("kv:a")
    cache.store("kv:d", Kind.KV, MB, 3.0)
    assert cache.tier_of("kv:a") is None


def test_payloads_through_real_ssd_and_restart(tmp_path):
    cfg = _cfg(host_bytes=10, ssd_bytes=100, directory=str(tmp_path))
    cache = TieredCache(cfg, ssd_store=SnapshotStore(tmp_path, "ns"))
    cache.store("snap:a", Kind.SNAPSHOT, 10, 0.0, payload=b"A" * 10)
    cache.store("snap:b", Kind.SNAPSHOT, 10, 1.0, payload=b"B" * 10)
    assert cache.tier_of("snap:a") == SSD and cache.load("snap:a") == b"A" * 10
    assert cache.load("snap:b") == b"B" * 10
    again = TieredCache(cfg, ssd_store=SnapshotStore(tmp_path, "ns"))
    assert again.tier_of("snap:a") == SSD and again.load("snap:a") == b"A" * 10
    assert again.tier_of("snap:b") is None  # it was only in host memory
    again.check_invariants()


def test_corrupt_ssd_file_becomes_a_miss_and_leaves_the_tier(tmp_path):
    cfg = _cfg(host_bytes=10, ssd_bytes=100)
    store = SnapshotStore(tmp_path, "ns")
    cache = TieredCache(cfg, ssd_store=store)
    cache.store("snap:a", Kind.SNAPSHOT, 10, 0.0, payload=b"A" * 10)
    cache.store("snap:b", Kind.SNAPSHOT, 10, 1.0, payload=b"B" * 10)
    path = store.path("snap:a")
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    assert cache.load("snap:a") is None and cache.tier_of("snap:a") is None
    assert cache.counters.value("ssd_corrupt") == 1


def test_failed_spill_write_is_not_offered(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path, "ns")
    cache = TieredCache(_cfg(host_bytes=10, ssd_bytes=100), ssd_store=store)
    monkeypatch.setattr(store, "write", lambda key, data: 5)  # EIO
    cache.store("snap:a", Kind.SNAPSHOT, 10, 0.0, payload=b"A" * 10)
    cache.store("snap:b", Kind.SNAPSHOT, 10, 1.0, payload=b"B" * 10)
    assert cache.tier_of("snap:a") is None


def _tiers(mapping):
    return lambda h: mapping.get(h)


def test_longest_hit_needs_kv_and_snapshot_at_the_same_point():
    chain = ["h0", "h1", "h2", "h3"]
    kv = _tiers({"h0": "device", "h1": "host", "h2": "host"})
    snaps = _tiers({"h0": "ssd", "h3": "host"})
    hit = longest_hit(chain, kv, snaps)
    # KV reaches 3 blocks but the only snapshot within it ends block 0
    assert (hit.blocks, hit.snapshot_tier, hit.kv_blocks_present) == (1, "ssd", 3)
    assert hit.kv_tiers == ("device",)
    snaps = _tiers({"h0": "ssd", "h2": "device"})
    assert longest_hit(chain, kv, snaps).blocks == 3
    assert longest_hit(chain, kv, snaps, max_blocks=2).blocks == 1
    assert longest_hit(chain, _tiers({}), snaps) == MISS
    assert longest_hit(chain, kv, _tiers({})).blocks == 0


def test_snapshot_positions_and_reasons():
    pos = snapshot_positions(10, 4, prompt_end=6, decode_end=8, branch=2)
    assert pos == {2: "branch", 4: "interval", 6: "prompt_end", 8: "decode_end"}
    assert snapshot_positions(3, 4, decode_end=5) == {}
    with pytest.raises(ValueError):
        snapshot_positions(3, 0)


def test_recompute_tokens_accounting():
    per_block, per_snap = recompute_tokens(6, [2, 5], block_size=10)
    # best hit 5; blocks 0,1 fall back to 0 -> 50; blocks 2..4 to snapshot 2 -> 30; block 5 none
    assert per_block == [50, 50, 30, 30, 30, 0]
    assert per_snap == {2: 20, 5: 30}


def test_concurrent_store_and_load_keep_invariants(tmp_path):
    import threading

    store = SnapshotStore(tmp_path, "ns", fsync=False)
    cache = TieredCache(_cfg(host_bytes=40, ssd_bytes=200), ssd_store=store)
    errors: list[BaseException] = []

    def writer(offset):
        try:
            for i in range(200):
                key = f"snap:{offset + i % 37}"
                cache.store(key, Kind.SNAPSHOT, 10, float(i), payload=key.encode().ljust(10))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def reader():
        try:
            for i in range(400):
                key = f"snap:{i % 74}"
                data = cache.load(key)
                assert data is None or data == key.encode().ljust(10)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 37)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cache.check_invariants()


def test_branch_points_only_where_a_seen_path_diverges():
    tree = BranchTracker()
    tree.observe(["a", "b", "c"])
    # the next turn extends the same path: no branch
    assert tree.branch_point(["a", "b", "c", "d"], 4) is None
    # another sequence shares "a" then diverges at block 1
    assert tree.branch_point(["a", "x", "y"], 3) == 1
    assert tree.branch_point(["a", "x", "y"], 1) is None
    assert tree.branch_point(["z"], 1) is None


def test_no_ssd_store_means_no_ssd_tier_when_payloads_are_real():
    cache = TieredCache(_cfg(host_bytes=10, ssd_bytes=100))
    cache.store("snap:a", Kind.SNAPSHOT, 10, 0.0, payload=b"A" * 10)
    result = cache.store("snap:b", Kind.SNAPSHOT, 10, 1.0, payload=b"B" * 10)
    assert [i.key for i in result.evicted] == ["snap:a"] and cache.tier_of("snap:a") is None


def test_a_full_disk_shrinks_the_ssd_tier_so_later_spills_are_kept(tmp_path, monkeypatch):
    import errno
    import os

    from vllm_ext.histate import snapfile

    disk = 3 * MB  # the disk holds less than the configured ssd_bytes (8 MiB)
    store = SnapshotStore(tmp_path, "ns", fsync=False)
    real_write = os.write

    def bounded_write(fd, data):
        used = sum(p.stat().st_size for p in store.root.iterdir() if p.is_file())
        if used + len(data) > disk:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(snapfile.os, "write", bounded_write)
    cache = TieredCache(_cfg(host_bytes=MB, ssd_bytes=8 * MB), ssd_store=store)
    size = MB // 4
    payloads = {f"snap:{i}": bytes([i]) * size for i in range(40)}
    spilled = []
    for t, (key, payload) in enumerate(payloads.items()):
        result = cache.store(key, Kind.SNAPSHOT, size, float(t), payload=payload)
        spilled += [item.key for item in result.spilled]
    counters = cache.counters
    assert counters.value("ssd_disk_full") >= 1
    assert cache.ssd.capacity < 8 * MB
    assert counters.value("ssd_capacity_shrunk_bytes") == 8 * MB - cache.ssd.capacity
    # once the tier knows the disk's size it evicts before writing: the latest
    # spills are all on the SSD and read back intact, none lost to ENOSPC
    assert counters.value("ssd_disk_full") < 3
    for key in spilled[-6:]:
        assert cache.tier_of(key) == SSD and cache.load(key) == payloads[key]
    assert sorted(store.keys()) == sorted(item.key for item in cache.ssd)
    cache.check_invariants()
