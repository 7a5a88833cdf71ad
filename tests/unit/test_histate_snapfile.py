"""HiState SSD snapshot files: round trip, corruption, foreign and temp files, faults, restart."""

from __future__ import annotations

import errno
import json
import os
import threading

import numpy as np
import pytest

from vllm_ext.histate import snapfile
from vllm_ext.histate.snapfile import (
    TMP_SUFFIX,
    WRITERS,
    SnapshotStore,
    namespace_id,
    pack_arrays,
    unpack_arrays,
)

NS = "model=tiny;dtype=bf16;layers=GGGA;block=64;tp=0/1"


@pytest.fixture
def store(tmp_path):
    return SnapshotStore(tmp_path, NS, fsync=True)


def test_round_trip_and_numpy_payload(store):
    arrays = {"conv": np.arange(12, dtype=np.float32).reshape(3, 4), "ssm": np.ones((2, 2))}
    assert store.put("h1", pack_arrays(arrays))
    out = unpack_arrays(store.get("h1"))
    assert set(out) == {"conv", "ssm"}
    np.testing.assert_array_equal(out["conv"], arrays["conv"])
    assert store.get("missing") is None
    assert store.counters.value("ssd_writes") == 1 and store.counters.value("ssd_reads") == 1


def test_restart_rebuilds_index(tmp_path, store):
    store.put("a", b"alpha")
    store.put("b", b"beta" * 100)
    again = SnapshotStore(tmp_path, NS)
    assert sorted(again.keys()) == ["a", "b"]
    assert again.sizes()["b"] == 400
    assert again.get("b") == b"beta" * 100


def test_other_namespace_sees_nothing(tmp_path, store):
    store.put("a", b"alpha")
    other = SnapshotStore(tmp_path, NS.replace("bf16", "fp16"))
    assert len(other) == 0 and other.get("a") is None
    assert namespace_id(model="m", tp=0) != namespace_id(model="m", tp=1)


def _corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) - 3]
    elif how == "zero_fill":
        data = bytearray(len(data))
    elif how == "header_flip":
        data[12] ^= 0x01
    elif how == "payload_flip":
        data[-1] ^= 0x80
    elif how == "extra_bytes":
        data += b"junk"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how", ["truncate", "zero_fill", "header_flip", "payload_flip", "extra_bytes"]
)
def test_corrupt_file_is_a_counted_miss_and_quarantined(tmp_path, store, how):
    store.put("k", b"x" * 1000)
    path = store.path("k")
    _corrupt(path, how)
    assert store.get("k") is None
    assert store.counters.value("ssd_corrupt") == 1
    assert not path.exists()
    assert len(list((tmp_path / snapfile.QUARANTINE).iterdir())) == 1
    assert "k" not in store


@pytest.mark.parametrize("how", ["truncate", "zero_fill", "header_flip"])
def test_corrupt_file_found_at_restart_is_quarantined(tmp_path, store, how):
    store.put("k", b"x" * 1000)
    store.put("good", b"fine")
    _corrupt(store.path("k"), how)
    again = SnapshotStore(tmp_path, NS)
    if how == "truncate":
        # the header is intact: detected at the read, by length
        assert again.get("k") is None
    assert "k" not in again and again.get("good") == b"fine"
    assert again.counters.value("ssd_corrupt") == 1


def test_foreign_file_in_folder_is_quarantined(tmp_path, store):
    foreign = snapfile.encode("another-model", "k", b"payload")
    store.path("k").write_bytes(foreign)
    again = SnapshotStore(tmp_path, NS)
    assert len(again) == 0 and again.counters.value("ssd_corrupt") == 1


def test_stale_temp_files_removed_at_start(tmp_path, store):
    tmp = store.root / "abc.1234.tmp"
    tmp.write_bytes(b"half a write")
    again = SnapshotStore(tmp_path, NS)
    assert not tmp.exists() and again.counters.value("ssd_stale_temp_removed") == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_error_fails_gracefully(monkeypatch, store, code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(snapfile.os, "write", fail)
    assert store.put("k", b"data") is False
    assert store.counters.value("ssd_write_failures") == 1
    assert "k" not in store
    # no partial file under the final name, no temp left behind
    assert list(store.root.iterdir()) == []


def test_open_and_rename_errors_fail_gracefully(monkeypatch, store):
    monkeypatch.setattr(
        snapfile.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EROFS, "ro"))
    )
    assert store.put("k", b"data") is False
    assert list(store.root.iterdir()) == []
    monkeypatch.setattr(
        snapfile.os, "open", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
    )
    assert store.put("k", b"data") is False
    assert store.counters.value("ssd_write_failures") == 2


def test_read_error_is_a_counted_miss(monkeypatch, store):
    store.put("k", b"data")

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "io")

    monkeypatch.setattr("builtins.open", fail)
    assert store.get("k") is None
    assert store.counters.value("ssd_read_failures") == 1


def test_delete_and_vanished_file(store):
    store.put("k", b"data")
    store.put("v", b"data")
    assert store.delete("k") and "k" not in store and not store.delete("k")
    os.unlink(store.path("v"))
    assert store.get("v") is None and "v" not in store


def test_file_deleted_between_check_and_read_is_a_miss(monkeypatch, store):
    store.put("k", b"data")
    real_open = open

    def evicting_open(path, *args, **kwargs):
        # a concurrent eviction lands between the index check and the read
        os.unlink(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(snapfile, "open", evicting_open, raising=False)
    assert store.get("k") is None and "k" not in store


_WRITER = """
import sys
from vllm_ext.histate.snapfile import SnapshotStore
store = SnapshotStore(sys.argv[1], sys.argv[2])
i = 0
while True:
    store.put(f"k{i}", bytes([i % 251]) * (1 << 18))
    i += 1
"""


def test_kill_9_during_writes_leaves_only_valid_files(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), NS])
    ns_dir = tmp_path / f"ns-{namespace_id(namespace=NS)}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(ns_dir.glob("*.snap"))) < 3:
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    store = SnapshotStore(tmp_path, NS)
    assert len(store) >= 3
    for key in store.keys():
        i = int(key[1:])
        assert store.get(key) == bytes([i % 251]) * (1 << 18)
    assert store.counters.value("ssd_corrupt") == 0
    assert not list(ns_dir.glob("*.tmp"))


def test_unusable_directory_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="not usable"):
        SnapshotStore(blocker / "sub", NS)


def test_a_second_writer_never_removes_a_live_writers_in_flight_files(tmp_path, monkeypatch):
    first = SnapshotStore(tmp_path, "ns", fsync=True)
    in_flight, resume = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def paused_fsync(fd):
        # the first writer's payload is written to its temp file, not yet renamed
        if threading.current_thread().name == "first-writer":
            in_flight.set()
            resume.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", paused_fsync)
    results = []
    writer = threading.Thread(
        target=lambda: results.append(first.put("k", b"state" * 100)), name="first-writer"
    )
    writer.start()
    assert in_flight.wait(30)
    (temp,) = first.root.glob("*" + TMP_SUFFIX)
    second = SnapshotStore(tmp_path, "ns", fsync=True)  # an engine starting on the same folder
    assert temp.exists() and second.counters.value("ssd_stale_temp_removed") == 0
    resume.set()
    writer.join(30)
    assert results == [True] and first.get("k") == b"state" * 100
    second.close()
    first.close()


def test_temp_files_of_dead_writers_and_unnamed_ones_are_removed(tmp_path):
    dead = SnapshotStore(tmp_path, "ns", fsync=False)
    orphan = dead.root / f"{'a' * 40}.{dead.writer}.1234{TMP_SUFFIX}"
    orphan.write_bytes(b"half a write")
    legacy = dead.root / f"{'b' * 40}.5678{TMP_SUFFIX}"
    legacy.write_bytes(b"half a write")
    live = SnapshotStore(tmp_path, "ns", fsync=False)
    assert orphan.exists() and not legacy.exists()  # its writer still holds the lock
    # what the kernel does when the writer's process dies: the lock goes, its file stays
    os.close(dead._writer_lock)
    dead._writer_lock = None
    again = SnapshotStore(tmp_path, "ns", fsync=False)
    assert not orphan.exists() and again.counters.value("ssd_stale_temp_removed") == 1
    assert sorted(p.stem for p in (tmp_path / WRITERS).glob("*.lock")) == sorted(
        [live.writer, again.writer]
    )
    live.close()
    again.close()


def _in_the_lock_gap(monkeypatch, action) -> None:
    """Run ``action(lock_fd)`` once, when the next store has created its lock file but
    not locked it yet (the first ``flock`` a constructor calls is on its own lock)."""
    real_flock = snapfile.fcntl.flock
    armed = [True]

    def flock(fd, operation):
        if armed[0]:
            armed[0] = False
            action(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(snapfile.fcntl, "flock", flock)


def test_a_store_starting_in_a_writers_lock_gap_never_removes_its_in_flight_files(
    tmp_path, monkeypatch
):
    """Regression: the second store found the first one's lock file unlocked, deleted
    it, and every later store then took the first one for dead and removed its temp
    files mid-write (the write failed)."""
    started = []
    _in_the_lock_gap(monkeypatch, lambda fd: started.append(SnapshotStore(tmp_path, "ns")))
    first = SnapshotStore(tmp_path, "ns", fsync=True)
    monkeypatch.undo()
    assert len(started) == 1
    lock = snapfile.Path(tmp_path) / WRITERS / f"{first.writer}.lock"
    assert lock.exists() and os.stat(lock).st_ino == os.fstat(first._writer_lock).st_ino
    real_fsync = os.fsync
    third = []

    def fsync_starting_a_store(fd):
        # the first store's payload sits in its temp file: an engine starts on the folder
        if not third:
            third.append(SnapshotStore(tmp_path, "ns"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_starting_a_store)
    assert first.put("k", b"state" * 100)
    assert first.get("k") == b"state" * 100
    assert third[0].counters.value("ssd_stale_temp_removed") == 0
    assert first.counters.value("ssd_write_failures") == 0
    for store in (first, *started, *third):
        store.close()


def test_a_lock_held_for_an_instant_in_the_gap_does_not_fail_the_constructor(
    tmp_path, monkeypatch
):
    """Regression: a checker holding the new store's lock file for an instant (it
    tries whether its writer is alive) made the constructor raise BlockingIOError."""
    holders = []

    def hold_for_an_instant(fd):
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # another open file description
        snapfile.fcntl.flock(other, snapfile.fcntl.LOCK_EX | snapfile.fcntl.LOCK_NB)
        holders.append(threading.Timer(0.2, os.close, (other,)))
        holders[0].start()

    _in_the_lock_gap(monkeypatch, hold_for_an_instant)
    store = SnapshotStore(tmp_path, "ns")
    holders[0].join()
    assert store.put("k", b"x") and store.get("k") == b"x"
    assert not SnapshotStore(tmp_path, "ns")._writer_alive("no-such-writer")
    assert SnapshotStore(tmp_path, "ns")._writer_alive(store.writer)
    store.close()


def _ns(model: str, weights: str) -> str:
    return json.dumps({"model": model, "weights": weights, "block_size": 64}, sort_keys=True)


def test_files_of_superseded_weights_are_removed_and_other_models_kept_unread(tmp_path):
    """After a weights change the old namespace can never hit: its files go, counted;
    another model's files stay (never read), counted; a live store's are never touched."""
    old, other = SnapshotStore(tmp_path, _ns("m", "w-old")), SnapshotStore(tmp_path, _ns("n", "w"))
    unverified = SnapshotStore(tmp_path, _ns("n", "unverified-1234"))
    for store in (old, other, unverified):
        assert store.put("k1", b"s1") and store.put("k2", b"s2")
    live = SnapshotStore(tmp_path, _ns("m", "w-live"))
    assert live.put("k1", b"s1")
    old.close()
    other.close()
    unverified.close()
    new = SnapshotStore(tmp_path, _ns("m", "w-new"))
    assert new.counters.value("ssd_superseded_removed") == 4  # old and unverified
    assert new.counters.value("ssd_foreign_files") == 3  # the other model's and the live one's
    assert not old.root.exists() and not unverified.root.exists()
    assert sorted(other.root.glob("*.snap")) and live.get("k1") == b"s1"
    assert len(new) == 0 and new.get("k1") is None
    live.close()
    new.close()
