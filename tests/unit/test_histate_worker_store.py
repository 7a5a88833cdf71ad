"""WorkerStore on CPU: the worker half of the tiers applies ids in order and reports facts only.

Store -> spill -> stage -> load restores the exact pages (random layouts); a delete queued
after a spill never overtakes it; an unreadable or refused file is reported, not raised; a
load of a copy the worker does not hold raises instead of computing on a wrong state; host
snapshots are written to the SSD at close.
"""

from __future__ import annotations

import errno

import pytest
import torch

from tests.histate_page_cases import random_caches
from vllm_ext.histate.pages import PageCopier
from vllm_ext.histate.policy import kv_key, snap_key
from vllm_ext.histate.snapfile import SnapshotStore
from vllm_ext.histate.worker_store import DROP, SPILL, STAGE, UNSTAGE, LoadJob, WorkerStore


def _store(seed: int, tmp_path, ssd: bool = True, device: str = "cpu"):
    caches, groups, num_blocks = random_caches(seed, device)
    pages = PageCopier(caches, groups, num_blocks)
    files = SnapshotStore(tmp_path / f"ssd{seed}", "ns", fsync=False) if ssd else None
    return WorkerStore(pages, files, attn_group=0, mamba_group=1), caches, groups, num_blocks


def _pages(caches, names, block: int) -> list[torch.Tensor]:
    out = []
    for name in names:
        value = caches[name]
        out += [t[block].clone().cpu() for t in (value if isinstance(value, list) else [value])]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_store_spill_stage_load_restores_the_pages(tmp_path, seed):
    round_trip(tmp_path, seed, "cpu")


def round_trip(tmp_path, seed: int, device: str) -> None:
    """Store a KV block and a state, spill and stage the state, scribble, load: identical."""
    store, caches, groups, n = _store(seed, tmp_path, device=device)
    kv, snap = kv_key(f"k{seed}"), snap_key(f"s{seed}")
    kv_before, state_before = _pages(caches, groups[0], 1), _pages(caches, groups[1], 1)
    store.store([(kv, 0, 1), (snap, 1, 1)])
    report = store.take_report()
    assert report.stored == {kv: store.pages.page_bytes(0), snap: store.pages.page_bytes(1)}
    store.apply([(SPILL, snap, ""), (STAGE, snap, "r#0")])
    store.settle()
    assert store.host_keys() == {kv}
    assert store.take_report().staged == [("r#0", snap)]
    for value in caches.values():
        for t in value if isinstance(value, list) else [value]:
            t.zero_()
    target = n - 1
    store.load([LoadJob("r", [(target, kv)], (target,), snap, "r#0")])
    for before, group in ((kv_before, 0), (state_before, 1)):
        after = _pages(caches, groups[group], target)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    store.close()


def test_a_drop_after_a_spill_deletes_the_file_and_a_later_stage_fails(tmp_path):
    store, *_ = _store(0, tmp_path)
    snap = snap_key("x")
    store.store([(snap, 1, 1)])
    store.apply([(SPILL, snap, ""), (DROP, snap, ""), (STAGE, snap, "r#1")])
    store.settle()
    assert snap not in store.ssd
    report = store.take_report()
    assert report.stage_failed == [("r#1", snap)] and not report.staged
    store.apply([(UNSTAGE, snap, "r#1")])
    store.close()


def test_refused_and_impossible_spills_are_reported(tmp_path, monkeypatch):
    store, *_ = _store(1, tmp_path)
    snap, gone = snap_key("full"), snap_key("never-stored")
    store.store([(snap, 1, 1)])
    monkeypatch.setattr(store.ssd, "write", lambda key, data: errno.ENOSPC)
    store.apply([(SPILL, snap, ""), (SPILL, gone, "")])
    store.settle()
    failed = store.take_report().spill_failed
    assert (snap, errno.ENOSPC, store.pages.page_bytes(1)) in failed
    assert (gone, errno.ENOENT, 0) in failed
    store.close(persist=False)


def test_a_corrupt_file_is_quarantined_and_reported_as_unreadable(tmp_path):
    store, *_ = _store(2, tmp_path)
    snap = snap_key("flip")
    store.store([(snap, 1, 1)])
    store.apply([(SPILL, snap, "")])
    store.settle()
    path = store.ssd.path(snap)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    store.apply([(STAGE, snap, "r#2")])
    store.settle()
    assert store.take_report().stage_failed == [("r#2", snap)]
    assert store.ssd.counters.value("ssd_corrupt") == 1
    store.close()


def test_a_load_of_a_copy_the_worker_lacks_raises(tmp_path):
    store, *_ = _store(3, tmp_path, ssd=False)
    with pytest.raises(RuntimeError, match="no host copy"):
        store.load([LoadJob("r", [(1, kv_key("absent"))], (1,), snap_key("absent"))])
    with pytest.raises(RuntimeError, match="no staged copy"):
        store.load([LoadJob("r", [], (1,), snap_key("absent"), "r#9")])
    store.close()


def test_failed_copies_are_reported_and_host_snapshots_persist_at_close(tmp_path, monkeypatch):
    store, *_ = _store(4, tmp_path)
    kv, snap = kv_key("a"), snap_key("b")
    store.store([(kv, 0, 1), (snap, 1, 2)])
    with monkeypatch.context() as patch:
        patch.setattr(store.pages, "read_many", lambda *args: 1 / 0)
        store.store([(kv_key("c"), 0, 2)])
    assert store.take_report().failed == [kv_key("c")]
    assert store.take_report() is None
    store.close()
    reopened = SnapshotStore(tmp_path / "ssd4", "ns", fsync=False)
    assert reopened.keys() == [snap]  # snapshots only: KV stays in host memory
    assert len(reopened.get(snap)) == store.pages.page_bytes(1)


def test_one_bad_block_in_a_batch_of_stores_loses_only_its_own_copy(tmp_path):
    store, caches, groups, n = _store(5, tmp_path, ssd=False)
    good = [(kv_key(f"g{b}"), 0, b) for b in range(1, n)] + [(snap_key("s"), 1, n - 1)]
    before = {key: _pages(caches, groups[g], b) for key, g, b in good}
    store.store([*good[:2], (kv_key("null"), 0, 0), *good[2:]])
    report = store.take_report()
    assert report.failed == [kv_key("null")]
    assert set(report.stored) == {key for key, _, _ in good}
    for value in caches.values():
        for t in value if isinstance(value, list) else [value]:
            t.zero_()
    # every good copy is exact: load each back into its own block
    store.load([LoadJob("r", [(b, key) for key, g, b in good if g == 0], (), snap_key("s"))])
    store.load([LoadJob("r", [], (n - 1,), snap_key("s"))])
    for key, g, b in good:
        after = _pages(caches, groups[g], b)
        if g == 0 and b == n - 1:
            continue  # the snapshot's load wrote the other group's pages of this block only
        assert all(torch.equal(x, y) for x, y in zip(before[key], after, strict=True)), key
    store.close()
